"""Figures of ``moetool super-experts``: ``super_experts_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_super_experts(table: Any) -> dict[str, Any]:
    """``super_experts_heatmap``: max |expert output| per layer and expert (log colour), the super experts boxed;
    ``super_experts_ranked``: every (layer, expert) maximum, largest first (log scale), with the threshold."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from ...report.figures import heatmap, log_axis_if_wide, new_figure

    mat = table.pivot(index="layer", columns="expert", values="max_abs_output")  # [layers, n]
    n = mat.shape[1]
    fig, (ax,) = new_figure(width=max(4.2, 0.18 * n + 2), height=max(2.4, 0.3 * len(mat) + 1.2))
    heatmap(ax, np.log10(mat.to_numpy().clip(min=1e-12)), title="max |expert output|", xlabel="expert",
            ylabel="layer", colorbar_label="log10 max_abs_output")
    ax.set_yticks(range(len(mat)), [str(i) for i in mat.index])
    rows = {layer: i for i, layer in enumerate(mat.index)}
    for r in table[table.is_super].itertuples():
        ax.add_patch(Rectangle((r.expert - 0.5, rows[r.layer] - 0.5), 1, 1, fill=False, edgecolor="red",
                               linewidth=1.2))
    out = {"super_experts_heatmap": fig}
    ranked = table.sort_values("rank")
    fig, (ax,) = new_figure(width=5.0)
    colors = ["#C44E52" if s else "#4C72B0" for s in ranked["is_super"]]
    ax.bar(range(len(ranked)), ranked["max_abs_output"].clip(lower=1e-12), color=colors, width=1.0)
    ax.axhline(float(ranked["threshold"].iloc[0]), color="black", linewidth=0.8, linestyle="--",
               label="threshold")
    log_axis_if_wide(ax, [*ranked["max_abs_output"], float(ranked["threshold"].iloc[0])])
    ax.set_xlabel("(layer, expert) by rank")
    ax.set_ylabel("max |expert output|")
    ax.set_title("super experts (red)")
    ax.legend(loc="upper right", fontsize=7)
    out["super_experts_ranked"] = fig
    return out

def super_experts_figures(result: Any) -> dict[str, Any]:
    return plot_super_experts(result["super_experts.csv"])
