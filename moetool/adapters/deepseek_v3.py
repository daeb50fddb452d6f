"""DeepSeek-V3 (and the same router in GLM-4-MoE): sigmoid scores, bias-corrected grouped top-k.

* Decoder layer ``i`` is MoE iff ``i >= config.first_k_dense_replace``; earlier layers are dense.
* Router ``mlp.gate`` (weight ``[E, H]``) computes its logits in **fp32** (input and weight cast),
  whatever the model dtype; everything after stays fp32, so the weights are fp32.
* Scores ``s = sigmoid(logits)``. Selection ranks ``s + gate.e_score_correction_bias`` (a buffer
  ``[E]``, load-balancing only) inside the ``topk_group`` best of ``n_group`` expert groups, a
  group scored by the sum of its two best biased scores.
* Weights are the *unbiased* ``s`` of the chosen, ``/ (sum + 1e-20)`` if ``norm_topk_prob``, then
  ``× routed_scaling_factor`` (so they sum to the factor, not to one).
* π (SPEC notation): ``s`` normalised to sum to one over all n experts.
* ``mlp.shared_experts``: one ungated dense MLP added to every token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .base import TINY_SHAPE, Adapter, MoELayer


def group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """``[T, n]`` bool: experts in the ``topk_group`` best of ``n_group`` contiguous groups.

    A group is scored by the sum of its two best scores (``"top2sum"``, V3) or its best (``"max"``, V2).
    """
    T, n = scores.shape
    grouped = scores.view(T, n_group, n // n_group)
    gs = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2sum" else grouped.max(dim=-1).values
    keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1], 1)
    return keep.bool().unsqueeze(-1).expand(T, n_group, n // n_group).reshape(T, n)


class DeepseekV3Layer(MoELayer):
    weights_fp32 = True
    scoring = ("sigmoid(fp32); top-k of score + e_score_correction_bias within the topk_group best of n_group "
               "groups (group score = sum of its top-2); weights = unbiased scores [/sum if norm_topk_prob] "
               "x routed_scaling_factor")

    @property
    def shared_experts(self) -> nn.Module | None:
        return getattr(self.block, "shared_experts", None)

    @property
    def weight_scale(self) -> float:
        return float(self.router.routed_scaling_factor)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.float(), self.router_weight().float())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return ops.normalize(torch.sigmoid(logits.float()))

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Biased sigmoid scores (before the group restriction)."""
        return torch.sigmoid(logits.float()) + self.router.e_score_correction_bias

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(logits.float()).gather(-1, idx)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.router.routed_scaling_factor

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.selection_scores(logits)
        keep = group_mask(s, self.router.num_group, self.router.topk_group, "top2sum")
        idx = ops.topk(s.masked_fill(~keep, float("-inf")), self.top_k)
        return idx, self.weights_for(logits, idx)

    def describe(self) -> dict[str, Any]:
        r = self.router
        return {**super().describe(), "n_group": r.num_group, "topk_group": r.topk_group,
                "routed_scaling_factor": r.routed_scaling_factor}


class DeepseekV3Adapter(Adapter):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    layer_cls = DeepseekV3Layer

    def is_moe_block(self, index, block, config) -> bool:
        return index >= config.first_k_dense_replace and super().is_moe_block(index, block, config)

    @staticmethod
    def tiny_config():
        """Layer 0 dense (``first_k_dense_replace=1``); 8 experts in 2 groups, 1 group kept, k=2."""
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**{**TINY_SHAPE, "num_key_value_heads": 4}, intermediate_size=128,
                                moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                v_head_dim=32)
