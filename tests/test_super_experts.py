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
    from moetool.experiments.super_experts.compute import MaxOutput

    model, layers, events = captured(model_type)
    probe = MaxOutput([L.index for L in layers], budget=budget)
    batch = padded_batch()
    with torch.no_grad(), Engine(model, layers, consumers=[probe]):
        for rows in (slice(0, 1), slice(1, None)):  # two forwards: counts summed, maxima the running max
            model(**{k: v[rows] for k, v in batch.items()})
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
    from moetool.experiments.super_experts.compute import super_mask

    a = np.array([1.0] * 197 + [3.0, 20.0, 100.0])
    # 99th percentile: position 0.99 x 199 = 197.01 -> 3 + 0.01 x (20 - 3) = 3.17
    mask, p, f = super_mask(a, 99.0, 0.1, "fraction")
    assert p == pytest.approx(3.17) and f == pytest.approx(10.0)
    assert list(np.flatnonzero(mask)) == [198, 199]
    mask, _, f = super_mask(a, 99.0, 0.5, "fraction")  # 20 is above the percentile but under half the largest
    assert f == 50.0 and list(np.flatnonzero(mask)) == [199]
    mask, p, _ = super_mask(a, 99.5, 0.1)  # 198.005 -> 20 + 0.005 x 80 = 20.4
    assert p == pytest.approx(20.4) and list(np.flatnonzero(mask)) == [199]
    assert not super_mask(np.full(50, 7.0))[0].any()  # nothing exceeds the percentile of equal maxima
    with pytest.raises(MoetoolError):
        super_mask(np.array([1.0, float("nan")]))
    # the code's max // 10 (floor division, strictly above) against the fraction rule's >= 0.1 x max
    b = np.array([0.0] * 300 + [10.0, 10.0, 100.0])  # 90th percentile: position 271.8 -> 0.0
    m_floor, p, f_floor = super_mask(b, 90.0, 0.1)  # floordiv: 100 // 10 = 10, 10.0 > 10 is False
    m_frac, _, f_frac = super_mask(b, 90.0, 0.1, "fraction")  # fraction: 10.0 >= 10.0
    assert p == 0.0 and f_floor == 10.0 and f_frac == 10.0
    assert list(np.flatnonzero(m_floor)) == [302] and list(np.flatnonzero(m_frac)) == [300, 301, 302]
    c = np.array([1.0] * 300 + [9.5, 99.0])  # 99 // 10 = 9 (floor) while 0.1 x 99 = 9.9: 9.5 passes floordiv only
    assert list(np.flatnonzero(super_mask(c, 90.0, 0.1)[0])) == [300, 301]
    assert list(np.flatnonzero(super_mask(c, 90.0, 0.1, "fraction")[0])) == [301]


def test_rank_ties_and_share_of_max_by_hand():
    """super_experts.csv from hand maxima of two layers with ties (5 in both layers, 0 for never routed experts):
    rank 1 = the largest, ties to the lower layer, then the lower expert; share_of_max = max / the largest (7)."""
    import torch

    from moetool.experiments.super_experts.compute import MaxOutput

    probe = MaxOutput([0, 1])
    probe.max = {0: torch.tensor([5.0, 0.0, 2.0]), 1: torch.tensor([5.0, 0.0, 7.0])}
    probe.count = {0: torch.tensor([3.0, 0.0, 1.0]), 1: torch.tensor([2.0, 0.0, 4.0])}
    df, _, _ = probe.table()
    got = df.set_index(["layer", "expert"])
    want_rank = {(1, 2): 1, (0, 0): 2, (1, 0): 3, (0, 2): 4, (0, 1): 5, (1, 1): 6}
    assert got["rank"].to_dict() == want_rank
    assert got["share_of_max"].to_dict() == pytest.approx({(0, 0): 5 / 7, (0, 1): 0.0, (0, 2): 2 / 7, (1, 0): 5 / 7,
                                                           (1, 1): 0.0, (1, 2): 1.0}, abs=1e-15)
    assert got["routed"].to_dict() == {(0, 0): 3, (0, 1): 0, (0, 2): 1, (1, 0): 2, (1, 1): 0, (1, 2): 4}
    # the default rule: 99.5th percentile of [0, 0, 2, 5, 5, 7] at position 4.975 -> 5 + 0.975 x 2 = 6.95 above the
    # floordiv 7 // 10 = 0; one value can pass (degenerate)
    assert df["threshold"].tolist() == pytest.approx([6.95] * 6) and df["can_pass"].eq(1).all() and df["degenerate"].all()
    assert got.index[got["is_super"]].tolist() == [(1, 2)]
    # median 2 + 0.5 x 3 = 3.5 below the max rule 7 // 1.25 = 5: the threshold is the larger; 3 values can pass
    df, p, f = probe.table(50.0, 0.8)
    assert (p, f) == (pytest.approx(3.5), 5.0) and (df["threshold"] == 5.0).all()
    assert df["can_pass"].eq(3).all() and not df["degenerate"].any()
    assert df.set_index(["layer", "expert"]).index[df["is_super"]].tolist() == [(1, 2)]


