"""``moetool norm-select`` (generated from ``moetool/experiments/norm_select/spec.py``): its checks before the
model loads (every norm policy, ``--prune``) and its console tables."""

from __future__ import annotations

from typing import Any


def check(p: Any, opts: Any) -> None:
    """A bad --weights or --prune fails before anything loads; the policies built here are the run's."""
    from moetool.policies import build_once

    for spec in opts.specs():
        build_once(spec, opts.weights, opts.seed)
    if opts.prune is not None:
        build_once(opts.prune, opts.weights, opts.seed)


def show(res: Any, p: Any) -> None:
    from moetool.experiments.published import console_layout
    from moetool.report.console import print_table, with_ci

    on = f"{p.model} pruned by {res.options.prune}" if res.options.prune else p.model
    print_table(with_ci(res.summary), title=f"norm-select on {on} (weights {res.options.weights}{_intervals(res)})")
    if "aoe_table1.csv" in res.tables:
        title, table = console_layout(res["aoe_table1"])
        print_table(table, title=title, csv="aoe_table1.csv")


def _intervals(res: Any) -> str:
    """The title's word on intervals: '; 95% intervals' where a policy's row has one (bootstrap or lm-eval's), '; no
    intervals (--bootstrap 0)' where none does (the title said 95% intervals over a table of bare numbers)."""
    df = res.summary
    rows = df[df.node != "router"] if "node" in df.columns else df  # the router's ratio is [1, 1] by definition
    if any(rows[c].notna().any() for c in df.columns if str(c).endswith("_lo")):
        return "; 95% intervals"
    return "; no intervals (--bootstrap 0)" if res.options.bootstrap == 0 else ""
