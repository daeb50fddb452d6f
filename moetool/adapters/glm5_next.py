"""GLM-5-Next and Hunyuan-V4 (``glm5_next``, ``hy_v4``, its vision-language ``hy_v4_vl``): DeepSeek-V3 routing,
clamped SwiGLU experts.

* Router ``mlp.gate``: sigmoid, correction bias, groups, ``routed_scaling_factor`` (identified at load by the
  generic adapter).
* The experts have no ``act_fn``: ``_apply_gate`` computes ``silu(clamp(gate, max=L)) * clamp(up, -L, L)`` with
  ``L = swiglu_limit`` on the standard fused layout (``gate_up_proj [E, 2I, H]``, gate first; ``down_proj
  [E, H, I]``). Here ``act(gate) = silu(clamp(gate, max=L))`` and ``glu = act(gate) * clamp(up, -L, L)``.
* The block adds ``shared_experts(h)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .generic import GenericAdapter, GenericLayer


class ClampedSwiGLULayer(GenericLayer):
    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.experts.swiglu_limit))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.experts.swiglu_limit
        return self.act(gate) * up.clamp(min=-limit, max=limit)


class ClampedSwiGLUAdapter(GenericAdapter):
    family = "clamped-swiglu"
    layer_cls = ClampedSwiGLULayer
