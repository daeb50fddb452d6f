"""Figures of ``moetool offload`` (named by its spec, ``spec.py``): hit rate vs cache size per
policy (one panel per layer, 95% bootstrap error bars), next-layer prediction recall per layer, activation
coverage vs tokens."""

from __future__ import annotations

from typing import Any


def offload_figures(result: Any) -> dict[str, Any]:
    from ...report.figures import grid_shape, line_by, new_figure

    out: dict[str, Any] = {}
    cache = result["offload_cache.csv"]
    layers = sorted(cache["layer"].unique())
    fig, axes = new_figure(*grid_shape(len(layers)))
    yerr = ("hit_rate_lo", "hit_rate_hi") if cache["hit_rate_lo"].notna().all() else None
    for ax, layer in zip(axes, layers):
        line_by(ax, cache[cache["layer"] == layer], "capacity", "hit_rate", "policy", title=f"layer {layer}",
                marker="o", yerr=yerr, xlabel="cache size C (experts)", ylabel="hit rate")
        ax.set_ylim(0, 1.02)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    out["offload_hit_rate_vs_cache_size"] = fig
    pref = result["offload_prefetch.csv"] if "offload_prefetch.csv" in result else []  # a trace has no prefetch
    if len(pref):
        import pandas as pd

        long = pd.concat([pd.DataFrame({"layer": pref["layer"], "recall": pref[c], "lo": pref[f"{c}_lo"],
                                        "hi": pref[f"{c}_hi"], "kind": c.replace("_recall", "")})
                          for c in ("top1_recall", "topk_recall")])
        fig, axes = new_figure(1, 1)
        line_by(axes[0], long, "layer", "recall", "kind", marker="o",
                yerr=("lo", "hi") if long["lo"].notna().all() else None,
                xlabel="predicted MoE layer ℓ+1 (router applied to layer ℓ's output)", ylabel="recall")
        axes[0].set_ylim(0, 1.02)
        out["offload_prefetch_recall"] = fig
    cov = result["offload_coverage.csv"].assign(kind="all layers")
    fig, axes = new_figure(1, 1)
    line_by(axes[0], cov, "tokens", "coverage", "kind", marker="o", xlabel="first N tokens",
            ylabel="(layer, expert) slots activated")
    axes[0].set_xscale("log")
    axes[0].set_ylim(0, 1.02)
    out["offload_coverage"] = fig
    return out
