"""Reading transformers configs (no torch import: configs are checked before any model loads)."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The language model's config: ``get_text_config(decoder=True)`` of a multimodal config (or an encoder-decoder
    one), its ``text_config``, or the config itself for a text-only model."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        for kwargs in ({"decoder": True}, {}):
            try:
                return get(**kwargs)
            except (TypeError, ValueError):
                continue
        return config
    return getattr(config, "text_config", None) or config


#: per-layer config types (``layer_types`` and the like) of token mixers without softmax attention: Mamba, linear and
#: lightning attention, convolutions -- they keep a state of fixed size, no keys and values per token
LINEAR_MIXER_TYPES = ("linear_attention", "mamba", "linear", "conv", "short_conv", "lightning", "deltanet", "mamba2")
#: per-layer types of layers with no attention at all (Nemotron-H's pattern: a layer is one block, ``moe`` or ``mlp``)
NO_ATTENTION_TYPES = ("moe", "mlp")


def stored_dtype(config: Any) -> Any:
    """The dtype a checkpoint's config records (``dtype``; a ``torch_dtype`` kept in the config's own attributes),
    ``None`` when it records none. Never through transformers 5's ``torch_dtype`` property: it only repeats
    ``dtype`` and prints "`torch_dtype` is deprecated! Use `dtype` instead!" on the user's console."""
    return getattr(config, "dtype", None) or vars(config).get("torch_dtype")


def layer_types(config: Any) -> list[str] | None:
    """The per-layer types of ``config`` (``layer_types``, ``layers_block_type``, ``attn_type_list``: the first that is a
    list of strings), or None."""
    for key in ("layer_types", "layers_block_type", "attn_type_list"):
        types = getattr(config, key, None)
        if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
            return list(types)
    return None


def kv_layer_types(config: Any) -> list[str]:
    """One entry per decoder layer that keeps keys and values per token (its type, ``"attention"`` when the config has
    no per-layer types): a hybrid's Mamba, linear-attention, convolution and attention-free layers are left out."""
    n = int(config.num_hidden_layers)
    types = (layer_types(config) or [])[:n]
    if len(types) < n:
        return ["attention"] * n
    return [t for t in types if t.lower() not in LINEAR_MIXER_TYPES + NO_ATTENTION_TYPES]
