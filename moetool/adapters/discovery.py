"""The MoE causal-LM families of the *installed* transformers, found at run time, and a tiny model of each.

* :func:`moe_model_types` lists every ``model_type`` of the installed transformers that has a causal-LM
  (or image-text-to-text) head and mixture-of-experts layers: a config whose text part carries expert
  fields, or a modeling file that defines an experts module. No hard-coded list: a transformers
  upgrade that adds a family shows up here (and in ``tests/test_families.py``) by itself.
* :func:`tiny_config` shrinks a family's *own* default config generically (a few layers keeping the
  dense-first / hybrid / sparse-step pattern, small width, heads and head dims, few experts with
  K < n, small vocabulary, consistent MLA and group-limited routing dims, multimodal sub-configs too).
* :data:`UNSUPPORTED` names every discovered type moetool does not analyse, with the reason.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from ..configs import text_config
from ..progress import logger_level

#: model_type -> why moetool does not analyse it (every other discovered type must pass tests/test_families.py)
UNSUPPORTED: dict[str, str] = {
    "gemma4_assistant": "Gemma-4's speculative-decoding assistant (drafts from the target model's hidden states "
                        "through a KV-shared head; not a standalone language model)",
    "nemo_speechlm": "speech recognition (Nemotron-3.5-Transcribe: audio encoder -> transcript); its MoE text decoder"
                     " is the nemotron_h family",
    "diffusion_gemma": "block text-diffusion model (DiffusionGemmaForBlockDiffusion, bidirectional decoder): its "
                       "forward samples, so two forwards on the same input differ and there is no routing to "
                       "reproduce",
    # families whose structure or routing rule moetool does not read yet (the reason says what differs)
    "nllb-moe": "its experts module runs the wrong experts in the installed transformers: NllbMoeExperts one-hot "
                "encodes the router's 0/1 top-1 dispatch mask, so every token goes through expert_1 (weighted by its "
                "top-1 gate) and expert_0 (its top-2 gate) whatever the router chose; the output is not the routing "
                "(a transformers bug, checked against the router's own choice)",
}

_EXPERT_FIELD = re.compile(r"\b\w*experts\w*\s*[:=]")  # a config field such as ``num_experts: int = 8``
_EXPERTS_CLASS = re.compile(r"^class \w*Experts\(|@use_experts_implementation", re.M)

# ----- shrinking rules (key name -> small value), applied to every int field of the default config -----
N_EXPERTS, TOP_K, N_LAYERS = 8, 2, 4
TEXT = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=64, moe_inter=32, vocab=1024)
_EXACT: dict[str, int] = {
    # experts and routing
    "num_experts": N_EXPERTS, "num_local_experts": N_EXPERTS, "n_routed_experts": N_EXPERTS,
    "moe_num_experts": N_EXPERTS, "n_experts": N_EXPERTS, "num_experts_per_tok": TOP_K, "moe_topk": TOP_K,
    "moe_k": TOP_K, "top_k_experts": TOP_K, "num_experts_per_token": TOP_K, "top_k": TOP_K, "moe_top_k": TOP_K,
    "zero_expert_num": 2, "n_group": 2, "num_expert_group": 2, "topk_group": 1, "n_groups": 1,
    # attention and MLA
    "num_attention_heads": TEXT["heads"], "num_attention_heads_per_layer": TEXT["heads"],
    "num_key_value_heads": TEXT["kv_heads"], "head_dim": TEXT["head_dim"],
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "o_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "global_head_dim": 16,
    "num_global_key_value_heads": 2, "attention_chunk_size": 8, "sliding_window": 8,
    # linear attention / mamba / short convolutions
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_head_dim": 16,
    "linear_num_heads": 2,
    "linear_num_value_heads": 4, "mamba_d_state": 8, "mamba_d_head": 16, "mamba_n_heads": 8,
    "mamba_head_dim": 16, "mamba_num_heads": 8, "ssm_state_size": 8, "mamba_n_groups": 1, "mamba_dt_rank": 8,
    "mamba_chunk_size": 8, "chunk_size": 8,
}


def _transformers_dir() -> str:
    import transformers

    return os.path.dirname(transformers.__file__)


@functools.lru_cache(maxsize=None)
def _mappings() -> tuple[dict, dict, dict]:
    from transformers.models.auto import modeling_auto as ma

    return (dict(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), dict(ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
            dict(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES))


def _module_name(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


@functools.lru_cache(maxsize=None)
def _source(model_type: str, prefix: str) -> str:
    """The installed ``<prefix>*.py`` files of the model type's folder, joined (``""`` if none)."""
    folder = os.path.join(_transformers_dir(), "models", _module_name(model_type))
    if not os.path.isdir(folder):
        return ""
    return "\n".join(open(os.path.join(folder, f), encoding="utf-8").read() for f in sorted(os.listdir(folder))
                     if f.startswith(prefix) and f.endswith(".py"))


