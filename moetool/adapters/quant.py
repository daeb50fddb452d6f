"""The quantization-aware view of a layer's expert weights: what every probe reads, whatever the checkpoint ships.

:func:`expert_format` tells, per MoE layer, how its experts are stored:

* ``plain``: float tensors (the family's own layout, :meth:`MoELayer.expert_weights`); also what bitsandbytes
  leaves (it only swaps ``nn.Linear``, so fused 3-D experts stay unquantized: :func:`model_quantization` says so);
* ``fp8`` / ``fp4``: transformers' ``FP8Experts`` (``integrations/finegrained_fp8.py``): ``gate_up_proj [E, 2I, H]``
  (or ``up_proj`` without a gate) and ``down_proj [E, H, I]`` as ``float8_e4m3fn`` with ``*_scale_inv`` per
  ``block_size`` block (fp32 or UE8M0), or FP4 packed two per ``int8`` with one scale per 1x32 group; a matrix
  ``--quantize fp8`` left in high precision (not whole blocks; its scales unset) is read as it is;
* ``mxfp4``: transformers' ``Mxfp4GptOssExperts`` (gpt-oss): Triton tensors of packed e2m1 blocks and E8M0
  scales, read back through their own layout's ``unswizzle_data`` (as transformers does to save them); gate and up
  interleaved, fp32 biases;
* ``linears``: un-fused experts, a list of per-expert MLPs (``gate_proj`` / ``up_proj`` / ``down_proj`` or
  ``w1`` / ``w3`` / ``w2``) of plain ``nn.Linear`` or transformers' ``FP8Linear`` (GPTQ/AWQ-style layouts);
* ``unreadable``: anything else holding integer or FP8 codes (bitsandbytes ``Params4bit``, GPTQ ``qweight``
  packs, ...): :func:`require_readable` refuses it in one line before any work; no number is ever computed
  from raw codes.

:func:`expert_chunks` yields the dequantized weights (the canonical :class:`ExpertWeights` layout, in the
caller's dtype) a slice of experts at a time, at most ``budget`` weight elements per slice (one expert at least):
a DeepSeek-V3 layer (256 experts, ~22 GB in bf16) is never materialised whole. The math is
:mod:`moetool.formats`; it is exact against transformers' own dequantization of the same tensors
(tests/test_quantized.py). Probes compute with the dequantized weights and unquantized activations, which is
what transformers runs on CPU or with ``dequantize=True``; a GPU kernel that also quantizes activations gives
slightly different expert outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from .. import formats
from ..configs import stored_dtype
from ..errors import MoetoolError, spans
from .base import ExpertWeights, MoELayer
from .fp8_backend import unquantized

KINDS = ("plain", "fp8", "fp4", "mxfp4", "linears", "unreadable")

#: what reads expert weights (refused on an unreadable format), and what only needs the routing (runs on any)
WEIGHT_READERS = ("approx", "erc", "norm-select", "prune (norm criteria)", "super-experts", "--routing norm:<node>")

_LINEAR_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertFormat:
    """How one layer's experts are stored."""

    kind: str  # one of KINDS
    detail: str  # one line for inspect and the manifest
    problem: str | None = None  # why moetool cannot read them (kind "unreadable")

    @property
    def readable(self) -> bool:
        return self.problem is None

    @property
    def quantized(self) -> bool:
        return self.kind not in ("plain", "unreadable")


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _is_codes(t: Any) -> bool:
    """Integer or FP8 storage: codes, not values."""
    return isinstance(t, torch.Tensor) and (not t.is_floating_point() or t.element_size() == 1)


def _per_expert(experts: nn.Module) -> list[nn.Module] | None:
    """The per-expert MLPs of un-fused experts (a ModuleList, or the module itself iterable), else None."""
    items = list(experts) if isinstance(experts, (nn.ModuleList, nn.Sequential)) else None
    if items is None:
        kids = list(experts.named_children())
        if kids and all(name.isdigit() for name, _ in kids):
            items = [m for _, m in kids]
    if not items:
        return None
    names = next((ns for ns in _LINEAR_NAMES if all(hasattr(items[0], a) for a in ns)), None)
    return items if names is not None else None


def _linear_kind(lin: nn.Module) -> str | None:
    """``plain`` (float ``nn.Linear``), ``fp8`` (transformers' ``FP8Linear``) or None (cannot read)."""
    if "FP8Linear" in _class_names(lin) and isinstance(getattr(lin, "weight_scale_inv", None), torch.Tensor) \
            and not unquantized(lin.weight):  # a weight left in high precision is read as it is (its scales unset)
        return "fp8"
    if isinstance(lin, nn.Linear) and not _is_codes(lin.weight):
        return "plain"
    return None


