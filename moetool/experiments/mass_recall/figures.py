"""Figures of ``moetool mass-recall``: ``mass_recall_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def plot_mass_recall(df: Any) -> dict[str, Any]:
    """Mass recall vs shortlist size per layer; mass recall vs router FLOPs fraction per layer."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from ...report.figures import grid_shape, line_by, new_figure

    df = df.assign(codebook=[f"G={g} {c}" for g, c in zip(df["codebook_size"], df["centroids"])])
    layers = sorted(df["layer"].unique())
    out = {}
    for name, x in (("mass_recall_vs_shortlist", "shortlist_size"),
                    ("mass_recall_vs_router_flops", "router_flops_frac")):
        fig, axes = new_figure(*grid_shape(len(layers)))
        ci = ("mass_recall_mean_lo", "mass_recall_mean_hi")  # bootstrap interval, when the run computed one
        yerr = ci if all(c in df for c in ci) and df[ci[0]].notna().all() else None
        flops = x == "router_flops_frac"
        lo, hi = min(float(df[x].min()), 1.0), max(float(df[x].max()), 1.0)  # the x range, the full router's 1 included
        for ax, layer in zip(axes, layers):
            if flops:  # the exact router's cost: left of the line the IVF router is cheaper
                ax.axvline(1.0, color="k", linewidth=0.8, linestyle="--", label="full router ((G + M) / n = 1)")
            line_by(ax, df[df["layer"] == layer], x, "mass_recall_mean", "codebook", title=f"layer {layer}",
                    yerr=yerr, xlabel="router inner products / the full router's, (G + M) / n" if flops else None)
            ax.set_ylim(0, 1.02)
            if flops and hi / lo > 8:  # codebooks of very different sizes: a log axis keeps each one's curve apart
                ax.set_xscale("log")
                ax.set_xlim(lo / 1.15, hi * 1.15)
                ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
        for ax in axes[len(layers):]:
            ax.set_visible(False)
        out[name] = fig
    if "bound_scaled_mean" in df.columns:  # measured mass recall against the paper's and the scale-aware bound
        out["mass_recall_vs_bounds"] = plot_mass_recall_bounds(df)
    return out

def plot_mass_recall_bounds(df: Any) -> Any:
    """Measured mass recall beside Proposition 1's bound and the scale-aware bound, largest codebook, per layer. The
    y axis spans the measured values (linear): bounds far below them (the paper's bound is often ~1e-9) are clipped,
    and the title says which and how low they go."""
    import pandas as pd

    from ...report.figures import grid_shape, line_by, new_figure

    G = df["codebook_size"].max()
    d = df[df["codebook_size"] == G]
    layers = sorted(d["layer"].unique())
    series = (("mass_recall_mean", "measured"), ("bound_scaled_mean", "scale-aware bound"),
              ("bound_mean", "paper bound (Prop. 1)"))
    long = pd.concat([pd.DataFrame({"layer": d["layer"], "shortlist_size": d["shortlist_size"], "value": d[col],
                                    "series": [f"{what} ({c})" for c in d["centroids"]]}) for col, what in series])
    measured = d["mass_recall_mean"].to_numpy(float)
    lo = max(0.0, float(measured.min()) - 0.1 * (1.02 - float(measured.min())))
    lo = 0.05 * (lo // 0.05)  # a round lower limit below every measured value
    clipped = []
    for col, what in series[1:]:
        v = d[col].to_numpy(float)
        if (v < lo).any():
            clipped.append(f"{what.split(' (')[0]} max {v.max():.2g}" + ("" if (v < lo).all() else ", partly shown"))
    title = f"mass recall and its lower bounds, G={G}"
    if clipped:
        title += f"\nbelow the axis (clipped at {lo:g}): " + "; ".join(clipped)
    fig, axes = new_figure(*grid_shape(len(layers)), title=title)
    for ax, layer in zip(axes, layers):
        line_by(ax, long[long["layer"] == layer], "shortlist_size", "value", "series", title=f"layer {layer}",
                marker="o", xlabel="shortlist size M (experts)", ylabel="mass recall or bound (mean over tokens)")
        ax.set_ylim(lo, 1.02)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    return fig

def mass_recall_figures(result: Any) -> dict[str, Any]:
    return plot_mass_recall(result["mass_recall.csv"])
