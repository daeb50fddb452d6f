"""Adapters by ``config.model_type``: a lazy registry, one file per family."""

from __future__ import annotations

from typing import Any

from ..errors import MoetoolError
from ..registry import LazyRegistry
from .base import Adapter, ExpertWeights, MoELayer

#: model_type -> "module:AdapterClass" (imported on first use)
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
    # known routers, layers found by structure (moetool/adapters/glm4_moe.py; checked by tests/test_families.py)
    "bailing_hybrid": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "deepseek_v32": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "dots1": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "dots3_note": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "dots3_note_text": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "exaone_moe": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "glm4_moe": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "glm4_moe_lite": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "glm4v_moe": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "glm_moe_dsa": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "kimi_k25": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "kimi_linear": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "mimo_v2_flash": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "solar_open": "moetool.adapters.glm4_moe:Glm4MoeAdapter",
    "deepseek_ocr2": "moetool.adapters.glm4_moe:SoftmaxGroupedAdapter",
    "unlimited_ocr": "moetool.adapters.glm4_moe:SoftmaxGroupedAdapter",
    "cohere2_moe": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "flex_olmo": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "jamba": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "mellum": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "mistral4": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "qwen3_next": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "qwen3_omni_moe_thinker": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "qwen4_exp": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "qwen4_exp_text": "moetool.adapters.glm4_moe:SoftmaxAdapter",
    "granitemoe": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "granitemoe_swa": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "granitemoehybrid": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "granitemoeshared": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "mistral_large4": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "qwen3_5_moe": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "qwen3_5_moe_text": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "qwen3_vl_moe": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "axk2": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "hy_v3": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "kolibri1": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "laguna": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "lfm2_moe": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "minimax_m2": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "step3p7": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "afmoe": "moetool.adapters.glm4_moe:SigmoidAdapter",
    "hunyuan_v1_moe": "moetool.adapters.glm4_moe:SoftmaxRenormAdapter",
    "ernie4_5_moe": "moetool.adapters.glm4_moe:SoftmaxBiasAdapter",
})

#: config attributes whose presence marks a model as mixture-of-experts
_MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def supported_model_types() -> list[str]:
    return ADAPTERS.names()


def check_config(config: Any) -> None:
    """Fail fast, before loading weights, on a dense or unsupported model."""
    mt = getattr(config, "model_type", "?")
    if mt in ADAPTERS:
        return
    if any(getattr(config, k, None) for k in _MOE_CONFIG_KEYS):
        raise MoetoolError(
            f"unsupported MoE family '{mt}'; supported: {', '.join(supported_model_types())}")
    raise MoetoolError(f"no MoE layers found in {mt} (a dense model?)")


def get_adapter(config: Any) -> Adapter:
    check_config(config)
    return ADAPTERS.get(config.model_type)()


def find_moe_layers(model: Any) -> list[MoELayer]:
    """Every MoE layer of ``model``, wrapped; a clear error when there is none."""
    layers = get_adapter(model.config).layers(model)
    if not layers:
        raise MoetoolError(f"no MoE layers found in {model.config.model_type}")
    return layers


__all__ = ["ADAPTERS", "Adapter", "ExpertWeights", "MoELayer", "check_config", "find_moe_layers",
           "get_adapter", "supported_model_types"]
