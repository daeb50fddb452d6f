"""``stats``: every table against a hand count over the captured top-K of real tokens only."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from conftest import build_tiny_model
from moetool import ops
from moetool.adapters import find_moe_layers
from moetool.data import TokenBatch, TokenSet
from moetool.engine import Engine
from moetool.engine.runner import id_space
from moetool.errors import MoetoolError
from moetool.experiments.stats.compute import ONE_EXPERT, RoutingStats, SparseCounter, StatsOptions, stats, summary_lines
from moetool.experiments.stats.figures import stats_figures
from moetool.sketch import DENSE_KEYS, DENSE_TOTAL, dense_space

COLUMNS = {
    "load.csv": ["layer", "expert", "load_fraction", "load_fraction_lo", "load_fraction_hi", "token_fraction",
                 "token_fraction_lo", "token_fraction_hi", "router_prob", "tokens"],
    "layers.csv": ["layer", "n_experts", "top_k", "tokens", "load_entropy", "load_entropy_norm",
                   "load_entropy_norm_lo", "load_entropy_norm_hi", "confidence_entropy", "confidence_entropy_norm",
                   "confidence_entropy_norm_lo", "confidence_entropy_norm_hi", "max_load_ratio", "max_load_ratio_lo",
                   "max_load_ratio_hi", "aux_loss", "aux_loss_hf_pooled"],
    "coactivation.csv": ["layer", "a", "b", "p_b_given_a", "count"],
    "domain_load.csv": ["layer", "domain", "expert", "load_fraction", "token_fraction", "uniform_token_fraction",
                        "tokens"],
    "cross_layer.csv": ["layer", "next_layer", "a", "b", "count", "p_b_given_a"],
    "cross_layer_summary.csv": ["layer", "next_layer", "tokens", "mean_max_p", "uniform_max_p", "mutual_information",
                                "mutual_information_norm"],
    "specialization.csv": ["layer", "view", "token_ids", "specialization", "token_ids_all", "specialization_all_ids"],
    "specialized_tokens.csv": ["layer", "view", "expert", "rank", "token_id", "token", "occurrences", "count",
                               "specialization"],
    "top_tokens.csv": ["layer", "expert", "rank", "token_id", "token", "count", "share"],
    "top_tokens_lift.csv": ["layer", "expert", "rank", "token_id", "token", "count", "share", "lift"],
}
#: columns the load-balancing consumer adds to RoutingStats' own tables (stats() merges them)
LOAD_BALANCE_COLUMNS = {"router_prob", "aux_loss", "aux_loss_hf_pooled"}
PAD = 3  # the id on padded positions; it also occurs as a real token, so counting padding changes every table


def make_batches() -> list[TokenBatch]:
    """Two right-padded batches (as data.pack pads) over a small id range, so token ids repeat."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for doms, pads in ((["web", "code", "web"], [0, 5, 2]), (["code", "math"], [4, 0])):
        ids = torch.randint(3, 15, (len(doms), 12), generator=gen)
        mask = torch.ones_like(ids)
        for r, p in enumerate(pads):
            if p:
                ids[r, -p:], mask[r, -p:] = PAD, 0
        out.append(TokenBatch(ids, mask, doms))
    return out


