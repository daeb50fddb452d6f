"""moetool: Mixture-of-Experts routing research, from the command line or Python.

``import moetool`` is cheap: the public names (``moetool.load``, ``moetool.tokens``, ``moetool.stats``, ...,
``moetool.hook``; see :mod:`moetool.api`) are resolved on first use, and torch and transformers load only inside
the functions that need them (``moetool --help`` never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any as _Any

__version__ = "0.1.0"


def _exports() -> dict[str, str]:
    from .api import EXPORTS

    return EXPORTS


def __getattr__(name: str) -> _Any:
    target = _exports().get(name)
    if target is None:
        raise AttributeError(f"module 'moetool' has no attribute '{name}'")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)  # "module" alone: the module itself (moetool.run, callable)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_exports()])
