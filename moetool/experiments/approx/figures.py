"""Figures of ``moetool approx``: ``approx_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_approx(approx: Any, per_layer: Any) -> dict[str, Any]:
    """``approx_error`` (mean relative error per layer, one line per selector) and ``approx_layers``."""
    from ...report.figures import line_by, new_figure

    out = {}
    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, approx, "layer", "rel_error_mean", "selector", title="k-term approximation error ||y_S − y||/||y||")
    ax.set_xticks(sorted(approx["layer"].unique()))
    out["approx_error"] = fig
    fig, (a1, a2) = new_figure(1, 2)
    a1.plot(per_layer["layer"], per_layer["spearman_prob_vs_norm"], marker="o", markersize=3)
    a1.set(xlabel="layer", ylabel="Spearman(π_e, ||E_e(h)||)", title="does the router predict the norm?")
    a2.plot(per_layer["layer"], per_layer["mean_abs_cos"], marker="o", markersize=3)
    a2.set(xlabel="layer", ylabel="mean |cos(u_i, u_j)|", title="orthogonality of the u_e")
    for ax in (a1, a2):
        ax.set_xticks(per_layer["layer"])
    fig.tight_layout()
    out["approx_layers"] = fig
    return out

def approx_figures(result: Any) -> dict[str, Any]:
    return plot_approx(result["approx.csv"], result["approx_layers.csv"])
