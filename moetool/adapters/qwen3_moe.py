"""Qwen3-MoE: Qwen2-MoE's layout and routing without the shared expert.

Same sparse-layer rule (``mlp_only_layers``, ``decoder_sparse_step``) and the same router
(``mlp.gate``: softmax in fp32 -> top-k -> ``/ sum`` if ``norm_topk_prob``, which the released
checkpoints set), weights cast back to the logits' dtype. No shared expert.
"""

from __future__ import annotations

from .base import TINY_SHAPE
from .qwen2_moe import Qwen2MoeAdapter


class Qwen3MoeAdapter(Qwen2MoeAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)

    @staticmethod
    def tiny_config():
        """``decoder_sparse_step=2``: layers 0 and 2 are dense (MoE layers 1, 3); renormalised top-k."""
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**TINY_SHAPE, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                              num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True)
