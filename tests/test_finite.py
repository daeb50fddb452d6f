"""NaN/inf guard (#14): a non-finite router logit or experts output stops the run with one line naming the MoE
layer, the tensor and the batch, exit 1, and no result file; no host sync inside the forward (test_host_sync)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.errors import MoetoolRuntimeError
from moetool.loading import embedded_models

runner = CliRunner()


def _poisoned_tiny(tmp_path: Path, layer: int, expert: int) -> Path:
    """The embedded tiny model with +inf in every weight of one expert's down projection."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "poisoned"
    shutil.copytree(embedded_models()["tiny"], d)
    w = load_file(d / "model.safetensors")
    key = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight"
    w[key] = torch.full_like(w[key], float("inf"))
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _first_batch_using(lm, ts, layer: int, expert: int, bs: int) -> int:
    """Independent reference: the first batch in which a real token of ``layer`` routes to ``expert`` (the clean
    model's choices up to that layer are the poisoned model's: the poison sits after the router)."""
    from conftest import feed

    from moetool.engine import Engine

    seen = []
    L = next(L for L in lm.layers if L.index == layer)
    with torch.no_grad():
        for i, b in enumerate(ts.batches(bs)):
            with Engine(lm.model, [L], consumers=[lambda ev: seen.append((ev.idx[ev.valid] == expert).any())]):
                feed(lm.model, b.input_ids, b.attention_mask)
            if seen.pop():
                return i
    raise AssertionError("expert never used")


