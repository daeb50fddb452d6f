"""Shared by the experiments that run the model under a routing policy or score its perplexity (ppl, topk,
capacity, prune, super-experts, norm-select; agreement, margin, placement, expert-similarity and locality use
:func:`data_name`): :class:`RoutingOptions` (how routing is replaced, defined in :mod:`.experiment` with the spec
types and re-exported here; trace and eval route with it), :func:`perplexity` (one forward loop, per-row sums for
the bootstrap), :func:`ppl_intervals`, :func:`ppl_columns` (a perplexity table's columns of one run),
:func:`data_name`, :func:`zero_computation_meta` (capacity, prune, expert-similarity) and the one meaning of
``scored_tokens`` (:data:`SCORED_TOKENS`).

The policy replaces routing in the chosen MoE layers during plain forwards of the packed rows
(:func:`moetool.engine.forward`); NLL sums and token counts are reduced on the device. Padding never counts.
With no policy the model runs unhooked (only the NaN/inf guard's read-only hooks: the reference a ``router`` run
must reproduce exactly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..engine.hooks import Consumer
from ..engine.runner import ForwardResult, forward
from ..errors import MoetoolError
from .experiment import RoutingOptions  # noqa: F401 - the routing options every policy-taking experiment shares
from ..uncertainty import DEFAULT_BOOTSTRAP, ppl_ratio_interval, ratio_intervals

#: the one meaning of ``scored_tokens`` in every perplexity table (ppl, topk, capacity, prune, super-experts);
#: ``tokens`` is always real (unpadded) tokens routed (by the layer, or to the expert on a per-expert row)
SCORED_TOKENS = ("scored next-token predictions, what the perplexity averages over: pairs of consecutive real "
                 "(unpadded) tokens within a packed row, so one fewer than the row's real tokens (encoder-decoder "
                 "models: every real token of the row, each a target of the decoder)")


def data_name(path: str | Path | None) -> str:
    """Short name of ``--data`` for tables: the file/folder stem, ``heldout`` for the default."""
    return Path(path).stem if path else "heldout"


def zero_computation_meta(layers: Iterable[Any], key: str) -> dict[str, Any]:
    """``{key: {layer: count}}`` of the chosen MoE layers with zero-computation experts (``n_zero_compute``:
    LongCat-Flash's identity experts, Zaya's skip), for a manifest that says they were left out; ``{}`` if none."""
    zero = {L.index: L.n_zero_compute for L in layers if L.n_zero_compute}
    return {key: zero} if zero else {}


def perplexity(lm: Any, tokens: Any, *, policy: Any = None, policy_layers: Iterable[int] | None = None,
               consumers: Iterable[Consumer] = (), batch_size: int = 8, quiet: bool = False,
               description: str = "perplexity", rows: Any = None) -> ForwardResult:
    """Perplexity of ``lm`` on packed ``tokens`` with ``policy`` applied in ``policy_layers`` (one forward loop).

    ``rows`` (a :class:`moetool.uncertainty.RowTable` over ``tokens``, which must then be a shard from
    :func:`moetool.distributed.shard` under a distributed launch) receives per-row ``nll`` sums and ``scored``
    counts (and whatever ``consumers`` add to it); it is reduced across ranks at the end and returned as
    ``result.rows``. The NLL is then their sum (the same float64 per-token values).
    """
    if rows is None:
        return forward(lm, tokens, policy=policy, layers=policy_layers, consumers=consumers, batch_size=batch_size,
                       nll=True, quiet=quiet, description=description)
    from ..engine.runner import NLL

    def per_row(nll: Any, scored: Any) -> None:
        rows.add("nll", nll)
        rows.add("scored", scored)

    res = forward(lm, tokens, policy=policy, layers=policy_layers, consumers=consumers, batch_size=batch_size,
                  before_batch=rows.next_batch, per_row_nll=per_row, quiet=quiet, description=description)
    rows.reduce_across_ranks()
    res.nll = NLL(float(rows.table("nll").sum()), int(rows.table("scored").sum()))
    res.rows = rows
    return res


def ppl_intervals(run: ForwardResult, base: ForwardResult | None = None, *, n_boot: int = DEFAULT_BOOTSTRAP,
                  seed: int = 0) -> dict[str, Any]:
    """``perplexity`` (and, with the router ``base`` run over the same rows, ``ratio``) with bootstrap intervals
    from the runs' per-row sums: ``{perplexity, perplexity_lo, perplexity_hi[, ratio, ratio_lo, ratio_hi]}``. The
    base itself (``run is base``) has ratio 1 and, where the perplexity has an interval, the interval [1, 1] (every
    resample's ratio is 1); NaN like the others with ``n_boot=0``."""
    import math

    import numpy as np

    nll, scored = run.rows.table("nll"), run.rows.table("scored")
    if not scored.sum():  # real tokens, but none followed by a real token in its row: no perplexity to speak of
        raise MoetoolError("no next-token prediction to score: no row has two consecutive real tokens (an "
                           "attention_mask with a gap after every real token, or rows of one real token)")
    from ..engine.runner import NLL

    for r in (run, base):  # a mean NLL whose exp is past float64: NLL.ppl's one line, before an exp here warns
        if r is not None:  # (the rows' sums: perplexity()'s own NLL of a run with rows)
            NLL(float(r.rows.table("nll").sum()), int(r.rows.table("scored").sum())).ppl
    kw = dict(n_boot=n_boot, seed=seed)  # one row: no interval (uncertainty.replicates)
    out = ratio_intervals(nll, scored, transform=np.exp, **kw)[0].columns("perplexity")
    if base is run:
        one = float("nan") if math.isnan(out["perplexity_lo"]) else 1.0
        out.update(ratio=1.0, ratio_lo=one, ratio_hi=one)
    elif base is not None:
        if not np.array_equal(base.rows.table("scored"), scored):
            raise MoetoolError("the baseline scored different tokens: no paired ratio")
        out.update(ppl_ratio_interval(nll, base.rows.table("nll"), scored, **kw).columns("ratio"))
    return out


def ppl_columns(run: ForwardResult, base: ForwardResult | None = None, *, n_boot: int, seed: int,
                between: dict[str, Any] | None = None) -> dict[str, Any]:
    """A perplexity table's columns of one run (ppl, topk, capacity, prune, super-experts), in their order:
    ``perplexity, perplexity_lo, perplexity_hi, *between, ratio, ratio_lo, ratio_hi``. The values are the
    forwards' own (``run.perplexity``, ``run.perplexity / base.perplexity``; NaN without a ``base``), the bounds
    :func:`ppl_intervals`' of the same ``run`` and ``base`` (``n_boot`` resamples, ``seed``; NaN where it gives
    none: ``n_boot=0``, one row, no ``base``), computed here: one call, so no table gets another pair's bounds or
    none. ``between``: the columns a table places between the two (capacity's ``router_perplexity``,
    super-experts' ``delta_ppl``)."""
    nan = float("nan")
    ci = ppl_intervals(run, base, n_boot=n_boot, seed=seed)
    return {"perplexity": run.perplexity, "perplexity_lo": ci.get("perplexity_lo", nan),
            "perplexity_hi": ci.get("perplexity_hi", nan), **(between or {}),
            "ratio": run.perplexity / base.perplexity if base is not None else nan,
            "ratio_lo": ci.get("ratio_lo", nan), "ratio_hi": ci.get("ratio_hi", nan)}
