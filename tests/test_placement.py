"""Expert-parallel placement (``moetool placement``): the EPLB implementation against hand-worked examples and its
invariants, and the experiment's loads and imbalances against independent counts on the embedded model. (During
development it was also compared with DeepSeek's own eplb.py on 1,600 random load sets: identical placements; that
code is not part of this repository.)"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import feed

from moetool.errors import MoetoolError
from moetool.experiments.placement.compute import (PlacementOptions, gpu_loads, imbalance, imbalance_statistic,
                                           rebalance_experts, replicate_experts, static_placement)

#: (layers, n, G, extra slots per GPU, groups, nodes): global (1 group), hierarchical over 1, 2 and 4 nodes, and
#: groups that do not divide into the nodes (EPLB's global fallback)
CONFIGS = [(3, 16, 4, 0, 1, 1), (3, 16, 4, 1, 4, 2), (2, 32, 8, 2, 8, 4), (2, 12, 4, 1, 3, 2), (2, 8, 2, 1, 4, 2),
           (2, 64, 16, 1, 8, 2), (2, 16, 4, 3, 4, 1)]


def test_eplb_by_hand():
    """Loads [8, 2, 1, 1] on 2 GPUs, worked by hand.
    R = 0: heaviest first into the lightest pack with room: 8 -> GPU0, 2 -> GPU1, 1 -> GPU1, 1 -> GPU0 (GPU1 full):
    GPU loads [9, 3], imbalance 9/6 = 1.5 (contiguous {8,2},{1,1}: 10/6; round-robin {8,1},{2,1}: 9/6).
    R = 2: replicas go to the largest load per replica: expert 0 (8/1), then expert 0 again (8/2 = 4 > 2): three
    replicas of 8/3; slots [e0, e1, e2, e3, e0, e0] with loads [8/3, 2, 1, 1, 8/3, 8/3] packed 3 per GPU:
    8/3 -> G0, 8/3 -> G1, 8/3 -> G0 (tie: the first), 2 -> G1, 1 -> G1 (G1 full), 1 -> G0:
    GPU0 = {e0, e0, e3} = 19/3, GPU1 = {e0, e1, e2} = 17/3, imbalance (19/3)/6 = 19/18."""
    w = torch.tensor([[8.0, 2.0, 1.0, 1.0]])
    phy2log, rank, count = rebalance_experts(w, 4, 1, 1, 2)
    assert phy2log.tolist() == [[0, 3, 1, 2]] and count.tolist() == [[1, 1, 1, 1]]
    assert gpu_loads(w, phy2log, count, 2).tolist() == [[9.0, 3.0]]
    assert imbalance(gpu_loads(w, phy2log, count, 2)).item() == 1.5
    phy2log, rank, count = rebalance_experts(w, 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 0, 3, 0, 1, 2]] and count.tolist() == [[3, 1, 1, 1]]
    assert sorted(rank[0, phy2log[0] == 0].tolist()) == [0, 1, 2]
    assert gpu_loads(w, phy2log, count, 2)[0].tolist() == pytest.approx([19 / 3, 17 / 3], abs=1e-12)
    assert imbalance(gpu_loads(w, phy2log, count, 2)).item() == pytest.approx(19 / 18, abs=1e-12)
    contiguous = gpu_loads(w, *static_placement(1, 4, 2, "contiguous"), 2)
    round_robin = gpu_loads(w, *static_placement(1, 4, 2, "round_robin"), 2)
    assert contiguous.tolist() == [[10.0, 2.0]] and round_robin.tolist() == [[9.0, 3.0]]


def zipf_loads(L: int, n: int, seed: int) -> torch.Tensor:
    """Skewed loads: 1/rank over a random permutation of the experts, per layer."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([(1e4 / torch.arange(1, n + 1).double())[torch.randperm(n, generator=g)] for _ in range(L)])


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_eplb_invariants(config):
    L, n, G, extra, groups, nodes = config
    R = extra * G
    w = zipf_loads(L, n, seed=n + G)
    phy2log, rank, count = rebalance_experts(w, n + R, groups, nodes, G)
    assert phy2log.shape == (L, n + R) and (n + R) % G == 0  # (n + R) / G slots on every GPU
    for layer in range(L):
        assert set(phy2log[layer].tolist()) == set(range(n))  # every expert placed
        assert torch.equal(torch.bincount(phy2log[layer], minlength=n), count[layer])  # its replicas counted
        for e in range(n):  # ranks 0 .. c-1 of each expert
            assert sorted(rank[layer, phy2log[layer] == e].tolist()) == list(range(int(count[layer, e])))
    assert (count.sum(-1) == n + R).all() and (count >= 1).all()
    per_gpu = gpu_loads(w, phy2log, count, G)
    assert torch.allclose(per_gpu.sum(-1), w.sum(-1))  # no load lost or counted twice
    imb = imbalance(per_gpu)
    assert (imb >= 1 - 1e-12).all()
    if nodes > 1:  # expert groups confined to nodes: balance traded for locality, no bound against the static ones
        return
    if R == 0:  # skewed loads: balanced packing beats both static layouts in every layer
        for method in ("contiguous", "round_robin"):
            static = imbalance(gpu_loads(w, *static_placement(L, n, G, method), G))
            assert (imb <= static + 1e-12).all() and (imb < static).any()
    else:  # replicas of the heaviest experts: below both static layouts and EPLB without replicas
        static = imbalance(gpu_loads(w, *static_placement(L, n, G, "round_robin"), G))
        phy2log, _, count = rebalance_experts(w, n, groups, nodes, G)
        assert (imb < static).all() and (imb < imbalance(gpu_loads(w, phy2log, count, G))).all()


