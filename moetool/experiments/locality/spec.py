"""The spec of ``moetool locality`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

SPEC = experiment("locality", "locality", "LocalityOptions", cmd=None, title="routing locality of consecutive tokens",
                  demo=Demo(max_tokens=2048), order=155)
