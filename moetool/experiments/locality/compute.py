"""The computation of ``moetool locality``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

from __future__ import annotations

from typing import Any

import torch

from ... import distributed, ops
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...uncertainty import fraction_text
from ..result import Result, resolve_options
from ..routing import data_name
from .spec import LocalityOptions  # noqa: F401 - its options (declared in spec.py)

SOURCE = "Jiang et al. 2024, Mixtral of Experts, arXiv 2401.04088, sec. 5 (routing analysis)"
COLUMNS = ("layer", "n_experts", "top_k", "tokens", "pairs", "top1_repeat", "top1_repeat_independent",
           "top1_repeat_uniform", "topk_overlap", "topk_overlap_uniform")
DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "n_experts": "routed experts n of the layer",
    "top_k": "experts K the model chooses per token",
    "tokens": "real (unpadded) tokens the layer routed",
    "pairs": "pairs of consecutive real tokens (t-1, t) within a packed row (a row may hold several documents)",
    "top1_repeat": "share of the pairs whose first-choice expert (the top-1: the chosen expert ranked first by the "
                   "router's selection scores, a correction bias included) is the same for t-1 and t",
    "top1_repeat_independent": "sum over experts of f_e^2, f_e = share of real tokens whose first choice is e: "
                               "top1_repeat if consecutive tokens chose independently with the layer's own load",
    "top1_repeat_uniform": "1 / n: top1_repeat of a uniform random router",
    "topk_overlap": "mean over the pairs of |top-K(t) ∩ top-K(t-1)| / K",
    "topk_overlap_uniform": "K / n: topk_overlap of a uniform random router",
}


class LocalitySums:
    """Forward consumer: per MoE layer, device float64 sums over the batches (no host sync): real tokens, pairs,
    pairs with the same first choice, top-K overlaps, and first-choice counts per expert."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = set(layers)
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        B, S = ev.shape
        idx = ev.idx.long()
        first = ev.ranked[0][:, 0]  # [T] the routing decision: first-ranked by the selection scores (ops.top1's)
        valid = ev.valid
        pair = (valid.reshape(B, S)[:, 1:] & valid.reshape(B, S)[:, :-1]).reshape(-1).double()  # [B * (S-1)]
        rows_first = first.reshape(B, S)
        same = (rows_first[:, 1:] == rows_first[:, :-1]).reshape(-1).double()
        rows_idx = idx.reshape(B, S, -1)
        shared = ops.overlap_count(rows_idx[:, 1:].reshape(B * (S - 1), -1),
                                   rows_idx[:, :-1].reshape(B * (S - 1), -1)).double()
        step = {"tokens": valid.double().sum().reshape(1), "pairs": pair.sum().reshape(1),
                "same": (same * pair).sum().reshape(1), "shared": (shared * pair).sum().reshape(1),
                "first": ops.one_hot_counts(first.unsqueeze(-1), L.n_experts, valid)}
        prev = self.acc.get(L.index)
        self.acc[L.index] = step if prev is None else {k: prev[k] + v for k, v in step.items()}

    def reduce_across_ranks(self) -> None:
        """Data parallel (called by ``engine.forward``): the per-layer sums all-reduced; alone a no-op."""
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def table(self, layers: list[Any]) -> Any:
        """``locality.csv``: one row per measured MoE layer."""
        import pandas as pd

        rows = []
        for L in layers:
            a = {k: v.cpu() for k, v in self.acc[L.index].items()}
            pairs, tokens = float(a["pairs"]), float(a["tokens"])
            if pairs == 0:
                raise MoetoolError(f"layer {L.index}: no two consecutive real tokens in a row (use --seq-len >= 2 "
                                   "and rows of more than one real token)")
            f = a["first"] / tokens
            rows.append({"layer": L.index, "n_experts": L.n_experts, "top_k": L.top_k, "tokens": int(tokens),
                         "pairs": int(pairs), "top1_repeat": float(a["same"]) / pairs,
                         "top1_repeat_independent": float((f * f).sum()), "top1_repeat_uniform": 1 / L.n_experts,
                         "topk_overlap": float(a["shared"]) / (pairs * L.top_k),
                         "topk_overlap_uniform": L.top_k / L.n_experts})
        return pd.DataFrame(rows, columns=list(COLUMNS))


def locality(lm: Any, tokens: Any, options: LocalityOptions | None = None, *, quiet: bool = False,
             **overrides: Any) -> Result:
    """Per MoE layer, how often consecutive tokens share their first-choice expert and their top-K, beside the
    independent and uniform figures (table ``locality``; see :data:`DEFINITIONS`)."""
    opts = resolve_options(LocalityOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    sums = LocalitySums([L.index for L in layers])
    forward(lm, distributed.shard(tokens, opts.batch_size), consumers=[sums], moe_layers=layers,
            batch_size=opts.batch_size, quiet=quiet, description="locality")  # all-reduces the sums
    df = sums.table(layers)
    return Result("locality", {"locality.csv": df}, opts,
                  meta=dict(definitions=DEFINITIONS, source=SOURCE, data=tokens.describe(),
                            data_name=data_name(tokens.source), layers=[L.index for L in layers]),
                  summary=df)


def summary_lines(name: str, res: Result) -> list[str]:
    """The first-choice repeat rate over the layers (fractions, as locality.csv), beside its independent figure."""
    df = res["locality"]
    return [f"locality {name}: consecutive tokens share their first-choice expert "
            f"{fraction_text(df.top1_repeat.min())}-{fraction_text(df.top1_repeat.max())} of the time over {len(df)} "
            f"MoE layer(s) (independent choice with the same "
            f"load: {fraction_text(df.top1_repeat_independent.min())}-"
            f"{fraction_text(df.top1_repeat_independent.max())}; uniform "
            f"{fraction_text(df.top1_repeat_uniform.iloc[0])})"]
