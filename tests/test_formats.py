"""``moetool.formats``: quantize / dequantize of every expert format against transformers' own routines and hand
references (nearest e2m1 value by brute force, per-block scales one block at a time)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import finegrained_fp8 as tf_fp8
from transformers.integrations import mxfp4 as tf_mx

from moetool import compiled, formats
from moetool.errors import MoetoolError

GEN = torch.Generator().manual_seed(0)


def weight(*shape, dtype=torch.float32):
    w = torch.randn(*shape, generator=GEN) * torch.linspace(0.01, 3.0, shape[-1])  # scales differ per block
    return w.to(dtype)


def tf_quantizer(scale_fmt, block=(128, 128)):
    cfg = SimpleNamespace(weight_block_size=list(block), scale_fmt=scale_fmt)
    return SimpleNamespace(quantization_config=cfg)



@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_block_of_tiny_values_and_zeros_stays_finite(scale_fmt):
    """A block whose largest |value| is 1e-38 (below 448 / fp32's largest, 1.3e-36): its scale 448 / 1e-38 overflowed
    to inf, so the block's zeros came back NaN (0 x inf) and 1e-38 as 0 -- a NaN weight from --quantize fp8. Now
    zeros stay 0 and each value is within e4m3's rounding (2^-4 relative), as in a block of ordinary values."""
    w = torch.zeros(4, 4)
    w[0, 0], w[1, 1], w[2, 3] = 1e-38, -5e-39, 0.5  # the top-left 2 x 2 block tiny, a normal one beside it
    q, inv = formats.quantize_fp8(w, block=(2, 2), scale_fmt=scale_fmt)
    back = formats.dequantize_fp8(q, inv, block=(2, 2))
    assert torch.isfinite(back).all() and torch.isfinite(formats.scales_fp32(inv)).all()
    assert (back[w == 0] == 0).all()
    for v in (1e-38, -5e-39, 0.5):
        got = float(back[w == v])
        assert got == pytest.approx(v, rel=2 ** -4), v
    assert torch.isfinite(formats.fake_quantize(w, "fp8")).all()

@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_matches_transformers_quantize_and_dequantize(scale_fmt):
    w = weight(3, 256, 384)  # 3 experts, 2 x 3 blocks each
    q, s = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    ref = tf_fp8.Fp8Quantize(tf_quantizer(scale_fmt))._quantize_one("experts.gate_up_proj", w)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), ref["experts.gate_up_proj"].view(torch.uint8))
    assert s.dtype == ref["experts.gate_up_proj_scale_inv"].dtype and s.shape == (3, 2, 3)
    assert torch.equal(s.float(), ref["experts.gate_up_proj_scale_inv"].float())
    deq = tf_fp8.Fp8Dequantize(tf_quantizer(scale_fmt))._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(formats.dequantize_fp8(q, s), deq)
    assert torch.equal(formats.fake_quantize(w, "fp8", scale_fmt=scale_fmt), deq)
    # transformers' backward-pass dequantization reads the same numbers
    assert torch.equal(tf_fp8._dequantize_fp8_weight(q, s, [128, 128], torch.float32), deq)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_ragged_blocks_one_block_at_a_time(scale_fmt):
    """Shapes that are not multiples of 128 (tiny models): each partial edge block scaled by its own amax."""
    w = weight(2, 200, 72)
    q, s = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    assert s.shape == (2, 2, 1)
    for e, i, j in itertools.product(range(2), range(2), range(1)):
        blk = w[e, 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
        scale = 448.0 / blk.abs().max()
        if scale_fmt == "ue8m0":
            scale = 1 / 2.0 ** torch.ceil(torch.log2(1 / scale))
        assert torch.equal(s[e, i, j].float(), 1 / scale)
        codes = (blk * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q[e, 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].view(torch.uint8), codes.view(torch.uint8))
    deq = formats.dequantize_fp8(q, s, block=(128, 128))
    assert torch.equal(deq, tf_fp8._dequantize_fp8_weight(q, s, [128, 128], torch.float32))
    assert torch.equal(formats.fake_quantize(w, "fp8", scale_fmt=scale_fmt), deq)
    q3, s3 = formats.quantize_fp8(weight(2, 201, 72), scale_fmt=scale_fmt)
    with pytest.raises(MoetoolError, match="not a whole number of blocks"):
        formats.dequantize_fp8(q3, s3)  # a ragged grid needs the module's block size
    with pytest.raises(MoetoolError, match="does not fit"):
        formats.dequantize_fp8(q3, s3, block=(64, 64))


def test_raw_e8m0_bytes_scale_by_two_to_the_byte_minus_127():
    """Scales as raw E8M0 bytes (``uint8``, OCP MX: bias 127) are ``2 ** (byte - 127)``: every byte 0..254 by hand
    (Python floats), the same as torch's ``float8_e8m0fnu`` of those bytes; FP8 codes times them dequantize as with
    the ``float8_e8m0fnu`` scales they are the bytes of, and as codes x 2 ** (byte - 127) block by block."""
    b = torch.arange(255, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (int(x) - 127) for x in b], dtype=torch.float64)
    assert torch.equal(formats.scales_fp32(b).double(), want)
    assert torch.equal(formats.scales_fp32(b.view(torch.float8_e8m0fnu)).double(), want)
    q, _ = formats.quantize_fp8(torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(5)))
    s = torch.tensor([[[120], [134]], [[127], [0]]], dtype=torch.uint8)  # [2 experts, 2 x 1 blocks]
    got = formats.dequantize_fp8(q, s)
    assert torch.equal(got, formats.dequantize_fp8(q, s.view(torch.float8_e8m0fnu)))
    for e, i in itertools.product(range(2), range(2)):
        blk = q[e, 128 * i:128 * (i + 1)].double() * 2.0 ** (int(s[e, i, 0]) - 127)
        assert torch.equal(got[e, 128 * i:128 * (i + 1)].double(), blk)


