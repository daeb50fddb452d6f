"""Resolve ``--model`` (embedded name, alias, local path or hub id) and load model + tokenizer.

* embedded: ``tiny``, ``tiny-fine`` and their checkpoints, shipped in ``moetool/embedded/``;
* aliases: short names of well-known MoE checkpoints (``moetool inspect --aliases``);
* a local directory with a ``config.json``; or a hub id ``org/name`` (needs network).

The config is read first, so a dense or unsupported model fails before any weight loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .configs import text_config
from .errors import MoetoolError, MoetoolRuntimeError, env_seconds
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
    "minimax-text-01": "MiniMaxAI/MiniMax-Text-01-hf",  # minimax
    "gemma-4-26b-a4b": "google/gemma-4-26B-A4B-it",  # gemma4
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


# ----- the Hugging Face Hub: decide online/offline in a second, never wait for retries ----------------------------
#: seconds the Hub (or the https proxy in front of it) may take to answer before moetool treats the machine as
#: offline; a slow link raises it with the environment variable ``MOETOOL_HUB_TIMEOUT``
HUB_PROBE_TIMEOUT = 1.5


def _hub_endpoint() -> str:
    """The Hub's base URL: ``HF_ENDPOINT``, default https://huggingface.co."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


_REACHABLE: set[str] = set()  # successes are remembered for the process; failures are probed again


def _probe(url: str, timeout: float) -> str | None:
    """``None`` if ``url`` answers a HEAD request (any HTTP status) within ``timeout`` seconds, else why not.

    urllib honours ``HTTPS_PROXY`` / ``NO_PROXY`` as a download does. DNS resolution cannot be timed out, so the
    request runs in a daemon thread that is abandoned after ``timeout``.
    """
    if url in _REACHABLE:
        return None
    import urllib.error
    import urllib.request

    result: dict[str, str] = {}

    def attempt() -> None:
        try:
            opener = urllib.request.build_opener()  # a fresh one: the proxy settings of now, not of the first call
            opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result["ok"] = ""
        except urllib.error.HTTPError:  # the server answered (404, 401, ...): the network is there
            result["ok"] = ""
        except Exception as e:  # noqa: BLE001 - URLError, timeouts, TLS errors, connection resets
            reason = getattr(e, "reason", e)
            result["error"] = str(reason) or type(reason).__name__

    t = threading.Thread(target=attempt, daemon=True, name="moetool-hub-probe")
    t.start()
    t.join(timeout)
    if "ok" in result:
        _REACHABLE.add(url)
        return None
    return result.get("error", f"no answer within {timeout:g} s")


