"""``moetool norm-select``: the Autonomy-of-Experts pilot (experts pick themselves by node norm)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .options import (BatchSize, Data, DEFAULT_MODEL, Device, DeviceMap, Dtype, Force, Layers, MaxTokens, Model,
                      Out, Quiet, Seed, SeqLen, echo_run, handle_errors, parse_layers, parse_list)
from .eval import IncludePath, Limit, NumFewshot
from .ppl import Weights

HELP = """Remove the router: the K experts with the largest norm of a node run (AoE, Table 1).

Sweeps the router baseline and norm:<node>:<norm> for every --nodes and --norm. Per policy:
agreement with the router per layer (mean |TopK_policy ∩ TopK_router|/K and top-1 agreement over
real tokens; TopK_router is the model's own choice for the hidden state reached under the policy),
perplexity on --data and its ratio to the router's, optional lm-eval accuracy (--tasks) and
retention = accuracy / router accuracy, and wall time. Writes agreement.csv (layer, policy,
topk_overlap, top1_agree, tokens), quality.csv (policy, task, metric, value, router_value, ratio,
seconds; perplexity rows have task = the data name), figures/retention and
figures/agreement_by_layer, manifest.json, and prints a Table-1-shaped summary.
--tasks: see `moetool eval --help` (shipped offline tasks: moetool_code, moetool_prose).

Examples:
  moetool norm-select --max-tokens 4096
  moetool norm-select --nodes gate,output --norm l1,l2 --tasks moetool_code,moetool_prose --limit 60
  moetool norm-select --model mixtral-8x7b --tasks mmlu,arc_challenge --num-fewshot 5 --device-map auto
"""


@handle_errors
def norm_select(model: Model = DEFAULT_MODEL,
                nodes: str = typer.Option("all", "--nodes", help="Comma list of gate,up,act,glu,output or 'all'."),
                norm: str = typer.Option("l2", "--norm", help="l2|l1|linf, or a comma list to sweep several."),
                weights: str = Weights, layers: Layers = None, data: Data = None,
                tasks: Optional[str] = typer.Option(None, "--tasks", "-t", help="lm-eval tasks (comma list); "
                                                    "default: perplexity only."),
                num_fewshot: Optional[int] = NumFewshot, limit: Optional[int] = Limit,
                include_path: Optional[Path] = IncludePath,
                seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
                dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, out: Out = None,
                force: Force = False, seed: Seed = 0, quiet: Quiet = False) -> None:
    from moetool.data import load_tokens
    from moetool.experiments import norm_select as ns
    from moetool.experiments.lmeval import plan_tasks
    from moetool.experiments.ppl import build_policy, data_name
    from moetool.loading import load
    from moetool.report import RunDir
    from moetool.report.console import print_table

    specs = ns.sweep_specs(ns.parse_nodes(nodes), ns.parse_norms(norm))
    policies = [build_policy(s, weights, seed) for s in specs]
    policy_layers = parse_layers(layers)
    plan = plan_tasks(parse_list(tasks, str, "task"), include_path) if tasks is not None else None
    run = RunDir.create("norm-select", out, force)
    lm = load(model, dtype=dtype, device=device, device_map=device_map)
    tokens = load_tokens(data, lm.tokenizer, seq_len, max_tokens)
    res = ns.run_norm_select(lm, tokens, policies, data=data_name(data), policy_layers=policy_layers,
                             batch_size=batch_size, plan=plan, num_fewshot=num_fewshot, limit=limit, seed=seed,
                             quiet=quiet)
    run.write_csv("agreement.csv", res.agreement)
    run.write_csv("quality.csv", res.quality)
    asked = plan.names if plan else None
    ns.figures(run, res.agreement, res.quality, tasks=asked)
    run.add(definitions=ns.DEFINITIONS, data=tokens.describe(), policies=specs, weights=weights,
            eval=plan.describe() if plan else None,
            n_samples={k: v.n_samples for k, v in res.evals.items()})
    run.finish(options=dict(model=model, nodes=nodes, norm=norm, weights=weights, layers=layers, data=str(data),
                            tasks=plan.names if plan else None, num_fewshot=num_fewshot, limit=limit,
                            include_path=str(include_path) if include_path else None, seq_len=seq_len,
                            max_tokens=max_tokens, batch_size=batch_size, dtype=dtype, device=device),
               model=lm, seed=seed)
    print_table(ns.table1(res.agreement, res.quality, tasks=asked),
                title=f"norm-select on {model} (weights {weights})")
    echo_run(run.path)


def register(app: typer.Typer) -> None:
    app.command(name="norm-select", help=HELP)(norm_select)
