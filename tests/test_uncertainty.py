"""Interval math (moetool.uncertainty): coverage at the nominal rate on a known answer, delta method vs simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moetool.errors import MoetoolError
from moetool.uncertainty import (RowSums, bootstrap_weights, delta_ratio, ppl_ratio_interval, ratio_interval,
                                 ratio_intervals)


def test_bootstrap_covers_known_p_at_nominal_rate():
    """Rows of Bernoulli(p) tokens with a per-row random effect (documents differ): the 95% document-level
    interval of the token fraction covers the true mean over 200 repeated experiments 90-99% of the time."""
    rng = np.random.default_rng(1)
    p, n_rows, reps = 0.3, 60, 200
    covered, widths = 0, []
    for i in range(reps):
        pr = np.clip(p + rng.normal(0, 0.1, n_rows), 0.01, 0.99)  # row-level heterogeneity, mean 0.3 (no clipping hit in practice)
        m = rng.integers(10, 40, n_rows)  # tokens per row
        k = rng.binomial(m, pr)
        ci = ratio_interval(k, m, n_boot=400, seed=i)
        covered += ci.covers(p)
        widths.append(ci.hi - ci.lo)
    rate = covered / reps
    assert 0.90 <= rate <= 0.99, rate
    # the interval width reflects the between-row spread, not the token-level binomial one alone
    naive = 2 * 1.96 * math.sqrt(p * (1 - p) / (n_rows * 25))
    assert np.mean(widths) > naive


def test_ratio_value_and_shared_denominator():
    num = np.array([[1.0, 2.0], [3.0, 0.0], [2.0, 2.0]])
    den = np.array([2.0, 4.0, 4.0])
    a, b = ratio_intervals(num, den, n_boot=0)
    assert a.value == pytest.approx(6 / 10) and b.value == pytest.approx(4 / 10)
    assert math.isnan(a.lo)
    a2, b2 = ratio_intervals(num, den, n_boot=200, seed=3)
    assert a2.lo <= a2.value <= a2.hi and b2.lo <= b2.value <= b2.hi


def test_weights_are_multinomial_and_seeded():
    w = bootstrap_weights(7, 50, seed=4)
    assert w.shape == (50, 7) and (w.sum(1) == 7).all()
    assert (w == bootstrap_weights(7, 50, seed=4)).all()
    assert not (w == bootstrap_weights(7, 50, seed=5)).all()


def test_ppl_ratio_is_exp_of_mean_nll_difference():
    rng = np.random.default_rng(0)
    tok = rng.integers(5, 20, 30).astype(float)
    a = tok * 2.0 + rng.normal(0, 1, 30)
    b = tok * 1.9 + rng.normal(0, 1, 30)
    ci = ppl_ratio_interval(a, b, tok, n_boot=300, seed=0)
    assert ci.value == pytest.approx(math.exp(a.sum() / tok.sum() - b.sum() / tok.sum()))
    assert ci.lo < ci.value < ci.hi


def test_delta_method_matches_closed_form_and_simulation():
    a, sa, b, sb = 0.62, 0.012, 0.70, 0.011
    ci = delta_ratio(a, sa, b, sb)
    se = (ci.hi - ci.lo) / (2 * 1.959963984540054)
    assert se == pytest.approx(a / b * math.sqrt((sa / a) ** 2 + (sb / b) ** 2), rel=1e-12)
    rng = np.random.default_rng(0)
    sim = rng.normal(a, sa, 200_000) / rng.normal(b, sb, 200_000)
    assert se == pytest.approx(sim.std(), rel=0.03)
    # positive covariance narrows the ratio's interval
    assert delta_ratio(a, sa, b, sb, cov=0.5 * sa * sb).half_width < ci.half_width


def test_row_sums_accumulate_by_row():
    rs = RowSums()
    rs.add(np.array([3, 1, 3]), hit=np.array([1.0, 0.0, 1.0]), n=np.ones(3))
    rs.add(np.array([1]), hit=np.array([1.0]), n=np.array([2.0]))
    assert rs.rows == [1, 3]
    assert rs.table("hit").tolist() == [1.0, 2.0] and rs.table("n").tolist() == [3.0, 2.0]
    assert rs.interval("hit", "n", n_boot=0).value == pytest.approx(3 / 5)


def test_errors_are_one_line():
    with pytest.raises(MoetoolError):
        ratio_interval([1.0], [0.0], n_boot=0)
    with pytest.raises(MoetoolError):
        ratio_interval([1.0, float("nan")], [1.0, 1.0], n_boot=0)
    with pytest.raises(MoetoolError):
        ratio_interval([1.0, 2.0], [1.0, 1.0], n_boot=10)
    with pytest.raises(MoetoolError):
        delta_ratio(0.5, 0.01, 0.0, 0.01)


def test_shared_cli_default_mirrors_the_library():
    from moetool.commands.options import DEFAULT_BOOTSTRAP as cli_default
    from moetool.uncertainty import DEFAULT_BOOTSTRAP

    assert cli_default == DEFAULT_BOOTSTRAP


def test_sum_intervals_of_a_ratio_equal_ratio_intervals_and_a_max_is_covered():
    from moetool.uncertainty import ratio_intervals, sum_intervals

    rng = np.random.default_rng(1)
    a, b = rng.poisson(3, (40, 4)).astype(float), rng.poisson(9, 40).astype(float) + 1
    ref = ratio_intervals(a, b, n_boot=300, seed=2)
    got = sum_intervals(np.column_stack([a, b]), lambda s: s[..., :4] / s[..., 4:], n_boot=300, seed=2)
    def flat(ivs):  # pytest >= 9.2 refuses nested structures in approx
        return [x for i in ivs for x in (i.value, i.lo, i.hi)]

    assert flat(got) == pytest.approx(flat(ref), rel=1e-12)
    mx = sum_intervals(a, lambda s: s.max(-1, keepdims=True) / s.sum(-1, keepdims=True), n_boot=300)[0]
    assert mx.lo <= mx.value <= mx.hi and mx.value == pytest.approx(a.sum(0).max() / a.sum())


def test_row_table_matches_row_sums_and_hand_counts():
    import torch

    from moetool.data import TokenSet
    from moetool.uncertainty import RowTable

    B, S, n = 2, 3, 4
    ids = torch.zeros(5, S, dtype=torch.long)
    tokens = TokenSet(ids, torch.ones_like(ids), [""] * 5, "t")
    rt, rs = RowTable(tokens), RowSums()
    rng = np.random.default_rng(0)
    hand = np.zeros((5, n))
    for batch in tokens.batches(B):
        rt.next_batch(batch)
        b = batch.input_ids.shape[0]
        start = len(rs.rows)
        x = rng.normal(size=b * S)
        idx = rng.integers(0, n, (b * S, 2))
        valid = rng.random(b * S) < 0.7
        rt.add("x", torch.tensor(x))  # per token -> per row
        rt.add("one", torch.ones(b))  # per row
        rt.add_counts("c", torch.tensor(idx), n, torch.tensor(valid))
        rows = np.repeat(np.arange(start, start + b), S)
        rs.add(rows, x=x)
        rs.add(np.arange(start, start + b), one=np.ones(b))
        for t in range(b * S):
            if valid[t]:
                for e in idx[t]:
                    hand[rows[t], e] += 1
    assert rt.n_rows == 5 and rt.names == ["c", "one", "x"]
    assert rt.table("x") == pytest.approx(rs.table("x"), rel=1e-12)
    assert rt.table("one").tolist() == [1.0] * 5
    assert rt.table("c").tolist() == hand.tolist()
    a = rt.interval("x", "one", n_boot=200, seed=3)
    b = rs.interval("x", "one", n_boot=200, seed=3)
    assert (a.value, a.lo, a.hi) == pytest.approx((b.value, b.lo, b.hi), rel=1e-12)
    with pytest.raises(MoetoolError):
        rt.table("missing")


def test_max_load_and_entropy_intervals_cover_the_known_values():
    """Non-ratio statistics of summed rows (stats' max_load_ratio and load entropy): per-row expert counts drawn
    around known fractions p with a per-row random effect (documents differ); the 95% percentile intervals of
    n·max(p) and H(p)/log n cover the known values in roughly 95% of 150 repeated experiments (near-tied top
    experts: the max's hardest case)."""
    from moetool.uncertainty import sum_intervals

    rng = np.random.default_rng(0)
    n, reps = 8, 150
    p = np.array([0.2, 0.19, 0.18, 0.12, 0.1, 0.08, 0.07, 0.06])

    def stat(s):
        f = s / s.sum(-1, keepdims=True)
        return np.stack([f.max(-1) * n, -(f * np.log(f)).sum(-1) / math.log(n)], -1)

    truth = stat(p)
    covered = np.zeros(2)
    for r in range(reps):
        counts = np.stack([rng.multinomial(512, rng.dirichlet(p * 200)) for _ in range(64)]).astype(float)
        cis = sum_intervals(counts, stat, n_boot=400, seed=r)
        covered += [ci.covers(t) for ci, t in zip(cis, truth)]
    rate = covered / reps
    assert (rate >= 0.88).all() and (rate <= 0.99).all(), rate
