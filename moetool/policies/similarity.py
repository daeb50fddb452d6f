"""``similarity[:tau]`` — Similarity-Aware routing (Graph of Tokens, Def. 2).

Per sequence, ``S[i, j] = softmax_j(h_i · h_j / tau)`` over the real tokens ``j`` of the same
sequence (causal, ``j <= i``, by default), ``s_i = Σ_j S[i, j] π(h_j)``; the K experts with the
largest ``s_i`` run, with weights ``s_i`` renormalised over the chosen K. ``sim="cosine"`` uses
``cos(h_i, h_j)`` instead of the raw dot product (W_s = I in the paper); only then does
``tau -> 0`` give ``S = I`` (every token keeps its own routing). Default ``tau = sqrt(d)``.

The choice ranks experts by the router's distribution π, so a hash-routed layer (DeepSeek-V4's first layers:
experts by token id) is refused in one line, as for ``topk`` (``Policy.routes_by_scores``).

Padding tokens get zero weight as ``j``; a row with no admissible ``j`` (a left-padding query)
keeps its own π, so nothing is NaN. The normalised score ``s`` of every token is left in
``ev.scores`` (``fluctuation`` reads its entropy).

The two helpers :func:`propagate` and :func:`choose` are shared with ``attention`` routing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import ops
from ..engine.hooks import RoutingEvent
from .base import Policy, spec_number

SIMS = ("dot", "cosine")
#: the smallest tau: fp32's smallest normal number (a smaller one is subnormal or 0 in the fp32 division)
TAU_MIN = float(torch.finfo(torch.float32).tiny)


def propagate(A: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``s_i = Σ_j A[b, i, j] π(h_j)`` per sequence, padding ``j`` dropped, rows normalised to sum 1.

    ``A [B, S, S]``, ``probs [T, n]`` (T = B*S row-major), ``valid [T]`` -> ``s [T, n]`` fp32.
    """
    B, S = A.shape[0], A.shape[1]
    keep = valid.reshape(B, 1, S).to(torch.float32)  # [B, 1, S] columns of real tokens
    p = probs.float().reshape(B, S, -1)  # [B, S, n]
    s = torch.bmm(A.float() * keep, p)  # [B, S, n]
    s = torch.where(s.sum(-1, keepdim=True) > 0, s, p)  # a row that only saw padding keeps its own π
    return ops.normalize(s.reshape(B * S, -1))  # [T, n]


def choose(s: torch.Tensor, k: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK of the scores ``s [T, n]`` and their renormalised values: ``(idx [T, K], w [T, K])``.

    ``scale`` is the layer's ``weight_scale`` (DeepSeek's routed scaling factor, else 1)."""
    idx = ops.topk(s, k)  # [T, K]
    return idx, ops.normalize(s.gather(-1, idx)) * scale


def similarity_matrix(h: torch.Tensor, valid: torch.Tensor, shape: tuple[int, int], tau: float,
                      sim: str = "dot", causal: bool = True) -> torch.Tensor:
    """``S [B, S, S]``: row-softmax of ``sim(h_i, h_j) / tau`` over the admissible ``j`` of each sequence."""
    B, S = shape
    x = h.float().reshape(B, S, -1)  # [B, S, d]
    if sim == "cosine":
        x = ops.unit(x)
    allowed = valid.reshape(B, 1, S).expand(B, S, S)  # [B, S, S] key j is a real token
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=h.device)
    allowed = allowed | (eye & ~allowed.any(-1, keepdim=True))  # nothing admissible: itself only
    sims = torch.bmm(x, x.transpose(1, 2))  # [B, S, S]
    # each row's largest admissible similarity subtracted before dividing by tau (softmax is unchanged by it): a
    # small tau overflowed sims / tau to inf, and inf - inf made the row NaN (which propagate read as "keep your own
    # π"); now the largest is 0 / tau = 0 and the others fall towards -inf, the tau -> 0 limit
    top = sims.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True)
    return torch.softmax(sims.sub_(top).div_(tau).masked_fill_(~allowed, float("-inf")), dim=-1)


class SimilarityPolicy(Policy):
    """``similarity[:tau]``, options ``sim`` (dot|cosine), ``causal`` (default True), ``tau``."""

    name = "similarity"
    routes_by_scores = True  # TopK of the neighbours' π: no routing of a hash-routed layer (experts by token id)
    reads_sequence = True  # the other tokens of the same sequence

    def __init__(self, tau: float | None = None, sim: str = "dot", causal: bool = True):
        if sim not in SIMS:
            raise ValueError(f"unknown --sim '{sim}' (choose from {', '.join(SIMS)})")
        if tau is not None and not TAU_MIN <= tau < math.inf:
            raise ValueError(f"tau must be a finite number >= {TAU_MIN:g} (fp32's smallest normal number: the "
                             f"similarities are divided by it in fp32), not {tau}")
        self.tau, self.sim, self.causal = tau, sim, bool(causal)

    @classmethod
    def from_spec(cls, args: list[str], tau: float | None = None, sim: str | None = None,
                  causal: bool | None = None, **_: Any) -> "SimilarityPolicy":
        if len(args) > 1:
            raise ValueError("use similarity[:tau], e.g. similarity or similarity:0.5")
        if args and args[0]:
            tau = spec_number(args[0], float, "tau")
        return cls(tau, sim or "dot", True if causal is None else causal)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "policy": "similarity", "tau": self.tau if self.tau is not None else "sqrt(d)", "sim": self.sim,
                "causal": self.causal}

    def scores(self, ev: RoutingEvent) -> torch.Tensor:
        """The normalised Similarity-Aware scores ``s [T, n]``."""
        tau = self.tau if self.tau is not None else math.sqrt(ev.h.shape[-1])
        S = similarity_matrix(ev.h, ev.valid, ev.shape, tau, self.sim, self.causal)  # [B, S, S]
        return propagate(S, ev.probs, ev.valid)

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(ev)  # [T, n]
        ev.scores = s
        return choose(s, ev.layer.top_k, ev.layer.weight_scale)
