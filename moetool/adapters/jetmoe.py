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
chosen by its own top-K router, inside the attention): a second routed layer type. Its router's rule is identified
at load like the MLP MoE's and reported apart (``describe()['attention_experts']``: rule, experts, top-K, and that
it is not analysed); the commands analyse the MLP MoE only (the MoA experts are no ``experts(h, idx, w)`` of the
layer input: their outputs pass through the attention). Its attention probabilities (softmax, eager) are what attention-aware
routing reads (:attr:`attention`: ``self_attention``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..configs import text_config
from ..errors import MoetoolError
from . import rules
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer, _candidates, _materialized, decoder_layers
from .generic import restore_views as restore  # noqa: F401 - undo the class swap

MOA_NOTE = ("mixture of attention experts (JetMoeMoA: top-K query/output projections inside the attention): "
            "routing identified at load, not analysed by the commands (they analyse the MLP MoE)")
_N_TOKENS = 256


def moa_routing(decoder_layer: nn.Module) -> dict[str, Any] | None:
    """The attention experts' routing, identified on their own router at load (as the MLP MoE's): ``{rule, n_experts,
    top_k}``; None without attention experts. A rule no catalogue entry reproduces is one line, as for the MLP MoE."""
    moa = getattr(getattr(decoder_layer, "self_attention", None), "experts", None)
    gating = getattr(moa, "router", None)
    if not isinstance(gating, nn.Module) or not hasattr(gating, "layer"):
        return None
    view = DispatchRouterView(gating)
    if view.weight.device.type == "meta":
        view = _materialized(view)
    w = view.weight
    h = torch.randn(_N_TOKENS, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
    with torch.no_grad():
        logits, weights, idx = view(h)
        try:
            rule, _ = rules.identify(logits, idx, weights, _candidates(view, int(idx.shape[-1]), None))
        except rules.NoRuleMatches as e:
            raise MoetoolError(f"jetmoe: the attention experts' router matches no known routing rule ({e})") from None
    return {"rule": rule.name, "n_experts": int(w.shape[0]), "top_k": int(idx.shape[-1])}


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
        self.attention_routing = moa_routing(decoder_layer)  # the second routed layer type, reported apart

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
        d = {**super().describe(), "note": "the MLP MoE; the attention experts (MoA) are not analysed"}
        if self.attention_routing is not None:
            a = self.attention_routing
            d["note"] = (f"the MLP MoE; attention experts (MoA): {a['rule']}, top-{a['top_k']} of {a['n_experts']}, "
                         f"not analysed")
            d["attention_experts"] = {**a, "analysed": False, "what": MOA_NOTE}
        return d


class JetMoeAdapter(GenericAdapter):
    family = "dispatch-tuples"
    layer_cls = DispatchLayer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        return [self.layer_cls(i, dl, dl.mlp, dl.mlp.router, dl.mlp, config)
                for i, dl in enumerate(decoder_layers(model)) if hasattr(getattr(dl, "mlp", None), "input_linear")]
