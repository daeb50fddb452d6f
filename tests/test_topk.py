"""Reduced and dynamic K (``topk:<k>``, ``topp:<p>``, ``moetool topk``) against hand computations and the
invariant that ``topk:K`` is the model's own routing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAMILIES, feed, padded_batch, run, zero_compute_lm

from moetool.adapters import find_moe_layers, rules
from moetool.engine.hooks import check_policy
from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.topk import top_p


def test_topk_at_the_models_k_reproduces_the_model(family, tiny_model, batch):
    """``topk:K`` goes through the model's own routing with K replaced by K: logits bit for bit (every family:
    group limits, correction biases, scaling factors, hand adapters)."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    with torch.no_grad():
        want = model(**batch).logits
    got, _, _ = run(model, layers, batch, policy=make_policy(f"topk:{layers[0].top_k}"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f in ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")])
def test_topk_one_is_the_first_ranked_expert(model_type, tiny_model, batch):
    model = tiny_model(model_type)
    layers = find_moe_layers(model)
    _, events, _ = run(model, layers, batch, policy=make_policy("topk:1"))
    for ev in events.values():
        L = ev.layer
        idx, w = L.route(ev.logits)  # the model's own top-K on the same router input
        assert torch.equal(ev.chosen_idx[:, 0], idx[:, 0])
        if L.renormalize:  # one chosen expert renormalised: its weight is the scaling factor
            assert torch.allclose(ev.chosen_weights[:, 0].float(), torch.full_like(w[:, 0], L.weight_scale))


def test_top_p_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.05, 0.9, 0.05], [0.34, 0.33, 0.33]])
    idx, mask = top_p(probs, 0.6, 3)
    assert idx.tolist() == [[0, 1, 2], [1, 0, 2], [0, 1, 2]]
    assert mask.tolist() == [[True, True, False], [True, False, False], [True, True, False]]
    assert top_p(probs, 0.5, 3)[1][0].tolist() == [True, False, False]  # 0.5 reaches 0.5: one expert
    assert top_p(probs, 1.0, 3)[1].all()
    assert top_p(probs, 1.0, 2)[1].tolist() == [[True, True]] * 3  # capped at kmax = 2


def test_masked_weights_by_hand():
    """A chosen set of its own size per token: a softmax over the chosen, a renormalisation over them, or the
    scores alone -- each by hand from the logits."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6)
    idx = torch.argsort(logits, dim=-1, descending=True)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6], dtype=torch.bool)
    p = rules.Params(top_k=2, scale=2.5)
    pi = torch.softmax(logits, -1).gather(-1, idx)
    for t in range(4):
        m = mask[t]
        chosen_logits = logits[t].gather(-1, idx[t])[m]
        soft = rules.TOPK_SOFTMAX.weights(logits, idx, p, mask)[t]
        assert torch.allclose(soft[m], torch.softmax(chosen_logits, -1) * 2.5) and (soft[~m] == 0).all()
        renorm = rules.SOFTMAX_TOPK_RENORM.weights(logits, idx, p, mask)[t]
        assert torch.allclose(renorm[m], pi[t][m] / pi[t][m].sum() * 2.5) and (renorm[~m] == 0).all()
        plain = rules.SOFTMAX_TOPK.weights(logits, idx, p, mask)[t]
        assert torch.allclose(plain[m], pi[t][m] * 2.5) and (plain[~m] == 0).all()
        sig = rules.SIGMOID_TOPK_RENORM.weights(logits, idx, p, mask)[t]
        s = torch.sigmoid(logits[t].gather(-1, idx[t]))[m]
        assert torch.allclose(sig[m], s / s.sum() * 2.5)
    with pytest.raises(MoetoolError, match="sparsemixer"):
        rules.SPARSEMIXER.weights(logits, idx, p, mask)


@pytest.fixture(scope="module")
def tiny_topk():
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    return lm, tokens, moetool.topk(lm, tokens, ks=(1, 8), ps=(0.6, 1.0), bootstrap=100, quiet=True)


@pytest.mark.slow
def test_experts_per_token_by_hand(tiny_topk):
    """The first MoE layer sees the same input under any policy: its top-p counts come from the unhooked
    router's π by hand; topk:1 uses one expert, the router K, topp:1 every expert (weights are positive)."""
    import numpy as np

    import moetool

    lm, tokens, res = tiny_topk
    first = lm.layers[0]
    probs = []
    with moetool.hook(lm, consumers=[lambda ev: probs.append(
            (ev.probs[ev.valid].cpu().numpy(), first.index == ev.layer.index))]):
        with torch.no_grad():
            for b in tokens.batches(8):
                feed(lm.model, b.input_ids, b.attention_mask)
    pi = np.concatenate([p for p, ok in probs if ok])
    ranked = -np.sort(-pi, axis=1)
    before = np.cumsum(ranked, axis=1) - ranked
    used = np.maximum((before < 0.6).sum(1), 1)
    want = used.mean()
    layers = res["topk_layers"].set_index(["policy", "layer"])
    assert layers.loc[("topp:0.6", first.index), "mean_experts"] == pytest.approx(want, abs=1e-12)
    got = layers.loc[("topp:0.6", first.index), ["min_experts", "max_experts"]].tolist()
    assert got == [used.min(), used.max()] and used.min() < used.max()  # the fewest / most experts of a token
    for policy, k in (("topk:1", 1), ("router", first.top_k)):
        assert (layers.loc[policy, "min_experts"] == k).all() and (layers.loc[policy, "max_experts"] == k).all()
    assert (layers.loc["topk:1", "mean_experts"] == 1).all()
    assert (layers.loc["router", "mean_experts"] == first.top_k).all()
    assert (layers.loc["topp:1", "mean_experts"] == first.n_experts).all()
    t = res["topk"].set_index("policy")
    assert t.loc["router", "ratio"] == 1 and t.loc["topk:1", "experts_frac"] == 1 / first.n_experts
    assert t.loc["topk:8", "experts_frac"] == 1 and (t["experts_frac"] <= 1).all()  # all 8 experts: the whole layer
    assert t.loc["topk:1", "ratio_lo"] <= t.loc["topk:1", "ratio"] <= t.loc["topk:1", "ratio_hi"]


