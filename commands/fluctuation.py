"""``moetool fluctuation`` (generated from ``moetool/experiments/fluctuation/spec.py``): the comparison of recorded
routings (``--trace``), its console lines (``moetool.run`` checks that the checkpoints match before any loads)."""

from __future__ import annotations

from typing import Any

DEFAULT_ROUTING = "router,similarity,attention"


def on_trace(p: Any, opts: Any) -> None:
    from .trace_input import fluctuation_on_traces, refuse

    from moetool.errors import MoetoolError

    if p.checkpoints:
        raise MoetoolError(f"fluctuation compares checkpoints (a forward of each) or --trace runs, not both: drop "
                           f"{' '.join(p.checkpoints)} or the --trace runs")
    if len(p.trace) < 2:
        raise MoetoolError("fluctuation --trace compares two or more recorded routings: --trace A --trace B")
    refuse({"--data": p.data, "--isolate": p.isolate, "--resume": p.resume,
            "--routing": p.routing != DEFAULT_ROUTING and p.routing, "--device-map": p.device_map,
            "--quantize": p.quantize, "--layers": p.layers})
    fluctuation_on_traces(p.trace, p.trace_config, p.reference, p.bootstrap, p.seed, p.max_tokens, p.out, p.force,
                          p.quiet)


def show(res: Any, p: Any) -> None:
    import typer

    from moetool.experiments.fluctuation.compute import summary_lines
    from moetool.report.console import print_table, with_ci

    print_table(with_ci(res.summary), f"routing fluctuation ({res.tokens.n_tokens:,} tokens)", csv="fluctuation.csv")
    for line in summary_lines(" vs ".join(p.checkpoints), res):
        typer.echo(line)
