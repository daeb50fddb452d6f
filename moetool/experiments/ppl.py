"""Perplexity under a routing policy (SPEC §Routing policies): ``moetool ppl`` and the ``norm-select`` sweep.

The policy runs through an :class:`~moetool.engine.hooks.Engine` around plain forwards of the
packed ``--data`` rows; NLL sums and token counts are reduced on the device
(:func:`moetool.engine.runner.run_batches`). Padding never counts. With ``policy=None`` the
model runs unhooked (the reference a ``router`` run must reproduce exactly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..engine.hooks import Consumer, Engine
from ..engine.runner import NLL, run_batches
from ..errors import MoetoolError

#: ppl.csv columns, one row per run
PPL_COLUMNS = ("model", "data", "routing", "weights", "layers", "tokens", "nll_mean", "perplexity", "seconds")


@dataclass
class PplResult:
    nll: NLL
    seconds: float  # wall time of the forward passes (hooks, policy and NLL reduction included)

    @property
    def perplexity(self) -> float:
        return self.nll.ppl


def build_policy(routing: str, weights: str = "softmax", seed: int = 0, **options: Any) -> Any:
    """``--routing`` + ``--weights`` (checked even when the policy ignores it) -> a policy object."""
    from ..policies import make_policy
    from ..policies.norm import WEIGHTS

    if weights not in WEIGHTS:
        raise MoetoolError(f"unknown --weights '{weights}' (choose from {', '.join(WEIGHTS)})")
    return make_policy(routing, weights=weights, seed=seed, **options)


def describe_policy(policy: Any) -> Any:
    """The policy's own description for the manifest (its name, and its options when it has them)."""
    return {"name": policy.name, **policy.describe()} if hasattr(policy, "describe") else {"name": policy.name,
            **({"weights": policy.weights} if hasattr(policy, "weights") else {})}


def data_name(path: str | Path | None) -> str:
    """Short name of ``--data`` for tables: the file/folder stem, ``heldout`` for the default."""
    return Path(path).stem if path else "heldout"


def perplexity(lm: Any, tokens: Any, *, policy: Any = None, policy_layers: Iterable[int] | None = None,
               consumers: Iterable[Consumer] = (), batch_size: int = 8, quiet: bool = False,
               description: str = "perplexity") -> PplResult:
    """Perplexity of ``lm`` on packed ``tokens`` with ``policy`` applied in ``policy_layers``.

    ``policy=None`` and no consumers: no hook is installed at all (the unhooked reference).
    """
    import torch

    consumers = list(consumers)
    t0 = time.perf_counter()
    with torch.no_grad():
        if policy is None and not consumers:
            nll = run_batches(lm.model, tokens.batches(batch_size), total=tokens.n_batches(batch_size), nll=True,
                              description=description, quiet=quiet)
        else:
            with Engine(lm.model, lm.layers, policy=policy, policy_layers=policy_layers, consumers=consumers):
                nll = run_batches(lm.model, tokens.batches(batch_size), total=tokens.n_batches(batch_size),
                                  nll=True, description=description, quiet=quiet)
    return PplResult(nll, time.perf_counter() - t0)


def ppl_frame(result: PplResult, *, model: str, data: str, routing: str, weights: str, layers: Any) -> Any:
    """One-row DataFrame with :data:`PPL_COLUMNS`."""
    import pandas as pd

    return pd.DataFrame([{
        "model": model, "data": data, "routing": routing, "weights": weights,
        "layers": "all" if layers is None else ",".join(str(i) for i in layers),
        "tokens": result.nll.tokens, "nll_mean": result.nll.mean, "perplexity": result.perplexity,
        "seconds": round(result.seconds, 3)}], columns=list(PPL_COLUMNS))


PPL_DEFINITIONS = {
    "tokens": "scored next-token predictions: pairs of consecutive real (unpadded) tokens within a packed row",
    "nll_mean": "mean next-token negative log-likelihood in nats over those predictions (fp32 logits, "
                "float64 sums)",
    "perplexity": "exp(nll_mean)",
    "seconds": "wall time of the forward passes with the routing hooks installed",
    "layers": "decoder layers whose routing the policy replaced ('all' = every MoE layer)",
}
