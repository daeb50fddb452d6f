"""The small routing math of :mod:`moetool.ops` against independent float64 references (numpy, scipy, Python sets
and sorts, closed forms): every experiment's numbers go through these functions, so each is pinned here on its own,
ties, padding ids and edge cases included (a wrong tie rule or a dropped term would otherwise show only where an
experiment's test happens to hit it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from moetool import ops


def _tied_scores(T=40, n=12, seed=0):
    """Scores with many exact ties (small integers): a tie rule shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (T, n), generator=g).float()


def test_stable_topk_is_descending_with_ties_to_the_lowest_index():
    s = _tied_scores()
    for k in (1, 3, 12):
        got = ops.topk(s, k, stable=True)
        want = [sorted(range(s.shape[1]), key=lambda e: (-float(row[e]), e))[:k] for row in s]
        assert got.tolist() == want
        plain = ops.topk(s, k)  # any tie order, but the same multiset of values, largest first
        vals = s.gather(-1, plain)
        assert torch.equal(vals, torch.tensor([[float(row[e]) for e in w] for row, w in zip(s, want)]))


def test_ranks_and_spearman_match_scipy_with_ties():
    s = _tied_scores(T=30, n=9, seed=1).double()
    u = torch.rand(30, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert np.array_equal(ops.ranks(s).numpy(), stats.rankdata(s.numpy(), axis=-1))
    assert np.array_equal(ops.ranks(s, dim=0).numpy(), stats.rankdata(s.numpy(), axis=0))
    got = ops.spearman(s, u).numpy()
    want = np.array([stats.spearmanr(a, b)[0] for a, b in zip(s.numpy(), u.numpy())])
    assert np.max(np.abs(got - want)) < 1e-12
    assert math.isnan(float(ops.spearman(torch.ones(1, 5), torch.arange(5.0).reshape(1, 5))[0]))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10])
def test_median_is_numpys(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got = ops.median(x)
    if n == 0:
        assert math.isnan(got)
    else:
        assert got == pytest.approx(float(np.median(x.double().numpy())), abs=1e-15)


def test_hist_quantile_is_the_upper_edge_of_the_bin_reaching_q():
    counts = torch.tensor([1, 0, 2, 1, 0, 4])  # cumulative 1 1 3 4 4 8 of 8 values over [0, 3], bin width 0.5

    def reference(q):  # the first bin whose cumulative count reaches q of the total, its upper edge
        cum = np.cumsum(counts.numpy())
        b = next(i for i, c in enumerate(cum) if c >= q * cum[-1])
        return 0.0 + 3.0 * (b + 1) / len(cum)

    for q in (0.0, 0.05, 0.125, 0.2, 0.375, 0.5, 0.51, 0.95, 1.0):
        assert ops.hist_quantile(counts, q, 0.0, 3.0) == pytest.approx(reference(q), abs=1e-12), q
    assert ops.hist_quantile(counts, 0.5, 0.0, 3.0) == 2.0  # 4 of 8 values in bins 0..3: bin 3 is [1.5, 2.0]
    assert math.isnan(ops.hist_quantile(torch.zeros(4), 0.5))


def test_best_of_and_rank_order_follow_the_scores_whatever_the_sets_order():
    s = _tied_scores(T=25, n=10, seed=3)
    g = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(25)])  # unsorted chosen sets
    order = ops.rank_order(idx, s)
    for t in range(25):
        ids = idx[t].tolist()
        # descending score; equal scores keep the set's own order (a stable sort)
        want = sorted(range(4), key=lambda j: -float(s[t, ids[j]]))
        assert order[t].tolist() == want
        assert int(ops.top1(idx, s)[t]) == ids[want[0]]


