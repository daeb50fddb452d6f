"""Expert similarity (``moetool expert-similarity``) against a hand computation from the raw parameters of the
embedded tiny model: each MoE layer's input and top-K captured with plain forward hooks on the model's own router,
every expert's output from the fused 3-D expert weights in float64, and the three matrices (cosine of mean outputs,
mean per-token cosine, Jaccard of the routed token sets) computed pair by pair; padding left out."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import feed
from test_host_sync import detect

from moetool.errors import MoetoolError, MoetoolRuntimeError

PAD = {1: 5, 3: 2}  # row -> left-padded positions (the second and fourth rows)


@pytest.fixture(scope="module")
def tiny():
    from moetool.data import load_tokens
    from moetool.loading import load

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 24, 96)  # 4 rows of 24
    mask = ts.attention_mask.clone()
    for row, n in PAD.items():
        mask[row, :n] = 0
    return lm, replace(ts, attention_mask=mask)


def _blocks(model) -> dict[int, torch.nn.Module]:
    """The model's sparse MoE blocks by decoder index, found by class name (not through moetool's adapters)."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "MixtralSparseMoeBlock":
            out[int(re.search(r"layers\.(\d+)\.", name + ".").group(1))] = m
    return out


def router_io(lm, ts) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE block, ``(router input, the model's top-K)`` of one plain forward of all rows (the router's input is
    the experts' input; its output holds the model's top-K)."""
    seen, handles = {}, []
    for i, blk in _blocks(lm.model).items():
        handles.append(blk.gate.register_forward_hook(
            lambda m, args, out, i=i: seen.__setitem__(i, (args[0].detach().clone(), out[2].detach().clone()))))
    try:
        with torch.no_grad():
            feed(lm.model, ts.input_ids, ts.attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def hand_matrices(lm, ts) -> dict[int, dict[str, np.ndarray]]:
    """Per MoE layer, the three [n, n] matrices from one plain forward of all rows (float64, loops over pairs)."""
    blocks = _blocks(lm.model)
    seen = router_io(lm, ts)
    valid = ts.attention_mask.reshape(-1).bool()
    real = torch.nonzero(valid).flatten().tolist()
    out = {}
    for i, blk in blocks.items():
        h, top = seen[i]
        h = h.reshape(-1, h.shape[-1]).double()
        ex = blk.experts
        n = ex.gate_up_proj.shape[0]
        E = []
        for e in range(n):  # gate_up_proj [n, 2I, d] (gate first), down_proj [n, d, I], SiLU
            gate, up = F.linear(h, ex.gate_up_proj[e].detach().double()).chunk(2, dim=-1)
            E.append(F.linear(F.silu(gate) * up, ex.down_proj[e].detach().double()))
        E = torch.stack(E)[:, real]  # [n, T_real, d]
        mean = E.mean(1)
        routed = [{t for t in real if e in top[t].tolist()} for e in range(n)]
        oc, tc, co = (np.full((n, n), np.nan) for _ in range(3))
        for a in range(n):
            for b in range(n):
                oc[a, b] = float(F.cosine_similarity(mean[a], mean[b], dim=0))
                tc[a, b] = float(F.cosine_similarity(E[a], E[b], dim=-1).mean())
                union = routed[a] | routed[b]
                co[a, b] = len(routed[a] & routed[b]) / len(union) if union else math.nan
        od = torch.cdist(mean, mean).cpu().numpy()  # Euclidean distance of the mean outputs (HC-SMoE's)
        out[i] = {"output_dist": od, "output_cos": oc, "token_cos": tc, "co_selection": co, "tokens": len(real)}
    return out


@pytest.fixture(scope="module")
def run(tiny):
    from moetool.experiments.expert_similarity.compute import expert_similarity

    lm, ts = tiny
    return expert_similarity(lm, ts, batch_size=3, quiet=True)  # two batches: the sums carry over


def test_every_pair_against_the_hand_computation(tiny, run):
    lm, ts = tiny
    hand = hand_matrices(lm, ts)
    pairs = run["expert_similarity_pairs"]
    assert sorted(set(pairs.layer)) == sorted(hand) == [0, 1, 2, 3]
    for layer, m in hand.items():
        p = pairs[pairs.layer == layer]
        n = m["output_cos"].shape[0]
        assert len(p) == n * (n - 1) // 2 and (p.i < p.j).all()
        for col in ("output_dist", "output_cos", "token_cos", "co_selection"):
            want = m[col][p.i.to_numpy(), p.j.to_numpy()]
            np.testing.assert_allclose(p[col].to_numpy(), want, atol=1e-5, rtol=0, err_msg=f"layer {layer} {col}")
        # the experts really differ: a sum over the wrong tokens or a mean instead of a cosine would show
        assert np.ptp(p.token_cos) > 0.05 and np.ptp(p.co_selection) > 0.05
    per_layer = run["expert_similarity"].set_index("layer")
    assert run.summary is not None and list(run.summary.layer) == [0, 1, 2, 3]
    for layer, m in hand.items():
        row = per_layer.loc[layer]
        i, j = np.triu_indices(m["output_cos"].shape[0], k=1)
        assert row.tokens == m["tokens"] == ts.n_tokens == 96 - sum(PAD.values())
        assert row.n_experts == 8
        for col, short in (("output_cos", "output_cos"), ("token_cos", "token_cos"), ("co_selection", "co_selection")):
            v = m[col][i, j]
            assert row[f"mean_{short}"] == pytest.approx(v.mean(), abs=1e-5)
            assert row[f"max_{short}"] == pytest.approx(v.max(), abs=1e-5)
        for col, pair in (("output_cos", "max_output_pair"), ("token_cos", "max_token_pair")):
            k = int(np.argmax(m[col][i, j]))
            assert row[pair] == f"{i[k]}-{j[k]}"
        k = int(np.argmin(m["output_dist"][i, j]))
        assert row.min_dist_pair == f"{i[k]}-{j[k]}"
        assert row.min_output_dist == pytest.approx(m["output_dist"][i, j].min(), rel=1e-5)


def test_an_expert_with_tiny_outputs_keeps_its_cosines(tiny):
    """Expert 2's weights x 1e-8 in every layer: its outputs are ~1e-23 (non-zero, normal fp32), cosines with the
    others are those of a hand computation in fp64 (a / ||a|| . b / ||b||, no eps). The fp32 norms of the outputs
    underflowed to 0: the expert counted as zero on every token, its token_cos NaN for all 7 pairs of each layer."""
    from moetool.experiments.expert_similarity.compute import expert_similarity
    from moetool.loading import load

    _, ts = tiny
    lm = load("tiny")
    with torch.no_grad():
        for blk in _blocks(lm.model).values():
            blk.experts.gate_up_proj[2].mul_(1e-8)
            blk.experts.down_proj[2].mul_(1e-8)
    seen = {i: h for i, (h, _) in router_io(lm, ts).items()}
    pairs = expert_similarity(lm, ts, batch_size=3, quiet=True)["expert_similarity_pairs"]
    real = ts.attention_mask.reshape(-1).bool()
    for i, blk in _blocks(lm.model).items():
        h = seen[i].reshape(-1, seen[i].shape[-1])[real].double()
        ex = blk.experts
        E = []
        for e in range(8):
            gate, up = F.linear(h, ex.gate_up_proj[e].detach().double()).chunk(2, dim=-1)
            E.append(F.linear(F.silu(gate) * up, ex.down_proj[e].detach().double()))
        U = torch.stack(E) / torch.stack(E).norm(dim=-1, keepdim=True)  # [n, T, d] unit outputs
        assert 0 < torch.stack(E)[2].abs().max() < 1e-19  # tiny, not zero
        p = pairs[(pairs.layer == i) & ((pairs.i == 2) | (pairs.j == 2))]
        assert len(p) == 7
        want = [float((U[a] * U[b]).sum(-1).mean()) for a, b in zip(p.i, p.j)]
        np.testing.assert_allclose(p.token_cos.to_numpy(), want, atol=1e-5, rtol=0)


def test_batch_size_and_token_chunks_do_not_change_the_sums(tiny, run):
    """One row per batch with one token per probe chunk gives the same matrices as the run's batches of three."""
    from moetool.engine.runner import forward
    from moetool.experiments.expert_similarity.compute import SimilaritySums, tables

    lm, ts = tiny
    sums = SimilaritySums([L.index for L in lm.layers], budget=1)  # one token per chunk
    forward(lm, ts, consumers=[sums], batch_size=1, quiet=True)
    pairs = tables(sums.matrices(), {L.index: L.n_experts for L in lm.layers})["expert_similarity_pairs.csv"]
    want = run["expert_similarity_pairs"]
    for col in ("output_dist", "output_cos", "token_cos", "co_selection"):
        np.testing.assert_allclose(pairs[col], want[col], atol=1e-6, rtol=0)


