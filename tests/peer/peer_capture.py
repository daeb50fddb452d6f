"""The peer cross-checks' own view of a model: plain transformers, no moetool hook or adapter.

A forward hook on each sparse MoE block's router (``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``: its input is the
experts' input; it returns ``(router_logits, router_scores, router_indices)``) records what the model computed, and
every expert's output comes from the block's raw fused weights (``gate_up_proj [n, 2I, d]``, gate first, SiLU,
``down_proj [n, d, I]``) in float64 -- the expert ``experts[i](x)`` of the reference codes, written out. The rows
are moetool's packed rows of the shipped held-out text (``moetool.tokens``), so both sides see the same tokens.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F


def blocks(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's sparse MoE blocks by decoder layer index, found by class name."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("SparseMoeBlock"):
            out[int(re.search(r"layers\.(\d+)\.", name + ".").group(1))] = m
    return out


def capture(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[int, dict]:
    """Per MoE layer of one plain forward of the rows: ``h [R*S, d]`` (float64), ``logits [R*S, n]`` (as the model
    computed them), ``idx [R*S, K]`` (the model's top-K), ``valid [R*S]`` and the rows' shape ``(R, S)``."""
    seen, handles = {}, []
    for i, blk in blocks(model).items():
        handles.append(blk.gate.register_forward_hook(
            lambda m, args, out, i=i: seen.__setitem__(i, (args[0].detach().reshape(-1, args[0].shape[-1]).clone(),
                                                           out[0].detach().clone(), out[2].detach().clone()))))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    valid = attention_mask.reshape(-1).bool()
    return {i: {"h": h.double(), "logits": lg, "idx": idx, "valid": valid, "shape": tuple(input_ids.shape)}
            for i, (h, lg, idx) in seen.items()}


def expert_output(block: torch.nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """``experts[e](x)``: expert ``e``'s output (before any routing weight) on ``x [T, d]``, float64."""
    ex = block.experts
    gate, up = F.linear(x.double(), ex.gate_up_proj[e].detach().double()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, ex.down_proj[e].detach().double())


def tokens(name: str, max_tokens: int = 8192, seq_len: int = 256):
    """The embedded model ``name`` and ``max_tokens`` of the shipped held-out text in packed rows (moetool's loader
    and packer: the same rows moetool's experiments read)."""
    import moetool

    lm = moetool.load(name, device="cpu")  # the ported references are CPU code (numpy, scipy): the comparison
    # is of algorithms, bit-for-bit on one device, wherever the suite runs
    return lm, moetool.tokens(lm, None, seq_len=seq_len, max_tokens=max_tokens)


def readme() -> str:
    """The README's text with its line breaks and runs of spaces as single spaces: the "Checked against the authors'
    code" table quotes what these cross-checks compute, and each test checks its own figures there."""
    from pathlib import Path

    return " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
