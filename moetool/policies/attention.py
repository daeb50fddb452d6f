"""``attention`` — Attention-Aware routing (Graph of Tokens, Def. 5 / Eq. 14; SPEC §Routing policies).

The attention probabilities ``A [B, heads, S, S]`` of the same decoder layer's self-attention
(read by the engine from the attention module's ``output[1]``; the model must run with
``attn_implementation="eager"``, which the commands arrange when ``needs_attention``). The head
``h*`` with the lowest mean attention-row entropy over the batch's real tokens (padding query rows
excluded) is chosen once per batch and layer; ``s_i = Σ_j A_{h*}[i, j] π(h_j)`` over the real
tokens ``j``, TopK of ``s_i``, weights renormalised over the chosen K. The normalised ``s`` is left
in ``ev.scores`` and the chosen head in ``ev.extra["head"]``.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..engine.hooks import RoutingEvent
from ..errors import MoetoolError
from .base import Policy
from .similarity import choose, propagate


def lowest_entropy_head(A: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Index of the head whose attention rows have the lowest mean entropy over real query tokens.

    Rows are renormalised first (gpt-oss drops its attention-sink mass, so its rows sum to less than 1).

    ``A [B, H, S, S]``, ``valid [T]`` (T = B*S) -> scalar long tensor.
    """
    B, H, S, _ = A.shape
    ent = ops.entropy(ops.normalize(A), dim=-1)  # [B, H, S] nats, one per query row
    keep = valid.reshape(B, 1, S).to(ent.dtype)  # [B, 1, S]
    mean = (ent * keep).sum((0, 2)) / keep.sum().clamp_min(1)  # [H]
    return torch.argmin(mean)


class AttentionPolicy(Policy):
    """``attention``: no arguments; needs the layer's attention probabilities."""

    name = "attention"
    needs_attention = True

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "policy": "attention", "head": "lowest mean row entropy over the batch's real tokens, per layer"}

    def scores(self, ev: RoutingEvent) -> torch.Tensor:
        """The normalised Attention-Aware scores ``s [T, n]``."""
        if ev.attn is None:
            raise MoetoolError("attention routing needs the attention probabilities: load the model with "
                               "attn_implementation='eager'")
        B, S = ev.shape
        if tuple(ev.attn.shape[-2:]) != (S, S) or ev.attn.shape[0] != B:
            raise MoetoolError(f"layer {ev.layer.index}: attention probabilities of shape {tuple(ev.attn.shape)} "
                               f"do not match the batch ({B}, {S}) (a KV cache in use? pass use_cache=False)")
        head = lowest_entropy_head(ev.attn, ev.valid)
        ev.extra["head"] = head  # 0-d tensor: no host sync inside the forward
        A = ev.attn[:, head]  # [B, S, S]
        return propagate(A, ev.probs, ev.valid)

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(ev)  # [T, n]
        ev.scores = s
        return choose(s, ev.layer.top_k, ev.layer.weight_scale)
