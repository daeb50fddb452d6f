"""The spec of ``moetool mass-recall`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "mass_recall_vs_shortlist": ("Per layer: mean mass recall against the shortlist size M, one line per codebook",
                                 ("mass_recall.csv",), ("mass_recall_mean", "codebook", "centroids")),
    "mass_recall_vs_router_flops": ("Per layer: mean mass recall against the router FLOPs spent (fraction of the "
                                    "full router's), one line per codebook", ("mass_recall.csv",),
                                    ("mass_recall_mean", "router_flops_frac")),
    "mass_recall_vs_bounds": ("Per layer, largest codebook: measured mass recall beside the paper's lower bound "
                              "and the scale-aware bound (log scale)", ("mass_recall.csv",),
                              ("mass_recall_mean", "bound_mean", "bound_scaled_mean")),
}

SPEC = experiment("mass-recall", "mass_recall", "MassRecallOptions", figures="moetool.experiments.mass_recall.figures:mass_recall_figures",
                  demo=Demo(max_tokens=4096, options={"codebook_sizes": (8, 32), "kmeans_iters": 1}),
                  order=50, captions=CAPTIONS)
