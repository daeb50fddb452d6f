"""OLMoE-style analyses of ``stats`` (vocabulary specialisation, cross-layer co-activation, load balancing,
co-activation conventions) against hand counts over the captured routing of a tiny model."""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import permutations
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import build_tiny_model
from moetool.adapters import find_moe_layers
from moetool.data import TokenSet
from moetool.engine import forward
from moetool.errors import MoetoolError
from moetool.experiments.specialization import (CrossLayer, LoadBalance, VocabSpecialization,
                                                coactivation_counts, cross_layer_matrix)


def token_set(rows=5, seq=14, lo=3, hi=12, seed=11) -> TokenSet:
    """Right-padded rows over a small id range (ids repeat); row 1 and 3 padded, padding id 3 is also real."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, hi, (rows, seq), generator=gen)
    mask = torch.ones_like(ids)
    for r, p in ((1, 5), (3, 2)):
        ids[r, -p:], mask[r, -p:] = 3, 0
    return TokenSet(ids, mask, [""] * rows, "test")


def run(model_type: str, consumers_of, tokens=None, batch_size=2):
    """Forward with the given consumers plus a recorder of (layer, idx, probs, valid) and of the logits."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    tokens = tokens or token_set()
    cons = consumers_of(layers)
    rec, logits = [], []

    def before(b):
        for c in cons:
            if hasattr(c, "begin_batch"):
                c.begin_batch(b)

    def after(b, out):
        logits.append(out.logits.clone())
        for c in cons:
            if hasattr(c, "on_batch"):
                c.on_batch(b, out)

    lm = SimpleNamespace(model=model, layers=layers, tokenizer=None)
    forward(lm, tokens, consumers=[*cons, lambda ev: rec.append(
        (ev.layer.index, ev.idx.clone(), ev.probs.clone(), ev.logits.clone(), ev.valid.clone()))],
        batch_size=batch_size, before_batch=before, on_batch=after, quiet=True)
    return cons, layers, tokens, rec, logits


def per_token(tokens, rec, logits, layer, batch_size=2):
    """[(input id, next id or None, predicted id, idx list, probs, logits)] per real token of ``layer``."""
    out = []
    events = [r for r in rec if r[0] == layer]
    for bi, (_, idx, probs, lg, valid) in enumerate(events):
        ids = tokens.input_ids[bi * batch_size:(bi + 1) * batch_size]
        mask = tokens.attention_mask[bi * batch_size:(bi + 1) * batch_size]
        pred = logits[bi].argmax(-1)
        S = ids.shape[1]
        for t in range(idx.shape[0]):
            r, s = divmod(t, S)
            assert bool(valid[t]) == bool(mask[r, s])
            if not mask[r, s]:
                continue
            nxt = int(ids[r, s + 1]) if s + 1 < S and mask[r, s + 1] else None
            out.append((int(ids[r, s]), nxt, int(pred[r, s]), idx[t].tolist(), probs[t], lg[t]))
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_vocab_specialization_matches_hand_count(model_type):
    (vs,), layers, tokens, rec, logits = run(model_type, lambda L: [VocabSpecialization(L, merge_min=3)])
    t = vs.tables(None, min_count=4, top_n=2)
    spec, best = t["specialization.csv"], t["specialized_tokens.csv"]
    assert len(spec) == 3 * len(layers)
    for L in layers:
        toks = per_token(tokens, rec, logits, L.index)
        for view, pick in (("input", 0), ("next_token", 1), ("predicted", 2)):
            seen = defaultdict(list)
            for row in toks:
                if row[pick] is not None:
                    seen[row[pick]].append(row[3][0])  # first-ranked expert
            hand = {}
            for tok, exps in seen.items():
                (e, c), = sorted(Counter(exps).items(), key=lambda x: (-x[1], x[0]))[:1]
                hand[tok] = (len(exps), e, c / len(exps))
            row = spec[(spec.layer == L.index) & (spec.view == view)].iloc[0]
            kept = [s for occ, _, s in hand.values() if occ >= 4]
            assert row["token_ids"] == len(kept) and row["token_ids_all"] == len(hand)
            assert row["specialization"] == pytest.approx(np.mean(kept), rel=1e-12)
            assert row["specialization_all_ids"] == pytest.approx(np.mean([s for *_, s in hand.values()]), rel=1e-12)
            got = best[(best.layer == L.index) & (best.view == view)]
            for e, g in got.groupby("expert"):
                want = sorted(((-s, -occ, tok) for tok, (occ, ee, s) in hand.items() if ee == e and occ >= 4))[:2]
                assert g["token_id"].tolist() == [tok for *_, tok in want]
                assert g["specialization"].tolist() == pytest.approx([-s for s, *_ in want], rel=1e-12)
                assert g["rank"].tolist() == list(range(1, len(want) + 1))
    # next-token and input views differ (the data is not constant), predicted is argmax of the logits
    assert not spec[spec.view == "input"]["specialization"].equals(spec[spec.view == "next_token"]["specialization"])


