"""gpt-oss: every decoder layer's ``mlp`` is MoE; biased router, interleaved and transposed experts.

* Router ``mlp.router``: weight ``[E, H]`` **and bias** ``[E]``; top-k on the raw logits, then
  softmax over the k chosen logits only (in the logits' dtype): rule ``topk-softmax``, identified at load by the
  generic layer this one extends. π = softmax over all n logits.
* Experts store ``gate_up_proj [E, H, 2I]`` (``x @ W``, transposed vs. the common layout) with
  gate and up **interleaved** (gate ``[..., ::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]``,
  ``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``. The canonical views are transposes
  (no copies).
* Clamped SwiGLU (``GptOssExperts._apply_gate``): ``g = clamp(gate, max=limit)``,
  ``act = g * sigmoid(alpha * g)``, ``glu = act * (clamp(up, ±limit) + 1)`` (alpha 1.702, limit 7).
* The block returns ``(h, router_scores)``. MXFP4 checkpoints on a GPU: transformers' ``Mxfp4GptOssMLP``, whose
  kernel path bypasses the router and experts modules; the engine routes it through them while it hooks
  (:func:`moetool.adapters.quant.route_through_modules`) and probes dequantize its blocks (:mod:`.quant`).

What is particular here: the experts' layout and clamped SwiGLU; the routing is the generic layer's.
"""

from __future__ import annotations

import torch

from .base import TINY_SHAPE, ExpertWeights
from .generic import GenericAdapter, GenericLayer


class GptOssLayer(GenericLayer):
    def expert_weights(self) -> ExpertWeights:
        ex = self.experts
        gate_up, bias = ex.gate_up_proj.transpose(1, 2), ex.gate_up_proj_bias  # [n, 2I, d] interleaved
        return ExpertWeights(gate=gate_up[:, ::2], up=gate_up[:, 1::2], down=ex.down_proj.transpose(1, 2),
                             gate_bias=bias[:, ::2], up_bias=bias[:, 1::2], down_bias=ex.down_proj_bias)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.experts.limit)
        return gate * torch.sigmoid(gate * self.experts.alpha)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.experts.limit
        return (up.clamp(min=-limit, max=limit) + 1) * self.act(gate)


class GptOssAdapter(GenericAdapter):
    family = "gpt_oss"
    layer_cls = GptOssLayer

    @staticmethod
    def tiny_config():
        """Plain RoPE (the yarn default warns at this size); ``swiglu_limit=0.3``: the clamps bind on random weights."""
        from transformers import GptOssConfig

        return GptOssConfig(**TINY_SHAPE, head_dim=32, intermediate_size=128, sliding_window=16, num_local_experts=8,
                            num_experts_per_tok=2, swiglu_limit=0.3,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
