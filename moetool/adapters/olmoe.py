"""OLMoE: every decoder layer's ``mlp`` is MoE.

Router ``mlp.gate`` (weight ``[E, H]``, no bias): softmax in fp32, top-k, ``/ sum`` only if ``norm_topk_prob``
(False for the released checkpoints, so the weights do not sum to one): rule ``softmax-topk`` or
``softmax-topk-renorm``, identified at load by the generic adapter. Expert width is ``intermediate_size``. No
shared expert. This file names the family and its tiny test config.
"""

from __future__ import annotations

from .base import TINY_SHAPE
from .generic import GenericAdapter


class OlmoeAdapter(GenericAdapter):
    family = "olmoe"
    model_types = ("olmoe",)

    @staticmethod
    def tiny_config():
        from transformers import OlmoeConfig

        return OlmoeConfig(**TINY_SHAPE, intermediate_size=128, num_experts=8, num_experts_per_tok=2, eos_token_id=2)
