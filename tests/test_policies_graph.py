"""Similarity- and Attention-Aware routing (Graph of Tokens) against explicit loops on a tiny padded batch."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from conftest import build_tiny_model, captured, padded_batch, run

from moetool.adapters import find_moe_layers
from moetool.errors import MoetoolError
from moetool.policies import make_policy


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def hand_route(ev, rows: dict[tuple[int, int], list[tuple[int, float]]], K: int):
    """For each real query (b, i) with its mixing list [(j, weight)], s_i = Σ_j weight π(h_j): top-K set and
    renormalised weights, by explicit loops (fp64)."""
    B, S = ev.shape
    P = ev.probs.double().tolist()
    out = {}
    for (b, i), mix in rows.items():
        s = [sum(wt * P[b * S + j][e] for j, wt in mix) for e in range(len(P[0]))]
        top = sorted(range(len(s)), key=lambda e: -s[e])[:K]
        tot = sum(s[e] for e in top)
        out[(b, i)] = ({e: s[e] / tot for e in top}, [v / sum(s) for v in s])
    return out


def hand_similarity(ev, tau: float, cosine: bool = False, causal: bool = True):
    """S[i, j] = softmax_j(sim(h_i, h_j) / tau) over real j (j <= i if causal), one (b, i) at a time."""
    B, S = ev.shape
    H = ev.h.double().tolist()
    valid = ev.valid.tolist()

    def sim(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        if cosine:
            dot /= math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
        return dot

    rows = {}
    for b in range(B):
        for i in range(S):
            if not valid[b * S + i]:
                continue
            js = [j for j in range(S) if valid[b * S + j] and (j <= i or not causal)]
            w = _softmax([sim(H[b * S + i], H[b * S + j]) / tau for j in js])
            rows[(b, i)] = list(zip(js, w))
    return rows


def assert_matches(ev, idx, w, want):
    S = ev.shape[1]
    assert len(want) == int(ev.valid.sum())
    for (b, i), (chosen, _) in want.items():
        t = b * S + i
        got = dict(zip(idx[t].tolist(), w[t].double().tolist()))
        assert set(got) == set(chosen), (b, i)
        for e in got:
            assert got[e] == pytest.approx(chosen[e], abs=1e-5)


@pytest.mark.parametrize("tau,causal", [(None, True), (40.0, True), (40.0, False)])
def test_similarity_dot_matches_loops(tau, causal):
    """Raw dot product (paper, W_s = I): S by loops with causal mask and left padding, chosen set and weights."""
    _, _, events = captured("mixtral")
    ev = events[1]
    pol = make_policy("similarity", tau=tau, causal=causal)
    idx, w = pol.select(ev)
    t = math.sqrt(ev.h.shape[-1]) if tau is None else tau
    want = hand_route(ev, hand_similarity(ev, t, causal=causal), ev.layer.top_k)
    assert_matches(ev, idx, w, want)
    # the normalised score distribution kept for fluctuation's entropies
    S = ev.shape[1]
    for (b, i), (_, s) in want.items():
        torch.testing.assert_close(ev.scores[b * S + i].double(), torch.tensor(s, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
    # a diffuse S (tau=40) really mixes: some token's choice differs from its own router's
    if tau == 40.0:
        own = ev.idx.sort(-1).values
        assert (idx.sort(-1).values != own)[ev.valid].any(-1).any()


def test_similarity_tau_in_spec_and_cosine_option():
    _, _, events = captured("mixtral")
    ev = events[0]
    a = make_policy("similarity:0.7", sim="cosine")
    assert a.tau == 0.7 and a.sim == "cosine" and a.causal
    idx, w = a.select(ev)
    assert_matches(ev, idx, w, hand_route(ev, hand_similarity(ev, 0.7, cosine=True), ev.layer.top_k))
    with pytest.raises(MoetoolError):
        make_policy("similarity", sim="euclid")
    with pytest.raises(MoetoolError):
        make_policy("similarity:-1")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_similarity_cosine_zero_tau_is_the_router(model_type):
    """cos(h_i, h_i) = 1 beats every other token when tau -> 0: each token keeps its own top-K and π."""
    _, _, events = captured(model_type)
    for ev in events.values():
        idx, w = make_policy("similarity", sim="cosine", tau=1e-4).select(ev)
        v = ev.valid
        assert torch.equal(idx[v].sort(-1).values, ev.idx[v].sort(-1).values)
        want = ev.probs.gather(-1, idx) / ev.probs.gather(-1, idx).sum(-1, keepdim=True)
        torch.testing.assert_close(w[v].float(), want[v].float(), atol=1e-5, rtol=0)


def test_similarity_runs_in_the_engine_with_padding():
    """Applied in every layer through the engine: what runs is the policy's choice; padded rows stay finite."""
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    pol = make_policy("similarity", tau=40.0)
    logits, events, _ = run(model, layers, padded_batch(), policy=pol)
    assert torch.isfinite(logits).all()
    for ev in events.values():
        idx, w = pol.select(ev)
        assert torch.equal(ev.chosen_idx, idx)
        torch.testing.assert_close(ev.chosen_weights, w.to(ev.chosen_weights.dtype))
        assert torch.isfinite(ev.chosen_weights).all()


