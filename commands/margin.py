"""``moetool margin``: routing margin and brittleness -- the K-th vs (K+1)-th score gap and top-K flips under noise."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      Layers, MaxTokens, Model, Out, Quiet, Seed, SeqLen, finish_command, handle_errors, parse_layers,
                      parse_list, preflight, start_run)
from .options import Quantize

HELP = """Routing margin and brittleness per MoE layer, over the real tokens of --data with the model's own routing.

Margin: the K-th minus the (K+1)-th largest selection score of a token (the scores the model ranks experts by:
softmax probabilities or sigmoids, correction bias included) -- its mean, 5th/50th/95th percentiles (a streaming
log-binned sketch, relative error in the manifest) and the share of tokens below each --thresholds value.
Brittleness: the router input h is perturbed, h' = h + eps ||h|| z / sqrt(d) with z ~ N(0, I) seeded per packed row
(--seed; the same z for every eps; noise_rel: the relative size that survives rounding to the model's dtype), the
layer's routing is recomputed from h' and compared with the one from h: the share of tokens whose top-K set
changed and whose top-1 changed, for each --eps, also per margin bin (edges 0, the thresholds, inf).
Agreement with routing policies (--policies, specs as --routing elsewhere: norm:gate, random, topk:1, ...; none =
off): each policy's choice on the same routing event, computed on the side, against the router's, per token: the
soft Jaccard sum_e min(w_r[e], w_p[e]) / sum_e max(w_r[e], w_p[e]) over the n experts (each weight vector
normalised to sum 1 over its chosen experts, 0 elsewhere) and the plain Jaccard |S_r ∩ S_p| / |S_r ∪ S_p| of the
chosen sets; means per layer. Policies that need attention probabilities are refused.
The forward itself is the model's; only its routing inputs are read.
Intervals: 95% document-level bootstrap over packed rows for the flip rates and the Jaccards (--bootstrap N, 0 =
off).

Writes margin.csv (layer, tokens, margin_mean, margin_p05, margin_p50, margin_p95, frac_below_<thr>),
margin_flips.csv (layer, eps, tokens, noise_rel, topk_flip, top1_flip; *_lo/*_hi),
margin_bins.csv (layer, eps, margin_lo, margin_hi, tokens, topk_flip, top1_flip),
margin_jaccard.csv (layer, policy, soft_jaccard, jaccard, tokens; *_lo/*_hi; not with --policies none),
figures/margin_flips (flip rate against eps by layer), figures/margin_quantiles (margin percentiles by layer),
figures/margin_jaccard (soft Jaccard with each policy by layer) and manifest.json (definitions).

Examples:
  moetool margin
  moetool margin --model tiny-fine --eps 0.01,0.1 --thresholds 0.01,0.05 --max-tokens 4096
  moetool margin --policies norm:gate,random,topk:1
"""


@handle_errors
def margin(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
           eps: str = typer.Option("0.001,0.01,0.05,0.1", "--eps", help="Relative noise sizes on the router input, "
                                                                      "comma-separated."),
           thresholds: str = typer.Option("0.001,0.01,0.1", "--thresholds", help="Margin thresholds (increasing), "
                                                                               "comma-separated."),
           policies: str = typer.Option("norm:gate,random", "--policies",
                                        help="Routing policies compared with the router (soft and plain top-N "
                                             "Jaccard), comma-separated; none = off."),
           bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
           max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
           device_map: DeviceMap = None, quantize: Quantize = None, seed: Seed = 0, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.margin import MarginOptions, margin as compute

    opts = MarginOptions(eps=tuple(parse_list(eps, float, "eps")),
                         thresholds=tuple(parse_list(thresholds, float, "threshold")), layers=parse_layers(layers),
                         batch_size=batch_size, bootstrap=bootstrap, seed=seed,
                         policies=() if policies.strip().lower() == "none" else
                         tuple(parse_list(policies, str, "policy")))
    started = start_run("margin", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    finish_command(started, res, f"routing margin and flips under noise: {model} ({tokens.n_tokens:,} tokens)",
                   "margin_flips.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(margin)
