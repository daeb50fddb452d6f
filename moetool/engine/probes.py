"""Batched probes: a node of all ``n`` experts of a layer at once.

All experts of a node in one large GEMM per chunk of tokens (never a Python loop over experts): on CUDA ``h [T, d]``
against the experts' stacked weights flattened to ``[n·I, d]`` (a view where they are stored that way: the fused
``gate_up_proj [n, 2I, d]`` gives gate and up of every expert in one ``[T, d] x [d, n·2I]`` product), else (and on
the CPU, whose BLAS prefers it) one batched matmul over the experts; the down projection is one batched matmul
``[n, T, I] x [n, I, d]``. Token chunks bound peak
memory: ``budget`` elements of fp32 intermediates, by default (``budget=None``) a share of the free memory of an
accelerator (CUDA: :func:`torch.cuda.mem_get_info` and the allocator's cached bytes) and :data:`DEFAULT_BUDGET` on
the CPU, so a GPU runs thousands of tokens per product rather than a few hundred.
Quantized experts (FP8 / FP4 / MXFP4 / per-expert linears, :mod:`moetool.adapters.quant`) are dequantized a slice
of experts at a time (at most ``budget`` weight elements, :data:`DEFAULT_BUDGET` by default; never a whole large
layer at once), in the tokens' dtype, once per probe call, then every token chunk reuses the slice; plain ones are
read as stored.
Zero-computation experts (``layer.n_zero_compute``, the last indices) have no weights: an identity expert's
(LongCat-Flash) output is its input ``x = expert_input(h)`` and so is every "activation" node, so its norms (every
node) are ``||x||`` and its output rows ``x``; a skip expert's (Zaya) are all 0; an I-wide node tensor of them does
not exist (:func:`expert_nodes` refuses it).
Works on offloaded (accelerate) layers: inside the layer's forward the weights accelerate brought in are reused;
elsewhere they are brought to the device for the call.

Under tensor / expert parallel (``--tp`` / ``--ep``: transformers' ``DistributedConfig`` made the expert weights
DTensors) every rank computes with the shard it holds and the results are gathered over the ranks holding the
layer, once per token chunk -- never the weights (one DeepSeek-V3 layer's experts are ~22 GB in bf16):

* expert parallel (``Shard(0)``: whole experts per rank): the rank's experts' nodes / norms, gathered along the
  expert dimension (the same per-expert arithmetic as one process);
* tensor parallel (each expert's intermediate features split, ``gate_up_proj`` packed per rank): the rank's
  features of gate / up / act / glu, gathered along the feature dimension before any norm; the down projection's
  partial outputs summed over the ranks (its bias added once, after the sum).

Every rank of the group runs the same probe on the same tokens (the hooks fire identically on each), so the
collectives line up.
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

#: elements of one ``[n, T_chunk, I]`` intermediate (fp32: 4 bytes each) -> 256 MB: the CPU's token chunks and the
#: dequantized weight slices of quantized experts
DEFAULT_BUDGET = 1 << 26

#: share of an accelerator's free memory one probe call's token-chunk intermediates may use (``budget=None``)
FREE_SHARE = 0.4


def auto_budget(device: torch.device | str) -> int:
    """The token-chunk budget (elements of fp32 intermediates) on ``device``: :data:`FREE_SHARE` of a CUDA device's
    free memory (the driver's free bytes plus what torch's allocator holds unused), at least :data:`DEFAULT_BUDGET`;
    :data:`DEFAULT_BUDGET` elsewhere (host memory is not measured)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(DEFAULT_BUDGET, int((free + cached) * FREE_SHARE) // 4)


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


@dataclasses.dataclass(frozen=True)
class Split:
    """How a layer's expert weights are split over ranks: ``kind`` ``experts`` (EP) or ``features`` (TP)."""

    kind: str
    group: object  # the torch.distributed process group of the ranks holding the layer
    size: int
    rank: int


def _dtensor_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed: nothing is split
        return {}
    return {n: p for n, p in module.named_parameters() if isinstance(p, DTensor)}


def split_of(layer: MoELayer) -> Split | None:
    """The layer's expert split under ``--tp`` / ``--ep`` (``None``: whole weights on this rank)."""
    params = _dtensor_params(layer.experts)
    if not params:
        return None
    from torch.distributed.tensor import Replicate, Shard

    kinds = set()
    group = size = rank = None
    for name, p in params.items():
        for dim, pl in enumerate(p.placements):
            if isinstance(pl, Replicate):
                continue
            shard_dim = getattr(pl, "dim", None)
            # Shard(0): whole experts per rank (EP); a split of any other dim (_StridedShard of the packed
            # gate/up, Shard(-1) of down) splits every expert's features (TP)
            kinds.add("experts" if type(pl) is Shard and shard_dim == 0 else "features")
            mesh = p.device_mesh
            group, size, rank = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    if not kinds:
        return None
    if len(kinds) > 1:
        raise MoetoolError(f"layer {layer.index}: its expert weights are split in a way moetool cannot read "
                           f"({', '.join(f'{n}: {p.placements}' for n, p in params.items())})")
    kind = kinds.pop()
    if kind == "features" and type(layer).expert_weights is not MoELayer.expert_weights:
        # verified: fused gate_up_proj [n, 2I, d] split as transformers' packed_colwise (each rank: its slice of
        # gate, then of up) and down_proj split on I; a family with its own expert layout (interleaved gate/up,
        # biases, per-expert linears) could read its local shard wrongly: refused rather than guessed
        raise MoetoolError(f"layer {layer.index}: reading the {type(layer).__name__} expert weights split by --tp "
                           f"alone is not supported; use --tp N --ep N (whole experts per rank)")
    return Split(kind, group, size, rank)


def _split(layer: MoELayer) -> Split | None:
    """:func:`split_of`, refusing quantized experts under ``--tp``/``--ep`` (their sliced dequantization and the
    split are not composed: one line rather than a guess)."""
    split = split_of(layer)
    if split is not None and quant.expert_format(layer).kind != "plain":
        raise MoetoolError(f"layer {layer.index}: quantized expert weights ({quant.expert_format(layer).kind}) split "
                           f"by --tp/--ep cannot be read by the probes yet; run without --tp/--ep")
    return split


@contextlib.contextmanager
def _local_weights(layer: MoELayer) -> Iterator[None]:
    """The experts module's DTensor parameters replaced by this rank's local shards for the block."""
    params = _dtensor_params(layer.experts)
    if not params:
        yield
        return
    modules = dict(layer.experts.named_modules())
    swapped = []
    for name, p in params.items():
        owner, _, attr = name.rpartition(".")
        mod = modules[owner]
        mod._parameters[attr] = p.to_local()
        swapped.append((mod, attr, p))
    try:
        yield
    finally:
        for mod, attr, p in swapped:
            mod._parameters[attr] = p


def _gather(t: torch.Tensor, dim: int, split: Split) -> torch.Tensor:
    """The ranks' ``t`` concatenated along ``dim`` in rank order (their experts, or their features)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(split.size)]
    dist.all_gather(parts, t.contiguous(), group=split.group)
    return torch.cat(parts, dim=dim)


def _sum(t: torch.Tensor, split: Split) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    dist.all_reduce(t, group=split.group)
    return t


def _split_nodes(layer: MoELayer, W: ExpertWeights, h: torch.Tensor, want: set[str],
                 split: Split | None) -> dict[str, torch.Tensor]:
    """:func:`_nodes_chunk` for every expert and feature, whatever this rank holds (see the module docstring)."""
    if split is None:
        return _nodes_chunk(layer, W, h, want)
    if split.kind == "experts":
        return {k: _gather(v, 0, split) for k, v in _nodes_chunk(layer, W, h, want).items()}
    bias = W.down_bias
    out = _nodes_chunk(layer, dataclasses.replace(W, down_bias=None), h, want)
    for k in out:
        if k == "output":
            out[k] = _sum(out[k], split) + (0 if bias is None else bias.unsqueeze(1))
        else:
            out[k] = _gather(out[k], -1, split)
    return out


def _matmul_ready(layer: MoELayer, want: set[str]) -> ExpertWeights:
    """The layer's expert weights; a needed view lacking a unit stride is copied once per probe call.

    A batched matmul needs a unit stride in one of the last two dims; gpt-oss's interleaved gate/up
    views (``gate_up_proj[..., ::2]``) have none, and torch then falls back to a kernel ~10x slower.
    """
    W = layer.expert_weights()
    need = _parts(want)
    fix = {k: t.contiguous() for k in need if 1 not in (t := getattr(W, k)).stride()[-2:]}
    return dataclasses.replace(W, **fix) if fix else W


def _flat(w: torch.Tensor) -> torch.Tensor | None:
    """``w [n, out, in]`` as one ``[n·out, in]`` matrix without a copy (None where its strides do not allow it)."""
    n, out, k = w.shape
    if w.stride(2) == 1 and (w.stride(1) == k or out == 1) and (w.stride(0) == out * k or n == 1):
        return w.as_strided((n * out, k), (k, 1))
    return None


def _one_gemm(device: torch.device) -> bool:
    """Whether all experts' rows go through one ``[T, in] x [in, n·out]`` GEMM on ``device`` (CUDA: one large
    product keeps the tensor cores busy); elsewhere one batched matmul over the experts, which the CPU's BLAS
    runs ~10% faster than the one wide product (measured at Mixtral / Qwen3 / OLMoE widths / 4)."""
    return device.type == "cuda"


def _copies_whole(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's CPU batched matmul would copy all of ``w [n, out, in]``: a half-precision stack whose experts
    are not back to back (the gate or up half of a fused ``gate_up_proj``). Measured at Mixtral's width (8 x 14336 x
    4096 bf16, 64 tokens): 5.5 s and a 924 MiB copy, against 0.26 s for one product per expert; fp32 does not copy."""
    n, out, k = w.shape
    return (x.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16) and n > 1
            and w.stride(0) != out * k)


