"""``plan``: what a checkpoint needs before any weight is downloaded -- bytes by format, memory per row, which
layouts fit a given set of GPUs, the command to run, and a ceiling in tokens/s for each command.

Everything comes from the config alone: the model is built on the meta device (no memory, no weights) and its
parameters are grouped by what they are (embeddings, output head, routers, routed experts, shared experts, other
matrices, vectors). Bytes per format:

* ``bf16`` / ``fp16``: 2 bytes per parameter; ``fp32``: 4;
* ``fp8`` (transformers' fine-grained FP8, DeepSeek-V3's release format): 1 byte per parameter plus one fp32
  ``scale_inv`` per 128 x 128 block, for every matrix but the embeddings, output head and routers (kept in
  bf16, as the released checkpoints keep them); vectors (norms, biases) stay bf16;
* ``mxfp4`` (gpt-oss): routed experts' matrices only, 4 bits per parameter plus one uint8 (E8M0) scale per block
  of 32; the rest bf16, the experts' bias rows included. ``fp4`` (FP4-packed experts, two values per int8 byte,
  one UE8M0 scale per 32) is the same size.

Throughput ceilings are upper bounds, not predictions: per token a routed forward costs
``2 x (active matrix parameters) + 2 x (positions attended, summed over the attention layers) x (query-key width +
value width)`` FLOPs (a hybrid's Mamba / linear-attention layers count in the matrices only; causal attention sees
half the sequence on average, a sliding window ``w`` shorter than it ``w - w^2 / (2 seq_len)``); a command that
runs all ``n`` experts of every MoE layer (approx, the norm policies of norm-select) adds ``2 x`` the
routed-expert parameters a token does not use. A batch of ``rows x seq_len`` tokens reads every weight byte of
its GPU once (large batches touch every expert). The ceiling is ``min(compute, memory)``: ``gpus x peak FLOP/s /
FLOPs per token`` and ``tokens per batch x bandwidth / bytes read per batch`` (``--device-map`` runs one GPU at a
time: one GPU's FLOP/s, every byte read in turn).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import MoetoolError
from ..result import Result


@dataclass(frozen=True)
class Gpu:
    """A GPU's memory and dense peak rates (vendor datasheets, SXM parts, no structured sparsity)."""

    name: str
    memory_gb: float  # decimal GB (1e9 bytes), as vendors quote it
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (Ampere)
    hbm_tbps: float  # TB/s (1e12 bytes/s)


GPUS = {g.name: g for g in (
    Gpu("H100", 80, 989, 1979, 3.35),
    Gpu("H200", 141, 989, 1979, 4.8),
    Gpu("B200", 192, 2250, 4500, 8.0),
    Gpu("A100-80", 80, 312, None, 2.039),
    Gpu("A100-40", 40, 312, None, 1.555),
    Gpu("L40S", 48, 362, 733, 0.864),
    Gpu("RTX4090", 24, 165, 330, 1.008),
)}
GPU_ALIASES = {"A100": "A100-80", "4090": "RTX4090"}

#: part of a GPU's memory a layout may plan for (the rest: CUDA context, allocator fragmentation, workspace)
USABLE = 0.9
FP8_BLOCK = 128 * 128  # one fp32 scale per 128 x 128 block
MX_BLOCK = 32  # one E8M0 byte per 32 values

SEQ_LEN = 2048  # tokens per row the commands would run, unless the model has fewer positions

#: the parameter groups (columns of params.csv)
GROUPS = ("embeddings", "lm_head", "routers", "routed_experts", "shared_experts", "other_matrices", "vectors")

#: per command: (routed forwards per token, all-expert forwards per token); None: reads weights, not data
COMMANDS: dict[str, tuple[int, int] | None] = {
    "ppl": (1, 0), "stats": (1, 0), "trace": (1, 0), "eval": (1, 0), "offload": (1, 0),
    "fluctuation": (1, 0),  # per checkpoint, one checkpoint in memory at a time
    "approx": (0, 1),  # the routed forward and all n experts per MoE layer input
    "mass-recall": (3, 0),  # k-means pass 1, one extra pass (kmeans_iters=1), the evaluation pass
    "norm-select": (1, 5),  # the router baseline + one norm policy per probe node (5 nodes), each runs all experts
    "erc": None,  # router rows through the experts: no data tokens
}

