"""Perplexity, mean next-token NLL and token count of --data with a routing policy applied.

--routing takes any policy: router (unchanged; reproduces the unhooked model exactly),
norm:<node>[:<norm>] (AoE: the K experts with the largest node norm; node gate|up|act|glu|output,
norm l2|l1|linf), random, topk:<k>, topp:<p>[:<kmax>], capacity:<cf>[:order|score],
prune:<criterion>:<fraction>[:<csv>], prune:file:<path>, similarity[:tau] and attention (each defined in the
README, Commands). Writes ppl.csv
(model, data, routing, weights, layers, scored_tokens, nll_mean, perplexity, router_perplexity,
ratio, seconds; *_lo/*_hi = 95% interval) and manifest.json. A policy other than router is compared with
the model's own routing on the same rows (ratio = perplexity / router_perplexity; --no-baseline
skips that second pass). Intervals: document-level bootstrap over packed rows (--bootstrap N,
paired for the ratio; 0 = off).

Examples:
  moetool ppl                                   # the router on the shipped held-out text
  moetool ppl --routing norm:gate --weights softmax
  moetool ppl --routing norm:output:l1 --layers 0-1 --max-tokens 4096
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ..experiment import RoutingOptions, experiment, option


@dataclass(frozen=True)
class PplOptions(RoutingOptions):
    """Options of :func:`~moetool.experiments.ppl.compute.ppl`: the routing (``--routing`` and its options, the
    routing flag group) and these."""

    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap (0 = no intervals)
    baseline: bool = option(True, "--baseline", "Also run the router on the same rows for the perplexity ratio "
                            "(policies other than router).")

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)

SPEC = experiment("ppl", "ppl", "PplOptions",
                  order=160,
                  groups=("routing",), bootstrap=True, defaults={"max_tokens": 32768})
