"""Expert pruning (``prune:...`` policies, ``moetool prune``) against hand computations: importance from captured
routing and reference expert outputs, removed experts never chosen, the renormalised weights by hand, and removing
nothing reproduces the model exactly."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import captured, mover_by_hand, reference_expert, run, wilson_by_hand, zero_compute_lm

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
    """First MoE layer, from the router logits: p = softmax over the kept experts' logits (the checkpoint with the
    removed experts' router rows deleted, as REAP's prune.py leaves it); the K largest p among the kept; weights
    p / their sum (mixtral: softmax-topk-renorm) or p itself (olmoe: softmax-topk; before, the softmax over all n:
    the removed experts' mass was lost, a kept weight 0.13 where the pruned checkpoint gives 0.40)."""
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
        p = torch.softmax(ev.logits[t].double().masked_fill(~_keep(len(ev.logits[t]), removed), float("-inf")), -1)
        ranked = [int(e) for e in p.argsort(descending=True) if int(e) not in removed][:K]
        got = dict(zip(ev.chosen_idx[t].tolist(), ev.chosen_weights[t].double().tolist()))
        assert sorted(got) == sorted(ranked)
        total = sum(float(p[e]) for e in ranked)
        for e in ranked:
            want = float(p[e]) / total if L.renormalize else float(p[e])
            assert got[e] == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("reap_weights", ["renormalised", "softmax"])
@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "olmoe"])
def test_importance_by_hand(model_type, reap_weights):
    """Frequency, weighted frequency and REAP saliency from the captured routing of the padded batch and each
    expert's output from its raw parameters (conftest.reference_expert), one token at a time. REAP's gate weight
    from the router logits by hand: the softmax over all experts, divided by its sum over the token's top-K when
    renormalised (olmoe's own weights are not renormalised: the model's weight is not REAP's there)."""
    from moetool.engine import Engine
    from moetool.experiments.prune.compute import Importance

    model, layers, events = captured(model_type)
    from conftest import padded_batch

    imp = Importance([L.index for L in layers], reap_weights=reap_weights)
    with torch.no_grad(), Engine(model, layers, consumers=[imp]):
        model(**padded_batch())
    table = imp.table().set_index(["layer", "expert"])
    for L in layers:
        ev = events[L.index]
        n = L.n_experts
        freq, wsum, rsum = [0] * n, [0.0] * n, [0.0] * n
        h = L.expert_input(ev.h)
        for t in torch.nonzero(ev.valid).flatten().tolist():
            p = torch.softmax(ev.logits[t, :n].double(), -1)
            top = ev.idx[t].tolist()
            for e, w in zip(top, ev.weights[t].double().tolist()):
                with torch.no_grad():
                    out = reference_expert(model_type, L, e, h[t:t + 1])["output"][0]
                gate = float(p[e] / p[top].sum()) if reap_weights == "renormalised" else float(p[e])
                freq[e] += 1
                wsum[e] += w
                rsum[e] += gate * float(out.double().norm())
        for e in range(n):
            row = table.loc[(L.index, e)]
            assert row["layer_tokens"] == int(ev.valid.sum())
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


def test_lowest_importance_goes_first_ties_to_the_lower_index():
    """``frequency`` is a whole count (0 for every expert never routed): ties are common, and the documented rule
    (lowest importance first, ties: the lower expert index) decides which experts go."""
    import pandas as pd

    from moetool.policies.prune import lowest, n_removed, removed_from_importance

    scores = [3, 0, 5, 0, 3, 0, 1, 3]
    for m in range(9):
        assert lowest(scores, m) == sorted(sorted(range(8), key=lambda e: (scores[e], e))[:m])
    assert lowest(scores, 2) == [1, 3] and lowest(scores, 5) == [0, 1, 3, 5, 6]
    assert [n_removed(f, 8) for f in (0.0, 0.1, 0.125, 0.25, 0.3, 0.375, 0.99)] == [0, 0, 1, 2, 2, 3, 7]
    # 0.29 x 100 is 28.999999999999996 in floats: the fraction's decimal means 29 experts
    assert [n_removed(f, 100) for f in (0.29, 0.57, 0.58)] == [29, 57, 58]
    imp = pd.DataFrame({"layer": [5] * 8, "expert": list(range(8))[::-1], "frequency": scores[::-1]})  # any row order
    assert removed_from_importance(imp, "frequency", 0.25) == {5: [1, 3]}
    # a layer that does not list experts 0..n-1 once (a row lost or repeated) would rank the wrong experts: refused
    for bad in (imp[imp["expert"] != 3], pd.concat([imp, imp.iloc[:1]]), imp.assign(expert=imp["expert"] + 1)):
        with pytest.raises(MoetoolError, match="does not list experts"):
            removed_from_importance(bad, "frequency", 0.25)