def test_layers_option_and_nan_on_padding_left_out(tiny, run):
    """``layers`` keeps those layers' rows, with the same numbers; NaN put into the padded positions of the last
    MoE layer's input (after it nothing mixes positions) changes nothing: padding is masked, not multiplied by 0."""
    from moetool.experiments.expert_similarity.compute import expert_similarity

    lm, ts = tiny
    blk = _blocks(lm.model)[3]
    pad = ~ts.attention_mask.bool()

    def poison(module, args):
        x = args[0].clone()
        x[pad] = float("nan")
        return (x,)

    handle = blk.register_forward_pre_hook(poison)
    try:
        res = expert_similarity(lm, ts, layers=(3,), batch_size=len(ts.input_ids), quiet=True)
    finally:
        handle.remove()
    got = res["expert_similarity_pairs"]
    want = run["expert_similarity_pairs"]
    want = want[want.layer == 3].reset_index(drop=True)
    assert list(res["expert_similarity"].layer) == [3] and len(got) == 28
    for col in ("output_cos", "token_cos", "co_selection"):
        np.testing.assert_allclose(got[col], want[col], atol=1e-6, rtol=0)
    assert np.isfinite(got[["output_cos", "token_cos", "co_selection"]].to_numpy()).all()


def test_bad_options_are_one_line(tiny):
    from moetool.experiments.expert_similarity.compute import ExpertSimilarityOptions, expert_similarity

    lm, ts = tiny
    for bad, flag in (({"batch_size": 0}, "^batch_size= "), ({"batch_size": 2.5}, "^batch_size= "),  # Python: keywords
                      ({"layers": (-1,)}, "^layers= "), ({"layers": "0"}, "^layers= "), ({"layers": (0.5,)}, "^layers= "),
                      ({"seed": "x"}, "--seed"), ({"batch_size": True}, "^batch_size= ")):
        with pytest.raises(MoetoolError, match=flag) as e:
            ExpertSimilarityOptions(**bad)
        assert "\n" not in str(e.value)
    with pytest.raises(MoetoolError, match="^batch_size= "):
        expert_similarity(lm, ts, batch_size=0, quiet=True)
    with pytest.raises(MoetoolError, match="unknown option"):
        expert_similarity(lm, ts, percentile=3, quiet=True)
    with pytest.raises(MoetoolError, match="not MoE layers"):
        expert_similarity(lm, ts, layers=(9,), quiet=True)