DEFINITIONS = {
    "group": "what the parameters are: embeddings, lm_head (untied output head), routers, routed_experts, "
             "shared_experts, other_matrices (attention, dense MLPs), vectors (norms, biases)",
    "params": "parameters in the group (the model built from its config on the meta device)",
    "active_params": "parameters one token uses: routed experts x K/n per MoE layer, everything else whole (the "
                     "embedding table and output head included; DeepSeek and OpenAI publish it without the "
                     "embedding table)",
    "bytes_<format>": "bytes of the group stored in that format (module docstring: which groups each format "
                      "quantizes, block scales included)",
    "layout": "how the model is placed: 1 GPU per replica (data parallel over all GPUs), --quantize fp8, "
              "--device-map auto over one node's GPUs (one replica per node), tensor+expert parallel (--tp N --ep N) "
              "within each node (one replica per node) or over every GPU",
    "gib_per_gpu": "weights on the fullest GPU + activations of one batch (logits + 2 hidden states, "
                   "sizing.estimate_memory), GiB; tensor+expert parallel: the routed experts split over the GPUs, "
                   "every other weight counted whole (an upper bound)",
    "fits": f"gib_per_gpu <= {USABLE:.0%} of the GPU's memory",
    "available": "whether this moetool version runs the layout (no: what is missing)",
    "command": "the command line for the layout (ppl as the example command); the column is not written when no layout can run",
    "why": "why the layout runs or not: fits (GiB per GPU of the usable), needs more GiB per GPU than usable, or "
           "what this moetool version lacks for it",
    "format": "how the layout stores the weights: the checkpoint's own format, or fp8 (--quantize fp8)",
    "gpus": "GPUs the layout uses in all: GPUs per replica x replicas",
    "replicas": "copies of the model running side by side (data parallel)",
    "throughput.command": "the moetool command the ceilings are for (each with its forwards per token: ppl one, "
                          "approx all n experts, mass-recall three passes, norm-select the router and five probes)",
    "tflops_per_token": "TFLOPs (10^12 floating-point operations) of one token's forwards for the command: routed "
                        "forwards at K active experts plus forwards running every routed expert",
    "compute_tokens_per_s": "compute ceiling: replicas x GPUs computing at once x the GPU's peak dense TFLOPS (fp8 "
                            "for fp8 weights where the GPU has it, else bf16) / tflops_per_token",
    "memory_tokens_per_s": "memory ceiling: replicas x tokens per batch x the GPU's HBM bandwidth / weight bytes read "
                           "per batch on the busiest path, divided by the command's forwards per token",
    "tokens_per_s": "ceiling min(compute, memory) for the command under the layout (an upper bound)",
    "bound": "which ceiling binds: compute (FLOPs) or memory (weight bytes read per batch)",
}


