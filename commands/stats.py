"""``moetool stats``: how the model's own router uses its experts (load, entropies, co-activation,
per-domain load, top tokens per expert)."""

from __future__ import annotations

import typer

from .options import (BatchSize, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force, MaxTokens, Model, Out, Quiet,
                      SeqLen, echo_run, handle_errors, run_options)

HELP = """Routing statistics of every MoE layer on --data, model's own router.

Padding never counts; every definition is also in manifest.json.
  load.csv: layer, expert, load_fraction (share of all top-K assignments,
    sums to 1, uniform 1/n), token_fraction (share of tokens picking the
    expert, sums to K), tokens (tokens picking the expert)
  layers.csv: layer, n_experts, top_k, tokens, load_entropy (nats, AoE
    Ent_load), load_entropy_norm (/ log n), confidence_entropy (mean entropy
    of each token's full routing distribution, AoE Ent_conf),
    confidence_entropy_norm, max_load_ratio (max load / (1/n))
  coactivation.csv: layer, a, b, p_b_given_a, count (tokens picking a and b)
  domain_load.csv: layer, domain, expert, load_fraction, tokens (if domains)
  top_tokens.csv: layer, expert, rank, token_id, token, count, share (count /
    the token's occurrences); top_tokens_lift.csv: the same ranked by lift =
    P(expert | token) / P(expert), plus lift, pairs with count >= --min-count
  figures/: load heatmap (load / uniform), co-activation, per-domain load.

Examples:
  moetool stats --out runs/stats-tiny
  moetool stats --model tiny-fine --top-tokens 20 --max-tokens 16384
  moetool stats --model mixtral-8x7b --data my.jsonl --device-map auto
"""


@handle_errors
def stats(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          top_tokens: int = typer.Option(10, "--top-tokens", min=0,
                                         help="Most frequent token ids listed per expert (0: skip top tokens)."),
          min_count: int = typer.Option(5, "--min-count", min=1,
                                        help="Minimum (token, expert) count for top_tokens_lift.csv."),
          seq_len: SeqLen = 256, max_tokens: MaxTokens = 32768, batch_size: BatchSize = 8,
          dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quiet: Quiet = False) -> None:
    from moetool.data import DocumentStream, load_tokens
    from moetool.experiments.stats import StatsOptions, stats as compute
    from moetool.loading import load
    from moetool.report import RunDir
    from moetool.report.console import print_table
    from moetool.report.writers import write

    opts = StatsOptions(top_tokens=top_tokens, min_count=min_count, batch_size=batch_size)
    DocumentStream(data)  # a missing --data fails before a model is loaded
    run = RunDir.create("stats", out, force)
    lm = load(model, dtype=dtype, device=device, device_map=device_map)
    tokens = load_tokens(data, lm.tokenizer, seq_len, max_tokens)
    res = compute(lm, tokens, opts, quiet=quiet)
    write(res, run, model=lm, options=run_options(model=model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                                                  dtype=dtype, device=device, device_map=device_map))
    print_table(res.summary, title=f"{model}: {tokens.n_tokens:,} tokens")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(stats)
