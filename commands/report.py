"""``moetool report``: gather run folders into one page for a paper (HTML, Markdown, LaTeX tables)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from .cli import finish, handle_errors
from .options import Force, Out, Quiet, parse_path

HELP = """Gather run folders of any commands (a demo folder with its sub-runs included) into one report.

Writes into --out: report.html (one self-contained page: a table of each run's headline numbers
linking to its section, an index of the runs by command and model, each run's manifest (model, data,
options, versions, seed, wall time, git revision) and contents, every figure at its pixel size with a caption
saying what it shows and the CSV it came from, every table in its own scroll box), report.md (the same
in Markdown), tables/<run>/<name>.csv and tables/<run>/<name>.tex (LaTeX booktabs),
figures/<run>/<name>.png and figures/<run>/<name>.pdf.
Tables longer than 20 rows show their first 10 rows and link the full CSV.

Only files inside each run folder are read: a manifest entry pointing elsewhere (../, an absolute
path, a symbolic link out of the run) is skipped with a warning, and symbolic links to folders are
not followed. Every text from a run is escaped in HTML, Markdown and LaTeX.

Examples:
  moetool report runs/demo-* --out runs/demo-report    # the folder(s) moetool demo wrote
  moetool report runs/stats-tiny runs/norm-select-tiny --out paper/ --force
"""


@handle_errors
def report(run_dirs: List[Path] = typer.Argument(..., metavar="RUN_DIR...", parser=parse_path, help="Run folders to gather."),
           out: Out = None, force: Force = False,
           title: str = typer.Option("moetool report", "--title", help="Title of the page."),
           quiet: Quiet = False) -> None:
    from moetool.report.page import write_report

    page = write_report(run_dirs, out, force=force, title=title)
    finish(None, page.parent, quiet, lambda: typer.echo(f"report: {page}"))


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(report)
