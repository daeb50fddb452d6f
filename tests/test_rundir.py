"""Runs that fail safely: --out validated before work, folder made at the first write, atomic files, manifest
status running/complete/failed/interrupted (SIGINT in a real run, SIGTERM like SIGINT), --force clears stale
results, default names never collide."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from conftest import ctrl_c_default
from moetool.errors import MoetoolError
from moetool.report import RunDir
from moetool.report import rundir as rd

DF = pd.DataFrame({"a": [1, 2], "b": [0.5, 0.25]})


def manifest(path):
    return json.loads((Path(path) / "manifest.json").read_text())


def test_out_that_is_a_file_or_unwritable_is_one_line_error(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(MoetoolError, match="exists and is not a folder"):
        RunDir.create("stats", f)
    with pytest.raises(MoetoolError, match="is a file, not a folder"):
        RunDir.create("stats", f / "sub")
    with pytest.raises(MoetoolError, match="cannot write in"):  # read-only even for root
        RunDir.create("stats", "/proc/moetool-run")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(MoetoolError, match="cannot write in"):
            RunDir.create("stats", ro / "run")


def test_folder_is_made_at_the_first_write_only(tmp_path):
    out = tmp_path / "a" / "b"
    run = RunDir.create("stats", out)
    assert not out.exists() and not (tmp_path / "a").exists()
    run.mark("failed", "boom")  # failed before any result: nothing left behind
    assert not out.exists()
    run = RunDir.create("stats", out)  # so the rerun is accepted
    run.write_csv("t.csv", DF)
    m = manifest(out)
    assert m["status"] == "running" and m["files"] == ["t.csv"]
    assert pd.read_csv(out / "t.csv").equals(DF)
    run.finish(options={"x": 1})
    m = manifest(out)
    assert m["status"] == "complete" and m["options"] == {"x": 1} and "git" in m and m["versions"]["python"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".part-")] == []


def test_default_names_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = {RunDir.create("stats")._path for _ in range(50)}  # same second
    assert len(paths) == 50
    assert all(p.parent == Path("runs") and p.name.startswith("stats-") for p in paths)


def test_a_default_name_drawn_twice_before_any_write_is_drawn_again(tmp_path, monkeypatch):
    """Default folders are made on the first write, so two runs created in the same second could draw the same
    4-hex suffix (the check above failed 1 time in about 50: 49 distinct paths of 50). The second draw of a name this
    process already handed out is drawn again."""
    from moetool.report import rundir

    monkeypatch.chdir(tmp_path)
    draws = iter(["abcd", "abcd", "beef"])
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: next(draws))
    first, second = RunDir.create("stats")._path, RunDir.create("stats")._path
    assert first.name.endswith("-abcd") and second.name.endswith("-beef") and not first.exists()


def test_interrupted_write_leaves_no_half_file(tmp_path):
    run = RunDir.create("stats", tmp_path / "r")

    class Boom:
        def __len__(self):
            return 1

        def to_csv(self, path, index=False):
            Path(path).write_text("half")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.write_csv("t.csv", Boom())
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [rd.LOCK, "manifest.json"]  # the run still runs
    assert manifest(tmp_path / "r")["files"] == []


def test_force_removes_the_previous_runs_results_only(tmp_path):
    out = tmp_path / "r"
    old = RunDir.create("erc", out)
    old.write_csv("erc.csv", DF)
    old.write_csv("old.csv", DF)
    child = old.sub("inspect")
    child.write_json("x.json", {"a": 1})
    child.finish(options={})
    old.figures.joinpath("stale.png").write_bytes(b"x")
    old.file("figures/stale.png")  # listed, as save_figure lists its files
    old.finish(options={})
    (out / "notes.txt").write_text("mine")
    with pytest.raises(MoetoolError, match="not empty"):
        RunDir.create("stats", out)
    new = RunDir.create("stats", out, force=True)
    assert (out / "old.csv").exists()  # nothing removed before the new run writes
    new.write_csv("load.csv", DF)
    new.finish(options={})
    assert sorted(p.name for p in out.iterdir()) == ["load.csv", "manifest.json", "notes.txt"]
    assert manifest(out)["command"] == "stats"


def test_failed_run_folder_is_reused_without_force_but_an_interrupted_one_is_not(tmp_path):
    out = tmp_path / "r"
    run = RunDir.create("stats", out)
    run.write_csv("load.csv", DF)
    run.mark("failed", "bad data")
    assert manifest(out)["status"] == "failed" and manifest(out)["error"] == "bad data"
    run = RunDir.create("stats", out)
    run.write_csv("layers.csv", DF)
    assert not (out / "load.csv").exists()
    run.mark("interrupted")
    with pytest.raises(MoetoolError, match="unfinished stats run .status interrupted"):
        RunDir.create("stats", out)



def test_a_killed_run_left_running_is_refused_as_unfinished_not_as_a_full_folder(tmp_path):
    """A run killed outright (SIGKILL, out of memory) leaves its manifest at status running and no lock holder: the
    next run into the folder says it holds an unfinished run (status running) and how to go on, as for an
    interrupted one, and removes nothing (pass 17: treating only "interrupted" as unfinished said "is not empty")."""
    out = tmp_path / "r"
    code = ("import os, signal, sys; import pandas as pd; from moetool.report import RunDir; "
            "r = RunDir.create('stats', sys.argv[1]); r.write_csv('load.csv', pd.DataFrame({'a': [1]})); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert manifest(out)["status"] == "running"
    with pytest.raises(MoetoolError, match=rf"^--out {re.escape(str(out))} holds an unfinished stats run \(status "
                                           r"running\); use --resume to continue it or --force to start over$"):
        RunDir.create("stats", out, resumable=True)
    assert (out / "load.csv").is_file() and manifest(out)["status"] == "running"

def _fake_command(tmp_path, fail_with):
    from moetool.commands.cli import handle_errors

    app = typer.Typer()

    @app.command()
    @handle_errors
    def cmd(out: Path, quiet: bool = False):
        run = RunDir.create("fake", out)
        run.write_csv("first.csv", DF)
        raise fail_with

    return app


def test_cli_failure_marks_failed_and_rerun_works(tmp_path):
    out = tmp_path / "r"
    app = _fake_command(tmp_path, MoetoolError("NaN in layer 3, batch 2"))
    r = CliRunner().invoke(app, [str(out)])
    assert r.exit_code == 2
    assert [ln for ln in r.output.splitlines() if ln.strip()] == ["error: NaN in layer 3, batch 2"]
    m = manifest(out)
    assert m["status"] == "failed" and m["error"] == "NaN in layer 3, batch 2" and m["files"] == ["first.csv"]
    assert rd.active_runs() == []
    r = CliRunner().invoke(app, [str(out)])  # same --out, no --force: accepted (and fails the same way)
    assert r.exit_code == 2 and "not empty" not in r.output


def test_cli_keyboard_interrupt_marks_interrupted(tmp_path):
    out = tmp_path / "r"
    r = CliRunner().invoke(_fake_command(tmp_path, KeyboardInterrupt()), [str(out)])
    assert r.exit_code == 130
    assert manifest(out)["status"] == "interrupted"


SIGTERM_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import pandas as pd, typer
    from moetool.commands.cli import handle_errors
    from moetool.report import RunDir

    @handle_errors
    def cmd(out: Path, quiet: bool = False):
        run = RunDir.create("fake", out)
        run.write_csv("first.csv", pd.DataFrame({"a": [1]}))
        print("ready", flush=True)
        time.sleep(60)

    typer.run(cmd)
""")


