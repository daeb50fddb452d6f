"""Qwen1.5/Qwen2-MoE: sparse ``mlp`` blocks by a config rule, plus a gated shared expert.

* Decoder layer ``i`` is MoE iff ``i not in config.mlp_only_layers`` and
  ``(i + 1) % config.decoder_sparse_step == 0`` (and ``num_experts > 0``); the others hold a
  dense ``Qwen2MoeMLP``.
* Router ``mlp.gate`` (weight ``[E, H]``, no bias): logits in the model dtype, softmax in fp32,
  top-k, ``/ sum`` only if ``norm_topk_prob`` (default False); the weights are cast back to the
  logits' dtype.
* The block adds ``sigmoid(shared_expert_gate(h)) * shared_expert(h)`` to the routed output;
  :attr:`Qwen2MoeLayer.shared_experts` exposes that sum as one module.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import TINY_SHAPE, Adapter, MoELayer


class GatedSharedExpert(nn.Module):
    """``sigmoid(gate(h)) * expert(h)``: Qwen2-MoE's shared expert as one callable (shares the model's modules)."""

    def __init__(self, expert: nn.Module, gate: nn.Module):
        super().__init__()
        self.expert, self.gate = expert, gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(h)) * self.expert(h)


class Qwen2MoeLayer(MoELayer):
    scoring = "softmax(fp32) -> top-k [-> renormalize if norm_topk_prob]"

    @property
    def shared_experts(self) -> nn.Module | None:
        expert = getattr(self.block, "shared_expert", None)
        if expert is None:
            return None
        return GatedSharedExpert(expert, self.block.shared_expert_gate)


class Qwen2MoeAdapter(Adapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    layer_cls = Qwen2MoeLayer

    def is_moe_block(self, index, block, config) -> bool:
        sparse = (index not in (config.mlp_only_layers or ()) and config.num_experts > 0
                  and (index + 1) % config.decoder_sparse_step == 0)
        return sparse and super().is_moe_block(index, block, config)

    @staticmethod
    def tiny_config():
        """Layer 1 is dense through ``mlp_only_layers`` (MoE layers 0, 2, 3)."""
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**TINY_SHAPE, intermediate_size=128, moe_intermediate_size=64,
                              shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                              mlp_only_layers=[1], decoder_sparse_step=1)
