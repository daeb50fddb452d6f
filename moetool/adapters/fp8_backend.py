"""How transformers' FP8 / FP4 layers compute on this machine: its ``finegrained-fp8`` kernel, or a torch path.

transformers 5.x runs ``FP8Linear`` and ``FP8Experts`` (``integrations/finegrained_fp8.py``: ``--quantize fp8``, and
every FP8 checkpoint as shipped -- DeepSeek-V3/V4, Kimi-K2, Qwen3 FP8) only through the Triton kernel
``kernels-community/finegrained-fp8``, which the ``kernels`` package downloads from the Hub at run time. Without
``kernels`` or without network no forward runs at all. Its three entry points (``FineGrainedFP8``: ``matmul`` for
one linear, ``batched_matmul`` with an expert id per row, ``grouped_matmul`` over rows sorted by expert) are
replaced here, when the kernel cannot be had, by a torch path: each weight (or each expert's weight, one at a
time) dequantized with :func:`moetool.formats.dequantize_fp8` -- the same codes times their block scales, FP4
unpacked -- and multiplied in the activations' dtype. The result is the dequantized model's, exactly (no
activation quantization, which the FP8 kernel does per 1x128 block); memory is one expert's weight at a time.

With ``kernels`` installed (``pip install "moetool[fp8]"``) transformers' own kernel is used. The choice is made
once per process (:func:`ensure`) and reported on the console and in the manifest (:func:`backend`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import formats

#: what :func:`ensure` chose: None (no FP8 layer seen), "kernels" or "torch"
_CHOSEN: str | None = None
TORCH_NOTE = ("FP8/FP4 layers run on moetool's torch path (transformers' finegrained-fp8 kernel needs the `kernels` "
              "package and network: pip install \"moetool[fp8]\"): weights dequantized one matrix or expert at a time, "
              "bf16 matmuls, the dequantized model's numbers")


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds transformers' FP8Linear / FP8Experts / FP8GroupedLinear modules."""
    return any(type(m).__name__ in ("FP8Linear", "FP8Experts", "FP8GroupedLinear") for m in model.modules())


def unquantized(weight: torch.Tensor) -> bool:
    """A weight of an FP8 module still in high precision (bf16/fp16/fp32): its scales are not read."""
    return weight.is_floating_point() and weight.element_size() > 1


def _mixed_experts(model: nn.Module) -> bool:
    """An ``FP8Experts`` module holding a high-precision weight: transformers' batched/grouped paths would hand it
    to the FP8 kernel with its uninitialised scales."""
    def mixed(m: nn.Module) -> bool:
        return any(unquantized(p) for n, p in m.named_parameters(recurse=False)
                   if not n.endswith(("scale_inv", "activation_scale")))

    return any(type(m).__name__ == "FP8Experts" and mixed(m) for m in model.modules())


def backend() -> str | None:
    """``"kernels"``, ``"torch"`` or None (no FP8 model loaded in this process)."""
    return _CHOSEN


def kernel_available() -> bool:
    """transformers' finegrained-fp8 kernel loads (the ``kernels`` package, and the kernel in its cache or on the Hub)."""
    from transformers.integrations import finegrained_fp8 as tf

    try:
        tf._load_finegrained_fp8_kernel()
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def ensure(model: nn.Module, *, prefer_kernel: bool = True) -> str | None:
    """Make ``model``'s FP8 layers runnable: transformers' kernel when it loads (and ``prefer_kernel``), else the
    torch path installed in its place. An ``FP8Experts`` with a high-precision weight (quantized while loading, a
    shape the block does not tile) takes the torch path too: transformers' batched/grouped experts would hand that
    weight to the FP8 kernel with uninitialised scales. Returns the backend, or None when the model has no FP8 layer."""
    global _CHOSEN
    if not has_fp8_layers(model):
        return None
    from transformers.integrations import finegrained_fp8 as tf

    if _CHOSEN == "torch" or _mixed_experts(model) or not (prefer_kernel and kernel_available()):
        tf._FINEGRAINED_FP8 = tf.FineGrainedFP8(matmul=matmul, batched_matmul=batched_matmul,
                                                grouped_matmul=grouped_matmul)
        if _CHOSEN != "torch":  # said once per process (and in every manifest: LoadedModel.quantization)
            print(f"note: {TORCH_NOTE}", file=sys.stderr)
        _CHOSEN = "torch"
    else:
        _CHOSEN = "kernels"
    return _CHOSEN


def _weight(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: Any, dtype: torch.dtype) -> torch.Tensor:
    """One ``[N, K]`` FP8 (or FP4-packed) weight dequantized to ``dtype``; ``block_size`` as the module holds it.
    A weight the quantizer left in high precision (quantized while loading, its shape not a multiple of the block:
    transformers passes it through and leaves its ``scale_inv`` uninitialised) is used as it is, as transformers'
    own ``FP8Linear`` / eager ``FP8Experts`` do."""
    if unquantized(weight):
        return weight.to(dtype)
    if scale_inv.dim() < 2:  # one scale for the tensor
        scale_inv = scale_inv.reshape(1, 1)
    block = None if block_size is None or weight.dtype == torch.int8 else tuple(block_size)
    if block is not None and tuple(block) == tuple(weight.shape[-2:]):  # "[N, K]": one scale per tensor
        block = None
    return formats.dequantize_fp8(weight, scale_inv, dtype, block=block)


def matmul(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: Any = None,
           output_dtype: torch.dtype | None = None, activation_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``FineGrainedFP8.matmul``: ``input [..., K] @ W.T`` with ``W [N, K]`` dequantized (no activation quantization:
    ``activation_scale`` is not applied)."""
    out = F.linear(input, _weight(weight, weight_scale_inv, block_size, input.dtype))
    return out if output_dtype is None else out.to(output_dtype)


def _by_expert(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: Any,
               counts: list[int]) -> torch.Tensor:
    """Rows of ``input`` grouped by expert, ``counts[e]`` for expert ``e`` in order, each group times its expert's
    weight dequantized (one at a time); rows past the groups stay zero."""
    out = input.new_zeros(input.shape[0], weight.shape[1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start:start + c] = F.linear(input[start:start + c],
                                            _weight(weight[e], weight_scale_inv[e], block_size, input.dtype))
            start += c
    return out


def batched_matmul(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: Any = None,
                   expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``FineGrainedFP8.batched_matmul``: row ``s`` of ``input [S, K]`` times expert ``expert_ids[s]``'s weight
    (``weight [E, N, K]``); an id >= E (expert parallel's sentinel) gives a zero row. The rows sorted by expert (a
    sort and one host read of the counts), then as :func:`grouped_matmul`."""
    n_experts = weight.shape[0]
    order = expert_ids.argsort(stable=True)  # sentinels (>= E) sort last
    counts = torch.bincount(expert_ids.clamp(max=n_experts), minlength=n_experts + 1)[:n_experts].tolist()
    rows = order[:sum(counts)]
    out = input.new_zeros(input.shape[0], weight.shape[1])
    out[rows] = _by_expert(input[rows], weight, weight_scale_inv, block_size, counts)
    return out


def grouped_matmul(input: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   offsets: torch.Tensor | None = None, tokens_per_expert: torch.Tensor | None = None,
                   block_size: Any = None) -> torch.Tensor:
    """``FineGrainedFP8.grouped_matmul``: ``input [S, K]`` sorted by expert, ``tokens_per_expert [E]`` rows each
    (rows past their sum -- expert parallel's sentinels -- stay zero); one expert dequantized at a time."""
    return _by_expert(input, weight, weight_scale_inv, block_size, [int(c) for c in tokens_per_expert.tolist()])
