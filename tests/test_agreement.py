"""``moetool agreement``: routing agreement across precisions against plain transformers forwards.

The hand reference loads the embedded tiny Mixtral with transformers itself in each precision (fp8 / mxfp4: the bf16
model whose matrices are replaced, here by their own parameter names, with ``formats.fake_quantize``), runs one
forward per batch with ``output_router_logits=True`` (no moetool engine, no hooks) and computes top-K sets, top-1,
the reference margin, flips and the NLL change with plain torch."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import moetool
from moetool import formats
from moetool.errors import MoetoolError
from moetool.experiments.agreement.compute import (AgreementOptions, CompareRun, ReferenceRun, agreement, load_precision,
                                           run_precision, tables)
from moetool.loading import EMBEDDED_DIR

TINY = EMBEDDED_DIR / "tiny"
THRESHOLDS = (0.001, 0.01, 0.1)
BATCH = 4


@pytest.fixture(scope="module")
def tokens():
    lm = moetool.load("tiny")
    t = moetool.tokens(lm, None, seq_len=64, max_tokens=500)  # 8 rows (two batches of 4), the last one padded
    assert not t.attention_mask.bool().all()
    return t


def hand_model(precision: str):
    """The embedded tiny model as transformers loads it in ``precision``; fp8 / mxfp4: bf16 with the format's
    matrices fake-quantized, chosen by parameter name (fp8: attention projections and experts, not the router
    ``mlp.gate``, embeddings or LM head; mxfp4: the experts only), experts one matrix (gate, up, down) at a time."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype).eval()
    if precision in ("fp8", "mxfp4"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("experts.gate_up_proj"):  # [E, 2I, H], gate rows first
                    inter = p.shape[1] // 2
                    for e in range(p.shape[0]):
                        p[e, :inter] = formats.fake_quantize(p[e, :inter].clone(), precision)
                        p[e, inter:] = formats.fake_quantize(p[e, inter:].clone(), precision)
                elif name.endswith("experts.down_proj"):  # [E, H, I]
                    for e in range(p.shape[0]):
                        p[e] = formats.fake_quantize(p[e].clone(), precision)
                elif precision == "fp8" and "self_attn" in name and name.endswith("_proj.weight"):
                    p.copy_(formats.fake_quantize(p, "fp8"))
    return model


def hand_run(model, tokens, K=2):
    """Per layer: top-K sets (sorted) [T, K], top-1 [T], margin of the softmax [T] over real tokens; per-token NLL
    sum and count."""
    sets, top1, margin = {}, {}, {}
    nll_sum, nll_n = 0.0, 0
    valid = []
    with torch.no_grad():
        for b in range(0, tokens.input_ids.shape[0], BATCH):
            ids, mask = tokens.input_ids[b:b + BATCH], tokens.attention_mask[b:b + BATCH]
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
            valid.append(mask.reshape(-1).bool())
            for j, logits in enumerate(out.router_logits):
                lg = logits.float()
                top = torch.topk(lg, K, dim=-1).indices
                sets.setdefault(j, []).append(top.sort(-1).values)
                top1.setdefault(j, []).append(lg.argmax(-1))
                p = torch.sort(torch.softmax(lg, -1), -1, descending=True).values
                margin.setdefault(j, []).append(p[:, K - 1] - p[:, K])
            lp = F.log_softmax(out.logits.float(), -1)[:, :-1]
            nll = -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            keep = mask[:, 1:].bool() & mask[:, :-1].bool()
            nll_sum += float(nll[keep].double().sum())
            nll_n += int(keep.sum())
    v = torch.cat(valid)
    cat = {j: (torch.cat(sets[j])[v], torch.cat(top1[j])[v], torch.cat(margin[j])[v]) for j in sets}
    return cat, nll_sum / nll_n


@pytest.fixture(scope="module")
def hand(tokens):
    return {p: hand_run(hand_model(p), tokens) for p in ("fp32", "bf16", "fp8")}


@pytest.fixture(scope="module")
def result(tokens):
    return agreement("tiny", tokens, precisions=("bf16", "fp32", "fp8"), thresholds=THRESHOLDS, bootstrap=100,
                     batch_size=BATCH, device="cpu", quiet=True)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_flips_margin_bins_and_nll_by_hand(result, hand, precision, tokens):
    ref, ref_nll = hand["fp32"]
    mine, nll = hand[precision]
    df = result["agreement"].set_index(["precision", "layer"])
    bins = result["agreement_bins"]
    s = result["agreement_summary"].set_index("precision")
    edges = torch.tensor(THRESHOLDS)
    total = [0, 0, 0]
    for j, layer in enumerate(sorted(result.meta["layers"])):  # every layer of the tiny model is MoE
        (rs, r1, rm), (ms, m1, _) = ref[j], mine[j]
        topk = (rs != ms).any(-1)
        one = r1 != m1
        n = rs.shape[0]
        row = df.loc[(precision, layer)]
        assert row["reference"] == "fp32" and row["tokens"] == n
        assert round(row["topk_flip"] * n) == int(topk.sum()) and round(row["top1_flip"] * n) == int(one.sum())
        assert row["margin_mean"] == pytest.approx(float(rm.double().mean()), rel=1e-5)
        b = torch.bucketize(rm, edges, right=True)
        g = bins[(bins.precision == precision) & (bins.layer == layer)].reset_index(drop=True)
        for k in range(len(THRESHOLDS) + 1):
            sel = b == k
            assert g.loc[k, "tokens"] == int(sel.sum())
            if sel.any():
                assert round(g.loc[k, "topk_flip"] * int(sel.sum())) == int(topk[sel].sum())
                assert round(g.loc[k, "top1_flip"] * int(sel.sum())) == int(one[sel].sum())
        total = [total[0] + n, total[1] + int(topk.sum()), total[2] + int(one.sum())]
    # the summary counts each real token once (the mask by hand), its flips over tokens x layers
    assert s.loc[precision, "tokens"] == int(tokens.attention_mask.sum()) == total[0] / 4
    assert s.loc[precision, "layers"] == 4
    assert s.loc[precision, "topk_flip"] == pytest.approx(total[1] / total[0], abs=1e-12)
    assert s.loc[precision, "top1_flip"] == pytest.approx(total[2] / total[0], abs=1e-12)
    assert s.loc[precision, "nll_ref"] == pytest.approx(ref_nll, rel=1e-6)
    assert s.loc[precision, "delta_nll"] == pytest.approx(nll - ref_nll, abs=2e-6)
    assert s.loc[precision, "delta_nll_lo"] <= s.loc[precision, "delta_nll"] <= s.loc[precision, "delta_nll_hi"]
    assert s.loc[precision, "simulated"] == (precision == "fp8")
    if precision == "fp8":
        assert total[1] > 0  # the comparison is not vacuous: fp8 changes some top-K set of the tiny model


@pytest.mark.slow
def test_manifest_says_what_was_simulated(result):
    assert result.meta["reference"] == "fp32" and result.meta["simulated"] == ["fp8"]
    rec = result.meta["precisions"]["fp8"]
    assert rec["simulated"] and rec["format"] == "fp8" and rec["dtype"] == "bfloat16"
    assert rec["matrices"] == 4 * (4 + 3)  # q, k, v, o and the experts' gate, up, down in each of 4 layers
    assert not result.meta["precisions"]["bf16"]["simulated"]
    assert list(result["agreement_summary"]["precision"]) == ["bf16", "fp8"]  # the listed order, reference out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8", "mxfp4"])
def test_the_weights_the_run_used_are_fake_quantize_of_the_bf16_weights(precision):
    lm, rec, owned = load_precision("tiny", precision, "cpu")
    assert owned and rec["simulated"]
    mine = dict(lm.model.named_parameters())
    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    expected = dict(hand_model(precision).named_parameters())
    changed = 0
    for name, p in plain.named_parameters():
        assert mine[name].dtype == p.dtype
        assert torch.equal(mine[name], expected[name]), name
        changed += not torch.equal(mine[name], p)
        if "mlp.gate." in name or "embed" in name or "lm_head" in name or "norm" in name:
            assert torch.equal(mine[name], p), f"{name} must not be quantized"
        if precision == "mxfp4" and "self_attn" in name:
            assert torch.equal(mine[name], p), f"{name}: mxfp4 quantizes the experts only"
    assert changed == (4 * 6 if precision == "fp8" else 4 * 2)


@pytest.mark.slow
def test_the_reference_against_itself_is_exactly_zero(tokens):
    lm, _, _ = load_precision("tiny", "fp32", "cpu")
    opts = AgreementOptions(precisions=("fp32", "bf16"), thresholds=THRESHOLDS, bootstrap=100, batch_size=BATCH)
    ref = ReferenceRun(tokens, lm.layers)
    run_precision(lm, tokens, ref, lm.layers, opts, "ref", True)
    again = CompareRun(tokens, lm.layers, ref, opts.thresholds)
    run_precision(lm, tokens, again, lm.layers, opts, "again", True)
    per_layer, summary, bins = tables("fp32", ref, {"fp32": again}, {"fp32": {"simulated": False}}, opts)
    cols = ["top1_flip", "top1_flip_lo", "top1_flip_hi", "topk_flip", "topk_flip_lo", "topk_flip_hi"]
    assert (per_layer[cols] == 0).all().all() and (summary[cols] == 0).all().all()
    assert (summary[["delta_nll", "delta_nll_lo", "delta_nll_hi"]] == 0).all().all()
    assert (bins[["top1_flip", "topk_flip"]].fillna(0) == 0).all().all()
    assert bins.groupby("layer")["tokens"].sum().eq(int(tokens.attention_mask.sum())).all()


@pytest.mark.slow
def test_padding_that_routes_otherwise_is_never_a_flip(tokens):
    """The compared run sees other ids at the padded positions (right padding: the real tokens' routing cannot
    change, only the padding's): every flip rate and bin is exactly 0, and the padding did route otherwise (checked
    by hand on the routing events), so a flip count that dropped the padding mask would read above 0."""
    import dataclasses

    lm, _, _ = load_precision("tiny", "fp32", "cpu")
    opts = AgreementOptions(precisions=("fp32", "bf16"), thresholds=THRESHOLDS, bootstrap=0, batch_size=BATCH)
    pad = ~tokens.attention_mask.bool()
    other = dataclasses.replace(tokens, input_ids=torch.where(pad, (tokens.input_ids + 7) % 50, tokens.input_ids))
    ref = ReferenceRun(tokens, lm.layers)
    run_precision(lm, tokens, ref, lm.layers, opts, "ref", True)
    moved = []

    class Watch(CompareRun):  # the padded positions' own top-K sets against the reference's, by hand
        def __call__(self, ev):
            idx = ev.idx.reshape(-1, ev.idx.shape[-1]).sort(-1).values
            r = self.ref.idx[ev.layer.index][self._slice].reshape(idx.shape)
            moved.append(int(((idx != r).any(-1) & ~ev.valid.reshape(-1)).sum()))
            super().__call__(ev)

    again = Watch(other, lm.layers, ref, opts.thresholds)
    run_precision(lm, other, again, lm.layers, opts, "again", True)
    per_layer, summary, bins = tables("fp32", ref, {"fp32": again}, {"fp32": {"simulated": False}}, opts)
    assert sum(moved) > 0  # the padding routed otherwise
    assert (per_layer[["top1_flip", "topk_flip"]] == 0).all().all()
    assert (summary[["top1_flip", "topk_flip", "delta_nll"]] == 0).all().all()
    assert (bins[["top1_flip", "topk_flip"]].fillna(0) == 0).all().all()


def test_a_loaded_model_is_used_for_its_own_precision():
    lm = moetool.load("tiny", dtype="fp32")
    same, rec, owned = load_precision(lm, "fp32", "cpu")
    assert same is lm and not owned and rec == {"dtype": "float32", "simulated": False}


@pytest.mark.parametrize("bad, msg", [
    (dict(precisions=("fp32",)), "at least two"),
    (dict(precisions=("fp32", "int4")), "unknown ['int4']"),
    (dict(precisions=("bf16", "bf16")), "given twice"),
    (dict(thresholds=(0.1, 0.01)), "increase strictly"),
    (dict(thresholds=(0.0,)), "finite positive"),
    (dict(bootstrap=5), "too few"),
])
def test_bad_options_are_one_line(bad, msg):
    from moetool.experiments.result import resolve_options

    with pytest.raises(MoetoolError, match=None) as e:  # as the library resolves options (a repeat: Flag.check)
        resolve_options(AgreementOptions, None, bad)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given, ref", [(("bf16", "fp8"), "bf16"), (("fp8", "fp16", "bf16"), "fp16"),
                                        (("mxfp4", "fp8"), "fp8"), (("fp4", "fp32", "bf16"), "fp32")])
