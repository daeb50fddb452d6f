"""Bounded-memory summaries against numpy on random data, within their stated bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetool.errors import MoetoolError
from moetool.sketch import Moments, QuantileSketch, TokenSpill


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
    assert (w.n, w.mean) == (2.0, 1.5)


def test_spill_reads_back_every_batch_in_order(tmp_path):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 64, (int(n), 4), generator=gen).to(torch.int16) for n in (5, 0, 17, 3)]
    parts.append(torch.randn(6, 2, generator=gen))
    with TokenSpill(tmp_path) as sp:
        for p in parts:
            sp.append(p)
        back = list(sp)
        assert len(sp) == len(parts) and sp.nbytes == sum(p.numel() * p.element_size() for p in parts)
        path = sp.path
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(back, parts))
    assert not path.exists()  # cleaned up
