"""``moetool stats``: how the model's own router uses its experts (load, entropies, co-activation,
per-domain load, top tokens per expert)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .trace_input import Trace, TraceConfig
from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      Layers, MaxTokens, Model, Out, Quantize, Quiet, Resume, Seed, SeqLen, echo_run, handle_errors,
                      parse_layers, preflight, start_run)

HELP = """Routing statistics of every MoE layer on --data, model's own router.

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
    neighbouring ranks as OLMoE's heatmaps, lower for K > 2)
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
estimate; the console prints value ± half-width.

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
(where the trace has token ids); no intervals, specialisation or figures.

Examples:
  moetool stats --out runs/stats-tiny
  moetool stats --model tiny-fine --top-tokens 20 --max-tokens 16384
  moetool stats --top-k 1 --coactivation adjacent  # as OLMoE (top-1)
  moetool stats --model mixtral-8x7b --data my.jsonl --device-map auto
"""


@handle_errors
def stats(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          top_tokens: int = typer.Option(10, "--top-tokens", min=0,
                                         help="Most frequent token ids listed per expert (0: skip top tokens)."),
          min_count: int = typer.Option(10, "--min-count", min=1,
                                        help="Minimum occurrences of a token id in specialization.csv and of a "
                                             "(token, expert) pair in top_tokens_lift.csv."),
          top_k: int = typer.Option(None, "--top-k", min=1, max=1,
                                    help="1: every table on each token's first-ranked expert only (OLMoE's "
                                         "*_top1). Default: the model's top-K."),
          coactivation: str = typer.Option("all", "--coactivation",
                                           help="all (default): count every ordered pair of the top-K (routed "
                                                "to both); adjacent: only neighbouring ranks, as OLMoE's "
                                                "heatmaps (lower for K > 2)."),
          all_tokens: bool = typer.Option(False, "--all-tokens",
                                          help="Write expert_tokens.parquet: every (layer, expert, token id) "
                                               "count, not truncated."),
          no_special_tokens: bool = typer.Option(False, "--no-special-tokens",
                                                 help="Tokenize without special tokens (default: the tokenizer's "
                                                      "own default, e.g. a BOS)."),
          layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 32768, batch_size: BatchSize = 8,
          dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
          bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, seed: Seed = 0, resume: Resume = False,
          quiet: Quiet = False, trace: Optional[Path] = Trace, trace_config: Optional[str] = TraceConfig) -> None:
    if trace is not None:  # recorded routing instead of a forward (commands/trace_input.py)
        from moetool.experiments.stats.compute import StatsOptions

        from .trace_input import refuse, stats_on_trace

        refuse({"--data": data, "--resume": resume, "--no-special-tokens": no_special_tokens, "--layers": layers})
        return stats_on_trace(trace, trace_config, StatsOptions(
            top_tokens=top_tokens, min_count=min_count, batch_size=batch_size, top_k=top_k,
            coactivation=coactivation, all_tokens=all_tokens, bootstrap=0, seed=seed), out, force)
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.stats.compute import StatsOptions, stats as compute
    from moetool.report.console import print_table

    opts = StatsOptions(top_tokens=top_tokens, min_count=min_count, batch_size=batch_size, top_k=top_k,
                        coactivation=coactivation, all_tokens=all_tokens, bootstrap=bootstrap, seed=seed,
                        layers=parse_layers(layers))
    started = start_run("stats", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
                        add_special_tokens=False if no_special_tokens else None, resume=resume,
                        units={**vars(opts), "no_special_tokens": no_special_tokens})
    run, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet, units=started.units)
    started.options["special_tokens"] = "none" if no_special_tokens else "tokenizer default"
    started.write(res)
    print_table(res.summary, title=f"{model}: {tokens.n_tokens:,} tokens", csv="layers.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(stats)
