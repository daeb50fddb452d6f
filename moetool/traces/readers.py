"""The engines' routing dumps, read as a stream (never a whole multi-GB dump in memory).

Per-token formats yield :class:`Chunk` (the routed experts of some tokens at every MoE layer, logical ids);
counts-only formats give one :class:`Counts` (per (layer, expert) assignments). Each reader checks the dump against
the model's :class:`~.shape.ModelShape` (``--config``): the layer count, dense layers (zero or -1 rows there), the
top-K, every id an integer below n and a token's K ids distinct; a disagreement is one line
(:class:`~moetool.errors.MoetoolError`, exit 2).

Formats, as the engines write them (the lines ported from their source are quoted where used):

* ``vllm``: per-request routed experts (``--enable-return-routed-experts``): an ndarray ``(num_tokens - 1,
  num_hidden_layers, top_k)`` of logical ids (uint8 up to 256 experts, else uint16; int32/int16 earlier), dense
  layers zero rows; over the OpenAI API ``choices[i].routed_experts`` is base64 of a whole ``.npy`` file. Read from
  ``.npy`` files (one request each) or JSONL, one API response (or ``RequestOutput``-like object) per line.
* ``sglang-routed``: per-request routed experts (``--enable-return-routed-experts``, ``return_routed_experts``):
  ``meta_info["routed_experts"]`` (OpenAI API: ``sglext.routed_experts``) base64 of raw int32, no header, reshaped
  ``(-1, num_hidden_layers, num_experts_per_tok)`` from the config. JSONL, one response (or a list of them) a line.
* ``sglang-dump``: the expert distribution recorder's ``.pt`` files (``stat``: ``logical_count``; ``per_pass``:
  ``global_physical_count`` per record; ``per_token``: ``topk_ids_of_layer`` physical ids, -1 padded, with
  ``last_physical_to_logical_map``), and the legacy CSV ``layer_id,expert_id,count``. ``.pt`` files are read with
  ``torch.load(weights_only=True)``: a dump is data from elsewhere, never unpickled code.
* ``megatron``: Megatron-Core's router trace ``router_trace_rank{r}.jsonl`` (``--moe-routing-trace-path``), one line
  per (step, block, layer) with ``top_indices [num_tokens][topk]`` (sorted by expert id in the hook path).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import MoetoolError, first_line
from .shape import ModelShape

FORMATS = ("vllm", "sglang-routed", "sglang-dump", "megatron")

#: where each format's source was read (repository, file, commit) -- also written to the imported trace's manifest
SOURCES = {
    "vllm": "vllm-project/vllm: RequestOutput.outputs[i].routed_experts (PR #28284, Rollout Router Replay); "
            "OpenAI API choices[i].routed_experts = base64 of a .npy file (numpy2base64, vllm/utils/serial_utils.py)",
    "sglang-routed": "sgl-project/sglang python/sglang/srt/layers/moe/routed_experts_capturer.py "
                     "@d4d0fc58371761f9f0da007a4ef4f0ad2bd19658 (get_routed_experts, "
                     "extract_routed_experts_from_meta_info)",
    "sglang-dump": "sgl-project/sglang python/sglang/srt/eplb/expert_distribution.py "
                   "@02295fe5ac5ccff3e8829800d50450351c56fb53 (_StatAccumulator.dump, _DetailAccumulator.dump, "
                   "_DetailSinglePassGatherer.collect)",
    "megatron": "NVIDIA/Megatron-LM megatron/core/transformer/moe/router_trace.py "
                "@d98e8a64ddf34856e74b24714e3bedb2f5a39553 (RouterTracer._make_index_record, "
                "_flush_records_to_disk)",
}

NPY_MAGIC = b"\x93NUMPY"
#: files beside Megatron's router traces in their folder that are no routing dump (router weights, sidecars)
MEGATRON_SIDECARS = ("router_state_rank", "hidden_states_rank", "logits_rank")


@dataclass
class Chunk:
    """Some tokens' routing: ``experts[layer]`` is ``[T, K]`` logical ids (int64) of the same T tokens at every MoE
    layer; ``row`` / ``pos`` / ``token_id`` ``[T]`` (token_id -1 where the dump has no token ids)."""

    row: np.ndarray
    pos: np.ndarray
    token_id: np.ndarray
    experts: dict[int, np.ndarray]


@dataclass
class Counts:
    """Per (layer, expert) assignments of a counts-only dump: ``counts[layer]`` ``[n]`` int64."""

    counts: dict[int, np.ndarray]
    notes: list[str] = field(default_factory=list)


@dataclass
class Dump:
    """What one call read: the format, the sources, notes for the manifest, and either ``chunks`` (an iterator of
    :class:`Chunk`) or ``counts``."""

    format: str
    sources: list[str]
    ids: str = "logical"
    order: str = "as the router returned them"
    notes: list[str] = field(default_factory=list)
    chunks: Iterator[Chunk] | None = None
    counts: Counts | None = None
    seen: set[str] = field(default_factory=set)  # what the files revealed of the engine's version (filled as read)

    def describe_version(self) -> str:
        """What the dump says of the engine's version, after it was read (the manifest's ``engine_version``)."""
        return "; ".join(sorted(self.seen)) or "not recorded in the dump"


# ----- sniffing ---------------------------------------------------------------------------------------------
def expand(paths: list[str | Path]) -> list[Path]:
    """Files of the sources: a folder stands for its dump files (sorted); a missing path is one line."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".jsonl", ".json", ".pt", ".npy",
                                                                                   ".csv")
                           and not f.name.startswith(MEGATRON_SIDECARS))
            if not found:
                raise MoetoolError(f"{p}: no .jsonl, .pt, .npy or .csv dump files in the folder")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise MoetoolError(f"{p}: no such file or folder")
    seen: dict[Path, Path] = {}
    for f in out:  # several files are summed (ranks, requests): one read twice would count its tokens twice
        first = seen.setdefault(f.resolve(), f)
        if first is not f:
            same = f"{first}" if str(first) == str(f) else f"{first} and {f}"
            raise MoetoolError(f"{same}: the same dump file given twice (a folder and a file in it, or a path "
                               f"repeated); give each file once")
    return out


