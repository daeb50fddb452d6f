"""The spec of ``moetool agreement`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "agreement_flips_by_layer": ("Share of real tokens whose chosen top-K set (left) or top-1 expert (right) differs from "
                           "the reference run's (the most precise of the list) on the same tokens, by MoE layer, one "
                           "line per precision (fp8/fp4/mxfp4 simulated by quantize-dequantize of the weights, run "
                           "in bf16); error bars: the bootstrap interval", ("agreement.csv",),
                           ("precision", "reference", "topk_flip", "top1_flip", "*_lo/*_hi")),
    "agreement_margin": ("The same flip rates per bin of the reference run's top-K routing margin (K-th minus "
                         "(K+1)-th selection score; the top-1 panel is binned by this top-K margin too), pooled "
                         "over MoE layers (tokens-weighted), one line per precision; empty bins left out", ("agreement_bins.csv",),
                         ("margin_lo", "margin_hi", "agreement_bins.topk_flip", "agreement_bins.top1_flip")),
}

SPEC = experiment("agreement", "agreement", "AgreementOptions", figures="moetool.experiments.agreement.figures:agreement_figures",
                  demo=Demo(max_tokens=2048, options={"precisions": ("fp32", "bf16", "fp8"), "bootstrap": 200}),
                  order=100, captions=CAPTIONS)
