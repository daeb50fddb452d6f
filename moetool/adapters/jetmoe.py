"""JetMoE (``jetmoe``): a dispatch-tuple router; the MLP MoE analysed, the mixture-of-attention experts not.

What ``JetMoeMoE.forward`` (each decoder layer's ``mlp``) does for ``h [T, d]``:

* ``JetMoeTopKGating``: ``logits = layer(h).float()``, top-K of the logits, ``softmax`` over the K
  (``topk-softmax``), cast to h's dtype; it returns dispatch tuples (tokens sorted by expert, per-expert counts), not
  ``(logits, w, idx)``;
* the experts are ``input_linear`` (``[n, 2I, d]``, gate first half) and ``output_linear`` (``[n, d, I]``),
  ``JetMoeParallelExperts`` run per sorted group as ``experts(inputs, expert_size)``; the weighted outputs are
  summed per token and the block adds one ``bias [d]``.

moetool's contract is ``router(h) -> (logits, w, idx)`` and ``experts(h, idx, w)``. So the block's class is swapped
(once, per instance; parameters and state dict unchanged: the views are not registered) for one whose forward
calls a router view (the model's router projection, top-K and softmax, exactly as ``JetMoeTopKGating`` computes
them) and an experts view (the model's own dispatch: sort by expert, ``input_linear`` / ``output_linear`` per
group, weight, ``index_add``), then adds the block's bias: the same operations on the same tensors as the original
forward. The bias is the layer's :meth:`post_step` (``block = Σ w E(h) + bias``).

The attention of every layer is a mixture of experts too (``JetMoeMoA``: per-expert query and output projections
chosen by its own top-K router, inside the attention). Its routing is not reported: moetool analyses the MLP MoE
(``describe()['attention_experts']`` says so). Its attention probabilities (softmax, eager) are what attention-aware
routing reads (:attr:`attention`: ``self_attention``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..configs import text_config
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer, decoder_layers
from .generic import restore_views as restore  # noqa: F401 - undo the class swap

MOA_NOTE = ("mixture of attention experts (JetMoeMoA, top-K query/output projections inside the attention): not "
            "analysed; the MLP MoE is")


class DispatchRouterView(nn.Module):
    """``(logits, w, idx)`` of a ``JetMoeTopKGating`` (its projection, top-K, softmax over the K)."""

    def __init__(self, gating: nn.Module):
        super().__init__()
        self.gating = gating
        self.top_k = int(gating.top_k)

    @property
    def weight(self) -> torch.Tensor:
        return self.gating.layer.weight

    def forward(self, hidden_states: torch.Tensor):
        logits = self.gating.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        return logits, torch.softmax(top_k_logits, dim=1).type_as(hidden_states), top_k_indices


class DispatchExpertsView(nn.Module):
    """``experts(h, idx, w)``: the block's own dispatch over ``input_linear`` / ``output_linear``, weighted and summed
    per token (no bias)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.input_linear, self.output_linear, self.act_fn = block.input_linear, block.output_linear, block.activation
        self.num_experts = int(block.input_linear.num_experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        K = top_k_index.shape[-1]
        expert_size = torch.bincount(top_k_index.flatten(), minlength=self.num_experts).tolist()
        _, index_sorted_experts = top_k_index.flatten().sort(0)
        batch_index = index_sorted_experts.div(K, rounding_mode="trunc")
        batch_gates = top_k_weights.flatten()[index_sorted_experts]
        gate, up = self.input_linear(hidden_states[batch_index], expert_size).chunk(2, dim=-1)
        out = self.output_linear(self.act_fn(gate) * up, expert_size) * batch_gates[:, None]
        zeros = torch.zeros(hidden_states.shape, dtype=out.dtype, device=out.device)
        return zeros.index_add(0, batch_index, out)


class AddBias(nn.Module):
    """``x + bias`` (the block's bias, after the experts' sum)."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def _forward(self, layer_input: torch.Tensor) -> torch.Tensor:
    router, experts = self.__dict__["_moetool_views"]
    bsz, length, emb_size = layer_input.size()
    h = layer_input.reshape(-1, emb_size)
    _, w, idx = router(h)
    return experts(h, idx, w).view(bsz, length, emb_size) + self.bias


@functools.lru_cache(maxsize=None)
def _swapped(original: type) -> type:
    return type(f"{original.__name__}WithViews", (original,), {"forward": _forward, "_moetool_original": original})


def _views(block: nn.Module) -> tuple[DispatchRouterView, DispatchExpertsView]:
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (DispatchRouterView(block._modules["router"]), DispatchExpertsView(block))
        block.__class__ = _swapped(type(block))
    return block.__dict__["_moetool_views"]


class DispatchLayer(GenericLayer):
    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        router_view, experts_view = _views(block)
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)

    @property
    def attention(self) -> nn.Module | None:
        return getattr(self.decoder_layer, "self_attention", None)  # softmax attention over MoA queries

    def post_step(self) -> nn.Module | None:
        return AddBias(self.block.bias)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.experts.act_fn(gate)

    def expert_weights(self) -> ExpertWeights:
        gate_up = self.experts.input_linear.weight  # [n, 2I, d], gate first
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=self.experts.output_linear.weight)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "attention_experts": MOA_NOTE,
                "note": "the MLP MoE; the attention experts (MoA) are not analysed"}


class JetMoeAdapter(GenericAdapter):
    family = "dispatch-tuples"
    layer_cls = DispatchLayer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        return [self.layer_cls(i, dl, dl.mlp, dl.mlp.router, dl.mlp, config)
                for i, dl in enumerate(decoder_layers(model)) if hasattr(getattr(dl, "mlp", None), "input_linear")]
