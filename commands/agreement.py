"""``moetool agreement``: routing agreement across precisions -- how much routing changes between fp32, bf16, fp16
and (simulated) fp8 / fp4 / mxfp4 on the same tokens."""

from __future__ import annotations

from typing import Optional

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, Force, Layers, MaxTokens,
                      Out, Quiet, Seed, SeqLen, check_run, echo_run, handle_errors, open_run, parse_layers,
                      parse_list, preflight, rank_layout, run_options, write_result)

HELP = """Routing agreement across precisions: the same tokens of --data through the model once per precision
(one model in memory at a time: loaded, run, freed), each run's routing compared token by token with the most
precise run of --precisions (the reference: fp32 > bf16/fp16 > fp8 > fp4/mxfp4, the first listed on a tie).

Precisions: fp32, bf16, fp16 load the model in that dtype (transformers' loading: modules a family keeps in fp32
stay fp32). fp8, fp4, mxfp4 are SIMULATED (on CPU and GPU alike; the manifest says so): the model loads in bf16, the
weights a real release stores in that format are quantized then dequantized with the format's own rules
(moetool.formats.fake_quantize: fp8 = e4m3 with one fp32 scale per 128x128 block; fp4 = e2m1 with one scale per 32
input values; mxfp4 = e2m1 with one E8M0 power-of-two scale per 32 input values) and the forward runs in bf16.
Which weights: fp8, every linear weight and expert matrix except the embeddings, the LM head and the routers (the
DeepSeek-V3 / Kimi-K2 / Qwen3 / GLM-4.5 FP8 releases); fp4 and mxfp4, the routed experts only (gpt-oss MXFP4,
DeepSeek-V4-style FP4 experts). FP8 activations and kernels are not simulated.

Per precision and MoE layer, against the reference: top1_flip (share of real tokens whose top-1 expert -- the chosen
expert with the largest selection score -- differs), topk_flip (the chosen top-K set differs), the reference's
routing margin (K-th minus (K+1)-th selection score: mean, median) and the flip rates per margin bin (edges 0,
--thresholds, inf); per precision: the flips pooled over layers and the mean next-token NLL change (ΔNLL, paired
on the same tokens).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off).

Writes agreement.csv (precision, reference, layer, tokens, top1_flip, topk_flip, margin_mean, margin_p50;
*_lo/*_hi), agreement_summary.csv (precision, reference, simulated, tokens, layers, top1_flip, topk_flip,
nll_ref, nll, delta_nll; *_lo/*_hi), agreement_bins.csv (precision, layer, margin_lo, margin_hi, tokens, top1_flip,
topk_flip), figures/agreement_flips_by_layer (flip rates by layer, one line per precision), figures/agreement_margin
(flip rates against the reference margin, pooled over layers) and manifest.json (definitions, precisions: which
were simulated and which weights).

Examples:
  moetool agreement tiny --precisions fp32,bf16,fp8
  moetool agreement --model tiny-fine --precisions bf16,fp8,mxfp4 --max-tokens 4096
"""


@handle_errors
def agreement(model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="The model (as --model)."),
              model: Optional[str] = typer.Option(None, "--model", "-m", help="Embedded name (tiny, tiny-fine, ...), "
                                                  "alias (moetool inspect --aliases), local directory or hub id "
                                                  f"(default {DEFAULT_MODEL})."),
              precisions: str = typer.Option("fp32,bf16,fp8", "--precisions", "-p",
                                             help="Precisions compared, comma-separated: fp32, bf16, fp16, fp8, fp4, "
                                                  "mxfp4 (the last three simulated)."),
              thresholds: str = typer.Option("0.0001,0.001,0.01,0.1", "--thresholds",
                                             help="Reference-margin bin edges (increasing), comma-separated."),
              data: Data = None, out: Out = None, force: Force = False, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP,
              layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
              device: Device = "auto", seed: Seed = 0, quiet: Quiet = False) -> None:
    if model_arg and model and model_arg != model:
        raise typer.BadParameter(f"the model is given twice ({model_arg} and --model {model})")
    model = model_arg or model or DEFAULT_MODEL
    preflight(model)  # before the experiment's imports: a bad model fails at once
    from moetool import distributed
    from moetool.data import DocumentStream, load_tokens
    from moetool.experiments.agreement.compute import LOAD_DTYPE, PRECISIONS, AgreementOptions, agreement as compute
    from moetool.loading import load_tokenizer
    from moetool.report.console import print_table, with_ci

    opts = AgreementOptions(precisions=tuple(parse_list(precisions, str, "precision")),
                            thresholds=tuple(parse_list(thresholds, float, "threshold")), layers=parse_layers(layers),
                            batch_size=batch_size, bootstrap=bootstrap, seed=seed, device=device)
    DocumentStream(data)  # a missing --data fails before anything is loaded
    est = check_run(model, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                    dtype=LOAD_DTYPE[PRECISIONS[opts.reference][0]])
    options = run_options(model=model, data=data, seq_len=seq_len, max_tokens=max_tokens, device=device)
    run, _ = open_run("agreement", out, force, resume=False, device=device, estimate=est, batch_size=batch_size)
    tokens = load_tokens(data, load_tokenizer(model), seq_len, max_tokens)
    if distributed.world_size() > 1:
        run.add(distributed=rank_layout(tokens, batch_size))
    res = compute(model, tokens, opts, quiet=quiet)
    write_result(res, run, options=options)
    print_table(with_ci(res.summary), f"routing agreement across precisions: {model} ({tokens.n_tokens:,} tokens)",
                csv="agreement.csv")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(agreement)