def _wait_for(cond, proc, timeout):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_sigterm_is_handled_like_sigint(tmp_path):
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 143
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGTERM)"), err
    m = manifest(out)
    assert m["status"] == "interrupted" and m["error"] == "SIGTERM" and m["files"] == ["first.csv"]


@pytest.mark.slow
def test_sigint_in_the_middle_of_a_real_demo_run(tmp_path):
    """``moetool demo --steps inspect,stats``: SIGINT once the first sub-run is complete (stats is running)."""
    out = tmp_path / "demo"
    p = subprocess.Popen([sys.executable, "-m", "moetool", "demo", "--steps", "inspect,stats", "--out", str(out),
                          "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_default)
    first = out / "inspect" / "manifest.json"
    _wait_for(lambda: first.exists() and json.loads(first.read_text())["status"] == "complete", p, 120)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)") and str(out) in lines[0], err
    m = manifest(out)
    assert m["status"] == "interrupted" and m["runs"][0] == "inspect"
    assert manifest(out / "inspect")["status"] == "complete"  # the finished step is kept
    for sub in out.iterdir():  # a started stats sub-run says so too; no half-written file anywhere
        if sub.is_dir() and (sub / "manifest.json").exists() and sub.name != "inspect":
            assert manifest(sub)["status"] == "interrupted"
    assert not list(out.rglob(".part-*"))


# ----- #21 item 7: --force removes only what the earlier run listed, checked before anything is removed ----------
def _complete_run_with_a_figure(out):
    old = RunDir.create("stats", out)
    old.write_csv("load.csv", DF)
    with old.atomic("figures/load.png") as tmp:
        tmp.write_bytes(b"png")
    old.finish(options={})
    return old


def test_force_keeps_a_users_own_file_in_the_earlier_runs_figures(tmp_path):
    out = tmp_path / "r"
    _complete_run_with_a_figure(out)
    (out / "figures" / "mine.png").write_bytes(b"my own figure")
    new = RunDir.create("ppl", out, force=True)
    new.write_csv("ppl.csv", DF)
    new.finish(options={})
    assert (out / "figures" / "mine.png").read_bytes() == b"my own figure"
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["mine.png"]  # the listed figure went
    assert sorted(p.name for p in out.iterdir()) == ["figures", "manifest.json", "ppl.csv"]
    # without a file of the user's, the figures/ folder the run's files sat in goes with them
    _complete_run_with_a_figure(tmp_path / "s")
    newer = RunDir.create("erc", tmp_path / "s", force=True)
    newer.write_csv("erc.csv", DF)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [rd.LOCK, "erc.csv", "manifest.json"]


@pytest.mark.parametrize("linked", ["figures", "units"])
def test_force_refuses_a_linked_folder_before_removing_anything(tmp_path, linked):
    out, elsewhere = tmp_path / "r", tmp_path / "elsewhere"
    _complete_run_with_a_figure(out)
    elsewhere.mkdir()
    (elsewhere / "precious.png").write_bytes(b"x")
    if (out / linked).exists():
        import shutil

        shutil.rmtree(out / linked)
    (out / linked).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(MoetoolError, match=f"--force: .*{linked} is a link .*nothing removed") as e:
        run = RunDir.create("ppl", out, force=True)
        run.write_csv("ppl.csv", DF)  # the original code failed here, the old manifest already deleted
    assert len(str(e.value).splitlines()) == 1
    assert manifest(out)["command"] == "stats" and (out / "load.csv").is_file()  # nothing removed
    assert (elsewhere / "precious.png").is_file()


@pytest.mark.parametrize("listed", ["../outside.csv", "/tmp/../{tmp}/outside.csv", "sub/../../outside.csv"])
def test_force_refuses_a_manifest_listing_paths_outside_the_run(tmp_path, listed):
    out = tmp_path / "r"
    _complete_run_with_a_figure(out)
    (tmp_path / "outside.csv").write_text("not moetool's")
    m = manifest(out)
    m["files"].append(listed.format(tmp=tmp_path))
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MoetoolError, match="outside the run folder or through a link: nothing removed"):
        run = RunDir.create("ppl", out, force=True)
        run.write_csv("ppl.csv", DF)
    assert (out / "load.csv").is_file() and (out / "figures" / "load.png").is_file()
    assert (tmp_path / "outside.csv").read_text() == "not moetool's"