@functools.lru_cache(maxsize=None)
def eager_run(family: str):
    """The tiny model with eager attention, the attention policy applied; events carry the attention probs."""
    model = copy.deepcopy(build_tiny_model(family))
    model.set_attn_implementation("eager")
    layers = find_moe_layers(model)
    logits, events, eng = run(model, layers, padded_batch(), policy=make_policy("attention"))
    return logits, events, eng


def hand_attention(ev):
    """Head with the lowest mean row entropy over real queries (loops), then its rows over real keys."""
    A = ev.attn.double().tolist()  # [B][H][S][S]
    B, S = ev.shape
    valid = ev.valid.tolist()
    means = []
    for hd in range(len(A[0])):
        ents = [-sum(p / sum(A[b][hd][i]) * math.log(p / sum(A[b][hd][i])) for p in A[b][hd][i] if p > 0)
                for b in range(B) for i in range(S) if valid[b * S + i]]  # rows renormalised (gpt-oss sinks)
        means.append(sum(ents) / len(ents))
    best = min(range(len(means)), key=lambda k: means[k])
    rows = {(b, i): [(j, A[b][best][i][j]) for j in range(S) if valid[b * S + j]]
            for b in range(B) for i in range(S) if valid[b * S + i]}
    return best, rows


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_attention_matches_loops(model_type):
    logits, events, _ = eager_run(model_type)
    assert torch.isfinite(logits).all()
    for ev in events.values():
        assert ev.attn is not None and ev.attn.shape[-2:] == ev.shape[1:] * 2
        best, rows = hand_attention(ev)
        assert ev.extra["head"] == best
        want = hand_route(ev, rows, ev.layer.top_k)
        assert_matches(ev, ev.chosen_idx, ev.chosen_weights, want)


def test_attention_needs_eager():
    """Without eager attention the engine cannot read probabilities: it switches an SDPA model to eager for the run
    (issue 37.3; tests/test_engine.py checks the same routing as the model loaded eager); a model whose attention
    returns none even then is one clear error, not a silent fallback."""
    import copy

    model = copy.deepcopy(build_tiny_model("mixtral"))
    logits, events, _ = run(model, find_moe_layers(model), padded_batch(), policy=make_policy("attention"))
    assert logits.isfinite().all() and all(ev.attn is not None for ev in events.values())
    model.set_attn_implementation = lambda impl: None  # a model that cannot switch (no AttentionInterface)
    with pytest.raises(MoetoolError, match="eager"):
        run(model, find_moe_layers(model), padded_batch(), policy=make_policy("attention"))


