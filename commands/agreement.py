"""``moetool agreement``: routing agreement across precisions -- how much routing changes between fp32, bf16, fp16
and (simulated) fp8 / fp4 / mxfp4 on the same tokens."""

from __future__ import annotations

from typing import Optional

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Ep, Force, Layers,
                      MaxTokens, Out, Quiet, Seed, SeqLen, Tp, check_run, echo_run, handle_errors, open_run,
                      parse_layers, parse_list, preflight, rank_layout, run_options, write_result)
from moetool.experiments.agreement import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/agreement/spec.py


@handle_errors
def agreement(model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="The model (as --model)."),
              model: Optional[str] = typer.Option(None, "--model", "-m", help="Embedded name (tiny, tiny-fine, ...), "
                                                  "alias (moetool inspect --aliases), local directory or hub id "
                                                  f"(default {DEFAULT_MODEL})."),
              precisions: str = typer.Option("fp32,bf16,fp8", "--precisions", "-p",
                                             help="Precisions compared, comma-separated: fp32, bf16, fp16, fp8, fp4, "
                                                  "mxfp4 (the last three simulated)."),
              thresholds: str = typer.Option("0.0001,0.001,0.01,0.1", "--thresholds",
                                             help="Reference-margin bin edges (increasing), comma-separated."),
              data: Data = None, out: Out = None, force: Force = False, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
              layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
              device: Device = "auto", device_map: DeviceMap = None, tp: Tp = 1, ep: Ep = 1, seed: Seed = 0, quiet: Quiet = False) -> None:
    if model_arg and model and model_arg != model:
        raise typer.BadParameter(f"the model is given twice ({model_arg} and --model {model})")
    model = model_arg or model or DEFAULT_MODEL
    preflight(model)  # before the experiment's imports: a bad model fails at once
    from moetool import distributed
    from moetool.data import DocumentStream, load_tokens
    from moetool.experiments.agreement.compute import LOAD_DTYPE, PRECISIONS, AgreementOptions, agreement as compute
    from moetool.loading import load_tokenizer
    from moetool.report.console import print_table, with_ci

    opts = AgreementOptions(precisions=tuple(parse_list(precisions, str, "precision")),
                            thresholds=tuple(parse_list(thresholds, float, "threshold")), layers=parse_layers(layers),
                            batch_size=batch_size, bootstrap=bootstrap, seed=seed, device=device,
                            device_map=device_map)
    DocumentStream(data)  # a missing --data fails before anything is loaded
    est = check_run(model, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                    dtype=LOAD_DTYPE[PRECISIONS[opts.reference][0]], device_map=device_map)
    options = run_options(model=model, data=data, seq_len=seq_len, max_tokens=max_tokens, device=device)
    run, _ = open_run("agreement", out, force, resume=False, device=device, estimate=est, batch_size=batch_size)
    tokens = load_tokens(data, load_tokenizer(model), seq_len, max_tokens)
    if distributed.world_size() > 1:
        run.add(distributed=rank_layout(tokens, batch_size))
    res = compute(model, tokens, opts, quiet=quiet)
    write_result(res, run, options=options)
    print_table(with_ci(res.summary), f"routing agreement across precisions: {model} ({tokens.n_tokens:,} tokens)",
                csv="agreement.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(agreement)
