"""The Python API: the experiments as functions of a loaded model and tokens, returning named DataFrames.

    import moetool
    lm = moetool.load("tiny")                                   # embedded name, alias, local dir or hub id
    tokens = moetool.tokens(lm, "text.jsonl", seq_len=256, max_tokens=8192)   # None: the shipped held-out text
    res = moetool.stats(lm, tokens)                             # a Result: res["load"], res.summary, res.definitions
    moetool.write(res, "runs/stats")                            # the CLI's CSVs, figures and manifest

Every experiment takes its options dataclass (``moetool.StatsOptions(...)``) or the same options as keywords, and
returns a :class:`~moetool.experiments.result.Result` holding DataFrames with exactly the CLI's CSV columns (the
command is a thin wrapper over the same function). ``moetool.hook`` is the hook engine itself, for custom probes.
Nothing here imports torch until a function is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable


def _timed(model: Any, run: Any, *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)`` -> its Result, which records the model (a loaded model's manifest entry, or the
    checkpoint names) and when the computation started and how long it took (for :func:`write`)."""
    import time

    started, t0 = time.time(), time.perf_counter()
    res = run(*args, **kwargs)
    res.started, res.wall_seconds = started, round(time.perf_counter() - t0, 3)
    if res.model is None:
        res.model = model.manifest() if hasattr(model, "manifest") else model
    return res


def load(name: str = "tiny", *, dtype: str = "auto", device: str = "auto", device_map: str | None = None,
         attn_implementation: str | None = None, tokenizer: bool = True) -> Any:
    """Load a MoE causal LM (eval mode) with its tokenizer and wrapped MoE layers (``lm.model``, ``lm.layers``,
    ``lm.tokenizer``). ``attn_implementation="eager"`` is needed for ``routing="attention"``."""
    from .loading import load as _load

    return _load(name, dtype=dtype, device=device, device_map=device_map, attn_implementation=attn_implementation,
                 tokenizer=tokenizer)


def tokens(lm: Any, data: str | Path | None = None, *, seq_len: int = 256, max_tokens: int = 32768,
           add_special_tokens: bool | None = False) -> Any:
    """Pack ``data`` (text file, JSONL with ``text`` and optional ``domain``, or a folder; ``None`` = the shipped
    held-out text) into rows of ``seq_len`` tokens, at most ``max_tokens`` real tokens (a ``TokenSet``)."""
    from .data import load_tokens

    if lm.tokenizer is None:
        from .errors import MoetoolError

        raise MoetoolError("this model was loaded without a tokenizer (load(..., tokenizer=True))")
    return load_tokens(data, lm.tokenizer, seq_len, max_tokens, add_special_tokens=add_special_tokens)


