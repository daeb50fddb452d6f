"""Quantized experts read correctly or refused (issue 23 part 1).

Tiny models of several routing rules get their experts replaced by transformers' own quantized modules --
``FP8Experts`` (FP8 128x128 / 64x64 blocks with fp32 or UE8M0 scales, FP4 packed), ``Mxfp4GptOssMLP`` /
``Mxfp4GptOssExperts`` (gpt-oss MXFP4), per-expert ``FP8Linear`` MLPs -- filled by quantizing the tiny model's
weights (transformers' ``Fp8Quantize`` where it has one, ``moetool.formats`` for FP4/MXFP4). The reference is a
copy of the tiny model holding transformers' own dequantization of the same codes (``_dequantize_fp8_weight``,
``Fp8Dequantize``, ``convert_moe_packed_tensors``). The quantized modules' GPU kernels do not run on CPU: in these
tests only, ``FP8Experts.linear`` and the MXFP4 Triton routing / matmul are replaced by dequantize-then-matmul
references (transformers' dequantization, then ``F.linear`` / the plain gpt-oss experts); everything else
(the modules' forwards, moetool's engine, probes, policies and experiments) is the real code.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model, padded_batch, run
from torch import nn
from transformers.integrations import finegrained_fp8 as tf_fp8
from transformers.integrations import mxfp4 as tf_mx
from transformers.integrations.moe import use_experts_implementation

from moetool import formats
from moetool.adapters import find_moe_layers, quant
from moetool.data import TokenSet
from moetool.engine import Engine, probes
from moetool.errors import MoetoolError
from moetool.policies import make_policy

# (model type, expert dtype, scale form, FP8 block): three routing rules (softmax-topk-renorm, sigmoid group, ...)
FP8_CASES = [("mixtral", "fp8", "float", (128, 128)), ("deepseek_v3", "fp8", "ue8m0", (64, 64)),
             ("qwen3_moe", "fp4", "float", None), ("deepseek_v3", "fp4", "ue8m0", None)]
IDS = [f"{m}-{d}-{s}" for m, d, s, _ in FP8_CASES]


def _tf_quantizer(block, scale_fmt):
    return SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=list(block), scale_fmt=scale_fmt))


def _tf_dequantize(q, s, block):
    """transformers' own dequantization of FP8Experts' storage (the reference)."""
    if q.dtype == torch.int8:
        return tf_fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    return tf_fp8._dequantize_fp8_weight(q, s, list(block), torch.float32)


def reference_linear(self, input, weight, weight_scale_inv, activation_scale=None):
    """Tests only: FP8Experts' quantized linear as dequantize (transformers') then matmul (no GPU kernel here)."""
    w = _tf_dequantize(weight, weight_scale_inv, self.block_size).to(input.dtype)
    return F.linear(input, w)


@pytest.fixture
def fp8_kernel(monkeypatch):
    monkeypatch.setattr(tf_fp8.FP8Experts, "linear", reference_linear)


def fp8_models(model_type, expert_dtype, scale_fmt, block):
    """(quantized model, dequantized model): the tiny model's experts as transformers' FP8Experts, and a copy holding
    transformers' dequantization of the same codes."""
    plain = build_tiny_model(model_type)
    qm, dq = copy.deepcopy(plain), copy.deepcopy(plain)
    cfg = copy.deepcopy(qm.config.get_text_config())
    cfg._experts_implementation = "eager"  # FP8Experts' own per-expert loop (its linear substituted in tests)
    cls = use_experts_implementation(experts_class=tf_fp8.FP8Experts, experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        new = cls(config=cfg, block_size=block, scale_fmt=scale_fmt, expert_dtype=expert_dtype)
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(Lq.experts, name).detach()
            if expert_dtype == "fp8":  # transformers' own quantizer
                out = tf_fp8.Fp8Quantize(_tf_quantizer(block, scale_fmt))._quantize_one(name, w)
                q, s = out[name], out[f"{name}_scale_inv"]
            else:
                q, s = formats.quantize_fp4(w, scale_fmt)
            setattr(new, name, nn.Parameter(q, requires_grad=False))
            setattr(new, f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))
            getattr(Ld.experts, name).data = _tf_dequantize(q, s, block)
        Lq.block.experts = new
    return qm.eval(), dq.eval()


class Strided:
    """Tests only: triton_kernels' ``wrap_torch_tensor`` with a ``StridedLayout`` (its ``unswizzle_data`` is the
    identity), the CPU stand-in for the Triton tensors transformers puts on ``Mxfp4GptOssExperts``."""

    def __init__(self, data):
        self.storage = SimpleNamespace(data=data, layout=SimpleNamespace(unswizzle_data=lambda d: d))


def mxfp4_models():
    """(quantized, dequantized) tiny gpt-oss: every ``GptOssMLP`` replaced as transformers' ``replace_with_mxfp4_linear``
    does, blocks and scales set as its ``swizzle_mxfp4_convertops`` does (strided layout); the reference holds
    transformers' ``convert_moe_packed_tensors`` of the same blocks."""
    plain = build_tiny_model("gpt_oss")
    qm, dq = copy.deepcopy(plain), copy.deepcopy(plain)
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        ex = tf_mx.Mxfp4GptOssExperts(qm.config)
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(Lq.experts, name).detach().transpose(1, 2)  # [E, out, in]: the checkpoint's orientation
            blocks, scales = formats.quantize_mxfp4(w)  # [E, out, in/32, 16], [E, out, in/32]
            getattr(Ld.experts, name).data = tf_mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            del ex._parameters[name]
            setattr(ex, name, Strided(blocks.reshape(*blocks.shape[:2], -1).transpose(-2, -1)))
            setattr(ex, f"{name}_precision_config", SimpleNamespace(weight_scale=Strided(scales.transpose(-2, -1))))
            bias = getattr(Lq.experts, f"{name}_bias").detach().clone()
            setattr(ex, f"{name}_bias", nn.Parameter(bias, requires_grad=False))
        ex.limit, ex.alpha = Lq.experts.limit, Lq.experts.alpha
        ex._test_reference = Ld.experts  # the kernels' stand-in computes with transformers' dequantization
        Lq.decoder_layer.mlp = tf_mx.Mxfp4GptOssMLP(Lq.router, ex)
    return qm.eval(), dq.eval()


