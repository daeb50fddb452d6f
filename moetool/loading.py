"""Resolve ``--model`` (embedded name, alias, local path or hub id) and load model + tokenizer.

* embedded: ``tiny``, ``tiny-fine`` and their checkpoints, shipped in ``moetool/embedded/``;
* aliases: short names of well-known MoE checkpoints (``moetool inspect --aliases``);
* a local directory with a ``config.json``; or a hub id ``org/name`` (needs network).

The config is read first, so a dense or unsupported model fails before any weight loads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .configs import stored_dtype
from .errors import MoetoolError, MoetoolRuntimeError, one_line, shown
from .hub import hub_error, hub_kwargs
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
    "trinity-mini": "arcee-ai/Trinity-Mini",  # afmoe
    "ernie-4.5-21b-a3b": "baidu/ERNIE-4.5-21B-A3B-PT",  # ernie4_5_moe
    "hunyuan-a13b": "tencent/Hunyuan-A13B-Instruct",  # hunyuan_v1_moe
    "ax-k2": "skt/A.X-K2",  # axk2
    "ling-3.0-flash": "inclusionAI/Ling-3.0-Flash",  # bailing_hybrid
    "command-a-plus": "CohereLabs/command-a-plus-05-2026",  # cohere2_moe
    "deepseek-ocr-2": "deepseek-community/DeepSeek-OCR-2",  # deepseek_ocr2
    "deepseek-v3.2-exp": "deepseek-ai/DeepSeek-V3.2-Exp",  # deepseek_v32
    "dots.llm1": "rednote-hilab/dots.llm1.base",  # dots1
    "dots3-note": "dots-studio/dots3-note-prev",  # dots3_note
    "k-exaone": "LGAI-EXAONE/K-EXAONE-236B-A23B",  # exaone_moe
    "flexolmo": "allenai/FlexOlmo-7x7B-1T",  # flex_olmo
    "glm-4.5": "zai-org/GLM-4.5",  # glm4_moe
    "glm-4.5v": "zai-org/GLM-4.5V",  # glm4v_moe
    "glm-5": "zai-org/GLM-5",  # glm_moe_dsa
    "powermoe-3b": "ibm/PowerMoE-3b",  # granitemoe
    "granite-swash-3b": "ibm-granite/granite-swash-3b-a600m",  # granitemoe_swa
    "granite-4.0-h-tiny": "ibm-granite/granite-4.0-h-tiny",  # granitemoehybrid
    "hy3": "tencent/Hy3-preview",  # hy_v3
    "jamba-v0.1": "ai21labs/Jamba-v0.1",  # jamba
    "kimi-k2.6": "moonshotai/Kimi-K2.6",  # kimi_k25
    "kimi-linear": "moonshotai/Kimi-Linear-48B-A3B-Instruct",  # kimi_linear
    "kolibri-1": "Aleph-Alpha/Kolibri-1",  # kolibri1
    "laguna-xs.2": "poolside/laguna-XS.2",  # laguna
    "lfm2-8b-a1b": "LiquidAI/LFM2-8B-A1B",  # lfm2_moe
    "mellum2": "JetBrains/Mellum2-12B-A2.5B-Base",  # mellum
    "mimo-v2-flash": "XiaomiMiMo/MiMo-V2-Flash",  # mimo_v2_flash
    "mistral-small-4": "mistralai/Mistral-Small-4-119B-2603",  # mistral4
    "mistral-large-4": "mistralai/Mistral-Large-4-1T-A52B",  # mistral_large4
    "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B",  # qwen3_5_moe
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",  # qwen3_next
    "qwen3-omni-30b-a3b": "Qwen/Qwen3-Omni-30B-A3B-Instruct",  # qwen3_omni_moe_thinker
    "qwen3-vl-30b-a3b": "Qwen/Qwen3-VL-30B-A3B-Instruct",  # qwen3_vl_moe
    "qwen4-exp": "Qwen/Qwen4-Exp",  # qwen4_exp
    "solar-open-100b": "upstage/Solar-Open-100B",  # solar_open
    "step-3.7-flash": "stepfun-ai/Step-3.7-Flash",  # step3p7
    "unlimited-ocr": "baidu/Unlimited-OCR",  # unlimited_ocr
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E",  # llama4
    "aria": "rhymes-ai/Aria",  # aria
    "nemotron-3-nano": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",  # nemotron_h
    "nemotron-3-nano-omni": "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16",  # nemotron_h_omni
    "minimax-m3": "MiniMaxAI/MiniMax-M3",  # minimax_m3_vl
    "glm-5.3-flash": "zai-org/GLM-5.3-Flash",  # glm5_next
    "hy4": "tencent/Hy4-preview",  # hy_v4
    "inkling-2-small": "thinkingmachines/Inkling-2-Small-MXFP8",  # inkling2
    "hy4-vl": "tencent/Hy4",  # hy_v4_vl
    "inkling-2-mini": "thinkingmachines/Inkling-2-Mini",  # inkling2_loop
    "lara-4-mini": "translated/Lara-4-Mini-Base",  # lara_mini
    "sarvam-105b": "sarvamai/sarvam-105b",  # sarvam_mla
    "sarvam-30b": "sarvamai/sarvam-30b",  # sarvam_moe
    "minimax-text-01": "MiniMaxAI/MiniMax-Text-01-hf",  # minimax
    "gemma-4-26b-a4b": "google/gemma-4-26B-A4B-it",  # gemma4
    "switch-base-8": "google/switch-base-8",  # switch_transformers
    "ax-k1": "skt/A.X-K1",  # axk1
    "beam-1.0": "reflection/Beam-1.0-501B-A23B",  # beam
    "flint": "RecursiveSI/flint",  # flint
    "muse-spark": "meta-models/Muse-Spark-Open-816B-A42B",  # muse_spark
    "inkling": "thinkingmachines/Inkling",  # inkling_mm_model
    "ernie-4.5-vl-28b-a3b": "baidu/ERNIE-4.5-VL-28B-A3B-PT",  # ernie4_5_vl_moe
    "jetmoe-8b": "jetmoe/jetmoe-8b",  # jetmoe
    "dbrx-instruct": "transformers-community/dbrx-instruct",  # dbrx
    "deepseek-v4-flash": "deepseek-ai/DeepSeek-V4-Flash-Base",  # deepseek_v4
    "longcat-flash": "meituan-longcat/LongCat-Flash-Chat",  # longcat_flash
    "zaya1-8b": "Zyphra/ZAYA1-8B",  # zaya
    "doge-320m": "SmallDoge/Doge-320M",  # doge
}

DTYPES = ("auto", "bf16", "fp16", "fp32")
#: the long names (torch's) of the choices of :data:`DTYPES`: the Python API takes them (and ``torch.bfloat16``, ...)
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
DEVICES = ("auto", "cuda", "cpu")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def embedded_models() -> dict[str, Path]:
    """Embedded model name -> directory."""
    if not EMBEDDED_DIR.is_dir():
        return {}
    return {p.name: p for p in sorted(EMBEDDED_DIR.iterdir()) if (p / "config.json").is_file()}


def looks_like_path(name: str) -> bool:
    """``name`` can only be a folder, never a hub id (``org/name``): it starts with ``./``, ``../``, ``/`` or ``~``,
    is ``.`` or ``..``, ends with ``/`` or has two or more ``/``."""
    return (name.startswith(("./", "../", "/", "~")) or name in (".", "..") or name.endswith("/")
            or name.count("/") >= 2)


#: file formats of other runtimes, by suffix: what a folder or file of them is, in a refusal
_FOREIGN_FORMATS = {".gguf": "a GGUF file (llama.cpp's format)", ".onnx": "an ONNX export",
                    ".mlmodel": "a Core ML model", ".mlpackage": "a Core ML model", ".engine": "a TensorRT engine"}
_TRANSFORMERS_CHECKPOINT = "a transformers checkpoint (a folder with config.json and *.safetensors or *.bin)"


def peft_adapter(name: str, path: Path, why: str) -> str:
    """The line that refuses ``path``, a PEFT adapter folder (``adapter_config.json``; ``why``: what shows it), naming
    its base model (``base_model_name_or_path``) and how to use it: merge it, or pass the base."""
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    of = f" of {base}" if isinstance(base, str) and base else ""
    point = f", or pass the base model itself (--model {shlex.quote(base)})" if of else ""
    return (f"{name} is a PEFT adapter{of} ({why}) and moetool loads whole models: merge it into its base first "
            f"(peft: PeftModel.from_pretrained(base, '{name}').merge_and_unload().save_pretrained(DIR), then "
            f"--model DIR){point}")


def not_a_model_directory(name: str, path: Path) -> str:
    """Why ``path`` (which exists and holds no ``config.json``) is no model ``--model`` loads, and what to pass
    instead, in one line: a file beside its checkpoint's config (``config.json``, a ``*.safetensors`` shard) names
    that folder; a PEFT adapter (``adapter_config.json``) names its base model; a GGUF or ONNX file or folder says
    it is another runtime's format."""
    if path.is_file():
        kind = _FOREIGN_FORMATS.get(path.suffix.lower())
        if kind is not None:
            return (f"{name} is {kind}; moetool loads {_TRANSFORMERS_CHECKPOINT}: pass the original model's folder "
                    f"or hub id")
        if (path.parent / "config.json").is_file():
            return f"{name} is a file; --model takes the folder that holds it: --model {shlex.quote(str(path.parent))}"
        return f"{name} is a file, not a model directory: moetool loads {_TRANSFORMERS_CHECKPOINT}"
    if (path / "adapter_config.json").is_file():
        return peft_adapter(name, path, "adapter_config.json, no config.json")
    try:
        found = sorted({f.suffix.lower() for f in path.iterdir()} & set(_FOREIGN_FORMATS))
    except OSError:
        found = []
    if found:
        return (f"{name} holds {_FOREIGN_FORMATS[found[0]]} and no config.json; moetool loads "
                f"{_TRANSFORMERS_CHECKPOINT}: pass the original model's folder or hub id")
    return f"{name} is not a model directory (no config.json in it)"


