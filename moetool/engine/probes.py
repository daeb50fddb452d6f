"""Batched probes: a node of all ``n`` experts of a layer at once.

One batched matmul over experts per chunk of tokens (never a Python loop over experts):
``gate = h @ W_g^T`` for every expert is ``[n, T, I]``. Token chunks bound peak memory.
Quantized experts (FP8 / FP4 / MXFP4 / per-expert linears, :mod:`moetool.adapters.quant`) are dequantized a slice
of experts at a time (at most ``budget`` weight elements), in the tokens' dtype; plain ones are read as stored.
Zero-computation experts (``layer.n_zero_compute``, the last indices) have no weights: an identity expert's
(LongCat-Flash) output is its input ``x = expert_input(h)`` and so is every "activation" node, so its norms (every
node) are ``||x||`` and its output rows ``x``; a skip expert's (Zaya) are all 0; an I-wide node tensor of them does
not exist (:func:`expert_nodes` refuses it).
Works on offloaded (accelerate) layers: inside the layer's forward the weights accelerate brought in are reused;
elsewhere they are brought to the device for the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Iterator

import torch

from .. import ops
from ..adapters import quant
from ..adapters.base import ExpertWeights, MoELayer
from ..errors import MoetoolError

NODES = ("gate", "up", "act", "glu", "output")

#: elements of one ``[n, T_chunk, I]`` intermediate (fp32: 4 bytes each) -> 256 MB by default
DEFAULT_BUDGET = 1 << 26


#: set on an experts module while accelerate's own pre-forward has its offloaded weights on the execution device
#: (the engine runs its hook there, :func:`moetool.engine.hooks.after_accelerate_loads`): probes reuse them
ON_DEVICE = "_moetool_weights_on_device"


@contextlib.contextmanager
def _weights_on_device(layer: MoELayer) -> Iterator[None]:
    """Materialise offloaded expert weights (accelerate ``device_map``) for the duration of a probe, unless the
    layer's own forward already brought them in (then they are reused, not moved a second time)."""
    if getattr(layer.experts, ON_DEVICE, False):
        yield
    elif hasattr(layer.experts, "_hf_hook"):
        from accelerate.utils import align_module_device

        with align_module_device(layer.experts):
            yield
    else:
        yield


def _parts(want: set[str]) -> set[str]:
    """The expert matrices the nodes ``want`` read (what :func:`_nodes_chunk` touches)."""
    return {"gate"} | ({"up"} if want & {"up", "glu", "output"} else set()) | ({"down"} if "output" in want else set())


def _matmul_ready(layer: MoELayer, want: set[str]) -> ExpertWeights:
    """The layer's expert weights; a needed view lacking a unit stride is copied once per probe call.

    A batched matmul needs a unit stride in one of the last two dims; gpt-oss's interleaved gate/up
    views (``gate_up_proj[..., ::2]``) have none, and torch then falls back to a kernel ~10x slower.
    """
    W = layer.expert_weights()
    need = _parts(want)
    fix = {k: t.contiguous() for k in need if 1 not in (t := getattr(W, k)).stride()[-2:]}
    return dataclasses.replace(W, **fix) if fix else W


def _bmm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in]`` against stacked ``w [n, out, in]`` -> ``[n, T, out]`` (one batched matmul)."""
    y = torch.matmul(x.unsqueeze(0), w.transpose(-1, -2))  # [n, T, out]
    return y if bias is None else y + bias.unsqueeze(1)


def _nodes_chunk(layer: MoELayer, W: ExpertWeights, h: torch.Tensor, want: set[str]) -> dict[str, torch.Tensor]:
    h = layer.expert_input(h).to(device=W.gate.device, dtype=W.gate.dtype)
    out: dict[str, torch.Tensor] = {}
    gate = _bmm(h, W.gate, W.gate_bias)  # [n, T, I]
    if "gate" in want:
        out["gate"] = gate
    if "act" in want:
        out["act"] = layer.act(gate)
    if want & {"up", "glu", "output"}:
        up = _bmm(h, W.up, W.up_bias)  # [n, T, I]
        if "up" in want:
            out["up"] = up
        if want & {"glu", "output"}:
            glu = layer.glu(gate, up)  # [n, T, I]
            if "glu" in want:
                out["glu"] = glu
            if "output" in want:
                out["output"] = torch.matmul(glu, W.down.transpose(-1, -2))  # [n, T, d]
                if W.down_bias is not None:
                    out["output"] = out["output"] + W.down_bias.unsqueeze(1)
                out["output"] = layer.expert_output(out["output"])  # in the model's width (muse_spark)
    return out


def _identity_input(layer: MoELayer, W: ExpertWeights, h: torch.Tensor) -> torch.Tensor:
    """What a zero-computation expert outputs (and its every node): the experts' input (identity experts) or zeros
    (skip experts, ``zero_compute_output == "zero"``), in the experts' dtype."""
    x = layer.expert_input(h).to(device=W.gate.device, dtype=W.gate.dtype)
    return torch.zeros_like(x) if layer.zero_compute_output == "zero" else x


