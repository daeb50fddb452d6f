"""``moetool norm-select``: the Autonomy-of-Experts pilot (experts pick themselves by node norm)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      IncludePath, Layers, Limit, MaxTokens, Model, NumFewshot, Out, Quiet, Resume, Seed, SeqLen, Tp,
                      Weights, echo_run, handle_errors, parse_layers, parse_list, preflight, start_run)
from .options import Quantize
from moetool.experiments.norm_select import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/norm_select/spec.py


@handle_errors
def norm_select(model: Model = DEFAULT_MODEL,
                nodes: str = typer.Option("all", "--nodes", help="Comma list of gate,up,act,glu,output or 'all'."),
                norm: str = typer.Option("l2", "--norm", help="l2|l1|linf, or a comma list to sweep several."),
                weights: str = Weights, layers: Layers = None, data: Data = None,
                tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks (comma list); "
                                                    "default: perplexity only."),
                num_fewshot: Optional[int] = NumFewshot, limit: Optional[int] = Limit,
                include_path: Optional[Path] = IncludePath,
                seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
                dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None,
                quantize: Quantize = None, tp: Tp = 1, ep: Ep = 1, out: Out = None,
                force: Force = False, resume: Resume = False, seed: Seed = 0,
                bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
                prune: Optional[str] = typer.Option(None, "--prune", help="Run on the pruned model: "
                                                    "<criterion>:<fraction>[:<prune_importance.csv>] or "
                                                    "file:<removed.json|csv> (as the prune: policy; see moetool "
                                                    "prune). The router baseline routes among the kept experts and "
                                                    "every norm policy chooses among them."),
                quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.norm_select import compute as ns
    from moetool.experiments.eval.compute import plan_tasks
    from moetool.policies import build_once
    from moetool.experiments.published import console_layout
    from moetool.report.console import print_table, with_ci

    opts = ns.NormSelectOptions(nodes=tuple(ns.parse_nodes(nodes)), norms=tuple(ns.parse_norms(norm)),
                                weights=weights, layers=parse_layers(layers),
                                tasks=tuple(parse_list(tasks, str, "task")) if tasks is not None else None,
                                num_fewshot=num_fewshot, limit=limit,
                                include_path=str(include_path) if include_path else None, batch_size=batch_size,
                                seed=seed, bootstrap=bootstrap, prune=prune)
    for spec in opts.specs():  # a bad --weights fails before anything is loaded; the experiment routes with these
        build_once(spec, weights, seed)
    if opts.prune is not None:
        build_once(opts.prune, weights, seed)  # a bad --prune (spec, file) too
    plan = plan_tasks(opts.tasks, opts.include_path) if opts.tasks is not None else None
    started = start_run("norm-select", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                         batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                         resume=resume, units=opts)
    run, lm, tokens = started
    res = ns.norm_select(lm, tokens, opts, plan=plan, quiet=quiet, units=started.units)
    started.write(res)
    on = f"{model} pruned by {opts.prune}" if opts.prune else model
    print_table(with_ci(res.summary), title=f"norm-select on {on} (weights {weights}; ± = 95% interval)")
    if "aoe_table1.csv" in res.tables:
        title, table = console_layout(res["aoe_table1"])
        print_table(table, title=title, csv="aoe_table1.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(name="norm-select", help=HELP)(norm_select)
