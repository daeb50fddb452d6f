"""The spec of ``moetool eval`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import experiment

#: the types a ``--resume`` unit checkpoint of this experiment may hold (:mod:`moetool.checkpoints`)
CHECKPOINT_TYPES = (
    "moetool.experiments.eval.compute.EvalResult",
)

SPEC = experiment("eval", "eval_tasks", "EvalOptions", api="evaluate", cmd="eval", inputs="model", lines=None,
                  order=170, checkpoint_types=CHECKPOINT_TYPES)