def test_set_overlaps_match_python_sets_with_padding_ids():
    a = torch.tensor([[0, 1, 2], [3, -1, -1], [4, 5, -1], [-1, -1, -1], [1, 2, 3]])
    b = torch.tensor([[2, 1, 0], [3, 4, -1], [5, -1, -1], [-1, -1, -1], [-1, -1, -1]])
    sa = [{e for e in r if e >= 0} for r in a.tolist()]
    sb = [{e for e in r if e >= 0} for r in b.tolist()]
    assert ops.set_size(a).tolist() == [len(x) for x in sa]
    assert ops.overlap_count(a, b).tolist() == [len(x & y) for x, y in zip(sa, sb)]
    assert ops.overlap_count(b, a).tolist() == [len(x & y) for x, y in zip(sa, sb)]
    assert ops.same_set(a, b).tolist() == [x == y for x, y in zip(sa, sb)]
    assert ops.same_set(b, a).tolist() == [x == y for x, y in zip(sa, sb)]
    want = [len(x & y) / len(x | y) if x | y else 1.0 for x, y in zip(sa, sb)]  # two empty sets: the same set
    assert ops.jaccard(a, b).tolist() == pytest.approx(want, abs=1e-7)


def test_norms_unit_normalize_and_entropy_match_numpy():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(5))
    xn = x.double().numpy()
    for norm, order in (("l2", 2), ("l1", 1), ("linf", np.inf)):
        assert np.allclose(ops.vector_norm(x, norm).double().numpy(), np.linalg.norm(xn, ord=order, axis=-1),
                           rtol=1e-6, atol=0)
        assert np.allclose(ops.vector_norm(x, norm, dim=0).double().numpy(), np.linalg.norm(xn, ord=order, axis=0),
                           rtol=1e-6, atol=0)
    assert np.allclose(ops.unit(x).double().numpy(), xn / np.linalg.norm(xn, axis=-1, keepdims=True), atol=1e-7)
    assert torch.equal(ops.unit(torch.zeros(2, 3)), torch.zeros(2, 3))
    p = x.abs()
    p[0, 2] = 0.0  # 0 log 0 = 0
    p[1] *= 1e-4  # a row of small mass: normalised exactly, nothing added to its sum
    want = p.double().numpy() / p.double().numpy().sum(-1, keepdims=True)
    assert np.allclose(ops.normalize(p).double().numpy(), want, rtol=1e-6, atol=0)
    assert torch.equal(ops.normalize(torch.zeros(1, 4)), torch.zeros(1, 4))
    assert np.allclose(ops.entropy(torch.from_numpy(want)).numpy(), stats.entropy(want, axis=-1), rtol=1e-12, atol=0)
    assert np.allclose(ops.entropy(torch.from_numpy(want).T, dim=0).numpy(), stats.entropy(want, axis=-1),
                       rtol=1e-12, atol=0)


def test_abs_cos_mean_is_the_mean_over_ordered_pairs_of_distinct_rows():
    x = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(6))
    x[1, 3] = 0.0  # a zero row: cosine 0 with everything, still counted in the m (m - 1) pairs
    for b in range(2):
        v = x[b].double().numpy()
        nrm = np.linalg.norm(v, axis=-1)
        cos = [abs(v[i] @ v[j]) / (nrm[i] * nrm[j]) if nrm[i] * nrm[j] > 0 else 0.0
               for i in range(5) for j in range(5) if i != j]
        assert float(ops.abs_cos_mean(x)[b]) == pytest.approx(np.mean(cos), abs=1e-6)
    assert math.isnan(float(ops.abs_cos_mean(torch.randn(1, 4))))


def test_counts_match_bincount_and_unique():
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 6, (50, 3), generator=g)
    valid = torch.rand(50, generator=g) > 0.3
    want = np.bincount(idx[valid.numpy()].reshape(-1).numpy(), minlength=6)
    assert ops.one_hot_counts(idx, 6, valid).tolist() == want.tolist()
    assert ops.one_hot_counts(idx, 6).tolist() == np.bincount(idx.reshape(-1).numpy(), minlength=6).tolist()
    hot = ops.multi_hot(idx, 6)
    assert hot.sum(-1).tolist() == [len(set(r)) for r in idx.tolist()]
    keys, w = torch.randint(-3, 4, (40,), generator=g), torch.randint(0, 5, (40,), generator=g)
    u, c = ops.unique_counts(keys, w)
    assert u.tolist() == sorted(set(keys.tolist()))
    assert c.tolist() == [int(w[keys == k].sum()) for k in u.tolist()]
    assert ops.unique_counts(keys)[1].tolist() == [int((keys == k).sum()) for k in u.tolist()]


