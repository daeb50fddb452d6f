"""Figures of ``moetool placement``: ``placement_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any


def _placement_series(df: Any) -> Any:
    """``df`` with ``series``: the method, with EPLB's redundant slots per GPU when it has any."""
    df = df.copy()
    extra = df["replicas"] // df["gpus"]
    df["series"] = [m if e == 0 else f"{m} +{e}/GPU" for m, e in zip(df["method"], extra)]
    return df

def _stale_twin(series: str) -> tuple[str, int]:
    """``eplb_stale[ +r/GPU]`` drawn dashed in the colour of ``eplb[ +r/GPU]``."""
    return series.replace("eplb_stale", "eplb"), int("eplb_stale" in series)

def plot_placement(overall: Any, per_layer: Any) -> dict[str, Any]:
    """``placement_imbalance``: overall per-GPU load imbalance against G, one line per placement;
    ``placement_layers``: per-layer imbalance at the largest G below n."""
    from ...report.figures import line_by, new_figure

    fig, (ax,) = new_figure(width=5.0)
    err = ("imbalance_lo", "imbalance_hi") if {"imbalance_lo", "imbalance_hi"} <= set(overall.columns) else None
    line_by(ax, _placement_series(overall), "gpus", "imbalance", "series", title="expert-parallel load imbalance",
            xlabel="GPUs (G)", ylabel="max / mean GPU load (over layers)", twin=_stale_twin, yerr=err)
    ax.set_xscale("log", base=2)
    gs = sorted(int(g) for g in overall["gpus"].unique())
    ax.set_xticks(gs, [str(g) for g in gs])
    ax.minorticks_off()
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    out = {"placement_imbalance": fig}
    from .compute import headline_gpus

    G = headline_gpus(per_layer)
    fig, (ax,) = new_figure(width=5.0)
    err = ("imbalance_lo", "imbalance_hi") if {"imbalance_lo", "imbalance_hi"} <= set(per_layer.columns) else None
    line_by(ax, _placement_series(per_layer[per_layer["gpus"] == G]), "layer", "imbalance", "series",
            title=f"per-layer load imbalance on {G} GPUs", ylabel="max / mean GPU load", twin=_stale_twin, yerr=err)
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    out["placement_layers"] = fig
    return out

def placement_figures(result: Any) -> dict[str, Any]:
    return plot_placement(result["placement_overall.csv"], result["placement.csv"])
