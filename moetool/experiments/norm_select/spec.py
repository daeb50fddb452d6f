"""The spec of ``moetool norm-select`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "retention": ("Each routing policy against the router: perplexity ratio (left, lower is better) and accuracy "
                  "retention per task (right, when tasks were evaluated); error bars: the bootstrap interval",
                  ("quality.csv",), ("ratio", "value", "*_lo/*_hi")),
    "agreement_by_layer": ("Per layer: top-K overlap (left) and top-1 agreement (right) of each policy's expert "
                           "choice with the router's", ("agreement.csv",), ("topk_overlap", "top1_agree")),
}

SPEC = experiment("norm-select", "norm_select", "NormSelectOptions", figures="moetool.experiments.norm_select.figures:norm_select_figures",
                  demo=Demo(models=("tiny",), seq_len=256, max_tokens=2048, options={"limit": 20, "batch_size": 16},
                            options_from="moetool.experiments.norm_select.compute:demo_options"),
                  order=20, captions=CAPTIONS)
