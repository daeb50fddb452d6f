"""Expert capacity and token dropping: ``capacity:<cf>[:order|score]``.

Per forward batch and MoE layer, every expert takes at most ``C = ceil(cf * tokens * K / n)`` assignments, where
``tokens`` is the batch's real (unpadded) tokens, K the layer's experts per token and n its computed experts
(GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021; Megatron-LM's ``get_capacity``).
Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip expert: ``layer.n_zero_compute``, the
last indices) compute nothing, so need no capacity: they are not counted in n and their assignments are never
dropped. The model's own
``(idx, w)`` are kept, except the assignments beyond an expert's capacity, which get weight 0: they contribute
nothing (the token keeps its other experts, shared experts and the residual). Padding never takes capacity
(its routing is left as the model's). Which assignments an expert keeps:

* ``order`` (default): the first C in the batch's flattened token order -- row 0 of the batch position by
  position, then row 1, ... (the order of the hidden states ``h [B*S, d]`` the experts module receives; GShard /
  Switch's cumulative sum over the group, Megatron-LM's ``drop_policy="position"``). A token's rank among its own
  K choices does not matter (GShard's priority of first choices over second ones is not modelled).
* ``score``: the C with the highest routing weight (the model's gate value of the assignment, as Megatron-LM's
  ``drop_policy="probs"``); ties go to the earlier token.

C depends on the batch: the same text in batches of other rows drops other assignments (capacity is per batch of
``--batch-size`` rows; a data-parallel rank's batches are the one-process batches, see
:func:`moetool.distributed.shard_indices`). ``cf >= n / K`` can drop nothing (an expert gets at most one
assignment per token), so ``capacity:inf`` (or any such cf) reproduces the model exactly.

Vectorised on the device: one stable sort of the assignments by expert (after a stable sort by score for
``score``) gives each assignment its rank among the expert's assignments; no host synchronisation.
:func:`drop_mask` is the kernel; :meth:`CapacityPolicy.select` leaves the dropped mask in
``ev.extra["dropped"]`` and C in ``ev.extra["capacity"]`` for consumers (``moetool capacity``).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from ..engine.hooks import RoutingEvent
from .base import Policy, number_text

ORDERS = ("order", "score")


def parse_cf(text: str | float) -> float:
    """A capacity factor: a positive number or ``inf``; one-line ValueError otherwise."""
    try:
        cf = float(text)
    except ValueError:
        raise ValueError(f"the capacity factor must be a number, not '{text}'") from None
    if not cf > 0 or math.isnan(cf):
        raise ValueError(f"the capacity factor must be positive, not {text}")
    return cf


#: the largest numerator and denominator of cf * k / n whose ceiling is computed in int64 (with up to 2**32 tokens
#: in a batch, tokens * numerator + denominator stays below 2**63)
EXACT_BOUND = 2 ** 31


def capacity(cf: float, tokens: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """``ceil(cf * tokens * k / n)`` as a float64 0-d tensor on ``tokens``' device (``inf`` for cf = inf), exact:
    cf is taken as the fraction its decimal text denotes (1.1 is 11/10) and the ceiling computed in integers.
    A cf whose fraction ``cf * k / n`` has a numerator or denominator of :data:`EXACT_BOUND` or more (1e15, 1e-12,
    many digits) would overflow int64 -- a capacity wrapped to a negative number, every assignment dropped: its
    ceiling is taken in float64 instead (at least 1 for a batch with real tokens)."""
    if math.isinf(cf):
        return torch.full((), math.inf, dtype=torch.float64, device=tokens.device)
    ratio = Fraction(number_text(cf)) * k / n
    if ratio.numerator < EXACT_BOUND and ratio.denominator < EXACT_BOUND:
        num, den = tokens.to(torch.int64) * ratio.numerator, ratio.denominator
        return torch.div(num + (den - 1), den, rounding_mode="floor").to(torch.float64)
    real = tokens.to(torch.float64)
    return torch.ceil(real * float(ratio)).clamp_min(1.0).where(real > 0, real)


def drop_mask(idx: torch.Tensor, valid: torch.Tensor, n: int, cap: torch.Tensor | float,
              scores: torch.Tensor | None = None) -> torch.Tensor:
    """``dropped [T, K]`` bool: the assignments of real tokens beyond their expert's capacity ``cap``.

    ``idx [T, K]`` experts per token (distinct per token), ``valid [T]`` False on padding (never counted, never
    dropped). Without ``scores`` an expert keeps its first ``cap`` assignments in token order (``t``, then the
    column k); with ``scores [T, K]`` its ``cap`` highest-scoring ones (ties: token order)."""
    T, K = idx.shape
    live = valid[:, None].expand(T, K).reshape(-1)
    key = torch.where(live, idx.reshape(-1).to(torch.int64), n)  # padding: bucket n, after every expert
    if scores is None:
        perm = torch.sort(key, stable=True).indices
    else:
        by_score = torch.sort(scores.reshape(-1).float(), descending=True, stable=True).indices
        perm = by_score[torch.sort(key[by_score], stable=True).indices]
    counts = torch.zeros(n + 1, dtype=torch.int64, device=idx.device).index_add_(0, key, torch.ones_like(key))
    start = counts.cumsum(0) - counts  # where each expert's run begins in the sorted order
    rank_sorted = torch.arange(T * K, device=idx.device) - start[key[perm]]
    rank = torch.empty_like(rank_sorted).scatter_(0, perm, rank_sorted)
    return (live & (rank >= cap)).view(T, K)


class CapacityPolicy(Policy):
    """``capacity:<cf>[:order|score]``: the model's routing with assignments beyond each expert's capacity
    dropped (module docstring)."""

    name = "capacity"

    def __init__(self, cf: float | str, order: str = "order"):
        self.cf = parse_cf(cf)
        if order not in ORDERS:
            raise ValueError(f"the drop order must be one of {', '.join(ORDERS)}, not '{order}'")
        self.order = order
        self.name = f"capacity:{number_text(self.cf)}:{order}"

    @classmethod
    def from_spec(cls, args: list[str], **_: Any) -> "CapacityPolicy":
        if len(args) not in (1, 2):
            raise ValueError("use capacity:<cf>[:order|score], e.g. capacity:1.25")
        return cls(args[0], *args[1:])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "cf": self.cf, "order": self.order}

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        K, n, m = ev.idx.shape[1], ev.layer.n_experts, ev.layer.n_computed
        cap = capacity(self.cf, ev.valid.sum(), K, m)
        dropped = drop_mask(ev.idx, ev.valid, n, cap, ev.weights if self.order == "score" else None)
        if m < n:  # zero-computation experts take no capacity: never dropped, no share of C
            dropped &= ev.idx < m
        ev.extra["capacity"], ev.extra["dropped"] = cap, dropped
        return ev.idx, ev.weights.masked_fill(dropped, 0)
