"""The demo's console lines (issue 35 item 14): each norm-select line names the model it is for; fluctuation's
summary is a heading per checkpoint pair and one short line per routing, not one line of ~700 characters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import numpy as np
import pandas as pd

from moetool.experiments.fluctuation import compute as fluctuation
from moetool.experiments.norm_select import compute as norm_select
from moetool.experiments.registry import EXPERIMENTS
from moetool.uncertainty import format_ci


def test_norm_select_lines_name_the_model_and_carry_the_intervals():
    """Each line names the model; every number with an interval in the summary is written with it (issue 35
    item 16: the report's headline table is these lines), a number without one alone."""
    summary = pd.DataFrame({"node": ["router", "gate"], "norm": ["-", "l2"], "ppl": [40.5, 83.4],
                            "ppl_lo": [38.1, 79.0], "ppl_hi": [43.0, 88.2],
                            "ppl ratio": [1.0, 83.4 / 40.5], "ppl ratio_lo": [1.0, 1.9], "ppl ratio_hi": [1.0, 2.2],
                            "top-K overlap": [1.0, 0.52], "top-K overlap_lo": [1.0, 0.49],
                            "top-K overlap_hi": [1.0, 0.55], "top-1 agree": [1.0, 0.5],
                            "code acc": [0.8, 0.7], "code acc_lo": [0.49, 0.4], "code acc_hi": [0.94, 0.89],
                            "code retention": [1.0, 0.875]})
    lines = norm_select.summary_lines("tiny-fine", SimpleNamespace(meta={}, summary=summary))
    r = summary.iloc[1]
    assert lines[1] == (f"tiny-fine, norm:gate:l2: ppl {format_ci(83.4, 79.0, 88.2)} "
                        f"(x{format_ci(r['ppl ratio'], 1.9, 2.2)}), top-K overlap {format_ci(0.52, 0.49, 0.55)}, top-1 agree 0.5, code acc "
                        f"{format_ci(0.7, 0.4, 0.89)} (x0.875)")
    assert lines[0].startswith(f"tiny-fine, router: ppl {format_ci(40.5, 38.1, 43.0)} (x1 ± 0)")
    pruned = norm_select.summary_lines("tiny", SimpleNamespace(meta={"pruned": {"name": "prune:random:0.5"}},
                                                               summary=summary))
    assert all(ln.startswith("tiny") for ln in pruned) and pruned[0] == "tiny: on the model pruned by prune:random:0.5"


def test_fluctuation_summary_is_one_short_line_per_routing():
    rows = []
    for checkpoint in ("tiny-early", "tiny-late"):
        for i, routing in enumerate(("router", "similarity", "attention")):
            red = (np.nan, np.nan, np.nan) if routing == "router" else (0.05 * i, 0.01, 0.09 * i)
            rows.append({"reference": "tiny", "checkpoint": checkpoint, "routing": routing,
                         "top1_change": 0.4 - 0.1 * i, "top1_change_lo": 0.38 - 0.1 * i,
                         "top1_change_hi": 0.42 - 0.1 * i, "reduction_vs_router": red[0],
                         "reduction_vs_router_lo": red[1], "reduction_vs_router_hi": red[2]})
    lines = fluctuation.summary_lines("x", {"fluctuation_summary": pd.DataFrame(rows)})
    assert len(lines) == 2 * 4 and max(map(len, lines)) < 120, lines
    assert lines[0] == "tiny -> tiny-early: top-1 change (mean over layers)"
    assert lines[1] == f"  router {format_ci(0.4, 0.38, 0.42)}"
    assert lines[2] == (f"  similarity {format_ci(0.3, 0.28, 0.32)} [reduction vs router "
                        f"{format_ci(0.05, 0.01, 0.09)} (interval excludes 0)]")
    assert lines[4] == "tiny -> tiny-late: top-1 change (mean over layers)"



def test_an_isolated_row_names_the_isolated_router_it_is_compared_with():
    """reduction_vs_router of a ``<routing>-isolated`` row is router-isolated's top-1 change minus its own (the
    tables' pairing), but the console said "reduction vs router": on the demo's tiny-early -> tiny, attention-isolated
    read "reduction vs router -0.093" beside router 0.250 and attention-isolated 0.255, which is not 0.250 - 0.255."""
    rows = []
    for routing, t1, red in (("router", 0.250, np.nan), ("router-isolated", 0.162, np.nan),
                             ("attention-isolated", 0.255, 0.162 - 0.255)):
        rows.append({"reference": "tiny-early", "checkpoint": "tiny", "routing": routing, "top1_change": t1,
                     "top1_change_lo": t1 - 0.01, "top1_change_hi": t1 + 0.01, "reduction_vs_router": red,
                     "reduction_vs_router_lo": red - 0.03, "reduction_vs_router_hi": red + 0.03})
    lines = fluctuation.summary_lines("x", {"fluctuation_summary": pd.DataFrame(rows)})
    assert lines[3] == (f"  attention-isolated {format_ci(0.255, 0.245, 0.265)} [reduction vs router-isolated "
                        f"{format_ci(0.162 - 0.255, 0.162 - 0.255 - 0.03, 0.162 - 0.255 + 0.03)} (interval excludes 0)]")
    assert "reduction" not in lines[1] + lines[2]


def test_headline_lines_carry_the_intervals_of_their_tables():
    """Issue 35 item 16: the lines a run records as its headline (the report page's first table) give each
    number its experiment's 95% interval, read from the run's own table: topk's perplexity ratios, stats' largest
    load ratio."""
    import moetool

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=128, max_tokens=1024)
    res = moetool.topk(lm, tokens, quiet=True)
    line = EXPERIMENTS["topk"].load("summary_lines")("tiny", res)[0]
    rows = [r for r in res["topk"].itertuples() if r.kind != "router"]
    assert rows and all(f"x{format_ci(r.ratio, r.ratio_lo, r.ratio_hi)}" in line for r in rows), line
    assert line.count("±") + line.count(" [") >= len(rows)  # an interval each: ± where symmetric, else [lo, hi]
    res = moetool.stats(lm, tokens, quiet=True)
    worst = res["layers"].loc[res["layers"].max_load_ratio.idxmax()]
    line = EXPERIMENTS["stats"].load("summary_lines")("tiny", res)[0]
    assert f"max load {format_ci(worst.max_load_ratio, worst.max_load_ratio_lo, worst.max_load_ratio_hi)}x" in line
    assert "±" in line or "[" in line