def test_only_e8m0_byte_255_and_non_finite_floats_are_refused_scales():
    """E8M0's only non-number is the byte 255 (NaN): of the 256 bytes (``uint8`` or ``float8_e8m0fnu``) exactly that
    one is counted, 254 (2^127) is a scale; fp32 counts NaN and +-inf, not its largest or smallest numbers."""
    b = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    for t in (b, b.view(torch.float8_e8m0fnu)):
        assert formats.nonfinite_scales(t) == 1
        assert formats.nonfinite_scales(t, per_row=True).tolist() == [0, 0, 0, 1]
        assert formats.nonfinite_scales(t[:, :-1]) == 0  # bytes 0..254 less three: none
    f = torch.tensor([[float("nan"), 1.0], [torch.finfo(torch.float32).max, float("inf")],
                      [torch.finfo(torch.float32).tiny, -float("inf")]])
    assert formats.nonfinite_scales(f) == 3 and formats.nonfinite_scales(f, per_row=True).tolist() == [1, 1, 1]


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch-indexed"])
def test_every_byte_decodes_to_torchs_own_value(host, monkeypatch):
    """The byte tables the CPU dequantizes with (numpy indexing by the codes) give torch's own conversion of every
    FP8 byte (NaN where it gives NaN) and the e2m1 values of both nibbles; the indexed path other devices take,
    run here on the CPU, the same."""
    if not host:
        monkeypatch.setattr(formats, "_bytes_on_host", lambda t: False)
    b = torch.arange(256, dtype=torch.uint8)
    odd_rows = torch.cat([b, b[:16]]).view(16, 17)[:, :16]  # rows 17 bytes apart: byte pairs across alignments
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        # whole rows (read two bytes at a time), a strided slice (a byte at a time), rows at odd offsets, an odd row
        for codes in (b.view(dt).reshape(16, 16), b.view(dt).reshape(16, 16)[:, ::2], odd_rows.view(dt),
                      b[:255].view(dt)):
            want, got = codes.to(torch.float32), formats.decode_bytes(codes, dt)
            assert got.dtype == torch.float32 and got.shape == codes.shape
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0), want.nan_to_num(0))
            assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays -0.0
    lo = [formats.E2M1_VALUES[i & 15] for i in range(256)]
    hi = [formats.E2M1_VALUES[i >> 4] for i in range(256)]
    for packed in (b.view(torch.int8).reshape(4, 64), b.view(torch.int8).reshape(64, 4)[:, ::2].T):
        want = [v for i in packed.flatten().view(torch.uint8).tolist() for v in (formats.E2M1_VALUES[i & 15],
                                                                                 formats.E2M1_VALUES[i >> 4])]
        got = formats.decode_bytes(packed, "e2m1x2")
        assert got.shape == (*packed.shape[:-1], 2 * packed.shape[-1]) and got.flatten().tolist() == want
    pairs = formats.decode_bytes(b.view(torch.int8).reshape(4, 64), "e2m1x2")
    assert pairs.flatten().tolist() == [v for pair in zip(lo, hi) for v in pair]
    assert torch.equal(torch.signbit(pairs.flatten()[0::2]), torch.tensor([i & 8 > 0 for i in range(256)]))


