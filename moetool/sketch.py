"""Bounded-memory summaries of per-token values (the one home of streaming sketches).

Memory flat in the number of tokens, updates on the device (no host synchronisation: no ``.item()``, no
boolean-mask indexing, no ``nonzero``), mergeable across batches and across ranks (``state()`` + ``REDUCE``:
the all-reduce operation of every state tensor; :func:`moetool.distributed.all_reduce_state` uses them).

* :class:`Moments` — exact count, sum, sum of squares (fp64): means and variances, no approximation.
* :class:`QuantileSketch` — quantiles (the median) of non-negative values from a fixed log-spaced histogram:
  ``bins`` equal bins of ``log x`` over ``[lo, hi]``, plus exact zeros, an underflow ``(0, lo)`` and an overflow
  ``(hi, inf]`` bin. **Error bound**: for a quantile whose order statistics fall inside ``[lo, hi]``, the
  estimate (each order statistic's bin replaced by its geometric centre, then numpy's linear interpolation
  between the two) is within a relative ``sqrt(g) - 1`` of the exact quantile (numpy ``np.quantile``
  default; the median is the mean of the two middle values), ``g = (hi/lo) ** (1/bins)``: about 0.17 % with
  the defaults (every positive fp32 value up to 1e4: 2^-149 .. 1e4, 32768 bins, 256 KiB; a confident router's
  margins and errors reach 1e-20 and below, which a range starting at 1e-8 or 1e-12 refused). Exact zeros stay
  exact. A quantile that falls in the
  underflow or overflow bin raises an error instead of a number off by an unknown factor; NaN, infinite or negative
  values raise too. The mean is exact (a :class:`Moments` rides along).
* :class:`SparseCounter` — exact counts of int64 keys (``stats``' (token id, expert) pairs): buffered on the
  device and merged with a sort whenever the buffer outgrows the running table; memory proportional to the
  distinct keys seen, amortised one sort per key. A merge synchronises (``torch.unique``), so a counter fed inside
  the forward defers its merges to :meth:`SparseCounter.settle`, called by its owner between forwards.
* :class:`TokenSpill` — per-token values that must be paired across passes (the same token's routing under
  two checkpoints): appended to a temporary file batch by batch and read back in the same batches, so host
  memory holds one batch, not the run.
"""

from __future__ import annotations

import bisect
import math
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from . import ops
from .errors import MoetoolError, write_error