def test_force_refuses_a_listed_path_through_a_link_to_another_folder_of_the_run(tmp_path):
    """A manifest listing ``via/precious.csv`` where ``via`` links to the user's own folder ``mine`` in the run
    folder: the resolved path lies inside the run, but it is reached through a link, so nothing is removed (pass 17:
    dropping the lexical-vs-resolved comparison removed ``mine/precious.csv`` and passed test_rundir)."""
    out = tmp_path / "r"
    _complete_run_with_a_figure(out)
    (out / "mine").mkdir()
    (out / "mine" / "precious.csv").write_text("the user's")
    (out / "via").symlink_to(out / "mine", target_is_directory=True)
    m = manifest(out)
    m["files"].append("via/precious.csv")
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MoetoolError, match="lists file 'via/precious.csv', outside the run folder or through a "
                                           "link: nothing removed"):
        run = RunDir.create("ppl", out, force=True)
        run.write_csv("ppl.csv", DF)
    assert (out / "mine" / "precious.csv").read_text() == "the user's" and (out / "load.csv").is_file()


def test_force_removes_the_folders_a_nested_listed_file_leaves_empty_deepest_first(tmp_path):
    """A run listing ``figures/deep/er/x.png``: --force removes the file, then ``er``, ``deep`` and ``figures`` as each
    is left empty (deepest first; shallowest first left all three, pass 17), and keeps a folder holding a user's file."""
    out = tmp_path / "r"
    old = RunDir.create("stats", out)
    old.write_csv("load.csv", DF)
    for name in ("figures/deep/er/x.png", "keep/in/y.png"):
        with old.atomic(name) as tmp:
            tmp.write_bytes(b"png")
    old.finish(options={})
    (out / "keep" / "mine.txt").write_text("the user's")
    run = RunDir.create("ppl", out, force=True)
    run.write_csv("ppl.csv", DF)
    assert not (out / "figures").exists() and not (out / "keep" / "in").exists()
    assert sorted(p.name for p in (out / "keep").iterdir()) == ["mine.txt"]

