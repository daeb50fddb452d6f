"""``moetool offload``: could an expert cache or a prefetcher serve this model on limited memory? (issue #11)"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .trace_input import Trace, TraceConfig
from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      Layers, MaxTokens, Model, Out, Quiet, Seed, SeqLen, Tp, echo_run, handle_errors, parse_layers,
                      parse_list, preflight, start_run)
from .options import Quantize
from moetool.experiments.offload import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/offload/spec.py


@handle_errors
def offload(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
            capacity: str = typer.Option(None, "--capacity", "-C",
                                         help="Cache sizes C (experts per layer), comma-separated; default "
                                              "K, 2K, n/4, n/2, 3n/4, n within [K, n]."),
            policies: str = typer.Option("lru,lfu,belady", "--policies", help="Cache policies: lru, lfu, belady."),
            coverage_tokens: str = typer.Option(None, "--coverage-tokens",
                                                help="N of coverage(N), comma-separated (default powers of 4 "
                                                     "from 16, and all tokens)."),
            predict_norm: bool = typer.Option(True, "--predict-norm/--no-predict-norm",
                                              help="Apply layer ℓ+1's post_attention_layernorm to x_ℓ before its "
                                                   "router."),
            bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
            layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192,
            batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None,
            quantize: Quantize = None, tp: Tp = 1, ep: Ep = 1,
            seed: Seed = 0, quiet: Quiet = False, trace: Optional[Path] = Trace,
            trace_config: Optional[str] = TraceConfig) -> None:
    if trace is None:
        preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.offload.compute import OffloadOptions, offload as compute
    from moetool.report.console import print_table

    opts = OffloadOptions(capacities=tuple(parse_list(capacity, int, "capacity")) if capacity else None,
                          policies=tuple(parse_list(policies, str, "policy")),
                          coverage_tokens=tuple(parse_list(coverage_tokens, int, "coverage tokens"))
                          if coverage_tokens else None, predict_norm=predict_norm, bootstrap=bootstrap, seed=seed,
                          batch_size=batch_size, layers=parse_layers(layers))
    if trace is not None:  # recorded routing instead of a forward (commands/trace_input.py)
        from .trace_input import offload_on_trace, refuse

        refuse({"--data": data})
        return offload_on_trace(trace, trace_config, opts, max_tokens, out, force)
    started = start_run("offload", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    started.write(res)
    if not quiet:
        print_table(res.summary, f"expert cache: {model} ({tokens.n_tokens:,} tokens; hit rate = mean over layers, "
                                 f"bytes/token = sum over layers)", csv="offload_cache.csv")
        pref = res["offload_prefetch"]
        if len(pref):
            from moetool.report.console import format_ci

            shown = pref[["layer", "source_layer"]].assign(
                **{c: [format_ci(r[c], r[f"{c}_lo"], r[f"{c}_hi"]) for _, r in pref.iterrows()]
                   for c in ("top1_recall", "topk_recall")})
            print_table(shown, "next-layer prediction recall (± half-width of the 95% interval)",
                        csv="offload_prefetch.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(offload)
