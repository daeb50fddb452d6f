"""``moetool ppl``: perplexity under any routing policy."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Causal, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype,
                      Ep, Force, Layers, MaxTokens, Model, Out, Quiet, Routing, Seed, SeqLen, Sim, Tp, Weights,
                      echo_run, handle_errors, parse_layers, preflight, start_run)
from .options import Quantize
from moetool.experiments.ppl import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/ppl/spec.py

@handle_errors
def ppl(model: Model = DEFAULT_MODEL, data: Data = None, routing: str = Routing, weights: str = Weights,
        sim: str = Sim, causal: bool = Causal, layers: Layers = None, seq_len: SeqLen = 256,
        max_tokens: MaxTokens = 32768, batch_size: BatchSize = 8,
        dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
        tp: Tp = 1, ep: Ep = 1,
        out: Out = None,
        force: Force = False, seed: Seed = 0, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
        baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also run the router on the same "
                                      "rows for the perplexity ratio (policies other than router)."),
        quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.ppl.compute import PplOptions, ppl as compute
    from moetool.experiments.routing import data_name
    from moetool.report.console import print_table

    opts = PplOptions(routing=routing, weights=weights, sim=sim, causal=causal, layers=parse_layers(layers),
                      batch_size=batch_size, seed=seed, bootstrap=bootstrap, baseline=baseline)
    policy = opts.policy()  # a bad --routing fails before anything is loaded
    started = start_run("ppl", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                         batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                         attention=policy.needs_attention)
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    started.write(res)
    # plain echo: rich would render the ':up:' of norm:up as an emoji
    typer.echo(f"perplexity of {model} on {data_name(data)}, routing {policy.name}")
    print_table(res.summary)
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(ppl)
