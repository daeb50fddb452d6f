"""The engines' routing writers, ported for the tests (routing captured by moetool written as each engine writes
it; ``tests/test_traces.py`` reads it back). Each function keeps the engine's own steps: buffers of the engine's
shape and dtype, the -1/zero fill of what was not written, the engine's reshape, encoding and container. Sources
(quoted in each function):

* vLLM: vllm-project/vllm vllm/model_executor/layers/fused_moe/routed_experts_capturer.py
  @42fa4c096d406754b7e5c6d93835fe390487c8af (a zeroed ``[tokens, num_hidden_layers, num_experts_per_tok]`` host
  buffer, ``self._device_buffer[:token_num_per_dp, layer_id, :] = topk_ids[...]`` per MoE layer) and its later
  ``RoutedExpertsManager`` (``expert_id_dtype = np.uint8 if num_experts <= 256 else np.uint16``; ``get`` returns
  ``num_tokens`` rows, "typically request.num_tokens - 1; the last sampled token has not been forwarded yet");
  over the API base64 of a whole ``.npy`` file (``numpy2base64``, vllm/utils/serial_utils.py, as the issue
  describes it: its source was not in the index read).
* SGLang routed experts: sgl-project/sglang python/sglang/srt/layers/moe/routed_experts_capturer.py
  @d4d0fc58371761f9f0da007a4ef4f0ad2bd19658 (int32 host cache ``(num_tokens, num_hidden_layers,
  num_experts_per_tok)``; ``get_routed_experts``: ``req_to_token[req_pool_idx][: seqlen - 1]``) and the detokenizer's
  ``pybase64.b64encode(tensor.detach().cpu().contiguous().numpy().tobytes()).decode("utf-8")``.
* SGLang recorder: sgl-project/sglang python/sglang/srt/eplb/expert_distribution.py
  @02295fe5ac5ccff3e8829800d50450351c56fb53 (``_DetailSinglePassGatherer``, ``_convert_per_token_to_global_physical
  _count``, ``_DetailAccumulator.dump``, ``_StatAccumulator.dump``, ``_convert_global_physical_count_to_logical
  _count``).
* Megatron-Core: NVIDIA/Megatron-LM megatron/core/transformer/moe/router_trace.py
  @d98e8a64ddf34856e74b24714e3bedb2f5a39553 (``_record`` on a boolean routing map, ``_make_index_record``,
  ``_flush_records_to_disk``).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch


# ----- vLLM ------------------------------------------------------------------------------------------------------
def vllm_routed_experts(experts: dict[int, np.ndarray], num_layers: int, n_experts: int) -> np.ndarray:
    """One request's ``routed_experts``: ``experts[layer] [T, K]`` of its T forwarded tokens (the request has T + 1
    tokens; the last sampled one is never forwarded)."""
    T, K = next(iter(experts.values())).shape
    expert_id_dtype = np.uint8 if n_experts <= 256 else np.uint16
    routed_experts_by_slot = np.zeros((T, num_layers, K), dtype=expert_id_dtype)  # zeroed: dense layers stay 0
    for layer_id, topk_ids in experts.items():
        routed_experts_by_slot[:T, layer_id, :] = topk_ids
    slot_mapping = np.arange(T)
    return routed_experts_by_slot[slot_mapping]


def numpy2base64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def vllm_response(routed: np.ndarray, prompt_ids: list[int], output_ids: list[int]) -> dict:
    """An OpenAI completions response of vLLM with routed experts on its one choice (and the token ids)."""
    return {"id": "cmpl-0", "object": "text_completion", "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "text": "", "token_ids": output_ids, "routed_experts": numpy2base64(routed)}]}


# ----- SGLang routed experts ---------------------------------------------------------------------------------------
def sglang_routed_response(experts: dict[int, np.ndarray], num_layers: int, seqlen: int) -> dict:
    """One ``/generate`` response: the int32 host cache rows of the request's first ``seqlen - 1`` tokens."""
    T, K = next(iter(experts.values())).shape
    host = torch.zeros((T, num_layers, K), dtype=torch.int32)
    for layer_id, topk_ids in experts.items():
        host[:, layer_id, :] = torch.from_numpy(np.array(topk_ids))
    routed = host[torch.arange(T)[: seqlen - 1]]
    b64 = base64.b64encode(routed.detach().cpu().contiguous().numpy().tobytes()).decode("utf-8")
    return {"text": "", "meta_info": {"id": "0", "finish_reason": {"type": "length"}, "routed_experts": b64}}


# ----- SGLang expert distribution recorder ---------------------------------------------------------------------------
def physical_map(num_layers: int, n: int, redundant: int, seed: int = 0) -> torch.Tensor:
    """A non-trivial ``physical_to_logical_map [L, n + redundant]``: every logical expert in a shuffled slot, and
    ``redundant`` extra replicas."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_layers):
        slots = torch.cat([torch.arange(n), torch.randint(0, n, (redundant,), generator=g)])
        rows.append(slots[torch.randperm(n + redundant, generator=g)])
    return torch.stack(rows).to(torch.int32)


def to_physical(logical: torch.Tensor, p2l: torch.Tensor, layer: int) -> torch.Tensor:
    """Each logical id's first physical slot in ``p2l[layer]`` (what a dispatch map would pick)."""
    first = torch.full((int(p2l.max()) + 1,), -1, dtype=torch.int64)
    for s in reversed(range(p2l.shape[1])):
        first[int(p2l[layer, s])] = s
    return first[logical.long()].to(torch.int32)


