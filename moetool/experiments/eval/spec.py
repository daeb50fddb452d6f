"""Benchmark accuracy through lm-evaluation-harness with a routing policy applied.

The loaded model object is wrapped in lm-eval's HFLM and every forward lm-eval makes goes through
the routing hooks. Writes eval.csv (task, metric, value, stderr = lm-eval's standard error,
value_lo, value_hi: the 95% interval, Wilson's over the items scored for an accuracy, inside [0, 1],
value ∓ 1.96 stderr for any other metric) and manifest.json; prints value [lo, hi] (value ± half-width
where the interval is symmetric).

Tasks: standard lm-eval names (mmlu, arc_challenge, ...: need network for their datasets), tasks
from --include-path, or the shipped offline tasks moetool_code and moetool_prose (4-choice "which
continuation is real" items cut from the embedded models' training text; no network needed).
The shipped tasks are looked up in $MOETOOL_TASKS, then moetool/tasks (installed package),
then examples/tasks of the source checkout (editable install). lm-eval's own task index is only
scanned when a name is neither shipped nor in --include-path.

Examples:
  moetool eval --tasks moetool_code,moetool_prose --limit 40
  moetool eval --tasks moetool_code --routing norm:gate --num-fewshot 2
  moetool eval --model mixtral-8x7b --tasks mmlu --num-fewshot 5 --routing norm:gate --device-map auto
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import FEWSHOT_SEED
from ..experiment import RoutingOptions, experiment, option


@dataclass(frozen=True)
class EvalOptions(RoutingOptions):
    """Options of :func:`~moetool.experiments.eval.compute.eval_tasks`: the tasks (``--tasks``), lm-eval's
    settings (the lm-eval flag group), and the routing (see ``RoutingOptions``: the routing flag group)."""

    # --tasks is required: shown="none" only spells the field's default (the empty tuple) as the command line does
    tasks: tuple[str, ...] = option(  # lm-eval task names (shipped offline: moetool_code, moetool_prose)
        (), "--tasks", "Comma list of lm-eval task names (shipped offline: moetool_code, moetool_prose).", kind="strs",
        shown="none", short="-t", required=True)
    num_fewshot: int | None = None  # few-shot examples per item (None: the task's own)
    limit: int | None = None  # at most this many items per task (None: all)
    include_path: str | None = None  # folder of extra lm-eval task YAMLs
    fewshot_seed: int = FEWSHOT_SEED  # lm-eval's few-shot sampler seed (lm-eval's own default)
    batch_size: int = 8


#: the types a ``--resume`` unit checkpoint of this experiment may hold (:mod:`moetool.checkpoints`)
CHECKPOINT_TYPES = (
    "moetool.experiments.eval.compute.EvalResult",
)

SPEC = experiment("eval", "eval_tasks", "EvalOptions", api="evaluate", inputs="model", lines=None,
                  order=170,
                  groups=("lmeval", "routing"),
                  checkpoint_types=CHECKPOINT_TYPES)
