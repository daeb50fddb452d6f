"""FP8 that runs without ``kernels`` (issue 37.5): moetool's torch path for transformers' FP8 layers.

transformers computes ``FP8Linear`` / ``FP8Experts`` only through the ``kernels-community/finegrained-fp8`` kernel
(a Hub download). :mod:`moetool.adapters.fp8_backend` puts a torch implementation of its three entry points in its
place when it cannot be had. Here (no ``kernels``, no network, as on CI and the GPU machine found) the quantized
tiny models of tests/test_quantized.py run their own forwards through it -- no test substitution of the quantized
linear -- under each experts implementation transformers dispatches to (eager loop, batched, grouped), and equal the
model holding transformers' own dequantization of the same codes. On a CUDA machine the same runs on the GPU, and
``moetool.load(..., quantize="fp8")`` quantizes on the GPU while loading and runs a forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_CUDA, padded_batch
from test_quantized import FP8_CASES, IDS, _by_blocks_fp64, _tf_dequantize, _tf_quantizer, fp8_models
from transformers.integrations import finegrained_fp8 as tf_fp8

from moetool import formats
from moetool.adapters import find_moe_layers, fp8_backend


@pytest.fixture
def torch_path(monkeypatch):
    """The torch path installed as a load would without ``kernels``; transformers' kernel slot and the choice put
    back after the test."""
    monkeypatch.setattr(tf_fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(fp8_backend, "_CHOSEN", None)
    return None


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("case", FP8_CASES, ids=IDS)
def test_quantized_experts_run_and_equal_the_dequantized_model(case, impl, torch_path, capsys):
    qm, dq = fp8_models(*case)
    for L in find_moe_layers(qm):
        L.experts.config._experts_implementation = impl
    qm, dq = qm.to(DEVICE), dq.to(DEVICE)
    inputs = {k: v.to(DEVICE) for k, v in padded_batch().items()}
    with pytest.raises(ImportError, match="kernel"):  # what transformers alone does here: no forward at all
        with torch.no_grad():
            qm(**inputs)
    assert fp8_backend.ensure(qm, prefer_kernel=False) == "torch" and fp8_backend.backend() == "torch"
    assert "torch path" in capsys.readouterr().err  # said once
    with torch.no_grad():
        got, want = qm(**inputs).logits, dq(**inputs).logits
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fp8_backend.ensure(qm) == "torch" and "torch path" not in capsys.readouterr().err  # not said twice
    assert fp8_backend.ensure(dq) is None  # no FP8 layer: nothing to choose


def test_fp8_linear_of_ragged_blocks_runs_with_its_block_size(torch_path):
    """An ``FP8Linear`` of a checkpoint quantized in 40x40 blocks on a [64, 128] weight (a 2x4 scale grid, the last
    blocks 24 and 8 wide) through the torch path: x @ W.T with W = codes x their own block's scale, by hand in
    float64. Reading the block off the scale grid (32 x 32) instead scaled rows 32-39 and columns 32-39, 72-79, ...
    by the wrong block: wrong outputs, no error."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen) * torch.linspace(0.01, 1.0, 128)  # block scales differ
    q, s = formats.quantize_fp8(w, block=(40, 40))
    assert s.shape == (2, 4)
    lin = tf_fp8.FP8Linear(128, 64, block_size=(40, 40))
    lin.weight = torch.nn.Parameter(q, requires_grad=False)
    lin.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    fp8_backend.ensure(lin, prefer_kernel=False)
    x = torch.randn(5, 128, generator=gen)
    with torch.no_grad():
        got = lin.to(DEVICE)(x.to(DEVICE)).cpu()
    want = x.double() @ _by_blocks_fp64(q, s, (40, 40)).T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block, scale_fmt", [((128, 128), "float"), ((64, 64), "ue8m0"), (None, "float")])
