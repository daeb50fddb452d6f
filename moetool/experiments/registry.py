"""The experiment registry: one :class:`Experiment` spec per experiment, from which everything else is derived.

* the command line: ``moetool <name>`` is generated from every spec (``moetool.commands.generated``);
* ``import moetool``: ``moetool.<api>`` is the compute function and ``moetool.<Options>`` its options dataclass
  (``moetool.api.EXPORTS``);
* ``moetool demo``: a spec with a :class:`Demo` is a demo step, run by :func:`moetool.demo.run_step`;
* figures: :func:`moetool.report.plots.figures` draws the spec's ``figures`` function for a result;
* the parametrised tests (every command with zero tokens, under torchrun, per routing rule) read :data:`EXPERIMENTS`.

Everything here is a string (``"module:attr"``), so the command line's ``--help`` imports no torch, pandas or
matplotlib. How to add an experiment: ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from ..checkpoints import allow_types
from ..errors import MoetoolError
from ..registry import did_you_mean
from .experiment import PAIRS, Demo, Experiment, Flag, experiment  # noqa: F401 - the spec types, re-exported

PACKAGE = __name__.rpartition(".")[0]  # moetool.experiments


def discover() -> dict[str, Experiment]:
    """Every experiment: the ``SPEC`` of each ``moetool/experiments/<name>/spec.py`` (only the spec modules are
    imported: torch-free), in ``order``. Two specs of one name, or two experiments captioning one figure name, stop
    the import with the names."""
    specs: list[Experiment] = []
    for info in pkgutil.iter_modules(importlib.import_module(PACKAGE).__path__):
        if info.ispkg and (Path(info.module_finder.path) / info.name / "spec.py").is_file():  # type: ignore[union-attr]
            spec = importlib.import_module(f"{PACKAGE}.{info.name}.spec").SPEC
            if spec.name.replace("-", "_") != info.name:
                raise RuntimeError(f"registry: {PACKAGE}.{info.name}.spec names the experiment '{spec.name}'")
            specs.append(spec)
    specs.sort(key=lambda s: (s.order, s.name))
    seen: dict[str, str] = {}
    for spec in specs:
        for fig in spec.captions:
            if fig in seen:
                raise RuntimeError(f"registry: figure '{fig}' captioned by both {seen[fig]} and {spec.name}")
            seen[fig] = spec.name
    return {s.name: s for s in specs}


#: every experiment, in the demo's order (discovered: adding an experiment edits no file here)
EXPERIMENTS: dict[str, Experiment] = discover()


def captions() -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """Every figure's caption (figure name -> (what it shows, its tables, the definitions it plots))."""
    return {fig: c for spec in EXPERIMENTS.values() for fig, c in spec.captions.items()}


def checkpoint_types() -> frozenset[str]:
    """Every experiment's ``--resume`` checkpoint types (beside :data:`moetool.checkpoints.CHECKPOINT_TYPES`)."""
    return frozenset(t for spec in EXPERIMENTS.values() for t in spec.checkpoint_types)


allow_types(checkpoint_types())

#: commands that are not experiments (their modules under moetool.commands)
OTHER_COMMANDS = ("demo", "inspect", "report", "import_trace")


def get(name: str) -> Experiment:
    """The spec of a command name (``norm-select``) or result name (``norm_select``); one line if unknown."""
    if name in EXPERIMENTS:
        return EXPERIMENTS[name]
    for spec in EXPERIMENTS.values():
        if spec.result == name:
            return spec
    raise MoetoolError(f"unknown experiment '{name}'{did_you_mean(name, EXPERIMENTS)}; known: "
                       f"{', '.join(EXPERIMENTS)}")


def of_result(name: str) -> Experiment | None:
    """The experiment that writes results named ``name`` -- a ``--trace`` analysis's (``stats_trace``, ...) is its
    experiment's -- or None (a result of no experiment): whose headline lines and figures the result gets."""
    base = name.removesuffix("_trace")
    return next((e for e in EXPERIMENTS.values() if e.result == base), None)


def command_modules() -> list[str]:
    """Every CLI command's module: ``moetool.commands.generated`` makes every experiment's command from its spec
    (with what ``moetool.commands.<name>`` adds, where there is one), then the commands that are not experiments."""
    return ["moetool.commands.generated"] + [f"moetool.commands.{c}" for c in OTHER_COMMANDS]
