"""Aria (and its text decoder ``aria_text``): routing as found by the generic adapter, experts stored for
grouped GEMM.

* Router ``mlp.router`` (``AriaTextTopKRouter``): top-K on the raw logits, softmax over the K chosen (the generic
  adapter identifies the rule at load).
* Experts (``AriaExperts``, ``@use_experts_implementation(is_transposed=True)``) store ``gate_up_proj [E, H, 2I]``
  and ``down_proj [E, I, H]`` as (in, out), ``x @ W``: gate is the first half of ``gate_up`` (``chunk(2)``), up
  the second; the routed experts are always SiLU-gated (``act_fn``), whatever ``hidden_act`` says.
* The block adds ``shared_experts(h)`` to the routed output.
"""

from __future__ import annotations

from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer


class AriaLayer(GenericLayer):
    def expert_weights(self) -> ExpertWeights:
        gate_up = self.experts.gate_up_proj.transpose(1, 2)  # [n, 2I, d], views
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:],
                             down=self.experts.down_proj.transpose(1, 2))


class AriaAdapter(GenericAdapter):
    family = "aria-transposed-experts"
    layer_cls = AriaLayer
