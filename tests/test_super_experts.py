"""Super Experts (``moetool super-experts``) against hand computations: the max |expert output| over the routed
tokens from each expert's raw parameters one token at a time, the criterion on synthetic maxima, and the ablations
(nothing removed is the model; the super set as a prune:file policy; the random set)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import captured, padded_batch, reference_expert

from moetool.errors import MoetoolError


@pytest.mark.parametrize("budget", [None, 1])  # the default chunk, and one token per chunk (the running max)
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_max_abs_output_by_hand(model_type, budget):
    from moetool.engine import Engine
    from moetool.experiments.super_experts import MaxOutput

    model, layers, events = captured(model_type)
    probe = MaxOutput([L.index for L in layers], budget=budget)
    with torch.no_grad(), Engine(model, layers, consumers=[probe]):
        model(**padded_batch())
    table = probe.table()[0].set_index(["layer", "expert"])
    for L in layers:
        ev = events[L.index]
        h = L.expert_input(ev.h)
        best, routed = [0.0] * L.n_experts, [0] * L.n_experts
        for t in torch.nonzero(ev.valid).flatten().tolist():
            for e in ev.idx[t].tolist():
                with torch.no_grad():
                    out = reference_expert(model_type, L, e, h[t:t + 1])["output"][0]
                best[e] = max(best[e], float(out.abs().max()))
                routed[e] += 1
        for e in range(L.n_experts):
            row = table.loc[(L.index, e)]
            assert row["routed"] == routed[e]
            assert row["max_abs_output"] == pytest.approx(best[e], rel=1e-5)


def test_criterion_by_hand():
    from moetool.experiments.super_experts import super_mask

    a = np.array([1.0] * 197 + [3.0, 20.0, 100.0])
    # 99th percentile: position 0.99 x 199 = 197.01 -> 3 + 0.01 x (20 - 3) = 3.17
    mask, p, f = super_mask(a, 99.0, 0.1)
    assert p == pytest.approx(3.17) and f == pytest.approx(10.0)
    assert list(np.flatnonzero(mask)) == [198, 199]
    mask, _, f = super_mask(a, 99.0, 0.5)  # 20 is above the percentile but under half the largest
    assert f == 50.0 and list(np.flatnonzero(mask)) == [199]
    mask, p, _ = super_mask(a, 99.5, 0.1)  # 198.005 -> 20 + 0.005 x 80 = 20.4
    assert p == pytest.approx(20.4) and list(np.flatnonzero(mask)) == [199]
    assert not super_mask(np.full(50, 7.0))[0].any()  # nothing exceeds the percentile of equal maxima
    with pytest.raises(MoetoolError):
        super_mask(np.array([1.0, float("nan")]))


@pytest.fixture(scope="module")
def tiny_run():
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    res = moetool.super_experts(lm, tokens, bootstrap=0, seed=3, quiet=True)
    return lm, tokens, res


def test_ablations(tiny_run, tmp_path):
    """Nothing removed is the model's own perplexity; the super ablation removes exactly the rows marked super
    and equals ppl with them as a prune:file policy; the random one as many others per layer."""
    import moetool
    from moetool.experiments.super_experts import super_mask

    lm, tokens, res = tiny_run
    table, abl = res["super_experts"], res["super_experts_ablation"].set_index("ablation")
    want_mask = super_mask(table["max_abs_output"])[0]
    assert list(table["is_super"]) == list(want_mask) and want_mask.any()
    assert sorted(table["rank"]) == list(range(1, len(table) + 1))
    assert table.loc[table["rank"] == 1, "max_abs_output"].iloc[0] == table["max_abs_output"].max()
    own = moetool.ppl(lm, tokens, bootstrap=0, baseline=False, quiet=True)["ppl"]
    assert abl.loc["none", "perplexity"] == pytest.approx(float(own["perplexity"].iloc[0]), rel=1e-9)
    assert abl.loc["none", "ratio"] == 1.0

    def sets(label: str) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for item in label.split():
            layer, e = item.split(":")
            out.setdefault(int(layer), []).append(int(e))
        return out

    sup = table[table.is_super]
    super_sets = sets(abl.loc["super", "experts"])
    assert super_sets == {int(k): sorted(g.expert) for k, g in sup.groupby("layer")}
    rand = sets(abl.loc["random", "experts"])
    assert {k: len(v) for k, v in rand.items()} == {k: len(v) for k, v in super_sets.items()}
    assert all(not set(rand[k]) & set(super_sets[k]) for k in rand)
    path = tmp_path / "removed.json"
    path.write_text(json.dumps({str(k): v for k, v in super_sets.items()}))
    got = moetool.ppl(lm, tokens, routing=f"prune:file:{path}", bootstrap=0, baseline=False, quiet=True)["ppl"]
    assert abl.loc["super", "perplexity"] == pytest.approx(float(got["perplexity"].iloc[0]), rel=1e-9)
    assert abl.loc["super", "perplexity"] != abl.loc["none", "perplexity"]


def test_bad_options_are_one_line():
    from moetool.experiments.super_experts import SuperExpertsOptions

    with pytest.raises(MoetoolError, match="--percentile"):
        SuperExpertsOptions(percentile=100.0)
    with pytest.raises(MoetoolError, match="--fraction-of-max"):
        SuperExpertsOptions(fraction_of_max=1.5)


def test_more_super_than_other_experts_refused(tiny_run):
    """Every expert above the 0th percentile: no random set as large as a layer's super set exists; one line,
    not a random ablation of fewer experts."""
    import moetool

    lm, tokens, _ = tiny_run
    with pytest.raises(MoetoolError, match="no random set of the same size"):
        moetool.super_experts(lm, tokens, percentile=0.0, fraction_of_max=0.0, bootstrap=0, quiet=True)
