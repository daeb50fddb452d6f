"""Figures of ``moetool agreement``: ``agreement_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_agreement(per_layer: Any, bins: Any) -> dict[str, Any]:
    """``agreement_flips_by_layer``: the top-K set (left) and top-1 (right) flip rates against the reference by layer, one
    line per precision (bootstrap error bars); ``agreement_margin``: the same flip rates per bin of the reference's
    routing margin, pooled over layers (tokens-weighted), one line per precision."""
    from ...report.figures import line_by, new_figure

    fig, axes = new_figure(1, 2, width=4.0)
    ref = per_layer["reference"].iloc[0] if len(per_layer) else "reference"
    for ax, col, title in ((axes[0], "topk_flip", "top-K set differs"), (axes[1], "top1_flip", "top-1 differs")):
        line_by(ax, per_layer, "layer", col, "precision", title=f"{title} (vs {ref})", marker="o",
                yerr=(f"{col}_lo", f"{col}_hi"), ylabel="share of tokens")
    out = {"agreement_flips_by_layer": fig}
    b = bins.copy()
    for col in ("topk_flip", "top1_flip"):
        b[col] = b[col].fillna(0) * b["tokens"]
    pooled = b.groupby(["precision", "margin_lo", "margin_hi"], sort=False)[["tokens", "topk_flip", "top1_flip"]].sum()
    pooled = pooled.reset_index()
    pooled = pooled[pooled["tokens"] > 0]
    for col in ("topk_flip", "top1_flip"):
        pooled[col] = pooled[col] / pooled["tokens"]
    edges = sorted(set(bins["margin_lo"]))
    pooled["bin"] = pooled["margin_lo"].map(edges.index)
    names = [f"[{lo:g}, {hi:g})" for lo, hi in zip(edges, [*edges[1:], float("inf")])]
    fig, axes = new_figure(1, 2, width=4.0)
    for ax, col, title in ((axes[0], "topk_flip", "top-K set differs"), (axes[1], "top1_flip", "top-1 differs")):
        line_by(ax, pooled, "bin", col, "precision", title=f"{title}, by the top-K margin", marker="o",
                xlabel="reference top-K margin s(K) - s(K+1)", ylabel="share of tokens in the bin")
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
    out["agreement_margin"] = fig
    return out

def agreement_figures(result: Any) -> dict[str, Any]:
    return plot_agreement(result["agreement.csv"], result["agreement_bins.csv"])
