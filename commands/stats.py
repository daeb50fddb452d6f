"""``moetool stats``: how the model's own router uses its experts (load, entropies, co-activation,
per-domain load, top tokens per expert)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .trace_input import Trace, TraceConfig
from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      Layers, MaxTokens, Model, Out, Quantize, Quiet, Resume, Seed, SeqLen, Tp, echo_run, handle_errors,
                      parse_layers, preflight, start_run)
from moetool.experiments.stats import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/stats/spec.py


@handle_errors
def stats(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          top_tokens: int = typer.Option(10, "--top-tokens", min=0,
                                         help="Most frequent token ids listed per expert (0: skip top tokens)."),
          min_count: int = typer.Option(10, "--min-count", min=1,
                                        help="Minimum occurrences of a token id in specialization.csv and of a "
                                             "(token, expert) pair in top_tokens_lift.csv."),
          top_k: int = typer.Option(None, "--top-k", min=1, max=1,
                                    help="1: every table on each token's first-ranked expert only (OLMoE's "
                                         "*_top1). Default: the model's top-K."),
          coactivation: str = typer.Option("all", "--coactivation",
                                           help="all (default): count every ordered pair of the top-K (routed "
                                                "to both); adjacent: only neighbouring ranks, as OLMoE's "
                                                "heatmaps (lower for K > 2)."),
          all_tokens: bool = typer.Option(False, "--all-tokens",
                                          help="Write expert_tokens.parquet: every (layer, expert, token id) "
                                               "count, not truncated."),
          no_special_tokens: bool = typer.Option(False, "--no-special-tokens",
                                                 help="Tokenize without special tokens (default: the tokenizer's "
                                                      "own default, e.g. a BOS)."),
          layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 32768, batch_size: BatchSize = 8,
          dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
          tp: Tp = 1, ep: Ep = 1,
          bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, seed: Seed = 0, resume: Resume = False,
          quiet: Quiet = False, trace: Optional[Path] = Trace, trace_config: Optional[str] = TraceConfig) -> None:
    if trace is not None:  # recorded routing instead of a forward (commands/trace_input.py)
        from moetool.experiments.stats.compute import StatsOptions

        from .trace_input import refuse, stats_on_trace

        refuse({"--data": data, "--resume": resume, "--no-special-tokens": no_special_tokens, "--layers": layers})
        return stats_on_trace(trace, trace_config, StatsOptions(
            top_tokens=top_tokens, min_count=min_count, batch_size=batch_size, top_k=top_k,
            coactivation=coactivation, all_tokens=all_tokens, bootstrap=0, seed=seed), out, force)
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.stats.compute import StatsOptions, stats as compute
    from moetool.report.console import print_table

    opts = StatsOptions(top_tokens=top_tokens, min_count=min_count, batch_size=batch_size, top_k=top_k,
                        coactivation=coactivation, all_tokens=all_tokens, bootstrap=bootstrap, seed=seed,
                        layers=parse_layers(layers))
    started = start_run("stats", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                        add_special_tokens=False if no_special_tokens else None, resume=resume,
                        units={**vars(opts), "no_special_tokens": no_special_tokens})
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet, units=started.units)
    started.options["special_tokens"] = "none" if no_special_tokens else "tokenizer default"
    started.write(res)
    print_table(res.summary, title=f"{model}: {tokens.n_tokens:,} tokens", csv="layers.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(stats)
