"""``approx``: per-token selections and errors against brute force from the raw weights; the reducer's tables."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import spearmanr
from typer.testing import CliRunner

from conftest import build_tiny_model, captured, feed, padded_batch, reference_expert, run
from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.engine import Engine
from moetool.experiments.approx.compute import MEDIAN_REL_TOL, SELECTORS, ApproxReducer, approx_tokens

COLUMNS = {"approx.csv": ["layer", "selector", "tokens", "rel_error_mean", "rel_error_median", "same_set_as_router"],
           "approx_layers.csv": ["layer", "spearman_prob_vs_norm", "mean_abs_cos"]}


@torch.no_grad()
def hand_contributions(model_type, layer, h, pi):
    """``u_e = π_e E_e(h)`` one expert at a time from the raw parameters: ``[T, n, d]`` fp64, and ``||E_e||``."""
    E = torch.stack([reference_expert(model_type, layer, e, h)["output"] for e in range(pi.shape[1])], 1).double()
    return pi.double().unsqueeze(-1) * E, E.norm(dim=-1)


def hand_error(U, subset):
    y = U.sum(0)
    return float((U[list(subset)].sum(0) - y).norm() / y.norm())


def real_tokens(model_type, layer_pos=0):
    model, layers, events = captured(model_type)
    L = layers[layer_pos]
    ev = events[L.index]
    return L, ev.h[ev.valid], ev.logits[ev.valid], ev.idx[ev.valid]


def test_every_selector_against_brute_force_per_token():
    L, h, logits, own = real_tokens("mixtral", 1)
    T, n, K = h.shape[0], L.n_experts, L.top_k
    r = approx_tokens(L, h, logits, SELECTORS, torch.Generator().manual_seed(0))
    assert set(r.error) == set(SELECTORS)
    for sel in SELECTORS:
        assert r.error["best_subset"].le(r.error[sel] + 1e-6).all(), sel  # the optimum beats every selector
    # random weights: the u_e are not orthogonal, and the norm rule is not always optimal
    assert (r.error["norm_oracle"] > r.error["best_subset"] + 1e-4).any()
    pi = torch.softmax(logits.double(), dim=-1)  # Mixtral's π, by hand
    U, enorm = hand_contributions("mixtral", L, h, pi)
    for t in range(T):
        errs = {S: hand_error(U[t], S) for S in itertools.combinations(range(n), K)}
        best = min(errs, key=errs.get)
        assert r.error["best_subset"][t].item() == pytest.approx(errs[best], rel=1e-5, abs=1e-7)
        assert sorted(r.idx["best_subset"][t].tolist()) == list(best)
        norm_set = tuple(sorted(U[t].norm(dim=-1).topk(K).indices.tolist()))
        assert sorted(r.idx["norm_oracle"][t].tolist()) == list(norm_set)
        router_set = tuple(sorted(pi[t].topk(K).indices.tolist()))
        assert sorted(r.idx["router"][t].tolist()) == list(router_set) == sorted(own[t].tolist())
        for sel in SELECTORS:  # each error is the error of the set it reports
            assert r.error[sel][t].item() == pytest.approx(hand_error(U[t], r.idx[sel][t].tolist()), rel=1e-4)
        assert r.spearman[t].item() == pytest.approx(spearmanr(pi[t], enorm[t])[0], abs=1e-6)
        cos = [abs(torch.cosine_similarity(U[t, i], U[t, j], dim=0).item())
               for i in range(n) for j in range(n) if i != j]
        assert r.abs_cos[t].item() == pytest.approx(np.mean(cos), rel=1e-4)
    assert len({tuple(sorted(s)) for s in r.idx["random"].tolist()}) > 1  # random sets vary across tokens
    assert r.idx["random"].unique(dim=None).numel() > K and (r.idx["random"].sort(1).values.diff(1) > 0).all()


def test_orthogonal_experts_make_the_norm_rule_exact():
    """Down projections writing to disjoint coordinate blocks: the u_e are orthogonal, the norm oracle is optimal."""
    model = copy.deepcopy(build_tiny_model("mixtral"))
    layers = find_moe_layers(model)
    with torch.no_grad():
        for L in layers:
            down = L.experts.down_proj  # [n, d, I]
            n, d = down.shape[:2]
            block = d // n
            for e in range(n):
                keep = torch.zeros(d, 1)
                keep[e * block:(e + 1) * block] = 1
                down[e] *= keep
    _, events, _ = run(model, layers, padded_batch())
    for L in layers[:2]:
        ev = events[L.index]
        r = approx_tokens(L, ev.h[ev.valid], ev.logits[ev.valid])
        torch.testing.assert_close(r.error["norm_oracle"], r.error["best_subset"], rtol=1e-6, atol=1e-7)
        assert r.abs_cos.abs().max() < 1e-6
        assert (r.error["router"] >= r.error["norm_oracle"] - 1e-7).all()
        assert (r.error["router"] > r.error["norm_oracle"] + 1e-4).any()  # not a trivial equality of sets


def test_best_subset_is_left_out_beyond_max_subsets():
    L, h, logits, _ = real_tokens("mixtral")
    r = approx_tokens(L, h, logits, SELECTORS, max_subsets=27)  # C(8, 2) = 28
    assert "best_subset" not in r.error and set(r.error) == {"router", "norm_oracle", "random"}


def test_best_subset_alone_where_no_layer_admits_it_says_so():
    """--selectors best_subset with C(n, K) > --max-subsets in every analysed layer (any n = 64, K = 6 model at the
    default) left no row at all and read 'no tokens reached the analysed MoE layers (empty data?)': a data problem
    that is not there. It names the limit before the forward; at C(n, K) = --max-subsets the rows are there."""
    import moetool
    from moetool.errors import MoetoolError

    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=16, max_tokens=32)
    with pytest.raises(MoetoolError, match=r"^--selectors best_subset: C\(n, K\) > --max-subsets 27 in every "
                                           r"analysed MoE layer \(layer 1: C\(8,2\) = 28\)"):
        moetool.approx(lm, toks, selectors=("best_subset",), max_subsets=27, layers=(1, 2), quiet=True)
    with pytest.raises(MoetoolError, match="^--selectors needs at least one selector$"):
        moetool.approx(lm, toks, selectors=(), quiet=True)
    res = moetool.approx(lm, toks, selectors=("best_subset",), max_subsets=28, layers=(1,), quiet=True)
    assert res["approx"][["layer", "selector", "tokens"]].values.tolist() == [[1, "best_subset", 32]]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_reducer_tables_over_real_tokens(model_type):
    """Router = the model's captured top-K (1.0), padding never counts, means/medians of the per-token errors."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    batch = padded_batch()
    red = ApproxReducer(seed=3)
    with torch.no_grad(), Engine(model, layers, consumers=[red]):
        model(**batch)
    approx, per_layer = red.tables()
    assert list(approx.columns) == COLUMNS["approx.csv"] and list(per_layer.columns) == COLUMNS["approx_layers.csv"]
    assert sorted(per_layer["layer"]) == [L.index for L in layers]
    real = int(batch["attention_mask"].sum())
    assert (approx["tokens"] == real).all()
    router = approx[approx["selector"] == "router"]
    assert (router["same_set_as_router"] == 1.0).all() and len(router) == len(layers)
    # the table is the reduction of approx_tokens over the same real tokens (random aside: its own generator)
    _, _, events = captured(model_type)
    for L in layers:
        ev = events[L.index]
        r = approx_tokens(L, ev.h[ev.valid], ev.logits[ev.valid], ("router", "norm_oracle", "best_subset"))
        for sel, err in r.error.items():
            row = approx[(approx["layer"] == L.index) & (approx["selector"] == sel)].iloc[0]
            assert row["rel_error_mean"] == pytest.approx(err.double().mean().item(), rel=1e-5)
            # streaming sketch: within its documented bound of the exact median (0.17 %), not identical
            exact = float(np.median(err.numpy()))
            assert abs(row["rel_error_median"] - exact) <= MEDIAN_REL_TOL * exact + 1e-12
            same = np.mean([set(a) == set(b) for a, b in zip(r.idx[sel].tolist(), ev.idx[ev.valid].tolist())])
            assert row["same_set_as_router"] == pytest.approx(same)
        lrow = per_layer[per_layer["layer"] == L.index].iloc[0]
        assert lrow["spearman_prob_vs_norm"] == pytest.approx(r.spearman.double().mean().item(), rel=1e-5)
        assert lrow["mean_abs_cos"] == pytest.approx(r.abs_cos.double().mean().item(), rel=1e-5)


