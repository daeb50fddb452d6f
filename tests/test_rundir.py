"""Runs that fail safely: --out validated before work, folder made at the first write, atomic files, manifest
status running/complete/failed/interrupted (SIGINT in a real run, SIGTERM like SIGINT), --force clears stale
results, default names never collide."""

import json
import os
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

from moetool.errors import MoetoolError
from moetool.loading import embedded_models
from moetool.report import RunDir
from moetool.report import rundir as rd

needs_tiny = pytest.mark.skipif("tiny" not in embedded_models(), reason="embedded model not built")
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
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["manifest.json"]
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


def _fake_command(tmp_path, fail_with):
    from moetool.commands.options import handle_errors

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
    from moetool.commands.options import handle_errors
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


@needs_tiny
def test_sigint_in_the_middle_of_a_real_demo_run(tmp_path):
    """``moetool demo --steps inspect,stats``: SIGINT once the first sub-run is complete (stats is running)."""
    out = tmp_path / "demo"
    p = subprocess.Popen([sys.executable, "-m", "moetool", "demo", "--steps", "inspect,stats", "--out", str(out),
                          "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