def stats(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Routing statistics of the model's own router: tables load, layers, coactivation, cross_layer(_summary),
    specialization, specialized_tokens, domain_load, top_tokens, top_tokens_lift (expert_tokens with
    ``all_tokens``). Options: :class:`moetool.StatsOptions` (top_tokens, min_count, top_k=1 for OLMoE's top-1
    views, coactivation="all"|"adjacent", all_tokens, specialization, batch_size)."""
    from .experiments.stats import stats as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def ppl(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Perplexity under a routing policy: table ppl. Options: :class:`moetool.PplOptions` (routing, weights, sim,
    causal, layers, seed, batch_size); ``routing="router"`` reproduces the unhooked model."""
    from .experiments.ppl import ppl as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def norm_select(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """The Autonomy-of-Experts pilot: tables agreement and quality, ``summary`` = Table 1. Options:
    :class:`moetool.NormSelectOptions` (nodes, norms, weights, layers, tasks, num_fewshot, limit, ...)."""
    from .experiments.norm_select import norm_select as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def evaluate(lm: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """lm-evaluation-harness accuracy under a routing policy: table eval. Options: :class:`moetool.EvalOptions`
    (tasks, num_fewshot, limit, include_path, routing, weights, layers, ...)."""
    from .experiments.lmeval import eval_tasks

    return _timed(lm, eval_tasks, lm, options, quiet=quiet, **overrides)


def erc(lm: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Expert–router coupling from the weights only (no tokens): tables erc, erc_layers, erc_matrix. Options:
    :class:`moetool.ErcOptions` (alphas, noise, samples, node, norm, seed, layers)."""
    from .experiments.erc import erc as run

    return _timed(lm, run, lm, options, quiet=quiet, **overrides)


def approx(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """MoE as the best k-term approximation of the dense sum: tables approx, approx_layers. Options:
    :class:`moetool.ApproxOptions` (selectors, max_subsets, layers, batch_size, seed)."""
    from .experiments.approx import approx as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def mass_recall(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Routing mass kept by an inverted-index router: table mass_recall. Options: :class:`moetool.MassRecallOptions`
    (codebook_sizes, shortlists, centroids, kmeans_iters, seed, batch_size, layers)."""
    from .experiments.mass_recall import mass_recall as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def fluctuation(checkpoints: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Routing change between checkpoints (loaded models or names) on the same tokens: table fluctuation.
    Options: :class:`moetool.FluctuationOptions` (routing, tau, sim, causal, reference, isolate, batch_size)."""
    from .experiments.fluctuation import fluctuation as run

    return _timed([getattr(c, "name", c) for c in checkpoints], run, checkpoints, tokens, options, quiet=quiet,
                  **overrides)


def trace(lm: Any, tokens: Any, options: Any = None, *, path: str | Path | None = None, quiet: bool = False,
          **overrides: Any) -> Any:
    """Per-token routing of every MoE layer: table trace (or streamed to ``path``, .csv.gz / .parquet). Options:
    :class:`moetool.TraceOptions` (routing, weights, layers, logits, batch_size, seed)."""
    from .experiments.trace import trace as run

    return _timed(lm, run, lm, tokens, options, path=path, quiet=quiet, **overrides)


def hook(lm: Any, *, policy: Any = None, layers: Iterable[int] | None = None, consumers: Iterable[Any] = (),
         attention: bool = False, **policy_options: Any) -> Any:
    """The hook engine as a context manager: every forward of ``lm.model`` inside the block hands a
    :class:`~moetool.engine.RoutingEvent` (``h``, ``logits``, ``idx``, ``weights``, ``valid``, ``probs``,
    ``chosen_idx``, ...) to each consumer; ``policy`` (a spec like ``"norm:gate"`` or a policy object) replaces routing in ``layers``.

        with moetool.hook(lm, consumers=[events.append]):
            lm.model(input_ids=ids)
    """
    from .engine.hooks import Engine, select_layers

    if isinstance(policy, str):
        from .policies import build_policy

        policy = build_policy(policy, **policy_options)
    if layers is not None:
        layers = [L.index for L in select_layers(lm.layers, layers)]
    return Engine(lm.model, lm.layers, policy=policy, policy_layers=layers, consumers=consumers, attention=attention)


def offload(lm: Any, tokens: Any, options: Any = None, *, quiet: bool = False, **overrides: Any) -> Any:
    """Expert offloading from real routing: tables offload_coverage, offload_layers, offload_cache (LRU/LFU/Belady
    hit rate by cache size, bytes per token), offload_prefetch (next-layer router recall). Options:
    :class:`moetool.OffloadOptions`."""
    from .experiments.offload import offload as run

    return _timed(lm, run, lm, tokens, options, quiet=quiet, **overrides)


def inspect_model(name: str) -> dict[str, Any]:
    """What ``moetool inspect --model NAME`` prints, as a dict: family, layers, which are MoE, n, K, routing,
    shared experts, parameters (no weights loaded)."""
    from .inspect import describe_model

    return describe_model(name)


def families() -> Any:
    """``moetool inspect --families`` as a DataFrame: one row per MoE model type of the installed transformers,
    supported or not (and why), routing rule, shared experts, dense layers, experts implementation."""
    import pandas as pd

    from .inspect import families as rows

    return pd.DataFrame(rows())


def write_report(run_dirs: Iterable[str | Path], out: str | Path, *, force: bool = False,
           title: str = "moetool report") -> Path:
    """``moetool report``: gather run folders into one HTML/Markdown page (+ LaTeX/CSV tables, PNG/PDF figures);
    returns the path of ``report.html``."""
    from .report.page import write_report as run

    return run(list(run_dirs), out, force=force, title=title)


def run_demo(out: str | Path | None = None, steps: Iterable[str] | None = None, *, force: bool = False,
         quiet: bool = False) -> Path:
    """``moetool demo``: every experiment on the embedded models into ``out`` and a report page; returns the
    folder."""
    from .demo import demo as run

    return run(out, list(steps) if steps else None, force=force, quiet=quiet)[0]


def forward(lm: Any, tokens: Any, **kwargs: Any) -> Any:
    """The one forward loop (:func:`moetool.engine.forward`): batches, optional policy and consumers, NLL."""
    from .engine.runner import forward as run

    return run(lm, tokens, **kwargs)


def write(result: Any, out: str | Path, *, force: bool = False, model: Any = None) -> Path:
    """Write a :class:`Result` as the CLI does (CSVs, figures, manifest.json) into the folder ``out``. The manifest's
    model (unless ``model`` is given), ``started`` and ``wall_seconds`` are the result's: from the start of the
    computation to the end of the write."""
    from .report import RunDir
    from .report.writers import write as _write

    run = RunDir.create(result.name.replace("_", "-"), out, force)
    _write(result, run, model=model)
    return run.path


def figures(result: Any) -> dict[str, Any]:
    """The experiment's figures as ``{name: matplotlib Figure}`` (the ones ``write`` saves)."""
    from .report.plots import figures as _figures

    return _figures(result)


#: public name -> "module:attribute" (resolved lazily by ``moetool.__getattr__``)
EXPORTS = {
    **{name: f"moetool.api:{name}" for name in (
        "load", "tokens", "stats", "ppl", "norm_select", "evaluate", "erc", "approx", "mass_recall", "fluctuation",
        "trace", "offload", "inspect_model", "families", "write_report", "run_demo", "hook", "forward", "write",
        "figures")},
    "OffloadOptions": "moetool.experiments.offload:OffloadOptions",
    "Result": "moetool.experiments.result:Result",
    "StatsOptions": "moetool.experiments.stats:StatsOptions",
    "PplOptions": "moetool.experiments.ppl:PplOptions",
    "NormSelectOptions": "moetool.experiments.norm_select:NormSelectOptions",
    "EvalOptions": "moetool.experiments.lmeval:EvalOptions",
    "ErcOptions": "moetool.experiments.erc:ErcOptions",
    "ApproxOptions": "moetool.experiments.approx:ApproxOptions",
    "MassRecallOptions": "moetool.experiments.mass_recall:MassRecallOptions",
    "FluctuationOptions": "moetool.experiments.fluctuation:FluctuationOptions",
    "TraceOptions": "moetool.experiments.trace:TraceOptions",
    "RoutingEvent": "moetool.engine.hooks:RoutingEvent",
    "MoetoolError": "moetool.errors:MoetoolError",
}