def test_a_confident_routers_tiny_errors_have_a_median_not_a_refusal():
    """The router's logits x 30 (a confident router: π of the left-out experts ~1e-20, so the router's error is
    ~1e-20 too): rel_error_median is the median of the per-token errors from the raw weights and an fp64 softmax,
    within the sketch's bound. The error sketch's range began at 1e-8: the run stopped with "a quantile falls outside
    the sketch's range [1e-08, 10000]" for a legal model."""
    model = copy.deepcopy(build_tiny_model("mixtral"))
    layers = find_moe_layers(model)
    with torch.no_grad():
        for L in layers:
            L.router.weight.mul_(30)
    batch = padded_batch()
    red = ApproxReducer(seed=3, selectors=("router", "norm_oracle"))
    _, events, _ = run(model, layers, batch)
    with torch.no_grad(), Engine(model, layers, consumers=[red]):
        model(**batch)
    approx, _ = red.tables()
    smallest = []
    for L in layers:
        ev = events[L.index]
        h, logits = ev.h[ev.valid], ev.logits[ev.valid]
        pi = torch.softmax(logits.double(), dim=-1)
        U, _ = hand_contributions("mixtral", L, h, pi)
        for sel, chosen in (("router", pi.topk(L.top_k).indices), ("norm_oracle", U.norm(dim=-1).topk(L.top_k).indices)):
            # ||y_S - y|| as the sum of the left-out u_e: y_S - y in fp64 cancels to 0 below ~1e-16 of ||y||
            out = [[e for e in range(L.n_experts) if e not in chosen[t].tolist()] for t in range(U.shape[0])]
            err = np.array([float(U[t, out[t]].sum(0).norm() / U[t].sum(0).norm()) for t in range(U.shape[0])])
            row = approx[(approx["layer"] == L.index) & (approx["selector"] == sel)].iloc[0]
            exact = float(np.median(err))
            assert abs(row["rel_error_median"] - exact) <= (MEDIAN_REL_TOL + 1e-5) * exact  # + fp32's rounding
            smallest.append(exact)
    assert min(smallest) < 1e-8  # the case: a median below the old range


