"""The computation of ``moetool topk``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

# How (the command's --help above is this module's docstring):
# For the router and every ``topk:<k>`` (k below the model's K) and ``topp:<p>`` policy
# (:mod:`moetool.policies.topk`), the policy replaces routing in every chosen MoE layer and the model runs on the
# data: perplexity (with the document-level bootstrap, paired ratio against the router on the same rows) and the
# experts each real token used per layer (those with a nonzero weight), counted on the device during the forward.

from __future__ import annotations

from typing import Any

import torch

from ... import distributed
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, check_policy, select_layers
from ...errors import MoetoolError, layers_of_one
from ...policies import make_policy
from ...uncertainty import RowTable, bootstrap_meta, format_ci, with_ci
from ..routing import SCORED_TOKENS, data_name, perplexity, ppl_columns
from ..result import Result, resolve_options
from .spec import TopkOptions  # noqa: F401 - its options (declared with their flags in spec.py)

DEFINITIONS = {
    "policy": "router (the model's own routing), topk:<k> (its routing with k experts), topp:<p> (the smallest set "
              "of experts in decreasing π whose mass reaches p; moetool.policies.topk)",
    "kind": "router | topk | topp",
    "value": "k of topk, p of topp (the model's K for the router)",
    "tokens": "real (unpadded) tokens each MoE layer routed (the same in topk.csv and topk_layers.csv)",
    "scored_tokens": SCORED_TOKENS,
    "mean_experts": "computed experts with a nonzero weight per real token and MoE layer, averaged over the layers "
                    "the policy ran in (topk.csv: those of --layers) or per layer (topk_layers.csv: every MoE layer, "
                    "those outside --layers with the model's own routing). Zero-computation experts (LongCat-Flash's "
                    "identity experts, Zaya's skip class) cost nothing and are not counted: there the router's row "
                    "is below K",
    "experts_frac": "mean_experts / n: the share of the layer's n computed experts a token uses, in [0, 1] (topk.csv: "
                    "averaged over the layers the policy ran in); the compute relative to the model's own is "
                    "mean_experts / the router row's mean_experts (K without zero-computation experts)",
    "min_experts/max_experts": "fewest / most experts a real token used in the layer",
    "perplexity": "exp(mean next-token NLL) of the data under the policy (as moetool ppl)",
    "ratio": "perplexity / the router's perplexity on the same rows (paired)",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


class ExpertCounter:
    """Per MoE layer, a histogram of real tokens by the number of computed experts with a nonzero weight
    (zero-computation experts, the last ``n_zero_compute`` indices, cost nothing and are not counted; a forward
    consumer; device tensors, no host synchronisation; summed over data-parallel ranks)."""

    def __init__(self) -> None:
        self.hist: dict[int, torch.Tensor] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        n = ev.layer.n_computed
        used = ((ev.chosen_weights != 0) & (ev.chosen_idx < n)).sum(-1)  # [T]
        h = torch.zeros(n + 1, dtype=torch.float64, device=used.device).index_add_(0, used, ev.valid.double())
        prev = self.hist.get(ev.layer.index)
        self.hist[ev.layer.index] = h if prev is None else prev + h

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.hist = distributed.all_reduce_keyed(self.hist)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for layer, h in sorted(self.hist.items()):
            h = h.cpu().double()
            tokens = float(h.sum())
            if tokens == 0:
                raise MoetoolError(f"layer {layer}: no real tokens (empty data or all padding)")
            used = torch.nonzero(h).flatten()
            mean = float((h * torch.arange(len(h), dtype=torch.float64, device="cpu")).sum()) / tokens
            out.append({"layer": layer, "tokens": int(tokens), "mean_experts": mean,
                        "experts_frac": mean / (len(h) - 1), "min_experts": int(used.min()),
                        "max_experts": int(used.max())})
        return out


def topk(lm: Any, tokens: Any, options: TopkOptions | None = None, *, quiet: bool = False, **overrides: Any) -> Result:
    """Perplexity against the experts each token uses, for fixed k < K (``topk:<k>``) and top-p routing
    (``topp:<p>``), with the router as the reference. Tables ``topk`` (one row per policy: kind, value,
    mean_experts, experts_frac, perplexity, ratio with intervals) and ``topk_layers`` (policy, layer,
    mean/min/max experts); see :data:`DEFINITIONS`."""
    import pandas as pd

    opts = resolve_options(TopkOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    K = layers_of_one({L.index: L.top_k for L in layers}, "the chosen MoE layers route different numbers of experts",
                      "K")
    specs = opts.specs(K)
    policies = {spec: make_policy(spec) for spec, _, _ in specs}  # a bad one fails before any forward
    indices = [L.index for L in layers]
    for policy in policies.values():  # as the forwards check it (over every layer at once): before the first
        check_policy(policy, layers, indices)
    shard = distributed.shard(tokens, opts.batch_size)
    runs, counts = {}, {}
    for spec, _, _ in specs:
        counter = ExpertCounter()
        policy = None if spec == "router" else policies[spec]
        runs[spec] = perplexity(lm, shard, policy=policy, policy_layers=indices, consumers=[counter],
                                batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard), description=spec)
        counter.merge_across_ranks()
        counts[spec] = counter.rows()
    base = runs["router"]
    table, per_layer = [], []
    for spec, kind, value in specs:
        ran = [r for r in counts[spec] if r["layer"] in indices]  # the layers the policy ran in (--layers)
        mean = sum(r["mean_experts"] for r in ran) / len(ran)
        frac = sum(r["experts_frac"] for r in ran) / len(ran)
        table.append({"policy": spec, "kind": kind, "value": value, "tokens": counts[spec][0]["tokens"],
                      "scored_tokens": runs[spec].nll.tokens, "mean_experts": mean, "experts_frac": frac,
                      **ppl_columns(runs[spec], base, n_boot=opts.bootstrap, seed=opts.seed)})
        per_layer += [{"policy": spec, "kind": kind, "value": value, **r} for r in counts[spec]]
    df = pd.DataFrame(table)

    summary = with_ci(df[["policy", "mean_experts", "experts_frac", "perplexity", "perplexity_lo", "perplexity_hi",
                          "ratio", "ratio_lo", "ratio_hi"]])
    return Result("topk", {"topk.csv": df, "topk_layers.csv": pd.DataFrame(per_layer)}, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(), model_top_k=K,
                            data_name=data_name(tokens.source), layers=indices,
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, base.rows.n_rows)),
                  summary=summary)


def summary_lines(name: str, res: Result) -> list[str]:
    """One line: the router's perplexity, then each policy's experts per token and perplexity ratio."""
    df = res["topk"]
    parts = [f"{r.policy} {r.mean_experts:.2f} experts x{format_ci(r.ratio, r.ratio_lo, r.ratio_hi)}"
             for r in df.itertuples() if r.kind != "router"]
    router = df[df.kind == "router"].iloc[0]
    ppl = format_ci(router.perplexity, router.perplexity_lo, router.perplexity_hi)
    computed = "" if router.mean_experts == router.value else f" ({router.mean_experts:.2f} computed)"
    return [f"topk {name}: router ppl {ppl} with K={router.value:g}{computed}; " + ", ".join(parts)]
