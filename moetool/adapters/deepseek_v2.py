"""DeepSeek-V2: the V3 layout (dense first ``first_k_dense_replace`` layers, fp32 router logits, ungated
``shared_experts``) with softmax routing and no renormalisation.

* Scores ``p = softmax(logits)`` in fp32; π = ``p``.
* ``gate.topk_method``: ``greedy`` = plain top-k of ``p`` (V2-Lite); ``group_limited_greedy`` = top-k within the
  ``topk_group`` best of ``n_group`` groups, a group scored by its best ``p`` (V2, V2.5).
* Weights = ``p`` of the chosen ``x routed_scaling_factor``. The 5.23 router ignores ``config.norm_topk_prob``:
  it never renormalises. Rule ``softmax-topk`` (identified at load).

What is particular: the router reads ``topk_method`` at every call, so :class:`DeepseekV2Layer` does too (a
change after load is followed, not frozen at identification).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import TINY_SHAPE
from .deepseek_v3 import DeepseekV3Adapter
from .generic import GenericLayer
from .rules import Params


class DeepseekV2Layer(GenericLayer):
    def _p(self) -> Params:
        r = self.router
        if r.topk_method == "group_limited_greedy":
            return replace(super()._p(), n_group=int(r.num_group), topk_group=int(r.topk_group), group_score="max")
        return replace(super()._p(), n_group=1, topk_group=1)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "topk_method": self.router.topk_method}


class DeepseekV2Adapter(DeepseekV3Adapter):
    family = "deepseek_v2"
    layer_cls = DeepseekV2Layer

    @staticmethod
    def tiny_config():
        """Layer 0 dense; 8 experts in 4 groups, 2 groups kept (``group_limited_greedy``), k=3, scale 1.5."""
        from transformers import DeepseekV2Config

        return DeepseekV2Config(**{**TINY_SHAPE, "num_key_value_heads": 4}, intermediate_size=128,
                                moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=3,
                                n_shared_experts=1, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                routed_scaling_factor=1.5, first_k_dense_replace=1, kv_lora_rank=32,
                                q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)
