"""``moetool eval`` (generated from ``moetool/experiments/eval/spec.py``): its console line."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    import typer

    from moetool.report.console import print_table

    typer.echo(f"lm-eval on {p.model}, routing {res.options.policy().name}")  # plain echo: rich makes ':up:' an emoji
    print_table(res.summary)
