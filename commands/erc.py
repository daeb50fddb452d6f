"""``moetool erc``: expert–router coupling matrix M and ERC loss from the weights (no data)."""

from __future__ import annotations

import typer

from .options import (DEFAULT_MODEL, Device, DeviceMap, Dtype, Force, Layers, Model, Out, Quiet, Seed, echo_run,
                      handle_errors, parse_layers, parse_list, preflight, start_run)
from .options import Quantize

HELP = r"""Expert–router coupling (ERC) from the weights only: no data, no tokenizer.

Source: Lv, Ma, Ma, Qiao (2025), "Coupling Experts and Routers in Mixture-of-Experts via an Auxiliary Loss",
arXiv 2512.23447.

Per MoE layer, router row R_i is a proxy token for expert i, perturbed
R~_i = R_i ⊙ δ_i with δ_i ~ U(1−eps_i, 1+eps_i)^d. M\[i,j] = ||W_g^j R~_i||
(--node gate) is how strongly expert j answers proxy i.
L_ERC(α) = (1/n²) Σ_i Σ_{j≠i} max(M\[i,j] − αM\[i,i], 0)
                          + max(M\[j,i] − αM\[i,i], 0).
alpha_min (clean M) is the smallest α with zero loss; row/col dominance is the
fraction of proxies/experts whose own counterpart is their row/column maximum.
Routed experts of the MoE layers only.

Writes erc.csv (layer, alpha, erc_loss = mean over --samples draws of each
draw's loss, erc_loss_clean), erc_layers.csv (layer, n_experts, alpha_min,
alpha_min_paper, row_dominance, col_dominance, eps_mean, router_abs_cos_mean;
alpha_min_paper = the ERC paper's vanilla-MoE value α≈5 in every layer,
approximate, printed beside the measured one), erc_matrix.csv
(layer, i, j, m = clean M), figures/erc_matrix (heatmaps), figures/erc_loss
(clean L_ERC(α) from 0 past every layer's alpha_min, which is marked; the noisy
loss at the --alpha values as points), manifest.json (every definition).

Examples:
  moetool erc --out runs/erc-tiny
  moetool erc --model tiny-fine --alpha 0.5,1,2,5 --samples 8
  moetool erc --noise none --node glu --norm l1 --layers 0,2
"""


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