def split_refusal(config: Any, size: int) -> str:
    """Why ``--tp size --ep size`` cannot split this model ('' when it can): attention heads, key/value heads
    and routed experts must divide over the ranks (the same rule as ``moetool.distributed.check_parallel``)."""
    text = getattr(config, "get_text_config", lambda: config)()
    for what, keys in (("attention heads", ("num_attention_heads",)), ("key/value heads", ("num_key_value_heads",)),
                       ("experts", ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"))):
        n = next((getattr(text, k) for k in keys if isinstance(getattr(text, k, None), int)), None)
        if n is not None and n % size:
            return f"{n} {what} do not split over {size} GPUs"
    return ""


def parse_gpus(spec: str) -> tuple[int, Gpu]:
    """``"8xH100"`` -> ``(8, H100)``; ``"H200"`` is one GPU. Unknown names are one line listing the known ones."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9\-]+)\s*", spec or "")
    if not m:
        raise MoetoolError(f"bad --gpus '{spec}' (use e.g. 8xH100)")
    count = int(m.group(1) or 1)
    name = m.group(2).upper().replace("RTX-", "RTX")
    name = GPU_ALIASES.get(name, name)
    if name not in GPUS:
        raise MoetoolError(f"unknown GPU '{m.group(2)}' in --gpus (known: {', '.join(GPUS)})")
    if count < 1:
        raise MoetoolError(f"--gpus needs at least one GPU, not {count}")
    return count, GPUS[name]


def native_format(config: Any) -> str:
    """The checkpoint's storage format: its ``quantization_config`` (fp8, mxfp4, fp4) or its ``torch_dtype``."""
    from ...configs import stored_dtype, text_config

    q = getattr(config, "quantization_config", None) or getattr(text_config(config), "quantization_config", None)
    if q:
        q = q if isinstance(q, dict) else getattr(q, "to_dict", lambda: vars(q))()
        method = str(q.get("quant_method", "")).lower()
        if method == "fp8" or "fp8" in str(q.get("fmt", "")).lower():
            return "fp8"
        if method in ("mxfp4", "fp4"):
            return method
        raise MoetoolError(f"quantization '{method or q}' of this checkpoint is not one moetool can size "
                           f"(fp8, mxfp4, fp4)")
    dtype = str(stored_dtype(config) or "bfloat16")
    return {"torch.float32": "fp32", "float32": "fp32", "torch.float16": "fp16", "float16": "fp16"}.get(dtype, "bf16")


def parameter_groups(config: Any) -> dict[str, Any]:
    """Parameter counts by group (:data:`GROUPS`), active counts, and the MoE shape, from the config alone (a
    model on the meta device; the counts of a config seen before come from the cache, :func:`moetool.inspect.cached`:
    building it imports transformers' modeling code, seconds the counts do not depend on)."""
    import hashlib

    from ...files import cached, installation_key

    here = Path(__file__).resolve().parents[2]  # this counting code, the loader that builds the model, the adapters
    key = {**installation_key([Path(__file__).resolve(), here / "loading.py", *(here / "adapters").glob("*.py")]),
           "config": hashlib.sha256(config.to_json_string().encode()).hexdigest(), "class": type(config).__name__}
    return cached("plan-params", key, lambda: _parameter_groups(config))


def _parameter_groups(config: Any) -> dict[str, Any]:
    import torch

    from ...adapters import find_moe_layers
    from ...loading import model_from_config, quiet_transformers

    with torch.device("meta"), quiet_transformers():
        model = model_from_config(config)
    layers = find_moe_layers(model)
    seen: set[int] = set()
    groups = dict.fromkeys(GROUPS, 0)
    inactive = expert_vectors = 0

    def add(group: str, module: Any) -> int:
        n = 0
        for p in (module.parameters() if module is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        groups[group] += n
        return n

    add("embeddings", model.get_input_embeddings())
    add("lm_head", model.get_output_embeddings())  # 0 when tied (the same tensor, seen already)
    for L in layers:
        add("routers", L.router)
        inactive += L.inactive_expert_params(add("routed_experts", L.experts))
        # the experts' bias rows (gpt-oss: [n, 2I] and [n, H]): counted with them, stored in bf16 by every format
        expert_vectors += sum(p.numel() for name, p in L.experts.named_parameters() if name.endswith("bias"))
        add("shared_experts", L.shared_experts)
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            groups["vectors" if p.dim() < 2 else "other_matrices"] += p.numel()
    total = sum(groups.values())
    return {"groups": groups, "total": total, "active": total - inactive, "inactive_experts": inactive,
            "expert_vectors": expert_vectors,
            "n_experts": layers[0].n_experts, "top_k": layers[0].top_k, "moe_layers": len(layers)}


def group_bytes(groups: dict[str, int], fmt: str, expert_vectors: int = 0) -> dict[str, float]:
    """Bytes of each group stored in ``fmt`` (module docstring); ``expert_vectors`` of the routed experts'
    parameters are bias rows (gpt-oss), kept in bf16 as vectors are."""
    plain = {"bf16": 2, "fp16": 2, "fp32": 4}
    if fmt in plain:
        return {g: n * plain[fmt] for g, n in groups.items()}
    out = {g: 2.0 * n for g, n in groups.items()}  # bf16 for what the format leaves alone
    experts = groups["routed_experts"] - expert_vectors  # the experts' matrices; their bias rows stay bf16
    if fmt == "fp8":
        for g in ("shared_experts", "other_matrices"):
            out[g] = groups[g] * (1 + 4 / FP8_BLOCK)
        out["routed_experts"] = experts * (1 + 4 / FP8_BLOCK) + 2.0 * expert_vectors
    elif fmt in ("mxfp4", "fp4"):
        out["routed_experts"] = experts * (0.5 + 1 / MX_BLOCK) + 2.0 * expert_vectors
    else:
        raise MoetoolError(f"unknown weight format '{fmt}' (bf16, fp16, fp32, fp8, mxfp4, fp4)")
    return out


def _attention_width(tc: Any) -> tuple[int, int, int]:
    """(query-key width, value width, per-token KV-cache values per layer) of the attention, summed over the heads
    (MLA caches its compressed latent: the ``kv_lora_rank`` values and the ``qk_rope_head_dim`` rotary key shared by
    every head, as transformers' cache holds them -- it expands the keys and values per head after reading the
    cache)."""
    heads = int(getattr(tc, "num_attention_heads", 0) or 0)
    if getattr(tc, "kv_lora_rank", None):  # DeepSeek MLA as transformers runs it
        qk = int(tc.qk_nope_head_dim) + int(tc.qk_rope_head_dim)
        return heads * qk, heads * int(tc.v_head_dim), int(tc.kv_lora_rank) + int(tc.qk_rope_head_dim)
    head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // heads)
    kv = int(getattr(tc, "num_key_value_heads", None) or heads)
    return heads * head_dim, heads * head_dim, 2 * kv * head_dim


def _windows(tc: Any) -> list[int | None]:
    """The sliding window of each layer that keeps keys and values (``kv_layer_types``: a hybrid's Mamba /
    linear-attention layers are left out), ``None`` where it attends to the whole sequence. A config with a window
    and no per-layer types (Mixtral, PhiMoE) slides in every layer, as transformers' cache and masks do."""
    from ...configs import kv_layer_types, layer_types

    types = kv_layer_types(tc)
    window = getattr(tc, "sliding_window", None)
    if not window:
        return [None] * len(types)
    return [int(window) if t == "sliding_attention" or not layer_types(tc) else None for t in types]


def per_row(config: Any, seq_len: int) -> dict[str, int]:
    """Bytes per row of ``seq_len`` tokens in bf16: activations of one forward (lower bound of
    ``sizing.estimate_memory``) and the KV cache a generating lm-eval task holds (sliding layers capped)."""
    import torch

    from ...configs import text_config
    from ...sizing import estimate_memory

    tc = text_config(config)
    _, act = estimate_memory(config, seq_len=seq_len, rows=1, dtype=torch.bfloat16, params=None)
    _, _, kv_values = _attention_width(tc)
    positions = sum(min(seq_len, w or seq_len) for w in _windows(tc))
    return {"activation_bytes": int(act), "kv_cache_bytes": int(positions * kv_values * 2)}


def flops_per_token(config: Any, counts: dict[str, Any], seq_len: int, *, all_experts: bool) -> float:
    """FLOPs of one token's forward (module docstring); ``all_experts``: every routed expert runs. A token attends
    to ``seq_len / 2`` positions on average (causal), within a sliding window ``w < seq_len`` to ``w - w^2 / (2
    seq_len)``; each position costs 2 x the query-key width (scores) + 2 x the value width (MLA's 192 and 128 per
    head differ)."""
    from ...configs import text_config

    tc = text_config(config)
    qk_width, v_width, _ = _attention_width(tc)
    matrices = counts["active"] - counts["groups"]["embeddings"] - counts["groups"]["vectors"]
    if all_experts:
        matrices += counts["inactive_experts"]
    positions = sum(seq_len / 2 if not w or w >= seq_len else w - w * w / (2 * seq_len) for w in _windows(tc))
    return 2.0 * matrices + 2.0 * positions * (qk_width + v_width)


class _Layout(NamedTuple):
    """A way to place the model on the GPUs (a row of ``layouts.csv`` before its memory is checked)."""

    name: str
    format: str
    shards: int  # of the weights
    replicas: int
    computing: int  # GPUs computing at once per replica (0: --device-map, one at a time)
    available: str  # "yes", or "no: why"
    command: str


def _config_of(model: Any) -> tuple[Any, Any]:
    """``(config, name)`` of ``model``: a name whose config alone is read, a transformers config, or a loaded model
    (``moetool.load``: its config, named as loaded); anything else is one line."""
    if isinstance(model, str):
        from ...loading import load_config

        return load_config(model)[0], model
    if hasattr(model, "model") and hasattr(model, "layers") and hasattr(model, "config"):
        return model.config, getattr(model, "name", None) or "MODEL"
    if not hasattr(model, "to_json_string"):
        from ...errors import shown

        raise MoetoolError(f"plan takes a model's name, its transformers config or a loaded model "
                           f"(moetool.load(...)), not {shown(model)}")
    return model, getattr(model, "_name_or_path", None) or "MODEL"


def _params_table(counts: dict[str, Any], sizes: dict[str, dict[str, float]]) -> Any:
    """``params.csv``: parameters and bytes per format of each group, then the total."""
    import pandas as pd

    params = pd.DataFrame([{"group": g, "params": n, **{f"bytes_{f}": round(sizes[f][g]) for f in sizes}}
                           for g, n in counts["groups"].items()])
    params.loc[len(params)] = {"group": "total", "params": counts["total"],
                               **{f"bytes_{f}": round(sum(sizes[f].values())) for f in sizes}}
    return params


def _layouts(config: Any, native: str, gpu: Gpu, per_node: int, nodes: int, base: str) -> list[_Layout]:
    """The layouts to check on ``nodes`` x ``per_node`` GPUs, each with the command (``base``: its arguments)."""
    world = per_node * nodes
    launch = (f"torchrun --nnodes {nodes} --nproc-per-node {{n}} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
              f"-m moetool" if nodes > 1 else "torchrun --nproc-per-node {n} -m moetool")
    layouts = [_Layout("1 GPU per replica, data parallel", native, 1, world, 1, "yes",
                       (launch.format(n=per_node) if world > 1 else "moetool") + " " + base)]
    if native in ("bf16", "fp16", "fp32"):
        ok = "yes" if gpu.fp8_tflops else f"no: {gpu.name} has no FP8 tensor cores"
        layouts.append(_Layout("1 GPU per replica, --quantize fp8", "fp8", 1, world, 1, ok,
                               ((launch.format(n=per_node) if world > 1 else "moetool") + f" {base} --quantize fp8")
                               if gpu.fp8_tflops else ""))
    if per_node > 1:
        layouts.append(_Layout(f"--device-map auto over {per_node} GPUs, one replica per node", native, per_node,
                               nodes, 0, "yes",
                               (launch.format(n=1) if nodes > 1 else "moetool") + f" {base} --device-map auto"))
    groups = ([(per_node, nodes, f"tensor+expert parallel within each node ({per_node} GPUs), one replica per "
                                 "node")] if per_node > 1 and nodes > 1 else [])
    groups += [(world, 1, f"tensor+expert parallel over {world} GPUs")] if world > 1 else []
    for size, replicas, name in groups:  # transformers' DistributedConfig(tp_size=size, ep_size=size)
        why = split_refusal(config, size)
        layouts.append(_Layout(name, native, size, replicas, size, f"no: {why}" if why else "yes",
                               f"{launch.format(n=per_node)} {base} --tp {size} --ep {size}"))
    return layouts


def _bytes_per_gpu(lay: _Layout, sizes: dict[str, dict[str, float]], act: float) -> float:
    """Weights on the fullest GPU of ``lay`` plus ``act`` bytes of activations."""
    weights = sum(sizes[lay.format].values())
    if lay.name.startswith("tensor+expert"):  # routed experts split; the rest counted whole on every GPU (an upper
        # bound: which dense layers a model's tensor-parallel plan splits differs, e.g. DeepSeek-V3's MLA is whole)
        routed = sizes[lay.format].get("routed_experts", 0)
        return routed / lay.shards + (weights - routed) + act
    return weights / lay.shards + act


def _throughput(lay: _Layout, config: Any, counts: dict[str, Any], gpu: Gpu, weights: float, seq_len: int,
                rows: int) -> list[dict[str, Any]]:
    """``throughput.csv`` rows of a layout that fits: per command, the compute and memory ceilings."""
    tokens_batch = rows * seq_len
    peak = (gpu.fp8_tflops if lay.format == "fp8" and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
    parallel = lay.computing or 1  # --device-map: one GPU at a time
    bytes_read = weights / lay.shards * (lay.shards if lay.computing == 0 else 1)  # per batch, on the busiest path
    memory = lay.replicas * tokens_batch * gpu.hbm_tbps * 1e12 / bytes_read
    out = []
    for cmd, cost in COMMANDS.items():
        if cost is None or (cmd == "eval" and lay.name.startswith("tensor+expert")):  # lm-eval refuses --tp
            continue
        fwd, full = cost
        flops = (fwd * flops_per_token(config, counts, seq_len, all_experts=False)
                 + full * flops_per_token(config, counts, seq_len, all_experts=True))
        compute = lay.replicas * parallel * peak / flops
        mem = memory / (fwd + full)
        out.append({"layout": lay.name, "command": cmd, "tflops_per_token": flops / 1e12,
                    "compute_tokens_per_s": compute, "memory_tokens_per_s": mem,
                    "tokens_per_s": min(compute, mem), "bound": "compute" if compute <= mem else "memory"})
    return out


def plan(model: Any = "tiny", gpus: str = "8xH100", nodes: int = 1, *, seq_len: int | None = None,
         rows: int = 8) -> Result:
    """Tables ``params`` (bytes by group and format), ``layouts`` (what fits ``nodes`` x ``gpus``, the command to
    run) and ``throughput`` (a ceiling in tokens/s per command) for ``model`` -- a name (embedded, alias,
    directory, hub id: only its config is read) or a transformers config (module docstring). ``seq_len``:
    :data:`SEQ_LEN`, or the model's positions when it has fewer (a longer one is refused: the commands refuse it);
    ``rows``: rows per forward (``--batch-size``), which the activations and KV cache are sized for.

    A model on disk planned before with the same arguments, config and code (:func:`moetool.loading.config_fingerprint`,
    :func:`moetool.files.installation_key`) is answered from the per-installation cache: the tables as they were,
    without importing torch or transformers."""
    from ...loading import config_fingerprint

    fingerprint = config_fingerprint(model) if isinstance(model, str) else None
    if fingerprint is None:
        return _plan(model, gpus, nodes, seq_len=seq_len, rows=rows)
    from ...files import cached, installation_key

    here = Path(__file__).resolve().parents[2]  # this code and what it computes with
    code = [Path(__file__).resolve(), here / "sizing.py", here / "configs.py", here / "loading.py",
            *(here / "adapters").glob("*.py")]
    key = {**installation_key(code), "model_files": fingerprint, "model": model, "gpus": gpus, "nodes": nodes,
           "seq_len": seq_len, "rows": rows}
    return _from_record(cached("plan", key, lambda: _record(_plan(model, gpus, nodes, seq_len=seq_len, rows=rows))))


def _record(res: Result) -> dict[str, Any]:
    """A plan's :class:`Result` as JSON values (:func:`_from_record` gives it back)."""
    return {"tables": {name: res.tables[name].to_dict(orient="split", index=False) for name in res.tables},
            "options": res.options, "meta": res.meta}


def _from_record(record: dict[str, Any]) -> Result:
    import pandas as pd

    tables = {name: pd.DataFrame(t["data"], columns=t["columns"]) for name, t in record["tables"].items()}
    return Result("plan", tables, options=record["options"], meta=record["meta"], summary=tables["layouts.csv"])


def _plan(model: Any, gpus: str, nodes: int, *, seq_len: int | None, rows: int) -> Result:
    import pandas as pd

    from ...sizing import check_seq_len, max_positions

    config, model = _config_of(model)
    if seq_len is None:
        seq_len = min(SEQ_LEN, max_positions(config) or SEQ_LEN)
    for flag, value in (("--nodes", nodes), ("--seq-len", seq_len), ("--batch-size", rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MoetoolError(f"{flag} must be a positive integer, not {value!r}")
    check_seq_len(config, seq_len)  # the suggested commands would refuse it
    per_node, gpu = parse_gpus(gpus)
    native = native_format(config)
    counts = parameter_groups(config)
    sizes = {f: group_bytes(counts["groups"], f, counts["expert_vectors"])
             for f in dict.fromkeys(["bf16", native, "fp8"])}
    row = per_row(config, seq_len)
    act = row["activation_bytes"] * rows
    lay_rows, thr_rows = [], []
    for lay in _layouts(config, native, gpu, per_node, nodes, f"ppl --model {model} --seq-len {seq_len} "
                                                             f"--batch-size {rows}"):
        per_gpu = _bytes_per_gpu(lay, sizes, act)
        fits = per_gpu <= USABLE * gpu.memory_gb * 1e9
        usable, gib = USABLE * gpu.memory_gb * 1e9 / 2 ** 30, round(per_gpu / 2 ** 30, 2)  # the gib_per_gpu column
        why = (f"needs {gib:g} GiB per GPU, more than the {usable:.2f} GiB usable: {USABLE:.0%} of the {gpu.name}'s "
               f"{gpu.memory_gb * 1e9 / 2 ** 30:.1f} GiB ({gpu.memory_gb:g} GB)" if not fits
               else f"fits: {gib:g} of {usable:.2f} usable GiB per GPU" if lay.available == "yes"
               else f"fits, but not available: {lay.available.removeprefix('no: ')}")
        lay_rows.append({"layout": lay.name, "format": lay.format, "gpus": lay.shards * lay.replicas,
                         "replicas": lay.replicas, "gib_per_gpu": gib, "fits": fits,
                         "available": lay.available, "command": lay.command if fits and lay.available == "yes" else "",
                         "why": why})
        if fits:
            thr_rows += _throughput(lay, config, counts, gpu, sum(sizes[lay.format].values()), seq_len, rows)
    if not math.isfinite(sum(r["tokens_per_s"] for r in thr_rows) or 0.0):
        raise MoetoolError("the throughput ceiling is not finite (a zero-size config?)")
    summary = pd.DataFrame(lay_rows)
    if not summary["command"].astype(bool).any():  # nothing runs: an answer (the why column), not an error
        summary = summary.drop(columns=["command"])
    meta = {"definitions": DEFINITIONS,
            "plan": {"gpu": vars(gpu), "gpus_per_node": per_node, "nodes": nodes, "seq_len": seq_len, "rows": rows,
                     "native_format": native, "total_params": counts["total"], "active_params": counts["active"],
                     "n_experts": counts["n_experts"], "top_k": counts["top_k"], "moe_layers": counts["moe_layers"],
                     **{f"{k}_per_row": v for k, v in row.items()}}}
    tables = {"params.csv": _params_table(counts, sizes), "layouts.csv": summary}
    if thr_rows:  # no layout fits: no ceiling to give; layouts.csv says why
        tables["throughput.csv"] = pd.DataFrame(thr_rows)
    return Result("plan", tables,
                  options={"gpus": gpus, "nodes": nodes, "seq_len": seq_len, "rows": rows}, meta=meta,
                  summary=summary)
