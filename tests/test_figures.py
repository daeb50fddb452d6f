"""House style: TrueType fonts in PDFs, labels in words, twins share a colour, one legend, two-column width,
and the style is a context (global rcParams untouched)."""

import re

import matplotlib
import numpy as np
import pandas as pd
import pytest

from moetool.report import RunDir
from moetool.report import figures as F


def curves():
    rows = [dict(pair=p, routing=r, layer=layer, top1_change=(i + 1) / 10 + layer / 100)
            for p in ("early -> final", "final -> early")
            for i, r in enumerate(["router", "router-isolated", "similarity", "similarity-isolated"])
            for layer in range(4)]
    return pd.DataFrame(rows)


def draw():
    df = curves()
    fig, axes = F.new_figure(*F.grid_shape(2), title="tiny-fine-early vs tiny-fine",
                             caption=F.describe_run("tiny", "data/held-out.txt", 8192))
    for ax, p in zip(axes, ["early -> final", "final -> early"]):
        F.line_by(ax, df[df.pair == p], "layer", "top1_change", "routing", title=p)
    return fig, axes


def font_subtypes(pdf: bytes) -> set[str]:
    return set(re.findall(rb"/Subtype\s*/(\w+)", pdf)) & {b"Type3", b"TrueType", b"CIDFontType2", b"Type1",
                                                           b"CIDFontType0"}


def test_pdf_has_truetype_fonts_and_no_type3(tmp_path):
    fig, _ = draw()
    F.savefig(fig, tmp_path / "f.pdf")
    subtypes = font_subtypes((tmp_path / "f.pdf").read_bytes())
    assert b"Type3" not in subtypes and subtypes & {b"TrueType", b"CIDFontType2"}, subtypes
    # the same figure with matplotlib's default (fonttype 3) does embed Type 3: the check can fail
    fig2, _ = draw()
    with matplotlib.rc_context({"pdf.fonttype": 3}):
        fig2.savefig(tmp_path / "g.pdf")
    assert b"Type3" in font_subtypes((tmp_path / "g.pdf").read_bytes())


def test_style_context_leaves_rcparams_unchanged(tmp_path):
    matplotlib.get_backend()  # resolve the backend first (that alone fills rcParams["backend"])
    before = {k: repr(v) for k, v in matplotlib.rcParams.items()}
    with F.house_style():
        assert matplotlib.rcParams["pdf.fonttype"] == 42
    fig, _ = draw()
    F.savefig(fig, tmp_path / "f.png")
    run = RunDir.create("x", tmp_path / "run")
    run.save_figure(draw()[0], "f")
    after = {k: repr(v) for k, v in matplotlib.rcParams.items()}
    assert {k for k in before if before[k] != after[k]} == set()


def test_labels_in_words_and_percent_scaled():
    fig, axes = draw()
    ax = axes[0]
    assert ax.get_ylabel() == "tokens whose top-1 expert changed (%)" and ax.get_xlabel() == "decoder layer"
    router = [ln for ln in ax.get_lines() if ln.get_label() == "router"][0]
    np.testing.assert_allclose(router.get_ydata(), [10.0, 11.0, 12.0, 13.0])  # fractions drawn as %
    fig2, (a,) = F.new_figure()
    a.plot([0, 1], [0.1, 0.2])
    a.set_xlabel("layer")
    a.set_ylabel("rel_error_mean")  # a raw column name set by hand is replaced at save time
    F.finalize(fig2)
    assert a.get_ylabel() == F.LABELS["rel_error_mean"] and a.get_xlabel() == "decoder layer"
    assert F.label("no_such_column") == "no such column"


def test_twins_share_colour_and_differ_in_line_style():
    fig, axes = draw()
    lines = {ln.get_label(): ln for ln in axes[0].get_lines()}
    assert lines["router"].get_color() == lines["router-isolated"].get_color() == F.PALETTE[0]
    assert lines["similarity"].get_color() == lines["similarity-isolated"].get_color() == F.PALETTE[1]
    assert lines["router"].get_linestyle() == "-" and lines["router-isolated"].get_linestyle() == "--"
    # the same series get the same colour in every panel
    other = {ln.get_label(): ln.get_color() for ln in axes[1].get_lines()}
    assert other == {k: ln.get_color() for k, ln in lines.items()}


