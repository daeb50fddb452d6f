"""Routing margin and brittleness per MoE layer, over the real tokens of --data with the model's own routing.

Margin: the K-th minus the (K+1)-th largest selection score of a token (the scores the model ranks experts by:
softmax probabilities, sigmoids with any correction bias, or the raw router logits where the model takes the top-K
of its logits before a softmax over the chosen, as gpt-oss and Granite do; over all n experts, before any group
limit: under DeepSeek-style grouped routing the K-th may lie outside the chosen set) -- its mean, 5th/50th/95th
percentiles (a streaming log-binned sketch, relative error in the manifest) and the share of tokens below each
--thresholds value.
Brittleness: the router input h is perturbed, h' = h + eps ||h|| z / sqrt(d) with z ~ N(0, I) seeded per packed row
(--seed; the same z for every eps; noise_rel: the relative size that survives rounding to the model's dtype), the
layer's routing is recomputed from h' and compared with the one from h: the share of tokens whose top-K set
changed and whose top-1 changed, for each --eps, also per margin bin (edges 0, the thresholds, inf).
Agreement with routing policies (--policies, specs as --routing elsewhere: norm:gate, random, topk:1, ...; off by
default): each policy's choice on the same routing event, computed on the side, against the router's, per token: the
soft Jaccard sum_e min(w_r[e], w_p[e]) / sum_e max(w_r[e], w_p[e]) over the n experts (each weight vector
normalised to sum 1 over its chosen experts, 0 elsewhere) and the plain Jaccard |S_r ∩ S_p| / |S_r ∪ S_p| of the
chosen sets; means per layer. Policies that need attention probabilities are refused. A policy costs what it
computes on every token: norm:gate every expert's gate projection (by arithmetic about 1.2 forwards more on
Mixtral-8x7B, 3.5 on Qwen3-30B-A3B, 6 on DeepSeek-V3), so none runs unless asked.
The forward itself is the model's; only its routing inputs are read.
Intervals: 95% document-level bootstrap over packed rows for the flip rates and the Jaccards (--bootstrap N, 0 =
off).

Writes margin.csv (layer, tokens, margin_mean, margin_p05, margin_p50, margin_p95, frac_below_<thr>),
margin_flips.csv (layer, eps, tokens, noise_rel, topk_flip, top1_flip; *_lo/*_hi),
margin_bins.csv (layer, eps, margin_lo, margin_hi, tokens, topk_flip, top1_flip),
margin_jaccard.csv (layer, policy, soft_jaccard, jaccard, tokens; *_lo/*_hi; with --policies),
figures/margin_flips (flip rate against eps by layer), figures/margin_quantiles (margin percentiles by layer),
figures/margin_jaccard (soft Jaccard with each policy by layer) and manifest.json (definitions).

Examples:
  moetool margin
  moetool margin --model tiny-fine --eps 0.01,0.1 --thresholds 0.01,0.05 --max-tokens 4096
  moetool margin --policies norm:gate,random,topk:1
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...context import flag
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

DEFAULT_EPS = (0.001, 0.01, 0.05, 0.1)
DEFAULT_THRESHOLDS = (0.001, 0.01, 0.1)
#: policies compared with the router by default: none (each costs its own arithmetic on every token; norm:gate
#: every expert's gate: several forwards' worth on many-expert models); the demo compares norm:gate and random
DEFAULT_POLICIES: tuple[str, ...] = ()
DEMO_POLICIES = ("norm:gate", "random")


@dataclass(frozen=True)
class MarginOptions:
    """Options of :func:`~moetool.experiments.margin.compute.margin`, each with the flag of ``moetool margin`` that
    sets it."""

    eps: tuple[float, ...] = option(DEFAULT_EPS, "--eps", "Relative noise sizes on the router input, "
                                    "comma-separated.")  # relative noise sizes
    thresholds: tuple[float, ...] = option(DEFAULT_THRESHOLDS, "--thresholds", "Margin thresholds (increasing), "
                                           "comma-separated.")  # margin thresholds (and bin edges)
    layers: tuple[int, ...] | None = None  # MoE layers (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0
    policies: tuple[str, ...] = option(  # routing policy specs compared with the router (() = none)
        DEFAULT_POLICIES, "--policies", "Routing policies compared with the router (soft and plain top-N Jaccard), "
        "comma-separated, e.g. norm:gate,random; none = off.", kind="strs", shown="none")

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if not self.eps or any(not (math.isfinite(e) and e >= 0) for e in self.eps):
            raise MoetoolError(f"{flag('eps')} must be finite non-negative numbers, not {list(self.eps)}")
        if not self.thresholds or any(not (math.isfinite(t) and t > 0) for t in self.thresholds):
            raise MoetoolError(f"--thresholds must be finite positive numbers, not {list(self.thresholds)}")
        if list(self.thresholds) != sorted(set(self.thresholds)):
            raise MoetoolError(f"--thresholds must increase strictly, not {list(self.thresholds)}")
        fp32 = array("f", self.thresholds)  # margins are compared with the thresholds in fp32
        same = [(a, b) for a, b, x, y in zip(self.thresholds, self.thresholds[1:], fp32, fp32[1:]) if x == y]
        if same:
            raise MoetoolError(f"--thresholds {same[0][0]!r} and {same[0][1]!r} are one number in fp32, where margins "
                               "are compared with them: give thresholds that differ there")


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
                  demo=Demo(max_tokens=2048, options={"bootstrap": 200, "policies": DEMO_POLICIES}), bootstrap=True,
                  title="routing margin and flips under noise", summary_csv="margin_flips.csv",
                  order=90, captions=CAPTIONS)
