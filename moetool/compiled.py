"""Compiled kernels: the one home of moetool's ``torch.compile`` use.

Where eager torch runs a small computation as several full passes over memory (a dtype cast, then a product, then
another cast), one compiled kernel reads its inputs once and writes its result once. Used on :data:`DEVICES` (CUDA,
where torch.compile makes Triton kernels) for FP8/FP4 dequantization (:func:`moetool.formats.dequantize_fp8`); the
CPU keeps the eager ops. A kernel is compiled once per process and shape (seconds; torch keeps its artifacts on
disk for the next process), so it is worth it only for work repeated many times per run, as dequantizing every
layer's experts for every batch is. A kernel that cannot be compiled or run falls back to the eager ops, with one
warning; ``MOETOOL_NO_COMPILE=1`` keeps the eager ops everywhere. Tests trace the kernels on the CPU by setting :data:`DEVICES` to ``("cpu",)`` and :data:`BACKEND` to
``"eager"``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

#: device types the compiled kernels run on
DEVICES = ("cuda",)
#: torch.compile's backend
BACKEND = "inductor"
_KERNELS: dict[str, Any] = {}


def wanted(t: torch.Tensor) -> bool:
    """Whether a computation on ``t`` should use a compiled kernel: its device, a plain tensor (not a DTensor shard or
    another subclass), not already inside a compile."""
    return t.device.type in DEVICES and type(t) in (torch.Tensor, torch.nn.Parameter) \
        and not torch.compiler.is_compiling() and os.environ.get("MOETOOL_NO_COMPILE", "") in ("", "0")


def kernel(name: str, fn: Callable[..., Any], **options: Any) -> Callable[..., Any] | None:
    """``fn`` compiled (once per process, under ``name``; ``options`` go to torch.compile), or None where compiling
    is off or failed."""
    if name not in _KERNELS:
        compiled = None
        if os.environ.get("MOETOOL_NO_COMPILE", "") in ("", "0"):
            try:
                compiled = torch.compile(fn, backend=BACKEND, **options)
            except Exception as e:  # noqa: BLE001 - no compiler here: the eager ops give the same numbers
                _warn(name, e)
        _KERNELS[name] = compiled
    return _KERNELS[name]


def run(name: str, fn: Callable[..., Any], *args: Any, **options: Any) -> Any | None:
    """``fn(*args)`` through its compiled kernel; None (the caller runs its eager ops) where there is none or it
    failed here (then never again in this process)."""
    k = kernel(name, fn, **options)
    if k is None:
        return None
    try:
        return k(*args)
    except torch.OutOfMemoryError:  # the caller's back-off (fewer rows) handles it, as with the eager ops
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that cannot be built or run here: the eager ops from now on
        _KERNELS[name] = None
        _warn(name, e)
        return None


def _warn(name: str, e: BaseException) -> None:
    warnings.warn(f"moetool: compiled {name} kernel unavailable ({type(e).__name__}: {str(e)[:200]}); "
                  "running eager torch ops instead (same computation, slower)", RuntimeWarning, stacklevel=4)
