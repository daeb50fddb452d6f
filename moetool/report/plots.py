"""Per-experiment figures: ``figures(result) -> {name: matplotlib Figure}`` (saved by :mod:`moetool.report.writers`).

Built on the house-style primitives of :mod:`moetool.report.figures`. One section per experiment; the functions
take the experiment's tables, so a notebook can draw them from a :class:`~moetool.experiments.result.Result`
(``moetool.plots.figures(result)``) without writing anything.
"""

from __future__ import annotations

from typing import Any, Iterable


# ----- stats ----------------------------------------------------------------------------------
def plot_load(load: Any) -> Any:
    """Heatmap layer x expert of load / uniform, diverging colormap centred at 1."""
    from matplotlib.colors import TwoSlopeNorm

    from .figures import heatmap, new_figure

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

    from .figures import grid_shape, heatmap, new_figure

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

    from .figures import grid_shape, new_figure

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
    from .figures import line_by, new_figure

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

    from .figures import grid_shape, heatmap, new_figure

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
    from .figures import line_by, new_figure

    df = layers.assign(model="router")
    fig, axes = new_figure(1, 2)
    for ax, col, title in ((axes[0], "max_load_ratio", "max load / uniform (1 = balanced)"),
                           (axes[1], "load_entropy_norm", "load entropy / log n (1 = balanced)")):
        line_by(ax, df, "layer", col, "model", title=title, marker="o", yerr=_yerr(df, col), legend=False,
                ylabel="")
        ax.axhline(1.0, color="k", linewidth=0.8)
    return fig


def stats_figures(result: Any) -> dict[str, Any]:
    out = {"load_heatmap": plot_load(result["load.csv"]),
           "coactivation": plot_coactivation(result["coactivation.csv"], result["layers.csv"]),
           "balance_by_layer": plot_balance(result["layers.csv"])}
    if "domain_load.csv" in result.tables:
        out["domain_load"] = plot_domain_load(result["domain_load.csv"])
    if "specialization.csv" in result.tables:
        out["specialization"] = plot_specialization(result["specialization.csv"])
    if "cross_layer.csv" in result.tables:
        out["cross_layer"] = plot_cross_layer(result["cross_layer.csv"], result["cross_layer_summary.csv"])
    return out