def _modeling_source(model_type: str) -> str:
    return _source(model_type, "modeling_")


def _config_source(model_type: str) -> str:
    return _source(model_type, "configuration_")


@functools.lru_cache(maxsize=1)
def _discover() -> dict[str, str]:
    """model_type -> head kind (``causal-lm`` | ``image-text-to-text`` | ``seq2seq``) of every MoE model type.

    Read from the installed sources (no config is built): a type with one of those heads is MoE if its modeling
    file defines an experts module (or uses ``@use_experts_implementation``), its configuration file has expert
    fields, or its configuration builds on the config class of a type found so (Kimi-K2.5 on DeepSeek-V3's).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    clm, itt, s2s = _mappings()
    kinds = {mt: "causal-lm" if mt in clm else "image-text-to-text" if mt in itt else "seq2seq"
             for mt in CONFIG_MAPPING_NAMES if mt in clm or mt in itt or mt in s2s}
    found = {mt: k for mt, k in kinds.items()
             if _EXPERTS_CLASS.search(_modeling_source(mt)) or _EXPERT_FIELD.search(_config_source(mt))}
    moe_configs = re.compile(r"\b(" + "|".join(re.escape(CONFIG_MAPPING_NAMES[mt]) for mt in found) + r")\b|"
                             r"model_type=\"(" + "|".join(re.escape(mt) for mt in found) + r")\"")
    found.update({mt: k for mt, k in kinds.items() if mt not in found and moe_configs.search(_config_source(mt))})
    return found


def moe_model_types() -> list[str]:
    """Every MoE model type (causal LM, multimodal with a causal text decoder, encoder-decoder) installed."""
    return sorted(_discover())


def head_kind(model_type: str) -> str:
    return _discover()[model_type]


def supported_types() -> list[str]:
    return [mt for mt in moe_model_types() if mt not in UNSUPPORTED]


# ----- the generic shrinker ---------------------------------------------------------------------------
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "decoder_layers")
_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types", "hybrid_override_pattern",
                    "attn_type_list", "moe_layer_types")


def _n_layers(d: dict) -> int | None:
    for k in _LAYER_KEYS:
        if isinstance(d.get(k), int):
            return d[k]
    return None


def _pick_layers(d: dict, n_default: int) -> int:
    """Fewest layers (>= 4, <= 8) whose prefix of every per-layer list shows each kind of layer it has."""
    lists = [v for k, v in d.items() if isinstance(v, (list, str)) and len(v) == n_default and n_default > 1
             and (k in _PER_LAYER_LISTS or k.endswith("layer_types"))]
    for n in range(N_LAYERS, 9):
        if all(set(v[:n]) == set(v[:max(n_default, n)]) for v in lists):
            return n
    return 8


#: routing fields some families leave ``None`` by default (the checkpoint's config sets them)
_FILL_NONE = {"num_experts_per_tok": TOP_K, "n_routed_experts": N_EXPERTS, "num_experts": N_EXPERTS,
              "n_shared_experts": 1, "moe_intermediate_size": TEXT["moe_inter"], "top_k_experts": TOP_K,
              "first_k_dense_replace": 1, "head_dim": TEXT["head_dim"], "sliding_window": 8}


def _shrink_value(key: str, value: Any, old_hidden: int | None, new_hidden: int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        return value
    if isinstance(value, list):
        if value and all(isinstance(x, int) and not isinstance(x, bool) for x in value) and (
                "intermediate" in key or "experts" in key or "heads" in key or key in _EXACT):
            return [_shrink_value(key, x, old_hidden, new_hidden) for x in value]
        return value
    if key in _EXACT:
        return min(value, _EXACT[key]) if value > 0 else value
    if key == "hidden_size":
        return new_hidden
    if old_hidden and value == old_hidden and ("hidden" in key or "dim" in key):
        return TEXT["hidden"]  # a width tied to the text model's
    if "intermediate" in key or "ffn_hidden" in key or "expert_dim" in key or key.endswith("_ffn_size") or \
            key == "moe_hidden_size":
        return TEXT["moe_inter"] if ("moe" in key or "expert" in key) else TEXT["inter"]
    if "vocab_size" in key:
        return min(value, TEXT["vocab"])
    if key.startswith(("n_shared", "num_shared", "moe_num_shared")) and value > 1:
        return 1
    return value


def _shrink_dict(d: dict, *, text: bool, old_hidden: int | None = None, skip: tuple[str, ...] = ()) -> dict:
    """A shrunk copy of one (sub-)config dict; nested sub-configs are shrunk as non-text towers."""
    out = {}
    old_hidden = old_hidden if old_hidden is not None else d.get("hidden_size")
    new_hidden = TEXT["hidden"] if text else 32
    n_default = _n_layers(d)
    n_new = _pick_layers(d, n_default) if (text and n_default) else 1
    for k, v in d.items():
        if isinstance(v, dict):
            if k in skip:
                out[k] = v
            elif n_default and v and all(str(i).isdigit() for i in v):  # per-layer overrides {layer index: ...}
                out[k] = {i: (_shrink_dict(x, text=text) if isinstance(x, dict) else x) for i, x in v.items()
                          if int(i) < n_new}
            elif text and v and all(isinstance(x, dict) for x in v.values()):  # per-layer-type overrides
                out[k] = {i: _shrink_dict(x, text=True) for i, x in v.items()}
            else:
                out[k] = _shrink_dict(v, text=False, old_hidden=old_hidden) if "model_type" in v or _n_layers(v) else v
            continue
        if v is None and k in _FILL_NONE and text:
            out[k] = _FILL_NONE[k]
            continue
        if k in _LAYER_KEYS and isinstance(v, int) and n_default is not None:
            out[k] = min(v, n_new)
        elif k in ("depth", "encoder_layers", "num_blocks") and isinstance(v, int) and not text:
            out[k] = 1
        elif isinstance(v, (list, str)) and n_default and len(v) == n_default > 1 and (
                isinstance(v, list) or k in _PER_LAYER_LISTS or k.endswith("_pattern")):
            out[k] = [_shrink_value(k, x, old_hidden, new_hidden) for x in v[:n_new]] if isinstance(v, list) \
                else v[:n_new]
        elif k in ("mlp_only_layers", "moe_layers", "dense_layers", "full_attn_idxs", "attn_layer_indices") and \
                isinstance(v, list):
            out[k] = [i for i in v if isinstance(i, int) and i < n_new]
        elif k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index") and isinstance(v, int):
            out[k] = min(v, 1)
        elif k == "moe_layer_end_index" and isinstance(v, int):
            out[k] = n_new - 1
        elif k.endswith("token_id") and isinstance(v, int) and v >= TEXT["vocab"]:
            out[k] = None if "pad" in k else 1
        elif k.endswith("token_id") and isinstance(v, list):
            out[k] = [x for x in v if isinstance(x, int) and x < TEXT["vocab"]] or None
        elif not text and k in ("num_attention_heads", "num_heads", "num_key_value_heads", "encoder_attention_heads",
                                "decoder_attention_heads"):
            out[k] = min(v, 2) if isinstance(v, int) else v
        elif not text and isinstance(v, int) and not isinstance(v, bool) and k != "hidden_size" and \
                v == d.get("hidden_size") and v != old_hidden and ("dim" in k or "hidden" in k or "size" in k):
            out[k] = new_hidden  # a width tied to this tower's own
        elif not text and isinstance(v, int) and not isinstance(v, bool) and (
                "intermediate" in k or "ffn_dim" in k or k in ("d_model", "output_dim", "hidden_size")) and v > 64:
            out[k] = TEXT["hidden"] if (old_hidden and v == old_hidden and k != "hidden_size") else \
                64 if ("intermediate" in k or "ffn" in k) else 32
        else:
            out[k] = _shrink_value(k, v, old_hidden, new_hidden)
    # keep the attention geometry consistent
    if text and isinstance(d.get("head_dim"), int) and d.get("head_dim") == d.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
    if text and isinstance(d.get("qk_head_dim"), int) and "qk_nope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if text and "num_attention_heads" in out and "num_key_value_heads" in out and out["num_key_value_heads"]:
        if d.get("num_key_value_heads") == d.get("num_attention_heads"):
            out["num_key_value_heads"] = out["num_attention_heads"]
    if text:
        n = next((out[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                                   "n_experts") if isinstance(out.get(k), int)), None)
        groups = next((k for k in ("n_group", "num_expert_group") if isinstance(out.get(k), int)), None)
        if groups and n and n % out[groups]:
            out[groups] = 1
        if groups and "topk_group" in out and isinstance(out["topk_group"], int):
            out["topk_group"] = max(1, min(out["topk_group"], out[groups] - 1 if out[groups] > 1 else 1))
    return out


MAX_TINY_PARAMS = 20_000_000

#: per-family fields the generic rules cannot guess (kept minimal; each line says why)
FIXUPS: dict[str, dict[str, Any]] = {
    "jamba": {"attn_layer_period": 4, "attn_layer_offset": 3},  # an attention layer within the 4 (cache needs one)
    "doge": {"is_moe": True, "num_experts": 16},  # MoE is opt-in; a square key grid (8 leaves 4 rows unreachable)
    "gemma4_text": {"enable_moe_block": True},  # MoE is opt-in (the 26B-A4B checkpoint sets it)
    "dbrx": {"d_model": TEXT["hidden"], "n_heads": TEXT["heads"], "n_layers": N_LAYERS, "max_seq_len": 256,
             "vocab_size": TEXT["vocab"], "attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": TEXT["moe_inter"], "moe_num_experts": N_EXPERTS, "moe_top_k": TOP_K}},
    "glm5_next_text": {"index_topk": 16},  # must be a multiple of index_kpool
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},  # default None = computed
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},  # default None
    # its default leaves the indexer (sparse attention) fields None although some layer types need them
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"] * 2},  # default: Mamba only, which fails
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 3},  # read by its forward, absent from the defaults
    "hunyuan_v1_moe": {"num_experts": N_EXPERTS, "moe_topk": TOP_K},  # its defaults: one expert, top-1
    "muse_spark": {"out_hidden_size": 32, "projector_hidden_size": 64},  # the vision adapter's widths
    "dots3_note": {"vision_config": {"adapter_in_dim": 32}},  # tied to the vision width, which equals the text's
    "glm4v_moe_text": {"head_dim": 128},  # its M-RoPE sections [8, 12, 12] need 128 * partial_rotary_factor / 2
    "ernie4_5_vl_moe_text": {"head_dim": 128},  # 3-D RoPE split sized for 128
    "hy_v4_vl_text": {"rope_parameters": {"mrope_section": [2, 1, 1]}},  # must sum to qk_rope_head_dim // 2 = 4
    # encoder-decoder (T5 field names the generic rules do not know): 4 + 4 blocks, every other one sparse
    "switch_transformers": {"d_model": TEXT["hidden"], "d_ff": TEXT["inter"], "d_kv": TEXT["head_dim"],
                            "num_heads": TEXT["heads"], "num_layers": N_LAYERS, "num_decoder_layers": N_LAYERS,
                            "num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2, "encoder_sparse_step": 2,
                            "decoder_sparse_step": 2,
                            "vocab_size": TEXT["vocab"], "decoder_start_token_id": 0},
}


def tiny_config(model_type: str) -> Any:
    """The family's own config class with its defaults shrunk (see the module docstring)."""
    import logging
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings(), logger_level("transformers", logging.ERROR):
        warnings.simplefilter("ignore")
        default = cls()
    d = default.to_dict()
    tc = text_config(default)
    composite = tc is not default and not getattr(default, "is_encoder_decoder", False)  # T5: a decoder copy
    if composite:
        sub = next(k for k, v in d.items() if isinstance(v, dict) and v.get("model_type") == tc.model_type)
        old_hidden = tc.hidden_size
        d = {k: (_shrink_dict(v, text=False, old_hidden=old_hidden) if isinstance(v, dict) and "model_type" in v
                 else v) for k, v in d.items()}
        d[sub] = _shrink_dict(tc.to_dict(), text=True)
        for k, v in FIXUPS.get(tc.model_type, {}).items():
            d[sub][k] = {**d[sub][k], **v} if isinstance(v, dict) and isinstance(d[sub].get(k), dict) else v
        d = _shrink_dict(d, text=False, skip=(sub,))  # token ids etc. of the wrapper
        for k, v in list(d.items()):  # wrapper-level dims tied to the text width
            if isinstance(v, int) and not isinstance(v, bool) and v == old_hidden and "hidden" in k:
                d[k] = TEXT["hidden"]
    else:
        d = _shrink_dict(d, text=True)
    for k, v in FIXUPS.get(model_type, {}).items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    for k in ("architectures", "transformers_version", "model_type", "_name_or_path"):
        d.pop(k, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**d)


def model_class(model_type: str) -> Any:
    """The Auto class that builds the family's language model (causal LM, image-text-to-text or seq2seq LM)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    kind = head_kind(model_type)
    if kind == "causal-lm":
        return AutoModelForCausalLM
    if kind == "image-text-to-text":
        return AutoModelForImageTextToText
    if kind == "seq2seq":
        return AutoModelForSeq2SeqLM
    raise ValueError(f"{model_type}: {kind} models are not analysed")