def test_threaded_decoding_gives_the_same_values(monkeypatch):
    """Large code arrays are decoded by several threads, each a slice along the first axis long enough (here an
    inner one too): the same values as one thread's."""
    monkeypatch.setattr(formats, "TAKE_GRAIN", 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        codes = torch.randint(0, 256, (2, 9, 40), dtype=torch.uint8, generator=GEN)
        for c in (codes, codes[:1], codes[:, :, 1:], codes[:, ::2]):
            f8 = c.view(torch.float8_e4m3fn)
            got, want = formats.decode_bytes(f8, f8.dtype), f8.to(torch.float32)
            assert torch.equal(got.nan_to_num(0), want.nan_to_num(0)) and torch.equal(got.isnan(), want.isnan())
            fp4 = formats.decode_bytes(c.view(torch.int8), "e2m1x2")
            monkeypatch.setattr(formats, "TAKE_GRAIN", 1 << 30)  # one thread
            assert torch.equal(fp4, formats.decode_bytes(c.view(torch.int8), "e2m1x2"))
            monkeypatch.setattr(formats, "TAKE_GRAIN", 16)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="fork")
def test_a_forked_child_decodes_with_its_own_threads(monkeypatch):
    """A thread pool made before a fork has no threads in the child: a submission there waited forever."""
    import os

    monkeypatch.setattr(formats, "TAKE_GRAIN", 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        codes = torch.randint(0, 256, (4, 64, 64), dtype=torch.uint8, generator=GEN).view(torch.float8_e4m3fn)
        want = formats.decode_bytes(codes, codes.dtype).nan_to_num(0)  # the parent's pool exists now
        pid = os.fork()
        if pid == 0:  # the child: a hang ends in SIGALRM after 20 s
            import signal

            signal.alarm(20)
            ok = torch.equal(formats.decode_bytes(codes, codes.dtype).nan_to_num(0), want)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


def nearest_e2m1(x):
    """Brute force: the e2m1 value nearest each x (clamped to +-6), ties to the one with an even mantissa."""
    vals = torch.tensor(formats.E2M1_VALUES[:8])
    a = x.abs().clamp(max=6.0)
    d = (a[..., None] - vals).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    even = torch.tensor([True, False, True, False, True, False, True, False])  # 0, 1, 2, 4 end in mantissa 0
    pick = torch.where(cand.sum(-1, keepdim=True) > 1, cand & even, cand).float().argmax(-1)
    return vals[pick] * torch.where(x < 0, -1.0, 1.0)


def test_e2m1_rounding_is_nearest_with_ties_to_even():
    x = torch.cat([torch.linspace(-7, 7, 2801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])])
    codes = formats.e2m1_codes(x)
    got = torch.tensor(formats.E2M1_VALUES)[codes.long()]
    assert torch.equal(got.abs(), nearest_e2m1(x).abs()) and torch.equal(got, nearest_e2m1(x))


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp4_packed_matches_transformers_dequantize(scale_fmt):
    w = weight(2, 48, 128)
    packed, s = formats.quantize_fp4(w, scale_fmt=scale_fmt)
    assert packed.dtype == torch.int8 and packed.shape == (2, 48, 64) and s.shape == (2, 48, 4)
    deq = tf_fp8.Fp8Dequantize(tf_quantizer(scale_fmt))._dequantize_one(packed, s, output_dtype=torch.float32)
    assert torch.equal(formats.dequantize_fp8(packed, s), deq)
    assert torch.equal(formats.fake_quantize(w, "fp4", scale_fmt=scale_fmt), deq)
    # hand: each group of 32 is amax/6 (ue8m0: rounded up to a power of two) times the nearest e2m1 value
    g = w.reshape(2, 48, 4, 32)
    scale = g.abs().amax(-1) / 6.0
    if scale_fmt == "ue8m0":
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    hand = (nearest_e2m1(g / scale[..., None]) * scale[..., None]).reshape(w.shape)
    assert torch.equal(deq, hand)


def test_mxfp4_matches_transformers_gpt_oss_dequantize():
    w = weight(3, 64, 96)  # [experts, out, in]
    blocks, scales = formats.quantize_mxfp4(w)
    assert blocks.shape == (3, 64, 3, 16) and scales.shape == (3, 64, 3) and scales.dtype == torch.uint8
    # transformers' gpt-oss loader turns the checkpoint blocks into its [experts, in, out] model layout
    ref = tf_mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(formats.dequantize_mxfp4(blocks, scales).transpose(1, 2), ref)
    g = w.reshape(3, 64, 3, 32)
    scale = 2.0 ** torch.ceil(torch.log2(g.abs().amax(-1) / 6.0))
    assert torch.equal(scales.int() - 127, torch.log2(scale).int())
    hand = (nearest_e2m1(g / scale[..., None]) * scale[..., None]).reshape(w.shape)
    assert torch.equal(formats.fake_quantize(w, "mxfp4"), hand)
    # gpt-oss' own layout: groups along dim -2
    assert torch.equal(formats.fake_quantize(w.transpose(1, 2), "mxfp4", in_dim=-2), hand.transpose(1, 2))