# ----- #21 item 6: one run at a time in a folder (an advisory lock held for the run) ---------------------------
def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "r"
    first, second = RunDir.create("stats", out), RunDir.create("ppl", out)  # both validated: nothing there yet
    first.write_csv("load.csv", DF)
    with pytest.raises(MoetoolError, match=f"--out {out} is in use by another moetool run \\(pid {os.getpid()}\\)"):
        second.write_csv("ppl.csv", DF)
    with pytest.raises(MoetoolError, match="in use by another moetool run"):  # --force too, before anything
        RunDir.create("ppl", out, force=True)
    assert manifest(out)["command"] == "stats" and sorted(p.name for p in out.iterdir()) == [
        rd.LOCK, "load.csv", "manifest.json"]
    first.finish(options={})
    assert not (out / rd.LOCK).exists()  # released and removed when the run ends
    again = RunDir.create("ppl", out, force=True)  # the folder is free again
    again.write_csv("ppl.csv", DF)
    again.mark("failed", "x")
    assert not (out / rd.LOCK).exists()



def test_a_folder_filled_between_validation_and_the_first_write_is_not_written_into(tmp_path):
    """``RunDir.create`` validates an empty ``--out``; when another run (finished before this one's first write, so no
    lock to meet) filled it in between, the first write refuses in one line, writes nothing and removes nothing
    (pass 17: skipping that second look wrote ppl.csv and a manifest over the other run's; test_rundir passed)."""
    from moetool.errors import MoetoolRuntimeError

    out = tmp_path / "r"
    run = RunDir.create("ppl", out)
    other = RunDir.create("stats", out)
    other.write_csv("load.csv", DF)
    other.finish(options={})
    before = manifest(out)
    with pytest.raises(MoetoolRuntimeError, match=rf"^--out {re.escape(str(out))} was filled by another run while this "
                                                  r"one ran: nothing written \(choose another --out\)$"):
        run.write_csv("ppl.csv", DF)
    assert sorted(p.name for p in out.iterdir()) == ["load.csv", "manifest.json"] and manifest(out) == before