def resolve(name: str) -> tuple[str, str]:
    """``(source, kind)`` with kind ``embedded`` | ``alias`` | ``local`` | ``hub``; ``name`` a string or a path."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        raise MoetoolError(f"a model is named by a string (an embedded name, an alias, a directory or a hub id) "
                           f"or a path, not {shown(name)}")  # a loaded model: named, not dumped
    emb = embedded_models()
    if not name.strip():  # an unset shell variable: not the current folder ('.' names it)
        raise MoetoolError(f"--model {name!r} is an empty name: give an embedded name ({', '.join(emb) or 'none'}), "
                           f"an alias, a local directory ('.' for the current folder) or a hub id org/name")
    if name in emb:
        return str(emb[name]), "embedded"
    if name in ALIASES:
        return ALIASES[name], "alias"
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise MoetoolError(not_a_model_directory(name, p))
        return str(p), "local"
    if looks_like_path(name):  # no hub id is spelled so: a folder that is not there
        raise MoetoolError(f"no such directory: {name}{did_you_mean(Path(name.rstrip('/')).name, [*emb, *ALIASES])}")
    if _HUB_ID.match(name):
        return name, "hub"
    repo, at, rev = name.partition("@")
    if at and (_HUB_ID.match(repo) or repo in ALIASES):  # org/name@rev: transformers' revision, not a hub id
        full = ALIASES.get(repo, repo)
        raise MoetoolError(f"'{name}': --model takes no revision (@{rev}); download that revision (hf download {full} "
                           f"--revision {rev} --local-dir DIR) and pass the folder, or pass {repo} for the latest")
    raise MoetoolError(f"unknown model '{name}'{did_you_mean(name, [*emb, *ALIASES])}: give an embedded name "
                       f"({', '.join(emb) or 'none'}), an alias (moetool inspect --aliases), "
                       f"a local directory or a hub id org/name")


# ----- the Hugging Face Hub: decide online/offline in a second, never wait for retries ----------------------------
# ----- local files ---------------------------------------------------------------------------------------------
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


#: the files a local checkpoint's weights come in (transformers' safetensors and PyTorch formats)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def check_safetensors(directory: str | Path) -> None:
    """Refuse (one line) a ``*.safetensors`` file in ``directory`` that is truncated or not a safetensors file.

    Reads only the 8-byte header length and the JSON header of each file: the file must be exactly
    ``8 + header + data`` bytes long, the data size being the largest tensor end offset in the header.
    """
    for f in sorted(Path(directory).glob("*.safetensors")):
        size = f.stat().st_size
        again = "copy or download it again"
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, _MAX_SAFETENSORS_HEADER):
                raise MoetoolRuntimeError(f"{f} is not a safetensors file (corrupt or truncated header, "
                                          f"{size:,} bytes): {again}")
            try:
                header = json.loads(fh.read(n))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, UnicodeDecodeError):
                raise MoetoolRuntimeError(f"{f} is not a safetensors file (unreadable header): {again}") from None
        want = 8 + n + end
        if size < want:
            raise MoetoolRuntimeError(f"{f} is truncated ({size:,} of {want:,} bytes): {again}")
        if size > want:
            raise MoetoolRuntimeError(f"{f} is corrupt ({size - want:,} bytes more than its header describes): "
                                      f"{again}")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars (``Loading weights``) off for the block, restored after it: moetool's
    progress is the one display. Hub download bars (huggingface_hub's own) are left alone."""
    from transformers.utils import logging as hf_logging

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:  # older transformers: switch every bar off for the block
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()
        return
    previous = set_hook(lambda factory, args, kwargs: factory(*args, **{**kwargs, "disable": True}))
    try:
        yield
    finally:
        set_hook(previous)