def test_a_removed_csv_set_is_picked_by_criterion_and_fraction(tmp_path):
    """prune_removed.csv holds a set per (criterion, fraction): :<criterion>:<fraction> reads that one set only."""
    import pandas as pd

    from moetool.policies.prune import read_removed

    path = tmp_path / "prune_removed.csv"
    pd.DataFrame({"criterion": ["frequency", "frequency", "frequency", "reap", "frequency"],
                  "fraction": [0.25, 0.5, 0.5, 0.25, 0.5], "layer": [0, 0, 0, 0, 2],
                  "expert": [1, 1, 2, 3, 0]}).to_csv(path, index=False)
    assert read_removed(str(path), "frequency", 0.25) == {0: [1]}
    assert read_removed(str(path), "frequency", 0.5) == {0: [1, 2], 2: [0]}
    assert read_removed(str(path), "reap", 0.25) == {0: [3]}


def test_a_file_set_may_list_other_layers_with_nothing_removed():
    """prune:file: a layer outside --layers is refused only where the set removes experts there."""
    from moetool.policies.prune import PrunePolicy

    PrunePolicy({0: [1], 5: []}).check_layers([0], [0, 5])
    with pytest.raises(MoetoolError, match=r"removes experts in layers \[5\]"):
        PrunePolicy({0: [1], 5: [2]}).check_layers([0], [0, 5])


def test_a_removed_expert_outside_the_layer_is_refused():
    """An expert id outside 0..n-1 is refused in one line -- a negative one is no Python index from the end (-1
    would silently remove the last expert)."""
    from moetool.policies.prune import PrunePolicy

    class Layer:  # a stand-in MoELayer (the policy keeps its sets per layer object, weakly: a class instance)
        index, n_experts = 0, 8

        def keep_problem(self, keep):
            return None

    layer = Layer()
    for bad in (-1, 8):
        with pytest.raises(MoetoolError, match=rf"layer 0 has experts 0..7, not \[{bad}\]"):
            PrunePolicy({0: [1, bad]}).check(layer)
    keep = PrunePolicy({0: [0, 7]}).keep(layer, torch.device("cpu"))
    assert keep.tolist() == [False] + [True] * 6 + [False]


def test_random_removed_skips_the_excluded_experts():
    """random_removed with ``exclude`` (super-experts' random control set): ``m`` experts, none excluded, the same
    for the same (seed, layer), and a set drawn with another set excluded is disjoint from it."""
    from moetool.policies.prune import random_removed

    for seed, layer, n, m in ((0, 3, 16, 4), (7, 0, 8, 3), (1, 12, 64, 20)):
        a = random_removed(seed, layer, n, m)
        assert len(a) == m == len(set(a)) and a == sorted(a) and all(0 <= e < n for e in a)
        assert a == random_removed(seed, layer, n, m)
        b = random_removed(seed, layer, n, m, exclude=a)
        assert len(b) == m and not set(a) & set(b) and b == sorted(b)
        assert random_removed(seed, layer, n, n - m, exclude=a) == sorted(set(range(n)) - set(a))
    # seeded by (seed, layer): every layer draws its own set (8 of 64 alike by chance: about 2e-10)
    assert len({tuple(random_removed(0, layer, 64, 8)) for layer in range(6)}) == 6
    assert random_removed(0, 1, 64, 8) != random_removed(1, 1, 64, 8)


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
        assert curve.loc[(c, 0.25), "removed_frac"] == 2 / 8  # of the experts of every layer: 2 of 8 per layer
        assert curve.loc[(c, 0.25), "ratio_lo"] <= curve.loc[(c, 0.25), "ratio"] <= curve.loc[(c, 0.25), "ratio_hi"]
    imp, removed = res["prune_importance"], res["prune_removed"]
    for layer, g in imp.groupby("layer"):
        r = g.sort_values("expert")["reap"].to_numpy()
        got = removed[(removed.criterion == "reap") & (removed.fraction == 0.25) & (removed.layer == layer)]
        assert sorted(got["expert"]) == sorted(int(e) for e in np.argsort(r, kind="stable")[:2])
        assert len(removed[(removed.criterion == "random") & (removed.layer == layer)]) == 2
    assert set(imp["layer_tokens"]) == {int(res.meta["data"]["tokens"])}
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


