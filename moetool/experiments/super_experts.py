"""Super Experts: the experts whose down projection makes extreme outputs, and what removing them costs.

One pass of the model's own routing over --data measures, per MoE layer (--layers) and expert, the largest
|output| of its down projection over its output dimensions and the real tokens routed to it (every expert's output
from batched probes in memory-bounded chunks; a running max). Super Experts (Su et al. 2025, "Unveiling Super
Experts in Mixture-of-Experts Large Language Models", arXiv 2507.23279): an expert whose maximum exceeds the
--percentile (99.5) percentile of every (layer, expert) maximum and is at least --fraction-of-max (0.1) of the
largest. Then the model runs on the same rows with the super experts removed (masked out of the top-K, as
prune's policy) and with as many random other experts removed in each layer (seeded by --seed).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes super_experts.csv (layer, expert, routed, max_abs_output, share_of_max, rank, is_super, threshold),
super_experts_ablation.csv (ablation: none|super|random, removed, experts, scored_tokens, perplexity, delta_ppl, ratio;
*_lo/*_hi), figures/super_experts_heatmap (max |output| per layer and expert, the super experts boxed),
figures/super_experts_ranked (every maximum by rank, with the threshold) and manifest.json (definitions,
criterion).

Examples:
  moetool super-experts
  moetool super-experts --model tiny-fine --max-tokens 4096 --percentile 99 --fraction-of-max 0.2
"""

# How (the command's --help above is this module's docstring):
# Super Experts (Su et al. 2025, "Unveiling Super Experts in Mixture-of-Experts Large Language Models", arXiv
# 2507.23279): a few experts whose down projection produces rare but extreme activation outliers, which become the
# massive activations of the hidden states; removing them hurts far more than removing others. One pass of the
# model's own routing over the data measures, per (MoE layer, expert), the largest ``|E_e(h)|`` over the output
# dimensions and over the real tokens whose top-K holds the expert (every expert's output from the engine's batched
# probes in memory-bounded token chunks, :func:`moetool.engine.probes.routed_absmax`; a running max on the device;
# the max over data-parallel ranks). The criterion, the paper's profiling criterion: with ``A`` the maxima of every
# (layer, expert) of the chosen layers, an expert is super when its maximum exceeds the 99.5th percentile of ``A``
# and is at least a tenth of ``max(A)`` (both settable).
#
# Then the model runs on the same rows with the super experts removed (:class:`moetool.policies.prune.PrunePolicy`:
# masked out of the top-K) and with as many random other experts removed in each layer (seeded): perplexity with the
# paired ratio to the model's own routing (document-level bootstrap).

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import distributed
from ..adapters import quant
from ..engine.hooks import RoutingEvent, select_layers
from ..engine.probes import DEFAULT_BUDGET, routed_absmax
from ..errors import MoetoolError
from ..policies.prune import PrunePolicy, random_removed
from ..uncertainty import DEFAULT_BOOTSTRAP, RowTable, bootstrap_meta, check_n_boot, with_ci
from .ppl import SCORED_TOKENS, data_name, perplexity, ppl_intervals
from .result import Result, resolve_options

SOURCE = "Su et al. 2025, arXiv 2507.23279"

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "expert": "expert index within the layer",
    "routed": "real (unpadded) tokens whose top-K (the model's own routing) holds the expert",
    "max_abs_output": "largest |E_e(h)| over the output dimensions of the expert's down projection and over the "
                      "tokens routed to it (the expert's output before any routing weight); 0 if never routed",
    "share_of_max": "max_abs_output / the largest max_abs_output over all chosen MoE layers and experts",
    "rank": "rank of max_abs_output over all chosen MoE layers and experts (1 = largest; ties: lower layer, "
            "then lower expert)",
    "is_super": f"Super Expert ({SOURCE}): max_abs_output > the percentile-th percentile (default 99.5, linear "
                "interpolation) of every (layer, expert) maximum AND >= fraction_of_max (default 0.1) x the largest",
    "threshold": "max(the percentile value, fraction_of_max x the largest): the value a super expert's maximum "
                 "passes (the same on every row)",
    "ablation": "none (the model's own routing), super (the super experts removed), random (as many experts per "
                "layer removed, a seeded permutation of the layer's other experts)",
    "removed": "experts removed, summed over the MoE layers",
    "experts": "the removed experts as layer:expert, space-separated",
    "scored_tokens": SCORED_TOKENS,
    "perplexity": "exp(mean next-token NLL) of the data with the experts removed (as moetool ppl)",
    "ratio": "perplexity / the model's own perplexity on the same rows (paired)",
    "delta_ppl": "perplexity - the model's own perplexity",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