def auto_model_class(config: Any) -> Any:
    """The transformers Auto class a model of ``config`` loads with: ``AutoModelForSeq2SeqLM`` for an encoder-decoder
    (Switch Transformers), ``AutoModelForImageTextToText`` for a vision-language family with no causal-LM head class
    (Qwen3-VL-MoE, GLM-4.5V, ...: moetool feeds it text only), ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    mt = getattr(config, "model_type", None)
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def model_from_config(config: Any) -> Any:
    """``auto_model_class(config).from_config(config)`` (on the device of the context, e.g. ``torch.device("meta")``):
    a config of the checkpoint's own code (read only when trusted, :func:`read_config`) builds its own model class;
    transformers is told so, and never asks on stdin."""
    remote = not type(config).__module__.startswith("transformers.")
    return auto_model_class(config).from_config(config, trust_remote_code=remote)


def trusted(trust_remote_code: bool | None = None) -> bool:
    """``trust_remote_code`` given, else the run's (``--trust-remote-code``, :class:`moetool.context.RunState`), else
    False: transformers is always told, so it never asks on stdin (a prompt would hang a job or torchrun)."""
    if trust_remote_code is not None:
        return bool(trust_remote_code)
    from .context import current

    run = current()
    return bool(run is not None and run.trust_remote_code)


def ask_trust(source: str) -> str:
    """The end of every refusal of a checkpoint's own code (its config's, its tokenizer's): how to allow it."""
    return (f"moetool runs a checkpoint's own code only when asked: pass --trust-remote-code "
            f"(trust_remote_code=True in Python) if you trust {source}")


@functools.lru_cache(maxsize=1)
def _native_types_by_class() -> dict[str, tuple[str, ...]]:
    """transformers' model class name -> the model types whose Auto mappings name it (every ``*_MAPPING_NAMES``
    of ``transformers.models.auto.modeling_auto``)."""
    from transformers.models.auto import modeling_auto

    found: dict[str, set[str]] = {}
    for attr in dir(modeling_auto):
        table = getattr(modeling_auto, attr)
        if not attr.endswith("_MAPPING_NAMES") or not isinstance(table, dict):
            continue
        for model_type, names in table.items():
            for cls in names if isinstance(names, (list, tuple)) else (names,):
                if isinstance(cls, str):
                    found.setdefault(cls, set()).add(model_type)
    return {cls: tuple(sorted(types)) for cls, types in found.items()}


def native_model_type(architectures: Any) -> str | None:
    """The model type of transformers' own class named first in a config's ``architectures`` (e.g.
    ``DeepseekV3ForCausalLM`` -> ``deepseek_v3``), ``None`` when transformers has no such class. A class that
    several model types' mappings name (``DeepseekV3ForCausalLM``: deepseek_v3 and sarvam_mla, which reuses it) is
    the type whose own module defines it (``transformers.models.deepseek_v3``)."""
    if not isinstance(architectures, (list, tuple)) or not architectures or not isinstance(architectures[0], str):
        return None
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    cls = architectures[0]
    types = [t for t in _native_types_by_class().get(cls, ()) if t in CONFIG_MAPPING]
    if len(types) > 1:  # the type whose package defines the class
        module = (getattr(transformers, "_class_to_module", None) or {}).get(cls, "")
        parts = module.split(".")
        package = parts[1] if len(parts) > 2 and parts[0] == "models" else None
        types = [t for t in types if model_type_to_module_name(t) == package]
    return types[0] if len(types) == 1 else None


