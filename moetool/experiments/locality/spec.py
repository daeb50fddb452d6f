"""Routing locality: how often consecutive tokens go to the same experts, per MoE layer.

For every pair of consecutive real tokens of a packed row (t-1, t) under the model's own routing: top1_repeat, the
share of pairs whose first-choice expert (the top-1: the chosen expert ranked first by the router's selection scores) is the same, and
topk_overlap, the mean share of token t's top-K experts that token t-1 also chose. Beside them what they would be
without locality: top1_repeat_independent, the chance two tokens drawn independently from the layer's own
first-choice load share their first choice (sum_e f_e^2, f_e = the share of real tokens whose first choice is e),
and the uniform router's 1/n and K/n. Mixtral's routing analysis reports the first of these (Jiang et al. 2024,
"Mixtral of Experts", arXiv 2401.04088, sec. 5: consecutive tokens assigned the same first-choice expert against
the 1/8 of random assignment); locality above the independent figure is what an expert cache or prefetcher can use
(moetool offload measures the caches themselves). Rows are packed, so a pair can straddle a document boundary.

Writes locality.csv (layer, n_experts, top_k, tokens, pairs, top1_repeat, top1_repeat_independent,
top1_repeat_uniform, topk_overlap, topk_overlap_uniform) and manifest.json (definitions).

Examples:
  moetool locality
  moetool locality --model tiny-fine --layers 1 --max-tokens 4096
"""

from __future__ import annotations

from dataclasses import dataclass

from ...context import flag
from ...errors import MoetoolError
from ..experiment import Demo, experiment


@dataclass(frozen=True)
class LocalityOptions:
    """Options of :func:`~moetool.experiments.locality.compute.locality` (no flags of its own: ``--layers``,
    ``--batch-size`` and ``--seed`` are the standard flags)."""

    layers: tuple[int, ...] | None = None  # MoE layers measured (None: every MoE layer)
    batch_size: int = 8
    seed: int = 0  # nothing here is random; recorded for the manifest like every experiment's seed

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise MoetoolError(f"{flag('batch_size')} must be >= 1, not {self.batch_size}")


SPEC = experiment("locality", "locality", "LocalityOptions", title="routing locality of consecutive tokens",
                  demo=Demo(max_tokens=2048), order=155)
