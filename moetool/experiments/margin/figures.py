"""Figures of ``moetool margin``: ``margin_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_margin(margins: Any, flips: Any) -> dict[str, Any]:
    """``margin_flips``: the top-K (left) and top-1 (right) flip rates against the noise size eps, one line per
    layer (bootstrap error bars), and ``margin_quantiles``: the 5th/50th/95th percentile of the margin by layer."""
    from ...report.figures import line_by, new_figure

    fl = flips.assign(layer=flips["layer"].map(lambda i: f"layer {i}"))
    fig, axes = new_figure(1, 2, width=4.0)
    for ax, col, title in ((axes[0], "topk_flip", "top-K set changed"), (axes[1], "top1_flip", "top-1 changed")):
        line_by(ax, fl, "eps", col, "layer", title=title, marker="o", yerr=(f"{col}_lo", f"{col}_hi"),
                xlabel="eps (noise / ||h||)", ylabel="share of tokens")
        positive = fl["eps"][fl["eps"] > 0]
        if len(positive):
            ax.set_xscale("symlog", linthresh=float(positive.min())) if (fl["eps"] == 0).any() else ax.set_xscale("log")
    out = {"margin_flips": fig}
    cols = {"margin_p05": "5th percentile", "margin_p50": "median", "margin_p95": "95th percentile"}
    q = margins.melt(id_vars="layer", value_vars=list(cols), var_name="quantile", value_name="margin")
    q["quantile"] = q["quantile"].map(cols)
    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, q, "layer", "margin", "quantile", title="routing margin by layer", marker="o",
            ylabel="margin s(K) - s(K+1)")
    if (q["margin"] > 0).all():
        ax.set_yscale("log")
    out["margin_quantiles"] = fig
    return out

def plot_margin_jaccard(jac: Any) -> dict[str, Any]:
    """``margin_jaccard``: the soft Jaccard between the router and each policy by layer (bootstrap error bars)."""
    from ...report.figures import line_by, new_figure

    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, jac, "layer", "soft_jaccard", "policy", title="soft Jaccard with the router by layer", marker="o",
            yerr=("soft_jaccard_lo", "soft_jaccard_hi"), ylabel="soft Jaccard (mean over tokens)")
    ax.set_ylim(0, 1.05)
    return {"margin_jaccard": fig}

def margin_figures(result: Any) -> dict[str, Any]:
    out = plot_margin(result["margin.csv"], result["margin_flips.csv"])
    if "margin_jaccard.csv" in result.tables and len(result["margin_jaccard.csv"]):
        out.update(plot_margin_jaccard(result["margin_jaccard.csv"]))
    return out
