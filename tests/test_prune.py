"""Expert pruning (``prune:...`` policies, ``moetool prune``) against hand computations: importance from captured
routing and reference expert outputs, removed experts never chosen, the renormalised weights by hand, and removing
nothing reproduces the model exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import captured, reference_expert, run

from moetool.adapters import find_moe_layers
from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.prune import PrunePolicy


def test_removing_nothing_reproduces_the_model(family, tiny_model, batch):
    """Every family (groups, correction biases, scaling factors, sparsemixer, hand adapters): the masked routing
    with every expert kept gives the model's logits bit for bit."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    with torch.no_grad():
        want = model(**batch).logits
    got, events, _ = run(model, layers, batch, policy=PrunePolicy({L.index: [] for L in layers}))
    assert torch.equal(got, want)
    assert all(ev.chosen_idx is not None for ev in events.values())
    got, _, _ = run(model, layers, batch, policy=make_policy("prune:random:0"))
    assert torch.equal(got, want)


def _most_chosen(ev, m: int) -> list[int]:
    counts = torch.bincount(ev.idx[ev.valid].reshape(-1), minlength=ev.layer.n_experts)
    return sorted(int(e) for e in counts.argsort(descending=True, stable=True)[:m])


def test_a_removed_expert_is_never_chosen(family, tiny_model, batch):
    """The model's most used experts removed in every layer: none of them is in any token's chosen set; in the
    first MoE layer (the same input) a token whose own top-K held none of them keeps its choice."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    _, own, _ = run(model, layers, batch)
    removed = {}
    for L in layers:
        m = max(1, L.n_experts // 4)
        while m > 1 and L.keep_problem(_keep(L.n_experts, _most_chosen(own[L.index], m))):
            m -= 1
        removed[L.index] = _most_chosen(own[L.index], m)
    _, events, _ = run(model, layers, batch, policy=PrunePolicy(removed))
    for L in layers:
        chosen = events[L.index].chosen_idx
        assert not torch.isin(chosen, torch.tensor(removed[L.index])).any(), L.index
        assert chosen.shape[-1] == L.top_k
    first = layers[0]
    ev, mine = own[first.index], events[first.index]
    untouched = ~torch.isin(ev.idx, torch.tensor(removed[first.index])).any(-1)
    assert untouched.any() and (~untouched).any()
    assert torch.equal(mine.chosen_idx[untouched].sort(-1).values, ev.idx[untouched].sort(-1).values)


def _keep(n: int, removed: list[int]) -> torch.Tensor:
    keep = torch.ones(n, dtype=torch.bool)
    keep[removed] = False
    return keep


@pytest.mark.parametrize("model_type", ["mixtral", "olmoe"])
def test_weights_among_the_kept_by_hand(model_type, tiny_model, batch):
    """First MoE layer, from the router logits: p = softmax(logits); the K largest p among the kept experts;
    weights p / their sum (mixtral: softmax-topk-renorm) or p itself (olmoe: softmax-topk, the removed experts'
    mass not handed on)."""
    model = tiny_model(model_type)
    layers = find_moe_layers(model)
    L = layers[0]
    _, own, _ = run(model, layers, batch)
    removed = _most_chosen(own[L.index], 2)
    _, events, _ = run(model, layers, batch, policy=PrunePolicy({L.index: removed}), policy_layers=[L.index])
    ev = events[L.index]
    K = L.top_k
    assert L.renormalize == (model_type == "mixtral")
    for t in range(ev.logits.shape[0]):
        p = torch.softmax(ev.logits[t].double(), -1)
        ranked = [int(e) for e in p.argsort(descending=True) if int(e) not in removed][:K]
        got = dict(zip(ev.chosen_idx[t].tolist(), ev.chosen_weights[t].double().tolist()))
        assert sorted(got) == sorted(ranked)
        total = sum(float(p[e]) for e in ranked)
        for e in ranked:
            want = float(p[e]) / total if L.renormalize else float(p[e])
            assert got[e] == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_importance_by_hand(model_type):
    """Frequency, weighted frequency and REAP saliency from the captured routing of the padded batch and each
    expert's output from its raw parameters (conftest.reference_expert), one token at a time."""
    from moetool.engine import Engine
    from moetool.experiments.prune import Importance

    model, layers, events = captured(model_type)
    from conftest import padded_batch

    imp = Importance([L.index for L in layers])
    with torch.no_grad(), Engine(model, layers, consumers=[imp]):
        model(**padded_batch())
    table = imp.table().set_index(["layer", "expert"])
    for L in layers:
        ev = events[L.index]
        n = L.n_experts
        freq, wsum, rsum = [0] * n, [0.0] * n, [0.0] * n
        h = L.expert_input(ev.h)
        for t in torch.nonzero(ev.valid).flatten().tolist():
            for e, w in zip(ev.idx[t].tolist(), ev.weights[t].double().tolist()):
                with torch.no_grad():
                    out = reference_expert(model_type, L, e, h[t:t + 1])["output"][0]
                freq[e] += 1
                wsum[e] += w
                rsum[e] += w * float(out.double().norm())
        for e in range(n):
            row = table.loc[(L.index, e)]
            assert row["tokens"] == int(ev.valid.sum())
            assert row["frequency"] == freq[e]
            assert row["weighted"] == pytest.approx(wsum[e], rel=1e-6)
            assert row["reap"] == pytest.approx(rsum[e] / freq[e] if freq[e] else 0.0, rel=1e-5)
        assert sum(freq) == int(ev.valid.sum()) * L.top_k


