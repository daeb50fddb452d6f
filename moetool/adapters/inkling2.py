"""Inkling-2 (``inkling2``, ``inkling2_loop`` and their text decoders ``*_text``): sigmoid routing, softcapped SwiGLU experts.

* Router ``mlp.gate`` (``Inkling2TopKRouter``, fp32): ``scoring_func`` (sigmoid) scores, top-K of score +
  correction bias, weights = chosen scores / (sum + 1e-20) x ``routed_scaling_factor`` (identified at load by
  the generic adapter).
* The experts' activation takes gate and up together (``Inkling2SoftcappedSwiGLU``, in fp32):
  ``glu = cap_g(gate) * sigmoid(gate) * cap_u(up)`` with ``cap_c(x) = c * tanh(x / c)``
  (``mlp_gate_softcap``, ``mlp_up_softcap``); here ``act(gate) = cap_g(gate) * sigmoid(gate)``.
* No shared experts; the block's output is the experts' output.
* The MoE block reads ``post_attention_layernorm(mlp_input(block_states, h)[0])``: ``mlp_input`` (block attention
  residuals) mixes the stream with the earlier blocks' outputs the decoder layer is handed beside it, and at a block
  boundary the stream after attention restarts from the attention's output: the router input is no function of the
  residual stream entering the layer alone (:attr:`SoftcappedSwiGLULayer.pre_router_norm` refuses).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import MoetoolError
from .generic import GenericAdapter, GenericLayer


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class SoftcappedSwiGLULayer(GenericLayer):
    @property
    def pre_router_norm(self) -> nn.Module:
        """None exists: the block reads a learned mix of the stream and the earlier blocks' outputs (module
        docstring) -- a one-line :class:`MoetoolError`."""
        raise MoetoolError(f"layer {self.index}'s MoE block reads a learned mix of the residual stream and the earlier "
                           f"blocks' outputs (Inkling-2's block attention residuals, mlp_input): its router input is "
                           f"no norm of the stream entering the layer")

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        fn = self.experts.act_fn
        g = gate.float()
        return (_softcap(g, fn.gate_softcap.softcap) * torch.sigmoid(g)).to(gate.dtype)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.experts.act_fn(gate, up)  # the model's own module: gate and up together


class Inkling2Adapter(GenericAdapter):
    family = "softcapped-swiglu"
    layer_cls = SoftcappedSwiGLULayer