def test_one_legend_per_figure_and_two_column_width():
    fig, axes = draw()
    assert all(ax.get_legend() is not None for ax in axes)
    F.finalize(fig)
    assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["router", "router-isolated", "similarity",
                                                                   "similarity-isolated"]
    fig4, axes4 = F.new_figure(1, 4)  # a four-panel strip: at most two columns wide
    assert fig4.get_size_inches()[0] == pytest.approx(F.TWO_COLUMN)
    one, _ = F.new_figure(size="one")
    assert one.get_size_inches()[0] == pytest.approx(F.ONE_COLUMN)
    assert F.grid_shape(4) == (2, 2) and F.grid_shape(3) == (1, 3) and F.grid_shape(7) == (3, 3)


def test_error_bars_from_interval_columns():
    df = pd.DataFrame({"layer": [0, 1], "policy": ["a", "a"], "ratio": [1.0, 2.0], "lo": [0.9, 1.5],
                       "hi": [1.2, 2.5]})
    fig, (ax,) = F.new_figure()
    F.line_by(ax, df, "layer", "ratio", "policy", yerr=("lo", "hi"))
    segs = [c for c in ax.collections if hasattr(c, "get_segments")][0].get_segments()
    np.testing.assert_allclose([s[:, 1] for s in segs], [[0.9, 1.2], [1.5, 2.5]])


def test_error_bars_are_never_negative_when_an_interval_excludes_its_value(tmp_path):
    """Issue 21.1: stats' balance figure with the issue's interval of max_load_ratio (estimate 1.339, interval
    [1.340, 1.895], entirely above it) failed with "'yerr' must not contain negative values". The bar below is
    drawn with length 0, the bar above to the bound; NaN bounds (no interval) draw no bar."""
    from moetool.experiments.stats.figures import plot_balance

    lengths = F.error_lengths([1.339, 2.0, 1.0], [1.340, 1.5, np.nan], [1.895, 1.9, np.nan])
    np.testing.assert_allclose(lengths[:, :2], [[0.0, 0.5], [0.556, 0.0]], atol=1e-12)
    assert np.isnan(lengths[:, 2]).all() and lengths.shape == (2, 3)
    layers = pd.DataFrame({"layer": [0, 1], "max_load_ratio": [1.2, 1.339], "max_load_ratio_lo": [1.1, 1.340],
                           "max_load_ratio_hi": [1.3, 1.895], "load_entropy_norm": [0.99, 0.98],
                           "load_entropy_norm_lo": [0.98, 0.97], "load_entropy_norm_hi": [0.995, 0.985]})
    fig = plot_balance(layers)
    segs = [c for c in fig.axes[0].collections if hasattr(c, "get_segments")][0].get_segments()
    np.testing.assert_allclose([s[:, 1] for s in segs], [[1.1, 1.3], [1.339, 1.895]])
    RunDir.create("stats", tmp_path / "run").save_figure(fig, "balance_by_layer")
    assert (tmp_path / "run" / "figures" / "balance_by_layer.png").stat().st_size > 0


def test_run_caption_goes_under_figures_without_one(tmp_path):
    run = RunDir.create("x", tmp_path / "run")
    run.caption = F.describe_run("tiny", "/data/heldout.jsonl", 8192)
    assert run.caption == "tiny · data: heldout.jsonl · 8,192 tokens"
    fig, _ = F.new_figure()
    run.save_figure(fig, "a")
    assert [t.get_text() for t in fig.texts if t.get_gid() == "caption"] == [run.caption]
    fig2, _ = F.new_figure(caption="own")
    run.save_figure(fig2, "b")
    assert [t.get_text() for t in fig2.texts if t.get_gid() == "caption"] == ["own"]


@pytest.mark.parametrize("rotation", [0, 45, 90])
def test_caption_sits_below_rotated_tick_labels_and_legend(tmp_path, rotation):
    """The caption's box overlaps no axes' box (tick labels included) and no figure legend."""
    fig, _ = draw() if rotation == 0 else F.new_figure(caption=F.describe_run("tiny", "data/held-out.txt", 8192))
    for ax in fig.axes:
        ax.bar(range(4), [1, 2, 3, 4])
        ax.set_xticks(range(4), [f"a long category name {i}" for i in range(4)], rotation=rotation)
    F.savefig(fig, tmp_path / "f.png")
    r = fig.canvas.get_renderer()
    cap = [t for t in fig.texts if t.get_gid() == "caption"][0].get_window_extent(r)
    others = [ax.get_tightbbox(r) for ax in fig.axes] + [lg.get_window_extent(r) for lg in fig.legends]
    assert others and all(cap.y1 <= b.y0 + 1e-6 for b in others)


