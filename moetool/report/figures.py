"""One house style for every figure (matplotlib, no screen needed): the one home of figure primitives.

- :func:`house_style` is a context manager (``matplotlib.rc_context``): the global ``rcParams`` never change.
  :func:`new_figure` builds its figure inside it; :func:`savefig` writes inside it, with TrueType fonts in PDF/PS
  (``pdf.fonttype`` 42, no Type 3 fonts).
- Sizes: :data:`ONE_COLUMN` (3.3 in) and :data:`TWO_COLUMN` (7 in); a figure never gets wider than two columns.
- Colours: the Okabe–Ito colour-blind-safe palette. Related series share a colour and differ in line style
  (:func:`line_by`'s ``twin``: a policy and its ``-isolated`` twin are solid and dashed).
- Axis labels in words with units: :data:`LABELS` maps column names; :func:`line_by` and :func:`finalize` (run at
  save time) replace a raw column-name label by its words. One legend per figure when panels share series.
- ``title``/``caption`` arguments carry the model and data (:func:`describe_run` builds the text).
- No legend covers data (:func:`place_legends`, run by :func:`finalize`); every colour bar has a label and a square
  matrix gets square cells (:func:`heatmap`).
- Figures are built with the object-oriented API on their own Agg canvas: the active backend (a notebook's) is
  never switched and pyplot does not keep them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ONE_COLUMN = 3.3  # inches
TWO_COLUMN = 7.0

#: Okabe & Ito (2008), colour-blind safe; black last.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]

STYLE: dict[str, Any] = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "legend.fontsize": 7, "figure.titlesize": 9, "legend.frameon": False,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
    "grid.linewidth": 0.5, "lines.linewidth": 1.2, "lines.markersize": 3.5,
    "figure.dpi": 100, "savefig.dpi": 200, "savefig.bbox": "tight",
    "pdf.fonttype": 42, "ps.fonttype": 42,  # TrueType, never Type 3 (venues reject Type 3 fonts)
    "image.cmap": "viridis",
}

#: column name -> axis label in words (with units). ``(%)`` columns are fractions in the CSVs, drawn ×100
#: (see :data:`PERCENT`).
LABELS: dict[str, str] = {
    "layer": "decoder layer",
    "expert": "expert",
    "alpha": "α (margin of the ERC loss)",
    "top1_change": "tokens whose top-1 expert changed (%)",
    "topk_change": "tokens whose top-K set changed (%)",
    "topk_overlap": "top-K overlap |A ∩ B| / K",
    "top1_agree": "top-1 agreement with the router",
    "jaccard": "Jaccard overlap of top-K sets",
    "entropy_ratio": "routing entropy ratio (checkpoint / reference)",
    "entropy_ref": "routing entropy of the reference (nats)",
    "entropy_ckpt": "routing entropy of the checkpoint (nats)",
    "entropy_vs_router": "routing entropy / the router's",
    "mass_recall_mean": "mass recall (mean over tokens)",
    "shortlist_size": "shortlist size (experts)",
    "router_flops_frac": "router FLOPs (fraction of the full router)",
    "codebook_size": "codebook size G",
    "rel_error_mean": "relative error ||y_S − y|| / ||y|| (mean)",
    "rel_error_median": "relative error ||y_S − y|| / ||y|| (median)",
    "erc_loss": "ERC loss (mean over noise draws)",
    "erc_loss_clean": "ERC loss (clean matrix)",
    "load_fraction": "share of top-K assignments",
    "token_fraction": "share of tokens choosing the expert",
    "load_entropy": "load entropy (nats)",
    "load_entropy_norm": "load entropy / log n",
    "confidence_entropy": "routing confidence entropy (nats)",
    "confidence_entropy_norm": "routing confidence entropy / log n",
    "max_load_ratio": "max load / uniform load",
    "p_b_given_a": "P(b | a)",
    "perplexity": "perplexity",
    "ratio": "ratio to the router",
    "spearman_prob_vs_norm": "Spearman(π_e, ||E_e(h)||)",
    "mean_abs_cos": "mean |cos(u_i, u_j)|",
    "tokens": "tokens",
}
#: columns stored as fractions and drawn as percentages
PERCENT = {"top1_change", "topk_change"}


def label(column: str) -> str:
    """Axis label of ``column``: its words from :data:`LABELS`, else the name with ``_`` as spaces."""
    return LABELS.get(column, column.replace("_", " "))


@contextlib.contextmanager
def house_style() -> Iterator[None]:
    """The house style for the block (``rc_context``: rcParams are restored afterwards)."""
    import matplotlib
    from cycler import cycler

    # no matplotlib.use(): the user's backend (a notebook's inline one) is left alone; figures are built with
    # the object-oriented API on an Agg canvas (new_figure), which needs no backend and no screen
    with matplotlib.rc_context({**STYLE, "axes.prop_cycle": cycler(color=PALETTE)}):
        yield


def new_figure(nrows: int = 1, ncols: int = 1, width: float = 4.2, height: float = 3.2, *,
               size: str | float | None = None, title: str = "", caption: str = "") -> tuple[Any, Any]:
    """``(fig, axes)`` in the house style; ``axes`` is always a flat list.

    ``width``/``height`` are per panel, in inches; the whole figure is scaled down to fit two columns (7 in).
    ``size="one"`` / ``"two"`` (or a width in inches) fixes the whole figure's width instead. ``title`` (model,
    data) goes above the panels, ``caption`` below.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    total_w, total_h = width * ncols, height * nrows
    target = {"one": ONE_COLUMN, "two": TWO_COLUMN}.get(size, size) if size is not None else min(total_w, TWO_COLUMN)
    scale = float(target) / total_w
    h_scale = max(scale, 0.6)  # panels keep a readable height when squeezed sideways
    with house_style():
        # a bare Figure on an Agg canvas: not registered with pyplot (a notebook does not show or keep every figure
        # built) and independent of the active backend
        fig = Figure(figsize=(float(target), total_h * h_scale))
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False)
    if title:
        fig.suptitle(title)
    if caption:
        set_caption(fig, caption)
    return fig, list(axes.ravel())