def test_a_random_prune_fraction_is_named_as_given_not_rounded_to_six_digits():
    """prune:random:0.1234567 removes round(0.1234567 x n) experts of each layer, its exact fraction; its name said
    0.123457 (':g'), a label no other run of that fraction could be told from (break-it run 6's note)."""
    for f in (0.1234567, 0.25, 0.5000001):
        p = make_policy(f"prune:random:{f!r}")
        assert p.fraction == f and p.name == f"prune:random:{f!r}" and float(p.name.split(":")[-1]) == f


@pytest.mark.slow
def test_a_prune_runs_table_that_lost_rows_is_refused(tiny_prune, tmp_path):
    """prune:reap:0.25:<prune_importance.csv> whose last two rows (layer 3's experts 6 and 7) were lost at a line
    break pruned layer 3 as a layer of 6 experts, 1 removed instead of 2, in silence. A table of a moetool prune run
    is read against its manifest's record (moetool.files.table_problem): one line; an intact one reads as before."""
    import moetool

    _, _, res = tiny_prune
    out = moetool.write(res, tmp_path / "prune")
    imp, removed = out / "prune_importance.csv", out / "prune_removed.csv"
    assert len(make_policy(f"prune:reap:0.25:{imp}").removed[3]) == 2
    assert make_policy(f"prune:file:{removed}:reap:0.25").removed == make_policy(f"prune:reap:0.25:{imp}").removed
    lines = imp.read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 + 4 * 8 and lines[-2].startswith(b"3,6,") and lines[-1].startswith(b"3,7,")
    imp.write_bytes(b"".join(lines[:-2]))
    lines = removed.read_bytes().splitlines(keepends=True)
    removed.write_bytes(b"".join(lines[:-1]))
    for spec, path, rows in ((f"prune:reap:0.25:{imp}", imp, "30 rows, the run wrote 32"),
                             (f"prune:file:{removed}:reap:0.25", removed, f"{len(lines) - 2} rows, the run wrote "
                                                                           f"{len(lines) - 1}")):
        with pytest.raises(MoetoolError) as e:
            make_policy(spec)
        assert str(e.value) == f"prune: {path} has {rows}; a truncated or edited copy?"


def test_unreadable_removed_csv_is_one_line(tmp_path):
    """prune:file:<csv> that is empty, binary or holds a non-number: one line naming the file (it read pandas' 'No
    columns to parse from file', "invalid literal for int() with base 10: 'x'" or a codec error)."""
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "word.csv").write_text("layer,expert\nx,1\n")
    (tmp_path / "half.csv").write_text("layer,expert\n0,1.5\n")
    (tmp_path / "binary.csv").write_bytes(b"\xd0\xff\x00layer")
    for name, message in (("empty", " is not a readable CSV (No columns to parse from file)"),
                          ("word", ": layer and expert must be whole numbers in every line"),
                          ("half", ": layer and expert must be whole numbers in every line"),
                          ("binary", " is not a readable CSV ('utf-8' codec can't decode")):
        path = tmp_path / f"{name}.csv"
        with pytest.raises(MoetoolError) as e:
            make_policy(f"prune:file:{path}")
        assert str(e.value).startswith(f"prune: {path}{message}") and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["nan", "", "inf", "high"])
def test_an_importance_that_is_not_a_finite_number_is_refused(tmp_path, value):
    """A hand-made or edited prune_importance.csv (no run's record beside it) with a NaN, an empty cell, inf or a
    word in the criterion's column: the NaN and the empty cell sorted last, so that expert was never removed and
    the pruned perplexity came out as another set's, exit 0 (a word read as a numpy conversion error). moetool
    prune writes finite values only: now one line naming the layer and expert."""
    rows = ["layer,expert,frequency,weighted,reap"] + [f"{li},{e},{e + 1},{e + 1},{e + 1}" for li in range(2)
                                                       for e in range(4)]
    rows[2] = f"0,1,2,2,{value}"  # layer 0, expert 1: the least important expert but for its cell
    path = tmp_path / "prune_importance.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(MoetoolError) as e:
        make_policy(f"prune:reap:0.25:{path}")
    assert "the importance table's reap is not a finite number at layer 0 expert 1" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert make_policy(f"prune:frequency:0.25:{path}").removed == {0: [0], 1: [0]}  # the other columns are fine


@pytest.mark.parametrize("experts", ["[1.5]", '"12"', "[true]", "3"])
def test_removed_json_takes_whole_expert_numbers_only(tmp_path, experts):
    """prune:file:<removed.json> read 1.5 as expert 1, true as expert 1 and "12" as experts 1 and 2 (a plausible
    pruned perplexity of a set nobody wrote, exit 0), where the CSV refuses anything but whole numbers; now one
    line naming the layer and what it maps to."""
    path = tmp_path / "removed.json"
    path.write_text('{"0": [2], "1": ' + experts + "}")
    with pytest.raises(MoetoolError) as e:
        make_policy(f"prune:file:{path}")
    assert str(e.value) == f"prune: {path}: layer 1 must map to a list of whole expert numbers, not {experts}"
    path.write_text('{"0": [2], "1": [3, 1, 1]}')
    assert make_policy(f"prune:file:{path}").removed == {0: [2], 1: [1, 3]}


