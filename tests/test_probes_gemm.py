"""The probes' one-GEMM layout and token chunks from free memory (issue #36): the same numbers as a per-expert
loop over the raw parameters, whatever the chunking, on a fused (gate_up_proj) and an interleaved layout."""

from __future__ import annotations

import collections
import copy
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import build_tiny_model, reference_expert
from moetool.adapters import find_moe_layers
from moetool.engine import probes


def _h(layer, T: int = 37) -> torch.Tensor:
    d = layer.expert_weights().gate.shape[-1]
    return torch.randn(T, d, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("one_gemm", [True, False])  # the CUDA layout (one wide GEMM) and the CPU's (batched)
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("budget", [None, 1, 10_000])
def test_nodes_match_per_expert_reference(model_type, budget, one_gemm, monkeypatch):
    monkeypatch.setattr(probes, "_one_gemm", lambda device: one_gemm)
    L = find_moe_layers(build_tiny_model(model_type))[0]
    h = _h(L)
    got = probes.expert_nodes(L, h, probes.NODES, budget=budget)
    for e in range(L.n_experts):
        ref = reference_expert(model_type, L, e, h)
        for node in probes.NODES:
            assert got[node].shape[0] == L.n_experts and got[node].is_contiguous()
            torch.testing.assert_close(got[node][e], ref[node], rtol=1e-5, atol=1e-6)
    scores = probes.node_scores(L, h, "gate", "l2", budget=budget)  # [T, n]
    ref = torch.stack([reference_expert(model_type, L, e, h)["gate"].norm(dim=-1) for e in range(L.n_experts)], 1)
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-6)


def test_fused_gate_up_is_one_view_of_the_stored_matrix():
    L = find_moe_layers(build_tiny_model("mixtral"))[0]
    fused = probes._fused_gate_up(L.expert_weights())
    assert fused is not None and fused.data_ptr() == L.experts.gate_up_proj.data_ptr()
    torch.testing.assert_close(fused, L.experts.gate_up_proj, rtol=0, atol=0)
    # gpt-oss interleaves gate and up (copied to unit stride per call): not one fused matrix
    G = find_moe_layers(build_tiny_model("gpt_oss"))[0]
    assert probes._fused_gate_up(probes._matmul_ready(G, {"output"})) is None



