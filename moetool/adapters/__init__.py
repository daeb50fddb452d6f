"""Adapters by ``config.model_type``: a lazy registry of the hand-adapted families (a module per adapter); every
other MoE model type gets the generic adapter (``generic.py``, found by ``discovery.py``)."""

from __future__ import annotations

from typing import Any

from ..errors import MoetoolError
from ..registry import LazyRegistry
from .base import Adapter, ExpertWeights, MoELayer

#: model_type -> "module:AdapterClass" (imported on first use): the families whose structure needs a hand adapter.
#: Every other model type whose config looks MoE (and that discovery.UNSUPPORTED does not list) gets the
#: generic adapter (moetool/adapters/generic.py: layers found by structure, routing rule identified on the
#: router at load; checked for every installed family by tests/test_families.py).
ADAPTERS = LazyRegistry("MoE family", {
    "mixtral": "moetool.adapters.mixtral:MixtralAdapter",
    "minimax": "moetool.adapters.mixtral:MixtralAdapter",
    "qwen2_moe": "moetool.adapters.qwen2_moe:Qwen2MoeAdapter",
    "qwen3_moe": "moetool.adapters.qwen3_moe:Qwen3MoeAdapter",
    "olmoe": "moetool.adapters.olmoe:OlmoeAdapter",
    "deepseek_v3": "moetool.adapters.deepseek_v3:DeepseekV3Adapter",
    "deepseek_v2": "moetool.adapters.deepseek_v2:DeepseekV2Adapter",
    "gpt_oss": "moetool.adapters.gpt_oss:GptOssAdapter",
    "phimoe": "moetool.adapters.phimoe:PhimoeAdapter",
    # hand adapters where the generic one cannot read the structure
    "aria": "moetool.adapters.aria:AriaAdapter",
    "aria_text": "moetool.adapters.aria:AriaAdapter",
    "nemotron_h": "moetool.adapters.nemotron_h:NemotronHAdapter",
    "nemotron_h_omni": "moetool.adapters.nemotron_h:NemotronHAdapter",
    "glm5_next": "moetool.adapters.glm5_next:ClampedSwiGLUAdapter",
    "hy_v4": "moetool.adapters.glm5_next:ClampedSwiGLUAdapter",
    "hy_v4_vl": "moetool.adapters.glm5_next:ClampedSwiGLUAdapter",
    "minimax_m3_vl": "moetool.adapters.minimax_m3_vl:MiniMaxM3Adapter",
    "minimax_m3_vl_text": "moetool.adapters.minimax_m3_vl:MiniMaxM3Adapter",
    "inkling2": "moetool.adapters.inkling2:Inkling2Adapter",
    "inkling2_text": "moetool.adapters.inkling2:Inkling2Adapter",
    "inkling2_loop": "moetool.adapters.inkling2:Inkling2Adapter",
    "inkling2_loop_text": "moetool.adapters.inkling2:Inkling2Adapter",
    "llama4": "moetool.adapters.llama4:Llama4Adapter",
    "llama4_text": "moetool.adapters.llama4:Llama4Adapter",
    "gemma4": "moetool.adapters.gemma4:Gemma4Adapter",
    "gemma4_text": "moetool.adapters.gemma4:Gemma4Adapter",
    "switch_transformers": "moetool.adapters.switch_transformers:SwitchAdapter",
    "dbrx": "moetool.adapters.dbrx:DbrxAdapter",
    "deepseek_v4": "moetool.adapters.glm5_next:ClampedSwiGLUAdapter",
    "zaya": "moetool.adapters.zaya:ZayaAdapter",
    "inkling_text": "moetool.adapters.inkling:InklingAdapter",
    "inkling_mm_model": "moetool.adapters.inkling:InklingAdapter",
    "ernie4_5_vl_moe": "moetool.adapters.ernie4_5_vl_moe:Ernie45VLMoeAdapter",
    "jetmoe": "moetool.adapters.jetmoe:JetMoeAdapter",
    "doge": "moetool.adapters.doge:DogeAdapter",
    "muse_spark": "moetool.adapters.muse_spark:MuseSparkAdapter",
    "muse_spark_text": "moetool.adapters.muse_spark:MuseSparkAdapter",
})