@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "ue8m0"), ("fp4", "ue8m0"), ("mxfp4", None)])
def test_power_of_two_formats_are_idempotent_and_keep_dtype(fmt, scale_fmt):
    w = weight(4, 256, 128, dtype=torch.bfloat16)
    once = formats.fake_quantize(w, fmt, scale_fmt=scale_fmt)
    assert once.dtype == torch.bfloat16 and once.shape == w.shape
    assert torch.equal(formats.fake_quantize(once, fmt, scale_fmt=scale_fmt), once)
    assert not torch.equal(once, w)


def test_plain_casts_and_errors_are_bounded():
    w = weight(64, 128)
    assert torch.equal(formats.fake_quantize(w, "bf16"), w.bfloat16().float())
    assert torch.equal(formats.fake_quantize(w, "fp16"), w.half().float())
    assert torch.equal(formats.fake_quantize(w, "fp32"), w)
    # worst-case relative error of each format, per block: fp8 e4m3 half an ulp (2^-4), fp4 half the widest gap (1/6)
    rel8 = ((formats.fake_quantize(w, "fp8") - w).abs() / w.abs().amax()).max()
    assert 0 < rel8 <= 2.0**-4
    for fmt in ("fp4", "mxfp4"):
        g = w.reshape(64, 4, 32)
        err = (formats.fake_quantize(w, fmt) - w).reshape(64, 4, 32).abs().amax(-1) / g.abs().amax(-1)
        assert 0 < err.max() <= (2 / 6 if fmt == "mxfp4" else 1 / 6) + 1e-6


def test_bad_formats_are_one_line():
    with pytest.raises(MoetoolError, match="unknown weight format 'int3'"):
        formats.fake_quantize(weight(4, 32), "int3")
    with pytest.raises(MoetoolError, match="not a multiple"):
        formats.fake_quantize(weight(4, 40), "mxfp4")
    with pytest.raises(MoetoolError, match="matrices"):
        formats.fake_quantize(torch.ones(32), "fp8")


