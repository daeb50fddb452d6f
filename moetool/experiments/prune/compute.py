"""``prune``: expert importance, and perplexity as experts are removed (issue: interventions, expert pruning).

One pass of the model's own routing over the data measures, per (MoE layer, expert), over the real tokens whose
top-K holds the expert: how many (``frequency``), the sum of the routing weights they give it (``weighted``), and
the REAP saliency (Lasby et al. 2025, "REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression",
arXiv 2510.13999, Eq. 9): the mean over those tokens of the gate weight times the L2 norm of the expert's output
``||E_e(h)||`` (all experts' outputs from the engine's batched probes, in memory-bounded token chunks;
:func:`moetool.engine.probes.node_scores`). The gate weight (``reap_weights``), as REAP's code
(CerebrasResearch/reap @ 1970473, ``src/reap/pruning_metrics.py`` ``update_pruning_state``: ``routing_weights =
F.softmax(router_logits)``, divided by its sum over the token's top-K when ``renormalize_router_weights``) with
``π`` the router's distribution over the n experts (``RoutingEvent.probs``; the softmax of the logits for softmax
routers): ``renormalised`` (default) ``π_e / Σ_{k in top-K} π_k`` -- REAP's README (2026-03-11) calls it correct,
``reap.layerwise_prune`` always uses it, ``reap.main`` when the config sets ``norm_topk_prob`` (Qwen3-MoE, not
Mixtral); ``softmax``: ``π_e`` -- what ``reap.main`` uses on a config without ``norm_topk_prob`` (Mixtral). The
router-weighted frequency (``weighted``) sums what the model multiplies the expert's output by (renormalised where
its rule renormalises, times DeepSeek's scaling factor, the same for every expert of a layer).

Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip: ``layer.n_zero_compute``, the last
indices) have no output of their own and cost nothing to keep (an identity expert's REAP would be ``||h||``, hundreds
of times a tiny model's expert outputs; a skip's 0): they are not measured, counted in n, removed or ablated.

Then per criterion (and a seeded random one) and fraction, the ``⌊fraction · n⌋`` least important computed experts
of every chosen MoE layer are removed (:class:`moetool.policies.prune.PrunePolicy`: their router rows deleted) and the model
runs on the same rows: perplexity with the paired ratio to the model's own routing (document-level bootstrap).
Last, single-expert ablations: each of the ``ablate`` experts with the largest REAP saliency removed alone.
With lm-eval tasks (``tasks``), the router and every (criterion, fraction) policy also run the tasks (as
``norm-select`` does: :func:`moetool.experiments.eval.compute.evaluate`, rows by
:func:`moetool.experiments.norm_select.compute.eval_rows`): accuracy and its retention against the fraction removed.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import distributed, ops
from ...data import require_tokens
from ...adapters import quant
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.probes import DEFAULT_BUDGET, node_scores
from ...errors import MoetoolError
from ...policies import build_policy
from ...policies.base import number_text
from ...policies.prune import PrunePolicy, lowest, n_removed, random_removed
from ...uncertainty import RowTable, bootstrap_meta, format_ci, fraction_text, with_ci
from ..eval import compute as lmeval  # as a module: its functions are looked up when called (tests stand in for lm-eval)
from ..norm_select.compute import RETENTION_INTERVAL, eval_rows
from ..routing import SCORED_TOKENS, data_name, perplexity, ppl_columns, zero_computation_meta
from ..result import Result, resolve_options
from .spec import REAP_WEIGHTS, PruneOptions  # its options (declared with their flags in spec.py)

MEASURED = ("frequency", "weighted", "reap")  # the criteria measured on data (random is not)

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "expert": "expert index within the layer",
    "layer_tokens": "real (unpadded) tokens the layer routed, the same on every expert row of the layer (the "
                    "denominator of frequency; prune_importance.csv)",
    "scored_tokens": SCORED_TOKENS,
    "frequency": "routed frequency: real tokens whose top-K (the model's own routing) holds the expert",
    "weighted": "router-weighted frequency: the sum over those tokens of the routing weight the expert gets (what "
                "the model multiplies its output by: renormalised where the rule renormalises, times the scaling "
                "factor)",
    "reap": "REAP saliency (Lasby et al. 2025, arXiv 2510.13999, Eq. 9): the mean over those tokens of gate weight "
            "x ||E_e(h)||_2 (the expert's output before any weight); 0 for an expert never routed. Gate weight "
            "(reap_weights, as CerebrasResearch/reap src/reap/pruning_metrics.py update_pruning_state): "
            "renormalised (default) pi_e / sum of pi over the token's top-K, REAP's renormalize_router_weights path "
            "(reap.layerwise_prune; reap.main where the config sets norm_topk_prob); softmax: pi_e, reap.main on a "
            "config without norm_topk_prob (Mixtral); pi = the router's distribution over the n experts (softmax "
            "of the logits for softmax routers)",
    "criterion": "frequency | weighted | reap (the experts with the lowest value go first; ties: the lower index), "
                 "random (a seeded permutation per layer), router (the model, nothing removed)",
    "fraction": "requested fraction of each chosen MoE layer's experts removed: floor(fraction x n) per layer, n "
                "= its computed experts (see zero_computation_experts)",
    "zero_computation_experts": "experts with no computation (LongCat-Flash's identity experts, Zaya's skip class, "
                                "the last indices) cost nothing to keep and have no output of their own: they are "
                                "not measured (prune_importance.csv lists the computed experts), counted in n, "
                                "removed or ablated; the router still routes to them (manifest: "
                                "zero_computation_experts_not_pruned)",
    "removed": "experts removed per chosen MoE layer (prune.csv: summed over them; prune_removed.csv: one row per "
               "removed expert)",
    "removed_frac": "experts removed / computed experts in the chosen MoE layers",
    "perplexity": "exp(mean next-token NLL) of the data with the experts removed (as moetool ppl)",
    "ratio": "perplexity / the model's own perplexity on the same rows (paired)",
    "delta_ppl": "perplexity - the model's own perplexity (single-expert ablation)",
    "rank": "rank of the expert by REAP saliency over all chosen MoE layers (1 = largest)",
    "task": "lm-eval task (prune_eval.csv, with --tasks)",
    "metric": "lm-eval's metric name ([filter] appended when the filter is not 'none')",
    "value": "the lm-eval metric with the experts removed (the router row: the model's own)",
    "stderr": "lm-eval's standard error of the metric (NaN when it reports none)",
    "value_lo": lmeval.INTERVAL_DEFINITION,
    "value_hi": lmeval.INTERVAL_DEFINITION,
    "router_value": "the same metric under the model's own routing (nothing removed)",
    "retention": "value / router_value: accuracy retention (higher is better)",
    "retention_lo": "95% lower bound of retention: " + RETENTION_INTERVAL + "; the router's is 1",
    "retention_hi": "95% upper bound of retention (MOVER-R, as retention_lo); the router's is 1",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}
EVAL_COLUMNS = ("criterion", "fraction", "task", "metric", "value", "stderr", "value_lo", "value_hi", "router_value",
                "retention", "retention_lo", "retention_hi")


def reap_gate(ev: RoutingEvent, reap_weights: str = "renormalised") -> torch.Tensor:
    """``[T, K]`` REAP's gate weight of the token's top-K experts (``ev.idx``): ``π_e`` (softmax) or ``π_e / Σ_{k
    in top-K} π_k`` (renormalised), ``π`` the router's distribution over the n experts (float64)."""
    p = ev.probs.double().gather(-1, ev.idx)  # [T, K]
    if reap_weights == "softmax":
        return p
    if reap_weights == "renormalised":
        return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    raise MoetoolError(f"--reap-weights must be one of {', '.join(REAP_WEIGHTS)}, not {reap_weights!r}")


