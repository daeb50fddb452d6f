"""Figures of ``moetool norm-select``: ``norm_select_figures(result) -> {name: matplotlib Figure}`` (named by its spec;
captions in ``spec.py``). Drawn with the house-style primitives of :mod:`moetool.report.figures`."""

from __future__ import annotations

from typing import Any, Iterable

from ...report.figures import eval_items, yerr_columns, bar_errors


def plot_norm_select(agreement: Any, quality: Any, metric: str = "acc",
                     tasks: Iterable[str] | None = None, items: dict[str, int] | None = None) -> dict[str, Any]:
    """``retention`` (perplexity ratio and accuracy retention by policy) and ``agreement_by_layer``.

    ``items``: task -> number of lm-eval items scored (shown beside each task; ``n_samples`` of the manifest)."""
    import numpy as np

    from .compute import asked_rows, data_rows
    from ...report.figures import line_by, new_figure

    out = {}
    acc = asked_rows(quality, metric, tasks)
    fig, axes = new_figure(1, 2 if len(acc) else 1, width=max(4.2, 0.8 * quality.policy.nunique()))
    ppl = data_rows(quality)
    axes[0].bar(range(len(ppl)), ppl.ratio, color="tab:gray", yerr=bar_errors(ppl), capsize=2)
    axes[0].axhline(1.0, color="k", linewidth=0.8)
    axes[0].set_xticks(range(len(ppl)), ppl.policy, rotation=35, ha="right")
    axes[0].set_ylabel("perplexity / router perplexity")
    axes[0].set_title("perplexity ratio (lower is better)")
    if len(acc):
        tasks = list(dict.fromkeys(acc.task))
        pols = list(dict.fromkeys(acc.policy))
        width = 0.8 / len(tasks)
        for i, t in enumerate(tasks):
            r = acc[acc.task == t].set_index("policy").reindex(pols)
            n = (items or {}).get(t)
            axes[1].bar(np.arange(len(pols)) + i * width, r.ratio, width, yerr=bar_errors(r), capsize=2,
                        label=f"{t} ({n:,} items)" if n else t)
        axes[1].axhline(1.0, color="k", linewidth=0.8)
        axes[1].set_xticks(np.arange(len(pols)) + 0.4 - width / 2, pols, rotation=35, ha="right")
        axes[1].set_ylabel(f"{metric} / router {metric}")
        how = {"acc": ", unnormalised", "acc_norm": ", length-normalised"}.get(metric, "")
        axes[1].set_title(f"accuracy retention (lm-eval {metric}{how})")
        # the legend in a band of headroom above the bars and error bars (it covers no data; finalize checks)
        ncol = 1 if len(tasks) < 4 else 2
        top = float(np.nanmax(np.concatenate([acc.ratio.to_numpy(float), acc.get("ratio_hi", acc.ratio).to_numpy(float),
                                              [1.0]])))
        axes[1].set_ylim(0, top * (1.08 + 0.1 * -(-len(tasks) // ncol)))
        axes[1].legend(fontsize=7, frameon=False, loc="upper center", ncol=ncol)
    out["retention"] = fig
    fig, axes = new_figure(1, 2)
    for ax, col, title in ((axes[0], "topk_overlap", "top-K overlap with the router"),
                           (axes[1], "top1_agree", "top-1 agreement with the router")):
        line_by(ax, agreement, "layer", col, "policy", title=title, yerr=yerr_columns(agreement, col))
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(sorted(agreement.layer.unique()))
    out["agreement_by_layer"] = fig
    return out

def norm_select_figures(result: Any) -> dict[str, Any]:
    tasks = result.meta.get("eval") or {}
    return plot_norm_select(result["agreement.csv"], result["quality.csv"], tasks=tasks.get("tasks"),
                            items=eval_items(result.meta.get("n_samples")))