def test_inf_in_an_expert_stops_ppl_with_one_line_naming_layer_and_batch(tmp_path):
    from moetool.data import load_tokens
    from moetool.loading import load

    layer, expert, bs, seq = 1, 3, 2, 32
    clean = load("tiny")
    ts = load_tokens(None, clean.tokenizer, seq, 600)
    want = _first_batch_using(clean, ts, layer, expert, bs)
    model = _poisoned_tiny(tmp_path, layer, expert)
    out = tmp_path / "run"
    r = runner.invoke(app, ["ppl", "--model", str(model), "--max-tokens", "600", "--seq-len", str(seq),
                            "--batch-size", str(bs), "--out", str(out), "--quiet"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 1, r.output
    assert lines == [f"error: non-finite experts output in MoE layer {layer} of {model} at batch {want} "
                     f"(rows {want * bs}-{want * bs + bs - 1}): results would be meaningless"], r.output
    assert not list(out.glob("*.csv")) if out.exists() else True
    if (out / "manifest.json").exists():
        assert json.loads((out / "manifest.json").read_text())["status"] == "failed"


def test_nan_input_embedding_is_caught_at_the_first_router():
    from moetool.data import load_tokens
    from moetool.engine import forward
    from moetool.loading import load

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 16, 200)
    first = lm.layers[0].index
    emb = lm.model.get_input_embeddings().weight
    saved = emb.detach().clone()
    tok = int(ts.input_ids[5, 3])  # a real token of row 5 (batch 1 with batch_size 4), absent from batch 0
    assert ts.attention_mask[5, 3] == 1 and tok not in ts.input_ids[:4][ts.attention_mask[:4] == 1].tolist()
    try:
        with torch.no_grad():
            emb[tok] = float("nan")
        with pytest.raises(MoetoolRuntimeError) as e:
            forward(lm, ts, batch_size=4, quiet=True)
        assert str(e.value) == (f"non-finite router logits in MoE layer {first} of tiny at batch 1 (rows 4-7): "
                                "results would be meaningless")
        # the tiny model ties its output embeddings to the input ones: the NaN row is also every position's logit of
        # that token, so batch 0's next-token NLL is already NaN (it passed unread before the output was guarded)
        assert lm.model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
        with pytest.raises(MoetoolRuntimeError) as e:
            forward(lm, ts, batch_size=4, nll=True, quiet=True)
        assert str(e.value) == ("non-finite next-token NLL of tiny at batch 0 (rows 0-3): the model's output logits "
                                "are NaN or inf in float32; results would be meaningless")
    finally:
        with torch.no_grad():
            emb.copy_(saved)


def test_guard_flags_stay_on_the_device_until_check():
    from conftest import build_tiny_model

    from moetool.adapters import find_moe_layers
    from moetool.engine.guard import FiniteGuard

    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad(), FiniteGuard(layers) as g:
        model(input_ids=ids)
        assert len(g.flags) == 2 * len(layers) and all(f.dtype == torch.bool and f.dim() == 0
                                                       for f in g.flags.values())
        g.check(0)  # clean: no error, flags reset
        assert g.flags == {}
        L = layers[-1]
        h = L.router.register_forward_hook(lambda m, a, o: (o[0].fill_(float("-inf")), *o[1:]), prepend=True)
        model(input_ids=ids)
        h.remove()
        with pytest.raises(MoetoolRuntimeError, match=f"non-finite router logits in MoE layer {L.index} at batch 7: results would be meaningless$"):
            g.check(7)
        # padding (mask 0) is not checked: -inf in a padded position's logits only is fine, in a real one is not
        g.mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
        for row, raises in ((4, False), (3, True)):
            h = L.router.register_forward_hook(lambda m, a, o: (o[0].index_fill_(0, torch.tensor([row]), float("nan")),
                                                                *o[1:]), prepend=True)
            model(input_ids=ids)
            h.remove()
            if raises:
                with pytest.raises(MoetoolRuntimeError, match=f"router logits in MoE layer {L.index} at batch 2:"):
                    g.check(2)
            else:
                g.check(2)


def test_forward_leaves_padding_unchecked_and_its_nll_unchanged():
    """``forward`` hands each batch's attention mask to the guard: a NaN in padded positions only (a fully masked
    attention row gives one in some kernels) stops nothing, and the perplexity is the clean run's, bit for bit
    (padding is never scored); the same NaN in one real position stops the run."""
    from conftest import build_tiny_model

    from moetool.adapters import find_moe_layers
    from moetool.data import TokenSet
    from moetool.engine.runner import forward

    class LM:
        model = build_tiny_model("mixtral")
        layers = find_moe_layers(model)

    ids = torch.randint(3, 1000, (3, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    tokens = TokenSet(ids, mask, [""] * 3, "test")
    clean = forward(LM, tokens, nll=True, batch_size=2, quiet=True).nll
    L = LM.layers[-1]
    for rows, raises in (((~mask.bool()).reshape(-1), False), (torch.arange(24) == 3, True)):
        def poison(m, a, out, rows=rows):  # rows of the flattened [B*S] batch (the first batch: rows 0-1)
            bad = rows[:out.shape[0]].to(out.device).unsqueeze(-1)
            return out.masked_fill(bad, float("nan"))
        h = L.experts.register_forward_hook(poison, prepend=True)
        try:
            if raises:
                with pytest.raises(MoetoolRuntimeError, match=f"non-finite experts output in MoE layer {L.index} "
                                                              "at batch 0"):
                    forward(LM, tokens, nll=True, batch_size=2, quiet=True)
            else:
                got = forward(LM, tokens, nll=True, batch_size=2, quiet=True).nll
                assert (got.nll_sum, got.tokens) == (clean.nll_sum, clean.tokens) and got.tokens == 24 - 3 - 3
        finally:
            h.remove()


def test_a_non_finite_call_is_kept_when_a_later_call_of_the_same_module_is_clean():
    """The flags OR every call of a module between two checks (a router or experts module run twice before the
    batch's check): a NaN in the first call stops the run although the second call is finite. Keeping only the last
    call's flag let the NaN pass."""
    from conftest import build_tiny_model

    from moetool.adapters import find_moe_layers
    from moetool.engine.guard import FiniteGuard

    model = build_tiny_model("mixtral")
    L = find_moe_layers(model)[0]
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    bad = h.clone()
    bad[2, 0] = float("nan")
    with torch.no_grad(), FiniteGuard([L]) as g:
        for first, second, raises in ((h, h, False), (bad, h, True), (h, bad, True)):
            L.router(first)
            L.router(second)
            if raises:
                with pytest.raises(MoetoolRuntimeError, match=f"^non-finite router logits in MoE layer {L.index} at "
                                                              f"batch 4: results would be meaningless$"):
                    g.check(4)
            else:
                g.check(4)


def test_padding_is_unchecked_in_batch_shaped_and_flattened_outputs():
    """The mask ``[B, S]`` covers an output of either layout: ``[B, S, ...]`` (a router or experts module called on
    the batch's shape) and ``[B * S, ...]`` (flattened tokens). NaN at the padded position (row 0, position 2) of
    either stops nothing; at a real one (row 1, position 2) it does. Masking only the flattened layout stopped a run
    on a NaN in padding of a ``[B, S, ...]`` output."""
    from types import SimpleNamespace

    from moetool.engine.guard import FiniteGuard

    L = SimpleNamespace(index=3, router=torch.nn.Identity(), experts=torch.nn.Identity())
    with FiniteGuard([L]) as g:
        g.mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
        for flat in (False, True):
            for row, raises in ((0, False), (1, True)):
                x = torch.zeros(2, 3, 4)
                x[row, 2, 1] = float("nan")
                L.experts(x.reshape(6, 4) if flat else x)
                if raises:
                    with pytest.raises(MoetoolRuntimeError, match="^non-finite experts output in MoE layer 3 at "
                                                                  "batch 0"):
                        g.check(0)
                else:
                    g.check(0)


def test_output_logits_that_overflow_fp16_stop_the_run_in_one_line_naming_the_batch():
    """The lm_head runs after the last MoE layer, where no guard hook looks: fp16 output logits past 65504 are inf,
    and log_softmax gives an inf/NaN NLL. forward(nll=True) returned perplexity inf (or NaN) with no word, ppl and
    agreement --precisions fp16 stopped with "per-row sums contain NaN/inf: no interval". Now the batch's NLL is read
    with the guard's flags: one line naming the first batch whose scored tokens have a non-finite logit (a plain
    fp16 forward's, the reference) and the dtype."""
    from moetool.data import load_tokens
    from moetool.engine import forward
    from moetool.loading import load

    lm = load("tiny", dtype="fp16")
    bs = 2
    ts = load_tokens(None, lm.tokenizer, 16, 300)
    head = lm.model.get_output_embeddings().weight
    with torch.no_grad():
        head[2] *= 9000  # vocabulary row 2's |logit| (4.1 at most in batch 0, 9.5 in batch 1) passes 65504 in batch 1
    want = None
    with torch.no_grad():
        for i, b in enumerate(ts.batches(bs)):
            logits = lm.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits  # [B, S, V] fp16
            m = b.attention_mask.bool()
            scored = torch.cat([m[:, 1:] & m[:, :-1], torch.zeros_like(m[:, :1])], 1)  # t predicts t+1
            if not torch.isfinite(logits[scored]).all():
                want = i
                break
    assert want is not None and want > 0, want  # a batch after the first: the batch number is checked
    with pytest.raises(MoetoolRuntimeError) as e:
        forward(lm, ts, batch_size=bs, nll=True, quiet=True)
    rows = f"rows {want * bs}-{want * bs + bs - 1}"
    assert str(e.value) == (f"non-finite next-token NLL of tiny at batch {want} ({rows}): "
                            f"the model's output logits are NaN or inf in float16 (fp16's largest number is 65504: try "
                            f"dtype='bf16' or dtype='fp32'); results would be meaningless")


def test_a_moe_layer_overflowing_fp16_or_bf16_names_the_model_and_the_dtype():
    """An expert output past fp16's 65504 is inf in an fp16 forward, the same weights finite in fp32: the line said
    "non-finite experts output in MoE layer 1 at batch 0: results would be meaningless" -- no model (fluctuation runs
    several checkpoints, agreement several precisions: which one?) and no word of the dtype (the output and probe
    lines named it). Now it names the model and, in fp16/bf16, the dtype with what to do; fp32 names no dtype."""
    from moetool.data import load_tokens
    from moetool.engine import forward
    from moetool.loading import load

    layer, bs = 1, 2
    runs = {}
    for dtype in ("fp32", "fp16"):
        lm = load("tiny", dtype=dtype)
        ts = load_tokens(None, lm.tokenizer, 16, 64)
        L = next(L for L in lm.layers if L.index == layer)
        with torch.no_grad():
            for p in L.experts.parameters():  # every expert's weights x 300: an output of every expert x 300^2
                p.mul_(300)
        runs[dtype] = (lm, ts, L)
    # the reference: the fp32 model's layer-1 experts output on batch 0's real tokens passes 65504, and is finite
    lm, ts, L = runs["fp32"]
    outs = []
    h = L.experts.register_forward_hook(lambda m, a, out: outs.append(out[0] if isinstance(out, tuple) else out))
    b = next(iter(ts.batches(bs)))
    with torch.no_grad():
        lm.model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    h.remove()
    top = float(outs[0].abs().max())
    assert math.isfinite(top) and top > 65504, top
    forward(lm, ts, batch_size=bs, quiet=True)  # fp32: runs
    lm, ts, _ = runs["fp16"]
    with pytest.raises(MoetoolRuntimeError) as e:
        forward(lm, ts, batch_size=bs, quiet=True)
    assert str(e.value) == (f"non-finite experts output in MoE layer {layer} of tiny at batch 0 (rows 0-1), computed "
                            f"in float16 (fp16's largest number is 65504: try dtype='bf16' or dtype='fp32'): results would be "
                            f"meaningless")
    lm, ts, L = runs["fp32"]
    with torch.no_grad():
        lm.model.to(torch.bfloat16)
        for p in L.experts.parameters():
            p.mul_(1e17)  # x 300 x 1e17 on each of the expert's two products: past bf16's 3.4e38
    lm.name = "scaled"
    with pytest.raises(MoetoolRuntimeError) as e:
        forward(lm, ts, batch_size=bs, quiet=True)
    assert str(e.value) == (f"non-finite experts output in MoE layer {layer} of scaled at batch 0 (rows 0-1), "
                            f"computed in bfloat16: results would be meaningless")


def test_guard_output_flags_inf_and_nan_nll_with_or_without_layer_flags_and_resets():
    """:meth:`FiniteGuard.output` by hand: an NLL sum of +inf (a target logit of -inf in fp16, its row finite: no
    NaN) stops the run as a NaN does; a bad output is read after clean MoE-layer flags (it is the last value read)
    and with no MoE layer flag at all; two outputs before one check are OR'ed (a bad one then a clean one is bad); and
    a check resets it, so the next clean batch passes. Pass 17: isnan for ~isfinite, dropping the OR, returning
    when no layer flag is set, reading the first value for the last, or not resetting, all passed test_finite."""
    from conftest import build_tiny_model

    from moetool.adapters import find_moe_layers
    from moetool.engine.guard import FiniteGuard

    inf, nan = float("inf"), float("nan")
    msg = "non-finite next-token NLL at batch {b}: the model's output logits are NaN or inf in float32; results"
    for bad in (torch.tensor([3.5, inf]), torch.tensor([nan, 1.0]), torch.tensor([-inf])):
        assert not all(map(math.isfinite, bad.tolist()))
        with FiniteGuard([]) as g:  # no MoE layer hook: the output alone
            g.output(torch.tensor([1.0, 2.0]), torch.float32)
            g.check(0)
            g.output(bad, torch.float32)
            with pytest.raises(MoetoolRuntimeError, match=re.escape(msg.format(b=4))):
                g.check(4)
            g.output(torch.tensor([0.5]), torch.float32)
            g.check(5)  # reset by the check that raised: a clean batch passes
            g.output(bad, torch.float32)
            g.output(torch.tensor([0.5]), torch.float32)  # OR'ed with the bad one before it
            with pytest.raises(MoetoolRuntimeError, match=re.escape(msg.format(b=6))):
                g.check(6)
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad(), FiniteGuard(layers) as g:
        model(input_ids=ids)  # clean layer flags, read first
        g.output(torch.tensor([2.0, inf]), torch.float32)
        assert len(g.flags) == 2 * len(layers)
        with pytest.raises(MoetoolRuntimeError, match=re.escape(msg.format(b=1))):
            g.check(1)


def test_a_mean_nll_past_float64s_range_stops_in_one_line_not_an_overflow_error():
    """Finite but huge output logits (fp32, the final norm x 1e5) give a mean next-token NLL past 709.78 nats, whose
    exp overflows float64: ``forward(...).perplexity`` raised Python's OverflowError (a traceback; the CLI's ppl and
    a --dtype fp32 rerun of an fp16 overflow hit it). Now one line with the NLL, computed here by hand from the
    model's own logits; a mean just under the bound still gives its number."""
    import torch.nn.functional as F

    from moetool.data import load_tokens
    from moetool.engine import forward
    from moetool.engine.runner import MAX_LOG, NLL
    from moetool.loading import load

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 16, 64)
    with torch.no_grad():
        lm.model.model.norm.weight *= 1e5
        total, count = 0.0, 0
        for b in ts.batches(4):
            logits = lm.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.double()
            m = b.attention_mask.bool()
            pair = m[:, 1:] & m[:, :-1]
            nll = F.cross_entropy(logits[:, :-1][pair], b.input_ids[:, 1:][pair], reduction="sum")
            total, count = total + float(nll), count + int(pair.sum())
    assert torch.isfinite(torch.tensor(total)) and total / count > MAX_LOG, total / count
    with pytest.raises(MoetoolRuntimeError) as e:
        forward(lm, ts, batch_size=4, nll=True, quiet=True).perplexity
    line = str(e.value)
    assert "\n" not in line and line.startswith("mean next-token NLL ") and f"over {count} tokens" in line, line
    assert float(line.split()[3]) == pytest.approx(total / count, rel=1e-3), line
    assert NLL(709.0 * 3, 3).ppl == pytest.approx(math.exp(709.0))
    with pytest.raises(MoetoolRuntimeError):
        NLL(710.0 * 3, 3).ppl


def test_a_mean_nll_past_float64s_range_prints_only_the_one_line(tmp_path):
    """The same model (the final norm x 1e5: a mean NLL past 709.78 nats) through ``moetool ppl``: on BASE stderr
    held NumPy's "RuntimeWarning: overflow encountered in exp" (the bootstrap's exp of the per-row NLL ran before
    NLL.ppl's refusal) above the error line; now stderr is that one line, with and without the bootstrap."""
    import os
    import subprocess
    import sys

    from moetool.engine.runner import MAX_LOG
    from moetool.loading import load

    lm = load("tiny")
    with torch.no_grad():
        lm.model.model.norm.weight *= 1e5
    lm.model.save_pretrained(tmp_path / "huge")
    lm.tokenizer.save_pretrained(tmp_path / "huge")
    env = {**os.environ, "MOETOOL_FIGURES": "none"}
    env.pop("PYTHONWARNINGS", None)  # Python's default filters: a RuntimeWarning is printed
    for boot in ("0", "100"):
        r = subprocess.run([sys.executable, "-m", "moetool", "ppl", "--model", str(tmp_path / "huge"), "--max-tokens",
                            "64", "--seq-len", "16", "--bootstrap", boot, "-q", "--out", str(tmp_path / boot)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        m = re.fullmatch(r"error: mean next-token NLL (\S+) nats over 60 tokens: its perplexity exp\(NLL\) is past "
                         r"float64's largest number \(1\.8e308\); the model's output logits are far outside a "
                         r"trained model's: results would be meaningless", r.stderr.strip())
        assert m and float(m.group(1)) > MAX_LOG, r.stderr
