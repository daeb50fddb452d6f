"""Expert importance and pruning: which experts matter, and perplexity as the least important are removed.

One pass of the model's own routing over --data measures, per MoE layer and expert, over the real tokens routed
to it: the routed frequency, the router-weighted frequency (the sum of the routing weights it gets) and the REAP
saliency (Lasby et al. 2025, arXiv 2510.13999: the mean of gate weight x ||expert output||_2; every expert's
output from batched probes in memory-bounded chunks). The gate weight, --reap-weights, as REAP's code
(CerebrasResearch/reap, src/reap/pruning_metrics.py update_pruning_state), with p the router's probabilities over
all experts: renormalised (default) p_e / the sum of p over the token's top-K, REAP's renormalize_router_weights
path (reap.layerwise_prune; reap.main when the config sets norm_topk_prob; REAP's README, 2026-03-11, calls it
correct); softmax: p_e, what reap.main uses on a config without norm_topk_prob (Mixtral). Then, per criterion (--criteria: frequency, weighted, reap,
random = a seeded permutation per layer) and fraction (--fractions), floor(fraction x n) of the n computed experts
of each MoE layer (--layers) with the lowest value are removed as REAP's prune.py deletes them (their router rows gone: the
model's choice among the rest, a softmax over the kept experts only, weights as its rule gives them, renormalised
where it renormalises), and the model runs on the same rows. Last, each of
the --ablate experts with the largest REAP saliency is removed alone. With --tasks, the router and every
(criterion, fraction) also run lm-eval under the same pruning (as norm-select does): accuracy, and its retention
against the router's (MOVER-R interval from the two accuracies' Wilson intervals). A fraction above 0 that removes
no expert in any layer (floor(fraction x n) = 0) is refused before any forward; 0 is the model with nothing removed.
Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip expert) cost nothing to keep and have no
output of their own: they are not measured, counted in n, removed or ablated (the router still routes to them).
The same pruning works in ppl, eval and trace: --routing prune:reap:0.25:<prune_importance.csv>,
prune:random:0.25, prune:file:<removed.json|csv> (prune_removed.csv of this command with :<criterion>:<fraction>);
and in norm-select as --prune reap:0.25:<prune_importance.csv>.
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes prune_importance.csv (layer, expert, layer_tokens, frequency, weighted, reap),
prune.csv (criterion, fraction, removed, removed_frac, scored_tokens, perplexity, ratio; *_lo/*_hi; the router first),
prune_removed.csv (criterion, fraction, layer, expert: every removed set; not with --fractions 0 alone),
prune_ablation.csv (rank, layer, expert, reap, frequency, scored_tokens, perplexity, delta_ppl, ratio; *_lo/*_hi;
not with --ablate 0),
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

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP, FEWSHOT_SEED
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

DEFAULT_FRACTIONS = (0.125, 0.25, 0.5)
REAP_WEIGHTS = ("renormalised", "softmax")


@dataclass(frozen=True)
class PruneOptions:
    """Options of :func:`~moetool.experiments.prune.compute.prune`, each with the flag of ``moetool prune`` that
    sets it (``--layers``, ``--batch-size``, ``--bootstrap``, ``--seed`` and the lm-eval flags: the standard flag
    groups)."""

    fractions: tuple[float, ...] = option(DEFAULT_FRACTIONS, "--fractions", "Fractions of each MoE layer's experts "
                                          "removed, comma-separated.")  # fractions of each layer's experts removed
    # frequency | weighted | reap | random: moetool.policies.prune.CRITERIA, spelled out to keep spec.py torch-free
    # (__post_init__ refuses any other)
    criteria: tuple[str, ...] = option(("frequency", "weighted", "reap", "random"), "--criteria", "Importance "
                                       "criteria, comma-separated: frequency, weighted, reap, random.")
    # single-expert ablations of the experts with the largest REAP saliency (0: none)
    ablate: int = option(8, "--ablate", "Single-expert ablations of the experts with the largest REAP saliency "
                         "(0: none; at most every expert of the layers measured, the manifest's 'ablations').")
    # REAP's gate weight: renormalised (pi over the top-K's sum) | softmax (pi)
    reap_weights: str = option("renormalised", "--reap-weights", "REAP's gate weight: renormalised (p over the sum "
                               "of the top-K's p, REAP's README) or softmax (p, reap.main on Mixtral).")
    layers: tuple[int, ...] | None = None  # MoE layers measured and pruned (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0  # the random criterion's permutations and the bootstrap
    # lm-eval tasks run under every policy (None: perplexity only)
    tasks: tuple[str, ...] | None = option(None, "--tasks", "lm-eval tasks (comma list) run under every pruning; "
                                           "default: perplexity only.", kind="strs", short="-t")
    num_fewshot: int | None = None  # few-shot examples per item (None: the task's own)
    limit: int | None = None  # at most this many items per task (None: all)
    include_path: str | None = None  # folder of extra lm-eval task YAMLs
    fewshot_seed: int = FEWSHOT_SEED  # lm-eval's few-shot sampler seed (lm-eval's own default)

    def __post_init__(self) -> None:
        from ...policies.prune import CRITERIA
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if not self.fractions or any(not 0.0 <= f < 1.0 for f in self.fractions):
            raise MoetoolError(f"--fractions must lie in [0, 1), not {list(self.fractions)}")
        bad = [c for c in self.criteria if c not in CRITERIA]
        if bad or not self.criteria:
            raise MoetoolError(f"--criteria must be some of {', '.join(CRITERIA)}, not {list(self.criteria)}")
        if self.ablate < 0:
            raise MoetoolError(f"--ablate must be at least 0, not {self.ablate}")
        if self.reap_weights not in REAP_WEIGHTS:
            raise MoetoolError(f"--reap-weights must be one of {', '.join(REAP_WEIGHTS)}, not {self.reap_weights!r}")


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "prune_curve": ("Perplexity relative to the model's own routing on the same rows against the fraction of each "
                    "MoE layer's experts removed (their router rows deleted), the least important first by each "
                    "criterion, or a seeded random set; the star is the model; error bars: the paired bootstrap "
                    "interval", ("prune.csv",), ("fraction", "ratio", "criterion", "*_lo/*_hi")),
    "prune_importance": ("REAP saliency of each expert (one row per MoE layer): the mean over the tokens routed to "
                         "it of routing weight times the norm of its output", ("prune_importance.csv",), ("reap",)),
    "prune_ablation": ("Perplexity relative to the model's own routing when one expert alone is removed, for the "
                       "experts with the largest REAP saliency; error bars: the paired bootstrap interval",
                       ("prune_ablation.csv",), ("ratio", "rank", "*_lo/*_hi")),
    "prune_accuracy": ("lm-eval accuracy relative to the model's own routing (retention) against the fraction of "
                       "each MoE layer's experts removed, one line per criterion, one panel per task; the star is "
                       "the model; error bars: the MOVER-R interval from the two accuracies' Wilson intervals",
                       ("prune_eval.csv",), ("fraction", "retention", "criterion", "retention_lo", "retention_hi")),
}

SPEC = experiment("prune", "prune", "PruneOptions", figures="moetool.experiments.prune.figures:prune_figures",
                  demo=Demo(models=("tiny",), max_tokens=2048, options={"fractions": (0.25, 0.5), "ablate": 4}),
                  order=120,
                  groups=("lmeval",), bootstrap=True, title="perplexity with experts removed", summary_csv="prune.csv",
                  captions=CAPTIONS)
