"""Report-page captions (issue 35 items 15 and 18): every figure's caption comes from its own experiment (the
definitions it cites are ones that experiment writes), no caption is given twice for one figure name, and a
caption describes only what is drawn."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from moetool.experiments.registry import EXPERIMENTS
from moetool.experiments.agreement import figures as agreement_figures
from moetool.experiments.capacity import figures as capacity_figures
from moetool.experiments.placement import figures as placement_figures
from moetool.experiments.prune import figures as prune_figures
from moetool.experiments.super_experts import figures as super_experts_figures
from moetool.report import plots

STEM = re.compile(r'out\["(\w+)"\] = |[{,]\s*"(\w+)": (?:plot_\w+\(|fig\b|ratio_curve\()'
                  r'|for name, \w+ in \(\("(\w+)", "\w+"\),|\),\s+\("(\w+)", "\w+"\)\):')


def stems_of(func, mod, seen=None) -> set[str]:
    """The figure names ``func`` draws, following the module's own functions it calls."""
    seen = set() if seen is None else seen
    if func in seen:
        return set()
    seen.add(func)
    src = inspect.getsource(func)
    out = {g for m in STEM.findall(src) for g in m if g}
    for name in set(re.findall(r"\b(\w+)\(", src)):
        f = getattr(mod, name, None)
        if inspect.isfunction(f) and f.__module__ == mod.__name__:
            out |= stems_of(f, mod, seen)
    return out


def figures_by_experiment() -> dict[str, set[str]]:
    out = {}
    for spec in EXPERIMENTS.values():
        if spec.figures:
            module, _, attr = spec.figures.partition(":")
            mod = importlib.import_module(module)
            out[spec.name] = stems_of(getattr(mod, attr), mod)
    return out


def test_no_figure_name_is_captioned_twice():
    """A dict literal keeps the last of two equal keys: the agreement figure once carried norm-select's caption
    because both were "agreement_by_layer"."""
    specs = sorted(Path(plots.__file__).parents[1].joinpath("experiments").glob("*/spec.py"))
    found = 0
    for path in specs:  # a dict literal in one spec: its keys; across specs the registry refuses a repeat
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "CAPTIONS":
                keys = [k.value for k in node.value.keys]
                assert len(keys) == len(set(keys)), (path, sorted(k for k in keys if keys.count(k) > 1))
                found += len(keys)
    assert found == len(plots.FIGURE_CAPTIONS) >= 30
    owners: dict[str, list[str]] = {}
    for exp, stems in figures_by_experiment().items():
        for s in stems:
            owners.setdefault(s, []).append(exp)
    assert {s: e for s, e in owners.items() if len(e) > 1} == {}  # one experiment per figure name
    assert len(owners) >= 30


def test_every_caption_cites_its_own_experiments_definitions():
    """The quantities a caption names (the definitions it cites) are columns the figure's own experiment
    defines, and the caption's tables are tables that experiment writes (its spec's docstring, the --help, says
    which)."""
    for exp, stems in figures_by_experiment().items():
        spec = EXPERIMENTS[exp]
        mod = importlib.import_module(spec.module)
        defs = {k for n in dir(mod) if n.endswith("DEFINITIONS") and isinstance(getattr(mod, n), dict)
                for k in getattr(mod, n)}
        folder = f"moetool.experiments.{exp.replace('-', '_')}"
        writes = inspect.getsource(mod) + inspect.getsource(importlib.import_module(f"{folder}.spec"))
        for stem in stems:
            shows, tables, keys = plots.FIGURE_CAPTIONS[stem]
            assert set(keys) <= defs, (exp, stem, set(keys) - defs)
            assert keys, (exp, stem)
            for t in tables:
                assert t in writes, (exp, stem, t)


# ----- what a caption names is drawn (issue 35 item 18) ------------------------------------------------------
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402


def drawn(fig) -> dict[str, bool]:
    """What the figure's axes hold: error bars, dotted / dashed lines, a star marker."""
    axes = fig.axes
    lines = [ln for ax in axes for ln in ax.get_lines()]
    return {"error bars": any(isinstance(c, ErrorbarContainer) for ax in axes for c in ax.containers),
            "dotted": any(ln.get_linestyle() == ":" for ln in lines),
            "dashed": any(ln.get_linestyle() == "--" for ln in lines),
            "star": any(getattr(c, "get_label", lambda: "")().startswith("the model") for ax in axes
                        for c in ax.collections)}


def check_caption(stem: str, fig) -> None:
    """Every element the caption names ("error bars", "dotted", "dashed", "the star") is drawn, and no dashed
    line is drawn that the caption does not name."""
    shows = plots.FIGURE_CAPTIONS[stem][0]
    have = drawn(fig)
    for word in ("error bars", "dotted", "dashed", "star"):
        if word in shows:
            assert have[word], (stem, word)
    if have["dashed"]:
        assert "dashed" in shows, stem


def tick_texts(ax) -> list[str]:
    lo, hi = ax.get_ylim()
    fmt = ax.yaxis.get_major_formatter()
    return [fmt(t, i) for i, t in enumerate(ax.get_yticks()) if lo <= t <= hi]


def interval(df, col, half):
    return df.assign(**{f"{col}_lo": df[col] - half, f"{col}_hi": df[col] + half})


