"""``--trace PATH``: a command's analysis on recorded routing (``moetool trace`` or ``moetool import-trace``) instead
of a forward of ``--model`` on ``--data``: the ``on_trace`` of ``stats``, ``placement``, ``offload`` and
``fluctuation`` (the flags are ``commands/options.py``'s). What needs a forward refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from .cli import echo_run


def refuse(flags: dict[str, Any]) -> None:
    """One line for the first flag that needs a forward and was given with ``--trace``."""
    from moetool.errors import MoetoolError

    for name, value in flags.items():
        if value:
            raise MoetoolError(f"{name} needs a forward of the model: not with --trace")


def not_default(command: str, p: Any, *names: str) -> dict[str, Any]:
    """``{--flag: value}`` for each of ``names`` that ``p`` holds at other than the command's default (for
    :func:`refuse`; a flag given at its default cannot be told from one left out, and changes nothing)."""
    from moetool.experiments.registry import EXPERIMENTS

    from .generated import parameters

    defaults = {name: default for name, _, default in parameters(EXPERIMENTS[command])}
    return {f"--{n.replace('_', '-')}": getattr(p, n) for n in names if getattr(p, n) != defaults[n]}


def _run(command: str, out: Any, force: bool) -> Any:
    from moetool.report.rundir import RunDir

    return RunDir.create(command, out, force)


def stats_on_trace(trace: Path, config: Optional[str], opts: Any, out: Any, force: bool) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    res, _ = analyse("stats", [trace], config, opts)
    run = _run("stats", out, force)
    write_result(res, run, options={"trace": str(trace), "trace_config": config})
    for what, why in res.meta["left_out"].items():
        typer.echo(f"left out: {what} ({why})")
    print_table(res.summary, title=f"{trace}", csv="layers.csv")
    echo_run(run.path)


def placement_on_trace(trace: Path, config: Optional[str], opts: Any, out: Any, force: bool,
                       export: Optional[str]) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table
    from moetool.traces.store import open_trace

    from moetool.run import write_result

    src = open_trace(trace, config)
    res, loads = analyse("placement", [trace], config, opts)
    run = _run("placement", out, force)
    if export:
        write_export_file(run, export, loads, opts, src.shape)
    write_result(res, run, options={"trace": str(trace), "trace_config": config, "export": export})
    print_table(res.summary, f"per-GPU load imbalance (max/mean): {trace}", csv="placement_overall.csv")
    echo_run(run.path)


def offload_on_trace(trace: Path, config: Optional[str], opts: Any, max_tokens: Optional[int], out: Any,
                     force: bool) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    res, _ = analyse("offload", [trace], config, opts, max_tokens)
    run = _run("offload", out, force)
    write_result(res, run, options={"trace": str(trace), "trace_config": config, "max_tokens": max_tokens})
    for what, why in res.meta["left_out"].items():
        typer.echo(f"left out: {what} ({why})")
    print_table(res.summary, f"expert cache hit rate: {trace}", csv="offload_cache.csv")
    echo_run(run.path)


def fluctuation_on_traces(traces: list[Path], config: Optional[str], reference: str, bootstrap: int, seed: int,
                          max_tokens: Optional[int], out: Any, force: bool) -> None:
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    opts = FluctuationOptions(reference=reference, bootstrap=bootstrap, seed=seed)
    res, _ = analyse("fluctuation", list(traces), config, opts, max_tokens)
    run = _run("fluctuation", out, force)
    write_result(res, run, options={"traces": [str(t) for t in traces], "trace_config": config,
                                    "max_tokens": max_tokens})
    for what, why in res.meta["left_out"].items():
        typer.echo(f"left out: {what} ({why})")
    print_table(res.summary, "routing change between recorded routings (mean over layers)", csv="fluctuation.csv")
    echo_run(run.path)


def write_export_file(run: Any, export: str, loads: dict[str, Any], opts: Any, shape: Any) -> None:
    """``--export sglang|eplb``: EPLB's placement of the loads at the one ``--gpus`` G and ``--extra-slots`` given
    (R = slots x G), in the file the engine loads (:mod:`moetool.traces.export`)."""
    from moetool.errors import MoetoolError
    from moetool.traces.export import EXPORTS, FILES, eplb_placement, write_export

    if export not in EXPORTS:
        raise MoetoolError(f"--export must be one of {', '.join(EXPORTS)}, not '{export}'")
    gpus = opts.gpu_counts(loads["n"])
    if len(gpus) != 1 or len(set(opts.extra_slots)) != 1:
        raise MoetoolError("--export writes one placement: give one --gpus G and one --extra-slots value")
    G, R = gpus[0], opts.extra_slots[0] * gpus[0]
    placed = eplb_placement(loads["load"], G, R, loads["groups"], opts.nodes)
    with run.atomic(FILES[export]) as tmp:
        write_export(export, tmp, placed, loads["layers"], shape,
                     {"num_replicas": loads["n"] + R, "num_groups": loads["groups"], "num_nodes": opts.nodes,
                      "num_gpus": G})
    run.add(export={"format": export, "file": FILES[export], "gpus": G, "replicas": R,
                    "engine": ("sglang: --init-expert-location " + FILES[export] + f" --ep-size {G} "
                               f"--ep-num-redundant-experts {R}") if export == "sglang" else
                    "DeepSeek EPLB rebalance_experts outputs (phy2log, log2phy, logcnt)"})


def loads_of_result(res: Any) -> dict[str, Any]:
    """The data's loads of a ``placement`` result (``placement_loads.csv``) as :func:`write_export_file` takes them."""
    import torch

    df = res["placement_loads"]
    df = df[df["data_set"] == "data"]
    layers = sorted(int(x) for x in df["layer"].unique())
    load = torch.stack([torch.tensor(df[df["layer"] == li].sort_values("expert")["load"].to_numpy(),
                                     dtype=torch.float64) for li in layers])
    return {"load": load, "layers": layers, "n": int(res.meta["n_experts"]), "groups": int(res.meta["groups"])}
