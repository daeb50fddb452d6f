"""The lm-evaluation-harness bridge: benchmark accuracy of the (routing-patched) model object.

``HFLM(pretrained=<model object>, tokenizer=..., batch_size=N)`` wraps the already loaded model
and ``simple_evaluate`` runs the tasks while an :class:`~moetool.engine.hooks.Engine` applies the
routing policy to every forward lm-eval makes (its model pre-hook records each forward's shape
and padding mask). lm-eval's loglikelihood forwards pass no mask: their right padding (lm-eval's
``pad_and_concat``) is handed to the engine as the forward's padding (:func:`lmeval_padding`), so
padding is no token for a policy that looks across the batch (``capacity`` counts and drops real
tokens only, ``attention`` picks its head and ``similarity`` its neighbours among real tokens), as
in ppl; the causal rows keep it from the scored tokens otherwise.

Shipped offline tasks (multiple choice, built from the embedded models' training text, see
``examples/tasks/README.md``) are found, in order, in ``$MOETOOL_TASKS``, in the package
(``moetool/tasks``: pyproject installs ``examples/tasks`` there) and next to the package in a
source checkout (``examples/tasks``, the editable install). They are handed to lm-eval as config dicts with
absolute data-file paths, so they work from any working directory; when only shipped tasks are
asked, the Hub and ``datasets`` are forced offline for the evaluation. Any other name is a
standard lm-eval task (or one from ``--include-path``) and needs whatever it needs (network).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ...defaults import FEWSHOT_SEED
from ...errors import MoetoolError
from ...lmeval_compat import hub_offline, no_env_report
from ...progress import logger_level, status
from ...registry import did_you_mean
from ..result import Result, resolve_options
from .spec import EvalOptions  # noqa: F401 - its options (declared with their flags in spec.py)

TASKS_ENV = "MOETOOL_TASKS"
EVAL_COLUMNS = ("task", "metric", "value", "stderr", "value_lo", "value_hi")


def shipped_tasks_dir() -> Path | None:
    """Directory of the shipped offline task YAMLs (see the module docstring), or ``None``."""
    here = Path(__file__).resolve().parents[2]  # the moetool package
    candidates = [Path(os.environ[TASKS_ENV])] if os.environ.get(TASKS_ENV) else []
    candidates += [here / "tasks", here.parent / "examples" / "tasks"]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.yaml")):
            return c
    return None


def shipped_tasks() -> dict[str, dict[str, Any]]:
    """Shipped task name -> lm-eval config dict, data files made absolute."""
    import yaml

    root = shipped_tasks_dir()
    if root is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.glob("*.yaml")):
        cfg = yaml.safe_load(p.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict) or "task" not in cfg:
            continue
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        cfg["dataset_kwargs"]["data_files"] = {k: str((root / v).resolve()) for k, v in files.items()}
        out[str(cfg["task"])] = cfg
    return out


@dataclass
class TaskPlan:
    """How the asked tasks are resolved: specs for ``simple_evaluate`` and the task manager."""

    names: list[str]
    specs: list[Any]  # str (registered name) or dict (shipped task config)
    include_path: str | None
    include_defaults: bool
    offline: bool  # only shipped tasks: Hub and datasets forced offline
    shipped_dir: str | None

    _manager: Any = field(default=None, repr=False)

    def task_manager(self) -> Any:
        """lm-eval's TaskManager for this plan, built once (scanning the built-in tasks takes seconds)."""
        if self._manager is None:
            from lm_eval.tasks import TaskManager

            self._manager = TaskManager(include_path=self.include_path, include_defaults=self.include_defaults)
        return self._manager

    def describe(self) -> dict[str, Any]:
        return {"tasks": self.names, "include_path": self.include_path, "include_defaults": self.include_defaults,
                "offline": self.offline, "shipped_tasks_dir": self.shipped_dir}


