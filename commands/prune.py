"""``moetool prune``: expert importance (frequency, router-weighted, REAP) and perplexity as experts are removed."""

from __future__ import annotations

import typer

from pathlib import Path
from typing import Optional

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      IncludePath, Layers, Limit, MaxTokens, Model, NumFewshot, Out, Quiet, Seed, SeqLen,
                      finish_command, handle_errors, parse_layers, parse_list, preflight, start_run)
from .options import Quantize

HELP = """Expert importance and pruning: which experts matter, and perplexity as the least important are removed.

One pass of the model's own routing over --data measures, per MoE layer and expert, over the real tokens routed
to it: the routed frequency, the router-weighted frequency (the sum of the routing weights it gets) and the REAP
saliency (Lasby et al. 2025, arXiv 2510.13999: the mean of gate weight x ||expert output||_2; every expert's
output from batched probes in memory-bounded chunks). The gate weight, --reap-weights, as REAP's code
(CerebrasResearch/reap, src/reap/pruning_metrics.py update_pruning_state), with p the router's probabilities over
all experts: renormalised (default) p_e / the sum of p over the token's top-K, REAP's renormalize_router_weights
path (reap.layerwise_prune; reap.main when the config sets norm_topk_prob; REAP's README, 2026-03-11, calls it
correct); softmax: p_e, what reap.main uses on a config without norm_topk_prob (Mixtral). Then, per criterion (--criteria: frequency, weighted, reap,
random = a seeded permutation per layer) and fraction (--fractions), floor(fraction x n) experts of each MoE layer
(--layers) with the lowest value are removed: masked out of the top-K (the model's choice among the rest, weights
as its rule gives them, renormalised where it renormalises), and the model runs on the same rows. Last, each of
the --ablate experts with the largest REAP saliency is removed alone. With --tasks, the router and every
(criterion, fraction) also run lm-eval under the same pruning (as norm-select does): accuracy, and its retention
against the router's (delta method on lm-eval's standard errors). A fraction above 0 that removes no expert in any
layer (floor(fraction x n) = 0) is refused before any forward; 0 is the model with nothing removed.
The same pruning works in ppl, eval, trace and norm-select: --routing prune:reap:0.25:<prune_importance.csv>,
prune:random:0.25, prune:file:<removed.json|csv> (prune_removed.csv of this command with :<criterion>:<fraction>).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes prune_importance.csv (layer, expert, tokens, frequency, weighted, reap),
prune.csv (criterion, fraction, removed, removed_frac, tokens, perplexity, ratio; *_lo/*_hi; the router first),
prune_removed.csv (criterion, fraction, layer, expert: every removed set; not with --fractions 0 alone),
prune_ablation.csv (rank, layer, expert, reap, frequency, tokens, perplexity, delta_ppl, ratio; *_lo/*_hi; not with
--ablate 0),
figures/prune_curve (perplexity / the model's vs fraction removed, one line per criterion),
figures/prune_importance (REAP saliency per layer and expert), figures/prune_ablation (perplexity / the model's
for each single-expert ablation; not with --ablate 0) and manifest.json (definitions; not_written: the tables left
out and why); with --tasks also
prune_eval.csv (criterion, fraction, task, metric, value, stderr, value_lo/hi, router_value, retention,
retention_lo/hi; the router first) and figures/prune_accuracy (accuracy retention vs fraction removed, one line per
criterion, one panel per task).
--tasks: see `moetool eval --help` (shipped offline tasks: moetool_code, moetool_prose).

Examples:
  moetool prune
  moetool prune --model tiny-fine --fractions 0.25,0.5 --criteria reap,random --ablate 4 --max-tokens 4096
  moetool prune --reap-weights softmax --ablate 0
  moetool prune --criteria reap,random --tasks moetool_code,moetool_prose --limit 60
"""


@handle_errors
def prune(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          fractions: str = typer.Option("0.125,0.25,0.5", "--fractions",
                                        help="Fractions of each MoE layer's experts removed, comma-separated."),
          criteria: str = typer.Option("frequency,weighted,reap,random", "--criteria",
                                       help="Importance criteria, comma-separated: frequency, weighted, reap, "
                                            "random."),
          ablate: int = typer.Option(8, "--ablate", help="Single-expert ablations of the experts with the largest "
                                                          "REAP saliency (0: none)."),
          reap_weights: str = typer.Option("renormalised", "--reap-weights", help="REAP's gate weight: renormalised "
                                           "(p over the sum of the top-K's p, REAP's README) or softmax (p, "
                                           "reap.main on Mixtral)."),
          tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks (comma list) run under "
                                              "every pruning; default: perplexity only."),
          num_fewshot: Optional[int] = NumFewshot, limit: Optional[int] = Limit,
          include_path: Optional[Path] = IncludePath,
          bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
          max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
          device_map: DeviceMap = None, quantize: Quantize = None, seed: Seed = 0, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.eval.compute import plan_tasks
    from moetool.experiments.prune.compute import PruneOptions, prune as compute

    opts = PruneOptions(fractions=tuple(parse_list(fractions, float, "fraction")),
                        criteria=tuple(parse_list(criteria, str, "criterion")), ablate=ablate, reap_weights=reap_weights,
                        layers=parse_layers(layers), batch_size=batch_size, bootstrap=bootstrap, seed=seed,
                        tasks=tuple(parse_list(tasks, str, "task")) if tasks is not None else None,
                        num_fewshot=num_fewshot, limit=limit,
                        include_path=str(include_path) if include_path else None)
    plan = plan_tasks(opts.tasks, opts.include_path) if opts.tasks is not None else None  # before the model loads
    started = start_run("prune", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, plan=plan, quiet=quiet)
    finish_command(started, res, f"perplexity with experts removed: {model} ({tokens.n_tokens:,} tokens)",
                   "prune.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(prune)
