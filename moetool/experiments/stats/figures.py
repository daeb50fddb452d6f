"""Figures of ``moetool stats``: ``stats_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any

from ...report.figures import yerr_columns


def plot_load(load: Any) -> Any:
    """Heatmap layer x expert of load / uniform, diverging colormap centred at 1."""
    from matplotlib.colors import TwoSlopeNorm

    from ...report.figures import heatmap, new_figure

    n = int(load["expert"].max()) + 1
    mat = load.pivot(index="layer", columns="expert", values="load_fraction") * n  # [layers, n]
    fig, (ax,) = new_figure(width=max(4.2, 0.18 * n + 2), height=max(2.4, 0.3 * len(mat) + 1.2))
    im = heatmap(ax, mat.to_numpy(), title="expert load / uniform (1/n)", xlabel="expert", ylabel="layer",
                 cmap="RdBu_r", colorbar_label="load / uniform load (1 = balanced)")
    lo, hi = float(mat.min().min()), float(mat.max().max())
    im.set_norm(TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01)))
    ax.set_yticks(range(len(mat)), [str(i) for i in mat.index])
    return fig

def plot_coactivation(co: Any, layers: Any) -> Any:
    """One ``P(b | a)`` panel per layer (diagonal blank)."""
    import numpy as np

    from ...report.figures import grid_shape, heatmap, new_figure

    rows, cols = grid_shape(len(layers))
    fig, axes = new_figure(rows, cols, width=3.4, height=3.0)
    top = float(np.nan_to_num(co["p_b_given_a"].max(), nan=1.0)) or 1.0  # one colour scale for every layer
    for ax, info in zip(axes, layers.itertuples()):
        n = info.n_experts
        g = co[co["layer"] == info.layer]
        mat = np.full((n, n), np.nan)  # [n, n] row a, column b; diagonal blank
        mat[g["a"], g["b"]] = g["p_b_given_a"]
        heatmap(ax, mat, title=f"layer {info.layer}", xlabel="b", ylabel="a", colorbar_label="p_b_given_a",
                vmin=0, vmax=top)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    k, n = int(layers["top_k"].iloc[0]), int(layers["n_experts"].iloc[0])
    fig.suptitle(f"P(b | a); independent uniform routing: (K-1)/(n-1) = {(k - 1) / max(n - 1, 1):.3g}")
    fig.tight_layout()
    return fig

def plot_domain_load(dom: Any) -> Any:
    """Per layer: token fraction of each expert (share of the domain's tokens using it, K x load), one bar per
    domain; the uniform reference K/n dashed."""
    import numpy as np

    from ...report.figures import grid_shape, new_figure

    layer_ids = sorted(dom["layer"].unique())
    domains = list(dict.fromkeys(dom["domain"]))
    n = int(dom["expert"].max()) + 1
    rows, cols = grid_shape(len(layer_ids), max_cols=2)
    fig, axes = new_figure(rows, cols, width=max(4.2, 0.12 * n * len(domains) + 2), height=2.8)
    width = 0.8 / len(domains)
    step = 1 if n <= 16 else 4  # 32+ expert labels side by side are unreadable
    for i, (ax, li) in enumerate(zip(axes, layer_ids)):
        g = dom[dom["layer"] == li]
        for j, name in enumerate(domains):
            d = g[g["domain"] == name]
            ax.bar(d["expert"] + (j - (len(domains) - 1) / 2) * width, d["token_fraction"], width=width, label=name)
        ax.axhline(float(g["uniform_token_fraction"].iloc[0]), color="k", linewidth=0.8, linestyle="--",
                   label="uniform K/n")
        ax.set_title(f"layer {li}")
        ax.set_xlabel("expert" if i // cols == rows - 1 else "")
        ax.set_xticks(np.arange(0, n, step))
        ax.set_xlim(-0.6, n - 0.4)
    for ax in axes[len(layer_ids):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, fontsize=7)
    fig.supylabel("share of the domain's tokens", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig

def plot_specialization(spec: Any) -> Any:
    """Vocabulary specialisation per layer, one line per view (input / next token / predicted)."""
    from ...report.figures import line_by, new_figure

    y = "specialization" if spec["specialization"].notna().any() else "specialization_all_ids"
    note = "" if y == "specialization" else " (every token id: none reaches --min-count)"
    fig, (ax,) = new_figure(title="vocabulary specialisation (first-ranked expert)" + note)
    line_by(ax, spec.dropna(subset=[y]), "layer", y, "view", marker="o", twin=None,
            ylabel="share routed to the token's top expert")
    ax.set_ylim(0, 1.02)
    return fig

def plot_cross_layer(pairs: Any, summary: Any) -> Any:
    """One ``P(b at next | a at l)`` heatmap per pair of consecutive MoE layers (one colour scale)."""
    import numpy as np

    from ...report.figures import grid_shape, heatmap, new_figure

    rows, cols = grid_shape(len(summary))
    fig, axes = new_figure(rows, cols, width=3.4, height=3.0)
    top = float(np.nan_to_num(pairs["p_b_given_a"].max(), nan=1.0)) or 1.0
    for ax, info in zip(axes, summary.itertuples()):
        g = pairs[(pairs["layer"] == info.layer) & (pairs["next_layer"] == info.next_layer)]
        mat = np.full((int(g["a"].max()) + 1, int(g["b"].max()) + 1), np.nan)  # [n, m] row a at l, column b
        mat[g["a"], g["b"]] = g["p_b_given_a"]
        heatmap(ax, mat, title=f"{info.layer} -> {info.next_layer}: MI {info.mutual_information:.3f} nats",
                xlabel=f"expert at layer {info.next_layer}", ylabel=f"expert at layer {info.layer}", vmin=0, vmax=top,
                colorbar_label="P(b at next layer | a)")
    for ax in axes[len(summary):]:
        ax.set_visible(False)
    fig.suptitle(f"P(b at next layer | a); independent uniform routing: K/n = {summary['uniform_max_p'].iloc[0]:.3g}")
    fig.tight_layout()
    return fig

def plot_balance(layers: Any) -> Any:
    """Per layer: max load / uniform and load entropy / log n, with 95% error bars when ``_lo``/``_hi`` exist."""
    from ...report.figures import line_by, new_figure

    df = layers.assign(model="router")
    fig, axes = new_figure(1, 2)
    for ax, col, title in ((axes[0], "max_load_ratio", "max load / uniform (1 = balanced)"),
                           (axes[1], "load_entropy_norm", "load entropy / log n (1 = balanced)")):
        line_by(ax, df, "layer", col, "model", title=title, marker="o", yerr=yerr_columns(df, col), legend=False,
                ylabel="")
        ax.axhline(1.0, color="k", linewidth=0.8)
    return fig

def stats_figures(result: Any) -> dict[str, Any]:
    out = {"load_heatmap": plot_load(result["load.csv"])}
    if "coactivation.csv" in result.tables:  # (none where every layer routes one expert per token)
        out["coactivation"] = plot_coactivation(result["coactivation.csv"], result["layers.csv"])
    out["balance_by_layer"] = plot_balance(result["layers.csv"])
    if "domain_load.csv" in result.tables:
        out["domain_load"] = plot_domain_load(result["domain_load.csv"])
    if "specialization.csv" in result.tables:
        out["specialization"] = plot_specialization(result["specialization.csv"])
    if "cross_layer.csv" in result.tables:
        out["cross_layer"] = plot_cross_layer(result["cross_layer.csv"], result["cross_layer_summary.csv"])
    return out