def test_no_real_token_and_non_finite_sums_are_refused(tiny):
    from moetool.engine.runner import forward
    from moetool.experiments.expert_similarity.compute import SimilaritySums, expert_similarity

    lm, ts = tiny
    with pytest.raises(MoetoolError, match="no real tokens"):
        expert_similarity(lm, replace(ts, attention_mask=torch.zeros_like(ts.attention_mask)), quiet=True)
    one = replace(ts, input_ids=ts.input_ids[:1], attention_mask=ts.attention_mask[:1], domains=ts.domains[:1])
    sums = SimilaritySums([2])  # the consumer itself fed only padding (the command refuses it before): one line
    forward(lm, replace(one, attention_mask=torch.zeros_like(one.attention_mask)), consumers=[sums],
            moe_layers=[L for L in lm.layers if L.index == 2], quiet=True)
    with pytest.raises(MoetoolError, match="layer 2: no real tokens"):  # not NaN means (0 / 0 tokens)
        sums.matrices()
    sums = SimilaritySums([2])
    forward(lm, one, consumers=[sums], moe_layers=[L for L in lm.layers if L.index == 2], quiet=True)
    sums.acc[2]["out"][5, 0] = float("inf")  # an expert that overflowed on some token (not one routed to it)
    with pytest.raises(MoetoolRuntimeError, match="layer 2: an expert output is NaN or inf") as e:
        sums.matrices()
    assert "\n" not in str(e.value)


