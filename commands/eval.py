"""``moetool eval``: lm-evaluation-harness accuracy under a routing policy."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import (BatchSize, Causal, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force, IncludePath, Layers, Limit,
                      Model, NumFewshot, Out, Quiet, Routing, Seed, Sim, Tp, Weights, echo_run, handle_errors,
                      parse_layers, parse_list, preflight, start_run)
from .options import Quantize
from moetool.experiments.eval import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/eval/spec.py


@handle_errors
def eval_command(model: Model = DEFAULT_MODEL,
                 tasks: str = typer.Option(..., "--tasks", "-t", help="Comma list of lm-eval task names "
                                           "(shipped offline: moetool_code, moetool_prose)."),
                 num_fewshot: Optional[int] = NumFewshot, limit: Optional[int] = Limit,
                 include_path: Optional[Path] = IncludePath,
                 routing: str = Routing, weights: str = Weights, sim: str = Sim, causal: bool = Causal,
                 layers: Layers = None, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
                 device_map: DeviceMap = None, quantize: Quantize = None,
                 tp: Tp = 1, ep: Ep = 1, out: Out = None, force: Force = False,
                 seed: Seed = 0,
                 quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.eval.compute import EvalOptions, eval_tasks, plan_tasks
    from moetool.report.console import print_table

    opts = EvalOptions(tasks=tuple(parse_list(tasks, str, "task")), num_fewshot=num_fewshot, limit=limit,
                       include_path=str(include_path) if include_path else None, routing=routing, weights=weights,
                       sim=sim, causal=causal, layers=parse_layers(layers), batch_size=batch_size, seed=seed)
    policy = opts.policy()
    plan = plan_tasks(opts.tasks, opts.include_path)  # unknown tasks fail before anything is loaded
    started = start_run("eval", out, force, model, batch_size=batch_size, dtype=dtype, device=device,
                         device_map=device_map, quantize=quantize, attention=policy.needs_attention)
    run, lm, _ = started
    res = eval_tasks(lm, opts, plan=plan, quiet=quiet)
    started.write(res)
    typer.echo(f"lm-eval on {model}, routing {policy.name}")  # plain echo: rich makes ':up:' an emoji
    print_table(res.summary)
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(name="eval", help=HELP)(eval_command)