# ----- norm-select ----------------------------------------------------------------------------
def plot_norm_select(agreement: Any, quality: Any, metric: str = "acc",
                     tasks: Iterable[str] | None = None, items: dict[str, int] | None = None) -> dict[str, Any]:
    """``retention`` (perplexity ratio and accuracy retention by policy) and ``agreement_by_layer``.

    ``items``: task -> number of lm-eval items scored (shown beside each task; ``n_samples`` of the manifest)."""
    import numpy as np

    from ..experiments.norm_select.compute import asked_rows
    from .figures import line_by, new_figure

    out = {}
    acc = asked_rows(quality, metric, tasks)
    fig, axes = new_figure(1, 2 if len(acc) else 1, width=max(4.2, 0.8 * quality.policy.nunique()))
    ppl = quality[quality.metric == "perplexity"]
    axes[0].bar(range(len(ppl)), ppl.ratio, color="tab:gray", yerr=_bar_err(ppl), capsize=2)
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
            axes[1].bar(np.arange(len(pols)) + i * width, r.ratio, width, yerr=_bar_err(r), capsize=2,
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
        line_by(ax, agreement, "layer", col, "policy", title=title, yerr=_yerr(agreement, col))
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(sorted(agreement.layer.unique()))
    out["agreement_by_layer"] = fig
    return out


def _yerr(df: Any, col: str) -> tuple[str, str] | None:
    """``(col_lo, col_hi)`` when ``df`` has that interval (not all NaN: ``--bootstrap 0``), else None."""
    lo, hi = f"{col}_lo", f"{col}_hi"
    return (lo, hi) if lo in df.columns and hi in df.columns and df[lo].notna().any() else None


def _bar_err(df: Any, col: str = "ratio") -> Any:
    """matplotlib's ``yerr`` ``[2, n]`` (distances below / above) of ``col`` from ``col_lo``/``col_hi``; None
    without an interval (NaN bounds draw no bar)."""
    if _yerr(df, col) is None:
        return None
    import numpy as np

    from .figures import error_lengths

    return np.nan_to_num(error_lengths(df[col], df[f"{col}_lo"], df[f"{col}_hi"]))


def norm_select_figures(result: Any) -> dict[str, Any]:
    tasks = result.meta.get("eval") or {}
    return plot_norm_select(result["agreement.csv"], result["quality.csv"], tasks=tasks.get("tasks"),
                            items=eval_items(result.meta.get("n_samples")))


def eval_items(n_samples: Any) -> dict[str, int]:
    """task -> items lm-eval scored for the router baseline, from a manifest's ``n_samples`` ({policy: {task:
    {original, effective}}}); {} when the run has none."""
    per_task = (n_samples or {}).get("router") or {}
    out = {}
    for task, n in per_task.items():
        n = n.get("effective", n.get("original")) if isinstance(n, dict) else n
        if n is not None:
            out[task] = int(n)
    return out


# ----- mass-recall ----------------------------------------------------------------------------
def plot_mass_recall(df: Any) -> dict[str, Any]:
    """Mass recall vs shortlist size per layer; mass recall vs router FLOPs fraction per layer."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from .figures import grid_shape, line_by, new_figure

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

    from .figures import grid_shape, line_by, new_figure

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


# ----- erc ------------------------------------------------------------------------------------
def plot_erc(erc: Any, per_layer: Any, matrix: Any, node: str, norm: str, noise: Any, samples: int) -> dict[str, Any]:
    """``erc_matrix`` (one heatmap of the clean M per layer) and ``erc_loss`` (L_ERC vs α, one line per layer)."""
    from .figures import grid_shape, heatmap, line_by, new_figure

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

    from ..experiments.erc.compute import loss_curves

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


# ----- approx ---------------------------------------------------------------------------------
def plot_approx(approx: Any, per_layer: Any) -> dict[str, Any]:
    """``approx_error`` (mean relative error per layer, one line per selector) and ``approx_layers``."""
    from .figures import line_by, new_figure

    out = {}
    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, approx, "layer", "rel_error_mean", "selector", title="k-term approximation error ||y_S − y||/||y||")
    ax.set_xticks(sorted(approx["layer"].unique()))
    out["approx_error"] = fig
    fig, (a1, a2) = new_figure(1, 2)
    a1.plot(per_layer["layer"], per_layer["spearman_prob_vs_norm"], marker="o", markersize=3)
    a1.set(xlabel="layer", ylabel="Spearman(π_e, ||E_e(h)||)", title="does the router predict the norm?")
    a2.plot(per_layer["layer"], per_layer["mean_abs_cos"], marker="o", markersize=3)
    a2.set(xlabel="layer", ylabel="mean |cos(u_i, u_j)|", title="orthogonality of the u_e")
    for ax in (a1, a2):
        ax.set_xticks(per_layer["layer"])
    fig.tight_layout()
    out["approx_layers"] = fig
    return out


# ----- fluctuation ----------------------------------------------------------------------------
def plot_fluctuation(df: Any) -> dict[str, Any]:
    """Paper Fig. 3: top-1 change (fluctuation rate) by layer per routing; entropy ratio by layer; plus each
    routing's entropy relative to the router's (the paper's ratio, method / baseline) at each checkpoint."""
    from .figures import grid_shape, line_by, new_figure

    df = df.assign(pair=[f"{r} -> {c}" for r, c in zip(df["reference"], df["checkpoint"])])
    pairs_ = list(dict.fromkeys(df["pair"]))
    out = {}
    for name, y in (("fluctuation_by_layer", "top1_change"), ("entropy_ratio_by_layer", "entropy_ratio")):
        fig, axes = new_figure(*grid_shape(len(pairs_), 3))
        lo, hi = f"{y}_lo", f"{y}_hi"  # bootstrap interval (error bars) when the run computed one
        yerr = (lo, hi) if lo in df and hi in df and df[lo].notna().all() else None
        for ax, p in zip(axes, pairs_):
            line_by(ax, df[df["pair"] == p], "layer", y, "routing", title=p, yerr=yerr)
        for ax in axes[len(pairs_):]:
            ax.set_visible(False)
        out[name] = fig
    plain = df[~df["routing"].str.endswith("-isolated")]
    if "router" in set(plain["routing"]) and plain["routing"].nunique() > 1:
        base = plain[plain["routing"] == "router"].set_index(["pair", "layer"])["entropy_ckpt"]
        rel = plain.assign(entropy_vs_router=[e / base.get((p, l), float("nan")) for e, p, l in
                                              zip(plain["entropy_ckpt"], plain["pair"], plain["layer"])])
        fig, axes = new_figure(*grid_shape(len(pairs_), 3))
        for ax, p in zip(axes, pairs_):
            line_by(ax, rel[rel["pair"] == p], "layer", "entropy_vs_router", "routing", title=p.split(" -> ")[1])
        for ax in axes[len(pairs_):]:
            ax.set_visible(False)
        out["entropy_vs_router_by_layer"] = fig
    return out


def fluctuation_figures(result: Any) -> dict[str, Any]:
    return plot_fluctuation(result["fluctuation.csv"])


def approx_figures(result: Any) -> dict[str, Any]:
    return plot_approx(result["approx.csv"], result["approx_layers.csv"])


def mass_recall_figures(result: Any) -> dict[str, Any]:
    return plot_mass_recall(result["mass_recall.csv"])


def ratio_curve(df: Any, by: str, x: str, *, title: str, xlabel: str, star: str, join: bool = False) -> Any:
    """One figure: perplexity / the model's own (paired ratio, bootstrap error bars) against ``x``, one line per
    value of ``by``; the row whose ``by`` is ``router`` (the model itself) a star. ``join``: the model's row is
    every line's first point too (a sweep that starts from the model: nothing pruned is the model)."""
    import pandas as pd

    from .figures import line_by, new_figure

    fig, (ax,) = new_figure(width=5.0)
    sweep = df[df[by] != "router"]
    start = df[df[by] == "router"]
    if join and len(start) and len(sweep):
        sweep = pd.concat([start.assign(**{by: v}) for v in dict.fromkeys(sweep[by])] + [sweep])
        sweep = sweep.sort_values(x, kind="stable")
    if len(sweep):
        line_by(ax, sweep, x, "ratio", by, title=title, yerr=("ratio_lo", "ratio_hi"), xlabel=xlabel,
                ylabel="perplexity / the model's own (paired)")
    router = df[df[by] == "router"]
    ax.scatter(router[x], router["ratio"], marker="*", s=90, color="black", zorder=10, label=star)
    ax.legend()
    return fig


# ----- topk ---------------------------------------------------------------------------------
def plot_topk(df: Any, layers: Any) -> dict[str, Any]:
    """``topk_frontier``: perplexity / the router's against the experts per token (fixed k, top-p; the router a
    star), and
    ``topk_layers``: experts per token by layer for each top-p policy."""
    from .figures import line_by, new_figure

    out = {"topk_frontier": ratio_curve(df, "kind", "mean_experts", title="compute-quality frontier",
                                        xlabel="experts per token (mean over MoE layers)",
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


# ----- margin -------------------------------------------------------------------------------
def plot_margin(margins: Any, flips: Any) -> dict[str, Any]:
    """``margin_flips``: the top-K (left) and top-1 (right) flip rates against the noise size eps, one line per
    layer (bootstrap error bars), and ``margin_quantiles``: the 5th/50th/95th percentile of the margin by layer."""
    from .figures import line_by, new_figure

    fl = flips.assign(layer=flips["layer"].map(lambda i: f"layer {i}"))
    fig, axes = new_figure(1, 2, width=4.0)
    for ax, col, title in ((axes[0], "topk_flip", "top-K set changed"), (axes[1], "top1_flip", "top-1 changed")):
        line_by(ax, fl, "eps", col, "layer", title=title, marker="o", yerr=(f"{col}_lo", f"{col}_hi"),
                xlabel="eps (noise / ||h||)", ylabel="share of tokens")
        positive = fl["eps"][fl["eps"] > 0]
        if len(positive):
            ax.set_xscale("symlog", linthresh=float(positive.min())) if (fl["eps"] == 0).any() else ax.set_xscale("log")
    out = {"margin_flips": fig}
    cols = {"margin_p05": "5th percentile", "margin_p50": "median", "margin_p95": "95th percentile"}
    q = margins.melt(id_vars="layer", value_vars=list(cols), var_name="quantile", value_name="margin")
    q["quantile"] = q["quantile"].map(cols)
    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, q, "layer", "margin", "quantile", title="routing margin by layer", marker="o",
            ylabel="margin s(K) - s(K+1)")
    if (q["margin"] > 0).all():
        ax.set_yscale("log")
    out["margin_quantiles"] = fig
    return out


def plot_margin_jaccard(jac: Any) -> dict[str, Any]:
    """``margin_jaccard``: the soft Jaccard between the router and each policy by layer (bootstrap error bars)."""
    from .figures import line_by, new_figure

    fig, (ax,) = new_figure(width=5.0)
    line_by(ax, jac, "layer", "soft_jaccard", "policy", title="soft Jaccard with the router by layer", marker="o",
            yerr=("soft_jaccard_lo", "soft_jaccard_hi"), ylabel="soft Jaccard (mean over tokens)")
    ax.set_ylim(0, 1.05)
    return {"margin_jaccard": fig}


def margin_figures(result: Any) -> dict[str, Any]:
    out = plot_margin(result["margin.csv"], result["margin_flips.csv"])
    if "margin_jaccard.csv" in result.tables and len(result["margin_jaccard.csv"]):
        out.update(plot_margin_jaccard(result["margin_jaccard.csv"]))
    return out


# ----- agreement ----------------------------------------------------------------------------
def plot_agreement(per_layer: Any, bins: Any) -> dict[str, Any]:
    """``agreement_flips_by_layer``: the top-K set (left) and top-1 (right) flip rates against the reference by layer, one
    line per precision (bootstrap error bars); ``agreement_margin``: the same flip rates per bin of the reference's
    routing margin, pooled over layers (tokens-weighted), one line per precision."""
    from .figures import line_by, new_figure

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


# ----- capacity -----------------------------------------------------------------------------
def plot_capacity(df: Any, layers: Any) -> dict[str, Any]:
    """``capacity_curve``: the dropped share of assignments (left) and perplexity / the router's (right) against the
    capacity factor, one line per drop order; ``capacity_layers``: the dropped share by layer, one line per cf and
    order. cf = inf sits at the right of the finite ones (no such x): left out of the curves."""
    import numpy as np
    import pandas as pd

    from .figures import line_by, log_axis_if_wide, new_figure

    out = {}
    finite = df[np.isfinite(df["cf"])]
    if len(finite):
        fig, axes = new_figure(ncols=2, width=4.0)
        line_by(axes[0], finite, "cf", "dropped_frac", "order", title="dropped assignments", marker="o",
                xlabel="capacity factor cf", ylabel="dropped share of assignments")
        line_by(axes[1], finite, "cf", "ratio", "order", title="perplexity", marker="o",
                yerr=("ratio_lo", "ratio_hi"), xlabel="capacity factor cf", ylabel="perplexity / router's (paired)")
        axes[1].axhline(1.0, color="black", linewidth=0.6, linestyle=":")
        # a collapse at small cf would flatten the rest: log, with readable ticks, when the range is wide
        log_axis_if_wide(axes[1], pd.concat([finite["ratio"], finite["ratio_hi"], finite["ratio_lo"]]))
        out["capacity_curve"] = fig
    if len(layers):
        lay = layers.assign(series=[f"cf {cf:g} ({order})" for cf, order in zip(layers["cf"], layers["order"])])
        fig, (ax,) = new_figure(width=5.0)
        line_by(ax, lay, "layer", "dropped_frac", "series", title="dropped assignments by layer",
                ylabel="dropped share of assignments")
        out["capacity_layers"] = fig
    return out


def capacity_figures(result: Any) -> dict[str, Any]:
    return plot_capacity(result["capacity.csv"], result["capacity_layers.csv"])


# ----- prune --------------------------------------------------------------------------------
def plot_prune(curve: Any, importance: Any, ablation: Any) -> dict[str, Any]:
    """``prune_curve``: perplexity / the model's against the fraction of experts removed per layer, one line per
    criterion (the model itself a star at 0); ``prune_importance``: REAP saliency per layer and expert;
    ``prune_ablation``: perplexity / the model's for each single-expert ablation (when any ran)."""
    from .figures import error_lengths, heatmap, new_figure

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
    removed per layer, one line per criterion (delta-method error bars), one panel per task; the router a star."""
    from .figures import line_by, new_figure

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


# ----- super experts -------------------------------------------------------------------------
def plot_super_experts(table: Any) -> dict[str, Any]:
    """``super_experts_heatmap``: max |expert output| per layer and expert (log colour), the super experts boxed;
    ``super_experts_ranked``: every (layer, expert) maximum, largest first (log scale), with the threshold."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from .figures import heatmap, log_axis_if_wide, new_figure

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


# ----- placement -----------------------------------------------------------------------------
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
    from .figures import line_by, new_figure

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
    from ..experiments.placement.compute import headline_gpus

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


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots): the
#: report page's captions (:mod:`moetool.report.page`), kept beside the functions that draw the figures
FIGURE_CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "prune_curve": ("Perplexity relative to the model's own routing on the same rows against the fraction of each "
                    "MoE layer's experts removed (masked out of the top-K), the least important first by each "
                    "criterion, or a seeded random set; the star is the model; error bars: the paired bootstrap "
                    "interval", ("prune.csv",), ("fraction", "ratio", "criterion", "*_lo/*_hi")),
    "prune_importance": ("REAP saliency of each expert (one row per MoE layer): the mean over the tokens routed to "
                         "it of routing weight times the norm of its output", ("prune_importance.csv",), ("reap",)),
    "prune_ablation": ("Perplexity relative to the model's own routing when one expert alone is removed, for the "
                       "experts with the largest REAP saliency; error bars: the paired bootstrap interval",
                       ("prune_ablation.csv",), ("ratio", "rank", "*_lo/*_hi")),
    "prune_accuracy": ("lm-eval accuracy relative to the model's own routing (retention) against the fraction of "
                       "each MoE layer's experts removed, one line per criterion, one panel per task; the star is "
                       "the model; error bars: the delta-method interval on lm-eval's standard errors",
                       ("prune_eval.csv",), ("fraction", "retention", "criterion", "retention_lo", "retention_hi")),
    "super_experts_heatmap": ("Largest |output| of each expert's down projection over the tokens routed to it and "
                              "its output dimensions (log scale; one row per MoE layer); the super experts boxed",
                              ("super_experts.csv",), ("max_abs_output", "is_super")),
    "super_experts_ranked": ("Every (layer, expert) maximum |output| of the down projection, largest first (log "
                             "scale when the values span a decade or more); red: the super experts; dashed: the "
                             "threshold they pass",
                             ("super_experts.csv",), ("max_abs_output", "rank", "is_super", "threshold")),
    "topk_frontier": ("Perplexity relative to the model's own routing on the same rows against the experts each "
                      "token uses (mean over MoE layers), for fixed k below the model's K and top-p routing; the "
                      "star is the model's own routing; error bars: the paired bootstrap interval", ("topk.csv",),
                      ("mean_experts", "ratio", "*_lo/*_hi")),
    "topk_layers": ("Top-p routing: experts per token (mean over real tokens) in each MoE layer, one line per p",
                    ("topk_layers.csv",), ("mean_experts",)),
    "margin_flips": ("Share of real tokens whose top-K set (left) or top-1 expert (right) changes when the router "
                     "input h is perturbed by Gaussian noise of relative size eps (h + eps ||h|| z / sqrt(d)), one "
                     "line per MoE layer; error bars: the bootstrap interval", ("margin_flips.csv",),
                     ("eps", "topk_flip", "top1_flip", "*_lo/*_hi")),
    "margin_quantiles": ("Routing margin: 5th, 50th and 95th percentile over real tokens of the K-th minus the "
                         "(K+1)-th largest selection score, by MoE layer", ("margin.csv",),
                         ("margin", "margin_p05", "margin_p50", "margin_p95")),
    "margin_jaccard": ("Soft Jaccard sum_e min(w_r, w_p) / sum_e max(w_r, w_p) between the router's weights and "
                       "each routing policy's on the same tokens (each normalised to sum 1 over its chosen experts; "
                       "the policy computed on the side, the model running its own routing), mean over real tokens "
                       "by MoE layer, one line per policy; error bars: the bootstrap interval",
                       ("margin_jaccard.csv",), ("policy", "soft_jaccard", "*_lo/*_hi")),
    "agreement_flips_by_layer": ("Share of real tokens whose chosen top-K set (left) or top-1 expert (right) differs from "
                           "the reference run's (the most precise of the list) on the same tokens, by MoE layer, one "
                           "line per precision (fp8/fp4/mxfp4 simulated by quantize-dequantize of the weights, run "
                           "in bf16); error bars: the bootstrap interval", ("agreement.csv",),
                           ("precision", "reference", "topk_flip", "top1_flip", "*_lo/*_hi")),
    "agreement_margin": ("The same flip rates per bin of the reference run's top-K routing margin (K-th minus "
                         "(K+1)-th selection score; the top-1 panel is binned by this top-K margin too), pooled "
                         "over MoE layers (tokens-weighted), one line per precision; empty bins left out", ("agreement_bins.csv",),
                         ("margin_lo", "margin_hi", "agreement_bins.topk_flip", "agreement_bins.top1_flip")),
    "capacity_curve": ("Expert capacity C = ceil(cf · tokens · K / n) per batch and MoE layer: the share of the "
                       "model's assignments beyond capacity (left) and perplexity relative to the model's own "
                       "routing on the same rows with them dropped (right) against cf, one line per drop order; "
                       "error bars: the paired bootstrap interval; dotted: no change (ratio 1)", ("capacity.csv",),
                       ("cf", "order", "dropped_frac", "ratio", "*_lo/*_hi")),
    "capacity_layers": ("The share of assignments beyond expert capacity in each MoE layer, one line per capacity "
                        "factor and drop order", ("capacity_layers.csv",), ("cf", "dropped_frac")),


    "placement_imbalance": ("Per-GPU load imbalance (max / mean GPU load; summed over MoE layers, each waiting for "
                            "its busiest GPU) against the number of GPUs, one line per expert placement the legend "
                            "names: contiguous, round-robin, DeepSeek's EPLB with R = slots × G redundant replicas "
                            "(+r/GPU), and eplb_stale (EPLB fitted on a --reference, when one was given); dotted: "
                            "perfect balance; error bars: the bootstrap interval", ("placement_overall.csv",),
                            ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
    "placement_layers": ("Per MoE layer: per-GPU load imbalance at the largest number of GPUs below the number of "
                         "experts, one line per placement; dotted: perfect balance; error bars: the bootstrap "
                         "interval", ("placement.csv",), ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
    "load_heatmap": ("Expert load relative to uniform routing (load_fraction × n), one row per layer and one column "
                     "per expert; 1 (white) is balanced, red above, blue below", ("load.csv",), ("load_fraction",)),
    "coactivation": ("P(b | a) per layer: of the tokens whose top-K contains expert a (row), the share whose top-K "
                     "also contains expert b (column); the title gives independent uniform routing's (K-1)/(n-1)",
                     ("coactivation.csv", "layers.csv"), ("coactivation",)),
    "balance_by_layer": ("Per layer: the largest expert load over uniform (left) and load entropy / log n (right); "
                         "1 is perfectly balanced; error bars: the bootstrap interval", ("layers.csv",),
                         ("max_load_ratio", "load_entropy", "*_lo/*_hi")),
    "domain_load": ("Per layer: the share of each domain's tokens routed to each expert (one bar per domain); "
                    "dashed: uniform routing's K/n", ("domain_load.csv",), ("domain_load",)),
    "specialization": ("Vocabulary specialisation per layer, one line per view (input token, next token, predicted "
                       "token): the share of a token's occurrences routed to its most frequent first-ranked expert",
                       ("specialization.csv",), ("specialization",)),
    "cross_layer": ("P(expert b at the next MoE layer | expert a at this one), one heatmap per pair of consecutive "
                    "layers, with their mutual information", ("cross_layer.csv", "cross_layer_summary.csv"),
                    ("cross_layer", "cross_layer_summary")),
    "retention": ("Each routing policy against the router: perplexity ratio (left, lower is better) and accuracy "
                  "retention per task (right, when tasks were evaluated); error bars: the bootstrap interval",
                  ("quality.csv",), ("ratio", "value", "*_lo/*_hi")),
    "agreement_by_layer": ("Per layer: top-K overlap (left) and top-1 agreement (right) of each policy's expert "
                           "choice with the router's", ("agreement.csv",), ("topk_overlap", "top1_agree")),
    "mass_recall_vs_shortlist": ("Per layer: mean mass recall against the shortlist size M, one line per codebook",
                                 ("mass_recall.csv",), ("mass_recall_mean", "codebook", "centroids")),
    "mass_recall_vs_router_flops": ("Per layer: mean mass recall against the router FLOPs spent (fraction of the "
                                    "full router's), one line per codebook", ("mass_recall.csv",),
                                    ("mass_recall_mean", "router_flops_frac")),
    "mass_recall_vs_bounds": ("Per layer, largest codebook: measured mass recall beside the paper's lower bound "
                              "and the scale-aware bound (log scale)", ("mass_recall.csv",),
                              ("mass_recall_mean", "bound_mean", "bound_scaled_mean")),
    "erc_matrix": ("The clean ERC matrix M[i, j] per layer: the norm of expert j's output on proxy i; the title "
                   "gives the layer's α_min", ("erc_matrix.csv", "erc_layers.csv"), ("M", "proxy", "alpha_min")),
    "erc_loss": ("ERC loss against the margin α, one line per layer", ("erc.csv",), ("erc_loss",)),
    "approx_error": ("Per layer: mean relative error ||y_S − y|| / ||y|| of the k-term approximation, one line per "
                     "expert selector", ("approx.csv",), ("rel_error",)),
    "approx_layers": ("Per layer: Spearman correlation of the router's probability with the expert output norm "
                      "(left) and the mean |cos| between the u_e (right)", ("approx_layers.csv",),
                      ("spearman_prob_vs_norm", "mean_abs_cos")),
    "fluctuation_by_layer": ("Per layer: the share of tokens whose top-1 expert changes between the two "
                             "checkpoints, one panel per checkpoint pair, one line per routing",
                             ("fluctuation.csv",), ("top1_change", "routing")),
    "entropy_ratio_by_layer": ("Per layer: routing entropy at the checkpoint over the reference's, one panel per "
                               "checkpoint pair, one line per routing", ("fluctuation.csv",),
                               ("entropy_ratio", "routing")),
    "entropy_vs_router_by_layer": ("Per layer: each routing's entropy over the router's at the same checkpoint",
                                   ("fluctuation.csv",), ("entropy_ref/entropy_ckpt", "routing")),
    "offload_hit_rate_vs_cache_size": ("Per layer: expert-cache hit rate against the cache size C, one line per "
                                       "eviction policy; error bars: the bootstrap interval",
                                       ("offload_cache.csv",), ("hit_rate", "policy")),
    "offload_prefetch_recall": ("Per layer: recall of the next layer's experts predicted from this layer's output "
                                "(top-1 and top-K)", ("offload_prefetch.csv",), ("top1_recall", "topk_recall")),
    "offload_coverage": ("Share of (layer, expert) slots activated by the first N tokens",
                         ("offload_coverage.csv",), ("coverage",)),
}


def figures(result: Any) -> dict[str, Any]:
    """Every figure of ``result``: the ``figures`` function its experiment's spec names
    (:mod:`moetool.experiments.registry`; none for an experiment without figures or a result of no experiment)."""
    import importlib

    from ..experiments.registry import EXPERIMENTS

    target = next((e.figures for e in EXPERIMENTS.values() if e.result == result.name), None)
    if target is None:
        return {}
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(result)