def test_stats_specialisation_line_says_none_instead_of_nan():
    """A short --data where no token id reaches --min-count: specialization.csv is empty (NaN) for that view, and
    the headline (the report's first table) said "input nan-nan"; now "none (no token id seen 10 times)"."""
    from moetool.experiments.result import Result

    sp = pd.DataFrame({"layer": [0, 0, 1, 1], "view": ["input", "predicted"] * 2,
                       "specialization": [np.nan, 0.5, np.nan, 0.75]})
    res = Result("stats", {"specialization.csv": sp}, SimpleNamespace(min_count=10))
    lines = EXPERIMENTS["stats"].load("analysis_lines")("tiny", res)
    assert lines == ["stats tiny: vocabulary specialisation (first-ranked expert) over layers: input none (no token "
                     "id seen 10 times), predicted 0.50-0.75"], lines


def test_a_ppl_run_records_its_perplexity_and_ratio_as_its_headline(tmp_path):
    """A ppl run had no headline (no line in the report page's "results at a glance"): now its policy's
    perplexity on the scored tokens and, with the router's baseline, the paired ratio, each with the interval of
    ppl.csv; a router run (no baseline) gives the perplexity alone."""
    import json
    import re

    import moetool
    from moetool.report.page import write_report

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=128, max_tokens=1024)
    moetool.run("ppl", lm, tokens, out=str(tmp_path / "ppl-norm"), routing="norm:gate")
    row = pd.read_csv(tmp_path / "ppl-norm" / "ppl.csv").iloc[0]
    headline = json.loads((tmp_path / "ppl-norm" / "manifest.json").read_text())["headline"]
    assert headline == [f"ppl tiny: norm:gate:l2 (softmax weights) perplexity "
                        f"{format_ci(row.perplexity, row.perplexity_lo, row.perplexity_hi)} on "
                        f"{int(row.scored_tokens):,} tokens, x{format_ci(row.ratio, row.ratio_lo, row.ratio_hi)} "
                        f"of the router's {row.router_perplexity:.4g}"], headline
    assert row.ratio_lo < row.ratio < row.ratio_hi and abs(row.ratio - row.perplexity / row.router_perplexity) < 1e-9
    line = EXPERIMENTS["ppl"].load("summary_lines")("tiny", moetool.ppl(lm, tokens, quiet=True))
    assert len(line) == 1 and "x" not in line[0].split("tokens")[1] and "router perplexity" in line[0]
    page = write_report([tmp_path / "ppl-norm"], tmp_path / "report")
    table = re.search(r'<table class="headline">.*?</table>', Path(page).read_text(), re.S).group(0)
    assert "ppl" in table and format_ci(row.ratio, row.ratio_lo, row.ratio_hi) in table


def test_mass_recall_line_says_over_what_the_bound_rate_is_lowest():
    """The line said the bound holds on "x% of tokens (worst row)": a reader took "row" for a packed row; it is
    the lowest bound_holds_rate over the table's rows (layers, G and M) of the centroid mode, printed as the
    fraction mass_recall.csv stores (0.980, no longer 98.0%: console fractions are the CSVs')."""
    from moetool.experiments.mass_recall import compute as mass_recall

    df = pd.DataFrame({"centroids": ["unit"] * 4, "layer": [0, 0, 1, 1], "codebook_size": [8] * 4,
                       "shortlist_size": [2, 4, 2, 4], "mass_recall_mean": [0.5, 0.7, 0.6, 0.8],
                       "bound_holds_rate": [1.0, 0.98, 1.0, 1.0], "bound_scaled_holds_rate": [1.0] * 4,
                       "bound_mean": [1e-9] * 4, "bound_scaled_mean": [1e-4] * 4})
    (line,) = mass_recall.summary_lines("tiny", {"mass_recall": df})
    assert "M=2: 0.550, M=4: 0.750" in line and "bound holds on 0.980 of tokens (lowest over layers, G and M)" in line
    assert "router_flops_frac" not in line  # no frac column: no note