def collect(model_type: str, merge_min: int = 5, dense: bool = False):
    """The stats consumer and, beside it, a plain recorder of every event (layer, top-K, pi, valid). ``dense``: its
    token counters over the model's id space (:func:`moetool.engine.runner.id_space`; default: sparse)."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    batches = make_batches()
    stats = RoutingStats(layers, [d for b in batches for d in b.domains], merge_min=merge_min,
                         vocab=id_space(model) if dense else None)
    rec = []
    with torch.no_grad(), Engine(model, layers, consumers=[
            stats, lambda ev: rec.append((ev.layer.index, ev.idx.clone(), ev.probs.clone(), ev.valid.clone()))]):
        for b in batches:
            stats.begin_batch(b)
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    return stats, layers, batches, rec


def reference_tokens(batches, rec, layer: int, with_padding: bool = False):
    """``[(token_id, domain, top-K list, pi row)]`` for one layer, one Python tuple per token."""
    events = [r for r in rec if r[0] == layer]
    assert len(events) == len(batches)
    out = []
    for b, (_, idx, probs, valid) in zip(batches, events):
        S = b.input_ids.shape[1]
        for t in range(idx.shape[0]):
            r, s = divmod(t, S)
            assert bool(valid[t]) == bool(b.attention_mask[r, s])
            if valid[t] or with_padding:
                out.append((int(b.input_ids[r, s]), b.domains[r], idx[t].tolist(), probs[t].numpy()))
    return out


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def collected(request):
    stats, layers, batches, rec = collect(request.param)
    return stats, layers, batches, rec, stats.tables(None, top_n=3, min_count=2)


def test_load_is_a_hand_count_over_real_tokens(collected):
    stats, layers, batches, rec, t = collected
    load = t["load.csv"]
    assert list(load.columns) == [c for c in COLUMNS["load.csv"] if c not in LOAD_BALANCE_COLUMNS and not c.endswith(("_lo", "_hi"))]
    assert sorted(load["layer"].unique()) == [L.index for L in layers]
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        assert len(toks) == int(sum(b.attention_mask.sum() for b in batches))
        hand = Counter(e for _, _, top, _ in toks for e in top)
        got = load[load["layer"] == L.index].set_index("expert")
        want = np.array([hand[e] / (L.top_k * len(toks)) for e in range(L.n_experts)])
        np.testing.assert_allclose(got["load_fraction"], want, rtol=1e-12)
        np.testing.assert_allclose(got["token_fraction"], want * L.top_k, rtol=1e-12)
        assert got["tokens"].tolist() == [hand[e] for e in range(L.n_experts)]
        # the batch is built so that counting padding would change the answer
        padded = Counter(e for _, _, top, _ in reference_tokens(batches, rec, L.index, with_padding=True) for e in top)
        assert padded != hand


def test_entropies_match_scipy(collected):
    stats, layers, batches, rec, t = collected
    lay = t["layers.csv"].set_index("layer")
    assert list(t["layers.csv"].columns) == [c for c in COLUMNS["layers.csv"] if c not in LOAD_BALANCE_COLUMNS and not c.endswith(("_lo", "_hi"))]
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        hand = Counter(e for _, _, top, _ in toks for e in top)
        load = np.array([hand[e] for e in range(L.n_experts)], dtype=float)
        load /= load.sum()
        conf = np.mean([scipy_entropy(p) for *_, p in toks])
        row = lay.loc[L.index]
        assert (row["n_experts"], row["top_k"], row["tokens"]) == (L.n_experts, L.top_k, len(toks))
        assert row["load_entropy"] == pytest.approx(scipy_entropy(load), rel=1e-6)
        assert row["load_entropy_norm"] == pytest.approx(scipy_entropy(load) / math.log(L.n_experts), rel=1e-6)
        assert row["confidence_entropy"] == pytest.approx(conf, rel=1e-5)
        assert row["confidence_entropy_norm"] == pytest.approx(conf / math.log(L.n_experts), rel=1e-5)
        assert row["max_load_ratio"] == pytest.approx(load.max() * L.n_experts, rel=1e-12)
        assert 0 < row["load_entropy_norm"] <= 1 and 0 < row["confidence_entropy_norm"] <= 1


def test_coactivation_matches_brute_force_over_all_pairs(collected):
    stats, layers, batches, rec, t = collected
    co = t["coactivation.csv"]
    assert list(co.columns) == COLUMNS["coactivation.csv"]
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        pair, chose = Counter(), Counter()
        for _, _, top, _ in toks:
            for a in top:
                chose[a] += 1
                for b in top:
                    if a != b:
                        pair[a, b] += 1
        g = co[co["layer"] == L.index]
        assert len(g) == L.n_experts * (L.n_experts - 1) and (g["a"] != g["b"]).all()
        for row in g.itertuples():
            assert row.count == pair[row.a, row.b]
            if chose[row.a]:
                assert row.p_b_given_a == pytest.approx(pair[row.a, row.b] / chose[row.a], rel=1e-12)
            else:
                assert math.isnan(row.p_b_given_a)
        # every token contributes K(K-1) ordered pairs
        assert g["count"].sum() == len(toks) * L.top_k * (L.top_k - 1)


def test_domain_load_is_a_hand_count_per_domain(collected):
    stats, layers, batches, rec, t = collected
    dom = t["domain_load.csv"]
    assert list(dom.columns) == COLUMNS["domain_load.csv"]
    assert sorted(dom["domain"].unique()) == ["code", "math", "web"]
    load = t["load.csv"]
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        hand: dict[str, Counter] = defaultdict(Counter)
        ntok = Counter(d for _, d, _, _ in toks)
        for _, d, top, _ in toks:
            hand[d].update(top)
        g = dom[dom["layer"] == L.index]
        for d, gd in g.groupby("domain"):
            gd = gd.set_index("expert")
            assert gd["tokens"].tolist() == [hand[d][e] for e in range(L.n_experts)]
            np.testing.assert_allclose(gd["load_fraction"], [hand[d][e] / (L.top_k * ntok[d])
                                                             for e in range(L.n_experts)], rtol=1e-12)
            assert gd["load_fraction"].sum() == pytest.approx(1.0)
            np.testing.assert_allclose(gd["token_fraction"], [hand[d][e] / ntok[d] for e in range(L.n_experts)],
                                       rtol=1e-12)
            assert (gd["uniform_token_fraction"] == L.top_k / L.n_experts).all()
        # the domains partition the tokens: their counts add up to the overall load
        per_expert = g.groupby("expert")["tokens"].sum()
        assert per_expert.tolist() == load[load["layer"] == L.index]["tokens"].tolist()


def test_a_domain_named_like_the_no_domain_label_beside_undomained_text_is_refused():
    # domain_load.csv labels text without a domain "(none)": a real domain "(none)" beside such text gave two groups
    # of rows under one label (16 rows per layer for 8 experts), neither told from the other
    with pytest.raises(MoetoolError, match="rename that domain"):
        RoutingStats([], ["(none)", "", "web", ""])
    assert RoutingStats([], ["(none)", "web"]).domains == ["(none)", "web"]  # no clash: a name like any other
    assert RoutingStats([], ["", "web"]).domains == ["(none)", "web"]


def test_top_tokens_match_a_counter(collected):
    stats, layers, batches, rec, t = collected
    top, lift = t["top_tokens.csv"], t["top_tokens_lift.csv"]
    assert list(top.columns) == COLUMNS["top_tokens.csv"]
    assert list(lift.columns) == COLUMNS["top_tokens_lift.csv"]
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        total = Counter(tok for tok, *_ in toks)
        pairs = Counter((e, tok) for tok, _, top_k, _ in toks for e in top_k)
        chose = Counter(e for _, _, top_k, _ in toks for e in top_k)
        for e in range(L.n_experts):
            mine = sorted(((-c, tok) for (ee, tok), c in pairs.items() if ee == e))[:3]
            g = top[(top["layer"] == L.index) & (top["expert"] == e)]
            assert g["rank"].tolist() == list(range(1, len(mine) + 1))
            assert list(zip(g["token_id"], g["count"])) == [(tok, -c) for c, tok in mine]
            np.testing.assert_allclose(g["share"], [-c / total[tok] for c, tok in mine], rtol=1e-12)
            # lift = P(e | token) / P(e), among pairs seen at least min_count=2 times
            p_e = chose[e] / len(toks)
            cand = [(-(c / total[tok]) / p_e, -c, tok) for (ee, tok), c in pairs.items() if ee == e and c >= 2]
            best = sorted(cand)[:3]  # lift descending, ties by count descending, then token id
            gl = lift[(lift["layer"] == L.index) & (lift["expert"] == e)]
            assert list(zip(gl["token_id"], gl["count"])) == [(tok, -c) for _, c, tok in best]
            np.testing.assert_allclose(gl["lift"], [-x for x, _, _ in best], rtol=1e-12)
        # shares of a token over experts add up to K
        shares = pd.DataFrame([(e, tok, c / total[tok]) for (e, tok), c in pairs.items()], columns=["e", "tok", "s"])
        np.testing.assert_allclose(shares.groupby("tok")["s"].sum(), L.top_k)


def test_counts_do_not_depend_on_merge_schedule():
    """A huge merge threshold (one merge at the end) and a tiny one (a merge every batch) agree."""
    a = collect("mixtral", merge_min=1)[0].tables(None, top_n=50, min_count=1)
    b = collect("mixtral", merge_min=1 << 30)[0].tables(None, top_n=50, min_count=1)
    dense, layers, _, _ = collect("mixtral", dense=True)  # counted in dense tables: no merge at all
    assert dense.token_totals.dense is not None and all(dense.acc[L.index].pairs.dense is not None for L in layers)
    c = dense.tables(None, top_n=50, min_count=1)
    for name in ("top_tokens.csv", "top_tokens_lift.csv"):
        pd.testing.assert_frame_equal(a[name], b[name])
        pd.testing.assert_frame_equal(a[name], c[name])


def test_sparse_counter_and_ops_primitives():
    gen = torch.Generator().manual_seed(3)
    chunks = [torch.randint(0, 40, (int(s),), generator=gen) for s in torch.randint(1, 30, (12,), generator=gen)]
    c = SparseCounter(merge_min=7)
    for ch in chunks:
        c.add(ch)
    keys, counts = c.result()
    want = Counter(int(k) for ch in chunks for k in ch)
    assert dict(zip(keys.tolist(), counts.tolist())) == want
    assert keys.tolist() == sorted(want)
    assert SparseCounter().result()[0].numel() == 0
    d = SparseCounter(merge_min=7, defer=True)  # merges only when settled (between forwards), same counts
    for ch in chunks:
        before = d.keys
        d.add(ch)
        assert d.keys is before and d._pending_n >= ch.numel()  # add alone never merges
        d.settle()
    assert d.keys is not None and d.result()[0].tolist() == keys.tolist() and d.result()[1].tolist() == counts.tolist()
    # a known key space (-1 = a dropped key, as _masked_keys writes): one dense table, the same result
    dropped = [torch.where(ch % 5 == 0, -1, ch) for ch in chunks]
    sparse, dense = SparseCounter(merge_min=7), SparseCounter(space=40)
    for ch in dropped:
        sparse.add(ch)
        dense.add(ch)
        dense.settle()
    assert dense.dense is not None and dense.keys is None and sparse.dense is None
    assert dense.result()[0].tolist() == sparse.result()[0].tolist() and -1 in dense.result()[0].tolist()
    assert dense.result()[1].tolist() == sparse.result()[1].tolist()
    assert SparseCounter(space=40).result()[0].numel() == 0
    assert SparseCounter(space=DENSE_KEYS + 1).space is None  # too large a space: sparse
    assert dense_space(DENSE_KEYS, 1) == DENSE_KEYS and dense_space(DENSE_KEYS + 1, 1) is None
    assert dense_space(1000, DENSE_TOTAL // 1000) == 1000 and dense_space(1000, DENSE_TOTAL // 1000 + 1) is None
    with pytest.raises(IndexError):  # a key outside the space is an error, never a miscount
        SparseCounter(space=40).add(torch.tensor([40]))
    idx = torch.tensor([[2, 0], [1, 3]])
    assert ops.multi_hot(idx, 4).tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]


def test_forward_without_begin_batch_is_an_error():
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    stats = RoutingStats(layers)
    with pytest.raises(MoetoolError, match="begin_batch"), torch.no_grad(), Engine(model, layers, consumers=[stats]):
        model(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.slow
def test_stats_writer_writes_every_file_with_exact_columns(tmp_path):
    from moetool.report import RunDir
    from moetool.report.writers import write

    model = build_tiny_model("mixtral")
    batches = make_batches()[:1]
    tokens = TokenSet(batches[0].input_ids, batches[0].attention_mask, batches[0].domains, "test")
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    run = RunDir.create("stats", tmp_path / "run")
    frames = stats(lm, tokens, StatsOptions(min_count=3), top_tokens=2, min_count=1, quiet=True)
    assert frames.options == StatsOptions(top_tokens=2, min_count=1)
    write(frames, run)
    for name, cols in COLUMNS.items():
        assert list(pd.read_csv(tmp_path / "run" / name, keep_default_na=False).columns) == cols
        assert name in frames
    for fig in ("load_heatmap", "coactivation", "domain_load", "specialization", "cross_layer"):
        assert (tmp_path / "run" / "figures" / f"{fig}.png").is_file()
    assert "definitions" in run.sections and run.sections["data"]["tokens"] == int(tokens.n_tokens)
    man = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert man["options"] == {"top_tokens": 2, "min_count": 1, "batch_size": 8, "top_k": None,
                              "coactivation": "all", "all_tokens": False, "specialization": True, "bootstrap": 1000,
                              "seed": 0, "layers": None}
    assert man["bootstrap"]["replicates"] == 1000 and man["bootstrap"]["rows"] == 3
    lay = frames["layers"]
    assert ((lay.max_load_ratio_lo <= lay.max_load_ratio) & (lay.max_load_ratio <= lay.max_load_ratio_hi)).all()
    assert (tmp_path / "run" / "figures" / "balance_by_layer.png").is_file()
    assert "specialization" in man["definitions"]


def _stats_on_batches(**options):
    model = build_tiny_model("mixtral")
    batches = make_batches()
    tokens = TokenSet(torch.cat([b.input_ids for b in batches[:1]]), torch.cat([b.attention_mask for b in batches[:1]]),
                      batches[0].domains, "test")
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    res = stats(lm, tokens, quiet=True, batch_size=2, **options)
    rec = []
    with torch.no_grad(), Engine(model, lm.layers, consumers=[lambda ev: rec.append(
            (ev.layer.index, ev.idx.clone(), ev.probs.clone(), ev.valid.clone()))]):
        for b in tokens.batches(2):
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    return res, lm.layers, list(tokens.batches(2)), rec


def test_top1_variant_counts_the_first_ranked_expert_only():
    res, layers, batches, rec = _stats_on_batches(top_k=1, min_count=1, top_tokens=50)
    load, lay = res["load"], res["layers"]
    assert (lay["top_k"] == 1).all()
    # one expert per token: no pair can co-activate, so no coactivation table (a table of zeros before), said why
    assert "coactivation.csv" not in res.tables and "coactivation" not in stats_figures(res)
    assert res.meta["left_out"] == {f"coactivation.csv rows of layers {[L.index for L in layers]}": ONE_EXPERT}
    assert any("left out: coactivation.csv" in line for line in summary_lines("tiny", res))
    for L in layers:
        toks = reference_tokens(batches, rec, L.index)
        hand = Counter(top[0] for _, _, top, _ in toks)
        g = load[load["layer"] == L.index]
        assert g["tokens"].tolist() == [hand[e] for e in range(L.n_experts)]
        np.testing.assert_allclose(g["load_fraction"], g["token_fraction"], rtol=1e-12)
        top = res["top_tokens"]
        pairs = Counter((top_[0], tok) for tok, _, top_, _ in toks)
        for r in top[top["layer"] == L.index].itertuples():
            assert r.count == pairs[r.expert, r.token_id]
        # first-ranked = highest router probability
        assert all(int(np.argmax(p)) == t[0] for _, _, t, p in toks)
    np.testing.assert_allclose(res["cross_layer"].groupby(["layer", "a"])["p_b_given_a"].sum(min_count=1).dropna(), 1.0)


@pytest.mark.slow
def test_coactivation_adjacent_equals_all_for_k2_and_all_tokens_are_complete(tmp_path, no_figures):
    # the written expert_tokens.parquet is checked, no figure (stats' figures: test_stats_writer_writes_every_file...)
    from moetool.report import RunDir
    from moetool.report.writers import write

    a, layers, batches, rec = _stats_on_batches(coactivation="adjacent", all_tokens=True, top_tokens=0)
    b, *_ = _stats_on_batches()
    pd.testing.assert_frame_equal(a["coactivation"], b["coactivation"])  # K = 2: the only pair is adjacent
    assert "top_tokens.csv" not in a and "specialized_tokens.csv" not in a
    run = RunDir.create("stats", tmp_path / "run")
    write(a, run)
    full = pd.read_parquet(tmp_path / "run" / "expert_tokens.parquet")
    assert list(full.columns) == ["layer", "expert", "token_id", "count"]
    for L in layers:
        hand = Counter((e, tok) for tok, _, top, _ in reference_tokens(batches, rec, L.index) for e in top)
        g = full[full["layer"] == L.index]
        assert dict(zip(zip(g["expert"], g["token_id"]), g["count"])) == hand


def test_stats_options_are_checked():
    with pytest.raises(MoetoolError, match="unknown option"):
        stats(None, None, top_token=3)
    with pytest.raises(MoetoolError, match="min-count"):
        StatsOptions(min_count=0)
    with pytest.raises(MoetoolError, match="top-k"):
        StatsOptions(top_k=2)
    with pytest.raises(MoetoolError, match="coactivation"):
        StatsOptions(coactivation="neighbours")


def _cli(*args):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    return CliRunner().invoke(app, ["stats", *args])


def test_cli_empty_data_is_one_line_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "   "}\n')
    res = _cli("--data", str(empty), "--out", str(tmp_path / "out"), "-q")
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "no text" in lines[0]


@pytest.mark.slow
def test_cli_on_embedded_tiny(tmp_path):
    out = tmp_path / "out"
    res = _cli("--model", "tiny", "--max-tokens", "1024", "--seq-len", "64", "--top-tokens", "3",
               "--min-count", "2", "--out", str(out), "-q")
    assert res.exit_code == 0, res.output
    frames = {name: pd.read_csv(out / name, keep_default_na=False) for name in COLUMNS}
    for name, cols in COLUMNS.items():
        assert list(frames[name].columns) == cols, name
    lay, load = frames["layers.csv"], frames["load.csv"]
    assert (lay["tokens"] == 1024).all()
    np.testing.assert_allclose(load.groupby("layer")["load_fraction"].sum(), 1.0)
    np.testing.assert_allclose(load.groupby("layer")["token_fraction"].sum(), lay.set_index("layer")["top_k"])
    n = int(lay["n_experts"].iloc[0])
    assert len(frames["coactivation.csv"]) == len(lay) * n * (n - 1)
    assert (out / "manifest.json").is_file() and (out / "figures" / "load_heatmap.png").is_file()
    man = json.loads((out / "manifest.json").read_text())
    assert man["data"]["special_tokens"]["add_special_tokens"] == "tokenizer default"  # the tokenizer's own default


@pytest.mark.slow
def test_cli_variants_on_embedded_tiny(tmp_path):
    """--top-k 1 --coactivation adjacent --all-tokens --no-special-tokens: K = 1 everywhere, the full pair table
    holds every real token once per layer, the manifest records the tokenization."""
    out = tmp_path / "out"
    res = _cli("--model", "tiny", "--max-tokens", "512", "--seq-len", "64", "--top-k", "1", "--coactivation",
               "adjacent", "--all-tokens", "--no-special-tokens", "--out", str(out), "-q")
    assert res.exit_code == 0, res.output
    lay = pd.read_csv(out / "layers.csv")
    assert (lay["top_k"] == 1).all() and (lay["tokens"] == 512).all()
    full = pd.read_parquet(out / "expert_tokens.parquet")
    assert full.groupby("layer")["count"].sum().tolist() == [512] * len(lay)
    man = json.loads((out / "manifest.json").read_text())
    assert man["options"]["top_k"] == 1 and man["options"]["coactivation"] == "adjacent"
    assert man["options"]["special_tokens"] == "none"
    assert man["data"]["special_tokens"]["add_special_tokens"] is False
    assert (out / "figures" / "specialization.png").is_file() and (out / "figures" / "cross_layer.png").is_file()
    assert not (out / "coactivation.csv").exists() and not (out / "figures" / "coactivation.png").exists()
    assert "coactivation.csv rows of layers" in " ".join(man["left_out"])
    bad = _cli("--model", "tiny", "--coactivation", "neighbours", "--out", str(tmp_path / "bad"), "-q")
    assert bad.exit_code == 2 and "coactivation" in bad.output


def test_bootstrap_columns_equal_independent_intervals_from_hand_row_counts():
    """Per packed row: expert counts, real tokens and Σ entropy(pi) by hand from the captured events; every
    *_lo/*_hi column equals uncertainty's interval computed from them (same seed = same row weights)."""
    from moetool.uncertainty import ratio_intervals, sum_intervals

    model = build_tiny_model("mixtral")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 40, (5, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[4, 3:] = 0, 0
    tokens = TokenSet(ids, mask, [""] * 5, "test")
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    res = stats(lm, tokens, quiet=True, batch_size=2, bootstrap=300, seed=3, specialization=False, top_tokens=0)
    rec = []
    with torch.no_grad(), Engine(model, lm.layers, consumers=[lambda ev: rec.append(
            (ev.layer.index, ev.idx.clone(), ev.probs.clone(), ev.valid.clone()))]):
        for b in tokens.batches(2):
            model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    S, n = ids.shape[1], lm.layers[0].n_experts
    load, lay = res["load"], res["layers"].set_index("layer")
    kw = dict(n_boot=300, seed=3)
    for L in lm.layers:
        counts, toks, conf = np.zeros((5, n)), np.zeros(5), np.zeros(5)
        for b, (_, idx, probs, valid) in enumerate(r for r in rec if r[0] == L.index):
            for t in range(idx.shape[0]):
                if valid[t]:
                    row = 2 * b + t // S
                    toks[row] += 1
                    conf[row] += scipy_entropy(probs[t].double().numpy())
                    for e in idx[t].tolist():
                        counts[row, e] += 1
        g = load[load.layer == L.index]
        lf = ratio_intervals(counts, counts.sum(1), **kw)
        tf = ratio_intervals(counts, toks, **kw)
        np.testing.assert_allclose(g.load_fraction, [i.value for i in lf], rtol=1e-12)
        np.testing.assert_allclose(g.load_fraction_lo, [i.lo for i in lf], rtol=1e-12)
        np.testing.assert_allclose(g.token_fraction_hi, [i.hi for i in tf], rtol=1e-12)
        assert (g.load_fraction_lo <= g.load_fraction).all() and (g.load_fraction <= g.load_fraction_hi).all()

        def stat(s):
            frac = s / s.sum(-1, keepdims=True)
            return np.stack([scipy_entropy(frac, axis=-1) / math.log(n), frac.max(-1) * n], -1)

        ent, mx = sum_intervals(counts, stat, method="bca", **kw)  # biased statistics: BCa (issue 21.1)
        c = ratio_intervals(conf, toks, **kw)[0]
        r = lay.loc[L.index]
        assert (r.max_load_ratio_lo, r.max_load_ratio_hi) == pytest.approx((mx.lo, mx.hi), rel=1e-12)
        assert (r.load_entropy_norm_lo, r.load_entropy_norm_hi) == pytest.approx((ent.lo, ent.hi), rel=1e-6)
        assert (r.confidence_entropy_norm_lo * math.log(n), r.confidence_entropy_norm_hi * math.log(n)) == \
            pytest.approx((c.lo, c.hi), rel=1e-5)
        for col in ("max_load_ratio", "load_entropy_norm", "confidence_entropy_norm"):
            assert r[f"{col}_lo"] <= r[col] <= r[f"{col}_hi"] and r[f"{col}_lo"] < r[f"{col}_hi"]
    off = stats(lm, tokens, quiet=True, batch_size=2, bootstrap=0, specialization=False, top_tokens=0)
    assert off["load"].load_fraction.tolist() == load.load_fraction.tolist()
    assert off["layers"].max_load_ratio_lo.isna().all() and off["load"].token_fraction_hi.isna().all()


def test_layers_keep_exactly_the_asked_layers_rows():
    """--layers (issue 32 item 2): the tables of a run over some MoE layers are the full run's rows of those layers
    (the router is not touched, only fewer layers are hooked); cross-layer pairs only where both layers are
    consecutive MoE layers of the model, and none with two layers that are not."""
    import moetool

    lm = moetool.load("tiny", device="cpu")
    ts = moetool.tokens(lm, None, seq_len=32, max_tokens=512)
    full = stats(lm, ts, bootstrap=0)
    moe = [L.index for L in lm.layers]
    assert len(moe) >= 3
    some = stats(lm, ts, bootstrap=0, layers=(moe[1], moe[2]))
    for name in ("load.csv", "layers.csv", "coactivation.csv", "specialization.csv", "cross_layer.csv"):
        want = full[name]
        want = want[want["layer"].isin([moe[1], moe[2]])]
        if name == "cross_layer.csv":
            want = want[want["next_layer"] == moe[2]]
        if name == "layers.csv":  # the layers' own figures; the pooled aux loss is over the layers measured
            want, got = want.drop(columns="aux_loss_hf_pooled"), some[name].drop(columns="aux_loss_hf_pooled")
        else:
            got = some[name]
        pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True), check_exact=True)
    apart = stats(lm, ts, bootstrap=0, layers=(moe[0], moe[2]))
    assert sorted(apart["layers.csv"]["layer"]) == [moe[0], moe[2]] and "cross_layer.csv" not in apart
    # the pooled aux loss of the two layers, by hand from the full run's per-expert f and P (equal token counts per
    # layer: the pool's means are the means of the layers'), and a definition that says whose pool it is
    load = full["load.csv"].set_index(["layer", "expert"])
    f = np.mean([load.loc[li, "token_fraction"].to_numpy() for li in (moe[1], moe[2])], 0)
    P = np.mean([load.loc[li, "router_prob"].to_numpy() for li in (moe[1], moe[2])], 0)
    assert np.allclose(some["layers.csv"]["aux_loss_hf_pooled"], len(f) * (f * P).sum(), rtol=1e-12)
    pooled_all = full["layers.csv"]["aux_loss_hf_pooled"].iloc[0]  # the model's (every MoE layer): another number
    assert not np.isclose(some["layers.csv"]["aux_loss_hf_pooled"].iloc[0], pooled_all)
    assert "measured MoE layers" in some.definitions["aux_loss_hf_pooled"]


def test_load_and_layers_against_plain_hooks_in_float64():
    """load.csv and layers.csv of the embedded tiny model against a reference that shares nothing with moetool's
    engine: each layer's router logits and top-K from a plain forward hook on transformers' own router
    (``mlp.gate``), every statistic in float64 numpy from its definition (load_entropy is the entropy of exact
    counts: no float32 rounding, which cost it ~1e-7), the pooled aux loss also as transformers'
    load_balancing_loss_func on the same logits and mask (one forward of every row, as the function sees it)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    import moetool

    lm = moetool.load("tiny", device="cpu")
    ts = moetool.tokens(lm, None, seq_len=32, max_tokens=512)
    ids, mask = ts.input_ids.clone(), ts.attention_mask.clone()
    for r, p in ((1, 7), (4, 12), (9, 3)):  # right padding with a real token id: counting padding would show
        ids[r, -p:], mask[r, -p:] = ids[0, 3], 0
    ts = TokenSet(ids, mask, list(ts.domains), "test")
    res = stats(lm, ts, quiet=True, bootstrap=0, batch_size=ids.shape[0], specialization=False, top_tokens=0)
    seen = {}
    hooks = [dl.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, (out[0].detach(), out[2])))
             for i, dl in enumerate(lm.model.model.layers)]
    try:
        with torch.no_grad():
            lm.model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    keep = mask.reshape(-1).bool().numpy()
    load, lay = res["load"], res["layers"].set_index("layer")
    assert sorted(seen) == sorted(lay.index)
    f_all, p_all = 0.0, 0.0
    for i, (logits, top) in sorted(seen.items()):
        lg, top = logits.double().numpy()[keep], top.numpy()[keep]
        T, n, K = lg.shape[0], lg.shape[1], top.shape[1]
        pi = np.exp(lg - lg.max(-1, keepdims=True))
        pi /= pi.sum(-1, keepdims=True)
        count = np.bincount(top.reshape(-1), minlength=n).astype(np.float64)
        frac = count / (K * T)
        g = load[load.layer == i]
        np.testing.assert_array_equal(g["tokens"], count)
        np.testing.assert_allclose(g["load_fraction"], frac, rtol=1e-15)
        np.testing.assert_allclose(g["token_fraction"], count / T, rtol=1e-15)
        np.testing.assert_allclose(g["router_prob"], pi.mean(0), rtol=1e-6)  # the model's float32 softmax
        row = lay.loc[i]
        ent = -(frac[frac > 0] * np.log(frac[frac > 0])).sum()
        assert (row.tokens, row.n_experts, row.top_k) == (T, n, K)
        assert row.load_entropy == pytest.approx(ent, rel=1e-12)
        assert row.load_entropy_norm == pytest.approx(ent / np.log(n), rel=1e-12)
        conf = -(pi * np.log(pi)).sum(-1).mean()
        assert row.confidence_entropy == pytest.approx(conf, rel=1e-7)
        assert row.confidence_entropy_norm == pytest.approx(conf / np.log(n), rel=1e-7)
        assert row.max_load_ratio == pytest.approx(frac.max() * n, rel=1e-15)
        assert row.aux_loss == pytest.approx(n * (count / T * pi.mean(0)).sum(), rel=1e-6)
        f_all, p_all = f_all + count, p_all + pi.sum(0)
    pooled = n * ((f_all / (T * len(seen))) * (p_all / (T * len(seen)))).sum()
    np.testing.assert_allclose(lay["aux_loss_hf_pooled"], pooled, rtol=1e-6)
    hf = float(load_balancing_loss_func(tuple(seen[i][0] for i in sorted(seen)), n, K, mask))
    assert pooled == pytest.approx(hf, rel=1e-6)


def test_first_ranked_expert_of_an_unsorted_router_against_plain_hooks():
    """LongCat-Flash (identity experts, a correction bias, ``topk(sorted=False)`` as DeepSeek-V3, GLM-4.5 and others):
    its router returns the top-K unsorted (on CPU the largest is never first at K = 4), so the first-ranked expert
    is the chosen one with the largest selection score (softmax + correction bias), the order ``topk(sorted=True)``
    gives. Against plain forward hooks on transformers' own router, ranked here: the specialisation views,
    --top-k 1 (load, cross-layer), --coactivation adjacent (neighbouring ranks), zero_compute_fraction (identity
    experts = the last ids), and the trace's expert_1..K (largest first, what stats --trace --top-k 1 reads)."""
    from itertools import pairwise

    from conftest import longcat_unsorted_router_model, router_outputs
    from moetool.experiments.trace.compute import trace

    model, routers, ids = longcat_unsorted_router_model(6, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, -6:], mask[5, -3:] = 0, 0
    seen = router_outputs(model, routers, ids, mask)
    keep = mask.reshape(-1).bool()
    tokens = TokenSet(ids, mask, [""] * 6, "test")
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    kw = dict(quiet=True, bootstrap=0, batch_size=6, top_tokens=0, min_count=2)
    adj, top1 = stats(lm, tokens, coactivation="adjacent", **kw), stats(lm, tokens, top_k=1, **kw)
    tr = trace(lm, tokens, quiet=True)["trace"]
    n, K, ranked = 16, 4, {}
    for i, r in enumerate(routers):
        logits, _, idx = seen[i]
        sel = torch.softmax(logits.float(), -1) + r.e_score_correction_bias
        order = torch.sort(sel.gather(1, idx), dim=-1, descending=True, stable=True).indices
        ranked[i] = idx.gather(1, order)[keep].numpy()
        assert (ranked[i][:, 0] != idx[keep][:, 0].numpy()).any()  # the router's order is not the rank order
    for i, rk in ranked.items():
        first = rk[:, 0]
        row = adj["layers"].set_index("layer").loc[i]
        assert row.zero_compute_fraction == pytest.approx(float((rk >= n - 4).mean()), abs=1e-15)
        co = adj["coactivation"]
        co = co[co.layer == i].set_index(["a", "b"])["count"]
        hand = Counter((a, b) for t in rk.tolist() for x, y in pairwise(t) for a, b in ((x, y), (y, x)))
        assert {k: v for k, v in co.items() if v} == hand, i
        assert top1["load"][top1["load"].layer == i]["tokens"].tolist() == np.bincount(first, minlength=n).tolist()
        sp = adj["specialization"].set_index(["layer", "view"]).loc[(i, "input")]
        by_token = defaultdict(Counter)
        for tid, e in zip(ids.reshape(-1)[keep].tolist(), first.tolist()):
            by_token[tid][e] += 1
        share = [max(c.values()) / sum(c.values()) for c in by_token.values()]
        assert sp.specialization_all_ids == pytest.approx(np.mean(share), abs=1e-12)
        got = tr[tr.layer == i].sort_values(["row", "pos"])[[f"expert_{k + 1}" for k in range(K)]].to_numpy()
        np.testing.assert_array_equal(got, rk)
    cl = top1["cross_layer"]
    for a, b in pairwise(sorted(ranked)):
        hand = np.zeros((n, n), dtype=np.int64)
        np.add.at(hand, (ranked[a][:, 0], ranked[b][:, 0]), 1)
        got = cl[(cl.layer == a) & (cl.next_layer == b)].sort_values(["a", "b"])["count"].to_numpy()
        np.testing.assert_array_equal(got, hand.reshape(-1))