@pytest.fixture(scope="module")
def tiny_prune():
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    res = moetool.prune(lm, tokens, fractions=(0.0, 0.25), criteria=("reap", "random"), ablate=2, bootstrap=100,
                        quiet=True)
    return lm, tokens, res


def test_experiment_tables(tiny_prune):
    """Removing nothing is the router's perplexity exactly; the removed sets are the lowest REAP per layer (ties:
    lower index) or the seeded random ones; the ablated experts are the largest REAP saliencies."""
    import numpy as np

    lm, _, res = tiny_prune
    curve = res["prune"].set_index(["criterion", "fraction"])
    router = curve.loc[("router", 0.0)]
    for c in ("reap", "random"):
        assert curve.loc[(c, 0.0), "perplexity"] == router["perplexity"] and curve.loc[(c, 0.0), "ratio"] == 1
        assert curve.loc[(c, 0.25), "removed"] == 2 * len(lm.layers)  # floor(0.25 x 8) per layer
        assert curve.loc[(c, 0.25), "ratio_lo"] <= curve.loc[(c, 0.25), "ratio"] <= curve.loc[(c, 0.25), "ratio_hi"]
    imp, removed = res["prune_importance"], res["prune_removed"]
    for layer, g in imp.groupby("layer"):
        r = g.sort_values("expert")["reap"].to_numpy()
        got = removed[(removed.criterion == "reap") & (removed.fraction == 0.25) & (removed.layer == layer)]
        assert sorted(got["expert"]) == sorted(int(e) for e in np.argsort(r, kind="stable")[:2])
        assert len(removed[(removed.criterion == "random") & (removed.layer == layer)]) == 2
    assert set(imp["tokens"]) == {int(res.meta["data"]["tokens"])}
    abl = res["prune_ablation"]
    top = imp.sort_values("reap", ascending=False).head(2)
    assert list(zip(abl.layer, abl.expert)) == list(zip(top.layer, top.expert))
    assert (abl["delta_ppl"] == abl["perplexity"] - router["perplexity"]).all()


