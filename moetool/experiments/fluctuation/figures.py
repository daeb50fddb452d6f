"""Figures of ``moetool fluctuation``: ``fluctuation_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_fluctuation(df: Any) -> dict[str, Any]:
    """Paper Fig. 3: top-1 change (fluctuation rate) by layer per routing; entropy ratio by layer; plus each
    routing's entropy relative to the router's (the paper's ratio, method / baseline) at each checkpoint."""
    from ...report.figures import grid_shape, line_by, new_figure

    df = df.assign(pair=[f"{r} -> {c}" for r, c in zip(df["reference"], df["checkpoint"])])
    pairs_ = list(dict.fromkeys(df["pair"]))
    out = {}
    for name, y in (("fluctuation_by_layer", "top1_change"), ("entropy_ratio_by_layer", "entropy_ratio")):
        if y not in df:  # a --trace run: no entropies (and no top-1 where a trace has no gate weights)
            continue
        fig, axes = new_figure(*grid_shape(len(pairs_), 3))
        lo, hi = f"{y}_lo", f"{y}_hi"  # bootstrap interval (error bars) when the run computed one
        yerr = (lo, hi) if lo in df and hi in df and df[lo].notna().all() else None
        for ax, p in zip(axes, pairs_):
            line_by(ax, df[df["pair"] == p], "layer", y, "routing", title=p, yerr=yerr)
        for ax in axes[len(pairs_):]:
            ax.set_visible(False)
        out[name] = fig
    plain = df[~df["routing"].str.endswith("-isolated")]
    if "entropy_ckpt" in plain and "router" in set(plain["routing"]) and plain["routing"].nunique() > 1:
        base = plain[plain["routing"] == "router"].set_index(["pair", "layer"])["entropy_ckpt"]
        rel = plain.assign(entropy_vs_router=[e / base.get((p, l), float("nan")) for e, p, l in
                                              zip(plain["entropy_ckpt"], plain["pair"], plain["layer"])])
        fig, axes = new_figure(*grid_shape(len(pairs_), 3))
        for ax, p in zip(axes, pairs_):
            line_by(ax, rel[rel["pair"] == p], "layer", "entropy_vs_router", "routing", title=p.split(" -> ")[1])
        for ax in axes[len(pairs_):]:
            ax.set_visible(False)
        out["entropy_vs_router_by_layer"] = fig
    return out

def fluctuation_figures(result: Any) -> dict[str, Any]:
    return plot_fluctuation(result["fluctuation.csv"])
