"""DeepSeek-V3 (and the same router in GLM-4-MoE): sigmoid scores, bias-corrected grouped top-k.

* Decoder layer ``i`` is MoE iff ``i >= config.first_k_dense_replace``; earlier layers are dense (no ``experts``,
  so the generic adapter's structural search skips them).
* Router ``mlp.gate`` (weight ``[E, H]``) computes its logits in **fp32** (input and weight cast), whatever the
  model dtype; everything after stays fp32, so the weights are fp32.
* Scores ``s = sigmoid(logits)``. Selection ranks ``s + gate.e_score_correction_bias`` (a buffer ``[E]``,
  load-balancing only) inside the ``topk_group`` best of ``n_group`` expert groups, a group scored by the sum of
  its two best biased scores. Weights are the *unbiased* ``s`` of the chosen, ``/ (sum + 1e-20)`` if
  ``norm_topk_prob``, then ``x routed_scaling_factor`` (so they sum to the factor, not to one): rule
  ``sigmoid-topk[-renorm]`` with bias, groups and scale, identified at load (moetool/adapters/rules.py).
* π: ``s`` normalised to sum to one over all n experts.
* ``mlp.shared_experts``: one ungated dense MLP added to every token.

Nothing here is particular beyond the tiny test config.
"""

from __future__ import annotations

from .base import TINY_SHAPE
from .generic import GenericAdapter
from .rules import group_mask

__all__ = ["DeepseekV3Adapter", "group_mask"]


class DeepseekV3Adapter(GenericAdapter):
    family = "deepseek_v3"

    @staticmethod
    def tiny_config():
        """Layer 0 dense (``first_k_dense_replace=1``); 8 experts in 2 groups, 1 group kept, k=2."""
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**{**TINY_SHAPE, "num_key_value_heads": 4}, intermediate_size=128,
                                moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                v_head_dim=32)
