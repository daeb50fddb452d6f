"""Qwen1.5/Qwen2-MoE: sparse ``mlp`` blocks by a config rule, plus a gated shared expert.

* Decoder layer ``i`` is MoE iff ``i not in config.mlp_only_layers`` and ``(i + 1) % config.decoder_sparse_step
  == 0`` (and ``num_experts > 0``); the others hold a dense ``Qwen2MoeMLP`` (no ``experts``), so the generic
  adapter's structural search finds exactly the MoE ones.
* Router ``mlp.gate``: softmax in fp32 -> top-k -> ``/ sum`` only if ``norm_topk_prob`` (default False), weights
  cast back to the logits' dtype (identified at load).
* The block adds ``sigmoid(shared_expert_gate(h)) * shared_expert(h)`` to the routed output
  (:class:`moetool.adapters.generic.GatedSharedExpert`).
"""

from __future__ import annotations

from .base import TINY_SHAPE
from .generic import GatedSharedExpert, GenericAdapter

__all__ = ["GatedSharedExpert", "Qwen2MoeAdapter"]


class Qwen2MoeAdapter(GenericAdapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)

    @staticmethod
    def tiny_config():
        """Layer 1 is dense through ``mlp_only_layers`` (MoE layers 0, 2, 3)."""
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**TINY_SHAPE, intermediate_size=128, moe_intermediate_size=64,
                              shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                              mlp_only_layers=[1], decoder_sparse_step=1)
