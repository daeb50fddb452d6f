"""The math of the quantized weight formats checkpoints ship their experts in: the one home of it.

Formats (``FORMATS``):

- ``fp8``: block-scaled FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3/GLM FP8 releases): ``float8_e4m3fn`` codes, one scale per
  ``128 x 128`` block of the ``[out, in]`` matrix, stored as its inverse (``*_scale_inv``, the number the codes are
  multiplied by) in fp32 or, in the UE8M0 form (``scale_fmt="ue8m0"``), as a power of two in ``float8_e8m0fnu``.
  Quantization is transformers' own (``Fp8Quantize``): scale_inv = 1 / (448 / amax) per block (UE8M0: rounded up to a power
  of two), codes = clamp(w / scale_inv) cast to e4m3 (round to nearest even). Blocks at a ragged edge are partial.
- ``fp4``: FP4-packed experts (DeepSeek-V4-style ``expert_dtype="fp4"``): e2m1 values packed two per ``int8`` byte
  (low nibble first) along the input dim, one scale per ``1 x 32`` group of a row, fp32 or UE8M0. Quantization:
  scale = amax / 6 (UE8M0: rounded up to a power of two), codes = nearest e2m1 value (ties to even).
- ``mxfp4``: OCP MXFP4 (gpt-oss): e2m1 packed two per ``uint8`` byte (low nibble first), one E8M0 exponent byte
  (bias 127) per 32 consecutive input values; the scale is amax / 6 rounded up to a power of two (the rounding
  transformers' gpt-oss kernels use, so no value clips), codes the nearest e2m1 value (ties to even).
- ``bf16`` / ``fp16`` / ``fp32``: plain casts.

:func:`fake_quantize` is quantize-then-dequantize of a full-precision weight with a format's rules (what a run "in
fp8" on CPU simulates); the ``dequantize_*`` functions read stored codes back, for any leading (expert) dims, so
callers dequantize a slice of experts at a time. Everything computes in fp32 and is exact against transformers'
dequantization of the same codes (tests/test_formats.py). On CUDA a whole-block dequantization is one compiled kernel
(:mod:`moetool.compiled`), bit-identical to the eager passes the CPU runs; the CPU reads the codes' values from a
byte table (:func:`decode_bytes`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import compiled
from .errors import MoetoolError

#: the formats :func:`fake_quantize` takes
FORMATS = ("fp32", "bf16", "fp16", "fp8", "fp4", "mxfp4")
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: quantized formats: how each stores its experts
DESCRIPTIONS = {
    "fp8": "FP8 e4m3, one scale per 128x128 block (fp32 or UE8M0 scale_inv)",
    "fp4": "FP4 e2m1 packed two per int8 byte, one scale per 1x32 group (fp32 or UE8M0)",
    "mxfp4": "MXFP4: e2m1 packed two per uint8 byte, one E8M0 exponent per 32 values",
}

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_BLOCK = (128, 128)
FP4_GROUP = 32
FP4_MAX = 6.0
#: the 16 e2m1 codes, in code order (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: midpoints between consecutive non-negative e2m1 values; at the odd-numbered ones a tie rounds up (to even)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
SCALE_FORMS = ("float", "ue8m0")


#: numpy tables by (key, pairs), device tensors by (key, device): built once each
_BYTE_TABLES: dict[Any, Any] = {}


def _byte_table(key: Any, pairs: bool = False) -> Any:
    """The fp32 values of every byte (a numpy table): ``[256]`` for a one-byte float dtype, ``[256, 2]`` for two
    packed e2m1 codes (``"e2m1x2"``, low nibble first); ``pairs``: of every two consecutive bytes read as one
    native ``uint16`` (``[65536, 2 or 4]``, 0.5-1 MiB: one lookup per two bytes)."""
    if (key, pairs) not in _BYTE_TABLES:
        import sys

        import numpy as np

        if pairs:
            one = _byte_table(key).reshape(256, -1)
            v = np.arange(65536)
            first, second = (v & 0xFF, v >> 8) if sys.byteorder == "little" else (v >> 8, v & 0xFF)
            table = np.concatenate([one[first], one[second]], axis=-1)
        elif key == "e2m1x2":
            e2m1 = np.asarray(E2M1_VALUES, dtype=np.float32)
            b = np.arange(256)
            table = np.stack([e2m1[b & 0xF], e2m1[b >> 4]], axis=-1)
        else:
            table = torch.arange(256, dtype=torch.uint8, device="cpu").view(key).to(torch.float32).numpy()
        _BYTE_TABLES[key, pairs] = table
    return _BYTE_TABLES[key, pairs]


def _bytes_on_host(t: torch.Tensor) -> bool:
    """A plain CPU tensor of one-byte codes that numpy can index with (not a DTensor shard or another subclass)."""
    return t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter) and t.element_size() == 1


#: codes per thread below which one thread decodes (a thread's start costs more than it saves)
TAKE_GRAIN = 1 << 20
_POOLS: dict[tuple[int, int], Any] = {}


def _take(table: Any, idx: Any) -> Any:
    """``table[idx]`` (numpy ``take`` along the table's rows, ``idx``'s shape + the row's): split over torch's CPU
    threads along the first axis long enough (numpy releases the GIL while it takes: 2 threads ~1.9x)."""
    import numpy as np

    threads = min(torch.get_num_threads(), idx.size // TAKE_GRAIN)
    axis = next((i for i, n in enumerate(idx.shape) if n >= threads), None) if threads > 1 else None
    if axis is None:
        return np.take(table, idx, axis=0, mode="clip")
    import os

    key = (os.getpid(), threads)  # a forked child never submits to its parent's threads (they are not in it)
    if key not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor

        _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="moetool-decode")
    out = np.empty(idx.shape + table.shape[1:], dtype=table.dtype)
    edges = np.linspace(0, idx.shape[axis], threads + 1).astype(int)
    parts = [(slice(None),) * axis + (slice(lo, hi),) for lo, hi in zip(edges[:-1], edges[1:])]
    for f in [_POOLS[key].submit(np.take, table, idx[p], 0, out[p], "clip") for p in parts]:
        f.result()
    return out


def decode_bytes(codes: torch.Tensor, key: Any) -> torch.Tensor:
    """fp32 values of one-byte codes looked up in :func:`_byte_table` (``key``: the codes' float dtype, or
    ``"e2m1x2"`` for packed FP4 pairs: the last dim doubles): on the CPU numpy's ``take`` indexed by the bytes
    themselves (two at a time where the last dim allows), 3-4x faster than torch's element-wise FP8 conversion or
    its int64-indexed lookups; the same values."""
    u8 = codes.detach().view(torch.uint8)
    if _bytes_on_host(codes):
        import numpy as np

        a = u8.numpy()
        if a.ndim and a.shape[-1] % 2 == 0 and a.strides[-1] == 1:  # rows of whole byte pairs (any row strides)
            a, table = a.view(np.uint16), _byte_table(key, pairs=True)
        else:
            table = _byte_table(key).reshape(256, -1)
        out = torch.from_numpy(_take(table, a))
    else:  # the table copied to the device once (a copy per call would wait for the device's queue)
        if (key, codes.device) not in _BYTE_TABLES:
            _BYTE_TABLES[key, codes.device] = torch.from_numpy(_byte_table(key)).to(codes.device)
        out = _BYTE_TABLES[key, codes.device][u8.long()]
    return out.reshape(codes.shape[:-1] + (-1,)) if codes.dim() else out.reshape(())


def _e8m0_dtype() -> torch.dtype:
    return torch.float8_e8m0fnu


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``x`` (``x`` > 0, fp32)."""
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=torch.finfo(torch.float32).tiny))))


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = -size % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
    return torch.nn.functional.pad(x, pad)


