"""Routing agreement across precisions: the same tokens of --data through the model once per precision
(one model in memory at a time: loaded, run, freed), each run's routing compared token by token with the most
precise run of --precisions (the reference: fp32 > bf16/fp16 > fp8 > fp4/mxfp4, the first listed on a tie).

Precisions: fp32, bf16, fp16 load the model in that dtype (transformers' loading: modules a family keeps in fp32
stay fp32). fp8, fp4, mxfp4 are SIMULATED (on CPU and GPU alike; the manifest says so): the model loads in bf16, the
weights a real release stores in that format are quantized then dequantized with the format's own rules
(moetool.formats.fake_quantize: fp8 = e4m3 with one fp32 scale per 128x128 block; fp4 = e2m1 with one scale per 32
input values; mxfp4 = e2m1 with one E8M0 power-of-two scale per 32 input values, amax / 6 rounded up as
transformers' gpt-oss kernels round it, so nothing clips; OCP's floor rule would clip) and the forward runs in bf16.
Which weights: fp8, every linear weight and expert matrix except the embeddings, the LM head and the routers (the
DeepSeek-V3 / Kimi-K2 / Qwen3 / GLM-4.5 FP8 releases); fp4 and mxfp4, the routed experts only (gpt-oss MXFP4,
DeepSeek-V4-style FP4 experts). FP8 activations and kernels are not simulated.

Per precision and MoE layer, against the reference: top1_flip (share of real tokens whose top-1 expert -- the chosen
expert with the largest selection score -- differs), topk_flip (the chosen top-K set differs), the reference's
routing margin (K-th minus (K+1)-th selection score: mean, median) and the flip rates per margin bin (edges 0,
--thresholds, inf); per precision: the flips pooled over layers and the mean next-token NLL change (ΔNLL, paired
on the same tokens).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off).

Writes agreement.csv (precision, reference, layer, tokens, top1_flip, topk_flip, margin_mean, margin_p50;
*_lo/*_hi), agreement_summary.csv (precision, reference, simulated, tokens, layers, top1_flip, topk_flip,
nll_ref, nll, delta_nll; *_lo/*_hi), agreement_bins.csv (precision, layer, margin_lo, margin_hi, tokens, top1_flip,
topk_flip), figures/agreement_flips_by_layer (flip rates by layer, one line per precision), figures/agreement_margin
(flip rates against the reference margin, pooled over layers) and manifest.json (definitions, precisions: which
were simulated and which weights).

Examples:
  moetool agreement tiny --precisions fp32,bf16,fp8
  moetool agreement --model tiny-fine --precisions bf16,fp8,mxfp4 --max-tokens 4096
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

#: how precise each is (lower = more precise): the reference is the lowest of the list (its keys are
#: compute.py's PRECISIONS, in their order)
RANK = {"fp32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "fp4": 3, "mxfp4": 3}
DEFAULT_THRESHOLDS = (1e-4, 1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class AgreementOptions:
    """Options of :func:`~moetool.experiments.agreement.compute.agreement`, each with the flag of
    ``moetool agreement`` that sets it."""

    precisions: tuple[str, ...] = option(("fp32", "bf16", "fp8"), "--precisions", "Precisions compared, "
                                         "comma-separated: fp32, bf16, fp16, fp8, fp4, mxfp4 (the last three "
                                         "simulated).", short="-p")
    thresholds: tuple[float, ...] = option(DEFAULT_THRESHOLDS, "--thresholds", "Reference-margin bin edges "
                                           "(increasing), comma-separated.")  # reference-margin bin edges
    layers: tuple[int, ...] | None = None  # MoE layers (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0
    device: str = "auto"  # where models given by name are loaded
    device_map: str | None = None  # --device-map of every per-precision load ("auto": accelerate places the layers)

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        bad = [p for p in self.precisions if p not in RANK]
        if bad:
            raise MoetoolError(f"--precisions: unknown {bad} (choose from {', '.join(RANK)})")
        if len(self.precisions) < 2:
            raise MoetoolError(f"--precisions needs at least two precisions to compare, got {list(self.precisions)}")
        if not self.thresholds or any(not (math.isfinite(t) and t > 0) for t in self.thresholds):
            raise MoetoolError(f"--thresholds must be finite positive numbers, not {list(self.thresholds)}")
        if list(self.thresholds) != sorted(set(self.thresholds)):
            raise MoetoolError(f"--thresholds must increase strictly, not {list(self.thresholds)}")

    @property
    def reference(self) -> str:
        return reference_of(self.precisions)


def reference_of(precisions: Sequence[str]) -> str:
    """The most precise of ``precisions`` (the first listed on a tie)."""
    return min(precisions, key=lambda p: RANK[p])


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
                  order=100,
                  bootstrap=True, loads_model=False, dtype_flag="--precisions",
                  captions=CAPTIONS)