class Importance:
    """Per MoE layer: real tokens, and per expert the routed count, the sum of routing weights and the sum of
    REAP's gate weight (:func:`reap_gate`) x ||E_e(h)||_2 over the tokens routed to it (a forward consumer; device
    float64 sums, no host sync; summed over data-parallel ranks). Only the layers in ``layers`` are measured."""

    def __init__(self, layers: list[int], budget: int | None = None, reap_weights: str = "renormalised") -> None:
        if reap_weights not in REAP_WEIGHTS:
            raise MoetoolError(f"--reap-weights must be one of {', '.join(REAP_WEIGHTS)}, not {reap_weights!r}")
        self.layers = set(layers)
        self.budget = budget
        self.reap_weights = reap_weights
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        n, m = L.n_experts, L.n_computed
        norms = node_scores(L, ev.h, "output", "l2", budget=self.budget or DEFAULT_BUDGET)  # [T, n] fp32
        idx = ev.idx  # the model's own routing (no policy runs in this pass)
        valid = ev.valid.double().unsqueeze(-1).expand(idx.shape)  # [T, K]
        w = ev.weights.double() * valid
        g = reap_gate(ev, self.reap_weights) * valid
        flat = idx.reshape(-1)
        zero = torch.zeros(n, dtype=torch.float64, device=idx.device)
        step = {"tokens": ev.valid.double().sum().reshape(1),  # the computed experts only (zero-computation: last)
                "frequency": ops.one_hot_counts(idx, n, ev.valid)[:m],
                "weighted": zero.index_add(0, flat, w.reshape(-1))[:m],
                "reap_sum": zero.index_add(0, flat, (g * norms.gather(-1, idx).double()).reshape(-1))[:m]}
        prev = self.acc.get(L.index)
        self.acc[L.index] = step if prev is None else {k: prev[k] + v for k, v in step.items()}

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def table(self) -> Any:
        """``prune_importance.csv``: layer, expert, layer_tokens, frequency, weighted, reap."""
        import pandas as pd

        rows = []
        for layer, a in sorted(self.acc.items()):
            a = {k: v.cpu() for k, v in a.items()}
            tokens = int(a["tokens"].item())
            if tokens == 0:
                raise MoetoolError(f"layer {layer}: no real tokens (empty data or all padding)")
            freq = a["frequency"]
            reap = torch.where(freq > 0, a["reap_sum"] / freq.clamp_min(1), torch.zeros_like(freq))
            rows += [{"layer": layer, "expert": e, "layer_tokens": tokens, "frequency": int(freq[e]),
                      "weighted": float(a["weighted"][e]), "reap": float(reap[e])} for e in range(len(freq))]
        return pd.DataFrame(rows)


