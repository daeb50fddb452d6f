"""DBRX (``dbrx``): the block routes, not the router; experts stored as flat per-expert row blocks.

What the model does (``DbrxFFN``, the ``ffn`` of every ``transformer.blocks[i]``):

* ``DbrxRouter`` (``router.layer``, an ``nn.Linear [E, H]`` without bias) returns the **logits only**;
* the block routes them itself: ``DbrxFFN.route_tokens_to_experts(logits)`` = softmax (in the logits' dtype),
  top-K, then the K probabilities divided by their p-norm (``moe_normalize_expert_weights``, 1 by default:
  the sum, i.e. rule ``softmax-topk-renorm``; ``None``: no renormalisation, ``softmax-topk``);
* ``experts(h [B, S, H], idx, w)`` (``DbrxExperts``): ``w1`` (gate) and ``v1`` (up) ``[E*I, H]``, ``w2``
  ``[E*I, H]`` used as ``x @ w2`` (so the down projection is its transpose per expert); it returns
  ``[B, -1, H]``.

moetool's contract is a router returning ``(logits, w, idx)`` and ``experts(h [T, d], idx, w) -> [T, d]``. So each
``DbrxFFN``'s class is swapped (once, per instance; parameters and state dict unchanged: the views are not
registered) for one whose forward reads the routing **where the block computes it**: a router view runs the
model's own router and the block's own ``route_tokens_to_experts`` and returns ``(logits, w, idx)``; an experts
view calls the model's own experts on the flattened input and returns ``[T, H]``. Same modules, same tensors,
same order of operations: the logits are bit for bit the original model's (tests/test_families.py). The
routing rule is identified on the router view by the generic layer, like any other family's. A p-norm other
than 1 (a config option no released DBRX uses) matches no catalogue rule and fails at load in one line.
"""

from __future__ import annotations

import torch
from torch import nn

from ..configs import text_config
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer
from .generic import restore_views as restore  # noqa: F401 - undo the class swap


class DbrxRouterView(nn.Module):
    """``(logits, w, idx)``: the model's ``DbrxRouter`` (logits), then its block's ``route_tokens_to_experts``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.router = block.router
        self.route = block.route_tokens_to_experts  # a bound method of the block (not a module: not registered)
        self.top_k = block.top_k

    @property
    def weight(self) -> torch.Tensor:
        return self.router.layer.weight

    def forward(self, hidden_states: torch.Tensor):
        logits = self.router(hidden_states)  # the model's own module (transformers' recorders see it)
        w, idx = self.route(logits)
        return logits, w, idx


class DbrxExpertsView(nn.Module):
    """``experts(h [T, H], idx, w) -> [T, H]``: the model's ``DbrxExperts`` on the flattened tokens."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts
        self.act_fn = experts.mlp.activation_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = self.experts(hidden_states, top_k_index, top_k_weights)
        return out.reshape(-1, out.shape[-1])


def _views(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The block's router and experts views, created once per block (not registered: the state dict is unchanged)."""
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (DbrxRouterView(block), DbrxExpertsView(block.experts))
        original = type(block)
        block.__class__ = type("DbrxMoeBlock", (original,), {"forward": _block_forward,
                                                             "_moetool_original": original})
    return block.__dict__["_moetool_views"]


def _block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``DbrxFFN.forward`` through the views: router, the block's routing, experts on the flattened tokens."""
    router, experts = self.__dict__["_moetool_views"]
    _, w, idx = router(hidden_states)
    out = experts(hidden_states.reshape(-1, hidden_states.shape[-1]), idx, w)
    return out.view(*hidden_states.shape[:-1], out.shape[-1])


class DbrxLayer(GenericLayer):
    """Routing identified on the router view; experts' weights as views of ``w1`` / ``v1`` / ``w2``."""

    def __init__(self, index, decoder_layer, block, router, experts, config):
        router_view, experts_view = _views(block)
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)

    @property
    def attention(self) -> nn.Module | None:
        return self.decoder_layer.norm_attn_norm.attn

    @property
    def shared_experts(self) -> nn.Module | None:
        return None

    @property
    def pre_router_norm(self) -> nn.Module:
        """The norm between the residual stream and the router (others' ``post_attention_layernorm``)."""
        return self.decoder_layer.norm_attn_norm.norm_2

    def expert_weights(self) -> ExpertWeights:
        mlp = self.experts.experts.mlp
        n, d = mlp.moe_num_experts, mlp.hidden_size
        w1, v1, w2 = (t.view(n, -1, d) for t in (mlp.w1, mlp.v1, mlp.w2))  # [n, I, d]
        return ExpertWeights(gate=w1, up=v1, down=w2.transpose(1, 2))

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.experts.act_fn(gate)

    def describe(self):
        return {**super().describe(), "routed_by": "DbrxFFN.route_tokens_to_experts (the block)"}


class DbrxAdapter(GenericAdapter):
    family = "dbrx-block-routed"
    layer_cls = DbrxLayer

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer.blocks) if hasattr(model, "transformer") else list(model.blocks)

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        return [self.layer_cls(i, dl, dl.ffn, dl.ffn.router, dl.ffn.experts, config)
                for i, dl in enumerate(self.decoder_layers(model))]