def test_the_reference_is_the_most_precise(given, ref):
    assert AgreementOptions(precisions=given).reference == ref


def test_cli_bad_precision_is_one_line_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    r = CliRunner().invoke(app, ["agreement", "tiny", "--precisions", "fp32,fp7", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and r.output.strip().startswith("error: ") and "fp7" in r.output
    assert not (tmp_path / "x").exists()
    r = CliRunner().invoke(app, ["agreement", "tiny", "--model", "tiny-fine", "--out", str(tmp_path / "y")])
    assert r.exit_code != 0 and "twice" in r.output and not (tmp_path / "y").exists()


def test_fp4_groups_that_do_not_divide_the_input_dim_are_one_line_before_any_run(monkeypatch):
    from moetool.experiments.agreement import compute as mod

    lm = moetool.load("tiny", dtype="fp32")
    runs = []
    monkeypatch.setattr(mod, "run_precision", lambda *a, **k: runs.append(a))
    monkeypatch.setattr(mod.formats, "FP4_GROUP", 36)  # 128 and 192 are not multiples of 36
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    with pytest.raises(MoetoolError, match="not a multiple of the format's 36-value groups"):
        agreement(lm, tokens, precisions=("fp32", "mxfp4"), bootstrap=0, quiet=True)
    assert not runs


def test_cli_device_map_reaches_every_per_precision_load(tmp_path, monkeypatch):
    """--device-map auto is passed to each precision's load (the loads are watched); on CPU accelerate places every
    layer on the CPU, so every table equals the run without it (with a GPU it places them there: the same tables'
    shapes, GPU kernels' numbers)."""
    from test_resume import _same_csvs as same_csvs
    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.experiments.agreement import compute as mod

    seen = []

    def watched(name, **kw):
        seen.append((kw["dtype"], kw["device_map"]))
        return load(name, **kw)

    load = mod.load
    monkeypatch.setattr(mod, "load", watched)
    args = ["agreement", "tiny", "--precisions", "fp32,bf16,fp8", "--seq-len", "64", "--max-tokens", "300",
            "--batch-size", "4", "--bootstrap", "100", "--device", "cpu", "--quiet"]
    for name, extra in (("plain", []), ("auto", ["--device-map", "auto"])):
        r = CliRunner().invoke(app, [*args, *extra, "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    assert seen == [("fp32", None), ("bf16", None), ("bf16", None), ("fp32", "auto"), ("bf16", "auto"),
                    ("bf16", "auto")]
    if torch.cuda.is_available():  # accelerate places the layers on the GPU: other kernels, the same tables' shapes
        for name in ("agreement.csv", "agreement_bins.csv", "agreement_summary.csv"):
            a, b = (pd.read_csv(tmp_path / run / name) for run in ("plain", "auto"))
            assert list(a.columns) == list(b.columns) and a.shape == b.shape
        return
    assert same_csvs(tmp_path / "plain", tmp_path / "auto") == ["agreement.csv", "agreement_bins.csv",
                                                                 "agreement_summary.csv"]


@pytest.mark.slow
def test_a_run_that_scored_other_tokens_is_refused_not_compared(tokens):
    """ΔNLL pairs the runs row by row: a compared run whose rows scored other tokens (row 0's last position masked
    out) is one line naming both counts of scored positions (by hand: a real token after a real token), never a
    ΔNLL over different tokens."""
    import dataclasses

    lm, _, _ = load_precision("tiny", "fp32", "cpu")
    opts = AgreementOptions(precisions=("fp32", "bf16"), thresholds=THRESHOLDS, bootstrap=0, batch_size=BATCH)
    mask = tokens.attention_mask.clone()
    assert mask[0].all()
    mask[0, -1] = 0
    other = dataclasses.replace(tokens, attention_mask=mask)
    ref = ReferenceRun(tokens, lm.layers)
    run_precision(lm, tokens, ref, lm.layers, opts, "ref", True)
    again = CompareRun(other, lm.layers, ref, opts.thresholds)
    run_precision(lm, other, again, lm.layers, opts, "again", True)
    m = tokens.attention_mask.bool()
    n = int((m[:, 1:] & m[:, :-1]).sum())
    with pytest.raises(MoetoolError, match=rf"fp32: the runs scored different tokens \({n - 1} vs {n}\)"):
        tables("fp32", ref, {"fp32": again}, {"fp32": {"simulated": False}}, opts)


def test_fp8_leaves_a_router_that_is_an_nn_linear_alone():
    """DBRX's router is an ``nn.Linear`` (``router.layer``): fp8 takes every other ``nn.Linear`` (attention) and the
    experts, never a router's weight nor the LM head. The expected set is written by name from the module tree."""
    from types import SimpleNamespace

    from torch import nn

    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.experiments.agreement.compute import quantized_views

    model = build_tiny("dbrx")
    layers = find_moe_layers(model)
    views = quantized_views(SimpleNamespace(model=model, layers=layers), "fp8")
    router_linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".router." in n}
    assert len(router_linears) == len(layers)  # the test is not vacuous: one nn.Linear router per MoE layer
    want = {n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n not in router_linears and n != "lm_head" and ".experts." not in n}
    linear = {n for n, _ in views if not n.startswith("layer ")}
    assert linear == want
    router_storage = {p.untyped_storage().data_ptr() for L in layers for p in L.router.parameters()}
    assert not router_storage & {w.untyped_storage().data_ptr() for _, w in views}


def test_a_loaded_model_is_not_taken_for_a_simulated_format_of_its_dtype():
    """fp8 computes in bf16 but is not bf16: a loaded bf16 model asked for fp8 is loaded again and fake-quantized
    (an expert matrix by hand), the caller's model untouched."""
    lm = moetool.load("tiny", dtype="bf16")
    name = "model.layers.0.mlp.experts.down_proj"
    before = dict(lm.model.named_parameters())[name].detach().clone()
    got, rec, owned = load_precision(lm, "fp8", "cpu")
    assert got is not lm and owned and rec["simulated"] and rec["format"] == "fp8"
    mine = dict(got.model.named_parameters())[name]
    assert torch.equal(mine[1], formats.fake_quantize(before[1].clone(), "fp8")) and not torch.equal(mine, before)
    assert torch.equal(dict(lm.model.named_parameters())[name], before)


def test_fp4_checks_each_matrix_along_its_input_dim(monkeypatch):
    """FP4/MXFP4 groups run along the input dim (the last of ``[out, in]``): with 96-value groups the experts' gate
    (input: hidden 128) is refused by name while down (input: intermediate 192, a multiple of 96) would pass."""
    from moetool.experiments.agreement import compute as mod

    lm = moetool.load("tiny", dtype="fp32")
    d, inter = lm.config.hidden_size, lm.config.intermediate_size
    assert (d, inter) == (128, 192)
    monkeypatch.setattr(mod.formats, "FP4_GROUP", 96)
    with pytest.raises(MoetoolError, match=rf"--precisions mxfp4: layer 0 experts.gate has an input dim of {d}, "):
        mod.check_formats(lm, ["fp32", "mxfp4"])
    monkeypatch.setattr(mod.formats, "FP4_GROUP", 64)  # divides both: accepted
    mod.check_formats(lm, ["fp32", "mxfp4"])


def test_a_layer_routing_every_expert_is_one_line_before_any_run(monkeypatch):
    """K = n: every precision chooses the same set and there is no (K+1)-th score; one line naming the layer before
    any forward."""
    from types import SimpleNamespace

    from moetool.experiments.agreement import compute as mod

    lm = moetool.load("tiny", dtype="fp32")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    layers = [SimpleNamespace(index=0, top_k=2, n_experts=8), SimpleNamespace(index=1, top_k=4, n_experts=4)]
    runs = []
    monkeypatch.setattr(mod, "load_precision",
                        lambda *a, **k: (SimpleNamespace(layers=layers), {"simulated": False}, False))
    monkeypatch.setattr(mod, "run_precision", lambda *a, **k: runs.append(a))
    with pytest.raises(MoetoolError, match=r"layer 1: routes all 4 experts \(K = n\)"):
        agreement(lm, tokens, precisions=("fp32", "bf16"), bootstrap=0, quiet=True)
    assert not runs


def test_each_precisions_model_is_freed_before_the_next_one_loads(monkeypatch):
    """Agreement loads one precision at a time so that a large model fits once, not three times; but the runs kept
    every precision's MoE layers (``_Run.layers``: the layers, holding the experts' weights) and the loop held the
    model while it collected, so all three stayed in memory to the end. Each loaded model is now garbage when the next
    precision loads, and the tables are those of before (test_flips_margin_bins_and_nll_by_hand checks them)."""
    import gc
    import weakref

    from moetool.experiments.agreement import compute as mod

    alive, real = [], mod.load_precision

    def load_and_watch(*a, **k):
        gc.collect()
        still = [p for p, refs in alive if any(r() is not None for r in refs)]
        assert not still, f"{still} still in memory when {a[1]} loads"
        lm, rec, owned = real(*a, **k)
        alive.append((a[1], [weakref.ref(t) for t in (lm.model, *lm.model.parameters())]))  # the experts' too
        return lm, rec, owned

    monkeypatch.setattr(mod, "load_precision", load_and_watch)
    lm = moetool.load("tiny", dtype="fp32")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=96)
    res = agreement("tiny", tokens, precisions=("fp32", "bf16", "fp8"), bootstrap=0, quiet=True)
    assert [p for p, _ in alive] == ["fp32", "bf16", "fp8"]
    assert set(res["agreement_summary"]["precision"]) >= {"bf16", "fp8"}
    gc.collect()
    assert not any(r() is not None for _, refs in alive for r in refs)  # and none is kept by the result


def test_a_reference_margin_equal_to_a_threshold_is_in_the_bin_above(tokens):
    """agreement_bins' bins are [margin_lo, margin_hi) (as margin's): with the thresholds set to reference margins some
    real tokens have exactly (fp32), those tokens count in the bin that starts there, not the one below it. The
    by-hand test's thresholds (0.001, 0.01, 0.1) meet no margin exactly, so bucketing with right=False passed it."""
    lm = moetool.load("tiny", dtype="fp32")
    opts = AgreementOptions(batch_size=BATCH)
    ref = ReferenceRun(tokens, lm.layers)
    run_precision(lm, tokens, ref, lm.layers, opts, "reference", True)
    valid = tokens.attention_mask.bool()
    L = lm.layers[0].index
    m = ref.margin[L][valid].cpu()  # fp32, the margins the bins are read against
    srt = m.sort().values
    thr = (float(srt[len(srt) // 3]), float(srt[2 * len(srt) // 3]))  # two tokens' own margins, exact in fp32
    cmp = CompareRun(tokens, lm.layers, ref, thr)
    run_precision(lm, tokens, cmp, lm.layers, opts, "compare", True)
    t1, t2 = thr
    assert int((m == t1).sum()) >= 1 and int((m == t2).sum()) >= 1  # the case: margins on the edges
    got = cmp.bins[L][:, 0].cpu().tolist()
    assert got == [int((m < t1).sum()), int(((m >= t1) & (m < t2)).sum()), int((m >= t2).sum())]
    assert cmp.bins[L][:, 1:].sum() == 0  # the same model against itself: no flip in any bin