def _whole_document(path: Path) -> Any:
    """A file that is one JSON document over several lines (a response saved pretty-printed), else ``None``."""
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _first_json(path: Path) -> Any:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    doc = _whole_document(path)
                    if doc is not None:
                        return doc
                    raise MoetoolError(f"{path}: the first line is not JSON: not a vLLM/SGLang response or "
                                       f"Megatron trace line") from None
    raise MoetoolError(f"{path}: empty file")


def _response_kind(obj: Any) -> str | None:
    """``vllm`` / ``sglang-routed`` / ``megatron`` for one JSON line, ``None`` when it carries no routing."""
    if isinstance(obj, list):
        return _response_kind(obj[0]) if obj else None
    if not isinstance(obj, dict):
        return None
    if "top_indices" in obj and "layer" in obj:
        return "megatron"
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and "routed_experts" in meta:
        return "sglang-routed"
    for ch in obj.get("choices") or []:
        if isinstance(ch, dict) and isinstance(ch.get("sglext"), dict) and "routed_experts" in ch["sglext"]:
            return "sglang-routed"
        if isinstance(ch, dict) and "routed_experts" in ch:
            return "vllm"
    outs = obj.get("outputs")
    if isinstance(outs, list) and outs and isinstance(outs[0], dict) and "routed_experts" in outs[0]:
        return "vllm"
    if "routed_experts" in obj:  # a bare payload: a .npy inside says vLLM, raw int32 SGLang
        raw = obj["routed_experts"]
        return "vllm" if isinstance(raw, str) and _b64(raw, "routed_experts")[:6] == NPY_MAGIC else "sglang-routed"
    return None


