"""Zaya (``zaya``): an MLP router over a down-projection plus the previous layer's router state, and a skip class.

What the model does (``ZayaSparseMoeBlock``, the ``mlp`` of every decoder layer):

* ``ZayaRouter(h, router_states)``: ``x = down_proj(h)`` (``[T, r]``), plus ``router_states * router_states_scale``
  from layer 1 on (EDA: the previous layer's ``x`` is carried to the next); ``logits = router_mlp(x)`` over
  ``n + 1`` classes (the last one a **skip** class with no computation); ``p = softmax(logits)``; top-K of
  ``p + balancing_biases`` (a correction bias, -1 on the skip class at init); weights ``p`` at the chosen (no
  renormalisation). A chosen skip class is handed to the experts as expert 0 with weight 0; the router returns
  ``(logits, w, idx, x)`` and the block passes ``x`` on to the next layer.

The routing is still a catalogue rule on the logits (``softmax-topk`` with correction bias, over ``n + 1`` classes);
only the logits need one more input, the carried state. So this adapter widens the contract rather than
reproducing the router by hand:

* each block's class is swapped (once, per instance; parameters and state dict unchanged: the views are not
  registered) for one whose forward calls a router view returning ``(logits, p at idx, idx)`` with the skip class
  kept as index ``n`` (the selection recomputed from the router's own logits exactly as the model does) and an
  experts view that hands a chosen skip class to the model's experts as expert 0 with weight 0, as the model
  does: the logits are bit for bit the original model's (tests/test_families.py);
* the skip class is a **zero-computation expert** (``n_zero_compute = 1``, ``zero_compute_output = "zero"``: its
  output and every activation are 0; ``stats`` reports how often it is taken);
* the carried state is an **input of the rule** (:meth:`ZayaLayer.router_inputs`: the engine captures it per event
  in ``RoutingEvent.inputs``); :meth:`ZayaLayer.logits` takes it; layers from 1 on are ``carried_state``: what
  recomputes routing from other inputs (margin, mass-recall, offload's prediction) refuses them in one line.
* There is no router matrix over the layer input (an MLP over a down-projection): :meth:`ZayaLayer.router_weight`
  refuses in one line (erc, mass-recall's unit mode).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..configs import text_config
from ..errors import MoetoolError
from . import rules
from .generic import (GenericAdapter, GenericLayer, _candidates, _is_meta, _materialized, _stand_in_bias,
                      correction_bias, decoder_layers)
from .generic import restore_views as restore  # noqa: F401 - undo the class swap


class ZayaRouterView(nn.Module):
    """``(logits, w, idx, state)`` of the model's ``ZayaRouter``, the skip class kept as index ``n``."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.top_k = router.top_k

    @property
    def weight(self) -> torch.Tensor:  # the class projection (its rows count the router's n + 1 classes)
        return self.router.router_mlp.out_proj.weight

    def forward(self, hidden_states: torch.Tensor, router_states: torch.Tensor | None = None):
        if hidden_states.dim() == 2:
            hidden_states = hidden_states.unsqueeze(0)
        logits, _, _, state = self.router(hidden_states, router_states=router_states)  # the model's own module
        probs = torch.softmax(logits, dim=-1)  # the model's selection, the skip class not masked yet
        idx = torch.topk(probs.detach().to(torch.float32) + self.router.balancing_biases, self.top_k, dim=-1)[1]
        return logits, probs.gather(-1, idx), idx, state