# Okabe & Ito (2008), "Color Universal Design": the eight colour-blind-safe colours
OKABE_ITO = {"#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"}


def test_palette_is_colour_blind_safe_and_is_what_figures_draw():
    assert set(F.PALETTE) == OKABE_ITO and len(F.PALETTE) == len(OKABE_ITO)
    fig, axes = draw()
    drawn = {matplotlib.colors.to_hex(ln.get_color()).upper() for ax in axes for ln in ax.get_lines()}
    assert drawn and drawn <= OKABE_ITO
    with F.house_style():  # a plain plot in the house style cycles through the same colours
        fig2, (ax,) = F.new_figure()
        colours = [matplotlib.colors.to_hex(ax.plot([0, 1])[0].get_color()).upper() for _ in range(3)]
    assert colours == F.PALETTE[:3]


def test_heatmap_panels_of_one_figure_share_one_colour_scale_and_layer_order():
    from moetool.experiments.stats.figures import plot_coactivation, plot_cross_layer

    # two layers whose largest P(b|a) differ (0.9 vs 0.3): both panels on the scale 0 .. 0.9
    co = pd.DataFrame([dict(layer=li, a=a, b=b, p_b_given_a=(0.9 if li == 3 else 0.3) * (a + b) / 4, count=1)
                       for li in (3, 1) for a in range(3) for b in range(3) if a != b])
    layers = pd.DataFrame({"layer": [1, 3], "n_experts": [3, 3], "top_k": [2, 2]})
    fig = plot_coactivation(co, layers)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [im.get_clim() for im in images] == [(0.0, pytest.approx(0.9 * 3 / 4))] * 2
    assert [im.axes.get_title() for im in images] == ["layer 1", "layer 3"]
    pairs = pd.DataFrame([dict(layer=li, next_layer=li + 2, a=a, b=b, p_b_given_a=p, count=1)
                          for li, p in ((1, 0.2), (3, 0.7)) for a in range(2) for b in range(2)])
    summary = pd.DataFrame({"layer": [1, 3], "next_layer": [3, 5], "mutual_information": [0.1, 0.2],
                            "uniform_max_p": [0.5, 0.5]})
    fig = plot_cross_layer(pairs, summary)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [im.get_clim() for im in images] == [(0.0, 0.7)] * 2


# ----- issue 24: legends off the data, α past α_min, mass-recall axes, retention labels, colour bars, backend -----
def along(xy, step=1.0):
    """Points every ``step`` display pixels along the polyline ``xy`` (its vertices included)."""
    out = [xy[:1]]
    for a, b in zip(xy[:-1], xy[1:]):
        k = max(1, int(np.hypot(*(b - a)) / step))
        out.append(a + (b - a) * np.linspace(0, 1, k + 1)[1:, None])
    return np.concatenate(out)


def drawn_points(ax):
    """Display coordinates of what ``ax`` draws as data: line vertices and the lines between them, error bars,
    scatter offsets; and the boxes of its bars."""
    from matplotlib.collections import LineCollection, PathCollection

    pts = []
    for ln in ax.get_lines():
        xy = ln.get_transform().transform(np.asarray(ln.get_xydata(), float))
        xy = xy[np.isfinite(xy).all(1)]
        if len(xy):
            pts.append(along(xy) if ln.get_linestyle() not in ("None", "none", "") else xy)
    for c in ax.collections:
        if isinstance(c, LineCollection):
            pts += [along(c.get_transform().transform(np.asarray(s, float))) for s in c.get_segments() if len(s)]
        elif isinstance(c, PathCollection):
            pts.append(c.get_offset_transform().transform(np.asarray(c.get_offsets(), float)))
    pts = np.concatenate(pts) if pts else np.zeros((0, 2))
    return pts[np.isfinite(pts).all(1)], [p.get_window_extent() for p in ax.patches]


