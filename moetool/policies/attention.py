"""``attention`` — Attention-Aware routing (Graph of Tokens, Def. 5 / Eq. 14).

The attention probabilities ``A [B, heads, S, S]`` of the same decoder layer's self-attention
(read by the engine from the attention module's ``output[1]``; the model must run with
``attn_implementation="eager"``, which the commands arrange when ``needs_attention``). The head
``h*`` with the lowest mean attention-row entropy over the batch's real tokens (padding query rows
excluded) is chosen once per batch and layer; ``s_i = Σ_j A_{h*}[i, j] π(h_j)`` over the real
tokens ``j``, TopK of ``s_i``, weights renormalised over the chosen K. The normalised ``s`` is left
in ``ev.scores`` and the chosen head in ``ev.extra["head"]``.

Hybrid models: a MoE layer whose decoder layer mixes tokens with something other than softmax attention
(Mamba, linear attention / DeltaNet, lightning attention, short convolutions) has no attention probabilities;
:func:`refuse_no_attention` refuses them in one line naming every such layer and its mixer, and the layers to
choose instead (the engine's ``check_policy`` asks the policy before hooking: ``policy.unable(layers)``;
then ``policy.attention_module(layer)`` per layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import ops
from ..configs import LINEAR_MIXER_TYPES, layer_types
from ..engine.hooks import RoutingEvent, refuse_unable
from ..errors import MoetoolError
from .base import Policy
from .similarity import choose, propagate


#: decoder-layer children that mix tokens (the first one present is the layer's mixer)
_MIXER_ATTRS = ("self_attn", "self_attention", "attention", "attn", "linear_attn", "mamba", "mixer", "conv", "short_conv",
                "token_mixer", "time_mix")
#: class-name fragments of token mixers without softmax attention probabilities
_NOT_SOFTMAX = ("mamba", "linear", "delta", "lightning", "conv", "retention", "rwkv", "ssm", "lru")


def _mixer(decoder_layer: nn.Module) -> tuple[str, nn.Module | None]:
    for attr in _MIXER_ATTRS:
        m = getattr(decoder_layer, attr, None)
        if isinstance(m, nn.Module):
            return attr, m
    return "", None


def _layer_type(layer: Any) -> str | None:
    types = layer_types(layer.config)
    return types[layer.index] if types is not None and layer.index < len(types) else None


def _attention(layer: Any) -> tuple[nn.Module | None, str]:
    """``layer``'s softmax self-attention module and ``""``, or ``None`` and why it has none (said after "MoE layers
    [i, ...]", :data:`NO_ATTENTION_SAID`)."""
    own = getattr(layer, "softmax_attention", None)  # an adapter that names it (Switch Transformers' T5 blocks)
    if own is not None:
        return own, ""
    name, mod = _mixer(layer.decoder_layer)
    if mod is layer.block:  # the decoder layer's one mixer is the MoE block (Nemotron-H's block type 'moe')
        return None, (f"have no softmax attention (their decoder layer is the MoE block alone: {name} "
                      f"({type(mod).__name__}))")
    if isinstance(mod, nn.ModuleList):  # LongCat-Flash: two attention sublayers per decoder layer
        return None, (f"have decoder layers of {len(mod)} attention sublayers ({name}); which one's probabilities "
                      "route is not defined")
    if getattr(mod, "compressor", None) is not None:  # DeepSeek-V4's CSA/HCA: keys are compressed blocks too
        return None, (f"attend over compressed key blocks beside the tokens ({type(mod).__name__}): their "
                      "probabilities are not token-to-token")
    kind = _layer_type(layer)
    cls = type(mod).__name__ if mod is not None else ""
    linear = (mod is None or name != "self_attn" and name not in ("self_attention", "attention", "attn")
              or any(f in cls.lower() for f in _NOT_SOFTMAX)
              or (kind is not None and kind.lower() in LINEAR_MIXER_TYPES))
    if linear:
        what = f"{name} ({cls})" if mod is not None else "no self-attention module"
        kind_txt = f", layer type '{kind}'" if kind else ""
        return None, f"have no softmax attention (their decoder layer mixes tokens with {what}{kind_txt})"
    return mod, ""