def test_tokens_count_one_thing(tiny_topk):
    """``tokens`` is the real tokens each layer routed in topk.csv and topk_layers.csv alike; the predictions the
    perplexity averages over are ``scored_tokens`` (one fewer per packed row); experts_frac is mean_experts / n."""
    lm, tokens, res = tiny_topk
    real = int(tokens.attention_mask.sum())
    t, layers = res["topk"], res["topk_layers"]
    assert (t["tokens"] == real).all() and (layers["tokens"] == real).all()
    assert (t["scored_tokens"] == real - tokens.input_ids.shape[0]).all()
    assert layers["experts_frac"].tolist() == pytest.approx((layers["mean_experts"] / 8).tolist(), abs=0)
    assert "tokens" in res.meta["definitions"] and "scored_tokens" in res.meta["definitions"]


def test_same_rows_as_ppl(tiny_topk):
    """The policies' perplexities are what ``moetool ppl`` gives for the same routing on the same rows."""
    import moetool

    lm, tokens, res = tiny_topk
    want = moetool.ppl(lm, tokens, routing="topk:1", bootstrap=0, baseline=False, quiet=True)["ppl"]
    t = res["topk"].set_index("policy")
    assert t.loc["topk:1", "perplexity"] == pytest.approx(float(want["perplexity"].iloc[0]), rel=1e-12)


def test_layers_subset_averages_the_layers_the_policy_ran_in():
    """With --layers, topk.csv's mean_experts / experts_frac average the chosen layers only (each policy's own
    count there), not every MoE layer: topk:1 and topp:1 in layer 1 of tiny (K = 2 of n = 8) use exactly 1 and 8
    experts per token (topp:1 takes every expert: all weights are positive), whatever the other layers do; those
    still run the router (K experts) in topk_layers.csv. Before the fix: (2 + 1 + 2 + 2) / 4 = 1.75 and
    (2 + 8 + 2 + 2) / 4 = 3.5."""
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=16, max_tokens=48)
    res = moetool.topk(lm, tokens, ks=(1,), ps=(1.0,), layers=(1,), bootstrap=0, quiet=True)
    t = res["topk"].set_index("policy")
    assert t.loc["topk:1", "mean_experts"] == 1 and t.loc["topk:1", "experts_frac"] == 1 / 8
    assert t.loc["topp:1", "mean_experts"] == 8 and t.loc["topp:1", "experts_frac"] == 1
    assert t.loc["router", "mean_experts"] == 2
    layers = res["topk_layers"].set_index(["policy", "layer"])["mean_experts"]
    assert layers.loc[("topk:1", 1)] == 1 and layers.loc[("topp:1", 1)] == 8
    assert [layers.loc[(p, i)] for p in ("topk:1", "topp:1") for i in (0, 2, 3)] == [2] * 6