def set_caption(fig: Any, text: str) -> None:
    """A caption line below the panels (model, data, tokens)."""
    fig.text(0.5, 0.0, text, ha="center", va="top", fontsize=7, color="0.3", gid="caption")


def has_caption(fig: Any) -> bool:
    return any(t.get_gid() == "caption" for t in fig.texts)


def describe_run(model: Any = None, data: Any = None, tokens: int | None = None) -> str:
    """``"tiny · data: held-out.txt · 8,192 tokens"``: the title/caption text of a run's figures."""
    parts = [str(model)] if model else []
    if data:
        parts.append(f"data: {Path(str(data)).name}")
    if tokens:
        parts.append(f"{int(tokens):,} tokens")
    return " · ".join(parts)


def trace_marker(meta: Any) -> str:
    """``" (trace)"`` after the model's name where a run's manifest (or a result's meta) ``meta`` is an analysis of
    recorded routing (``--trace``: its ``trace``, fluctuation's ``traces``), ``" (trace, routing topk:1)"`` where
    the trace recorded a policy's choice; ``""`` for a forward. What tells a ``--trace`` run from a forward of the
    same model and text in a report, its headline and its figures' captions."""
    if not isinstance(meta, dict):
        return ""
    traces = meta.get("traces") if isinstance(meta.get("traces"), list) else [meta.get("trace")]
    traces = [t for t in traces if isinstance(t, dict)]
    if not traces:
        return ""
    policies = list(dict.fromkeys(str((t.get("routing") or {}).get("name")) for t in traces
                                  if isinstance(t.get("routing"), dict) and t["routing"].get("name")))
    policies = [x for x in policies if x != "router"]
    return f" (trace, routing {', '.join(policies)})" if policies else " (trace)"