def legends_on_data(fig):
    """(legend texts, what it covers) for every legend whose box holds a drawn point (a line's vertex or a point on
    the line between two) or meets a bar."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert legends, "no legend drawn"
    bad = []
    for lg in legends:
        box = lg.get_window_extent(r)
        for ax in fig.axes:
            pts, bars = drawn_points(ax)
            inside = [(float(x), float(y)) for x, y in pts if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1]
            hit = [b for b in bars if b.width > 0 and b.height > 0 and b.overlaps(box)]
            if inside or hit:
                bad.append(([t.get_text() for t in lg.get_texts()], inside[:3], len(hit)))
    return bad


#: a tiny-early -> tiny run (384 tokens): per routing and layer (top-1 change, its 95% interval, entropy ratio)
ROUTINGS = {
    "router": [(0.06, 0.039, 0.094, 1.167), (0.414, 0.375, 0.453, 0.842), (0.273, 0.211, 0.32, 0.789),
               (0.331, 0.273, 0.398, 0.84)],
    "similarity": [(0.06, 0.047, 0.086, 1.164), (0.396, 0.352, 0.461, 0.846), (0.271, 0.188, 0.352, 0.792),
                   (0.328, 0.266, 0.414, 0.843)],
    "attention": [(0.544, 0.5, 0.594, 1.021), (0.734, 0.672, 0.805, 0.864), (0.427, 0.102, 0.648, 0.92),
                  (0.323, 0.039, 0.484, 0.944)],
    "router-isolated": [(0.055, 0.039, 0.086, 1.032), (0.31, 0.25, 0.344, 0.728), (0.143, 0.117, 0.172, 0.674),
                        (0.206, 0.188, 0.234, 0.766)],
    "similarity-isolated": [(0.06, 0.039, 0.102, 1.032), (0.328, 0.266, 0.375, 0.757), (0.146, 0.125, 0.172, 0.708),
                            (0.208, 0.172, 0.242, 0.79)],
    "attention-isolated": [(0.154, 0.07, 0.203, 1.006), (0.628, 0.531, 0.781, 0.838), (0.096, 0.016, 0.188, 0.705),
                           (0.135, 0.102, 0.188, 0.889)]}


#: entropy ratios that cross the whole panel (no free corner): matplotlib's "best" legend spot lies on a line
ZIGZAG = {"router": [1.2, 0.7, 1.2, 0.7], "similarity": [0.7, 1.2, 0.7, 1.2], "attention": [0.95] * 4,
          "router-isolated": [1.1, 0.8, 1.1, 0.8], "similarity-isolated": [0.8, 1.1, 0.8, 1.1],
          "attention-isolated": [1.0, 0.9, 0.9, 1.0]}


def fluctuation_table(entropy=None):
    """One checkpoint pair (the demo's shape: one panel, so the legend is the panel's own), six routings;
    ``entropy``: routing -> entropy ratio per layer instead of the run's."""
    return pd.DataFrame([dict(layer=layer, routing=r, reference="tiny-early", checkpoint="tiny", top1_change=y,
                              top1_change_lo=lo, top1_change_hi=hi, entropy_ref=1.4,
                              entropy_ratio=e if entropy is None else entropy[r][layer])
                         for r, rows in ROUTINGS.items() for layer, (y, lo, hi, e) in enumerate(rows)]
                        ).eval("entropy_ckpt = entropy_ref * entropy_ratio")


def quality_table(metric="acc"):
    rows = []
    for p, ppl, accs in (("router", 1.0, (0.8, 0.65)), ("norm:gate:l2", 1.95, (0.7, 0.6)),
                         ("norm:up:l2", 6.5, (0.4, 0.35)), ("norm:act:l2", 8.8, (0.25, 0.45)),
                         ("norm:glu:l2", 2.2, (0.4, 0.55)), ("norm:output:l2", 2.1, (0.55, 0.55))):
        rows.append(dict(policy=p, task="heldout", metric="perplexity", value=50 * ppl, router_value=50.0, ratio=ppl,
                         ratio_lo=ppl * 0.9, ratio_hi=ppl * 1.15))
        for t, a, base in zip(("moetool_code", "moetool_prose"), accs, (0.8, 0.65)):
            ratio = a / base
            for m in ("acc", "acc_norm"):
                rows.append(dict(policy=p, task=t, metric=m, value=a, router_value=base, ratio=ratio,
                                 ratio_lo=ratio - (0 if p == "router" else 0.33), ratio_hi=ratio + (0 if p == "router" else 0.45)))
    return pd.DataFrame(rows)


def agreement_table():
    return pd.DataFrame([dict(layer=layer, policy=p, topk_overlap=0.5, top1_agree=0.4, tokens=100)
                         for p in ("router", "norm:gate:l2") for layer in range(4)])