def test_vocab_specialization_ignores_padding():
    """Padding id 3 also appears as a real token: its occurrences must equal its real count only."""
    (vs,), layers, tokens, rec, logits = run("mixtral", lambda L: [VocabSpecialization(L)])
    tok = vs.token_table(layers[0].index, "input").set_index("token_id")
    real = int(((tokens.input_ids == 3) & tokens.attention_mask.bool()).sum())
    assert tok.loc[3, "occurrences"] == real < int((tokens.input_ids == 3).sum())
    assert tok["occurrences"].sum() == int(tokens.attention_mask.sum())


@pytest.mark.parametrize("top_k", [None, 1])
def test_cross_layer_matches_hand_count(top_k):
    (cl,), layers, tokens, rec, logits = run("mixtral", lambda L: [CrossLayer(L, top_k=top_k)])
    t = cl.tables()
    pairs, summ = t["cross_layer.csv"], t["cross_layer_summary.csv"]
    n, K = layers[0].n_experts, (top_k or layers[0].top_k)
    assert summ[["layer", "next_layer"]].values.tolist() == [[a.index, b.index] for a, b in zip(layers, layers[1:])]
    for L0, L1 in zip(layers, layers[1:]):
        t0 = per_token(tokens, rec, logits, L0.index)
        t1 = per_token(tokens, rec, logits, L1.index)
        hand = Counter()
        for r0, r1 in zip(t0, t1):
            for a in r0[3][:K]:
                for b in r1[3][:K]:
                    hand[a, b] += 1
        chose = Counter(a for r in t0 for a in r[3][:K])
        g = pairs[pairs.layer == L0.index].set_index(["a", "b"])
        for a in range(n):
            for b in range(n):
                assert g.loc[(a, b), "count"] == hand[a, b]
                want = hand[a, b] / chose[a] if chose[a] else np.nan
                np.testing.assert_allclose(g.loc[(a, b), "p_b_given_a"], want, rtol=1e-12)
        # summary: mean max-p over chosen experts, MI of the pair distribution (independent numpy computation)
        joint = np.array([[hand[a, b] for b in range(n)] for a in range(n)], dtype=float)
        joint /= joint.sum()
        pa, pb = joint.sum(1), joint.sum(0)
        nz = joint > 0
        mi = float((joint[nz] * np.log(joint[nz] / np.outer(pa, pb)[nz])).sum())
        s = summ[summ.layer == L0.index].iloc[0]
        assert s["tokens"] == len(t0)
        assert s["mutual_information"] == pytest.approx(mi, rel=1e-10)
        assert s["mean_max_p"] == pytest.approx(np.mean([max(hand[a, b] for b in range(n)) / chose[a]
                                                         for a in range(n) if chose[a]]), rel=1e-12)
        assert s["uniform_max_p"] == pytest.approx(K / n)