@pytest.mark.parametrize("spec, message", [("topk:0", "at least 1"), ("topp:1.5", "(0, 1]"), ("topk:x", "number"),
                                           ("topp", "topp:<p>")])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(MoetoolError, match="bad routing policy") as e:
        make_policy(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_top_p_mass_runs_and_is_named_as_given_not_rounded_to_six_digits():
    """``moetool topk --ps`` built each policy from ``f"topp:{p:g}"`` (six significant digits) and ``topp:<p>`` was
    named so: ``--ps 0.5,0.5000001`` gave two rows 'topp:0.5' of p = 0.5, ``--ps 0.9999999`` ran and printed topp:1
    (all experts), ``ppl --routing topp:0.9999999`` wrote routing 'topp:1' (break-it run 6). Here a token whose top-1
    mass c lies just below a p whose six-digit text is at most c: by the definition (the smallest prefix whose mass
    reaches p) that token needs a second expert at p, and only one at the rounded p."""
    import math

    from conftest import captured

    from moetool.experiments.topk.spec import TopkOptions

    _, _, events = captured("mixtral")
    ev = events[0]
    top1 = ev.probs.max(-1).values.double().tolist()
    pick = [(t, c + 2e-7) for t, c in enumerate(top1) if ev.valid[t] and float(format(c + 2e-7, "g")) <= c - 1e-7]
    assert pick
    t, p = pick[0]
    spec = [s for s, kind, _ in TopkOptions(ps=(p,), ks=(1,)).specs(ev.layer.top_k) if kind == "topp"][0]
    policy = make_policy(spec)
    assert policy.p == p and float(policy.name.split(":")[1]) == p
    _, w = policy.select(ev)
    assert int((w[t] > 0).sum()) >= 2  # the mass before the second expert, c, is below p
    assert make_policy("topp:0.9999999").name == "topp:0.9999999" and math.isclose(make_policy("topp:0.5").p, 0.5)
    assert [s for s, _, _ in TopkOptions(ps=(0.5, 0.5000001), ks=(1,)).specs(2)][2:] == ["topp:0.5", "topp:0.5000001"]


def test_sparsemixer_refuses_before_any_forward(tiny_model):
    model = tiny_model("phimoe")
    L = find_moe_layers(model)[0]
    make_policy("topk:2").check(L)  # its own K: fine
    for spec in ("topk:1", "topp:0.9"):
        with pytest.raises(MoetoolError, match="sparsemixer"):
            make_policy(spec).check(L)


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_k_above_the_experts_available_is_refused(tiny_model, kind):
    """topk:<k> and topp's kmax above what a layer can route a token to: one line before any forward, never a
    clamped k recorded as k. DeepSeek-V3's group limits (topk_group of n_group groups) allow fewer than n."""
    model = tiny_model(kind)
    L = find_moe_layers(model)[0]
    c = model.config
    n = c.num_local_experts if kind == "mixtral" else c.n_routed_experts
    most = n if kind == "mixtral" else c.topk_group * n // c.n_group
    assert most < n or kind == "mixtral"
    check_policy(make_policy(f"topk:{most}"), [L], [L.index])
    check_policy(make_policy(f"topp:0.9:{n}"), [L], [L.index])  # top-p ranks by π over every expert, group limits aside
    for spec, limit in ((f"topk:{most + 1}", most), (f"topk:{n + 90}", most), (f"topp:0.9:{n + 1}", n)):
        with pytest.raises(MoetoolError, match=f"can route a token to at most {limit}[;( ]") as e:
            check_policy(make_policy(spec), [L], [L.index])
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_refuses_k_above_n_before_any_forward(tmp_path):
    """In one process (a subprocess per case cost its imports four times); the one line on stderr alone is
    checked by the subprocess tests of tests/test_cli.py."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    for args in (["ppl", "--routing", "topk:999"], ["topk", "--ks", "1,99"], ["topk", "--kmax", "9"],
                 ["ppl", "--routing", "topp:0.5:9"]):
        r = CliRunner().invoke(app, [*args, "--max-tokens", "256", "--out", str(tmp_path / "x")])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and "at most 8; choose at most 8" in lines[0], r.output
        assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cli_refuses_bad_values_in_one_line(tmp_path, cli):
    for args in (["--ps", "0.5,1.5"], ["--ks", "0"]):
        r = cli("topk", *args, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "x").exists()


def test_padded_batch_counts_real_tokens_only(tiny_model):
    from moetool.experiments.topk.compute import ExpertCounter

    model = tiny_model("mixtral")
    batch = padded_batch()
    counter = ExpertCounter()
    run(model, find_moe_layers(model), batch, policy=make_policy("topk:1"))
    from moetool.engine import Engine

    with torch.no_grad(), Engine(model, find_moe_layers(model), policy=make_policy("topk:1"), consumers=[counter]):
        model(**batch)
    rows = counter.rows()
    real = int(batch["attention_mask"].sum())
    assert all(r["tokens"] == real and r["mean_experts"] == 1 for r in rows)
    assert json.dumps(rows)  # plain numbers


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_top_p_columns_are_known_without_reading_the_batch(model_type, tiny_model, batch):
    """topp hands the experts ``kmax`` (default n) columns, a width known before the forward (cutting to the batch's
    largest set would read it on the host: a sync per layer, issue 37); the unchosen columns weigh 0, so the block
    output is that of the chosen set alone, computed expert by expert here."""
    model = tiny_model(model_type)
    _, events, _ = run(model, find_moe_layers(model), batch)
    for spec, width in (("topp:0.5", None), ("topp:0.5:3", 3)):
        pol = make_policy(spec)
        for ev in events.values():
            L = ev.layer
            idx, w = pol.select(ev)
            full_idx, mask = top_p(ev.probs, 0.5, width or L.n_experts)
            assert idx.shape[1] == (width or L.n_experts) and torch.equal(idx, full_idx)
            assert (w[~mask] == 0).all() and (w[mask] > 0).all()
            used = int(mask.sum(-1).max())
            with torch.no_grad():
                torch.testing.assert_close(L.experts(ev.h, idx, w), L.experts(ev.h, idx[:, :used], w[:, :used]),
                                           rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("spec", ["topp:1", "topk:n"])
def test_wide_sets_run_in_chunks_of_the_models_pairs(model_type, spec, tiny_model):
    """A policy handing the experts n columns per token (topp:1, topk:n) runs them over chunks of tokens holding at
    most tokens x K (token, expert) pairs -- the activations of the model's own forward, not n / K times them -- and
    each layer's experts output is still sum_j w_j W_o glu(h) of every chosen expert, by hand from the raw weights."""

    model = tiny_model(model_type)
    layers = find_moe_layers(model)
    n, K = layers[0].n_experts, layers[0].top_k
    assert n > K
    inputs = padded_batch(batch=3, seq=11)
    T = inputs["input_ids"].numel()
    calls = {L.index: [] for L in layers}
    for L in layers:  # a spy under the engine's chunking: the calls the experts module really runs
        def spy(h, idx, w, L=L):
            calls[L.index].append((h.shape[0], idx.shape[-1]))
            return type(L.experts).forward(L.experts, h, idx, w)
        vars(L.experts)["forward"] = spy
    out = {}
    try:
        _, events, _ = run(model, layers, inputs, policy=make_policy(spec.replace(":n", f":{n}")), experts_out=out)
        assert all(isinstance(vars(L.experts).get("forward"), type(spy)) for L in layers)  # restored: the spy
    finally:
        for L in layers:
            vars(L.experts).pop("forward", None)
    assert all(not isinstance(getattr(L.experts, "forward"), type(spy)) for L in layers)
    rows = max(1, T * K // n)
    for L in layers:
        assert calls[L.index] == [(min(rows, T - s), n) for s in range(0, T, rows)]
        assert all(r * width <= T * K for r, width in calls[L.index])
        ev = events[L.index]
        W = L.expert_weights()
        h = ev.h.double()
        want = torch.zeros_like(h)
        for j in range(ev.chosen_idx.shape[1]):
            e = ev.chosen_idx[:, j]
            g = torch.einsum("tid,td->ti", W.gate[e].double(), h)
            u = torch.einsum("tid,td->ti", W.up[e].double(), h)
            y = torch.einsum("tdi,ti->td", W.down[e].double(), L.act(g) * u)
            want += ev.chosen_weights[:, j, None].double() * y
        assert torch.allclose(out[L.index].double(), want, atol=1e-5, rtol=1e-4)
        assert (ev.chosen_weights != 0).sum(-1).max() > K  # the wide set really is used


def test_chunked_experts_change_no_logit(family, tiny_model, monkeypatch):
    """Invariant on every family: topp:1 (every expert per token) gives the same logits with the experts run in
    chunks of tokens x K pairs as in one call (up to fp32 rounding of the smaller GEMMs)."""
    from moetool.engine import hooks

    model = tiny_model(family)
    layers = find_moe_layers(model)
    inputs = padded_batch(batch=3, seq=11)
    try:
        got, _, _ = run(model, layers, inputs, policy=make_policy("topp:1"))
    except MoetoolError as e:  # sparsemixer: no weights for a set of any size
        pytest.skip(str(e))

    class Whole:
        def __init__(self, layer):
            pass

        def remove(self):
            pass
    monkeypatch.setattr(hooks, "ChunkedExperts", Whole)
    want, _, _ = run(model, layers, inputs, policy=make_policy("topp:1"))
    assert layers[0].n_experts > layers[0].top_k
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_routers_own_ratio_interval_is_one_with_a_bootstrap_and_nan_without():
    """The router row's ratio interval was set to [1, 1] by each of topk, norm-select, prune and super-experts, also
    with --bootstrap 0, where the definitions say every *_lo/*_hi is NaN (the other rows' were). Now
    ``ppl_intervals(run, base=run)`` says it once: [1, 1] where the perplexity has an interval, NaN where not."""
    import math

    import moetool
    from moetool.experiments.routing import perplexity, ppl_intervals
    from moetool.uncertainty import RowTable

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    for n_boot in (0, 100):
        df = moetool.topk(lm, tokens, bootstrap=n_boot, quiet=True)["topk"]
        router, others = df[df.kind == "router"].iloc[0], df[df.kind != "router"]
        assert router.ratio == 1.0
        if n_boot:
            assert (router.ratio_lo, router.ratio_hi) == (1.0, 1.0)
            assert (others.ratio_lo < others.ratio_hi).all()
        else:
            assert math.isnan(router.ratio_lo) and math.isnan(router.ratio_hi)
            assert others.ratio_lo.isna().all() and others.ratio_hi.isna().all()
    one_row = moetool.tokens(lm, None, seq_len=64, max_tokens=64)  # one row: no perplexity interval, no ratio one
    assert one_row.input_ids.shape[0] == 1
    res = perplexity(lm, one_row, batch_size=1, quiet=True, rows=RowTable(one_row))
    ci = ppl_intervals(res, res, n_boot=100)
    assert ci["ratio"] == 1.0 and math.isnan(ci["perplexity_lo"]) and math.isnan(ci["ratio_lo"])


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_zero_computation_experts_are_not_counted_as_experts_used(model_type):
    """LongCat-Flash's identity experts and Zaya's skip expert (the last n_zero_compute indices) can be chosen but
    compute nothing: experts per token count the computed experts only, experts_frac is over the m computed. By hand
    from the unhooked routing: the router's computed choices per token in every layer, and topp:0.9's set in the
    first layer (the same input under any policy) from π ranked by hand (brk11: before, the router's row read
    mean_experts 2 = K on LongCat-Flash, though 36% of its assignments are identity ones)."""
    import numpy as np

    import moetool

    seen = {}
    lm, tokens = zero_compute_lm(model_type, 4, 24, 3, {1: 5}, lambda ev: seen.setdefault(ev.layer.index, []).append(
        (ev.idx[ev.valid], ev.weights[ev.valid], ev.probs[ev.valid].double())))
    layers = lm.layers
    first, m = layers[0], layers[0].n_computed
    assert first.n_zero_compute >= 1
    res = moetool.topk(lm, tokens, ks=(1,), ps=(0.9,), batch_size=2, bootstrap=0,
                       quiet=True)
    per_layer = res["topk_layers"].set_index(["policy", "layer"])
    router_means = []
    for L in layers:
        idx = torch.cat([i for i, _, _ in seen[L.index]])
        w = torch.cat([x for _, x, _ in seen[L.index]])
        used = ((idx < m) & (w != 0)).sum(-1).numpy()
        row = per_layer.loc[("router", L.index)]
        assert row["mean_experts"] == pytest.approx(used.mean(), abs=1e-12)
        assert row["experts_frac"] == pytest.approx(used.mean() / m, abs=1e-12)
        assert (row["min_experts"], row["max_experts"]) == (used.min(), used.max())
        router_means.append(used.mean())
    assert model_type != "longcat_flash" or max(router_means) < first.top_k  # identity experts are chosen
    pi = torch.cat([p for _, _, p in seen[first.index]]).numpy()
    order = np.argsort(-pi, axis=1, kind="stable")
    ranked = np.take_along_axis(pi, order, 1)
    size = np.maximum(((np.cumsum(ranked, axis=1) - ranked) < 0.9).sum(1), 1)
    used = np.array([(order[t, :size[t]] < m).sum() for t in range(len(size))])
    assert per_layer.loc[("topp:0.9", first.index), "mean_experts"] == pytest.approx(used.mean(), abs=1e-12)
    assert used.mean() < size.mean()  # the set holds zero-computation experts
    t = res["topk"].set_index("policy")
    assert t.loc["router", "mean_experts"] == pytest.approx(np.mean(router_means), abs=1e-12)
    # the summary line: K is the model's, the computed experts per token beside it
    from moetool.experiments.topk.compute import summary_lines

    assert f" with K={first.top_k} ({np.mean(router_means):.2f} computed); " in summary_lines("z", res)[0]
