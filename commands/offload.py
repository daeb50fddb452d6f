"""``moetool offload`` (generated from ``moetool/experiments/offload/spec.py``): the simulation on a recorded
trace (``--trace``) and its console tables."""

from __future__ import annotations

from typing import Any


def on_trace(p: Any, opts: Any) -> None:
    from .trace_input import not_default, offload_on_trace, refuse

    refuse({"--data": p.data, **not_default("offload", p, "model")})  # the trace's model (--max-tokens caps it)
    offload_on_trace(p.trace, p.trace_config, opts, p.max_tokens, p.out, p.force, p.quiet)


def show(res: Any, p: Any) -> None:
    from moetool.report.console import format_ci, print_table

    print_table(res.summary, f"expert cache: {p.model} ({res.tokens.n_tokens:,} tokens; hit rate = mean over layers, "
                             f"bytes/token = sum over layers)", csv="offload_cache.csv",
                formats={"bytes_per_token": "{:,.0f}"})  # 1,476,838 and 4,608, not 1.477e+06 beside 4608
    pref = res["offload_prefetch"] if "offload_prefetch" in res else ()  # none when no layer has one ahead
    if len(pref):
        shown = pref[["layer", "source_layer"]].assign(
            **{c: [format_ci(r[c], r[f"{c}_lo"], r[f"{c}_hi"]) for _, r in pref.iterrows()]
               for c in ("top1_recall", "topk_recall")})
        print_table(shown, "next-layer prediction recall (with the 95% interval)",
                    csv="offload_prefetch.csv")