def grid_shape(n: int, max_cols: int = 3) -> tuple[int, int]:
    """``(rows, cols)`` for ``n`` panels: at most ``max_cols`` wide, near square (4 -> 2×2)."""
    import math

    n = max(1, n)
    cols = min(max_cols, n if n <= max_cols else math.ceil(math.sqrt(n)))
    return -(-n // cols), cols


def heatmap(ax: Any, matrix: Any, title: str = "", xlabel: str = "", ylabel: str = "", cmap: str = "viridis",
            colorbar: bool = True, vmin: float | None = None, vmax: float | None = None,
            colorbar_label: str = "") -> Any:
    """``imshow`` of ``matrix`` (no grid). Pass ``vmin``/``vmax`` so every panel of a run shares one scale.

    A square matrix (expert x expert) gets square cells; a colour bar always says what it measures
    (``colorbar_label``, a column name or words; required with ``colorbar``) and is as tall as the matrix.
    """
    import numpy as np

    if colorbar and not colorbar_label:
        raise ValueError("heatmap: a colour bar needs colorbar_label (what the colours measure)")
    rows, cols = np.shape(matrix)[:2]
    im = ax.imshow(matrix, aspect="equal" if rows == cols else "auto", cmap=cmap, interpolation="nearest",
                   vmin=vmin, vmax=vmax)
    ax.set_title(title)
    ax.set_xlabel(label(xlabel) if xlabel in LABELS else xlabel)
    ax.set_ylabel(label(ylabel) if ylabel in LABELS else ylabel)
    ax.grid(False)
    if colorbar:
        # in axes coordinates, so it follows the (aspect-shrunk) matrix: as tall as the drawn cells
        cb = ax.figure.colorbar(im, cax=ax.inset_axes((1.04, 0.0, 0.05, 1.0)))
        cb.set_label(label(colorbar_label) if colorbar_label in LABELS else colorbar_label,
                     fontsize=STYLE["axes.labelsize"])
        cb.ax.tick_params(labelsize=STYLE["ytick.labelsize"])
    return im


def default_twin(key: str) -> tuple[str, int]:
    """``(family, variant)`` of a series name: ``x-isolated`` / ``x+isolate`` / ``x (isolated)`` -> ``(x, 1)``,
    anything else -> ``(key, 0)``. Series of one family share a colour; variant 1 is dashed."""
    for suffix in ("-isolated", "+isolate", " (isolated)", ":isolate"):
        if key.endswith(suffix):
            return key[: -len(suffix)], 1
    return key, 0


def series_styles(keys: Sequence[Any], twin: Callable[[str], tuple[str, int]] | None = default_twin,
                  families: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{key: {color, linestyle, marker}}``: one colour (and marker) per family, one line style per variant.
    ``families`` fixes the colour order (the same series get the same colour in every figure of a run)."""
    twin = twin or (lambda k: (k, 0))
    fam_of = {str(k): twin(str(k)) for k in keys}
    order = list(families or []) + [f for f, _ in fam_of.values() if f not in (families or [])]
    order = list(dict.fromkeys(order))
    return {k: {"color": PALETTE[order.index(f) % len(PALETTE)], "linestyle": LINESTYLES[v % len(LINESTYLES)],
                "marker": MARKERS[order.index(f) % len(MARKERS)]} for k, (f, v) in fam_of.items()}


def error_lengths(value: Any, lo: Any, hi: Any) -> Any:
    """matplotlib's ``yerr`` ``[2, n]`` (lengths below / above ``value``) of the interval ``[lo, hi]``.

    Never negative: a bound on the wrong side of its value (an interval that does not contain its estimate, or
    float rounding between a table's value and its interval) draws no bar on that side rather than failing the
    figure; NaN bounds (no interval) stay NaN: no bar."""
    import numpy as np

    v = np.asarray(value, dtype=float)
    below = np.asarray(v - np.asarray(lo, dtype=float))
    above = np.asarray(np.asarray(hi, dtype=float) - v)
    return np.clip(np.vstack([below.reshape(1, -1), above.reshape(1, -1)]), 0.0, None)  # NaN stays NaN


def log_axis_if_wide(ax: Any, values: Any, axis: str = "y", decades: float = 1.0) -> bool:
    """A log scale on ``axis`` only when the positive ``values`` span at least ``decades`` decades (max / min >=
    10 ** decades), with ticks a reader reads at a glance: 1, 2, 5 x 10^k written as plain numbers (``20``,
    ``0.5``), never ``3 x 10^1`` or a lone ``10^0``; a smaller range stays linear. Returns whether it is log."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) == 0 or v.max() < v.min() * 10 ** decades:
        return False
    getattr(ax, f"set_{axis}scale")("log")
    ax_ = ax.yaxis if axis == "y" else ax.xaxis
    ax_.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax_.set_minor_formatter(NullFormatter())
    return True


def line_by(ax: Any, df: Any, x: str, y: str, by: str, title: str = "", marker: str | None = None, *,
            twin: Callable[[str], tuple[str, int]] | None = default_twin, families: Sequence[str] | None = None,
            yerr: tuple[str, str] | None = None, legend: bool = True, xlabel: str | None = None,
            ylabel: str | None = None) -> None:
    """One line per value of column ``by``; axis labels from :data:`LABELS`.

    ``twin`` maps a series name to ``(family, variant)``: a family shares a colour and marker, variants differ
    in line style (default: ``<policy>-isolated`` dashed beside ``<policy>`` solid). ``yerr=(lo, hi)`` names the
    columns of a confidence interval (drawn as error bars). Columns in :data:`PERCENT` are drawn ×100.
    """
    scale = 100.0 if y in PERCENT else 1.0
    styles = series_styles(list(dict.fromkeys(str(k) for k in df[by])), twin, families)
    for n, (key, g) in enumerate(df.groupby(by, sort=False)):
        g = g.sort_values(x)
        st = dict(styles[str(key)])
        if marker is not None:
            st["marker"] = marker
        # later series drawn slightly thinner on top, so a line hidden under another stays visible
        kw = dict(label=str(key), linewidth=1.4 - 0.15 * min(n, 4), markersize=3.5, zorder=2 + n, **st)
        if yerr is not None:
            ys = g[y] * scale
            ax.errorbar(g[x], ys, yerr=error_lengths(ys, g[yerr[0]] * scale, g[yerr[1]] * scale), capsize=2,
                        elinewidth=0.8, **kw)
        else:
            ax.plot(g[x], g[y] * scale, **kw)
    if df[x].dtype.kind in "iu":  # layers, shortlist sizes: integer ticks only
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel if xlabel is not None else label(x))
    ax.set_ylabel(ylabel if ylabel is not None else label(y))
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=STYLE["legend.fontsize"], frameon=False)


def finalize(fig: Any) -> Any:
    """House rules applied before saving (idempotent): raw column-name axis labels become words, text sizes
    follow the style, and panels that repeat the same legend get one legend for the figure."""
    from matplotlib.text import Text

    if getattr(fig, "_moetool_final", False):
        return fig
    fig._moetool_final = True
    axes = [ax for ax in fig.axes if ax.get_visible()]
    for ax in axes:
        for axis, get, set_ in (("x", ax.get_xlabel, ax.set_xlabel), ("y", ax.get_ylabel, ax.set_ylabel)):
            text = get()
            if text in LABELS:
                set_(label(text) if text not in PERCENT else label(text).replace("(%)", "(fraction)"))
        ax.title.set_fontsize(STYLE["axes.titlesize"])
        ax.xaxis.label.set_fontsize(STYLE["axes.labelsize"])
        ax.yaxis.label.set_fontsize(STYLE["axes.labelsize"])
        ax.tick_params(labelsize=STYLE["xtick.labelsize"])
    if fig._suptitle is not None:
        fig._suptitle.set_fontsize(STYLE["figure.titlesize"])
    for ax in axes:
        if ax.get_legend() is not None:
            for t in ax.get_legend().get_texts():
                t.set_fontsize(STYLE["legend.fontsize"])
    _one_legend(fig, axes)
    place_legends(fig)
    captions = [t for t in fig.findobj(Text) if t.get_gid() == "caption"]
    if captions:
        low = _lowest(fig, captions)
        for t in captions:
            t.set_fontsize(7)
            t.set_y(min(0.0, low - 0.01))
    return fig


def _lowest(fig: Any, skip: list[Any]) -> float:
    """The figure y (fraction) of the lowest drawn thing but ``skip``: axes with their tick labels (rotated ones
    reach far below), legends, texts. The caption goes under it, never over a label."""
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    boxes += [a.get_window_extent(renderer) for a in (*fig.legends, *fig.texts) if a not in skip and a.get_visible()]
    ys = [b.y0 for b in boxes if b is not None and b.height > 0]
    return min(ys) / fig.bbox.height if ys else 0.0


def _one_legend(fig: Any, axes: list[Any]) -> None:
    """Replace per-panel legends that repeat one set of series by one legend below the panels."""
    legends = [(ax, ax.get_legend()) for ax in axes if ax.get_legend() is not None]
    if len(legends) < 2:
        return
    handles: dict[str, Any] = {}
    for ax, _ in legends:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if len(handles) > 12:
        return
    for _, lg in legends:
        lg.remove()
    try:
        fig.tight_layout()
    except (ValueError, RuntimeError):  # a layout it cannot solve: keep matplotlib's own
        pass
    fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(handles), 4), fontsize=STYLE["legend.fontsize"], frameon=False)