_NOTICED: set[str] = set()  # sources whose native reading was said (once per process)


def _notice_native(source: str, model_type: str, native: str, architectures: list[str]) -> None:
    if source in _NOTICED:
        return
    _NOTICED.add(source)
    from .distributed import global_rank

    if global_rank() == 0:  # one line per launch, not one per rank of a --tp group
        print(f"{source}'s config names model type {model_type} with remote code; reading it as transformers' native "
              f"{native} (architectures: {', '.join(architectures)}); its code is not run", file=sys.stderr, flush=True)


def _remote_config_refused(source: str, config_dict: dict[str, Any]) -> MoetoolError:
    auto = (config_dict.get("auto_map") or {}).get("AutoConfig")
    arch = config_dict.get("architectures")
    import transformers

    return MoetoolError(
        f"{source}'s config is remote code ({auto}, the checkpoint's own): transformers "
        f"{transformers.__version__} has no model type {config_dict.get('model_type')!r} nor a class of its "
        f"architectures {arch or '(none named)'}; {ask_trust(source)}")


def read_config(source: str, from_hub: dict[str, Any] | None = None, *,
                trust_remote_code: bool = False) -> tuple[Any, str]:
    """``(config, how)``: ``source``'s config, never asking on stdin; ``how`` is ``native``, ``architecture`` or
    ``remote``:

    * ``native``: a model type transformers has: :class:`~transformers.AutoConfig` as always (a checkpoint's
      ``auto_map`` is not run, even when trusted: transformers' own code first);
    * ``architecture``: remote code (``auto_map``) of a model type transformers lacks whose ``architectures[0]`` is
      a class it has (Kimi-K2: ``kimi_k2``, ``DeepseekV3ForCausalLM``): that class's config
      (:func:`native_model_type`), from the same fields as AutoConfig reads them (``from_dict``:
      ``quantization_config`` and every other field kept), ``auto_map`` dropped; one notice line on stderr;
    * ``remote``: other remote code, run only with ``trust_remote_code``, else one line.

    config.json is read once for a native config: AutoConfig with ``trust_remote_code=False`` first (it never runs
    a checkpoint's code then, nor asks on stdin: remote code without a native class is its ``ValueError``); only
    when it refuses are the fields read to tell the other cases (and its other errors, a network's, pass as they
    are).
    """
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    from_hub = from_hub or {}
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False, **from_hub), "native"
    except ValueError:  # remote code transformers has no class for, or a config it cannot read: decided below
        pass
    config_dict, unused = PretrainedConfig.get_config_dict(source, **from_hub)
    model_type = config_dict.get("model_type")
    remote = bool((config_dict.get("auto_map") or {}).get("AutoConfig"))
    if model_type in CONFIG_MAPPING or not remote:
        return AutoConfig.from_pretrained(source, trust_remote_code=False, **from_hub), "native"
    native = native_model_type(config_dict.get("architectures"))
    if native is not None:
        _notice_native(source, model_type, native, config_dict["architectures"])
        fields = {k: v for k, v in config_dict.items() if k != "auto_map"}
        config = CONFIG_MAPPING[native].from_dict({**fields, "model_type": native}, **unused)
        config._name_or_path = str(source)  # as AutoConfig names it (transformers' tokenizer rules read it)
        return config, "architecture"
    if not trust_remote_code:
        raise _remote_config_refused(source, config_dict)
    return AutoConfig.from_pretrained(source, trust_remote_code=True, **from_hub), "remote"


def _read_config(name: str, trust_remote_code: bool | None = None
                 ) -> tuple[Any, str, str, dict[str, Any], str | None, str]:
    source, kind = resolve(name)
    from_hub, offline = hub_kwargs(kind)
    if offline:  # decided before transformers (and torch) are even imported: a second, not half a minute
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "config.json"), str):
            raise hub_error(source, FileNotFoundError("config.json not cached"), offline)
    from .adapters import check_config

    try:
        config, how = read_config(source, from_hub, trust_remote_code=trusted(trust_remote_code))
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - hub/network errors come in many types
        if kind in ("hub", "alias"):
            raise hub_error(source, e, offline) from e
        # a config.json on disk that transformers cannot read (not JSON, no or an unknown model_type, a field of the
        # wrong type): the input is wrong, a usage error as the config checks of check_config are
        raise MoetoolError(f"cannot read the config of {source}: {one_line(e)}") from e
    check_config(config)
    check_stored_dtype(config, source)
    return config, source, kind, from_hub, offline, how


#: the dtypes transformers builds a model in (its default dtype while the modules are made)
BUILD_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_stored_dtype(config: Any, source: str) -> None:
    """Refuse (one line, exit 2) a config whose recorded dtype (:func:`moetool.configs.stored_dtype`) is one no model
    is built in (``float8_e4m3fn``, ``int8``): transformers makes its modules in that dtype and fails deep in torch
    (``couldn't find storage object Float8_e4m3fnStorage``, or "cannot be instantiated under dtype=torch.int8"), and
    plan would size the weights as bf16. A quantized checkpoint records its quantization in ``quantization_config``
    and the dtype of its other layers here."""
    dtype = stored_dtype(config)
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    if name is None or name in BUILD_DTYPES:
        return
    raise MoetoolError(f"the config of {source} records dtype {name}, which no model is built in "
                       f"({', '.join(BUILD_DTYPES[:3])}): a quantized checkpoint records its quantization in "
                       f"quantization_config and the dtype of its other layers in dtype -- fix config.json "
                       f"(e.g. \"dtype\": \"bfloat16\")")


