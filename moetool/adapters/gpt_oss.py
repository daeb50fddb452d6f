"""gpt-oss: every decoder layer's ``mlp`` is MoE; biased router, interleaved and transposed experts.

* Router ``mlp.router``: weight ``[E, H]`` **and bias** ``[E]``; top-k on the raw logits, then
  softmax over the k chosen logits only (in the logits' dtype). π = softmax over all n logits.
* Experts store ``gate_up_proj [E, H, 2I]`` (``x @ W``, transposed vs. the common layout) with
  gate and up **interleaved** (gate ``[..., ::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias [E, 2I]``,
  ``down_proj [E, I, H]`` and ``down_proj_bias [E, H]``. The canonical views are transposes
  (no copies).
* Clamped SwiGLU (``GptOssExperts._apply_gate``): ``g = clamp(gate, max=limit)``,
  ``act = g * sigmoid(alpha * g)``, ``glu = act * (clamp(up, ±limit) + 1)`` (alpha 1.702, limit 7).
* The block returns ``(h, router_scores)``; MXFP4 checkpoints must be loaded with
  ``dequantize=True`` (the kernels bypass the router and experts modules).
"""

from __future__ import annotations

import torch

from .base import TINY_SHAPE, Adapter, ExpertWeights, MoELayer


class GptOssLayer(MoELayer):
    scoring = "top-k on logits (with router bias) -> softmax over the k"

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

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The raw logits (top-k before any softmax)."""
        return logits

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.gather(-1, idx), dim=-1, dtype=logits.dtype)


class GptOssAdapter(Adapter):
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    layer_cls = GptOssLayer
    router_attr = "router"

    @staticmethod
    def tiny_config():
        """Plain RoPE (the yarn default warns at this size); ``swiglu_limit=0.3``: the clamps bind on random weights."""
        from transformers import GptOssConfig

        return GptOssConfig(**TINY_SHAPE, head_dim=32, intermediate_size=128, sliding_window=16, num_local_experts=8,
                            num_experts_per_tok=2, swiglu_limit=0.3,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
