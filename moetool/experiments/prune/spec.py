"""The spec of ``moetool prune`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "prune_curve": ("Perplexity relative to the model's own routing on the same rows against the fraction of each "
                    "MoE layer's experts removed (masked out of the top-K), the least important first by each "
                    "criterion, or a seeded random set; the star is the model; error bars: the paired bootstrap "
                    "interval", ("prune.csv",), ("fraction", "ratio", "criterion", "*_lo/*_hi")),
    "prune_importance": ("REAP saliency of each expert (one row per MoE layer): the mean over the tokens routed to "
                         "it of routing weight times the norm of its output", ("prune_importance.csv",), ("reap",)),
    "prune_ablation": ("Perplexity relative to the model's own routing when one expert alone is removed, for the "
                       "experts with the largest REAP saliency; error bars: the paired bootstrap interval",
                       ("prune_ablation.csv",), ("ratio", "rank", "*_lo/*_hi")),
    "prune_accuracy": ("lm-eval accuracy relative to the model's own routing (retention) against the fraction of "
                       "each MoE layer's experts removed, one line per criterion, one panel per task; the star is "
                       "the model; error bars: the delta-method interval on lm-eval's standard errors",
                       ("prune_eval.csv",), ("fraction", "retention", "criterion", "retention_lo", "retention_hi")),
}

SPEC = experiment("prune", "prune", "PruneOptions", figures="moetool.experiments.prune.figures:prune_figures",
                  demo=Demo(models=("tiny",), max_tokens=2048, options={"fractions": (0.25, 0.5), "ablate": 4}),
                  order=120, captions=CAPTIONS)
