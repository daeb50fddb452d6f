"""The spec of ``moetool offload`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "offload_hit_rate_vs_cache_size": ("Per layer: expert-cache hit rate against the cache size C, one line per "
                                       "eviction policy; error bars: the bootstrap interval",
                                       ("offload_cache.csv",), ("hit_rate", "policy")),
    "offload_prefetch_recall": ("Per layer: recall of the next layer's experts predicted from this layer's output "
                                "(top-1 and top-K)", ("offload_prefetch.csv",), ("top1_recall", "topk_recall")),
    "offload_coverage": ("Share of (layer, expert) slots activated by the first N tokens",
                         ("offload_coverage.csv",), ("coverage",)),
}

SPEC = experiment("offload", "offload", "OffloadOptions", figures="moetool.experiments.offload.figures:offload_figures",
                  demo=Demo(max_tokens=2048),
                  order=60, captions=CAPTIONS)
