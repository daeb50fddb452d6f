"""``moetool margin``: the routing margin against a hand computation from the captured logits, zero flips without
noise, and the flip rates against a hand re-routing of the first MoE layer under the same seeded noise."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import moetool
from moetool.errors import MoetoolError
from moetool.experiments.margin.compute import MarginOptions, margin


@pytest.fixture(scope="module")
def tiny():
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=500)  # 8 rows, the last one padded
    first = lm.layers[0]
    got = {"h": [], "logits": [], "valid": [], "rows": []}

    def grab(ev):
        if ev.layer.index == first.index:
            got["h"].append(ev.h.reshape(-1, ev.h.shape[-1]).clone())
            got["logits"].append(ev.logits.reshape(-1, ev.logits.shape[-1]).clone())
            got["valid"].append(ev.valid.reshape(-1).clone())
            got["rows"] += [int(r) for r in ev.rows]

    # the experiments' own batches (3 rows): on CUDA a GEMM's fp32 sums depend on its shape, so the reference sees
    # the hidden states the experiment sees only when it runs the same batches
    moetool.forward(lm, tokens, consumers=[grab], batch_size=3, quiet=True)
    cap = {k: torch.cat(v) if k != "rows" else v for k, v in got.items()}
    assert not cap["valid"].all()  # padding is there, and must not count
    return lm, tokens, first, cap


def test_margins_of_the_first_layer_by_hand(tiny):
    lm, tokens, L, cap = tiny
    res = margin(lm, tokens, eps=(0.0,), thresholds=(0.01, 0.05), bootstrap=0, batch_size=3, quiet=True)
    row = res["margin"].set_index("layer").loc[L.index]
    valid = cap["valid"]
    scores = L.selection_scores(cap["logits"][valid]).float()  # the model's ranking scores, bias included
    s = scores.sort(dim=-1, descending=True).values
    m = (s[:, L.top_k - 1] - s[:, L.top_k]).double().cpu().numpy()
    assert row["tokens"] == int(valid.sum()) == m.shape[0]
    assert row["margin_mean"] == pytest.approx(m.mean(), rel=1e-9)
    rel = 2e-3 + 1e-6  # the sketch's bound (about 0.17% with 32768 bins over 2^-149 .. 1e4: under 0.2%)
    for q, col in ((0.05, "margin_p05"), (0.5, "margin_p50"), (0.95, "margin_p95")):
        assert row[col] == pytest.approx(np.quantile(m, q), rel=rel)
    assert row["frac_below_0.01"] == (m < 0.01).mean() and row["frac_below_0.05"] == (m < 0.05).mean()
    assert 0 < row["frac_below_0.01"] < row["frac_below_0.05"] < 1  # the thresholds split the tokens


def test_a_confident_routers_tiny_margins_are_quantiles_not_a_refusal():
    """The router's logits x 10 (a confident router: a token's K-th and (K+1)-th probabilities can be ~1e-10 and
    their gap far smaller): every layer's margin quantiles are np.quantile of the margins of an fp64 softmax of the
    captured logits. The sketch's range began at 1e-12, so the run stopped with "a quantile falls outside the
    sketch's range [1e-12, 10000] (values from 5.85261e-20 to 0.485533)" for a legal model."""
    lm = moetool.load("tiny")
    with torch.no_grad():
        for L in lm.layers:
            L.router_weight().mul_(10)
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=500)
    got = {L.index: [] for L in lm.layers}
    moetool.forward(lm, tokens, consumers=[lambda ev: got[ev.layer.index].append(
        ev.logits.reshape(-1, ev.logits.shape[-1])[ev.valid.reshape(-1)].clone())], batch_size=3, quiet=True)
    res = margin(lm, tokens, eps=(0.0,), thresholds=(1e-12, 0.01), bootstrap=0, batch_size=3, quiet=True)
    table = res["margin"].set_index("layer")
    rel = 1.8e-3 + 1e-5  # the sketch's bound (0.17%) and fp32 softmax's rounding of the probabilities
    below = []
    for L in lm.layers:
        p = torch.softmax(torch.cat(got[L.index]).double(), dim=-1).sort(dim=-1, descending=True).values
        m = (p[:, L.top_k - 1] - p[:, L.top_k]).numpy()
        row = table.loc[L.index]
        for q, col in ((0.05, "margin_p05"), (0.5, "margin_p50"), (0.95, "margin_p95")):
            assert row[col] == pytest.approx(np.quantile(m, q), rel=rel)
        assert row["frac_below_1e-12"] == (m < 1e-12).mean()
        below.append(np.quantile(m, 0.05))
    assert min(below) < 1e-12  # the case: a layer's lower 5% of the margins below the old range