def _wide(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in]`` against stacked ``w [n, out, in]`` -> ``[T, n, out]``: one GEMM ``[T, in] x [in, n·out]`` when
    the experts' rows flatten to one matrix (a view) on a device that prefers it (:func:`_one_gemm`), else one
    batched matmul (a view of its ``[n, T, out]``; one product per expert where the batched one would copy the
    weights, :func:`_copies_whole`)."""
    n, out, _ = w.shape
    flat = _flat(w) if _one_gemm(x.device) else None
    if flat is not None:
        y = (x @ flat.T).view(x.shape[0], n, out)
    elif _copies_whole(x, w):
        y = torch.stack([x @ w[e].transpose(0, 1) for e in range(n)]).transpose(0, 1)  # [T, n, out] (a view)
    else:
        y = torch.matmul(x.unsqueeze(0), w.transpose(-1, -2)).transpose(0, 1)  # [T, n, out] (a view)
    return y if bias is None else y + bias


def _fused_gate_up(W: ExpertWeights) -> torch.Tensor | None:
    """``[n, 2I, d]``: gate and up as the two halves of one stored matrix (transformers' ``gate_up_proj``), a view;
    None when they are stored apart (or interleaved: gpt-oss)."""
    g, u = W.gate, W.up
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device or g.stride() != u.stride():
        return None
    n, inter, d = g.shape
    if g.stride() != (2 * inter * d, d, 1) or u.data_ptr() != g.data_ptr() + inter * d * g.element_size():
        return None
    return g.as_strided((n, 2 * inter, d), (2 * inter * d, d, 1))


def _gate_up(x: torch.Tensor, W: ExpertWeights, need_up: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every expert's gate (and up) pre-activations for ``x [T, d]``: ``[T, n, I]`` each; gate and up of a fused
    matrix in one GEMM."""
    fused = _fused_gate_up(W) if need_up else None
    if fused is not None:
        inter = W.gate.shape[1]
        y = _wide(x, fused, None)  # [T, n, 2I]
        gate, up = y[..., :inter], y[..., inter:]
        if W.gate_bias is not None:
            gate = gate + W.gate_bias
        if W.up_bias is not None:
            up = up + W.up_bias
        return gate, up
    return _wide(x, W.gate, W.gate_bias), (_wide(x, W.up, W.up_bias) if need_up else None)


def _nodes_chunk(layer: MoELayer, W: ExpertWeights, h: torch.Tensor, want: set[str]) -> dict[str, torch.Tensor]:
    """``{node: [n, T, I or d]}`` for the tokens ``h`` (views of ``[T, n, I]`` products for the I-wide nodes)."""
    h = layer.expert_input(h).to(device=W.gate.device, dtype=W.gate.dtype)
    out: dict[str, torch.Tensor] = {}
    gate, up = _gate_up(h, W, bool(want & {"up", "glu", "output"}))  # [T, n, I]
    if "gate" in want:
        out["gate"] = gate.transpose(0, 1)
    if "act" in want:
        out["act"] = layer.act(gate).transpose(0, 1)
    if up is not None:
        if "up" in want:
            out["up"] = up.transpose(0, 1)
        if want & {"glu", "output"}:
            glu = layer.glu(gate, up).transpose(0, 1)  # [n, T, I]
            del gate, up
            if "glu" in want:
                out["glu"] = glu
            if "output" in want:
                y = torch.matmul(glu, W.down.transpose(-1, -2))  # [n, T, d]: one batched matmul
                if W.down_bias is not None:
                    y = y + W.down_bias.unsqueeze(1)
                out["output"] = layer.expert_output(y)  # in the model's width (muse_spark)
    return out


def _identity_input(layer: MoELayer, W: ExpertWeights, h: torch.Tensor) -> torch.Tensor:
    """What a zero-computation expert outputs (and its every node): the experts' input (identity experts) or zeros
    (skip experts, ``zero_compute_output == "zero"``), in the experts' dtype."""
    x = layer.expert_input(h).to(device=W.gate.device, dtype=W.gate.dtype)
    return torch.zeros_like(x) if layer.zero_compute_output == "zero" else x


def _chunk_size(W: ExpertWeights, budget: int | None) -> int:
    """Tokens per product: ``budget`` fp32 elements over three ``[n, T, I]`` intermediates (``None``: the free
    memory of the weights' device, :func:`auto_budget`)."""
    n, inter = W.gate.shape[0], max(W.gate.shape[1], W.down.shape[1])
    if budget is None:
        budget = auto_budget(W.gate.device)
    return max(1, budget // (3 * n * inter))


def _chunks(layer: MoELayer, h: torch.Tensor, want: set[str],
            budget: int | None) -> Iterator[tuple[slice, ExpertWeights]]:
    """Expert slices with their (dequantized) weights: the whole layer's views for plain experts; quantized ones
    in slices of at most ``budget`` (default :data:`DEFAULT_BUDGET`) weight elements."""
    plain = quant.expert_format(layer).kind == "plain"
    dtype = h.dtype if h.is_floating_point() else None
    yield from quant.expert_chunks(layer, DEFAULT_BUDGET if budget is None else budget, dtype,
                                   plain=_matmul_ready(layer, want) if plain else None, parts=_parts(want))


def _check(want: set[str]) -> None:
    unknown = want - set(NODES)
    if unknown:
        raise ValueError(f"unknown node(s) {sorted(unknown)}; choose from {', '.join(NODES)}")


def expert_nodes(layer: MoELayer, h: torch.Tensor, nodes: Iterable[str],
                 budget: int | None = None) -> dict[str, torch.Tensor]:
    """Nodes of all experts for tokens ``h [T, d]``: ``{node: [n, T, I or d]}`` (on h's device)."""
    want = set(nodes)
    _check(want)
    z = layer.n_zero_compute
    if z and want - {"output"}:
        raise MoetoolError(f"layer {layer.index}: its {z} zero-computation experts have no {sorted(want - {'output'})}"
                           f" activations of the experts' width (theirs are the input itself): use node norms")
    split = _split(layer)
    per_slice = []
    with _weights_on_device(layer), _local_weights(layer):
        for _, W in _chunks(layer, h, want, budget):
            step = _chunk_size(W, budget)
            parts = [_split_nodes(layer, W, h[s:s + step], want, split) for s in range(0, h.shape[0], step)]
            per_slice.append({k: (parts[0][k].contiguous() if len(parts) == 1 else
                                  torch.cat([p[k] for p in parts], dim=1)).to(h.device) for k in want})
        if z:  # identity experts: E_e(h) = h (skip experts: 0)
            x = _identity_input(layer, W, h).to(h.device)
            per_slice.append({"output": x.unsqueeze(0).expand(z, *x.shape)})
    if len(per_slice) == 1:
        return per_slice[0]
    return {k: torch.cat([p[k] for p in per_slice], dim=0) for k in want}


def node_scores(layer: MoELayer, h: torch.Tensor, node: str, norm: str = "l2",
                budget: int | None = None) -> torch.Tensor:
    """Norm of ``node`` for every expert: ``[T, n]`` fp32, streamed over token chunks."""
    if node not in NODES:
        raise ValueError(f"unknown node '{node}'; choose from {', '.join(NODES)}")
    split = _split(layer)
    cols = []
    with _weights_on_device(layer), _local_weights(layer):
        for _, W in _chunks(layer, h, {node}, budget):
            step = _chunk_size(W, budget)
            if split is not None and split.kind == "experts":  # whole experts here: norms of this rank's, gathered
                out = [_gather(ops.vector_norm(_nodes_chunk(layer, W, h[s:s + step], {node})[node], norm).T, 1, split)
                       for s in range(0, h.shape[0], step)]  # each [T_c, n]
            else:
                out = [ops.vector_norm(_split_nodes(layer, W, h[s:s + step], {node}, split)[node], norm).T
                       for s in range(0, h.shape[0], step)]  # each [T_c, n_slice]
            cols.append(torch.cat(out, dim=0).to(h.device))
        if layer.n_zero_compute:  # identity experts: every node is the input itself
            x = ops.vector_norm(_identity_input(layer, W, h), norm).to(h.device)  # [T]
            cols.append(x.unsqueeze(-1).expand(-1, layer.n_zero_compute))
    return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)


def expert_outputs(layer: MoELayer, h: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """``E_e(h)`` for every expert: ``[n, T, d]`` (before any routing weight)."""
    return expert_nodes(layer, h, ("output",), budget)["output"]


def routed_absmax(layer: MoELayer, h: torch.Tensor, routed: torch.Tensor, node: str = "output",
                  budget: int | None = None) -> torch.Tensor:
    """Per expert, the largest ``|node|`` over its dimensions and the tokens ``routed [T, n]`` (bool) sends to it:
    ``[n]`` fp32 on h's device, a running max over memory-bounded token chunks (0 for an expert with no token;
    a NaN output propagates)."""
    if node not in NODES:
        raise ValueError(f"unknown node '{node}'; choose from {', '.join(NODES)}")
    split = _split(layer)
    z = layer.n_zero_compute
    out = []
    with _weights_on_device(layer), _local_weights(layer):
        for sl, W in _chunks(layer, h, {node}, budget):
            step = _chunk_size(W, budget)
            best = None
            for s in range(0, h.shape[0], step):
                y = _split_nodes(layer, W, h[s:s + step], {node}, split)[node]  # [n_slice, T_c, d]
                m = y.abs().amax(dim=-1).float().to(h.device)  # [n_slice, T_c]
                cols = routed[s:s + step, :routed.shape[1] - z][:, sl]  # the computed experts of the slice
                m = torch.where(cols.T, m, torch.zeros_like(m))
                best = m.amax(dim=1) if best is None else torch.maximum(best, m.amax(dim=1))
            out.append(best if best is not None else torch.zeros(0, device=h.device))
        if z:  # identity experts: |node| is |h|, over the tokens routed to each
            x = _identity_input(layer, W, h).abs().amax(dim=-1).float().to(h.device)  # [T]
            m = torch.where(routed[:, -z:].T, x.unsqueeze(0).expand(z, -1), torch.zeros(z, x.shape[0], device=h.device))
            out.append(m.amax(dim=1))
    return out[0] if len(out) == 1 else torch.cat(out)