def test_prune_curve_lines_start_at_the_model_star():
    curve = pd.DataFrame({"criterion": ["router", "frequency", "frequency", "random", "random"],
                          "fraction": [0.0, 0.25, 0.5, 0.25, 0.5], "ratio": [1.0, 2.2, 3.3, 2.0, 4.7]})
    curve = interval(curve, "ratio", 0.1)
    importance = pd.DataFrame({"layer": np.repeat([0, 1], 4), "expert": np.tile(range(4), 2),
                               "reap": np.linspace(0.1, 0.8, 8)})
    ablation = pd.DataFrame(columns=["layer", "expert", "ratio", "ratio_lo", "ratio_hi"])
    figs = prune_figures.plot_prune(curve, importance, ablation)
    ax = figs["prune_curve"].axes[0]
    lines = {c.get_label(): c.lines[0] for c in ax.containers if isinstance(c, ErrorbarContainer)}
    assert set(lines) == {"frequency", "random"}
    for name, ln in lines.items():  # joined: each line's first point is the model's (0, 1)
        x, y = ln.get_data()
        assert (x[0], y[0]) == (0.0, 1.0) and list(x) == [0.0, 0.25, 0.5], name
        assert list(y[1:]) == list(curve[curve.criterion == name]["ratio"])
    check_caption("prune_curve", figs["prune_curve"])


def test_placement_draws_the_intervals_its_caption_names():
    rows = [{"gpus": g, "nodes": 1, "replicas": r, "slots_per_gpu": 4, "method": m, "imbalance": 1 + 0.1 * i * g}
            for i, (m, r) in enumerate([("contiguous", 0), ("round_robin", 0), ("eplb", 0)]) for g in (2, 4, 8)]
    overall = interval(pd.DataFrame(rows), "imbalance", 0.02)
    per_layer = pd.concat([overall.assign(layer=layer) for layer in range(3)], ignore_index=True)
    figs = placement_figures.plot_placement(overall, per_layer)
    for stem, fig in figs.items():
        ax = fig.axes[0]
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 3, stem  # one per placement drawn
        check_caption(stem, fig)
        assert not drawn(fig)["dashed"]  # no stale placement without a reference: none drawn


def test_capacity_log_axis_has_readable_ticks_and_a_small_range_stays_linear():
    def table(ratios):
        df = pd.DataFrame({"cf": [0.5, 1.0, 2.0] * 2, "order": ["order"] * 3 + ["score"] * 3,
                           "ratio": ratios, "dropped_frac": [0.5, 0.1, 0.0] * 2})
        return interval(df, "ratio", 0.05)

    layers = pd.DataFrame({"cf": [1.0, 1.0], "order": ["order"] * 2, "layer": [0, 1], "dropped_frac": [0.1, 0.2]})
    wide = capacity_figures.plot_capacity(table([15.7, 1.7, 1.0, 3.0, 1.04, 1.0]), layers)["capacity_curve"]
    ax = wide.axes[1]
    assert ax.get_yscale() == "log"
    texts = tick_texts(ax)
    assert {"1", "2", "5", "10"} <= set(texts), texts  # not only 10^0 and 10^1
    assert not any("10^" in t or "times" in t or "$" in t for t in texts)
    check_caption("capacity_curve", wide)
    narrow = capacity_figures.plot_capacity(table([1.3, 1.1, 1.0, 1.2, 1.05, 1.0]), layers)["capacity_curve"]
    assert narrow.axes[1].get_yscale() == "linear"


def test_super_experts_ticks_are_plain_numbers():
    def table(values):
        n = len(values)
        t = pd.DataFrame({"layer": np.arange(n) // 4, "expert": np.arange(n) % 4, "max_abs_output": values})
        t["rank"] = t["max_abs_output"].rank(ascending=False, method="first").astype(int)
        t["threshold"] = 27.5
        t["is_super"] = t["max_abs_output"] > 27.5
        return t

    small = super_experts_figures.plot_super_experts(table([28.6, 21.7, 19.6, 18.0, 16.5, 15.7, 14.8, 3.7]))["super_experts_ranked"]
    assert small.axes[0].get_yscale() == "linear"  # 3.7 .. 28.6: less than a decade
    check_caption("super_experts_ranked", small)
    wide = super_experts_figures.plot_super_experts(table([900.0, 21.7, 19.6, 18.0, 16.5, 15.7, 14.8, 3.7]))["super_experts_ranked"]
    ax = wide.axes[0]
    texts = tick_texts(ax)
    assert ax.get_yscale() == "log" and {"10", "100"} <= set(texts) and not any("$" in t for t in texts), texts


def test_agreement_margin_says_both_panels_are_binned_by_the_top_k_margin():
    per_layer = pd.DataFrame({"precision": ["fp8"] * 2, "reference": ["bf16"] * 2, "layer": [0, 1],
                              "topk_flip": [0.1, 0.2], "top1_flip": [0.05, 0.1]})
    per_layer = interval(interval(per_layer, "topk_flip", 0.01), "top1_flip", 0.01)
    bins = pd.DataFrame({"precision": ["fp8"] * 3, "layer": [0] * 3, "margin_lo": [0.0, 0.01, 0.1],
                         "margin_hi": [0.01, 0.1, np.inf], "tokens": [5, 10, 20], "top1_flip": [0.4, 0.2, 0.0],
                         "topk_flip": [0.6, 0.3, 0.05]})
    figs = agreement_figures.plot_agreement(per_layer, bins)
    assert set(figs) == {"agreement_flips_by_layer", "agreement_margin"}
    for ax in figs["agreement_margin"].axes:
        assert "top-K margin" in ax.get_xlabel()
    assert "top-1 panel is binned by this top-K margin" in plots.FIGURE_CAPTIONS["agreement_margin"][0]
    for stem, fig in figs.items():
        check_caption(stem, fig)
