"""Confidence intervals: the one home of interval math (document-level bootstrap, Wilson, MOVER-R).

Bootstrap for streamed statistics
---------------------------------
A streamed statistic is a ratio of sums: agreement = Σ agree / Σ tokens, mean NLL = Σ nll / Σ tokens, a
fluctuation rate, a load fraction. Resampling whole documents (packed rows) keeps the dependence between the
tokens of one row: the consumer accumulates, per row ``r``, the numerator ``a[r]`` and the denominator ``b[r]``
(:class:`RowSums`), and every bootstrap replicate is ``Σ_r w[r] a[r] / Σ_r w[r] b[r]`` with multinomial row
weights ``w`` (``n_rows`` draws with replacement). All replicates of all statistics come out of ONE matrix
product ``W [N_boot, n_rows] @ A [n_rows, k]``. The interval is the percentile interval (2.5%, 97.5%) of the
replicates. ``n_boot = 0`` switches intervals off (``lo = hi = NaN``). Seeded: the same seed gives the same
weights, so intervals of two statistics measured on the same rows are paired.

BCa for biased statistics
-------------------------
A statistic that is not a plain ratio, such as a max over experts or a load entropy, is biased under resampling:
the max of resampled loads is larger on average than the max of the loads (with near-uniform routing the whole
percentile interval can lie above the estimate). :func:`sum_intervals` with ``method="bca"`` gives the
bias-corrected and accelerated interval (:func:`bca`, Efron 1987): bias correction ``z0`` from the share of
replicates below the estimate, acceleration ``a`` from the leave-one-row-out jackknife. When BCa is degenerate
(every replicate on one side of the estimate, zero jackknife spread, or a zero-width interval from a resample of
a few rows whose replicates vary) the percentile interval is used; either
interval is then widened to include the estimate, so an interval never excludes the number it belongs to.

Wilson score interval for proportions
-----------------------------------
An accuracy over ``n`` items scored 0 or 1 (lm-eval's ``acc``, ``acc_norm``, ``exact_match``): :func:`wilson`,
inside [0, 1] even at 10 items or an accuracy of 0 or 1, where ``p ± 1.96·se`` leaves [0, 1].

MOVER-R for a ratio of two estimates
------------------------------------
Retention = acc_policy / acc_router: :func:`mover_ratio`, Fieller's interval with each variance recovered from the
estimate's own (Wilson) interval (Newcombe 2016). It stays honest at an accuracy of 0 or 1, where the delta method
``r ± z·se`` collapses (lm-eval's se is 0 there: 5/5 right in both runs gave ``1 ± 0``), and agrees with the delta
method away from the boundary. The estimates are taken as independent (conservative for two runs over the same
items).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .defaults import DEFAULT_BOOTSTRAP, MAX_BOOTSTRAP  # noqa: F401 - the default number of replicates (--bootstrap)
from .errors import MoetoolError
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its ``level`` interval ``[lo, hi]`` (NaN bounds when intervals are off)."""

    value: float
    lo: float = float("nan")
    hi: float = float("nan")

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def covers(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def columns(self, name: str) -> dict[str, float]:
        """``{name: value, name_lo: lo, name_hi: hi}`` for a CSV row."""
        return {name: self.value, f"{name}_lo": self.lo, f"{name}_hi": self.hi}


def check_n_boot(n_boot: int) -> int:
    n_boot = int(n_boot)
    if n_boot < 0:
        raise MoetoolError(f"--bootstrap must be >= 0 (0 = no intervals), got {n_boot}")
    if 0 < n_boot < 100:
        raise MoetoolError(f"--bootstrap {n_boot} is too few replicates for a 95% percentile interval (use >= 100 or 0)")
    if n_boot > MAX_BOOTSTRAP:
        raise MoetoolError(f"--bootstrap {n_boot:,} is more replicates than moetool takes (at most {MAX_BOOTSTRAP:,}: "
                           f"their resample weights are held in memory, replicates x rows)")
    return n_boot


def replicates(n_boot: int, n_rows: int) -> int:
    """The replicates a bootstrap over ``n_rows`` packed rows makes: ``n_boot`` (checked), none from one row (its
    one resample is itself: no interval, as ``n_boot = 0``, never an error). The one home of that rule: the
    interval functions below and :func:`bootstrap_meta` apply it."""
    n_boot = check_n_boot(n_boot)
    return n_boot if n_rows >= 2 else 0


#: Fewer packed rows than this: a "95%" bootstrap interval is no 95% interval. Measured with
#: ``python bench/bench_fewrows.py`` (the coverage of :func:`ratio_intervals` and BCa :func:`sum_intervals` for a
#: token-weighted mean over rows of equal length, 1000 replicates; README's table): 0.52 at 2 rows, 0.75 at 3, 0.79
#: at 4, 0.85 at 5, 0.87 at 6 and 8, 0.90 at 10, 0.92-0.93 from 15 to 30 rows (row means normal or lognormal, CV
#: 5-20%; Student t3 rows 0.89 at 10, 0.90-0.92 from 15). From 2 or 3 rows a percentile interval is (nearly always)
#: the range of the rows' own values (one row repeated is a resample of probability n^-n, above the 2.5% tail),
#: which holds the true value with probability 1 - 2^(1-n) (0.5, 0.75) when the rows scatter symmetrically about it.
FEW_ROWS = 10


def few_rows_note(n_boot: int, n_rows: int) -> str | None:
    """The one line that says a run's bootstrap intervals over ``n_rows`` packed rows are not 95% intervals
    (``n_rows`` below :data:`FEW_ROWS`, intervals on), else ``None``. The interval is still computed (a rough range,
    and what explicit small data asks for); the line goes into the manifest (:func:`bootstrap_meta`), onto the
    console (:func:`moetool.report.writers.write`) and into the report page."""
    if replicates(n_boot, n_rows) == 0 or n_rows >= FEW_ROWS:
        return None
    if n_rows <= 3:
        cover = (f"each interval is about the range of the {n_rows} rows' own values and holds the true value about "
                 f"{1 - 2.0 ** (1 - n_rows):.0%} of the time, not 95%")
    else:
        cover = (f"from fewer than {FEW_ROWS} rows a 95% bootstrap interval holds the true value only about "
                 f"77-89% of the time (bench/bench_fewrows.py)")
    return (f"{n_rows} packed rows: {cover}; read the intervals as rough ranges, or give at least {FEW_ROWS} rows "
            f"(a larger --max-tokens or a smaller --seq-len)")


def bootstrap_meta(n_boot: int, seed: int, n_rows: int, interval: str = "percentile interval") -> dict[str, Any]:
    """The manifest's ``bootstrap`` section of a run over ``n_rows`` packed rows (no interval from one row; the
    :func:`few_rows_note` under ``note`` from fewer than :data:`FEW_ROWS` rows)."""
    meta = {"replicates": replicates(n_boot, n_rows), "seed": seed, "rows": n_rows, "level": LEVEL,
            "method": f"document-level bootstrap over packed rows, {interval} (moetool.uncertainty)"}
    note = few_rows_note(n_boot, n_rows)
    if note:
        meta["note"] = note
    return meta


def bootstrap_weights(n_rows: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """Multinomial row weights ``[n_boot, n_rows]`` (float64): each replicate draws ``n_rows`` rows with
    replacement; ``w[b, r]`` = how often row ``r`` was drawn. Read-only and cached: every statistic of one run
    (same rows, replicates, seed) reuses the same draw."""
    if n_rows < 2:
        raise MoetoolError(f"a bootstrap needs at least 2 documents/rows, got {n_rows}")
    return _weights(int(n_rows), int(n_boot), int(seed))


@functools.lru_cache(maxsize=4)
def _weights(n_rows: int, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n_rows, np.full(n_rows, 1.0 / n_rows), size=n_boot).astype(np.float64)
    w.flags.writeable = False
    return w


def percentile(replicates: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval over axis 0 of ``replicates [N_boot, ...]``. NaN replicates (a resample whose
    denominator is zero) are an error: never a narrower-looking interval."""
    if np.isnan(replicates).any():
        raise MoetoolError("bootstrap replicate is NaN (a resample with zero tokens): too few rows for an interval")
    a = (1 - level) / 2
    lo, hi = np.quantile(replicates, [a, 1 - a], axis=0)
    return lo, hi


def bca(replicates: np.ndarray, value: np.ndarray, jackknife: np.ndarray, level: float = LEVEL
        ) -> tuple[np.ndarray, np.ndarray]:
    """Bias-corrected and accelerated (BCa) interval of ``m`` statistics, widened to include ``value``.

    ``replicates [N_boot, m]`` bootstrap replicates, ``value [m]`` the estimates, ``jackknife [n_rows, m]`` the
    leave-one-row-out values. Per statistic: ``z0 = Φ⁻¹(share of replicates below the estimate, ties count
    half)``, ``a = Σ d³ / (6 (Σ d²)^1.5)`` with ``d = mean(jackknife) − jackknife``, and the interval is the
    replicates' quantiles at ``Φ(z0 + (z0 + z) / (1 − a (z0 + z)))`` for ``z = Φ⁻¹((1 ∓ level) / 2)``. Degenerate
    (``z0`` infinite, no jackknife spread, ``1 − a (z0 + z) <= 0``, or both adjusted levels on one value of a
    few-row resample: a zero-width interval where the replicates vary): the percentile interval. Either way
    ``lo <= value <= hi``.
    """
    from statistics import NormalDist

    nd = NormalDist()
    reps = np.asarray(replicates, dtype=np.float64)
    reps = reps.reshape(reps.shape[0], -1)
    value = np.asarray(value, dtype=np.float64).reshape(-1)
    jack = np.asarray(jackknife, dtype=np.float64).reshape(-1, value.shape[0])
    if np.isnan(reps).any():
        raise MoetoolError("bootstrap replicate is NaN (a resample with zero tokens): too few rows for an interval")
    tail = (1 - level) / 2
    lo, hi = np.quantile(reps, [tail, 1 - tail], axis=0)  # the percentile interval: the fallback
    below = (np.sum(reps < value, 0) + 0.5 * np.sum(reps == value, 0)) / reps.shape[0]  # [m]
    levels: dict[int, list[float]] = {}  # statistic -> its two adjusted levels
    for j in range(value.shape[0]):
        p = below[j]
        d = jack[:, j].mean() - jack[:, j]
        ss = float(np.sum(d ** 2))
        if not 0 < p < 1 or not ss > 0:  # NaN too: a jackknife row that leaves no tokens
            continue
        z0, a = nd.inv_cdf(p), float(np.sum(d ** 3)) / (6 * ss ** 1.5)
        q = []
        for z in (nd.inv_cdf(tail), nd.inv_cdf(1 - tail)):
            den = 1 - a * (z0 + z)
            if den <= 0:
                break
            q.append(nd.cdf(z0 + (z0 + z) / den))
        if len(q) == 2:
            levels[j] = q
    for j, (b_lo, b_hi) in _column_quantiles(reps, levels).items():
        if b_hi > b_lo or hi[j] == lo[j]:  # both levels on one atom of a few-row resample: degenerate
            lo[j], hi[j] = b_lo, b_hi
    return np.minimum(lo, value), np.maximum(hi, value)


def _column_quantiles(reps: np.ndarray, levels: dict[int, list[float]], chunk: int = 16
                      ) -> dict[int, tuple[float, float]]:
    """``{j: np.quantile(reps[:, j], levels[j])}``, each column at its own two levels, in a few calls: the columns
    sorted once, then ``chunk`` columns at a time at all of their levels (``np.quantile`` of a sorted column picks
    the same order statistics, each level interpolated alone: the values of one column's call), the diagonal
    kept."""
    cols = list(levels)
    srt = np.sort(reps[:, cols], 0)
    out = {}
    for s in range(0, len(cols), chunk):
        part = cols[s:s + chunk]
        k = np.arange(len(part))
        qs = np.quantile(srt[:, s:s + chunk], [q for j in part for q in levels[j]], axis=0)  # [2 k, k]
        out.update(zip(part, zip(qs[2 * k, k].tolist(), qs[2 * k + 1, k].tolist())))
    return out


def ratio_intervals(num: np.ndarray, den: np.ndarray, *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                    level: float = LEVEL, transform: Callable[[np.ndarray], np.ndarray] | None = None
                    ) -> list[Interval]:
    """Intervals of ``k`` ratio statistics ``Σ num[:, j] / Σ den[:, j]`` from per-row sums.

    ``num``: ``[n_rows]`` or ``[n_rows, k]``; ``den``: the same shape or ``[n_rows]`` (one denominator shared).
    ``transform`` maps ratios to the reported statistic (``np.exp`` for a perplexity from a mean NLL).
    """
    num = np.asarray(num, dtype=np.float64)
    one = num.ndim == 1
    num = num.reshape(num.shape[0], -1)
    den = np.asarray(den, dtype=np.float64)
    den = den.reshape(den.shape[0], -1)  # [n_rows, k] or [n_rows, 1] (shared): broadcast after the sums
    if den.shape[1] not in (1, num.shape[1]) or den.shape[0] != num.shape[0]:
        raise MoetoolError(f"denominator shape {den.shape} does not fit numerator {num.shape}")
    if not (np.isfinite(num).all() and np.isfinite(den).all()):
        raise MoetoolError("per-row sums contain NaN/inf: no interval")
    if den.sum(0).min() <= 0:
        raise MoetoolError("a statistic has zero denominator: no tokens counted")
    f = transform or (lambda x: x)
    value = np.broadcast_to(f(num.sum(0) / den.sum(0)), (num.shape[1],))
    n_boot = replicates(n_boot, num.shape[0])
    if n_boot == 0:
        out = [Interval(float(v)) for v in value]
    else:
        w = bootstrap_weights(num.shape[0], n_boot, seed)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = f((w @ num) / (w @ den))
        lo, hi = percentile(reps, level)
        out = [Interval(float(v), float(a), float(b)) for v, a, b in zip(value, lo, hi)]
    return out[:1] if one else out


def sum_intervals(sums: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], *, n_boot: int = DEFAULT_BOOTSTRAP,
                  seed: int = 0, level: float = LEVEL, method: str = "percentile") -> list[Interval]:
    """Intervals of ``m`` statistics that are any function of the column sums of per-row sums ``[n_rows, k]``.

    ``statistic([..., k]) -> [..., m]`` maps summed columns to the statistics (vectorised over leading axes):
    the value is ``statistic(Σ_r sums[r])``, replicate ``b`` is ``statistic(W[b] @ sums)`` (the same multinomial
    row weights as :func:`ratio_intervals` for the same seed and row count). A max over experts or a load entropy
    is such a function; a plain ratio is :func:`ratio_intervals`.

    ``method``: ``"percentile"``, or ``"bca"`` for a statistic biased under resampling (a max, an entropy):
    :func:`bca`, with the jackknife over rows ``statistic(Σ sums − sums[r])``; its interval always contains the
    value.
    """
    if method not in ("percentile", "bca"):
        raise MoetoolError(f"interval method must be percentile or bca, got '{method}'")
    sums = np.asarray(sums, dtype=np.float64)
    sums = sums.reshape(sums.shape[0], -1)
    if not np.isfinite(sums).all():
        raise MoetoolError("per-row sums contain NaN/inf: no interval")
    value = np.asarray(statistic(sums.sum(0)), dtype=np.float64).reshape(-1)
    if not np.isfinite(value).all():
        raise MoetoolError("a statistic of the summed rows is NaN/inf (no tokens counted?): no interval")
    n_boot = replicates(n_boot, sums.shape[0])
    if n_boot == 0:
        return [Interval(float(v)) for v in value]
    w = bootstrap_weights(sums.shape[0], n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = np.asarray(statistic(w @ sums), dtype=np.float64).reshape(n_boot, -1)
        if method == "bca":
            jack = np.asarray(statistic(sums.sum(0) - sums), dtype=np.float64).reshape(sums.shape[0], -1)
    lo, hi = bca(reps, value, jack, level) if method == "bca" else percentile(reps, level)
    return [Interval(float(v), float(a), float(b)) for v, a, b in zip(value, lo, hi)]


def ratio_interval(num: Any, den: Any, **kw: Any) -> Interval:
    """One ratio statistic ``Σ num / Σ den`` with its bootstrap interval (see :func:`ratio_intervals`)."""
    return ratio_intervals(np.asarray(num, dtype=np.float64).reshape(-1), den, **kw)[0]


def ppl_ratio_interval(nll_a: Any, nll_b: Any, tokens: Any, *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                       level: float = LEVEL) -> Interval:
    """Perplexity ratio ``ppl_a / ppl_b = exp(mean NLL_a − mean NLL_b)`` of two runs over the SAME rows
    (paired: one weight per row applies to both), from per-row NLL sums and per-row token counts."""
    d = np.asarray(nll_a, dtype=np.float64) - np.asarray(nll_b, dtype=np.float64)
    return ratio_intervals(d, tokens, n_boot=n_boot, seed=seed, level=level, transform=np.exp)[0]


def mover_ratio(a: float, a_lo: float, a_hi: float, b: float, b_lo: float, b_hi: float) -> Interval:
    """``a / b`` with the MOVER-R interval (Donner & Zou 2012; Newcombe 2016, "MOVER-R confidence intervals for
    ratios and products of two independently estimated quantities", Stat Methods Med Res 25:1774) from the two
    estimates' own intervals ``[a_lo, a_hi]`` and ``[b_lo, b_hi]`` (for an accuracy, its :func:`wilson` interval).

    Fieller's construction with each variance recovered from its interval's side: ``lo`` is the root below
    ``a / b`` of ``(a - r b)² = (a - a_lo)² + r² (b_hi - b)²`` and ``hi`` the root above it of
    ``(a - r b)² = (a_hi - a)² + r² (b - b_lo)²``, in closed form

    ``lo = a_lo (2a - a_lo) / (a b + sqrt((a b)² - a_lo (2a - a_lo) b_hi (2b - b_hi)))``
    ``hi = (a b + sqrt((a b)² - a_hi (2a - a_hi) b_lo (2b - b_lo))) / (b_lo (2b - b_lo))``

    Why not the delta method ``r ± z·se``: at an accuracy of 0 or 1 lm-eval's standard error is 0, and 5 of 5
    items right in both runs gave retention ``1 ± 0`` although each accuracy's Wilson interval is [0.57, 1]; here it
    is [0.57, 1.77]. Away from the boundary, with many items, the Wilson intervals are ``p ± z·se`` and MOVER-R is
    Fieller's interval, which the delta method approximates (they agree to the third digit at 10,000 items). The two
    estimates are taken as independent: for two runs scoring the same items, which agree more often than chance, the
    interval is conservative. NaN bounds (value ``a / b``, NaN where ``b`` is 0) unless all six numbers are finite,
    each interval holds its estimate and ``b_lo > 0`` (a base that may be 0 bounds no ratio from above: no interval,
    never a finite-looking one; an accuracy's Wilson ``b_lo`` is above 0 whenever ``b`` is)."""
    nan = float("nan")
    vals = (a, a_lo, a_hi, b, b_lo, b_hi)
    value = a / b if b else nan
    if not all(math.isfinite(float(v)) for v in vals) or not (a_lo <= a <= a_hi and 0 < b_lo <= b <= b_hi):
        return Interval(value, nan, nan)
    ab = a * b
    c_lo, c_hi = a_lo * (2 * a - a_lo), a_hi * (2 * a - a_hi)  # a² - (a - a_lo)², a² - (a_hi - a)²
    d_lo, d_hi = b_hi * (2 * b - b_hi), b_lo * (2 * b - b_lo)  # b² - (b_hi - b)², b² - (b - b_lo)²
    root_lo = math.sqrt(max(ab * ab - c_lo * d_lo, 0.0))  # >= 0: c_lo <= a², d_lo <= b²
    lo = c_lo / (ab + root_lo) if ab + root_lo > 0 else 0.0  # a = a_lo = 0: the ratio's lower bound is 0
    hi = (ab + math.sqrt(max(ab * ab - c_hi * d_hi, 0.0))) / d_hi  # d_hi > 0: 0 < b_lo <= b
    return Interval(value, min(lo, value), max(hi, value))


def wilson(p: float, n: float, *, level: float = LEVEL) -> Interval:
    """A proportion ``p`` of ``n`` items (an accuracy) with its Wilson score interval (Wilson 1927), always inside
    [0, 1] (unlike ``p ± z·se``): centre ``(p + z²/2n) / (1 + z²/n)``, half-width
    ``z / (1 + z²/n) · sqrt(p(1 - p)/n + z²/4n²)``. NaN bounds when ``n`` is not a positive finite count or ``p``
    lies outside [0, 1] (not a proportion)."""
    nan = float("nan")
    if not (math.isfinite(p) and math.isfinite(n) and n > 0 and 0.0 <= p <= 1.0):
        return Interval(p, nan, nan)
    z = normal_quantile(0.5 + level / 2)
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(p, max(centre - half, 0.0), min(centre + half, 1.0))  # [0, 1] exactly: only rounding clipped


def normal_quantile(p: float) -> float:
    """Standard normal quantile (``statistics.NormalDist``; 1.959964 for 0.975)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


class RowSums:
    """Per-row (per packed row / document) sums of named quantities, streamed.

    ``add(rows, **values)``: ``rows`` global row ids ``[m]`` (numpy/torch ints), each value ``[m]`` or
    ``[m, k]`` — added to those rows (repeated ids accumulate). ``table(name)`` -> ``[n_rows, ...]`` over the
    rows seen, in sorted row order. Memory: n_rows × k float64 per name (one row of numbers per document).
    """

    def __init__(self) -> None:
        self._sums: dict[str, dict[int, np.ndarray]] = {}

    def add(self, rows: Any, **values: Any) -> None:
        rows = _np(rows).astype(np.int64).reshape(-1)
        uniq, inv = np.unique(rows, return_inverse=True)
        for name, v in values.items():
            v = _np(v).astype(np.float64)
            v = v.reshape(rows.shape[0], -1)
            agg = np.zeros((uniq.shape[0], v.shape[1]))
            np.add.at(agg, inv, v)
            store = self._sums.setdefault(name, {})
            for r, s in zip(uniq.tolist(), agg):
                store[r] = store[r] + s if r in store else s

    @property
    def rows(self) -> list[int]:
        keys: set[int] = set()
        for store in self._sums.values():
            keys.update(store)
        return sorted(keys)

    def table(self, name: str) -> np.ndarray:
        store = self._sums.get(name)
        if not store:
            raise MoetoolError(f"no per-row sums named '{name}' were recorded")
        rows = self.rows
        width = next(iter(store.values())).shape[0]
        out = np.zeros((len(rows), width))
        for i, r in enumerate(rows):
            if r in store:
                out[i] = store[r]
        return out[:, 0] if width == 1 else out

    def merge_across_ranks(self) -> None:
        """Data parallel: every rank's rows (global ids) merged into this one, on every rank (alone: nothing)."""
        from . import distributed

        if distributed.world_size() <= 1:
            return
        for i, part in enumerate(distributed.gather_object(self._sums)):
            if i != distributed.rank():
                for name, store in part.items():
                    mine = self._sums.setdefault(name, {})
                    for r, v in store.items():
                        mine[r] = mine[r] + v if r in mine else v

    def interval(self, num: str, den: str, **kw: Any) -> list[Interval] | Interval:
        """Bootstrap interval(s) of ``Σ num / Σ den`` over the recorded rows."""
        a, b = self.table(num), self.table(den)
        out = ratio_intervals(a, b, **kw)
        return out[0] if a.ndim == 1 else out


class RowTable:
    """Per-row sums kept on the device while the forward runs (no host sync): the streaming side of
    :class:`RowSums` for consumers inside :func:`moetool.engine.forward`.

    ``RowTable(tokens)``; ``next_batch(batch)`` before each forward (the batch's rows are the next ``B`` rows of
    ``tokens``); then ``add(name, values)`` with ``values [B]``/``[B, k]`` per row, or ``[B*S]``/``[B*S, k]``
    per token (summed over each row's tokens; weight padding out yourself); ``add_counts(name, idx, n, valid)``
    adds per-row counts of expert ids ``idx [B*S, K]`` (``[B, n]``). Rows are numbered by their GLOBAL row id
    (``tokens.row_ids``, set by :func:`moetool.distributed.shard`; ``0..N-1`` alone), so
    :meth:`reduce_across_ranks` (an all-reduce sum over a ``[N_global, k]`` table per name) leaves every rank
    with every row, exactly as one process would. ``table(name)`` / ``interval(num, den)`` as :class:`RowSums`.
    """

    def __init__(self, tokens: Any) -> None:
        import torch

        ids = getattr(tokens, "row_ids", None)
        self.row_ids = (torch.arange(tokens.input_ids.shape[0]) if ids is None else ids).long()
        self._sums: dict[str, Any] = {}
        self._start = 0
        self._rows: slice | None = None

    def next_batch(self, batch: Any) -> None:
        B = batch.input_ids.shape[0]
        self._rows = slice(self._start, self._start + B)
        self._start += B

    def _slot(self, name: str, B: int, k: int, like: Any) -> Any:
        import torch

        t = self._sums.get(name)
        if t is None:
            t = self._sums[name] = torch.zeros(self.row_ids.shape[0], k, dtype=torch.float64, device=like.device)
        if t.shape[1] != k:
            raise MoetoolError(f"row sums '{name}': width {k} after {t.shape[1]}")
        return t[self._rows]

    def add(self, name: str, values: Any) -> None:
        if self._rows is None:
            raise MoetoolError("RowTable: call next_batch(batch) before each forward")
        B = self._rows.stop - self._rows.start
        v = values.double()
        if v.shape[0] != B:  # per token: [B*S(, k)] -> per row
            v = v.reshape(B, -1, *v.shape[1:]).sum(1)
        v = v.reshape(B, -1)
        slot = self._slot(name, B, v.shape[1], v)
        slot += v.to(slot.device)

    def add_counts(self, name: str, idx: Any, n: int, valid: Any) -> None:
        """Per-row counts of the ids ``idx [T, K]`` in ``0..n-1`` over the valid tokens (``[B, n]``)."""
        import torch

        from .ops import one_hot_counts

        B = self._rows.stop - self._rows.start
        row = torch.arange(B, device=idx.device).repeat_interleave(idx.shape[0] // B)  # [T] row of each token
        self.add(name, one_hot_counts(idx.long() + (row * n).unsqueeze(-1), B * n, valid).view(B, n))

    def reduce_across_ranks(self) -> None:
        """All-reduce (sum) the rows of every rank into a ``[N_global, k]`` table per name (alone: nothing)."""
        from . import distributed

        if distributed.world_size() <= 1:
            return
        import torch

        ids = self.row_ids
        top = ids.max().reshape(1) + 1 if ids.numel() else torch.zeros(1, dtype=torch.long)
        n = int(distributed.all_reduce(top, op="max").item())
        widths: dict[str, int] = {}  # a rank with no row recorded no name: the ranks agree on names and widths
        for part in distributed.gather_object({k: int(t.shape[1]) for k, t in self._sums.items()}):
            widths.update(part)
        for name in sorted(widths):
            t = self._sums.get(name)
            full = torch.zeros(n, widths[name], dtype=torch.float64, device=None if t is None else t.device)
            if t is not None:
                full.index_copy_(0, ids.to(t.device), t)
            self._sums[name] = distributed.all_reduce(full)
        self.row_ids = torch.arange(n)

    @property
    def names(self) -> list[str]:
        return sorted(self._sums)

    @property
    def n_rows(self) -> int:
        return int(self.row_ids.shape[0])

    def table(self, name: str) -> np.ndarray:
        t = self._sums.get(name)
        if t is None:
            raise MoetoolError(f"no per-row sums named '{name}' were recorded")
        out = t.cpu().numpy()
        return out[:, 0] if out.shape[1] == 1 else out

    interval = RowSums.interval


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def add_interval_columns(df: Any, name: str, intervals: Sequence[Interval]) -> Any:
    """Set ``name``, ``name_lo``, ``name_hi`` columns of ``df`` (one interval per row)."""
    if len(intervals) != len(df):
        raise MoetoolError(f"{len(intervals)} intervals for {len(df)} rows")
    df[name] = [i.value for i in intervals]
    df[f"{name}_lo"] = [i.lo for i in intervals]
    df[f"{name}_hi"] = [i.hi for i in intervals]
    return df


# ----- writing an interval --------------------------------------------------------------------------------
FRACTION_DIGITS = 3  # decimals of a fraction in a summary line: 0.005, 0.500, 1.000


def fraction_text(v: float, digits: int = FRACTION_DIGITS) -> str:
    """A fraction (a rate, share or proportion, as the CSVs store it) for a console line, in the CSV's unit, never
    as a percentage: ``digits`` decimals (``0.5`` -> ``"0.500"``, ``0.005`` -> ``"0.005"``); a nonzero value that
    would round to zero keeps two significant digits (``0.00042`` -> ``"0.00042"``, not a plausible ``"0.000"``);
    a missing value (NaN) is ``"nan"``."""
    v = float(v)
    if math.isnan(v):
        return "nan"
    if v != 0 and abs(v) < 0.5 * 10.0 ** -digits:
        return f"{v:.2g}" if abs(v) >= 1e-4 else f"{v:.2e}"
    return f"{v:.{digits}f}"


def format_ci(value: float, lo: float, hi: float, digits: int = 2) -> str:
    """``"0.512 ± 0.013"``: the value and the half-width ``(hi - lo) / 2`` of its interval, both rounded to the
    decimal place of the half-width's ``digits`` significant digits -- only where the interval is symmetric about the
    value within that rounding (``value ± half`` then gives each bound to half a unit of the last digit shown:
    ``|(hi - value) - (value - lo)|`` at most one unit). Any other interval is written as itself,
    ``"0.60 [0.39, 0.78]"`` (the Wilson interval of 12/20 is not ``0.60 ± 0.20``), as is a value outside its interval;
    a missing value (NaN) is ``""``; a missing interval gives the value alone."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return f"{value:.4g}"
    half = (hi - lo) / 2
    if half <= 0:
        return f"{value:.4g} ± 0"
    place = digits - 1 - math.floor(math.log10(half))  # decimals that keep `digits` significant digits of half
    dec = max(place, 0)
    below, above = value - lo, hi - value
    if min(below, above) < 0 or abs(above - below) > 10.0 ** -dec * (1 + 1e-9):  # not symmetric: the interval
        return f"{value:.{dec}f} [{lo:.{dec}f}, {hi:.{dec}f}]"
    return f"{value:.{dec}f} ± {half:.{dec}f}"


def with_ci(df: Any, digits: int = 2) -> Any:
    """A copy of ``df`` where every column ``c`` that has ``c_lo`` and ``c_hi`` beside it becomes the text
    ``value ± half-width``, or ``value [lo, hi]`` for an interval not symmetric about it (:func:`format_ci`; the
    value alone where the interval is NaN), ``_lo``/``_hi`` dropped. Columns without an interval are kept as they are."""
    out = df.copy()
    for c in list(df.columns):
        lo, hi = f"{c}_lo", f"{c}_hi"
        if lo in df.columns and hi in df.columns:
            if df[lo].isna().all():
                out = out.drop(columns=[lo, hi])
                continue
            out[c] = [format_ci(float(v), float(a), float(b), digits) for v, a, b in zip(df[c], df[lo], df[hi])]
            out = out.drop(columns=[lo, hi])
    return out