def test_stacked_placements_give_each_placement_its_own_numbers():
    """imbalance_statistic evaluates the placements of one G and slot count stacked: every placement's per-layer
    and overall imbalances, on single loads and on a batch of replicates, are exactly those it gives alone."""
    L, n = 3, 16
    w = zipf_loads(L, n, seed=4)
    places = [(G, 0, m, *static_placement(L, n, G, m)) for G in (2, 4, 8) for m in ("contiguous", "round_robin")]
    places += [(G, e * G, "eplb", *rebalance_experts(w, n + e * G, 4, 2, G)[::2]) for G in (2, 4, 8) for e in (0, 1)]
    rng = np.random.default_rng(0)
    loads = rng.multinomial(2000, np.full(L * n, 1 / (L * n)), size=(5, 7)).astype(float)  # [5, 7, L * n]
    for s in (w.reshape(-1).numpy(), loads):
        got = imbalance_statistic(places)(s).reshape(*s.shape[:-1], len(places), L + 1)
        for i, p in enumerate(places):
            assert np.array_equal(got[..., i, :], imbalance_statistic([p])(s)), p[:3]


def test_static_layouts_by_hand():
    phy2log, count = static_placement(1, 8, 4, "contiguous")
    assert phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]  # GPU g: experts 2g, 2g + 1 (e -> e * G // n)
    phy2log, count = static_placement(1, 8, 4, "round_robin")
    assert phy2log.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]  # GPU g: experts g, g + 4 (e -> e % G)


@pytest.fixture(scope="module")
def tiny_placement():
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=740)  # the last row padded
    return lm, tokens, moetool.placement(lm, tokens, gpus=(2, 4), extra_slots=(0, 1), reference=tokens, quiet=True)


