"""Figures of ``moetool prune``: ``prune_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any

from ...report.figures import ratio_curve


def plot_prune(curve: Any, importance: Any, ablation: Any) -> dict[str, Any]:
    """``prune_curve``: perplexity / the model's against the fraction of experts removed per layer, one line per
    criterion (the model itself a star at 0); ``prune_importance``: REAP saliency per layer and expert;
    ``prune_ablation``: perplexity / the model's for each single-expert ablation (when any ran)."""
    from ...report.figures import error_lengths, heatmap, new_figure

    out = {"prune_curve": ratio_curve(curve, "criterion", "fraction", title="perplexity as experts are removed",
                                      xlabel="fraction of each layer's experts removed",
                                      star="the model (nothing removed)", join=True)}
    mat = importance.pivot(index="layer", columns="expert", values="reap")  # [layers, n]
    n = mat.shape[1]
    fig, (ax,) = new_figure(width=max(4.2, 0.18 * n + 2), height=max(2.4, 0.3 * len(mat) + 1.2))
    heatmap(ax, mat.to_numpy(), title="REAP saliency", xlabel="expert", ylabel="layer",
            colorbar_label="mean weight x ||expert output||")
    ax.set_yticks(range(len(mat)), [str(i) for i in mat.index])
    out["prune_importance"] = fig
    if ablation is not None and len(ablation):  # none with --ablate 0
        fig, (ax,) = new_figure(width=max(4.2, 0.35 * len(ablation) + 1.5))
        x = range(len(ablation))
        ax.bar(x, ablation["ratio"] - 1.0, bottom=1.0, color="#4C72B0",
               yerr=error_lengths(ablation["ratio"], ablation["ratio_lo"], ablation["ratio_hi"]), capsize=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [f"{r.layer}:{r.expert}" for r in ablation.itertuples()], rotation=60)
        ax.set_xlabel("layer:expert (by REAP saliency, largest first)")
        ax.set_ylabel("perplexity / the model's (paired)")
        ax.set_title("single-expert ablation")
        out["prune_ablation"] = fig
    return out

def plot_prune_accuracy(evals: Any, metric: str = "acc") -> Any:
    """``prune_accuracy``: lm-eval accuracy retention (``metric`` / the router's) against the fraction of experts
    removed per layer, one line per criterion (MOVER-R error bars), one panel per task; the router a star."""
    from ...report.figures import line_by, new_figure

    rows = evals[evals.metric == metric]
    tasks = list(dict.fromkeys(rows.task))
    fig, axes = new_figure(ncols=max(1, len(tasks)), width=4.2)
    for ax, task in zip(axes, tasks):
        g = rows[rows.task == task]
        sweep = g[g.criterion != "router"]
        if len(sweep):
            line_by(ax, sweep, "fraction", "retention", "criterion", title=task,
                    yerr=("retention_lo", "retention_hi"), xlabel="fraction of each layer's experts removed",
                    ylabel=f"{metric} / the model's")
        router = g[g.criterion == "router"]
        ax.scatter(router["fraction"], router["retention"], marker="*", s=90, color="black", zorder=10,
                   label=f"the model ({metric} {float(router['value'].iloc[0]):.3f})" if len(router) else "the model")
        ax.legend(fontsize=7)
    return fig

def prune_figures(result: Any) -> dict[str, Any]:
    out = plot_prune(result["prune.csv"], result["prune_importance.csv"], result.tables.get("prune_ablation.csv"))
    evals = result.tables.get("prune_eval.csv")
    if evals is not None and (evals.metric == "acc").any():
        out["prune_accuracy"] = plot_prune_accuracy(evals)
    return out
