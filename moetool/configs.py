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