def test_inf_in_an_expert_stops_the_run_with_one_line(tiny):
    from moetool.experiments.expert_similarity.compute import expert_similarity

    lm, ts = tiny
    w = _blocks(lm.model)[1].experts.down_proj
    saved = w[4].clone()
    with torch.no_grad():
        w[4] = float("inf")
    try:
        with pytest.raises(MoetoolRuntimeError) as e:
            expert_similarity(lm, ts, quiet=True)
    finally:
        with torch.no_grad():
            w[4] = saved
    assert "\n" not in str(e.value) and "layer 1" in str(e.value)


def test_no_host_sync_inside_the_forward(tiny):
    from moetool.experiments.expert_similarity.compute import expert_similarity

    lm, ts = tiny
    with detect(lm.model) as det:
        expert_similarity(lm, ts, quiet=True)
    assert not det.hits, sorted(det.hits)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine along the last dim, NaN where either vector is 0 (undefined), float64."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    return torch.where((na > 0) & (nb > 0), (a * b).sum(-1) / (na * nb), torch.tensor(float("nan"), dtype=torch.float64))


@pytest.mark.parametrize("model_type", ["longcat_flash", "zaya"])  # identity experts (output = input); a skip class
def test_zero_computation_experts_are_not_compared(model_type):
    """Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip, the last indices) have no weights to
    compare or merge: the matrices are over the m computed experts, each one's output through the model's own experts
    module (all tokens sent to it with weight 1), by hand. brk11: before, they were compared as their output --
    LongCat-Flash's two identity experts (output = input) were every layer's most alike pair (output_cos 1) and
    HC-SMoE's first merge (output_dist 0), Zaya's skip (mean output 0) the first merge of every layer."""
    from conftest import padded_batch
    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.engine import Engine
    from moetool.experiments.expert_similarity.compute import SimilaritySums, tables
    from test_families import one_expert

    model = build_tiny(model_type, seed=0)
    layers = find_moe_layers(model)
    assert all(L.n_zero_compute for L in layers)
    sums = SimilaritySums([L.index for L in layers])
    events = {}
    with torch.no_grad(), Engine(model, layers, consumers=[sums, lambda ev: events.__setitem__(ev.layer.index, ev)]):
        model(**padded_batch(seq=8))
    mats = sums.matrices()
    out = tables(mats, {L.index: L.n_computed for L in layers})
    per_layer, pairs, merges = out["expert_similarity.csv"], out["expert_similarity_pairs.csv"], \
        out["expert_similarity_merges.csv"]
    for L in layers:
        ev = events[L.index]
        h, valid = ev.h, ev.valid
        n = L.n_experts - L.n_zero_compute
        outs = torch.stack([one_expert(L, e, h) for e in range(n)])[:, valid]  # [n, T_real, d]
        mean = outs.double().mean(1)
        oc = _cos(mean[:, None], mean[None, :]).numpy()
        per_token = _cos(outs[:, None], outs[None, :])  # [n, n, T_real]
        tc = torch.where(per_token.isnan().all(-1), float("nan"), per_token.nan_to_num().sum(-1) /
                         (~per_token.isnan()).sum(-1).clamp_min(1)).numpy()
        routed = [set(torch.nonzero((ev.idx == e).any(-1) & valid).flatten().tolist()) for e in range(n)]
        co = np.array([[len(routed[a] & routed[b]) / len(routed[a] | routed[b]) if routed[a] | routed[b] else np.nan
                        for b in range(n)] for a in range(n)])
        np.testing.assert_allclose(mats[L.index]["output_cos"], oc, atol=1e-5, rtol=0)
        np.testing.assert_allclose(mats[L.index]["token_cos"], tc, atol=1e-5, rtol=0)
        np.testing.assert_allclose(mats[L.index]["co_selection"], co, atol=1e-12, rtol=0)
        dist = torch.cdist(mean, mean).numpy()
        np.testing.assert_allclose(mats[L.index]["output_dist"], dist, atol=1e-5, rtol=1e-5)
        i, j = np.triu_indices(n, k=1)
        row = per_layer.set_index("layer").loc[L.index]
        assert row.n_experts == n
        assert row.mean_output_cos == pytest.approx(np.nanmean(oc[i, j]), abs=1e-5)
        assert row.max_token_cos == pytest.approx(np.nanmax(tc[i, j]), abs=1e-5)
        k = int(np.argmin(dist[i, j]))
        assert row.min_dist_pair == f"{i[k]}-{j[k]}" and row.min_output_dist > 1e-4
        assert len(pairs[pairs.layer == L.index]) == n * (n - 1) // 2
        assert len(merges[merges.layer == L.index]) == n - 1


