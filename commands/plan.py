"""``moetool plan`` (generated from ``moetool/experiments/plan/spec.py``): not a run of a model -- the plan of a
config, printed (or ``--json``) and written to a run folder."""

from __future__ import annotations

import json
from typing import Any

import typer

from .cli import echo_run


def main(p: Any) -> None:
    from moetool.experiments.plan.compute import parse_gpus
    from moetool.run import preflight

    model, gpus, nodes, out, force, batch_size = p.model, p.gpus, p.nodes, p.out, p.force, p.batch_size
    parse_gpus(gpus)  # a bad --gpus fails before the config is read
    preflight(model)
    from moetool.experiments.plan.compute import plan as compute
    from moetool.loading import resolve
    from moetool.report.console import console, count_text, print_table

    source = resolve(model)[0]
    if p.json:
        res = compute(model, gpus, nodes, seq_len=p.seq_len, rows=batch_size)
        typer.echo(json.dumps({"plan": res.meta["plan"], **{n: res[n].to_dict(orient="records") for n in res.names}},
                              indent=2, default=str))
        return
    import moetool

    res = moetool.run("plan", model, gpus=gpus, nodes=nodes, seq_len=p.seq_len, batch_size=batch_size, out=out,
                      force=force)  # the run folder, the plan, its files: what moetool.run("plan", ...) does
    if p.quiet:
        echo_run(res.path)
        return
    c, p = console(), res.meta["plan"]
    c.print(f"{model} ({source}): {count_text(p['total_params'])} parameters, "
            f"{count_text(p['active_params'])} active, {p['n_experts']} experts top-{p['top_k']} in "
            f"{p['moe_layers']} MoE layers, stored as {p['native_format']}; "
            f"{nodes} node{'s' if nodes > 1 else ''} of {gpus}", markup=False, highlight=False)
    print_table(res["params"], title="parameter bytes by group and format", intfmt="{:,}")  # 1,342,052,808,704
    _print_layouts(c, res["layouts"], f"layouts (rows of {p['seq_len']} tokens x {batch_size})")
    layouts = res["layouts"]  # no command column where no layout fits
    if _config_alone(source) and "command" in layouts and layouts["command"].astype(bool).any():  # a config alone
        c.print(f"  (the commands name {model}, a config without weights: put the checkpoint's folder or hub id "
                "in --model)", soft_wrap=True, markup=False, highlight=False)
    if "throughput" in res:
        wide = res["throughput"].pivot(index="command", columns="layout", values="tokens_per_s")
        print_table(wide.reset_index(), title="ceiling, tokens/s (upper bound)", floatfmt="{:,.0f}")  # 23,537
    else:
        c.print("no layout fits: add GPUs or nodes, or a larger GPU")
    echo_run(res.path)


def _config_alone(source: str) -> bool:
    """``source`` is a local folder holding no weight file (a config alone, as ``examples/configs/``): a suggested
    command naming it would fail to load weights, after the load's minute."""
    from pathlib import Path

    from moetool.loading import WEIGHT_SUFFIXES

    folder = Path(source)
    return folder.is_dir() and not any(f.suffix in WEIGHT_SUFFIXES for f in folder.rglob("*") if f.is_file())


def _print_layouts(c: object, layouts: object, title: str) -> None:
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


