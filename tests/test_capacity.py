"""Expert capacity and token dropping (``capacity:<cf>[:order|score]``, ``moetool capacity``) against a hand loop over
tokens, the invariant that a capacity no expert can exceed reproduces the model, and hand counts of the tables."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import feed, padded_batch, run, zero_compute_lm

from moetool.adapters import find_moe_layers
from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.capacity import capacity, drop_mask


def hand_drop(idx, valid, n, cap, scores=None):
    """Per expert, its assignments of real tokens in token order (t, then k) -- or by decreasing score, ties in
    token order -- and everything after the first ``cap`` dropped: the test's own loop."""
    T, K = idx.shape
    dropped = torch.zeros(T, K, dtype=torch.bool)
    for e in range(n):
        mine = [(t, k) for t in range(T) for k in range(K) if valid[t] and int(idx[t, k]) == e]
        if scores is not None:
            mine.sort(key=lambda tk: -float(scores[tk]))  # Python's sort is stable: ties keep token order
        for t, k in mine[cap:]:
            dropped[t, k] = True
    return dropped


@pytest.mark.parametrize("seed", range(4))
def test_drop_mask_is_the_hand_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    T, n, K = 40, 6, 2
    idx = torch.rand(T, n, generator=gen).argsort(-1)[:, :K]  # distinct experts per token
    valid = torch.rand(T, generator=gen) > 0.25  # padding scattered through the batch
    scores = (torch.rand(T, K, generator=gen) * 5).round() / 5  # coarse: many ties
    for cap in (0, 1, 3, 7, 40):
        for s in (None, scores):
            got = drop_mask(idx, valid, n, torch.tensor(float(cap)), s)
            assert torch.equal(got, hand_drop(idx, valid, n, cap, s)), (cap, s is None)
    assert not drop_mask(idx, valid, n, torch.tensor(math.inf)).any()
    assert not drop_mask(idx, valid, n, torch.tensor(0.0))[~valid].any()  # padding never dropped, never counted


def test_capacity_is_the_exact_ceiling():
    """C = ceil(cf · tokens · K / n) with cf read as its decimal: 1.1 · 10 is 11, not the float 11.000000000000002
    whose ceiling is 12."""
    assert float(capacity(1.1, torch.tensor(10), 1, 1)) == 11
    assert float(capacity(1.25, torch.tensor(100), 2, 8)) == 32  # 31.25 -> 32
    assert float(capacity(0.5, torch.tensor(3), 2, 8)) == 1  # 0.375 -> 1
    assert float(capacity(2.0, torch.tensor(0), 2, 8)) == 0  # no real token: no capacity
    assert math.isinf(float(capacity(math.inf, torch.tensor(5), 2, 8)))


@pytest.mark.parametrize("cf", [2e15, 1e16, 1e20, 1e-12, 1e-300, 5e-324, 1.2345678901234])
def test_extreme_capacity_factors_do_not_overflow(cf):
    """A cf whose fraction cf·K/n does not fit int64 arithmetic (2e15 · 4096 tokens · 2 / 8 > 2**63) is not wrapped to
    a negative capacity that drops every assignment: C is the ceiling of the exact product (Python integers), to
    float64's precision, and at least 1 for a batch with real tokens -- also where cf·K/n underflows float64 to 0
    (5e-324, fp64's smallest subnormal, times 2 / 8: a ceiling of 0 dropped every assignment)."""
    from fractions import Fraction

    from moetool.policies.base import number_text

    for tokens, k, n in ((4096, 2, 8), (10_000, 8, 64), (1, 1, 128)):
        want = math.ceil(Fraction(number_text(cf)) * tokens * k / n)
        got = float(capacity(cf, torch.tensor(tokens), k, n))
        assert got == pytest.approx(want, rel=1e-12) and got >= 1, (tokens, k, n, got, want)
        idx = torch.arange(k).repeat(tokens, 1) % n  # every token to the same experts
        assert drop_mask(idx, torch.ones(tokens, dtype=torch.bool), n, torch.tensor(got)).sum() == \
            tokens * k - min(want, tokens) * k
    assert float(capacity(cf, torch.tensor(0), 2, 8)) == 0  # no real token: no capacity


