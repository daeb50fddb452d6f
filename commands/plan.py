"""``moetool plan``: what fits where, and how fast it can be, from the config alone."""

from __future__ import annotations

import json
from typing import Optional

import typer

from .options import DEFAULT_MODEL, Force, Model, Out, Quiet, echo_run, handle_errors, preflight
from moetool.experiments.plan import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/plan/spec.py


@handle_errors
def plan(model: Model = DEFAULT_MODEL,
         gpus: str = typer.Option("8xH100", "--gpus", help="GPUs per node, COUNTxNAME (e.g. 8xH100, 1xRTX4090)."),
         nodes: int = typer.Option(1, "--nodes", help="Nodes (each with --gpus).", min=1),
         seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per row the commands would run "
                                               "(default 2048, or the model's positions when it has fewer).", min=2),
         batch_size: int = typer.Option(8, "--batch-size", help="Rows per batch the commands would run.", min=1),
         as_json: bool = typer.Option(False, "--json", help="Print the tables as JSON (no run folder)."),
         out: Out = None, force: Force = False, quiet: Quiet = False) -> None:
    from moetool.experiments.plan.compute import parse_gpus

    parse_gpus(gpus)  # a bad --gpus fails before the config is read
    preflight(model)
    from moetool.experiments.plan.compute import plan as compute
    from moetool.loading import resolve
    from moetool.report.console import console, count_text, print_table

    source = resolve(model)[0]
    run = None
    if not as_json:
        from moetool.report import RunDir

        run = RunDir.create("plan", out, force)  # a non-empty --out fails before the work
    res = compute(model, gpus, nodes, seq_len=seq_len, rows=batch_size)
    if as_json:
        typer.echo(json.dumps({"plan": res.meta["plan"], **{n: res[n].to_dict(orient="records") for n in res.names}},
                              indent=2, default=str))
        return
    from moetool.report.writers import write

    p = res.meta["plan"]
    c = console()
    if quiet:
        write(res, run, options={"model": model})
        echo_run(run.path)
        return
    c.print(f"{model} ({source}): {count_text(p['total_params'])} parameters, "
            f"{count_text(p['active_params'])} active, {p['n_experts']} experts top-{p['top_k']} in "
            f"{p['moe_layers']} MoE layers, stored as {p['native_format']}; "
            f"{nodes} node{'s' if nodes > 1 else ''} of {gpus}", markup=False, highlight=False)
    print_table(res["params"], title="parameter bytes by group and format")
    print_layouts(c, res["layouts"], f"layouts (rows of {p['seq_len']} tokens x {batch_size})")
    if "throughput" in res:
        wide = res["throughput"].pivot(index="command", columns="layout", values="tokens_per_s").round(0)
        print_table(wide.reset_index(), title="ceiling, tokens/s (upper bound)")
    else:
        c.print("no layout fits: add GPUs or nodes, or a larger GPU")
    write(res, run, options={"model": model})
    echo_run(run.path)


def print_layouts(c: object, layouts: object, title: str) -> None:
    """Each layout in a few lines, its command on one line of its own (unwrapped: it is copied as it is), so the
    list reads the same in 80 columns as in 200 (a table of eight columns splits into one-column slices there)."""
    c.print(title + ":", soft_wrap=True)
    for r in layouts.to_dict(orient="records"):
        gpus, replicas = int(r["gpus"]), int(r["replicas"])
        c.print(f"  {r['layout']}: {r['format']}, {gpus} GPU{'s' if gpus != 1 else ''}, {replicas} "
                f"replica{'s' if replicas != 1 else ''}, {r['gib_per_gpu']:g} GiB per GPU, "
                f"{'fits' if r['fits'] else 'does not fit'}"
                + ("" if r["available"] == "yes" else f"; not available ({r['available'][4:]})"), soft_wrap=True)
        if r.get("command"):  # no command column where nothing fits (the why column says why)
            c.print(f"    {r['command']}", soft_wrap=True)
        elif not r["fits"] and r.get("why"):
            c.print(f"    {r['why']}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(plan)