def expert_format(layer: MoELayer) -> ExpertFormat:
    """How ``layer``'s experts are stored (module docstring)."""
    ex = layer.experts
    names = _class_names(ex)
    if "FP8Experts" in names:
        w = ex.gate_up_proj if getattr(ex, "has_gate", True) else ex.up_proj
        scale = ex.down_proj_scale_inv
        form = "UE8M0" if scale.dtype == getattr(torch, "float8_e8m0fnu", None) else str(scale.dtype).replace(
            "torch.", "")
        static = ", static activation scales (not applied by probes)" if \
            getattr(ex, "activation_scheme", "dynamic") == "static" else ""
        if w.dtype == torch.int8:
            return ExpertFormat("fp4", f"FP8Experts, FP4 e2m1 packed in int8, 1x32 groups, {form} scales{static}")
        if w.dtype == formats.FP8_DTYPE:
            block = getattr(ex, "block_size", None)
            blk = "per-tensor" if block is None else f"{block[0]}x{block[1]} blocks"
            return ExpertFormat("fp8", f"FP8Experts, e4m3, {blk}, {form} scale_inv{static}")
        if w.is_floating_point():  # dequantize=True kept the class with float weights
            return ExpertFormat("plain", f"FP8Experts holding {str(w.dtype).replace('torch.', '')} weights")
        return ExpertFormat("unreadable", f"FP8Experts with {w.dtype} weights",
                            f"FP8Experts stores {w.dtype} weights, neither FP8 nor packed FP4")
    if "Mxfp4GptOssExperts" in names:
        if getattr(ex, "gate_up_proj_precision_config", None) is None or not hasattr(ex.gate_up_proj, "storage"):
            return ExpertFormat("unreadable", "Mxfp4GptOssExperts without loaded kernel tensors",
                                "MXFP4 experts whose blocks and scales are not loaded (no Triton tensors)")
        return ExpertFormat("mxfp4", "Mxfp4GptOssExperts, e2m1 packed in uint8, 32-value blocks, E8M0 scales")
    items = _per_expert(ex)
    if items is not None:
        lins = [getattr(m, a) for m in items for ns in _LINEAR_NAMES if hasattr(m, ns[0]) for a in ns]
        kinds = {_linear_kind(lin) for lin in lins}
        if None in kinds:
            bad = next(type(lin).__name__ for lin in lins if _linear_kind(lin) is None)
            return ExpertFormat("unreadable", f"{len(items)} per-expert MLPs of {bad}",
                                f"per-expert linears of class {bad}: a quantized format moetool cannot read")
        what = "FP8Linear (block-scaled FP8)" if "fp8" in kinds else "nn.Linear"
        return ExpertFormat("linears", f"{len(items)} per-expert MLPs of {what}")
    codes = [(n, t) for n, t in [*ex.named_parameters(), *((n, b) for n, b in ex.named_buffers() if b.dim() >= 2)]
             if _is_codes(t)]  # matrices of codes (a small integer buffer, e.g. expert ids, is not one)
    if codes:
        n, t = codes[0]
        return ExpertFormat("unreadable", f"{type(ex).__name__} with {n} in {t.dtype}",
                            f"{type(ex).__name__} stores {n} as {str(t.dtype).replace('torch.', '')} codes "
                            f"({type(t).__name__}): a format moetool cannot read")
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in ex.parameters()})
    return ExpertFormat("plain", f"{type(ex).__name__}, {'/'.join(dtypes) or 'no parameters'}")


def require_readable(layers: list[MoELayer] | MoELayer, what: str = "this command") -> None:
    """One line (:class:`MoetoolError`) if some layer's experts are in a format moetool cannot read."""
    for L in [layers] if isinstance(layers, MoELayer) else layers:
        fmt = expert_format(L)
        if not fmt.readable:
            raise MoetoolError(f"layer {L.index}: {fmt.problem}; {what} reads expert weights and refuses it "
                               f"(routing-only commands such as ppl and trace run)")