def test_capacity_at_the_int64_bound():
    """EXACT_BOUND is where tokens x numerator stops fitting int64 for batches of up to 2**32 tokens: a cf of
    2**31 - 1 (numerator below the bound) is exact in integers (2**32 x (2**31 - 1) = 2**63 - 2**32), and 4e9 (above
    it) is taken in float64 -- in int64 2**32 x 4e9 wraps to a negative capacity."""
    from moetool.policies.capacity import EXACT_BOUND

    tokens = torch.tensor(2 ** 32)
    assert float(capacity(float(EXACT_BOUND - 1), tokens, 1, 1)) == 2 ** 32 * (EXACT_BOUND - 1)
    got = float(capacity(4e9, tokens, 1, 1))
    assert got == pytest.approx(4e9 * 2 ** 32, rel=1e-12)
    assert float(capacity(4e9, tokens, 3, 7)) == pytest.approx(4e9 * 2 ** 32 * 3 / 7, rel=1e-12)


def test_a_capacity_no_expert_can_exceed_reproduces_the_model(family, tiny_model, batch):
    """cf = n/K gives every expert a capacity of all the batch's real tokens (at most one assignment each): nothing
    dropped, logits bit for bit (every family); likewise cf = inf."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    with torch.no_grad():
        want = model(**batch).logits
    L = layers[0]
    for spec in (f"capacity:{L.n_experts / L.top_k!r}", "capacity:inf:score"):
        got, events, _ = run(model, layers, batch, policy=make_policy(spec))
        assert torch.equal(got, want), spec
        assert not any(ev.extra["dropped"].any() for ev in events.values())


@pytest.mark.parametrize("order", ["order", "score"])
def test_dropped_assignments_weigh_nothing(tiny_model, order):
    """cf = 0.5 on a padded batch: the model's experts kept, the hand loop's dropped set at weight 0, the rest at
    the model's own weights."""
    model = tiny_model("mixtral")
    layers = find_moe_layers(model)
    batch = padded_batch(batch=3, seq=12, pad=5)
    _, events, _ = run(model, layers, batch, policy=make_policy(f"capacity:0.5:{order}"))
    for ev in events.values():
        n, K = ev.layer.n_experts, ev.idx.shape[1]
        real = int(ev.valid.sum())
        cap = math.ceil(0.5 * real * K / n)
        want = hand_drop(ev.idx, ev.valid, n, cap, ev.weights if order == "score" else None)
        assert want.any() and float(ev.extra["capacity"]) == cap
        assert torch.equal(ev.extra["dropped"], want)
        assert torch.equal(ev.chosen_idx, ev.idx)
        assert (ev.chosen_weights[want] == 0).all() and torch.equal(ev.chosen_weights[~want], ev.weights[~want])


def test_policy_and_counter_stay_on_the_device(tiny_model):
    from test_host_sync import detect

    from moetool.engine import Engine
    from moetool.experiments.capacity.compute import DropCounter

    model = tiny_model("mixtral")
    for spec in ("capacity:0.5", "capacity:1:score"):
        counter = DropCounter()
        with detect(model) as det, torch.no_grad(), Engine(model, find_moe_layers(model),
                                                           policy=make_policy(spec), consumers=[counter]):
            out = model(**padded_batch()).logits
        assert not det.hits and out.isfinite().all() and counter.acc, (spec, det.hits)


@pytest.fixture(scope="module")
def tiny_capacity():
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=640)  # 10 rows: batches of 4, 4 and 2
    res = moetool.capacity(lm, tokens, cfs=(0.5, 1.25), orders=("order", "score"), batch_size=4, bootstrap=100,
                           quiet=True)
    return lm, tokens, res


