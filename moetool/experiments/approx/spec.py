"""The spec of ``moetool approx`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

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
                  order=40, captions=CAPTIONS)
