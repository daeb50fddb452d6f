"""``prune``: expert importance, and perplexity as experts are removed (issue: interventions, expert pruning).

One pass of the model's own routing over the data measures, per (MoE layer, expert), over the real tokens whose
top-K holds the expert: how many (``frequency``), the sum of the routing weights they give it (``weighted``), and
the REAP saliency (Lasby et al. 2025, "REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression",
arXiv 2510.13999, Eq. 9): the mean over those tokens of the routing weight times the L2 norm of the expert's output
``||E_e(h)||`` (all experts' outputs from the engine's batched probes, in memory-bounded token chunks;
:func:`moetool.engine.probes.node_scores`). The weight is what the model multiplies the expert's output by
(renormalised where its rule renormalises, times DeepSeek's scaling factor, which is the same for every expert of
a layer), REAP's gate value.

Then per criterion (and a seeded random one) and fraction, the ``⌊fraction · n⌋`` least important experts of every
chosen MoE layer are removed (:class:`moetool.policies.prune.PrunePolicy`: masked out of the top-K) and the model
runs on the same rows: perplexity with the paired ratio to the model's own routing (document-level bootstrap).
Last, single-expert ablations: each of the ``ablate`` experts with the largest REAP saliency removed alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from ..engine.hooks import RoutingEvent, select_layers
from ..engine.probes import DEFAULT_BUDGET, node_scores
from ..errors import MoetoolError
from ..policies.prune import CRITERIA, PrunePolicy, lowest, n_removed, random_removed
from ..uncertainty import DEFAULT_BOOTSTRAP, RowTable, bootstrap_meta, check_n_boot, with_ci
from .ppl import data_name, perplexity, ppl_intervals
from .result import Result, resolve_options

DEFAULT_FRACTIONS = (0.125, 0.25, 0.5)
MEASURED = ("frequency", "weighted", "reap")  # the criteria measured on data (random is not)

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "expert": "expert index within the layer",
    "tokens": "real (unpadded) tokens the layer routed (prune_importance.csv); scored next-token predictions "
              "(prune.csv, prune_ablation.csv)",
    "frequency": "routed frequency: real tokens whose top-K (the model's own routing) holds the expert",
    "weighted": "router-weighted frequency: the sum over those tokens of the routing weight the expert gets (what "
                "the model multiplies its output by: renormalised where the rule renormalises, times the scaling "
                "factor)",
    "reap": "REAP saliency (Lasby et al. 2025, arXiv 2510.13999, Eq. 9): the mean over those tokens of routing "
            "weight x ||E_e(h)||_2 (the expert's output before any weight); 0 for an expert never routed",
    "criterion": "frequency | weighted | reap (the experts with the lowest value go first; ties: the lower index), "
                 "random (a seeded permutation per layer), router (the model, nothing removed)",
    "fraction": "requested fraction of each chosen MoE layer's experts removed: floor(fraction x n) per layer",
    "removed": "experts removed per chosen MoE layer (prune.csv: summed over them; prune_removed.csv: one row per "
               "removed expert)",
    "removed_frac": "experts removed / experts in the chosen MoE layers",
    "perplexity": "exp(mean next-token NLL) of the data with the experts removed (as moetool ppl)",
    "ratio": "perplexity / the model's own perplexity on the same rows (paired)",
    "delta_ppl": "perplexity - the model's own perplexity (single-expert ablation)",
    "rank": "rank of the expert by REAP saliency over all chosen MoE layers (1 = largest)",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


@dataclass(frozen=True)
class PruneOptions:
    """Options of :func:`prune`."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS  # fractions of each layer's experts removed
    criteria: tuple[str, ...] = CRITERIA  # frequency | weighted | reap | random
    ablate: int = 8  # single-expert ablations of the experts with the largest REAP saliency (0: none)
    layers: tuple[int, ...] | None = None  # MoE layers measured and pruned (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0  # the random criterion's permutations and the bootstrap

    def __post_init__(self) -> None:
        check_n_boot(self.bootstrap)
        if not self.fractions or any(not 0.0 <= f < 1.0 for f in self.fractions):
            raise MoetoolError(f"--fractions must lie in [0, 1), not {list(self.fractions)}")
        bad = [c for c in self.criteria if c not in CRITERIA]
        if bad or not self.criteria:
            raise MoetoolError(f"--criteria must be some of {', '.join(CRITERIA)}, not {list(self.criteria)}")
        if self.ablate < 0:
            raise MoetoolError(f"--ablate must be at least 0, not {self.ablate}")


