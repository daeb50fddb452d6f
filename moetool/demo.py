"""``moetool demo``: every experiment on the embedded models, with no network, into one run folder.

The steps are ``inspect`` and every experiment whose spec in :mod:`moetool.experiments.registry` has a
:class:`~moetool.experiments.registry.Demo`, in the registry's order; :func:`run_step` runs any of them the same
way (``<step>/<model>/`` per model -- a checkpoint pair's named after its final checkpoint --,
``<step>/manifest.json``). Experiments write nothing: this module writes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .demo_models import DEMO_MODELS
from .experiments.registry import EXPERIMENTS, Experiment


def steps() -> list[str]:
    """The demo's steps, in order."""
    return ["inspect"] + [name for name, spec in EXPERIMENTS.items() if spec.demo is not None]


def run_step(parent: Any, spec: Experiment, quiet: bool = False) -> list[str]:
    """One demo step: ``spec.function`` on each of the spec's demo models (or checkpoint pairs) with the demo's
    sizes and options, each result written to ``parent/<step>/<model>/``; returns the summary lines."""
    import importlib

    from .context import RunState, state
    from .data import load_tokens
    from .loading import embedded_models, load
    from .report.writers import write

    demo = spec.demo
    compute = spec.load()
    overrides = dict(demo.options)
    if demo.options_from:
        module, _, attr = demo.options_from.partition(":")
        overrides.update(getattr(importlib.import_module(module), attr)())
    options_class = spec.options_class()
    opts = options_class(**overrides) if options_class is not None else None
    seed = getattr(opts, "seed", None)
    lines_of = spec.load(spec.lines) if spec.lines else (lambda name, res: [])
    child = parent.sub(spec.name)
    have = embedded_models()
    sizes = {} if demo.seq_len is None else dict(seq_len=demo.seq_len, max_tokens=demo.max_tokens)
    lines: list[str] = []
    done: list[Any] = []
    for model in demo.models:
        names = list(model) if isinstance(model, tuple) else [model]
        if not all(n in have for n in names):
            continue
        # each model its own run, as a command's: policies built afresh, suggestions naming the step's dtype flag
        with RunState(dtype_flag=spec.dtype_flag, cli=state().cli).active():
            run = child.sub(names[-1])  # before the work: the sub-run's manifest times the whole of it
            if spec.inputs == "checkpoints":
                from .experiments.fluctuation.compute import check_checkpoints

                tokens = load_tokens(None, check_checkpoints(names), seq_len=demo.seq_len, max_tokens=demo.max_tokens,
                                     **demo.tokens)
                res = compute(names, tokens, opts, quiet=quiet)
                write(res, run, options=dict(checkpoints=names, **sizes, **demo.tokens))
                label = " -> ".join(names)
            else:
                lm = load(names[0], tokenizer=demo.seq_len is not None)
                if demo.seq_len is None:
                    res = compute(lm, opts, quiet=quiet)
                else:
                    tokens = load_tokens(None, lm.tokenizer, seq_len=demo.seq_len, max_tokens=demo.max_tokens,
                                         **demo.tokens)
                    res = compute(lm, tokens, opts, quiet=quiet)
                write(res, run, model=lm, options=dict(model=names[0], **sizes, **demo.tokens))
                label = lm.name
        done.append(names if len(names) > 1 else names[0])
        lines += lines_of(label, res)
    key = "pairs" if spec.inputs == "checkpoints" else "models"
    child.finish(options={key: done, **sizes}, seed=seed)
    return lines or [f"{spec.name}: no embedded model found"]


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


def run_demo(parent: Any, chosen: list[str] | None = None, quiet: bool = False,
             echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the demo steps (all by default); returns one record per step. Each step's heading and summary lines go
    to ``echo``; ``quiet`` (``--quiet``): none of them, as no command prints its tables or progress under it."""
    records = []
    todo = [name for name in steps() if not chosen or name in chosen]
    say = (lambda line: None) if quiet else echo
    for i, name in enumerate(todo, 1):
        say(f"== {name} ({i}/{len(todo)})")  # a demo runs for minutes: how far it is
        t0 = time.time()
        before = {p.name for p in parent.path.iterdir()}
        lines = inspect_demo(parent, quiet) if name == "inspect" else run_step(parent, EXPERIMENTS[name], quiet)
        for line in lines:
            say(f"   {line}")
        new = sorted(p.name for p in parent.path.iterdir() if p.is_dir() and p.name not in before)
        records.append({"step": name, "seconds": round(time.time() - t0, 2), "summary": lines,
                        "folders": [str(parent.path / d) for d in new]})
    return records


def demo(out: Any = None, chosen: list[str] | None = None, *, force: bool = False, quiet: bool = False,
         echo: Callable[[str], None] = print) -> tuple[Any, list[dict[str, Any]], Any]:
    """``moetool demo``: every step (or ``steps``) into one run folder, then the report page gathering them.
    Returns (run folder, one record per step, path of report.html)."""
    from .errors import MoetoolError
    from .registry import did_you_mean, refuse_repeats
    from .report import RunDir
    from .report.page import write_report

    known = steps()
    if chosen is not None and not chosen:  # an empty choice is no step, not every step
        raise MoetoolError(f"give at least one demo step (None: every step); steps: {', '.join(known)}")
    for s in chosen or []:
        if s not in known:
            raise MoetoolError(f"unknown demo step '{s}'{did_you_mean(s, known)}; steps: {', '.join(known)}")
    refuse_repeats(chosen or [], "--steps")
    run = RunDir.create("demo", out, force)
    records = run_demo(run, chosen, quiet=quiet, echo=echo)
    run.add(steps=records)
    run.finish(options={"steps": chosen or known})
    page = write_report([run.path], run.sub("report"), title="moetool demo")  # every step's figures and tables
    return run.path, records, page