def test_a_confident_routers_tiny_contributions_keep_their_norms_errors_and_cosines():
    """The router's logits x 30: π_e of the left-out experts ~1e-20 and below, so u_e = π_e E_e has fp32 squares of 0.
    Against the raw weights in fp64: the norm oracle is TopK of π_e ||E_e|| (3 of 17 tokens of the first layer took
    another set: a tie of zero norms), the router's error is ||sum of the left-out u_e|| / ||y|| (7 of 17 tokens read
    0.0), and |cos(u_i, u_j)| = |cos(E_i, E_j)|, whatever π (the per-token mean read ~7e8: g / tiny). Without
    best_subset, the path whose Gram matrix was fp32."""
    model = copy.deepcopy(build_tiny_model("mixtral"))
    layers = find_moe_layers(model)
    with torch.no_grad():
        for L in layers:
            L.router.weight.mul_(30)
    _, events, _ = run(model, layers, padded_batch())
    tiny_errors = 0
    for L in layers:
        ev = events[L.index]
        h, logits = ev.h[ev.valid], ev.logits[ev.valid]
        r = approx_tokens(L, h, logits, ("router", "norm_oracle"))
        pi = torch.softmax(logits.double(), dim=-1)
        with torch.no_grad():
            E = torch.stack([reference_expert("mixtral", L, e, h)["output"] for e in range(L.n_experts)], 1).double()
        U = pi.unsqueeze(-1) * E  # [T, n, d] fp64
        want = (pi * E.norm(dim=-1)).topk(L.top_k).indices.sort(-1).values
        assert torch.equal(r.idx["norm_oracle"].sort(-1).values, want)
        unit = E / E.norm(dim=-1, keepdim=True)
        cos = (unit @ unit.transpose(1, 2)).abs()
        n = L.n_experts
        mean_cos = (cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(1)) / (n * (n - 1))
        np.testing.assert_allclose(r.abs_cos.double().numpy(), mean_cos.numpy(), rtol=1e-5)
        for t in range(U.shape[0]):
            out = [e for e in range(n) if e not in r.idx["router"][t].tolist()]
            err = float(U[t, out].sum(0).norm() / U[t].sum(0).norm())  # the left-out sum: no cancellation
            assert r.error["router"][t].item() == pytest.approx(err, rel=1e-4)
            tiny_errors += 0 < err < 1e-19
    assert tiny_errors > 0  # the case: errors whose fp32 squares underflow