@pytest.mark.parametrize("text", ['{"1": [1], "1": [2]}', '{"1": [1], "01": [2]}'])
def test_removed_json_naming_a_layer_twice_is_refused(tmp_path, text):
    """json.loads keeps the last of two keys of one layer ("1" twice, or "1" and "01"): {"1": [1], "01": [2]}
    removed expert 2 alone (tiny's ppl 46.87, as {"1": [2]}; both experts: 48.68), the other list dropped unsaid."""
    path = tmp_path / "removed.json"
    path.write_text(text)
    with pytest.raises(MoetoolError) as e:
        make_policy(f"prune:file:{path}")
    assert str(e.value) == f"prune: {path} names layer 1 more than once: give each layer's experts in one list"
    path.write_text('[["1", [2]]]')  # an array of pairs is no object
    with pytest.raises(MoetoolError, match="is not a JSON object of layer -> list of experts"):
        make_policy(f"prune:file:{path}")
    path.write_text('{"1": [1, 2]}')
    assert make_policy(f"prune:file:{path}").removed == {1: [1, 2]}


def test_too_few_kept_experts_refused(tiny_model):
    model = tiny_model("mixtral")
    L = find_moe_layers(model)[0]
    with pytest.raises(MoetoolError, match="fewer than its top"):
        PrunePolicy({L.index: list(range(L.n_experts - L.top_k + 1))}).check(L)
    with pytest.raises(MoetoolError, match="experts 0"):
        PrunePolicy({L.index: [L.n_experts]}).check(L)


