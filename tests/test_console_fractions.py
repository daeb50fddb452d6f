"""Fractions on the console are the CSVs' fractions (issue: "drops 50.0%" in capacity's line and "flips 0.5%" in
margin's beside 0.5 and 0.005 in capacity.csv and margin_flips.csv, and beside the fractions of every other command's
line: a number copied from the console next to a CSV value was off by 100x). Each command's summary line on the tiny
model is read back against an independent reading of its own CSVs: every number printed for a fraction column is
the CSV's value in the same unit (rounded to the decimals printed), and no line prints a percentage. Not run here:
fluctuation (two checkpoints; its lines' fractions are pinned in test_demo_lines) and prune's lm-eval accuracy line."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from moetool.report.console import fraction_text

NUM = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def same(printed: str, value: float) -> bool:
    """``printed`` is ``value`` in the same unit, to the precision printed (half a unit of its last digit)."""
    mantissa = printed.split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exp = int(printed.split("e")[1]) if "e" in printed else 0
    return abs(float(printed) - float(value)) <= 0.5 * 10.0 ** (exp - decimals) * (1 + 1e-9)


def test_fraction_text_is_the_csv_unit_and_never_a_plausible_zero():
    assert [fraction_text(v) for v in (0.5, 0.005, 1.0, 0.0, 0.1234)] == ["0.500", "0.005", "1.000", "0.000", "0.123"]
    assert fraction_text(0.00042) == "0.00042" and fraction_text(3e-7) == "3.00e-07"  # not "0.000"
    assert fraction_text(float("nan")) == "nan" and fraction_text(0.876, 2) == "0.88"
    assert all(same(fraction_text(v), v) for v in (0.5, 0.005, 0.00042, 3e-7, 0.99951))
    assert not same("50.0", 0.5) and not same("0.5", 0.005)  # a percentage is not the CSV's number


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs[command]`` -> (its headline lines, its run folder): the command run once on the tiny model (1,024
    tokens), on first use."""
    import moetool

    class Runs(dict):
        def __missing__(self, name):
            mp = pytest.MonkeyPatch()
            mp.setenv("MOETOOL_FIGURES", "none")  # the tables are checked here, not the figures
            try:
                if "lm" not in cache:
                    cache["lm"] = moetool.load("tiny")
                    cache["tokens"] = moetool.tokens(cache["lm"], None, seq_len=128, max_tokens=1024)
                d = tmp_path_factory.mktemp(name.replace("-", "_")) / "run"
                moetool.run(name, cache["lm"], cache["tokens"], out=str(d))
            finally:
                mp.undo()
            self[name] = (json.loads((d / "manifest.json").read_text())["headline"], d)
            return self[name]

    cache = {}
    return Runs()


def check(lines, pairs):
    """``pairs``: (printed, the CSV's value) for each fraction the lines print; none is a percentage."""
    assert lines and not any("%" in ln for ln in lines), lines
    assert pairs
    bad = [(p, v) for p, v in pairs if not same(p, v)]
    assert not bad, (bad, lines)


def test_margin_flip_rates_are_margin_flips_csv(runs):
    (line,), d = runs["margin"]
    fl = pd.read_csv(d / "margin_flips.csv")
    printed = dict(re.findall(r"eps ([\d.e-]+): " + NUM, line))
    assert sorted(map(float, printed)) == sorted(fl.eps.unique())
    check([line], [(p, fl.loc[fl.eps == float(e), "topk_flip"].mean()) for e, p in printed.items()])


def test_capacity_dropped_share_is_capacity_csv(runs):
    (line,), d = runs["capacity"]
    df = pd.read_csv(d / "capacity.csv")
    printed = re.findall(r"cf ([\d.]+) (\w+) drops " + NUM + " x", line)
    assert len(printed) == len(df)
    check([line], [(p, df[(df.cf == float(cf)) & (df.order == order)].dropped_frac.item())
                   for cf, order, p in printed])
    assert any(float(p) == 0.5 for *_, p in printed)  # cf 0.5 drops half the assignments: 0.500, not 50.0


def test_mass_recall_rates_are_mass_recall_csv(runs):
    lines, d = runs["mass-recall"]
    df = pd.read_csv(d / "mass_recall.csv")
    pairs = []
    for line, (mode, g) in zip(lines, df.groupby("centroids", sort=False)):
        assert line.startswith(f"tiny, {mode} centroids")
        G = g.codebook_size.max()
        for m, p in re.findall(r"M=(\d+): " + NUM, line):
            pairs.append((p, g[(g.codebook_size == G) & (g.shortlist_size == int(m))].mass_recall_mean.mean()))
        pairs.append((re.search("bound holds on " + NUM + " of tokens", line).group(1), g.bound_holds_rate.min()))
        pairs.append((re.search("scale-aware bound on " + NUM + ";", line).group(1),
                      g.bound_scaled_holds_rate.min()))
    assert len(lines) == df.centroids.nunique()
    check(lines, pairs)


