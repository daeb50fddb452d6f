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

from dataclasses import dataclass
from typing import Sequence

from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

SELECTORS = ("router", "norm_oracle", "best_subset", "random")
MAX_SUBSETS = 10_000


def check_selectors(selectors: Sequence[str]) -> None:
    if not selectors:
        raise MoetoolError("--selectors needs at least one selector")
    unknown = [s for s in selectors if s not in SELECTORS]
    if unknown:
        raise MoetoolError(f"unknown selector(s) {unknown}; choose from {', '.join(SELECTORS)}")


@dataclass(frozen=True)
class ApproxOptions:
    """Options of :func:`~moetool.experiments.approx.compute.approx`. ``selectors`` are selection rules scored
    offline against the dense sum of all experts; they do not change the routing (the model runs with its own
    router), so they are not routing policies (``--routing`` elsewhere)."""

    selectors: tuple[str, ...] = option(SELECTORS, "--selectors", "Comma-separated selection rules scored against "
                                        "the dense sum: router, norm_oracle, best_subset, random. They do not change "
                                        "the routing (the model runs with its own router), so they are not --routing "
                                        "policies.")  # router | norm_oracle | best_subset | random
    max_subsets: int = option(MAX_SUBSETS, "--max-subsets", "best_subset only in layers with C(n, K) at most this.",
                              min=1)  # best_subset only in layers with C(n, K) at most this
    layers: tuple[int, ...] | None = None  # MoE layers analysed (None: every MoE layer)
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_selectors(self.selectors)
        if self.max_subsets < 1:
            raise MoetoolError(f"--max-subsets must be >= 1, got {self.max_subsets}")


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
                  captions=CAPTIONS)
