"""The spec of ``moetool ppl`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import experiment

SPEC = experiment("ppl", "ppl", "PplOptions", lines=None,
                  order=160)
