"""``moetool super-experts`` (generated from ``moetool/experiments/super_experts/spec.py``): its console output."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    """The ablation table, then which experts are super (and, where the rule could pick only the largest maximum,
    that it was degenerate): the run's headline lines, without the one that repeats the table."""
    import typer

    from moetool.experiments.super_experts.compute import summary_lines
    from moetool.report.console import print_table

    print_table(res.summary, f"super experts and perplexity without them: {p.model} ({res.tokens.n_tokens:,} tokens)",
                csv="super_experts_ablation.csv")
    for line in summary_lines(p.model, res):
        if not line.lstrip().startswith("removed:"):
            typer.echo(line)