@pytest.fixture
def mxfp4_kernels(monkeypatch):
    """Tests only: the Triton routing (top-K of the logits, softmax over the K) and grouped matmul of gpt-oss'
    MXFP4 path as plain torch (the experts computed from transformers' dequantization of their blocks)."""
    def routing(logits, k):
        vals, idx = torch.topk(logits, k, dim=-1)
        return (idx, torch.softmax(vals, dim=-1)), None, None

    monkeypatch.setattr(tf_mx, "triton_kernels_hub", SimpleNamespace(routing=SimpleNamespace(routing=routing)),
                        raising=False)
    monkeypatch.setattr(tf_mx, "routing_from_top_k", lambda idx, w, n: ((idx, w), None, None))
    monkeypatch.setattr(tf_mx.Mxfp4GptOssExperts, "forward_routed",
                        lambda self, h, data, gather, scatter: self._test_reference(h, *data))


def _models(case):
    return mxfp4_models() if case == "mxfp4" else fp8_models(*case)


ALL = [*FP8_CASES, "mxfp4"]
ALL_IDS = [*IDS, "gpt_oss-mxfp4"]


@pytest.fixture
def kernels(fp8_kernel, mxfp4_kernels):
    return None


# ---------------------------------------------------------------------------------------------------- the view


@pytest.mark.parametrize("case", ALL, ids=ALL_IDS)
def test_view_equals_transformers_dequantization(case):
    qm, dq = _models(case)
    want = "mxfp4" if case == "mxfp4" else case[1]
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        fmt = quant.expert_format(Lq)
        assert (fmt.kind, fmt.readable) == (want, True) and quant.expert_format(Ld).kind == "plain"
        got, ref = quant.dequantized(Lq), Ld.expert_weights()
        for part in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
            a, b = getattr(got, part), getattr(ref, part)
            assert (a is None) == (b is None), part
            if a is not None:
                assert torch.equal(a, b), (case, Lq.index, part)


