"""Gemma 4 (``gemma4`` and its text decoder ``gemma4_text``, ``enable_moe_block``): a normed router and experts
on the decoder layer itself, beside its dense MLP.

What the model does (``Gemma4TextDecoderLayer.forward`` with ``enable_moe_block``), for the residual stream ``h``
after attention:

* the dense ``mlp`` runs on ``pre_feedforward_layernorm(h)``; the MoE path on the same ``h``, flattened;
* ``Gemma4TextRouter(h)``: ``x = rms(h) * scale / sqrt(d)`` (an RMS norm without weight, a learned per-channel
  ``scale``), ``logits = proj(x)`` (``nn.Linear [E, H]``, no bias), ``π = softmax(logits)`` in fp32, top-K of π,
  renormalised, then times ``per_expert_scale[idx]``; it returns ``(π, w, idx)``, not the logits;
* ``experts(pre_feedforward_layernorm_2(h), idx, w)``: the common fused layout (``gate_up_proj [E, 2I, H]``,
  gate first; ``down_proj [E, H, I]``), so the experts see a normalised copy of the router's input;
* the two outputs are normed (``post_feedforward_layernorm_1`` / ``_2``) and added.

moetool's contract is a router returning ``(logits, w, idx)`` and ``experts(h, idx, w)`` on the router's input
``h``. So each MoE decoder layer's class is swapped (once, per instance; parameters, buffers and state dict
unchanged: the views are not registered) for one that reads ``router`` / ``experts`` /
``pre_feedforward_layernorm_2`` through views: the router view runs the model's own router and returns its
projection's output as the logits; the experts view applies the model's own ``pre_feedforward_layernorm_2`` and
calls the model's own experts; the layer's own call of that norm becomes the identity. Same modules, same
tensors, same order of operations: the logits are bit for bit the original model's (tests/test_families.py).

Routing: rule ``softmax-topk-renorm`` (identified on the router, per-expert scale divided out) times
``per_expert_scale[idx]``: :meth:`Gemma4Layer.weights_for` is that for any set. ``logits(h)`` recomputes the
router's normed projection. :meth:`Gemma4Layer.expert_input` is ``pre_feedforward_layernorm_2``: probes (node
norms, expert outputs) see what the experts see. Policies whose weights sum to one (``softmax`` / ``uniform``)
do not apply ``per_expert_scale`` (it is per expert, not one factor: ``weight_scale`` stays 1).
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
from .generic import IDENTITY as _IDENTITY
from .generic import GenericAdapter, GenericLayer, _candidates, _is_meta, _materialized, decoder_layers
from .generic import restore_views as restore  # noqa: F401 - undo the class swap

_N_TOKENS = 256


def _logits(router: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A ``Gemma4TextRouter``'s projection of its normed, scaled input ``h`` (its own modules and order)."""
    return router.proj(router.norm(h.to(router.proj.weight.dtype)) * router.scale * router.scalar_root_size)