class Moments:
    """Exact streaming count / sum / sum of squares (fp64, on the values' device)."""

    REDUCE = {"count": "sum", "sum": "sum", "sumsq": "sum"}

    def __init__(self, device: Any = None):
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.sum = torch.zeros((), dtype=torch.float64, device=device)
        self.sumsq = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add the values ``x`` (any shape); ``weight`` (same shape, e.g. a 0/1 padding mask) counts each one."""
        x = x.detach().double().reshape(-1)
        w = torch.ones_like(x) if weight is None else weight.detach().reshape(-1).to(x.dtype)
        self._to(x.device)
        self.count += w.sum()
        self.sum += (w * x).sum()
        self.sumsq += (w * x * x).sum()

    def _to(self, device: torch.device) -> None:
        if self.count.device != device:
            self.count, self.sum, self.sumsq = (ops.to_device(t, device) for t in (self.count, self.sum, self.sumsq))

    def merge(self, other: "Moments") -> "Moments":
        for k in self.REDUCE:
            setattr(self, k, getattr(self, k) + getattr(other, k).to(getattr(self, k).device))
        return self

    def state(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.REDUCE}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for k in self.REDUCE:
            setattr(self, k, state[k])

    @property
    def n(self) -> float:
        return float(self.count)

    @property
    def mean(self) -> float:
        n = float(self.count)
        return float(self.sum) / n if n else float("nan")

    @property
    def var(self) -> float:
        """Population variance (``np.var``); NaN if empty."""
        n = float(self.count)
        return max(float(self.sumsq) / n - (float(self.sum) / n) ** 2, 0.0) if n else float("nan")


#: the smallest positive fp32 value (a subnormal, 2^-149): the default lower end of a :class:`QuantileSketch`, so no
#: positive fp32 per-token value falls in its underflow bin
FP32_TINY = 2.0 ** -149


class QuantileSketch:
    """Log-binned histogram of non-negative values: quantiles within ``rel_error`` (module docstring)."""

    REDUCE = {"counts": "sum", "min": "min", "max": "max", "count": "sum", "sum": "sum", "sumsq": "sum"}

    def __init__(self, lo: float = FP32_TINY, hi: float = 1e4, bins: int = 1 << 15, device: Any = "cpu"):
        if not (0 < lo < hi) or bins < 1:
            raise ValueError("QuantileSketch needs 0 < lo < hi and bins >= 1")
        self.lo, self.hi, self.bins = float(lo), float(hi), int(bins)
        self._log_lo, self._log_span = math.log(lo), math.log(hi) - math.log(lo)
        # on the host until the first add() moves it to the values' device (device="cpu": explicit, not the default)
        # slots: 0 exact zeros, 1 underflow (0, lo), 2 .. bins+1 the log bins, bins+2 overflow, bins+3 invalid
        self.counts = torch.zeros(self.bins + 4, dtype=torch.long, device=device)
        self.min = torch.full((), math.inf, dtype=torch.float64, device=device)  # of positive values
        self.max = torch.full((), -math.inf, dtype=torch.float64, device=device)
        self.moments = Moments(device)

    @property
    def rel_error(self) -> float:
        """Bound on the relative error of a quantile inside ``[lo, hi]``."""
        return math.sqrt(math.exp(self._log_span / self.bins)) - 1

    def add(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Add values ``x``; ``weight`` (0/1, same shape) drops padding without boolean indexing."""
        x = x.detach().double().reshape(-1)
        if x.numel() == 0:  # a shape, not a value: no synchronisation
            return
        w = torch.ones_like(x, dtype=torch.long) if weight is None else weight.detach().reshape(-1).long()
        if self.counts.device != x.device:
            self.counts, self.min, self.max = (ops.to_device(t, x.device) for t in (self.counts, self.min, self.max))
        b = ((x.clamp_min(self.lo).log() - self._log_lo) * (self.bins / self._log_span)).floor()
        b = b.clamp(0, self.bins - 1).long() + 2
        b = torch.where(x > self.hi, self.bins + 2, b)
        b = torch.where(x < self.lo, 1, b)
        b = torch.where(x == 0, 0, b)
        b = torch.where(~torch.isfinite(x) | (x < 0), self.bins + 3, b)  # NaN, inf, negative: invalid
        self.counts.index_add_(0, b, w)
        pos = (x > 0) & (w > 0) & torch.isfinite(x)
        self.min = torch.minimum(self.min, torch.where(pos, x, math.inf).amin())
        self.max = torch.maximum(self.max, torch.where(pos, x, -math.inf).amax())
        self.moments.add(torch.where((w > 0) & torch.isfinite(x), x, 0.0), w)  # (nan_to_num read inf as 1.8e308)

    def merge(self, other: "QuantileSketch") -> "QuantileSketch":
        if (other.lo, other.hi, other.bins) != (self.lo, self.hi, self.bins):
            raise ValueError("cannot merge sketches of different ranges")
        self.counts = self.counts + other.counts.to(self.counts.device)
        self.min = torch.minimum(self.min, other.min.to(self.min.device))
        self.max = torch.maximum(self.max, other.max.to(self.max.device))
        self.moments.merge(other.moments)
        return self

    def state(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts, "min": self.min, "max": self.max, **self.moments.state()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.counts, self.min, self.max = state["counts"], state["min"], state["max"]
        self.moments.load_state(state)

    # ----- reading (host, once at the end) -------------------------------------------------------------
    @property
    def n(self) -> int:
        return int(self.counts[: self.bins + 3].sum())

    @property
    def mean(self) -> float:
        """Exact mean of the values added."""
        self._check()
        return self.moments.mean

    def _check(self) -> None:
        bad = int(self.counts[self.bins + 3])
        if bad:
            raise MoetoolError(f"{bad} NaN, infinite or negative value(s) reached a quantile sketch")

    def _order_stat(self, cum: list[int], rank: int) -> float:
        """Estimate of the ``rank``-th smallest value (0-based) from the cumulative slot counts."""
        slot = bisect.bisect_right(cum, rank)  # the first slot whose cumulative count exceeds rank (cum ascends)
        if slot == 0:
            return 0.0
        if slot in (1, self.bins + 2):  # a tail bin: known exactly only at its ends
            vmin, vmax = float(self.min), float(self.max)
            if vmin == vmax or (slot == 1 and rank == cum[0]):
                return vmin
            if slot == self.bins + 2 and rank == cum[-1] - 1:
                return vmax
            raise MoetoolError(f"a quantile falls outside the sketch's range [{self.lo:g}, {self.hi:g}] "
                               f"(values from {vmin:g} to {vmax:g})")
        k = slot - 2
        return math.exp(self._log_lo + (k + 0.5) * self._log_span / self.bins)

    def quantile(self, q: float) -> float:
        """``np.quantile(values, q)`` (linear interpolation) within ``rel_error``; NaN if empty."""
        self._check()
        n = self.n
        if n == 0:
            return float("nan")
        if not 0 <= q <= 1:
            raise ValueError("q must be in [0, 1]")
        cum = self.counts[: self.bins + 3].cumsum(0).tolist()
        pos = (n - 1) * q
        a, frac = int(math.floor(pos)), pos - math.floor(pos)
        va = self._order_stat(cum, a)
        return va if frac == 0 else va + frac * (self._order_stat(cum, a + 1) - va)

    def median(self) -> float:
        return self.quantile(0.5)


#: keys buffered before a merge (at least; a merge also waits until the buffer is as large as the table, so the
#: sorting stays amortised O(log) per key). Small on purpose: every (layer, view) of ``stats`` has its own counter,
#: and a 2^20 floor held up to 8 MiB of unmerged keys per counter (``stats --bootstrap 0`` peak RSS 705 -> 1153 MiB
#: from 200k to 1M tokens on the embedded model); with 2^16, ``python bench/bench.py --shapes --rss --commands
#: stats --rss-tokens 20000 200000 1000000`` prints 651 / 673 / 692 MiB, at the same speed.
MERGE_MIN = 1 << 16
#: a counter whose keys are known to lie in ``-1 .. space-1`` with ``space`` at most this counts them in a dense
#: int64 table (8 MiB at most; Mixtral's 8 experts x 32,000 token ids: 2 MiB): no sort, no host synchronisation
DENSE_KEYS = 1 << 20
#: the dense tables one owner's counters may hold together (:func:`dense_space`): 2^25 keys, 256 MiB (Mixtral-8x7B's
#: 32 layers x 3 views of ``stats``' specialisation: 24.6M keys)
DENSE_TOTAL = 1 << 25


def dense_space(space: int | None, counters: int) -> int | None:
    """The ``space`` to give each of ``counters`` counters of that key space: itself where their dense tables fit
    :data:`DENSE_KEYS` each and :data:`DENSE_TOTAL` together, else ``None`` (sparse)."""
    if space is None or not 0 < space <= DENSE_KEYS or space * max(counters, 1) > DENSE_TOTAL:
        return None
    return space


class SparseCounter:
    """Exact counts of int64 keys streamed in batches; memory proportional to the distinct keys seen.

    A merge is a ``torch.unique`` (its output size is the data's: a host synchronisation on a GPU). ``defer=True``:
    :meth:`add` never merges, the owner calls :meth:`settle` between forwards (a counter fed by routing events inside
    the forward: its merges wait until the forward is over instead of stalling it); memory then holds at most the
    keys of one forward beyond the merge threshold.

    ``space``: the keys lie in ``-1 .. space-1`` (-1: a key its owner drops). Up to :data:`DENSE_KEYS` the counts
    are one dense table on the keys' device (``index_add_``: no merge, no sort, no host synchronisation until
    :meth:`result`), the same :meth:`result` as the sparse table's; a key outside the space is an index error, never
    a miscount."""

    defer = False  # a counter saved (``--resume``) before the attribute existed merges as it did
    dense: torch.Tensor | None = None  # [space + 1] counts of keys -1 .. space-1 (None: the sparse table)
    space: int | None = None

    def __init__(self, merge_min: int = MERGE_MIN, defer: bool = False, space: int | None = None):
        self.merge_min = merge_min
        self.defer = defer
        self.space = dense_space(space, 1)
        self.keys: torch.Tensor | None = None  # [U] sorted unique keys
        self.counts: torch.Tensor | None = None  # [U] int64
        self._pending: list[torch.Tensor] = []
        self._pending_n = 0

    def add(self, keys: torch.Tensor) -> None:
        if self.space is not None:
            k = keys.reshape(-1).long()
            if self.dense is None:
                self.dense = torch.zeros(self.space + 1, dtype=torch.long, device=k.device)
            k = k.to(self.dense.device)
            self.dense.index_add_(0, k + 1, torch.ones_like(k))
            return
        self._pending.append(keys.reshape(-1).long())
        self._pending_n += keys.numel()
        if not self.defer:
            self.settle()

    def settle(self) -> None:
        """Merge the buffered keys once they outnumber ``merge_min`` and the running table (amortised one sort per
        key); a deferred counter's owner calls it outside the forward."""
        if self._pending_n >= max(self.merge_min, 0 if self.keys is None else self.keys.numel()):
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        keys = torch.cat(self._pending)  # [P]
        counts = torch.ones_like(keys)
        if self.keys is not None:
            keys = torch.cat([self.keys, keys.to(self.keys.device)])
            counts = torch.cat([self.counts, counts.to(self.keys.device)])
        self.keys, self.counts = ops.unique_counts(keys, counts)
        self._pending, self._pending_n = [], 0

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sorted unique keys [U], counts [U])``, both int64 on the device the keys came from."""
        if self.dense is not None:
            seen = self.dense.nonzero().squeeze(1)  # ascending
            return seen - 1, self.dense[seen]
        self._merge()
        if self.keys is None:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        return self.keys, self.counts

    def host_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``result()`` on the host (what ranks exchange under data parallelism)."""
        keys, counts = self.result()
        return keys.cpu(), counts.cpu()

    @classmethod
    def merged(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], merge_min: int = MERGE_MIN) -> "SparseCounter":
        """One counter holding the summed counts of ``parts`` (``host_state()`` of every rank)."""
        out = cls(merge_min)
        if parts:
            out.keys, out.counts = ops.unique_counts(torch.cat([k for k, _ in parts]), torch.cat([c for _, c in parts]))
        return out


