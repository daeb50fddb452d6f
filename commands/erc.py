"""``moetool erc``: expert–router coupling matrix M and ERC loss from the weights (no data)."""

from __future__ import annotations

import typer

from .options import (DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force, Layers, Model, Out, Quiet, Seed, Tp, echo_run,
                      handle_errors, parse_layers, parse_list, preflight, start_run)
from .options import Quantize
from moetool.experiments.erc import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/erc/spec.py


@handle_errors
def erc(model: Model = DEFAULT_MODEL, out: Out = None, force: Force = False,
        alpha: str = typer.Option("0.4,0.6,0.8,1.0", "--alpha", help="Comma-separated α values of L_ERC(α)."),
        noise: str = typer.Option("derived", "--noise", help="derived: eps_i from the nearest other router row "
                                  "(||R_i − R_j*|| / 2||R_i||); none: no noise; a number: that eps for every expert."),
        samples: int = typer.Option(1, "--samples", min=1, help="Noise draws (seeded); erc_loss is their mean."),
        node: str = typer.Option("gate", "--node", help="Probe node whose norm fills M: gate|up|act|glu|output."),
        norm: str = typer.Option("l2", "--norm", help="Norm of the node: l2|l1|linf."),
        layers: Layers = None,
        dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
        tp: Tp = 1, ep: Ep = 1,
        seed: Seed = 0,
        quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.erc.compute import ErcOptions, erc as compute, parse_noise, summary_lines
    from moetool.experiments.published import erc_alpha_min
    from moetool.report.console import print_table

    opts = ErcOptions(alphas=tuple(parse_list(alpha, float, "alpha")), noise=parse_noise(noise), samples=samples,
                      node=node, norm=norm, seed=seed, layers=parse_layers(layers))
    started = start_run("erc", out, force, model, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                         tokenizer=False)
    run, lm, _ = started
    res = compute(lm, opts, quiet=quiet)
    started.write(res)
    if not quiet:
        print_table(res["erc_layers"], "ERC per layer", csv="erc_layers.csv")
        typer.echo(f"alpha_min_paper: {erc_alpha_min(res['erc_layers'], model).attrs['source']}")
        print_table(res["erc"], "ERC loss", csv="erc.csv")
        typer.echo(summary_lines(model, res)[0])
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(erc)
