"""Bounded-memory summaries against numpy on random data, within their stated bounds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from moetool.errors import MoetoolError
from moetool.sketch import (DENSE_KEYS, DENSE_TOTAL, FP32_TINY, Moments, QuantileSketch, SparseCounter, TokenSpill,
                            dense_space)


def data(kind, n, seed):
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        return rng.lognormal(-1.0, 1.5, n)
    if kind == "uniform":
        return rng.random(n)
    x = rng.gamma(0.5, 0.3, n)  # with exact zeros and ties
    x[rng.random(n) < 0.2] = 0.0
    return np.round(x, 3)


@pytest.mark.parametrize("kind", ["lognormal", "uniform", "zeros_and_ties"])
@pytest.mark.parametrize("n", [1, 2, 1001, 20000])
def test_quantiles_within_the_stated_bound(kind, n):
    x = data(kind, n, seed=n)
    sk = QuantileSketch()
    for part in np.array_split(x, 7):  # streamed in batches
        sk.add(torch.from_numpy(part).float())
    x32 = x.astype(np.float32).astype(np.float64)  # what the sketch saw
    for q in (0.05, 0.5, 0.95):
        want = np.quantile(x32, q)
        assert sk.quantile(q) == pytest.approx(want, rel=sk.rel_error, abs=0), q
    assert sk.median() == pytest.approx(np.median(x32), rel=sk.rel_error, abs=0)
    assert sk.mean == pytest.approx(x32.mean(), rel=1e-12)
    assert sk.n == n and sk.rel_error < 0.002


def test_weights_drop_padding_and_merge_equals_one_sketch():
    x = torch.from_numpy(data("lognormal", 5000, 1))
    mask = torch.rand(5000, generator=torch.Generator().manual_seed(0)) < 0.7
    a, b, whole = QuantileSketch(), QuantileSketch(), QuantileSketch()
    a.add(x[:2500], mask[:2500])
    b.add(x[2500:], mask[2500:])
    whole.add(x, mask)
    a.merge(b)
    assert torch.equal(a.counts, whole.counts) and a.n == int(mask.sum())
    kept = x[mask].numpy()
    assert a.median() == pytest.approx(np.median(kept), rel=a.rel_error, abs=0)
    assert a.mean == pytest.approx(kept.mean(), rel=1e-12)


def test_padding_never_reaches_the_tail_ends_or_the_variance():
    """Weight 0 (padding) leaves alone what is kept exactly beside the bins: the smallest and largest positive value
    (a quantile in a tail bin is known only at those ends) and the sum of squares (the variance)."""
    real = np.array([5e-4, 0.5, 2.0, 20.0])  # lo = 1e-3, hi = 10: 5e-4 in the underflow bin, 20 in the overflow
    pad = np.array([1e-5, 1e3])  # padding beyond both ends
    sk = QuantileSketch(lo=1e-3, hi=10.0)
    sk.add(torch.from_numpy(np.concatenate([real, pad])), torch.tensor([1, 1, 1, 1, 0, 0]))
    assert sk.n == 4
    assert (sk.quantile(0.0), sk.quantile(1.0)) == (5e-4, 20.0)  # np.quantile(real, 0 / 1), exactly
    assert sk.moments.var == pytest.approx(real.var(), rel=1e-12)
    assert sk.mean == pytest.approx(real.mean(), rel=1e-12)


@pytest.mark.parametrize("space", [None, 50])
@pytest.mark.parametrize("defer", [False, True])
def test_sparse_counter_counts_are_a_counters_and_merge_across_ranks(space, defer):
    """Sparse (sort-merged) and dense (``space``) tables, merging as it goes or deferred to ``settle``: the exact
    counts of every key (-1 included) in ascending key order; ``merged`` of two ranks' states sums them."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(-1, 50, (m,), generator=g) for m in (7, 300, 1, 90, 64)]
    ranks = [SparseCounter(merge_min=64, defer=defer, space=space) for _ in range(2)]
    for i, b in enumerate(batches):
        ranks[i % 2].add(b)
        if defer:
            ranks[i % 2].settle()
    for c, part in zip(ranks, (batches[0::2], batches[1::2])):
        keys, counts = c.result()
        want = Counter(torch.cat(part).tolist())
        assert keys.tolist() == sorted(want) and counts.tolist() == [want[k] for k in sorted(want)]
    keys, counts = SparseCounter.merged([c.host_state() for c in ranks]).result()
    want = Counter(torch.cat(batches).tolist())
    assert keys.tolist() == sorted(want) and counts.tolist() == [want[k] for k in sorted(want)]
    # one part (a layer only one rank saw: stats' ``if li in p``) is that rank's counts, not an empty table
    keys, counts = SparseCounter.merged([ranks[1].host_state()]).result()
    want = Counter(torch.cat(batches[1::2]).tolist())
    assert keys.tolist() == sorted(want) and counts.tolist() == [want[k] for k in sorted(want)]
    assert SparseCounter.merged([]).result()[0].numel() == 0