def test_cross_layer_summary_closed_forms():
    # independent layers: count = outer product -> MI 0; a deterministic map a -> b (a permutation) -> MI = H(a)
    c = torch.outer(torch.tensor([1.0, 2, 3, 4]), torch.tensor([2.0, 2, 1, 5]))
    assert cross_layer_matrix(c, 1, 1)[1]["mutual_information"] == pytest.approx(0.0, abs=1e-12)
    perm = torch.eye(4)[[2, 0, 3, 1]] * torch.tensor([[1.0], [2], [3], [4]])
    p, s = cross_layer_matrix(perm, 1, 1)
    w = np.array([1, 2, 3, 4]) / 10
    assert s["mutual_information"] == pytest.approx(-(w * np.log(w)).sum(), rel=1e-12)
    assert s["mutual_information_norm"] == pytest.approx(-(w * np.log(w)).sum() / np.log(4), rel=1e-12)  # / log n
    assert s["mean_max_p"] == 1.0 and s["tokens"] == 10
    # K differs between the layers: 3 tokens, top-1 at l = [0, 0, 1], top-2 at next = [0 1], [0 2], [1 2]
    c = torch.tensor([[2.0, 1, 1], [0, 1, 1], [0, 0, 0]])
    p, s = cross_layer_matrix(c, 1, 2)
    np.testing.assert_allclose(p[:2], [[1, 0.5, 0.5], [0, 1, 1]])
    assert torch.isnan(p[2]).all() and s["tokens"] == 3 and s["uniform_max_p"] == pytest.approx(2 / 3)
    assert s["mean_max_p"] == 1.0
    with pytest.raises(MoetoolError, match="no tokens"):
        cross_layer_matrix(torch.zeros(3, 3), 1, 1)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balance_matches_transformers(model_type, masked):
    """Pooled aux loss == transformers' load_balancing_loss_func on the same router logits (with/without mask);
    per-layer loss == the same function on that layer alone."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    tokens = token_set() if masked else token_set(rows=4, seq=9)
    if not masked:
        tokens.attention_mask[:] = 1
    (lb,), layers, _, rec, _ = run(model_type, lambda L: [LoadBalance(L)], tokens=tokens, batch_size=len(
        tokens.input_ids))
    experts, per_layer = lb.tables()
    n, K = layers[0].n_experts, layers[0].top_k
    gate = tuple(lg for _, _, _, lg, _ in rec)
    mask = tokens.attention_mask if masked else None
    want = float(load_balancing_loss_func(gate, n, K, mask))
    np.testing.assert_allclose(per_layer["aux_loss_hf_pooled"], want, rtol=1e-6)
    for (li, idx, probs, lg, valid), row in zip(rec, per_layer.itertuples()):
        assert row.layer == li
        assert row.aux_loss == pytest.approx(float(load_balancing_loss_func((lg,), n, K, mask)), rel=1e-6)
        v = valid.double()
        g = experts[experts.layer == li]
        np.testing.assert_allclose(g["router_prob"], (probs.double() * v[:, None]).sum(0) / v.sum(), rtol=1e-12)
        hand = Counter(e for t in range(len(idx)) if valid[t] for e in idx[t].tolist())
        np.testing.assert_allclose(g["token_fraction"], [hand[e] / v.sum() for e in range(n)], rtol=1e-12)


def test_load_balance_top1_and_uniform_closed_form():
    (lb,), layers, *_ = run("mixtral", lambda L: [LoadBalance(L, top_k=1)])
    experts, per_layer = lb.tables()
    np.testing.assert_allclose(experts.groupby("layer")["token_fraction"].sum(), 1.0)
    np.testing.assert_allclose(experts.groupby("layer")["router_prob"].sum(), 1.0, rtol=1e-6)
    # uniform routing: f = K/n, P = 1/n -> n * n * K/n * 1/n = K
    from moetool.experiments.specialization import aux_loss
    assert aux_loss(torch.full((8,), 2 / 8), torch.full((8,), 1 / 8)) == pytest.approx(2.0)


def test_coactivation_conventions_on_k4_hand_counts():
    """K = 4: 'all' counts the 12 ordered pairs of each token's top-4, 'adjacent' only ranks (1,2), (2,3),
    (3,4) in both orders (OLMoE's pairwise), so it is never larger."""
    gen = torch.Generator().manual_seed(5)
    n, K, T = 7, 4, 40
    idx = torch.stack([torch.randperm(n, generator=gen)[:K] for _ in range(T)])
    valid = torch.rand(T, generator=gen) > 0.2
    all_ = coactivation_counts(idx, n, valid, "all")
    adj = coactivation_counts(idx, n, valid, "adjacent")
    h_all, h_adj, chose = Counter(), Counter(), Counter()
    for t in range(T):
        if not valid[t]:
            continue
        row = idx[t].tolist()
        chose.update(row)
        h_all.update(permutations(row, 2))
        for a, b in zip(row, row[1:]):
            h_adj[a, b] += 1
            h_adj[b, a] += 1
    for a in range(n):
        assert all_[a, a] == adj[a, a] == chose[a]
        for b in range(n):
            if a != b:
                assert all_[a, b] == h_all[a, b] and adj[a, b] == h_adj[a, b]
    assert (adj <= all_).all() and (adj < all_).any()
    with pytest.raises(MoetoolError, match="coactivation"):
        coactivation_counts(idx, n, valid, "neighbours")


def test_top_per_group_and_token_arrays_match_one_lexsort():
    """The shortcuts of top_per_group (only rows that can rank top_n sorted, an in-order last key left to the sort's
    stability) and _token_arrays (runs of sorted keys, no sort) give exactly what one full lexsort gives."""
    from moetool.experiments.specialization import _token_arrays, top_per_group

    def lexsorted(group, keys, top_n):
        order = np.lexsort([-v if d else v for v, d in reversed(keys)] + [group])
        g, at = group[order], np.arange(len(order))
        start = np.maximum.accumulate(np.where(np.r_[True, g[1:] != g[:-1]], at, 0)) if len(order) else at
        rank = at - start + 1
        return order[rank <= top_n], rank[rank <= top_n]

    rng = np.random.default_rng(0)
    for it in range(300):
        N, top_n = int(rng.integers(0, 300)), int(rng.integers(0, 12))
        group = rng.integers(-1 if it % 7 == 0 else 0, int(rng.integers(1, 10)), N)
        keys = []
        for kind in rng.integers(0, 4, int(rng.integers(1, 4))):
            v = [rng.integers(0, 5, N), np.round(rng.random(N), 1), np.sort(rng.integers(0, 40, N)),
                 rng.random(N)][kind]
            if kind == 3 and it % 5 == 0 and N:
                v[rng.integers(0, N)] = np.nan
            keys.append((v, bool(rng.integers(0, 2))))
        for got, want in zip(top_per_group(group, keys, top_n), lexsorted(group, keys, top_n)):
            np.testing.assert_array_equal(got, want)
        n = int(rng.integers(1, 9))
        k = np.unique(rng.integers(-1, 50 * n, int(rng.integers(0, 200))))
        c = rng.integers(1, 6, len(k))
        if it % 3 == 0:
            k, c = k[::-1].copy(), c[::-1].copy()
        got = _token_arrays(torch.from_numpy(k), torch.from_numpy(c), n)
        k, c = k[k >= 0], c[k >= 0]
        tid, ex = k // n, k % n
        order = np.lexsort((ex, -c, tid))
        t = tid[order]
        start = np.flatnonzero(np.r_[True, t[1:] != t[:-1]]) if len(t) else np.zeros(0, dtype=np.int64)
        occ = np.add.reduceat(c[order], start) if len(t) else c[:0]
        top = order[start]
        want = {"token_id": t[start], "occurrences": occ, "expert": ex[top], "count": c[top],
                "specialization": c[top] / occ.astype(np.float64)}
        for col in want:
            assert got[col].dtype == want[col].dtype
            np.testing.assert_array_equal(got[col], want[col])


def test_blockwise_argmax_is_torch_argmax():
    """ops.argmax (the predicted view's argmax over blocks of the vocabulary): torch.argmax's indices, ties (the first),
    NaN (counts as largest) and infinities included, in every float dtype."""
    from moetool import ops

    g = torch.Generator().manual_seed(0)
    for it, V in enumerate((64, 128, 2048, 1000, 100, 130) * 8):
        x = torch.randn(3, 5, V, generator=g).to((torch.float32, torch.bfloat16, torch.float16, torch.float64)[it % 4])
        if it % 3 == 0:
            x = x.round()
        if it % 5 == 0:
            x[0, 1, torch.randint(0, V, (3,), generator=g)] = float("nan")
        if it % 7 == 0:
            x[1, 2, torch.randint(0, V, (2,), generator=g)] = float("inf")
            x[2] = float("-inf")
        assert torch.equal(ops.argmax(x), x.argmax(-1)), (it, V)


def test_a_decoder_position_after_padding_reads_no_input_token():
    """An encoder-decoder's decoder position t reads token t-1 (the input view): with left padding the first real
    position's t-1 is padding, so it counts no input token; its next_token view counts token t itself. One
    left-padded row, ids 7 | 8 9 10 (7 padding), first-ranked experts 2, 1, 0 at positions 1, 2, 3. By hand: input
    view 8 -> expert 1 (position 2), 9 -> expert 0 (position 3); next_token view 8 -> 2, 9 -> 1, 10 -> 0. (Without
    the mask of t-1 the padding id 7 was counted as position 1's input, with expert 2.)"""
    layer = SimpleNamespace(index=0, n_experts=4, stack="decoder")
    vs = VocabSpecialization([layer])
    vs.begin_batch(SimpleNamespace(input_ids=torch.tensor([[7, 8, 9, 10]]),
                                   attention_mask=torch.tensor([[0, 1, 1, 1]])))
    top1 = torch.tensor([[3], [2], [1], [0]])
    vs(SimpleNamespace(layer=layer, shape=(1, 4), idx=top1, ranked=(top1, None),
                       valid=torch.tensor([False, True, True, True])))
    got = {v: vs.token_table(0, v)[["token_id", "expert", "occurrences"]].values.tolist() for v in ("input", "next_token")}
    assert got["input"] == [[8, 1, 1], [9, 0, 1]]
    assert got["next_token"] == [[8, 2, 1], [9, 1, 1], [10, 0, 1]]


def test_cross_layer_pairs_only_layers_consecutive_in_the_model():
    """Hooked MoE layers 0, 2, 3 of a model with MoE layers 0-3 (``--layers`` left out 1): 0 -> 2 skips a layer and
    is no pair; 2 -> 3 is. Two tokens, K = 1: experts 1, 2 at layer 2 and 3, 3 at layer 3, so by hand count[1, 3] =
    count[2, 3] = 1 and every other count 0 (counting 0 -> 2 as a pair gave one pair more than the model has)."""
    model = [SimpleNamespace(index=i, n_experts=4, stack=None) for i in range(4)]
    cl = CrossLayer([model[0], model[2], model[3]], model_layers=model)
    cl.begin_batch(None)
    valid = torch.tensor([True, True])
    for L, idx in ((model[0], [[0], [1]]), (model[2], [[1], [2]]), (model[3], [[3], [3]])):
        cl(SimpleNamespace(layer=L, idx=torch.tensor(idx), valid=valid))
    df = cl.tables()["cross_layer.csv"]
    assert set(zip(df.layer, df.next_layer)) == {(2, 3)}
    assert {(a, b): c for a, b, c in zip(df.a, df.b, df["count"]) if c} == {(1, 3): 1, (2, 3): 1}


def test_vocab_specialization_counts_the_first_ranked_expert_of_an_unsorted_router():
    """LongCat-Flash's routers return their top-4 unsorted (``topk(sorted=False)``): the (token, expert) counts of
    the input view take the expert with the largest selection score (softmax + correction bias, as its router
    chooses), by hand from the routers' own outputs, not the first column (mutation pass 12's S12)."""
    from conftest import longcat_unsorted_router_model, router_outputs

    model, routers, ids = longcat_unsorted_router_model(6, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, -6:], mask[5, -3:] = 0, 0
    seen = router_outputs(model, routers, ids, mask)
    layers = find_moe_layers(model)
    vs = VocabSpecialization(layers, merge_min=3)
    lm = SimpleNamespace(model=model, layers=layers, tokenizer=None)
    forward(lm, TokenSet(ids, mask, [""] * 6, "test"), consumers=[vs], batch_size=6, before_batch=vs.begin_batch,
            on_batch=vs.on_batch, quiet=True)
    keep, flat = mask.reshape(-1).bool(), ids.reshape(-1)
    for i, (logits, _, idx) in seen.items():
        score = logits.float().softmax(-1) + routers[i].e_score_correction_bias
        first = idx.gather(1, score.gather(1, idx).argmax(-1, keepdim=True))[:, 0]  # [T] the largest chosen score
        assert (first != idx[:, 0])[keep].any()  # the case: the first column is not the first-ranked expert
        keys, counts = vs.counters[i]["input"].result()
        got = Counter({int(k): int(c) for k, c in zip(np.asarray(keys), np.asarray(counts)) if k >= 0})  # -1: unkept
        want = Counter(int(t) * vs.n[i] + int(e) for t, e, k in zip(flat, first, keep) if k)
        assert got == want


def test_an_encoder_position_before_padding_predicts_nothing_in_the_predicted_view():
    """An encoder-decoder's logits at position t predict token t itself, so an encoder layer's predicted view at t
    reads the prediction at t+1 -- where t+1 is a real position. One right-padded row, ids 5 6 7 | 8 (8 padding),
    argmax of the logits 10 11 12 13, both layers' first-ranked experts 0 1 2 3. By hand: encoder 11 -> expert 0
    (position 0), 12 -> 1 (position 1), position 2's t+1 is padding: nothing; decoder 10 -> 0, 11 -> 1, 12 -> 2.
    (Without the mask of t+1 the padded position's prediction 13 was counted for the encoder's position 2.)"""
    enc, dec = (SimpleNamespace(index=i, n_experts=4, stack=s) for i, s in ((0, "encoder"), (1, "decoder")))
    vs = VocabSpecialization([enc, dec])
    batch = SimpleNamespace(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    vs.begin_batch(batch)
    top1 = torch.tensor([[0], [1], [2], [3]])
    for L in (enc, dec):
        vs(SimpleNamespace(layer=L, shape=(1, 4), idx=top1, ranked=(top1, None),
                           valid=torch.tensor([True, True, True, False])))
    logits = torch.zeros(1, 4, 16)
    logits[0, torch.arange(4), torch.tensor([10, 11, 12, 13])] = 1.0
    vs.on_batch(batch, SimpleNamespace(logits=logits))
    got = {li: vs.token_table(li, "predicted")[["token_id", "expert", "occurrences"]].values.tolist() for li in (0, 1)}
    assert got[0] == [[11, 0, 1], [12, 1, 1]]
    assert got[1] == [[10, 0, 1], [11, 1, 1], [12, 2, 1]]
