"""Console output that reads well in a terminal and in a log: rich tables from DataFrames, one line per message.

- No emoji codes (``norm:up:l2`` stays text) and no markup in data cells (``[bold]`` in a cell stays text).
- Numbers are never truncated: numeric columns keep their full width; a table wider than the console (80
  columns when piped with no terminal to measure) is split into column blocks that each repeat the key columns (the
  row labels: the first column and the text columns right after it, e.g. ``layer, routing, reference,
  checkpoint``; a frame whose leading text columns are not all row labels says how many are in
  ``df.attrs["keys"]``), text cells wrap. A row label with no room beside the others whose value is the same in
  every row goes to the title (``checkpoint tiny``). A listing (``print_table(whole_when_piped=True)``: ``inspect
  --families``) piped into a file, ``grep`` or ``less -S`` is printed whole instead: one line a row.
- A long table prints its first rows and ``… N more rows in <file>`` (the CSV with every row).
- Integer counts are written with thousands separators in every table (``tokens`` ``32,768``, ``params``
  ``1,342,052,808,704``, never ``1342052808704``), as the titles write them; identifiers (:data:`ID_COLUMNS`:
  ``layer``, ``expert``, ``token``, ``step``, ...) stay plain digits. A table may set ``intfmt`` for every integer
  cell, ``formats`` a column's own format (``{"bytes_per_token": "{:,.0f}"}``: whole numbers, not ``1.477e+06``
  beside ``4608``); the CSVs keep the exact values.
- Intervals are written ``value ± half-width`` (``value [lo, hi]`` where not symmetric) by
  :func:`moetool.uncertainty.format_ci` (:func:`with_ci` for tables).
- Fractions stay fractions. A rate, share or proportion (a flip rate, a dropped share, a hit rate, the share of tokens
  a bound holds on, an active-parameter share) is stored in the CSVs as a fraction in [0, 1], and every summary line
  and table prints it in that same unit: ``drops 0.500``, ``flips 0.005``, never ``50.0%`` or ``0.5%``, so a number
  copied from the console sits beside the CSV's without a factor of 100. The one home of that text is
  :func:`fraction_text` (the value alone) or, with an interval, :func:`moetool.uncertainty.format_ci` (which writes
  the value in its column's unit). No summary line or table prints a CSV column as a ``%``; a ``%`` left on the
  console is a fixed setting (``95% intervals``, a layout's ``90%`` of a GPU's memory) or a note's prose.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import sys
from typing import Any, Sequence

from ..uncertainty import fraction_text, format_ci, with_ci  # noqa: F401 - the console's interval text, for the commands

MAX_ROWS = 30  # longer tables are summarised
PIPED_WIDTH = 100_000  # print_table(whole_when_piped=True) piped without COLUMNS: no split, no wrap (one row a line)
HEAD_ROWS = 20  # rows shown of a summarised table
COUNT_FORMAT = "{:,}"  # an integer count's cells: 32,768
#: integer columns that name a thing rather than count it (a layer, an expert, a vocabulary id, a training step,
#: a position, a rank): plain digits, no thousands separator (``expert_<k>`` columns too)
ID_COLUMNS = frozenset({"layer", "expert", "token", "token_id", "i", "j", "a", "b", "rank", "row", "step", "pos",
                        "source_layer", "next_layer", "hottest_expert", "seed", "batch", "group", "index"})


def integer_format(column: str) -> str:
    """The default format of an integer column's cells: :data:`COUNT_FORMAT` for a count, plain for an identifier
    (:data:`ID_COLUMNS`, ``expert_<k>``)."""
    return "{}" if column in ID_COLUMNS or column.startswith("expert_") else COUNT_FORMAT


def console(stderr: bool = False, width: int | None = None) -> Any:
    """A rich console: ``emoji=False`` ("norm:up:l2" is not an emoji), no markup, no highlighting of numbers;
    80 columns when not a terminal (rich's default, or ``COLUMNS``)."""
    from rich.console import Console

    return Console(file=sys.stderr if stderr else sys.stdout, emoji=False, markup=False, highlight=False,
                   width=width)


def count_text(n: float) -> str:
    """A count for a sentence, in the largest unit that keeps it at least 1 with 3 significant digits:
    ``2823296`` -> ``"2.82M"``, ``46702792704`` -> ``"46.7B"``, ``512`` -> ``"512"``."""
    r = float(f"{n:.3g}")  # rounded first: 999,999 is "1M", not "1e+03K"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(r) >= scale:
            return f"{r / scale:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) and not float(n).is_integer() else str(int(n))


def _fmt(v: Any, floatfmt: str, intfmt: str = "{}") -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else floatfmt.format(v)  # missing stays empty, never a plausible number
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return intfmt.format(v)
    return str(v)


_NUMBER = re.compile(r"^\s*[-+]?(\d|\.\d|inf|nan)", re.IGNORECASE)  # a number, or "value ± half" / "value [lo, hi]"


def key_columns(df: Any) -> int:
    """How many leading columns label the rows: the first column, and the text columns right after it whose cells
    are not numbers (``with_ci`` turns numbers into text ``0.41 ± 0.02``, which stays a value column)."""
    n = 1 if len(df.columns) else 0
    for c in list(df.columns)[1:]:
        col = df[c]
        if col.dtype.kind != "O" or any(_NUMBER.match(str(v)) for v in col if v is not None):
            break
        n += 1
    return n


def _blocks(widths: Sequence[int], key: int, avail: int, keys: int = 1) -> list[list[int]]:
    """Column indices per block after the ``keys`` leading key columns (repeated in every block, ``key`` their
    width), the others added while the block fits."""
    blocks: list[list[int]] = []
    cur: list[int] = []
    used = key
    for i, w in enumerate(widths[keys:], start=keys):
        if cur and used + w + 3 > avail:
            blocks.append(cur)
            cur, used = [], key
        cur.append(i)
        used += w + 3
    if cur or not blocks:
        blocks.append(cur)
    return blocks


def render_table(df: Any, title: str = "", floatfmt: str = "{:.4g}", csv: str | None = None,
                 max_rows: int = MAX_ROWS, width: int | None = None, keys: int | None = None,
                 intfmt: str | None = None, formats: dict[str, str] | None = None) -> list[Any]:
    """The rich renderables of :func:`print_table` (tables and the "more rows" note). ``keys``: the number of
    leading key columns every block of a split table repeats (default: the frame's ``attrs["keys"]`` where it says,
    else :func:`key_columns`). ``floatfmt`` / ``intfmt``: the format of float / integer cells (``intfmt`` None:
    :func:`integer_format`'s, thousands separators on counts); ``formats``: a
    column's own format, for both (``{"bytes_per_token": "{:,.0f}"}``; a column the table lacks, as offload's
    bytes_per_token on a recorded trace, is passed over)."""
    from rich.table import Table
    from rich.text import Text

    con = console(width=width)
    avail = con.width
    n = len(df)
    shown = df.head(HEAD_ROWS) if n > max_rows else df
    cols = [str(c) for c in df.columns]
    numeric = [df[c].dtype.kind in "fiub" for c in df.columns]
    fmts = [(formats or {}).get(c) for c in cols]
    ints = [intfmt or integer_format(c) for c in cols]
    cells = [[_fmt(v, f or floatfmt, f or i) for v, f, i in zip(row, fmts, ints)]
             for row in shown.itertuples(index=False)]
    # a column's width is its longest cell (numbers never fold); a header longer than 14 may fold
    widths = [max([len(r[i]) for r in cells] + [min(len(c), 14), 1]) for i, c in enumerate(cols)]
    out: list[Any] = []
    keys = df.attrs.get("keys") if keys is None else keys
    nkeys = min(key_columns(df) if keys is None else max(keys, 1), len(cols))
    room = lambda n: avail - 1 - sum(w + 3 for w in widths[:n]) - 4  # noqa: E731 - beside n key columns
    labels = nkeys
    while nkeys > 1 and room(nkeys) < max([w for i, w in enumerate(widths) if numeric[i] and i >= nkeys] + [20]):
        nkeys -= 1  # no room for a value beside every key column: fewer keys
    # a row label left out of the keys that is the same in every row goes to the title: as a column of its own it
    # opened a part with no value in it (fluctuation's `checkpoint`, always `tiny`: part 1 of 7 held labels only)
    same = [i for i in range(nkeys, labels) if n and df.iloc[:, i].nunique(dropna=False) == 1]
    if same:
        title = "; ".join([*([title] if title else []), *(f"{cols[i]} {cells[0][i]}" for i in same)])
        keep = [i for i in range(len(cols)) if i not in same]
        cols, numeric, widths = [cols[i] for i in keep], [numeric[i] for i in keep], [widths[i] for i in keep]
        cells = [[r[i] for i in keep] for r in cells]
    # a text column wider than the room beside the keys wraps (whole words: a reason is never cut at the edge)
    natural = widths
    widths = [w if numeric[i] or i < nkeys else max(min(w, room(nkeys)), min(w, 14)) for i, w in enumerate(widths)]
    wraps = [widths[i] < natural[i] for i in range(len(cols))]  # only these are held to their width
    blocks = _blocks(widths, sum(w + 3 for w in widths[:nkeys]) + 1, avail - 1, nkeys) if cols else [[]]
    for b, idx in enumerate(blocks):
        idx = [*range(nkeys), *idx] if cols else []
        t = Table(title=Text(title + (f" ({b + 1}/{len(blocks)})" if len(blocks) > 1 else "")) if title else None,
                  show_lines=False, padding=(0, 1),
                  title_justify="left" if avail >= PIPED_WIDTH else "center")  # whole: at column 0, not ~300
        for i in idx:
            t.add_column(Text(cols[i]), justify="right" if numeric[i] else "left",
                         min_width=widths[i], max_width=widths[i] if wraps[i] else None, overflow="fold")
        for r in cells:
            t.add_row(*[Text(r[i]) for i in idx])
        out.append(t)
    if n > max_rows:
        where = f" in {csv}" if csv else " not shown"
        out.append(Text(f"… {n - len(shown)} more rows{where}"))
    return out


def print_table(df: Any, title: str = "", floatfmt: str = "{:.4g}", csv: str | None = None,
                max_rows: int = MAX_ROWS, keys: int | None = None, intfmt: str | None = None,
                formats: dict[str, str] | None = None, whole_when_piped: bool = False) -> None:
    """Print ``df`` as a table that fits the console (see the module docstring); ``csv`` names the file that
    holds every row of a long table; ``floatfmt``, ``intfmt`` and ``formats`` as :func:`render_table`.
    ``whole_when_piped``: output that is not a terminal and no ``COLUMNS`` -- a listing piped into a file, ``grep``
    or ``less -S`` -- gets the table at its natural width, one line a row, not split into 80-column parts
    (``inspect --families``: 5 parts, 620 lines)."""
    con = console()
    if whole_when_piped and not con.is_terminal and not os.environ.get("COLUMNS"):
        con = console(width=PIPED_WIDTH)
    for r in render_table(df, title, floatfmt, csv, max_rows, width=con.width, keys=keys, intfmt=intfmt,
                          formats=formats):
        con.print(r)