@pytest.mark.parametrize("case", [FP8_CASES[0], FP8_CASES[2], "mxfp4"], ids=[IDS[0], IDS[2], "gpt_oss-mxfp4"])
def test_probes_equal_the_dequantized_model_and_dequantize_a_few_experts_at_a_time(case, monkeypatch, kernels):
    qm, dq = _models(case)
    _, events, _ = run(dq, find_moe_layers(dq), padded_batch())
    seen = []
    for fn in ("dequantize_fp8", "dequantize_mxfp4"):
        orig = getattr(formats, fn)
        monkeypatch.setattr(formats, fn, lambda *a, _o=orig, **k: seen.append(a[0].shape[0]) or _o(*a, **k))
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        h = events[Ld.index].h
        want = probes.expert_nodes(Ld, h, probes.NODES)
        got = probes.expert_nodes(Lq, h, probes.NODES)
        for node in probes.NODES:
            torch.testing.assert_close(got[node], want[node], rtol=1e-6, atol=1e-6)
            # one node alone dequantizes only the matrices it reads (gate rows of gate_up, ...): same numbers
            torch.testing.assert_close(probes.node_scores(Lq, h, node), probes.node_scores(Ld, h, node),
                                       rtol=1e-6, atol=1e-6)
        n, per = quant._sizes(Lq, quant.expert_format(Lq))
        seen.clear()  # a budget of two experts' weights: slices of at most two experts, same numbers
        small = probes.node_scores(Lq, h, "output", "l1", budget=2 * per)
        assert seen and max(seen) == 2 < n
        torch.testing.assert_close(small, probes.node_scores(Ld, h, "output", "l1"), rtol=1e-6, atol=1e-6)
        routed = events[Ld.index].idx
        mask = torch.zeros(h.shape[0], n, dtype=torch.bool).scatter_(1, routed, True)
        torch.testing.assert_close(probes.routed_absmax(Lq, h, mask, budget=3 * per),
                                   probes.routed_absmax(Ld, h, mask), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- routing and policies


def _router_outputs(layers):
    seen, handles = {}, []
    for L in layers:
        handles.append(L.router.register_forward_hook(lambda m, a, out, i=L.index: seen.__setitem__(i, out)))
    return seen, handles


@pytest.mark.parametrize("case", ALL, ids=ALL_IDS)
def test_routing_capture_and_a_norm_policy_on_quantized_experts(case, kernels):
    qm, dq = _models(case)
    lq, ld = find_moe_layers(qm), find_moe_layers(dq)
    inputs = padded_batch()
    with torch.no_grad():
        unhooked = qm(**inputs).logits  # the quantized module's own forward (kernels substituted)
    ref_logits, ref_events, _ = run(dq, ld, inputs)
    torch.testing.assert_close(unhooked, ref_logits, rtol=1e-5, atol=1e-5)
    seen, handles = _router_outputs(lq)
    try:
        logits, events, _ = run(qm, lq, inputs)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(logits, unhooked)  # capturing changes nothing
    assert sorted(events) == [L.index for L in lq]  # every layer reported (MXFP4: its kernel path is bypassed)
    for L in lq:
        ev, (r_logits, r_w, r_idx) = events[L.index], seen[L.index]
        assert torch.equal(ev.logits, r_logits) and torch.equal(ev.idx, r_idx) and torch.equal(ev.weights, r_w)
        assert torch.equal(ev.idx, ref_events[L.index].idx)  # the same routing as the dequantized model
        assert "_is_hooked" not in vars(L.experts)  # the engine's mark is gone after the run
    pol = make_policy("norm:output:l2")
    p_logits, p_events, _ = run(qm, lq, inputs, policy=pol)
    d_logits, d_events, _ = run(dq, ld, inputs, policy=pol)
    for L in lq:
        assert torch.equal(p_events[L.index].chosen_idx, d_events[L.index].chosen_idx)
    assert any(not torch.equal(p_events[L.index].chosen_idx, p_events[L.index].idx) for L in lq)
    torch.testing.assert_close(p_logits, d_logits, rtol=1e-5, atol=1e-5)


def test_mxfp4_routing_is_missed_without_the_engine_mark(mxfp4_kernels, monkeypatch):
    """The MXFP4 block's kernel path calls neither router nor experts: without routing it through them no hook
    fires and the engine refuses (the old behaviour), never a silent empty capture."""
    qm, _ = mxfp4_models()
    monkeypatch.setattr(quant, "route_through_modules", lambda layer: None)
    with pytest.raises(MoetoolError, match="never reported"):
        run(qm, find_moe_layers(qm), padded_batch())


# ------------------------------------------------------------------------------------------------ experiments


class _LM:
    def __init__(self, model):
        self.model, self.layers = model, find_moe_layers(model)


def _tokens(rows=3, seq=12):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 1024, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[-1, seq - 5:] = 0
    return TokenSet(ids, mask, [""] * rows, "test")


def _same_tables(a, b):
    assert set(a.tables) == set(b.tables)
    for name in a.tables:
        x, y = (t.tables[name].drop(columns=["seconds"], errors="ignore").reset_index(drop=True) for t in (a, b))
        assert len(x) > 0
        pd.testing.assert_frame_equal(x, y,
                                      rtol=1e-5, atol=1e-6, check_dtype=False)


@pytest.mark.parametrize("case", [FP8_CASES[1], "mxfp4"], ids=[IDS[1], "gpt_oss-mxfp4"])
def test_experiments_equal_the_dequantized_model(case, kernels):
    from moetool.experiments.approx.compute import approx
    from moetool.experiments.erc.compute import erc
    from moetool.experiments.norm_select.compute import norm_select
    from moetool.experiments.super_experts.compute import super_experts

    qm, dq = _models(case)
    q, d, tokens = _LM(qm), _LM(dq), _tokens()
    kw = dict(quiet=True, batch_size=2)
    _same_tables(norm_select(q, tokens, nodes=("gate", "output"), norms=("l2",), bootstrap=0, **kw),
                 norm_select(d, tokens, nodes=("gate", "output"), norms=("l2",), bootstrap=0, **kw))
    _same_tables(approx(q, tokens, **kw), approx(d, tokens, **kw))
    _same_tables(erc(q, quiet=True, samples=64), erc(d, quiet=True, samples=64))
    _same_tables(super_experts(q, tokens, bootstrap=0, **kw), super_experts(d, tokens, bootstrap=0, **kw))


# ------------------------------------------------------------------------------------ per-expert linears


class UnfusedExperts(nn.ModuleList):
    """Tests only: experts un-fused into per-expert MLPs of transformers' ``FP8Linear`` (a GPTQ/AWQ-style layout),
    called as ``experts(h, idx, w)``."""

    def __init__(self, mlps, act_fn):
        super().__init__(mlps)
        self.__dict__["act_fn"] = act_fn  # not a child: the list holds experts only

    def forward(self, h, idx, w):
        out = torch.zeros_like(h)
        for e, m in enumerate(self):
            tok, k = torch.where(idx == e)
            y = m.down_proj(self.act_fn(m.gate_proj(h[tok])) * m.up_proj(h[tok]))
            out.index_add_(0, tok, y * w[tok, k, None])
        return out


def _fp8_linear(w, block=(64, 64)):
    lin = tf_fp8.FP8Linear(w.shape[1], w.shape[0], block_size=block)
    out = tf_fp8.Fp8Quantize(_tf_quantizer(block, "float"))._quantize_one("weight", w)
    lin.weight = nn.Parameter(out["weight"], requires_grad=False)
    lin.weight_scale_inv = nn.Parameter(out["weight_scale_inv"], requires_grad=False)
    return lin, _tf_dequantize(out["weight"], out["weight_scale_inv"], block)


def test_per_expert_fp8_linears_read_exactly(monkeypatch):
    # tests only: FP8Linear's GPU kernel as dequantize (transformers') then matmul
    monkeypatch.setattr(tf_fp8.FP8Linear, "forward", lambda self, x: F.linear(
        x, _tf_dequantize(self.weight, self.weight_scale_inv, self.block_size).to(x.dtype), self.bias))
    plain = build_tiny_model("qwen3_moe")
    qm, dq = copy.deepcopy(plain), copy.deepcopy(plain)
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        ex = Lq.experts
        inter = ex.gate_up_proj.shape[1] // 2
        mlps = []
        for e in range(ex.gate_up_proj.shape[0]):
            g, gd = _fp8_linear(ex.gate_up_proj[e, :inter].detach())
            u, ud = _fp8_linear(ex.gate_up_proj[e, inter:].detach())
            d, dd = _fp8_linear(ex.down_proj[e].detach())
            mlps.append(SimpleNamespace(gate_proj=g, up_proj=u, down_proj=d))
            Ld.experts.gate_up_proj.data[e] = torch.cat([gd, ud])
            Ld.experts.down_proj.data[e] = dd
        Lq.block.experts = UnfusedExperts([nn.Module() for _ in mlps], ex.act_fn)
        for m, parts in zip(Lq.block.experts, mlps):
            m.gate_proj, m.up_proj, m.down_proj = parts.gate_proj, parts.up_proj, parts.down_proj
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        fmt = quant.expert_format(Lq)
        assert fmt.kind == "linears" and "FP8Linear" in fmt.detail
        got, ref = quant.dequantized(Lq), Ld.expert_weights()
        for part in ("gate", "up", "down"):
            assert torch.equal(getattr(got, part), getattr(ref, part))
        h = torch.randn(5, got.gate.shape[-1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(probes.node_scores(Lq, h, "glu", budget=1), probes.node_scores(Ld, h, "glu"),
                                   rtol=1e-6, atol=1e-6)
    # routing and a norm policy through the un-fused experts equal the dequantized model's
    lq, ld = find_moe_layers(qm), find_moe_layers(dq)
    q_logits, q_events, _ = run(qm, lq, padded_batch(), policy=make_policy("norm:glu"))
    d_logits, d_events, _ = run(dq, ld, padded_batch(), policy=make_policy("norm:glu"))
    for Lq in lq:
        assert torch.equal(q_events[Lq.index].idx, d_events[Lq.index].idx)
        assert torch.equal(q_events[Lq.index].chosen_idx, d_events[Lq.index].chosen_idx)
    torch.testing.assert_close(q_logits, d_logits, rtol=1e-5, atol=1e-5)
    # a NaN block scale of one expert's FP8Linear: one line naming it (its column was NaN)
    L = lq[0]
    L.experts[2].down_proj.weight_scale_inv.data[0, 0] = float("nan")
    quant._FINITE_SCALES.discard(L.experts)  # checked above, once per module (a loaded checkpoint's never change)
    with pytest.raises(MoetoolError, match=rf"^layer {L.index}: 1 of the \d+ scales of experts\.2\.down_proj\."
                                           r"weight_scale_inv are NaN or infinite"):
        probes.node_scores(L, torch.randn(3, L.experts[0].gate_proj.in_features), "output", budget=1)


def _by_blocks_fp64(codes, scale_inv, block):
    """Tests only: FP8 codes times the scale of the ``block`` (bn x bk; the last row/column block may be partial) that
    holds each element, one block at a time in float64 (the reference)."""
    (n, k), (bn, bk) = codes.shape, block
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = codes[rows, cols].double() * float(scale_inv[i, j])
    return out


def test_per_expert_fp8_linears_of_ragged_blocks_read_with_the_modules_block_size():
    """Per-expert ``FP8Linear`` whose shapes are not whole blocks (gate/up [64, 128], down [128, 64] in 40x40 blocks:
    2x4 and 4x2 scale grids, the last blocks 24 or 8 wide): each element times its own block's scale, by hand in
    float64. Read with the block taken off the scale grid (64 / 2 = 32, 128 / 4 = 32) instead of the module's
    ``block_size``, rows 32-39 took the second block's scale: a wrong weight, and no error."""
    plain = build_tiny_model("qwen3_moe")
    qm = copy.deepcopy(plain)
    block = (40, 40)
    L = find_moe_layers(qm)[0]
    ex = L.experts
    inter = ex.gate_up_proj.shape[1] // 2
    want = {"gate": [], "up": [], "down": []}
    mods = []
    for e in range(ex.gate_up_proj.shape[0]):
        m = nn.Module()
        for part, attr, w in (("gate", "gate_proj", ex.gate_up_proj[e, :inter]), ("up", "up_proj", ex.gate_up_proj[e, inter:]),
                              ("down", "down_proj", ex.down_proj[e])):
            q, s = formats.quantize_fp8(w.detach(), block=block)
            assert s.shape == (-(-w.shape[0] // 40), -(-w.shape[1] // 40)) and w.shape[0] % 40 and w.shape[1] % 40
            lin = tf_fp8.FP8Linear(w.shape[1], w.shape[0], block_size=block)
            lin.weight = nn.Parameter(q, requires_grad=False)
            lin.weight_scale_inv = nn.Parameter(s, requires_grad=False)
            setattr(m, attr, lin)
            want[part].append(_by_blocks_fp64(q, s, block))
        mods.append(m)
    L.block.experts = UnfusedExperts(mods, ex.act_fn)
    L = find_moe_layers(qm)[0]
    assert quant.expert_format(L).kind == "linears"
    got = quant.dequantized(L, torch.float64)
    for part in ("gate", "up", "down"):
        torch.testing.assert_close(getattr(got, part), torch.stack(want[part]), rtol=1e-7, atol=0)  # one fp32 product


def test_fp8_experts_of_ragged_blocks_read_with_the_modules_block_size():
    """FP8Experts in 40x40 blocks on shapes that are not whole blocks (gate_up [2I = 128, 128], down [128, I = 64]: 4x4
    and 4x2 scale grids, the last blocks 8 or 24 wide): gate, up and down equal codes x their own block's scale by
    hand in float64, read whole and one part at a time. With the block taken off the scale grid (128 / 4 = 32), rows
    32-39 of every matrix took the next block's scale: wrong weights, and no error."""
    qm = copy.deepcopy(build_tiny_model("mixtral"))
    L = find_moe_layers(qm)[0]
    block = (40, 40)
    cls = use_experts_implementation(experts_class=tf_fp8.FP8Experts, experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    new = cls(config=qm.config, block_size=block)
    ref = {}
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(L.experts, name).detach()
        q, s = formats.quantize_fp8(w, block=block)
        assert w.shape[1] % 40 and w.shape[2] % 40 and s.shape[1:] == (-(-w.shape[1] // 40), -(-w.shape[2] // 40))
        setattr(new, name, nn.Parameter(q, requires_grad=False))
        setattr(new, f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))
        ref[name] = torch.stack([_by_blocks_fp64(q[e], s[e], block) for e in range(q.shape[0])])
    L.block.experts = new
    L = find_moe_layers(qm)[0]
    inter = ref["down_proj"].shape[-1]
    want = {"gate": ref["gate_up_proj"][:, :inter], "up": ref["gate_up_proj"][:, inter:], "down": ref["down_proj"]}
    got = quant.dequantized(L, torch.float64)
    for part in ("gate", "up", "down"):
        torch.testing.assert_close(getattr(got, part), want[part], rtol=1e-7, atol=0)  # one fp32 product
        (_, alone), = quant.expert_chunks(L, 1 << 62, torch.float64, parts={part})
        torch.testing.assert_close(getattr(alone, part), want[part], rtol=1e-7, atol=0)


@pytest.mark.parametrize("case", ALL, ids=ALL_IDS)
def test_a_slice_budget_counts_the_weight_elements_an_expert_dequantizes_to(case):
    """``expert_chunks`` cuts a layer into slices of at most ``budget`` dequantized weight elements: an expert counts
    its gate, up and down (3 I d; FP4 packs two values per int8 of ``down_proj [E, d, I/2]``, MXFP4 holds no float
    matrix to read the sizes off), a third of that per part asked for. A budget of two experts' elements gives slices
    of two experts, of one part two experts at a third of the budget."""
    qm, _ = _models(case)
    L = find_moe_layers(qm)[0]
    W = quant.dequantized(L)
    n, inter, d = W.gate.shape
    assert W.up.shape == (n, inter, d) and W.down.shape == (n, d, inter)
    assert quant._sizes(L, quant.expert_format(L)) == (n, 3 * inter * d)
    assert [sl.indices(n) for sl, _ in quant.expert_chunks(L, 2 * 3 * inter * d)] == [(e, e + 2, 1) for e in range(0, n, 2)]
    gate = [(sl.indices(n), w.gate.shape[0]) for sl, w in quant.expert_chunks(L, 2 * inter * d, parts={"gate"})]
    assert gate == [((e, e + 2, 1), 2) for e in range(0, n, 2)]


@pytest.mark.parametrize("case", FP8_CASES, ids=IDS)
def test_gate_and_up_read_together_are_one_matrix_and_one_product(case, monkeypatch):
    """Asked for gate and up, FP8Experts' fused ``gate_up_proj`` is dequantized once and gate and up are its two
    halves (views), as the plain experts' are: the probe then runs gate and up as one product over the tokens
    (``probes._wide`` once per slice, not twice), the quantized probe's layout equal to the plain one's; the values
    equal transformers' dequantization (the view test above), the nodes the plain model's (the probe test above)."""
    qm, dq = _models(case)
    Lq, Ld = find_moe_layers(qm)[0], find_moe_layers(dq)[0]
    (_, W), = quant.expert_chunks(Lq, 1 << 62)
    fused = probes._fused_gate_up(W)
    assert fused is not None
    ref = Ld.expert_weights()
    assert torch.equal(fused, torch.cat([ref.gate, ref.up], dim=1))
    calls = []
    orig = probes._wide
    monkeypatch.setattr(probes, "_wide", lambda x, w, b: calls.append(tuple(w.shape)) or orig(x, w, b))
    h = torch.randn(5, W.gate.shape[2], generator=torch.Generator().manual_seed(0))
    got = probes.expert_nodes(Lq, h, ("up", "output"))
    n, inter, d = W.gate.shape
    assert calls == [(n, 2 * inter, d)]
    want = probes.expert_nodes(Ld, h, ("up", "output"))
    for node in ("up", "output"):
        torch.testing.assert_close(got[node], want[node], rtol=1e-6, atol=1e-6)


def test_rectangular_fp8_blocks_read_each_half_of_gate_up_by_its_own_block_rows():
    """FP8Experts in 32x64 blocks (32 rows of gate_up per scale row, 64 columns per scale column): gate and up read
    apart (only their own scale rows) equal transformers' dequantization of the whole fused matrix. Cutting the
    rows by the block's column size read up's rows with gate's scales, or did not fit the scale grid."""
    qm, dq = fp8_models("mixtral", "fp8", "float", (32, 64))
    for Lq, Ld in zip(find_moe_layers(qm), find_moe_layers(dq)):
        ex = Lq.experts
        inter = ex.gate_up_proj.shape[1] // 2
        assert ex.gate_up_proj_scale_inv.shape[1:] == (2 * inter // 32, ex.gate_up_proj.shape[2] // 64)
        ref = Ld.expert_weights()
        for part in ("gate", "up"):  # one part alone: its rows of gate_up, read by quant._rows
            (_, got), = quant.expert_chunks(Lq, 1 << 62, parts={part})
            assert torch.equal(getattr(got, part), getattr(ref, part)), part


# ------------------------------------------------------------------------------------------------- refusals


def _unreadable(model_type="mixtral"):
    """A tiny model whose experts hold codes of a format moetool does not know (bitsandbytes-like uint8 packs)."""
    m = copy.deepcopy(build_tiny_model(model_type))
    for L in find_moe_layers(m):
        packed = torch.zeros(L.experts.gate_up_proj.numel() // 2, 1, dtype=torch.uint8)
        del L.experts._parameters["gate_up_proj"]
        L.experts.register_parameter("gate_up_proj", nn.Parameter(packed, requires_grad=False))
    return m


def test_unknown_formats_are_one_line_before_any_work():
    from moetool.experiments.approx.compute import approx
    from moetool.experiments.erc.compute import erc
    from moetool.experiments.super_experts.compute import super_experts

    m = _unreadable()
    lm, layers = _LM(m), find_moe_layers(m)
    fmt = quant.expert_format(layers[0])
    assert fmt.kind == "unreadable" and "gate_up_proj as uint8" in fmt.problem
    calls = []
    handle = m.register_forward_pre_hook(lambda *a: calls.append(1))
    for fn in (lambda: approx(lm, _tokens(), quiet=True), lambda: erc(lm, quiet=True),
               lambda: super_experts(lm, _tokens(), quiet=True),
               lambda: probes.node_scores(layers[0], torch.zeros(2, 128), "gate")):
        with pytest.raises(MoetoolError, match=r"layer \d+: MixtralExperts stores gate_up_proj as uint8 codes"):
            fn()
    with pytest.raises(MoetoolError, match="--routing norm:gate:l2 reads expert weights"):
        with Engine(m, layers, policy=make_policy("norm:gate")):
            pass
    handle.remove()
    assert not calls  # refused before any forward


def test_fp8_codes_in_an_experts_module_moetool_does_not_know_are_refused_not_read_as_weights():
    """float8_e4m3fn is a floating dtype, but one byte per value: codes whose scales live elsewhere (an FP8 format
    other than transformers' FP8Experts). Read as plain weights they would be the codes themselves (off by each
    block's scale, here ~1/60); the format is unreadable and the probes refuse it in one line."""
    m = copy.deepcopy(build_tiny_model("mixtral"))
    L = find_moe_layers(m)[0]
    w = L.experts.gate_up_proj.detach()
    del L.experts._parameters["gate_up_proj"]
    L.experts.register_parameter("gate_up_proj", nn.Parameter((w * 60).to(torch.float8_e4m3fn), requires_grad=False))
    fmt = quant.expert_format(L)
    assert (fmt.kind, fmt.readable) == ("unreadable", False)
    assert fmt.problem == ("MixtralExperts stores gate_up_proj as float8_e4m3fn codes (Parameter): a format moetool "
                           "cannot read")
    with pytest.raises(MoetoolError, match=r"^layer \d+: MixtralExperts stores gate_up_proj as float8_e4m3fn codes"):
        probes.node_scores(L, torch.zeros(2, w.shape[-1]), "gate")


def test_bitsandbytes_note_and_manifest_record_the_formats():
    from moetool.loading import LoadedModel

    m = copy.deepcopy(build_tiny_model("mixtral"))
    m.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    lm = LoadedModel("tiny", "x", "local", m, None, find_moe_layers(m), torch.device("cpu"), torch.float32)
    man = lm.manifest()
    assert man["quantization"]["method"] == "bitsandbytes" and "stayed unquantized" in man["quantization"]["note"]
    (detail, entry), = man["expert_formats"].items()
    assert entry == {"kind": "plain", "readable": True, "layers": [L.index for L in lm.layers]}
    assert detail == "MixtralExperts, float32"


def test_quantize_flag_is_one_line_on_cpu(tmp_path):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    for flag, msg in (("fp8", "quantizes on a CUDA GPU while loading"), ("int4", "--quantize takes fp8, not 'int4'")):
        res = CliRunner().invoke(app, ["ppl", "--model", "tiny", "--quantize", flag, "--device", "cpu",
                                       "--out", str(tmp_path / flag)])
        assert res.exit_code == 2, res.output
        assert msg in res.output and len(res.output.strip().splitlines()) == 1
        assert not (tmp_path / flag).exists()


@pytest.mark.parametrize("qc,fmt,weights", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
     "block-scaled FP8 e4m3 (128x128 blocks, UE8M0 scale_inv)", "probes dequantize FP8Experts a slice"),
    ({"quant_method": "fp8", "expert_dtype": "fp4", "weight_block_size": [128, 128]},
     "FP4 e2m1 experts packed in int8, 1x32 groups, fp32 scales", "probes dequantize FP8Experts a slice"),
    ({"quant_method": "mxfp4"}, "MXFP4 (e2m1 in 32-value blocks, E8M0 scales)", "probes dequantize the MXFP4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes (nn.Linear only)", "unquantized experts"),
    ({"quant_method": "gptq", "bits": 4}, "gptq (per-expert quantized linears of its own library)", "refused"),
])
def test_inspect_shows_the_expert_format_and_what_commands_do(tmp_path, qc, fmt, weights):
    from typer.testing import CliRunner

    from moetool.adapters import ADAPTERS
    from moetool.commands.app import app
    from moetool.inspect import describe_model

    cfg = ADAPTERS.get("mixtral").tiny_config()
    cfg.quantization_config = qc
    cfg.save_pretrained(tmp_path)
    info = describe_model(str(tmp_path))["experts_format"]
    assert info["format"] == fmt and weights in info["weights"]
    out = CliRunner().invoke(app, ["inspect", "--model", str(tmp_path)], env={"COLUMNS": "400"}).output
    assert f"experts: {fmt}" in out and weights in out


@pytest.mark.parametrize("case", [FP8_CASES[0], "mxfp4"], ids=[IDS[0], "gpt_oss-mxfp4"])
def test_a_bf16_model_with_fp32_scales_or_biases_identifies_its_routing(case):
    """The routing check runs the router on inputs of the hidden states' dtype (the router's), not the dtype of
    the quantized experts' fp32 scales or biases."""
    qm, _ = _models(case)
    for L in find_moe_layers(qm):
        L.router.to(torch.bfloat16)
    layers = find_moe_layers(qm)
    assert layers and all(L.logits_mode == "native" and L.top_k == 2 for L in layers)


def test_per_tensor_fp8_experts_one_scale_per_half():
    """FP8Experts without a block size: one scale per expert matrix, the fused gate_up one per half."""
    plain = build_tiny_model("mixtral")
    qm = copy.deepcopy(plain)
    L = find_moe_layers(qm)[0]
    cls = use_experts_implementation(experts_class=tf_fp8.FP8Experts, experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    new = cls(config=qm.config, block_size=None)
    gu, dn = L.experts.gate_up_proj.detach(), L.experts.down_proj.detach()
    assert new.gate_up_proj_scale_inv.shape == (8, 2, 1) and new.down_proj_scale_inv.shape == (8, 1, 1)
    inter = gu.shape[1] // 2
    ref = {}
    for name, w, halves in (("gate_up_proj", gu, 2), ("down_proj", dn, 1)):
        parts = w.reshape(w.shape[0], halves, -1, w.shape[-1])
        inv = parts.abs().amax(dim=(-2, -1), keepdim=True) / 448.0
        q = (parts / inv).to(torch.float8_e4m3fn)
        setattr(new, name, nn.Parameter(q.reshape(w.shape), requires_grad=False))
        setattr(new, f"{name}_scale_inv", nn.Parameter(inv[..., 0], requires_grad=False))
        ref[name] = (q.float() * inv).reshape(w.shape)  # by hand: each half times its own scale
    L.block.experts = new
    L = find_moe_layers(qm)[0]
    assert quant.expert_format(L).detail.startswith("FP8Experts, e4m3, per-tensor")
    got = quant.dequantized(L)
    assert torch.equal(got.gate, ref["gate_up_proj"][:, :inter]) and torch.equal(got.up, ref["gate_up_proj"][:, inter:])
    assert torch.equal(got.down, ref["down_proj"])
    h = torch.randn(4, gu.shape[-1], generator=torch.Generator().manual_seed(3))
    want = torch.stack([F.linear(h, ref["gate_up_proj"][e, :inter]) for e in range(8)])
    torch.testing.assert_close(probes.expert_nodes(L, h, ["gate"])["gate"], want, rtol=1e-6, atol=1e-6)


def test_a_matrix_the_fp8_quantizer_left_in_high_precision_is_read_as_it_is():
    """``--quantize fp8`` (transformers' ``Fp8Quantize``) passes a matrix that is not whole 128x128 blocks through in
    high precision and leaves its ``scale_inv`` unset (``torch.empty``): with I = 192 the fused gate_up [384, 256]
    is FP8 and down [256, 192] is not. The probes multiplied that down by its unset scales (here NaN; a scale of 3.7
    gave expert outputs 3.7x too large, 270% off) while the model's own forward reads it as it is."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=64, hidden_size=256, intermediate_size=192, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    L = find_moe_layers(model)[0]
    cls = use_experts_implementation(experts_class=tf_fp8.FP8Experts, experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    new = cls(config=cfg, block_size=(128, 128), scale_fmt="float")
    by_hand = {}
    for name in ("gate_up_proj", "down_proj"):
        out = tf_fp8.Fp8Quantize(_tf_quantizer((128, 128), "float"))._quantize_one(name, getattr(L.experts, name).detach())
        setattr(new, name, nn.Parameter(out[name], requires_grad=False))
        if name == "gate_up_proj":  # quantized: e4m3 codes x their block's scale_inv (one block of 128 x 128 each)
            q, inv = out[name], out[f"{name}_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and inv.shape == (4, 3, 2)
            new.gate_up_proj_scale_inv = nn.Parameter(inv, requires_grad=False)
            by_hand[name] = q.double() * inv.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
        else:  # passed through; its scales stay unset
            assert f"{name}_scale_inv" not in out and out[name].dtype == torch.float32
            new.down_proj_scale_inv.data.fill_(float("nan"))
            by_hand[name] = out[name].double()
    L.block.experts = new
    L = find_moe_layers(model)[0]
    w = quant.dequantized(L)
    assert torch.equal(w.down, by_hand["down_proj"].float())
    assert torch.equal(w.gate, by_hand["gate_up_proj"][:, :192].float())
    h = torch.randn(6, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gu = by_hand["gate_up_proj"]
    glu = F.silu(torch.einsum("td,eid->eti", h, gu[:, :192])) * torch.einsum("td,eid->eti", h, gu[:, 192:])
    want = torch.einsum("eti,edi->etd", glu, by_hand["down_proj"])  # [4, 6, 256]
    for budget in (None, 1):
        got = probes.expert_outputs(L, h.float(), budget=budget)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
        norms = probes.node_scores(L, h.float(), "output", budget=budget)
        assert ((norms.double() - want.norm(dim=-1).T).abs().max() / want.norm(dim=-1).max()).item() < 1e-6
    # an FP8Linear holding a high-precision weight is a plain linear (its scales unset)
    lin = tf_fp8.FP8Linear(32, 16, block_size=(128, 128))
    lin.weight = nn.Parameter(torch.randn(16, 32), requires_grad=False)
    lin.weight_scale_inv.data.fill_(float("nan"))
    assert quant._linear_kind(lin) == "plain"


def _scale_grid(experts, name):
    """The stored scales of ``name`` (FP8Experts' ``*_scale_inv``; MXFP4's E8M0 bytes through its Triton stand-in)."""
    if hasattr(experts, f"{name}_precision_config"):
        return getattr(experts, f"{name}_precision_config").weight_scale.storage.data  # [E, G, R] uint8
    return getattr(experts, f"{name}_scale_inv").data


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("case", ALL, ids=ALL_IDS)
def test_a_nan_or_infinite_scale_is_one_line_never_a_table(case, bad):
    """A NaN / inf scale (an E8M0 byte 255 is E8M0's NaN; UE8M0 and MXFP4 have no inf: the same byte) made every
    number of its experts NaN or inf (FP8 codes x NaN; MXFP4's ldexp read byte 255 as 2^128: +-inf, its zero codes
    0) and the probes returned them as a table (REAP saliency, norm scores): refused in one line instead. Valid
    extremes are read: E8M0 bytes 0 and 254 are 2^-127 and 2^127, an fp32 scale of 2^-149 (subnormal) as it is."""
    qm, _ = _models(case)
    L = find_moe_layers(qm)[0]
    h = torch.randn(5, qm.config.hidden_size, generator=torch.Generator().manual_seed(7))
    grid = _scale_grid(L.experts, "down_proj")
    raw = grid.dtype in (torch.uint8, torch.float8_e8m0fnu)
    # valid extremes first: the dequantized expert equals codes x 2^(byte - 127) (or the fp32 scale) in float64
    ok_values = [0, 254] if raw else [2.0 ** -149, 2.0 ** 100]
    for v in ok_values:
        if raw:
            grid.view(torch.uint8)[1, 0, 0] = v
        else:
            grid[1, 0, 0] = v
        # (fp32 holds 2^127 x codes >= 2 as inf, as transformers' dequantization does)
        assert torch.equal(quant.dequantized(L).down[1], _down_by_hand(L.experts, 1).float())
    if raw:
        grid.view(torch.uint8)[1, 0, 0] = 255
    else:
        grid[1, 0, 0] = float(bad)
    for fn in (lambda: probes.node_scores(L, h, "output"), lambda: probes.expert_outputs(L, h),
               lambda: probes.node_scores(L, h, "gate", budget=1)):
        quant._FINITE_SCALES.discard(L.experts)  # the check is once per module: this model's scales were finite
        with pytest.raises(MoetoolError) as e:
            fn()
        msg = str(e.value)
        m = re.fullmatch(rf"layer {L.index}: 1 of the (\d+) scales of down_proj_\w+ of expert 1 are NaN or "
                         r"infinite: their weights cannot be read \(refused rather than computed as NaN/inf\)", msg)
        assert m, msg  # one line, naming the expert and the tensor's number of scales
        assert int(m[1]) == grid.numel()


def _down_by_hand(experts, e):
    """Expert ``e``'s down projection from its stored codes and scales, float64, from the format definitions: e4m3
    bits (bias 7, subnormals m/8 2^-6), e2m1 nibbles (low first), E8M0 bytes 2^(b-127)."""
    e4m3 = []
    for b in range(256):
        sign, ex, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
        e4m3.append(float("nan") if (ex, m) == (15, 7) else sign * (m / 8 * 2.0 ** -6 if ex == 0 else
                                                                        (1 + m / 8) * 2.0 ** (ex - 7)))
    e2m1 = [(-1.0 if n & 8 else 1.0) * ((n & 1) * 0.5 if not (n >> 1) & 3 else (1 + (n & 1) / 2) * 2.0 ** (((n >> 1) & 3) - 1))
            for n in range(16)]
    e4m3, e2m1 = torch.tensor(e4m3, dtype=torch.float64), torch.tensor(e2m1, dtype=torch.float64)
    grid = _scale_grid(experts, "down_proj")
    if hasattr(experts, "down_proj_precision_config"):  # MXFP4: blocks [E, G*16, R] and bytes [E, G, R]
        blocks = experts.down_proj.storage.data[e].T.contiguous().long()  # [R, G*16]
        v = torch.stack([e2m1[blocks & 0xF], e2m1[blocks >> 4]], -1).reshape(blocks.shape[0], -1, 32)
        s = 2.0 ** (grid[e].T.double() - 127)  # [R, G]
        return (v * s[..., None]).reshape(blocks.shape[0], -1)
    codes = experts.down_proj[e].view(torch.uint8).long()
    s = 2.0 ** (grid[e].view(torch.uint8).double() - 127) if grid.dtype == torch.float8_e8m0fnu else grid[e].double()
    if experts.down_proj.dtype == torch.int8:  # FP4: one scale per 1 x 32
        v = torch.stack([e2m1[codes & 0xF], e2m1[codes >> 4]], -1).reshape(codes.shape[0], -1)
        return v * s.repeat_interleave(32, dim=-1)
    bn, bk = experts.block_size
    v = e4m3[codes]
    return v * s.repeat_interleave(bn, 0)[: v.shape[0]].repeat_interleave(bk, 1)[:, : v.shape[1]]


def test_quantize_fp8_asks_transformers_for_block_fp8_with_the_routers_kept(monkeypatch):
    """The GPU path of --quantize fp8 up to from_pretrained (no GPU here: CUDA is pretended, the load stopped)."""
    import transformers

    from moetool import loading

    seen = {}

    class Stop(Exception):
        pass

    def from_pretrained(source, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(MoetoolError, match="cannot load the weights"):
        loading.load("tiny", quantize="fp8")
    qc = seen["quantization_config"]
    assert isinstance(qc, transformers.FineGrainedFP8Config) and list(qc.weight_block_size) == [128, 128]
    assert {"gate", "router"} <= set(qc.modules_to_not_convert) and qc.scale_fmt == "float"


def test_bitsandbytes_is_said_in_one_console_line(tmp_path, monkeypatch, capsys):
    from moetool import loading
    from moetool import run as options  # the run's start (moetool.run.start_run)

    m = copy.deepcopy(build_tiny_model("mixtral"))
    m.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    lm = loading.LoadedModel("tiny", "x", "local", m, None, find_moe_layers(m), torch.device("cpu"), torch.float32)
    monkeypatch.setattr(loading, "load", lambda *a, **k: lm)  # the load itself needs bitsandbytes' CUDA backend
    options.start_run("erc", tmp_path / "run", False, "tiny", device="cpu")
    lines = [x for x in capsys.readouterr().err.splitlines() if "bitsandbytes" in x]
    assert lines == ["note: bitsandbytes quantizes nn.Linear only: the fused 3-D expert weights stayed unquantized "
                     "(experts in full precision, the rest quantized)"]


@pytest.mark.parametrize("case", [FP8_CASES[0], FP8_CASES[2], "mxfp4"], ids=[IDS[0], IDS[2], "gpt_oss-mxfp4"])
def test_offload_counts_the_stored_bytes_of_one_expert(case):
    from moetool.experiments.offload.compute import expert_bytes

    qm, dq = _models(case)
    Lq, Ld = find_moe_layers(qm)[0], find_moe_layers(dq)[0]
    W = Ld.expert_weights()
    inter, d = W.gate.shape[1], W.gate.shape[2]
    if case == "mxfp4":  # half a byte per value, one scale byte per 32 values, fp32 biases
        want = 3 * inter * d // 2 + 3 * inter * d // 32 + (2 * inter + d) * 4
    elif case[1] == "fp8":  # a byte per value, one fp32 scale per 128x128 block
        want = 3 * inter * d + 4 * (2 * inter // 128 * d // 128 + d // 128 * -(-inter // 128))
    else:  # fp4: half a byte per value, one fp32 scale per 32 values
        want = 3 * inter * d // 2 + 4 * 3 * inter * d // 32
    assert expert_bytes(Lq) == want
    assert expert_bytes(Ld) == 3 * inter * d * 4 + (0 if W.gate_bias is None else (2 * inter + d) * 4)


@pytest.mark.parametrize("case", [FP8_CASES[0], "mxfp4"], ids=[IDS[0], "gpt_oss-mxfp4"])
def test_quantized_experts_split_by_tp_or_ep_are_one_line(case, monkeypatch, kernels):
    """Under --tp/--ep the probes would read a rank's slice of quantized experts, whose sliced dequantization is not
    composed with the split: refused in one line naming the format (the split itself is substituted here: a real
    one needs several processes; tests/test_tensor_parallel.py runs the plain split under gloo). The same layers
    unsplit, and plain weights under the same split, are not refused."""
    qm, dq = _models(case)
    Lq, Ld = find_moe_layers(qm)[0], find_moe_layers(dq)[0]
    h = torch.randn(3, qm.config.hidden_size)
    probes.node_scores(Lq, h, "output")  # unsplit: read
    monkeypatch.setattr(probes, "split_of", lambda layer: probes.Split("experts", None, 2, 0))
    fmt = "mxfp4" if case == "mxfp4" else case[1]
    for call in (lambda: probes.node_scores(Lq, h, "output"), lambda: probes.expert_nodes(Lq, h, ("gate",))):
        with pytest.raises(MoetoolError) as e:
            call()
        assert str(e.value) == (f"layer {Lq.index}: quantized expert weights ({fmt}) split by --tp/--ep cannot be "
                                "read by the probes yet; run without --tp/--ep")
    assert probes._split(Ld) is not None  # plain weights pass the check (and go on to the split's gather)


@pytest.mark.parametrize("case", ALL, ids=ALL_IDS)
def test_the_scales_are_checked_once_per_layer_not_per_slice(case, monkeypatch):
    """The finite-scale check counts on the device and reads the count on the host: a sync on a GPU. Done per slice
    of experts it was one sync per expert per layer per batch at budget 1 (DeepSeek-V3's probes read one expert a
    slice); now once per experts module, however many slices and probe calls follow."""
    qm, _ = _models(case)
    L = find_moe_layers(qm)[0]
    quant._FINITE_SCALES.discard(L.experts)
    calls = []
    real = formats.nonfinite_scales
    monkeypatch.setattr(formats, "nonfinite_scales", lambda s, **k: (calls.append(s.shape), real(s, **k))[1])
    h = torch.randn(3, qm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    probes.node_scores(L, h, "output", budget=1)
    first = len(calls)
    assert 1 <= first <= 3  # one per scale tensor (gate_up / up / down), not per slice
    probes.node_scores(L, h, "gate", budget=1)
    probes.expert_outputs(L, h)
    assert len(calls) == first and L.experts in quant._FINITE_SCALES