def test_dense_space_fits_each_table_and_all_of_them():
    assert dense_space(None, 1) is None and dense_space(0, 1) is None
    assert dense_space(DENSE_KEYS, 1) == DENSE_KEYS and dense_space(DENSE_KEYS + 1, 1) is None
    per = DENSE_TOTAL // DENSE_KEYS  # this many full-size tables fit together, one more does not
    assert dense_space(DENSE_KEYS, per) == DENSE_KEYS and dense_space(DENSE_KEYS, per + 1) is None
    assert SparseCounter(space=DENSE_KEYS + 1).space is None


def test_out_of_range_and_nan_raise_instead_of_a_wrong_number():
    sk = QuantileSketch(lo=1e-3, hi=10.0)
    sk.add(torch.tensor([1e-6, 2e-6, 3e-6, 1.0]))
    with pytest.raises(MoetoolError, match="outside the sketch's range"):
        sk.median()
    assert sk.quantile(1.0) == pytest.approx(1.0, rel=sk.rel_error)
    one = QuantileSketch(lo=1e-3, hi=10.0)
    one.add(torch.tensor([50.0, 50.0]))  # a single value in the tail bin is known exactly
    assert one.median() == 50.0
    bad = QuantileSketch()
    bad.add(torch.tensor([1.0, float("nan")]))
    with pytest.raises(MoetoolError, match="NaN, infinite or negative"):
        bad.median()
    assert np.isnan(QuantileSketch().median())
    for inf in (float("inf"), float("-inf")):  # before: +inf sat in the overflow bin and the mean read 9e307
        worse = QuantileSketch()
        worse.add(torch.tensor([1.0, inf], dtype=torch.float64))
        for read in (worse.median, lambda: worse.mean):
            with pytest.raises(MoetoolError, match=r"^1 NaN, infinite or negative value\(s\) reached"):
                read()


def test_moments_exact():
    x = data("lognormal", 3001, 5)
    m = Moments()
    for part in np.array_split(x, 5):
        m.add(torch.from_numpy(part))
    assert m.n == 3001 and m.mean == pytest.approx(x.mean(), rel=1e-12)
    assert m.var == pytest.approx(x.var(), rel=1e-9)
    w = Moments()
    w.add(torch.tensor([1.0, 2.0, 100.0]), torch.tensor([1, 1, 0]))
    assert (w.n, w.mean, w.var) == (2.0, 1.5, 0.25)  # np.var([1, 2]): the weight-0 value 100 nowhere


def test_spill_reads_back_every_batch_in_order(tmp_path):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 64, (int(n), 4), generator=gen).to(torch.int16) for n in (5, 0, 17, 3)]
    parts += [torch.randn(6, 2, generator=gen), torch.randn(3, generator=gen, dtype=torch.float64),
              torch.randn(2, 2, generator=gen).bfloat16()]  # each read back in its own dtype
    with TokenSpill(tmp_path) as sp:
        for p in parts:
            sp.append(p)
        back = list(sp)
        assert len(sp) == len(parts) and sp.nbytes == sum(p.numel() * p.element_size() for p in parts)
        path = sp.path
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(back, parts))
    assert not path.exists()  # cleaned up


