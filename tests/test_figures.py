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
    from moetool.report.plots import plot_balance

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
    from moetool.report.plots import plot_coactivation, plot_cross_layer

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
