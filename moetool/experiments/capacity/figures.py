"""Figures of ``moetool capacity``: ``capacity_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_capacity(df: Any, layers: Any) -> dict[str, Any]:
    """``capacity_curve``: the dropped share of assignments (left) and perplexity / the router's (right) against the
    capacity factor, one line per drop order; ``capacity_layers``: the dropped share by layer, one line per cf and
    order. cf = inf sits at the right of the finite ones (no such x): left out of the curves."""
    import numpy as np
    import pandas as pd

    from ...report.figures import line_by, log_axis_if_wide, new_figure

    out = {}
    finite = df[np.isfinite(df["cf"])]
    if len(finite):
        fig, axes = new_figure(ncols=2, width=4.0)
        line_by(axes[0], finite, "cf", "dropped_frac", "order", title="dropped assignments", marker="o",
                xlabel="capacity factor cf", ylabel="dropped share of assignments")
        line_by(axes[1], finite, "cf", "ratio", "order", title="perplexity", marker="o",
                yerr=("ratio_lo", "ratio_hi"), xlabel="capacity factor cf", ylabel="perplexity / router's (paired)")
        axes[1].axhline(1.0, color="black", linewidth=0.6, linestyle=":")
        # a collapse at small cf would flatten the rest: log, with readable ticks, when the range is wide
        log_axis_if_wide(axes[1], pd.concat([finite["ratio"], finite["ratio_hi"], finite["ratio_lo"]]))
        out["capacity_curve"] = fig
    if len(layers):
        lay = layers.assign(series=[f"cf {cf:g} ({order})" for cf, order in zip(layers["cf"], layers["order"])])
        fig, (ax,) = new_figure(width=5.0)
        line_by(ax, lay, "layer", "dropped_frac", "series", title="dropped assignments by layer",
                ylabel="dropped share of assignments")
        out["capacity_layers"] = fig
    return out


def capacity_figures(result: Any) -> dict[str, Any]:
    return plot_capacity(result["capacity.csv"], result["capacity_layers.csv"])
