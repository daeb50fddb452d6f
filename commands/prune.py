"""``moetool prune``: expert importance (frequency, router-weighted, REAP) and perplexity as experts are removed."""

from __future__ import annotations

import typer

from pathlib import Path
from typing import Optional

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      IncludePath, Layers, Limit, MaxTokens, Model, NumFewshot, Out, Quiet, Seed, SeqLen, Tp,
                      finish_command, handle_errors, parse_layers, parse_list, preflight, start_run)
from .options import Quantize
from moetool.experiments.prune import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/prune/spec.py


@handle_errors
def prune(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          fractions: str = typer.Option("0.125,0.25,0.5", "--fractions",
                                        help="Fractions of each MoE layer's experts removed, comma-separated."),
          criteria: str = typer.Option("frequency,weighted,reap,random", "--criteria",
                                       help="Importance criteria, comma-separated: frequency, weighted, reap, "
                                            "random."),
          ablate: int = typer.Option(8, "--ablate", help="Single-expert ablations of the experts with the largest "
                                                          "REAP saliency (0: none)."),
          reap_weights: str = typer.Option("renormalised", "--reap-weights", help="REAP's gate weight: renormalised "
                                           "(p over the sum of the top-K's p, REAP's README) or softmax (p, "
                                           "reap.main on Mixtral)."),
          tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks (comma list) run under "
                                              "every pruning; default: perplexity only."),
          num_fewshot: Optional[int] = NumFewshot, limit: Optional[int] = Limit,
          include_path: Optional[Path] = IncludePath,
          bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
          max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
          device_map: DeviceMap = None, quantize: Quantize = None,
          tp: Tp = 1, ep: Ep = 1, seed: Seed = 0, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.eval.compute import plan_tasks
    from moetool.experiments.prune.compute import PruneOptions, prune as compute

    opts = PruneOptions(fractions=tuple(parse_list(fractions, float, "fraction")),
                        criteria=tuple(parse_list(criteria, str, "criterion")), ablate=ablate, reap_weights=reap_weights,
                        layers=parse_layers(layers), batch_size=batch_size, bootstrap=bootstrap, seed=seed,
                        tasks=tuple(parse_list(tasks, str, "task")) if tasks is not None else None,
                        num_fewshot=num_fewshot, limit=limit,
                        include_path=str(include_path) if include_path else None)
    plan = plan_tasks(opts.tasks, opts.include_path) if opts.tasks is not None else None  # before the model loads
    started = start_run("prune", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, plan=plan, quiet=quiet)
    finish_command(started, res, f"perplexity with experts removed: {model} ({tokens.n_tokens:,} tokens)",
                   "prune.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(prune)
