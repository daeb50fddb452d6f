"""ERNIE-4.5-VL-MoE (``ernie4_5_vl_moe``): text and vision expert groups in one layer; text tokens use the text group.

Each sparse decoder layer's ``mlp`` (``Ernie4_5_VLMoeMoeBlock``) holds two complete MoE blocks, ``text_moe`` and
``vision_moe`` (each its own router over its own ``num_experts`` experts, ERNIE-4.5 routing: softmax, top-K of
π + correction bias, weights = π / clamp(sum, ``moe_norm_min``)), and optional ``shared_experts`` added to both.
The model sends a token to one group by its ``moe_mm_token_type_ids`` (0: text); without them (a text-only
input) every token goes through ``text_moe``.

moetool feeds text, so the MoE layer it analyses is the **text group**: router ``mlp.text_moe.gate``, experts
``mlp.text_moe.experts``, shared experts ``mlp.shared_experts``; the vision group is not routed for text tokens
and is left out (``describe()`` says ``expert_group: text``). The rule is identified on the text router at load.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import text_config
from .base import MoELayer
from .generic import GenericAdapter, GenericLayer, decoder_layers


class TextGroupLayer(GenericLayer):
    """The text expert group of a layer with per-modality groups (the block is the layer's whole MoE block)."""

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "expert_group": "text (text tokens route within the text experts; the "
                                                      "vision group is not used for text)",
                "note": "text tokens within the text expert group"}


class Ernie45VLMoeAdapter(GenericAdapter):
    family = "modality-groups"
    layer_cls = TextGroupLayer

    def layers(self, model: nn.Module) -> list[MoELayer]:
        config = text_config(model.config)
        out = []
        for i, dl in enumerate(decoder_layers(model)):
            block = getattr(dl, "mlp", None)
            text = getattr(block, "text_moe", None)
            if isinstance(text, nn.Module):
                out.append(self.layer_cls(i, dl, block, text.gate, text.experts, config))
        return out