def test_cli_on_embedded_tiny(tmp_path):
    r = CliRunner().invoke(app, ["approx", "--model", "tiny", "--out", str(tmp_path), "--max-tokens", "256",
                                 "--seq-len", "64", "-q"])
    assert r.exit_code == 0, r.output
    approx = pd.read_csv(tmp_path / "approx.csv")
    assert list(approx.columns) == COLUMNS["approx.csv"]
    assert (approx.query("selector == 'router'")["same_set_as_router"] == 1.0).all()
    wide = approx.pivot(index="layer", columns="selector", values="rel_error_mean")
    if "best_subset" in wide:
        assert (wide["best_subset"] <= wide[["router", "norm_oracle", "random"]].min(axis=1) + 1e-6).all()
    assert (tmp_path / "figures" / "approx_error.png").is_file()


def test_a_sigmoid_routers_pi_is_its_scores_normalised_to_sum_one():
    """DeepSeek-V3 scores its experts with a sigmoid: π (SPEC: the model's scoring function normalised to sum to one
    over all n experts) is sigmoid(logits) / Σ sigmoid, not softmax(logits). Every selector's error is the error of
    its set under u_e = π_e E_e(h) with that π and the experts from the raw parameters; the norm oracle's set is the
    top-K of ||u_e||."""
    L, h, logits, _ = real_tokens("deepseek_v3")
    s = torch.sigmoid(logits.double())
    pi = s / s.sum(-1, keepdim=True)
    U, _ = hand_contributions("deepseek_v3", L, h, pi)
    r = approx_tokens(L, h, logits, ("router", "norm_oracle", "best_subset"))
    for t in range(h.shape[0]):
        for sel in r.error:
            assert r.error[sel][t].item() == pytest.approx(hand_error(U[t], r.idx[sel][t].tolist()), rel=1e-4), sel
        assert sorted(r.idx["norm_oracle"][t].tolist()) == sorted(U[t].norm(dim=-1).topk(L.top_k).indices.tolist())


def test_chunks_rank_each_tokens_own_noise_row():
    """approx_tokens in chunks (a small budget: one token per chunk) gives every token the numbers of one chunk, and
    ``random`` takes the K experts of largest noise in the token's OWN row of ``noise`` (not the first chunk's)."""
    L, h, logits, _ = real_tokens("mixtral")
    T, n, K = h.shape[0], L.n_experts, L.top_k
    noise = torch.rand(T, n, generator=torch.Generator().manual_seed(5))
    sels = ("router", "norm_oracle", "random")
    whole = approx_tokens(L, h, logits, sels, noise=noise)
    parts = approx_tokens(L, h, logits, sels, noise=noise, budget=1)
    for t in range(T):
        want = sorted(sorted(range(n), key=lambda e: -float(noise[t, e]))[:K])
        assert sorted(parts.idx["random"][t].tolist()) == want == sorted(whole.idx["random"][t].tolist())
    for sel in sels:
        torch.testing.assert_close(parts.error[sel], whole.error[sel])


