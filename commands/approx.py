"""``moetool approx`` (generated from ``moetool/experiments/approx/spec.py``): its console tables."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    import typer

    from moetool.experiments.approx.compute import summary_lines
    from moetool.report.console import print_table

    print_table(res["approx"], f"k-term approximation: {p.model} ({res.tokens.n_tokens:,} tokens)", csv="approx.csv")
    print_table(res["approx_layers"], "router vs norm, orthogonality", csv="approx_layers.csv")
    typer.echo(summary_lines(p.model, res)[0])
