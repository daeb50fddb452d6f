"""``moetool trace``: per-token routing of every MoE layer, to a file pandas reads."""

from __future__ import annotations

import typer

from .options import (BatchSize, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force, Layers, MaxTokens, Model,
                      Out, Quiet, Seed, SeqLen, echo_run, handle_errors, parse_layers)

HELP = """Per-token routing of every MoE layer: token ids, positions, top-K experts and weights.

Writes trace.csv.gz (one row per real token and MoE layer: row, pos, token_id, token, domain, layer,
expert_1..expert_K, weight_1..weight_K, and with --logits logit_0..logit_{n-1}) and manifest.json.
Read it with pandas.read_csv(path). --routing traces what a policy chose instead of the router.

Examples:
  moetool trace --out runs/trace-tiny
  moetool trace --model tiny-fine --logits --max-tokens 2048
"""


@handle_errors
def trace(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
          logits: bool = typer.Option(False, "--logits", help="Also write the full router logits."),
          routing: str = typer.Option("router", "--routing", help="Policy whose choice is traced."),
          layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
          dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, seed: Seed = 0,
          quiet: Quiet = False) -> None:
    from moetool.data import load_tokens
    from moetool.experiments.trace import run_trace
    from moetool.loading import load
    from moetool.policies import make_policy
    from moetool.report import RunDir

    policy = make_policy(routing, seed=seed)
    run = RunDir.create("trace", out, force)
    lm = load(model, dtype=dtype, device=device, device_map=device_map,
              attn_implementation="eager" if policy.needs_attention else None)
    tokens = load_tokens(data, lm.tokenizer, seq_len, max_tokens)
    path = run_trace(lm, tokens, run, policy=policy, policy_layers=parse_layers(layers), logits=logits,
                     batch_size=batch_size, quiet=quiet)
    run.finish(options=dict(model=model, data=str(data), routing=routing, layers=layers, logits=logits,
                            seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size, dtype=dtype,
                            device=device), model=lm, seed=seed)
    echo_run(path)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(trace)