def test_blocked_argmax_is_the_first_largest_value_as_torch():
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 50, (30, 256), generator=g).float()  # ties across and within blocks of 64
    x[3, 200] = float("nan")  # NaN counts as the largest
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    want = [next(i for i, v in enumerate(r) if math.isnan(v) or v == max(r)) if not any(map(math.isnan, r))
            else next(i for i, v in enumerate(r) if math.isnan(v)) for r in x.tolist()]
    assert ops.argmax(x).tolist() == want


def test_stable_topk_and_rank_order_keep_index_order_on_wide_tied_rows():
    """Rows wider than 16: the CPU's unstable sort reorders equal scores there (at 12 it happens to keep them), so a
    tie rule lost from ops.topk(stable=True) or rank_order shows only on rows as wide as a real router's (64)."""
    s = _tied_scores(T=20, n=64, seed=9)
    for k in (1, 20, 64):
        want = [sorted(range(64), key=lambda e: (-float(row[e]), e))[:k] for row in s]
        assert ops.topk(s, k, stable=True).tolist() == want
    g = torch.Generator().manual_seed(10)
    idx = torch.stack([torch.randperm(64, generator=g)[:24] for _ in range(20)])  # unsorted 24-expert sets
    order = ops.rank_order(idx, s)
    for t in range(20):
        ids = idx[t].tolist()
        assert order[t].tolist() == sorted(range(24), key=lambda j: -float(s[t, ids[j]]))  # Python's sort: stable


def test_float64_norms_are_computed_in_float64():
    """A float64 input keeps its precision: 1 + 2^-40 is 1 in fp32 (the sums below differ from fp32's by 2^-40)."""
    x = torch.tensor([[1 + 2.0 ** -40, -(2.0 ** -30), 3.0]], dtype=torch.float64)
    exact = {"l1": 4 + 2.0 ** -40 + 2.0 ** -30, "linf": 3.0,
             "l2": math.sqrt((1 + 2.0 ** -40) ** 2 + 2.0 ** -60 + 9.0)}
    for norm, want in exact.items():
        got = ops.vector_norm(x, norm)
        assert got.dtype == torch.float64 and float(got[0]) == pytest.approx(want, rel=1e-15, abs=0), norm
    assert float(ops.vector_norm(x, "l1")[0]) != float(ops.vector_norm(x.float(), "l1")[0])


def test_normalize_scales_a_row_of_tiny_mass_to_sum_one():
    """The clamp only guards an all-zero row: a row whose mass is far below fp32's epsilon (1e-20 + 3e-20) still
    becomes (0.25, 0.75), not itself divided by a floor."""
    p = torch.tensor([[1e-20, 3e-20, 0.0], [2e-38, 2e-38, 4e-38]])
    assert np.allclose(ops.normalize(p).numpy(), [[0.25, 0.75, 0.0], [0.25, 0.25, 0.5]], rtol=1e-6, atol=0)


@pytest.mark.parametrize("V", [200, 130, 64])
def test_blocked_argmax_of_a_width_not_a_multiple_of_the_block(V):
    """200 and 130 are not multiples of 64 (torch.argmax's path), 64 is one block: the first largest value by hand."""
    x = torch.randint(0, 20, (6, V), generator=torch.Generator().manual_seed(V)).float()
    want = [r.index(max(r)) for r in x.tolist()]
    assert ops.argmax(x).tolist() == want