# ---------------------------------------------------------------------------------------------------------- FP8


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` -> (e4m3 codes ``[..., N, K]``, scale_inv ``[..., ceil(N/bn), ceil(K/bk)]``), transformers'
    ``Fp8Quantize`` rules (fp32 scale_inv, or UE8M0 ``float8_e8m0fnu`` powers of two); a ragged edge block is a
    partial block."""
    if scale_fmt not in SCALE_FORMS:
        raise MoetoolError(f"unknown FP8 scale form '{scale_fmt}' (choose from {', '.join(SCALE_FORMS)})")
    bn, bk = block
    *lead, n, k = weight.shape
    w = _pad_to(_pad_to(weight.float(), -2, bn), -1, bk)
    tiles = w.reshape(*lead, w.shape[-2] // bn, bn, w.shape[-1] // bk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    # finite: a block whose largest |value| is below FP8_MAX / fp32's largest (1.3e-36) made it inf, and 0 x inf
    # NaN in the block's zeros (transformers' Fp8Quantize too)
    big = torch.finfo(torch.float32).max
    scale = torch.where(amax > 0, (FP8_MAX / torch.where(amax > 0, amax, 1.0)).clamp(max=big), torch.ones_like(amax))
    inv = 1.0 / scale
    if scale_fmt == "ue8m0":
        inv = _pow2_ceil(inv)
        scale = 1.0 / inv
    q = (tiles * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(w.shape)[..., :n, :k]
    return q, (inv.to(_e8m0_dtype()) if scale_fmt == "ue8m0" else inv)


def scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32 multipliers: fp32/bf16 as they are, ``float8_e8m0fnu`` decoded, raw E8M0 bytes (``uint8``,
    bias 127) as ``2 ** (byte - 127)``."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def nonfinite_scales(scale: torch.Tensor, per_row: bool = False) -> Any:
    """How many of ``scale`` (fp32/bf16 multipliers, ``float8_e8m0fnu``, or raw E8M0 ``uint8`` bytes) are not a finite
    number: NaN or inf, and the E8M0 byte 255, which is NaN (OCP MX; transformers' ``ldexp`` would read it as
    2^128, an inf weight). Codes times such a scale are NaN or inf, never a weight. Bytes are compared as they
    are stored (no fp32 copy of a large scale grid). ``per_row``: a device tensor of the counts per index of dim 0
    (an expert's), no host sync; else an int."""
    bad = (scale.view(torch.uint8) == 255) if scale.dtype == torch.uint8 or scale.dtype == _e8m0_dtype() \
        else ~torch.isfinite(scale)
    return bad.reshape(bad.shape[0], -1).sum(1) if per_row else int(bad.sum())


def dequantize_fp8(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: tuple[int, int] | list[int] | None = None,
) -> torch.Tensor:
    """FP8 ``[..., N, K]`` codes (or FP4 ``int8``-packed ``[..., N, K/2]``) times their block scales ``[..., sn, sk]``
    -> ``[..., N, K]`` in ``dtype``. ``block`` (``[bn, bk]``; a ragged last block is partial) is the module's
    ``block_size``; without it the block is read from the scale grid, which must then divide the matrix (how
    transformers' ``Fp8Dequantize`` reads 128x128 FP8 and 1x32 FP4 alike)."""
    fp4_x2 = getattr(torch, "float4_e2m1fn_x2", None)
    fp4 = codes.dtype in (torch.int8, fp4_x2)
    *_, n, k = codes.shape
    k = 2 * k if fp4 else k
    sn, sk = scale_inv.shape[-2:]
    if fp4:
        block = (1, FP4_GROUP)
    fused = _fused_blocks(codes, scale_inv, n, k, block, dtype, fp4)
    if fused is not None:
        return fused
    # the codes' exact values: on the CPU fp32 from a byte table (its products below take torch's fast fp32 path);
    # elsewhere bf16 (it holds every e4m3 value exactly: half the bytes of fp32), the same products
    if fp4:
        values = unpack_fp4(codes)
    else:
        values = decode_bytes(codes, codes.dtype) if _bytes_on_host(codes) else codes.to(torch.bfloat16)
    if block is None:
        if n % sn or k % sk:
            raise MoetoolError(f"weight [{n}, {k}] is not a whole number of blocks of its scale grid [{sn}, {sk}]")
        block = (n // sn, k // sk)
    bn, bk = block
    if math.ceil(n / bn) != sn or math.ceil(k / bk) != sk:
        raise MoetoolError(f"scale grid [{sn}, {sk}] does not fit weight [{n}, {k}] in blocks of [{bn}, {bk}]")
    s = scales_fp32(scale_inv)
    if n % bn == 0 and k % bk == 0 and s.shape[:-2] == values.shape[:-2]:  # whole blocks: one broadcast product (fp32) written in dtype, no scale grid
        lead = values.shape[:-2]
        # the decoded fp32 values are this call's own: scaled in place when fp32 is wanted (no second buffer)
        out = values if values.dtype == dtype == torch.float32 and values.is_contiguous() \
            else torch.empty(values.shape, dtype=dtype, device=values.device)
        torch.mul(values.reshape(*lead, sn, bn, sk, bk), s.reshape(*lead, sn, 1, sk, 1),
                  out=out.view(*lead, sn, bn, sk, bk))
        return out
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (values * s).to(dtype)


def _blocks_fp8(codes: torch.Tensor, s: torch.Tensor, lead: tuple[int, ...], sn: int, bn: int, sk: int, bk: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Whole-block FP8 codes times their fp32 scales, in fp32, written in ``dtype`` (the eager path's products)."""
    v = codes.to(torch.float32).reshape(*lead, sn, bn, sk, bk) * s.reshape(*lead, sn, 1, sk, 1)
    return v.to(dtype).reshape(*lead, sn * bn, sk * bk)


def _blocks_fp4(u8: torch.Tensor, s: torch.Tensor, lut: torch.Tensor, lead: tuple[int, ...], n: int, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Packed e2m1 pairs (``uint8``) looked up in ``lut`` (the 16 values, fp32), times their fp32 ``1 x 32`` group
    scales."""
    v = torch.stack([lut[(u8 & 0xF).to(torch.int32)], lut[(u8 >> 4).to(torch.int32)]], dim=-1)
    v = v.reshape(*lead, n, k // FP4_GROUP, FP4_GROUP) * s.reshape(*lead, n, k // FP4_GROUP, 1)
    return v.to(dtype).reshape(*lead, n, k)


def _fused_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, n: int, k: int, block: tuple[int, int] | list[int] | None,
                  dtype: torch.dtype, fp4: bool) -> torch.Tensor | None:
    """:func:`dequantize_fp8`'s whole-block case as one compiled kernel (:mod:`moetool.compiled`: CUDA; the codes read
    once, the result written once, where the eager ops make two to four passes: on one H100 an ``[8, 4096, 1024]``
    FP8 slice 0.28 -> 0.07 ms, FP4 0.89 -> 0.11 ms, the same bits); None elsewhere (ragged blocks, a scale grid
    that does not fit, per-tensor scales broadcast over experts, the CPU)."""
    if not compiled.wanted(codes):
        return None
    lead, (sn, sk) = tuple(codes.shape[:-2]), scale_inv.shape[-2:]
    if tuple(scale_inv.shape[:-2]) != lead:
        return None
    bn, bk = block if block is not None else (n // sn if n % sn == 0 else 0, k // sk if k % sk == 0 else 0)
    if not bn or not bk or n != sn * bn or k != sk * bk or (fp4 and (bn, bk) != (1, FP4_GROUP)):
        return None
    s = scales_fp32(scale_inv)
    if fp4:
        if ("e2m1", codes.device) not in _BYTE_TABLES:  # the 16 values on the device, once
            _BYTE_TABLES["e2m1", codes.device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
        return compiled.run("fp4 dequantization", _blocks_fp4, codes.contiguous().view(torch.uint8), s.contiguous(),
                            _BYTE_TABLES["e2m1", codes.device], lead, n, k, dtype, dynamic=False)
    return compiled.run("fp8 dequantization", _blocks_fp8, codes, s, lead, sn, bn, sk, bk, dtype, dynamic=False)


# ---------------------------------------------------------------------------------------------------------- FP4


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code (``uint8`` 0..15, sign in bit 3) of each value of ``x`` (already scaled into +-6;
    beyond saturates to 6), ties to even mantissa."""
    a = x.abs().float().clamp(max=FP4_MAX).contiguous()
    bounds = torch.tensor(_E2M1_BOUNDS, device=x.device)
    idx = torch.bucketize(a, bounds)  # a at a midpoint lands on the lower value
    at = torch.gather(bounds, 0, idx.clamp(max=len(_E2M1_BOUNDS) - 1).flatten()).view_as(a) == a
    idx = idx + (at & (idx % 2 == 1)).long()  # ...except at 0.75, 1.75, 3.5, where even is the upper one
    return (idx | (torch.signbit(x).long() << 3) * (idx > 0)).to(torch.uint8)


def pack_fp4(codes: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Pack e2m1 codes ``[..., K]`` (K even) two per byte, element ``2i`` in the low nibble -> ``[..., K/2]``."""
    c = codes.to(torch.uint8)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed.view(torch.int8) if dtype == torch.int8 else packed


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values per byte (low nibble first; ``uint8``, ``int8`` or ``float4_e2m1fn_x2``) -> fp32, the last dim
    twice as long."""
    return decode_bytes(packed.contiguous(), "e2m1x2")


def _group_scales(weight: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` (K a multiple of 32) -> (groups ``[..., K/32, 32]`` fp32, scale ``[..., K/32]`` fp32)."""
    *lead, k = weight.shape
    if k % FP4_GROUP:
        raise MoetoolError(f"FP4 groups are {FP4_GROUP} input values: an input dim of {k} is not a multiple")
    g = weight.float().reshape(*lead, k // FP4_GROUP, FP4_GROUP)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP4_MAX, torch.ones_like(amax))
    return g, (_pow2_ceil(scale) if pow2 else scale)


def quantize_fp4(weight: torch.Tensor, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` -> (``int8`` packed ``[..., N, K/2]``, scales ``[..., N, K/32]`` fp32 or ``float8_e8m0fnu``):
    the FP4 expert storage of transformers' ``FP8Experts(expert_dtype="fp4")``."""
    if scale_fmt not in SCALE_FORMS:
        raise MoetoolError(f"unknown FP4 scale form '{scale_fmt}' (choose from {', '.join(SCALE_FORMS)})")
    g, scale = _group_scales(weight, scale_fmt == "ue8m0")
    codes = e2m1_codes(g / scale[..., None]).reshape(weight.shape)
    return pack_fp4(codes, torch.int8), (scale.to(_e8m0_dtype()) if scale_fmt == "ue8m0" else scale)