@pytest.mark.parametrize("name,entropy", [("fluctuation_by_layer", None), ("entropy_ratio_by_layer", ZIGZAG),
                                          ("retention", None)])
def test_legends_cover_no_data_point(tmp_path, name, entropy):
    """After saving, no legend's box holds a point of a line or an error bar or meets a bar (the legends of these
    figures used to sit on the curves and bars: one checkpoint pair = one panel with its own legend)."""
    from moetool.experiments.fluctuation.figures import plot_fluctuation
    from moetool.experiments.norm_select.figures import plot_norm_select

    if name == "retention":
        fig = plot_norm_select(agreement_table(), quality_table(), "acc", ["moetool_code", "moetool_prose"])[name]
    else:
        fig = plot_fluctuation(fluctuation_table(entropy))[name]
    F.savefig(fig, tmp_path / f"{name}.png")
    assert legends_on_data(fig) == []


def test_place_legends_moves_a_legend_off_the_data_and_keeps_one_that_covers_none():
    fig, (ax,) = F.new_figure()
    ax.plot([0, 1], [0, 1], label="diagonal")
    ax.plot([0, 1], [0.9, 0.95], label="top")
    ax.legend(loc="upper left")  # on the "top" line
    assert legends_on_data(fig)
    F.finalize(fig)
    assert legends_on_data(fig) == [] and ax.get_legend() is not None
    fig2, (ax2,) = F.new_figure()
    ax2.plot([0, 1], [0, 0.2], label="low")
    ax2.legend(loc="upper left")  # covers nothing: stays where it is
    F.finalize(fig2)
    assert ax2.get_legend()._loc == 2 and legends_on_data(fig2) == []


def hand_erc_loss(M, a):
    n = len(M)
    return sum(max(M[i, j] - a * M[i, i], 0) + max(M[j, i] - a * M[i, i], 0)
               for i in range(n) for j in range(n) if j != i) / n ** 2


def erc_tables():
    """Two layers with α_min 1.8 and 2.2 (off-diagonal up to that times the diagonal); erc.csv at α 0.4 .. 1.0."""
    rng = np.random.default_rng(0)
    mats = {}
    for layer, amin in ((0, 1.8), (1, 2.2)):
        M = 0.2 + 0.6 * rng.random((4, 4))  # off-diagonal below the diagonal (1) but for one pair
        np.fill_diagonal(M, 1.0)
        M[2, 1] = amin  # max over i != j of max(M[i,j], M[j,i]) / M[i,i] = amin
        mats[layer] = M
    matrix = pd.DataFrame([dict(layer=layer, i=i, j=j, m=M[i, j]) for layer, M in mats.items()
                           for i in range(4) for j in range(4)])
    alphas = (0.4, 0.6, 0.8, 1.0)
    erc = pd.DataFrame([dict(layer=layer, alpha=a, erc_loss=hand_erc_loss(M, a) * 1.01, erc_loss_clean=hand_erc_loss(M, a))
                        for layer, M in mats.items() for a in alphas])
    per_layer = pd.DataFrame({"layer": [0, 1], "n_experts": [4, 4], "alpha_min": [1.8, 2.2]})
    return erc, per_layer, matrix, mats


def test_erc_loss_sweeps_past_alpha_min_and_marks_it():
    from moetool.experiments.erc.figures import plot_erc

    erc, per_layer, matrix, mats = erc_tables()
    fig = plot_erc(erc, per_layer, matrix, "gate", "l2", "derived", 4)["erc_loss"]
    ax = fig.axes[0]
    assert ax.get_xlim()[1] > 2.2 * 1.1  # was 1.0 (the --alpha values only)
    marks = [ln for ln in ax.get_lines() if ln.get_gid() == "alpha_min"]
    assert sorted(float(ln.get_xdata()[0]) for ln in marks) == pytest.approx([1.8, 2.2])
    for layer, amin in ((0, 1.8), (1, 2.2)):
        (curve,) = [ln for ln in ax.get_lines() if ln.get_label().startswith(f"layer {layer} ")]
        x, y = np.asarray(curve.get_xdata(), float), np.asarray(curve.get_ydata(), float)
        np.testing.assert_allclose(y, [hand_erc_loss(mats[layer], a) for a in x], atol=1e-12)
        assert x.max() > amin and y[x >= amin].max() == 0 and (y[x < amin] > 0).all()
        assert f"α_min {amin:.2f}" in curve.get_label()
    noisy = [ln for ln in ax.get_lines() if ln.get_gid() == "erc_loss_noisy"]  # erc.csv's own points
    assert sorted(np.concatenate([ln.get_xdata() for ln in noisy]).tolist()) == sorted(erc["alpha"].tolist())