def config_fingerprint(name: str, trust_remote_code: bool | None = None) -> str | None:
    """A hash of what a model on disk (a local directory, an embedded model) is built from -- its ``config.json``
    and the code files beside it -- read without importing torch or transformers: what an answer computed from
    its config alone depends on (with the code that computed it, :func:`moetool.files.installation_key`). ``None``
    for a hub id or alias (its files are the Hub's). Trusted (:func:`trusted`: a checkpoint's own code may run),
    another hash: an answer computed with the checkpoint's code is not one computed without it."""
    import hashlib

    source, kind = resolve(name)
    if kind not in ("local", "embedded"):
        return None
    h = hashlib.sha256()
    for f in sorted([Path(source) / "config.json", *Path(source).glob("*.py")]):
        try:
            data = f.read_bytes()
        except OSError:  # no config.json: load_config says so
            return None
        h.update(f.name.encode() + b"\0" + data + b"\0")
    if trusted(trust_remote_code):
        h.update(b"trust_remote_code")
    return h.hexdigest()


def check_model(name: str, trust_remote_code: bool | None = None) -> None:
    """:func:`load_config`'s checks (a known name, a readable config, a supported MoE family), answered from the
    per-installation cache (:func:`moetool.files.cached`) for a model on disk whose config passed them before:
    no torch or transformers import then (a second of the whole process instead of several). A config passed
    with ``trust_remote_code`` (its own code run) is answered so only when trusted again
    (:func:`config_fingerprint`)."""
    trust = trusted(trust_remote_code)
    fingerprint = config_fingerprint(name, trust)
    if fingerprint is None:
        load_config(name, trust)
        return
    from .files import cached, installation_key

    here = Path(__file__).resolve().parent
    key = {**installation_key([here / "loading.py", *(here / "adapters").glob("*.py")]), "model_files": fingerprint}
    cached("checked", key, lambda: (load_config(name, trust), {"supported": True})[1])


def load_config(name: str, trust_remote_code: bool | None = None) -> tuple[Any, str, str]:
    """``(config, source, kind)``; checks that the model is a supported MoE family. A hub id is read from the
    local cache when the Hub is out of reach (:func:`moetool.hub.hub_offline`). A config of remote code is read as
    :func:`read_config` says (transformers' native class first; its own code only with ``trust_remote_code``,
    default the run's, :func:`trusted`)."""
    config, source, kind, _, _, _ = _read_config(name, trust_remote_code)
    return config, source, kind


def pick_device(device: str = "auto"):
    import torch

    if device not in DEVICES:
        raise MoetoolError(f"--device must be one of {', '.join(DEVICES)}, not '{device}'")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise MoetoolRuntimeError("--device cuda asked for, but no CUDA device is available (torch "
                                  f"{torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}): "
                                  "use --device cpu or auto")
    return torch.device(device)


def dtype_name(dtype: Any) -> str:
    """``dtype`` as its choice of :data:`DTYPES`: a choice itself, a long name of :data:`DTYPE_ALIASES`
    (``"bfloat16"``) or a ``torch.dtype`` of one (``torch.bfloat16``); anything else is one line naming what is
    accepted (the flag's choices on the command line, the keyword's in Python: :func:`moetool.context.flag`)."""
    from .context import flag, state

    name = str(dtype).removeprefix("torch.") if type(dtype).__name__ == "dtype" else dtype
    if isinstance(name, str) and name in DTYPES:
        return name
    if isinstance(name, str) and name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    accepted = ", ".join(DTYPES)
    if not state().cli:  # Python: the long names and torch's dtypes too
        accepted += f", {', '.join(DTYPE_ALIASES)} or a torch.dtype of them (torch.bfloat16, ...)"
    raise MoetoolError(f"{flag('dtype')} must be one of {accepted}, not {str(dtype)!r}")


def pick_dtype(dtype: Any, config: Any, device) -> Any:
    """``auto``: the checkpoint's dtype, except fp16/bf16 are upcast to fp32 on CPU; ``dtype`` as
    :func:`dtype_name` takes it."""
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtype_name(dtype)
    if dtype in table:
        return table[dtype]
    ck = stored_dtype(config)
    if isinstance(ck, str):
        ck = getattr(torch, ck, None)
    if not isinstance(ck, torch.dtype) or device.type == "cpu":
        return torch.float32
    return ck


_SHOWN_KEYS = 3  # names a refused load report shows of each kind


def _keys_sample(keys: Any) -> str:
    names = sorted(k if isinstance(k, str) else f"{k[0]} (checkpoint {list(k[1])}, model {list(k[2])})"
                   for k in keys)
    more = f", ... ({len(names) - _SHOWN_KEYS} more)" if len(names) > _SHOWN_KEYS else ""
    return ", ".join(names[:_SHOWN_KEYS]) + more


