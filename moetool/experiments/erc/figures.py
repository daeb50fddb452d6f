"""Figures of ``moetool erc``: ``erc_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_erc(erc: Any, per_layer: Any, matrix: Any, node: str, norm: str, noise: Any, samples: int) -> dict[str, Any]:
    """``erc_matrix`` (one heatmap of the clean M per layer) and ``erc_loss`` (L_ERC vs α, one line per layer)."""
    from ...report.figures import grid_shape, heatmap, line_by, new_figure

    rows, cols = grid_shape(len(per_layer))
    fig, axes = new_figure(rows, cols, width=3.8, height=3.2)
    for ax, r in zip(axes, per_layer.itertuples()):
        M = matrix[matrix["layer"] == r.layer].pivot(index="i", columns="j", values="m")  # [n, n]
        heatmap(ax, M.to_numpy(), title=f"layer {r.layer}  α_min={r.alpha_min:.2f}", xlabel="expert j",
                ylabel="proxy i", colorbar_label=f"M[i, j] = ||{node}_j(R_i)||_{norm[1:]}")
    for ax in axes[len(per_layer):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.suptitle(f"ERC matrix M[i, j] = ||{node}_j(R_i)||_{norm[1:]} (clean)", y=1.03)
    out = {"erc_matrix": fig}

    from matplotlib.lines import Line2D

    from .compute import loss_curves

    # the clean loss swept past every layer's α_min (erc.csv holds --alpha only; the noisy draws are not kept)
    curves = loss_curves(matrix, sorted(set(erc["alpha"])))
    name = {layer: f"layer {layer} (α_min {a:.2f})" for layer, a in zip(per_layer["layer"], per_layer["alpha_min"])}
    fig, (ax,) = new_figure()
    line_by(ax, curves.assign(layer=curves["layer"].map(name)), "alpha", "erc_loss_clean", "layer", marker="",
            title=f"ERC loss vs α (noise {noise}, {samples} draws)", ylabel="ERC loss L_ERC(α)", legend=False)
    colour = {ln.get_label(): ln.get_color() for ln in ax.get_lines()}
    for layer, g in erc.groupby("layer", sort=True):
        ax.plot(g["alpha"], g["erc_loss"], linestyle="none", marker="o", markersize=3.5, color=colour[name[layer]],
                gid="erc_loss_noisy")
    for r in per_layer.itertuples():  # where the clean loss reaches 0
        ax.axvline(r.alpha_min, color=colour[name[r.layer]], linestyle=":", linewidth=0.9, gid="alpha_min")
    handles, labels = ax.get_legend_handles_labels()
    key = [Line2D([], [], color="0.3", label="clean M (line)"),
           Line2D([], [], color="0.3", linestyle="none", marker="o", markersize=3.5,
                  label=f"noisy M, mean of {samples} draws (--alpha)"),
           Line2D([], [], color="0.3", linestyle=":", linewidth=0.9, label="α_min: clean loss reaches 0")]
    ax.legend(handles + key, labels + [h.get_label() for h in key], fontsize=7, frameon=False)
    ax.set_xlim(0, float(curves["alpha"].max()))
    out["erc_loss"] = fig
    return out

def erc_figures(result: Any) -> dict[str, Any]:
    o = result.options
    return plot_erc(result["erc.csv"], result["erc_layers.csv"], result["erc_matrix.csv"], o.node, o.norm, o.noise,
                    o.samples)