def model_quantization(model: nn.Module) -> dict[str, Any]:
    """The model's quantization as loaded: ``method`` (transformers' ``quant_method`` or None) and, for
    bitsandbytes, ``note``: its fused 3-D experts stayed unquantized."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return {"method": None}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = str(getattr(method, "value", method))
    out: dict[str, Any] = {"method": method}
    if method == "bitsandbytes":
        out["note"] = ("bitsandbytes quantizes nn.Linear only: the fused 3-D expert weights stayed unquantized "
                       "(experts in full precision, the rest quantized)")
    return out


# ------------------------------------------------------------------------------------------------- the view


def _fp8_pair(ex: nn.Module, name: str, sl: slice, dtype: torch.dtype) -> torch.Tensor:
    """FP8Experts' ``name`` for experts ``sl``, dequantized. Without ``block_size`` the scales are per tensor (a
    fused gate_up keeps one for each half: ``[E, 2, 1]``); the block is then read from the scale grid."""
    w, s = getattr(ex, name)[sl], getattr(ex, f"{name}_scale_inv")[sl]
    if unquantized(w):  # left in high precision by the quantizer (not whole blocks): its scales are unset
        return w.to(dtype)
    return formats.dequantize_fp8(w, s, dtype, block=getattr(ex, "block_size", None))


class _Mxfp4:
    """A Mxfp4GptOssExperts' blocks and scales (``[E, R, G*16]``, ``[E, R, G]``; a slice of experts is cut into the
    checkpoint's ``[e, R, G, 16]`` blocks), unswizzled once per probe call exactly as transformers'
    ``Mxfp4ReverseDeserialize`` does."""

    def __init__(self, ex: nn.Module):
        self.parts = {p: self._unswizzle(ex, p) for p in ("gate_up_proj", "down_proj")}

    @staticmethod
    def _unswizzle(ex: nn.Module, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scales = getattr(ex, proj), getattr(ex, f"{proj}_precision_config").weight_scale
        scales = scales.storage.layout.unswizzle_data(scales.storage.data).transpose(-1, -2)
        blocks = weight.storage.layout.unswizzle_data(weight.storage.data).transpose(-1, -2)
        return blocks, scales  # [E, R, G*16] and [E, R, G]: views (a strided layout copies nothing)

    def read(self, proj: str, sl: slice, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        blocks, scales = self.parts[proj]
        b = blocks[sl, rows]  # only this slice of experts is made contiguous
        b = b.reshape(*b.shape[:-1], -1, 16)
        return formats.dequantize_mxfp4(b, scales[sl, rows], dtype)  # [e, out rows, in]


def _per_expert_weight(lin: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    if _linear_kind(lin) == "fp8":
        return formats.dequantize_fp8(lin.weight, lin.weight_scale_inv, dtype, block=getattr(lin, "block_size", None))
    return lin.weight.to(dtype)


def _sizes(layer: MoELayer, fmt: ExpertFormat) -> tuple[int, int]:
    """(experts, weight elements per expert) of the dequantized view."""
    ex = layer.experts
    if fmt.kind == "linears":
        items = _per_expert(ex)
        first = next(ns for ns in _LINEAR_NAMES if hasattr(items[0], ns[0]))
        return len(items), sum(_out_in(getattr(items[0], a)) for a in first)
    if fmt.kind == "mxfp4":
        n, i, d = ex.num_experts, ex.intermediate_size, ex.hidden_size
        return n, 3 * i * d
    up = ex.gate_up_proj if getattr(ex, "has_gate", True) else ex.up_proj
    n, rows = up.shape[0], up.shape[1]
    d, inter = ex.down_proj.shape[1], ex.down_proj.shape[2] * (2 if fmt.kind == "fp4" else 1)
    return n, rows * d + d * inter


def _out_in(lin: nn.Module) -> int:
    return int(lin.out_features) * int(lin.in_features)


PARTS = ("gate", "up", "down")


def _absent(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A part the caller did not ask for: its shape, no memory (a stride-0 view of one zero)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _rows(ex: nn.Module, name: str, sl: slice, rows: slice, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows ``rows`` of FP8Experts' ``name`` for experts ``sl``, dequantized: only their scale blocks are read
    (None when the rows do not start and end on a block boundary: the caller reads the whole matrix)."""
    w, s = getattr(ex, name), getattr(ex, f"{name}_scale_inv")
    if unquantized(w):
        return w[sl, rows].to(dtype)
    block = None if w.dtype == torch.int8 else getattr(ex, "block_size", None)
    bn = 1 if w.dtype == torch.int8 else block[0] if block else w.shape[1] // s.shape[1]
    start, stop = rows.start, rows.stop
    if start % bn or (stop % bn and stop != w.shape[1]):
        return None
    block = block or (None if w.dtype == torch.int8 else (bn, w.shape[2]))
    return formats.dequantize_fp8(w[sl, start:stop], s[sl, start // bn:-(-stop // bn)], dtype, block=block)


def _read(layer: MoELayer, fmt: ExpertFormat, sl: slice, dtype: torch.dtype, state: Any,
          parts: frozenset[str] = frozenset(PARTS)) -> ExpertWeights:
    ex = layer.experts
    if fmt.kind in ("fp8", "fp4"):
        n_sl = len(range(*sl.indices(ex.down_proj.shape[0])))
        d = ex.down_proj.shape[1]
        inter = ex.down_proj.shape[2] * (2 if fmt.kind == "fp4" else 1)
        device = ex.down_proj.device
        down = _fp8_pair(ex, "down_proj", sl, dtype) if "down" in parts else _absent((n_sl, d, inter), dtype, device)
        if not getattr(ex, "has_gate", True):
            up = _fp8_pair(ex, "up_proj", sl, dtype)
            return ExpertWeights(gate=up, up=up, down=down)
        if {"gate", "up"} <= parts:  # both halves: one dequantized [e, 2I, d], gate and up its halves (views), so
            gate_up = _fp8_pair(ex, "gate_up_proj", sl, dtype)  # the probe runs them as one product (the plain
            return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=down)  # experts' layout)
        got = {}
        for part, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter))):
            if part in parts:
                got[part] = _rows(ex, "gate_up_proj", sl, rows, dtype)
        if any(v is None for v in got.values()):  # a block straddles gate and up: read the fused matrix
            gate_up = _fp8_pair(ex, "gate_up_proj", sl, dtype)  # [e, 2I, d], gate first
            got = {p: gate_up[:, r].contiguous() for p, r in (("gate", slice(0, inter)), ("up", slice(inter, None)))
                   if p in got}
        gate, up = (got.get(p, _absent((n_sl, inter, d), dtype, device)) for p in ("gate", "up"))
        return ExpertWeights(gate=gate, up=up, down=down)
    if fmt.kind == "mxfp4":
        n_sl = len(range(*sl.indices(ex.num_experts)))
        inter, d = ex.intermediate_size, ex.hidden_size
        bias = ex.gate_up_proj_bias[sl].to(dtype)
        device = bias.device
        gate, up = ((state.read("gate_up_proj", sl, dtype, rows=slice(i, None, 2)) if p in parts
                     else _absent((n_sl, inter, d), dtype, device)) for i, p in enumerate(("gate", "up")))
        down = state.read("down_proj", sl, dtype) if "down" in parts else _absent((n_sl, d, inter), dtype, device)
        return ExpertWeights(gate=gate, up=up, down=down, gate_bias=bias[:, ::2], up_bias=bias[:, 1::2],
                             down_bias=ex.down_proj_bias[sl].to(dtype))
    items = _per_expert(ex)[sl]
    g, u, dn = next(ns for ns in _LINEAR_NAMES if hasattr(items[0], ns[0]))

    def stack(attr: str) -> torch.Tensor:
        return torch.stack([_per_expert_weight(getattr(m, attr), dtype) for m in items])

    def bias(attr: str) -> torch.Tensor | None:
        bs = [getattr(getattr(m, attr), "bias", None) for m in items]
        return None if bs[0] is None else torch.stack(bs).to(dtype)

    return ExpertWeights(gate=stack(g), up=stack(u), down=stack(dn), gate_bias=bias(g), up_bias=bias(u),
                         down_bias=bias(dn))