def test_loads_and_imbalance_by_hand(tiny_placement):
    """Loads counted from the routing events by hand (real tokens only); the static layouts' GPU loads summed by
    hand from them; EPLB fitted on the same data as the reference: eplb_stale == eplb."""
    import moetool

    lm, tokens, res = tiny_placement
    n, K = lm.layers[0].n_experts, lm.layers[0].top_k
    counts = {L.index: torch.zeros(n, dtype=torch.float64) for L in lm.layers}
    with moetool.hook(lm, consumers=[lambda ev: counts[ev.layer.index].add_(
            torch.bincount(ev.idx[ev.valid].reshape(-1), minlength=n).double().cpu())]):
        with torch.no_grad():
            for b in tokens.batches(8):
                feed(lm.model, b.input_ids, b.attention_mask)
    loads = res["placement_loads"]
    for li, c in counts.items():
        got = loads[(loads.data_set == "data") & (loads.layer == li)].sort_values("expert")
        assert got["load"].tolist() == c.tolist() and c.sum() == tokens.n_tokens * K
    df = res["placement"]
    for G in (2, 4):
        for li, c in counts.items():
            rows = df[(df.gpus == G) & (df.layer == li)].set_index(["method", "replicas"])
            for method, gpu_of in (("contiguous", lambda e: e * G // n), ("round_robin", lambda e: e % G)):
                per_gpu = [sum(float(c[e]) for e in range(n) if gpu_of(e) == g) for g in range(G)]
                r = rows.loc[(method, 0)]
                assert r["max_gpu_load"] == max(per_gpu) and r["min_gpu_load"] == min(per_gpu)
                assert r["mean_gpu_load"] == tokens.n_tokens * K / G
                assert r["imbalance"] == pytest.approx(max(per_gpu) / (sum(per_gpu) / G), rel=1e-12)
            for R in (0, G):
                assert rows.loc[("eplb", R)].equals(rows.loc[("eplb_stale", R)])
                assert rows.loc[("eplb", R), "slots_per_gpu"] == (n + R) // G
    overall = res["placement_overall"].set_index(["gpus", "replicas", "method"])
    one = df[(df.gpus == 4) & (df.method == "eplb") & (df.replicas == 4)]
    assert overall.loc[(4, 4, "eplb"), "imbalance"] == pytest.approx(
        one["max_gpu_load"].sum() / one["mean_gpu_load"].sum(), rel=1e-12)
    assert set(res.definitions) >= {"imbalance", "max_gpu_load/min_gpu_load", "mean_gpu_load", "load", "method"}


@pytest.mark.parametrize("what", ["data", "model", "both"])
def test_staleness(tiny_placement, tmp_path, what):
    """A reference of other text, another checkpoint (tiny-early), or both: the reference loads are that model's
    choices on that text counted by hand, and eplb_stale is EPLB fitted on them (refitted here) evaluated on the
    data's loads under the model."""
    import moetool

    lm, tokens, _ = tiny_placement
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # arithmetic" for i in range(200)))
    ref = moetool.tokens(lm, str(other), seq_len=64, max_tokens=512) if what != "model" else None
    ref_lm = moetool.load("tiny-early") if what != "data" else None
    res = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), reference=ref, reference_model=ref_lm,
                            quiet=True)
    n = lm.layers[0].n_experts
    counts = {L.index: torch.zeros(n, dtype=torch.float64) for L in lm.layers}
    with moetool.hook(ref_lm or lm, consumers=[lambda ev: counts[ev.layer.index].add_(
            torch.bincount(ev.idx[ev.valid].reshape(-1), minlength=n).double().cpu())]):
        with torch.no_grad():
            for b in (ref or tokens).batches(8):
                feed((ref_lm or lm).model, b.input_ids, b.attention_mask)
    loads = res["placement_loads"]
    idx = [L.index for L in lm.layers]
    w = {s: torch.tensor(loads[loads.data_set == s].pivot(index="layer", columns="expert", values="load")
                         .loc[idx].to_numpy()) for s in ("data", "reference")}
    assert torch.equal(w["reference"], torch.stack([counts[i] for i in idx]))
    assert not torch.equal(w["data"], w["reference"])
    phy2log, _, count = rebalance_experts(w["reference"], 12, 1, 1, 4)
    want = imbalance(gpu_loads(w["data"], phy2log, count, 4))
    got = res["placement"].query("method == 'eplb_stale'").sort_values("layer")["imbalance"].to_numpy()
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-12)
    assert res.meta["reference"]["model"] == ("tiny-early" if ref_lm else "tiny")


def test_reference_data_read_again_is_the_data(tiny_placement):
    """--reference-data naming the --data file reads it again into another TokenSet holding the same rows: EPLB
    fitted on them under the same model is the eplb placement, in-sample, so eplb_stale must be eplb row for row,
    its interval the refit one (checked by hand in test_fitted_placement_intervals_refit_per_replicate) too. Before:
    only the very same object counted as the data, and a copy's eplb_stale got the fixed placement's BCa interval
    around its in-sample estimate (4 GPUs, R = 4, overall: [1.0299, 1.0399] beside eplb's [1.0378, 1.1761])."""
    import moetool

    lm, tokens, res = tiny_placement
    again = moetool.tokens(lm, None, seq_len=64, max_tokens=740)  # the same text, read and packed again
    assert again is not tokens and again.fingerprint() == tokens.fingerprint()
    copy = moetool.placement(lm, tokens, gpus=(2, 4), extra_slots=(0, 1), reference=again, quiet=True)
    cols = ["imbalance", "imbalance_lo", "imbalance_hi", "max_gpu_load", "min_gpu_load", "max_replicas"]
    for name, keys in (("placement", ["gpus", "replicas", "layer"]), ("placement_overall", ["gpus", "replicas"])):
        df = copy[name]
        stale = df[df.method == "eplb_stale"].set_index(keys).sort_index()
        eplb = res[name][res[name].method == "eplb"].set_index(keys).sort_index()
        assert len(stale) == len(eplb) > 0
        for c in (x for x in cols if x in stale.columns):
            assert np.array_equal(stale[c].to_numpy(), eplb[c].to_numpy()), (name, c)
    o = copy["placement_overall"].set_index(["gpus", "replicas", "method"]).loc[(4, 4, "eplb_stale")]
    assert o.imbalance_lo == o.imbalance  # the in-sample estimate at the refit interval's low end


