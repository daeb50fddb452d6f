"""``moetool demo``: the whole tool on the embedded models, offline, in one run folder."""

from __future__ import annotations

from typing import Optional

import typer

from .cli import finish, handle_errors, parse_list
from .options import Force, Out, Quiet

from moetool.experiments.registry import EXPERIMENTS  # specs as strings: no torch

HELP = f"""Run every experiment on the embedded tiny models (no network needed) into one run folder.

Steps: inspect, {", ".join(n for n, e in EXPERIMENTS.items() if e.demo is not None)} (norm-select with the
shipped offline lm-eval tasks, fluctuation on the early vs final training checkpoints). Each step writes
a manifest.json and, per model, its CSVs and figures/ (PNG, PDF) in its own sub-folder, <step>/<model>/
(a checkpoint pair's is named after its final checkpoint: tiny-early -> tiny in fluctuation/tiny/; no figures from {", ".join(["inspect"] + [n for n, e in EXPERIMENTS.items() if e.demo is not None and
                                            e.figures is None])}); report/report.html (and .md, LaTeX tables)
gathers them all. Each step's heading says which of how many it is (== stats (2/17)); --quiet prints
no headings, step lines or timing table: only notes, warnings and the results line.

Examples:
  moetool demo
  moetool demo --out runs/demo --force
  moetool demo --steps stats,erc
"""


@handle_errors
def demo(out: Out = None, force: Force = False, quiet: Quiet = False,
         steps: Optional[str] = typer.Option(None, "--steps", help="Comma-separated subset of the steps.")) -> None:
    from moetool.demo import demo as run_demo

    chosen = parse_list(steps, str, "step") if steps is not None else None  # '' names no step: one line
    path, records, page = run_demo(out, chosen, force=force, quiet=quiet, echo=typer.echo)

    def table() -> None:
        typer.echo("")
        width = max((len(r["step"]) for r in records), default=0)
        for r in records:
            typer.echo(f"{r['step']:<{width}} {r['seconds']:>7.1f}s  {'  '.join(r['folders'])}")
        typer.echo(f"report: {page}")

    finish(None, path, quiet, table)


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(demo)
