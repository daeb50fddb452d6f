"""Console output that reads well in a terminal and in a log: rich tables from DataFrames, one line per message.

- No emoji codes (``norm:up:l2`` stays text) and no markup in data cells (``[bold]`` in a cell stays text).
- Numbers are never truncated: numeric columns keep their full width; a table wider than the console (80
  columns when piped) is split into column blocks that repeat the key column, text cells wrap.
- A long table prints its first rows and ``… N more rows in <file>`` (the CSV with every row).
- Intervals are written ``value ± half-width`` by :func:`moetool.uncertainty.format_ci` (:func:`with_ci` for tables).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Sequence

from ..uncertainty import format_ci, with_ci  # noqa: F401 - the console's interval text, for the commands

MAX_ROWS = 30  # longer tables are summarised
HEAD_ROWS = 20  # rows shown of a summarised table


def console(stderr: bool = False, width: int | None = None) -> Any:
    """A rich console: ``emoji=False`` ("norm:up:l2" is not an emoji), no markup, no highlighting of numbers;
    80 columns when not a terminal (rich's default, or ``COLUMNS``)."""
    from rich.console import Console

    return Console(file=sys.stderr if stderr else sys.stdout, emoji=False, markup=False, highlight=False,
                   width=width)


def _fmt(v: Any, floatfmt: str) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else floatfmt.format(v)  # missing stays empty, never a plausible number
    return str(v)


def _blocks(widths: Sequence[int], key: int, avail: int) -> list[list[int]]:
    """Column indices per block: column 0 (the key) repeated, the others added while the block fits."""
    blocks: list[list[int]] = []
    cur: list[int] = []
    used = key
    for i, w in enumerate(widths[1:], start=1):
        if cur and used + w + 3 > avail:
            blocks.append(cur)
            cur, used = [], key
        cur.append(i)
        used += w + 3
    if cur or not blocks:
        blocks.append(cur)
    return blocks


def render_table(df: Any, title: str = "", floatfmt: str = "{:.4g}", csv: str | None = None,
                 max_rows: int = MAX_ROWS, width: int | None = None) -> list[Any]:
    """The rich renderables of :func:`print_table` (tables and the "more rows" note)."""
    from rich.table import Table
    from rich.text import Text

    con = console(width=width)
    avail = con.width
    n = len(df)
    shown = df.head(HEAD_ROWS) if n > max_rows else df
    cols = [str(c) for c in df.columns]
    numeric = [df[c].dtype.kind in "fiub" for c in df.columns]
    cells = [[_fmt(v, floatfmt) for v in row] for row in shown.itertuples(index=False)]
    # a column's width is its longest cell (numbers never fold); a header longer than 14 may fold
    widths = [max([len(r[i]) for r in cells] + [min(len(c), 14), 1]) for i, c in enumerate(cols)]
    out: list[Any] = []
    blocks = _blocks(widths, widths[0] + 4, avail - 1) if cols else [[]]
    for b, idx in enumerate(blocks):
        idx = [0, *idx] if cols else []
        t = Table(title=Text(title + (f" ({b + 1}/{len(blocks)})" if len(blocks) > 1 else "")) if title else None,
                  show_lines=False, padding=(0, 1))
        for i in idx:
            t.add_column(Text(cols[i]), justify="right" if numeric[i] else "left",
                         min_width=widths[i], overflow="fold")
        for r in cells:
            t.add_row(*[Text(r[i]) for i in idx])
        out.append(t)
    if n > max_rows:
        where = f" in {csv}" if csv else " (every row is in the run's CSV)"
        out.append(Text(f"… {n - len(shown)} more rows{where}"))
    return out


def print_table(df: Any, title: str = "", floatfmt: str = "{:.4g}", csv: str | None = None,
                max_rows: int = MAX_ROWS) -> None:
    """Print ``df`` as a table that fits the console (see the module docstring); ``csv`` names the file that
    holds every row of a long table."""
    con = console()
    for r in render_table(df, title, floatfmt, csv, max_rows, width=con.width):
        con.print(r)
