"""GLM-5-Next, Hunyuan-V4 (and its vision-language ``hy_v4_vl``) and DeepSeek-V4 (``glm5_next``, ``hy_v4``,
``deepseek_v4``): clamped SwiGLU experts (GLM-5-Next and Hunyuan-V4 route as DeepSeek-V3).

DeepSeek-V4 routes by ``sqrtsoftplus`` scores (rule ``sqrtsoftplus-topk-renorm``) and its first layers are
hash-routed (``DeepseekV4HashRouter``: experts by token id; the generic layer identifies and reports them, see
``GenericLayer.hash_routed``); its experts store the limit as ``limit`` and apply their own ``act_fn``.

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
    @property
    def limit(self) -> float:
        limit = getattr(self.experts, "swiglu_limit", None)
        return self.experts.limit if limit is None else limit

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        act = getattr(self.experts, "act_fn", F.silu)
        return act(gate.clamp(max=self.limit))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up.clamp(min=-self.limit, max=self.limit)


class ClampedSwiGLUAdapter(GenericAdapter):
    family = "clamped-swiglu"
    layer_cls = ClampedSwiGLULayer
