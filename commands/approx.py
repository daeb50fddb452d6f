"""``moetool approx``: MoE as the best k-term approximation of the dense sum of all experts (Su 2025,
"MoE Travelogue 1: Starting from Geometric Meaning", https://kexue.fm/archives/10699)."""

from __future__ import annotations

import typer

from .options import (BatchSize, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force, Layers, MaxTokens, Model,
                      Out, Quiet, Seed, SeqLen, Tp, echo_run, handle_errors, parse_layers, parse_list, preflight,
                      start_run)
from .options import Quantize
from moetool.experiments.approx import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/approx/spec.py


@handle_errors
def approx(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
           selectors: str = typer.Option("router,norm_oracle,best_subset,random", "--selectors",
                                         help="Comma-separated selection rules scored against the dense sum: "
                                              "router, norm_oracle, best_subset, random. They do not change "
                                              "the routing (the model runs with its own router), so they are "
                                              "not --routing policies."),
           max_subsets: int = typer.Option(10_000, "--max-subsets", min=1,
                                           help="best_subset only in layers with C(n, K) at most this."),
           layers: Layers = None,
           seq_len: SeqLen = 256, max_tokens: MaxTokens = 4096, batch_size: BatchSize = 4, dtype: Dtype = "auto",
           device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
           tp: Tp = 1, ep: Ep = 1, seed: Seed = 0,
           quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.approx.compute import ApproxOptions, approx as compute, summary_lines
    from moetool.report.console import print_table

    opts = ApproxOptions(selectors=tuple(parse_list(selectors, str, "selector")), max_subsets=max_subsets,
                         layers=parse_layers(layers), batch_size=batch_size, seed=seed)
    started = start_run("approx", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                         batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    started.write(res)
    if not quiet:
        print_table(res["approx"], f"k-term approximation: {model} ({tokens.n_tokens:,} tokens)", csv="approx.csv")
        print_table(res["approx_layers"], "router vs norm, orthogonality", csv="approx_layers.csv")
        typer.echo(summary_lines(model, res)[0])
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(approx)