def test_approx_same_set_share_is_approx_csv(runs):
    (line,), d = runs["approx"]
    df = pd.read_csv(d / "approx.csv")
    p = re.search("router set on " + NUM + " of tokens", line).group(1)
    check([line], [(p, df[df.selector == "norm_oracle"].same_set_as_router.mean())])


def test_locality_repeat_rates_are_locality_csv(runs):
    (line,), d = runs["locality"]
    df = pd.read_csv(d / "locality.csv")
    a, b = re.search(f"expert {NUM}-{NUM} of the time", line).groups()
    c, e = re.search(f"load: {NUM}-{NUM};", line).groups()
    u = re.search(f"uniform {NUM}", line).group(1)
    check([line], [(a, df.top1_repeat.min()), (b, df.top1_repeat.max()), (c, df.top1_repeat_independent.min()),
                   (e, df.top1_repeat_independent.max()), (u, df.top1_repeat_uniform.iloc[0])])


def test_offload_hit_rates_and_recalls_are_offload_csvs(runs):
    lines, d = runs["offload"]
    cache, pref = pd.read_csv(d / "offload_cache.csv"), pd.read_csv(d / "offload_prefetch.csv")
    pairs = []
    for line in lines:
        m = re.match(r"tiny offload C=(\d+): hit rate \(mean over layers\) (.*)", line)
        if m:
            for policy, p in re.findall(r"(\w+) " + NUM, m.group(2)):
                pairs.append((p, cache[(cache.capacity == int(m.group(1))) & (cache.policy == policy)].hit_rate.mean()))
    assert len(pairs) == cache.groupby(["capacity", "policy"]).ngroups
    t1, tk = re.search(f"top-1 recall {NUM}, top-K recall {NUM}", lines[-1]).groups()
    check(lines, pairs + [(t1, pref.top1_recall.mean()), (tk, pref.topk_recall.mean())])


def test_stats_specialisation_and_next_layer_probability_are_stats_csvs(runs):
    lines, d = runs["stats"]
    sp, cl = pd.read_csv(d / "specialization.csv"), pd.read_csv(d / "cross_layer_summary.csv")
    (line,) = [ln for ln in lines if "vocabulary specialisation" in ln]
    pairs = []
    for view, lo, hi in re.findall(rf"(\w+) {NUM}-{NUM}", line.split(": ", 2)[2]):
        s = sp[sp.view == view].specialization
        pairs += [(lo, s.min()), (hi, s.max())]
    assert len(pairs) == 2 * sp.view.nunique()
    (line2,) = [ln for ln in lines if "mean max P" in ln]
    p, u = re.search(rf"mean max P\(b\|a\) {NUM} \(uniform {NUM}\)", line2).groups()
    check(lines, pairs + [(p, cl.mean_max_p.mean()), (u, cl.uniform_max_p.iloc[0])])


def test_expert_similarity_co_selection_is_its_csv(runs):
    lines, d = runs["expert-similarity"]
    df = pd.read_csv(d / "expert_similarity.csv")
    check(lines, [(re.search("co-selection " + NUM, lines[0]).group(1), df.mean_co_selection.mean())])


def test_agreement_flip_rates_are_agreement_summary_csv(runs):
    (line,), d = runs["agreement"]
    s = pd.read_csv(d / "agreement_summary.csv")
    pairs = []
    for r in s.itertuples():
        t1, tk = re.search(rf"{r.precision} top-1 {NUM}\S* .*?top-K {NUM}", line).groups()
        pairs += [(t1, r.top1_flip), (tk, r.topk_flip)]
    check([line], pairs)


def test_norm_select_overlap_and_agreement_are_its_agreement_csv(runs):
    lines, d = runs["norm-select"]
    ag = pd.read_csv(d / "agreement.csv")
    pairs = []
    for line in lines:
        policy = re.match(r"tiny, (\S+): ", line).group(1)
        a = ag[ag.policy == policy]
        assert len(a), (policy, sorted(ag.policy.unique()))
        o, t = re.search(f"top-K overlap {NUM}.*top-1 agree {NUM}", line).groups()
        pairs += [(o, (a.topk_overlap * a.tokens).sum() / a.tokens.sum()),
                  (t, (a.top1_agree * a.tokens).sum() / a.tokens.sum())]
    check(lines, pairs)