def _convert_per_token_to_global_physical_count(num_tokens, num_layers, num_physical_experts, _topk_ids_of_layer):
    topk_ids_layer_major = _topk_ids_of_layer[:, :num_tokens, :].reshape(num_layers, -1)
    mask = topk_ids_layer_major != -1
    index = topk_ids_layer_major.masked_fill(~mask, 0).long()
    src = mask.int()
    ans = torch.zeros((num_layers, num_physical_experts), dtype=_topk_ids_of_layer.dtype,
                      device=_topk_ids_of_layer.device)
    ans.scatter_add_(dim=1, index=index, src=src)
    return ans


def sglang_per_token_record(forward_pass_id: int, experts: dict[int, np.ndarray], input_ids: list[int],
                            positions: list[int], num_layers: int, p2l: torch.Tensor, rank: int = 0,
                            per_token: bool = True) -> dict:
    """One forward pass of ``_DetailSinglePassGatherer`` (``per_token``) -- or its ``global_physical_count`` alone
    (``per_pass``) -- as ``_DetailAccumulator.append`` records it. ``experts`` are logical ids, dispatched to
    physical slots through ``p2l``."""
    _TOP_K_NUM = 8
    num_tokens = len(input_ids)
    _topk_ids_of_layer = torch.zeros((num_layers, num_tokens, _TOP_K_NUM), dtype=torch.int32)
    _topk_ids_of_layer[...] = -1  # reset()
    for layer_idx, ids in experts.items():  # on_select_experts
        topk_ids = to_physical(torch.tensor(ids), p2l, layer_idx)
        _topk_ids_of_layer[layer_idx, : topk_ids.shape[0], : topk_ids.shape[1]] = topk_ids
    metadata = dict(input_ids=list(input_ids), positions=list(positions), extend_seq_lens=[num_tokens],
                    forward_mode=1)
    global_physical_count = _convert_per_token_to_global_physical_count(num_tokens, num_layers, p2l.shape[1],
                                                                        _topk_ids_of_layer)
    data = (dict(**metadata, topk_ids_of_layer=_topk_ids_of_layer[:, :num_tokens, :].clone().cpu(),
                 misc_objects=[], global_physical_count=global_physical_count) if per_token
            else dict(global_physical_count=global_physical_count))
    return dict(forward_pass_id=forward_pass_id, rank=rank, gatherer_key="primary",
                **{k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in data.items()})


def sglang_detail_dump(path: Path, records: list[dict], p2l: torch.Tensor) -> None:
    torch.save(dict(records=records, last_physical_to_logical_map=p2l), str(path))


def sglang_stat_dump(path: Path, records: list[dict], p2l: torch.Tensor, num_logical_experts: int) -> None:
    """``_StatAccumulator``: every pass's ``global_physical_count`` buffered (infinite buffer), converted to logical
    counts with the map, dumped as rank 0 dumps it."""
    buffered = torch.stack([r["global_physical_count"] for r in records])  # get_all()
    dim_extra, num_layers, _ = buffered.shape
    logical_count = torch.zeros((dim_extra, num_layers, num_logical_experts), dtype=buffered.dtype)
    logical_count.scatter_add_(dim=2, index=p2l.unsqueeze(0).expand(dim_extra, -1, -1).to(torch.int64),
                               src=buffered)
    torch.save(dict(rank=0, logical_count=logical_count, average_utilization_rate_over_window=None), str(path))


# ----- Megatron-Core ---------------------------------------------------------------------------------------------
def megatron_records(step: int, experts: dict[int, np.ndarray], n_experts: int, rank: int = 0) -> list[dict]:
    """One step's records: the router's boolean routing map ``[num_tokens, num_experts]``, its indices read as
    ``_record`` reads them (``second.nonzero``: sorted by expert id), one record per layer."""
    out = []
    for layer, ids in experts.items():
        second = torch.zeros(ids.shape[0], n_experts, dtype=torch.bool)
        second.scatter_(1, torch.tensor(ids), True)
        topk = ids.shape[1]
        num_tokens = second.shape[0]
        _, expert_idx = second.nonzero(as_tuple=True)
        top_indices = expert_idx.view(num_tokens, topk)
        top_indices_cpu = top_indices.detach().to("cpu", torch.int32)
        out.append({"step": int(step), "stage": "pre_dispatch", "block": "decoder", "layer": int(layer),
                    "rank": rank, "num_tokens": int(top_indices_cpu.shape[0]), "topk": int(top_indices_cpu.shape[1]),
                    "top_indices": top_indices_cpu.tolist()})
    return out


def megatron_flush(path: Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