def data_extents(ax: Any, renderer: Any) -> tuple[list[Any], list[Any]]:
    """What ``ax`` draws as data, in display coordinates: ``(paths, boxes)``. Paths: every line (reference lines
    included), error-bar segment and scatter point; boxes: bars and other patches."""
    import numpy as np
    from matplotlib.collections import LineCollection, PathCollection
    from matplotlib.path import Path as MPath

    paths, boxes = [], []
    for ln in ax.get_lines():
        if ln.get_visible() and len(ln.get_xydata()):
            xy = ln.get_transform().transform(np.asarray(ln.get_xydata(), float))
            paths.append(MPath(xy[np.isfinite(xy).all(1)]))
    for c in ax.collections:
        if not c.get_visible():
            continue
        if isinstance(c, LineCollection):
            paths += [MPath(c.get_transform().transform(np.asarray(seg, float))) for seg in c.get_segments()
                      if len(seg)]
        elif isinstance(c, PathCollection):
            xy = c.get_offset_transform().transform(np.asarray(c.get_offsets(), float))
            paths += [MPath(p[None]) for p in xy[np.isfinite(xy).all(1)]]
    boxes += [p.get_window_extent(renderer) for p in ax.patches if p.get_visible()]
    return paths, boxes


def covers_data(box: Any, axes: Sequence[Any], renderer: Any) -> bool:
    """Whether the display box ``box`` (a legend's) covers anything the ``axes`` draw as data."""
    for ax in axes:
        paths, boxes = data_extents(ax, renderer)
        if any(b.overlaps(box) for b in boxes):
            return True
        for p in paths:
            if len(p.vertices) == 1:
                if box.contains(*p.vertices[0]):
                    return True
            elif len(p.vertices) and p.intersects_bbox(box, filled=False):
                return True
    return False