def test_no_noise_no_flips_and_flips_by_hand(tiny):
    lm, tokens, L, cap = tiny
    eps, seed = 0.1, 3
    res = margin(lm, tokens, eps=(0.0, eps), thresholds=(0.02,), bootstrap=100, seed=seed, batch_size=3, quiet=True)
    fl = res["margin_flips"]
    zero = fl[fl.eps == 0]
    assert (zero[["topk_flip", "top1_flip", "topk_flip_lo", "topk_flip_hi"]] == 0).all().all()
    got = fl[(fl.layer == L.index) & (fl.eps == eps)].iloc[0]

    # the test's own noise: row r's z from a generator seeded by (seed, layer, r), N(0, I) in d dimensions
    h, valid, K = cap["h"], cap["valid"], L.top_k
    S, d = h.shape[0] // len(cap["rows"]), h.shape[1]
    base = (seed * 1_000_003 + L.index) * 1_000_000_007
    dev = h.device  # drawn where the model runs, as moetool draws (a CUDA generator's stream is not the CPU's)
    z = torch.cat([torch.randn(S, d, device=dev, generator=torch.Generator(device=dev).manual_seed(base + r))
                   for r in cap["rows"]])
    hn = (h.float() + eps * h.float().norm(dim=-1, keepdim=True) * z / math.sqrt(d)).to(h.dtype)
    with torch.no_grad():
        a, b = (L.selection_scores(L.logits(x)).float() for x in (h, hn))
    top_a, top_b = a.topk(K).indices.sort(-1).values, b.topk(K).indices.sort(-1).values
    set_flip = (top_a != top_b).any(-1)[valid].double()
    one_flip = (a.argmax(-1) != b.argmax(-1))[valid].double()
    assert got["topk_flip"] == pytest.approx(float(set_flip.mean()), abs=1e-12)
    assert got["top1_flip"] == pytest.approx(float(one_flip.mean()), abs=1e-12)
    assert got["topk_flip"] > 0 and got["top1_flip"] > 0  # eps 0.1 moves some tokens: the comparison bites
    assert got["topk_flip_lo"] <= got["topk_flip"] <= got["topk_flip_hi"]
    rel = ((hn.float() - h.float()).norm(dim=-1) / h.float().norm(dim=-1))[valid].double()
    assert got["noise_rel"] == pytest.approx(float(rel.mean()), rel=1e-6)
    assert got["noise_rel"] == pytest.approx(eps, rel=0.05)  # fp32: the noise as asked (||z|| ~ sqrt(d))

    # per margin bin: the flips of the tokens below / above the threshold
    m = a.sort(-1, descending=True).values
    low = (m[:, K - 1] - m[:, K] < 0.02)[valid]
    bins = res["margin_bins"]
    mine = bins[(bins.layer == L.index) & (bins.eps == eps)].set_index("margin_lo")
    assert mine.loc[0.0, "tokens"] == int(low.sum())
    assert mine.loc[0.0, "topk_flip"] == pytest.approx(float(set_flip[low].mean()), abs=1e-12)
    assert mine.loc[0.02, "topk_flip"] == pytest.approx(float(set_flip[~low].mean()), abs=1e-12)