def removed_sets(importance: Any, layers: list[Any], criterion: str, fraction: float,
                 seed: int) -> dict[int, list[int]]:
    """Per chosen MoE layer, the experts ``criterion`` removes at ``fraction`` (:mod:`moetool.policies.prune`)."""
    out = {}
    for L in layers:
        m = n_removed(fraction, L.n_computed)
        if criterion == "random":
            out[L.index] = random_removed(seed, L.index, L.n_computed, m)
        else:
            scores = importance[importance.layer == L.index].sort_values("expert")[criterion].to_numpy()
            out[L.index] = lowest(scores, m)
    return out


ABLATION_COLUMNS = ("rank", "layer", "expert", "reap", "frequency", "scored_tokens", "perplexity", "perplexity_lo",
                    "perplexity_hi", "delta_ppl", "ratio", "ratio_lo", "ratio_hi")


def _check_fractions(layers: list[Any], fractions: tuple[float, ...]) -> None:
    """Before any forward: every layer keeps at least its K experts at every fraction, and a fraction above 0
    removes an expert somewhere (one that floors to none everywhere could only give the router's row again)."""
    for f in fractions:
        if f > 0 and all(n_removed(f, L.n_computed) == 0 for L in layers):
            n = max(L.n_computed for L in layers)
            f_ = number_text(f)
            raise MoetoolError(f"--fractions {f_} removes no expert in any chosen MoE layer (floor({f_} x {n}) = 0); "
                               f"use at least {1 / n:g}, or 0 for the model with nothing removed")
        for L in layers:
            m = n_removed(f, L.n_computed)
            if L.n_experts - m < L.top_k:
                raise MoetoolError(f"--fractions {number_text(f)} removes {m} of layer {L.index}'s {L.n_experts} "
                                   f"experts, leaving fewer than its top-{L.top_k}")


