"""Expert importance and pruning: which experts matter, and perplexity as the least important are removed.

One pass of the model's own routing over --data measures, per MoE layer and expert, over the real tokens routed
to it: the routed frequency, the router-weighted frequency (the sum of the routing weights it gets) and the REAP
saliency (Lasby et al. 2025, arXiv 2510.13999: the mean of gate weight x ||expert output||_2; every expert's
output from batched probes in memory-bounded chunks). The gate weight, --reap-weights, as REAP's code
(CerebrasResearch/reap, src/reap/pruning_metrics.py update_pruning_state), with p the router's probabilities over
all experts: renormalised (default) p_e / the sum of p over the token's top-K, REAP's renormalize_router_weights
path (reap.layerwise_prune; reap.main when the config sets norm_topk_prob; REAP's README, 2026-03-11, calls it
correct); softmax: p_e, what reap.main uses on a config without norm_topk_prob (Mixtral). Then, per criterion (--criteria: frequency, weighted, reap,
random = a seeded permutation per layer) and fraction (--fractions), floor(fraction x n) experts of each MoE layer
(--layers) with the lowest value are removed: masked out of the top-K (the model's choice among the rest, weights
as its rule gives them, renormalised where it renormalises), and the model runs on the same rows. Last, each of
the --ablate experts with the largest REAP saliency is removed alone. With --tasks, the router and every
(criterion, fraction) also run lm-eval under the same pruning (as norm-select does): accuracy, and its retention
against the router's (delta method on lm-eval's standard errors). A fraction above 0 that removes no expert in any
layer (floor(fraction x n) = 0) is refused before any forward; 0 is the model with nothing removed.
The same pruning works in ppl, eval, trace and norm-select: --routing prune:reap:0.25:<prune_importance.csv>,
prune:random:0.25, prune:file:<removed.json|csv> (prune_removed.csv of this command with :<criterion>:<fraction>).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes prune_importance.csv (layer, expert, tokens, frequency, weighted, reap),
prune.csv (criterion, fraction, removed, removed_frac, tokens, perplexity, ratio; *_lo/*_hi; the router first),
prune_removed.csv (criterion, fraction, layer, expert: every removed set; not with --fractions 0 alone),
prune_ablation.csv (rank, layer, expert, reap, frequency, tokens, perplexity, delta_ppl, ratio; *_lo/*_hi; not with
--ablate 0),
figures/prune_curve (perplexity / the model's vs fraction removed, one line per criterion),
figures/prune_importance (REAP saliency per layer and expert), figures/prune_ablation (perplexity / the model's
for each single-expert ablation; not with --ablate 0) and manifest.json (definitions; not_written: the tables left
out and why); with --tasks also
prune_eval.csv (criterion, fraction, task, metric, value, stderr, value_lo/hi, router_value, retention,
retention_lo/hi; the router first) and figures/prune_accuracy (accuracy retention vs fraction removed, one line per
criterion, one panel per task).
--tasks: see `moetool eval --help` (shipped offline tasks: moetool_code, moetool_prose).

Examples:
  moetool prune
  moetool prune --model tiny-fine --fractions 0.25,0.5 --criteria reap,random --ablate 4 --max-tokens 4096
  moetool prune --reap-weights softmax --ablate 0
  moetool prune --criteria reap,random --tasks moetool_code,moetool_prose --limit 60
"""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

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
                  order=120,
                  groups=("lmeval",), bootstrap=True, title="perplexity with experts removed", summary_csv="prune.csv",
                  flags=(Flag("--fractions", "floats", "0.125,0.25,0.5", "Fractions of each MoE layer's experts removed, "
                              "comma-separated."),
                         Flag("--criteria", "strs", "frequency,weighted,reap,random", "Importance criteria, "
                              "comma-separated: frequency, weighted, reap, random."),
                         Flag("--ablate", "int", 8, "Single-expert ablations of the experts with the largest REAP saliency "
                              "(0: none)."),
                         Flag("--reap-weights", "str", "renormalised", "REAP's gate weight: renormalised (p over the sum "
                              "of the top-K's p, REAP's README) or softmax (p, reap.main on Mixtral)."),
                         Flag("--tasks", "strs", None, "lm-eval tasks (comma list) run under every pruning; default: "
                              "perplexity only.", short="-t")), captions=CAPTIONS)
