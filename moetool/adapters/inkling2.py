"""Inkling-2 (``inkling2``, ``inkling2_loop`` and their text decoders ``*_text``): sigmoid routing, softcapped SwiGLU experts.

* Router ``mlp.gate`` (``Inkling2TopKRouter``, fp32): ``scoring_func`` (sigmoid) scores, top-K of score +
  correction bias, weights = chosen scores / (sum + 1e-20) x ``routed_scaling_factor`` (identified at load by
  the generic adapter).
* The experts' activation takes gate and up together (``Inkling2SoftcappedSwiGLU``, in fp32):
  ``glu = cap_g(gate) * sigmoid(gate) * cap_u(up)`` with ``cap_c(x) = c * tanh(x / c)``
  (``mlp_gate_softcap``, ``mlp_up_softcap``); here ``act(gate) = cap_g(gate) * sigmoid(gate)``.
* No shared experts; the block's output is the experts' output.
"""

from __future__ import annotations

import torch

from .generic import GenericAdapter, GenericLayer


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class SoftcappedSwiGLULayer(GenericLayer):
    def act(self, gate: torch.Tensor) -> torch.Tensor:
        fn = self.experts.act_fn
        g = gate.float()
        return (_softcap(g, fn.gate_softcap.softcap) * torch.sigmoid(g)).to(gate.dtype)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.experts.act_fn(gate, up)  # the model's own module: gate and up together


class Inkling2Adapter(GenericAdapter):
    family = "softcapped-swiglu"
    layer_cls = SoftcappedSwiGLULayer