def test_tables_are_the_hand_count_of_the_first_layer(tiny_capacity):
    """The first MoE layer sees the same input under any capacity: per batch of 4 rows its captured routing,
    dropped by the hand loop, gives the per-expert and per-layer counts of the tables."""
    import moetool

    lm, tokens, res = tiny_capacity
    first = lm.layers[0]
    n = first.n_experts
    seen = []
    with moetool.hook(lm, consumers=[
            lambda ev: seen.append((ev.idx.cpu(), ev.weights.cpu(), ev.valid.cpu()))
            if ev.layer.index == first.index else None]):
        with torch.no_grad():
            for b in tokens.batches(4):
                feed(lm.model, b.input_ids, b.attention_mask)
    assert len(seen) == 3
    experts = res["capacity_experts"].set_index(["cf", "order", "layer", "expert"]).sort_index()
    layers = res["capacity_layers"].set_index(["cf", "order", "layer"]).sort_index()
    lost_any = False
    for cf in (0.5, 1.25):
        for order in ("order", "score"):
            load, dropped, cap, lost, tokens_seen = torch.zeros(n), torch.zeros(n), 0, 0, 0
            for idx, w, valid in seen:
                K, real = idx.shape[1], int(valid.sum())
                c = math.ceil(cf * real * K / n)
                d = hand_drop(idx, valid, n, c, w if order == "score" else None)
                load += torch.bincount(idx[valid].reshape(-1), minlength=n)
                dropped += torch.bincount(idx[d], minlength=n)
                cap, lost, tokens_seen = cap + c, lost + int(d.all(-1).sum()), tokens_seen + real
            got = experts.loc[(cf, order, first.index)]
            assert got["load"].tolist() == load.long().tolist()
            assert got["dropped"].tolist() == dropped.long().tolist() and dropped.sum() > 0
            assert (got["capacity"] == cap).all()
            row = layers.loc[(cf, order, first.index)]
            assert row["tokens"] == tokens_seen == tokens.n_tokens
            assert row["tokens_dropped_all"] == lost
            assert row["dropped_frac"] == pytest.approx(float(dropped.sum()) / float(load.sum()), rel=1e-12)
            assert row["tokens_dropped_all_frac"] == pytest.approx(lost / tokens_seen, rel=1e-12)
            lost_any = lost_any or lost > 0
    assert lost_any  # (a token that lost every expert: the fraction's denominator counts)
    per_layer = res["capacity_layers"].groupby(["cf", "order"])[["tokens_dropped_all", "tokens"]].sum()
    overall = res["capacity"].set_index(["cf", "order"])["tokens_dropped_all_frac"]
    assert overall.to_dict() == pytest.approx(
        (per_layer["tokens_dropped_all"] / per_layer["tokens"]).to_dict(), rel=1e-12)


def test_perplexity_is_ppl_under_the_policy(tiny_capacity):
    """The sweep's perplexity is ``moetool ppl --routing capacity:...`` on the same rows and batches; the ratio is
    paired with the router and its interval holds it."""
    import moetool

    lm, tokens, res = tiny_capacity
    want = moetool.ppl(lm, tokens, routing="capacity:1.25:score", batch_size=4, bootstrap=0, quiet=True)["ppl"]
    t = res["capacity"].set_index(["cf", "order"])
    row = t.loc[(1.25, "score")]
    assert row["perplexity"] == pytest.approx(float(want["perplexity"].iloc[0]), rel=1e-12)
    assert row["router_perplexity"] == pytest.approx(float(want["router_perplexity"].iloc[0]), rel=1e-12)
    assert row["ratio_lo"] <= row["ratio"] <= row["ratio_hi"]
    assert t.loc[(0.5, "order"), "dropped_frac"] > t.loc[(1.25, "order"), "dropped_frac"]


