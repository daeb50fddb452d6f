"""Mixtral (and its twin MiniMax): every decoder layer's ``mlp`` is MoE.

Router ``mlp.gate`` (weight ``[E, H]``): logits in the hidden dtype, softmax in fp32,
top-k, renormalise; the weights stay fp32.
"""

from __future__ import annotations

from .base import Adapter, MoELayer


class MixtralLayer(MoELayer):
    weights_fp32 = True
    scoring = "softmax(fp32) -> top-k -> renormalize"

    @property
    def renormalize(self) -> bool:
        return True


class MixtralAdapter(Adapter):
    family = "mixtral"
    model_types = ("mixtral", "minimax")
    layer_cls = MixtralLayer

    @staticmethod
    def tiny_config():
        from transformers import MixtralConfig

        return MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=256)