def test_reference_model_of_other_layers_is_refused(tiny_placement):
    import moetool

    lm, tokens, _ = tiny_placement
    with pytest.raises(MoetoolError, match="reference model's MoE layers"):
        moetool.placement(lm, tokens, gpus=(2,), reference_model=moetool.load("tiny-fine"), quiet=True)


def test_reference_model_by_name_or_of_another_tokenizer_is_refused_before_any_forward(tiny_placement, tmp_path,
                                                                                         monkeypatch):
    """``reference_model="tiny-early"`` (a name: the command loads it, the function takes it loaded) raised an
    AttributeError after the model's forward; a checkpoint with the same weights and two token ids swapped gave a
    table (its loads on ids that are other text to it), where ``moetool placement --reference-model`` refuses it.
    Both are one line now, and so is a text file given as ``reference``, before any forward."""
    import json
    import shutil

    import moetool
    from moetool.experiments.placement import compute
    from moetool.loading import EMBEDDED_DIR

    lm, tokens, _ = tiny_placement
    retok = tmp_path / "tiny-retok"
    shutil.copytree(EMBEDDED_DIR / "tiny", retok)
    tok = json.loads((retok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (retok / "tokenizer.json").write_text(json.dumps(tok))
    other = moetool.load(str(retok))
    monkeypatch.setattr(compute, "expert_loads", lambda *a, **k: pytest.fail("a forward ran before the refusal"))
    for kw, message in ((dict(reference_model="tiny-early"),
                         r"^reference_model takes a loaded model \(moetool.load\(...\)\), not 'tiny-early'$"),
                        (dict(reference_model=other), r"^the reference model's tokenizer differs from the model's"),
                        (dict(reference="other.txt"), r"^reference takes packed tokens .*not str 'other.txt'$")):
        with pytest.raises(MoetoolError, match=message):
            moetool.placement(lm, tokens, gpus=(2,), quiet=True, **kw)


def test_bad_options_are_one_line():
    for kw, message in ((dict(gpus=(0,)), "--gpus"), (dict(extra_slots=(-1,)), "--extra-slots"),
                        (dict(nodes=0), "--nodes"), (dict(groups=0), "--groups")):
        with pytest.raises(MoetoolError, match=message) as e:
            PlacementOptions(**kw)
        assert "\n" not in str(e.value)
    with pytest.raises(MoetoolError, match="must divide the 8 experts"):
        PlacementOptions(gpus=(3,)).gpu_counts(8)
    with pytest.raises(MoetoolError, match="multiple of --nodes"):
        PlacementOptions(gpus=(2,), nodes=4).gpu_counts(8)
    assert PlacementOptions().gpu_counts(8) == [2, 4, 8] and PlacementOptions().gpu_counts(12) == [2, 4]
    with pytest.raises(MoetoolError, match="multiple of the GPUs"):
        rebalance_experts(torch.ones(1, 8), 9, 1, 1, 2)


def test_cli_refuses_bad_values_in_one_line(tmp_path, cli):
    for args in (["--extra-slots", "-1"], ["--reference-data", str(tmp_path / "missing.txt")],
                 ["--reference-model", "tiny-fine"]):  # another architecture: refused before any weight loads
        r = cli("placement", *args, "--out", str(tmp_path / "x"))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("model_type, groups", [("deepseek_v2", 4), ("deepseek_v3", 2), ("mixtral", 1)])
def test_default_groups_are_the_routing_groups(tiny_model, model_type, groups):
    """EPLB's expert groups default to the routing's n_group (the tiny configs': 4, 2, none)."""
    from moetool.adapters import find_moe_layers
    from moetool.experiments.placement.compute import model_groups

    assert model_groups(find_moe_layers(tiny_model(model_type))[0]) == groups


def rows_by_hand(lm, tokens):
    """Per packed row, the top-K assignments of real tokens per expert, counted from the routing events:
    ``{layer: [rows, n]}``."""
    import moetool

    n, S = lm.layers[0].n_experts, tokens.input_ids.shape[1]
    per_row = {L.index: np.zeros((tokens.input_ids.shape[0], n)) for L in lm.layers}
    start = [0]

    def count(ev):
        idx, valid = ev.idx.tolist(), ev.valid.tolist()
        for t, (experts, ok) in enumerate(zip(idx, valid)):
            if ok:
                for e in experts:
                    per_row[ev.layer.index][start[0] + t // S, e] += 1

    with moetool.hook(lm, consumers=[count]):
        with torch.no_grad():
            for b in tokens.batches(8):
                feed(lm.model, b.input_ids, b.attention_mask)
                start[0] += b.input_ids.shape[0]
    return per_row


def test_imbalance_intervals_by_hand(tiny_placement):
    """The imbalance intervals: per-row loads counted by hand from the routing events, resampled with the same
    row weights, each static layout's imbalance summed by hand per replicate, BCa as moetool.uncertainty; the
    value lies inside, and the overall interval is the one of Σ max / Σ mean."""
    from moetool.uncertainty import bca, bootstrap_weights

    lm, tokens, res = tiny_placement
    n = lm.layers[0].n_experts
    layer_ids = [L.index for L in lm.layers]
    per_row = rows_by_hand(lm, tokens)
    rows = tokens.input_ids.shape[0]

    w = bootstrap_weights(rows, 1000, 0)
    df, overall = res["placement"], res["placement_overall"].set_index(["gpus", "replicas", "method"])
    for G, method, gpu_of in ((2, "contiguous", lambda e: e * G // n), (4, "round_robin", lambda e: e % G)):
        onehot = np.array([[1.0 if gpu_of(e) == g else 0.0 for g in range(G)] for e in range(n)])  # [n, G]

        def stat(loads):  # loads [..., L, n] -> per-layer imbalance [..., L] and overall [...]
            gpu = loads @ onehot
            mx, mean = gpu.max(-1), gpu.mean(-1)
            return np.concatenate([mx / mean, (mx.sum(-1) / mean.sum(-1))[..., None]], -1)

        sums = np.stack([per_row[li] for li in layer_ids], 1)  # [rows, L, n]
        value = stat(sums.sum(0))
        reps = stat(np.einsum("br,rln->bln", w, sums))
        jack = stat(sums.sum(0) - sums)
        lo, hi = bca(reps, value, jack)
        got = df[(df.gpus == G) & (df.method == method)].set_index("layer").loc[layer_ids]
        assert np.allclose(got.imbalance, value[:-1], rtol=1e-12)
        assert np.allclose(got.imbalance_lo, lo[:-1], rtol=1e-9) and np.allclose(got.imbalance_hi, hi[:-1], rtol=1e-9)
        o = overall.loc[(G, 0, method)]
        assert o.imbalance == pytest.approx(value[-1], rel=1e-12)
        assert o.imbalance_lo == pytest.approx(lo[-1], rel=1e-9) and o.imbalance_hi == pytest.approx(hi[-1], rel=1e-9)
        assert (got.imbalance_lo <= got.imbalance).all() and (got.imbalance <= got.imbalance_hi).all()
        assert (got.imbalance_hi > got.imbalance_lo).all()  # the data do vary


def test_fitted_placement_intervals_refit_per_replicate(tiny_placement):
    """eplb is fitted on the data it is evaluated on (in sample, optimistic). Its interval: replicate b (the run's
    row weights) refits EPLB on resample b's loads (one replicate at a time here) and serves resample b + 1's (mod
    1000), its GPU loads summed by hand; the percentile interval, widened to include the estimate. eplb_stale, fitted on
    the same rows (reference = the data), gets the same. Before: the placement was held fixed and BCa, reading the
    replicates above the in-sample estimate as bias, shifted the interval down to end near the estimate."""
    from moetool.uncertainty import bootstrap_weights

    lm, tokens, res = tiny_placement
    n = lm.layers[0].n_experts
    layer_ids = [L.index for L in lm.layers]
    per_row = rows_by_hand(lm, tokens)
    sums = np.stack([per_row[li] for li in layer_ids], 1)  # [rows, L, n]
    w = bootstrap_weights(sums.shape[0], 1000, 0)
    df, overall = res["placement"], res["placement_overall"].set_index(["gpus", "replicas", "method"])
    for G in (2, 4):
        for R in (0, G):
            P = n + R
            reps = []
            for b in range(w.shape[0]):
                phy2log, _, count = rebalance_experts(torch.from_numpy(np.einsum("r,rln->ln", w[b], sums)), P, 1, 1, G)
                phy2log, count = phy2log.numpy(), count.numpy()
                served = np.einsum("r,rln->ln", w[(b + 1) % w.shape[0]], sums)  # the next resample's loads
                gpu = np.array([[sum(served[li, e] / count[li, e] for e in phy2log[li, g * P // G:(g + 1) * P // G])
                                 for g in range(G)] for li in range(len(layer_ids))])  # [L, G]
                mx, mean = gpu.max(-1), gpu.mean(-1)
                reps.append([*(mx / mean), mx.sum() / mean.sum()])
            lo, hi = np.quantile(np.array(reps), [0.025, 0.975], axis=0)
            for method in ("eplb", "eplb_stale"):
                got = df[(df.gpus == G) & (df.replicas == R) & (df.method == method)].set_index("layer").loc[layer_ids]
                o = overall.loc[(G, R, method)]
                value = np.array([*got.imbalance, o.imbalance])
                want_lo, want_hi = np.minimum(lo, value), np.maximum(hi, value)
                assert np.allclose([*got.imbalance_lo, o.imbalance_lo], want_lo, rtol=1e-12), (G, R, method)
                assert np.allclose([*got.imbalance_hi, o.imbalance_hi], want_hi, rtol=1e-12), (G, R, method)
                assert (got.imbalance_lo <= got.imbalance).all() and (got.imbalance <= got.imbalance_hi).all()
    # the in-sample estimate sits at the low end: on 4 GPUs with 4 replicas the interval lies above it, 1.0378
    # [1.0378, 1.1761] (before: BCa's 1.0378 [1.0299, 1.0399], ending near the estimate)
    o = overall.loc[(4, 4, "eplb")]
    assert o.imbalance_lo == o.imbalance and o.imbalance_hi - o.imbalance > 0.01


def test_stale_placement_of_another_model_on_the_data_refits_on_that_models_rows(tiny_placement):
    """eplb_stale of a reference model (tiny-early) on the data's own rows: replicate b refits EPLB on resample b of
    tiny-early's per-row loads and serves resample b + 1 of the data's loads under tiny (by hand, as above). Refit on
    the data's own loads instead, it read eplb's interval (mutation pass 19)."""
    import moetool
    from moetool.uncertainty import bootstrap_weights

    lm, tokens, _ = tiny_placement
    ref_lm = moetool.load("tiny-early")
    res = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), reference_model=ref_lm, quiet=True)
    n, G, R = lm.layers[0].n_experts, 4, 4
    ids = [L.index for L in lm.layers]
    data = np.stack([rows_by_hand(lm, tokens)[li] for li in ids], 1)  # [rows, L, n]
    ref = np.stack([rows_by_hand(ref_lm, tokens)[li] for li in ids], 1)
    w = bootstrap_weights(data.shape[0], 1000, 0)
    reps = []
    for b in range(w.shape[0]):
        phy2log, _, count = rebalance_experts(torch.from_numpy(np.einsum("r,rln->ln", w[b], ref)), n + R, 1, 1, G)
        served = torch.from_numpy(np.einsum("r,rln->ln", w[(b + 1) % w.shape[0]], data))
        gpu = gpu_loads(served, phy2log, count, G).numpy()  # [L, G]
        mx, mean = gpu.max(-1), gpu.mean(-1)
        reps.append([*(mx / mean), mx.sum() / mean.sum()])
    lo, hi = np.quantile(np.array(reps), [0.025, 0.975], axis=0)
    df = res["placement"].query("method == 'eplb_stale'").set_index("layer").loc[ids]
    o = res["placement_overall"].set_index("method").loc["eplb_stale"]
    value = np.array([*df.imbalance, o.imbalance])
    assert np.allclose([*df.imbalance_lo, o.imbalance_lo], np.minimum(lo, value), rtol=1e-12)
    assert np.allclose([*df.imbalance_hi, o.imbalance_hi], np.maximum(hi, value), rtol=1e-12)


def test_nodes_that_the_groups_cannot_shape_are_said(tiny_placement):
    """``--nodes 2`` on a model of one expert group: EPLB's hierarchical policy needs the groups to divide into the
    nodes, so (as eplb.py) the global policy places across nodes -- the same placements as one node. The run said
    nothing while its ``nodes`` column read 2; now the manifest's ``left_out`` says so (and ``eplb.policy``). With
    groups that divide into the nodes the hierarchical policy runs and nothing is said."""
    import moetool

    lm, tokens, _ = tiny_placement
    one = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), bootstrap=0, quiet=True)
    two = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), bootstrap=0, nodes=2, quiet=True)
    cols = ["layer", "gpus", "replicas", "method", "imbalance"]
    assert (two["placement"][cols].to_numpy() == one["placement"][cols].to_numpy()).all()
    assert two.meta["eplb"]["policy"] == "global" and "hierarchical placement (--nodes 2)" in two.meta["left_out"]
    assert one.meta["eplb"]["policy"] == "hierarchical" and "left_out" not in one.meta
    grouped = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), bootstrap=0, nodes=2, groups=2, quiet=True)
    assert grouped.meta["eplb"]["policy"] == "hierarchical" and "left_out" not in grouped.meta