def hub_offline() -> str | None:
    """Why the Hub must not be contacted (``HF_HUB_OFFLINE`` set, or no answer from it within
    :data:`HUB_PROBE_TIMEOUT` s), or ``None`` when it answers. Offline, models load from the local cache only
    (``local_files_only``): an uncached hub id fails at once instead of after ~30 s of retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    url = _hub_endpoint()
    timeout = env_seconds("MOETOOL_HUB_TIMEOUT", HUB_PROBE_TIMEOUT)
    why = _probe(url, timeout)
    if why is None:
        return None
    slow = "; a slow link: raise MOETOOL_HUB_TIMEOUT" if "timed out" in why or "no answer" in why else ""
    return f"cannot reach {url}: {why}{slow}"


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    text = text if len(text) <= 240 else text[:237] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _hub_error(source: str, err: Exception, offline: str | None) -> MoetoolError:
    last = source.split("/")[-1]
    if offline:
        return MoetoolRuntimeError(
            f"'{source}' is not in the local Hugging Face cache and the Hub is out of reach ({offline}): download it "
            f"where there is network (hf download {source}) and pass the folder, e.g. --model /path/to/{last}")
    chain = [err, err.__cause__, err.__context__]
    if any(type(e).__name__ in ("RepositoryNotFoundError", "GatedRepoError") for e in chain if e is not None) \
            or "not a valid model identifier" in str(err):
        return MoetoolRuntimeError(f"the Hugging Face Hub has no model '{source}' that you may read (a typo, or a "
                                   f"gated/private model: log in with `hf auth login`): {_one_line(err)}")
    return MoetoolRuntimeError(f"could not fetch '{source}' from the Hugging Face Hub ({_one_line(err)})")


def _hub_kwargs(kind: str) -> tuple[dict[str, Any], str | None]:
    """``from_pretrained`` keyword arguments for a model of this kind, and why we are offline (hub kinds only)."""
    if kind not in ("hub", "alias"):
        return {}, None
    offline = hub_offline()
    return ({"local_files_only": True} if offline else {}), offline


# ----- local files ---------------------------------------------------------------------------------------------
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


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


def _read_config(name: str) -> tuple[Any, str, str, dict[str, Any], str | None]:
    source, kind = resolve(name)
    hub_kwargs, offline = _hub_kwargs(kind)
    if offline:  # decided before transformers (and torch) are even imported: a second, not half a minute
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "config.json"), str):
            raise _hub_error(source, FileNotFoundError("config.json not cached"), offline)
    from transformers import AutoConfig

    from .adapters import check_config

    try:
        config = AutoConfig.from_pretrained(source, **hub_kwargs)
    except Exception as e:  # noqa: BLE001 - hub/network errors come in many types
        if kind in ("hub", "alias"):
            raise _hub_error(source, e, offline) from e
        raise MoetoolRuntimeError(f"cannot read the config of {source}: {_one_line(e)}") from e
    check_config(config)
    return config, source, kind, hub_kwargs, offline


def load_config(name: str) -> tuple[Any, str, str]:
    """``(config, source, kind)``; checks that the model is a supported MoE family. A hub id is read from the
    local cache when the Hub is out of reach (:func:`hub_offline`)."""
    config, source, kind, _, _ = _read_config(name)
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


# ----- validate a run from the config, before any weight loads ----------------------------------------------------
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
GiB = 1024 ** 3


def _positions(config: Any) -> tuple[int | None, str]:
    for cfg in (text_config(config), config):
        for key in _POSITION_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return None, ""


def max_positions(config: Any) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings`` or an equivalent key, read from
    the text config of a multimodal model); ``None`` if the config names none."""
    return _positions(config)[0]


def count_parameters(config: Any) -> int | None:
    """Parameters of the model ``config`` describes (built on the meta device: no memory, no weights; tied
    embeddings count once); ``None`` if it cannot be built from its config."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an estimate only: the load itself reports real problems
        return None
    return sum(p.numel() for p in model.parameters())


def _meminfo_available() -> int | None:
    """Bytes of RAM available to this process: ``MemAvailable`` of /proc/meminfo (psutil if installed), capped
    by a cgroup v2/v1 memory limit (containers, cluster jobs)."""
    avail = None
    try:
        import psutil  # type: ignore[import-not-found]

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except OSError:
            pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            room = max(int(limit) - used, 0)
            avail = room if avail is None else min(avail, room)
        break
    return avail


def available_memory(device: Any) -> int | None:
    """Free bytes on ``device`` (a ``torch.device``): ``torch.cuda.mem_get_info`` on CUDA, available RAM on CPU
    (:func:`_meminfo_available`); ``None`` when unknown (then nothing is refused)."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _meminfo_available()
    return None


@dataclass
class RunEstimate:
    """What :func:`validate_run` checked: a *lower bound* of the memory one forward batch needs."""

    device: str
    dtype: str
    max_positions: int | None
    rows_per_batch: int  # min(--batch-size, rows --max-tokens can fill)
    params: int | None
    weights_bytes: int
    activation_bytes: int
    available_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def estimate_memory(config: Any, *, seq_len: int, rows: int, dtype: Any, params: int | None,
                    attn_implementation: str | None = None) -> tuple[int, int]:
    """``(weights, activations)`` in bytes: a lower bound of what one forward of ``rows x seq_len`` tokens holds.

    weights = parameters x element size (0 for a quantized checkpoint: its size depends on the kernel);
    activations = the logits ``rows x seq_len x vocab`` (transformers computes them for every position) +
    two hidden-state tensors ``rows x seq_len x hidden`` + the attention probabilities
    ``rows x heads x seq_len^2`` only with ``attn_implementation="eager"`` (SDPA kernels need not materialise them).
    Everything else (KV projections, expert intermediates, the fp32 chunks of the logits an NLL makes --
    ``moetool.engine.runner.NLL_CHUNK_ELEMENTS`` at a time --, allocator slack) is left out, so a run refused by this bound cannot fit; one that passes may still run out.
    """
    import torch

    tc = text_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    quantized = getattr(config, "quantization_config", None) or getattr(tc, "quantization_config", None)
    weights = 0 if quantized or params is None else params * size
    vocab = int(getattr(tc, "vocab_size", 0) or 0)
    hidden = int(getattr(tc, "hidden_size", 0) or 0)
    tokens = rows * seq_len
    act = tokens * vocab * size + 2 * tokens * hidden * size
    if attn_implementation == "eager":
        heads = int(getattr(tc, "num_attention_heads", 0) or 0)
        act += rows * heads * seq_len * seq_len * size
    return weights, act


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 1024 ** 2:.0f} MiB"