#: experts modules whose scales were found finite (a check per layer and process, not per slice and batch: on a
#: GPU each check is a host sync, and scales do not change during a run)
_FINITE_SCALES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _require_finite_scales(layer: MoELayer, fmt: ExpertFormat, state: Any) -> None:
    """One line (:class:`MoetoolError`) when a scale of the layer's experts is NaN or infinite (an E8M0 byte 255;
    :func:`formats.nonfinite_scales`): their weights would be NaN/inf, and so every number a probe makes of them.
    Checked once per experts module (:data:`_FINITE_SCALES`)."""
    ex = layer.experts
    if ex in _FINITE_SCALES:
        return
    if fmt.kind in ("fp8", "fp4"):
        scales = [(f"{n}_scale_inv", s) for n in ("gate_up_proj", "up_proj", "down_proj")
                  if isinstance(s := getattr(ex, f"{n}_scale_inv", None), torch.Tensor)
                  and not unquantized(getattr(ex, n))]  # a high-precision weight's scales are unset, never read
    elif fmt.kind == "mxfp4":
        scales = [(f"{p}_scales", s) for p, (_, s) in state.parts.items()]
    else:  # per-expert linears: FP8Linear's weight_scale_inv, stacked per name (one count for all experts)
        scales = [(f"experts.{i}.{a}.weight_scale_inv", lin.weight_scale_inv.unsqueeze(0))
                  for i, m in enumerate(_per_expert(ex)) for a, lin in m.named_children() if _linear_kind(lin) == "fp8"]
    for name, s in scales:  # [E, ...] (per-expert linears: [1, ...] each)
        bad = formats.nonfinite_scales(s, per_row=True)  # [E]: one host sync per tensor, then only on a refusal
        total = int(bad.sum())
        if total:
            hit = [int(e) for e in torch.nonzero(bad).flatten().tolist()]
            where = name if s.shape[0] == 1 else f"{name} of expert{'s' if len(hit) > 1 else ''} {spans(hit)}"
            raise MoetoolError(f"layer {layer.index}: {total} of the {s.numel()} scales of {where} are NaN or "
                               f"infinite: their weights cannot be read (refused rather than computed as NaN/inf)")
    _FINITE_SCALES.add(ex)


