"""``moetool fluctuation``: routing change between checkpoints (Graph of Tokens: Nguyen, Tran, Nguyen,
Baraniuk 2025, arXiv 2505.00792, Fig. 3)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .trace_input import TraceConfig
from .options import (DEFAULT_BOOTSTRAP, BatchSize, Bootstrap, Causal, Data, Device, DeviceMap, Dtype, Force,
                      MaxTokens, Out, Quantize, Quiet, Resume, Seed, SeqLen, Sim, check_run, echo_run, handle_errors, open_run, parse_list,
                      preflight, rank_layout, run_options, unit_key, write_result)

HELP = """Routing fluctuation: the same token ids through two or more checkpoints of one architecture.

Source: Nguyen, Tran, Nguyen, Baraniuk (2025), "Improving Routing in Sparse Mixture of Experts with Graph of
Tokens", arXiv 2505.00792 (routing fluctuation, Fig. 3; Similarity-/Attention-Aware routing).

Token ids come from the first checkpoint's tokenizer; checkpoints of a different architecture (model_type,
layers, experts, K) or tokenizer vocabulary are refused. Checkpoints load one at a time. Per MoE layer, pair
(reference, checkpoint) and routing: top1_change (fraction of real tokens whose top-1 expert differs: the
paper's fluctuation rate; top-1 = chosen expert with the largest weight), topk_change (top-K set differs),
topk_overlap (mean |A∩B|/K), jaccard (mean |A∩B|/|A∪B|), entropy_ref / entropy_ckpt (mean entropy in nats)
and entropy_ratio (ckpt/ref).

--routing router: the model's own top-K, entropy of π. similarity / attention: that training-free policy
applied in every MoE layer of each checkpoint (Similarity-Aware S = softmax(h_i·h_j/τ), causal;
Attention-Aware: the same layer's lowest-entropy attention head), the chosen sets compared, entropy of the
policy's normalised scores s_i = Σ_j S[i,j] π(h_j). --isolate adds rows <routing>-isolated: the
reference's own MoE inputs (and attention) fed to the checkpoint's routers — router drift alone.

Memory: routing stays on the device during the forward, one host copy per batch is spilled to a temporary
file and read back batch by batch for the comparison, so RSS stays flat in the number of tokens.

--bootstrap N (default 1000, 0 = off, seeded by --seed): 95% document-level bootstrap over packed rows of
every rate (per-row sums, moetool.uncertainty), *_lo/*_hi columns, error bars in fluctuation_by_layer, value ±
half-width on the console.

--resume (with the --out of an interrupted run, same options): checkpoints
whose routing was captured before the interruption are read back, not run
again; the same tables as an uninterrupted run.

Writes fluctuation.csv (layer, routing, reference, checkpoint, tokens, top1_change, topk_change, topk_overlap,
jaccard, each with _lo/_hi, entropy_ref, entropy_ckpt, entropy_ratio), fluctuation_summary.csv (the headline,
one row per routing, reference and checkpoint: routing, reference, checkpoint, tokens, layers, top1_change =
the top-1 change averaged over layers, reduction_vs_router = the router's top1_change minus this routing's
(paired bootstrap), each with _lo/_hi),
figures/fluctuation_by_layer, figures/entropy_ratio_by_layer, figures/entropy_vs_router_by_layer (each
routing's entropy / the router's, the paper's ratio), manifest.json.

--trace RUN (twice or more, instead of checkpoints): the recorded routings of the same tokens (moetool trace
or import-trace runs, e.g. one model at two training steps), their first --max-tokens tokens: fluctuation.csv
with topk_change, topk_overlap, jaccard (and top1_change when every trace has gate weights, as moetool trace
writes them); no entropies (they need the router's probabilities), no --isolate, no figures.

Examples:
  moetool fluctuation tiny-early tiny --out runs/fluct-tiny
  moetool fluctuation --trace runs/step-1000 --trace runs/step-2000 --bootstrap 0
  moetool fluctuation tiny-fine-early tiny-fine --routing router,similarity --sim cosine --tau 0.1 --isolate
  moetool fluctuation ckpt-1000 ckpt-2000 ckpt-3000 --reference last
"""


@handle_errors
def fluctuation(checkpoints: List[str] = typer.Argument(None, help="Two or more checkpoints (embedded names, "
                                                           "local directories, aliases or hub ids), in order."),
                data: Data = None, out: Out = None, force: Force = False,
                routing: str = typer.Option("router,similarity,attention", "--routing",
                                            help="Routing policies compared, comma-separated (router = the model's "
                                                 "own routing; similarity, attention, or any --routing spec)."),
                tau: Optional[float] = typer.Option(None, "--tau", help="Similarity temperature τ (default sqrt(d))."),
                sim: str = Sim, causal: bool = Causal,
                reference: str = typer.Option("previous", "--reference",
                                              help="Pairs: previous (i-1 vs i), first (0 vs i) or last (last vs i)."),
                isolate: bool = typer.Option(False, "--isolate", help="Also feed the reference's MoE inputs to the "
                                             "other checkpoint's routers (rows <routing>-isolated)."),
                seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
                bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, seed: Seed = 0,
                dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None,
                quantize: Quantize = None, resume: Resume = False, quiet: Quiet = False,
                trace: List[Path] = typer.Option(None, "--trace", help="Two or more recorded routings of the same "
                                                 "tokens (moetool trace / import-trace runs), in order, instead of "
                                                 "checkpoints."),
                trace_config: Optional[str] = TraceConfig) -> None:
    if trace:  # recorded routings instead of forwards (commands/trace_input.py)
        from .trace_input import fluctuation_on_traces, refuse

        refuse({"checkpoints": checkpoints, "--data": data, "--isolate": isolate, "--resume": resume,
                "--routing": routing != "router,similarity,attention" and routing, "--device-map": device_map,
                "--quantize": quantize})
        return fluctuation_on_traces(trace, trace_config, reference, bootstrap, seed, max_tokens, out, force)
    if not checkpoints:
        from moetool.errors import MoetoolError

        raise MoetoolError("give two or more checkpoints (or --trace runs)")
    preflight(*checkpoints)  # before the experiment's imports: a bad --model fails at once
    from moetool import distributed
    from moetool.data import DocumentStream, load_tokens
    from moetool.experiments.fluctuation.compute import (FluctuationOptions, check_checkpoints, fluctuation as compute,
                                                 summary_lines)
    from moetool.report.console import print_table, with_ci

    opts = FluctuationOptions(routing=tuple(parse_list(routing, str, "routing")), tau=tau, sim=sim, causal=causal,
                              reference=reference, isolate=isolate, batch_size=batch_size, dtype=dtype, device=device,
                              device_map=device_map, quantize=quantize,
                              bootstrap=bootstrap, seed=seed)
    DocumentStream(data)
    tokenizer = check_checkpoints(checkpoints)
    est = check_run(checkpoints[0], seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                    dtype=dtype, device_map=device_map, quantize=quantize,
                    attn_implementation="eager" if opts.needs_attention else None)
    options = run_options(checkpoints=list(checkpoints), data=data, seq_len=seq_len, max_tokens=max_tokens)
    run, units = open_run("fluctuation", out, force, resume=resume, device=device, estimate=est,
                          batch_size=batch_size, units={**options, **unit_key(opts)})
    tokens = load_tokens(data, tokenizer, seq_len, max_tokens)
    if units is not None:  # --resume: refused when the data or a checkpoint's weights differ from what the run read
        from moetool.loading import weights_fingerprint

        units.check_inputs(data=tokens.fingerprint(), model=[weights_fingerprint(c) for c in checkpoints])
    if distributed.world_size() > 1:
        run.add(distributed=rank_layout(tokens, batch_size))
    res = compute(checkpoints, tokens, opts, quiet=quiet, units=units)
    write_result(res, run, options=options)
    if not quiet:
        print_table(with_ci(res.summary), f"routing fluctuation ({tokens.n_tokens:,} tokens)", csv="fluctuation.csv")
        for line in summary_lines(" vs ".join(checkpoints), res):
            typer.echo(line)
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(fluctuation)