def mass_recall_table():
    rows = []
    for layer in (0, 1):
        for G in (8, 32):
            for c in ("raw", "unit"):
                for m, rec in ((2, 0.62), (4, 0.81), (8, 1.0)):
                    rows.append(dict(layer=layer, codebook_size=G, shortlist_size=m, centroids=c,
                                     mass_recall_mean=rec - (0.05 if c == "raw" else 0), bound_mean=5e-10 * m,
                                     bound_scaled_mean=0.02 * m, router_flops_frac=(G + m) / 8))
    return pd.DataFrame(rows)


def test_mass_recall_bounds_axis_spans_the_measured_values_and_says_what_is_clipped():
    from moetool.experiments.mass_recall.figures import plot_mass_recall

    df = mass_recall_table()
    fig = plot_mass_recall(df)["mass_recall_vs_bounds"]
    for ax in fig.axes:
        lo, hi = ax.get_ylim()
        assert ax.get_yscale() == "linear" and 0.3 < lo <= df["mass_recall_mean"].min() and 1.0 <= hi < 1.1
        assert "/" not in ax.get_ylabel() and "bound" in ax.get_ylabel()  # not "mass recall / lower bound"
    title = fig._suptitle.get_text()
    assert "clipped" in title and "paper bound max 4e-09" in title and "scale-aware bound max 0.16" in title


def test_mass_recall_vs_router_flops_marks_the_full_router():
    from moetool.experiments.mass_recall.figures import plot_mass_recall

    fig = plot_mass_recall(mass_recall_table())["mass_recall_vs_router_flops"]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2
    for ax in panels:
        ref = [ln for ln in ax.get_lines() if ln.get_label().startswith("full router")]
        assert len(ref) == 1 and list(ref[0].get_xdata()) == [1.0, 1.0]
        assert ax.get_xlim()[0] < 1.0 < ax.get_xlim()[1]


@pytest.mark.parametrize("metric", ["acc", "acc_norm"])
def test_retention_names_the_metric_and_the_items(metric):
    from moetool.experiments.result import Result
    from moetool.experiments.norm_select.figures import norm_select_figures

    res = Result("norm_select", {"agreement.csv": agreement_table(), "quality.csv": quality_table()},
                 meta={"eval": {"tasks": ["moetool_code", "moetool_prose"]},
                       "n_samples": {"router": {"moetool_code": {"original": 100, "effective": 20},
                                                "moetool_prose": {"original": 57, "effective": 57}}}})
    if metric == "acc":
        fig = norm_select_figures(res)["retention"]
    else:
        from moetool.report.figures import eval_items
        from moetool.experiments.norm_select.figures import plot_norm_select

        fig = plot_norm_select(agreement_table(), quality_table(), metric, ["moetool_code", "moetool_prose"],
                               eval_items(res.meta["n_samples"]))["retention"]
    ax = fig.axes[1]
    assert f"lm-eval {metric}," in ax.get_title() and ax.get_ylabel() == f"{metric} / router {metric}"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["moetool_code (20 items)",
                                                                   "moetool_prose (57 items)"]


def stats_heatmaps():
    from moetool.experiments.stats.figures import plot_coactivation, plot_cross_layer, plot_load

    n = 6
    load = pd.DataFrame([dict(layer=li, expert=e, load_fraction=(1 + (e + li) % 3) / (2 * n)) for li in range(3)
                         for e in range(n)])
    co = pd.DataFrame([dict(layer=li, a=a, b=b, p_b_given_a=(a + b) / 20, count=1) for li in range(3)
                       for a in range(n) for b in range(n) if a != b])
    layers = pd.DataFrame({"layer": [0, 1, 2], "n_experts": [n] * 3, "top_k": [2] * 3})
    pairs = pd.DataFrame([dict(layer=li, next_layer=li + 1, a=a, b=b, p_b_given_a=(a * b) / 30, count=1)
                          for li in range(2) for a in range(n) for b in range(n)])
    summary = pd.DataFrame({"layer": [0, 1], "next_layer": [1, 2], "mutual_information": [0.1, 0.2],
                            "uniform_max_p": [2 / n] * 2})
    return {"load_heatmap": plot_load(load), "coactivation": plot_coactivation(co, layers),
            "cross_layer": plot_cross_layer(pairs, summary)}