def test_bad_options_refused_in_one_line(tmp_path, cli):
    from moetool.experiments.prune.compute import PruneOptions

    for kw, message in (({"criteria": ("reap", "size")}, "--criteria"), ({"fractions": (1.0,)}, r"\[0, 1\)"),
                        ({"ablate": -1}, "--ablate"), ({"reap_weights": "raw"}, "--reap-weights")):
        with pytest.raises(MoetoolError, match=message):
            PruneOptions(**kw)
    # 0.9 of 8 leaves 1 < K = 2; 0.01234567 of 8 removes floor(0.099) = 0 experts everywhere (it could only give the
    # router's row again): refused before any forward, no folder
    for args, message in ((["--fractions", "0.9"], "fewer than its top-2"),
                          (["--fractions", "0.25,0.01234567"],  # named exactly, not :g's 0.0123457
                           r"--fractions 0\.01234567 removes no expert .*floor\(0\.01234567 x 8\) = 0")):
        r = cli("prune", *args, "--max-tokens", "256", "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert re.search(message, r.stderr), r.stderr
        assert not (tmp_path / "x").exists()


def test_ablate_0_leaves_the_ablation_table_out(tiny_prune):
    """``ablate=0``: no prune_ablation table (the manifest's not_written says why), the curve's numbers those of
    the run with ablations (the ablations change nothing else)."""
    import moetool

    lm, tokens, full = tiny_prune
    res = moetool.prune(lm, tokens, fractions=(0.25,), criteria=("reap",), ablate=0, bootstrap=0, quiet=True)
    assert "prune_ablation" not in res and "prune_removed" in res and res.meta["ablations"] == 0
    assert full.meta["ablations"] == 2 == len(full["prune_ablation"])
    assert res.meta["not_written"] == {"prune_ablation.csv": "no single-expert ablation: --ablate 0"}
    got = res["prune"].set_index(["criterion", "fraction"])
    want = full["prune"].set_index(["criterion", "fraction"])
    for key in (("router", 0.0), ("reap", 0.25)):
        assert got.loc[key, "perplexity"] == want.loc[key, "perplexity"]


def test_more_ablations_than_experts_run_every_expert_and_say_so():
    """--ablate beyond the experts of the layers measured ablates each of them once; the manifest's 'ablations'
    gives the number run (the options keep the number asked)."""
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    layer = lm.layers[0]
    res = moetool.prune(lm, tokens, fractions=(0.0,), criteria=("reap",), ablate=99, bootstrap=0, quiet=True,
                        layers=(layer.index,))
    ab = res["prune_ablation"]
    assert res.meta["ablations"] == layer.n_experts == len(ab) < 99
    assert sorted(ab.expert) == list(range(layer.n_experts)) and set(ab.layer) == {layer.index}


@pytest.mark.slow
def test_nothing_removed_by_choice_writes_no_empty_table(tmp_path):
    """`moetool prune --fractions 0 --ablate 0`: nothing removed and no ablation, by the user's choice: exit 0, the
    importance and the curve written, no empty prune_removed.csv or prune_ablation.csv, manifest complete with
    not_written saying why; the rows at 0 are the router's perplexity."""
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "--model", "tiny", "--fractions", "0", "--ablate", "0", "--criteria",
                                 "reap,random", "--max-tokens", "256", "--seq-len", "64", "--bootstrap", "0", "-q",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert not (out / "prune_removed.csv").exists() and not (out / "prune_ablation.csv").exists()
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert set(m["not_written"]) == {"prune_removed.csv", "prune_ablation.csv"}
    assert "prune_removed.csv" not in m["files"] and "figures/prune_ablation.png" not in m["files"]
    assert "figures/prune_curve.png" in m["files"]
    curve = pd.read_csv(out / "prune.csv")
    assert list(curve.criterion) == ["router", "reap", "random"] and (curve.removed == 0).all()
    assert (curve.perplexity == curve.perplexity.iloc[0]).all()


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


# ----- lm-eval accuracy against the fraction removed (--tasks) -----------------------------------------------------
PRUNE_ACC = {"router": {"mmlu": (0.70, 0.004), "arc_challenge": (0.62, 0.014)},
             "prune:reap:0.25": {"mmlu": (0.66, 0.005), "arc_challenge": (0.55, 0.015)},
             "prune:random:0.25": {"mmlu": (0.35, 0.006), "arc_challenge": (0.61, 0.013)},
             "prune:reap:0": {"mmlu": (0.69, 0.004), "arc_challenge": (0.62, 0.014)}}


@pytest.fixture
def fake_prune_lm_eval(monkeypatch):
    """lm-eval replaced by fixed accuracies with standard errors per policy name (as test_norm_select's
    fake_lm_eval); every call recorded."""
    from moetool.experiments.eval import compute as lmeval

    calls = []

    def evaluate(lm, plan, *, policy=None, limit=None, **kw):
        name = policy.name if policy is not None else "router"
        calls.append({"name": name, "limit": limit, **kw})
        results = {t: {"alias": t, "acc,none": v, "acc_stderr,none": se}
                   for t, (v, se) in PRUNE_ACC[name].items() if t in plan.names}
        return lmeval.EvalResult(lmeval.results_frame({"results": results}), 0.5, {t: 9 for t in plan.names})

    plan = lmeval.TaskPlan(names=["mmlu", "arc_challenge"], specs=[], include_path=None, include_defaults=False,
                           offline=True, shipped_dir=None)
    monkeypatch.setattr(lmeval, "evaluate", evaluate)
    monkeypatch.setattr(lmeval, "make_hflm", lambda lm, batch_size=8: "hflm")
    monkeypatch.setattr(lmeval, "plan_tasks", lambda names, include_path=None: plan)
    return calls


@pytest.mark.slow
def test_accuracy_curve_by_hand(fake_prune_lm_eval, tmp_path):
    """`moetool prune --tasks ... --num-fewshot 2 --limit 3`: every pruning of the perplexity curve runs lm-eval under
    the same policy in the same layers (once per distinct removed set); prune_eval.csv's value with its Wilson interval, retention = value / router's and its
    MOVER-R interval (conftest.mover_by_hand from the two Wilson intervals; about the delta method's), the router's
    [1, 1]; the figure is drawn."""
    import math

    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "--model", "tiny", "--tasks", "mmlu,arc_challenge", "--num-fewshot", "2",
                                 "--limit", "3", "--fractions", "0,0.25", "--criteria", "reap,random", "--ablate",
                                 "1", "--layers", "1,3", "--max-tokens", "256", "--seq-len", "64", "--bootstrap", "0",
                                 "-q", "--out", str(out)])
    assert r.exit_code == 0, r.output
    calls = fake_prune_lm_eval
    # random at 0 removes the same (no) experts as reap at 0: one lm-eval run, as one perplexity forward
    assert [c["name"] for c in calls] == ["router", "prune:reap:0", "prune:reap:0.25", "prune:random:0.25"]
    assert all(c["limit"] == 3 and c["num_fewshot"] == 2 and c["policy_layers"] == [1, 3] and c["hflm"] == "hflm"
               for c in calls)
    ev = pd.read_csv(out / "prune_eval.csv")
    assert list(ev.columns) == ["criterion", "fraction", "task", "metric", "value", "stderr", "value_lo", "value_hi",
                                "router_value", "retention", "retention_lo", "retention_hi"]
    assert list(zip(ev.criterion, ev.fraction))[::2] == [("router", 0.0), ("reap", 0.0), ("reap", 0.25),
                                                         ("random", 0.0), ("random", 0.25)]
    z = 1.959963984540054
    for row in ev.itertuples():
        name = "router" if row.criterion == "router" else f"prune:{row.criterion}:{row.fraction:g}"
        name = "prune:reap:0" if name == "prune:random:0" else name
        v, se = PRUNE_ACC[name][row.task]
        b, se_b = PRUNE_ACC["router"][row.task]
        assert (row.metric, row.value, row.stderr, row.router_value) == ("acc", v, se, b)
        n = v * (1 - v) / se ** 2 + 1  # the items lm-eval's stderr implies for 0/1 scores
        assert (row.value_lo, row.value_hi) == pytest.approx(wilson_by_hand(v, n), rel=1e-9)
        assert row.retention == pytest.approx(v / b, rel=1e-12)
        n_b = b * (1 - b) / se_b ** 2 + 1
        want = (1.0, 1.0) if name == "router" else mover_by_hand(v, *wilson_by_hand(v, n), b, *wilson_by_hand(b, n_b))
        assert (row.retention_lo, row.retention_hi) == pytest.approx(want, rel=1e-6)
        half = z * v / b * math.sqrt((se / v) ** 2 + (se_b / b) ** 2)  # the delta method's, away from 0 and 1: close
        assert name == "router" or (row.retention_hi - row.retention_lo) == pytest.approx(2 * half, rel=0.05)
    m = json.loads((out / "manifest.json").read_text())
    assert m["eval"]["tasks"] == ["mmlu", "arc_challenge"] and "retention_lo" in m["definitions"]
    assert (out / "figures" / "prune_accuracy.png").exists()
    assert not (tmp_path / "plain").exists()


