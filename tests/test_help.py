"""`--help` text reads well at 80 columns: docstrings hard-wrapped in the source are re-flowed before rich wraps them."""

import pytest



def test_reflow_joins_sentences_and_keeps_structure():
    from moetool.commands.app import reflow

    doc = ("First sentence runs\nover two lines.\n\nCache simulation: per layer\na cache.\n"
           "Intervals: 95% bootstrap\n(--bootstrap N).\n\n  load.csv: layer, expert,\n    load_fraction\n"
           "  layers.csv: layer\n\nExamples:\n  moetool stats\n  moetool stats --top-k 1\n")
    assert reflow(doc).splitlines() == [
        "First sentence runs over two lines.", "",
        "Cache simulation: per layer a cache.", "Intervals: 95% bootstrap (--bootstrap N).", "",
        "  load.csv: layer, expert, load_fraction", "  layers.csv: layer", "",
        "Examples:", "  moetool stats", "  moetool stats --top-k 1"]


def test_every_command_help_is_reflowed():
    from moetool.commands.app import app, reflow

    for info in app.registered_commands:
        assert info.help and reflow(info.help) == info.help, info.name


def _options(args):
    """{flag: its type column} of ``moetool <args> --help`` (rich's table, wide enough for one line per flag)."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    rows = {}
    for line in r.output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("  ") if c.strip()]
        if cells and cells[0].startswith("--"):
            rows[cells[0]] = line
    return rows


def test_switches_show_no_type_ranges_their_kind_repeated_flags_one_value():
    """--version <bool>, --help <bool>, stats --top-k <int range> [1<=x<=1], fluctuation --trace <list[Path]>: a
    switch shows no value, a bounded number its kind, a flag given once per value the one value it takes."""
    import typer

    from moetool.commands.app import app

    top = _options([])
    assert "<" not in top["--version"] and "<" not in top["--help"]
    stats = _options(["stats"])
    assert " <int> [x=1] " in stats["--top-k"] and " <int> [x>=0] " in stats["--top-tokens"]
    assert "<" not in stats["--force"] and "<" not in stats["--quiet"] and "<" not in stats["--all-tokens"]
    assert " <path> " in _options(["fluctuation"])["--trace"]
    for name in typer.main.get_command(app).commands:  # nowhere a typer type name the user cannot type
        for flag, line in _options([name]).items():
            assert not any(bad in line for bad in ("<bool>", " range>", "<list[")), (name, flag, line)


def test_bracketed_help_text_survives_rich():
    """typer reads help as rich markup, which ate '[lo, hi]': `stats --help` said "(value  where the interval is
    not symmetric)", every --bootstrap "('value ' where ...)". Every bracketed text of every command's help and
    every flag's help is printed as its source says it."""
    import re

    import typer
    from typer.testing import CliRunner

    from moetool.commands.app import app

    group = typer.main.get_command(app)
    tag = re.compile(r"\[[A-Za-z#/@][^\[\]]*\]")  # what rich would take for a tag
    seen = 0
    for name, cmd in group.commands.items():
        texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]
        wanted = {m for t in texts for m in tag.findall(" ".join(t.split()))}
        if not wanted:
            continue
        r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "2000"})
        assert r.exit_code == 0, r.output
        shown = " ".join(r.output.replace("│", " ").split())
        missing = [w for w in wanted if w not in shown]
        assert not missing, (name, missing)
        seen += len(wanted)
    assert seen >= 20
    shown = " ".join(CliRunner().invoke(app, ["stats", "--help"], env={"COLUMNS": "2000"}).output.split())
    assert "(value [lo, hi] where the interval is not symmetric)" in shown


def test_the_commands_a_help_says_a_policy_works_in_take_routing():
    """`topk --help` said its policies work in "ppl, eval, trace and norm-select: --routing topk:1", and `prune --help`
    the same of prune:; norm-select has no --routing (its --prune takes prune: specs only, `--prune topk:1` is
    refused). Every command a help says a policy "works in" takes --routing."""
    import re

    import typer

    from moetool.commands.app import app

    group = typer.main.get_command(app)
    named = re.compile(r"works? in ((?:[a-z][a-z-]*(?:, and |, | and ))+[a-z][a-z-]*)")
    checked = 0
    for name, cmd in group.commands.items():
        for m in named.finditer(" ".join((cmd.help or "").split())):
            for other in re.split(r", and |, | and ", m.group(1)):
                target = group.commands.get(other)
                assert target is not None, (name, m.group(0))
                opts = {o for p in target.params for o in p.opts}
                assert "--routing" in opts, f"{name} --help: '{m.group(0)}', but {other} has no --routing"
                checked += 1
    assert checked >= 9  # topk, capacity and prune name ppl, eval and trace


