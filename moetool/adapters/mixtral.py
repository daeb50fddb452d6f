"""Mixtral (and its twin MiniMax): every decoder layer's ``mlp`` is MoE.

Router ``mlp.gate`` (weight ``[E, H]``): logits in the hidden dtype, softmax in fp32, top-k, renormalise; the
weights stay fp32 (rule ``softmax-topk-renorm``, identified at load by the generic adapter). Nothing else is
particular: this file names the family and its tiny test config.
"""

from __future__ import annotations

from .generic import GenericAdapter


class MixtralAdapter(GenericAdapter):
    family = "mixtral"

    @staticmethod
    def tiny_config():
        from transformers import MixtralConfig

        return MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=256)
