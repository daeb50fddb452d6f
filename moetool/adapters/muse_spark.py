"""Muse Spark (``muse_spark``, its text decoder ``muse_spark_text``): experts in a projected width.

What the model does (``MuseSparkMoE.forward``) for the MoE input ``h [T, d]``:

* ``gate(h)``: ``logits = linear(h, R) x output_multiplier`` in fp32, sigmoid scores, top-K of score + correction
  bias, weights = chosen scores / (sum + 1e-15) x ``routed_scaling_factor`` (the generic identification, with
  the router's ``output_multiplier``: ``sigmoid-topk-renorm``);
* ``x = pre_expert_norm(pre_expert_proj(h))`` (width ``moe_hidden_size``), ``experts(x, idx, w)`` where each
  expert's output goes through ``post_expert_norm`` before its weight, then ``post_expert_proj`` back to ``d``.

moetool's contract is ``experts(h, idx, w)`` on the router's input, in the model's width. So the block's class is
swapped (once, per instance; parameters and state dict unchanged: the view is not registered) for one whose
``experts`` is a view -- the model's own ``pre_expert_proj``, ``pre_expert_norm``, experts and
``post_expert_proj``, in that order -- and whose own three projection/norm attributes are the identity. Same modules,
same order of operations. ``expert_input(h)`` is the projected, normed ``x`` (probes see what the experts see);
``expert_weights()`` are the experts' own in the projected width; ``expert_output(y)`` maps one expert's output
back (``post_expert_proj(post_expert_norm(y))``: the projection is linear without bias, so the block's output is
``Σ w expert_output(y)``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer
from .generic import restore_views as restore  # noqa: F401 - undo the class swap

_IDENTITY = nn.Identity()
_PROJECTED = ("pre_expert_proj", "pre_expert_norm", "post_expert_proj")


class ProjectedExpertsView(nn.Module):
    """``experts(h, idx, w)`` on the router's input ``h``: projected in, the model's experts, projected out."""

    def __init__(self, experts: nn.Module, pre_proj: nn.Module, pre_norm: nn.Module, post_proj: nn.Module):
        super().__init__()
        self.experts = experts
        # not registered: the view's parameters are the experts' (``plan`` counts the dense projections apart)
        for name, m in (("pre_proj", pre_proj), ("pre_norm", pre_norm), ("post_proj", post_proj)):
            object.__setattr__(self, name, m)

    def project_in(self, h: torch.Tensor) -> torch.Tensor:
        return self.pre_norm(self.pre_proj(h))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.post_proj(self.experts(self.project_in(hidden_states), top_k_index, top_k_weights))


@functools.lru_cache(maxsize=None)
def _swapped(original: type) -> type:
    """``original`` whose ``experts`` is the view and whose projections and pre-norm are the identity."""
    return type(f"{original.__name__}WithViews", (original,), {
        "experts": property(lambda self: self.__dict__["_moetool_views"][0]),
        **{a: property(lambda self: _IDENTITY) for a in _PROJECTED}, "_moetool_original": original})


def _view(block: nn.Module) -> ProjectedExpertsView:
    if "_moetool_views" not in block.__dict__:
        m = block._modules
        block.__dict__["_moetool_views"] = (ProjectedExpertsView(m["experts"], *(m[a] for a in _PROJECTED)),)
        block.__class__ = _swapped(type(block))
    return block.__dict__["_moetool_views"][0]


class ProjectedExpertsLayer(GenericLayer):
    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        super().__init__(index, decoder_layer, block, router, _view(block), config)

    @property
    def _experts(self) -> nn.Module:
        return self.experts.experts  # the model's MuseSparkExperts

    def expert_weights(self) -> ExpertWeights:
        gate_up = self._experts.gate_up_proj  # [n, 2I, d_e], gate first
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=self._experts.down_proj)

    def expert_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts.project_in(h)

    def expert_output(self, y: torch.Tensor) -> torch.Tensor:
        return self.experts.post_proj(self._experts.post_expert_norm(y))

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self._experts.act_fn(gate)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "expert_width": int(self._experts.gate_up_proj.shape[-1]),
                "note": "experts in a projected width"}


class MuseSparkAdapter(GenericAdapter):
    family = "projected-experts"
    layer_cls = ProjectedExpertsLayer
