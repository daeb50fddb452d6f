"""moetool: Mixture-of-Experts routing research, from the command line or Python.

``import moetool`` is cheap: the public names (``moetool.load``, ``moetool.tokens``, ``moetool.stats``, ...,
``moetool.hook``; see :mod:`moetool.api`; ``__all__`` lists them for ``from moetool import *``) are resolved on first
use, and torch and transformers load only inside the functions that need them (``moetool --help`` never imports
torch).
"""

from __future__ import annotations

import importlib
from typing import Any as _Any

__version__ = "0.1.0"


def _in_place_subpackages() -> None:
    """A checkout run in place (``python -m moetool`` or ``torchrun -m moetool`` from the repository's root, where
    ``./moetool`` shadows an installed copy): ``moetool.commands`` and ``moetool.tasks`` live at the repository's
    top (``commands/``, ``examples/tasks/``; pyproject's ``package-dir``), so they are found there, as an
    installation finds them. An installed copy (they sit inside it) or an editable install (its finder answers
    first) is left alone."""
    import sys
    from importlib.abc import MetaPathFinder
    from importlib.machinery import ModuleSpec
    from importlib.util import spec_from_file_location
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if (here / "commands").is_dir() or not (here.parent / "commands" / "app.py").is_file():
        return
    places = {"moetool.commands": here.parent / "commands", "moetool.tasks": here.parent / "examples" / "tasks"}

    class _InPlace(MetaPathFinder):
        def find_spec(self, name: str, path: _Any = None, target: _Any = None) -> _Any:
            d = places.get(name)
            if d is None or not d.is_dir():
                return None
            if (d / "__init__.py").is_file():
                return spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
            spec = ModuleSpec(name, None, is_package=True)  # data only (the lm-eval tasks): a namespace
            spec.submodule_search_locations = [str(d)]
            return spec

    if not any(type(f).__name__ == "_InPlace" for f in sys.meta_path):
        sys.meta_path.append(_InPlace())


_in_place_subpackages()


def _exports() -> dict[str, str]:
    from .api import EXPORTS

    return EXPORTS


def __getattr__(name: str) -> _Any:
    if name == "__all__":  # ``from moetool import *``: the public names, as lazy as they are
        globals()["__all__"] = sorted(_exports())
        return globals()["__all__"]
    target = _exports().get(name)
    if target is None:
        raise AttributeError(f"module 'moetool' has no attribute '{name}'")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)  # "module" alone: the module itself (moetool.run, callable)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([n for n in globals() if not n.startswith("_") and n not in ("annotations", "importlib")]
                  + [*_exports(), "__version__"])
