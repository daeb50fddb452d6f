"""Perplexity under a routing policy: ``moetool ppl`` and the ``norm-select`` sweep.

The policy replaces routing in the chosen MoE layers during plain forwards of the packed rows
(:func:`moetool.engine.forward`); NLL sums and token counts are reduced on the device. Padding never counts.
With no policy the model runs unhooked (the reference a ``router`` run must reproduce exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ...engine.hooks import Consumer, select_layers
from ...engine.runner import ForwardResult, forward
from ...errors import MoetoolError
from ...uncertainty import DEFAULT_BOOTSTRAP, bootstrap_meta, check_n_boot, ppl_ratio_interval, ratio_intervals
from ..result import Result, resolve_options

#: ppl.csv columns, one row per run
PPL_COLUMNS = ("model", "data", "routing", "weights", "layers", "scored_tokens", "nll_mean", "perplexity", "perplexity_lo",
               "perplexity_hi", "router_perplexity", "ratio", "ratio_lo", "ratio_hi", "seconds")

#: the one meaning of ``scored_tokens`` in every perplexity table (ppl, topk, capacity, prune, super-experts);
#: ``tokens`` is always real (unpadded) tokens routed (by the layer, or to the expert on a per-expert row)
SCORED_TOKENS = ("scored next-token predictions, what the perplexity averages over: pairs of consecutive real "
                 "(unpadded) tokens within a packed row, so one fewer than the row's real tokens (encoder-decoder "
                 "models: every real token of the row, each a target of the decoder)")

PPL_DEFINITIONS = {
    "scored_tokens": SCORED_TOKENS,
    "nll_mean": "mean next-token negative log-likelihood in nats over those predictions (fp32 logits, "
                "float64 sums); encoder-decoder models (Switch Transformers): the model's own seq2seq loss with the "
                "row as both source and target -- the encoder reads the row, the decoder is teacher-forced on it "
                "shifted right (decoder_start_token_id first) and position t predicts token t: mean cross-entropy "
                "over the real target tokens, transformers' loss with labels = the row (padding -100)",
    "perplexity": "exp(nll_mean)",
    "seconds": "wall time of the forward passes with the routing hooks installed (the baseline's not included)",
    "router_perplexity": "perplexity of the model's own routing (unhooked) on the same rows (baseline; NaN when "
                         "routing is router or baseline=False)",
    "ratio": "perplexity / router_perplexity = exp(nll_mean - router nll_mean) (lower is better)",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows (moetool.uncertainty; "
                 "the ratio's is paired: one row weight applies to both runs); NaN with bootstrap=0",
    "layers": "decoder layers whose routing the policy replaced ('all' = every MoE layer)",
}


@dataclass(frozen=True)
class RoutingOptions:
    """How routing is replaced: a policy spec (``router`` = the model's own routing) and its options."""

    routing: str = "router"  # router | norm:<node>[:<norm>] | random | similarity[:tau] | attention
    weights: str = "softmax"  # weights of the experts a norm policy chose: softmax | router | uniform
    sim: str = "dot"  # similarity policy: dot | cosine
    causal: bool = True  # similarity policy: only tokens j <= i
    layers: tuple[int, ...] | None = None  # MoE layers whose routing is replaced (None: every MoE layer)
    seed: int = 0

    def policy(self) -> Any:
        from ...policies import build_policy

        return build_policy(self.routing, self.weights, self.seed, sim=self.sim, causal=self.causal)


@dataclass(frozen=True)
class PplOptions(RoutingOptions):
    """Options of :func:`ppl`."""

    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap (0 = no intervals)
    baseline: bool = True  # also run the router on the same rows (ratio column) when routing is not router

    def __post_init__(self) -> None:
        check_n_boot(self.bootstrap)


def data_name(path: str | Path | None) -> str:
    """Short name of ``--data`` for tables: the file/folder stem, ``heldout`` for the default."""
    return Path(path).stem if path else "heldout"


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
    from ...engine.runner import NLL

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
    from the runs' per-row sums: ``{perplexity, perplexity_lo, perplexity_hi[, ratio, ratio_lo, ratio_hi]}``."""
    import numpy as np

    nll, scored = run.rows.table("nll"), run.rows.table("scored")
    kw = dict(n_boot=n_boot if run.rows.n_rows >= 2 else 0, seed=seed)
    out = ratio_intervals(nll, scored, transform=np.exp, **kw)[0].columns("perplexity")
    if base is not None:
        if not np.array_equal(base.rows.table("scored"), scored):
            raise MoetoolError("the baseline scored different tokens: no paired ratio")
        out.update(ppl_ratio_interval(nll, base.rows.table("nll"), scored, **kw).columns("ratio"))
    return out


def ppl_frame(result: ForwardResult, *, model: str, data: str, routing: str, weights: str, layers: Any,
              base: ForwardResult | None = None, intervals: dict[str, Any] | None = None) -> Any:
    """One-row DataFrame with :data:`PPL_COLUMNS` (``base``: the router run; ``intervals``: :func:`ppl_intervals`;
    missing ones are NaN)."""
    import pandas as pd

    nan = float("nan")
    row = {"model": model, "data": data, "routing": routing, "weights": weights,
           "layers": "all" if layers is None else ",".join(str(i) for i in layers),
           "scored_tokens": result.nll.tokens, "nll_mean": result.nll.mean, "perplexity": result.perplexity,
           "perplexity_lo": nan, "perplexity_hi": nan,
           "router_perplexity": base.perplexity if base is not None else nan,
           "ratio": result.perplexity / base.perplexity if base is not None else nan, "ratio_lo": nan,
           "ratio_hi": nan, "seconds": round(result.seconds, 3)}
    row.update({k: v for k, v in (intervals or {}).items() if k.endswith(("_lo", "_hi"))})
    return pd.DataFrame([row], columns=list(PPL_COLUMNS))


def ppl(lm: Any, tokens: Any, options: PplOptions | None = None, *, quiet: bool = False, **overrides: Any) -> Result:
    """Perplexity of ``lm`` on ``tokens`` with the ``routing`` policy in ``layers``.

    Table ``ppl`` (one row): model, data, routing, weights, layers, tokens, nll_mean, perplexity, seconds
    (see :data:`PPL_DEFINITIONS`).
    """
    from ... import distributed
    from ...uncertainty import RowTable

    opts = resolve_options(PplOptions, options, overrides)
    policy = opts.policy()
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    shard = distributed.shard(tokens, opts.batch_size)  # alone: the same rows, numbered
    res = perplexity(lm, shard, policy=policy, policy_layers=layers, batch_size=opts.batch_size, quiet=quiet,
                     rows=RowTable(shard))
    base = None
    if opts.baseline and policy.name != "router":
        base = perplexity(lm, shard, batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard),
                          description="router baseline")
    ci = ppl_intervals(res, base, n_boot=opts.bootstrap, seed=opts.seed)
    df = ppl_frame(res, model=lm.name, data=data_name(tokens.source), routing=policy.name,
                   weights=policy.weights or "-", layers=layers, base=base, intervals=ci)
    return Result("ppl", {"ppl.csv": df}, opts,
                  meta=dict(definitions=PPL_DEFINITIONS, data=tokens.describe(), routing=policy.describe(),
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, res.rows.n_rows)),
                  summary=ppl_summary(df))


def ppl_summary(df: Any) -> Any:
    """The console row (``value ± half-width`` via :func:`moetool.uncertainty.with_ci`); the baseline's
    columns only when it ran."""
    from ...uncertainty import with_ci

    cols = ["weights", "layers", "scored_tokens", "nll_mean", "perplexity", "perplexity_lo", "perplexity_hi"]
    if df.router_perplexity.notna().any():
        cols += ["router_perplexity", "ratio", "ratio_lo", "ratio_hi"]
    return with_ci(df[cols + ["seconds"]]).rename(columns={"router_perplexity": "router"})