def validate_run(config: Any, *, seq_len: int | None = None, batch_size: int | None = None,
                 max_tokens: int | None = None, device: Any = "auto", dtype: Any = "auto",
                 device_map: str | None = None, attn_implementation: str | None = None,
                 check_memory: bool = True) -> RunEstimate:
    """Refuse, with one line and before any weight loads or any run folder exists, inputs a run cannot use.

    * ``seq_len``, ``max_tokens``, ``batch_size`` must be positive (``seq_len`` at least 2: one next-token
      prediction) -- usage errors (exit 2);
    * ``seq_len`` must not exceed the model's positions (:func:`max_positions`; ``text_config`` of a multimodal
      config) -- a usage error: the position encoding was never trained there and the statistics change;
    * ``device`` / ``dtype`` are resolved as :func:`load` resolves them (``--device cuda`` without CUDA: exit 1);
    * memory: the weights plus one batch's activations (:func:`estimate_memory`, a lower bound) must fit in the
      device's free memory (CUDA: free memory of the device; CPU: available RAM, within a cgroup limit) -- a
      runtime error (exit 1). The batch is the one the options ask for, ``min(batch_size, ceil(max_tokens /
      seq_len))`` rows: the data are not read yet, so a ``--data`` with fewer than ``max_tokens`` tokens (smaller
      batches) can be refused although it would fit -- the message says which option to lower. Skipped with
      ``device_map="auto"`` (accelerate spreads and offloads) or when the free memory is unknown.

    Returns the :class:`RunEstimate` (its ``as_dict()`` fits a manifest).
    """
    for flag, value, least in (("--seq-len", seq_len, 2), ("--max-tokens", max_tokens, 2),
                               ("--batch-size", batch_size, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise MoetoolError(f"{flag} must be an integer of at least {least}, not {value!r}")
    positions, key = _positions(config)
    if seq_len is not None and positions is not None and seq_len > positions:
        mt = getattr(text_config(config), "model_type", None) or getattr(config, "model_type", "the model")
        raise MoetoolError(f"--seq-len {seq_len} is longer than the model's {positions} positions "
                           f"({mt} {key}): use --seq-len {positions} or less")
    dev = pick_device(device) if not hasattr(device, "type") else device
    torch_dtype = pick_dtype(dtype, config, dev) if isinstance(dtype, str) else dtype
    rows = batch_size or 1
    if max_tokens is not None and seq_len:
        rows = min(rows, -(-max_tokens // seq_len))
    est = RunEstimate(device=str(dev), dtype=str(torch_dtype).replace("torch.", ""), max_positions=positions,
                      rows_per_batch=rows, params=None, weights_bytes=0, activation_bytes=0, available_bytes=None)
    if not check_memory or device_map or seq_len is None:
        return est
    est.available_bytes = available_memory(dev)
    if est.available_bytes is None:
        return est
    est.params = count_parameters(config)
    est.weights_bytes, est.activation_bytes = estimate_memory(
        config, seq_len=seq_len, rows=rows, dtype=torch_dtype, params=est.params,
        attn_implementation=attn_implementation)
    avail = est.available_bytes
    if est.weights_bytes > avail:
        raise MoetoolRuntimeError(
            f"the weights alone need {_gib(est.weights_bytes)} ({est.params:,} parameters in {est.dtype}) but "
            f"{dev} has {_gib(avail)} free: use a smaller --dtype, --device-map auto or a larger machine")
    if est.weights_bytes + est.activation_bytes > avail:
        raise MoetoolRuntimeError(
            f"a batch of {rows} rows x --seq-len {seq_len} needs at least {_gib(est.activation_bytes)} of "
            f"activations (logits over {int(getattr(text_config(config), 'vocab_size', 0)):,} tokens in "
            f"{est.dtype}) besides {_gib(est.weights_bytes)} of weights, but {dev} has {_gib(avail)} free: "
            f"lower --batch-size or --seq-len")
    return est


_SHOWN_KEYS = 3  # names a refused load report shows of each kind


def _keys_sample(keys: Any) -> str:
    names = sorted(k if isinstance(k, str) else f"{k[0]} (checkpoint {list(k[1])}, model {list(k[2])})"
                   for k in keys)
    more = f", ... ({len(names) - _SHOWN_KEYS} more)" if len(names) > _SHOWN_KEYS else ""
    return ", ".join(names[:_SHOWN_KEYS]) + more


def check_loading_info(source: str, config: Any, info: dict[str, Any]) -> None:
    """Refuse (one line, exit 1) a load whose report (``from_pretrained(..., output_loading_info=True)``) lists a
    MISSING parameter (transformers initialised it at random), an UNEXPECTED one (a checkpoint weight the model
    has no place for) or one of the wrong shape: such a model computes numbers that look like results and are
    noise (a config naming another family, a conversion mistake, a transformers version that renamed expert
    parameters). transformers has already taken out of these sets what is legitimately absent: weights tied to
    another (``lm_head`` tied to the embeddings), non-persistent buffers, its ``_keys_to_ignore_on_load_*``."""
    parts = [f"{len(keys)} {what}: {_keys_sample(keys)}"
             for what, keys in (("missing (would be random)", info.get("missing_keys") or ()),
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
    """Load a supported MoE causal LM in eval mode with its tokenizer and wrapped MoE layers.

    Every failure is one :class:`MoetoolError` line: the config is read first (dense or unsupported models stop
    there), local ``*.safetensors`` files are checked before loading (:func:`check_safetensors`), a hub id is
    read from the cache when the Hub is out of reach, and transformers' own progress bars stay off.
    """
    config, source, kind, hub_kwargs, offline = _read_config(name)
    import torch  # noqa: F401 - heavy imports only here
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .adapters import find_moe_layers

    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, config, dev)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, **hub_kwargs}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map:
        if device_map != "auto":
            raise MoetoolError("--device-map takes 'auto' (accelerate places the layers)")
        kwargs["device_map"] = "auto"
    if kind in ("local", "embedded"):
        check_safetensors(source)
    # the load report comes back to us (output_loading_info), wrong shapes included (ignore_mismatched_sizes:
    # refused below by check_loading_info, with the names, instead of transformers' "see the report above")
    kwargs.update(output_loading_info=True, ignore_mismatched_sizes=True)
    try:
        with quiet_transformers(), _no_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        check_loading_info(source, config, info)
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt files, missing shards, network: one line each
        if kind in ("hub", "alias") and isinstance(e, OSError):
            raise _hub_error(source, e, offline) from e
        raise MoetoolRuntimeError(f"cannot load the weights of {source}: {_one_line(e)}") from e
    if not device_map:
        model.to(dev)
    model.eval()
    tok = None
    if tokenizer:
        try:
            with quiet_transformers():
                tok = AutoTokenizer.from_pretrained(source, **hub_kwargs)
        except Exception as e:  # noqa: BLE001
            raise MoetoolRuntimeError(f"cannot load the tokenizer of {source}: {_one_line(e)}") from e
        if tok.pad_token_id is None and tok.eos_token_id is not None:
            tok.pad_token = tok.eos_token
    return LoadedModel(name=name, source=source, kind=kind, model=model, tokenizer=tok,
                       layers=find_moe_layers(model), device=model.device, dtype=torch_dtype)


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