# ----- the fused (compiled) dequantization: CUDA's path, traced here with torch.compile's "eager" backend -------


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Route the CPU through the fused path (dynamo traces the kernels; "eager" runs the traced graph)."""
    monkeypatch.setattr(compiled, "DEVICES", ("cpu",))
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    monkeypatch.delenv("MOETOOL_NO_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    return compiled._KERNELS


def _eager(codes, scale, dtype, block=None):
    saved = compiled.DEVICES
    compiled.DEVICES = ()
    try:
        return formats.dequantize_fp8(codes, scale, dtype, block=block)
    finally:
        compiled.DEVICES = saved


@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "float"), ("fp8", "ue8m0"), ("fp4", "float"), ("fp4", "ue8m0")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_dequantization_equals_the_eager_passes_bit_for_bit(fused_on_cpu, fmt, scale_fmt, dtype):
    w = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(5)) * 0.03
    codes, scale = formats.quantize_fp8(w, scale_fmt=scale_fmt) if fmt == "fp8" else \
        formats.quantize_fp4(w, scale_fmt=scale_fmt)
    block = (128, 128) if fmt == "fp8" else None
    want = _eager(codes, scale, dtype, block)
    got = formats.dequantize_fp8(codes, scale, dtype, block=block)
    assert fused_on_cpu[f"{fmt} dequantization"] is not None  # the compiled kernel ran
    assert got.dtype == dtype and got.shape == want.shape == w.shape
    assert torch.equal(got, want)
    # a slice of experts and of the rows (how probes read gate and up of a fused gate_up)
    if fmt == "fp8":
        part = formats.dequantize_fp8(codes[1:3, 128:256], scale[1:3, 1:2], dtype, block=block)
        assert torch.equal(part, want[1:3, 128:256])
    # against an independent reading: every code's value times its block's scale
    vals = codes.float() if fmt == "fp8" else formats.unpack_fp4(codes)
    bn, bk = block or (1, formats.FP4_GROUP)
    grid = formats.scales_fp32(scale).repeat_interleave(bn, -2).repeat_interleave(bk, -1)
    assert torch.equal(got, (vals * grid).to(dtype))


def test_ragged_blocks_and_broadcast_scales_stay_on_the_eager_path(fused_on_cpu):
    w = torch.randn(2, 200, 300, generator=torch.Generator().manual_seed(6))
    codes, scale = formats.quantize_fp8(w)
    got = formats.dequantize_fp8(codes, scale, torch.float32, block=(128, 128))
    assert not fused_on_cpu  # ragged: never compiled
    assert torch.equal(got, _eager(codes, scale, torch.float32, (128, 128)))
    one = torch.full((1, 1), 0.5)
    c2 = codes[:, :128, :128].contiguous()
    assert torch.equal(formats.dequantize_fp8(c2, one), c2.float() * 0.5)  # per-tensor scale over experts
    assert not fused_on_cpu


def test_a_compiler_that_fails_falls_back_to_the_same_numbers_with_one_warning(fused_on_cpu, monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "no-such-backend")
    w = torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(7))
    codes, scale = formats.quantize_fp8(w)
    with pytest.warns(RuntimeWarning, match="compiled fp8 dequantization kernel unavailable"):
        got = formats.dequantize_fp8(codes, scale, torch.bfloat16, block=(128, 128))
    assert torch.equal(got, _eager(codes, scale, torch.bfloat16, (128, 128)))
    assert fused_on_cpu["fp8 dequantization"] is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls go straight to the eager passes
        assert torch.equal(formats.dequantize_fp8(codes, scale, torch.bfloat16, block=(128, 128)), got)


def test_moetool_no_compile_keeps_the_eager_passes(fused_on_cpu, monkeypatch):
    monkeypatch.setenv("MOETOOL_NO_COMPILE", "1")
    codes, scale = formats.quantize_fp4(torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(8)))
    got = formats.dequantize_fp8(codes, scale, torch.float32)
    assert not fused_on_cpu  # not even compiled
    assert torch.equal(got, _eager(codes, scale, torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on CUDA")
@pytest.mark.parametrize("fmt,scale_fmt", [("fp8", "float"), ("fp8", "ue8m0"), ("fp4", "float"), ("fp4", "ue8m0")])
def test_fused_dequantization_on_cuda_equals_the_cpu_bit_for_bit(monkeypatch, fmt, scale_fmt):
    monkeypatch.setattr(compiled, "_KERNELS", {})
    monkeypatch.delenv("MOETOOL_NO_COMPILE", raising=False)
    w = torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(9)) * 0.02
    codes, scale = formats.quantize_fp8(w, scale_fmt=scale_fmt) if fmt == "fp8" else \
        formats.quantize_fp4(w, scale_fmt=scale_fmt)
    block = (128, 128) if fmt == "fp8" else None
    for dtype in (torch.bfloat16, torch.float32):
        want = formats.dequantize_fp8(codes, scale, dtype, block=block)  # the CPU: eager passes
        got = formats.dequantize_fp8(codes.cuda(), scale.cuda(), dtype, block=block)
        assert compiled._KERNELS[f"{fmt} dequantization"] is not None  # Triton kernels here
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_an_all_zero_block_has_scale_one_and_reads_back_as_zeros(scale_fmt):
    """A 128 x 128 block of zeros (a pruned or padded expert): transformers' ``Fp8Quantize`` stores scale_inv 1 for
    it, the codes 0, and every read gives 0. A scale of 0 there made scale_inv inf and every dequantized value
    0 x inf = NaN (mutation pass 16: the ``torch.ones_like`` of an empty block's scale). The other blocks keep
    their own scales."""
    w = weight(2, 256, 256)
    w[0, :128, 128:] = 0  # one zero block of expert 0
    w[1] = 0  # every block of expert 1
    q, s = formats.quantize_fp8(w, scale_fmt=scale_fmt)
    ref = tf_fp8.Fp8Quantize(tf_quantizer(scale_fmt))._quantize_one("experts.down_proj", w)
    assert torch.equal(s.float(), ref["experts.down_proj_scale_inv"].float())
    assert s.float()[0, 0, 1] == 1.0 and torch.equal(s.float()[1], torch.ones(2, 2))
    assert torch.equal(q.view(torch.uint8), ref["experts.down_proj"].view(torch.uint8))
    fake = formats.fake_quantize(w, "fp8", scale_fmt=scale_fmt)
    assert bool(fake.isfinite().all())
    assert torch.equal(fake[1], torch.zeros(256, 256)) and torch.equal(fake[0, :128, 128:], torch.zeros(128, 128))
    assert torch.equal(fake[0, :128, :128], formats.fake_quantize(w[0, :128, :128], "fp8", scale_fmt=scale_fmt))