def plan_tasks(names: Iterable[str], include_path: str | Path | None = None) -> TaskPlan:
    """Resolve task names: shipped offline tasks first, then ``--include-path``, then lm-eval's own.

    lm-eval's built-in index (~15k tasks, several seconds to scan) is only loaded when a name is
    neither shipped nor in ``--include-path`` (``include_defaults`` False otherwise).
    """
    names = list(dict.fromkeys(names))
    if not names:
        raise MoetoolError("no tasks given (--tasks)")
    if include_path is not None and not Path(include_path).is_dir():
        raise MoetoolError(f"--include-path {include_path} is not a directory")
    shipped = shipped_tasks()
    others = [n for n in names if n not in shipped]
    inc = str(include_path) if include_path is not None else None
    defaults, manager = False, None
    if others:
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=inc, include_defaults=False) if inc else None
        known = set(manager.all_tasks) if manager else set()
        if any(n not in known for n in others):
            defaults = True
            manager = TaskManager(include_path=inc, include_defaults=True)
            known = set(manager.all_tasks)
        for n in others:
            if n not in known:
                raise MoetoolError(f"unknown lm-eval task '{n}'{did_you_mean(n, [*shipped, *known])}; shipped "
                                   f"offline tasks: {', '.join(shipped) or 'none found'}")
    root = shipped_tasks_dir()
    return TaskPlan(names=names, specs=[shipped.get(n, n) for n in names], include_path=inc,
                    include_defaults=defaults, offline=not others, shipped_dir=str(root) if root else None,
                    _manager=manager)


@dataclass
class EvalResult:
    frame: Any  # DataFrame with EVAL_COLUMNS
    seconds: float
    n_samples: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # with log_samples

    def value(self, task: str, metric: str = "acc") -> float:
        row = self.frame[(self.frame.task == task) & (self.frame.metric == metric)]
        return float(row.value.iloc[0]) if len(row) else float("nan")


def _number(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v if math.isfinite(v) else float("nan")


#: lm-eval metrics that are a share of items scored 0 or 1: their interval is Wilson's, inside [0, 1]
PROPORTIONS = ("acc", "acc_norm", "exact_match", "acc_mutual_info")


def _items(results: dict[str, Any], task: str) -> float:
    """The items lm-eval scored for ``task`` (``n-samples`` effective; a group: the sum over its subtasks); NaN
    when the results do not say."""
    return _hits(results, task)[1]


def _pooled(results: dict[str, Any], task: str, key: str) -> float:
    """The share of all items of ``task``'s leaf tasks scored 1 for the results ``key`` (``"acc,none"``): Σ value ×
    items / Σ items, what a group reports when it weights its subtasks by size (lm-eval's ``weight_by_size``); NaN
    when a leaf's value or item count is not given."""
    hits, n = _hits(results, task, key)
    return hits / n if n > 0 else float("nan")


def _hits(results: dict[str, Any], task: str, key: str | None = None) -> tuple[float, float]:
    """``(items scored 1 for the results key, items scored)`` of ``task``: its ``n-samples`` (effective), a group's
    summed over its subtasks; NaN where the results do not say (the hits without ``key``)."""
    n = results.get("n-samples", {}).get(task, {})
    if isinstance(n, dict) and n.get("effective") is not None:
        m = float(n["effective"])
        return (_number(results.get("results", {}).get(task, {}).get(key)) * m if key else float("nan")), m
    subtasks = results.get("group_subtasks", {}).get(task)
    if not subtasks:
        return float("nan"), float("nan")
    parts = [_hits(results, t, key) for t in subtasks]
    return float(sum(h for h, _ in parts)), float(sum(m for _, m in parts))


def _interval(results: dict[str, Any], task: str, metric: str, value: float, stderr: float) -> tuple[float, float]:
    """``(value_lo, value_hi)``: a proportion's Wilson interval over the items scored (:func:`_items`; without
    them, or for a group whose value is not the share of its items scored 1 -- lm-eval's ``weight_by_size: false``,
    the unweighted mean of its subtasks' accuracies, :func:`_pooled` --, the item count lm-eval's stderr implies
    for a mean of 0/1 scores, se² = p(1-p)/(n-1)), any other metric's value ∓ 1.96 stderr (lm-eval's normal
    approximation); NaN without a stderr or an item count."""
    from ...uncertainty import normal_quantile, wilson

    if metric.partition("[")[0] in PROPORTIONS and 0.0 <= value <= 1.0:
        n = _items(results, task)
        name, _, filt = metric.partition("[")
        if task in results.get("group_subtasks", {}) and not math.isclose(
                _pooled(results, task, f"{name},{filt[:-1] or 'none'}"), value, rel_tol=1e-9, abs_tol=1e-12):
            n = float("nan")  # not a proportion of the pooled items: their count would say too narrow an interval
        if not math.isfinite(n) and stderr > 0:
            n = value * (1 - value) / stderr ** 2 + 1
        iv = wilson(value, n)
        return iv.lo, iv.hi
    z = normal_quantile(0.975)
    return value - z * stderr, value + z * stderr


def results_frame(results: dict[str, Any]) -> Any:
    """lm-eval's ``results`` dict -> DataFrame (task, metric, value, stderr = lm-eval's, value_lo, value_hi: the
    95% interval, Wilson's for a proportion, else value ∓ 1.96 stderr; see :func:`_interval`).

    ``metric`` is lm-eval's metric name, suffixed ``[filter]`` when the filter is not ``none``.
    """
    import pandas as pd

    rows = []
    for task, res in results.get("results", {}).items():
        for key, val in res.items():
            metric, sep, filt = key.partition(",")
            if not sep or metric.endswith("_stderr"):
                continue
            rows.append({"task": task, "metric": metric if filt == "none" else f"{metric}[{filt}]",
                         "value": _number(val), "stderr": _number(res.get(f"{metric}_stderr,{filt}"))})
    for r in rows:
        r["value_lo"], r["value_hi"] = _interval(results, r["task"], r["metric"], r["value"], r["stderr"])
    return pd.DataFrame(rows, columns=list(EVAL_COLUMNS))


def make_hflm(lm: Any, batch_size: int = 8) -> Any:
    """lm-eval's HF wrapper around the loaded model object (no reload, hooks stay visible)."""
    if getattr(lm.model.config, "is_encoder_decoder", False):
        raise MoetoolError(f"lm-eval tasks score a causal LM's continuations; {lm.model.config.model_type} is an "
                           f"encoder-decoder model (ppl gives its own seq2seq loss)")
    if lm.tokenizer is None:
        raise MoetoolError("lm-eval needs the model's tokenizer")
    if lm.tokenizer.bos_token_id is None and lm.tokenizer.eos_token_id is None:
        raise MoetoolError("the tokenizer has neither a BOS nor an EOS token: lm-eval cannot use it")
    from lm_eval.models.huggingface import HFLM

    with logger_level("lm_eval", logging.ERROR):
        hflm = HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=batch_size)
    return data_parallel(hflm)


