"""``moetool mass-recall`` (generated from ``moetool/experiments/mass_recall/spec.py``): its console table."""

from __future__ import annotations

from typing import Any


def show(res: Any, p: Any) -> None:
    from moetool.report.console import print_table, with_ci

    print_table(with_ci(res.summary), f"mass recall: {p.model} ({res.tokens.n_tokens:,} tokens)",
                csv="mass_recall.csv")