def expert_chunks(layer: MoELayer, budget: int, dtype: torch.dtype | None = None,
                  plain: ExpertWeights | None = None,
                  parts: frozenset[str] | set[str] = frozenset(PARTS)) -> Iterator[tuple[slice, ExpertWeights]]:
    """``(experts slice, weights)`` covering every expert of ``layer``: one slice of views for plain experts
    (``plain``: the views to use, e.g. made matmul-ready), else dequantized slices of at most ``budget`` weight
    elements (one expert at least) in ``dtype``. Only ``parts`` (of gate, up, down) are dequantized for FP8/FP4
    and MXFP4 experts; the others are stride-0 placeholders of the right shape that must not be read.
    Unreadable formats raise (:func:`require_readable`), and so does a layer with a NaN or infinite scale."""
    fmt = expert_format(layer)
    if fmt.kind == "plain":
        yield slice(0, None), plain if plain is not None else layer.expert_weights()
        return
    require_readable(layer, "a probe")
    n, per = _sizes(layer, fmt)
    parts = frozenset(parts)
    if fmt.kind != "linears":  # gate, up and down are a third of an expert each
        per = max(1, per * len(parts) // 3)
    dtype = dtype or torch.float32
    step = max(1, budget // max(per, 1))
    state = _Mxfp4(layer.experts) if fmt.kind == "mxfp4" else None
    _require_finite_scales(layer, fmt, state)
    for s in range(0, n, step):
        sl = slice(s, min(n, s + step))
        yield sl, _read(layer, fmt, sl, dtype, state, parts)


def dequantized(layer: MoELayer, dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """Every expert's weights at once (tests and small models only: a whole layer)."""
    parts = [w for _, w in expert_chunks(layer, 1 << 62, dtype)]
    return parts[0]


def stored_bytes_per_expert(layer: MoELayer) -> int:
    """Bytes one expert occupies as stored (codes and scales for quantized formats; biases included)."""
    fmt = expert_format(layer)
    ex = layer.experts
    if fmt.kind == "plain":
        w = layer.expert_weights()
        return int(sum((t.numel() // t.shape[0]) * t.element_size()  # global shapes (a DTensor's too), no indexing
                       for t in (w.gate, w.up, w.down, w.gate_bias, w.up_bias, w.down_bias) if t is not None))
    if fmt.kind == "linears":
        items = _per_expert(ex)
        return int(sum(t.numel() * t.element_size() for t in [*items[0].parameters(), *items[0].buffers()]))
    if fmt.kind == "mxfp4":
        state = _Mxfp4(ex)
        total = sum(t[0].numel() * t.element_size() for b, s in state.parts.values() for t in (b, s))
        return int(total + ex.gate_up_proj_bias[0].numel() * 4 + ex.down_proj_bias[0].numel() * 4)
    return int(sum(t[0].numel() * t.element_size() for name, t in ex.named_parameters()
                   if t is not None and t.dim() >= 1 and t.shape[0] == _sizes(layer, fmt)[0]))


class _RouteThroughModules:
    """A handle: ``experts._is_hooked`` set for the duration, restored by ``remove()``."""

    def __init__(self, experts: nn.Module):
        self.experts, self.had, self.old = experts, "_is_hooked" in vars(experts), vars(experts).get("_is_hooked")
        experts._is_hooked = True

    def remove(self) -> None:
        if self.had:
            self.experts._is_hooked = self.old
        else:
            vars(self.experts).pop("_is_hooked", None)


def route_through_modules(layer: MoELayer) -> _RouteThroughModules | None:
    """transformers' ``Mxfp4GptOssMLP`` computes its logits with ``F.linear`` and routes in a Triton kernel, calling
    neither the router nor the experts module, so no hook would see its routing. Unless its experts are marked
    ``_is_hooked`` (its expert-parallel path): then it runs ``router(h)`` and ``experts(h, idx, w)`` like
    ``GptOssMLP``, the same rule (top-K of the logits, softmax over the K). The engine sets that mark while it
    hooks such a layer (this handle's ``remove()`` restores it); None for every other layer."""
    if "Mxfp4GptOssMLP" in _class_names(layer.block) and not getattr(layer.experts, "_is_hooked", False):
        return _RouteThroughModules(layer.experts)
    return None


# ----------------------------------------------------------------------------------- from the config alone

#: quant_method values whose experts transformers keeps in a module this view reads (on a GPU)
_READABLE_METHODS = {"fp8": "FP8Experts", "mxfp4": "Mxfp4GptOssMLP / Mxfp4GptOssExperts"}


def _qc_get(qc: Any, key: str, default: Any = None) -> Any:
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def checkpoint_format(config: Any, quantize: str | None = None) -> dict[str, str]:
    """What a checkpoint's experts are stored in (its config's ``quantization_config``, or ``--quantize``), what
    loading gives on a GPU and on CPU, and what moetool's commands do with it: ``{format, gpu, cpu, routing,
    weights}`` (one line each), for ``inspect`` and the manifest. From the config alone (no weights)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None and quantize == "fp8":
        qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "float", "quantize": True}
    routing = "routing commands (ppl, trace, stats, ...) capture the router's own output"
    if qc is None:
        dtype = str(stored_dtype(config) or "?").replace("torch.", "")
        return {"format": f"plain ({dtype})", "gpu": "experts as stored", "cpu": "experts as stored",
                "routing": routing, "weights": "probes read the expert weights as stored"}
    method = str(getattr(_qc_get(qc, "quant_method"), "value", _qc_get(qc, "quant_method")))
    if method == "fp8":
        fp4 = _qc_get(qc, "expert_dtype", "fp8") == "fp4"
        scales = "UE8M0" if _qc_get(qc, "scale_fmt", "float") == "ue8m0" else "fp32"
        block = _qc_get(qc, "weight_block_size", None)
        fmt = (f"FP4 e2m1 experts packed in int8, 1x32 groups, {scales} scales" if fp4 else
               f"block-scaled FP8 e4m3 ({'x'.join(map(str, block)) if block else 'per-tensor'} blocks, "
               f"{scales} scale_inv)")
        if _qc_get(qc, "quantize", False):
            fmt = f"--quantize fp8: bf16 checkpoint quantized at load to {fmt}"
        return {"format": fmt, "gpu": "experts become transformers' FP8Experts",
                "cpu": "transformers dequantizes at load: plain experts",
                "routing": routing,
                "weights": "probes dequantize FP8Experts a slice of experts at a time (exact, in the model's dtype; "
                           "activations unquantized)"}
    if method == "mxfp4":
        return {"format": "MXFP4 (e2m1 in 32-value blocks, E8M0 scales)",
                "gpu": "MLP becomes transformers' Mxfp4GptOssMLP (Triton kernels, router module bypassed)",
                "cpu": "transformers dequantizes at load: plain experts",
                "routing": "the engine routes the MXFP4 block through its router and experts modules (its "
                           "expert-parallel path, same rule) so the router's own output is captured",
                "weights": "probes dequantize the MXFP4 blocks a slice of experts at a time (exact)"}
    if method == "bitsandbytes":
        return {"format": "bitsandbytes (nn.Linear only)",
                "gpu": "attention and dense linears quantized; fused 3-D experts stay unquantized",
                "cpu": "bitsandbytes needs its own backend", "routing": routing,
                "weights": "probes read the unquantized experts as stored (said in the console and the manifest)"}
    return {"format": f"{method} (per-expert quantized linears of its own library)",
            "gpu": f"experts un-fused into {method} linears", "cpu": f"{method} needs its own backend",
            "routing": routing + " if the experts module is still called as experts(h, idx, w)",
            "weights": f"refused in one line before any work ({method} linears: a format moetool cannot read)"}
