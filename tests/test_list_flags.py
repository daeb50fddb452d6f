"""Every comma-separated list flag treats a value given twice the same way: kept once, at its first place (one
parser, ``commands.cli.parse_list``, over ``moetool.registry.unique``), so no table has a row computed twice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moetool.errors import MoetoolError

ROOT = Path(__file__).resolve().parents[1]


def test_parse_list_keeps_each_value_once():
    from moetool.commands.cli import parse_list

    assert parse_list("0.5,0.5,.50,0.25,0.5", float, "fraction") == [0.5, 0.25]  # equal once cast
    assert parse_list("3,1,03,1", int, "k") == [3, 1]
    assert parse_list(" reap , random,reap", str, "criterion") == ["reap", "random"]
    with pytest.raises(MoetoolError, match="bad fraction 'x'"):
        parse_list("0.5,x,0.5", float, "fraction")


def test_every_list_flag_names_itself_in_its_errors():
    """An empty or bad list names the flag as typed ("--eps: no value in ''"; it read "empty list of epss")."""
    from moetool.commands.generated import parse_flag
    from moetool.experiments.registry import EXPERIMENTS

    lists = {f.flag: f for spec in EXPERIMENTS.values() for f in spec.command_flags() if f.many and f.parse is None}
    assert {"--eps", "--ks", "--gpus", "--policies", "--thresholds"} <= set(lists)
    for name, f in lists.items():
        with pytest.raises(MoetoolError) as e:
            parse_flag(f, " , ")
        assert str(e.value) == f"{name}: no value in ' , '"
        if f.kind in ("ints", "floats"):
            with pytest.raises(MoetoolError) as e:
                parse_flag(f, "1,x")
            assert str(e.value) == f"{name}: bad value 'x' in '1,x'"


def test_norm_select_lists_too():
    from moetool.experiments.norm_select.compute import parse_nodes, parse_norms

    assert parse_nodes("up,gate,up") == ["up", "gate"] and parse_norms("l1,l2,l1") == ["l1", "l2"]


def test_no_command_splits_a_list_itself():
    """Commands parse list flags with parse_list only (a hand-made split would skip the de-duplication)."""
    own = [p.name for p in (ROOT / "commands").glob("*.py")
           if p.name != "cli.py" and re.search(r"\.split\(\s*['\"],['\"]", p.read_text(encoding="utf-8"))]
    assert own == []


@pytest.mark.slow
def test_prune_fractions_given_twice_run_once(tmp_path):
    """`prune --fractions 0.25,0.25 --criteria reap,reap`: one row per (criterion, fraction), as capacity does."""
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "--fractions", "0.25,0.25,.25", "--criteria", "reap,reap", "--ablate", "1",
                                 "--max-tokens", "256", "--seq-len", "64", "--bootstrap", "0", "-q", "--out",
                                 str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "prune.csv")
    assert list(zip(df.criterion, df.fraction)) == [("router", 0.0), ("reap", 0.25)]
    removed = pd.read_csv(out / "prune_removed.csv")
    assert not removed.duplicated().any()