class TokenSpill:
    """Tensors appended batch by batch to a temporary file and read back in the same batches (host memory:
    one batch). For per-token values that must be paired across passes over the same tokens."""

    def __init__(self, directory: str | Path | None = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="moetool-spill-", dir=directory)
        self.path = Path(self._tmp.name) / "spill.bin"
        self._fh = open(self.path, "wb")
        self._meta: list[tuple[tuple[int, ...], torch.dtype, int]] = []
        self.nbytes = 0

    def append(self, t: torch.Tensor) -> None:
        a = t.detach().cpu().contiguous()
        raw = a.reshape(-1).view(torch.uint8).numpy().tobytes() if a.numel() else b""
        self._io(self._fh.write, raw)
        self._meta.append((tuple(a.shape), a.dtype, len(raw)))
        self.nbytes += len(raw)

    def __len__(self) -> int:
        return len(self._meta)

    def _io(self, op: Any, *args: Any) -> Any:
        """A write to the spill file; an :class:`OSError` (a full ``TMPDIR``) names the file (exit 1)."""
        try:
            return op(*args)
        except OSError as e:
            raise write_error(e, self.path) from None

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._io(self._fh.flush)
        with open(self.path, "rb") as fh:
            for shape, dtype, size in self._meta:
                buf = bytearray(fh.read(size))
                flat = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
                yield flat.view(dtype).reshape(shape)

    def save(self, path: str | Path) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        """Copy the spilled bytes to ``path``; returns the layout :meth:`restore` needs (``--resume``)."""
        import shutil

        self._io(self._fh.flush)
        try:
            shutil.copyfile(self.path, path)
        except OSError as e:
            raise write_error(e, path) from None
        return list(self._meta)

    @classmethod
    def restore(cls, path: str | Path, layout: list[tuple[tuple[int, ...], torch.dtype, int]],
                directory: str | Path | None = None) -> "TokenSpill":
        """A spill holding a copy of what :meth:`save` wrote (further appends go after it)."""
        import shutil

        out = cls(directory)
        out._fh.close()
        shutil.copyfile(path, out.path)
        out._fh = open(out.path, "ab")
        out._meta = list(layout)
        out.nbytes = sum(size for _, _, size in out._meta)
        return out

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self._tmp.cleanup()

    def __enter__(self) -> "TokenSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
