"""Resolving --model: embedded names, aliases, local dirs, hub ids, and the one-line errors."""

import pytest

from moetool.errors import MoetoolError
from moetool.loading import ALIASES, load_config, pick_dtype, pick_device, resolve


def test_alias_and_hub_id_resolve_without_network():
    assert resolve("mixtral-8x7b") == ("mistralai/Mixtral-8x7B-v0.1", "alias")
    assert resolve("olmoe")[0] == "allenai/OLMoE-1B-7B-0924"
    assert resolve("some-org/some-model") == ("some-org/some-model", "hub")
    assert set(ALIASES) >= {"mixtral-8x7b", "olmoe", "qwen1.5-moe", "qwen3-30b-a3b", "deepseek-v2-lite",
                            "gpt-oss-20b", "phi-3.5-moe"}


def test_unknown_model_suggests_alias():
    with pytest.raises(MoetoolError, match="did you mean 'mixtral-8x7b'"):
        resolve("mixtral-8x7")


def test_local_dir_without_config(tmp_path):
    with pytest.raises(MoetoolError, match="no config.json"):
        resolve(str(tmp_path))


def test_dense_model_is_refused_before_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(MoetoolError, match="no MoE layers found in llama"):
        load_config(str(tmp_path))


def test_unsupported_moe_family_names_supported_ones(tmp_path):
    from transformers import GraniteMoeConfig

    GraniteMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, num_local_experts=4).save_pretrained(tmp_path)
    with pytest.raises(MoetoolError, match="unsupported MoE family 'granitemoe'; supported: .*mixtral"):
        load_config(str(tmp_path))


def test_dtype_and_device_choices():
    import torch
    from transformers import MixtralConfig

    cfg = MixtralConfig()
    cfg.dtype = torch.bfloat16
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cfg, cpu) == torch.float32  # upcast on CPU
    assert pick_dtype("auto", cfg, torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("fp16", cfg, cpu) == torch.float16
    with pytest.raises(MoetoolError, match="--dtype"):
        pick_dtype("int8", cfg, cpu)
    with pytest.raises(MoetoolError, match="--device"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(MoetoolError, match="no CUDA"):
            pick_device("cuda")
