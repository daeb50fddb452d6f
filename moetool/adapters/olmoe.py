"""OLMoE: every decoder layer's ``mlp`` is MoE.

Router ``mlp.gate`` (weight ``[E, H]``, no bias): logits in the model dtype, softmax in fp32,
top-k, ``/ sum`` only if ``norm_topk_prob`` (False for the released OLMoE checkpoints, so the
weights do not sum to one); weights cast back to the logits' dtype. Expert width is
``intermediate_size`` (there is no separate ``moe_intermediate_size``). No shared expert.
"""

from __future__ import annotations

from .base import TINY_SHAPE, Adapter, MoELayer


class OlmoeLayer(MoELayer):
    scoring = "softmax(fp32) -> top-k [-> renormalize if norm_topk_prob]"


class OlmoeAdapter(Adapter):
    family = "olmoe"
    model_types = ("olmoe",)
    layer_cls = OlmoeLayer

    @staticmethod
    def tiny_config():
        from transformers import OlmoeConfig

        return OlmoeConfig(**TINY_SHAPE, intermediate_size=128, num_experts=8, num_experts_per_tok=2, eos_token_id=2)