def check_loading_info(source: str, config: Any, info: dict[str, Any], model: Any = None) -> None:
    """Refuse (one line, exit 1) a load whose report (``from_pretrained(..., output_loading_info=True)``) lists a
    MISSING parameter (transformers initialised it at random), an UNEXPECTED one (a checkpoint weight the model
    has no place for) or one of the wrong shape: such a model computes numbers that look like results and are
    noise (a config naming another family, a conversion mistake, a transformers version that renamed expert
    parameters). transformers has already taken out of these sets what is legitimately absent: weights tied to
    another (``lm_head`` tied to the embeddings), non-persistent buffers, its ``_keys_to_ignore_on_load_*``.
    ``model`` given: the scale (``X_scale_inv``) of a weight ``X`` that ``model`` holds in high precision is not
    read -- quantizing while loading (``--quantize fp8``), transformers passes a weight whose shape is not a multiple
    of the block through unquantized and reports its scale missing; a missing scale of an FP8 weight still counts."""
    from .adapters.fp8_backend import unquantized

    def unread(k: Any) -> bool:
        if model is None or not isinstance(k, str) or not k.endswith("_scale_inv"):
            return False
        try:
            return unquantized(model.get_parameter(k[:-len("_scale_inv")]))
        except AttributeError:
            return False

    missing = [k for k in info.get("missing_keys") or () if not unread(k)]
    parts = [f"{len(keys)} {what}: {_keys_sample(keys)}"
             for what, keys in (("missing (would be random)", missing),
                                ("unexpected (not used)", info.get("unexpected_keys") or ()),
                                ("of the wrong shape", info.get("mismatched_keys") or ()))
             if keys]
    if parts:
        family = getattr(config, "model_type", "?")
        raise MoetoolRuntimeError(
            f"the weights of {source} do not fit its config ({family}): {'; '.join(parts)} -- a checkpoint of "
            f"another family or transformers version, or a conversion mistake: fix config.json or convert the "
            f"weights")


class _DropLoadReport:
    """A :mod:`logging` filter: transformers' multi-line LOAD REPORT table is dropped (check_loading_info says
    the same in one line)."""

    @staticmethod
    def filter(record: Any) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def _no_load_report() -> Iterator[None]:
    import logging

    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(_DropLoadReport)
    try:
        yield
    finally:
        log.removeFilter(_DropLoadReport)


QUANTIZE = ("fp8",)


def check_quantize(quantize: str | None, device: str = "auto") -> None:
    """``--quantize``: ``fp8`` (transformers' ``FineGrainedFP8Config``, block-scaled e4m3 128x128) needs a CUDA device;
    anything else, or no GPU, is one line before any work."""
    if quantize is None:
        return
    if quantize not in QUANTIZE:
        raise MoetoolError(f"--quantize takes {', '.join(QUANTIZE)}, not '{quantize}'")
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        raise MoetoolError("--quantize fp8 quantizes on a CUDA GPU while loading (never the whole model in host "
                           "memory); on CPU load the checkpoint as it is (transformers dequantizes FP8 checkpoints "
                           "on CPU)")


@contextlib.contextmanager
def _whole_replicas(active: bool) -> Iterator[None]:
    """Data parallel over model groups (``--tp`` with world = dp × tp): transformers lays the dp groups out as
    ``dp_replicate_size`` and then wraps the model in FSDP2 (HSDP with shard size 1) -- a training device that
    turns every replicated weight into a DTensor outside the forward. moetool only runs forwards, each group on its
    own batches, so every group keeps its whole replica: the FSDP2 step is skipped for this load (tensor and expert
    parallel are applied as transformers does them)."""
    if not active:
        yield
        return
    from transformers.distributed import mixin

    original = mixin.apply_fully_sharded_data_parallelism
    mixin.apply_fully_sharded_data_parallelism = lambda model, *args, **kwargs: model
    try:
        yield
    finally:
        mixin.apply_fully_sharded_data_parallelism = original


@dataclass
class LoadedModel:
    name: str  # what the user typed
    source: str  # resolved path or hub id
    kind: str
    model: Any
    tokenizer: Any
    layers: list  # [MoELayer]
    loaded_device: Any  # where and in what dtype it was loaded (``device`` and ``dtype``: where it is now)
    loaded_dtype: Any
    quantize: str | None = None  # --quantize: the quantization moetool asked transformers for at load
    #: the input embeddings' dtype at load: ``dtype`` is the load's until a cast (``lm.model.to(torch.bfloat16)``)
    #: changes it (a quantized model's embeddings keep the compute dtype it was loaded in)
    _loaded_weights: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._loaded_weights = self._weights_dtype()

    def _weights_dtype(self) -> Any:
        get = getattr(self.model, "get_input_embeddings", None)
        weight = getattr(get() if callable(get) else None, "weight", None)
        return getattr(weight, "dtype", None)

    @property
    def device(self) -> Any:
        """The device of the model's weights now (``model.device``): ``lm.model.to("cuda")`` after the load moves
        it, and what the run sizes, checks and records (manifest.json) follows it."""
        return getattr(self.model, "device", None) or self.loaded_device

    @device.setter
    def device(self, value: Any) -> None:
        self.loaded_device = value

    @property
    def dtype(self) -> Any:
        """The model's dtype now: the load's (``--dtype``), or after a cast of the model (``lm.model.half()``) its
        weights' new dtype, which the forwards compute in and the manifest records."""
        now = self._weights_dtype()
        return now if now is not None and now != self._loaded_weights else self.loaded_dtype

    @dtype.setter
    def dtype(self, value: Any) -> None:
        self.loaded_dtype, self._loaded_weights = value, self._weights_dtype()

    @property
    def config(self) -> Any:
        return self.model.config

    def quantization(self) -> dict[str, Any]:
        """How the model was loaded: transformers' ``quant_method`` (None: not quantized), ``--quantize``, and for
        bitsandbytes the note that its fused experts stayed unquantized."""
        from .adapters import quant

        from .adapters import fp8_backend

        out = {**quant.model_quantization(self.model), "quantize": self.quantize}
        if fp8_backend.has_fp8_layers(self.model):  # which computes its FP8 layers: transformers' kernel or torch
            out["fp8_backend"] = fp8_backend.backend()
            if out["fp8_backend"] == "torch":
                out["fp8_backend_note"] = fp8_backend.TORCH_NOTE
        return out

    def expert_formats(self) -> dict[str, Any]:
        """Each distinct expert format with the MoE layers stored in it (``{detail: {kind, layers}}``)."""
        from .adapters import quant

        out: dict[str, Any] = {}
        for L in self.layers:
            fmt = quant.expert_format(L)
            out.setdefault(fmt.detail, {"kind": fmt.kind, "readable": fmt.readable, "layers": []})["layers"].append(
                L.index)
        return out

    def manifest(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "kind": self.kind,
                "model_type": self.config.model_type, "device": str(self.device), "dtype": str(self.dtype),
                "moe_layers": [L.index for L in self.layers], "quantization": self.quantization(),
                "expert_formats": self.expert_formats(), "config": self.config.to_dict(), **self.parallel()}

    def parallel(self) -> dict[str, Any]:
        """``{"parallel": {tp, ep, dp, world}}`` when loaded with --tp/--ep (transformers' DistributedConfig)."""
        from . import distributed

        par = distributed.parallel()
        if not par.active:
            return {}
        return {"parallel": {"tp": par.tp, "ep": par.ep, "dp": distributed.world_size(), "group": par.group,
                             "world": distributed.world_size() * par.group, "engine": "transformers DistributedConfig"}}


