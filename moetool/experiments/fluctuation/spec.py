"""The spec of ``moetool fluctuation`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, PAIRS, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "fluctuation_by_layer": ("Per layer: the share of tokens whose top-1 expert changes between the two "
                             "checkpoints, one panel per checkpoint pair, one line per routing",
                             ("fluctuation.csv",), ("top1_change", "routing")),
    "entropy_ratio_by_layer": ("Per layer: routing entropy at the checkpoint over the reference's, one panel per "
                               "checkpoint pair, one line per routing", ("fluctuation.csv",),
                               ("entropy_ratio", "routing")),
    "entropy_vs_router_by_layer": ("Per layer: each routing's entropy over the router's at the same checkpoint",
                                   ("fluctuation.csv",), ("entropy_ref/entropy_ckpt", "routing")),
}

SPEC = experiment("fluctuation", "fluctuation", "FluctuationOptions", inputs="checkpoints",
                  figures="moetool.experiments.fluctuation.figures:fluctuation_figures", demo=Demo(models=PAIRS, options={"isolate": True}),
                  order=70, captions=CAPTIONS)