def test_average_linkage_by_hand():
    """Points on a line, worked by hand: each merge joins the two clusters with the smallest mean distance over
    their pairs of points; ties go to the lowest names; the groups and dominant experts at 3 and 2 clusters."""
    from moetool.experiments.expert_similarity.compute import average_linkage, dominant, groups

    x = np.array([0.0, 1.0, 5.0, 6.5, 20.0])
    d = np.abs(x[:, None] - x[None, :])
    merges = average_linkage(d)
    # (0,1) at 1; (2,3) at 1.5; {0,1}-{2,3}: mean(5, 6.5, 4, 5.5) = 5.25; then 4: mean(20, 19, 15, 13.5) = 16.875
    assert [(a, b, size, left) for a, b, _, size, left in merges] == [(0, 1, 2, 4), (2, 3, 2, 3), (0, 2, 4, 2),
                                                                       (0, 4, 5, 1)]
    np.testing.assert_allclose([m[2] for m in merges], [1.0, 1.5, 5.25, 16.875])
    assert groups(merges, 5, 3).tolist() == [0, 0, 1, 1, 2] and groups(merges, 5, 2).tolist() == [0, 0, 0, 0, 1]
    assert groups(merges, 5, 5).tolist() == [0, 1, 2, 3, 4]
    # dominant: the member closest to its group's mean (ties: the lowest): {0,1} -> 0, {2,3} -> 2, {4} -> 4
    assert dominant(x[:, None], groups(merges, 5, 3)).tolist() == [True, False, True, False, True]
    assert [m[:2] for m in average_linkage(np.abs(np.subtract.outer([0.0, 1, 2], [0.0, 1, 2])))] == [(0, 1), (0, 2)]
    # clusters of unequal sizes: 0, 1, 5, 11 -> (0,1) at 1; {0,1}-2: mean(5, 4) = 4.5; {0,1,2}-3: mean(11, 10, 6) = 9
    # over the 3 pairs (an unweighted mean of the two merged clusters' distances, (10.5 + 6) / 2, gives 8.25)
    y = np.array([0.0, 1.0, 5.0, 11.0])
    merges = average_linkage(np.abs(y[:, None] - y[None, :]))
    assert [(a, b, size, left) for a, b, _, size, left in merges] == [(0, 1, 2, 3), (0, 2, 3, 2), (0, 3, 4, 1)]
    np.testing.assert_allclose([m[2] for m in merges], [1.0, 4.5, 9.0], rtol=1e-15)


def test_cluster_to_more_groups_than_experts_refused(tiny):
    from moetool.experiments.expert_similarity.compute import ExpertSimilarityOptions, expert_similarity

    lm, ts = tiny
    with pytest.raises(MoetoolError, match=r"--cluster-to 9 asks for more groups than MoE layers \[0, 1, 2, 3\]"):
        expert_similarity(lm, ts, cluster_to=9, quiet=True)
    for bad in (0, True, 2.5):
        with pytest.raises(MoetoolError, match="--cluster-to"):
            ExpertSimilarityOptions(cluster_to=bad)


def test_token_cos_averages_over_the_tokens_where_both_outputs_are_non_zero():
    """matrices() from hand sums of 4 real tokens: expert 1's output is 0 on 2 of them, so token_cos(0, 1) is the
    cosine sum over the 2 tokens where both are non-zero / 2 (0.75), not / the 4 tokens (0.375); co_selection is
    |A ∩ B| / (|A| + |B| - |A ∩ B|)."""
    import numpy as np

    from moetool.experiments.expert_similarity.compute import SimilaritySums

    sums = SimilaritySums([0])
    f64 = dict(dtype=torch.float64)
    sums.acc[0] = {"out": torch.tensor([[4.0, 0.0], [0.0, 2.0]], **f64),
                   "cos": torch.tensor([[4.0, 1.5], [1.5, 2.0]], **f64),
                   "both": torch.tensor([[4.0, 2.0], [2.0, 2.0]], **f64),
                   "co": torch.tensor([[3.0, 1.0], [1.0, 2.0]], **f64), "tokens": torch.tensor(4.0, **f64)}
    m = sums.matrices()[0]
    assert m["token_cos"][0, 1] == m["token_cos"][1, 0] == 0.75
    assert m["co_selection"][0, 1] == 1 / (3 + 2 - 1)
    assert m["output_cos"][0, 1] == 0.0 and m["output_dist"][0, 1] == pytest.approx(np.hypot(1.0, 0.5), abs=1e-15)
    assert m["tokens"] == 4


