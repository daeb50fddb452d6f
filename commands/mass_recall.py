"""``moetool mass-recall``: routing mass kept by an inverted-index (IVF) router (AIR-MoE: Kladny et al. 2026,
arXiv 2605.04952)."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      Layers, MaxTokens, Model, Out, Quantize, Quiet, Seed, SeqLen, Tp, echo_run, handle_errors,
                      parse_layers, parse_list, preflight, start_run)
from moetool.experiments.mass_recall import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/mass_recall/spec.py


@handle_errors
def mass_recall(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
                codebook_size: str = typer.Option("8,32,128", "--codebook-size", "-G",
                                                  help="Codebook sizes G, comma-separated."),
                shortlist: str = typer.Option(None, "--shortlist", "-M",
                                              help="Shortlist sizes M, comma-separated, each at most the layer's n "
                                                   "experts (default: 2,4,8,16 up to n)."),
                centroids: str = typer.Option("raw,unit", "--centroids",
                                              help="Expert centroid modes, comma-separated: raw (the router as "
                                                   "is) and/or unit (rows on the unit sphere)."),
                kmeans_iters: int = typer.Option(1, "--kmeans-iters", min=0,
                                                 help="Extra k-means passes over the data after the first."),
                layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 16384,
                batch_size: BatchSize = 8, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, dtype: Dtype = "auto",
                device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
                tp: Tp = 1, ep: Ep = 1, seed: Seed = 0,
                quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.mass_recall.compute import MassRecallOptions, mass_recall as compute
    from moetool.report.console import print_table, with_ci

    opts = MassRecallOptions(codebook_sizes=tuple(parse_list(codebook_size, int, "codebook size")),
                             shortlists=tuple(parse_list(shortlist, int, "shortlist size")) if shortlist else None,
                             centroids=tuple(parse_list(centroids, str, "centroids mode")),
                             kmeans_iters=kmeans_iters, seed=seed, batch_size=batch_size, layers=parse_layers(layers),
                             bootstrap=bootstrap)
    started = start_run("mass-recall", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    started.write(res)
    if not quiet:
        print_table(with_ci(res.summary), f"mass recall: {model} ({tokens.n_tokens:,} tokens)", csv="mass_recall.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(name="mass-recall", help=HELP)(mass_recall)
