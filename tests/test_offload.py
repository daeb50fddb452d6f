"""moetool offload: cache policies against hand simulations, and the streamed tables against a manual
computation on the embedded tiny model (coverage, hottest share, next-layer prediction)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import feed

from moetool.errors import MoetoolError
from moetool.experiments.offload.compute import default_capacities, expert_bytes, offload, simulate

# K = 1, C = 2, requests 0 1 2 0 1 3 0 1 (worked by hand, see the module docstring's rules)
TRACE_A = [[0], [1], [2], [0], [1], [3], [0], [1]]
HAND_A = {
    "lru": [0, 0, 0, 0, 0, 0, 0, 0],  # always evicts the expert that comes back next
    "lfu": [0, 0, 0, 0, 0, 0, 0, 1],  # t6 evicts 3 (1 request) and keeps 1 (2 requests): t7 hits
    "belady": [0, 0, 0, 1, 0, 0, 1, 0],  # t2 evicts 1 (next at 4, 0 at 3); t4 evicts 2 (never); t5 evicts 1 (7 > 6)
}
# K = 2, C = 3: {0,1} {0,2} {1,3} {0,1} {2,3}
TRACE_B = [[0, 1], [0, 2], [1, 3], [0, 1], [2, 3]]
HAND_B = {
    "lru": [[0, 0], [1, 0], [1, 0], [0, 1], [0, 1]],  # t2 evicts 0 (tie with 2 at t1: lowest id); t3 evicts 2
    "belady": [[0, 0], [1, 0], [1, 0], [1, 1], [0, 1]],  # t2 evicts 2 (next at 4, 0 at 3)
}


@pytest.mark.parametrize("policy", sorted(HAND_A))
def test_hand_trace_k1(policy):
    assert simulate(np.array(TRACE_A), 2, policy)[:, 0].astype(int).tolist() == HAND_A[policy]


@pytest.mark.parametrize("policy", sorted(HAND_B))
def test_hand_trace_k2(policy):
    assert simulate(np.array(TRACE_B), 3, policy).astype(int).tolist() == HAND_B[policy]


def test_policy_invariants_on_random_traces():
    rng = np.random.default_rng(0)
    n, K, T = 8, 2, 300
    p = rng.dirichlet(np.ones(n) * 0.5)
    trace = np.stack([rng.choice(n, K, replace=False, p=p) for _ in range(T)])
    for C in range(K, n + 1):
        h = {pol: int(simulate(trace, C, pol).sum()) for pol in ("lru", "lfu", "belady")}
        assert h["belady"] >= max(h["lru"], h["lfu"]), (C, h)  # optimal offline
        if C == K:  # the cache holds exactly the previous token's experts, whatever the policy
            prev = sum(len(set(a) & set(b)) for a, b in zip(trace[1:], trace[:-1]))
            assert h["lru"] == h["lfu"] == h["belady"] == prev
    full = T * K - len(np.unique(trace))  # C = n: only cold misses
    assert all(int(simulate(trace, n, pol).sum()) == full for pol in ("lru", "lfu", "belady"))
    assert default_capacities(8, 2) == (2, 4, 6, 8)
    with pytest.raises(MoetoolError):
        simulate(trace, 1, "lru")


def _lru_by_hand(trace, C):
    """LRU with a token's requests protected, one request at a time (the module docstring's rule), written
    independently of moetool: residents ordered by (last request, id), the least recent evicted."""
    last, hits = {}, np.zeros(trace.shape, dtype=bool)
    for t, row in enumerate(trace.tolist()):
        for j, e in enumerate(row):
            if e in last:
                hits[t, j] = True
            elif len(last) >= C:
                del last[min((x for x in last if x not in row), key=lambda x: (last[x], x))]
            last[e] = t
    return hits


@pytest.mark.parametrize("n,K,T", [(8, 2, 700), (16, 4, 500), (5, 1, 300), (64, 8, 200)])
def test_vectorised_lru_matches_token_by_token(n, K, T, monkeypatch):
    """LRU (every capacity from one rank computation, blocks of tokens) == the request-by-request simulation;
    capacity >= the distinct experts (nothing evicted) hits every repeat, for every policy."""
    from moetool.experiments.offload import compute as off

    monkeypatch.setattr(off, "RANK_KEYS", 500)  # several chunks of tokens: the keys carried across them
    rng = np.random.default_rng(n * K)
    p = rng.dirichlet(np.ones(n) * 0.3)
    trace = np.stack([rng.choice(n, K, replace=False, p=p) for _ in range(T)])
    ranks = off.lru_ranks(trace)
    for C in sorted({K, K + 1, 2 * K, n // 2, n - 1, n} - set(range(K))):
        want = _lru_by_hand(trace, C)
        assert np.array_equal(simulate(trace, C, "lru"), want), C
        assert np.array_equal(simulate(trace, C, "lru", lru=ranks), want), C
    distinct = len(np.unique(trace))
    first = np.zeros(trace.shape, dtype=bool)
    seen = set()
    for t, row in enumerate(trace.tolist()):
        first[t] = [e in seen for e in row]
        seen.update(row)
    for pol in ("lru", "lfu", "belady"):
        assert np.array_equal(simulate(trace, max(K, distinct), pol), first)
    if distinct > K:  # capacity K, any policy: the previous token's experts, by hand
        prev = np.array([[t > 0 and e in trace[t - 1] for e in row] for t, row in enumerate(trace.tolist())])
        for pol in ("lru", "lfu", "belady"):
            assert np.array_equal(simulate(trace, K, pol), prev)


def _evicting_by_hand(trace, C, policy, ties=None):
    """LFU / Belady one request at a time (the module docstring's rules), written independently of moetool: a dict
    of residents; a miss in a full cache evicts, among residents the token does not request, the fewest requests so
    far (ties: least recent, then lowest id) or the next request furthest ahead (never = T + 1; ties: lowest id).
    ``ties``: a list that gets one entry per eviction decided by a tie-break."""
    T = len(trace)
    rows = trace.tolist()
    last, freq, hits = {}, {}, np.zeros(trace.shape, dtype=bool)
    future = {}
    for t, row in enumerate(rows):
        for e in row:
            future.setdefault(e, []).append(t)

    def next_use(x, t):
        later = [u for u in future[x] if u > t]
        return later[0] if later else T + 1
    for t, row in enumerate(rows):
        for j, e in enumerate(row):
            freq[e] = freq.get(e, 0) + 1
            if e in last:
                hits[t, j] = True
            elif len(last) >= C:
                cand = [x for x in last if x not in row]
                if policy == "lfu":
                    victim = min(cand, key=lambda x: (freq[x], last[x], x))
                    tied = [x for x in cand if freq[x] == freq[victim]]
                else:
                    victim = max(cand, key=lambda x: (next_use(x, t), -x))
                    tied = [x for x in cand if next_use(x, t) == next_use(victim, t)]
                if ties is not None and len(tied) > 1:
                    ties.append((t, policy, C))
                del last[victim]
            last[e] = t
    return hits


def _random_trace(n, K, T, alpha, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(n) * alpha)
    return np.stack([rng.choice(n, K, replace=False, p=p) for _ in range(T)])


#: (block, warm-up share, guess): the default blocks; blocks of one token; small blocks without warm-up; and a
#: random guess of every block's start (wrong almost always: blocks re-stepped, some over several rounds)
BLOCKINGS = {"default": (None, 0.25, None), "one-token blocks": (1, 0.0, None), "7-token blocks": (7, 0.0, None),
             "random guesses": (5, 1.0, "random")}


#: (the widest trace simulated bit-packed, blocks a restepped stretch may cross before its cache goes to boolean
#: rows): bit-packed up to 64 experts, boolean rows beyond; every cache that needs a restep given to boolean rows;
#: boolean rows only
RESTEPS = {"bits": (64, 10 ** 6), "bits, resteps as rows": (64, 0), "rows": (0, 0)}


@pytest.mark.parametrize("restep", sorted(RESTEPS))
@pytest.mark.parametrize("blocking", sorted(BLOCKINGS))
@pytest.mark.parametrize("n,K,T,alpha", [(8, 2, 600, 0.3), (8, 2, 400, 5.0), (16, 4, 300, 0.3), (5, 1, 300, 1.0),
                                         (32, 4, 200, 0.5), (64, 8, 150, 0.3), (128, 8, 100, 1.0),
                                         (72, 3, 200, 0.5)])
def test_lfu_and_belady_match_request_by_request(n, K, T, alpha, blocking, restep, monkeypatch):
    """The block-parallel simulation (keys from the trace, vectorised; blocks stepped at once from guesses, then
    re-stepped until consistent) == the request-by-request rules, at every capacity strictly between K and the
    distinct experts, with and without keys computed once, each capacity alone and all of them in one call;
    including evictions decided by tie-breaks, and whatever the blocks' guesses; bit-packed (states of 8 to 64
    bits) and as boolean rows."""
    from moetool.experiments.offload import compute as off

    if n > 64 and restep != "rows":
        pytest.skip("more than 64 experts: boolean rows only")
    block, warm, guess = BLOCKINGS[blocking]
    monkeypatch.setattr(off, "EVICT_BLOCK", block)
    monkeypatch.setattr(off, "EVICT_WARMUP", warm)
    monkeypatch.setattr(off, "BIT_BLOCK", block or off.BIT_BLOCK)
    monkeypatch.setattr(off, "BIT_WARMUP", warm if block else off.BIT_WARMUP)
    monkeypatch.setattr(off, "BIT_EXPERTS", RESTEPS[restep][0])
    monkeypatch.setattr(off, "BIT_RESTEP_BLOCKS", RESTEPS[restep][1])
    if guess == "random":
        rng = np.random.default_rng(7)
        monkeypatch.setattr(off, "block_guess", lambda keyv: rng.random(keyv.shape) < 0.5)
    trace = _random_trace(n, K, T, alpha, n * K + T)
    distinct = len(np.unique(trace))
    caps = sorted({K + 1, 2 * K, n // 4, n // 2, 3 * n // 4, distinct - 1} & set(range(K + 1, distinct)))
    assert caps
    ties = []
    want = {(C, pol): _evicting_by_hand(trace, C, pol, ties) for pol in ("lfu", "belady") for C in caps}
    if K > 1:
        assert {pol for _, pol, _ in ties} == {"lfu", "belady"}  # tie-breaks were exercised
    together = off.simulate_all(trace, caps, ("lfu", "belady"))
    for pol in ("lfu", "belady"):
        keys = off.request_keys(trace, pol)
        for C in caps:
            w = want[(C, pol)]
            assert 0 < w.sum() < w.size
            assert np.array_equal(simulate(trace, C, pol), w), (pol, C)
            assert np.array_equal(simulate(trace, C, pol, keys=keys), w), (pol, C)
            assert np.array_equal(together[(C, pol)], w), (pol, C)


def test_blocks_are_restepped_when_guessed_wrong(monkeypatch):
    """With a wrong guess (an empty cache) blocks after the first are stepped again from their predecessor's end,
    one miss at a time, and the hits still equal the request-by-request rules (boolean rows)."""
    from moetool.experiments.offload import compute as off

    trace = _random_trace(16, 2, 240, 0.5, 3)
    monkeypatch.setattr(off, "BIT_EXPERTS", 0)
    monkeypatch.setattr(off, "EVICT_BLOCK", 10)
    monkeypatch.setattr(off, "block_guess", lambda keyv: np.zeros(keyv.shape, dtype=bool))  # an empty cache
    lanes = []
    step = off._cache_step

    def counting(res, *a):
        lanes.append(len(res))
        return step(res, *a)
    monkeypatch.setattr(off, "_cache_step", counting)
    got = off.simulate_all(trace, (8,), ("lfu", "belady"))
    first = 10 + 3 + 1  # the first pass: a block and its warm-up (ceil(0.25 * 10) + 1 tokens), every block of both
    assert lanes[:first] == [2 * 24] * first  # caches at once (24 blocks)
    assert len(lanes) > first and set(lanes[first:]) == {1}  # then blocks stepped again, one miss at a time
    for pol in ("lfu", "belady"):
        assert np.array_equal(got[(8, pol)], _evicting_by_hand(trace, 8, pol))


def test_bit_packed_blocks_are_restepped_when_guessed_wrong(monkeypatch):
    """Bit-packed, with a wrong guess (an empty cache): every block of both caches steps at once through its warm-up
    and its tokens, then the blocks after the first are stepped again, all at once, fewer and fewer as they meet the
    recorded states; the hits equal the request-by-request rules."""
    from moetool.experiments.offload import compute as off

    trace = _random_trace(16, 2, 240, 0.5, 3)
    monkeypatch.setattr(off, "BIT_BLOCK", 10)
    monkeypatch.setattr(off, "BIT_WARMUP", 0.25)
    monkeypatch.setattr(off, "block_guess", lambda keyv: np.zeros(keyv.shape, dtype=bool))  # an empty cache
    monkeypatch.setattr(off, "BIT_RESTEP_BLOCKS", 10 ** 6)
    monkeypatch.setattr(off, "_row_hits", None)  # never given to boolean rows
    lanes, step = [], off._bit_step

    def counting(x, *a):
        lanes.append(x.shape)
        return step(x, *a)
    monkeypatch.setattr(off, "_bit_step", counting)
    got = off.simulate_all(trace, (8,), ("lfu", "belady"))
    first = 10 + 3  # the first pass: a block and its warm-up (ceil(0.25 * 10) tokens), every block of both caches
    assert lanes[:first] == [(2, 1, 24)] * first  # at once ([policy, capacity, block])
    again = [shape[0] for shape in lanes[first:]]  # then the blocks entered wrongly: one lane each, narrowing
    assert again and 1 < again[0] <= 2 * 23 and again == sorted(again, reverse=True)
    for pol in ("lfu", "belady"):
        assert np.array_equal(got[(8, pol)], _evicting_by_hand(trace, 8, pol))


def test_bit_helpers():
    """popcount (numpy's and the fallback for numpy < 2) and the bit segments against hand counts."""
    from moetool.experiments.offload import compute as off

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2 ** 63, 200, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 200, dtype=np.uint64)
    want = [bin(int(v)).count("1") for v in x]
    assert off.popcount(x).tolist() == want
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(off, "_BITWISE_COUNT", False)
        assert off.popcount(x).tolist() == want
    for word in (np.uint8, np.uint16, np.uint32, np.uint64):
        bits = np.iinfo(word).bits
        assert off.word_type(bits) is word and (bits == 8 or off.word_type(bits // 2 + 1) is word)
        for _ in range(20):
            K = int(rng.integers(1, 5))
            where = sorted(rng.choice(bits, K, replace=False).tolist())
            mask = word(sum(1 << int(p) for p in where))
            segs = off.bit_segments(np.array([mask]), K)[:, 0]
            for b in range(bits):  # bit b: in segment #(positions below b), unless a position itself
                got = [s for s in range(K + 1) if int(segs[s]) >> b & 1]
                assert got == ([] if b in where else [sum(p < b for p in where)])


@pytest.fixture(scope="module")
def tiny():
    from moetool.data import load_tokens
    from moetool.loading import load

    lm = load("tiny")
    tokens = load_tokens(None, lm.tokenizer, seq_len=32, max_tokens=256)
    tokens.attention_mask[1, :5] = 0  # a left-padded row: padding must never count
    return lm, tokens


def _manual(lm, tokens):
    """Per layer: the real tokens' chosen experts (hooks) and x_ℓ = hidden_states[ℓ] (transformers' own output)."""
    from moetool.engine import forward

    got = {L.index: [] for L in lm.layers}
    hs = []

    def rec(ev):
        got[ev.layer.index].append(ev.idx[ev.valid].cpu())
    forward(lm, tokens, consumers=[rec], batch_size=8, quiet=True,
            on_batch=lambda b, out: None)
    with torch.no_grad():
        for b in tokens.batches(8):
            out = feed(lm.model, b.input_ids, b.attention_mask, output_hidden_states=True)
            keep = b.attention_mask.reshape(-1).bool().to(out.logits.device)
            hs.append([h.reshape(-1, h.shape[-1])[keep] for h in out.hidden_states])
    x = [torch.cat([h[i] for h in hs]) for i in range(len(hs[0]))]
    return {i: torch.cat(v) for i, v in got.items()}, x


def test_tables_match_manual_computation(tiny):
    lm, tokens = tiny
    res = offload(lm, tokens, bootstrap=200, quiet=True)
    idx, x = _manual(lm, tokens)
    T = tokens.n_tokens
    # the intervals' bootstrap: over the packed rows, each with real tokens here
    assert bool(tokens.attention_mask.any(1).all())
    assert {k: res.meta["bootstrap"][k] for k in ("replicates", "rows", "unit")} == {
        "replicates": 200, "rows": tokens.input_ids.shape[0], "unit": "packed row"}
    lay = res["offload_layers"].set_index("layer")
    cache = res["offload_cache"]
    for L in lm.layers:
        trace = idx[L.index]
        assert trace.shape[0] == T
        c = torch.bincount(trace.reshape(-1), minlength=L.n_experts).double()
        assert lay.loc[L.index, "hottest_share"] == pytest.approx(float(c.max() / c.sum()))
        n_params = sum(p[0].numel() for p in (L.experts.gate_up_proj, L.experts.down_proj))
        assert lay.loc[L.index, "expert_bytes"] == expert_bytes(L) == n_params * 4  # fp32
        for _, r in cache[cache.layer == L.index].iterrows():
            assert r.hits == int(simulate(trace.numpy(), r.capacity, r.policy).sum())
            assert r.hit_rate_lo <= r.hit_rate <= r.hit_rate_hi
            assert r.bytes_per_token == pytest.approx((T * L.top_k - r.hits) / T * expert_bytes(L), rel=1e-12)
        # next-layer prediction by hand: route(logits(post_attention_layernorm_ℓ(x_ℓ))) vs the chosen set
        if L.index > 0:
            with torch.no_grad():
                logits = L.logits(L.decoder_layer.post_attention_layernorm(x[L.index]))
            pred = L.route(logits)[0].cpu()
            topk = ((pred.unsqueeze(-1) == trace.unsqueeze(-2)).any(-1).sum(-1).double() / L.top_k).mean()
            pr = res["offload_prefetch"].set_index("layer").loc[L.index]
            assert pr.topk_recall == pytest.approx(float(topk))
            assert pr.tokens == T
    # the summary: per (policy, capacity) the hit rate averaged and the bytes per token summed over the layers
    for _, r in res.summary.iterrows():
        rows = cache[(cache.policy == r.policy) & (cache.capacity == r.capacity)]
        assert len(rows) == len(lm.layers) > 1
        assert r.hit_rate == pytest.approx(rows.hit_rate.mean(), rel=1e-12)
        assert r.bytes_per_token == pytest.approx(rows.bytes_per_token.sum(), rel=1e-12)
    # coverage: first occurrence over all layers by hand
    first = torch.stack([torch.full((L.n_experts,), T).scatter_reduce(
        0, idx[L.index].reshape(-1), torch.arange(T).repeat_interleave(L.top_k), reduce="amin") for L in lm.layers])
    for _, r in res["offload_coverage"].iterrows():
        assert r.coverage == pytest.approx(float((first < r.tokens).double().mean()))


def test_prediction_is_exact_when_attention_adds_nothing(tiny):
    """Invariant: with every attention output projection zeroed, x_ℓ + attn = x_ℓ, so layer ℓ+1's router input IS
    post_attention_layernorm(x_ℓ): top-1 and top-K recall must be exactly 1."""
    lm, tokens = tiny
    lm2 = copy.copy(lm)
    lm2.model = copy.deepcopy(lm.model)
    from moetool.adapters import find_moe_layers

    lm2.layers = find_moe_layers(lm2.model)
    with torch.no_grad():
        for L in lm2.layers:
            L.decoder_layer.self_attn.o_proj.weight.zero_()
    pr = offload(lm2, tokens, bootstrap=0, policies=("lru",), quiet=True)["offload_prefetch"]
    assert len(pr) == len(lm2.layers) - 1
    assert (pr.top1_recall == 1.0).all() and (pr.topk_recall == 1.0).all()
    # x_l is what the pre-hook on decoder layer l+1 reads: the output of decoder layer l, one before the predicted one
    # (mutation pass 13: source_layer written as the predicted layer itself passed)
    assert list(pr.layer) == [L.index for L in lm2.layers[1:]] and list(pr.source_layer) == list(pr.layer - 1)
    pr0 = offload(lm, tokens, bootstrap=0, policies=("lru",), quiet=True)["offload_prefetch"]
    assert (pr0.topk_recall < 1.0).any()  # the real model: attention moves the routing


def _deepseek_v3_routing(gate, h, cfg):
    """DeepSeek-V3's router written from transformers' modeling code (not moetool's rule): sigmoid scores, the
    correction bias for the choice only, groups scored by their top-2 sum, the top-K among ``topk_group`` groups;
    weights = the unbiased scores of the chosen, renormalised, x routed_scaling_factor. ``(idx, weights)``."""
    s = (h.float() @ gate.weight.float().T).sigmoid()
    sel = s + gate.e_score_correction_bias.float()
    n, G = sel.shape[-1], cfg.n_group
    top_groups = sel.view(-1, G, n // G).topk(2, dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1)[1]
    keep = torch.zeros(sel.shape[0], G).scatter_(1, top_groups, 1).repeat_interleave(n // G, dim=1).bool()
    idx = sel.masked_fill(~keep, 0.0).topk(cfg.num_experts_per_tok, dim=-1)[1]
    w = s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


@pytest.mark.parametrize("n, K", [(8, 2), (16, 4)])
def test_prediction_of_a_biased_grouped_router_against_plain_hooks(n, K):
    """DeepSeek-V3 (sigmoid, correction bias, groups): the next-layer prediction is the layer's own routing rule,
    and its top-1 is, as the real one, the routing decision: the chosen expert of largest selection score (sigmoid +
    correction bias), not of largest weight (the unbiased sigmoid): here both from plain hooks (decoder-layer
    pre-hooks for x_ℓ, the gate's output for its logits and chosen set) and the rule above. The correction bias
    reorders the chosen experts' selection scores against their weights (on 512 tokens of
    moetool.adapters.tiny's DeepSeek-V3 top1_recall was 0.8613 / 0.8223 / 0.8125 by weight, 0.8496 / 0.8203 /
    0.8203 by selection score). Both read the same way, a
    perfect predictor is perfect: with every attention output zeroed (router input = post_attention_layernorm(x_ℓ)
    exactly) both recalls are 1.

    transformers' DeepSeek-V3 router takes its top-K with ``sorted=False``: with 16 experts and K=4 torch's CPU topk
    returns the chosen set out of score order (on CUDA too, for most sizes), so the chosen set's first column is not
    the top-1 (mutation pass 21 gap O21: the real top-1 read as ``idx[:, 0]`` survived at n=8, K=2, where CPU topk
    happens to come back sorted); the reference ranks the chosen set itself."""
    from types import SimpleNamespace

    from conftest import build_tiny_model

    from moetool.adapters import find_moe_layers
    from moetool.data import TokenSet

    model = copy.deepcopy(build_tiny_model("deepseek_v3", n_routed_experts=n, num_experts_per_tok=K))
    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, cfg.vocab_size, (6, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -5:], mask[4, :3] = 0, 0
    tokens = TokenSet(ids, mask, [""] * 6, "test")
    layers = model.model.layers
    bites = unsorted = 0
    for zero_attention in (False, True):
        if zero_attention:
            with torch.no_grad():
                for dl in layers:
                    dl.self_attn.o_proj.weight.zero_()
        xin, out, hooks = {}, {}, []
        for i, dl in enumerate(layers):
            hooks.append(dl.register_forward_pre_hook(lambda m, a, kw, i=i: xin.__setitem__(
                i, (a[0] if a else kw["hidden_states"]).detach().clone()), with_kwargs=True))
            if i >= cfg.first_k_dense_replace:
                hooks.append(dl.mlp.gate.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, o)))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        for h in hooks:
            h.remove()
        lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name="ds")
        pr = offload(lm, tokens, bootstrap=0, policies=("lru",), batch_size=6, quiet=True)["offload_prefetch"]
        pr = pr.set_index("layer")
        keep = mask.reshape(-1).bool()
        assert sorted(pr.index) == list(range(cfg.first_k_dense_replace, len(layers)))
        for i in pr.index:
            logits, w, idx = out[i]
            gate = layers[i].mlp.gate
            idx, sel = idx[keep], (logits.sigmoid() + gate.e_score_correction_bias.float())[keep]
            real = idx.gather(1, sel.gather(1, idx).argmax(-1, keepdim=True))[:, 0]
            by_weight = idx.gather(1, w[keep].argmax(-1, keepdim=True))[:, 0]
            with torch.no_grad():
                x = layers[i].post_attention_layernorm(xin[i].reshape(-1, cfg.hidden_size)[keep])
                pidx, pw = _deepseek_v3_routing(gate, x, cfg)
                psel = (x.float() @ gate.weight.float().T).sigmoid() + gate.e_score_correction_bias.float()
            best = pidx.gather(1, psel.gather(1, pidx).argmax(-1, keepdim=True))[:, 0]
            bites += int((real != by_weight).sum())
            unsorted += int((real != idx[:, 0]).sum())
            overlap = (pidx.unsqueeze(-1) == idx.unsqueeze(-2)).any(-1).double().mean()
            assert pr.loc[i, "top1_recall"] == pytest.approx(float((best == real).double().mean()), abs=1e-12)
            assert pr.loc[i, "topk_recall"] == pytest.approx(float(overlap), abs=1e-12)
            if zero_attention:
                assert pr.loc[i, "top1_recall"] == 1.0 and pr.loc[i, "topk_recall"] == 1.0
    assert bites > 0  # the test bites: on some tokens the largest weight is another chosen expert
    if n == 16:  # ... and the chosen set's first column another chosen expert than the top-1
        assert unsorted > 0



@pytest.mark.parametrize("sandwich", ["muse_spark", "beam", "gemma4"])
def test_prediction_is_exact_without_attention_in_sandwich_norm_families(sandwich):
    """Invariant, for decoder layers whose MoE block does not read ``post_attention_layernorm(stream)``: Muse Spark
    and Beam norm the attention OUTPUT with it and feed the block ``pre_feedforward_layernorm(stream)``; Gemma 4's
    router reads the stream itself (its norm inside). With every attention output projection zeroed (Muse Spark's
    residual gates at 0: the stream only rescaled, uniformly, which the norms undo), layer ℓ+1's router input is
    exactly that norm of x_ℓ, so both recalls must be 1 -- with the norms' weights away from their init, as in a
    trained checkpoint. Before, offload applied post_attention_layernorm: top-1 recall 0.44-0.84 (Muse Spark
    0.445 / 0.74 / 0.835) for a perfect predictor."""
    from types import SimpleNamespace

    from moetool.adapters import find_moe_layers, tiny as tiny_models
    from moetool.data import TokenSet

    model = tiny_models.build_tiny(sandwich, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):  # not the identity: the norms must be told apart
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            if name.endswith(("self_attn.o_proj.weight", "self_attn.o_proj.bias", "residual_gate.gate")):
                p.zero_()
    cfg = model.config.get_text_config(decoder=True)
    ids = torch.randint(3, cfg.vocab_size, (4, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name=sandwich)
    pr = offload(lm, TokenSet(ids, mask, [""] * 4, "test"), bootstrap=0, policies=("lru",), batch_size=4,
                 quiet=True)["offload_prefetch"]
    assert len(pr) >= 2
    assert (pr.top1_recall == 1.0).all() and (pr.topk_recall == 1.0).all(), pr[["layer", "top1_recall", "topk_recall"]]

def test_first_layer_alone_gives_the_cache_tables_without_prefetch(tiny):
    """``--layers 0``: the first MoE layer has no decoder layer ahead to predict it from, so there is no prefetch
    table; the cache and coverage tables stand (before, the run refused after its forward with 'nothing to write to
    offload_prefetch.csv: no rows (empty data?)'). Capacity K holds exactly the previous token's K experts
    (any policy); capacity n misses only each expert's first request: hits by hand from the hooked choices."""
    lm, tokens = tiny
    res = offload(lm, tokens, layers=(0,), bootstrap=0, quiet=True)
    assert "offload_prefetch" not in res and "offload_prefetch" in res.meta["left_out"]
    trace = _manual(lm, tokens)[0][0]
    T, K, n = tokens.n_tokens, lm.layers[0].top_k, lm.layers[0].n_experts
    sets = [set(r) for r in trace.tolist()]
    cache = res["offload_cache"]
    assert list(cache.layer.unique()) == [0] and (cache.requests == T * K).all()
    assert (cache[cache.capacity == K].hits == sum(len(a & b) for a, b in zip(sets[1:], sets))).all()
    assert (cache[cache.capacity == n].hits == T * K - len(set().union(*sets))).all()


def _unnormed_router_lm(model_type):
    """A tiny model whose routers read no norm of the stream entering their layer (Inkling-2: a learned mix of the
    stream and the earlier blocks' outputs, block attention residuals; DeepSeek-V4: of its hc_mult streams,
    hyper-connections, the first three MoE layers hash-routed); 2 rows of 16 tokens, the second right-padded by 3."""
    from types import SimpleNamespace

    from moetool.adapters import find_moe_layers, tiny as tiny_models
    from moetool.data import TokenSet

    model = tiny_models.build_tiny(model_type, seed=0)
    cfg = model.config.get_text_config(decoder=True)
    ids = torch.randint(3, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name=model_type)
    return lm, TokenSet(ids, mask, [""] * 2, "test")


@pytest.fixture(scope="module")
def block_residual():
    return _unnormed_router_lm("inkling2")


@pytest.mark.parametrize("model_type", ["inkling2", "deepseek_v4"])
def test_a_first_layer_whose_router_reads_no_norm_of_the_stream_is_not_predicted_so_not_refused(model_type):
    """``--layers 0`` on a model whose routers read no norm of one stream (Inkling-2, DeepSeek-V4): layer 0 has no
    decoder layer ahead to predict it from, so its router input is never asked for and the cache tables stand
    (capacity K: the previous token's K experts, hits by hand from the hooked choices). Without the ahead-ness check
    in ``prediction_norms`` the run was refused ('MoE layers [0] cannot be predicted ... no other layer is left');
    DeepSeek-V4's hash-routed layer 0 was refused too ('needs the routing recomputed from the router logits'),
    though nothing recomputes the routing of a layer that is not predicted."""
    lm, tokens = _unnormed_router_lm(model_type)
    res = offload(lm, tokens, layers=(0,), bootstrap=0, policies=("lru",), batch_size=2, quiet=True)
    assert "offload_prefetch" not in res
    L = lm.layers[0]
    from moetool.engine import forward

    got = []
    forward(lm, tokens, consumers=[lambda ev: got.append(ev.idx[ev.valid].cpu()) if ev.layer.index == 0 else None],
            batch_size=2, quiet=True)
    sets = [set(r) for r in torch.cat(got).tolist()]
    assert len(sets) == tokens.n_tokens == 29
    cache = res["offload_cache"].set_index("capacity")
    assert cache.loc[L.top_k, "requests"] == 29 * L.top_k
    assert cache.loc[L.top_k, "hits"] == sum(len(a & b) for a, b in zip(sets[1:], sets))


def _suggested(msg):
    """The invocations a refusal offers: per alternative (``, or `` between them), its ``--layers`` (``None``: as
    given) and whether it adds ``--no-predict-norm``."""
    import re

    tips = msg.rsplit(": ", 1)[1]
    return [(tuple(int(i) for i in m.group(1).split(",")) if (m := re.search(r"--layers (\S+)", alt)) else None,
             "--no-predict-norm" in alt) for alt in tips.split(", or ")]


@pytest.mark.parametrize("given", [{}, {"layers": (0, 3)}, {"layers": (0, 3), "predict_norm": False},
                                   {"layers": (1, 2)}, {"predict_norm": False}])
def test_every_deepseek_v4_refusal_suggests_an_offload_that_runs(given):
    """The tiny DeepSeek-V4: layers 0-2 hash-routed (a token -> experts table in the router), every layer reading a
    mix of hc_mult residual streams. Offload predicts every layer with a decoder layer ahead, so layers 1-2 (no
    logits to recompute) and 3 (no one hidden state: not through the norm, not from the stream) cannot be; layer 0,
    first of the stack, is simulated from its own routing. Each refusal must offer exactly what runs: the refusal
    of every layer offered --layers 0,3 (refused next for its hyper-connections, whose refusal offered
    --no-predict-norm, refused again in the forward). Expected layers from the model itself: the hash tables and
    the config's hc_mult."""
    from moetool.adapters.generic import hash_table

    lm, tokens = _unnormed_router_lm("deepseek_v4")
    hc = lm.model.config.get_text_config(decoder=True).hc_mult
    assert hc > 1
    hashed = {L.index for L in lm.layers if hash_table(L.router) is not None}
    assert hashed == {0, 1, 2}
    asked = list(given.get("layers", [L.index for L in lm.layers]))
    with pytest.raises(MoetoolError) as e:
        offload(lm, tokens, bootstrap=0, policies=("lru",), batch_size=2, quiet=True, **given)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    bad = [i for i in asked if i != 0]  # layer 0 has no decoder layer ahead: not predicted, whatever it reads
    hash_bad, stream_bad = [i for i in bad if i in hashed], [i for i in bad if i not in hashed]
    assert (f"MoE layers {hash_bad} are hash-routed" in msg) == bool(hash_bad), msg
    assert (f"MoE layers {stream_bad} carry {hc} residual streams" in msg) == bool(stream_bad), msg
    tips = _suggested(msg)
    # the layers asked for that run, or (none left) the model's that do: layer 0 either way; never --no-predict-norm
    assert tips == [((0,), False)], msg
    for layers, no_norm in tips:
        res = offload(lm, tokens, bootstrap=0, policies=("lru",), batch_size=2, quiet=True,
                      **{**given, "layers": layers, **({"predict_norm": False} if no_norm else {})})
        assert sorted(set(res["offload_layers"].layer)) == list(layers)
        cache = res["offload_cache"].set_index("capacity")  # capacity K: hits of the previous token's K experts
        got = []
        from moetool.engine import forward

        forward(lm, tokens, batch_size=2, quiet=True,
                consumers=[lambda ev: got.append(ev.idx[ev.valid].cpu()) if ev.layer.index == 0 else None])
        sets = [set(r) for r in torch.cat(got).tolist()]
        K = lm.layers[0].top_k
        assert cache.loc[K, "hits"] == sum(len(a & b) for a, b in zip(sets[1:], sets))


def test_the_norm_refusal_names_the_layers_left_to_choose(block_residual):
    """Every analysed layer of the tiny Inkling-2: layers 1-5 cannot be predicted through a norm and are named; the
    hint offers exactly the others, layer 0 (first of its stack, not predicted): never a refused layer among them."""
    import re

    lm, tokens = block_residual
    assert [L.index for L in lm.layers] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(MoetoolError) as e:
        offload(lm, tokens, bootstrap=0, policies=("lru",), batch_size=2, quiet=True)
    msg = str(e.value)
    assert re.search(r"MoE layers \[(.*?)\] cannot be predicted", msg).group(1) == "1, 2, 3, 4, 5", msg
    assert re.search(r"choose the others with --layers (\S+),", msg).group(1) == "0", msg
    assert "--no-predict-norm" in msg
    res = offload(lm, tokens, bootstrap=0, policies=("lru",), batch_size=2, quiet=True, predict_norm=False)
    assert list(res["offload_prefetch"].layer) == [1, 2, 3, 4, 5]


def test_cli_first_layer_alone_writes_no_prefetch_table(tmp_path):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "off"
    r = CliRunner().invoke(app, ["offload", "--layers", "0", "--out", str(out), "--max-tokens", "64", "--seq-len",
                                 "32", "--bootstrap", "0"])
    assert r.exit_code == 0, r.output
    assert (out / "offload_cache.csv").exists() and not (out / "offload_prefetch.csv").exists()
    assert "next-layer prediction" not in r.output


def test_options_are_checked(tiny):
    lm, tokens = tiny
    with pytest.raises(MoetoolError):
        offload(lm, tokens, policies=("fifo",), quiet=True)
    with pytest.raises(MoetoolError):
        offload(lm, tokens, capacities=(1,), bootstrap=0, quiet=True)
    with pytest.raises(MoetoolError):
        offload(lm, tokens, bootstrap=5, quiet=True)


@pytest.mark.slow
def test_cli_writes_tables_and_figures(tmp_path):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "off"
    r = CliRunner().invoke(app, ["offload", "--out", str(out), "--max-tokens", "256", "--seq-len", "32",
                                 "--capacity", "2,4", "--bootstrap", "100", "--quiet"])
    assert r.exit_code == 0, r.output
    import pandas as pd

    cache = pd.read_csv(out / "offload_cache.csv")
    assert sorted(cache.capacity.unique()) == [2, 4] and set(cache.policy) == {"lru", "lfu", "belady"}
    assert (cache.hit_rate_lo <= cache.hit_rate).all() and (cache.hit_rate <= cache.hit_rate_hi).all()
    assert (out / "figures" / "offload_hit_rate_vs_cache_size.png").exists()
    assert (out / "figures" / "offload_prefetch_recall.png").exists()
    r = CliRunner().invoke(app, ["offload", "--out", str(tmp_path / "bad"), "--policies", "fifo"])
    assert r.exit_code == 2 and "fifo" in r.output


def test_coverage_and_hottest_expert_of_a_hand_trace():
    """offload's tables from a hand trace (K = 2, n = 6; expert 5 never requested; two packed rows):
    first requests 0, 1 at token 0, 2 at 1, 3 at 2, 4 at 3, so coverage(N) = |{e: first < N}| / 6 =
    2/6, 3/6, 4/6, 5/6 for N = 1..4 (the first N tokens: indices 0..N-1); loads 2 2 2 1 1 0 of 8 requests: hottest
    share 2/8 (expert 0: the lowest of the tied), x n = 1.5 against the uniform 1/6, 5 experts used; a cache of
    all n experts never evicts, so it misses each expert's first request only: 5 misses, 5/4 per token."""
    from moetool.experiments.offload.spec import OffloadOptions
    from moetool.experiments.offload.compute import offload_tables
    from moetool.experiments.trace_analyses import TraceStream
    from types import SimpleNamespace

    req = np.array([[0, 1], [1, 2], [3, 0], [2, 4]])
    stream = TraceStream(np.array([0, 0, 1, 1]), {0: req}, {0: 6})
    opts = OffloadOptions(capacities=(6,), policies=("lru",), coverage_tokens=(1, 2, 3, 4), bootstrap=0)
    res = offload_tables(stream, [SimpleNamespace(index=0, n_experts=6, top_k=2)], opts, {}, None)
    cov = res["offload_coverage"].set_index("tokens")["coverage"]
    assert cov.to_dict() == pytest.approx({1: 2 / 6, 2: 3 / 6, 3: 4 / 6, 4: 5 / 6}, abs=1e-12)
    # default N: the powers 4**k (k >= 2) below T, then every token T (here 16 > T = 4: T alone)
    default = offload_tables(stream, [SimpleNamespace(index=0, n_experts=6, top_k=2)],
                             OffloadOptions(capacities=(6,), policies=("lru",), bootstrap=0), {}, None)
    assert default["offload_coverage"].set_index("tokens")["coverage"].to_dict() == pytest.approx({4: 5 / 6})
    one = TraceStream(np.array([0]), {0: req[:1]}, {0: 6})  # one token: no cache trace to speak of, refused
    with pytest.raises(MoetoolError, match="at least 2 real tokens, got 1"):
        offload_tables(one, [SimpleNamespace(index=0, n_experts=6, top_k=2)], opts, {}, None)
    lay = res["offload_layers"].iloc[0]
    assert (lay.hottest_expert, lay.experts_used, lay.tokens) == (0, 5, 4)
    assert lay.hottest_share == pytest.approx(2 / 8, abs=1e-12)
    assert lay.hottest_vs_uniform == pytest.approx(2 / 8 * 6, abs=1e-12)
    cache = res["offload_cache"].iloc[0]
    assert (cache.requests, cache.hits) == (8, 3)
    assert cache.hit_rate == pytest.approx(3 / 8, abs=1e-12)
    assert cache.misses_per_token == pytest.approx(5 / 4, abs=1e-12)


def test_coverage_of_the_first_tokens_skips_leading_padding(tiny):
    """A left-padded first row (5 padded positions before the data's first real token): coverage(N) for N = 1, 2, 3
    counts the experts of the first N real tokens only, by hand from the real tokens' routing. The padded
    positions sit before token 0 in the stream; counted, the experts they route to read as activated by the first
    token (coverage(1) above its 2 of 8 per layer)."""
    from moetool.data import TokenSet

    lm, base = tiny
    mask = base.attention_mask[:2].clone()
    mask[0, :5] = 0
    tokens = TokenSet(base.input_ids[:2].clone(), mask, base.domains[:2], base.source)
    res = offload(lm, tokens, coverage_tokens=(1, 2, 3), capacities=(8,), policies=("lru",), bootstrap=0,
                  quiet=True)
    idx, _ = _manual(lm, tokens)
    T = tokens.n_tokens
    first = torch.stack([torch.full((L.n_experts,), T).scatter_reduce(
        0, idx[L.index].reshape(-1), torch.arange(T).repeat_interleave(L.top_k), reduce="amin") for L in lm.layers])
    cov = res["offload_coverage"].set_index("tokens")
    got = cov["coverage"]
    for N in (1, 2, 3):
        seen = (first < N).double()  # [layers, n]
        assert got[N] == pytest.approx(float(seen.mean()), abs=1e-12)
        per_layer = seen.mean(1)  # each layer's share of its experts
        assert (cov.loc[N, "coverage_min_layer"], cov.loc[N, "coverage_max_layer"]) == \
            pytest.approx((float(per_layer.min()), float(per_layer.max())), abs=1e-12)
    assert got[1] == 2 / 8  # the first token's K of n experts in every layer


def test_cli_bytes_per_token_is_printed_as_whole_bytes(tmp_path):
    """The console's ``bytes_per_token`` mixed ``1.477e+06`` with ``4608`` (4 significant digits); it is now the
    whole number of bytes with thousands separators, each the CSV's exact value rounded."""
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "off"
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["offload", "--out", str(out), "--max-tokens", "256",
                                                       "--seq-len", "64", "--bootstrap", "0"])
    assert r.exit_code == 0, r.output
    csv = pd.read_csv(out / "offload_cache.csv")  # per layer; the console sums over layers
    want = csv.groupby(["policy", "capacity"]).bytes_per_token.sum()
    assert want.max() >= 1e6  # printed 1.477e+06 before
    header = next(ln for ln in r.output.splitlines() if "bytes_per_token" in ln)
    names = [c.strip() for c in header.strip("┃").split("┃")]
    rows = [dict(zip(names, (c.strip() for c in ln.strip("│").split("│")))) for ln in r.output.splitlines()
            if ln.startswith("│") and ln.strip("│").split("│")[0].strip() in ("lru", "lfu", "belady")]
    assert len(rows) == len(want)
    for row in rows:
        assert row["bytes_per_token"] == f"{want[(row['policy'], int(row['capacity']))]:,.0f}", row
