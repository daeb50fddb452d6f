"""ppl: the router reproduces the unhooked perplexity; policies and --layers change it; the CLI."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model, feed, hand_ppl
from typer.testing import CliRunner

from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.data import TokenSet
from moetool.experiments.ppl.compute import PPL_COLUMNS, ppl_frame
from moetool.experiments.routing import perplexity
from moetool.policies import build_policy
from moetool.uncertainty import RowTable



class _LM:
    def __init__(self, model_type="mixtral"):
        self.model = build_tiny_model(model_type)
        self.layers = find_moe_layers(self.model)


def _tokens():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1024, (3, 16), generator=gen)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[2, 9:] = 0
    return TokenSet(ids, mask, [""] * 3, "test")


def test_router_reproduces_the_unhooked_perplexity():
    lm, tokens = _LM(), _tokens()
    ref, n = hand_ppl(lm.model, tokens, 2)
    plain = perplexity(lm, tokens, batch_size=2, quiet=True)
    router = perplexity(lm, tokens, policy=build_policy("router"), batch_size=2, quiet=True)
    assert plain.nll.tokens == router.nll.tokens == n == tokens.n_tokens - 3
    assert router.nll.nll_sum == plain.nll.nll_sum  # bit-identical logits through the override path
    assert router.perplexity == pytest.approx(ref, rel=1e-6)


def test_policy_and_layers_change_perplexity_only_where_asked():
    lm, tokens = _LM(), _tokens()
    router = perplexity(lm, tokens, batch_size=2, quiet=True)
    norm = build_policy("norm:gate", weights="uniform")
    every = perplexity(lm, tokens, policy=norm, batch_size=2, quiet=True)
    one = perplexity(lm, tokens, policy=norm, policy_layers=[3], batch_size=2, quiet=True, rows=RowTable(tokens))
    none = perplexity(lm, tokens, policy=norm, policy_layers=[], batch_size=2, quiet=True)
    assert none.nll.nll_sum == router.nll.nll_sum
    assert len({router.perplexity, every.perplexity, one.perplexity}) == 3
    df = ppl_frame(one, model="m", data="d", routing=norm.name, weights="uniform", layers=[3], n_boot=0, seed=0)
    assert list(df.columns) == list(PPL_COLUMNS)
    assert df.loc[0, "layers"] == "3" and df.loc[0, "perplexity"] == pytest.approx(math.exp(df.loc[0, "nll_mean"]))


def test_router_replaces_no_layer_and_ppl_csv_says_so(tmp_path):
    """--routing router runs the model's own routing unhooked, so no layer's routing is replaced: ppl.csv's layers
    is '-' (as weights), with or without --layers (BASE wrote '0' for --layers 0 and 'all' without, which the
    column's definition reads as layers replaced); the perplexity is the same unhooked one either way."""
    from moetool.experiments.ppl.compute import PPL_DEFINITIONS

    common = ["ppl", "--model", "tiny", "--routing", "router", "--seq-len", "64", "--max-tokens", "300", "--bootstrap",
              "0", "-q"]
    runs = {}
    for name, more in (("one", ["--layers", "0"]), ("every", [])):
        r = CliRunner().invoke(app, [*common, *more, "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        runs[name] = pd.read_csv(tmp_path / name / "ppl.csv", keep_default_na=False).iloc[0]
    assert [runs[n]["layers"] for n in runs] == ["-", "-"] and [runs[n]["weights"] for n in runs] == ["-", "-"]
    assert runs["one"]["perplexity"] == runs["every"]["perplexity"]
    assert "- for router" in PPL_DEFINITIONS["layers"]
    r = CliRunner().invoke(app, [*common, "--layers", "9", "--out", str(tmp_path / "bad")])  # still checked
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output


def test_cli_matches_a_hand_perplexity_on_the_embedded_model(tmp_path):
    from moetool.data import load_tokens
    from moetool.loading import load

    runner = CliRunner()
    common = ["--model", "tiny", "--seq-len", "64", "--max-tokens", "300", "--batch-size", "4", "-q"]
    r = runner.invoke(app, ["ppl", *common, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    r2 = runner.invoke(app, ["ppl", *common, "--routing", "norm:gate", "--layers", "0", "--out", str(tmp_path / "b")])
    assert r2.exit_code == 0, r2.output
    a, b = pd.read_csv(tmp_path / "a" / "ppl.csv"), pd.read_csv(tmp_path / "b" / "ppl.csv")
    assert list(a.columns) == list(PPL_COLUMNS) and (tmp_path / "a" / "manifest.json").is_file()
    lm = load("tiny")
    ref, n = hand_ppl(lm.model, load_tokens(None, lm.tokenizer, 64, 300), 4)
    assert a.loc[0, "scored_tokens"] == n and a.loc[0, "perplexity"] == pytest.approx(ref, rel=1e-6)
    assert b.loc[0, "routing"] == "norm:gate:l2" and str(b.loc[0, "layers"]) == "0"
    assert b.loc[0, "perplexity"] != a.loc[0, "perplexity"]


def hand_row_nll(model, tokens, batch_size):
    """Per-row next-token NLL sums and scored counts, by my own loop (no moetool code)."""
    nll, cnt = [], []
    with torch.no_grad():
        for s in range(0, tokens.input_ids.shape[0], batch_size):
            ids, mask = tokens.input_ids[s:s + batch_size], tokens.attention_mask[s:s + batch_size]
            logp = F.log_softmax(feed(model, ids, mask).logits.float(), dim=-1).cpu()
            for b in range(ids.shape[0]):
                keep = [t for t in range(ids.shape[1] - 1) if mask[b, t] and mask[b, t + 1]]
                nll.append(-sum(float(logp[b, t, ids[b, t + 1]]) for t in keep))
                cnt.append(len(keep))
    return np.array(nll), np.array(cnt, dtype=float)


def _rows_tokens(n=7):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 1024, (n, 12), generator=gen)
    mask = torch.ones(n, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[4, 3:] = 0
    return TokenSet(ids, mask, [""] * n, "test")


def test_bootstrap_columns_equal_an_independent_interval_from_per_row_sums():
    from moetool.experiments.ppl.compute import ppl
    from moetool.uncertainty import ppl_ratio_interval, ratio_intervals

    lm, tokens = _LM(), _rows_tokens()
    lm.name = "m"
    nll, cnt = hand_row_nll(lm.model, tokens, 3)
    res = ppl(lm, tokens, routing="norm:gate", layers=(3,), batch_size=3, bootstrap=200, seed=4, quiet=True)
    row = res["ppl"].iloc[0]
    # the baseline (router) run is the plain model: my per-row sums; the policy run's per-row sums via the hook
    base = ratio_intervals(nll, cnt, n_boot=200, seed=4, transform=np.exp)[0]
    assert row.router_perplexity == pytest.approx(base.value, rel=1e-6)
    pol = perplexity(lm, tokens, policy=build_policy("norm:gate"), policy_layers=[3], batch_size=3, quiet=True)
    assert row.perplexity == pytest.approx(pol.perplexity, rel=1e-12)
    # the policy's own per-row sums (moetool's RowTable) equal to the float: re-derive the interval from them
    from moetool.uncertainty import RowTable
    from moetool import distributed
    shard = distributed.shard(tokens, 3)
    again = perplexity(lm, shard, policy=build_policy("norm:gate"), policy_layers=[3], batch_size=3, quiet=True,
                       rows=RowTable(shard))
    assert again.rows.table("scored").tolist() == cnt.tolist()
    pn = again.rows.table("nll")
    assert pn.sum() == pytest.approx(pol.nll.nll_sum, rel=1e-12)  # the rows add up to the plain NLL path
    ci = ratio_intervals(pn, cnt, n_boot=200, seed=4, transform=np.exp)[0]
    assert (row.perplexity_lo, row.perplexity_hi) == pytest.approx((ci.lo, ci.hi), rel=1e-12)
    r = ppl_ratio_interval(pn, nll, cnt, n_boot=200, seed=4)
    assert (row.ratio, row.ratio_lo, row.ratio_hi) == pytest.approx((r.value, r.lo, r.hi), rel=1e-6)
    for name in ("perplexity", "ratio"):
        assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"]
    assert row.ratio_lo < row.ratio_hi and row.perplexity_lo < row.perplexity_hi
    # bootstrap=0: same values, no interval; router: no baseline pass
    off = ppl(lm, tokens, routing="norm:gate", layers=(3,), batch_size=3, bootstrap=0, quiet=True)["ppl"].iloc[0]
    assert off.perplexity == row.perplexity and math.isnan(off.perplexity_lo) and math.isnan(off.ratio_hi)
    plain = ppl(lm, tokens, batch_size=3, bootstrap=200, quiet=True)["ppl"].iloc[0]
    assert math.isnan(plain.ratio) and plain.perplexity == pytest.approx(base.value, rel=1e-6)
    assert (plain.perplexity_lo, plain.perplexity_hi) == pytest.approx((ratio_intervals(
        nll, cnt, n_boot=200, seed=0, transform=np.exp)[0].lo, ratio_intervals(
        nll, cnt, n_boot=200, seed=0, transform=np.exp)[0].hi), rel=1e-6)


def test_router_ppl_runs_unhooked(monkeypatch):
    """ppl with the model's own routing installs no hook (the router policy would reproduce it bit for bit, at the
    hooks' cost): the hand perplexity of plain forwards, with no Engine built."""
    import moetool
    import moetool.engine.runner as runner

    lm, tokens = _LM(), _tokens()
    lm.name, lm.device = "tiny-mixtral", torch.device("cpu")
    ref, n = hand_ppl(lm.model, tokens, 2)

    def no_engine(*a, **k):
        raise AssertionError("hooked")
    monkeypatch.setattr(runner, "Engine", no_engine)
    row = moetool.ppl(lm, tokens, batch_size=2, quiet=True, bootstrap=0)["ppl"].iloc[0]
    assert row.routing == "router" and row.scored_tokens == n
    assert row.perplexity == pytest.approx(ref, rel=1e-6)
    with pytest.raises(AssertionError, match="hooked"):
        moetool.ppl(lm, tokens, batch_size=2, quiet=True, bootstrap=0, routing="random")


def test_data_name_is_the_files_stem_or_heldout():
    """The ``data`` column names ``--data`` by its file or folder stem (no directory, no extension), ``heldout`` for
    the default."""
    from moetool.experiments.routing import data_name

    assert [data_name(p) for p in ("/some/dir/wiki.jsonl", "corpus.txt.gz", "shards/", None, "")] == \
        ["wiki", "corpus.txt", "shards", "heldout", "heldout"]


def test_ppl_columns_computes_the_bounds_of_the_pair_it_is_given():
    """The one builder of a perplexity table's columns (ppl, topk, capacity, prune, super-experts) computes their
    bounds itself -- before, each caller called ppl_intervals and passed its dict in a second step, so a table could
    get no bounds (NaN, read as "no interval" under --bootstrap 1000) or another pair's. The forwards' perplexity
    and ratio, each bound beside its value, ``between`` before the ratio; the bounds by hand from the runs' per-row
    sums (the document-level bootstrap of uncertainty), NaN with n_boot=0 or without a base."""
    from moetool import distributed
    from moetool.experiments.routing import ppl_columns
    from moetool.uncertainty import ppl_ratio_interval, ratio_intervals

    lm, tokens = _LM(), _rows_tokens()
    shard = distributed.shard(tokens, 3)
    base = perplexity(lm, shard, batch_size=3, quiet=True, rows=RowTable(shard))
    run = perplexity(lm, shard, policy=build_policy("norm:gate"), policy_layers=[3], batch_size=3, quiet=True,
                     rows=RowTable(shard))
    cols = ppl_columns(run, base, n_boot=200, seed=4, between={"delta_ppl": 10.0})
    assert list(cols) == ["perplexity", "perplexity_lo", "perplexity_hi", "delta_ppl", "ratio", "ratio_lo",
                          "ratio_hi"]
    nll, base_nll, cnt = run.rows.table("nll"), base.rows.table("nll"), run.rows.table("scored")
    p = ratio_intervals(nll, cnt, n_boot=200, seed=4, transform=np.exp)[0]
    r = ppl_ratio_interval(nll, base_nll, cnt, n_boot=200, seed=4)
    assert [cols[c] for c in cols] == pytest.approx([run.perplexity, p.lo, p.hi, 10.0,
                                                     run.perplexity / base.perplexity, r.lo, r.hi], rel=1e-12)
    assert cols["perplexity_lo"] < cols["perplexity_hi"] and cols["ratio_lo"] < cols["ratio_hi"]
    off = ppl_columns(run, base, n_boot=0, seed=4)
    assert off["ratio"] == cols["ratio"] and all(math.isnan(off[c]) for c in off if c.endswith(("_lo", "_hi")))
    alone = ppl_columns(run, n_boot=200, seed=4)  # no router run: its perplexity's bounds, no ratio
    assert (alone["perplexity_lo"], alone["perplexity_hi"]) == pytest.approx((p.lo, p.hi), rel=1e-12)
    assert all(math.isnan(alone[c]) for c in ("ratio", "ratio_lo", "ratio_hi"))


@pytest.mark.slow
@pytest.mark.parametrize("rows", [9, 10])
def test_cli_says_once_when_too_few_rows_for_a_95_interval(tmp_path, rows):
    """ppl over 9 packed rows of 32 tokens (FEW_ROWS - 1): one ``note:`` line on stderr, the manifest's
    ``bootstrap`` section has the same note, the interval is still in ppl.csv; over 10 rows: neither."""
    import json

    from moetool.uncertainty import FEW_ROWS, few_rows_note

    r = CliRunner().invoke(app, ["ppl", "--model", "tiny", "--seq-len", "32", "--max-tokens", str(32 * rows),
                                 "-q", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    boot = json.loads((tmp_path / "a" / "manifest.json").read_text())["bootstrap"]
    assert boot["rows"] == rows and boot["replicates"] == 1000
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    if rows < FEW_ROWS:
        assert notes == [f"note: {few_rows_note(1000, rows)}"] and boot["note"] == few_rows_note(1000, rows)
        assert "9 packed rows" in notes[0]
    else:
        assert notes == [] and "note" not in boot
    df = pd.read_csv(tmp_path / "a" / "ppl.csv")
    assert df.loc[0, "perplexity_lo"] < df.loc[0, "perplexity"] < df.loc[0, "perplexity_hi"]


def test_a_paired_ratio_over_rows_that_scored_different_tokens_is_refused():
    """The ratio's interval is paired (one weight per row for both runs): a baseline whose rows scored other token
    counts is refused in one line, never a ratio interval of mismatched rows; the same counts give the paired
    interval of uncertainty.ppl_ratio_interval."""
    from types import SimpleNamespace

    from moetool.errors import MoetoolError, MoetoolRuntimeError
    from moetool.experiments.routing import ppl_intervals
    from moetool.uncertainty import RowSums, ppl_ratio_interval

    def fake(nll, scored):
        rows = RowSums()
        rows.add(np.arange(len(nll)), nll=np.array(nll), scored=np.array(scored, dtype=float))
        return SimpleNamespace(rows=rows)

    run = fake([30.0, 20.0, 12.0, 40.0], [10, 8, 6, 12])
    same = fake([28.0, 21.0, 11.0, 37.0], [10, 8, 6, 12])
    got = ppl_intervals(run, same, n_boot=200, seed=1)
    want = ppl_ratio_interval([30.0, 20.0, 12.0, 40.0], [28.0, 21.0, 11.0, 37.0], [10, 8, 6, 12], n_boot=200, seed=1)
    assert (got["ratio_lo"], got["ratio_hi"]) == pytest.approx((want.lo, want.hi), rel=1e-12)
    with pytest.raises(MoetoolError, match="^the baseline scored different tokens: no paired ratio$"):
        ppl_intervals(run, fake([28.0, 21.0, 11.0, 37.0], [10, 8, 7, 12]), n_boot=200, seed=1)
    # a mean NLL of 800 nats (exp past float64's 709.78) in either run, the baseline too: NLL.ppl's one line, before
    # any exp of the bootstrap warns (mutation pass 22: checking the run alone survived)
    huge = fake([8000.0, 6400.0, 4800.0, 9600.0], [10, 8, 6, 12])
    for a, b in ((huge, run), (run, huge)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(MoetoolRuntimeError) as e:
                ppl_intervals(a, b, n_boot=200, seed=1)
        assert str(e.value).startswith("mean next-token NLL ") and float(str(e.value).split()[3]) == 800.0


def test_ppl_headline_and_console_row_show_the_ratio_only_where_a_baseline_ran_and_no_scored_token_is_one_line():
    """summary_lines / ppl_summary: the ratio to the router (and the router's columns) only where the baseline ran;
    the base's own ratio has the interval [1, 1] only where intervals are on (NaN with n_boot=0); rows with no
    scored token are refused with the line that says why."""
    from types import SimpleNamespace

    from moetool.errors import MoetoolError
    from moetool.experiments.ppl.compute import PPL_COLUMNS, ppl_summary, summary_lines
    from moetool.experiments.routing import ppl_intervals
    from moetool.uncertainty import RowSums, format_ci

    nan = float("nan")
    base = dict(model="m", data="heldout", weights="-", layers="all", scored_tokens=1000, nll_mean=2.0,
                perplexity=7.389, perplexity_lo=7.0, perplexity_hi=7.8, seconds=1.0)
    alone = pd.DataFrame([{**base, "routing": "router", "router_perplexity": nan, "ratio": nan, "ratio_lo": nan,
                           "ratio_hi": nan}], columns=list(PPL_COLUMNS))
    paired = pd.DataFrame([{**base, "routing": "norm:gate:l2", "router_perplexity": 5.0, "ratio": 1.4778,
                            "ratio_lo": 1.4, "ratio_hi": 1.55}], columns=list(PPL_COLUMNS))
    assert summary_lines("tiny", {"ppl": alone}) == [
        f"ppl tiny: router perplexity {format_ci(7.389, 7.0, 7.8)} on 1,000 tokens"]
    assert summary_lines("tiny", {"ppl": paired}) == [
        f"ppl tiny: norm:gate:l2 perplexity {format_ci(7.389, 7.0, 7.8)} on 1,000 tokens, "
        f"x{format_ci(1.4778, 1.4, 1.55)} of the router's 5"]
    assert "router" not in ppl_summary(alone).columns and "ratio" not in ppl_summary(alone).columns
    assert {"router", "ratio"} <= set(ppl_summary(paired).columns)

    rows = RowSums()
    rows.add(np.arange(3), nll=np.array([3.0, 4.0, 5.0]), scored=np.array([2.0, 2.0, 2.0]))
    run = SimpleNamespace(rows=rows)
    off = ppl_intervals(run, run, n_boot=0)
    assert off["ratio"] == 1.0 and math.isnan(off["ratio_lo"]) and math.isnan(off["ratio_hi"])
    on = ppl_intervals(run, run, n_boot=200)
    assert (on["ratio_lo"], on["ratio_hi"]) == (1.0, 1.0)
    empty = RowSums()
    empty.add(np.arange(2), nll=np.zeros(2), scored=np.zeros(2))
    with pytest.raises(MoetoolError, match="^no next-token prediction to score"):
        ppl_intervals(SimpleNamespace(rows=empty), n_boot=0)