#: the files a tokenizer is read from (transformers' fast tokenizer first, then the slow ones' vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def _tokenizer_problem(source: str, exc: BaseException) -> str:
    """What is wrong, in one line: a local folder holding none of :data:`TOKENIZER_FILES` names the missing file
    (transformers' own text stops at "...backend tokenizer from one of:"); otherwise the error's first line."""
    folder = Path(source)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return f"no {TOKENIZER_FILES[0]} in {folder} (nor {', '.join(TOKENIZER_FILES[1:])})"
    return one_line(exc)


def remote_tokenizer(source: str, from_hub: dict[str, Any], config: Any) -> str | None:
    """The class (``module.Class``) of ``source``'s tokenizer when it is the checkpoint's own code
    (``tokenizer_config.json``'s ``auto_map``, Kimi-K2's ``tokenization_kimi.TikTokenTokenizer``) naming no class
    transformers has; ``None`` otherwise. Untrusted, transformers would refuse it -- or, for a model type with a
    tokenizer of its own (Mixtral), silently tokenize with its generic class instead: other tokens, plausible
    numbers. A model type whose hub tokenizer code transformers knows to be wrong and replaces on purpose
    (``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``) is left to it."""
    from transformers.models.auto import tokenization_auto as ta

    found = ta.get_tokenizer_config(source, **from_hub)
    auto = found.get("auto_map")
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto
    if not isinstance(ref, (list, tuple)) or not any(ref):
        return None
    named = found.get("tokenizer_class")
    if isinstance(named, str) and any(ta.tokenizer_class_from_name(n) is not None
                                      for n in (named, named.removesuffix("Fast"), named + "Fast")):
        return None  # the class it names is transformers' own: transformers reads it so, the code aside
    if getattr(config, "model_type", None) in getattr(ta, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", ()):
        return None
    return next(r for r in (ref[1] if len(ref) > 1 else None, ref[0]) if r)


def _tokenizer(source: str, from_hub: dict[str, Any], config: Any, trust_remote_code: bool) -> Any:
    """``config`` as :func:`read_config` read it (transformers' tokenizer rules read the model type; never read
    again, so the config's own code never runs); ``trust_remote_code`` for a tokenizer that is remote code
    (:func:`remote_tokenizer`: untrusted, one line)."""
    from transformers import AutoTokenizer

    remote = None if trust_remote_code else remote_tokenizer(source, from_hub, config)
    if remote is not None:
        raise MoetoolError(f"the tokenizer of {source} is remote code ({remote}, the checkpoint's own) "
                           f"and {ask_trust(source)}")
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(source, config=config, trust_remote_code=trust_remote_code, **from_hub)
    except Exception as e:  # noqa: BLE001
        raise MoetoolRuntimeError(f"cannot load the tokenizer of {source}: {_tokenizer_problem(source, e)}") from e
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(name: str, trust_remote_code: bool | None = None) -> Any:
    """The tokenizer :func:`load` gives ``name`` (pad = eos when it has none), without loading the weights."""
    trust = trusted(trust_remote_code)
    config, source, _, from_hub, _, _ = _read_config(name, trust)
    return _tokenizer(source, from_hub, config, trust)


def load(name: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto", device_map: str | None = None,
         attn_implementation: str | None = None, tokenizer: bool = True, quantize: str | None = None,
         trust_remote_code: bool | None = None) -> LoadedModel:
    """Load a supported MoE causal LM (or encoder-decoder LM) in eval mode with its tokenizer and wrapped MoE layers.

    Every failure is one :class:`MoetoolError` line: the config is read first (dense or unsupported models stop
    there), local ``*.safetensors`` files are checked before loading (:func:`check_safetensors`), a hub id is
    read from the cache when the Hub is out of reach, and transformers' own progress bars stay off.
    ``trust_remote_code`` (default: the run's ``--trust-remote-code``, else False): a checkpoint's own code may run
    -- its tokenizer's, and its config's and model's where transformers has no native class (:func:`read_config`).
    """
    trust = trusted(trust_remote_code)
    config, source, kind, from_hub, offline, how = _read_config(name, trust)
    import torch  # noqa: F401 - heavy imports only here

    from .adapters import find_moe_layers

    check_quantize(quantize, device)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, config, dev)
    # the tokenizer before any weight (a tokenizer of remote code, untrusted, is one line before a 1T model loads)
    tok = _tokenizer(source, from_hub, config, trust) if tokenizer else None
    # transformers never asks: the checkpoint's own modeling code only where its config is remote code, trusted; a
    # config read other than by AutoConfig (a native class for remote code) is the one the model is built from
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": how == "remote", **from_hub,
                              **({"config": config} if how != "native" else {})}
    if quantize == "fp8":  # GPU only (check_quantize); not testable on CPU
        if getattr(config, "quantization_config", None) is not None:
            raise MoetoolError(f"--quantize fp8: {name} is already quantized ({_quant_method(config)}); load it as is")
        from transformers import FineGrainedFP8Config

        # the routers stay in the model's dtype, as in DeepSeek's FP8 checkpoints: moetool reads their rows
        kwargs["quantization_config"] = FineGrainedFP8Config(weight_block_size=(128, 128),
                                                             modules_to_not_convert=["gate", "router", "lm_head"])
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map:
        if device_map != "auto":
            raise MoetoolError("--device-map takes 'auto' (accelerate places the layers)")
        kwargs["device_map"] = "auto"
    from . import distributed

    par = distributed.check_parallel(config, device_map)
    if par.active:  # --tp / --ep: transformers' own engine splits the model over this rank's group
        from transformers.distributed import DistributedConfig

        distributed.init(device)
        dp = distributed.world_size()
        kwargs["distributed_config"] = DistributedConfig(
            tp_size=par.tp, ep_size=par.ep if par.ep > 1 else None,
            dp_replicate_size=dp if dp > 1 else None)
    if dev.type == "cuda" and not device_map and not par.active:
        # straight onto the GPU: safetensors streamed to the device, and --quantize fp8 quantizes there while loading
        # (never a whole model in host memory first)
        kwargs["device_map"] = {"": str(dev)}
    if kind in ("local", "embedded"):
        check_safetensors(source)
    # the load report comes back to us (output_loading_info), wrong shapes included (ignore_mismatched_sizes:
    # refused below by check_loading_info, with the names, instead of transformers' "see the report above")
    kwargs.update(output_loading_info=True, ignore_mismatched_sizes=True)
    try:
        with quiet_transformers(), _no_load_report(), _whole_replicas(par.active):
            model, info = auto_model_class(config).from_pretrained(source, **kwargs)
        check_loading_info(source, config, info, model)
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt files, missing shards, network: one line each
        if kind in ("hub", "alias") and isinstance(e, OSError):
            raise hub_error(source, e, offline, part="weights") from e
        folder = Path(source)
        weights = [f.name for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES] if kind == "local" else ["?"]
        if (folder / "adapter_config.json").is_file() and all(f.startswith("adapter_model.") for f in weights):
            raise MoetoolError(peft_adapter(source, folder, "adapter_config.json and adapter weights only")) from e
        if not weights:
            raise MoetoolRuntimeError(f"cannot load the weights of {source}: it holds a config and no weight files "
                                      f"({', '.join('*' + x for x in WEIGHT_SUFFIXES)}); plan and inspect read a "
                                      f"config alone (moetool plan --model {shlex.quote(source)})") from e
        from transformers.utils import (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                                        WEIGHTS_NAME)

        names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
        if kind == "local" and not any((folder / n).is_file() for n in names):  # model.pt, weights.safetensors
            raise MoetoolRuntimeError(
                f"cannot load the weights of {source}: it holds {', '.join(sorted(weights)[:3])} but transformers "
                f"reads a checkpoint's weights from {' or '.join(names[::2])} (or their sharded {names[1]} / "
                f"{names[3]}): save them so (model.save_pretrained) or rename the file") from e
        raise MoetoolRuntimeError(f"cannot load the weights of {source}: {one_line(e)}") from e
    if not device_map and not par.active:  # tp/ep: transformers placed every shard on this rank's device
        model.to(dev)
    model.eval()
    from .adapters import fp8_backend

    fp8_backend.ensure(model)  # FP8 layers: transformers' kernel, or moetool's torch path where it cannot be had
    return LoadedModel(name=name, source=source, kind=kind, model=model, tokenizer=tok,
                       layers=find_moe_layers(model), loaded_device=model.device, loaded_dtype=torch_dtype,
                       quantize=quantize)