def test_a_margin_equal_to_a_threshold_is_in_the_bin_above(tiny):
    """margin_bins' bins are [margin_lo, margin_hi) and frac_below_<thr> counts margin < thr (the definitions): with
    the thresholds set to margins some tokens have exactly (fp32), those tokens count in the bin that starts there
    and not below it. Bucketing with right=False put them in the bin below (the bin counts then disagreed with
    frac_below)."""
    lm, tokens, L, cap = tiny
    valid = cap["valid"]
    s = L.selection_scores(cap["logits"][valid]).float().sort(dim=-1, descending=True).values
    m = (s[:, L.top_k - 1] - s[:, L.top_k]).cpu()  # fp32, as the experiment forms it
    srt = m.sort().values
    thr = (float(srt[len(srt) // 3]), float(srt[2 * len(srt) // 3]))  # exact in fp32: two tokens' own margins
    res = margin(lm, tokens, eps=(0.0,), thresholds=thr, bootstrap=0, batch_size=3, quiet=True)
    bins = res["margin_bins"]
    mine = bins[bins.layer == L.index].set_index("margin_lo")["tokens"]
    t1, t2 = thr
    assert list(mine.index) == [0.0, t1, t2]
    assert int((m == t1).sum()) >= 1 and int((m == t2).sum()) >= 1  # the case: margins on the edges
    assert mine.loc[0.0] == int((m < t1).sum())
    assert mine.loc[t1] == int(((m >= t1) & (m < t2)).sum())
    assert mine.loc[t2] == int((m >= t2).sum())
    row = res["margin"].set_index("layer").loc[L.index]
    assert row[f"frac_below_{t1!r}"] * row["tokens"] == pytest.approx(mine.loc[0.0], abs=1e-9)


@pytest.mark.parametrize("bad, msg", [({"eps": (-0.1,)}, r"^eps= must be finite"), ({"thresholds": (0.1, 0.01)}, "increase"),
                                      ({"thresholds": (0.0,)}, "positive")])
def test_bad_options_are_one_line(bad, msg):
    with pytest.raises(MoetoolError, match=msg):
        MarginOptions(**bad)


def test_noise_rounded_to_the_routers_dtype_is_reported():
    """In bf16 a noise below its resolution (about 0.4% of each component) largely rounds away: noise_rel says
    so, instead of the flip rate of a perturbation that never reached the router passing for eps's."""
    lm = moetool.load("tiny", dtype="bf16")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    fl = margin(lm, tokens, eps=(1e-4, 0.1), bootstrap=0, quiet=True)["margin_flips"]
    small, big = fl[fl.eps == 1e-4]["noise_rel"], fl[fl.eps == 0.1]["noise_rel"]
    assert (small < 0.5e-4).all()  # most of it rounded away
    assert ((big > 0.09) & (big < 0.11)).all()  # well above the resolution: as asked


def test_a_layer_routing_every_expert_has_no_margin():
    """K = n: no (K+1)-th score; one line before any forward, not a table of NaN or index errors."""
    from types import SimpleNamespace

    layers = [SimpleNamespace(index=0, top_k=2, n_experts=8), SimpleNamespace(index=1, top_k=4, n_experts=4)]
    tokens = SimpleNamespace(require_tokens=lambda: None)
    with pytest.raises(MoetoolError, match="layer 1: routes all 4 experts"):
        margin(SimpleNamespace(layers=layers), tokens, quiet=True)


def test_every_column_has_its_own_definition(tiny):
    """The report's tooltips: each column of each table resolves to a definition; the margin bin edges are not
    mistaken for bootstrap bounds (they end in _lo/_hi)."""
    from moetool.report.page import column_definition

    lm, tokens, _, _ = tiny
    res = margin(lm, tokens, eps=(0.01,), thresholds=(0.02, 0.2), bootstrap=0, quiet=True)
    defs = res.meta["definitions"]
    for name, df in res.tables.items():
        for c in df.columns:
            assert column_definition(defs, name.removesuffix(".csv"), c), (name, c)
    assert "bootstrap" not in column_definition(defs, "margin_bins", "margin_lo")
    assert column_definition(defs, "margin", "frac_below_0.2") == "share of real tokens with margin < 0.2"
    assert "bin" in column_definition(defs, "margin_bins", "topk_flip")


def test_the_router_against_itself_agrees_exactly(tiny):
    lm, tokens, _, _ = tiny
    res = margin(lm, tokens, eps=(0.0,), bootstrap=100, policies=("router",), batch_size=3, quiet=True)
    jac = res["margin_jaccard"]
    assert sorted(jac.layer) == [L.index for L in lm.layers] and (jac.policy == "router").all()
    assert (jac[["soft_jaccard", "soft_jaccard_lo", "soft_jaccard_hi", "jaccard", "jaccard_lo", "jaccard_hi"]]
            == 1.0).all().all()
    assert "margin_jaccard" not in margin(lm, tokens, eps=(0.0,), bootstrap=0, policies=(), quiet=True)


def test_no_policy_runs_unless_asked_and_the_demo_asks_for_two(tiny, monkeypatch):
    """By default margin costs its forward: no policy's probe (norm:gate computes every expert's gate: several
    forwards' worth on many-expert models) and no Jaccard table; the demo compares norm:gate and random."""
    from moetool.experiments.registry import EXPERIMENTS
    from moetool.policies import norm

    lm, tokens, _, _ = tiny
    calls = []
    orig = norm.node_scores
    monkeypatch.setattr(norm, "node_scores", lambda *a, **k: calls.append(a[0].index) or orig(*a, **k))
    res = margin(lm, tokens, eps=(0.01,), bootstrap=0, batch_size=3, quiet=True)
    assert "margin_jaccard" not in res and calls == [] and res.meta["policies"] == []
    demo = EXPERIMENTS["margin"].demo.options["policies"]
    assert tuple(demo) == ("norm:gate", "random")
    res = margin(lm, tokens, eps=(0.01,), bootstrap=0, batch_size=3, quiet=True, policies=demo)
    assert sorted(set(calls)) == [L.index for L in lm.layers]  # norm:gate's probe, once per layer and batch
    assert sorted(set(res["margin_jaccard"].policy)) == ["norm:gate", "random"]


def test_policy_jaccards_of_the_first_layer_by_hand(tiny):
    """topp:0.5 (masked columns of weight 0: not chosen) and random (seeded per row), each by its own select on the
    captured events of the first MoE layer; the router's weights renormalised over its chosen set."""
    from moetool.policies import build_policy

    lm, tokens, L, _ = tiny
    specs = ("topp:0.5", "random")
    pols = [build_policy(s, seed=5) for s in specs]
    per = {s: [] for s in specs}

    def grab(ev):
        if ev.layer.index != L.index:
            return
        valid = ev.valid.reshape(-1)
        r_idx, r_w = ev.idx[valid].tolist(), ev.weights[valid].double().tolist()
        for s, p in zip(specs, pols):
            p_idx, p_w = (x[valid] for x in p.select(ev))
            for ri, rw, pi, pw in zip(r_idx, r_w, p_idx.tolist(), p_w.double().tolist()):
                a, b = {}, {}
                for e, x in zip(ri, rw):
                    a[e] = a.get(e, 0.0) + x
                for e, x in zip(pi, pw):
                    b[e] = b.get(e, 0.0) + x
                a = {e: x / sum(a.values()) for e, x in a.items() if x > 0}
                b = {e: x / sum(b.values()) for e, x in b.items() if x > 0}
                keys = set(a) | set(b)
                soft = (sum(min(a.get(e, 0), b.get(e, 0)) for e in keys)
                        / sum(max(a.get(e, 0), b.get(e, 0)) for e in keys))
                per[s].append((soft, len(set(a) & set(b)) / len(keys)))

    # the experiments' own batches (3 rows): on CUDA a GEMM's fp32 sums depend on its shape, so the reference sees
    # the hidden states the experiment sees only when it runs the same batches
    moetool.forward(lm, tokens, consumers=[grab], batch_size=3, quiet=True)
    res = margin(lm, tokens, eps=(0.0,), bootstrap=0, seed=5, policies=specs, batch_size=3, quiet=True)
    jac = res["margin_jaccard"].set_index(["layer", "policy"])
    for s in specs:
        got = jac.loc[(L.index, s)]
        want = np.array(per[s]).mean(0)
        assert got["tokens"] == len(per[s])
        assert got["soft_jaccard"] == pytest.approx(want[0], abs=1e-6)
        assert got["jaccard"] == pytest.approx(want[1], abs=1e-12)  # a ratio of counts, float64 per token
        assert 0 < got["soft_jaccard"] < 1 and 0 < got["jaccard"] < 1  # the comparison bites
    # topp:0.5 chooses fewer than its kmax columns: a masked expert counted as chosen would lower its jaccard
    assert jac.loc[(L.index, "topp:0.5"), "jaccard"] > 0.5


def test_top1_against_the_router_is_its_top1_weight(tiny):
    lm, tokens, _, _ = tiny
    jac = margin(lm, tokens, eps=(0.0,), bootstrap=0, policies=("topk:1",), quiet=True)["margin_jaccard"]
    assert (jac["jaccard"] == 1 / lm.layers[0].top_k).all()  # the top-1 is always in the top-K set


def test_top3_against_the_routers_top2_is_two_thirds_exactly(tiny):
    """topk:3 keeps the router's top-2 and adds one: |S_r ∩ S_p| / |S_r ∪ S_p| = 2/3 for every token. It read
    0.6666666865348816 (2/3 in fp32, jaccards' dtype, carried into the float64 mean: 2e-8 off); now float64."""
    lm, tokens, _, _ = tiny
    jac = margin(lm, tokens, eps=(0.0,), bootstrap=0, policies=("topk:3",), quiet=True)["margin_jaccard"]
    assert lm.layers[0].top_k == 2 and len(jac) == len(lm.layers)
    assert (abs(jac["jaccard"] - 2 / 3) < 1e-15).all(), jac["jaccard"].tolist()


@pytest.mark.parametrize("bad, msg", [(("attention",), "needs attention"), (("random", "random"), "twice"),
                                      (("nope",), "nope")])
def test_bad_policies_are_one_line(tiny, bad, msg):
    lm, tokens, _, _ = tiny
    with pytest.raises(MoetoolError, match=msg):
        margin(lm, tokens, eps=(0.0,), bootstrap=0, policies=bad, quiet=True)


def test_cli_policies_none_writes_no_jaccard_table(tmp_path):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    args = ["margin", "--max-tokens", "128", "--seq-len", "64", "--bootstrap", "0", "--eps", "0.05", "--quiet"]
    r = CliRunner().invoke(app, [*args, "--policies", "none", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "a" / "margin_jaccard.csv").exists()
    r = CliRunner().invoke(app, [*args, "--policies", "router,topk:1", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    import pandas as pd

    jac = pd.read_csv(tmp_path / "b" / "margin_jaccard.csv")
    assert set(jac.policy) == {"router", "topk:1"} and (jac[jac.policy == "router"].soft_jaccard == 1).all()
    assert (tmp_path / "b" / "figures" / "margin_jaccard.png").exists()


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "olmoe"])
def test_margin_space_is_the_hf_routers_ranking(model_type, tiny_model):
    """The margin is in the space each router ranks experts by, read off transformers' own router module (its logits
    through a plain forward hook; not the adapter's rule), in float64: gpt-oss takes the top-K of its logits (a
    softmax over the chosen only): logit gaps; DeepSeek-V3 ranks sigmoid + e_score_correction_bias over all n
    experts (before its group limit); OLMoE softmax probabilities. gpt-oss's logit gaps are far from its
    probability gaps, so the space is pinned, not only the ranking."""
    from conftest import padded_batch

    from moetool.adapters import find_moe_layers
    from moetool.data import TokenSet
    from moetool.loading import LoadedModel

    model = tiny_model(model_type)
    inputs = padded_batch(batch=3, seq=12, pad=0)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    mask[2, 9:] = 0  # right padding, as moetool packs rows
    layers = find_moe_layers(model)
    lm = LoadedModel(model_type, "x", "local", model, None, layers, torch.device("cpu"), torch.float32)
    res = margin(lm, TokenSet(ids, mask, [""] * 3, "test"), eps=(0.0,), thresholds=(0.01, 0.1), bootstrap=0,
                 quiet=True)
    block = model.model.layers[layers[0].index].mlp
    router = block.router if model_type == "gpt_oss" else block.gate
    got = []
    handle = router.register_forward_hook(lambda m, a, out: got.append(out[0].detach().double()))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    logits = got[0].reshape(-1, got[0].shape[-1])[mask.reshape(-1).bool()]
    if model_type == "gpt_oss":
        scores = logits
    elif model_type == "deepseek_v3":
        scores = logits.sigmoid() + router.e_score_correction_bias.double()
    else:
        scores = torch.softmax(logits, -1)
    K = model.config.num_experts_per_tok
    s = scores.sort(-1, descending=True).values
    m = (s[:, K - 1] - s[:, K]).numpy()
    row = res["margin"].set_index("layer").loc[layers[0].index]
    assert row["tokens"] == len(m) == 33
    assert row["margin_mean"] == pytest.approx(m.mean(), rel=1e-6)
    assert row["frac_below_0.1"] == (m < 0.1).mean() and row["frac_below_0.01"] == (m < 0.01).mean()
    if model_type == "gpt_oss":
        p = torch.softmax(logits, -1).sort(-1, descending=True).values
        assert abs(m.mean() - (p[:, K - 1] - p[:, K]).mean().item()) > 0.1  # logit gaps, not probability gaps


def test_the_same_set_in_another_column_order_is_no_flip(tiny):
    """The top-1 is the chosen expert with the largest selection score, not the router's first column: routers
    returning their top-K unsorted (DeepSeek-V3, LongCat: ``topk(sorted=False)``) give the same set in another
    order under a small noise, which is neither a top-K nor a top-1 flip. By hand: the top-1 of routing_of is the
    argmax of the layer's selection scores (a plain top-K router: the largest chosen is the largest of all)."""
    from moetool.experiments.margin.compute import flips, routing_of

    lm, tokens, L, cap = tiny
    h = cap["h"]
    idx, top1 = routing_of(L, h)
    logits = h.float() @ L.router_weight().detach().float().T  # tiny's (Mixtral) router: a linear map, no bias
    assert torch.equal(top1.cpu(), logits.argmax(-1).cpu())
    k, one = flips((idx, top1), (idx.flip(-1), top1))
    assert not k.any() and not one.any()
    moved = torch.where(idx[:, :1] == top1.unsqueeze(-1), idx.roll(1, -1), idx)  # top-1 out of column 0
    assert not flips((idx, top1), (moved, top1))[1].any()


def test_soft_jaccard_compares_weights_normalised_to_sum_one():
    """soft_jaccard's w_r and w_p are each token's weights normalised to sum 1 (the definition): a router whose
    weights carry a scale (DeepSeek-V3's routed_scaling_factor 2.5, Qwen2-MoE without norm_topk_prob) and a policy
    with the same experts in the same proportions agree exactly. By hand: weights (2.5, 7.5) on experts (3, 1) and
    (0.25, 0.75) on (3, 1) are both (0, 0.75, 0, 0.25); against (0.5, 0.5) on (1, 2): sum min = 0.5 + 0 + 0, sum
    max = 0.75 + 0.5 + 0.25, soft 1/3, plain 1/3."""
    from moetool.experiments.margin.compute import jaccards, weight_vectors

    idx = torch.tensor([[3, 1], [3, 1]])
    a = weight_vectors(idx, torch.tensor([[2.5, 7.5], [2.5, 7.5]]), 4)
    assert a.tolist() == [[0.0, 0.75, 0.0, 0.25]] * 2
    b = weight_vectors(torch.tensor([[3, 1], [1, 2]]), torch.tensor([[0.25, 0.75], [0.5, 0.5]]), 4)
    soft, plain = jaccards(a, b)
    assert soft.tolist() == pytest.approx([1.0, 0.5 / 1.5], abs=1e-7) and plain.tolist() == [1.0, 1 / 3]


def _fp16_noise():
    """The tiny model in fp16, 3 rows of 32 tokens (16 padding positions), its first MoE layer, that layer's captured
    router inputs h ``[T, d]`` with their real-token mask, and the test's own seeded noise z (seed 0) of margin."""
    lm = moetool.load("tiny", dtype="fp16")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=80)  # 3 rows of 32: 16 padding positions, which
    L = lm.layers[0]  # overflow too and must not be counted among the real tokens
    got = {"h": [], "valid": [], "rows": []}

    def grab(ev):
        if ev.layer.index == L.index:
            got["h"].append(ev.h.reshape(-1, ev.h.shape[-1]).clone())
            got["valid"].append(ev.valid.reshape(-1).clone())
            got["rows"] += [int(r) for r in ev.rows]

    moetool.forward(lm, tokens, consumers=[grab], batch_size=8, quiet=True)
    h, valid = torch.cat(got["h"]), torch.cat(got["valid"])
    assert not valid.all()
    S, d = h.shape[0] // len(got["rows"]), h.shape[1]
    base = L.index * 1_000_000_007  # seed 0
    dev = h.device
    z = torch.cat([torch.randn(S, d, device=dev, generator=torch.Generator(device=dev).manual_seed(base + r))
                   for r in got["rows"]])
    return lm, tokens, L, h, valid, z


def test_an_overflowing_eps_is_told_the_largest_eps_that_keeps_the_noise_finite():
    """The refusal said "use a smaller --eps" with no value. It now names the bound below which every real token's
    h' (rounded to fp16) stays finite, computed here by hand from the captured h and the seeded z: coordinate j may
    move by 65504 - h_j sign(z_j) along z_j; the value it suggests runs (no refusal, noise_rel about it), and 1%
    past the bound is refused again."""
    lm, tokens, L, h, valid, z = _fp16_noise()
    hf = h.float()
    unit = z * (hf.norm(dim=-1, keepdim=True) / math.sqrt(h.shape[1]))
    per = ((65504 - hf * torch.sign(unit)) / unit.abs()).amin(-1)  # the tiny model's z has no zero coordinate
    bound = float(per[valid].min())
    assert 1e3 < bound < 1e5  # the case: fp16's range, not fp32's distance bound (about 1.8e19 / ||unit||)
    kw = dict(policies=(), layers=(L.index,), bootstrap=0, quiet=True)
    with pytest.raises(MoetoolError) as e:
        margin(lm, tokens, eps=(0.1, 2 * bound), **kw)
    m = re.search(r"below eps (\S+) \(computed from the data\): use eps=(\S+) or less$", str(e.value))
    assert m, str(e.value)
    assert float(m.group(1)) == pytest.approx(bound, rel=2e-3)  # shown to 3 digits, a thousandth under
    suggested = float(m.group(2))
    assert 0.9 * bound <= suggested < bound
    fl = margin(lm, tokens, eps=(suggested,), **kw)["margin_flips"]
    assert fl["noise_rel"].iloc[0] == pytest.approx(suggested, rel=0.05)
    with pytest.raises(MoetoolError, match="overflows float16"):
        margin(lm, tokens, eps=(1.01 * bound,), **kw)


def test_finite_eps_and_eps_hint_by_hand():
    """finite_eps per token, by hand: coordinate j may move by finfo.max - h_j sign(u_j) along u_j (fp16: 65504), a
    zero coordinate of the noise never limits, a zero noise is inf, and in fp32 the distance sqrt(3.4028e38) /
    ||u|| binds first; a thousandth under. The bound is what it says: noisy_inputs at it is finite, 1% past the
    fp16 overflow (65520 rounds to inf) is not. eps_hint's two cases by hand (mutation pass 22: M1, M4, M10
    survived)."""
    from moetool.experiments.margin.compute import eps_hint, finite_eps, noisy_inputs

    hf = torch.tensor([[60000.0, 100.0, 5.0], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    unit = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.5]])
    got = finite_eps(hf, unit, torch.float16)
    want = [(65504 - 60000) * 0.999, math.inf, min((65504 + 1) / 2, (65504 - 3) / 0.5) * 0.999]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    ok = noisy_inputs(hf[:1], float(got[0]), unit[:1], torch.float16)
    assert torch.isfinite(ok).all() and ok[0, 0] == 65504  # 65498.5: fp16's largest, not inf
    assert not torch.isfinite(noisy_inputs(hf[:1], 1.01 * (65520 - 60000), unit[:1], torch.float16)).all()
    big = math.sqrt(torch.finfo(torch.float32).max) / math.sqrt(2)  # ||(1, 1)||: the distance binds in fp32
    assert finite_eps(torch.zeros(1, 2), torch.ones(1, 2), torch.float32).item() == pytest.approx(0.999 * big,
                                                                                                rel=1e-6)

    from moetool.context import RunState

    with RunState(cli=True).active():  # as the command line words it (Python: eps=, tests/test_api_keywords.py)
        assert eps_hint(1e30, 12345.6, [0.1]) == (
            "h' and ||h' - h|| stay finite for every real token of every layer below eps 1.23e+04 (computed from the "
            "data): use --eps 12000 or less")
        assert eps_hint(5.0, 100.0, [0.1, 2.0, 3.0, 7.0]) == (
            "h' stays finite up to eps 100, its router logits overflow earlier: use an --eps below 5 (--eps 3 of "
            "this run passed)")
        assert eps_hint(5.0, 100.0, [7.0]).endswith("use an --eps below 5")
    assert eps_hint(1e30, 12345.6, [0.1]).endswith("use eps=12000 or less")


def test_the_overflow_bound_is_the_smallest_over_every_layer_batch_and_real_token():
    """The bound an overflowing eps is told is the smallest finite_eps over the real tokens of every layer asked,
    over every batch: layers 2 and 3 of the fp16 tiny model, one row per batch, by hand from the captured h and
    the seeded z. Here the refused layer (2, the first) has a larger bound than layer 3, the last batch's rows are
    not the smallest, and layer 2's padding positions lie lower than its real tokens (mutation pass 22: naming
    the refused layer's bound, the last batch's, or counting padding survived)."""
    lm = moetool.load("tiny", dtype="fp16")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=80)  # 3 rows of 32, 16 padding positions
    got: dict[int, dict[str, list]] = {}

    def grab(ev):
        g = got.setdefault(ev.layer.index, {"h": [], "valid": [], "rows": []})
        g["h"].append(ev.h.reshape(-1, ev.h.shape[-1]).float())
        g["valid"].append(ev.valid.reshape(-1).clone())
        g["rows"] += [int(r) for r in ev.rows]

    moetool.forward(lm, tokens, consumers=[grab], batch_size=8, quiet=True)
    real, every, last = {}, {}, {}
    for i in (2, 3):
        h, valid, rows = torch.cat(got[i]["h"]), torch.cat(got[i]["valid"]), got[i]["rows"]
        S, d = h.shape[0] // len(rows), h.shape[1]
        z = torch.cat([torch.randn(S, d, generator=torch.Generator().manual_seed(i * 1_000_000_007 + r))
                       for r in rows])  # seed 0
        unit = z * (h.norm(dim=-1, keepdim=True) / math.sqrt(d))
        per = ((65504 - h * torch.sign(unit)) / unit.abs()).amin(-1)  # fp32's distance bound is ~1e19: not binding
        real[i], every[i] = float(per[valid].min()), float(per.min())
        last[i] = float(per.reshape(len(rows), S)[-1][valid.reshape(len(rows), S)[-1]].min())
    bound = min(real.values())
    assert real[2] > real[3] and every[2] < real[2] and min(last.values()) > 1.01 * bound  # the case
    kw = dict(policies=(), layers=(2, 3), bootstrap=0, quiet=True, batch_size=1)
    with pytest.raises(MoetoolError) as e:
        margin(lm, tokens, eps=(0.1, 1e5), **kw)
    m = re.search(r"layer (\d+)'s .* below eps (\S+) \(computed from the data\): use eps=(\S+) or less$",
                  str(e.value))
    assert m and m.group(1) == "2", str(e.value)
    assert float(m.group(2)) == pytest.approx(bound, rel=2e-3)
    fl = margin(lm, tokens, eps=(float(m.group(3)),), **kw)["margin_flips"]  # it runs in both layers
    assert sorted(fl["layer"]) == [2, 3]


def test_noise_that_overflows_the_routers_dtype_is_one_line_not_a_flip_rate():
    """fp16 holds at most 65504: --eps 1e5 made h' inf, its routing one of NaN logits, and margin_flips read
    topk_flip 0.996 with noise_rel inf; --eps 1e39 (past fp32's largest) was a RuntimeError of torch.add (break-it
    run 7). Now the tokens whose h', ||h' - h|| or router logits are not finite are counted and named. By hand: the
    test's own seeded noise on the first MoE layer's captured fp16 inputs."""
    lm, tokens, L, h, valid, z = _fp16_noise()
    d = h.shape[1]
    hf = h.float()
    for eps in (2e4, 1e39):  # 2e4: some of the tokens overflow, not all
        hn = (hf + min(eps, 3.4e38) * hf.norm(dim=-1, keepdim=True) * z / math.sqrt(d)).to(h.dtype)
        with torch.no_grad():
            bad = ~torch.isfinite((hn.float() - hf).norm(dim=-1)) | ~torch.isfinite(L.logits(hn)).all(-1)
        n_bad, n = int(bad[valid].sum()), int(valid.sum())
        assert 0 < n_bad and (n_bad < n) == (eps == 2e4)
        with pytest.raises(MoetoolError) as e:
            margin(lm, tokens, eps=(0.1, eps), policies=(), layers=(L.index,), bootstrap=0, quiet=True)
        assert f"eps={eps:g}: the noisy router input" in str(e.value)  # Python: the keyword
        assert f"overflows float16 for {n_bad} of layer {L.index}'s {n} real tokens" in str(e.value)
    # below the overflow the noise is as asked: no refusal, noise_rel about eps
    fl = margin(lm, tokens, eps=(10.0,), policies=(), layers=(L.index,), bootstrap=0, quiet=True)["margin_flips"]
    assert fl["noise_rel"].iloc[0] == pytest.approx(10.0, rel=0.05)
    # h' finite but its fp16 router logits not: the router 64x larger (layer 0's inputs unchanged; its clean logits
    # reach about 190), eps 1e3 (h' up to about 4e3, logits past 65504 for some tokens). Counted by the logits alone
    with torch.no_grad():
        L.router.weight.mul_(64)
        hn = (hf + 1e3 * hf.norm(dim=-1, keepdim=True) * z / math.sqrt(d)).to(h.dtype)
        h_ok = torch.isfinite((hn.float() - hf).norm(dim=-1))
        bad = ~torch.isfinite(L.logits(hn)).all(-1)
    n_bad, n = int(bad[valid].sum()), int(valid.sum())
    assert h_ok.all() and 0 < n_bad < n and torch.isfinite(L.logits(h)).all()
    with pytest.raises(MoetoolError) as e:
        margin(lm, tokens, eps=(10.0, 1e3), policies=(), layers=(L.index,), bootstrap=0, quiet=True)
    assert f"overflows float16 for {n_bad} of layer {L.index}'s {n} real tokens" in str(e.value)
    # h' finite (eps 1e3 below the bound): the logits overflowed first, the run's eps that passed is named
    assert str(e.value).endswith("its router logits overflow earlier: use an eps= below 1000 (eps=10 of this run "
                                 "passed)"), str(e.value)


def test_thresholds_closer_than_six_digits_get_a_column_each(tiny):
    """frac_below_<thr> was named with :g: --thresholds 0.05,0.0500001 wrote one column frac_below_0.05 holding the
    share below 0.0500001 (the second overwrote the first; break-it run 7). Each threshold now has its column,
    named by its number exactly; by hand from the captured logits of the first MoE layer."""
    lm, tokens, L, cap = tiny
    valid = cap["valid"]
    s = L.selection_scores(cap["logits"][valid]).float().sort(dim=-1, descending=True).values
    m = (s[:, L.top_k - 1] - s[:, L.top_k]).double().cpu()
    a = float(m.sort().values[len(m) // 2])  # a token's own margin (fp32-exact): < a and < a + tiny differ
    b = float(np.nextafter(np.float32(a), np.float32(1)))  # the next fp32 margin (margins are compared in fp32)
    assert f"{a:g}" == f"{b:g}" and (m < a).sum() != (m < b).sum()  # the case: :g cannot tell them apart
    res = margin(lm, tokens, eps=(0.0,), thresholds=(a, b), policies=(), bootstrap=0, batch_size=3, quiet=True)
    row = res["margin"].set_index("layer").loc[L.index]
    assert row[f"frac_below_{a!r}"] == float((m < a).double().mean())
    assert row[f"frac_below_{b!r}"] == float((m < b).double().mean())
    # thresholds that are one number in fp32 cannot be told apart there: one line
    with pytest.raises(MoetoolError, match="one number in fp32"):
        MarginOptions(thresholds=(a, a + 1e-12))