def test_without_tasks_no_lm_eval(fake_prune_lm_eval, tiny_prune):
    """Without --tasks nothing of lm-eval runs and no prune_eval table is written."""
    _, _, res = tiny_prune
    assert "prune_eval.csv" not in res.tables and "eval" not in res.meta and not fake_prune_lm_eval


@pytest.mark.slow
def test_accuracy_on_the_shipped_tasks_matches_eval(tiny_prune, tmp_path):
    """The real lm-eval on the shipped offline task, 5 items: prune's router row is `moetool eval`'s accuracy, and
    its reap 0.25 row is `moetool eval --routing prune:reap:0.25:<prune_importance.csv>`'s."""
    import moetool
    from moetool.experiments.eval import compute as lmeval

    if "moetool_code" not in lmeval.shipped_tasks():
        pytest.skip("the shipped offline tasks are not installed")
    lm, tokens, _ = tiny_prune
    res = moetool.prune(lm, tokens, fractions=(0.25,), criteria=("reap",), ablate=1, bootstrap=0,
                        tasks=("moetool_code",), limit=5, quiet=True)
    ev = res["prune_eval"].set_index(["criterion", "metric"])
    want = moetool.evaluate(lm, tasks=("moetool_code",), limit=5, quiet=True)["eval"].set_index("metric")
    assert ev.loc[("router", "acc"), "value"] == want.loc["acc", "value"]
    assert ev.loc[("router", "acc"), "stderr"] == want.loc["acc", "stderr"]
    imp = tmp_path / "prune_importance.csv"
    res["prune_importance"].to_csv(imp, index=False)
    pruned = moetool.evaluate(lm, tasks=("moetool_code",), limit=5, routing=f"prune:reap:0.25:{imp}",
                              quiet=True)["eval"].set_index("metric")
    assert ev.loc[("reap", "acc"), "value"] == pruned.loc["acc", "value"]
    assert ev.loc[("reap", "acc"), "retention"] == pytest.approx(pruned.loc["acc", "value"] / want.loc["acc", "value"])


def _pruned_checkpoint(model, removed: dict[int, list[int]], attr: str):
    """The model with the removed experts deleted as REAP's ``prune.py`` deletes them: each MoE layer's router rows
    (and correction bias) and fused expert weights sliced to the kept experts, in a model built from a config of
    that many experts; nothing of moetool involved."""
    import copy

    n = getattr(model.config, attr)
    kept = {li: [e for e in range(n) if e not in r] for li, r in removed.items()}
    sizes = {len(k) for k in kept.values()}
    assert len(sizes) == 1
    cfg = copy.deepcopy(model.config)
    setattr(cfg, attr, sizes.pop())
    state = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        li = int(parts[2]) if parts[1] == "layers" else None
        if li in kept and re.search(r"\.mlp\.(gate\.(weight|bias|e_score_correction_bias)|experts\.(gate_up_proj|"
                                    r"down_proj))$", key):
            value = value[kept[li]]
        state[key] = value
    pruned = type(model)(cfg).eval()
    pruned.load_state_dict(state, strict=True)
    return pruned