def test_propagate_drops_padding_keys_whatever_the_mixing_matrix_gives_them():
    """:func:`propagate` is shared by similarity and attention routing; an attention matrix may put mass on padding
    keys (a fully masked query row, an implementation's own masking): ``s_i = Σ_{j real} A[i, j] π_j``, renormalised,
    a row that only saw padding keeping its own π -- against explicit fp64 loops."""
    from moetool.policies.similarity import propagate

    g = torch.Generator().manual_seed(0)
    B, S, n = 2, 5, 6
    A = torch.rand(B, S, S, generator=g)  # mass everywhere, padding columns included
    A[1, 4, :2] = 0.0  # row (1, 4) sees padding only
    probs = torch.softmax(torch.randn(B * S, n, generator=g), -1)
    valid = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool).reshape(-1)
    A[1, 4, 2:] = 0.0
    got = propagate(A, probs, valid)
    P, V = probs.double().tolist(), valid.tolist()
    for b in range(B):
        for i in range(S):
            s = [sum(float(A[b, i, j]) * P[b * S + j][e] for j in range(S) if V[b * S + j]) for e in range(n)]
            if sum(s) == 0:
                s = P[b * S + i]
            want = [v / sum(s) for v in s]
            assert got[b * S + i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-7), (b, i)


def test_lowest_entropy_head_averages_real_queries_of_renormalised_rows():
    """The head is chosen by the mean entropy over REAL query rows (a padding query's row says nothing about the
    text) of rows renormalised to sum to one (gpt-oss's sink takes mass off the keys): scipy's entropy by hand."""
    import numpy as np
    from scipy.stats import entropy

    from moetool.policies.attention import lowest_entropy_head

    def reference(A, valid):
        rows = A.double().numpy().transpose(1, 0, 2, 3).reshape(A.shape[1], -1, A.shape[-1])  # [H, B*S, S]
        keep = valid.numpy()
        return int(np.argmin([entropy(r[keep], axis=-1).mean() for r in rows]))

    B, S = 2, 4
    valid = torch.tensor([1, 1, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    A = torch.zeros(B, 2, S, S)
    pad = ~valid.reshape(B, S)
    A[:, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # real queries: entropy log 2
    A[:, 1] = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0])  # log 3
    A[:, 0][pad] = 0.25  # padding queries: head 0 flat (log 4), head 1 certain (0)
    A[:, 1][pad] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert reference(A, valid) == 0 and int(lowest_entropy_head(A, valid)) == 0
    sink = torch.zeros(B, 2, S, S)
    sink[:, 0] = 0.1 * 0.25  # rows summing to 0.1 (the rest on a sink): flat over 4 keys once renormalised, log 4
    sink[:, 1] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # log 2
    every = torch.ones(B * S, dtype=torch.bool)
    assert reference(sink, every) == 1 and int(lowest_entropy_head(sink, every)) == 1


@pytest.mark.parametrize("spec", ["similarity", "attention"])
def test_graph_policies_refuse_hash_routed_layers(spec):
    """DeepSeek-V4's first MoE layers choose their experts by token id (a hash table), not by the router's scores;
    Similarity-/Attention-Aware routing re-ranks experts by the router's distribution π (TopK of Σ_j S[i,j] π(h_j)), as
    topk/topp/prune do (``routes_by_scores``), which such a layer never does. With cosine and tau -> 0 (S = I, 'each
    token keeps its own routing') the policy still chose other experts than the hash layer's own (break-it run 6:
    fluctuation of the tiny DeepSeek-V4 against a copy with perturbed routers gave the router topk_change 0.000 on
    hash layers 0-2 and similarity 0.70-0.81 there, a 'reduction_vs_router' of -0.20 from comparing a score routing
    with a hash routing). Now one line before any forward naming the other layers; on the top-K layer it runs."""
    from moetool.adapters import tiny
    from moetool.engine.hooks import check_policy

    model = tiny.build_tiny("deepseek_v4", seed=0).float().eval()
    layers = find_moe_layers(model)
    hashed = [L.index for L in layers if getattr(L, "hash_routed", False)]
    routed = [L.index for L in layers if not getattr(L, "hash_routed", False)]
    assert hashed and routed
    _, events, _ = run(model, layers, padded_batch())  # the model's own (hash) choice, no policy
    ev = events[hashed[0]]
    idx, _ = make_policy("similarity", sim="cosine", tau=1e-4).select(ev)  # S = I: TopK(π), not the hash set
    v = ev.valid
    assert not torch.equal(idx[v].sort(-1).values, ev.idx[v].sort(-1).values)
    # the engine's check before any forward (DeepSeek-V4's compressed attention also refuses ``attention`` there)
    with pytest.raises(MoetoolError) as e:
        check_policy(make_policy(spec), layers, [L.index for L in layers])
    msg = str(e.value)
    assert "\n" not in msg and "hash-routed" in msg and f"{routed[0]}" in msg, msg
    if spec == "attention":  # the top-K layer alone: its compressed attention has no token-to-token probabilities
        with pytest.raises(MoetoolError, match=r"compressed key blocks .*: no other layer is left$"):
            check_policy(make_policy(spec), layers, routed)
    else:
        check_policy(make_policy(spec), layers, routed)  # the top-K layer alone: nothing to refuse
    if spec == "similarity":
        with pytest.raises(MoetoolError, match="hash-routed"):
            run(model, layers, padded_batch(), policy=make_policy(spec))
        logits, events, _ = run(model, layers, padded_batch(), policy=make_policy(spec), policy_layers=routed)
        assert torch.isfinite(logits).all() and set(events) == {L.index for L in layers}


def _three_tokens(third: tuple[float, float]):
    """One sequence of three real tokens, h = (30, 0), (10, 0), ``third``, and their routers' π."""
    from types import SimpleNamespace

    h = torch.tensor([[30.0, 0.0], [10.0, 0.0], list(third)])
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.2, 0.5, 0.3]])
    return SimpleNamespace(h=h, valid=torch.ones(3, dtype=torch.bool), shape=(1, 3), probs=probs)