def test_fp8_linear_equals_its_dequantized_weight(block, scale_fmt, torch_path):
    """``FP8Linear`` (what ``--quantize fp8`` makes of attention and dense projections): its own forward through
    the torch path is ``F.linear`` with transformers' dequantization of its codes."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen) * 0.05  # whole blocks: transformers' quantizer leaves others unquantized
    lin = tf_fp8.FP8Linear(256, 256, block_size=block, scale_fmt=scale_fmt)
    if block is None:  # per tensor: one fp32 scale
        scale = w.abs().max() / torch.finfo(torch.float8_e4m3fn).max
        q, s = (w / scale).to(torch.float8_e4m3fn), scale.reshape(())
        ref = q.float() * scale
    else:
        out = tf_fp8.Fp8Quantize(_tf_quantizer(block, scale_fmt))._quantize_one("l.weight", w)
        q, s = out["l.weight"], out["l.weight_scale_inv"]
        ref = _tf_dequantize(q, s, block)
    lin.weight = torch.nn.Parameter(q, requires_grad=False)
    lin.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    fp8_backend.ensure(lin, prefer_kernel=False)
    lin, ref = lin.to(DEVICE), ref.to(DEVICE)
    x = torch.randn(3, 7, 256, generator=gen).to(DEVICE)
    with torch.no_grad():
        got = lin(x)
    torch.testing.assert_close(got, F.linear(x, ref), rtol=1e-5, atol=1e-6)


def test_batched_matmul_leaves_expert_parallel_sentinels_zero(torch_path):
    """Rows whose expert id is past the last expert (expert parallel's sentinel) come out zero, the rest are their
    expert's product: by hand per row."""
    gen = torch.Generator().manual_seed(1)
    E, N, K = 3, 128, 256
    w = torch.randn(E, N, K, generator=gen)
    q, s = [], []
    for e in range(E):
        out = tf_fp8.Fp8Quantize(_tf_quantizer((128, 128), "float"))._quantize_one("w", w[e])
        q.append(out["w"]), s.append(out["w_scale_inv"])  # noqa: E401
    q, s = torch.stack(q), torch.stack(s)
    x = torch.randn(6, K, generator=gen)
    ids = torch.tensor([2, 0, 3, 2, 1, 5])
    got = fp8_backend.batched_matmul(x, q, s, block_size=[128, 128], expert_ids=ids)
    for r, e in enumerate(ids.tolist()):
        want = torch.zeros(N) if e >= E else x[r] @ _tf_dequantize(q[e], s[e], (128, 128)).T
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ON_CUDA, reason="the CPU refusal (on CUDA: the next test)")
def test_quantize_fp8_on_the_cpu_is_one_line():
    from moetool.errors import MoetoolError
    from moetool.loading import load

    with pytest.raises(MoetoolError, match="quantizes on a CUDA GPU while loading") as e:
        load("tiny", quantize="fp8", device="cpu")
    assert "\n" not in str(e.value)


