"""GLM-4.5 and the other 5.x families that reuse a known router but lay their layers out differently.

These families' routers are, line for line, one of the hand-written families' (DeepSeek-V3's sigmoid +
correction bias + group-limited top-K, Mixtral's / OLMoE's / Qwen's softmax top-K); what differs is where the
layers are and which are MoE: dense layers by ``mlp_layer_types`` / ``first_k_dense_replace`` /
``num_dense_layers`` / ``decoder_sparse_step``, the decoder under ``model.language_model`` in multimodal
checkpoints, the shared experts as ``shared_experts`` / ``shared_expert`` (+ sigmoid gate) / ``shared_mlp``.

So the layers are found by structure: the decoder layers are the model's ``layers`` list (the text decoder's,
for multimodal models); a decoder layer is MoE iff one of its children (or the layer itself) has an ``experts``
module and a ``gate`` or ``router`` module returning ``(logits, weights, idx)``. Which adapter serves which
model type is fixed in the registry and checked by tests/test_families.py on a tiny model of each.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .. import ops
from ..errors import MoetoolError
from .base import Adapter, MoELayer
from .deepseek_v2 import DeepseekV2Layer
from .deepseek_v3 import DeepseekV3Layer, group_mask
from .mixtral import MixtralLayer
from .olmoe import OlmoeLayer
from .qwen2_moe import GatedSharedExpert

_ROUTER_ATTRS = ("gate", "router")
_SKIP = ("vision", "visual", "audio", "talker", "mtp", "image", "speech")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's layer list: the first ``layers`` ModuleList outside vision/audio towers."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and \
                not any(s in name for s in _SKIP):
            return list(mod)
    return []


def moe_parts(decoder_layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """``(block, router, experts)`` of a decoder layer, or None for a dense one."""
    for block in (*decoder_layer.children(), decoder_layer):
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module):
            router = next((getattr(block, a) for a in _ROUTER_ATTRS if isinstance(getattr(block, a, None), nn.Module)),
                          None)
            if router is not None:
                return block, router, experts
    return None


def _shared(block: nn.Module) -> nn.Module | None:
    if isinstance(getattr(block, "shared_expert_gate", None), nn.Module):
        return GatedSharedExpert(block.shared_expert, block.shared_expert_gate)
    for attr in ("shared_experts", "shared_expert", "shared_mlp"):
        if isinstance(getattr(block, attr, None), nn.Module):
            return getattr(block, attr)
    return None


def _router_linear(router: nn.Module) -> nn.Module:
    """The router's projection: the router itself, or its one ``nn.Linear`` child (``gate``, ``wg``, ...)."""
    if isinstance(getattr(router, "weight", None), torch.Tensor):
        return router
    linears = [m for m in router.children() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        raise MoetoolError(f"cannot tell the router projection of {type(router).__name__}")
    return linears[0]


class _SharedMixin:
    @property
    def shared_experts(self) -> nn.Module | None:
        return _shared(self.block)

    @property
    def n_experts(self) -> int:
        return int(self.router_weight().shape[0])

    def router_weight(self) -> torch.Tensor:
        return _router_linear(self.router).weight

    def router_bias(self) -> torch.Tensor | None:
        return getattr(_router_linear(self.router), "bias", None)


class StructuralAdapter(Adapter):
    """Layers found by structure (see the module docstring); the routing is the layer class's."""

    def layers(self, model: nn.Module) -> list:
        out = []
        for i, dl in enumerate(decoder_layers(model)):
            parts = moe_parts(dl)
            if parts is not None:
                block, router, experts = parts
                out.append(self.layer_cls(i, dl, block, router, experts, _text_config(model.config)))
        return out


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config(decoder=True)
    except (ValueError, TypeError):
        return config


class SigmoidGroupedLayer(_SharedMixin, DeepseekV3Layer):
    """DeepSeek-V3's router (GLM-4.5, DeepSeek-V3.2, dots.llm1, EXAONE-MoE, ...)."""


class SoftmaxGroupedLayer(_SharedMixin, DeepseekV2Layer):
    """DeepSeek-V2's router (DeepSeek-OCR-2, Unlimited-OCR)."""


class SoftmaxRenormLayer(_SharedMixin, MixtralLayer):
    """Mixtral's router: softmax -> top-K -> renormalise (Granite-MoE, Qwen3.5/3-VL-MoE, Hunyuan, ...)."""


class SoftmaxLayer(_SharedMixin, OlmoeLayer):
    """OLMoE's / Qwen's router: softmax -> top-K [-> renormalise if norm_topk_prob]."""


def _structural(family: str, layer_cls: type) -> type:
    return type(f"{layer_cls.__name__[:-5]}Adapter", (StructuralAdapter,), {"family": family, "layer_cls": layer_cls})


Glm4MoeAdapter = _structural("sigmoid-grouped", SigmoidGroupedLayer)
SoftmaxGroupedAdapter = _structural("softmax-grouped", SoftmaxGroupedLayer)
SoftmaxRenormAdapter = _structural("softmax-renorm", SoftmaxRenormLayer)
SoftmaxAdapter = _structural("softmax", SoftmaxLayer)


# ----- sigmoid routers with an optional correction bias, groups, renormalisation and scale -----------------
_BIAS_ATTRS = ("e_score_correction_bias", "expert_bias")
_SCALE_ATTRS = ("routed_scaling_factor", "router_scaling_factor", "moe_routed_scaling_factor", "route_scale")


class SigmoidLayer(_SharedMixin, DeepseekV3Layer):
    """``s = sigmoid(logits)``; top-K of ``s + bias`` (or of ``logits + bias``) within the best groups; weights =
    ``s`` of the chosen [/ sum] x scale. Where the bias lives (router or block), whether the weights are
    renormalised and what is ranked are read off the router itself: it is run once on random inputs and the
    variant that reproduces its indices and weights is kept; none -> a one-line error."""

    scoring = "sigmoid; top-k of score + correction bias [within groups]; weights = scores [/sum] x scale"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank_logits = False
        self._renorm = bool(getattr(self.router, "norm_topk_prob", False))
        self._identify()

    # --- attributes with defaults -------------------------------------------------------------------
    @property
    def correction_bias(self):
        for owner in (self.router, self.block):
            for a in _BIAS_ATTRS:
                b = getattr(owner, a, None)
                if b is not None:
                    return b.float()
        return None

    @property
    def scale(self) -> float:
        return float(next((getattr(self.router, a) for a in _SCALE_ATTRS if getattr(self.router, a, None)), 1.0))

    weight_scale = scale

    @property
    def renormalize(self) -> bool:
        return self._renorm

    def logits(self, h):
        out = super().logits(h)
        cap = float(getattr(self.router, "router_logit_softcapping", 0.0) or 0.0)
        return torch.tanh(out / cap) * cap if cap > 0 else out

    def selection_scores(self, logits):
        x = logits.float() if self.rank_logits else torch.sigmoid(logits.float())
        b = self.correction_bias
        return x if b is None else x + b.reshape(-1)

    def weights_for(self, logits, idx):
        w = torch.sigmoid(logits.float()).gather(-1, idx)
        if self._renorm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale

    def route(self, logits):
        s = self.selection_scores(logits)
        n_group = int(getattr(self.router, "num_group", None) or getattr(self.router, "n_group", None) or 1)
        if n_group > 1:
            keep = group_mask(s, n_group, int(self.router.topk_group), "top2sum")
            s = s.masked_fill(~keep, float("-inf"))
        idx = ops.topk(s, self.top_k)
        return idx, self.weights_for(logits, idx)

    def describe(self):
        return {**MoELayer.describe(self), "rank": "logits + bias" if self.rank_logits else "sigmoid + bias",
                "routed_scaling_factor": self.scale}

    def _identify(self) -> None:
        w = self.router_weight()
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(64, w.shape[1], generator=gen).to(w.dtype)
        args = (h,)
        if "e_score_correction_bias" in inspect.signature(self.router.forward).parameters or \
                "expert_bias" in inspect.signature(self.router.forward).parameters:
            args = (h, self.correction_bias)
        with torch.no_grad():
            try:
                logits, want_w, want_idx = self.router(*args)[:3]
            except ValueError:  # a router that unpacks [B, S, H]
                logits, want_w, want_idx = self.router(h.unsqueeze(0), *args[1:])[:3]
            for rank_logits in (False, True):
                for renorm in (self._renorm, not self._renorm):
                    self.rank_logits, self._renorm = rank_logits, renorm
                    idx, wt = self.route(logits)
                    if ops.same_set(idx, want_idx).all() and torch.allclose(
                            self.weights_for(logits, want_idx).float(), want_w.float(), rtol=1e-5, atol=1e-6):
                        return
        raise MoetoolError(f"{self.config.model_type} layer {self.index}: the router matches no sigmoid rule "
                           f"(selection on sigmoid/logits + bias, with/without renormalisation, x {self.scale})")


SigmoidAdapter = _structural("sigmoid", SigmoidLayer)


class SoftmaxBiasLayer(_SharedMixin, MoELayer):
    """ERNIE-4.5: softmax (fp32); top-K of ``p + moe_statics.e_score_correction_bias``; weights = ``p`` of the
    chosen ``/ clamp(sum, moe_norm_min)``, cast to the model dtype."""

    scoring = "softmax(fp32); top-k of p + correction bias; weights = p / clamp(sum, norm_min)"

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h.float(), self.router_weight().float())

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        return self.probs(logits) + self.router.moe_statics.e_score_correction_bias.float().reshape(-1)

    @property
    def renormalize(self) -> bool:
        return True

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        w = self.probs(logits).gather(-1, idx)
        w = w / torch.clamp(w.sum(dim=-1, keepdim=True), min=self.router.norm_min)
        return w.to(self.router_weight().dtype)


SoftmaxBiasAdapter = _structural("softmax-bias", SoftmaxBiasLayer)