@pytest.mark.parametrize("spec, message", [("capacity:0", "positive"), ("capacity:x", "number"),
                                           ("capacity:1:last", "order"), ("capacity", "capacity:<cf>"),
                                           ("capacity:nan", "positive")])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(MoetoolError, match="bad routing policy") as e:
        make_policy(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_bad_values_in_one_line(tmp_path, cli):
    for args in (["--cf", "0.5,-1"], ["--order", "random"]):
        r = cli("capacity", *args, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "x").exists()


def test_backed_off_batches_are_refused(monkeypatch):
    """Capacity is per batch of --batch-size rows: batches cut smaller by an out-of-memory back-off would give
    another capacity, so the run stops with one line."""
    from moetool.context import Backoff, RunState
    from moetool.errors import MoetoolRuntimeError
    from moetool.experiments.capacity.compute import _check_batches

    with RunState(backoff=Backoff(enabled=True, rows=2)).active():  # the run backed off to 2 rows
        with pytest.raises(MoetoolRuntimeError, match="rerun with --batch-size 2"):
            _check_batches(4)
        _check_batches(2)
    with RunState(backoff=Backoff(enabled=True, rows=3)).active():  # one row short is already another capacity
        with pytest.raises(MoetoolRuntimeError, match="rerun with --batch-size 3"):
            _check_batches(4)
        _check_batches(3)
    _check_batches(4)  # no run: no back-off


@pytest.mark.parametrize("order", ["order", "score"])
def test_trace_writes_the_weights_that_ran(tiny_model, order):
    """``trace --routing capacity:<cf>`` on DeepSeek-V3 (correction bias, groups, unsorted top-K): every row holds
    the router's own experts in decreasing selection score (sigmoid + bias, read off transformers' gate) with the
    weights that ran: the gate's own weight, 0 where the test's hand loop drops the assignment (the trace wrote the
    model's weight for every dropped assignment)."""
    from types import SimpleNamespace

    from moetool.data import TokenSet
    from moetool.experiments.trace.compute import trace

    model = tiny_model("deepseek_v3")
    batch = padded_batch(batch=3, seq=12, pad=5)
    gates = {i: dl.mlp.gate for i, dl in enumerate(model.model.layers) if hasattr(dl.mlp, "experts")}
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name="deepseek_v3")
    seen = {}

    def keep(i, out):  # the gate's last call: the one forward (batch_size = the 3 rows)
        seen[i] = [t.detach().clone() for t in out]

    hooks = [g.register_forward_hook(lambda m, a, out, i=i: keep(i, out)) for i, g in gates.items()]
    tokens = TokenSet(batch["input_ids"], batch["attention_mask"], ["x"] * 3, "test")
    try:
        df = trace(lm, tokens, routing=f"capacity:0.5:{order}", batch_size=3, quiet=True)["trace"]
    finally:
        for h in hooks:
            h.remove()
    valid = batch["attention_mask"].reshape(-1).bool()
    zeros = 0
    for i, (logits, w, idx) in seen.items():  # the gate's own (logits, weights, unsorted top-K)
        n, K = logits.shape[-1], idx.shape[-1]
        cap = math.ceil(0.5 * int(valid.sum()) * K / n)
        dropped = hand_drop(idx, valid, n, cap, w if order == "score" else None)
        select = logits.double().sigmoid() + gates[i].e_score_correction_bias.double()
        rows = df[df.layer == i]
        got_e = rows[[f"expert_{k + 1}" for k in range(K)]].to_numpy()
        got_w = rows[[f"weight_{k + 1}" for k in range(K)]].to_numpy()
        for r, t in enumerate(torch.nonzero(valid).flatten().tolist()):
            want = sorted(range(K), key=lambda k: -float(select[t, idx[t, k]]))
            assert got_e[r].tolist() == [int(idx[t, k]) for k in want], (i, t)
            expect = [0.0 if dropped[t, k] else float(w[t, k]) for k in want]
            assert got_w[r].tolist() == pytest.approx(expect, abs=1e-6), (i, t)
            zeros += sum(x == 0.0 for x in expect)
    assert zeros > 0


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_every_layer_and_perplexity_from_plain_router_hooks(tiny_model, model_type):
    """Independent of moetool's engine: forward hooks on transformers' own gates drop, in every MoE layer and per
    batch of 2 rows (left- and right-padded rows among them), what the hand loop drops (its input already changed
    by the drops before it), and the perplexity comes from the logits in float64: the tables' per-layer counts and
    the perplexity are these."""
    import moetool
    from moetool.data import TokenSet
    from moetool.loading import LoadedModel

    model = tiny_model(model_type)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 1024, (4, 16), generator=gen)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, :5], mask[2, 12:] = 0, 0
    lm = LoadedModel(model_type, "x", "local", model, None, find_moe_layers(model), torch.device("cpu"), torch.float32)
    res = moetool.capacity(lm, TokenSet(ids, mask, [""] * 4, "test"), cfs=(0.5,), orders=("order", "score"),
                           batch_size=2, bootstrap=0, quiet=True)
    gates = {i: dl.mlp.gate for i, dl in enumerate(model.model.layers) if hasattr(dl.mlp, "experts")}
    layers = res["capacity_layers"].set_index(["order", "layer"])
    for order in ("order", "score"):
        counts, nll, scored = {}, 0.0, 0
        for s in range(0, 4, 2):
            b_ids, b_mask = ids[s:s + 2], mask[s:s + 2]
            valid = b_mask.reshape(-1).bool()

            def drop(i, out):
                logits, w, idx = out
                n, K = logits.shape[-1], idx.shape[-1]
                d = hand_drop(idx, valid, n, math.ceil(0.5 * int(valid.sum()) * K / n),
                              w if order == "score" else None)
                c = counts.setdefault(i, [0, 0, 0, 0])  # tokens, assignments, dropped, tokens that lost all
                c[0] += int(valid.sum())
                c[1] += int(valid.sum()) * K
                c[2] += int(d.sum())
                c[3] += int(d.all(-1).sum())
                return logits, w.masked_fill(d.to(w.device), 0), idx

            hooks = [g.register_forward_hook(lambda m, a, out, i=i: drop(i, out)) for i, g in gates.items()]
            try:
                with torch.no_grad():
                    logp = feed(model, b_ids, b_mask).logits.double().log_softmax(-1).cpu()
            finally:
                for h in hooks:
                    h.remove()
            pair = (b_mask[:, :-1] * b_mask[:, 1:]).bool()
            nll -= float(logp[:, :-1].gather(-1, b_ids[:, 1:, None])[..., 0][pair].sum())
            scored += int(pair.sum())
        row = res["capacity"].set_index("order").loc[order]
        assert row["scored_tokens"] == scored
        assert row["perplexity"] == pytest.approx(math.exp(nll / scored), rel=1e-6)
        assert sorted(counts) == sorted(layers.loc[order].index)
        for i, (tok, assigned, dropped, lost) in counts.items():
            got = layers.loc[(order, i)]
            assert (got["tokens"], got["assignments"], got["dropped"], got["tokens_dropped_all"]) == \
                (tok, assigned, dropped, lost), (order, i)
            assert dropped > 0
        # capacity.csv: over every MoE layer, drops per assignment (K per token: not per token) and lost tokens
        tok, assigned, dropped, lost = (sum(c[j] for c in counts.values()) for j in range(4))
        assert (row["assignments"], row["dropped"]) == (assigned, dropped)
        assert row["dropped_frac"] == pytest.approx(dropped / assigned, rel=1e-12)
        assert row["tokens_dropped_all_frac"] == pytest.approx(lost / tok, rel=1e-12)


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_zero_computation_experts_take_no_capacity(model_type):
    """LongCat-Flash's identity experts and Zaya's skip expert (the last n_zero_compute indices) compute nothing: C is
    ceil(cf · tokens · K / m) over the m computed experts, their assignments are never dropped and are not counted,
    and the per-expert table lists the computed experts only. Hand count of the first MoE layer (same input under any
    capacity) per batch of 2 rows (brk11: before, n = 10 on LongCat-Flash gave identity experts capacity: at cf 0.5
    on 2048 tokens 1071 of layer 0's 2120 drops were identity assignments, which need no compute)."""
    import moetool

    events = {}
    lm, tokens = zero_compute_lm(model_type, 6, 32, 11, {1: 7, 4: 3}, lambda ev: events.setdefault(
        ev.layer.index, []).append((ev.idx.cpu(), ev.weights.cpu(), ev.valid.cpu())))
    model, layers = lm.model, lm.layers
    first = layers[0]
    n, z = first.n_experts, first.n_zero_compute
    m = n - z
    assert z >= 1
    seen = events[first.index]
    assert len(seen) == 3 and any(bool((idx[valid] >= m).any()) for idx, _, valid in seen)  # they are chosen
    res = moetool.capacity(lm, tokens, cfs=(0.5,), orders=("order", "score"), batch_size=2, bootstrap=0, quiet=True)
    experts = res["capacity_experts"].set_index(["order", "layer"]).sort_index()
    lay = res["capacity_layers"].set_index(["order", "layer"]).sort_index()
    for order in ("order", "score"):
        load, dropped, cap, lost, assigned = torch.zeros(m), torch.zeros(m), 0, 0, 0
        for idx, w, valid in seen:
            K, real = idx.shape[1], int(valid.sum())
            c = math.ceil(0.5 * real * K / m)
            d = hand_drop(idx, valid, m, c, w if order == "score" else None)  # experts 0..m-1 only
            computed = (idx < m) & valid[:, None]
            load += torch.bincount(idx[computed], minlength=n)[:m]
            dropped += torch.bincount(idx[d], minlength=n)[:m]
            cap, lost, assigned = cap + c, lost + int(d.all(-1).sum()), assigned + int(computed.sum())
        got = experts.loc[(order, first.index)]
        assert got["expert"].tolist() == list(range(m))
        assert got["load"].tolist() == load.long().tolist() and got["dropped"].tolist() == dropped.long().tolist()
        assert dropped.sum() > 0 and (got["capacity"] == cap).all()
        row = lay.loc[(order, first.index)]
        assert (row["assignments"], row["dropped"], row["tokens_dropped_all"]) == (assigned, int(dropped.sum()), lost)
        assert row["dropped_frac"] == pytest.approx(float(dropped.sum()) / assigned, rel=1e-12)
    assert res.meta["zero_computation_experts_without_capacity"] == {L.index: z for L in layers}
    # the policy itself: an identity / skip assignment keeps the model's weight
    _, events, _ = run(model, layers, padded_batch(batch=3, seq=12, pad=5), policy=make_policy("capacity:0.25"))
    for ev in events.values():
        zero = ev.idx >= m
        assert not ev.extra["dropped"][zero].any() and ev.extra["dropped"].any()
        assert torch.equal(ev.chosen_weights[zero], ev.weights[zero])
        assert float(ev.extra["capacity"]) == math.ceil(0.25 * int(ev.valid.sum()) * ev.idx.shape[1] / m)


def test_the_zero_computation_manifest_entry_lists_only_layers_with_such_experts():
    """routing.zero_computation_meta, the one home of capacity's, prune's and expert-similarity's manifest entry:
    ``{key: {layer: count}}`` over the given layers with zero-computation experts only; no entry at all for a model
    without them (no empty ``{}`` claiming something was left out)."""
    from types import SimpleNamespace

    from moetool.experiments.routing import zero_computation_meta

    layers = [SimpleNamespace(index=i, n_zero_compute=z) for i, z in ((0, 2), (1, 0), (3, 1))]
    assert zero_computation_meta(layers, "k") == {"k": {0: 2, 3: 1}}
    assert zero_computation_meta(layers[1:2], "k") == {}
    assert zero_computation_meta([], "k") == {}
