"""``moetool ppl`` (generated from ``moetool/experiments/ppl/spec.py``): its console line."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    import typer

    from moetool.experiments.routing import data_name
    from moetool.report.console import print_table

    # plain echo: rich would render the ':up:' of norm:up as an emoji
    typer.echo(f"perplexity of {p.model} on {data_name(p.data)}, routing {res.options.policy().name}")
    print_table(res.summary)
