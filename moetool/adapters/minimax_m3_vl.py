"""MiniMax-M3-VL (``minimax_m3_vl`` and its text decoder ``minimax_m3_vl_text``): M2 routing, gpt-oss-style
clamped SwiGLU experts on the standard layout, the routed output scaled in the block.

* Router ``mlp.gate``: sigmoid scores, top-K of score + correction bias, weights = chosen scores / their sum
  (identified at load by the generic adapter).
* Experts without ``act_fn``: ``_apply_gate`` on ``gate_up_proj [E, 2I, H]`` (gate first half, **not**
  interleaved): ``g = clamp(gate, max=L)``, ``act = g * sigmoid(alpha g)``, ``glu = (clamp(up, -L, L) + 1) * act``.
* The block returns ``experts(h, idx, w) * routed_scaling_factor + shared_experts(h)``: the factor sits on the
  block, after the experts, so the routing weights keep summing to one (``weight_scale`` 1) and the layer's
  :attr:`output_scale` says what the block multiplies the routed output by.
"""

from __future__ import annotations

import torch

from .generic import GenericAdapter, GenericLayer


class MiniMaxM3Layer(GenericLayer):
    @property
    def output_scale(self) -> float:
        """What the block multiplies the experts' output by (``routed_scaling_factor`` on the block)."""
        return float(getattr(self.block, "routed_scaling_factor", 1.0) or 1.0)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.experts.swiglu_limit)
        return g * torch.sigmoid(g * self.experts.swiglu_alpha)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.experts.swiglu_limit
        return (up.clamp(min=-limit, max=limit) + 1.0) * self.act(gate)

    def describe(self):
        return {**super().describe(), "output_scale": self.output_scale}


class MiniMaxM3Adapter(GenericAdapter):
    family = "clamped-swiglu-alpha"
    layer_cls = MiniMaxM3Layer
