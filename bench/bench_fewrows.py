"""Coverage of moetool's 95% bootstrap intervals from a handful of packed rows (the rule behind
``uncertainty.FEW_ROWS``).

    python bench/bench_fewrows.py                           # n = 2 ... 30 rows, 1000 datasets per n, 1000 replicates
    python bench/bench_fewrows.py --rows 3,10 --datasets 2000

A statistic of moetool's streams is a ratio of per-row sums, ``Σ_r a[r] / Σ_r b[r]`` (a token-weighted mean: mean
NLL, agreement, an entropy of summed counts). Here every row has ``L`` tokens (``b[r] = L``) and a row mean
``m[r]`` drawn from a between-row distribution with mean ``μ`` (``a[r] = L · m[r]``), so the true value of the
statistic is ``μ``. For each row count ``n`` and case, ``--datasets`` datasets of ``n`` rows are drawn, each gets
moetool's own interval (:func:`moetool.uncertainty.ratio_intervals`: the percentile interval, and
:func:`moetool.uncertainty.sum_intervals` with ``method="bca"``), ``--replicates`` replicates, seeded per dataset,
and the share of intervals that contain ``μ`` is printed (nominal 0.95; ± is the binomial standard error of the
share). Nothing is re-implemented: the intervals are the ones the commands print.

Cases (row means): ``normal`` with a coefficient of variation (CV) of 5% and of 20% (a percentile interval is
equivariant under ``m -> c + s·m``, so both give the same coverage: a check), ``lognormal`` with CV 20%
(right-skewed), and ``t3`` (Student t, 3 degrees of freedom, scaled to CV 10%: heavy tails).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

MU, L = 3.0, 256  # a mean NLL of 3 nats, rows of 256 tokens (the embedded models' default seq_len)
CASES = ("normal cv5%", "normal cv20%", "lognormal cv20%", "t3 cv10%")


def row_means(case: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` row means of ``case`` (see the module docstring), mean ``MU``."""
    if case.startswith("normal"):
        cv = 0.05 if "cv5%" in case else 0.20
        return MU + cv * MU * rng.standard_normal(n)
    if case == "lognormal cv20%":
        s = math.sqrt(math.log1p(0.20 ** 2))  # CV² = exp(s²) − 1
        return MU * rng.lognormal(-s * s / 2, s, n)  # E = MU
    if case == "t3 cv10%":
        return MU + 0.10 * MU * rng.standard_t(3, n) / math.sqrt(3.0)  # t3 has variance 3
    raise ValueError(case)


def coverage(case: str, n: int, datasets: int, n_boot: int, seed: int = 0) -> dict[str, float]:
    """Share of ``datasets`` percentile and BCa intervals of ``n`` rows of ``case`` that contain the true value."""
    from moetool.uncertainty import ratio_intervals, sum_intervals

    rng = np.random.default_rng([seed, n])  # the same draws for every case: the two normal ones are one
    hit = {"percentile": 0, "bca": 0}
    for d in range(datasets):
        a = L * row_means(case, n, rng)
        b = np.full(n, float(L))
        p = ratio_intervals(a, b, n_boot=n_boot, seed=d)[0]
        q = sum_intervals(np.stack([a, b], 1), lambda s: s[..., :1] / s[..., 1:], n_boot=n_boot, seed=d,
                          method="bca")[0]
        hit["percentile"] += p.covers(MU)
        hit["bca"] += q.covers(MU)
    return {k: v / datasets for k, v in hit.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="2,3,4,5,6,8,10,15,20,30")
    ap.add_argument("--datasets", type=int, default=1000)
    ap.add_argument("--replicates", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",")]
    se = math.sqrt(0.95 * 0.05 / args.datasets)
    print(f"coverage of the nominal 95% interval, {args.datasets} datasets per cell (binomial se ≈ {se:.3f} at 0.95,"
          f" larger below), {args.replicates} replicates; percentile / BCa")
    print(f"{'rows':>5} " + " ".join(f"{c:>18}" for c in CASES))
    for n in rows:
        cells = [coverage(c, n, args.datasets, args.replicates, args.seed) for c in CASES]
        print(f"{n:>5} " + " ".join(f"{c['percentile']:>8.3f} / {c['bca']:.3f}" for c in cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
