"""Perplexity under a routing policy (SPEC §Routing policies): ``moetool ppl`` and the ``norm-select`` sweep.

The policy replaces routing in the chosen MoE layers during plain forwards of the packed rows
(:func:`moetool.engine.forward`); NLL sums and token counts are reduced on the device. Padding never counts.
With no policy the model runs unhooked (the reference a ``router`` run must reproduce exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..engine.hooks import Consumer, select_layers
from ..engine.runner import ForwardResult, forward
from .result import Result, resolve_options

#: ppl.csv columns, one row per run
PPL_COLUMNS = ("model", "data", "routing", "weights", "layers", "tokens", "nll_mean", "perplexity", "seconds")

PPL_DEFINITIONS = {
    "tokens": "scored next-token predictions: pairs of consecutive real (unpadded) tokens within a packed row",
    "nll_mean": "mean next-token negative log-likelihood in nats over those predictions (fp32 logits, "
                "float64 sums)",
    "perplexity": "exp(nll_mean)",
    "seconds": "wall time of the forward passes with the routing hooks installed",
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
        from ..policies import build_policy

        return build_policy(self.routing, self.weights, self.seed, sim=self.sim, causal=self.causal)


@dataclass(frozen=True)
class PplOptions(RoutingOptions):
    """Options of :func:`ppl`."""

    batch_size: int = 8


def data_name(path: str | Path | None) -> str:
    """Short name of ``--data`` for tables: the file/folder stem, ``heldout`` for the default."""
    return Path(path).stem if path else "heldout"


def perplexity(lm: Any, tokens: Any, *, policy: Any = None, policy_layers: Iterable[int] | None = None,
               consumers: Iterable[Consumer] = (), batch_size: int = 8, quiet: bool = False,
               description: str = "perplexity") -> ForwardResult:
    """Perplexity of ``lm`` on packed ``tokens`` with ``policy`` applied in ``policy_layers`` (one forward loop)."""
    return forward(lm, tokens, policy=policy, layers=policy_layers, consumers=consumers, batch_size=batch_size,
                   nll=True, quiet=quiet, description=description)


def ppl_frame(result: ForwardResult, *, model: str, data: str, routing: str, weights: str, layers: Any) -> Any:
    """One-row DataFrame with :data:`PPL_COLUMNS`."""
    import pandas as pd

    return pd.DataFrame([{
        "model": model, "data": data, "routing": routing, "weights": weights,
        "layers": "all" if layers is None else ",".join(str(i) for i in layers),
        "tokens": result.nll.tokens, "nll_mean": result.nll.mean, "perplexity": result.perplexity,
        "seconds": round(result.seconds, 3)}], columns=list(PPL_COLUMNS))


def ppl(lm: Any, tokens: Any, options: PplOptions | None = None, *, quiet: bool = False, **overrides: Any) -> Result:
    """Perplexity of ``lm`` on ``tokens`` with the ``routing`` policy in ``layers``.

    Table ``ppl`` (one row): model, data, routing, weights, layers, tokens, nll_mean, perplexity, seconds
    (see :data:`PPL_DEFINITIONS`).
    """
    opts = resolve_options(PplOptions, options, overrides)
    policy = opts.policy()
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    res = perplexity(lm, tokens, policy=policy, policy_layers=layers, batch_size=opts.batch_size, quiet=quiet)
    df = ppl_frame(res, model=lm.name, data=data_name(tokens.source), routing=policy.name,
                   weights=policy.weights or "-", layers=layers)
    return Result("ppl", {"ppl.csv": df}, opts,
                  meta=dict(definitions=PPL_DEFINITIONS, data=tokens.describe(), routing=policy.describe()),
                  summary=df[["weights", "layers", "tokens", "nll_mean", "perplexity", "seconds"]])