def _quantized_while_loading():
    """The embedded model as ``--quantize fp8`` loads it (moetool's FineGrainedFP8Config, transformers' quantizer
    quantizing each weight as it loads), in float32 on the CPU: transformers' "a GPU is needed" check told a GPU is
    there -- the quantizer's arithmetic is torch code that runs anywhere. Returns (model, load report)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from moetool.loading import EMBEDDED_DIR

    qc = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=["gate", "router", "lm_head"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        model, info = AutoModelForCausalLM.from_pretrained(
            EMBEDDED_DIR / "tiny", quantization_config=qc, dtype=torch.float32, device_map={"": "cpu"},
            output_loading_info=True, ignore_mismatched_sizes=True)
    return model.eval(), info


def test_quantizing_while_loading_runs_the_dequantized_model(torch_path, monkeypatch):
    """--quantize fp8 on the embedded model (tested by substitution on the CPU; the GPU test below loads it for
    real): weights whose shape is a multiple of 128 become FP8 codes with block scales, the others (k/v_proj 64
    rows, down_proj 192 columns) stay in the model's dtype, their ``scale_inv`` reported missing and uninitialised.
    The load check accepts exactly those scales (not an FP8 weight's), and the forward -- under each experts
    implementation -- equals the float32 model holding the dequantized weights (by hand: codes x 128x128 block scale)
    and the unquantized weights as they are (an H100 run gave perplexity 4,926 instead of 56: the uninitialised
    scales were applied)."""
    from transformers import AutoModelForCausalLM

    from moetool.errors import MoetoolRuntimeError
    from moetool.loading import EMBEDDED_DIR, check_loading_info

    qm, info = _quantized_while_loading()
    kinds = {n: p.dtype for n, p in qm.named_parameters() if "layers.0." in n and "norm" not in n}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == torch.float8_e4m3fn
    assert kinds["model.layers.0.self_attn.k_proj.weight"] == kinds["model.layers.0.mlp.experts.down_proj"] == \
        torch.float32
    missing = set(info["missing_keys"])
    assert missing and all(k.endswith("_scale_inv") for k in missing)
    assert "model.layers.0.mlp.experts.down_proj_scale_inv" in missing
    check_loading_info("tiny", qm.config, info, qm)  # the unread scales only
    with pytest.raises(MoetoolRuntimeError, match="do not fit its config"):
        check_loading_info("tiny", qm.config, info)  # no model: nothing to tell them by
    fp8_scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"  # an FP8 weight's scale missing: refused
    with pytest.raises(MoetoolRuntimeError, match="q_proj.weight_scale_inv"):
        check_loading_info("tiny", qm.config, {"missing_keys": [*missing, fp8_scale]}, qm)

    ref = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR / "tiny", dtype=torch.float32).eval()
    state = dict(qm.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            q = state[name]
            if q.dtype == torch.float8_e4m3fn:  # by hand: each 128x128 block times its scale
                s = state[name + "_scale_inv" if not name.endswith(".weight") else name[:-7] + ".weight_scale_inv"]
                full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)
                p.copy_((q.float() * full).to(p.dtype))
            else:
                assert torch.equal(q, p), name
    inputs = padded_batch()
    with torch.no_grad():
        want = ref(**inputs).logits.float()
    # with the kernel at hand, a fully quantized model takes it; this one the torch path (its mixed experts)
    monkeypatch.setattr(fp8_backend, "kernel_available", lambda: True)
    assert fp8_backend.ensure(fp8_models(*FP8_CASES[0])[0]) == "kernels"
    assert fp8_backend.ensure(qm) == "torch"
    for impl in ("eager", "batched_mm", "grouped_mm"):
        for L in find_moe_layers(qm):
            L.experts.config._experts_implementation = impl
        with torch.no_grad():
            got = qm(**inputs).logits.float()
        assert got.isfinite().all(), impl
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_CUDA, reason="--quantize fp8 quantizes on a CUDA GPU")
def test_quantize_fp8_loads_onto_the_gpu_and_runs(monkeypatch):
    """On a GPU without ``kernels`` (or with it): the embedded model quantized while loading onto the GPU, its
    forward runs, its perplexity within 2% of the unquantized model's, the manifest says which backend computed."""
    import moetool
    from moetool.loading import load

    monkeypatch.setattr(fp8_backend, "_CHOSEN", None)
    lm = load("tiny", quantize="fp8")
    assert lm.device.type == "cuda" and fp8_backend.has_fp8_layers(lm.model)
    assert all(p.device.type == "cuda" for p in lm.model.parameters())
    man = lm.manifest()["quantization"]
    assert man["fp8_backend"] in ("kernels", "torch")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    got = float(moetool.ppl(lm, tokens, bootstrap=0, baseline=False, quiet=True)["ppl"]["perplexity"].iloc[0])
    plain = moetool.load("tiny")
    want = float(moetool.ppl(plain, tokens, bootstrap=0, baseline=False, quiet=True)["ppl"]["perplexity"].iloc[0])
    assert abs(got / want - 1) < 0.02, (got, want)