class Importance:
    """Per MoE layer: real tokens, and per expert the routed count, the sum of routing weights and the sum of
    weight x ||E_e(h)||_2 over the tokens routed to it (a forward consumer; device float64 sums, no host sync;
    summed over data-parallel ranks). Only the layers in ``layers`` are measured."""

    def __init__(self, layers: list[int], budget: int | None = None) -> None:
        self.layers = set(layers)
        self.budget = budget
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        n = L.n_experts
        norms = node_scores(L, ev.h, "output", "l2", budget=self.budget or DEFAULT_BUDGET)  # [T, n] fp32
        idx = ev.idx  # the model's own routing (no policy runs in this pass)
        valid = ev.valid.double().unsqueeze(-1).expand(idx.shape)  # [T, K]
        w = ev.weights.double() * valid
        flat = idx.reshape(-1)
        zero = torch.zeros(n, dtype=torch.float64, device=idx.device)
        step = {"tokens": ev.valid.double().sum().reshape(1),
                "frequency": zero.index_add(0, flat, valid.reshape(-1)),
                "weighted": zero.index_add(0, flat, w.reshape(-1)),
                "reap_sum": zero.index_add(0, flat, (w * norms.gather(-1, idx).double()).reshape(-1))}
        prev = self.acc.get(L.index)
        self.acc[L.index] = step if prev is None else {k: prev[k] + v for k, v in step.items()}

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def table(self) -> Any:
        """``prune_importance.csv``: layer, expert, tokens, frequency, weighted, reap."""
        import pandas as pd

        rows = []
        for layer, a in sorted(self.acc.items()):
            a = {k: v.cpu() for k, v in a.items()}
            tokens = int(a["tokens"].item())
            if tokens == 0:
                raise MoetoolError(f"layer {layer}: no real tokens (empty data or all padding)")
            freq = a["frequency"]
            reap = torch.where(freq > 0, a["reap_sum"] / freq.clamp_min(1), torch.zeros_like(freq))
            rows += [{"layer": layer, "expert": e, "tokens": tokens, "frequency": int(freq[e]),
                      "weighted": float(a["weighted"][e]), "reap": float(reap[e])} for e in range(len(freq))]
        return pd.DataFrame(rows)


def removed_sets(importance: Any, layers: list[Any], criterion: str, fraction: float,
                 seed: int) -> dict[int, list[int]]:
    """Per chosen MoE layer, the experts ``criterion`` removes at ``fraction`` (:mod:`moetool.policies.prune`)."""
    out = {}
    for L in layers:
        m = n_removed(fraction, L.n_experts)
        if criterion == "random":
            out[L.index] = random_removed(seed, L.index, L.n_experts, m)
        else:
            scores = importance[importance.layer == L.index].sort_values("expert")[criterion].to_numpy()
            out[L.index] = lowest(scores, m)
    return out


