"""``moetool capacity``: expert capacity and token dropping -- dropped assignments and perplexity against cf."""

from __future__ import annotations

import typer

from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force,
                      Layers, MaxTokens, Model, Out, Quiet, Seed, SeqLen, finish_command, handle_errors, parse_layers,
                      parse_list, preflight, start_run)
from .options import Quantize

HELP = """Expert capacity and token dropping: which assignments a capacity factor drops, and what it costs.

Per forward batch of --batch-size rows and MoE layer (--layers), each expert takes at most
C = ceil(cf * tokens * K / n) assignments, tokens = the batch's real (unpadded) tokens (GShard, Switch
Transformer; Megatron-LM's capacity). Assignments beyond C keep the model's expert but get weight 0: they
contribute nothing (the token keeps its other experts, shared experts and the residual); padding never takes
capacity. --order order: an expert keeps its first C assignments in the batch's flattened token order (row 0
position by position, then row 1, ...); --order score: its C with the highest routing weight (ties: the earlier
token). Capacity depends on the batch: the same text in batches of other rows drops other assignments (under
torchrun each process's batches of --batch-size rows are the one-process batches, so the tables are the same).
cf >= n/K drops nothing (cf may be inf). The policy capacity:<cf>[:order|score] works in ppl, eval and trace
too (capacity per forward batch there as well).
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
model's own routing on the same rows.

Writes capacity.csv (cf, order, tokens, perplexity, router_perplexity, ratio, assignments, dropped,
dropped_frac, tokens_dropped_all_frac; *_lo/*_hi), capacity_layers.csv (cf, order, layer, tokens, assignments,
capacity, dropped, dropped_frac, tokens_dropped_all, tokens_dropped_all_frac), capacity_experts.csv (cf, order,
layer, expert, load, capacity, dropped), figures/capacity_curve (dropped fraction and perplexity / the router's
vs cf), figures/capacity_layers (dropped fraction by layer, one line per cf) and manifest.json (definitions).

Examples:
  moetool capacity
  moetool capacity --model tiny-fine --cf 0.5,1,2 --order order,score --max-tokens 4096
"""


@handle_errors
def capacity(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
             cf: str = typer.Option("0.5,1,1.25,1.5,2", "--cf", help="Capacity factors, comma-separated (inf "
                                                                    "allowed)."),
             order: str = typer.Option("order", "--order", help="Which assignments an expert keeps: order (the "
                                                               "first in token order), score (the highest routing "
                                                               "weight), or both: order,score."),
             bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, layers: Layers = None, seq_len: SeqLen = 256,
             max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8, dtype: Dtype = "auto", device: Device = "auto",
             device_map: DeviceMap = None, quantize: Quantize = None, seed: Seed = 0, quiet: Quiet = False) -> None:
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.experiments.capacity import CapacityOptions, capacity as compute

    opts = CapacityOptions(cfs=tuple(parse_list(cf, float, "capacity factor")),
                           orders=tuple(parse_list(order, str, "order")), layers=parse_layers(layers),
                           batch_size=batch_size, bootstrap=bootstrap, seed=seed)
    started = start_run("capacity", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    res = compute(lm, tokens, opts, quiet=quiet)
    finish_command(started, res, f"capacity factor, dropped assignments and perplexity: {model} "
                                 f"({tokens.n_tokens:,} tokens)", "capacity.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(capacity)
