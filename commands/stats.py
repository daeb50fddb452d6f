"""``moetool stats`` (generated from ``moetool/experiments/stats/spec.py``): the command's own parts -- the
tokenizer's special tokens (``--no-special-tokens``) and the statistics of a recorded trace (``--trace``)."""

from __future__ import annotations

import dataclasses
from typing import Any


def check(p: Any, opts: Any) -> dict[str, Any]:
    """Special tokens: the tokenizer's default (a BOS where it adds one, the spec's ``special_tokens``) unless
    ``--no-special-tokens``; ``moetool.run`` records the choice in the manifest (and the key a ``--resume`` must
    match)."""
    return {"add_special_tokens": False} if p.no_special_tokens else {}


def on_trace(p: Any, opts: Any) -> None:
    from .trace_input import not_default, refuse, stats_on_trace

    refuse({"--data": p.data, "--resume": p.resume, "--no-special-tokens": p.no_special_tokens, "--layers": p.layers,
            **not_default("stats", p, "model", "max_tokens")})  # the trace's model and every token it holds
    stats_on_trace(p.trace, p.trace_config, dataclasses.replace(opts, bootstrap=0), p.out, p.force,
                   p.quiet)


def show(res: Any, p: Any) -> None:
    from moetool.report.console import print_table

    print_table(res.summary, title=f"{p.model}: {res.tokens.n_tokens:,} tokens", csv="layers.csv")
