"""Figures of ``moetool topk``: ``topk_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any

from ...report.figures import ratio_curve


def plot_topk(df: Any, layers: Any) -> dict[str, Any]:
    """``topk_frontier``: perplexity / the router's against the experts per token (fixed k, top-p; the router a
    star), and
    ``topk_layers``: experts per token by layer for each top-p policy."""
    from ...report.figures import line_by, new_figure

    out = {"topk_frontier": ratio_curve(df, "kind", "mean_experts", title="compute-quality frontier",
                                        xlabel="experts per token (mean over the MoE layers routed)",
                                        star="router (the model's K)")}
    topp = layers[layers["kind"] == "topp"]
    if len(topp):
        fig, (ax,) = new_figure(width=5.0)
        line_by(ax, topp, "layer", "mean_experts", "policy", title="top-p: experts per token by layer",
                ylabel="experts per token (mean)")
        out["topk_layers"] = fig
    return out


def topk_figures(result: Any) -> dict[str, Any]:
    return plot_topk(result["topk.csv"], result["topk_layers.csv"])