def test_replicas_go_to_the_largest_load_per_replica_one_at_a_time():
    """EPLB's replication: each extra replica goes to the expert whose load PER REPLICA is the largest then (not the
    largest load): loads 10, 6, 1 with two extra slots -> 10 (10 > 6), then 6 (6 > 10 / 2), by hand."""
    phy2log, rank, count = replicate_experts(torch.tensor([[10.0, 6.0, 1.0]]), 5)
    assert phy2log.tolist() == [[0, 1, 2, 0, 1]] and rank.tolist() == [[0, 0, 0, 1, 1]]
    assert count.tolist() == [[2, 2, 1]]
    assert max(w / c for w, c in zip((10.0, 6.0, 1.0), count[0].tolist())) == 5.0  # the smallest largest share


def test_zero_computation_experts_are_not_placed():
    """LongCat-Flash (12 routed + 4 identity experts, the last ids): the placed experts are the 12 computed ones, and
    their loads are the router's own top-K assignments of real tokens to experts 0..11, counted here from plain
    forward hooks on transformers' router (the identity experts' assignments take no GPU)."""
    from types import SimpleNamespace

    from conftest import longcat_unsorted_router_model, router_outputs
    from moetool.adapters import find_moe_layers
    from moetool.data import TokenSet
    from moetool.experiments.placement.compute import placement

    model, routers, ids = longcat_unsorted_router_model(6, torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    seen = router_outputs(model, routers, ids, mask)
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name="longcat")
    res = placement(lm, TokenSet(ids, mask, [""] * 6, "test"), gpus=(4,), bootstrap=0, quiet=True)
    loads = res["placement_loads"]
    keep = mask.reshape(-1).bool()
    for i, (_, _, idx) in seen.items():
        hand = torch.bincount(idx[keep].reshape(-1), minlength=16).double()
        assert hand[12:].sum() > 0  # the case: identity experts are chosen
        mine = loads[loads.layer == i].sort_values("expert")
        assert mine.expert.tolist() == list(range(12)) and mine.load.tolist() == hand[:12].tolist()
        # load_fraction = load / (tokens * K): short of 1 by the identity experts' share
        assert mine.load_fraction.tolist() == pytest.approx((hand[:12] / (int(keep.sum()) * 4)).tolist(), rel=1e-15)
        assert mine.tokens.iloc[0] == int(keep.sum())