def test_quiet_leaves_out_every_commands_tables(tmp_path):
    """--quiet is one thing on every command: no progress bars and no console tables (tests/test_help_files.py
    checks every command's -q output). Before, approx, erc, fluctuation, mass-recall, offload, plan and
    super-experts printed no table under it and the others theirs, and the help had to list the seven: stats -q
    printed its table. No command's own console output decides it (commands.cli.finish does), and the --trace
    analyses leave theirs out too (stats --trace -q printed its table)."""
    import re
    from pathlib import Path

    from typer.testing import CliRunner

    from moetool.commands.app import app

    src = Path(__file__).resolve().parents[1] / "commands"
    assert not [f.name for f in src.glob("*.py") if f.name not in ("cli.py", "plan.py")
                and re.search(r"\bif (not )?(p\.)?quiet\b", f.read_text())]
    runner = CliRunner()
    loud = runner.invoke(app, ["stats", "--max-tokens", "256", "--out", str(tmp_path / "a")])
    quiet = runner.invoke(app, ["stats", "--max-tokens", "256", "--out", str(tmp_path / "b"), "-q"])
    assert loud.exit_code == quiet.exit_code == 0
    assert "tiny: 256 tokens" in loud.output and quiet.output.strip() == f"results in {tmp_path / 'b'}"
    r = runner.invoke(app, ["trace", "--max-tokens", "128", "--out", str(tmp_path / "t")])  # no table, -q or not
    assert r.exit_code == 0 and r.output.strip().splitlines()[-1] == f"results in {tmp_path / 't' / 'trace.csv.gz'}"
    on_trace = runner.invoke(app, ["stats", "--trace", str(tmp_path / "t"), "--out", str(tmp_path / "c"), "-q"])
    assert on_trace.exit_code == 0 and on_trace.output.strip().splitlines()[-1] == f"results in {tmp_path / 'c'}"
    assert "│" not in on_trace.output and "┃" not in on_trace.output, on_trace.output
    help_ = " ".join(runner.invoke(app, ["ppl", "--help"], env={"COLUMNS": "300"}).output.split())
    assert "No progress bars and no console tables" in help_ and "erc, fluctuation" not in help_


@pytest.mark.slow
def test_demo_quiet_prints_only_the_line_naming_its_folder(tmp_path, capsys):
    """``demo -q`` as every other command under -q (:func:`moetool.commands.cli.finish`): no step headings, no step
    lines, no timing table, only the ``results in`` line. Before, it printed ``== inspect (1/1)`` and each step's
    summary lines, and the timing table and ``report:`` line: a log kept clean with -q held them. Without -q they
    are all there, with the embedded models' shapes (tiny: 4 MoE layers of 8 experts, top-2; tiny-fine: 32, top-4).
    ``moetool.run_demo(quiet=True)`` prints nothing either (it printed the headings)."""
    from typer.testing import CliRunner

    import moetool
    from moetool.commands.app import app

    runner = CliRunner()
    loud = runner.invoke(app, ["demo", "--steps", "inspect", "--out", str(tmp_path / "a")])
    quiet = runner.invoke(app, ["demo", "--steps", "inspect", "--out", str(tmp_path / "b"), "-q"])
    assert loud.exit_code == quiet.exit_code == 0, (loud.output, quiet.output)
    lines = loud.output.splitlines()
    assert lines[0] == "== inspect (1/1)" and lines[1].startswith("   tiny: mixtral, 4 MoE layers, n=8, K=2, ")
    assert lines[2].startswith("   tiny-fine: qwen3_moe, 4 MoE layers, n=32, K=4, ")
    assert lines[-2:] == [f"report: {tmp_path / 'a' / 'report' / 'report.html'}", f"results in {tmp_path / 'a'}"]
    assert quiet.output.splitlines() == [f"results in {tmp_path / 'b'}"]
    assert (tmp_path / "b" / "report" / "report.html").exists() and (tmp_path / "b" / "inspect" / "tiny.json").exists()
    capsys.readouterr()
    moetool.run_demo(tmp_path / "c", steps=["inspect"], quiet=True)
    assert capsys.readouterr().out == ""


def test_norm_select_help_names_every_column_of_its_console_table():
    """The console's Table-1 summary (ppl ratio, top-K overlap, top-1 agree, <task> retention, seconds) is written
    to no CSV and its columns were named nowhere: --help now says which CSV column each is, and how agreement is
    pooled over layers (token-weighted: 0.6 and 0.3 on 300 and 100 tokens give 0.525, not the plain mean 0.45)."""
    import pandas as pd

    from moetool.experiments.norm_select import compute, spec

    agreement = pd.DataFrame({"layer": [0, 1], "policy": ["norm:gate:l2"] * 2, "topk_overlap": [0.6, 0.3],
                              "top1_agree": [0.5, 0.1], "tokens": [300, 100]})
    quality = pd.DataFrame({"policy": ["norm:gate:l2"] * 2, "task": ["heldout", "code"],
                            "metric": ["perplexity", "acc"], "value": [80.0, 0.7], "router_value": [40.0, 0.8],
                            "ratio": [2.0, 0.875], "seconds": [3.0, 5.0],
                            **{f"{c}_{e}": [float("nan")] * 2 for c in ("value", "ratio") for e in ("lo", "hi")}})
    t = compute.table1(agreement, quality, tasks=["code"])
    assert t["top-K overlap"].iloc[0] == (0.6 * 300 + 0.3 * 100) / 400 == 0.525
    assert (t["ppl ratio"].iloc[0], t["code retention"].iloc[0], t["seconds"].iloc[0]) == (2.0, 0.875, 8.0)
    doc = " ".join(spec.__doc__.split())
    shown = [c for c in t.columns if not c.endswith(("_lo", "_hi")) and c not in ("node", "norm")]
    assert all(c.replace("code ", "<task> ") in doc for c in shown), (shown, doc)
    assert "token-weighted over the layers" in doc