def test_gate_and_up_with_the_fused_strides_but_not_adjacent_are_not_read_as_one_matrix():
    """Gate and up each with the strides of one half of a ``[n, 2I, d]`` matrix, but up not right after gate (an
    up-first matrix; halves of two different matrices): they are not one fused view, and every expert's gate and up
    pre-activations are ``x @ W.T`` by hand. Pass 17: without the data-pointer check the up-first pair failed in
    as_strided and the two-matrix pair silently read the first matrix's other half as up; test_probes_gemm passed.
    A fused pair with biases adds each half's own (dropping the gate's passed too: no tiny family has both)."""
    from moetool.adapters.base import ExpertWeights

    n, inter, d = 3, 4, 5
    g0 = torch.Generator().manual_seed(7)
    one, other = torch.randn(n, 2 * inter, d, generator=g0), torch.randn(n, 2 * inter, d, generator=g0)
    x = torch.randn(6, d, generator=g0)
    down = torch.randn(n, d, inter, generator=g0)
    for gate, up in ((one[:, inter:], one[:, :inter]), (one[:, :inter], other[:, :inter])):
        W = ExpertWeights(gate=gate, up=up, down=down)
        assert gate.stride() == up.stride() == (2 * inter * d, d, 1) and probes._fused_gate_up(W) is None
        got_gate, got_up = probes._gate_up(x, W, need_up=True)
        for e in range(n):
            torch.testing.assert_close(got_gate[:, e], x @ gate[e].T, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got_up[:, e], x @ up[e].T, rtol=1e-6, atol=1e-6)
    gb, ub = torch.randn(n, inter, generator=g0), torch.randn(n, inter, generator=g0)
    W = ExpertWeights(gate=one[:, :inter], up=one[:, inter:], down=down, gate_bias=gb, up_bias=ub)
    assert probes._fused_gate_up(W).data_ptr() == one.data_ptr()  # gate then up: one view, no copy
    got_gate, got_up = probes._gate_up(x, W, need_up=True)  # the fused product, then each half's bias
    for e in range(n):
        torch.testing.assert_close(got_gate[:, e], x @ one[e, :inter].T + gb[e], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_up[:, e], x @ one[e, inter:].T + ub[e], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_zero_computation_experts_nodes_are_the_input_or_zero_by_hand(model_type):
    """LongCat-Flash's identity experts output their input, Zaya's skip expert zeros (the last n_zero_compute
    indices): their output node is that, their every node's norm (l1 and l2) is its norm, and asking for a node of
    the experts' width (gate) is one line. Pass 17: a skip expert outputting the input, the l2 norm for an l1 score,
    and a layer with zero-computation experts giving a gate node all passed the probe tests."""
    from moetool.adapters import tiny
    from moetool.errors import MoetoolError

    L = find_moe_layers(tiny.build_tiny(model_type, seed=0))[0]
    n, z = L.n_experts, L.n_zero_compute
    assert z >= 1
    h = _h(L, T=9)
    x = L.expert_input(h)
    want = torch.zeros_like(x) if model_type == "zaya" else x
    if model_type == "zaya":
        assert L.zero_compute_output == "zero" and x.abs().sum() > 0
    out = probes.expert_nodes(L, h, ["output"])["output"]
    assert out.shape[0] == n
    for e in range(n - z, n):
        torch.testing.assert_close(out[e], want, rtol=0, atol=0)
    for norm, order in (("l2", 2), ("l1", 1)):
        got = probes.node_scores(L, h, "gate", norm)
        assert got.shape == (9, n)
        for e in range(n - z, n):
            torch.testing.assert_close(got[:, e], want.double().norm(p=order, dim=-1).float(), rtol=1e-6, atol=1e-6)
    with pytest.raises(MoetoolError, match=rf"^layer {L.index}: its {z} zero-computation experts have no \['gate'\] "
                                           r"activations of the experts' width"):
        probes.expert_nodes(L, h, ["gate", "output"])


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "longcat_flash"])
def test_routed_absmax_is_the_largest_output_over_the_tokens_routed_to_each_expert_by_hand(model_type):
    """``routed_absmax``: per expert, max |output| over its dimensions and the tokens ``routed`` sends to it (0 for an
    expert with none), against the per-expert reference (identity experts: |input|), chunked to 2 tokens. Pass 17:
    ignoring ``routed`` for the computed experts (the max over every token) passed every probe test, which compared
    routed_absmax only with itself."""
    from moetool.adapters import tiny

    L = find_moe_layers(tiny.build_tiny(model_type, seed=0) if model_type == "longcat_flash"
                        else build_tiny_model(model_type))[0]
    n, z = L.n_experts, L.n_zero_compute
    h = _h(L, T=11)
    routed = torch.rand(11, n, generator=torch.Generator().manual_seed(4)) < 0.3
    routed[:, 0] = False  # an expert no token reaches: 0
    routed[:, 1] = False
    routed[5, 1] = True  # one token
    with torch.no_grad():
        got = probes.routed_absmax(L, h, routed, budget=3 * 2 * n * max(L.expert_weights().gate.shape[1], 1))
    for e in range(n):
        with torch.no_grad():
            y = h if e >= n - z else reference_expert(model_type, L, e, h)["output"]
        m = y.abs().amax(dim=-1)[routed[:, e]]
        want = float(m.max()) if m.numel() else 0.0
        assert float(got[e]) == pytest.approx(want, rel=1e-6, abs=1e-7), e
    assert float(got[0]) == 0.0

def test_wide_gemm_equals_batched_matmul_on_a_strided_view(monkeypatch):
    monkeypatch.setattr(probes, "_one_gemm", lambda device: True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=gen)
    big = torch.randn(4, 10, 16, generator=gen)
    w = big[:, :6]  # [4, 6, 16] with expert stride 160: cannot flatten, the batched path
    assert probes._flat(w) is None and probes._flat(big) is not None
    want = torch.einsum("td,nod->tno", x, w)
    torch.testing.assert_close(probes._wide(x, w, None), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probes._wide(x, w.contiguous(), None), want, rtol=1e-5, atol=1e-6)
    bias = torch.randn(4, 6, generator=gen)
    torch.testing.assert_close(probes._wide(x, w.contiguous(), bias), want + bias, rtol=1e-5, atol=1e-6)


