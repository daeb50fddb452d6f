"""``moetool topk``: fewer experts per token -- fixed k < K and top-p routing against perplexity."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      Layers, MaxTokens, Model, Out, Quiet, Seed, SeqLen, finish_command, handle_errors, parse_layers,
                      parse_list, preflight, start_run)
from .options import Quantize

HELP = """The compute-quality frontier of reduced and dynamic K: perplexity against experts per token.

For the router and each policy, the policy replaces routing in the MoE layers (--layers) and the model runs on
--data. topk:<k> is the model's own routing with k experts instead of K (its ranking, group limits and bias;
the weights its rule gives the chosen set, renormalised where it renormalises; topk:K reproduces the model).
topp:<p> keeps, per token, the smallest set of experts in decreasing routing probability π whose mass reaches p
(at least one, at most --kmax; dynamic routing, Huang et al. 2024, arXiv 2403.07652). The same policies work in
ppl, eval, trace and norm-select: --routing topk:1, --routing topp:0.9.
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
router on the same rows.

Writes topk.csv (policy, kind, value, tokens, mean_experts, experts_frac, perplexity, ratio; *_lo/*_hi),
topk_layers.csv (policy, kind, value, layer, tokens, mean_experts, min_experts, max_experts),
figures/topk_frontier (perplexity / the router's vs experts per token), figures/topk_layers (top-p: experts per token by
layer) and manifest.json (definitions).

Examples:
  moetool topk
  moetool topk --model tiny-fine --ks 1,4 --ps 0.5,0.9 --max-tokens 4096
"""


@handle_errors
def topk(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
         ks: str = typer.Option(None, "--ks", help="Fixed experts per token, comma-separated (default 1 .. K-1)."),
         ps: str = typer.Option("0.5,0.7,0.8,0.9,0.95,0.99", "--ps", help="Top-p masses, comma-separated ('none': no top-p)."),
         kmax: int = typer.Option(None, "--kmax", help="At most this many experts per token under top-p "
                                                       "(default: all n)."),
         bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
         max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
         device_map: DeviceMap = None, quantize: Quantize = None, seed: Seed = 0, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.topk import TopkOptions, topk as compute

    masses = () if ps.strip().lower() == "none" else tuple(parse_list(ps, float, "p"))
    opts = TopkOptions(ks=tuple(parse_list(ks, int, "k")) if ks else None, ps=masses,
                       kmax=kmax, layers=parse_layers(layers), batch_size=batch_size, bootstrap=bootstrap,
                       seed=seed)
    started = start_run("topk", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    finish_command(started, res, f"experts per token and perplexity: {model} ({tokens.n_tokens:,} tokens)",
                   "topk.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(topk)