LOCK_HOLDER = textwrap.dedent("""
    import sys, time
    import pandas as pd
    from moetool.report import RunDir

    run = RunDir.create("stats", sys.argv[1])
    run.write_csv("load.csv", pd.DataFrame({"a": [1]}))
    print("ready", flush=True)
    time.sleep(60)
""")


STATS = ["stats", "--max-tokens", "64", "--seq-len", "32", "--batch-size", "2", "--bootstrap", "0", "--quiet"]


def test_a_run_in_another_process_holds_the_folder(tmp_path):
    from moetool.commands.app import app

    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        r = CliRunner().invoke(app, STATS + ["--out", str(out), "--force"])
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert f"--out {out} is in use by another moetool run (pid {p.pid})" in lines[0]
        assert manifest(out)["status"] == "running" and (out / "load.csv").is_file()  # the first run untouched
    finally:
        p.kill()
        p.wait()
    run = RunDir.create("stats", out, force=True)  # its holder died: the folder is free (a stale lock file is fine)
    run.write_csv("layers.csv", DF)
    run.finish(options={})
    assert sorted(p.name for p in out.iterdir()) == ["layers.csv", "manifest.json"]


def test_runs_go_unlocked_where_there_is_no_fcntl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl -> ImportError, as on Windows
    run = RunDir.create("stats", tmp_path / "r")
    run.write_csv("load.csv", DF)
    assert not (tmp_path / "r" / rd.LOCK).exists()
    run.finish(options={})
    assert manifest(tmp_path / "r")["status"] == "complete"


@pytest.mark.parametrize("direct_url, git", [
    ({"url": "https://github.com/o/moetool.git", "vcs_info": {"vcs": "git", "commit_id": "ab" * 20}},
     {"commit": "ab" * 20, "dirty": False, "from": "pip direct_url.json"}),
    ({"url": "file:///src/moetool", "dir_info": {}}, None),
])
def test_an_installed_package_records_its_version_and_known_revision(tmp_path, monkeypatch, direct_url, git):
    """Outside a git checkout (pip install . / pip install git+URL) the manifest records the package version, where
    it was installed from and pip's recorded commit when there is one (it said only "git": null)."""
    import importlib.metadata as md

    class Dist:
        version = "9.8.7"

        def read_text(self, name):
            return json.dumps(direct_url) if name == "direct_url.json" else None

    monkeypatch.setattr(md, "distribution", lambda name: Dist())
    monkeypatch.setattr(rd, "__file__", str(tmp_path / "site-packages" / "moetool" / "report" / "rundir.py"))
    monkeypatch.setattr(rd, "_GIT", {})
    run = RunDir.create("stats", tmp_path / "r")
    run.write_csv("t.csv", DF)
    run.finish(options={})
    m = manifest(tmp_path / "r")
    assert m["git"] == git
    assert m["package"]["version"] == "9.8.7" and m["package"]["installed_from"] == direct_url["url"]
    assert m["package"]["editable"] is False


@pytest.mark.parametrize("force", [False, True])
def test_an_out_that_is_a_file_is_refused_before_anything_loads(tmp_path, monkeypatch, force):
    """``ppl --out afile`` was refused only after ~8 s of imports and loading; a non-empty folder in under a second.
    Now both before the model is even resolved: resolving, reading the config or loading raises here."""
    import importlib

    import moetool
    from moetool import loading
    from moetool.commands.app import app

    def never(*args, **kwargs):
        raise AssertionError("the model was touched before --out was checked")

    for mod, names in ((loading, ("resolve", "load_config", "load", "check_model")),
                       (importlib.import_module("moetool.run"), ("preflight", "check_run", "start_run"))):
        for name in names:
            monkeypatch.setattr(mod, name, never)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, says in ((afile, f"--out {afile} exists and is not a folder"),
                      (afile / "sub", f"--out {afile / 'sub'}: {afile} is a file, not a folder")):
        r = CliRunner().invoke(app, ["ppl", "--out", str(out), *(["--force"] if force else [])])
        assert r.exit_code == 2 and r.output.strip() == f"error: {says}", r.output
        with pytest.raises(MoetoolError) as e:
            moetool.run("ppl", "tiny", out=out, force=force)
        assert str(e.value) == says
    assert afile.read_text() == "mine"