#: in-axes legend corners tried before a legend goes outside its axes
LEGEND_SPOTS = ("upper right", "upper left", "lower right", "lower left", "center right", "center left",
                "upper center", "lower center")


def place_legends(fig: Any) -> None:
    """Every axes legend covers no data: it stays where it is if it covers none, else takes the first free corner
    of :data:`LEGEND_SPOTS`, else goes outside its axes (to the right when no panel is there, else under the
    panels as a figure legend)."""
    axes = [ax for ax in fig.axes if ax.get_visible()]
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        lg = ax.get_legend()
        if lg is None or not lg.get_visible():
            continue
        fig.canvas.draw()  # positions after layout (limits, aspect, tight_layout)
        if not covers_data(lg.get_window_extent(renderer), axes, renderer):
            continue
        for spot in LEGEND_SPOTS:
            lg.set_loc(spot)
            if not covers_data(lg.get_window_extent(renderer), axes, renderer):
                break
        else:
            box = ax.get_position()
            right = [o for o in axes if o is not ax and o not in ax.child_axes and o.get_position().x0 >= box.x1
                     and o.get_position().y0 < box.y1 and o.get_position().y1 > box.y0]
            if not right:
                lg.set_loc("upper left")
                lg.set_bbox_to_anchor((1.02, 1.0), transform=ax.transAxes)
            else:
                handles, labels = ax.get_legend_handles_labels()
                lg.remove()
                fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                           ncol=min(len(handles), 4), fontsize=STYLE["legend.fontsize"], frameon=False)


