"""Super Experts: the experts whose down projection makes extreme outputs, and what removing them costs.

One pass of the model's own routing over --data measures, per MoE layer and expert, the largest |output| of its down
projection (every expert's output from batched probes in memory-bounded chunks; a running max). Super Experts (Su
et al. 2025, "Unveiling Super Experts in Mixture-of-Experts Large Language Models", arXiv 2507.23279), by default
the rule of the paper's code (ZunhaiSu/Super-Experts-Profilling eval_utils.py, _super_experts_analysis and
_identify_super_experts): among the MoE layers of the first round(0.75 L) decoder layers (--include-layers 0.75; L
the model's decoder layers; 1 = every layer), an expert whose maximum is above the --percentile (99.5) percentile of
every (layer, expert) maximum (numpy's linear interpolation) and above max // 10 (--max-rule floordiv, floor
division by 1 / --fraction-of-max, as the code's `np.max(output_max_values) // times`; --max-rule fraction: at
least --fraction-of-max x the largest). --reading routed (default) reads every real token routed to the expert;
--reading first-row reads what the public code's hook reads: output[0] of each down-projection call, the first
token routed to the expert in each row (in the order transformers' expert loop gathers them: the tokens that hold it
as their first choice, in position order, then those that hold it second, ...), a max over the rows. With at most
201 maxima the 99.5th percentile lies above the second largest: the rule can pick the single largest only, and the
table says so (degenerate). Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip experts) have
no down projection: they are not measured, not among the maxima and never removed. Then the model runs on the same
rows with the super experts removed (their router rows deleted, as prune's policy) and with as many random other
computed experts removed in each layer (seeded by --seed).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes super_experts.csv (layer, expert, routed, max_abs_output, share_of_max, rank, is_super, threshold,
can_pass, degenerate), super_experts_ablation.csv (ablation: none|super|random, removed, experts, scored_tokens,
perplexity, delta_ppl, ratio; *_lo/*_hi), figures/super_experts_heatmap (max |output| per layer and expert, the
super experts boxed), figures/super_experts_ranked (every maximum by rank, with the threshold) and manifest.json
(definitions, criterion).

Examples:
  moetool super-experts
  moetool super-experts --reading first-row
  moetool super-experts --model tiny-fine --max-tokens 4096 --include-layers 1 --max-rule fraction --percentile 99
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

MAX_RULES = ("floordiv", "fraction")
READINGS = ("routed", "first-row")


@dataclass(frozen=True)
class SuperExpertsOptions:
    """Options of :func:`~moetool.experiments.super_experts.compute.super_experts`, each with the flag of
    ``moetool super-experts`` that sets it."""

    # a super expert's maximum exceeds this percentile of all (layer, expert) maxima
    percentile: float = option(99.5, "--percentile", "A super expert's maximum exceeds this percentile of every "
                               "(layer, expert) maximum.")
    # ... and the largest // (1 / this) (max_rule floordiv) or this x the largest
    fraction_of_max: float = option(0.1, "--fraction-of-max", "... and above the largest // (1 / this) (--max-rule "
                                    "floordiv) or at least this x the largest (--max-rule fraction).")
    # floordiv: > largest // (1 / fraction_of_max), the code's; fraction: >= f x largest
    max_rule: str = option("floordiv", "--max-rule", "floordiv: > largest // (1 / --fraction-of-max), the paper's "
                           "code (largest // 10); fraction: >= --fraction-of-max x the largest.")
    # the MoE layers of the first round(include_layers x L) decoder layers (1: all)
    include_layers: float = option(0.75, "--include-layers", "Only the MoE layers of the first round(this x L) "
                                   "decoder layers, as the paper's code; 1: every layer.")
    # routed: every routed token; first-row: the first routed token per row (the code's)
    reading: str = option("routed", "--reading", "routed: every routed token; first-row: per row, the first token "
                          "routed to the expert (what the paper's code's hook reads).")
    layers: tuple[int, ...] | None = None  # MoE layers measured and ablated (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0  # the random ablation's permutations and the bootstrap

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if not 0.0 <= self.percentile < 100.0:
            raise MoetoolError(f"--percentile must lie in [0, 100), not {self.percentile:g}")
        if not 0.0 <= self.fraction_of_max <= 1.0:
            raise MoetoolError(f"--fraction-of-max must lie in [0, 1], not {self.fraction_of_max:g}")
        if self.max_rule not in MAX_RULES:
            raise MoetoolError(f"--max-rule must be one of {', '.join(MAX_RULES)}, not {self.max_rule!r}")
        if self.reading not in READINGS:
            raise MoetoolError(f"--reading must be one of {', '.join(READINGS)}, not {self.reading!r}")
        if not 0.0 < self.include_layers <= 1.0:
            raise MoetoolError(f"--include-layers must lie in (0, 1], not {self.include_layers:g}")


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "super_experts_heatmap": ("Largest |output| of each expert's down projection over the tokens routed to it and "
                              "its output dimensions (log scale; one row per MoE layer); the super experts boxed",
                              ("super_experts.csv",), ("max_abs_output", "is_super")),
    "super_experts_ranked": ("Every (layer, expert) maximum |output| of the down projection, largest first (log "
                             "scale when the values span a decade or more); red: the super experts; dashed: the "
                             "threshold they pass",
                             ("super_experts.csv",), ("max_abs_output", "rank", "is_super", "threshold")),
}

SPEC = experiment("super-experts", "super_experts", "SuperExpertsOptions", figures="moetool.experiments.super_experts.figures:super_experts_figures",
                  demo=Demo(models=("tiny",), max_tokens=2048), bootstrap=True,
                  title="super experts and perplexity without them", sample=("--bootstrap", "100"),
                  order=130, captions=CAPTIONS)
