"""Nemotron-H (and the text decoder of Nemotron-H Omni): hybrid Mamba / attention / MoE decoder, non-gated experts.

* The MoE block (``NemotronHMoE``, the ``mixer`` of the decoder layers whose block type is ``moe``) has a
  DeepSeek-V3 router (``gate``: sigmoid, correction bias, groups, scale; identified at load by the generic
  adapter), ``experts`` and ``shared_experts``.
* ``NemotronHExperts`` are **not gated**: ``down_proj @ act(up_proj @ x)`` with ``act = mlp_hidden_act``
  (relu^2), ``up_proj [E, I, H]``, ``down_proj [E, H, I]``. In the canonical view the gate *is* the up
  projection (one tensor) and ``glu(gate, up) = act(up)``: the "gate", "up" and "act" nodes are the up
  projection and its activation, "glu" what the down projection sees.
* ``moe_latent_size`` (experts in a projected width, ``fc1_latent_proj`` / ``fc2_latent_proj`` around them) is
  refused: the experts' input is then not the router's.
"""

from __future__ import annotations

import torch

from ..errors import MoetoolError
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer


class NemotronHLayer(GenericLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.config, "moe_latent_size", None) is not None:
            raise MoetoolError(f"{self.config.model_type}: MoE in a latent width (moe_latent_size="
                               f"{self.config.moe_latent_size}) is not supported: the experts' input is not the "
                               f"router's")

    def expert_weights(self) -> ExpertWeights:
        up = self.experts.up_proj  # [n, I, d]
        return ExpertWeights(gate=up, up=up, down=self.experts.down_proj)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(up)


class NemotronHAdapter(GenericAdapter):
    family = "nongated-relu2-experts"
    layer_cls = NemotronHLayer