class _Runs:
    """The forwards (and lm-eval runs, with a task ``plan``) of one :func:`prune` call, all on the same rows, and
    their rows compared with the model's own routing (``base``, ``base_eval``: set by :meth:`measure`)."""

    def __init__(self, lm: Any, shard: Any, opts: PruneOptions, plan: Any, indices: list[int], quiet: bool) -> None:
        self.lm, self.shard, self.opts, self.plan, self.indices, self.quiet = lm, shard, opts, plan, indices, quiet
        self.hflm = lmeval.make_hflm(lm, opts.batch_size) if plan is not None else None
        self.base: Any = None
        self.base_eval: Any = None

    def ppl(self, policy: Any, policy_layers: list[int], description: str, consumers: tuple = ()) -> Any:
        return perplexity(self.lm, self.shard, policy=policy, policy_layers=policy_layers, consumers=consumers,
                          batch_size=self.opts.batch_size, quiet=self.quiet, rows=RowTable(self.shard),
                          description=description)

    def evaluate(self, policy: Any) -> Any:
        o = self.opts
        return lmeval.evaluate(self.lm, self.plan, policy=policy, policy_layers=self.indices,
                               num_fewshot=o.num_fewshot, limit=o.limit, batch_size=o.batch_size, seed=o.seed,
                               fewshot_seed=o.fewshot_seed, hflm=self.hflm, quiet=self.quiet)

    def measure(self) -> Any:
        """The model's own routing (perplexity, and lm-eval with tasks) and ``prune_importance.csv``."""
        imp = Importance(self.indices, reap_weights=self.opts.reap_weights)
        self.base = self.ppl(None, self.indices, "router + importance", (imp,))
        self.base_eval = self.evaluate(build_policy("router")) if self.plan is not None else None
        imp.merge_across_ranks()
        return imp.table()

    def row(self, res: Any) -> dict[str, Any]:
        """tokens, perplexity and the paired ratio to the model's own routing, with bootstrap intervals."""
        return {"scored_tokens": res.nll.tokens,
                **ppl_columns(res, self.base, n_boot=self.opts.bootstrap, seed=self.opts.seed)}

    def accuracy(self, criterion: str, fraction: float, name: str, res: Any) -> list[dict[str, Any]]:
        """``prune_eval.csv`` rows of one lm-eval run: value and retention against the model's own."""
        return [{"criterion": criterion, "fraction": fraction, **{k: r[k] for k in EVAL_COLUMNS[2:9]},
                 "retention": r["ratio"], "retention_lo": r["ratio_lo"], "retention_hi": r["ratio_hi"]}
                for r in eval_rows(name, res, self.base_eval)]


def _pruned(runs: _Runs, importance: Any, layers: list[Any]) -> tuple[list, list, list, dict]:
    """Per criterion and fraction, the experts removed and the model run without them: rows of ``prune.csv``
    (the router first), ``prune_removed.csv`` and ``prune_eval.csv``, and the lm-eval runs by removed set."""
    opts, with_tasks = runs.opts, runs.plan is not None
    n_total = sum(L.n_computed for L in layers)
    table = [{"criterion": "router", "fraction": 0.0, "removed": 0, "removed_frac": 0.0, **runs.row(runs.base)}]
    removed_rows, done, evals = [], {}, {}
    eval_table = runs.accuracy("router", 0.0, "router", runs.base_eval) if with_tasks else []
    for criterion in opts.criteria:  # each once (Flag.check)
        for f in opts.fractions:
            removed = removed_sets(importance, layers, criterion, f, opts.seed)
            key = tuple(sorted((k, tuple(v)) for k, v in removed.items()))
            if key not in done:  # two criteria removing the same experts: one forward
                policy = PrunePolicy(removed, criterion=criterion, fraction=f)
                for L in layers:
                    policy.check(L)
                done[key] = runs.ppl(policy, runs.indices, policy.name)
                if with_tasks:
                    evals[key] = (policy.name, runs.evaluate(policy))
            m = sum(len(v) for v in removed.values())
            table.append({"criterion": criterion, "fraction": f, "removed": m, "removed_frac": m / n_total,
                          **runs.row(done[key])})
            if with_tasks:
                eval_table += runs.accuracy(criterion, f, *evals[key])
            removed_rows += [{"criterion": criterion, "fraction": f, "layer": layer, "expert": e}
                             for layer, es in sorted(removed.items()) for e in es]
    return table, removed_rows, eval_table, evals


def _ablations(runs: _Runs, importance: Any, layers: list[Any]) -> list[dict[str, Any]]:
    """``prune_ablation.csv`` rows: each of the ``ablate`` experts with the largest REAP saliency removed alone."""
    ablation = []
    top = importance.sort_values(["reap", "layer", "expert"], ascending=[False, True, True]).head(runs.opts.ablate)
    by_index = {L.index: L for L in layers}
    for rank, r in enumerate(top.itertuples(), 1):
        policy = PrunePolicy({int(r.layer): [int(r.expert)]}, name=f"ablate layer {r.layer} expert {r.expert}")
        policy.check(by_index[int(r.layer)])
        res = runs.ppl(policy, [int(r.layer)], policy.name)
        ablation.append({"rank": rank, "layer": int(r.layer), "expert": int(r.expert), "reap": r.reap,
                         "frequency": r.frequency, **runs.row(res), "delta_ppl": res.perplexity - runs.base.perplexity})
    return ablation