@pytest.mark.parametrize("model_type, attr", [("olmoe", "num_experts"), ("qwen2_moe", "num_experts"),
                                              ("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts")])
def test_pruned_routing_is_the_pruned_checkpoints(model_type, attr, tiny_model, batch):
    """``PrunePolicy`` on the whole model gives the logits of the checkpoint with those experts deleted (router rows
    and expert weights sliced, REAP's way), on softmax routers without renormalisation (olmoe, qwen2_moe with its
    gated shared expert) as with it (mixtral, qwen3_moe). Before, the softmax without renormalisation stayed over
    all n experts, the removed ones' share lost: logits off by up to 0.04 (olmoe) and 0.03 (qwen2_moe)."""
    model = tiny_model(model_type)
    layers = find_moe_layers(model)
    _, own, _ = run(model, layers, batch)
    removed = {L.index: _most_chosen(own[L.index], 2) for L in layers}
    got, events, _ = run(model, layers, batch, policy=PrunePolicy(removed))
    with torch.no_grad():
        want = _pruned_checkpoint(model, removed, attr)(**batch).logits
    mask = batch["attention_mask"].bool()
    assert torch.allclose(got[mask], want[mask], rtol=1e-4, atol=1e-5), (got[mask] - want[mask]).abs().max()


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_keep_problem_is_exactly_the_sets_some_token_cannot_route_within(model_type):
    """Every one of the 2^8 kept sets of a tiny 8-expert layer: refused iff some token's routing could not find K
    kept experts -- fewer than K kept at all, or (DeepSeek-V3: 2 groups of 4, the best 1 chosen) fewer than K kept
    within some topk_group of the groups, by hand over every choice of groups. Exactly K kept is routable."""
    import itertools

    from moetool.adapters.tiny import build_tiny

    L = find_moe_layers(build_tiny(model_type))[0]
    n, K = L.n_experts, L.top_k
    groups = int(getattr(L.config, "n_group", 1) or 1)
    chosen = int(getattr(L.config, "topk_group", 1) or 1) if groups > 1 else 1
    assert n == 8 and K == 2 and (groups, chosen) == ((2, 1) if model_type == "deepseek_v3" else (1, 1))
    size = n // groups
    for bits in range(1 << n):
        keep = torch.tensor([(bits >> e) & 1 == 1 for e in range(n)])
        per_group = [int(keep[g * size:(g + 1) * size].sum()) for g in range(groups)]
        worst = min(sum(per_group[g] for g in c) for c in itertools.combinations(range(groups), chosen))
        assert (L.keep_problem(keep) is not None) == (worst < K), (bits, per_group)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "inkling_text"])
