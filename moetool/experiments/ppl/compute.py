"""Perplexity under a routing policy: ``moetool ppl`` (the loop it shares with other experiments is
:mod:`moetool.experiments.routing`).

The policy replaces routing in the chosen MoE layers during plain forwards of the packed rows
(:func:`moetool.engine.forward`); NLL sums and token counts are reduced on the device. Padding never counts.
With no policy the model runs unhooked (the reference a ``router`` run must reproduce exactly).
"""

from __future__ import annotations

from typing import Any

from ...data import require_tokens
from ...engine.hooks import select_layers
from ...engine.runner import ForwardResult
from ...uncertainty import bootstrap_meta
from ..result import Result, resolve_options
from ..routing import SCORED_TOKENS, data_name, perplexity, ppl_columns
from .spec import PplOptions  # noqa: F401 - its options (declared with their flags in spec.py)

#: ppl.csv columns, one row per run
PPL_COLUMNS = ("model", "data", "routing", "weights", "layers", "scored_tokens", "nll_mean", "perplexity", "perplexity_lo",
               "perplexity_hi", "router_perplexity", "ratio", "ratio_lo", "ratio_hi", "seconds")

PPL_DEFINITIONS = {
    "model": "the model measured (--model: its name or path)",
    "data": "the text measured: --data's file or folder stem (heldout: the embedded default)",
    "routing": "the routing policy that ran in layers (--routing; router: the model's own)",
    "weights": "the weights given to the experts a norm policy chose (--weights: softmax, router or uniform); - for "
               "every other policy, which keeps its own",
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
    "layers": "decoder layers whose routing the policy replaced ('all' = every MoE layer); - for router, which "
              "replaces none (--layers then only checked)",
}


def ppl_frame(result: ForwardResult, *, model: str, data: str, routing: str, weights: str, layers: Any,
              base: ForwardResult | None = None, n_boot: int, seed: int) -> Any:
    """One-row DataFrame with :data:`PPL_COLUMNS` (``base``: the router run, NaN columns without it; the intervals
    :func:`~moetool.experiments.routing.ppl_columns`', ``n_boot`` resamples)."""
    import pandas as pd

    router = base.perplexity if base is not None else float("nan")
    row = {"model": model, "data": data, "routing": routing, "weights": weights,
           "layers": "-" if routing == "router" else "all" if layers is None else ",".join(str(i) for i in layers),
           "scored_tokens": result.nll.tokens, "nll_mean": result.nll.mean,
           **ppl_columns(result, base, n_boot=n_boot, seed=seed, between={"router_perplexity": router}),
           "seconds": round(result.seconds, 3)}
    return pd.DataFrame([row], columns=list(PPL_COLUMNS))


def ppl(lm: Any, tokens: Any, options: PplOptions | None = None, *, quiet: bool = False, **overrides: Any) -> Result:
    """Perplexity of ``lm`` on ``tokens`` with the ``routing`` policy in ``layers``.

    Table ``ppl`` (one row, :data:`PPL_COLUMNS`): model, data, routing, weights, layers, scored_tokens, nll_mean,
    perplexity, router_perplexity, ratio, seconds; ``perplexity`` and ``ratio`` (paired) with ``_lo``/``_hi`` (95%
    document-level bootstrap, NaN with ``bootstrap=0``); ``router_perplexity`` (the model's own routing on the same
    rows) and ``ratio`` are NaN when ``routing`` is ``router`` or ``baseline=False``. ``nll_mean`` is in nats per
    scored token, ``seconds`` the forwards' wall time (see :data:`PPL_DEFINITIONS`).
    """
    from ... import distributed
    from ...uncertainty import RowTable

    opts = resolve_options(PplOptions, options, overrides)
    require_tokens(tokens)
    policy = opts.policy()
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    shard = distributed.shard(tokens, opts.batch_size)  # alone: the same rows, numbered
    # the model's own routing runs unhooked: the router policy reproduces it bit for bit, at the hooks' cost
    res = perplexity(lm, shard, policy=None if policy.name == "router" else policy, policy_layers=layers,
                     batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard))
    base = None
    if opts.baseline and policy.name != "router":
        base = perplexity(lm, shard, batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard),
                          description="router baseline")
    df = ppl_frame(res, model=lm.name, data=data_name(tokens.source), routing=policy.name,
                   weights=policy.weights or "-", layers=layers, base=base, n_boot=opts.bootstrap, seed=opts.seed)
    return Result("ppl", {"ppl.csv": df}, opts,
                  meta=dict(definitions=PPL_DEFINITIONS, data=tokens.describe(), routing=policy.describe(),
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, res.rows.n_rows)),
                  summary=ppl_summary(df))


def summary_lines(name: str, res: Result) -> list[str]:
    """One line: the policy's perplexity with its interval on the scored tokens and, beside the router's
    baseline, their ratio with its (paired) interval -- the run's headline (the report page's first table)."""
    import math

    from ...uncertainty import format_ci

    r = res["ppl"].iloc[0]
    weights = f" ({r.weights} weights)" if r.weights != "-" else ""
    line = (f"ppl {name}: {r.routing}{weights} perplexity {format_ci(r.perplexity, r.perplexity_lo, r.perplexity_hi)} "
            f"on {int(r.scored_tokens):,} tokens")
    if not math.isnan(r.ratio):
        line += f", x{format_ci(r.ratio, r.ratio_lo, r.ratio_hi)} of the router's {r.router_perplexity:.4g}"
    return [line]


def ppl_summary(df: Any) -> Any:
    """The console row (``value ± half-width`` via :func:`moetool.uncertainty.with_ci`); the baseline's
    columns only when it ran."""
    from ...uncertainty import with_ci

    cols = ["weights", "layers", "scored_tokens", "nll_mean", "perplexity", "perplexity_lo", "perplexity_hi"]
    if df.router_perplexity.notna().any():
        cols += ["router_perplexity", "ratio", "ratio_lo", "ratio_hi"]
    return with_ci(df[cols + ["seconds"]]).rename(columns={"router_perplexity": "router"})
