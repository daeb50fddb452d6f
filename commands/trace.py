"""``moetool trace``: per-token routing of every MoE layer, to a file pandas reads."""

from __future__ import annotations

import typer

from .options import (BatchSize, Causal, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force, Layers, MaxTokens,
                      Model, Out, Quiet, Resume, Routing, Seed, SeqLen, Sim, Tp, Weights, echo_run, handle_errors,
                      parse_layers, preflight, start_run)
from .options import Quantize
from moetool.experiments.trace import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/trace/spec.py


@handle_errors
def trace(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          logits: bool = typer.Option(False, "--logits", help="Also write the full router logits."),
          routing: str = Routing, weights: str = Weights, sim: str = Sim, causal: bool = Causal,
          fmt: str = typer.Option("csv.gz", "--format", help="csv.gz (pandas.read_csv) or parquet "
                                  "(pandas.read_parquet; faster, smaller)."),
          layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
          dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
          tp: Tp = 1, ep: Ep = 1,
          seed: Seed = 0,
          resume: Resume = False, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.errors import MoetoolError
    from moetool.experiments.trace.compute import TraceOptions, trace as compute

    if fmt not in ("csv.gz", "parquet"):
        raise MoetoolError(f"--format must be csv.gz or parquet, not '{fmt}'")
    opts = TraceOptions(routing=routing, weights=weights, sim=sim, causal=causal, layers=parse_layers(layers),
                        logits=logits, batch_size=batch_size, seed=seed)
    policy = opts.policy()
    started = start_run("trace", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                         batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                         attention=policy.needs_attention, resume=resume, units={**vars(opts), "format": fmt})
    run, lm, tokens = started
    name = f"trace.{fmt}"
    if getattr(run, "discard", False):  # a rank other than 0 under torchrun: its rows go to rank 0
        res = compute(lm, tokens, opts, quiet=quiet)
    else:  # written under a temporary name, renamed once complete
        with run.atomic(name) as tmp:
            res = compute(lm, tokens, opts, path=tmp, quiet=quiet, units=started.units)
        res.meta["files"] = {"trace": name}
    started.options["format"] = fmt
    started.write(res)
    echo_run(run.path / name)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(trace)
