"""``--trace PATH``: a command's analysis on recorded routing (``moetool trace`` or ``moetool import-trace``) instead
of a forward of ``--model`` on ``--data``: the ``on_trace`` of ``stats``, ``placement``, ``offload`` and
``fluctuation`` (the flags are ``commands/options.py``'s). What needs a forward refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .cli import finish

# Each run records as its options the ``data``, ``seq_len`` and ``max_tokens`` of the text it read (the analysis's
# ``meta["traced_run"]``: the trace's, ``max_tokens`` the cap where it cut the trace), as a forward of the command
# records them: the report tells the two apart only where they differ.


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


def stats_on_trace(trace: Path, config: Optional[str], opts: Any, out: Any, force: bool, quiet: bool) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    res, _ = analyse("stats", [trace], config, opts)
    run = _run("stats", out, force)
    write_result(res, run, options={**res.meta["traced_run"], "trace": str(trace), "trace_config": config})
    finish(res, run.path, quiet, lambda: print_table(res.summary, title=f"{trace}", csv="layers.csv"))


def placement_on_trace(trace: Path, config: Optional[str], opts: Any, out: Any, force: bool,
                       export: Optional[str], quiet: bool) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table
    from moetool.traces.store import open_trace

    from moetool.run import write_result

    src = open_trace(trace, config)
    res, loads = analyse("placement", [trace], config, opts)
    run = _run("placement", out, force)
    if export:
        write_export_file(run, export, loads, opts, src.shape)
    write_result(res, run, options={**res.meta["traced_run"], "trace": str(trace), "trace_config": config,
                                    "export": export})
    finish(res, run.path, quiet, lambda: print_table(res.summary, f"per-GPU load imbalance (max/mean): {trace}",
                                                     csv="placement_overall.csv"))


def offload_on_trace(trace: Path, config: Optional[str], opts: Any, max_tokens: Optional[int], out: Any,
                     force: bool, quiet: bool) -> None:
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    res, _ = analyse("offload", [trace], config, opts, max_tokens)
    run = _run("offload", out, force)
    write_result(res, run, options={**res.meta["traced_run"], "trace": str(trace), "trace_config": config})
    finish(res, run.path, quiet, lambda: print_table(res.summary, f"expert cache hit rate: {trace}",
                                                     csv="offload_cache.csv"))


def fluctuation_on_traces(traces: list[Path], config: Optional[str], reference: str, bootstrap: int, seed: int,
                          max_tokens: Optional[int], out: Any, force: bool, quiet: bool) -> None:
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace_analyses import analyse
    from moetool.report.console import print_table

    from moetool.run import write_result

    opts = FluctuationOptions(reference=reference, bootstrap=bootstrap, seed=seed)
    res, _ = analyse("fluctuation", list(traces), config, opts, max_tokens)
    run = _run("fluctuation", out, force)
    write_result(res, run, options={**res.meta["traced_run"], "traces": [str(t) for t in traces],
                                    "trace_config": config})
    finish(res, run.path, quiet, lambda: print_table(
        res.summary, "routing change between recorded routings (mean over layers)", csv="fluctuation.csv"))


def write_export_file(run: Any, export: str, loads: dict[str, Any], opts: Any, shape: Any) -> None:
    """``--export sglang|eplb`` into the run folder (:func:`moetool.traces.export.export_placement`)."""
    from moetool.traces.export import FILES, export_layout, export_placement

    export_layout(export, loads["n"], opts)  # one placement, before a file is made
    with run.atomic(FILES[export]) as tmp:
        entry = export_placement(export, tmp, loads, opts, shape)
    run.add(export=entry)