class ZayaExpertsView(nn.Module):
    """``experts(h, idx, w)`` with the skip class ``n``: handed to the model's experts as expert 0, weight 0."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts
        self.act_fn = experts.act_fn
        self.n = experts.num_experts

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.experts.gate_up_proj

    @property
    def down_proj(self) -> torch.Tensor:
        return self.experts.down_proj

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        skip = top_k_index == self.n
        return self.experts(hidden_states, top_k_index.masked_fill(skip, 0), top_k_weights.masked_fill(skip, 0))


def _views(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (ZayaRouterView(block.gate), ZayaExpertsView(block.experts))
        original = type(block)
        block.__class__ = type("ZayaMoeBlock", (original,), {"forward": _block_forward,
                                                             "_moetool_original": original})
    return block.__dict__["_moetool_views"]


def _block_forward(self, hidden_states: torch.Tensor, prev_router_hidden_states: torch.Tensor | None = None):
    """``ZayaSparseMoeBlock.forward`` through the views (same tensors, same order of operations)."""
    router, experts = self.__dict__["_moetool_views"]
    B, S, D = hidden_states.shape
    _, w, idx, state = router(hidden_states, prev_router_hidden_states)
    out = experts(hidden_states.view(B * S, D), idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1]))
    return out.view(B, S, D), state


class ZayaLayer(GenericLayer):
    """Routing ``softmax-topk`` (+ correction bias) over ``n + 1`` classes; logits from ``h`` and the carried state."""

    zero_compute_output = "zero"

    def __init__(self, index, decoder_layer, block, router, experts, config):
        router_view, experts_view = _views(block)
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)

    @property
    def n_zero_compute(self) -> int:
        return 1  # the skip class

    @property
    def carried_state(self) -> bool:
        return bool(self.router.router.use_eda)

    def router_inputs(self, args: tuple) -> dict[str, torch.Tensor]:
        state = args[1] if len(args) > 1 else None
        return {} if state is None or not self.carried_state else {"router_state": state.reshape(-1, state.shape[-1])}

    def router_weight(self) -> torch.Tensor:
        raise MoetoolError(f"layer {self.index}: Zaya's router is an MLP over a down-projection (plus the previous "
                           f"layer's router state), not a matrix R [n, d] over the layer input")

    def router_bias(self) -> torch.Tensor | None:
        return None

    def logits(self, h: torch.Tensor, router_state: torch.Tensor | None = None) -> torch.Tensor:
        """The router's logits for inputs ``h [T, d]`` and, from layer 1 on, the carried ``router_state [T, r]``
        (``RoutingEvent.inputs``), as the model computes them."""
        r = self.router.router
        x = r.down_proj(h.to(r.down_proj.weight.dtype).unsqueeze(0))
        if r.use_eda:
            if router_state is None:
                raise MoetoolError(f"layer {self.index}: Zaya's router logits depend on the previous layer's router "
                                   f"state as well as h (pass the event's inputs)")
            x = x + router_state.to(x.dtype).unsqueeze(0) * r.router_states_scale
        return r.router_mlp(x).reshape(-1, self.n_experts)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "router": "MLP over down_proj(h) + carried state (EDA)",
                "skip_class": self.n_experts - 1}

    def _identify(self):
        """The rule on the router view's own output (seeded random inputs, no carried state: the state shifts the
        logits, not the rule from logits to choice)."""
        mt = getattr(self.config, "model_type", "?")
        router = self.router  # built on the meta device (inspect, plan): a CPU copy with seeded random weights
        if _is_meta(*router.parameters(), *router.buffers()):
            router = _materialized(router)
        d = router.router.hidden_size
        h = torch.randn(256, d, generator=torch.Generator().manual_seed(0)).to(router.weight)
        bias = _stand_in_bias(correction_bias(router, self.block))
        with torch.no_grad():
            logits, w, idx, _ = router(h)
            try:
                rule, params = rules.identify(logits, idx, w, _candidates(router, int(idx.shape[-1]),
                                                                          bias.detach()))
            except rules.NoRuleMatches as e:
                raise MoetoolError(f"{mt}: router output matches no known routing rule ({e}) (layer {self.index}, "
                                   f"ZayaRouter)") from None
        return rule, replace(params, bias=correction_bias(self.router, self.block)), "native", 0.0


class ZayaAdapter(GenericAdapter):
    family = "zaya-carried-state"
    layer_cls = ZayaLayer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        return [self.layer_cls(i, dl, dl.mlp, dl.mlp.gate, dl.mlp.experts, config)
                for i, dl in enumerate(decoder_layers(model))]
