"""Every comma-separated list flag treats a value given twice the same way, on the command line and from Python:
one line naming the flag and the value, before any work (``moetool.registry.refuse_repeats``, asked by
``Flag.check``), so no table has a row computed twice and no run quietly does less than it was asked. The parser,
``commands.cli.parse_list``, keeps the values as given; ``--layers`` alone names a set (ranges may overlap)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import moetool
from moetool.errors import MoetoolError

from test_flag_values import console

ROOT = Path(__file__).resolve().parents[1]


def test_parse_list_keeps_the_values_as_given():
    from moetool.commands.cli import parse_layers, parse_list

    assert parse_list("0.5,0.5,.50,0.25", float, "fraction") == [0.5, 0.5, 0.5, 0.25]  # equal once cast: kept
    assert parse_list(" reap , random,reap", str, "criterion") == ["reap", "random", "reap"]
    with pytest.raises(MoetoolError, match="bad fraction 'x'"):
        parse_list("0.5,x,0.5", float, "fraction")
    assert parse_layers("0-2,1,1") == (0, 1, 2)  # a set of layers, as select_layers reads layers=(1, 1)


def list_flags():
    """(command, flag) for every list flag of every generated command (a kind of list, or a parser of its own that
    returns one: --nodes, --norm)."""
    from moetool.experiments.registry import EXPERIMENTS

    return [(spec, f) for spec in EXPERIMENTS.values() for f in spec.command_flags()
            if f.to_options and (f.many or (f.kind == "str" and f.name in ("nodes", "norms")))]


@pytest.mark.parametrize("spec, flag", list_flags(), ids=lambda x: getattr(x, "name", None) or x.flag)
def test_a_value_given_twice_in_any_list_flag_is_one_line_naming_it(spec, flag):
    """Each list flag, a value given twice (the second spelled otherwise where a number allows it: equal once cast)
    is refused naming the flag and the value; it was kept once on the command line while the library refused it."""
    from moetool.commands.generated import options_of

    value, shown = {"ints": ("2,02", "2"), "floats": ("0.5,.50", "0.5")}.get(flag.kind, ("gate,gate", "'gate'"))
    if flag.name == "norms":
        value, shown = "l1,l1", "'l1'"
    with pytest.raises(MoetoolError) as e:
        options_of(spec, {flag.name: value})
    assert str(e.value).startswith(f"{flag.flag}: {shown} is given twice in "), str(e.value)


@pytest.mark.parametrize("argv, line", [
    (["margin", "--eps", "0.1,0.1"], "--eps: 0.1 is given twice in [0.1, 0.1]"),
    (["margin", "--policies", "random,random"], "--policies: 'random' is given twice in ['random', 'random']"),
    (["topk", "--ps", "0.5,0.9,.50"], "--ps: 0.5 is given twice in [0.5, 0.9, 0.5]"),
    (["prune", "--criteria", "reap,reap"], "--criteria: 'reap' is given twice in ['reap', 'reap']"),
    (["capacity", "--cf", "1,inf,1.0"], "--cf: 1.0 is given twice in [1.0, inf, 1.0]"),
    (["norm-select", "--nodes", "gate,up,gate"], "--nodes: 'gate' is given twice in ['gate', 'up', 'gate']"),
    (["demo", "--steps", "stats,locality,stats"],
     "--steps: 'stats' is given twice in ['stats', 'locality', 'stats']"),
])
def test_the_command_line_refuses_a_repeat_in_one_line(argv, line, monkeypatch, capsys, tmp_path):
    """moetool margin --eps 0.1,0.1 ran 0.1 once and said nothing; now exit 2, one line, no run folder."""
    code, err, made = console(argv, monkeypatch, capsys, tmp_path)
    assert code == 2 and err == [f"error: {line} (each value once: no row is computed twice)"], err
    assert not made


def test_the_library_refuses_the_same_repeat_with_the_same_line(tmp_path):
    """moetool.run(...) and moetool.demo resolve list options through the same check: the command line's line."""
    with pytest.raises(MoetoolError, match=re.escape("--eps: 0.1 is given twice in [0.1, 0.1] (each value once")):
        moetool.run("margin", "tiny", eps=(0.1, 0.1), out=tmp_path / "a")
    with pytest.raises(MoetoolError, match=re.escape("--criteria: 'reap' is given twice in ['reap', 'reap']")):
        moetool.run("prune", "tiny", criteria=("reap", "reap"), out=tmp_path / "b")
    from moetool.demo import demo

    with pytest.raises(MoetoolError, match=re.escape("--steps: 'stats' is given twice in ['stats', 'stats']")):
        demo(tmp_path / "c", ["stats", "stats"])
    assert not any(tmp_path.iterdir())


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

    assert parse_nodes("up,gate,up") == ["up", "gate", "up"] and parse_norms("l1,l2,l1") == ["l1", "l2", "l1"]


def test_no_command_splits_a_list_itself():
    """Commands parse list flags with parse_list only (one parser, one error for a bad item)."""
    own = [p.name for p in (ROOT / "commands").glob("*.py")
           if p.name != "cli.py" and re.search(r"\.split\(\s*['\"],['\"]", p.read_text(encoding="utf-8"))]
    assert own == []