def sniff(path: Path) -> str:
    """The format of one dump file, from its name and first bytes; one line when it is none of them."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return "vllm"
    if suffix == ".pt":
        return "sglang-dump"
    if suffix == ".csv":
        with open(path) as f:
            head = f.readline().strip().replace(" ", "")
        if head == "layer_id,expert_id,count":
            return "sglang-dump"
        raise MoetoolError(f"{path}: a CSV dump must be SGLang's legacy layer_id,expert_id,count, not '{head}'")
    if suffix in (".jsonl", ".json"):
        kind = _response_kind(_first_json(path))
        if kind is None:
            raise MoetoolError(f"{path}: the first line has no routed experts (vLLM choices[].routed_experts, SGLang "
                               f"meta_info.routed_experts / sglext.routed_experts) and is no Megatron trace line")
        return kind
    raise MoetoolError(f"{path}: unknown dump type '{suffix}' (.jsonl, .npy, .pt, .csv)")


def resolve_format(files: list[Path], fmt: str | None) -> str:
    """The one format of all files: sniffed (mixed formats refused), or ``fmt`` checked against each file."""
    if fmt is not None and fmt not in FORMATS:
        raise MoetoolError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'")
    kinds = {f: sniff(f) for f in files}
    found = sorted(set(kinds.values()))
    if len(found) > 1:
        raise MoetoolError("mixed formats in one call: " + ", ".join(
            f"{k} ({next(str(f) for f, v in kinds.items() if v == k)})" for k in found) + "; import them apart")
    if fmt is not None and found[0] != fmt:
        raise MoetoolError(f"--format {fmt}, but {files[0]} is a {found[0]} dump")
    return found[0]


# ----- shared checks ------------------------------------------------------------------------------------------
def _b64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise MoetoolError(f"{what}: expected a base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise MoetoolError(f"{what}: not valid base64") from None


def load_npy(data: bytes | Path, what: str) -> np.ndarray:
    """An ``.npy`` file (bytes or a path), never with pickled objects; truncated or not ``.npy``: one line."""
    try:
        if isinstance(data, Path):
            arr = np.load(data, allow_pickle=False)
        else:
            if data[:6] != NPY_MAGIC:
                raise MoetoolError(f"{what}: not a .npy payload (vLLM sends base64 of a whole .npy file)")
            arr = np.load(io.BytesIO(data), allow_pickle=False)
    except MoetoolError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise MoetoolError(f"{what}: not a readable .npy array (truncated?): {first_line(e)}") from None
    if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
        raise MoetoolError(f"{what}: routed experts must be integer expert ids, got dtype {arr.dtype}")
    return arr


def split_layers(arr: np.ndarray, shape: ModelShape, what: str, dense_fill: tuple[int, ...] = (0,)) -> dict[int,
                                                                                                          np.ndarray]:
    """``[T, num_layers, K]`` ids -> ``{MoE layer: [T, K] int64}``; the layer count and K must be the config's, the
    dense layers' rows only ``dense_fill`` values, every MoE id in ``[0, n)``."""
    if arr.ndim != 3:
        raise MoetoolError(f"{what}: routed experts must be [tokens, layers, top_k], got shape {list(arr.shape)}")
    T, L, K = arr.shape
    if L != shape.num_layers:
        raise MoetoolError(f"{what}: {L} layers in the dump, {shape.num_layers} in --config {shape.source}: the dump "
                           f"is of another model")
    if K != shape.top_k():
        raise MoetoolError(f"{what}: top-{K} in the dump, top-{shape.top_k()} in --config {shape.source}")
    for li in range(L):
        if li not in shape.moe and not np.isin(arr[:, li], dense_fill).all():
            raise MoetoolError(f"{what}: layer {li} is dense in --config {shape.source} but routed in the dump: the "
                               f"dump and --config disagree")
    return {li: check_ids(arr[:, li].astype(np.int64), shape.n_experts(li), what, li) for li in shape.moe_layers}


def check_ids(ids: np.ndarray, n: int, what: str, layer: int, of: str = "--config",
              unwritten: str = "rows the engine never wrote?") -> np.ndarray:
    """Every id in ``[0, n)``; ``[T, K]`` ids: each token's K distinct (a router picks K different experts: a
    repeat is a row the engine never wrote, e.g. vLLM's zero-filled buffer). ``of`` names where n comes from,
    ``unwritten`` the likely cause of a repeat (the messages)."""
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise MoetoolError(f"{what}: layer {layer} has expert id {int(ids.min() if ids.min() < 0 else ids.max())}, "
                           f"outside the {n} experts of {of}")
    if ids.ndim == 2 and ids.shape[1] > 1:
        s = np.sort(ids, 1)
        repeat = (s[:, 1:] == s[:, :-1]).any(1)
        if repeat.any():
            t = int(np.argmax(repeat))
            e = int(s[t, 1:][s[t, 1:] == s[t, :-1]][0])
            raise MoetoolError(f"{what}: layer {layer}, token {t} has expert {e} twice in its top-{ids.shape[1]} "
                               f"({int(repeat.sum())} of {len(ids)} tokens): a top-K names K distinct experts "
                               f"({unwritten})")
    return ids


def _token_ids(ids: Any, T: int, what: str) -> np.ndarray:
    """The token ids of a request's routed rows: the first T of the prompt and output ids (the last token is never
    forwarded: num_tokens - 1 rows); -1 where the response carries none."""
    if ids is None:
        return np.full(T, -1, dtype=np.int64)
    try:
        ids = np.asarray(ids)
    except ValueError:  # ragged nesting
        ids = np.asarray([None])
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or (ids.size and ids.min() < 0):
        raise MoetoolError(f"{what}: the token ids must be a list of whole numbers 0 or more (a token id null, "
                           f"fractional, negative or a string is no vocabulary entry)")
    ids = ids.astype(np.int64)
    if len(ids) not in (T, T + 1):
        raise MoetoolError(f"{what}: {len(ids)} token ids but {T} routed rows (expected num_tokens - 1 rows)")
    return ids[:T]


