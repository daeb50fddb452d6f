"""The spec of ``moetool trace`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import experiment

SPEC = experiment("trace", "trace", "TraceOptions", lines=None,
                  order=180)
