"""The spec of ``moetool placement`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "placement_imbalance": ("Per-GPU load imbalance (max / mean GPU load; summed over MoE layers, each waiting for "
                            "its busiest GPU) against the number of GPUs, one line per expert placement the legend "
                            "names: contiguous, round-robin, DeepSeek's EPLB with R = slots × G redundant replicas "
                            "(+r/GPU), and eplb_stale (EPLB fitted on a --reference, when one was given); dotted: "
                            "perfect balance; error bars: the bootstrap interval", ("placement_overall.csv",),
                            ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
    "placement_layers": ("Per MoE layer: per-GPU load imbalance at the largest number of GPUs below the number of "
                         "experts, one line per placement; dotted: perfect balance; error bars: the bootstrap "
                         "interval", ("placement.csv",), ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
}

SPEC = experiment("placement", "placement", "PlacementOptions", figures="moetool.experiments.placement.figures:placement_figures",
                  demo=Demo(max_tokens=4096),
                  order=140, captions=CAPTIONS)
