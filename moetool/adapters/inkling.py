"""Inkling (``inkling_text``, ``inkling_mm_model``): routed weights normalised together with the shared experts'.

What ``InklingTopkRouter`` does for the MoE input ``h [T, d]`` (fp32 throughout):

* one projection ``R [n + s, d]`` gives the logits of the ``n`` routed experts and of the ``s`` shared ones;
* top-K of ``sigmoid(routed) + e_score_correction_bias``;
* the K chosen routed logits and the ``s`` shared logits get ``softmax(logsigmoid(.))`` over those K + s, i.e.
  ``sigmoid(l) / (sum of the chosen's sigmoids + sum of the shared's)``, times ``route_scale x global_scale``;
* it returns ``(routed logits, routed weights, idx, shared gammas)``; the block adds
  ``shared_experts(h, gammas)``.

So the routed weights are a function of the logits once the shared experts' logits are among them: the layer's
logits are ``[T, n + s]`` (routed, then shared; :meth:`captured_logits` appends the shared ones the router
computes but does not return), and the rule is ``sigmoid-topk-renorm`` with ``Params.shared = s``
(:mod:`moetool.adapters.rules`: the shared sigmoid mass joins the denominator; computed as the router does, a
softmax of logsigmoids, so the weights are the router's bit for bit). π, selection scores and every
policy see the ``n`` routed experts only. :attr:`shared_experts` is the model's shared experts with the gammas of
the layer's own routing (what the block computes); a policy replaces the routed experts' choice and weights, the
block's shared experts keep the router's gammas (for the router's own choice).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import MoetoolError
from . import rules
from .generic import (LOGITS_MODES, GenericAdapter, GenericLayer, _candidates, _materialized, correction_bias,
                      linear_logits)

_N_TOKENS = 256


class NormalisedSharedExperts(nn.Module):
    """``shared_experts(h, gammas)`` with the gammas the router gives for its own choice (a callable of ``h``)."""

    def __init__(self, layer: "SharedNormalisedLayer"):
        super().__init__()
        self.shared = layer.block.shared_experts  # the model's module (its parameters)
        object.__setattr__(self, "_layer", layer)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        L = self._layer
        logits = L.logits(h.reshape(-1, h.shape[-1]))
        return self.shared(h, gammas=L.shared_gammas(logits).to(h.dtype))


class SharedNormalisedLayer(GenericLayer):
    @property
    def n_shared(self) -> int:
        return int(self.router.n_shared_experts)

    @property
    def n_experts(self) -> int:
        return int(self.linear.weight.shape[0]) - self.n_shared

    @property
    def shared_experts(self) -> nn.Module | None:
        return NormalisedSharedExperts(self)

    def router_weight(self) -> torch.Tensor:
        return self.linear.weight[:self.n_experts]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, n + s]``: the routed experts' logits, then the shared experts'."""
        return linear_logits(h, self.linear.weight, None, self.logits_mode)

    def captured_logits(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        shared = self.logits(h.reshape(-1, h.shape[-1]))[:, self.n_experts:]
        return torch.cat([out.reshape(-1, out.shape[-1]), shared], dim=-1)

    def shared_gammas(self, logits: torch.Tensor) -> torch.Tensor:
        """``[T, s]``: the shared experts' weights for the layer's own routing (what the router returns)."""
        p = self._p()
        idx = self.rule.select(logits, p)
        chosen = torch.sigmoid(rules.routed_part(logits, p).float()).gather(-1, idx).sum(-1, keepdim=True)
        mass = torch.sigmoid(logits[..., self.n_experts:].float())
        return mass / (chosen + mass.sum(-1, keepdim=True)) * p.scale

    def describe(self) -> dict[str, Any]:
        g = float(self.router.global_scale.detach().float().reshape(-1)[0]) if self.global_scale_read else \
            "learned: not read from the config (routed_scaling_factor is route_scale x it; 1 here)"
        return {**super().describe(), "n_shared_logits": self.n_shared, "global_scale": g,
                "note": "weights normalised with the shared experts' logits"}

    def _identify(self):
        mt = getattr(self.config, "model_type", "?")

        def fail(what: str) -> MoetoolError:
            return MoetoolError(f"{mt}: {what} (layer {self.index}, {type(self.router).__name__})")

        router = self.router
        # a model built on the meta device (inspect, plan): the rule is in the router's code, its learned
        # global_scale is not known (1, its init, in the copy)
        self.global_scale_read = router.weight.device.type != "meta"
        if not self.global_scale_read:
            router = _materialized(router)
        w = router.weight
        n = int(w.shape[0]) - int(router.n_shared_experts)
        dtype = next((p.dtype for p in self.experts.parameters() if p.is_floating_point()), w.dtype)
        h = torch.randn(_N_TOKENS, w.shape[1], generator=torch.Generator().manual_seed(0)).to(device=w.device,
                                                                                              dtype=dtype)
        bias = correction_bias(router, self.block)
        with torch.no_grad():
            out = router(h)
            if not (isinstance(out, tuple) and len(out) == 4):
                raise fail("the router does not return (routed logits, weights, indices, shared gammas)")
            routed, want_w, want_idx, _ = out
            mode = next((m for m in LOGITS_MODES
                         if torch.equal((got := linear_logits(h, w, None, m))[:, :n], routed) and
                         got.dtype == routed.dtype), None)
            if mode is None:
                raise fail("the router's routed logits are not the first rows of its projection")
            full = linear_logits(h, w, None, mode)
            g = float(router.global_scale.float().reshape(-1)[0])
            bias = None if bias is None else bias.detach()
            cands = [replace(c, shared=full.shape[-1] - n, scale=c.scale * g)
                     for c in _candidates(router, int(want_idx.shape[-1]), bias)
                     if not c.renorm_eps and not c.norm_min]
            try:
                rule, params = rules.identify(full, want_idx, want_w, cands)
            except rules.NoRuleMatches as e:
                raise fail(f"router output matches no known routing rule ({e})") from None
        if params.bias is not None:
            params = replace(params, bias=correction_bias(self.router, self.block))
        return rule, params, mode, 0.0


class InklingAdapter(GenericAdapter):
    family = "shared-normalised"
    layer_cls = SharedNormalisedLayer