@dataclass(frozen=True)
class SuperExpertsOptions:
    """Options of :func:`super_experts`."""

    percentile: float = 99.5  # a super expert's maximum exceeds this percentile of all (layer, expert) maxima
    fraction_of_max: float = 0.1  # ... and is at least this fraction of the largest
    layers: tuple[int, ...] | None = None  # MoE layers measured and ablated (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0  # the random ablation's permutations and the bootstrap

    def __post_init__(self) -> None:
        check_n_boot(self.bootstrap)
        if not 0.0 <= self.percentile < 100.0:
            raise MoetoolError(f"--percentile must lie in [0, 100), not {self.percentile:g}")
        if not 0.0 <= self.fraction_of_max <= 1.0:
            raise MoetoolError(f"--fraction-of-max must lie in [0, 1], not {self.fraction_of_max:g}")


def super_mask(maxima: Any, percentile: float = 99.5, fraction_of_max: float = 0.1) -> tuple[np.ndarray, float,
                                                                                             float]:
    """``(is_super, percentile value, fraction_of_max x largest)`` of the maxima of every (layer, expert): super
    when strictly above the percentile (linear interpolation) and at least the fraction of the largest."""
    a = np.asarray(maxima, dtype=np.float64)
    if a.size == 0 or not np.isfinite(a).all():
        raise MoetoolError("super-experts: the expert output maxima are empty or not finite")
    p = float(np.percentile(a, percentile))
    f = float(fraction_of_max * a.max())
    return (a > p) & (a >= f), p, f


class MaxOutput:
    """Per chosen MoE layer: per expert, the routed real tokens and the running max of ``|E_e(h)|`` over them (a
    forward consumer; device tensors, no host sync; over data-parallel ranks: summed counts, max of maxima)."""

    def __init__(self, layers: list[int], budget: int | None = None) -> None:
        self.layers = set(layers)
        self.budget = budget or DEFAULT_BUDGET
        self.count: dict[int, torch.Tensor] = {}
        self.max: dict[int, torch.Tensor] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        idx = ev.idx  # the model's own routing (no policy runs in this pass)
        routed = torch.zeros(idx.shape[0], L.n_experts, dtype=torch.bool, device=idx.device)
        routed.scatter_(1, idx, ev.valid.unsqueeze(-1).expand(idx.shape))
        m = routed_absmax(L, ev.h, routed, "output", budget=self.budget)
        c = routed.double().sum(0)
        i = L.index
        self.count[i] = c if i not in self.count else self.count[i] + c
        self.max[i] = m if i not in self.max else torch.maximum(self.max[i], m)

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.count = distributed.all_reduce_keyed(self.count)
            self.max = distributed.all_reduce_keyed(self.max, op="max")

    def table(self, percentile: float = 99.5, fraction_of_max: float = 0.1) -> tuple[Any, float, float]:
        """``super_experts.csv`` (layer, expert, routed, max_abs_output, share_of_max, rank, is_super, threshold)
        and the two thresholds (the percentile value, fraction_of_max x the largest)."""
        import pandas as pd

        if not self.max:
            raise MoetoolError("super-experts: no MoE layer routed a token (empty data?)")
        rows = []
        for layer in sorted(self.max):
            c, m = self.count[layer].cpu(), self.max[layer].cpu()
            rows += [{"layer": layer, "expert": e, "routed": int(c[e]), "max_abs_output": float(m[e])}
                     for e in range(len(m))]
        df = pd.DataFrame(rows)
        is_super, p, f = super_mask(df["max_abs_output"], percentile, fraction_of_max)
        top = df["max_abs_output"].max()
        df["share_of_max"] = df["max_abs_output"] / top if top > 0 else 0.0
        order = df.sort_values(["max_abs_output", "layer", "expert"], ascending=[False, True, True]).index
        df.loc[order, "rank"] = np.arange(1, len(df) + 1)
        df["rank"] = df["rank"].astype(int)
        df["is_super"] = is_super
        df["threshold"] = max(p, f)
        return df, p, f


def _label(removed: dict[int, list[int]]) -> str:
    return " ".join(f"{layer}:{e}" for layer, es in sorted(removed.items()) for e in es)


