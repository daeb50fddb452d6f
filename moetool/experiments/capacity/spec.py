"""The spec of ``moetool capacity`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "capacity_curve": ("Expert capacity C = ceil(cf · tokens · K / n) per batch and MoE layer: the share of the "
                       "model's assignments beyond capacity (left) and perplexity relative to the model's own "
                       "routing on the same rows with them dropped (right) against cf, one line per drop order; "
                       "error bars: the paired bootstrap interval; dotted: no change (ratio 1)", ("capacity.csv",),
                       ("cf", "order", "dropped_frac", "ratio", "*_lo/*_hi")),
    "capacity_layers": ("The share of assignments beyond expert capacity in each MoE layer, one line per capacity "
                        "factor and drop order", ("capacity_layers.csv",), ("cf", "dropped_frac")),
}

SPEC = experiment("capacity", "capacity", "CapacityOptions", figures="moetool.experiments.capacity.figures:capacity_figures",
                  demo=Demo(max_tokens=2048, options={"cfs": (0.5, 1.0, 2.0), "orders": ("order", "score")}), cmd=None,
                  bootstrap=True, title="capacity factor, dropped assignments and perplexity",
                  flags=(Flag("--cf", "floats", "0.5,1,1.25,1.5,2", "Capacity factors, comma-separated (inf allowed).",
                              field="cfs"),
                         Flag("--order", "strs", "order", "Which assignments an expert keeps: order (the first in token "
                              "order), score (the highest routing weight), or both: order,score.", field="orders")),
                  order=110, captions=CAPTIONS)
