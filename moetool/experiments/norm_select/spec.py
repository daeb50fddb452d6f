"""Remove the router: the K experts with the largest norm of a node run (AoE, Table 1).

Source: Lv et al. (2025), "Autonomy-of-Experts Models", ICML 2025, arXiv 2501.13074 (Table 1: the
training-free pilot on Mixtral 8x7B).

Sweeps the router baseline and norm:<node>:<norm> for every --nodes and --norm. Per policy:
agreement with the router per layer (mean |TopK_policy ∩ TopK_router|/K and top-1 agreement over
real tokens; TopK_router is the model's own choice for the hidden state reached under the policy),
perplexity on --data and its ratio to the router's, optional lm-eval accuracy (--tasks) and
retention = accuracy / router accuracy, and wall time. Writes agreement.csv (layer, policy,
topk_overlap, top1_agree, tokens), quality.csv (policy, task, metric, value, router_value, ratio,
seconds; perplexity rows have task = the data name), figures/retention and
figures/agreement_by_layer, manifest.json, and prints a Table-1-shaped summary, one row per policy: ppl and
ppl ratio (quality.csv's perplexity value and ratio), top-K overlap and top-1 agree (agreement.csv's
topk_overlap and top1_agree, token-weighted over the layers), <task> acc and <task> retention (quality.csv's
value and ratio: fractions, 0.948 for the paper's 94.8%), seconds (perplexity plus lm-eval). Every value has a
95% interval (*_lo/*_hi; ± or [lo, hi] in the tables; error bars): document-level bootstrap over packed rows
for agreement and perplexity (--bootstrap N, 0 = off), Wilson's interval for an accuracy (inside
[0, 1]; lm-eval's standard error beside it) and MOVER-R for retention (Fieller's interval from the two
accuracies' Wilson intervals, honest at an accuracy of 0 or 1). With lm-eval tasks
scored by acc it also prints and writes aoe_table1.csv: AoE Table 1's layout (router and best node
per task), the paper's published Mixtral 8x7B numbers (MMLU 70.35% -> 66.66% = 94.8%, ARC-C 62.12% ->
58.79% = 94.6%) as fractions (0.7035, as in quality.csv) beside the measured ones; for other models the
measured columns only.
--tasks: see `moetool eval --help` (shipped offline tasks: moetool_code, moetool_prose).

Examples:
  moetool norm-select --max-tokens 4096
  moetool norm-select --nodes gate,output --norm l1,l2 --tasks moetool_code,moetool_prose --limit 60
  moetool norm-select --model mixtral-8x7b --tasks mmlu,arc_challenge --num-fewshot 5 --device-map auto
  moetool norm-select --prune random:0.25     # on a model with a quarter of each layer's experts removed

--prune <criterion>:<fraction>[:<csv>]: every row is on the pruned model: "router" is the model's router
among the kept experts, each norm policy picks the K largest norms among them, agreement is with the
pruned router (criteria and files as the prune: policy, see `moetool prune --help`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ...defaults import DEFAULT_BOOTSTRAP, FEWSHOT_SEED
from ..experiment import Demo, experiment, option


def sweep_specs(nodes: Iterable[str], norms: Iterable[str] = ("l2",)) -> list[str]:
    """``router`` plus ``norm:<node>:<norm>`` for every node and norm."""
    return ["router"] + [f"norm:{node}:{norm}" for norm in norms for node in nodes]


@dataclass(frozen=True)
class NormSelectOptions:
    """Options of :func:`~moetool.experiments.norm_select.compute.norm_select`, each with the flag of
    ``moetool norm-select`` that sets it (``--weights``, ``--layers``, ``--bootstrap``, ``--seed``, ``--batch-size``
    and the lm-eval flags: the standard flag groups)."""

    # probe nodes swept (norm:<node>:<norm> for each): moetool.engine.probes.NODES, spelled out to keep spec.py
    # torch-free (--nodes all parses to NODES: tests/test_generated.py checks the flag and this default agree)
    nodes: tuple[str, ...] = option(("gate", "up", "act", "glu", "output"), "--nodes",
                                    "Comma list of gate,up,act,glu,output or 'all'.", kind="str", shown="all",
                                    parse="moetool.experiments.norm_select.compute:parse_nodes")
    norms: tuple[str, ...] = option(("l2",), "--norm", "l2|l1|linf, or a comma list to sweep several.", kind="str",
                                    shown="l2", parse="moetool.experiments.norm_select.compute:parse_norms")  # norms swept
    weights: str = "softmax"  # weights of the chosen experts: softmax | router | uniform
    layers: tuple[int, ...] | None = None  # MoE layers whose routing is replaced (None: every MoE layer)
    tasks: tuple[str, ...] | None = option(None, "--tasks", "lm-eval tasks (comma list); default: perplexity only.",
                                           kind="strs", short="-t")  # lm-eval tasks (None: perplexity only)
    num_fewshot: int | None = None
    limit: int | None = None
    include_path: str | None = None
    fewshot_seed: int = FEWSHOT_SEED  # lm-eval's few-shot sampler seed (lm-eval's own default)
    batch_size: int = 8
    seed: int = 0
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap (0 = no intervals)
    # run on the pruned model: a prune:<criterion>:<fraction>[:<csv>] policy spec
    prune: str | None = option(None, "--prune", "Run on the pruned model: <criterion>:<fraction>[:<prune_importance"
                               ".csv>] or file:<removed.json|csv> (as the prune: policy; see moetool prune). The router "
                               "baseline routes among the kept experts and every norm policy chooses among them.",
                               kind="str")

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if self.prune is not None and not self.prune.startswith("prune:"):
            object.__setattr__(self, "prune", "prune:" + self.prune)

    def specs(self) -> list[str]:
        return sweep_specs(self.nodes, self.norms)


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "retention": ("Each routing policy against the router: perplexity ratio (left, lower is better) and accuracy "
                  "retention per task (right, when tasks were evaluated); error bars: the bootstrap interval (left) "
                  "and the MOVER-R interval from the two accuracies' Wilson intervals (right)",
                  ("quality.csv",), ("ratio", "value", "*_lo/*_hi")),
    "agreement_by_layer": ("Per layer: top-K overlap (left) and top-1 agreement (right) of each policy's expert "
                           "choice with the router's", ("agreement.csv",), ("topk_overlap", "top1_agree")),
}

SPEC = experiment("norm-select", "norm_select", "NormSelectOptions", figures="moetool.experiments.norm_select.figures:norm_select_figures",
                  demo=Demo(models=("tiny",), max_tokens=2048, options={"limit": 20, "batch_size": 16},
                            options_from="moetool.experiments.norm_select.compute:demo_options"),
                  order=20,
                  groups=("weights", "lmeval", "resume"), bootstrap=True,
                  captions=CAPTIONS)
