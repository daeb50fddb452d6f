"""Routing statistics of every MoE layer on --data, model's own router.

Padding never counts; every definition is also in manifest.json.
  load.csv: layer, expert, load_fraction (share of all top-K assignments,
    sums to 1, uniform 1/n), token_fraction (share of tokens picking the
    expert, sums to K; f_e of the aux loss), router_prob (P_e: mean router
    probability), tokens (tokens picking the expert)
  layers.csv: layer, n_experts, top_k, tokens, load_entropy (nats, AoE
    Ent_load), load_entropy_norm (/ log n), confidence_entropy (mean entropy
    of each token's full routing distribution, AoE Ent_conf),
    confidence_entropy_norm, max_load_ratio (max load / (1/n)), aux_loss
    (n * sum f_e P_e, this layer), aux_loss_hf_pooled (pooled over layers as
    transformers' load_balancing_loss_func)
  coactivation.csv: layer, a, b, p_b_given_a, count (tokens picking a and b;
    --coactivation all = every ordered pair of the top-K, adjacent = only
    neighbouring ranks as OLMoE's heatmaps, lower for K > 2; layers with
    one expert per token, --top-k 1 or a top-1 router, have no rows)
  cross_layer.csv: layer, next_layer, a, b, count, p_b_given_a (P(b at the
    next MoE layer | a at this one), same token, every top-K x top-K pair);
    cross_layer_summary.csv: mean_max_p, uniform_max_p (K/n),
    mutual_information (nats, 0 = independent), _norm (/ log n)
  specialization.csv: layer, view (input, next_token, predicted), token_ids,
    specialization (OLMoE sec. 5: mean over token ids with >= --min-count
    occurrences of the share routed to the token's most frequent
    first-ranked expert), token_ids_all, specialization_all_ids;
    specialized_tokens.csv: the most specialised token ids per expert
  domain_load.csv: layer, domain, expert, load_fraction, token_fraction
    (K x load), uniform_token_fraction (K/n), tokens (if domains)
  top_tokens.csv: layer, expert, rank, token_id, token, count, share (count /
    the token's occurrences); top_tokens_lift.csv: the same ranked by lift =
    P(expert | token) / P(expert), plus lift, pairs with count >= --min-count
  expert_tokens.parquet (--all-tokens): layer, expert, token_id, count for
    every pair seen
  figures/ (PNG and PDF): figures/load_heatmap (load / uniform per layer and
    expert), figures/coactivation (P(b | a) per layer), figures/balance_by_layer
    (max load ratio and normalised load entropy per layer, 95% error bars),
    figures/domain_load (per-domain token fraction with the K/n line; if
    domains), figures/specialization (per layer and view), figures/cross_layer
    (P(b at the next layer | a) heatmaps).
Intervals: load_fraction, token_fraction, load_entropy_norm,
confidence_entropy_norm and max_load_ratio get *_lo/*_hi (95% document-level
bootstrap over packed rows, --bootstrap N replicates seeded by --seed, 0 =
off): percentile intervals, but BCa (bias-corrected) for max_load_ratio and
load_entropy_norm, which are biased under resampling, widened to include the
estimate; the console prints value ± half-width (value [lo, hi] where the interval is not
symmetric).

Special tokens follow the tokenizer's default (a BOS where it adds one);
--no-special-tokens adds none. The choice is in manifest.json (data).

--resume (with the --out of an interrupted run, same options): the
accumulators saved after a batch (at most once a minute, and after the
last) are restored and the forward goes on from the next batch: the same
tables as an uninterrupted run.

--trace PATH (a moetool trace or import-trace run, see import-trace) reads the
routing from there instead of a forward: load.csv (without router_prob),
layers.csv (without the confidence entropy and aux loss: they need the router's
probabilities, which the engines do not record), coactivation.csv (per-token
traces; none from counts-only dumps), top_tokens.csv and top_tokens_lift.csv
(where the trace has token ids), and the figures of those tables (load_heatmap,
coactivation, balance_by_layer); no intervals, specialisation, domain or
cross-layer tables.

Examples:
  moetool stats --out runs/stats-tiny
  moetool stats --model tiny-fine --top-tokens 20 --max-tokens 16384
  moetool stats --coactivation adjacent  # OLMoE's co-activation heatmaps
  moetool stats --top-k 1  # OLMoE's *_top1 tables (no co-activation)
  moetool stats --model mixtral-8x7b --data my.jsonl --device-map auto
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...context import flag
from ...errors import MoetoolError
from ..experiment import Demo, Flag, experiment, option


@dataclass(frozen=True)
class StatsOptions:
    """Options of :func:`~moetool.experiments.stats.compute.stats` (the manifest's options), each with the flag of
    ``moetool stats`` that sets it."""

    top_tokens: int = option(10, "--top-tokens", "Most frequent token ids listed per expert (0: skip top tokens).",
                             min=0)  # also specialized_tokens.csv
    min_count: int = option(10, "--min-count", "Minimum occurrences of a token id in specialization.csv and of a "
                            "(token, expert) pair in top_tokens_lift.csv.", min=1)
    batch_size: int = 8  # rows per forward
    top_k: int | None = option(None, "--top-k", "1: every table on each token's first-ranked expert only (OLMoE's "
                               "*_top1). Default: the model's top-K.", kind="int", min=1, max=1)
    coactivation: str = option("all", "--coactivation", "all (default): count every ordered pair of the top-K "
                               "(routed to both); adjacent: only neighbouring ranks, as OLMoE's heatmaps (lower for "
                               "K > 2).")
    all_tokens: bool = option(False, "--all-tokens", "Write expert_tokens.parquet: every (layer, expert, token id) "
                              "count, not truncated.")
    specialization: bool = True  # vocabulary specialisation tables (three views)
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap (0 = no intervals)
    seed: int = 0  # seeds the bootstrap's row weights
    layers: tuple[int, ...] | None = None  # MoE layers measured (None: every MoE layer)

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot
        from ..specialization import COACTIVATION

        if self.top_tokens < 0:
            raise MoetoolError(f"--top-tokens must be >= 0, got {self.top_tokens}")
        if self.min_count < 1:
            raise MoetoolError(f"--min-count must be >= 1, got {self.min_count}")
        if self.batch_size < 1:
            raise MoetoolError(f"{flag('batch_size')} must be >= 1, got {self.batch_size}")
        if self.top_k not in (None, 1):
            raise MoetoolError(f"--top-k must be 1 (first-ranked expert) or unset (the model's top-K), got {self.top_k}")
        if self.coactivation not in COACTIVATION:
            raise MoetoolError(f"--coactivation must be one of {', '.join(COACTIVATION)}, got '{self.coactivation}'")
        check_n_boot(self.bootstrap)


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "load_heatmap": ("Expert load relative to uniform routing (load_fraction × n), one row per layer and one column "
                     "per expert; 1 (white) is balanced, red above, blue below", ("load.csv",), ("load_fraction",)),
    "coactivation": ("P(b | a) per layer: of the tokens whose top-K contains expert a (row), the share whose top-K "
                     "also contains expert b (column); the title gives independent uniform routing's (K-1)/(n-1)",
                     ("coactivation.csv", "layers.csv"), ("coactivation",)),
    "balance_by_layer": ("Per layer: the largest expert load over uniform (left) and load entropy / log n (right); "
                         "1 is perfectly balanced; error bars: the bootstrap interval", ("layers.csv",),
                         ("max_load_ratio", "load_entropy", "*_lo/*_hi")),
    "domain_load": ("Per layer: the share of each domain's tokens routed to each expert (one bar per domain); "
                    "dashed: uniform routing's K/n", ("domain_load.csv",), ("domain_load",)),
    "specialization": ("Vocabulary specialisation per layer, one line per view (input token, next token, predicted "
                       "token): the share of a token's occurrences routed to its most frequent first-ranked expert",
                       ("specialization.csv",), ("specialization",)),
    "cross_layer": ("P(expert b at the next MoE layer | expert a at this one), one heatmap per pair of consecutive "
                    "layers, with their mutual information", ("cross_layer.csv", "cross_layer_summary.csv"),
                    ("cross_layer", "cross_layer_summary")),
}

#: the types a ``--resume`` unit checkpoint of this experiment may hold (:mod:`moetool.checkpoints`)
CHECKPOINT_TYPES = (
    "moetool.experiments.stats.compute.Collected",
    "moetool.experiments.stats.compute.RoutingStats",
    "moetool.experiments.stats.compute.LayerAccumulator",
    "moetool.experiments.specialization.VocabSpecialization",
    "moetool.experiments.specialization.CrossLayer",
    "moetool.experiments.specialization.LoadBalance",
)

SPEC = experiment("stats", "stats", "StatsOptions", figures="moetool.experiments.stats.figures:stats_figures",
                  demo=Demo(seq_len=256, max_tokens=8192, tokens={"add_special_tokens": None}),
                  order=10,
                  groups=("resume", "trace"), bootstrap=True, defaults={"max_tokens": 32768}, title="routing statistics",
                  summary_csv="layers.csv",
                  flags=(Flag("--no-special-tokens", "bool", False, "Tokenize without special tokens (default: the "
                              "tokenizer's own default, e.g. a BOS).", to_options=False),),
                  captions=CAPTIONS, checkpoint_types=CHECKPOINT_TYPES, special_tokens=None)
