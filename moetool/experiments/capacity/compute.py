"""The computation of ``moetool capacity``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

# How (the command's --help above is this module's docstring):
# For every capacity factor cf and drop order, the policy ``capacity:<cf>:<order>`` (:mod:`moetool.policies.capacity`)
# replaces routing in every chosen MoE layer and the model runs on the data: perplexity (document-level bootstrap,
# paired ratio against the model's own routing on the same rows) and, counted on the device during the forward, per
# layer and expert the assignments of real tokens, the capacity offered and the assignments dropped.

from __future__ import annotations

from typing import Any

import torch

from ... import distributed, ops
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...context import state as run_state
from ...errors import MoetoolError, MoetoolRuntimeError
from ...policies import make_policy
from ...uncertainty import RowTable, bootstrap_meta, format_ci, fraction_text, with_ci
from ..routing import SCORED_TOKENS, data_name, perplexity, ppl_columns, zero_computation_meta
from ..result import Result, resolve_options
from .spec import DEFAULT_CFS, CapacityOptions  # noqa: F401 - its options (declared with their flags in spec.py)

DEFINITIONS = {
    "cf": "capacity factor: per forward batch of --batch-size rows (per process under torchrun, whose batches are "
          "the one-process batches) and MoE layer, each expert takes at most C = ceil(cf · tokens · K / n) "
          "assignments, tokens = the batch's real (unpadded) tokens, n = the layer's computed experts (see "
          "zero_computation_experts); the same text in batches of other rows drops other assignments. cf >= n/K "
          "drops nothing",
    "order": "which assignments an expert keeps: order = its first C in the batch's flattened token order (row 0 "
             "of the batch position by position, then row 1, ...: GShard/Switch), score = its C with the highest "
             "routing weight (the model's gate value; ties to the earlier token)",
    "layer/expert": "decoder layer index of the MoE layer / expert index within it",
    "tokens": "real (unpadded) tokens the layer routed (capacity_layers.csv)",
    "scored_tokens": SCORED_TOKENS + " (capacity.csv)",
    "assignments": "(token, expert) assignments of real tokens to computed experts by the model's own routing in "
                   "the layer, K per token without zero-computation experts (its input already changed by the drops "
                   "of the layers before it)",
    "zero_computation_experts": "experts with no computation (LongCat-Flash's identity experts, Zaya's skip class, "
                                "the last indices) need no capacity: n counts the computed experts, their "
                                "assignments are never dropped and are left out of assignments, load and "
                                "capacity_experts.csv (manifest: zero_computation_experts_without_capacity)",
    "load": "assignments of real tokens to the expert (summed over batches)",
    "capacity": "C summed over the batches: the assignments the expert could take (inf for cf = inf)",
    "dropped": "assignments beyond capacity, run with weight 0: they contribute nothing (the token keeps its other "
               "experts, any shared expert and the residual)",
    "dropped_frac": "dropped / assignments (capacity.csv: over every chosen MoE layer)",
    "tokens_dropped_all": "real tokens that lost all K of their experts in the layer (never one that chose a "
                          "zero-computation expert: those are never dropped)",
    "tokens_dropped_all_frac": "tokens_dropped_all / real tokens (capacity.csv: over every chosen MoE layer)",
    "perplexity": "exp(mean next-token NLL) of the data with the dropped assignments at weight 0 (as moetool ppl)",
    "router_perplexity": "perplexity of the model's own routing (unhooked) on the same rows",
    "ratio": "perplexity / router_perplexity on the same rows (paired)",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


class DropCounter:
    """Per MoE layer where the capacity policy ran: assignments, capacity and drops per expert, real tokens and
    tokens that lost every expert (a forward consumer; float64 device tensors, no host synchronisation; summed
    over data-parallel ranks)."""

    def __init__(self) -> None:
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        dropped = ev.extra.get("dropped")
        if dropped is None:  # a layer the policy does not act on
            return
        n, m, f64 = ev.layer.n_experts, ev.layer.n_computed, torch.float64
        flat = ev.idx.reshape(-1).to(torch.int64)
        new = {"load": ops.one_hot_counts(ev.idx, n, ev.valid)[:m],  # zero-computation experts take no capacity
               "dropped": torch.zeros(n, dtype=f64, device=flat.device).index_add_(0, flat,
                                                                                     dropped.reshape(-1).to(f64))[:m],
               "capacity": ev.extra["capacity"].to(f64),
               "tokens": ev.valid.sum(dtype=f64),
               "lost_all": (dropped.all(-1) & ev.valid).sum(dtype=f64)}
        prev = self.acc.get(ev.layer.index)
        self.acc[ev.layer.index] = new if prev is None else {k: prev[k] + v for k, v in new.items()}

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(per layer, per expert)`` rows."""
        layers, experts = [], []
        for layer, a in sorted(self.acc.items()):
            a = {k: v.cpu() for k, v in a.items()}
            tokens = float(a["tokens"])
            if tokens == 0:
                raise MoetoolError(f"layer {layer}: no real tokens (empty data or all padding)")
            assigned, dropped, cap = float(a["load"].sum()), float(a["dropped"].sum()), float(a["capacity"])
            layers.append({"layer": layer, "tokens": int(tokens), "assignments": int(assigned), "capacity": cap,
                           "dropped": int(dropped), "dropped_frac": dropped / assigned,
                           "tokens_dropped_all": int(a["lost_all"]),
                           "tokens_dropped_all_frac": float(a["lost_all"]) / tokens})
            experts += [{"layer": layer, "expert": e, "load": int(a["load"][e]), "capacity": cap,
                         "dropped": int(a["dropped"][e])} for e in range(len(a["load"]))]
        return layers, experts