def test_sglang_export_of_a_placement_of_some_moe_layers_is_refused(tiny_placement, tmp_path, cli):
    """Break-it run 5: `moetool placement --layers 1 --gpus 4 --extra-slots 1 --export sglang` wrote a file whose
    MoE layers 0, 2 and 3 held SGLang's trivial map [0..7, 0..3] -- read by the server as their placement, nothing
    in it or the manifest saying they were never measured. Refused in one line (the command: before any weight
    loads); every MoE layer placed is exported, each MoE row EPLB's placement of that layer's loads; eplb's file,
    which lists its layers, still takes some."""
    import json

    import moetool
    from moetool.experiments.placement.compute import rebalance_experts

    lm, tokens, _ = tiny_placement
    one = moetool.placement(lm, tokens, layers=(1,), gpus=(4,), extra_slots=(1,), bootstrap=0, quiet=True)
    with pytest.raises(MoetoolError, match=r"placement covers only layers 1; MoE layers 0, 2-3 would get SGLang's"):
        moetool.export_placement(one, "sglang", tmp_path / "one.json")
    assert not (tmp_path / "one.json").exists()
    eplb = json.loads(moetool.export_placement(one, "eplb", tmp_path / "one-eplb.json").read_text())
    assert eplb["layers"] == [1]
    every = moetool.placement(lm, tokens, gpus=(4,), extra_slots=(1,), bootstrap=0, quiet=True)
    rows = json.loads(moetool.export_placement(every, "sglang", tmp_path / "all.json").read_text())
    loads = every["placement_loads"]
    loads = loads[loads["data_set"] == "data"]
    for layer in range(4):  # by hand: the layer's routed counts over the real tokens, EPLB on 12 slots over 4 GPUs
        load = torch.tensor(loads[loads.layer == layer].sort_values("expert")["load"].to_numpy()).view(1, -1)
        assert rows["physical_to_logical_map"][layer] == rebalance_experts(load.double(), 12, 1, 1, 4)[0][0].tolist()
    r = cli("placement", "--layers", "1", "--gpus", "4", "--extra-slots", "1", "--export", "sglang",
            "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "MoE layers 0, 2-3" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_an_export_of_several_extra_slot_values_is_one_line():
    """``--export`` writes one placement: two ``--extra-slots`` values are one line (mutation pass 13: only several
    ``--gpus`` were refused, and the first slots value was written silently); one value per GPU is R = slots x G."""
    from types import SimpleNamespace

    from moetool.traces.export import export_layout

    def opts(slots):
        return SimpleNamespace(gpu_counts=lambda n: [4], extra_slots=slots)

    assert export_layout("sglang", 8, opts((2,))) == (4, 8)
    with pytest.raises(MoetoolError, match=r"^--export writes one placement: give one --gpus G and one --extra-slots "
                                           r"value$"):
        export_layout("eplb", 8, opts((0, 1)))


def test_hierarchical_eplb_confines_each_expert_group_to_one_node_by_hand():
    """EPLB's hierarchical policy (groups divide into the nodes): expert groups are packed onto nodes FIRST, then
    replicated and packed within their node. Loads [2, 1, 8, 3], groups {0, 1} (3) and {2, 3} (11), 2 nodes of one
    GPU: one group per node, group g on node g (eplb.py keeps the order when a pack takes one item), so the GPUs
    carry 3 and 11 -- imbalance 11/7 -- where the global policy mixes the groups (8, 3, 2, 1 heaviest first: 8 -> G0,
    3 -> G1, 2 -> G1, 1 -> G0, loads 9 and 5). With one extra slot per GPU a replica stays in its node: expert 0 (2 >
    1) on node 0, expert 2 (8 > 3) on node 1, the GPU loads still 3 and 11."""
    w = torch.tensor([[2.0, 1.0, 8.0, 3.0]])
    phy2log, rank, count = rebalance_experts(w, 4, 2, 2, 2)
    assert phy2log.tolist() == [[0, 1, 2, 3]] and count.tolist() == [[1, 1, 1, 1]]
    assert gpu_loads(w, phy2log, count, 2).tolist() == [[3.0, 11.0]]
    assert imbalance(gpu_loads(w, phy2log, count, 2)).item() == pytest.approx(11 / 7, abs=1e-12)
    glob = rebalance_experts(w, 4, 1, 1, 2)
    assert gpu_loads(w, glob[0], glob[2], 2).tolist() == [[9.0, 5.0]]
    phy2log, rank, count = rebalance_experts(w, 6, 2, 2, 2)
    assert count.tolist() == [[2, 1, 2, 1]]
    assert sorted(phy2log[0, :3].tolist()) == [0, 0, 1] and sorted(phy2log[0, 3:].tolist()) == [2, 2, 3]
    assert gpu_loads(w, phy2log, count, 2).tolist() == [[3.0, 11.0]]
    # one expert per GPU: eplb.py's packing keeps the experts in order (no sort), whatever their loads
    phy2log, _, _ = rebalance_experts(torch.tensor([[1.0, 8.0, 2.0, 1.0]]), 4, 1, 1, 4)
    assert phy2log.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[4] % c[5] == 0 and c[5] > 1], ids=str)
def test_hierarchical_eplb_keeps_every_group_on_one_node(config):
    """The hierarchical policy's defining property on the skewed loads of :func:`test_eplb_invariants` (which checks
    no bound for it): every replica of a group's experts sits on one node (slot s on node s // (P / nodes)), and every
    node holds groups / nodes whole groups."""
    L, n, G, extra, groups, nodes = config
    P = n + extra * G
    w = zipf_loads(L, n, seed=n + G)
    phy2log, _, _ = rebalance_experts(w, P, groups, nodes, G)
    node_of_slot = torch.arange(P) // (P // nodes)
    for layer in range(L):
        group_of_slot = phy2log[layer] // (n // groups)
        for g in range(groups):
            assert len(set(node_of_slot[group_of_slot == g].tolist())) == 1, (layer, g)
        for node in range(nodes):
            assert len(set(group_of_slot[node_of_slot == node].tolist())) == groups // nodes, (layer, node)