def test_layer_summary_ties_go_to_the_first_pair():
    """The layer row's max/min pairs from hand matrices with tied values: output_cos 0.5 at (0, 1) and (1, 2),
    output_dist 2 at (0, 2) and (1, 2): the first pair in (i, j) order is named (0-1 and 0-2), the means are over the
    defined pairs (token_cos NaN at (0, 2) left out)."""
    import numpy as np

    from moetool.experiments.expert_similarity.compute import tables

    cos = np.array([[1.0, 0.5, 0.2], [0.5, 1.0, 0.5], [0.2, 0.5, 1.0]])
    dist = np.array([[0.0, 3.0, 2.0], [3.0, 0.0, 2.0], [2.0, 2.0, 0.0]])
    tok = np.array([[1.0, 0.4, np.nan], [0.4, 1.0, 0.4], [np.nan, 0.4, 1.0]])
    co = np.array([[1.0, 0.1, 0.3], [0.1, 1.0, 0.3], [0.3, 0.3, 1.0]])
    mats = {0: {"output_dist": dist, "output_cos": cos, "token_cos": tok, "co_selection": co,
                "mean": np.eye(3), "tokens": 5}}
    row = tables(mats, {0: 3})["expert_similarity.csv"].iloc[0]
    assert (row.max_output_pair, row.min_dist_pair, row.max_token_pair) == ("0-1", "0-2", "0-1")
    assert (row.max_output_cos, row.min_output_dist, row.max_token_cos) == (0.5, 2.0, 0.4)
    assert row.mean_output_cos == pytest.approx(1.2 / 3, abs=1e-15)
    assert row.mean_token_cos == pytest.approx(0.4, abs=1e-15) and row.max_co_selection == 0.3
    assert row.mean_co_selection == pytest.approx(0.7 / 3, abs=1e-15)


def test_dominant_expert_of_two_dimensional_mean_outputs():
    """HC-SMoE's dominant expert in more than one dimension: group {0, 1, 2} with mean outputs (0, 0), (3, 0),
    (1, 1) has its centre at (4/3, 1/3), at distances 1.374, 1.667 and 0.745 by hand, so expert 2 is dominant;
    {3} is its own. (A norm over the experts instead of the features picked expert 1 of the group.)"""
    from moetool.experiments.expert_similarity.compute import dominant

    mean = np.array([[0.0, 0.0], [3.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    assert dominant(mean, np.array([0, 0, 0, 1])).tolist() == [False, False, True, True]


def test_the_command_compares_and_groups_the_computed_experts_only():
    """expert_similarity() itself on the tiny LongCat-Flash (m = 8 computed of n = 10 experts per layer): the tables
    are over the 8 (8·7/2 pairs, 7 merges, --cluster-to 8 groups experts 0-7, each its own group), the manifest names
    the layers' 2 zero-computation experts, and --cluster-to 9 -- more groups than computed experts, fewer than n --
    is refused before any forward naming the 8."""
    import moetool
    from conftest import zero_compute_lm

    lm, tokens = zero_compute_lm("longcat_flash", 2, 16, 3, {1: 4}, lambda ev: None)
    assert {(L.n_experts, L.n_computed) for L in lm.layers} == {(10, 8)}
    with pytest.raises(MoetoolError, match=r"computed experts \(8\); use at most that many"):
        moetool.expert_similarity(lm, tokens, cluster_to=9, batch_size=2, quiet=True)
    res = moetool.expert_similarity(lm, tokens, cluster_to=8, batch_size=2, quiet=True)
    per_layer = res["expert_similarity"].set_index("layer")
    assert list(per_layer.index) == [L.index for L in lm.layers] and (per_layer.n_experts == 8).all()
    for L in lm.layers:
        assert len(res["expert_similarity_pairs"].query("layer == @L.index")) == 28
        assert len(res["expert_similarity_merges"].query("layer == @L.index")) == 7
        groups = res["expert_similarity_groups"].query("layer == @L.index")
        assert sorted(groups.expert) == list(range(8)) and groups.group.nunique() == 8
    assert res.meta["zero_computation_experts_not_compared"] == {L.index: 2 for L in lm.layers}