def _quant_method(config: Any) -> str:
    qc = getattr(config, "quantization_config", None)
    return str(qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc))


#: files whose name, size and modification time make a model's fingerprint (weights, their index, config)
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json", "config.json")


def weights_fingerprint(name: str) -> dict[str, Any]:
    """The weight files model ``name`` loads from: ``{"files": {file: {bytes, modified}}}`` for a local, embedded
    or cached hub model (a hub model also gives the cached revision), ``{"source": id}`` when nothing is on disk
    yet. Stats files only (``--resume`` refuses a run whose weights changed since it started)."""
    from datetime import datetime

    source, kind = resolve(name)
    folder = Path(source) if kind in ("local", "embedded") else None
    out: dict[str, Any] = {"source": source}
    if folder is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except Exception:  # noqa: BLE001 - no cache, odd id: the fingerprint is the id alone
            cached = None
        if isinstance(cached, str):
            folder = Path(cached).parent
            out["revision"] = folder.name
    if folder is not None:
        files = sorted({f for pattern in _WEIGHT_FILES for f in folder.glob(pattern) if f.is_file()})
        out["files"] = {f.name: {"bytes": f.stat().st_size, "modified": datetime.fromtimestamp(
            f.stat().st_mtime_ns / 1e9).isoformat(timespec="microseconds")} for f in files}
    return out