def _check_batches(batch_size: int) -> None:
    """Capacity is per batch of --batch-size rows: a run whose batches out-of-memory cut smaller is refused."""
    rows = run_state().backoff.rows  # the run's back-off (moetool.context)
    if rows is not None and rows < batch_size:
        raise MoetoolRuntimeError(f"capacity is per batch of --batch-size rows, but out of memory cut the batches "
                                  f"to {rows} rows: rerun with --batch-size {rows}")


def capacity(lm: Any, tokens: Any, options: CapacityOptions | None = None, *, quiet: bool = False,
             **overrides: Any) -> Result:
    """Perplexity and dropped assignments under expert capacity ``ceil(cf · tokens · K / n)`` per batch and MoE
    layer, for every cf and drop order. Tables ``capacity`` (cf, order, perplexity, paired ratio to the router,
    dropped_frac), ``capacity_layers`` (per layer) and ``capacity_experts`` (per layer and expert: load, capacity,
    dropped); see :data:`DEFINITIONS`."""
    import pandas as pd

    opts = resolve_options(CapacityOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    indices = [L.index for L in layers]
    specs = opts.specs()
    policies = {spec: make_policy(spec) for _, _, spec in specs}
    shard = distributed.shard(tokens, opts.batch_size)
    _check_batches(opts.batch_size)
    base = perplexity(lm, shard, batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard),
                      description="router")
    table, per_layer, per_expert = [], [], []
    for cf, order, spec in specs:
        counter = DropCounter()
        run = perplexity(lm, shard, policy=policies[spec], policy_layers=indices, consumers=[counter],
                         batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard), description=spec)
        _check_batches(opts.batch_size)
        counter.merge_across_ranks()
        lay, exp = counter.rows()
        assigned, dropped = sum(r["assignments"] for r in lay), sum(r["dropped"] for r in lay)
        table.append({"cf": cf, "order": order, "scored_tokens": run.nll.tokens,
                      **ppl_columns(run, base, n_boot=opts.bootstrap, seed=opts.seed,
                                    between={"router_perplexity": base.perplexity}),
                      "assignments": assigned, "dropped": dropped, "dropped_frac": dropped / assigned,
                      "tokens_dropped_all_frac": sum(r["tokens_dropped_all"] for r in lay)
                      / sum(r["tokens"] for r in lay)})
        per_layer += [{"cf": cf, "order": order, **r} for r in lay]
        per_expert += [{"cf": cf, "order": order, **r} for r in exp]
    df = pd.DataFrame(table)
    summary = with_ci(df[["cf", "order", "dropped_frac", "tokens_dropped_all_frac", "perplexity", "perplexity_lo",
                          "perplexity_hi", "ratio", "ratio_lo", "ratio_hi"]])
    return Result("capacity", {"capacity.csv": df, "capacity_layers.csv": pd.DataFrame(per_layer),
                               "capacity_experts.csv": pd.DataFrame(per_expert)}, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(), data_name=data_name(tokens.source),
                            layers=indices, **zero_computation_meta(layers, "zero_computation_experts_without_capacity"),
                            policies={spec: p.describe() for spec, p in policies.items()},
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, base.rows.n_rows)),
                  summary=summary)



def summary_lines(name: str, res: Result) -> list[str]:
    """One line: the router's perplexity, then per cf and order the dropped share (a fraction, as capacity.csv's
    dropped_frac) and the perplexity ratio."""
    df = res["capacity"]
    parts = [f"cf {r.cf:g} {r.order} drops {fraction_text(r.dropped_frac)} "
             f"x{format_ci(r.ratio, r.ratio_lo, r.ratio_hi)}"
             for r in df.itertuples()]
    return [f"capacity {name}: router ppl {df.router_perplexity.iloc[0]:.1f}; " + ", ".join(parts)]