# -------------------------------------------------------------------------------------------------------- MXFP4


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` -> (blocks ``uint8 [..., N, K/32, 16]``, E8M0 exponent bytes ``uint8 [..., N, K/32]``): the
    gpt-oss checkpoint form (``*_blocks``, ``*_scales``), 32 consecutive input values per scale."""
    g, scale = _group_scales(weight, True)
    codes = e2m1_codes(g / scale[..., None])
    exponent = torch.log2(scale).round().to(torch.int32) + 127
    return pack_fp4(codes), exponent.clamp(0, 254).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks ``uint8 [..., N, G, 16]`` and exponent bytes ``uint8 [..., N, G]`` -> ``[..., N, 32 G]`` in ``dtype``
    (the matrix the blocks were cut from; gpt-oss' model layout is its transpose)."""
    values = unpack_fp4(blocks)  # [..., N, G, 32]
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)


# --------------------------------------------------------------------------------------------------- fake quant


def fake_quantize(weight: torch.Tensor, fmt: str, *, in_dim: int = -1, scale_fmt: str | None = None) -> torch.Tensor:
    """Quantize ``weight`` with format ``fmt``'s rules and read it back: the weight a checkpoint in ``fmt`` would hold,
    in ``weight``'s dtype and shape. ``bf16`` / ``fp16`` / ``fp32`` are plain casts (and back). The last two dims
    are one matrix (leading dims, e.g. experts, are independent); ``in_dim`` (-1 or -2) is its input dim, along which
    FP4/MXFP4 groups run (gpt-oss stores ``[in, out]``: pass ``in_dim=-2``). ``scale_fmt``: ``float`` (default for
    fp8 and fp4) or ``ue8m0`` (power-of-two scales; always for mxfp4)."""
    if fmt in PLAIN:
        return weight.to(PLAIN[fmt]).to(weight.dtype)
    if fmt not in DESCRIPTIONS:
        raise MoetoolError(f"unknown weight format '{fmt}' (choose from {', '.join(FORMATS)})")
    if weight.dim() < 2:
        raise MoetoolError(f"{fmt} quantizes matrices: got a tensor of shape {tuple(weight.shape)}")
    if in_dim not in (-1, -2):
        raise MoetoolError(f"in_dim is -1 or -2, not {in_dim}")
    w = weight if in_dim == -1 else weight.transpose(-1, -2)
    if fmt == "fp8":
        out = dequantize_fp8(*quantize_fp8(w, scale_fmt=scale_fmt or "float"), block=FP8_BLOCK)
    elif fmt == "fp4":
        out = dequantize_fp8(*quantize_fp4(w, scale_fmt=scale_fmt or "float"))
    else:
        if scale_fmt not in (None, "ue8m0"):
            raise MoetoolError("mxfp4 scales are always E8M0 powers of two (scale_fmt='ue8m0')")
        out = dequantize_mxfp4(*quantize_mxfp4(w))
    out = out if in_dim == -1 else out.transpose(-1, -2)
    return out.to(weight.dtype).contiguous()
