"""Expert capacity and token dropping: which assignments a capacity factor drops, and what it costs.

Per forward batch of --batch-size rows and MoE layer (--layers), each expert takes at most
C = ceil(cf * tokens * K / n) assignments, tokens = the batch's real (unpadded) tokens, n = the computed experts
(GShard, Switch Transformer; Megatron-LM's capacity). Zero-computation experts (LongCat-Flash's identity experts,
Zaya's skip expert) need no capacity: never dropped, left out of n, the assignments and capacity_experts.csv.
Assignments beyond C keep the model's expert but get weight 0: they contribute nothing (the token keeps its other experts, shared experts and the residual); padding never takes
capacity. --order order: an expert keeps its first C assignments in the batch's flattened token order (row 0
position by position, then row 1, ...); --order score: its C with the highest routing weight (ties: the earlier
token). Capacity depends on the batch: the same text in batches of other rows drops other assignments (under
torchrun each process's batches of --batch-size rows are the one-process batches, so the tables are the same).
cf >= n/K drops nothing (cf may be inf). The policy capacity:<cf>[:order|score] works in ppl, eval and trace
too (capacity per forward batch there as well).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes capacity.csv (cf, order, scored_tokens, perplexity, router_perplexity, ratio, assignments, dropped,
dropped_frac, tokens_dropped_all_frac; *_lo/*_hi), capacity_layers.csv (cf, order, layer, tokens, assignments,
capacity, dropped, dropped_frac, tokens_dropped_all, tokens_dropped_all_frac), capacity_experts.csv (cf, order,
layer, expert, load, capacity, dropped), figures/capacity_curve (dropped fraction and perplexity / the router's
vs cf), figures/capacity_layers (dropped fraction by layer, one line per cf) and manifest.json (definitions).

Examples:
  moetool capacity
  moetool capacity --model tiny-fine --cf 0.5,1,2 --order order,score --max-tokens 4096
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

DEFAULT_CFS = (0.5, 1.0, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class CapacityOptions:
    """Options of :func:`~moetool.experiments.capacity.compute.capacity`, each with the flag of ``moetool capacity``
    that sets it."""

    cfs: tuple[float, ...] = option(DEFAULT_CFS, "--cf", "Capacity factors, comma-separated (inf allowed).",
                                    shown="0.5,1,1.25,1.5,2", inf=True)  # capacity factors (inf allowed)
    orders: tuple[str, ...] = option(("order",), "--order", "Which assignments an expert keeps: order (the first in "
                                     "token order), score (the highest routing weight), or both: "
                                     "order,score.")  # drop orders: order | score
    layers: tuple[int, ...] | None = None  # MoE layers where capacity applies (None: every MoE layer)
    batch_size: int = 8  # rows per forward batch: capacity is per batch
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0

    def __post_init__(self) -> None:
        from ...policies.capacity import ORDERS
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if not self.cfs or any(not cf > 0 or math.isnan(cf) for cf in self.cfs):
            raise MoetoolError(f"--cf must be positive numbers (inf allowed), not {list(self.cfs)}")
        bad = [o for o in self.orders if o not in ORDERS]
        if not self.orders or bad:
            raise MoetoolError(f"--order must be among {', '.join(ORDERS)}, not {list(self.orders)}")

    def specs(self) -> list[tuple[float, str, str]]:
        """``(cf, order, policy spec)`` in the sweep's order."""
        from ...policies.base import number_text

        return [(cf, order, f"capacity:{number_text(cf)}:{order}") for order in self.orders for cf in self.cfs]


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "capacity_curve": ("Expert capacity C = ceil(cf · tokens · K / n) per batch and MoE layer: the share of the "
                       "model's assignments beyond capacity (left) and perplexity relative to the model's own "
                       "routing on the same rows with them dropped (right) against cf, one line per drop order; "
                       "error bars: the paired bootstrap interval; dotted: no change (ratio 1)", ("capacity.csv",),
                       ("cf", "order", "dropped_frac", "ratio", "*_lo/*_hi")),
    "capacity_layers": ("The share of assignments beyond expert capacity in each MoE layer, one line per capacity "
                        "factor and drop order", ("capacity_layers.csv",), ("cf", "dropped_frac")),
}

SPEC = experiment("capacity", "capacity", "CapacityOptions", figures="moetool.experiments.capacity.figures:capacity_figures",
                  demo=Demo(max_tokens=2048, options={"cfs": (0.5, 1.0, 2.0), "orders": ("order", "score")}),
                  bootstrap=True, title="capacity factor, dropped assignments and perplexity",
                  order=110, captions=CAPTIONS)