def _chunk_size(W: ExpertWeights, budget: int) -> int:
    n, inter = W.gate.shape[0], max(W.gate.shape[1], W.down.shape[1])
    return max(1, budget // (3 * n * inter))


def _chunks(layer: MoELayer, h: torch.Tensor, want: set[str], budget: int) -> Iterator[tuple[slice, ExpertWeights]]:
    """Expert slices with their (dequantized) weights: the whole layer's views for plain experts."""
    plain = quant.expert_format(layer).kind == "plain"
    dtype = h.dtype if h.is_floating_point() else None
    yield from quant.expert_chunks(layer, budget, dtype, plain=_matmul_ready(layer, want) if plain else None,
                                   parts=_parts(want))


def _check(want: set[str]) -> None:
    unknown = want - set(NODES)
    if unknown:
        raise ValueError(f"unknown node(s) {sorted(unknown)}; choose from {', '.join(NODES)}")


def expert_nodes(layer: MoELayer, h: torch.Tensor, nodes: Iterable[str],
                 budget: int = DEFAULT_BUDGET) -> dict[str, torch.Tensor]:
    """Nodes of all experts for tokens ``h [T, d]``: ``{node: [n, T, I or d]}`` (on h's device)."""
    want = set(nodes)
    _check(want)
    z = layer.n_zero_compute
    if z and want - {"output"}:
        raise MoetoolError(f"layer {layer.index}: its {z} zero-computation experts have no {sorted(want - {'output'})}"
                           f" activations of the experts' width (theirs are the input itself): use node norms")
    per_slice = []
    with _weights_on_device(layer):
        for _, W in _chunks(layer, h, want, budget):
            step = _chunk_size(W, budget)
            parts = [_nodes_chunk(layer, W, h[s:s + step], want) for s in range(0, h.shape[0], step)]
            per_slice.append({k: torch.cat([p[k] for p in parts], dim=1).to(h.device) for k in want})
        if z:  # identity experts: E_e(h) = h (skip experts: 0)
            x = _identity_input(layer, W, h).to(h.device)
            per_slice.append({"output": x.unsqueeze(0).expand(z, *x.shape)})
    if len(per_slice) == 1:
        return per_slice[0]
    return {k: torch.cat([p[k] for p in per_slice], dim=0) for k in want}


def node_scores(layer: MoELayer, h: torch.Tensor, node: str, norm: str = "l2",
                budget: int = DEFAULT_BUDGET) -> torch.Tensor:
    """Norm of ``node`` for every expert: ``[T, n]`` fp32, streamed over token chunks."""
    if node not in NODES:
        raise ValueError(f"unknown node '{node}'; choose from {', '.join(NODES)}")
    cols = []
    with _weights_on_device(layer):
        for _, W in _chunks(layer, h, {node}, budget):
            step = _chunk_size(W, budget)
            out = [ops.vector_norm(_nodes_chunk(layer, W, h[s:s + step], {node})[node], norm).T
                   for s in range(0, h.shape[0], step)]  # each [T_c, n_slice]
            cols.append(torch.cat(out, dim=0).to(h.device))
        if layer.n_zero_compute:  # identity experts: every node is the input itself
            x = ops.vector_norm(_identity_input(layer, W, h), norm).to(h.device)  # [T]
            cols.append(x.unsqueeze(-1).expand(-1, layer.n_zero_compute))
    return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)


def expert_outputs(layer: MoELayer, h: torch.Tensor, budget: int = DEFAULT_BUDGET) -> torch.Tensor:
    """``E_e(h)`` for every expert: ``[n, T, d]`` (before any routing weight)."""
    return expert_nodes(layer, h, ("output",), budget)["output"]


def routed_absmax(layer: MoELayer, h: torch.Tensor, routed: torch.Tensor, node: str = "output",
                  budget: int = DEFAULT_BUDGET) -> torch.Tensor:
    """Per expert, the largest ``|node|`` over its dimensions and the tokens ``routed [T, n]`` (bool) sends to it:
    ``[n]`` fp32 on h's device, a running max over memory-bounded token chunks (0 for an expert with no token;
    a NaN output propagates)."""
    if node not in NODES:
        raise ValueError(f"unknown node '{node}'; choose from {', '.join(NODES)}")
    out = []
    with _weights_on_device(layer):
        for sl, W in _chunks(layer, h, {node}, budget):
            step = _chunk_size(W, budget)
            best = torch.zeros(W.gate.shape[0], dtype=torch.float32, device=h.device)
            for s in range(0, h.shape[0], step):
                y = _nodes_chunk(layer, W, h[s:s + step], {node})[node]  # [n_slice, T_c, d]
                m = y.abs().amax(dim=-1).float().to(h.device)  # [n_slice, T_c]
                m = torch.where(routed[s:s + step, sl].T, m, torch.zeros_like(m))
                best = torch.maximum(best, m.amax(dim=1))
            out.append(best)
        z = layer.n_zero_compute
        if z:  # identity experts: |node| is |h|, over the tokens routed to each
            x = _identity_input(layer, W, h).abs().amax(dim=-1).float().to(h.device)  # [T]
            m = torch.where(routed[:, -z:].T, x.unsqueeze(0).expand(z, -1), torch.zeros(z, x.shape[0], device=h.device))
            out.append(m.amax(dim=1))
    return out[0] if len(out) == 1 else torch.cat(out)
