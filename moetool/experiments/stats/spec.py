"""The spec of ``moetool stats`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "load_heatmap": ("Expert load relative to uniform routing (load_fraction × n), one row per layer and one column "
                     "per expert; 1 (white) is balanced, red above, blue below", ("load.csv",), ("load_fraction",)),
    "coactivation": ("P(b | a) per layer: of the tokens whose top-K contains expert a (row), the share whose top-K "
                     "also contains expert b (column); the title gives independent uniform routing's (K-1)/(n-1)",
                     ("coactivation.csv", "layers.csv"), ("coactivation",)),
    "balance_by_layer": ("Per layer: the largest expert load over uniform (left) and load entropy / log n (right); "
                         "1 is perfectly balanced; error bars: the bootstrap interval", ("layers.csv",),
                         ("max_load_ratio", "load_entropy", "*_lo/*_hi")),
    "domain_load": ("Per layer: the share of each domain's tokens routed to each expert (one bar per domain); "
                    "dashed: uniform routing's K/n", ("domain_load.csv",), ("domain_load",)),
    "specialization": ("Vocabulary specialisation per layer, one line per view (input token, next token, predicted "
                       "token): the share of a token's occurrences routed to its most frequent first-ranked expert",
                       ("specialization.csv",), ("specialization",)),
    "cross_layer": ("P(expert b at the next MoE layer | expert a at this one), one heatmap per pair of consecutive "
                    "layers, with their mutual information", ("cross_layer.csv", "cross_layer_summary.csv"),
                    ("cross_layer", "cross_layer_summary")),
}

#: the types a ``--resume`` unit checkpoint of this experiment may hold (:mod:`moetool.checkpoints`)
CHECKPOINT_TYPES = (
    "moetool.experiments.stats.compute.Collected",
    "moetool.experiments.stats.compute.RoutingStats",
    "moetool.experiments.stats.compute.LayerAccumulator",
    "moetool.experiments.specialization.VocabSpecialization",
    "moetool.experiments.specialization.CrossLayer",
    "moetool.experiments.specialization.LoadBalance",
)

SPEC = experiment("stats", "stats", "StatsOptions", figures="moetool.experiments.stats.figures:stats_figures",
                  demo=Demo(seq_len=256, max_tokens=8192, tokens={"add_special_tokens": None}),
                  order=10, captions=CAPTIONS, checkpoint_types=CHECKPOINT_TYPES)