def test_both_ends_of_the_range_are_inside_it():
    """``[lo, hi]`` is closed: a value exactly at ``lo`` or at ``hi`` falls in a log bin, so a quantile there is a
    number within ``rel_error`` (the default range's ends, 2^-149 and 1e4, are values a run can meet: the smallest
    fp32 and the round top). Before this test a value at ``hi`` put in the overflow bin, or one at ``lo`` in the
    underflow bin, read nothing but the sketch's range error."""
    for values, q, want in (([1e4, 1e4, 1e4, 1.0], 0.5, 1e4), ([FP32_TINY] * 3 + [1.0], 0.5, FP32_TINY)):
        sk = QuantileSketch()  # 2^-149 .. 1e4
        sk.add(torch.tensor(values, dtype=torch.float64))
        assert np.quantile(values, q) == want
        # lo is a bin's lower edge, where the bound is reached (the centre lo * sqrt(g)): equal up to rounding
        assert sk.quantile(q) == pytest.approx(want, rel=sk.rel_error * (1 + 1e-9), abs=0)


def test_a_quantile_inside_the_overflow_bin_is_refused_not_read_as_the_max():
    """Overflow values are known only at the top (the max): 30 of [1, 20, 30, 40] (hi = 10) is the quantile 2/3,
    the overflow bin's second value, which no number of the sketch gives -- one line; 40 (q = 1) is the max, exactly.
    Reading every overflow rank as the max gave 40 for 30."""
    sk = QuantileSketch(lo=1e-3, hi=10.0)
    sk.add(torch.tensor([1.0, 20.0, 30.0, 40.0]))
    assert np.quantile([1.0, 20.0, 30.0, 40.0], 2 / 3) == pytest.approx(30.0)
    with pytest.raises(MoetoolError, match="outside the sketch's range"):
        sk.quantile(2 / 3)
    assert sk.quantile(1.0) == 40.0 and sk.quantile(0.0) == pytest.approx(1.0, rel=sk.rel_error)


def test_merge_keeps_the_smallest_and_largest_of_both():
    """The tail ends after a merge are the smaller min and the larger max of the two parts: q = 0 / 1 read exactly
    from the under- and overflow bins (2e-4 and 30, np.quantile of the union), whichever part held them."""
    a, b = QuantileSketch(lo=1e-3, hi=10.0), QuantileSketch(lo=1e-3, hi=10.0)
    a.add(torch.tensor([5e-4, 1.0, 30.0], dtype=torch.float64))
    b.add(torch.tensor([2e-4, 2.0, 20.0], dtype=torch.float64))
    for x, y in ((a, b), (b, a)):
        m = QuantileSketch(lo=1e-3, hi=10.0).merge(x).merge(y)
        assert (m.quantile(0.0), m.quantile(1.0)) == (2e-4, 30.0) and m.n == 6


def test_a_restored_spill_keeps_its_batches_and_appends_after_them(tmp_path):
    """``save`` then ``restore`` (fluctuation's ``--resume``) gives back the saved batches, and a batch appended after
    the restore is read after them: the restored file is opened for appending. Opened for writing, the append
    overwrote the first saved batch's bytes (read back as the new batch's values under the old layout)."""
    a, b, c = torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.tensor([0.5, -1.25]), torch.tensor([7, 8, 9])
    with TokenSpill(tmp_path) as sp:
        sp.append(a)
        sp.append(b)
        layout = sp.save(tmp_path / "saved.bin")
    with TokenSpill.restore(tmp_path / "saved.bin", layout, tmp_path) as back:
        back.append(c)
        got = list(back)
        assert len(back) == 3 and back.nbytes == a.numel() * 4 + b.numel() * 4 + c.numel() * 8
    assert [t.dtype for t in got] == [torch.int32, torch.float32, torch.int64]
    assert all(torch.equal(x, y) for x, y in zip(got, (a, b, c)))