def test_mass_recall_lines_say_what_raw_and_unit_centroids_are():
    """The demo printed "tiny raw: mass recall ..." and "tiny unit: mass recall ...": nothing said that raw and
    unit are the centroid modes (--centroids) nor what they mean. Each line now names the mode and its meaning, as
    mass-recall's spec defines them: raw = the model's router as is, unit = router rows on the unit sphere."""
    from moetool.experiments.mass_recall import compute as mass_recall

    df = pd.DataFrame({"centroids": ["raw", "raw", "unit", "unit"], "layer": [0, 1, 0, 1], "codebook_size": [8] * 4,
                       "shortlist_size": [2] * 4, "mass_recall_mean": [0.5, 0.7, 0.6, 0.8],
                       "bound_holds_rate": [1.0] * 4, "bound_scaled_holds_rate": [1.0] * 4,
                       "bound_mean": [1e-9] * 4, "bound_scaled_mean": [1e-4] * 4})
    raw, unit = mass_recall.summary_lines("tiny", {"mass_recall": df})
    assert raw.startswith("tiny, raw centroids (the model's router as is): mass recall (G=8, mean over layers) "
                          "M=2: 0.600;"), raw
    assert unit.startswith("tiny, unit centroids (router rows on the unit sphere): mass recall (G=8, mean over "
                           "layers) M=2: 0.700;"), unit


@pytest.mark.parametrize("n, noted", [(8, True), (10, True), (12, False), (64, False)])
def test_mass_recall_line_says_when_the_ivf_router_costs_more_than_exact_routing(n, noted):
    """router_flops_frac = (G + M) / n above 1 (the tiny model's 8 experts at G = 8, M = 2..4: 1.25-1.5) means the IVF
    router computes more inner products than exact routing; the line said nothing, the figure's dashed line at 1
    alone showed it. The note names the lowest fraction, only where every row is at least 1 (at n = 10 the
    (8 + 2) / 10 row is exactly 1: no saving; at 12 that row is 0.83)."""
    from moetool.experiments.mass_recall import compute as mass_recall

    G, M = [8] * 4, [2, 4, 2, 4]
    df = pd.DataFrame({"centroids": ["unit"] * 4, "layer": [0, 0, 1, 1], "codebook_size": G,
                       "shortlist_size": M, "mass_recall_mean": [0.5, 0.7, 0.6, 0.8],
                       "bound_holds_rate": [1.0] * 4, "bound_scaled_holds_rate": [1.0] * 4,
                       "bound_mean": [1e-9] * 4, "bound_scaled_mean": [1e-4] * 4,
                       "router_flops_frac": [(g + m) / n for g, m in zip(G, M)]})
    (line,) = mass_recall.summary_lines("tiny", {"mass_recall": df})
    lowest = min((g + m) / n for g, m in zip(G, M))
    assert (f"every row's router_flops_frac (G + M) / n is at least 1 (lowest {lowest:.3g}): the IVF router costs "
            f"no less than exact routing here" in line) == noted


def test_erc_line_says_the_dominance_is_a_mean_over_layers():
    """erc's line printed 'row/col dominance 0.62/0.41' beside a per-layer alpha_min range: a reader could not tell
    whether it was one layer's; it is the mean over the layers of erc_layers.csv."""
    from moetool.experiments.erc import compute as erc

    layers = pd.DataFrame({"layer": [0, 1], "alpha_min": [1.5, 2.5], "row_dominance": [0.5, 0.75],
                           "col_dominance": [0.25, 0.5]})
    table = pd.DataFrame({"layer": [0, 1], "alpha": [1.0, 1.0], "erc_loss": [0.1, 0.3], "erc_loss_clean": [0.1, 0.2]})
    (line,) = erc.summary_lines("tiny", {"erc_layers": layers, "erc": table})
    assert "alpha_min 1.50-2.50 over 2 layers; row/col dominance 0.62/0.38 (mean over layers)" in line


def test_demo_help_names_the_folder_a_checkpoint_pair_is_written_to():
    """run_step writes a checkpoint pair to <step>/<its final checkpoint>/ (tiny-early -> tiny: fluctuation/tiny/),
    but `moetool demo --help` promised <step>/<model>/ only, so a newcomer looked for fluctuation/tiny-early/ or a
    pair's folder. The help now names the pair's folder as run_step names it (child.sub(names[-1]))."""
    import typer

    from moetool.commands.app import app
    from moetool.experiments.registry import EXPERIMENTS

    pair = EXPERIMENTS["fluctuation"].demo.models[0]
    assert isinstance(pair, tuple) and pair == ("tiny-early", "tiny")
    text = " ".join(typer.main.get_command(app).commands["demo"].help.split())
    assert f"{' -> '.join(pair)} in fluctuation/{pair[-1]}/" in text