def prune(lm: Any, tokens: Any, options: PruneOptions | None = None, *, quiet: bool = False,
          **overrides: Any) -> Result:
    """Expert importance (frequency, router-weighted frequency, REAP saliency), perplexity against the fraction of
    experts removed per layer for each criterion and random, and single-expert ablations of the top experts by
    REAP. Tables ``prune_importance``, ``prune`` (one row per criterion and fraction, the router first),
    ``prune_removed`` (the removed sets) and ``prune_ablation``; see :data:`DEFINITIONS`."""
    import pandas as pd

    opts = resolve_options(PruneOptions, options, overrides)
    tokens.require_tokens()
    layers = select_layers(lm.layers, opts.layers)
    indices = [L.index for L in layers]
    for f in opts.fractions:  # before any forward: every layer keeps at least its K experts
        for L in layers:
            m = n_removed(f, L.n_experts)
            if L.n_experts - m < L.top_k:
                raise MoetoolError(f"--fractions {f:g} removes {m} of layer {L.index}'s {L.n_experts} experts, "
                                   f"leaving fewer than its top-{L.top_k}")
    shard = distributed.shard(tokens, opts.batch_size)

    def run(policy: Any, policy_layers: list[int], description: str, consumers: tuple = ()) -> Any:
        return perplexity(lm, shard, policy=policy, policy_layers=policy_layers, consumers=consumers,
                          batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard), description=description)

    imp = Importance(indices)
    base = run(None, indices, "router + importance", (imp,))
    imp.merge_across_ranks()
    importance = imp.table()
    nan = float("nan")

    def row(res: Any) -> dict[str, Any]:
        ci = ppl_intervals(res, None if res is base else base, n_boot=opts.bootstrap, seed=opts.seed)
        out = {"tokens": res.nll.tokens, "perplexity": res.perplexity, "perplexity_lo": nan, "perplexity_hi": nan,
               "ratio": res.perplexity / base.perplexity, "ratio_lo": nan, "ratio_hi": nan}
        out.update({k: v for k, v in ci.items() if k.endswith(("_lo", "_hi"))})
        if res is base:
            out.update(ratio_lo=1.0, ratio_hi=1.0)
        return out

    n_total = sum(L.n_experts for L in layers)
    table = [{"criterion": "router", "fraction": 0.0, "removed": 0, "removed_frac": 0.0, **row(base)}]
    removed_rows, done = [], {}
    for criterion in opts.criteria:
        for f in opts.fractions:
            removed = removed_sets(importance, layers, criterion, f, opts.seed)
            key = tuple(sorted((k, tuple(v)) for k, v in removed.items()))
            if key not in done:  # two criteria removing the same experts: one forward
                policy = PrunePolicy(removed, criterion=criterion, fraction=f)
                for L in layers:
                    policy.check(L)
                done[key] = run(policy, indices, policy.name)
            m = sum(len(v) for v in removed.values())
            table.append({"criterion": criterion, "fraction": f, "removed": m, "removed_frac": m / n_total,
                          **row(done[key])})
            removed_rows += [{"criterion": criterion, "fraction": f, "layer": layer, "expert": e}
                             for layer, es in sorted(removed.items()) for e in es]
    ablation = []
    top = importance.sort_values(["reap", "layer", "expert"], ascending=[False, True, True]).head(opts.ablate)
    by_index = {L.index: L for L in layers}
    for rank, r in enumerate(top.itertuples(), 1):
        policy = PrunePolicy({int(r.layer): [int(r.expert)]}, name=f"ablate layer {r.layer} expert {r.expert}")
        policy.check(by_index[int(r.layer)])
        res = run(policy, [int(r.layer)], policy.name)
        ablation.append({"rank": rank, "layer": int(r.layer), "expert": int(r.expert), "reap": r.reap,
                         "frequency": r.frequency, **row(res), "delta_ppl": res.perplexity - base.perplexity})
    df = pd.DataFrame(table)
    abl_cols = ["rank", "layer", "expert", "reap", "frequency", "tokens", "perplexity", "perplexity_lo",
                "perplexity_hi", "delta_ppl", "ratio", "ratio_lo", "ratio_hi"]
    ablation_df = pd.DataFrame(ablation, columns=abl_cols)
    removed_df = pd.DataFrame(removed_rows, columns=["criterion", "fraction", "layer", "expert"])
    summary = with_ci(df[["criterion", "fraction", "removed", "perplexity", "perplexity_lo", "perplexity_hi",
                          "ratio", "ratio_lo", "ratio_hi"]])
    return Result("prune", {"prune_importance.csv": importance, "prune.csv": df, "prune_removed.csv": removed_df,
                            "prune_ablation.csv": ablation_df}, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(), data_name=data_name(tokens.source),
                            layers=indices, bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, base.rows.n_rows)),
                  summary=summary)


def summary_lines(name: str, res: Result) -> list[str]:
    """One line per measured fraction: each criterion's perplexity ratio; then the largest single ablation."""
    df = res["prune"]
    router = df[df.criterion == "router"].iloc[0]
    out = [f"prune {name}: router ppl {router.perplexity:.1f}"]
    for f, g in df[df.criterion != "router"].groupby("fraction"):
        out.append(f"  {f:g} of experts removed: " + ", ".join(f"{r.criterion} x{r.ratio:.2f}"
                                                               for r in g.itertuples()))
    abl = res["prune_ablation"]
    if len(abl):
        worst = abl.loc[abl.delta_ppl.idxmax()]
        out.append(f"  single-expert ablation (top {len(abl)} by REAP): largest delta ppl {worst.delta_ppl:+.2f} "
                   f"(layer {int(worst.layer)}, expert {int(worst.expert)})")
    return out
