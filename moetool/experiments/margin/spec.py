"""Routing margin and brittleness per MoE layer, over the real tokens of --data with the model's own routing.

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

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "margin_flips": ("Share of real tokens whose top-K set (left) or top-1 expert (right) changes when the router "
                     "input h is perturbed by Gaussian noise of relative size eps (h + eps ||h|| z / sqrt(d)), one "
                     "line per MoE layer; error bars: the bootstrap interval", ("margin_flips.csv",),
                     ("eps", "topk_flip", "top1_flip", "*_lo/*_hi")),
    "margin_quantiles": ("Routing margin: 5th, 50th and 95th percentile over real tokens of the K-th minus the "
                         "(K+1)-th largest selection score, by MoE layer", ("margin.csv",),
                         ("margin", "margin_p05", "margin_p50", "margin_p95")),
    "margin_jaccard": ("Soft Jaccard sum_e min(w_r, w_p) / sum_e max(w_r, w_p) between the router's weights and "
                       "each routing policy's on the same tokens (each normalised to sum 1 over its chosen experts; "
                       "the policy computed on the side, the model running its own routing), mean over real tokens "
                       "by MoE layer, one line per policy; error bars: the bootstrap interval",
                       ("margin_jaccard.csv",), ("policy", "soft_jaccard", "*_lo/*_hi")),
}

SPEC = experiment("margin", "margin", "MarginOptions", figures="moetool.experiments.margin.figures:margin_figures",
                  demo=Demo(max_tokens=2048, options={"bootstrap": 200}), bootstrap=True,
                  title="routing margin and flips under noise", summary_csv="margin_flips.csv",
                  flags=(Flag("--eps", "floats", "0.001,0.01,0.05,0.1", "Relative noise sizes on the router input, "
                              "comma-separated."),
                         Flag("--thresholds", "floats", "0.001,0.01,0.1", "Margin thresholds (increasing), comma-separated."),
                         Flag("--policies", "strs", "norm:gate,random", "Routing policies compared with the router (soft and "
                              "plain top-N Jaccard), comma-separated; none = off.")),
                  order=90, captions=CAPTIONS)
