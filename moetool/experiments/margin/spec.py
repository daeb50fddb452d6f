"""The spec of ``moetool margin`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

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
                  demo=Demo(max_tokens=2048, options={"bootstrap": 200}), cmd=None, bootstrap=True,
                  title="routing margin and flips under noise", summary_csv="margin_flips.csv",
                  flags=(Flag("--eps", "floats", "0.001,0.01,0.05,0.1", "Relative noise sizes on the router input, "
                              "comma-separated."),
                         Flag("--thresholds", "floats", "0.001,0.01,0.1", "Margin thresholds (increasing), comma-separated."),
                         Flag("--policies", "strs", "norm:gate,random", "Routing policies compared with the router (soft and "
                              "plain top-N Jaccard), comma-separated; none = off.")),
                  order=90, captions=CAPTIONS)