def tight_bbox(fig: Any) -> Any:
    """The box (inches) ``bbox_inches="tight"`` crops to: the figure's tight box plus ``savefig.pad_inches``, from
    the figure's own Agg renderer. Computed once, it serves the PNG and the PDF (matplotlib measured every artist
    again per file: about a fifth of a save); the two crops differ by at most a pixel from per-file ones."""
    import matplotlib

    with house_style():
        return fig.get_tightbbox(fig.canvas.get_renderer()).padded(matplotlib.rcParams["savefig.pad_inches"])


def savefig(fig: Any, path: str | Path, *, finalized: bool = False, bbox: Any = "tight", **kwargs: Any) -> Path:
    """Save ``fig`` in the house style (format from the suffix; PDFs with TrueType fonts), cropped to ``bbox``
    (matplotlib's ``bbox_inches``: ``"tight"``, or :func:`tight_bbox` computed once for several files). Does not
    close it."""
    import matplotlib
    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    if not finalized:
        finalize(fig)
    p = Path(path)
    fmt = p.suffix.lstrip(".").lower() or "png"
    # fig.tight_layout() leaves a PlaceHolderLayoutEngine, whose layout does nothing; matplotlib still draws the
    # whole figure once more per file for any engine (to lay it out before printing): that draw is dropped, the
    # file is the same (the same pixels, the same PDF bytes)
    engine = fig.get_layout_engine()
    idle = isinstance(engine, PlaceHolderLayoutEngine)
    try:
        if idle:  # None, never an rc's autolayout engine
            with matplotlib.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
                fig.set_layout_engine(None)
        with house_style():
            fig.savefig(p, format=fmt, dpi=STYLE["savefig.dpi"] if fmt == "png" else None, bbox_inches=bbox,
                        **kwargs)
    finally:
        if idle:
            fig.set_layout_engine(engine)
    return p


# ----- shared by several experiments' figures (moetool/experiments/<name>/figures.py) -----------------
def yerr_columns(df: Any, col: str) -> tuple[str, str] | None:
    """``(col_lo, col_hi)`` when ``df`` has that interval (not all NaN: ``--bootstrap 0``), else None."""
    lo, hi = f"{col}_lo", f"{col}_hi"
    return (lo, hi) if lo in df.columns and hi in df.columns and df[lo].notna().any() else None


def bar_errors(df: Any, col: str = "ratio") -> Any:
    """matplotlib's ``yerr`` ``[2, n]`` (distances below / above) of ``col`` from ``col_lo``/``col_hi``; None
    without an interval (NaN bounds draw no bar)."""
    if yerr_columns(df, col) is None:
        return None
    import numpy as np

    return np.nan_to_num(error_lengths(df[col], df[f"{col}_lo"], df[f"{col}_hi"]))


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


def ratio_curve(df: Any, by: str, x: str, *, title: str, xlabel: str, star: str, join: bool = False) -> Any:
    """One figure: perplexity / the model's own (paired ratio, bootstrap error bars) against ``x``, one line per
    value of ``by``; the row whose ``by`` is ``router`` (the model itself) a star. ``join``: the model's row is
    every line's first point too (a sweep that starts from the model: nothing pruned is the model)."""
    import pandas as pd

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