def test_policies_reproduce_the_experiment(tiny_prune, tmp_path):
    """``moetool ppl`` with prune:reap:0.25:<importance.csv>, prune:file:<prune_removed.csv>:reap:0.25 and a JSON
    set for an ablation gives the experiment's perplexities (the same rows)."""
    import moetool

    lm, tokens, res = tiny_prune
    imp_csv, removed_csv = tmp_path / "prune_importance.csv", tmp_path / "prune_removed.csv"
    res["prune_importance"].to_csv(imp_csv, index=False)
    res["prune_removed"].to_csv(removed_csv, index=False)
    want = res["prune"].set_index(["criterion", "fraction"]).loc[("reap", 0.25), "perplexity"]
    for spec in (f"prune:reap:0.25:{imp_csv}", f"prune:file:{removed_csv}:reap:0.25"):
        got = moetool.ppl(lm, tokens, routing=spec, bootstrap=0, baseline=False, quiet=True)["ppl"]
        assert float(got["perplexity"].iloc[0]) == pytest.approx(want, rel=1e-12), spec
    a = res["prune_ablation"].iloc[0]
    path = tmp_path / "one.json"
    path.write_text(json.dumps({str(int(a.layer)): [int(a.expert)]}))
    got = moetool.ppl(lm, tokens, routing=f"prune:file:{path}", bootstrap=0, baseline=False, quiet=True)["ppl"]
    assert float(got["perplexity"].iloc[0]) == pytest.approx(a.perplexity, rel=1e-12)


@pytest.mark.parametrize("spec, message", [("prune:reap:0.25", "prune_importance.csv"), ("prune:x:0.1", "criterion"),
                                           ("prune:random:1.5", "[0, 1)"), ("prune", "use prune:"),
                                           ("prune:file:/nonexistent.json", "no file")])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(MoetoolError, match="bad routing policy|prune") as e:
        make_policy(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_too_few_kept_experts_refused(tiny_model):
    model = tiny_model("mixtral")
    L = find_moe_layers(model)[0]
    with pytest.raises(MoetoolError, match="fewer than its top"):
        PrunePolicy({L.index: list(range(L.n_experts - L.top_k + 1))}).check(L)
    with pytest.raises(MoetoolError, match="experts 0"):
        PrunePolicy({L.index: [L.n_experts]}).check(L)


def test_bad_options_refused_in_one_line(tmp_path):
    from moetool.experiments.prune import PruneOptions

    for kw, message in (({"criteria": ("reap", "size")}, "--criteria"), ({"fractions": (1.0,)}, r"\[0, 1\)"),
                        ({"ablate": -1}, "--ablate")):
        with pytest.raises(MoetoolError, match=message):
            PruneOptions(**kw)
    for args in (["--fractions", "0.9"],):  # 0.9 of 8 leaves 1 < K = 2: refused before any forward, no folder
        r = subprocess.run([sys.executable, "-m", "moetool", "prune", *args, "--max-tokens", "256",
                            "--out", str(tmp_path / "x")], capture_output=True, text=True, check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "x").exists()


def test_sets_for_other_layers_refused_before_any_forward(tiny_model, batch, tmp_path):
    """An explicit set naming a layer the policy does not run in, or an importance table without rows for a
    layer it runs in, would silently remove nothing there: one line before any forward."""
    import pandas as pd

    model = tiny_model("mixtral")
    layers = find_moe_layers(model)
    first, second = layers[0].index, layers[1].index
    seen = []
    handle = model.register_forward_pre_hook(lambda *a: seen.append(1))
    imp = tmp_path / "imp.csv"
    pd.DataFrame({"layer": [first] * 8, "expert": range(8), "reap": range(8)}).to_csv(imp, index=False)
    policy = make_policy(f"prune:reap:0.25:{imp}")
    assert policy.removed == {first: [0, 1]}
    try:
        with pytest.raises(MoetoolError, match=r"layers \[99\], which are not MoE layers"):
            run(model, layers, batch, policy=PrunePolicy({99: [0]}))
        with pytest.raises(MoetoolError, match="layers the policy runs in"):
            run(model, layers, batch, policy=PrunePolicy({second: [0]}), policy_layers=[first])
        with pytest.raises(MoetoolError, match=rf"no rows for MoE layers \[{second}"):
            run(model, layers, batch, policy=policy)
    finally:
        handle.remove()
    assert not seen
    _, events, _ = run(model, layers, batch, policy=policy, policy_layers=[first])  # its own layer: fine
    assert not torch.isin(events[first].chosen_idx, torch.tensor([0, 1])).any()
