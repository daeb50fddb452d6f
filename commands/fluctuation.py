"""``moetool fluctuation``: routing change between checkpoints (Graph of Tokens: Nguyen, Tran, Nguyen,
Baraniuk 2025, arXiv 2505.00792, Fig. 3)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .trace_input import TraceConfig
from .options import (BatchSize, Bootstrap, Causal, Data, DEFAULT_BOOTSTRAP, Device, DeviceMap, Dtype, Ep, Force,
                      Layers, MaxTokens, Out, Quantize, Quiet, Resume, Seed, SeqLen, Sim, Tp, check_run, echo_run,
                      handle_errors, open_run, parse_layers, parse_list, preflight, rank_layout, run_options,
                      unit_key, write_result)
from moetool.experiments.fluctuation import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/fluctuation/spec.py


@handle_errors
def fluctuation(checkpoints: List[str] = typer.Argument(None, help="Two or more checkpoints (embedded names, "
                                                           "local directories, aliases or hub ids), in order."),
                data: Data = None, out: Out = None, force: Force = False,
                routing: str = typer.Option("router,similarity,attention", "--routing",
                                            help="Routing policies compared, comma-separated (router = the model's "
                                                 "own routing; similarity, attention, or any --routing spec)."),
                tau: Optional[float] = typer.Option(None, "--tau", help="Similarity temperature τ (default sqrt(d))."),
                sim: str = Sim, causal: bool = Causal,
                reference: str = typer.Option("previous", "--reference",
                                              help="Pairs: previous (i-1 vs i), first (0 vs i) or last (last vs i)."),
                isolate: bool = typer.Option(False, "--isolate", help="Also feed the reference's MoE inputs to the "
                                             "other checkpoint's routers (rows <routing>-isolated)."),
                layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
                bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, seed: Seed = 0,
                dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None,
                quantize: Quantize = None, tp: Tp = 1, ep: Ep = 1, resume: Resume = False, quiet: Quiet = False,
                trace: List[Path] = typer.Option(None, "--trace", help="Two or more recorded routings of the same "
                                                 "tokens (moetool trace / import-trace runs), in order, instead of "
                                                 "checkpoints."),
                trace_config: Optional[str] = TraceConfig) -> None:
    if trace:  # recorded routings instead of forwards (commands/trace_input.py)
        from .trace_input import fluctuation_on_traces, refuse

        refuse({"checkpoints": checkpoints, "--data": data, "--isolate": isolate, "--resume": resume,
                "--routing": routing != "router,similarity,attention" and routing, "--device-map": device_map,
                "--quantize": quantize, "--layers": layers})
        return fluctuation_on_traces(trace, trace_config, reference, bootstrap, seed, max_tokens, out, force)
    if not checkpoints:
        from moetool.errors import MoetoolError

        raise MoetoolError("give two or more checkpoints (or --trace runs)")
    preflight(*checkpoints)  # before the experiment's imports: a bad --model fails at once
    from moetool import distributed
    from moetool.data import DocumentStream, load_tokens
    from moetool.experiments.fluctuation.compute import (FluctuationOptions, check_checkpoints, fluctuation as compute,
                                                 summary_lines)
    from moetool.report.console import print_table, with_ci

    opts = FluctuationOptions(routing=tuple(parse_list(routing, str, "routing")), tau=tau, sim=sim, causal=causal,
                              reference=reference, isolate=isolate, layers=parse_layers(layers),
                              batch_size=batch_size, dtype=dtype, device=device, device_map=device_map,
                              quantize=quantize,
                              bootstrap=bootstrap, seed=seed)
    DocumentStream(data)
    tokenizer = check_checkpoints(checkpoints)
    est = check_run(checkpoints[0], seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                    dtype=dtype, device_map=device_map, quantize=quantize,
                    attn_implementation="eager" if opts.needs_attention else None)
    options = run_options(checkpoints=list(checkpoints), data=data, seq_len=seq_len, max_tokens=max_tokens)
    run, units = open_run("fluctuation", out, force, resume=resume, device=device, estimate=est,
                          batch_size=batch_size, units={**options, **unit_key(opts)})
    tokens = load_tokens(data, tokenizer, seq_len, max_tokens)
    if units is not None:  # --resume: refused when the data or a checkpoint's weights differ from what the run read
        from moetool.loading import weights_fingerprint

        units.check_inputs(data=tokens.fingerprint(), model=[weights_fingerprint(c) for c in checkpoints])
    if distributed.world_size() > 1:
        run.add(distributed=rank_layout(tokens, batch_size))
    res = compute(checkpoints, tokens, opts, quiet=quiet, units=units)
    write_result(res, run, options=options)
    if not quiet:
        print_table(with_ci(res.summary), f"routing fluctuation ({tokens.n_tokens:,} tokens)", csv="fluctuation.csv")
        for line in summary_lines(" vs ".join(checkpoints), res):
            typer.echo(line)
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(fluctuation)