def test_a_name_too_long_for_the_file_system_is_a_usage_line(tmp_path, monkeypatch):
    """``--out`` (or ``--data``) with a part of 300 bytes: ``Path.exists()`` raised ENAMETOOLONG, shown as
    "error: OSError: [Errno 36] ..." with exit 1 (a runtime failure). Now one usage line (exit 2) before anything
    loads, nothing written."""
    from moetool.commands.app import app
    from moetool.data import DocumentStream
    from moetool import loading

    monkeypatch.setattr(loading, "resolve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    long = tmp_path / ("a" * 300)
    r = CliRunner().invoke(app, ["ppl", "--out", str(long)])
    assert r.exit_code == 2 and r.output.startswith("error: --out ") and "File name too long (a shorter folder " \
        "name)" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    with pytest.raises(MoetoolError, match=r"File name too long \(a shorter folder name\)$"):
        RunDir.create("ppl", long / "sub")
    with pytest.raises(MoetoolError, match=r"^--data .*\.\.\.: File name too long$"):
        DocumentStream(long / "x.txt")
    assert list(tmp_path.iterdir()) == []


# ----- each table's rows, bytes and sha256 in the manifest: a copy that lost rows is told from the run's -----------
# tables only (no_figures): stats' and erc's figures are tests/test_stats.py's, test_erc.py's and test_help_files.py's
@pytest.mark.slow
def test_the_manifest_records_every_tables_rows_bytes_and_sha256(tmp_path, no_figures):
    """The manifest's ``tables`` equal the files read back (rows as pandas reads them, size, sha256) for every
    table of stats (CSVs and its --all-tokens Parquet), of demo's erc step (a sub-run per model) and of the demo's
    report (its copies of the tables). tiny: 4 MoE layers of 8 experts; tiny-fine: 4 of 32."""
    from conftest import recorded_tables
    from moetool.commands.app import app

    r = CliRunner().invoke(app, ["stats", "--max-tokens", "256", "--seq-len", "32", "--bootstrap", "0",
                                 "--all-tokens", "-q", "--device", "cpu", "--out", str(tmp_path / "stats")])
    assert r.exit_code == 0, r.output
    rows = recorded_tables(tmp_path / "stats")
    assert rows["load.csv"] == 4 * 8 and rows["layers.csv"] == 4 and "expert_tokens.parquet" in rows
    assert len(rows) == 11 and all(n > 0 for n in rows.values())

    r = CliRunner().invoke(app, ["demo", "--steps", "erc", "--out", str(tmp_path / "demo"), "--quiet"])
    assert r.exit_code == 0, r.output
    for model, n in (("tiny", 8), ("tiny-fine", 32)):
        rows = recorded_tables(tmp_path / "demo" / "erc" / model)
        assert rows["erc_matrix.csv"] == 4 * n * n and rows["erc_layers.csv"] == 4, rows
    assert recorded_tables(tmp_path / "demo" / "erc") == {} and recorded_tables(tmp_path / "demo") == {}
    copies = recorded_tables(tmp_path / "demo" / "report")
    assert len(copies) == 6 and [copies[f"tables/demo-erc-{m}/erc_matrix.csv"] for m in ("tiny", "tiny-fine")] == \
        [256, 4096]


def test_a_resumed_run_records_the_tables_it_writes_not_the_previous_ones(tmp_path):
    """``--resume`` rewrites the run's tables: the manifest holds the new rows, bytes and sha256, never the
    interrupted run's record (here a stale one for load.csv and one for a table the resumed run does not write)."""
    from conftest import recorded_tables

    out = tmp_path / "r"
    first = RunDir.create("stats", out)
    first.write_csv("load.csv", pd.DataFrame({"x": range(3)}))
    first.write_csv("gone.csv", DF)
    first.mark("interrupted")
    assert {f: t["rows"] for f, t in manifest(out)["tables"].items()} == {"load.csv": 3, "gone.csv": 2}
    resumed = RunDir.create("stats", out, resume=True)
    assert resumed.resuming is not None
    resumed.write_csv("load.csv", pd.DataFrame({"x": range(5)}))
    resumed.finish(options={})
    assert recorded_tables(out) == {"load.csv": 5} and not (out / "gone.csv").exists()


def test_a_table_written_again_as_a_plain_file_loses_its_record(tmp_path):
    """The manifest never keeps the counts of a file that is no longer the table they describe."""
    run = RunDir.create("stats", tmp_path / "r")
    run.write_csv("t.csv", DF)
    assert manifest(tmp_path / "r")["tables"]["t.csv"]["rows"] == 2
    with run.atomic("t.csv") as tmp:
        tmp.write_text("a\n1\n2\n3\n")
    run.finish(options={})
    m = manifest(tmp_path / "r")
    assert m["files"] == ["t.csv"] and m["tables"] == {}


def test_null_run_drops_an_atomic_write(tmp_path):
    """A rank other than 0 under torchrun writes through a NullRun: ``with run.atomic(name) as tmp:`` (placement's
    --export file) got ``None`` from its catch-all and raised TypeError (no context manager), failing the torchrun
    run on rank 1. The body now writes into a temporary folder that is removed; nothing appears under --out."""
    from moetool.report.rundir import NullRun

    run = NullRun("placement", tmp_path / "out")
    with run.atomic("eplb_placement.json") as tmp:
        tmp.write_text("{}")
        written = tmp
    assert not written.exists() and not (tmp_path / "out").exists()


def test_a_csv_gz_table_is_the_same_file_from_any_run(tmp_path, monkeypatch):
    """moetool.run("trace", lm, tokens) writes trace.csv.gz with write_csv: two runs of the same rows (a resumed one,
    a rerun) had other bytes and manifest sha256s, gzip's header holding the clock and the temporary
    .part-<pid>- name. Now the same rows give the same file (and the text pandas writes)."""
    import gzip

    df = pd.DataFrame({"token": ["a", "b,c", "null"], "x": [1.5, float("nan"), 3.0]})
    files = []
    for i, out in enumerate(("a", "b")):
        monkeypatch.setattr(time, "time", lambda i=i: 1_700_000_000.0 + 1000 * i)
        run = RunDir.create("trace", tmp_path / out)
        files.append(run.write_csv("trace.csv.gz", df))
        run.finish(options={})
    a, b = (f.read_bytes() for f in files)
    assert a == b and a[3] & 0x08 == 0 and a[4:8] == bytes(4)  # no FNAME flag, MTIME 0
    assert gzip.decompress(a).decode() == df.to_csv(index=False)
    m = [json.loads((tmp_path / out / "manifest.json").read_text())["tables"]["trace.csv.gz"] for out in "ab"]
    assert m[0] == m[1] and m[0]["rows"] == 3


def test_a_csv_table_keeps_every_float_to_the_last_bit(tmp_path):
    """write_csv writes floats at full precision (plain and gzip): 1/3, 0.1 + 0.2, 1e-17 and a 17-digit count read
    back bit for bit (a %.6g format would turn 1/3 into 0.333333 in every table)."""
    vals = [1 / 3, 0.1 + 0.2, 1e-17, 12345678.901234567, -2.5e300]
    run = RunDir.create("stats", tmp_path / "run")
    df = pd.DataFrame({"layer": range(len(vals)), "value": vals})
    for name in ("t.csv", "t.csv.gz"):
        run.write_csv(name, df)
        assert pd.read_csv(tmp_path / "run" / name)["value"].tolist() == vals