class _RankCollectives:
    """The three ``accelerate.Accelerator`` calls HFLM makes under data parallelism (``gather`` of equal-shaped
    tensors, ``wait_for_everyone``, ``unwrap_model``), on the process group :func:`moetool.distributed.init`
    started (torchrun / accelerate launch): lm-eval's own request split and result gathering then run as under
    ``accelerate launch lm_eval``, on the model moetool loaded and hooked."""

    def gather(self, tensor: Any) -> Any:
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)  # accelerate's layout

    def wait_for_everyone(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def unwrap_model(self, model: Any) -> Any:
        return model


def data_parallel(hflm: Any) -> Any:
    """Under a distributed launch, give ``hflm`` this process's rank and the world size (HFLM forgoes them for
    a model object passed as ``pretrained``): lm-eval then splits every task's requests over the ranks, pads
    them to equal forwards and gathers the metrics on rank 0 (:func:`evaluate` shares rank 0's results with
    every rank). Alone: unchanged."""
    from ... import distributed

    if distributed.world_size() > 1:
        hflm._rank, hflm._world_size = distributed.rank(), distributed.world_size()
        hflm.accelerator = _RankCollectives()
    return hflm


def _shared_results(out: Any) -> Any:
    """lm-eval returns results on rank 0 only; every rank gets rank 0's (the tables are the same everywhere)."""
    from ... import distributed

    if distributed.world_size() <= 1:
        return out
    import torch.distributed as dist

    keep = None if out is None else {k: out[k] for k in ("results", "n-samples", "samples") if k in out}
    box = [keep]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def lmeval_padding(engine: Any) -> Any:
    """While open, every batch lm-eval pads with ``pad_and_concat`` (its loglikelihood inputs, passed to the model
    without an attention mask) sets ``engine.padding`` to the batch's real tokens ``[B, S]``: the engine's
    ``valid`` for the forward that follows."""
    import torch
    from lm_eval.models import huggingface

    pad = getattr(huggingface, "pad_and_concat", None)
    if pad is None:  # another lm-eval: its padding unknown, which only a policy looking across the batch minds
        name = getattr(getattr(engine, "policy", None), "name", None)
        if name in ("capacity", "attention", "similarity"):
            raise MoetoolError(f"this lm-eval version has no models.huggingface.pad_and_concat: moetool cannot tell "
                               f"its padding from real tokens, which the {name} policy must not count")
        yield
        return

    from ... import ops

    def padded(max_length: int, tensors: list[Any], padding_side: str = "right") -> Any:
        lengths = torch.tensor([int(t.shape[-1]) for t in tensors]).unsqueeze(-1)  # before pad replaces them
        out = pad(max_length, tensors, padding_side)
        # the mask on the batch's device (lm-eval's): the engine's model pre-hook then copies nothing from the host
        # (on CUDA a pageable copy there waited for the device once per forward); the lengths copied without a wait
        lengths = ops.to_device(lengths, out.device)
        pos = torch.arange(out.shape[-1], device=out.device).unsqueeze(0)
        engine.padding = pos < lengths if padding_side == "right" else pos >= out.shape[-1] - lengths
        return out

    huggingface.pad_and_concat = padded
    try:
        yield
    finally:
        huggingface.pad_and_concat = pad


@contextlib.contextmanager
def whole_sequence_generation(model: Any, policy: Any) -> Any:
    """While open, ``model.generate`` (lm-eval's ``generate_until``, which passes ``use_cache=True``) runs without a
    KV cache when ``policy`` routes a token by the other tokens of its sequence (``Policy.reads_sequence``:
    similarity, attention): every decoding step is then a forward over the whole sequence so far, which the policy
    routes as ppl's forwards are routed. With the cache a step's forward holds the new token alone: similarity
    routed it by itself (its own π: the router's choice, silently) and attention refused in the middle of the run.
    Other policies route each token by itself: the cache is kept."""
    if not getattr(policy, "reads_sequence", False):
        yield
        return
    import functools

    had = "generate" in vars(model)
    generate = model.generate

    @functools.wraps(generate)
    def uncached(*args: Any, **kwargs: Any) -> Any:
        return generate(*args, **{**kwargs, "use_cache": False})

    model.generate = uncached
    try:
        yield
    finally:
        if had:
            model.generate = generate
        else:
            del model.generate


def evaluate(lm: Any, plan: TaskPlan, *, policy: Any = None, policy_layers: Iterable[int] | None = None,
             num_fewshot: int | None = None, limit: int | None = None, batch_size: int = 8, seed: int = 0,
             fewshot_seed: int = FEWSHOT_SEED, hflm: Any = None, log_samples: bool = False,
             quiet: bool = False) -> EvalResult:
    """Run ``plan``'s tasks with ``policy`` applied in ``policy_layers`` (``None``: the router, hooked). ``seed``
    seeds lm-eval's Python, numpy and torch generators, ``fewshot_seed`` its few-shot sampler (lm-eval's own
    default: the examples ``lm_eval`` picks for a task)."""
    import time

    import torch
    from lm_eval import evaluator

    from ...engine.hooks import Engine

    hflm = make_hflm(lm, batch_size) if hflm is None else hflm
    t0 = time.perf_counter()
    # lm-eval's and datasets' own progress bars (stderr) are swallowed; moetool's spinner is the one display
    # (errors still raise). lm-eval's environment report runs ~12 subprocesses per call: off (the manifest
    # records the versions)
    routing = f" ({policy.describe().get('name', '')})" if policy is not None else ""
    what = f"lm-eval {', '.join(plan.names)}{routing}"
    with status(what, quiet), contextlib.redirect_stderr(io.StringIO()), hub_offline(plan.offline), torch.no_grad(), \
            logger_level("lm_eval", logging.ERROR if quiet else logging.WARNING), no_env_report(), \
            Engine(lm.model, lm.layers, policy=policy, policy_layers=policy_layers) as engine, \
            lmeval_padding(engine), whole_sequence_generation(lm.model, policy):
        try:
            out = evaluator.simple_evaluate(
                model=hflm, tasks=list(plan.specs), num_fewshot=num_fewshot, limit=limit,
                task_manager=plan.task_manager(), log_samples=log_samples, random_seed=seed,
                numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=fewshot_seed,
                bootstrap_iters=1000)
        except (KeyError, FileNotFoundError, ConnectionError, OSError) as e:
            raise MoetoolError(f"lm-eval could not load the tasks {plan.names}: {type(e).__name__}: {e}") from None
        except StopIteration:  # datasets' json/csv builder reading a data file with no rows
            raise MoetoolError(f"lm-eval could not load the tasks {plan.names}: a data file has no rows") from None
        except ValueError as e:  # lm-eval's few-shot sampler: random.sample(docs, n) with n beyond the split
            if num_fewshot is None or "Sample larger than population" not in str(e):
                raise
            raise MoetoolError(f"--num-fewshot {num_fewshot}: more few-shot examples than the few-shot split of "
                               f"{', '.join(plan.names)} holds") from None
    out = _shared_results(out)
    seconds = time.perf_counter() - t0
    if out is None:
        raise MoetoolError("lm-eval returned no results")
    return EvalResult(frame=results_frame(out), seconds=seconds, n_samples=dict(out.get("n-samples", {})),
                      samples=dict(out.get("samples", {})) if log_samples else {})


#: what value_lo/value_hi are, in eval.csv and wherever lm-eval values are tabled (norm-select, prune)
INTERVAL_DEFINITION = ("95% interval of the metric: a proportion (acc, acc_norm, exact_match) gets the Wilson score "
                       "interval over the items lm-eval scored (n-samples; a group: the sum over its subtasks when its "
                       "value is their pooled share, weight_by_size; else the count its stderr implies, as for a "
                       "group's unweighted mean of its subtasks), always inside [0, 1]; any other metric value ∓ 1.96 stderr "
                       "(lm-eval's normal approximation); NaN without a stderr or an item count")

EVAL_DEFINITIONS = {"task": "the lm-eval task (or group of tasks) the metric was scored on (--tasks)",
                    "metric": "lm-eval's metric name ([filter] appended when the filter is not 'none')",
                    "value": "the metric lm-eval reports for the task over the items it scored (--limit: at most that "
                             "many per task), every forward routed by --routing in --layers",
                    "stderr": "lm-eval's standard error of the metric (NaN when it reports none)",
                    "value_lo": INTERVAL_DEFINITION, "value_hi": INTERVAL_DEFINITION}


def eval_tasks(lm: Any, options: EvalOptions | None = None, *, plan: TaskPlan | None = None, quiet: bool = False,
               **overrides: Any) -> Result:
    """Benchmark accuracy through lm-evaluation-harness with the ``routing`` policy in ``layers``.

    Table ``eval`` (task, metric, value, stderr, value_lo, value_hi), see :data:`EVAL_DEFINITIONS`. ``plan`` (from
    :func:`plan_tasks`) may be passed when the caller resolved the tasks already.
    """
    from ...engine.hooks import select_layers

    opts = resolve_options(EvalOptions, options, overrides)
    plan = plan if plan is not None else plan_tasks(opts.tasks, opts.include_path)
    policy = opts.policy()
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    res = evaluate(lm, plan, policy=policy, policy_layers=layers, num_fewshot=opts.num_fewshot, limit=opts.limit,
                   batch_size=opts.batch_size, seed=opts.seed, fewshot_seed=opts.fewshot_seed,
                   quiet=quiet)
    return Result("eval", {"eval.csv": res.frame}, opts,
                  meta=dict(eval=plan.describe(), n_samples=res.n_samples, routing=policy.describe(),
                            eval_seconds=round(res.seconds, 3), definitions=EVAL_DEFINITIONS),
                  summary=eval_summary(res.frame))


def eval_summary(frame: Any) -> Any:
    """The console table: each value with its interval (Wilson for a proportion: ``value [lo, hi]`` unless it is
    symmetric about the value, ``value ± half-width`` then; :func:`moetool.uncertainty.format_ci`) beside the
    stderr."""
    from ...uncertainty import with_ci

    return with_ci(frame)
