"""A spec's flags as generated typer options, and their values reaching the command's body (mutation testing,
part 7)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moetool.commands import generated
from moetool.commands.app import app


def test_a_path_flag_refuses_an_empty_path_and_reaches_the_body_as_a_path(monkeypatch, tmp_path):
    """``--reference-data ""`` (placement's own path flag) is the current folder to pathlib: refused in one line
    before the command's body; a real path reaches it as a Path."""
    got = []
    monkeypatch.setattr(generated, "run", lambda spec, params: got.append(params))
    r = CliRunner().invoke(app, ["placement", "--model", "tiny", "--reference-data", "", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "empty path" in r.output and got == []
    f = tmp_path / "ref.txt"
    r = CliRunner().invoke(app, ["placement", "--model", "tiny", "--reference-data", str(f), "--out",
                                 str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert got[0]["reference_data"] == f and isinstance(got[0]["reference_data"], Path)


def test_a_bad_seed_is_refused_before_the_model_is_even_checked(monkeypatch, tmp_path):
    import importlib

    run_module = importlib.import_module("moetool.run")  # the module (moetool.run is also a function name)
    monkeypatch.setattr(run_module, "preflight", lambda *m: (_ for _ in ()).throw(AssertionError("preflight ran")))
    for argv in (["stats", "--model", "tiny", "--seed", "-1"],
                 ["eval", "--model", "tiny", "--tasks", "x", "--fewshot-seed", "-1"]):
        r = CliRunner().invoke(app, [*argv, "--out", str(tmp_path / "o")])
        assert r.exit_code == 2, r.output
        assert f"{argv[-2]} must be an integer from 0 to 4294967295" in r.output


def test_the_console_summary_points_to_the_specs_summary_csv(monkeypatch):
    """A summary that is not one of the tables itself (a selection of stats' layers.csv) points to the CSV the spec
    names, not to the first table."""
    import pandas as pd

    from moetool.experiments.registry import EXPERIMENTS
    from moetool.experiments.result import Result
    from moetool.report import console

    layers = pd.DataFrame({"layer": [0, 1], "entropy": [0.5, 0.25]})
    res = Result("stats", {"load.csv": pd.DataFrame({"x": [1]}), "layers.csv": layers}, None,
                 summary=layers[["layer"]])
    shown = []
    monkeypatch.setattr(console, "print_table", lambda df, title, csv=None: shown.append((title, csv)))
    generated.show(EXPERIMENTS["stats"], res, "tiny")
    assert shown == [(f"{EXPERIMENTS['stats'].title}: tiny", "layers.csv")]
    res = Result("erc", {"a.csv": layers, "b.csv": layers.copy()}, None, summary=layers)
    generated.show(EXPERIMENTS["erc"], res, "tiny")
    assert shown[-1][1] == "a.csv" and EXPERIMENTS["erc"].summary_csv is None