class Gemma4RouterView(nn.Module):
    """``(logits, w, idx)`` of the model's ``Gemma4TextRouter`` (which runs inside; ``logits`` = its ``proj``
    output)."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.top_k = int(router.config.top_k_experts)

    @property
    def weight(self) -> torch.Tensor:
        return self.router.proj.weight

    def forward(self, hidden_states: torch.Tensor):
        grabbed: dict[str, torch.Tensor] = {}
        handle = self.router.proj.register_forward_hook(lambda m, args, out: grabbed.__setitem__("logits", out))
        try:
            _, w, idx = self.router(hidden_states)
        finally:
            handle.remove()
        return grabbed["logits"], w, idx


class Gemma4ExpertsView(nn.Module):
    """``experts(h, idx, w)`` on the router's input: the model's ``pre_feedforward_layernorm_2``, then its experts."""

    def __init__(self, experts: nn.Module, norm: nn.Module):
        super().__init__()
        self.experts, self.norm = experts, norm

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.experts(self.norm(hidden_states), top_k_index, top_k_weights)


@functools.lru_cache(maxsize=None)
def _swapped(original: type) -> type:
    """``original`` whose ``router`` / ``experts`` / ``pre_feedforward_layernorm_2`` are read through the views."""

    def view(i: int):
        return property(lambda self: self.__dict__["_moetool_views"][i])

    return type(f"{original.__name__}WithViews", (original,), {
        "router": view(0), "experts": view(1), "pre_feedforward_layernorm_2": property(lambda self: _IDENTITY),
        "_moetool_original": original})


def _views(decoder_layer: nn.Module) -> tuple[Gemma4RouterView, Gemma4ExpertsView]:
    """The decoder layer's views, created once (not registered: the state dict is unchanged)."""
    if "_moetool_views" not in decoder_layer.__dict__:
        m = decoder_layer._modules
        decoder_layer.__dict__["_moetool_views"] = (
            Gemma4RouterView(m["router"]), Gemma4ExpertsView(m["experts"], m["pre_feedforward_layernorm_2"]))
        decoder_layer.__class__ = _swapped(type(decoder_layer))
    return decoder_layer.__dict__["_moetool_views"]


class Gemma4Layer(GenericLayer):
    def __init__(self, index: int, decoder_layer: nn.Module, config: Any):
        router_view, experts_view = _views(decoder_layer)
        super().__init__(index, decoder_layer, decoder_layer, router_view, experts_view, config)

    @property
    def _router(self) -> nn.Module:
        return self.router.router  # the model's Gemma4TextRouter

    def _scale(self, idx: torch.Tensor) -> torch.Tensor:
        return self._router.per_expert_scale[idx]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The router's projection of its normed, scaled input (its own modules, its order of operations); ``h`` in
        the router's dtype, as the model passes it."""
        return _logits(self._router, h)

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().weights_for(logits, idx, mask) * self._scale(idx)

    @property
    def pre_router_norm(self) -> nn.Module:
        """None between the residual stream and the router: it reads the stream after attention itself (its own
        RMS norm and scale are inside it, :meth:`logits`); ``pre_feedforward_layernorm`` feeds the dense MLP."""
        return _IDENTITY

    def expert_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts.norm(h)

    def expert_weights(self) -> ExpertWeights:
        gate_up = self.experts.experts.gate_up_proj  # [n, 2I, d], gate first
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=self.experts.experts.down_proj)

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.experts.experts.act_fn(gate)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "per_expert_scale": True, "dense_mlp_beside": True}

    def _identify(self):
        """The rule of the router's ``(logits, w / per_expert_scale[idx], idx)`` on seeded random inputs (a model
        built on the meta device, as inspect and plan build it: on a CPU copy of the router with seeded random
        weights)."""
        view = self.router
        if _is_meta(*view.parameters(), *view.buffers()):
            view = _materialized(view)
        w0 = view.weight
        h = torch.randn(_N_TOKENS, w0.shape[1], generator=torch.Generator().manual_seed(0)).to(w0)
        with torch.no_grad():
            logits, w, idx = view(h)
            if not torch.equal(_logits(view.router, h), logits):
                raise self._fail("logits(h) differs from the router's projection")
            try:
                rule, params = rules.identify(logits, idx, w / view.router.per_expert_scale[idx],
                                              _candidates(view.router, idx.shape[-1], None))
            except rules.NoRuleMatches as e:
                raise self._fail(f"router output matches no known routing rule ({e})") from None
        return rule, params, "native", 0.0

    def _fail(self, what: str):
        return MoetoolError(f"{getattr(self.config, 'model_type', '?')}: {what} (layer {self.index}, gemma4 router)")


class Gemma4Adapter(GenericAdapter):
    family = "gemma4-normed-router"
    layer_cls = Gemma4Layer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        return [self.layer_cls(i, dl, config) for i, dl in enumerate(decoder_layers(model))
                if getattr(dl, "enable_moe_block", False) and "router" in dl._modules]
