"""Expert offloading analysis from the model's real routing (one forward, the router's own choices).

Activation coverage: fraction of (layer, expert) slots activated by the first N real tokens (rows in data order,
padding skipped); per layer the hottest expert's share of the T·K activations against uniform 1/n.
Cache simulation: per MoE layer a cache of C experts serves the token stream; a token requests its K experts
together (none of them is evicted for another; K <= C <= n); hit = expert resident before the token; hit rate =
hits / (T·K requests), caches start empty. lru: evict the least recently requested; lfu: fewest requests so far
(ties: LRU); belady: next request furthest ahead (optimal offline bound). Bytes moved per token = misses per
token × one expert's bytes (gate, up, down, biases × their dtype's bytes).
Next-layer prediction: layer ℓ+1's routing applied to pre_router_norm_{ℓ+1}(x_ℓ) (what its MoE block reads of
the stream when attention adds nothing: post_attention_layernorm, pre_feedforward_layernorm with sandwich norms,
the stream itself with post-norms; layers whose block reads a mix of streams are refused), x_ℓ the output of
decoder layer ℓ (what a prefetcher can compute a layer ahead; --no-predict-norm: to x_ℓ itself); top-1 recall =
predicted top-1 == layer ℓ+1's real top-1 (the top-1: the routing decision, the chosen expert ranked first by the
router's selection scores -- a correction bias included, before any per-expert scale --, not the largest weight);
top-K recall = |predicted ∩ chosen| / K.
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N replicates, 0 = off).
Memory: one [T, K] int16 request trace per layer is kept for the simulation (T bounded by --max-tokens).

Writes offload_coverage.csv, offload_layers.csv, offload_cache.csv (layer, policy, capacity, requests, hits,
hit_rate, hit_rate_lo, hit_rate_hi, misses_per_token, bytes_per_token), offload_prefetch.csv (layer,
source_layer, tokens, top1_recall, topk_recall with _lo/_hi; none when --layers names only a first MoE layer,
which has no layer ahead), figures/offload_hit_rate_vs_cache_size,
figures/offload_prefetch_recall, figures/offload_coverage, manifest.json (definitions).

--trace PATH (a moetool trace or import-trace run) simulates the caches on the first --max-tokens tokens of
recorded routing instead of a forward: offload_coverage.csv, offload_layers.csv and offload_cache.csv without
expert_bytes / bytes_per_token (an expert's bytes depend on the serving precision); no offload_prefetch.csv (the
prediction needs a forward's hidden states); figures/offload_hit_rate_vs_cache_size and
figures/offload_coverage, not figures/offload_prefetch_recall.

Examples:
  moetool offload --out runs/offload-tiny
  moetool offload --trace runs/vllm-trace --max-tokens 100000 --policies lru,belady
  moetool offload --model tiny-fine --capacity 2,3,4,6 --policies lru,belady --bootstrap 0
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

POLICIES = ("lru", "lfu", "belady")


@dataclass(frozen=True)
class OffloadOptions:
    """Options of :func:`~moetool.experiments.offload.compute.offload`, each with the flag of ``moetool offload``
    that sets it."""

    # cache sizes C (None: K, 2K, n/4, n/2, 3n/4, n within [K, n])
    capacities: tuple[int, ...] | None = option(None, "--capacity", "Cache sizes C (experts per layer), "
                                                "comma-separated; default K, 2K, n/4, n/2, 3n/4, n within [K, n].",
                                                kind="ints", short="-C")
    policies: tuple[str, ...] = option(POLICIES, "--policies", "Cache policies: lru, lfu, belady.")
    # N of coverage(N) (None: powers of 4 from 16, and T)
    coverage_tokens: tuple[int, ...] | None = option(None, "--coverage-tokens", "N of coverage(N), comma-separated "
                                                     "(default powers of 4 from 16, and all tokens).", kind="ints")
    # apply layer ℓ+1's norm before its MoE block (MoELayer.pre_router_norm) to x_ℓ before its router
    predict_norm: bool = option(True, "--predict-norm", "Apply layer ℓ+1's norm before its MoE block "
                                "(what its router reads of the stream: MoELayer.pre_router_norm) to x_ℓ before its "
                                "router; layers whose router reads no norm of one stream are refused.")
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap (0 = no intervals)
    seed: int = 0
    batch_size: int = 8
    layers: tuple[int, ...] | None = None  # MoE layers analysed (None: every MoE layer)

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise MoetoolError(f"--policies {bad[0] if bad else ''!r}: choose from {', '.join(POLICIES)}")
        if self.capacities is not None and (not self.capacities or min(self.capacities) < 1):
            raise MoetoolError("--capacity values must be >= 1")
        if self.coverage_tokens is not None and (not self.coverage_tokens or min(self.coverage_tokens) < 1):
            raise MoetoolError("--coverage-tokens values must be >= 1")
        check_n_boot(self.bootstrap)


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
                  order=60,
                  groups=("trace",), bootstrap=True,
                  captions=CAPTIONS)
