"""Resolve ``--model`` (embedded name, alias, local path or hub id) and load model + tokenizer.

* embedded: ``tiny``, ``tiny-fine`` and their checkpoints, shipped in ``moetool/embedded/``;
* aliases: short names of well-known MoE checkpoints (``moetool inspect --aliases``);
* a local directory with a ``config.json``; or a hub id ``org/name`` (needs network).

The config is read first, so a dense or unsupported model fails before any weight loads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MoetoolError
from .registry import did_you_mean

DEFAULT_MODEL = "tiny"
EMBEDDED_DIR = Path(__file__).parent / "embedded"

ALIASES: dict[str, str] = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "mixtral-8x7b-instruct": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "olmoe": "allenai/OLMoE-1B-7B-0924",
    "qwen1.5-moe": "Qwen/Qwen1.5-MoE-A2.7B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "phi-3.5-moe": "microsoft/Phi-3.5-MoE-instruct",
}

DTYPES = ("auto", "bf16", "fp16", "fp32")
DEVICES = ("auto", "cuda", "cpu")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def embedded_models() -> dict[str, Path]:
    """Embedded model name -> directory."""
    if not EMBEDDED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(EMBEDDED_DIR.iterdir()) if (p / "config.json").is_file()}


def resolve(name: str) -> tuple[str, str]:
    """``(source, kind)`` with kind ``embedded`` | ``alias`` | ``local`` | ``hub``."""
    emb = embedded_models()
    if name in emb:
        return str(emb[name]), "embedded"
    if name in ALIASES:
        return ALIASES[name], "alias"
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise MoetoolError(f"{name} is not a model directory (no config.json in it)")
        return str(p), "local"
    if _HUB_ID.match(name) and not name.startswith((".", "/")):
        return name, "hub"
    raise MoetoolError(f"unknown model '{name}'{did_you_mean(name, [*emb, *ALIASES])}: give an embedded name "
                       f"({', '.join(emb) or 'none'}), an alias (moetool inspect --aliases), "
                       f"a local directory or a hub id org/name")


def _offline_error(name: str, source: str, err: Exception) -> MoetoolError:
    return MoetoolError(f"could not fetch '{source}' from the Hugging Face Hub ({type(err).__name__}: no network, "
                        f"or not a hub id?): download it where there is network and pass the local directory, "
                        f"e.g. --model /path/to/{source.split('/')[-1]}")


def load_config(name: str) -> tuple[Any, str, str]:
    """``(config, source, kind)``; checks that the model is a supported MoE family."""
    from transformers import AutoConfig

    from .adapters import check_config

    source, kind = resolve(name)
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - hub/network errors come in many types
        if kind in ("hub", "alias"):
            raise _offline_error(name, source, e) from None
        raise MoetoolError(f"cannot read the config of {source}: {e}") from None
    check_config(config)
    return config, source, kind


def pick_device(device: str = "auto"):
    import torch

    if device not in DEVICES:
        raise MoetoolError(f"--device must be one of {', '.join(DEVICES)}, not '{device}'")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoetoolError("--device cuda asked for, but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, config: Any, device) -> Any:
    """``auto``: the checkpoint's dtype, except fp16/bf16 are upcast to fp32 on CPU."""
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype in table:
        return table[dtype]
    if dtype != "auto":
        raise MoetoolError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'")
    ck = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(ck, str):
        ck = getattr(torch, ck, None)
    if not isinstance(ck, torch.dtype) or device.type == "cpu":
        return torch.float32
    return ck


@dataclass
class LoadedModel:
    name: str  # what the user typed
    source: str  # resolved path or hub id
    kind: str
    model: Any
    tokenizer: Any
    layers: list  # [MoELayer]
    device: Any
    dtype: Any

    @property
    def config(self) -> Any:
        return self.model.config

    def manifest(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "kind": self.kind,
                "model_type": self.config.model_type, "device": str(self.device), "dtype": str(self.dtype),
                "moe_layers": [L.index for L in self.layers], "config": self.config.to_dict()}


def load(name: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto", device_map: str | None = None,
         attn_implementation: str | None = None, tokenizer: bool = True) -> LoadedModel:
    """Load a supported MoE causal LM in eval mode with its tokenizer and wrapped MoE layers."""
    config, source, kind = load_config(name)
    import torch  # noqa: F401 - heavy imports only here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .adapters import find_moe_layers

    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, config, dev)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map:
        if device_map != "auto":
            raise MoetoolError("--device-map takes 'auto' (accelerate places the layers)")
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as e:
        if kind in ("hub", "alias"):
            raise _offline_error(name, source, e) from None
        raise MoetoolError(f"cannot load the weights of {source}: {e}") from None
    if not device_map:
        model.to(dev)
    model.eval()
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except Exception as e:  # noqa: BLE001
            raise MoetoolError(f"cannot load the tokenizer of {source}: {e}") from None
        if tok.pad_token_id is None and tok.eos_token_id is not None:
            tok.pad_token = tok.eos_token
    return LoadedModel(name=name, source=source, kind=kind, model=model, tokenizer=tok,
                       layers=find_moe_layers(model), device=model.device, dtype=torch_dtype)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