#: how :func:`refuse_no_attention` says why layers have no attention probabilities (``detail``: :func:`_attention`'s)
NO_ATTENTION_SAID = {"mixer": "MoE layers {layers} {detail}"}


def attention_unable(layers: Any, alternative: bool = False) -> dict[int, tuple[str, str]]:
    """The layers of ``layers`` with no token-to-token softmax attention probabilities, each with why."""
    return {L.index: ("mixer", why) for L in layers if (why := _attention(L)[1])}


def refuse_no_attention(layers: list[Any]) -> None:
    """One line before any forward naming every layer of ``layers`` (all attention routing runs in) without softmax
    attention and why, and the layers to choose instead (``--layers``), from the same check
    (:func:`moetool.engine.hooks.refuse_unable`)."""
    refuse_unable(layers, layers, attention_unable, NO_ATTENTION_SAID, "attention routing: ")


def softmax_attention(layer: Any) -> nn.Module:
    """The softmax self-attention module of ``layer``'s decoder layer (an :class:`~moetool.adapters.MoELayer`).

    A decoder layer whose token mixer is Mamba, linear attention, lightning attention or a convolution (hybrid
    models) has no attention probabilities: a :class:`MoetoolError` naming the layer and its mixer.
    """
    mod, _ = _attention(layer)
    if mod is None:
        refuse_no_attention([layer])
    return mod


def lowest_entropy_head(A: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Index of the head whose attention rows have the lowest mean entropy over real query tokens.

    Rows are renormalised first (gpt-oss drops its attention-sink mass, so its rows sum to less than 1).

    ``A [B, H, S, S]``, ``valid [T]`` (T = B*S) -> scalar long tensor.
    """
    B, H, S, _ = A.shape
    ent = ops.entropy(ops.normalize(A), dim=-1)  # [B, H, S] nats, one per query row
    keep = valid.reshape(B, 1, S).to(ent.dtype)  # [B, 1, S]
    mean = (ent * keep).sum((0, 2)) / keep.sum().clamp_min(1)  # [H]
    return torch.argmin(mean)


class AttentionPolicy(Policy):
    """``attention``: no arguments; needs the layer's attention probabilities."""

    name = "attention"
    needs_attention = True
    routes_by_scores = True  # TopK of the attended tokens' π: refused on hash-routed layers, as similarity
    reads_sequence = True  # the other tokens of the same sequence

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "policy": "attention", "head": "lowest mean row entropy over the batch's real tokens, per layer"}

    unable_said = NO_ATTENTION_SAID

    def unable(self, layers: Any, alternative: bool = False) -> dict[int, tuple[str, str]]:
        """The layers it cannot run in (no softmax attention probabilities, :func:`attention_unable`): refused in one
        line with the hash-routed ones by :func:`moetool.engine.hooks.check_policy`, the others to choose computed
        from both."""
        return attention_unable(layers)

    def attention_module(self, layer: Any) -> nn.Module:
        """The module whose output carries ``layer``'s attention probabilities; refuses non-softmax mixers."""
        return softmax_attention(layer)

    def scores(self, ev: RoutingEvent) -> torch.Tensor:
        """The normalised Attention-Aware scores ``s [T, n]``."""
        if ev.attn is None:
            raise MoetoolError("attention routing needs the attention probabilities: load the model with "
                               "attn_implementation='eager'")
        B, S = ev.shape
        if tuple(ev.attn.shape[-2:]) != (S, S) or ev.attn.shape[0] != B:
            raise MoetoolError(f"layer {ev.layer.index}: attention probabilities of shape {tuple(ev.attn.shape)} "
                               f"do not match the batch ({B}, {S}) (a KV cache in use? pass use_cache=False)")
        head = lowest_entropy_head(ev.attn, ev.valid)
        ev.extra["head"] = head  # 0-d tensor: no host sync inside the forward
        A = ev.attn.index_select(1, head.reshape(1)).squeeze(1)  # [B, S, S], the index stays on the device
        return propagate(A, ev.probs, ev.valid)

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(ev)  # [T, n]
        ev.scores = s
        return choose(s, ev.layer.top_k, ev.layer.weight_scale)