def test_spearman_along_the_first_dim_is_scipys_per_column():
    """``dim=0``: each column's ranks centred on their own mean (a centring along the last dim survived the row-wise
    check, where the two dims coincide)."""
    a = _tied_scores(T=9, n=30, seed=11).double()
    b = torch.rand(9, 30, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    want = np.array([stats.spearmanr(a[:, j].numpy(), b[:, j].numpy())[0] for j in range(30)])
    assert np.max(np.abs(ops.spearman(a, b, dim=0).numpy() - want)) < 1e-12


def test_unit_scaled_makes_rows_of_underflowing_squares_unit_vectors():
    """(3e-25, 4e-25): its squares underflow fp32 (a norm of 0), so only the scaled projection gives (0.6, 0.8); along
    dim 0 each column is scaled by its own largest magnitude."""
    x = torch.tensor([[3e-25, 4e-25], [0.0, 0.0], [-6.0, 8.0]])
    want = [[0.6, 0.8], [0.0, 0.0], [-0.6, 0.8]]
    assert np.allclose(ops.unit(x, scaled=True).numpy(), want, rtol=0, atol=1e-6)
    col = ops.unit(torch.tensor([[3e-25, 5.0], [4e-25, 12.0]]), dim=0, scaled=True)
    assert np.allclose(col.numpy(), [[0.6, 5 / 13], [0.8, 12 / 13]], rtol=0, atol=1e-6)



@pytest.mark.parametrize("scaled", [False, True])
def test_unit_of_an_fp16_row_of_subnormals_is_its_direction(scaled):
    """(3, 4) x 2^-24 in fp16 (subnormals: fp16's smallest normal is 2^-14 = 6.1e-5) has norm 5 x 2^-24 = 3e-7: its
    unit vector is (0.6, 0.8), to fp16's rounding. The division runs in fp32, so the norm is clamped at fp32's tiny,
    not fp16's (pass 17: clamping at fp16's 6.1e-5, or dividing in fp16, gave (0.0029, 0.0039) and passed
    test_ops)."""
    x = torch.tensor([[3 * 2.0 ** -24, 4 * 2.0 ** -24], [0.0, 0.0]], dtype=torch.float16)
    assert x[0].tolist() == [3 * 2.0 ** -24, 4 * 2.0 ** -24]  # exact in fp16
    u = ops.unit(x, scaled=scaled)
    assert u.dtype == torch.float16
    assert u.tolist() == [[float(torch.tensor(0.6, dtype=torch.float16)), float(torch.tensor(0.8, dtype=torch.float16))],
                          [0.0, 0.0]]

def test_abs_cos_mean_of_a_given_gram_ignores_x():
    """``gram=`` (approx passes its fp64 Gram matrix of the expert outputs): the mean |cos| of the rows whose Gram it is,
    whatever ``x`` is (here none)."""
    x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    for b in range(3):
        v = x[b].numpy()
        nrm = np.linalg.norm(v, axis=-1)
        want = np.mean([abs(v[i] @ v[j]) / (nrm[i] * nrm[j]) for i in range(4) for j in range(4) if i != j])
        got = ops.abs_cos_mean(None, gram=x @ x.transpose(-1, -2))[b]
        assert got.dtype == torch.float64 and float(got) == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unit_of_half_precision_rows_whose_norm_passes_fp16s_range(dtype):
    """An fp16 row of 4096 entries of 2000 has norm 128000 > 65504: computed in fp16 it is inf, and x / inf made the
    row a zero vector (0.0 in every entry, not 1/64 = 0.015625). The unit vector of a row of equal entries is
    1/sqrt(4096) = 1/64 exactly, in either dtype; a row (3, 4, 3, 4) x 1e4 (norm 70711) gives (0.6, 0.8, 0.6, 0.8) /
    sqrt(2) to the dtype's rounding."""
    x = torch.full((2, 4096), 2000.0, dtype=dtype)
    u = ops.unit(x)
    assert u.dtype == dtype and torch.equal(u, torch.full_like(x, 1 / 64))
    y = ops.unit(torch.tensor([[3e4, 4e4, 3e4, 4e4]], dtype=dtype))
    want = torch.tensor([[0.6, 0.8, 0.6, 0.8]], dtype=torch.float64) / math.sqrt(2)
    assert y.dtype == dtype and torch.allclose(y.double(), want, rtol=0, atol=torch.finfo(dtype).eps)
    z = ops.unit(torch.tensor([[3e4, 4e4]], dtype=dtype), dim=0)  # along the other dim: each entry its own sign
    assert torch.equal(z, torch.ones_like(z))
