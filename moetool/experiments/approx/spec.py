"""How well does a K-expert sum approximate the dense sum of all n experts?

Source: Su (2025), "MoE环游记：1、从几何意义出发" (MoE Travelogue 1: Starting from Geometric Meaning),
https://kexue.fm/archives/10699: MoE as the best K-term approximation of the dense sum.

Per MoE layer and real token all n experts run: u_e = π_e(h)·E_e(h),
y = Σ_e u_e. A selector picks K experts S; rel. error = ||y_S − y|| / ||y||.
Selectors (selection rules scored offline, not routing policies: the model
keeps its own routing): router (the model's own routing rule on its logits),
norm_oracle (TopK of ||u_e||, the paper's rule), best_subset (exhaustive over
all C(n,K) subsets, only where C(n,K) <= --max-subsets), random (seeded). The
model runs with its own router; all experts are computed on the side (about
n/K times an MoE layer's FLOPs: keep --max-tokens modest on big models).

Writes approx.csv (layer, selector, tokens, rel_error_mean (exact),
rel_error_median (streaming log-binned sketch: within 0.17% relative of the
exact median, memory flat in tokens); same_set_as_router: fraction of tokens whose
set equals the model's captured top-K), approx_layers.csv (layer,
spearman_prob_vs_norm: per-token Spearman across experts of π_e vs ||E_e(h)||,
averaged over tokens; mean_abs_cos: mean |cos(u_i, u_j)|, i≠j),
figures/approx_error, figures/approx_layers, manifest.json (every definition).

Examples:
  moetool approx --out runs/approx-tiny
  moetool approx --model tiny-fine --max-tokens 2048 --selectors router,random
  moetool approx --model mixtral-8x7b --device-map auto --max-tokens 512
"""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "approx_error": ("Per layer: mean relative error ||y_S − y|| / ||y|| of the k-term approximation, one line per "
                     "expert selector", ("approx.csv",), ("rel_error",)),
    "approx_layers": ("Per layer: Spearman correlation of the router's probability with the expert output norm "
                      "(left) and the mean |cos| between the u_e (right)", ("approx_layers.csv",),
                      ("spearman_prob_vs_norm", "mean_abs_cos")),
}

SPEC = experiment("approx", "approx", "ApproxOptions", figures="moetool.experiments.approx.figures:approx_figures",
                  demo=Demo(max_tokens=1024, options={"batch_size": 8}),
                  order=40,
                  defaults={"max_tokens": 4096, "batch_size": 4},
                  flags=(Flag("--selectors", "strs", "router,norm_oracle,best_subset,random", "Comma-separated selection "
                              "rules scored against the dense sum: router, norm_oracle, best_subset, random. They do not "
                              "change the routing (the model runs with its own router), so they are not --routing "
                              "policies."),
                         Flag("--max-subsets", "int", 10_000, "best_subset only in layers with C(n, K) at most this.",
                              min=1)), captions=CAPTIONS)