def _assert_tau_to_zero_limit(ev, rows: list[int]):
    """Raw dot products, tau -> 0 (1e-37 and fp32's smallest normal): token i's score is exactly π(h_rows[i])."""
    from moetool.policies.similarity import TAU_MIN

    for tau in (1e-37, TAU_MIN):
        s = make_policy(f"similarity:{tau!r}").scores(ev)
        torch.testing.assert_close(s, ev.probs[rows], atol=0, rtol=0)


def test_a_small_similarity_tau_gives_the_limit_of_its_softmax_not_the_tokens_own_routing():
    """sim / tau overflowed fp32 for a small tau (900 / 1e-37), inf - inf made S's rows NaN, and propagate read a
    NaN row as "keep your own π": fluctuation --tau 1e-300 and ppl --routing similarity:1e-300 ran the router's
    routing, not Def. 2's tau -> 0 limit (break-it run 7). By hand: with raw dot products and causal rows, tau -> 0
    puts all of token i's weight on argmax_{j <= i} h_i · h_j; token 1 (h = (10, 0)) meets token 0 (30, 0) at 300 and
    itself at 100, so s_1 = π(h_0); token 2 (0, 10) is orthogonal to both, so s_2 = π(h_2)."""
    ev = _three_tokens((0.0, 10.0))
    probs = ev.probs
    _assert_tau_to_zero_limit(ev, [0, 0, 2])
    # a huge tau (inf in fp32) is the other limit: S uniform over the admissible j <= i
    s = make_policy("similarity:1e39").scores(ev)
    torch.testing.assert_close(s, torch.stack([probs[0], probs[:2].mean(0), probs.mean(0)]), atol=1e-7, rtol=0)
    # a tau that is subnormal or 0 in fp32 cannot be divided by there: one line
    with pytest.raises(MoetoolError, match="fp32's smallest normal"):
        make_policy("similarity:1e-300")


