"""norm-select: the norm policies against a per-expert hand computation, --layers, agreement, frames, CLI errors."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (build_tiny_model, longcat_unsorted_router_model, mover_by_hand, padded_batch, reference_expert, run,
                      wilson_by_hand)
from typer.testing import CliRunner

from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.data import TokenSet
from moetool.engine.hooks import check_policy
from moetool.errors import MoetoolError
from moetool.experiments.norm_select import compute as ns
from moetool.policies import make_policy

ORD = {"l2": 2.0, "l1": 1.0, "linf": math.inf}


def hand_choice(model_type, layer, h, node, norm, weights):
    """Top-K of a node norm computed expert by expert from the raw weights, and the weights ``--weights`` asks."""
    cfg = layer.config
    n, K = cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts, cfg.num_experts_per_tok
    norms = torch.stack([torch.linalg.vector_norm(reference_expert(model_type, layer, e, h)[node].float(),
                                                  ord=ORD[norm], dim=-1) for e in range(n)], dim=-1)  # [T, n]
    idx = torch.argsort(norms, dim=-1, descending=True)[:, :K]  # [T, K]
    if weights == "softmax":
        w = torch.softmax(norms.gather(-1, idx), dim=-1)
    elif weights == "router":
        p = torch.softmax(F.linear(h, layer.block.gate.weight).float(), dim=-1).gather(-1, idx)
        renorm = model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        w = p / p.sum(-1, keepdim=True) if renorm else p
    else:
        w = torch.full(idx.shape, 1.0 / K)
    return idx, w, norms


CASES = [("mixtral", "gate", "l2", "softmax"), ("mixtral", "up", "l1", "router"), ("mixtral", "act", "linf", "uniform"),
         ("mixtral", "glu", "l2", "router"), ("mixtral", "output", "l1", "softmax"), ("olmoe", "gate", "l2", "router"),
         ("olmoe", "output", "linf", "uniform")]


@pytest.mark.parametrize("model_type,node,norm,weights", CASES)
def test_norm_policy_runs_the_hand_computed_topk(model_type, node, norm, weights):
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    policy = make_policy(f"norm:{node}:{norm}", weights=weights)
    _, events, _ = run(model, layers, padded_batch(), policy=policy)
    changed = 0
    for L in layers:
        ev = events[L.index]
        idx, w, norms = hand_choice(model_type, L, ev.h, node, norm, weights)
        gap = norms.sort(-1, descending=True).values
        clear = (gap[:, idx.shape[1] - 1] - gap[:, idx.shape[1]]) > 1e-4  # no near-tie at the K-th place
        assert clear.float().mean() > 0.8
        assert torch.equal(ev.chosen_idx[clear], idx[clear])
        torch.testing.assert_close(ev.chosen_weights[clear].float(), w[clear].float(), rtol=1e-4, atol=1e-5)
        changed += int((~(ev.chosen_idx.sort(-1).values == ev.idx.sort(-1).values).all(-1)).sum())
    assert changed > 0  # the router's choice really was replaced somewhere


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("weights", ["softmax", "uniform"])
def test_softmax_and_uniform_weights_carry_the_routed_scaling_factor(model_type, weights):
    """DeepSeek multiplies its routing weights by ``routed_scaling_factor`` (1.5 / 2.5 in the tiny configs): a norm
    policy's softmax or uniform weights (summing to one) are scaled by it too, so the routed output keeps the
    model's scale: every real token's chosen weights sum to the config's factor, uniform ones are factor / K each."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    scale = float(model.config.routed_scaling_factor)
    assert scale != 1.0
    _, events, _ = run(model, layers, padded_batch(), policy=make_policy("norm:gate", weights=weights))
    for L in layers:
        ev = events[L.index]
        w = ev.chosen_weights[ev.valid].double()
        K = model.config.num_experts_per_tok
        assert w.shape[-1] == K
        torch.testing.assert_close(w.sum(-1), torch.full((w.shape[0],), scale, dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
        if weights == "uniform":
            assert torch.allclose(w, torch.full_like(w, scale / K), rtol=1e-6, atol=0)


def test_layers_leave_the_other_layers_untouched():
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    inputs = padded_batch()
    target = layers[2].index
    plain, plain_events, _ = run(model, layers, inputs)
    logits, events, _ = run(model, layers, inputs, policy=make_policy("norm:gate"), policy_layers=[target])
    for L in layers:
        ev = events[L.index]
        if L.index != target:  # the router's choice on whatever hidden state reached the layer
            assert torch.equal(ev.chosen_idx, ev.idx) and torch.equal(ev.chosen_weights, ev.weights)
        if L.index <= target:  # nothing upstream of the replaced layer moved
            assert torch.equal(ev.h, plain_events[L.index].h)
    assert not torch.equal(events[target].chosen_idx, events[target].idx)
    # a manual run: my own pre-hook on the target layer's experts with the hand-computed choice
    def manual(module, args):
        h = args[0]
        idx, w, _ = hand_choice("mixtral", layers[2], h, "gate", "l2", "softmax")
        return h, idx, w.to(args[2].dtype)
    handle = layers[2].experts.register_forward_pre_hook(manual)
    try:
        with torch.no_grad():
            ref = model(**inputs).logits
    finally:
        handle.remove()
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    empty, _, _ = run(model, layers, inputs, policy=make_policy("norm:gate"), policy_layers=[])
    assert torch.equal(empty, plain)


def _tokens(rows=3, seq=12):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 1024, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[-1, seq - 5:] = 0  # a right-padded last row, as data.pack makes
    return TokenSet(ids, mask, [""] * rows, "test")


class _LM:
    def __init__(self, model_type):
        self.model = build_tiny_model(model_type)
        self.layers = find_moe_layers(self.model)


def _hand_agreement(events, K, B=2, S=12):
    """Per layer: mean |A ∩ B|/K and top-1 agreement over real tokens (the per-row hand sums, added up)."""
    return {li: (t[:, 0].sum() / t[:, 2].sum(), t[:, 1].sum() / t[:, 2].sum(), t[:, 2].sum())
            for li, t in _hand_row_agreement(events, K, B, S).items()}


@pytest.mark.parametrize("spec", ["router", "norm:glu:l1"])
def test_agreement_equals_a_hand_computation(spec):
    from moetool.experiments.routing import perplexity

    lm, tokens = _LM("mixtral"), _tokens()
    meter, events = ns.AgreementMeter(), []
    perplexity(lm, tokens, policy=make_policy(spec), consumers=[meter, events.append], batch_size=2, quiet=True)
    df = meter.frame(spec)
    assert list(df.columns) == list(ns.AGREEMENT_COLUMNS)
    hand = _hand_agreement(events, K=2)
    assert sorted(df.layer) == sorted(hand) == [L.index for L in lm.layers]
    for r in df.itertuples():
        ov, t1, n = hand[r.layer]
        assert r.tokens == n == tokens.n_tokens
        assert r.topk_overlap == pytest.approx(ov, abs=1e-12) and r.top1_agree == pytest.approx(t1, abs=1e-12)
        if spec == "router":
            assert r.topk_overlap == 1.0 and r.top1_agree == 1.0
    if spec != "router":
        assert df.topk_overlap.min() < 1.0


def test_top1_agree_ranks_an_unsorted_routers_choice_by_its_scores():
    """LongCat-Flash's router returns its top-K unsorted (topk(sorted=False), as DeepSeek-V3 and GLM-4.5; on CPU at
    K = 4 the largest is often not first): top1_agree compares the policy's first expert with the router's chosen
    expert of largest selection score (softmax + correction bias, by hand from the captured logits), not with the
    router's first column. Reading the first column survived the suite: its tiny routers return the top-K sorted."""
    from types import SimpleNamespace

    from conftest import longcat_unsorted_router_model
    from moetool.experiments.routing import perplexity

    model, _, ids = longcat_unsorted_router_model(4, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, -6:] = 0
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    meter, events = ns.AgreementMeter(), []
    perplexity(lm, TokenSet(ids, mask, [""] * 4, "test"), policy=make_policy("norm:glu:l1"),
               consumers=[meter, events.append], batch_size=4, quiet=True)
    df = meter.frame("norm:glu:l1").set_index("layer")
    unsorted = parted = 0
    for ev in events:  # one batch: one event per layer
        v = ev.valid
        sel = torch.softmax(ev.logits.double(), -1) + ev.layer.router.e_score_correction_bias.double()
        best = ev.idx.gather(1, sel.gather(1, ev.idx).argmax(-1, keepdim=True))[:, 0]
        want = float((ev.chosen_idx[:, 0] == best)[v].double().mean())
        assert df.loc[ev.layer.index, "top1_agree"] == pytest.approx(want, abs=1e-12)
        assert df.loc[ev.layer.index, "tokens"] == int(v.sum()) == 74
        unsorted += int((best != ev.idx[:, 0])[v].sum())
        parted += float((ev.chosen_idx[:, 0] == ev.idx[:, 0])[v].double().mean()) != want
    assert unsorted > 0 and parted > 0  # the router's first column is not its best, and the readings part



@pytest.mark.parametrize("spec", [None, "router"])
def test_the_routers_own_choice_agrees_with_itself_on_an_unsorted_router(spec):
    """The model's own routing measured against itself: top1_agree and topk_overlap are 1 on every layer, also where
    the router returns its top-K unsorted (LongCat-Flash, its first column often not its best). Pass 17: comparing
    the router's first column with its best gave the router itself a top1_agree below 1 there
    and passed test_norm_select, whose tiny routers are sorted."""
    from types import SimpleNamespace

    from moetool.experiments.routing import perplexity

    model, _, ids = longcat_unsorted_router_model(4, torch.Generator().manual_seed(1))
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    meter, events = ns.AgreementMeter(), []
    perplexity(lm, TokenSet(ids, torch.ones_like(ids), [""] * 4, "test"),
               policy=None if spec is None else make_policy(spec), consumers=[meter, events.append], batch_size=4,
               quiet=True)
    sel = [torch.softmax(ev.logits.double(), -1) + ev.layer.router.e_score_correction_bias.double() for ev in events]
    assert any(bool((ev.idx[:, 0] != ev.idx.gather(1, s.gather(1, ev.idx).argmax(-1, keepdim=True))[:, 0]).any())
               for ev, s in zip(events, sel))  # the first column is not always the best
    df = meter.frame(spec or "router")
    assert len(df) == len(lm.layers) and (df.top1_agree == 1.0).all() and (df.topk_overlap == 1.0).all()
    assert (df.tokens == 80).all()

def test_sweep_frames_and_table():
    lm, tokens = _LM("mixtral"), _tokens()
    specs = ns.sweep_specs(["gate", "output"], ["l2"])
    assert specs == ["router", "norm:gate:l2", "norm:output:l2"]
    res = ns.run_norm_select(lm, tokens, [make_policy(s) for s in specs], data="rand", policy_layers=[1, 3],
                             batch_size=2, quiet=True)
    assert list(res.agreement.columns) == list(ns.AGREEMENT_COLUMNS)
    assert list(res.quality.columns) == list(ns.QUALITY_COLUMNS)
    assert set(res.agreement.layer) == {1, 3}  # only the replaced layers
    q = res.quality.set_index("policy")
    assert (res.quality.task == "rand").all() and (res.quality.metric == "perplexity").all()
    assert q.loc["router", "ratio"] == 1.0
    for s in specs:
        assert q.loc[s, "ratio"] == pytest.approx(q.loc[s, "value"] / q.loc["router", "value"])
    assert q.loc["norm:gate:l2", "value"] != q.loc["router", "value"]
    t = ns.table1(res.agreement, res.quality)
    assert list(t.node) == ["router", "gate", "output"] and list(t.norm) == ["-", "l2", "l2"]
    assert t.loc[0, "top-K overlap"] == 1.0 and t.loc[0, "ppl ratio"] == 1.0
    a = res.agreement[res.agreement.policy == "norm:gate:l2"]
    assert t.loc[1, "top-K overlap"] == pytest.approx((a.topk_overlap * a.tokens).sum() / a.tokens.sum())
    with pytest.raises(MoetoolError):
        ns.run_norm_select(lm, tokens, [make_policy("norm:gate")], batch_size=2, quiet=True)


def test_parse_nodes_and_norms():
    assert ns.parse_nodes("all") == ["gate", "up", "act", "glu", "output"]
    assert ns.parse_nodes("output, gate") == ["output", "gate"]  # a repeat: the flag's check refuses it
    assert ns.parse_norms("l1,linf") == ["l1", "linf"]
    for bad in ("", " , ", "gates", "gate,foo"):
        with pytest.raises(MoetoolError):
            ns.parse_nodes(bad)
    with pytest.raises(MoetoolError):
        ns.parse_norms("l3")


BAD_FLAGS = [
    ("norm-select", ["--nodes", "gaet"]), ("norm-select", ["--nodes", ""]), ("norm-select", ["--nodes", ","]),
    ("norm-select", ["--norm", "l3"]), ("norm-select", ["--weights", "softmaxx"]),
    ("norm-select", ["--layers", "x-1"]), ("norm-select", ["--tasks", ""]),
    ("ppl", ["--routing", "routr"]), ("ppl", ["--routing", "norm:gaet"]), ("ppl", ["--routing", "norm:gate:l5"]),
    ("ppl", ["--routing", "norm"]), ("ppl", ["--routing", ""]), ("ppl", ["--weights", "soft"]),
    ("eval", ["--tasks", ""]), ("eval", ["--tasks", "moetool_code", "--routing", "norm:glue"]),
    ("eval", ["--tasks", "moetool_code", "--include-path", "/no/such/dir"]),
    ("eval", ["--tasks", "moetool_code", "--weights", "x"]),
]


@pytest.mark.parametrize("command,args", BAD_FLAGS)
def test_bad_flags_are_one_line_exit_2(command, args, tmp_path):
    """norm-select, ppl and eval: a bad flag value is one line on stderr, exit code 2, before any model loads."""
    r = CliRunner().invoke(app, [command, "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def _hand_row_agreement(events, K, B, S):
    """Per layer, per packed row: [Σ |A ∩ B|/K, Σ top-1 agree, real tokens] over real tokens, python sets, from
    captured idx; events arrive batch by batch (B rows of S tokens), every layer once per batch."""
    out, seen = {}, {}
    for ev in events:
        li = ev.layer.index
        b = seen.get(li, 0)  # batch number of this layer's event
        seen[li] = b + 1
        rows = out.setdefault(li, {})
        probs = torch.softmax(ev.logits.float(), -1)
        for t in range(ev.h.shape[0]):
            s = rows.setdefault(b * B + t // S, [0.0, 0.0, 0.0])
            if not bool(ev.valid[t]):
                continue
            pol, ref = ev.chosen_idx[t].tolist(), ev.idx[t].tolist()
            s[0] += len(set(pol) & set(ref)) / K
            s[1] += int(pol[0] == max(ref, key=lambda e: float(probs[t, e])))
            s[2] += 1
    return {li: np.array([rows[r] for r in sorted(rows)]) for li, rows in out.items()}


def test_bootstrap_columns_equal_independent_intervals_from_per_row_sums():
    from test_ppl import hand_row_nll

    from moetool.uncertainty import ratio_intervals

    lm, tokens = _LM("mixtral"), _tokens(rows=5)
    specs = ["router", "norm:gate:l2"]
    res = ns.run_norm_select(lm, tokens, [make_policy(s) for s in specs], data="rand", batch_size=2, quiet=True,
                             bootstrap=300, seed=1)
    events = []
    from moetool.experiments.routing import perplexity
    perplexity(lm, tokens, policy=make_policy("norm:gate:l2"), consumers=[events.append], batch_size=2, quiet=True)
    hand = _hand_row_agreement(events, K=2, B=2, S=tokens.input_ids.shape[1])
    a = res.agreement[res.agreement.policy == "norm:gate:l2"].set_index("layer")
    for li, t in hand.items():
        ov, t1 = ratio_intervals(t[:, :2], t[:, 2], n_boot=300, seed=1)
        row = a.loc[li]
        assert (row.topk_overlap, row.topk_overlap_lo, row.topk_overlap_hi) == pytest.approx((ov.value, ov.lo, ov.hi),
                                                                                             abs=1e-12)
        assert (row.top1_agree, row.top1_agree_lo, row.top1_agree_hi) == pytest.approx((t1.value, t1.lo, t1.hi),
                                                                                       abs=1e-12)
        assert row.topk_overlap_lo <= row.topk_overlap <= row.topk_overlap_hi
        assert row.top1_agree_lo < row.top1_agree_hi
    # pooled over layers (the Table-1 column)
    pooled = sum(hand.values())
    ov, _ = ratio_intervals(pooled[:, :2], pooled[:, 2], n_boot=300, seed=1)
    t = ns.table1(res.agreement, res.quality, overall=res.overall).set_index("node")
    assert (t.loc["gate", "top-K overlap_lo"], t.loc["gate", "top-K overlap_hi"]) == pytest.approx((ov.lo, ov.hi))
    # perplexity: the router run is the plain model (my own per-row NLL); ratio paired on the same rows
    nll, cnt = hand_row_nll(lm.model, tokens, 2)
    q = res.quality.set_index("policy")
    base = ratio_intervals(nll, cnt, n_boot=300, seed=1, transform=np.exp)[0]
    assert (q.loc["router", "value_lo"], q.loc["router", "value_hi"]) == pytest.approx((base.lo, base.hi), rel=1e-6)
    assert (q.loc["router", "ratio_lo"], q.loc["router", "ratio_hi"]) == (1.0, 1.0)
    g = q.loc["norm:gate:l2"]
    assert g.value_lo <= g.value <= g.value_hi and g.ratio_lo <= g.ratio <= g.ratio_hi and g.ratio_lo < g.ratio_hi
    # bootstrap=0: the same values, NaN bounds
    off = ns.run_norm_select(lm, tokens, [make_policy(s) for s in specs], data="rand", batch_size=2, quiet=True)
    assert off.quality.value.tolist() == pytest.approx(res.quality.value.tolist(), rel=1e-12)
    assert off.agreement.topk_overlap_lo.isna().all() and off.quality.value_lo.isna().all()


FAKE_ACC = {"router": {"mmlu": (0.7035, 0.0037), "arc_challenge": (0.6212, 0.0142)},
            "norm:gate:l2": {"mmlu": (0.6666, 0.0038), "arc_challenge": (0.5879, 0.0144)},
            "norm:up:l2": {"mmlu": (0.60, 0.0040), "arc_challenge": (0.5900, 0.0144)}}


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """lm-eval replaced by fixed accuracies with standard errors per policy (no network, no lm-eval run)."""
    from moetool.experiments.eval import compute as lmeval

    def evaluate(lm, plan, *, policy=None, limit=None, **kw):  # lm-eval's results dict, read by moetool
        name = policy.name if policy is not None else "router"
        results = {t: {"alias": t, "acc,none": v, "acc_stderr,none": se}
                   for t, (v, se) in FAKE_ACC.get(name, FAKE_ACC["router"]).items() if t in plan.names}
        return lmeval.EvalResult(lmeval.results_frame({"results": results}), 0.5, {})

    monkeypatch.setattr(lmeval, "evaluate", evaluate)
    monkeypatch.setattr(lmeval, "make_hflm", lambda lm, batch_size=8: None)
    return lmeval.TaskPlan(names=["mmlu", "arc_challenge"], specs=[], include_path=None, include_defaults=False,
                           offline=True, shipped_dir=None)


def test_lm_eval_intervals_and_the_aoe_table1_layout(fake_lm_eval):
    from moetool.experiments.published import console_layout
    lm, tokens = _LM("mixtral"), _tokens(rows=4)
    lm.name = "mistralai/Mixtral-8x7B-v0.1"
    res = ns.norm_select(lm, tokens, nodes=("gate", "up"), batch_size=2, bootstrap=200, plan=fake_lm_eval,
                         quiet=True)
    q = res["quality"]
    acc = q[q.metric == "acc"].set_index(["policy", "task"])
    for (pol, task), r in acc.iterrows():
        v, se = FAKE_ACC[pol][task]
        b, se_b = FAKE_ACC["router"][task]
        n = v * (1 - v) / se ** 2 + 1  # the items lm-eval's stderr implies (no n-samples here)
        assert (r.value_lo, r.value_hi) == pytest.approx(wilson_by_hand(v, n), abs=1e-6)  # Wilson, inside [0, 1]
        assert r.stderr == se  # lm-eval's own standard error, as in eval.csv
        n_b = b * (1 - b) / se_b ** 2 + 1
        # retention: MOVER-R, the roots of Fieller's equations from the two Wilson intervals (conftest, by hand)
        want = (1.0, 1.0) if pol == "router" else mover_by_hand(v, *wilson_by_hand(v, n), b, *wilson_by_hand(b, n_b))
        assert (r.ratio_lo, r.ratio_hi) == pytest.approx(want, rel=1e-6)
        assert r.ratio_lo <= r.ratio <= r.ratio_hi
    # seconds: the perplexity pass plus the one lm-eval run of all tasks (0.5 s each here), not once per task
    summary = res.summary.set_index("node")
    for node, pol in (("router", "router"), ("gate", "norm:gate:l2"), ("up", "norm:up:l2")):
        ppl_s = q[(q.policy == pol) & (q.metric == "perplexity")].seconds.iloc[0]
        assert (q[(q.policy == pol) & (q.metric == "acc")].seconds == 0.5).all()
        assert summary.loc[node, "seconds"] == pytest.approx(ppl_s + 0.5, abs=1e-9)
    t = res["aoe_table1"].set_index("row")
    best = t.loc["best node"]
    assert best["mmlu node"] == "gate:l2" and best["arc_challenge node"] == "up:l2"  # highest retention per task
    assert best["mmlu retention paper"] == pytest.approx(0.948) and best["arc_challenge retention paper"] == 0.946
    assert best["mmlu retention measured"] == pytest.approx(0.6666 / 0.7035)  # a fraction, as in quality.csv
    n_a, n_b = 0.6666 * 0.3334 / 0.0038 ** 2 + 1, 0.7035 * 0.2965 / 0.0037 ** 2 + 1
    d = mover_by_hand(0.6666, *wilson_by_hand(0.6666, n_a), 0.7035, *wilson_by_hand(0.7035, n_b))
    assert (best["mmlu retention measured_lo"], best["mmlu retention measured_hi"]) == pytest.approx(d, rel=1e-6)
    assert best["mmlu retention Δ"] == pytest.approx(0.6666 / 0.7035 - 0.948)
    assert t.loc["router", "mmlu acc paper"] == pytest.approx(0.7035) and t.loc["router", "mmlu acc measured"] == 0.7035
    assert t.loc["router", "mmlu acc measured"] == q.set_index(["policy", "task", "metric"]).loc[
        ("router", "mmlu", "acc"), "value"]  # one unit per quantity across the tables
    title, shown = console_layout(res["aoe_table1"])
    assert "Table 1" in title and "mmlu retention paper" in shown.columns
    assert shown.set_index("row").loc["best node", "mmlu retention measured"].startswith("0.94")
    # another model: the same layout, measured only, and the title says the paper has no numbers for it
    lm.name = "tiny"
    other = ns.norm_select(lm, tokens, nodes=("gate", "up"), batch_size=2, bootstrap=0, plan=fake_lm_eval,
                           quiet=True)
    title, shown = console_layout(other["aoe_table1"])
    assert "not tiny" in title and "measured only" in title
    assert not [c for c in shown.columns if "paper" in c or "Δ" in c]
    # lm-eval's standard errors still give the accuracy/retention intervals without the bootstrap
    assert shown.set_index("row").loc["best node", "mmlu retention measured"] == "0.948 ± 0.014"


# tables and console only (no_figures): norm-select's figures are tests/test_help_files.py's
@pytest.mark.slow
def test_the_issue_command_line_prints_aoe_table1_offline(fake_lm_eval, monkeypatch, tmp_path, no_figures):
    """`moetool norm-select --tasks mmlu,arc_challenge --num-fewshot 5` with lm-eval faked (no network) on the
    embedded tiny model: measured-only AoE layout and a line saying why; with the model taken for Mixtral 8x7B the
    paper's numbers stand beside the measured ones."""
    import pandas as pd

    from moetool.experiments import published
    from moetool.experiments.eval import compute as lmeval

    monkeypatch.setattr(lmeval, "plan_tasks", lambda names, include_path=None: fake_lm_eval)
    args = ["norm-select", "--model", "tiny", "--tasks", "mmlu,arc_challenge", "--num-fewshot", "5", "--nodes",
            "gate,up", "--max-tokens", "512", "--seq-len", "64", "--bootstrap", "200"]  # no -q: it prints no tables
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a")], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "not tiny: measured only" in text
    assert "mmlu retention measured" in text and "paper" not in text.split("not tiny")[1]
    t = pd.read_csv(tmp_path / "a" / "aoe_table1.csv").set_index("row")
    assert t.loc["best node", "mmlu node"] == "gate:l2" and "mmlu retention paper" not in t.columns
    monkeypatch.setattr(published, "paper_model", lambda model: "mixtral-8x7b")
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "Table 1: paper beside measured" in text
    t = pd.read_csv(tmp_path / "b" / "aoe_table1.csv").set_index("row")
    assert t.loc["best node", "mmlu retention paper"] == pytest.approx(0.948)
    assert t.loc["router", "arc_challenge acc paper"] == pytest.approx(0.6212)
    assert t.loc["best node", "mmlu retention measured"] == pytest.approx(0.6666 / 0.7035)
    table = text.split("Table 1: paper beside measured")[1]
    assert "paper" in table and "Δ" in table and "0.6212" in table  # the paper's router ARC-C accuracy


def test_norm_select_on_a_pruned_model(tmp_path):
    """--prune: 'router' is the pruned router (its perplexity is ppl --routing prune:...), each norm policy takes
    the K largest hand-computed norms among the kept experts, agreement is with the pruned router's choice, and
    pruning nothing (random:0) gives the unpruned tables exactly."""
    import json

    import pandas as pd

    from moetool.experiments.routing import perplexity

    lm, tokens = _LM("mixtral"), _tokens()
    removed = {L.index: [0, 3, 5] for L in lm.layers}
    path = tmp_path / "removed.json"
    path.write_text(json.dumps(removed))
    res = ns.norm_select(lm, tokens, nodes=("gate", "glu"), prune=f"file:{path}", batch_size=2, bootstrap=0,
                         quiet=True)
    q = res["quality"].set_index("policy")
    assert list(q.index) == ["router", "norm:gate:l2", "norm:glu:l2"]
    pruned_router = perplexity(lm, tokens, policy=make_policy(f"prune:file:{path}"), batch_size=2, quiet=True)
    plain_router = perplexity(lm, tokens, policy=make_policy("router"), batch_size=2, quiet=True)
    assert q.loc["router", "value"] == pytest.approx(pruned_router.perplexity, rel=1e-12)
    assert abs(q.loc["router", "value"] - plain_router.perplexity) > 1e-3  # pruning changed the model
    assert res.meta["pruned"]["removed"] == {str(k): v for k, v in removed.items()}
    a = res["agreement"]
    assert (a[a.policy == "router"].topk_overlap == 1.0).all() and (a[a.policy == "router"].top1_agree == 1.0).all()

    # the norm policy on the pruned model against the hand computation from raw weights
    prune = make_policy(f"prune:file:{path}")
    pol = make_policy("norm:gate:l2")
    pol.among = prune
    _, events, _ = run(lm.model, lm.layers, padded_batch(), policy=pol)
    for L in lm.layers:
        ev = events[L.index]
        assert not torch.isin(ev.chosen_idx, torch.tensor(removed[L.index])).any()
        _, _, norms = hand_choice("mixtral", L, ev.h, "gate", "l2", "softmax")
        norms[:, removed[L.index]] = -math.inf
        gap = norms.sort(-1, descending=True).values
        idx = torch.argsort(norms, dim=-1, descending=True)[:, :2]
        clear = (gap[:, 1] - gap[:, 2]) > 1e-4
        assert clear.float().mean() > 0.8 and torch.equal(ev.chosen_idx[clear], idx[clear])

    # agreement with the pruned router's choice, by hand from the logits the policy's run saw
    evs = []
    perplexity(lm, tokens, policy=pol, consumers=[evs.append], batch_size=2, quiet=True)
    sums: dict[int, list[float]] = {}
    for ev in evs:
        logits = ev.logits.float().clone()
        logits[:, removed[ev.layer.index]] = -math.inf
        ref = torch.topk(logits, 2, dim=-1).indices  # Mixtral: the top-K of the logits among the kept
        v = ev.valid
        ov = (ev.chosen_idx.unsqueeze(-1) == ref.unsqueeze(-2)).any(-1).sum(-1).double() / 2
        t1 = (ev.chosen_idx[:, 0] == ref[:, 0]).double()
        s = sums.setdefault(ev.layer.index, [0.0, 0.0, 0.0])
        s[0] += float(ov[v].sum()); s[1] += float(t1[v].sum()); s[2] += float(v.sum())
    for r in a[a.policy == "norm:gate:l2"].itertuples():
        ov, t1, n = sums[r.layer]
        assert r.tokens == n and r.topk_overlap == pytest.approx(ov / n, abs=1e-12)
        assert r.top1_agree == pytest.approx(t1 / n, abs=1e-12)

    # pruning nothing is the unpruned sweep, number for number
    zero = ns.norm_select(lm, tokens, nodes=("gate", "glu"), prune="random:0", batch_size=2, bootstrap=0, quiet=True)
    plain = ns.norm_select(lm, tokens, nodes=("gate", "glu"), batch_size=2, bootstrap=0, quiet=True)
    for t in ("agreement", "quality"):
        pd.testing.assert_frame_equal(zero[t].drop(columns="seconds", errors="ignore"),
                                      plain[t].drop(columns="seconds", errors="ignore"))


@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe"])
def test_router_weights_on_a_pruned_model_are_the_pruned_routers(model_type, tmp_path):
    """norm-select --prune ... --weights router: the chosen experts weigh what the pruned model's router gives them,
    a softmax over the kept experts' logits (these families do not renormalise over the chosen K). They weighed the
    full model's p_e, the removed experts' mass included: layer 0's chosen weights summed to 0.154 on average where
    the pruned router's sum to 0.487 (olmoe, 4 of 8 removed), unlike the pruned router baseline they are compared
    with."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    removed = [0, 3, 4, 7]
    path = tmp_path / "removed.json"
    path.write_text(json.dumps({str(L.index): removed for L in layers}))
    prune = make_policy(f"prune:file:{path}")
    pol = make_policy("norm:gate:l2", weights="router")
    pol.among = prune
    _, events, _ = run(model, layers, padded_batch(), policy=pol)
    for L in layers:
        ev = events[L.index]
        assert not L.renormalize
        logits = ev.logits[:, :L.n_experts].float().clone()
        full = torch.softmax(logits, -1).gather(-1, ev.chosen_idx)
        logits[:, removed] = -math.inf
        want = torch.softmax(logits, -1).gather(-1, ev.chosen_idx) * L.weight_scale  # softmax over the kept
        torch.testing.assert_close(ev.chosen_weights.float(), want, rtol=1e-5, atol=1e-7)
        assert (want > full * L.weight_scale * 1.01).all()  # the full model's p_e weigh less


@pytest.mark.slow
def test_the_console_title_says_95_percent_intervals_only_where_there_are_some(tmp_path, no_figures):
    """``moetool norm-select --bootstrap 0`` printed 'norm-select on tiny (weights softmax; 95% intervals)' over a
    table of bare numbers (no *_lo/*_hi anywhere in quality.csv). The title now says what the table holds."""
    import pandas as pd

    for boot, want in (("0", "(weights softmax; no intervals (--bootstrap 0))"),
                       ("100", "(weights softmax; 95% intervals)")):
        out = CliRunner().invoke(app, ["norm-select", "--nodes", "gate", "--max-tokens", "512", "--seq-len", "32",
                                       "--bootstrap", boot, "--out", str(tmp_path / boot)])
        assert out.exit_code == 0, out.output
        title = next(ln for ln in out.output.splitlines() if "norm-select on tiny" in ln)
        assert want in title, title
        q = pd.read_csv(tmp_path / boot / "quality.csv")
        assert q[q.policy != "router"].value_lo.notna().all() == (boot != "0")


def test_norm_select_prune_flag_is_one_line(tmp_path):
    out = CliRunner().invoke(app, ["norm-select", "--prune", "frequency:0.5", "--max-tokens", "64", "-q",
                                   "--out", str(tmp_path / "r")])
    assert out.exit_code == 2, out.output
    assert "importance" in out.output and len(out.output.strip().splitlines()) == 1


def test_a_split_aoe_table_repeats_the_row_label_not_the_first_tasks_best_node():
    """`norm-select --tasks moetool_code,moetool_prose`: the AoE layout split for 80 columns repeated 'moetool_code
    node' in every part as if it labelled the rows, so prose's retention (0.89, of gate:l2) stood beside code's best
    node (output:l2). Only 'row' is repeated; each task's node stays in the part with its own numbers."""
    import pandas as pd
    from rich.console import Console

    from moetool.experiments.published import aoe_table1, console_layout
    from moetool.report.console import render_table

    tasks = ("moetool_code", "moetool_prose")
    rows = {"router": (0.50, 0.60, 1.0, 1.0), "output:l2": (0.43, 0.516, 0.86, 0.86), "gate:l2": (0.40, 0.534, 0.80,
                                                                                                   0.89)}
    table = pd.DataFrame([{"node": k.split(":")[0], "norm": k.split(":")[-1],
                           **{f"{t} acc": v[i] for i, t in enumerate(tasks)},
                           **{f"{t} acc_lo": v[i] - 0.1 for i, t in enumerate(tasks)},
                           **{f"{t} acc_hi": v[i] + 0.1 for i, t in enumerate(tasks)},
                           **{f"{t} retention": v[2 + i] for i, t in enumerate(tasks)},
                           **{f"{t} retention_lo": v[2 + i] - 0.21 for i, t in enumerate(tasks)},
                           **{f"{t} retention_hi": v[2 + i] + 0.21 for i, t in enumerate(tasks)}}
                          for k, v in rows.items()])
    title, shown = console_layout(aoe_table1(table, "tiny", tasks=tasks))
    parts = render_table(shown, title=title, width=80)
    assert len(parts) >= 2
    for part in parts:
        heads = [c.header.plain for c in part.columns]
        assert heads[0] == "row" and heads.count("moetool_code node") <= 1
        for t in tasks:  # a task's retention is in the part that holds the task's node, beside it
            if f"{t} retention measured" in heads:
                assert f"{t} node" in heads
        con = Console(width=80, file=open("/dev/null", "w"), record=True)
        con.print(part)
        text = con.export_text()
        if "moetool_prose retention measured" in heads:
            assert "gate:l2" in text and "output:l2" not in text


def test_aoe_table1_keeps_each_retention_interval_beside_its_value_and_the_routers_is_one():
    """aoe_table1.csv (demo's norm-select) had the columns of the first row, the router's, which had no retention
    bounds: ``moetool_code retention measured_lo/_hi`` came last, after the other task's columns, and the router's
    were empty where quality.csv gives its ratio exactly [1, 1]. Now every bound sits beside its value."""
    import pandas as pd

    from moetool.experiments.published import aoe_table1

    tasks = ("moetool_code", "moetool_prose")
    rows = {"router": (0.80, 0.65, 1.0, 1.0, 1.0, 1.0), "gate:l2": (0.70, 0.60, 0.875, 0.923, 0.55, 0.47)}
    table = pd.DataFrame([{"node": k.split(":")[0], "norm": k.split(":")[-1],
                           **{f"{t} acc": v[i] for i, t in enumerate(tasks)},
                           **{f"{t} acc_lo": v[i] - 0.2 for i, t in enumerate(tasks)},
                           **{f"{t} acc_hi": v[i] + 0.1 for i, t in enumerate(tasks)},
                           **{f"{t} retention": v[2 + i] for i, t in enumerate(tasks)},
                           **{f"{t} retention_lo": v[4 + i] if k != "router" else 1.0 for i, t in enumerate(tasks)},
                           **{f"{t} retention_hi": 2 * v[2 + i] - v[4 + i] for i, t in enumerate(tasks)}}
                          for k, v in rows.items()])
    out = aoe_table1(table, "tiny", tasks=tasks)
    cols = list(out.columns)
    assert cols == ["row"] + [f"{t} {c}" for t in tasks for c in (
        "node", "acc measured", "acc measured_lo", "acc measured_hi", "retention measured", "retention measured_lo",
        "retention measured_hi")]
    t = out.set_index("row")
    for task in tasks:
        assert (t.loc["router", f"{task} retention measured_lo"], t.loc["router", f"{task} retention measured_hi"]) \
            == (1.0, 1.0)
    assert t.loc["best node", "moetool_code retention measured_lo"] == 0.55
    assert t.loc["best node", "moetool_prose retention measured_hi"] == pytest.approx(2 * 0.923 - 0.47)


def test_an_lm_eval_task_reporting_perplexity_is_not_taken_for_the_datas():
    """Break-it run 5: a loglikelihood task (lambada's kind) reports a metric named ``perplexity``; norm-select's
    retention figure took every ``perplexity`` row of quality.csv as the data's, drawing the task's ratio (600/300)
    beside the data's (80/50) under the same policy labels, and the Table-1 seconds left out the lm-eval time of a
    task whose only metric is that one. The data's rows are the data's task only; the seconds add the lm-eval run."""
    from types import SimpleNamespace

    import pandas as pd

    from moetool.experiments.eval import compute as lmeval
    from moetool.experiments.norm_select.figures import plot_norm_select

    ppl = {"router": SimpleNamespace(perplexity=50.0, seconds=1.0, rows=None),
           "norm:gate:l2": SimpleNamespace(perplexity=80.0, seconds=2.0, rows=None)}
    evals = {name: lmeval.EvalResult(lmeval.results_frame({"results": {"lambada_like": {
        "alias": "lambada_like", "perplexity,none": v, "perplexity_stderr,none": 10.0}}}), 0.5, {})
        for name, v in (("router", 300.0), ("norm:gate:l2", 600.0))}
    quality = ns.quality_frame(ppl, evals, "heldout")
    assert sorted(quality.metric) == ["perplexity"] * 4  # the data's and the task's, two per policy
    agreement = pd.DataFrame({"layer": [0, 0], "policy": ["router", "norm:gate:l2"], "topk_overlap": [1.0, 0.5],
                              "top1_agree": [1.0, 0.5], "tokens": [10, 10]})
    fig = plot_norm_select(agreement, quality, tasks=["lambada_like"])["retention"]
    bars = [round(b.get_height(), 12) for b in fig.axes[0].patches]
    assert bars == [1.0, 80.0 / 50.0]  # one bar per policy: the data's perplexity ratio
    table = ns.table1(agreement, quality).set_index("node")
    assert table.loc["router", "ppl"] == 50.0 and table.loc["gate", "ppl"] == 80.0
    assert table.loc["router", "seconds"] == 1.5 and table.loc["gate", "seconds"] == 2.5  # + the lm-eval run


def test_retention_over_a_zero_base_accuracy_is_nan_not_an_error():
    """A task the router scores 0 on: retention a / 0 is undefined, so that row's ratio and interval are NaN (not a
    crash of the whole run); the other task keeps its MOVER-R interval (conftest.mover_by_hand from the two Wilson
    intervals over the item counts the stderrs imply)."""
    from moetool.experiments.eval import compute as lmeval

    def result(acc):
        res = {t: {"acc,none": v, "acc_stderr,none": se} for t, (v, se) in acc.items()}
        return lmeval.EvalResult(lmeval.results_frame({"results": res}), 0.5, {})

    base = result({"zero": (0.0, 0.0), "half": (0.5, 0.02)})
    mine = result({"zero": (0.1, 0.03), "half": (0.4, 0.025)})
    rows = {r["task"]: r for r in ns.eval_rows("norm:gate:l2", mine, base)}
    z = rows["zero"]
    assert z["value"] == 0.1 and z["router_value"] == 0.0
    assert all(math.isnan(z[c]) for c in ("ratio", "ratio_lo", "ratio_hi"))
    n_a, n_b = 0.4 * 0.6 / 0.025 ** 2 + 1, 0.5 * 0.5 / 0.02 ** 2 + 1
    h = rows["half"]
    want = mover_by_hand(0.4, *wilson_by_hand(0.4, n_a), 0.5, *wilson_by_hand(0.5, n_b))
    assert (h["ratio"], h["ratio_lo"], h["ratio_hi"]) == pytest.approx((0.8, *want), abs=1e-6)
    assert h["ratio_lo"] < 0.8 - 0.1 < 0.8 + 0.1 < h["ratio_hi"]  # about the delta method's ± 0.12
    # the router's own rows: retention 1 with the interval [1, 1] where it is defined, NaN on the task it scores 0 on
    # (it wrote NaN with [1, 1]) and where its value has no stderr
    router = {r["task"]: r for r in ns.eval_rows("router", base, base)}
    assert (router["half"]["ratio"], router["half"]["ratio_lo"], router["half"]["ratio_hi"]) == (1.0, 1.0, 1.0)
    assert all(math.isnan(router["zero"][c]) for c in ("ratio", "ratio_lo", "ratio_hi"))
    bare = result({"half": (0.5, float("nan"))})
    r = ns.eval_rows("router", bare, bare)[0]
    assert r["ratio"] == 1.0 and math.isnan(r["ratio_lo"]) and math.isnan(r["ratio_hi"])


def test_retention_of_perfect_accuracies_is_not_one_plus_minus_zero():
    """5 items, both runs right on all 5 (lm-eval: acc 1.0, stderr 0, n-samples 5): each accuracy's Wilson interval is
    [0.566, 1], and retention's interval was the delta method's [1, 1], printed "1 ± 0". Now MOVER-R's [l, 1 / l] with
    l the Wilson lower bound (conftest.mover_by_hand: Fieller's equations by np.roots), written "1.00 [0.57, 1.77]";
    a policy with 4 of 5 right against the router's 5: never a zero-width side either."""
    import pandas as pd

    from moetool.experiments.eval import compute as lmeval
    from moetool.uncertainty import format_ci

    def result(acc):
        res = {"results": {t: {"acc,none": v, "acc_stderr,none": se} for t, (v, se) in acc.items()},
               "n-samples": {t: {"original": 5, "effective": 5} for t in acc}}
        return lmeval.EvalResult(lmeval.results_frame(res), 0.5, {})

    se4 = math.sqrt(0.8 * 0.2 / 4)  # lm-eval's stderr of 4/5
    base = result({"code": (1.0, 0.0), "prose": (1.0, 0.0)})
    mine = result({"code": (1.0, 0.0), "prose": (0.8, se4)})
    rows = {r["task"]: r for r in ns.eval_rows("norm:gate:l2", mine, base)}
    lo = wilson_by_hand(1.0, 5)[0]
    c = rows["code"]
    assert (c["value_lo"], c["value_hi"]) == pytest.approx((lo, 1.0), abs=1e-6)
    assert (c["ratio"], c["ratio_lo"], c["ratio_hi"]) == pytest.approx((1.0, lo, 1 / lo), rel=1e-6)
    assert mover_by_hand(1.0, lo, 1.0, 1.0, lo, 1.0) == pytest.approx((lo, 1 / lo), rel=1e-6)
    assert format_ci(c["ratio"], c["ratio_lo"], c["ratio_hi"]) == "1.00 [0.57, 1.77]"
    p = rows["prose"]
    want = mover_by_hand(0.8, *wilson_by_hand(0.8, 5), 1.0, lo, 1.0)
    assert (p["ratio"], p["ratio_lo"], p["ratio_hi"]) == pytest.approx((0.8, *want), rel=1e-6)
    assert p["ratio_lo"] < 0.8 < p["ratio_hi"] and p["ratio_hi"] > 1.0
    # the summary line prints the honest interval
    q = pd.DataFrame(ns.eval_rows("router", base, base) + list(rows.values()), columns=list(ns.QUALITY_COLUMNS))
    nan = float("nan")
    ppl = pd.DataFrame([{"policy": pol, "task": "heldout", "metric": "perplexity", "value": 10.0, "stderr": nan,
                         "value_lo": nan, "value_hi": nan, "router_value": 10.0, "ratio": 1.0, "ratio_lo": nan,
                         "ratio_hi": nan, "seconds": 1.0} for pol in ("router", "norm:gate:l2")])
    quality = pd.concat([ppl, q], ignore_index=True)
    agreement = pd.DataFrame({"layer": [0, 0], "policy": ["router", "norm:gate:l2"], "topk_overlap": [1.0, 0.5],
                              "top1_agree": [1.0, 0.5], "tokens": [10, 10]})

    class _Res:
        meta: dict = {}
        summary = ns.table1(agreement, quality, tasks=["code", "prose"])

    line = ns.summary_lines("tiny", _Res())[1]
    assert "code acc 1.00 [0.57, 1.00] (x1.00 [0.57, 1.77])" in line, line


@pytest.mark.parametrize("node", ["gate", "glu", "output"])
def test_zero_computation_experts_are_ranked_only_where_they_have_an_activation(node):
    """LongCat-Flash's identity experts (the last 4 of 16, output = input) compute no gate/up/act/glu: at those nodes
    ``norm:<node>`` ranks the 12 computed experts only (by hand, expert by expert from the raw weights); at ``output``
    an identity expert is ranked by ``||x||``, what it outputs. (They were ranked by ``||x||`` at every node and won
    every choice on this model: norm:gate ran no computed expert.)"""
    model, _, ids = longcat_unsorted_router_model(4, torch.Generator().manual_seed(0))
    layers = find_moe_layers(model)
    _, events, _ = run(model, layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                       policy=make_policy(f"norm:{node}"))
    for L in layers:
        ev, m = events[L.index], L.n_experts - L.n_zero_compute
        assert (L.n_experts, m, L.top_k) == (16, 12, 4)
        norms = torch.stack([torch.linalg.vector_norm(reference_expert("longcat_flash", L, e, ev.h)[node], dim=-1)
                             for e in range(m)], dim=-1)  # [T, 12]
        if node == "output":
            norms = torch.cat([norms, torch.linalg.vector_norm(ev.h, dim=-1, keepdim=True).expand(-1, 4)], dim=-1)
        idx = torch.argsort(norms, dim=-1, descending=True)[:, :L.top_k]
        top = norms.sort(-1, descending=True).values
        clear = (top[:, L.top_k - 1] - top[:, L.top_k]) > 1e-4  # no near-tie at the K-th place
        assert clear.float().mean() > 0.8
        assert torch.equal(ev.chosen_idx[clear].sort(-1).values, idx[clear].sort(-1).values)
        w = torch.softmax(norms.gather(-1, ev.chosen_idx), -1) * L.weight_scale  # LongCat's routed scaling factor
        torch.testing.assert_close(ev.chosen_weights.float(), w, rtol=1e-4, atol=1e-5)
        assert node == "output" or (ev.chosen_idx < m).all()


def test_an_internal_node_with_fewer_computed_experts_than_k_is_one_line():
    from moetool.adapters.discovery import model_class, tiny_config

    cfg = tiny_config("longcat_flash")
    cfg.n_routed_experts, cfg.zero_expert_num, cfg.moe_topk = 3, 4, 4  # 3 computed experts for a top-4
    torch.manual_seed(0)
    layers = find_moe_layers(model_class("longcat_flash").from_config(cfg).float().eval())
    every = [L.index for L in layers]
    with pytest.raises(MoetoolError, match=re.escape(f"norm:gate:l2: MoE layers {every} have 3 computed experts for a "
                                                     "top-4")):
        check_policy(make_policy("norm:gate"), layers, every)
    check_policy(make_policy("norm:output"), layers, every)  # identity experts have an output: rankable


def test_an_internal_node_with_exactly_k_computed_experts_runs_every_one_of_them():
    """4 computed experts (+ 4 identity) for a top-4: ``norm:gate`` is allowed (the check is ``n_computed < K``, not
    ``<=``: mutation pass 13) and every token runs the 4 computed experts, never an identity expert, with softmax
    weights of their gate norms computed by hand from the raw weights."""
    from moetool.adapters.discovery import model_class, tiny_config

    cfg = tiny_config("longcat_flash")
    cfg.n_routed_experts, cfg.zero_expert_num, cfg.moe_topk = 4, 4, 4
    torch.manual_seed(0)
    model = model_class("longcat_flash").from_config(cfg).float().eval()
    layers = find_moe_layers(model)
    policy = make_policy("norm:gate")
    check_policy(policy, layers, [L.index for L in layers])  # 4 computed experts for a top-4: rankable
    ids = torch.randint(3, 30, (2, 12), generator=torch.Generator().manual_seed(1))
    _, events, _ = run(model, layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, policy=policy)
    for L in layers:
        ev = events[L.index]
        assert (L.n_experts, L.n_zero_compute, L.top_k) == (8, 4, 4)
        assert torch.equal(ev.chosen_idx.sort(-1).values, torch.arange(4).expand(ev.h.shape[0], 4))
        norms = torch.stack([torch.linalg.vector_norm(reference_expert("longcat_flash", L, e, ev.h)["gate"], dim=-1)
                             for e in range(4)], dim=-1)  # [T, 4]
        w = torch.softmax(norms.gather(-1, ev.chosen_idx), -1) * L.weight_scale
        torch.testing.assert_close(ev.chosen_weights.float(), w, rtol=1e-4, atol=1e-5)


def test_table1_pools_agreement_over_layers_weighted_by_their_tokens():
    """Table 1's agreement is the token-weighted mean over the replaced layers (Σ overlap·tokens / Σ tokens), not
    the mean of the layers' means: layers of 10 and 30 tokens with overlaps 1.0 and 0.5 pool to 0.625 (not 0.75)."""
    import pandas as pd

    agreement = pd.DataFrame([
        {"layer": 0, "policy": "router", "topk_overlap": 1.0, "top1_agree": 1.0, "tokens": 10},
        {"layer": 1, "policy": "router", "topk_overlap": 0.5, "top1_agree": 0.2, "tokens": 30}],
        columns=list(ns.AGREEMENT_COLUMNS))
    quality = pd.DataFrame([{"policy": "router", "task": "heldout", "metric": "perplexity", "value": 12.0,
                             "stderr": math.nan, "value_lo": 11.0, "value_hi": 13.0, "router_value": 12.0,
                             "ratio": 1.0, "ratio_lo": 1.0, "ratio_hi": 1.0, "seconds": 2.5}],
                           columns=list(ns.QUALITY_COLUMNS))
    row = ns.table1(agreement, quality).iloc[0]
    assert row["top-K overlap"] == pytest.approx((1.0 * 10 + 0.5 * 30) / 40)
    assert row["top-1 agree"] == pytest.approx((1.0 * 10 + 0.2 * 30) / 40)
    assert (row["ppl"], row["ppl_lo"], row["ppl_hi"], row["seconds"]) == (12.0, 11.0, 13.0, 2.5)


def test_overall_agreement_without_rows_is_the_pooled_ratio_of_the_sums():
    """--bootstrap 0 (no per-row sums): overall agreement = Σ overlap / Σ tokens and Σ top-1 / Σ tokens over the
    layers, with NaN bounds; frame() gives each layer's own ratios."""
    meter = ns.AgreementMeter()
    meter.sums = {0: torch.tensor([3.0, 2.0, 4.0], dtype=torch.float64),
                  2: torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64)}
    o = meter.overall("norm:gate:l2")
    assert (o["policy"], o["topk_overlap"], o["top1_agree"]) == ("norm:gate:l2", 4 / 8, 3 / 8)
    assert all(math.isnan(o[k]) for k in ("topk_overlap_lo", "topk_overlap_hi", "top1_agree_lo", "top1_agree_hi"))
    f = meter.frame("norm:gate:l2")
    assert f[["layer", "topk_overlap", "top1_agree", "tokens"]].values.tolist() == [[0, 0.75, 0.5, 4],
                                                                                      [2, 0.25, 0.25, 4]]


def test_all_is_a_whole_value_of_nodes_not_a_prefix():
    assert ns.parse_nodes(" all ") == ["gate", "up", "act", "glu", "output"]
    for text in ("all,gate", "allgate"):
        with pytest.raises(MoetoolError, match="^unknown node"):
            ns.parse_nodes(text)