@pytest.mark.slow
def test_every_colour_bar_has_a_label_and_square_matrices_get_square_cells(tmp_path):
    from moetool.experiments.erc.figures import plot_erc

    erc, per_layer, matrix, _ = erc_tables()
    figs = {**stats_heatmaps(), "erc_matrix": plot_erc(erc, per_layer, matrix, "gate", "l2", "none", 1)["erc_matrix"]}
    for name, fig in figs.items():
        F.savefig(fig, tmp_path / f"{name}.png")
        images = [im for ax in fig.axes for im in ax.images]
        assert images, name
        for im in images:
            assert im.colorbar is not None and im.colorbar.ax.get_ylabel().strip(), name
            rows, cols = im.get_array().shape
            box = im.axes.get_window_extent()  # the drawn matrix (after the aspect is applied)
            cell_w, cell_h = box.width / cols, box.height / rows
            if rows == cols:  # expert x expert: square cells (they were squashed into wide rectangles)
                assert cell_w == pytest.approx(cell_h, rel=0.02), name
            # the colour bar is as tall as the matrix
            assert im.colorbar.ax.get_window_extent().height == pytest.approx(box.height, rel=0.02), name
    with pytest.raises(ValueError, match="colorbar_label"):
        F.heatmap(F.new_figure()[1][0], np.eye(2))


def test_house_style_leaves_the_users_backend_alone(tmp_path):
    """house_style() used to call matplotlib.use('Agg'), switching a notebook's backend; figures are now built on
    their own Agg canvas and not registered with pyplot (a notebook does not show or keep each one)."""
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # the user's choice (non-interactive, so the test runs headless)
        open_figs = plt.get_fignums()
        with F.house_style():
            pass
        fig, _ = draw()
        F.savefig(fig, tmp_path / "f.png")
        F.savefig(fig, tmp_path / "f.pdf")
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == open_figs
        assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "f.pdf").read_bytes()[:4] == b"%PDF"
    finally:
        matplotlib.use(before)


def test_one_crop_for_png_and_pdf_is_matplotlibs_tight_crop_of_each(tmp_path):
    """``save_figure`` measures the tight box once for both files: each file's size is the one matplotlib's own
    per-file ``bbox_inches="tight"`` gives, within a pixel (PNG at 200 dpi) / a point (PDF)."""
    from PIL import Image

    fig, _ = draw()
    RunDir.create("x", tmp_path / "run").save_figure(fig, "f")
    with F.house_style():
        for ext in ("png", "pdf"):
            fig.savefig(tmp_path / f"ref.{ext}", dpi=F.STYLE["savefig.dpi"] if ext == "png" else None,
                        bbox_inches="tight")
    got, ref = (Image.open(p).size for p in (tmp_path / "run" / "figures" / "f.png", tmp_path / "ref.png"))
    assert abs(got[0] - ref[0]) <= 1 and abs(got[1] - ref[1]) <= 1, (got, ref)
    assert got[0] > 600 and got[1] > 300  # a real two-panel figure, not an empty crop

    def media_box(p):
        return [float(v) for v in re.search(rb"/MediaBox \[([^\]]*)\]", p.read_bytes()).group(1).split()]

    got, ref = media_box(tmp_path / "run" / "figures" / "f.pdf"), media_box(tmp_path / "ref.pdf")
    np.testing.assert_allclose(got, ref, atol=1.0)