def test_the_shift_before_tau_is_the_largest_admissible_similarity_not_a_future_tokens():
    """Each row's shift is its largest similarity over the j it may attend to: a later (causal) token more similar
    than any earlier one must not set it. h = (30, 0), (10, 0), (100, 0), raw dot products, tau -> 0: token 1 meets
    token 0 at 300 and itself at 100 (s_1 = π(h_0)), but the future token 2 at 1000; shifted by 1000, both of its
    admissible similarities overflowed to -inf / tau and the NaN row fell back to its own π(h_1)."""
    _assert_tau_to_zero_limit(_three_tokens((100.0, 0.0)), [0, 0, 2])


@pytest.mark.parametrize("attn_shape", [(2, 2, 3, 3), (1, 2, 4, 4), (1, 2, 3, 4)])
def test_attention_probabilities_of_another_batch_shape_are_one_line(attn_shape):
    """Probabilities whose batch or (query, key) sizes are not the routed batch's (1, 3) -- a KV cache, another
    layer's -- are refused in one line naming both shapes, never read against the wrong tokens (the batch check
    dropped, a [2, heads, 3, 3] reached the head choice and stopped with a reshape traceback)."""
    from types import SimpleNamespace

    A = torch.full(attn_shape, 1.0 / attn_shape[-1])
    ev = SimpleNamespace(attn=A, shape=(1, 3), valid=torch.ones(3, dtype=torch.bool), probs=torch.full((3, 4), 0.25),
                         layer=SimpleNamespace(index=0, top_k=2, weight_scale=1.0), extra={})
    with pytest.raises(MoetoolError, match=r"^layer 0: attention probabilities of shape .* do not match the batch "
                                           r"\(1, 3\) \(a KV cache in use\? pass use_cache=False\)$"):
        make_policy("attention").select(ev)


def test_attention_refuses_a_decoder_layer_with_two_attention_sublayers():
    """LongCat-Flash's decoder layer holds two attention sublayers (a ``ModuleList`` under ``self_attn``): which one's
    probabilities would route is undefined, so one line -- never the list handed to the engine as 'the' attention."""
    from moetool.adapters.tiny import build_tiny
    from moetool.policies.attention import softmax_attention

    layers = find_moe_layers(build_tiny("longcat_flash", seed=0))
    assert isinstance(layers[0].decoder_layer.self_attn, torch.nn.ModuleList)
    for L in layers:
        with pytest.raises(MoetoolError, match=rf"^attention routing: MoE layers \[{L.index}\] have decoder layers "
                                               r"of 2 attention sublayers \(self_attn\)"):
            softmax_attention(L)


@pytest.mark.parametrize("kind", ["linear_attention", "mamba", "lightning", "deltanet"])
def test_attention_refuses_a_layer_whose_config_type_is_a_linear_mixer(kind):
    """A remote-code hybrid may call its linear-attention module ``self_attn`` with a class name that says nothing
    (``Attention``): the config's per-layer type is then the only witness, and it must refuse that layer in one line
    naming the type while the same module on a ``full_attention`` layer is accepted."""
    from types import SimpleNamespace

    from moetool.policies.attention import softmax_attention

    class Attention(torch.nn.Module):
        pass

    attn = Attention()
    config = SimpleNamespace(layer_types=["full_attention", kind])
    decoder = SimpleNamespace(self_attn=attn)
    ok = SimpleNamespace(index=0, config=config, decoder_layer=decoder, block=torch.nn.Identity())
    assert softmax_attention(ok) is attn
    bad = SimpleNamespace(index=1, config=config, decoder_layer=decoder, block=torch.nn.Identity())
    with pytest.raises(MoetoolError, match=rf"MoE layers \[1\] have no softmax attention .*self_attn \(Attention\), "
                                           rf"layer type '{kind}'\)"):
        softmax_attention(bad)