def test_mean_abs_cos_is_over_every_real_token_where_spearman_is_undefined():
    """A token with equal router logits (constant π: its Spearman is undefined and left out of
    spearman_prob_vs_norm) still has its |cos|: mean_abs_cos is the mean over all real tokens, spearman_prob_vs_norm
    the mean over the tokens where it is defined; padding counts in neither."""
    import dataclasses

    model, layers, events = captured("mixtral")
    L = layers[0]
    ev = events[L.index]
    logits = ev.logits.clone()
    flat = torch.nonzero(ev.valid.reshape(-1)).flatten()
    logits.reshape(-1, logits.shape[-1])[flat[:2]] = 0.0  # two real tokens with a constant π
    ev = dataclasses.replace(ev, logits=logits)
    red = ApproxReducer(("router",), layers=[L.index])
    red(ev)
    _, per_layer = red.tables()
    keep = ev.valid.reshape(-1)
    r = approx_tokens(L, ev.h.reshape(-1, ev.h.shape[-1])[keep], logits.reshape(-1, logits.shape[-1])[keep], ("router",))
    sp = r.spearman.double()
    assert int(torch.isnan(sp).sum()) == 2  # the two constant rows, and only they
    row = per_layer.iloc[0]
    assert row["mean_abs_cos"] == pytest.approx(r.abs_cos.double().mean().item(), rel=1e-9)
    assert row["spearman_prob_vs_norm"] == pytest.approx(sp[~torch.isnan(sp)].mean().item(), rel=1e-9)


@pytest.fixture(scope="module")
def hot_unchosen(tmp_path_factory):
    """The tiny DeepSeek-V3 with expert 3 of its second MoE layer (decoder layer 2) never chosen (correction bias
    -1e4) and its weights scaled (gate_up x1e3, down x1e2): its output on any token is ~1e6 and more, past fp16's
    65504, while the model's own forward never computes it."""
    from moetool.adapters.tiny import build_tiny

    model = build_tiny("deepseek_v3")
    layer = find_moe_layers(model)[1]
    with torch.no_grad():
        layer.router.e_score_correction_bias[3] = -1e4
        layer.experts.gate_up_proj[3] *= 1e3
        layer.experts.down_proj[3] *= 1e2
    path = tmp_path_factory.mktemp("hot") / "m"
    model.save_pretrained(path)
    return str(path)


def test_an_unchosen_expert_overflowing_fp16_stops_in_one_line_naming_layer_probe_and_dtype(hot_unchosen):
    """In fp16 the model's own forward is finite and never routes a token to expert 3 of layer 2, but approx's
    all-expert probe computes it on every token and it overflows: the run stopped at the end with '128 NaN,
    infinite or negative value(s) reached a quantile sketch' (no layer, no cause). Now: one line at the batch,
    naming the layer, the all-expert probe and float16 with --dtype bf16; in bf16 the same checkpoint's tables are
    finite (its range holds the ~1e6 outputs), the router's error below 1."""
    import moetool
    from moetool.data import TokenSet
    from moetool.errors import MoetoolRuntimeError

    ids = torch.randint(3, 1000, (4, 32), generator=torch.Generator().manual_seed(3))
    toks = TokenSet(ids, torch.ones_like(ids), [""] * 4, "t")
    lm = moetool.load(hot_unchosen, dtype="fp16", tokenizer=False)
    chosen = []
    with torch.no_grad(), Engine(lm.model, lm.layers, consumers=[lambda ev: chosen.append(ev.idx)]):
        logits = feed(lm.model, ids).logits
    assert torch.isfinite(logits).all() and not (chosen[1] == 3).any()  # the model never computes expert 3 there
    with pytest.raises(MoetoolRuntimeError) as e:
        moetool.approx(lm, toks, quiet=True, batch_size=4)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"non-finite all-expert probe outputs in MoE layer 2 of {lm.name} at batch 0")
    assert "float16" in msg and "dtype='bf16'" in msg  # called from Python: the keyword
    res = moetool.approx(moetool.load(hot_unchosen, dtype="bf16", tokenizer=False), toks, quiet=True, batch_size=4)
    df = res["approx"]
    assert np.isfinite(df["rel_error_mean"]).all() and len(df) == 3 * 4
    assert (df.loc[df.selector == "router", "rel_error_mean"] < 1).all()