#: config attributes whose presence marks a model as mixture-of-experts
_MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
                    "n_experts")


def _looks_moe(config: Any) -> bool:
    from ..configs import text_config  # no torch import: configs are checked before the model loads

    return any(getattr(c, k, None) for c in (config, text_config(config)) for k in _MOE_CONFIG_KEYS)


def _unsupported_reason(mt: str) -> str | None:
    from .discovery import UNSUPPORTED

    return UNSUPPORTED.get(mt)


def supported_model_types() -> list[str]:
    """Hand-adapted types plus every installed MoE type the generic adapter serves."""
    from .discovery import supported_types

    return sorted(set(ADAPTERS.names()) | set(supported_types()))


#: config attributes holding the number of routed experts / the experts each token is routed to (top-K)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k_experts")


def config_experts(config: Any) -> int | None:
    """The routed experts a config declares (its decoder config's first, as :func:`check_top_k` reads them), or
    ``None``."""
    from .discovery import text_config

    for c in (text_config(config), config):
        for k in _EXPERT_KEYS:
            v = getattr(c, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def check_top_k(config: Any) -> None:
    """A top-K the router cannot choose (``num_experts_per_tok`` = 0, or more than the experts) is one line, before
    any model is built: torch's topk would fail deep in the forward (even ``inspect``) with "selected index k out of
    range". Checked on the config and its decoder config where both counts are integers (a per-layer list of top-K
    values: each one); ``zero_expert_num`` (zero-computation experts the router may choose) counts as experts."""
    from .discovery import text_config

    for c in {id(c): c for c in (config, text_config(config))}.values():
        experts = [getattr(c, k, None) for k in _EXPERT_KEYS]
        experts = [int(v) for v in experts if isinstance(v, int) and not isinstance(v, bool)]
        if not experts:
            continue
        n = max(experts) + int(getattr(c, "zero_expert_num", 0) or 0)
        if n < 1:  # "top-K must be between 1 and -3" named the wrong field
            field = next(k for k in _EXPERT_KEYS if getattr(c, k, None) == max(experts))
            raise MoetoolError(f"{field} = {max(experts)} in the {getattr(config, 'model_type', '?')} config: an MoE "
                               f"layer needs at least 1 expert (fix config.json)")
        for key in _TOP_K_KEYS:
            value = getattr(c, key, None)
            for k in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(k, int) and not isinstance(k, bool) and not 1 <= k <= n:
                    raise MoetoolError(f"{key} = {k} in the {getattr(config, 'model_type', '?')} config, but the "
                                       f"model has {n} experts: top-K must be between 1 and {n} (fix config.json)")


def check_config(config: Any) -> None:
    """Fail fast, before loading weights, on a dense or unsupported model, or a top-K the experts cannot serve
    (:func:`check_top_k`)."""
    mt = getattr(config, "model_type", "?")
    check_top_k(config)
    if mt in ADAPTERS:
        return
    reason = _unsupported_reason(mt)
    if reason is not None:
        raise MoetoolError(f"unsupported MoE family '{mt}'; supported: {', '.join(supported_model_types())}. "
                           f"Why not {mt}: {reason}")
    if _looks_moe(config):
        return  # the generic adapter; a router it cannot reproduce fails at load with what did not match
    raise MoetoolError(f"no MoE layers found in {mt} (a dense model?)")


def get_adapter(config: Any) -> Adapter:
    check_config(config)
    mt = config.model_type
    if mt in ADAPTERS:
        return ADAPTERS.get(mt)()
    from .generic import GenericAdapter

    return GenericAdapter()


def find_moe_layers(model: Any) -> list[MoELayer]:
    """Every MoE layer of ``model``, wrapped; a clear error when there is none."""
    layers = get_adapter(model.config).layers(model)
    if not layers:
        raise MoetoolError(f"no MoE layers found in {model.config.model_type}")
    return layers


__all__ = ["ADAPTERS", "Adapter", "ExpertWeights", "MoELayer", "check_config", "check_top_k", "find_moe_layers",
           "get_adapter", "supported_model_types"]
