"""``moetool ppl``: perplexity under any routing policy."""

from __future__ import annotations

import typer

from .options import (BatchSize, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force, Layers, MaxTokens, Model,
                      Out, Quiet, Seed, SeqLen, echo_run, handle_errors, parse_layers)

HELP = """Perplexity, mean next-token NLL and token count of --data with a routing policy applied.

--routing takes any policy: router (unchanged; reproduces the unhooked model exactly),
norm:<node>[:<norm>] (AoE: the K experts with the largest node norm; node gate|up|act|glu|output,
norm l2|l1|linf), random, and the others listed by the error for an unknown name. Writes ppl.csv
(model, data, routing, weights, layers, tokens, nll_mean, perplexity, seconds) and manifest.json.

Examples:
  moetool ppl                                   # the router on the shipped held-out text
  moetool ppl --routing norm:gate --weights softmax
  moetool ppl --routing norm:output:l1 --layers 0-1 --max-tokens 4096
"""

Routing = typer.Option("router", "--routing", "-r", help="Routing policy: router, norm:<node>[:<norm>], random, ...")
Weights = typer.Option("softmax", "--weights", help="Weights of the experts a norm policy chose: softmax (over "
                       "their norms, AoE Algorithm 1), router (the model's probabilities, renormalised as the "
                       "model does) or uniform (1/K). Ignored by router.")
Sim = typer.Option("dot", "--sim", help="similarity policy: dot (raw h_i·h_j, the paper) or cosine.")
Causal = typer.Option(True, "--causal/--no-causal", help="similarity policy: only tokens j <= i (default).")


@handle_errors
def ppl(model: Model = DEFAULT_MODEL, data: Data = None, routing: str = Routing, weights: str = Weights,
        sim: str = Sim, causal: bool = Causal, layers: Layers = None, seq_len: SeqLen = 256,
        max_tokens: MaxTokens = 32768, batch_size: BatchSize = 8,
        dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, out: Out = None,
        force: Force = False, seed: Seed = 0, quiet: Quiet = False) -> None:
    from moetool.data import load_tokens
    from moetool.experiments.ppl import (PPL_DEFINITIONS, build_policy, data_name, describe_policy, perplexity,
                                         ppl_frame)
    from moetool.loading import load
    from moetool.report import RunDir
    from moetool.report.console import print_table

    policy = build_policy(routing, weights, seed, sim=sim, causal=causal)
    policy_layers = parse_layers(layers)
    run = RunDir.create("ppl", out, force)
    lm = load(model, dtype=dtype, device=device, device_map=device_map,
              attn_implementation="eager" if policy.needs_attention else None)
    tokens = load_tokens(data, lm.tokenizer, seq_len, max_tokens)
    res = perplexity(lm, tokens, policy=policy, policy_layers=policy_layers, batch_size=batch_size, quiet=quiet)
    df = ppl_frame(res, model=model, data=data_name(data), routing=policy.name,
                   weights=getattr(policy, "weights", "-"), layers=policy_layers)
    run.write_csv("ppl.csv", df)
    run.add(definitions=PPL_DEFINITIONS, data=tokens.describe(), routing=describe_policy(policy))
    run.finish(options=dict(model=model, data=str(data), routing=routing, weights=weights, sim=sim, causal=causal,
                            layers=layers, seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size, dtype=dtype,
                            device=device), model=lm, seed=seed)
    # plain echo: rich would render the ':up:' of norm:up as an emoji
    typer.echo(f"perplexity of {model} on {data_name(data)}, routing {policy.name}")
    print_table(df[["weights", "layers", "tokens", "nll_mean", "perplexity", "seconds"]])
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(ppl)