def _object(obj: Any, where: str, what: str) -> dict[str, Any]:
    """``obj`` if it is a JSON object, else one line naming what was expected."""
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")
        raise MoetoolError(f"{where}: {kind}, not {what} (a JSON object)")
    return obj


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, object)`` of each JSON line; a file that is one pretty-printed document is its one object."""
    first = True
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    doc = _whole_document(path) if first else None
                    if doc is None:
                        raise MoetoolError(f"{path}:{i}: not a JSON line (truncated?)") from None
                    yield 1, doc
                    return
                first = False
                yield i, obj


# ----- vLLM -------------------------------------------------------------------------------------------------
def _vllm_requests(obj: Any, where: str) -> Iterator[tuple[Any, Any, str]]:
    """``(routed_experts payload, token ids or None, where)`` of each completion of one JSON line."""
    if isinstance(obj, list):
        for j, o in enumerate(obj):
            yield from _vllm_requests(o, f"{where}[{j}]")
        return
    obj = _object(obj, where, "a vLLM response")
    prompt = obj.get("prompt_token_ids")
    choices = obj.get("choices") if obj.get("choices") is not None else obj.get("outputs")
    if choices is None:
        choices = [obj]
    if not isinstance(choices, list):
        raise MoetoolError(f"{where}: choices / outputs is not a list")
    for j, ch in enumerate(choices):
        ch = _object(ch, f"{where} choice {j}", "a completion choice")
        if "routed_experts" not in ch or ch["routed_experts"] is None:
            raise MoetoolError(f"{where}: choice {j} has no routed_experts (was the server started with "
                               f"--enable-return-routed-experts?)")
        p = ch.get("prompt_token_ids", prompt)
        out = ch.get("token_ids")
        ids = None if p is None or out is None else list(p) + list(out)
        yield ch["routed_experts"], ids, f"{where} choice {j}"


def read_vllm(files: list[Path], shape: ModelShape, seen: set[str] | None = None) -> Iterator[Chunk]:
    row = 0
    for path in files:
        if path.suffix.lower() == ".npy":
            items: Iterator[tuple[Any, Any, str]] = iter([(path, None, str(path))])
        else:
            items = (r for i, obj in _jsonl(path) for r in _vllm_requests(obj, f"{path}:{i}"))
        for payload, ids, where in items:
            arr = load_npy(payload if isinstance(payload, Path) else _b64(payload, where), where)
            if seen is not None:
                seen.add(f"routed_experts dtype {arr.dtype} ("
                         + ("uint8/uint16: vLLM's narrow ids, v0.33 and later" if arr.dtype.kind == "u"
                            else "signed: vLLM before v0.33") + ")")
            experts = split_layers(arr, shape, where)
            T = arr.shape[0]
            yield Chunk(np.full(T, row, dtype=np.int64), np.arange(T, dtype=np.int64), _token_ids(ids, T, where),
                        experts)
            row += 1


# ----- SGLang per-request routed experts ----------------------------------------------------------------------
def _sglang_requests(obj: Any, where: str) -> Iterator[tuple[Any, str | None, Any, str]]:
    """``(base64 payload, dtype name or None, token ids or None, where)`` of each response of one JSON line."""
    if isinstance(obj, list):
        for j, o in enumerate(obj):
            yield from _sglang_requests(o, f"{where}[{j}]")
        return
    obj = _object(obj, where, "an SGLang response")
    if isinstance(obj.get("meta_info"), dict):
        meta = obj["meta_info"]
        if meta.get("routed_experts") is None:
            raise MoetoolError(f"{where}: meta_info has no routed_experts (--enable-return-routed-experts on the "
                               f"server and return_routed_experts in the request?)")
        ids = None
        if obj.get("input_ids") is not None and obj.get("output_ids") is not None:
            ids = list(obj["input_ids"]) + list(obj["output_ids"])
        yield meta["routed_experts"], meta.get("routed_experts_dtype"), ids, where
        return
    choices = obj.get("choices") or []
    if not isinstance(choices, list):
        raise MoetoolError(f"{where}: choices is not a list")
    for j, ch in enumerate(choices):
        ext = _object(ch, f"{where} choice {j}", "a completion choice").get("sglext") or {}
        ext = _object(ext, f"{where} choice {j} sglext", "SGLang's extension fields")
        if ext.get("routed_experts") is None:
            raise MoetoolError(f"{where}: choice {j} has no sglext.routed_experts")
        yield ext["routed_experts"], ext.get("routed_experts_dtype"), None, f"{where} choice {j}"


def read_sglang_routed(files: list[Path], shape: ModelShape, seen: set[str] | None = None) -> Iterator[Chunk]:
    L, K = shape.num_layers, shape.top_k()
    row = 0
    for path in files:
        for i, obj in _jsonl(path):
            for payload, dtype, ids, where in _sglang_requests(obj, f"{path}:{i}"):
                raw = _b64(payload, where)
                try:
                    dt = np.dtype(dtype or "int32")  # sglang: np.frombuffer(..., dtype=np.int32) unless told
                except TypeError:
                    raise MoetoolError(f"{where}: unknown routed_experts_dtype '{dtype}'") from None
                if not np.issubdtype(dt, np.integer):
                    raise MoetoolError(f"{where}: routed_experts_dtype '{dtype}' is not an integer type: expert ids "
                                       f"are integers")
                if len(raw) % (dt.itemsize * L * K):
                    raise MoetoolError(f"{where}: {len(raw)} bytes are no whole number of {dt.name} rows of "
                                       f"{L} layers x top-{K} (--config {shape.source}): another model, or truncated")
                arr = np.frombuffer(raw, dtype=dt).reshape(-1, L, K)  # sglang's reshape from the config
                if seen is not None:
                    seen.add(f"routed_experts {dt.name}" + (" (routed_experts_dtype given)" if dtype else
                                                            " (no routed_experts_dtype: int32, SGLang's default)"))
                T = arr.shape[0]
                yield Chunk(np.full(T, row, dtype=np.int64), np.arange(T, dtype=np.int64), _token_ids(ids, T, where),
                            split_layers(arr, shape, where))
                row += 1


# ----- SGLang expert distribution recorder ----------------------------------------------------------------------
def load_pt(path: Path) -> Any:
    """A ``.pt`` dump with ``torch.load(weights_only=True)``: tensors and plain containers only, no code."""
    import pickle
    import zipfile

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise MoetoolError(f"{path}: refused: the .pt file holds more than tensors and plain data "
                           f"(weights_only=True): {first_line(e)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise MoetoolError(f"{path}: not a readable .pt file (truncated?): {first_line(e)}") from None


def _np(x: Any, what: str) -> np.ndarray:
    try:
        return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)
    except Exception:  # noqa: BLE001
        raise MoetoolError(f"{what}: not an array") from None


def _integers(x: Any, what: str) -> np.ndarray:
    """An array of counts or ids that must be integers (SGLang's recorder keeps int tensors): a float, string or
    object array is one line, never truncated to integers."""
    a = _np(x, what)
    if a.dtype.kind not in "iu":
        raise MoetoolError(f"{what}: integer counts / expert ids expected, got dtype {a.dtype}")
    return a.astype(np.int64)


def _counts_per_token(x: Any, T: int | None, where: str, name: str) -> np.ndarray:
    """A per_token record's ``name`` (input ids, positions, sequence lengths): whole numbers 0 or more, ``T`` of
    them (``None``: any number); else one line (a fractional one is never truncated)."""
    a = _np(x, f"{where}: {name}")
    if a.ndim != 1 or a.dtype.kind not in "iu" or (a.size and a.min() < 0) or (T is not None and len(a) != T):
        raise MoetoolError(f"{where}: {name} must be " + (f"{T} " if T is not None else "") + "whole numbers 0 or "
                           "more" + (" (one per token of topk_ids_of_layer)" if T is not None else ""))
    return a.astype(np.int64)


def _logical(physical: np.ndarray, p2l: np.ndarray, what: str) -> np.ndarray:
    """Physical ids ``[L, T, K]`` (-1 kept) -> logical through ``p2l [L, P]``."""
    if physical.size and physical.max() >= p2l.shape[1]:
        raise MoetoolError(f"{what}: physical expert id {int(physical.max())} beyond the map's {p2l.shape[1]} slots")
    lay = np.arange(p2l.shape[0])[:, None, None]
    return np.where(physical >= 0, p2l[lay, np.maximum(physical, 0)], -1)


def _layer_counts(c: np.ndarray, shape: ModelShape, what: str) -> dict[int, np.ndarray]:
    """``[num_layers, n]`` logical counts -> ``{MoE layer: [n]}``; dense layers must count nothing."""
    if c.ndim != 2 or c.shape[0] != shape.num_layers:
        raise MoetoolError(f"{what}: counts of shape {list(c.shape)}, --config {shape.source} has "
                           f"{shape.num_layers} layers")
    out = {}
    for li in range(c.shape[0]):
        if li not in shape.moe:
            if c[li].any():
                raise MoetoolError(f"{what}: layer {li} is dense in --config {shape.source} but has counts")
            continue
        n = shape.n_experts(li)
        if c.shape[1] != n:
            raise MoetoolError(f"{what}: {c.shape[1]} logical experts in the dump, {n} in --config {shape.source}")
        out[li] = c[li].astype(np.int64)
    return out


def read_sglang_dump(files: list[Path], shape: ModelShape) -> Dump:
    """Counts (``stat``, ``per_pass``, legacy CSV) or per-token chunks (``per_token``); the files' kinds must
    agree. Counts of several files (ranks) are summed."""
    loaded = []
    for path in files:
        if path.suffix.lower() == ".csv":
            loaded.append((path, "csv", None))
            continue
        d = load_pt(path)
        if not isinstance(d, dict):
            raise MoetoolError(f"{path}: not an SGLang expert distribution dump (a dict), got {type(d).__name__}")
        if "logical_count" in d:
            loaded.append((path, "stat", d))
        elif "records" in d:
            if not isinstance(d["records"], (list, tuple)) or not all(isinstance(r, dict) for r in d["records"]):
                raise MoetoolError(f"{path}: records is not a list of per-pass records (dicts)")
            if d.get("last_physical_to_logical_map") is None:
                raise MoetoolError(f"{path}: physical expert ids without last_physical_to_logical_map: cannot map "
                                   f"them to logical experts")
            per_token = any("topk_ids_of_layer" in r for r in d["records"])
            loaded.append((path, "per_token" if per_token else "per_pass", d))
        else:
            raise MoetoolError(f"{path}: neither logical_count (stat) nor records (per_pass/per_token): not an "
                               f"SGLang expert distribution dump")
    kinds = sorted({k for _, k, _ in loaded})
    if len(kinds) > 1:
        raise MoetoolError(f"mixed SGLang recorder modes in one call: {', '.join(kinds)}")
    kind = kinds[0]
    dump = Dump("sglang-dump", [str(p) for p, _, _ in loaded], ids="physical, mapped to logical with "
                "last_physical_to_logical_map" if kind in ("per_pass", "per_token") else "logical")
    dump.notes.append(f"recorder mode: {kind}")
    dump.seen.add("legacy CSV recorder (before mid-2025)" if kind == "csv" else
                  f"expert_distribution recorder, mode {kind} (.pt, python/sglang/srt/eplb/expert_distribution.py)")
    if len(loaded) > 1:
        dump.notes.append(f"{len(loaded)} files (ranks) summed: ranks that saw the same tokens (tensor parallel "
                          f"without DP attention) count them once each; relative loads are unaffected")
    if kind == "per_token":
        dump.notes.append("per_token records carry no request ids: a row is one sequence of one forward pass (a "
                          "request's decode steps are rows of their own)")
        dump.chunks = _sglang_per_token(loaded, shape)
        return dump
    total: dict[int, np.ndarray] | None = None
    for path, k, d in loaded:
        if k == "csv":
            c = _legacy_csv(path, shape)
        elif k == "stat":
            lc = _integers(d["logical_count"], f"{path}: logical_count")
            c = lc.sum(0) if lc.ndim == 3 else lc  # [buffer rows, L, n]: the rows of the window summed
            c = _layer_counts(c, shape, str(path))
        else:
            p2l = _integers(d["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
            n_max = max(shape.n_experts(li) for li in shape.moe)
            if p2l.size and (p2l.min() < 0 or p2l.max() >= n_max):
                raise MoetoolError(f"{path}: the physical-to-logical map names expert "
                                   f"{int(p2l.min() if p2l.min() < 0 else p2l.max())}, outside the {n_max} experts "
                                   f"of --config {shape.source}")
            if any("global_physical_count" not in r for r in d["records"]):
                raise MoetoolError(f"{path}: a per_pass record without global_physical_count")
            phys = sum(_integers(r["global_physical_count"], f"{path}: global_physical_count") for r in d["records"])
            if isinstance(phys, int):
                raise MoetoolError(f"{path}: no records")
            if phys.shape != p2l.shape:
                raise MoetoolError(f"{path}: global_physical_count {list(phys.shape)} and the map {list(p2l.shape)} "
                                   f"disagree")
            n = n_max
            logical = np.zeros((p2l.shape[0], n), dtype=np.int64)
            for li in range(p2l.shape[0]):  # sglang's _convert_global_physical_count_to_logical_count
                np.add.at(logical[li], p2l[li], phys[li])
            c = _layer_counts(logical, shape, str(path))
        total = c if total is None else {li: total.get(li, 0) + c.get(li, 0) for li in sorted({*total, *c})}
    dump.counts = Counts(total or {})
    return dump


def _legacy_csv(path: Path, shape: ModelShape) -> dict[int, np.ndarray]:
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except Exception as e:  # noqa: BLE001
        raise MoetoolError(f"{path}: not a readable CSV: {first_line(e)}") from None
    if not isinstance(df.index, pd.RangeIndex):  # pandas reads the extra leading fields as the index
        raise MoetoolError(f"{path}: a line with more fields than layer_id,expert_id,count")
    bad = [c for c in ("layer_id", "expert_id", "count") if len(df) and not pd.api.types.is_integer_dtype(df[c])]
    if bad:
        raise MoetoolError(f"{path}: {', '.join(bad)} must be whole numbers in every line")
    out: dict[int, np.ndarray] = {}  # the layers with a line (one missing is refused by store.check_counts)
    for li, e, c in df[["layer_id", "expert_id", "count"]].itertuples(index=False):
        if li not in shape.moe:
            if c:
                raise MoetoolError(f"{path}: layer {li} is not an MoE layer of --config {shape.source}")
            continue
        check_ids(np.array([e]), shape.n_experts(li), str(path), li)
        out.setdefault(li, np.zeros(shape.n_experts(li), dtype=np.int64))[e] += int(c)
    return out


def _sglang_per_token(loaded: list[tuple[Path, str, Any]], shape: ModelShape) -> Iterator[Chunk]:
    """``per_token`` records: ``topk_ids_of_layer [num_layers, num_tokens, 8]`` physical ids (-1 padded: columns
    beyond the top-K and dense layers) split into sequences by ``extend_seq_lens`` (a decode pass: one token per
    request); each sequence is a row, ``positions`` its positions."""
    K = shape.top_k()
    row = 0
    for path, _, d in loaded:
        p2l = _integers(d["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
        if p2l.shape[0] != shape.num_layers:
            raise MoetoolError(f"{path}: the map has {p2l.shape[0]} layers, --config {shape.source} "
                               f"{shape.num_layers}")
        for r in d["records"]:
            where = f"{path} forward pass {r.get('forward_pass_id')}"
            if "topk_ids_of_layer" not in r:
                raise MoetoolError(f"{where}: a record without topk_ids_of_layer among per_token records")
            topk = _integers(r["topk_ids_of_layer"], f"{where}: topk_ids_of_layer")  # [L, T, 8]
            if topk.ndim != 3 or topk.shape[0] != shape.num_layers:
                raise MoetoolError(f"{where}: topk_ids_of_layer of shape {list(topk.shape)}, --config has "
                                   f"{shape.num_layers} layers")
            if topk.shape[2] < K or (topk[:, :, K:] != -1).any():
                raise MoetoolError(f"{where}: more than top-{K} (--config {shape.source}) ids per token")
            T = topk.shape[1]
            logical = _logical(topk[:, :, :K], p2l, where)  # [L, T, K]
            arr = logical.transpose(1, 0, 2)  # [T, L, K]
            experts = split_layers(arr, shape, where, dense_fill=(-1,))
            given = r.get("extend_seq_lens")
            lens = ([] if given is None or (isinstance(given, (list, tuple)) and not given)
                    else _counts_per_token(given, None, where, "extend_seq_lens").tolist())
            if lens and sum(lens) != T:
                raise MoetoolError(f"{where}: extend_seq_lens {lens} sum to {sum(lens)}, not the {T} tokens of "
                                   f"topk_ids_of_layer")
            if not lens:  # a decode pass (no lengths): one token per request
                lens = [1] * T
            rows = np.repeat(np.arange(row, row + len(lens)), lens)
            row += len(lens)
            pos = (np.zeros(T, dtype=np.int64) if r.get("positions") is None
                   else _counts_per_token(r["positions"], T, where, "positions"))
            ids = (np.full(T, -1, dtype=np.int64) if r.get("input_ids") is None
                   else _counts_per_token(r["input_ids"], T, where, "input_ids"))
            yield Chunk(rows, pos, ids, experts)


# ----- Megatron-Core router trace -----------------------------------------------------------------------------
def read_megatron(files: list[Path], shape: ModelShape, notes: list[str]) -> Iterator[Chunk]:
    """Records of one rank's file grouped into forwards: a (step, block) whose decoder layers each fire once; a
    layer firing again in the same step starts the next forward (micro-batches), as the tracer's own step heuristic
    does. MTP records are skipped (counted in the notes)."""
    K = shape.top_k()
    row, skipped = 0, 0
    for path in files:
        group: dict[int, np.ndarray] = {}
        key = None

        def flush(where: str) -> Chunk | None:
            if not group:
                return None
            missing = [li for li in shape.moe_layers if li not in group]
            if missing:
                raise MoetoolError(f"{where}: MoE layers {missing} of --config {shape.source} have no record in this "
                                   f"step (pipeline parallel: import every stage's ranks; layers are numbered per "
                                   f"stage in the hook's module names)")
            T = {len(v) for v in group.values()}
            if len(T) != 1:
                raise MoetoolError(f"{where}: the layers of one step routed different numbers of tokens {sorted(T)}")
            t = T.pop()
            return Chunk(np.full(t, -1, dtype=np.int64), np.arange(t, dtype=np.int64), np.full(t, -1, dtype=np.int64),
                         dict(group))

        for i, rec in _jsonl(path):
            where = f"{path}:{i}"
            rec = _object(rec, where, "a Megatron router trace record")
            if rec.get("block", "decoder") != "decoder" or rec.get("mtp_idx") is not None:
                skipped += 1
                continue
            try:
                li, k, num_tokens, top = rec["layer"], rec["topk"], rec["num_tokens"], rec["top_indices"]
            except KeyError:
                li = None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (li, k, num_tokens)):
                raise MoetoolError(f"{where}: not a Megatron router trace record (layer, topk, num_tokens: whole "
                                   f"numbers; top_indices)")
            if li not in shape.moe:
                raise MoetoolError(f"{where}: layer {li} is not an MoE layer of --config {shape.source} "
                                   f"(MoE layers {shape.moe_layers})")
            if k != K:
                raise MoetoolError(f"{where}: top-{k} in the trace, top-{K} in --config {shape.source}")
            try:
                ids = np.asarray(top)
            except (ValueError, TypeError):
                ids = None
            if ids is not None and ids.size == 0:
                ids = ids.astype(np.int64).reshape(0, K)
            if ids is None or ids.ndim != 2 or ids.shape[1] != K or ids.dtype.kind not in "iu":
                raise MoetoolError(f"{where}: top_indices is not a [num_tokens][{K}] list of expert ids "
                                   f"(integers)")
            ids = ids.astype(np.int64)
            if ids.shape[0] != num_tokens:
                raise MoetoolError(f"{where}: {ids.shape[0]} rows of top_indices, num_tokens {num_tokens}")
            check_ids(ids, shape.n_experts(li), where, li)
            k2 = (rec.get("rank"), rec.get("step"))
            if key is not None and (k2 != key or li in group):
                c = flush(where)
                if c is not None:
                    c.row[:] = row
                    row += 1
                    yield c
                group = {}
            key = k2
            group[li] = ids
        c = flush(str(path))
        if c is not None:
            c.row[:] = row
            row += 1
            yield c
    if skipped:
        notes.append(f"{skipped} MTP records skipped (not decoder layers)")


# ----- entry point ------------------------------------------------------------------------------------------
def read(sources: list[str | Path], shape: ModelShape, fmt: str | None = None) -> Dump:
    """The dump in ``sources`` (files or folders of one format), lazily: ``chunks`` is read as it is consumed."""
    files = expand(sources)
    fmt = resolve_format(files, fmt)
    names = [str(f) for f in files]
    if fmt in ("vllm", "sglang-routed"):
        dump = Dump(fmt, names)
        dump.chunks = (read_vllm if fmt == "vllm" else read_sglang_routed)(files, shape, dump.seen)
        return dump
    if fmt == "sglang-dump":
        return read_sglang_dump(files, shape)
    dump = Dump(fmt, names, order="sorted by expert id (Megatron's hook reads the routing map: the rank of each "
                                  "expert in a token's top-K is lost)")
    if len(files) > 1:
        dump.notes.append(f"{len(files)} rank files read one after the other: ranks that routed the same tokens "
                          f"(tensor parallel) count them once each; relative loads are unaffected")
    if any(f.parent.joinpath(f.name.replace("router_trace_", "logits_").replace(".jsonl", ".bin")).is_file()
           for f in files):
        dump.notes.append("the logits sidecar (logits_rank*.bin) is not read: the trace keeps the chosen ids")
    dump.seen.add("router_trace.py JSONL (stage pre_dispatch)")
    dump.chunks = read_megatron(files, shape, dump.notes)
    return dump
