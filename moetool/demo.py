"""``moetool demo``: every experiment on the embedded models, with no network, into one run folder.

Each experiment module exposes ``demo(parent: RunDir, quiet: bool) -> list[str]`` that writes
into its own sub-folder and returns summary lines. The steps run in this order.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

from .demo_models import DEMO_MODELS

#: (step name, "module:function")
STEPS: list[tuple[str, str]] = [
    ("inspect", "moetool.demo:inspect_demo"),
    ("stats", "moetool.experiments.stats:demo"),
    ("norm-select", "moetool.experiments.norm_select:demo"),
    ("erc", "moetool.experiments.erc:demo"),
    ("approx", "moetool.experiments.approx:demo"),
    ("mass-recall", "moetool.experiments.mass_recall:demo"),
    ("offload", "moetool.experiments.offload:demo"),
    ("fluctuation", "moetool.experiments.fluctuation:demo"),
]


def each_model(parent: Any, step: str, run_one: Callable[[Any, Any], tuple[Any, list[str]]], *,
               seq_len: int | None = 128, max_tokens: int = 2048, seed: int | None = None,
               **tokens_kw: Any) -> list[str]:
    """One demo step over the embedded base models, one layout for every step: ``parent/<step>/<model>/`` per
    model and ``parent/<step>/manifest.json``. ``run_one(lm, tokens) -> (Result, summary lines)``; tokens are
    ``max_tokens`` of the shipped held-out text in rows of ``seq_len`` (``seq_len=None``: weights only, no
    tokens). ``tokens_kw`` go to :func:`moetool.data.load_tokens`."""
    from .data import load_tokens
    from .loading import embedded_models, load
    from .report.writers import write

    child = parent.sub(step)
    names = [m for m in DEMO_MODELS if m in embedded_models()]
    sizes = {} if seq_len is None else dict(seq_len=seq_len, max_tokens=max_tokens)
    lines: list[str] = []
    for name in names:
        run = child.sub(name)  # before the model loads: the manifest's wall time is the whole sub-run's
        lm = load(name, tokenizer=seq_len is not None)
        tokens = None if seq_len is None else load_tokens(None, lm.tokenizer, seq_len=seq_len, max_tokens=max_tokens,
                                                          **tokens_kw)
        res, more = run_one(lm, tokens)
        write(res, run, model=lm, options=dict(model=name, **sizes, **tokens_kw))
        lines += more
    child.finish(options=dict(models=names, **sizes), seed=seed)
    return lines or [f"{step}: no embedded model found"]


def _load(target: str) -> Callable[..., list[str]]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def inspect_demo(parent: Any, quiet: bool) -> list[str]:
    from .inspect import describe_model

    child = parent.sub("inspect")
    lines = []
    for name in DEMO_MODELS:
        info = describe_model(name)
        child.write_json(f"{name}.json", info)
        L = info["moe_layers"][0]
        lines.append(f"{name}: {info['model_type']}, {len(info['moe_layers'])} MoE layers, n={L['n_experts']}, "
                     f"K={L['top_k']}, {info['total_params']:,} params ({info['active_params']:,} active)")
    child.finish(options={"models": list(DEMO_MODELS)})
    return lines


def run_demo(parent: Any, steps: list[str] | None = None, quiet: bool = False,
             echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the demo steps (all by default); returns one record per step."""
    names = [s for s, _ in STEPS]
    chosen = steps or names
    records = []
    for name, target in STEPS:
        if name not in chosen:
            continue
        echo(f"== {name}")
        t0 = time.time()
        before = {p.name for p in parent.path.iterdir()}
        lines = _load(target)(parent, quiet)
        for line in lines:
            echo(f"   {line}")
        new = sorted(p.name for p in parent.path.iterdir() if p.is_dir() and p.name not in before)
        records.append({"step": name, "seconds": round(time.time() - t0, 2), "summary": lines,
                        "folders": [str(parent.path / d) for d in new]})
    return records


def demo(out: Any = None, steps: list[str] | None = None, *, force: bool = False, quiet: bool = False,
         echo: Callable[[str], None] = print) -> tuple[Any, list[dict[str, Any]], Any]:
    """``moetool demo``: every step (or ``steps``) into one run folder, then the report page gathering them.
    Returns (run folder, one record per step, path of report.html)."""
    from .errors import MoetoolError
    from .registry import did_you_mean
    from .report import RunDir
    from .report.page import write_report

    known = [s for s, _ in STEPS]
    for s in steps or []:
        if s not in known:
            raise MoetoolError(f"unknown demo step '{s}'{did_you_mean(s, known)}; steps: {', '.join(known)}")
    run = RunDir.create("demo", out, force)
    records = run_demo(run, steps, quiet=quiet, echo=echo)
    run.add(steps=records)
    run.finish(options={"steps": steps or known})
    page = write_report([run.path], run.sub("report"), title="moetool demo")  # every step's figures and tables
    return run.path, records, page
