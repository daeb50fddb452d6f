"""``moetool super-experts``: experts whose down projection makes extreme outputs, and perplexity without them."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      Layers, MaxTokens, Model, Out, Quiet, Seed, SeqLen, finish_command, handle_errors, parse_layers,
                      preflight, start_run)
from .options import Quantize

HELP = """Super Experts: the experts whose down projection makes extreme outputs, and what removing them costs.

One pass of the model's own routing over --data measures, per MoE layer (--layers) and expert, the largest
|output| of its down projection over its output dimensions and the real tokens routed to it (every expert's output
from batched probes in memory-bounded chunks; a running max). Super Experts (Su et al. 2025, "Unveiling Super
Experts in Mixture-of-Experts Large Language Models", arXiv 2507.23279): an expert whose maximum exceeds the
--percentile (99.5) percentile of every (layer, expert) maximum and is at least --fraction-of-max (0.1) of the
largest. Then the model runs on the same rows with the super experts removed (masked out of the top-K, as
prune's policy) and with as many random other experts removed in each layer (seeded by --seed).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes super_experts.csv (layer, expert, routed, max_abs_output, share_of_max, rank, is_super, threshold),
super_experts_ablation.csv (ablation: none|super|random, removed, experts, tokens, perplexity, delta_ppl, ratio;
*_lo/*_hi), figures/super_experts_heatmap (max |output| per layer and expert, the super experts boxed),
figures/super_experts_ranked (every maximum by rank, with the threshold) and manifest.json (definitions,
criterion).

Examples:
  moetool super-experts
  moetool super-experts --model tiny-fine --max-tokens 4096 --percentile 99 --fraction-of-max 0.2
"""


@handle_errors
def super_experts(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
                  percentile: float = typer.Option(99.5, "--percentile",
                                                   help="A super expert's maximum exceeds this percentile of every "
                                                        "(layer, expert) maximum."),
                  fraction_of_max: float = typer.Option(0.1, "--fraction-of-max",
                                                        help="... and is at least this fraction of the largest."),
                  bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
                  max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto",
                  device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None, seed: Seed = 0,
                  quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.super_experts import SuperExpertsOptions, super_experts as compute

    opts = SuperExpertsOptions(percentile=percentile, fraction_of_max=fraction_of_max, layers=parse_layers(layers),
                               batch_size=batch_size, bootstrap=bootstrap, seed=seed)
    started = start_run("super-experts", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    finish_command(started, res, f"super experts and perplexity without them: {model} ({tokens.n_tokens:,} tokens)",
                   "super_experts_ablation.csv")


def register(app: typer.Typer) -> None:
    app.command(name="super-experts", help=HELP)(super_experts)
