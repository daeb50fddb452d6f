"""Console output: rich tables from DataFrames, one line per message."""

from __future__ import annotations

import sys
from typing import Any


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(file=sys.stderr if stderr else sys.stdout, emoji=False)  # "norm:up:l2" is not an emoji


def print_table(df: Any, title: str = "", floatfmt: str = "{:.4g}") -> None:
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in df.columns:
        t.add_column(str(c), justify="right" if df[c].dtype.kind in "fiu" else "left")
    for row in df.itertuples(index=False):
        t.add_row(*[floatfmt.format(v) if isinstance(v, float) else str(v) for v in row])
    console().print(t)