def test_a_tight_layout_figure_is_drawn_once_per_file_and_saved_as_matplotlib_saves_it(tmp_path, monkeypatch):
    """``fig.tight_layout()`` leaves a placeholder layout engine, for which matplotlib drew the whole figure twice
    per file (a layout pass that lays out nothing, then the print): ``savefig`` draws it once per file, and the PNG
    (pixels, size, dpi) and the PDF (bytes) are the ones matplotlib's own ``savefig`` writes."""
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import PlaceHolderLayoutEngine
    from PIL import Image

    fig, _ = draw()
    fig.tight_layout()
    F.finalize(fig)
    bbox = F.tight_bbox(fig)
    pdf_meta = {"metadata": {"CreationDate": None}}
    with F.house_style():  # the reference: matplotlib's own save, before any of ours
        fig.savefig(tmp_path / "ref.png", dpi=F.STYLE["savefig.dpi"], bbox_inches=bbox)
        fig.savefig(tmp_path / "ref.pdf", bbox_inches=bbox, **pdf_meta)
    engine = fig.get_layout_engine()
    assert isinstance(engine, PlaceHolderLayoutEngine)
    draws = []
    plain = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: (draws.append(1), plain(self, renderer))[1])
    with matplotlib.rc_context({"figure.autolayout": True}):  # a user's rc: the engine still comes back as it was
        F.savefig(fig, tmp_path / "f.png", finalized=True, bbox=bbox)
        F.savefig(fig, tmp_path / "f.pdf", finalized=True, bbox=bbox, **pdf_meta)
    assert len(draws) == 2 and fig.get_layout_engine() is engine, draws
    got, ref = Image.open(tmp_path / "f.png"), Image.open(tmp_path / "ref.png")
    assert got.size == ref.size and got.size[0] > 600 and got.info["dpi"] == ref.info["dpi"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert (tmp_path / "f.pdf").read_bytes() == (tmp_path / "ref.pdf").read_bytes()


# ----- which files a figure is saved as (MOETOOL_FIGURES) --------------------------------------------------------
def test_moetool_figures_chooses_the_files_and_never_changes_a_table(tmp_path, monkeypatch):
    """Unset: every figure as PNG and PDF. ``png``: the PNGs alone, ``none``: no figure drawn and no ``figures/``
    folder; the manifest records the choice (``figure_formats``) and lists exactly the files written; the tables
    are byte for byte those of the default run. Values are read without case or spaces, in PNG-then-PDF order."""
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.errors import env_figures

    for value, want in (("", ("png", "pdf")), ("PDF", ("pdf",)), ("pdf, png", ("png", "pdf")), (" None ", ())):
        monkeypatch.setenv("MOETOOL_FIGURES", value)
        assert env_figures() == want
    args = ["stats", "--model", "tiny", "--max-tokens", "128", "--seq-len", "32", "--bootstrap", "0", "--quiet"]
    runs = {}
    for value in ("", "png", "none"):
        monkeypatch.setenv("MOETOOL_FIGURES", value)
        runs[value] = tmp_path / (value or "default")
        r = CliRunner().invoke(app, [*args, "--out", str(runs[value])])
        assert r.exit_code == 0, r.output
    man = {v: json.loads((d / "manifest.json").read_text()) for v, d in runs.items()}
    figs = {v: sorted(p.name for p in (d / "figures").glob("*")) if (d / "figures").exists() else None
            for v, d in runs.items()}
    stems = sorted({n.rsplit(".", 1)[0] for n in figs[""]})
    assert stems and figs[""] == sorted([f"{s}.png" for s in stems] + [f"{s}.pdf" for s in stems])
    assert figs["png"] == [f"{s}.png" for s in stems] and figs["none"] is None
    assert "figure_formats" not in man[""]
    assert man["png"]["figure_formats"] == ["png"] and man["none"]["figure_formats"] == []
    for v, d in runs.items():
        assert {f for f in man[v]["files"] if f.startswith("figures/")} == {f"figures/{n}" for n in figs[v] or []}
        assert man[v]["tables"] == man[""]["tables"]  # rows, bytes and sha256 of every table
        for name in man[""]["tables"]:
            assert (d / name).read_bytes() == (runs[""] / name).read_bytes()


@pytest.mark.parametrize("value", ["jpg", "png,png", "png;pdf", "png,", "no"])
def test_a_bad_moetool_figures_is_one_usage_line_before_the_command_runs(value, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    monkeypatch.setenv("MOETOOL_FIGURES", value)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["stats", "--model", "tiny", "--max-tokens", "64", "--seq-len", "32", "--quiet",
                                 "--out", str(out)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and lines == [f"error: MOETOOL_FIGURES must be png, pdf, png,pdf or none, not '{value}'"]
    assert not out.exists()


def test_a_bad_moetool_figures_stops_the_api_writer_before_any_file(tmp_path, monkeypatch):
    import moetool
    from moetool.errors import MoetoolError

    res = moetool.erc(moetool.load("tiny"), samples=1, quiet=True)
    monkeypatch.setenv("MOETOOL_FIGURES", "svg")
    with pytest.raises(MoetoolError, match="MOETOOL_FIGURES must be png, pdf, png,pdf or none, not 'svg'"):
        moetool.write(res, tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