def test_routing_among_every_expert_is_the_models_routing(model_type):
    """``route_masked(logits, all kept) == route(logits)`` (its definition), also where the rule reads the shared
    experts' logits appended after the routed ones (Inkling: ``[T, n + s]``, never masked)."""
    from conftest import padded_batch

    from moetool.adapters.tiny import build_tiny

    model = build_tiny(model_type)
    layers = find_moe_layers(model)
    _, events, _ = run(model, layers, padded_batch())
    for L in layers:
        ev = events[L.index]
        idx, w = L.route(ev.logits)
        midx, mw = L.route_masked(ev.logits, torch.ones(L.n_experts, dtype=torch.bool))
        assert torch.equal(midx, idx) and torch.equal(mw, w)
        assert torch.equal(idx.sort(-1).values, ev.idx.long().sort(-1).values)  # the model's own choice
    if model_type == "inkling_text":
        assert ev.logits.shape[-1] > L.n_experts  # the shared experts' logits really are there


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])
def test_zero_computation_experts_are_not_measured_nor_pruned(model_type):
    """LongCat-Flash's identity experts output their input and Zaya's skip expert 0 (the last n_zero_compute
    indices): no output of their own, nothing saved by removing them. The importance table lists the computed experts
    only, by hand (each expert's output from its raw parameters, REAP's renormalised gate from the router's
    probabilities); the removed sets are floor(0.23 · m) of the m computed experts (1 of 8, where floor(0.23 · n)
    would be 2 of 10 or 9; lowest REAP / frequency, ties to the lower index; random: the seeded permutation of m);
    removed_frac counts computed experts; the ablations are the largest computed REAPs (brk11: before, LongCat-Flash's
    identity experts had REAP ||h|| 2.2-4.3 against 0.006 and were the top ablations; Zaya's never-routed skip expert
    was removed first by every criterion)."""
    import moetool
    from moetool.policies.prune import random_removed

    seen = {}
    lm, tokens = zero_compute_lm(model_type, 4, 24, 5, {2: 6}, lambda ev: seen.setdefault(ev.layer.index, []).append(
        (ev.layer.expert_input(ev.h)[ev.valid], ev.idx[ev.valid], ev.probs[ev.valid].double())))
    layers = lm.layers
    res = moetool.prune(lm, tokens, fractions=(0.23,),
                        criteria=("reap", "frequency", "random"), ablate=3, batch_size=2, bootstrap=0, quiet=True)
    imp = res["prune_importance"].set_index(["layer", "expert"])
    removed = res["prune_removed"]
    want_reap = {}
    for L in layers:
        m = L.n_computed
        assert L.n_zero_compute >= 1
        assert sorted(e for (layer, e) in imp.index if layer == L.index) == list(range(m))
        freq, rsum = [0] * m, [0.0] * m
        for h, idx, p in seen[L.index]:
            for t in range(h.shape[0]):
                top = idx[t].tolist()
                for e in top:
                    if e < m:
                        with torch.no_grad():
                            out = reference_expert(model_type, L, e, h[t:t + 1])["output"][0]
                        freq[e] += 1
                        rsum[e] += float(p[t, e] / p[t, top].sum()) * float(out.double().norm())
        reap = [rsum[e] / freq[e] if freq[e] else 0.0 for e in range(m)]
        for e in range(m):
            assert imp.loc[(L.index, e), "frequency"] == freq[e]
            assert imp.loc[(L.index, e), "reap"] == pytest.approx(reap[e], rel=1e-5, abs=1e-12)
            want_reap[(L.index, e)] = reap[e]
        k = int(0.23 * m)
        assert k == 1 < int(0.23 * L.n_experts)
        for crit, vals in (("reap", reap), ("frequency", freq)):
            got = removed[(removed.criterion == crit) & (removed.layer == L.index)]["expert"].tolist()
            assert sorted(got) == sorted(sorted(range(m), key=lambda e: (vals[e], e))[:k]), crit
        got = removed[(removed.criterion == "random") & (removed.layer == L.index)]["expert"].tolist()
        assert sorted(got) == random_removed(0, L.index, m, k) and max(got) < m
    curve = res["prune"].set_index("criterion")
    assert curve.loc["reap", "removed_frac"] == pytest.approx(
        sum(int(0.23 * L.n_computed) for L in layers) / sum(L.n_computed for L in layers), rel=1e-12)
    top = sorted(want_reap, key=lambda k: (-want_reap[k], k))[:3]
    assert list(zip(res["prune_ablation"].layer, res["prune_ablation"].expert)) == top
    assert res.meta["zero_computation_experts_not_pruned"] == {L.index: L.n_zero_compute for L in layers}
    policy = make_policy("prune:random:0.23")  # the policy of ppl/eval/trace draws the experiment's sets
    for L in layers:
        assert policy.removed_in(L) == sorted(removed[(removed.criterion == "random")
                                                      & (removed.layer == L.index)]["expert"])


def test_fractions_are_checked_against_the_computed_experts():
    """_check_fractions over the m computed experts of the tiny LongCat-Flash (m = 8 of n = 10, top-K 2; the identity
    experts stay routable): 0.1 removes floor(0.1 · 8) = 0 anywhere, refused naming 8 and 1/8 (floor(0.1 · 10) would
    be 1); 0.875 removes 7 of the 8, leaving 1 computed and 2 identity experts for a top-2: it runs, 7 removed per
    layer, and the removed fraction is 7/8 of the computed experts."""
    import moetool
    from moetool.policies.prune import random_removed

    lm, tokens = zero_compute_lm("longcat_flash", 2, 16, 5, {}, lambda ev: None)
    (n, m, K), = {(L.n_experts, L.n_computed, L.top_k) for L in lm.layers}
    assert (n, m, K) == (10, 8, 2)
    with pytest.raises(MoetoolError, match=r"floor\(0\.1 x 8\) = 0\); use at least 0\.125,"):
        moetool.prune(lm, tokens, fractions=(0.1,), criteria=("random",), batch_size=2, bootstrap=0, quiet=True)
    res = moetool.prune(lm, tokens, fractions=(0.875,), criteria=("random",), ablate=0, batch_size=2, bootstrap=0,
                        quiet=True)
    removed = res["prune_removed"]
    assert removed.groupby("layer")["expert"].apply(sorted).tolist() == [
        sorted(random_removed(0, L.index, m, 7)) for L in lm.layers]
    assert res["prune"].set_index("criterion").loc["random", "removed_frac"] == 7 / 8