def test_degenerate_and_layer_cut_by_hand():
    """How many values can pass the percentile (N - 1 - floor((N - 1) q / 100)), checked by brute force on
    distinct values; the code's round(0.75 L) with Python's half-to-even rounding."""
    from moetool.experiments.super_experts.compute import can_pass, included_layers

    for n in (2, 32, 128, 200, 201, 401, 1000):
        for q in (99.5, 99.0, 90.0):
            a = np.arange(n, dtype=float) ** 1.5
            assert can_pass(n, q) == int((a > np.percentile(a, q)).sum()), (n, q)
    assert can_pass(200, 99.5) == 1 and can_pass(201, 99.5) == 1 and can_pass(202, 99.5) == 2
    assert [included_layers(L, 0.75) for L in (2, 4, 6, 10, 27, 48, 61)] == [2, 3, 4, 8, 20, 36, 46]


def test_decoder_layer_count_from_the_config_or_the_last_moe_layer():
    """L = the text config's num_hidden_layers (num_layers, n_layers), at least one past the last MoE layer's
    index: a config without the count gives last index + 1, not the last index."""
    from types import SimpleNamespace

    from moetool.experiments.super_experts.compute import decoder_layers

    layers = [SimpleNamespace(index=i) for i in (1, 3, 5)]
    assert decoder_layers(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=8), layers=layers)) == 8
    assert decoder_layers(SimpleNamespace(config=SimpleNamespace(n_layers=7), layers=layers)) == 7
    assert decoder_layers(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=4), layers=layers)) == 6
    assert decoder_layers(SimpleNamespace(config=None, layers=layers)) == 6


def test_first_rows_by_hand():
    """The token the paper's code reads per row and expert: slot-major (first choices in position order, then
    second choices), padding skipped."""
    from moetool.experiments.super_experts.compute import first_rows

    idx = torch.tensor([[2, 0], [1, 2], [0, 1],   # row 0: expert 0 first chosen at slot 0 by token 2
                        [3, 1], [1, 0], [1, 3]])  # row 1: expert 3 at slot 0 by token 3
    valid = torch.tensor([True, True, True, False, True, True])  # token 3 is padding: expert 3 -> token 5 slot 1
    got = first_rows(idx, valid, (2, 3), 4)
    want = {(2, 0), (1, 1), (0, 2), (4, 1), (4, 0), (5, 3)}
    assert {(int(t), int(e)) for t, e in torch.nonzero(got)} == want


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
    from moetool.experiments.super_experts.compute import super_mask

    lm, tokens, res = tiny_run
    table, abl = res["super_experts"], res["super_experts_ablation"].set_index("ablation")
    want_mask = super_mask(table["max_abs_output"])[0]
    assert list(table["is_super"]) == list(want_mask) and want_mask.any()
    assert sorted(set(table.layer)) == [0, 1, 2]  # the first round(0.75 x 4) = 3 decoder layers, as the code
    assert (table.can_pass == 1).all() and table.degenerate.all()  # 24 maxima: only the largest can pass
    assert sorted(table["rank"]) == list(range(1, len(table) + 1))
    assert table.loc[table["rank"] == 1, "max_abs_output"].iloc[0] == table["max_abs_output"].max()
    own = moetool.ppl(lm, tokens, bootstrap=0, baseline=False, quiet=True)["ppl"]
    assert abl.loc["none", "perplexity"] == pytest.approx(float(own["perplexity"].iloc[0]), rel=1e-9)
    assert abl.loc["none", "ratio"] == 1.0
    for k in ("super", "random"):  # the change from the model's own perplexity, removed minus kept
        assert abl.loc[k, "delta_ppl"] == pytest.approx(abl.loc[k, "perplexity"] - abl.loc["none", "perplexity"],
                                                         rel=1e-12)
        assert abl.loc[k, "ratio"] == pytest.approx(abl.loc[k, "perplexity"] / abl.loc["none", "perplexity"],
                                                     rel=1e-12)

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
    from moetool.experiments.super_experts.compute import SuperExpertsOptions

    with pytest.raises(MoetoolError, match="--percentile"):
        SuperExpertsOptions(percentile=100.0)
    with pytest.raises(MoetoolError, match="--fraction-of-max"):
        SuperExpertsOptions(fraction_of_max=1.5)
    for bad, flag in ((dict(max_rule="ge"), "--max-rule"), (dict(reading="all"), "--reading"),
                      (dict(include_layers=0.0), "--include-layers"), (dict(include_layers=1.5), "--include-layers")):
        with pytest.raises(MoetoolError, match=flag):
            SuperExpertsOptions(**bad)