def super_experts(lm: Any, tokens: Any, options: SuperExpertsOptions | None = None, *, quiet: bool = False,
                  **overrides: Any) -> Result:
    """Max |expert output| per (MoE layer, expert), the Super Experts among them, and perplexity with them removed
    against as many random experts removed per layer. Tables ``super_experts`` and ``super_experts_ablation``; see
    :data:`DEFINITIONS`."""
    import pandas as pd

    opts = resolve_options(SuperExpertsOptions, options, overrides)
    tokens.require_tokens()
    layers = select_layers(lm.layers, opts.layers)
    quant.require_readable(layers, "super-experts")
    indices = [L.index for L in layers]
    shard = distributed.shard(tokens, opts.batch_size)

    def run(policy: Any, description: str, consumers: tuple = ()) -> Any:
        return perplexity(lm, shard, policy=policy, policy_layers=indices, consumers=consumers,
                          batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard), description=description)

    probe = MaxOutput(indices)
    base = run(None, "router + max |expert output|", (probe,))
    probe.merge_across_ranks()
    table, p_value, f_value = probe.table(opts.percentile, opts.fraction_of_max)
    sup = table[table.is_super]
    removed = {int(layer): sorted(int(e) for e in g.expert) for layer, g in sup.groupby("layer")}
    by_index = {L.index: L for L in layers}
    rand = {layer: random_removed(opts.seed, layer, by_index[layer].n_experts, len(es), exclude=es)
            for layer, es in removed.items()}
    short = [layer for layer, es in removed.items() if len(rand[layer]) < len(es)]
    if short:  # a random set smaller than the super set would compare unlike with like
        raise MoetoolError(f"super-experts: layers {short} have more super experts than other experts, so no random "
                           f"set of the same size exists (raise --percentile or --fraction-of-max)")
    nan = float("nan")

    def row(ablation: str, res: Any, sets: dict[int, list[int]]) -> dict[str, Any]:
        ci = ppl_intervals(res, None if res is base else base, n_boot=opts.bootstrap, seed=opts.seed)
        out = {"ablation": ablation, "removed": sum(len(v) for v in sets.values()), "experts": _label(sets),
               "scored_tokens": res.nll.tokens, "perplexity": res.perplexity, "perplexity_lo": nan, "perplexity_hi": nan,
               "delta_ppl": res.perplexity - base.perplexity, "ratio": res.perplexity / base.perplexity,
               "ratio_lo": nan, "ratio_hi": nan}
        out.update({k: v for k, v in ci.items() if k.endswith(("_lo", "_hi"))})
        if res is base:
            out.update(ratio_lo=1.0, ratio_hi=1.0)
        return out

    rows = [row("none", base, {})]
    if removed:
        for name, sets in (("super", removed), ("random", rand)):
            policy = PrunePolicy(sets, name=f"{name} experts removed")
            for L in layers:
                policy.check(L)
            rows.append(row(name, run(policy, policy.name), sets))
    ablation = pd.DataFrame(rows)
    summary = with_ci(ablation[["ablation", "removed", "perplexity", "perplexity_lo", "perplexity_hi", "ratio",
                                "ratio_lo", "ratio_hi"]])
    criterion = {"source": SOURCE, "percentile": opts.percentile, "fraction_of_max": opts.fraction_of_max,
                 "percentile_value": p_value, "fraction_of_max_value": f_value,
                 "threshold": max(p_value, f_value), "n_super": int(table.is_super.sum())}
    return Result("super_experts", {"super_experts.csv": table, "super_experts_ablation.csv": ablation}, opts,
                  meta=dict(definitions=DEFINITIONS, criterion=criterion, data=tokens.describe(),
                            data_name=data_name(tokens.source), layers=indices,
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, base.rows.n_rows)),
                  summary=summary)


def summary_lines(name: str, res: Result) -> list[str]:
    """The super experts and the perplexity ratios of removing them and as many random experts."""
    df = res["super_experts"]
    sup = df[df.is_super].sort_values("rank")
    out = [f"super-experts {name}: {len(sup)} super expert(s) of {len(df)}: "
           + (", ".join(f"layer {r.layer} expert {r.expert} (max |out| {r.max_abs_output:.3g})"
                        for r in sup.itertuples()) or "none")]
    abl = res["super_experts_ablation"].set_index("ablation")
    if "super" in abl.index:
        out.append(f"  removed: super x{abl.loc['super', 'ratio']:.2f}, random x{abl.loc['random', 'ratio']:.2f} "
                   f"(perplexity / the model's, {int(abl.loc['super', 'removed'])} expert(s))")
    return out