def test_auto_budget_is_a_share_of_free_device_memory(monkeypatch):
    assert probes.auto_budget("cpu") == probes.DEFAULT_BUDGET
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    assert probes.auto_budget("cuda") == int(62 * gib * probes.FREE_SHARE) // 4
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert probes.auto_budget("cuda") == probes.DEFAULT_BUDGET  # never below the CPU's budget


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_half_precision_probes_on_cpu_read_the_fused_halves_in_place(model_type, monkeypatch):
    """On the CPU, torch's batched matmul copies a bf16/fp16 stack whose experts are not back to back (the gate half
    of a fused gate_up_proj: all of it, 924 MiB and 5.5 s at Mixtral's width against 0.1 s). Those probes take one
    product per expert instead: the same bf16 numbers as the batched product on a contiguous copy, for every node;
    fp32 (no copy there) and contiguous stacks keep the batched product."""
    monkeypatch.setattr(probes, "_one_gemm", lambda device: False)
    L = find_moe_layers(copy.deepcopy(build_tiny_model(model_type)).to(torch.bfloat16))[0]  # the cached one stays fp32
    W = L.expert_weights()
    assert probes._copies_whole(_h(L).bfloat16(), W.gate) and not probes._copies_whole(_h(L), W.gate.float())
    assert not probes._copies_whole(_h(L).bfloat16(), W.down)  # its own contiguous parameter
    h = _h(L).bfloat16()
    got = probes.expert_nodes(L, h, probes.NODES)
    x = L.expert_input(h)
    for name, w in (("gate", W.gate), ("up", W.up)):
        batched = torch.matmul(x.unsqueeze(0), w.contiguous().transpose(-1, -2))  # [n, T, I], no strided batch
        assert torch.equal(got[name], batched)
    for e in range(L.n_experts):  # every node against the raw parameters, per expert (bf16 rounding apart)
        ref = reference_expert(model_type, L, e, x)
        for node in probes.NODES:
            torch.testing.assert_close(got[node][e].float(), ref[node].float(), rtol=2e-2, atol=2e-2)


class _Ops(TorchDispatchMode):
    """Counts the aten ops a call dispatches (what runs, not what the Python code says)."""

    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemm_layout_per_device_by_substitution(dtype, monkeypatch):
    """Which product each device runs, on the CPU: the meta device stands in for CUDA (both are not the CPU, so
    :func:`probes._copies_whole` answers for them alike, and ``_one_gemm`` is told meta prefers the one wide GEMM as
    CUDA does). CUDA keeps one ``[T, d] x [d, n·2I]`` GEMM for gate and up of the fused gate_up_proj (an ``mm``, no
    per-expert loop), in every dtype; the gate alone (a half that cannot flatten) one batched product. Only the CPU
    with a half-precision strided half takes one product per expert (``n`` ``mm``, no copy of the weights: no
    ``clone``); fp32 there keeps the batched product. Every node lands on the tokens' device."""
    monkeypatch.setattr(probes, "_one_gemm", lambda device: device.type != "cpu")
    model = copy.deepcopy(build_tiny_model("mixtral")).to(dtype)
    for device in ("cpu", "meta"):  # the CPU first: a model on meta has no numbers to move back
        L = find_moe_layers(model.to(device))[0]
        n, inter, d = L.expert_weights().gate.shape
        h = _h(L).to(device=device, dtype=dtype)
        gpu_like = device == "meta"
        half = dtype in (torch.bfloat16, torch.float16)
        assert probes._copies_whole(h, L.expert_weights().gate) == (not gpu_like and half)
        cuda_x = types.SimpleNamespace(device=torch.device("cuda"))  # a CUDA tensor's device, without a GPU
        assert not probes._copies_whole(cuda_x, L.expert_weights().gate)
        for nodes, wide in ((("gate",), False), (("up",), True), (("glu", "output"), True)):
            with _Ops() as ops:
                got = probes.expert_nodes(L, h, nodes)
            for node in nodes:
                assert got[node].device == h.device and got[node].dtype == dtype
                assert got[node].shape == (n, h.shape[0], d if node == "output" else inter)
            products = ops.count["mm"] + ops.count["bmm"]
            down = int("output" in nodes)  # the down projection: one batched product
            if gpu_like and wide:
                assert (ops.count["mm"], ops.count["bmm"]) == (1, down), ops.count  # the one wide GEMM
            elif not gpu_like and half and not wide:
                assert (ops.count["mm"], ops.count["bmm"], ops.count["stack"]) == (n, 0, 1), ops.count
                assert ops.count["clone"] == 0, ops.count  # the strided half read in place, never copied
            else:
                assert (ops.count["mm"], products) == (0, 1 + down), ops.count  # one batched product