def prune(lm: Any, tokens: Any, options: PruneOptions | None = None, *, plan: Any = None, quiet: bool = False,
          **overrides: Any) -> Result:
    """Expert importance (frequency, router-weighted frequency, REAP saliency), perplexity against the fraction of
    experts removed per layer for each criterion and random, and single-expert ablations of the top experts by
    REAP. Tables ``prune_importance``, ``prune`` (one row per criterion and fraction, the router first),
    ``prune_removed`` (the removed sets) and ``prune_ablation``; with ``tasks`` also ``prune_eval`` (lm-eval accuracy
    and retention per criterion and fraction, the router first); see :data:`DEFINITIONS`. ``plan`` (from
    :func:`moetool.experiments.eval.compute.plan_tasks`) may be passed when the caller resolved the tasks already."""
    import pandas as pd

    opts = resolve_options(PruneOptions, options, overrides)
    require_tokens(tokens)
    if plan is None and opts.tasks is not None:  # before any forward: an unknown task fails at once
        plan = lmeval.plan_tasks(opts.tasks, opts.include_path)
    layers = select_layers(lm.layers, opts.layers)
    quant.require_readable(layers, "prune")  # its importance reads expert outputs
    _check_fractions(layers, opts.fractions)
    indices = [L.index for L in layers]
    runs = _Runs(lm, distributed.shard(tokens, opts.batch_size), opts, plan, indices, quiet)
    importance = runs.measure()
    table, removed_rows, eval_table, evals = _pruned(runs, importance, layers)
    ablation = _ablations(runs, importance, layers)
    df = pd.DataFrame(table)
    tables = {"prune_importance.csv": importance, "prune.csv": df}
    not_written = {}  # the optional tables empty by the user's choice: not written, the manifest says why
    if removed_rows:
        tables["prune_removed.csv"] = pd.DataFrame(removed_rows, columns=["criterion", "fraction", "layer", "expert"])
    else:
        not_written["prune_removed.csv"] = "no expert removed: --fractions 0 only"
    if ablation:
        tables["prune_ablation.csv"] = pd.DataFrame(ablation, columns=list(ABLATION_COLUMNS))
    else:
        not_written["prune_ablation.csv"] = "no single-expert ablation: --ablate 0"
    meta = dict(definitions=DEFINITIONS, data=tokens.describe(), data_name=data_name(tokens.source), layers=indices,
                **zero_computation_meta(layers, "zero_computation_experts_not_pruned"), reap_weights=opts.reap_weights,
                ablations=len(ablation),  # at most --ablate: the experts there are
                bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, runs.base.rows.n_rows))
    if not_written:
        meta["not_written"] = not_written
    if plan is not None:
        tables["prune_eval.csv"] = pd.DataFrame(eval_table, columns=list(EVAL_COLUMNS))
        meta.update(eval=plan.describe(), n_samples={"router": runs.base_eval.n_samples,
                                                     **{n: r.n_samples for n, r in evals.values()}})
    summary = with_ci(df[["criterion", "fraction", "removed", "perplexity", "perplexity_lo", "perplexity_hi",
                          "ratio", "ratio_lo", "ratio_hi"]])
    return Result("prune", tables, opts, meta=meta, summary=summary)



def summary_lines(name: str, res: Result) -> list[str]:
    """One line per measured fraction: each criterion's perplexity ratio; then the largest single ablation (an
    accuracy and the fraction removed as fractions, as prune_eval.csv and prune.csv)."""
    df = res["prune"]
    router = df[df.criterion == "router"].iloc[0]
    out = [f"prune {name}: router ppl {format_ci(router.perplexity, router.perplexity_lo, router.perplexity_hi)}"]
    for f, g in df[df.criterion != "router"].groupby("fraction"):
        out.append(f"  {number_text(f)} of experts removed: " + ", ".join(
            f"{r.criterion} x{format_ci(r.ratio, r.ratio_lo, r.ratio_hi)}" for r in g.itertuples()))
    if "prune_eval.csv" in res.tables:  # lm-eval: each criterion's accuracy retention per task and fraction
        ev = res["prune_eval"]
        for (task, metric), g in ev[ev.criterion != "router"].groupby(["task", "metric"], sort=False):
            if metric != "acc":
                continue
            b = float(g.router_value.iloc[0])
            out.append(f"  {task} acc (router {fraction_text(b)}) retention: " + ", ".join(
                f"{r.criterion}@{number_text(r.fraction)} x{r.retention:.2f}" for r in g.itertuples()))
    abl = res.tables.get("prune_ablation.csv")
    if abl is not None and len(abl):
        worst = abl.loc[abl.delta_ppl.idxmax()]
        out.append(f"  single-expert ablation (top {len(abl)} by REAP): largest delta ppl {worst.delta_ppl:+.2f} "
                   f"(layer {int(worst.layer)}, expert {int(worst.expert)})")
    return out
