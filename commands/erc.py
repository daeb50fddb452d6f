"""``moetool erc`` (generated from ``moetool/experiments/erc/spec.py``): its console tables."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    import typer

    from moetool.experiments.erc.compute import summary_lines
    from moetool.experiments.published import erc_alpha_min
    from moetool.report.console import print_table

    print_table(res["erc_layers"], "ERC per layer", csv="erc_layers.csv")
    typer.echo(f"alpha_min_paper: {erc_alpha_min(res['erc_layers'], p.model).attrs['source']}")
    print_table(res["erc"], "ERC loss", csv="erc.csv")
    typer.echo(summary_lines(p.model, res)[0])
