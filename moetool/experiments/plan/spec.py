"""The spec of ``moetool plan`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import experiment

SPEC = experiment("plan", "plan", None, inputs="config", lines=None,
                  order=190)