def test_more_super_than_other_experts_refused(tiny_run):
    """Every expert above the 0th percentile: no random set as large as a layer's super set exists; one line,
    not a random ablation of fewer experts."""
    import moetool

    lm, tokens, _ = tiny_run
    with pytest.raises(MoetoolError, match="no random set of the same size"):
        moetool.super_experts(lm, tokens, percentile=0.0, fraction_of_max=0.0, bootstrap=0, quiet=True)


def test_layer_cut_leaving_nothing_refused(tiny_run):
    import moetool

    lm, tokens, _ = tiny_run
    with pytest.raises(MoetoolError, match=r"--include-layers 0.5 keeps decoder layers < round\(0.5 x 4\) = 2"):
        moetool.super_experts(lm, tokens, layers=(2, 3), include_layers=0.5, bootstrap=0, quiet=True)


# table and console only (no_figures): super-experts' figures are tests/test_help_files.py's
def test_the_console_names_the_super_experts_and_says_when_the_rule_was_degenerate(tmp_path, no_figures):
    """The command printed only the ablation table: which experts are super, and that with 24 maxima the rule
    could pick only the largest (``degenerate`` in the CSV), were on no console line. Now both are, from the
    run's own table."""
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["super-experts", "--max-tokens", "512", "--seq-len", "64", "--bootstrap", "0",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(out / "super_experts.csv")
    sup = table[table.is_super].sort_values("rank")
    assert len(sup) == 1 and table.degenerate.all()
    row = sup.iloc[0]
    assert (f"1 super expert(s) of {len(table)}: layer {row.layer} expert {row.expert} "
            f"(max |out| {row.max_abs_output:.3g})") in r.output
    assert f"degenerate: with {len(table)} maxima the percentile lets only the largest through" in r.output


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_zero_computation_experts_are_not_measured_nor_removed(model_type, tmp_path):
    """LongCat-Flash's identity experts output their input (|h| ~ 1, hundreds of times a tiny expert's output) and
    Zaya's skip expert 0: neither has a down projection, so neither is a (super) expert. The table holds the computed
    experts only, their maxima by hand from the raw parameters; the criterion by hand (numpy) over those maxima;
    the random ablation draws computed experts only (brk10: before, LongCat-Flash's identity expert 9 of layer 0
    was the one super expert, 40 maxima instead of 32)."""
    import shutil

    import moetool
    from moetool.adapters import tiny
    from moetool.experiments.super_experts.compute import super_mask
    from moetool.loading import EMBEDDED_DIR

    model = tiny.build_tiny(model_type, seed=0)
    model.resize_token_embeddings(2048, mean_resizing=False)  # the embedded tokenizer's ids
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, tmp_path / "m" / f)
    lm = moetool.load(str(tmp_path / "m"))
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    res = moetool.super_experts(lm, tokens, bootstrap=0, include_layers=1.0, quiet=True)
    table = res["super_experts"].set_index(["layer", "expert"])
    ev_h, ev_idx = {}, {}

    def grab(ev):
        ev_h.setdefault(ev.layer.index, []).append(ev.layer.expert_input(ev.h)[ev.valid])
        ev_idx.setdefault(ev.layer.index, []).append(ev.idx[ev.valid])

    from moetool.engine.runner import forward
    forward(lm, tokens, consumers=[grab], batch_size=8, quiet=True)
    maxima = []
    for L in lm.layers:
        m = L.n_experts - L.n_zero_compute
        assert L.n_zero_compute >= 1 and m < L.n_experts  # the case
        h, idx = torch.cat(ev_h[L.index]), torch.cat(ev_idx[L.index])
        assert model_type != "longcat_flash" or (idx >= m).any()  # the identity experts are chosen
        assert sorted(e for (layer, e) in table.index if layer == L.index) == list(range(m))
        for e in range(m):
            rows = (idx == e).any(-1)
            with torch.no_grad():
                out = reference_expert(model_type, L, e, h[rows])["output"] if rows.any() else torch.zeros(1)
            best = float(out.abs().max())
            assert table.loc[(L.index, e), "routed"] == int(rows.sum())
            assert table.loc[(L.index, e), "max_abs_output"] == pytest.approx(best, rel=1e-4, abs=1e-9)
            maxima.append(best)
    a = np.asarray(maxima)
    want = (a > np.percentile(a, 99.5)) & (a > a.max() // 10)
    assert list(table["is_super"]) == list(want) == list(super_mask(a)[0])
    assert table["can_pass"].iloc[0] == len(a) - 1 - int(np.floor((len(a) - 1) * 0.995))
    abl = res["super_experts_ablation"].set_index("ablation")
    for k in ("super", "random"):
        if k in abl.index:
            for item in abl.loc[k, "experts"].split():
                layer, e = map(int, item.split(":"))
                assert e < lm.layers[0].n_experts - lm.layers[0].n_zero_compute


@pytest.mark.parametrize("where, include", [(3, 1.0), (0, 1.0), (0, 0.75)])
def test_hash_routed_layers_are_measured_and_ablated_only_where_experts_are_removed(where, include, tmp_path):
    """DeepSeek-V4's first layers are hash-routed (experts by token id): a super expert made in router-routed layer 3
    (its down projection x1000) is removed there only, the perplexity that of ppl with the same prune:file in layer
    3 (before, brk10: the ablation ran its policy in every measured layer, so it was refused for hash layers 0-2 it
    removed nothing from); one in hash layer 0 cannot be removed: one line naming it and the router's layers."""
    import shutil

    import moetool
    from moetool.adapters import find_moe_layers, tiny
    from moetool.adapters.generic import hash_table, random_table
    from moetool.loading import EMBEDDED_DIR

    model = tiny.build_tiny("deepseek_v4", seed=0)
    model.resize_token_embeddings(2048, mean_resizing=False)
    gen = torch.Generator().manual_seed(3)
    layers = find_moe_layers(model)
    for L in layers:
        table = hash_table(L.router)
        if table is not None:
            L.router.tid2eid = random_table((2048, table.shape[1]), L.n_experts, gen)
    assert [bool(getattr(L, "hash_routed", False)) for L in layers] == [True, True, True, False]  # the case
    with torch.no_grad():
        layers[where].experts.down_proj[5] *= 1000.0
    model.save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, tmp_path / "m" / f)
    lm = moetool.load(str(tmp_path / "m"))
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    if where == 0:  # --include-layers 0.75 measures layers < round(0.75 x 4) = 3: layer 3 needs --include-layers 1
        # too (mutation pass 13: 'max(others) > cut' left it out exactly at the cut)
        hint = "--layers 3" + (" --include-layers 1" if include < 1 else "")
        with pytest.raises(MoetoolError, match=r"super expert\(s\) 0:5 sit in hash-routed layers .* "
                                               rf"the layers the router routes are {hint}$"):
            moetool.super_experts(lm, tokens, bootstrap=0, include_layers=include, quiet=True)
        return
    res = moetool.super_experts(lm, tokens, bootstrap=0, include_layers=1.0, quiet=True)
    table, abl = res["super_experts"], res["super_experts_ablation"].set_index("ablation")
    assert sorted(set(table.layer)) == [0, 1, 2, 3]
    assert [(int(r.layer), int(r.expert)) for r in table[table.is_super].itertuples()] == [(3, 5)]
    assert abl.loc["super", "experts"] == "3:5"
    path = tmp_path / "removed.json"
    path.write_text(json.dumps({"3": [5]}))
    got = moetool.ppl(lm, tokens, routing=f"prune:file:{path}", layers=(3,), bootstrap=0, baseline=False,
                      quiet=True)["ppl"]
    assert abl.loc["super", "perplexity"] == pytest.approx(float(got["perplexity"].iloc[0]), rel=1e-9)
    assert abl.loc["super", "perplexity"] != abl.loc["none", "perplexity"]
