"""The spec of ``moetool super-experts`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

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
                  demo=Demo(models=("tiny",), max_tokens=2048), cmd=None, bootstrap=True,
                  title="super experts and perplexity without them", sample=("--bootstrap", "100"),
                  flags=(Flag("--percentile", "float", 99.5, "A super expert's maximum exceeds this percentile of every "
                              "(layer, expert) maximum."),
                         Flag("--fraction-of-max", "float", 0.1, "... and above the largest // (1 / this) (--max-rule "
                              "floordiv) or at least this x the largest (--max-rule fraction)."),
                         Flag("--max-rule", "str", "floordiv", "floordiv: > largest // (1 / --fraction-of-max), the paper's "
                              "code (largest // 10); fraction: >= --fraction-of-max x the largest."),
                         Flag("--include-layers", "float", 0.75, "Only the MoE layers of the first round(this x L) decoder "
                              "layers, as the paper's code; 1: every layer."),
                         Flag("--reading", "str", "routed", "routed: every routed token; first-row: per row, the first token "
                              "routed to the expert (what the paper's code's hook reads).")),
                  order=130, captions=CAPTIONS)
