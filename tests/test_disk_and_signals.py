"""#21.10: the machine's failures are one line with the right exit code -- a full disk (ENOSPC, EFBIG) anywhere is
exit 1 naming the file and leaves no empty run folder or ``units/`` behind; a bad MOETOOL_*_TIMEOUT is a usage
error (exit 2) before anything runs; a burst of Ctrl-C ends the run with one line and exit 130, no traceback."""

import errno
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
from typer.testing import CliRunner

from conftest import ctrl_c_default
from moetool.commands.app import app
from moetool.errors import MoetoolRuntimeError
from moetool.report import RunDir
from moetool.report import rundir as rd
from moetool.sketch import TokenSpill

runner = CliRunner()
FULL = {"ENOSPC": "No space left on device", "EFBIG": "File too large"}


def _one_line_error(r, code):
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == code, r.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output
    return lines[0]


# ----- a full disk ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", sorted(FULL))
def test_a_full_disk_writing_a_table_is_exit_1_naming_the_file(tmp_path, monkeypatch, code):
    """The CSV writer fails as a full disk makes it fail: one line naming ppl.csv, exit 1 (it was 2, a usage
    error), the run marked failed, no half file."""
    def full(self, path, *args, **kwargs):
        raise OSError(getattr(errno, code), FULL[code], str(path))

    monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    out = tmp_path / "run"
    r = runner.invoke(app, ["ppl", "--max-tokens", "64", "--seq-len", "32", "--bootstrap", "0", "--out", str(out),
                            "-q"])
    line = _one_line_error(r, 1)
    assert f"cannot write {out / 'ppl.csv'}: {FULL[code]}: free space or write elsewhere" in line, line
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"
    assert not list(out.rglob(".part-*"))


def test_a_full_disk_at_the_first_checkpoint_leaves_no_units_folder(tmp_path, monkeypatch):
    """stats saves its first unit into units/ and the disk is full: units/ held nothing a resume could use and
    is removed; the line names the checkpoint file (it was 'OSError: [Errno 28] No space left on device')."""
    import torch

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, FULL["ENOSPC"])  # as a write through a file handle: no file name

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    r = runner.invoke(app, ["stats", "--max-tokens", "128", "--seq-len", "32", "--bootstrap", "0", "--out",
                            str(out), "-q"])
    line = _one_line_error(r, 1)
    assert f"cannot write {out / 'units'}{os.sep}" in line and ".unit: No space left on device" in line, line
    assert not (out / "units").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"


def test_a_run_folder_that_could_not_take_its_first_manifest_is_removed(tmp_path, monkeypatch):
    real = rd.atomic_path

    def full(p):
        if Path(p).name == rd.MANIFEST:
            raise OSError(errno.ENOSPC, FULL["ENOSPC"])
        return real(p)

    monkeypatch.setattr(rd, "atomic_path", full)
    run = RunDir.create("fake", tmp_path / "run")
    with pytest.raises(MoetoolRuntimeError, match=f"cannot write {tmp_path / 'run' / 'manifest.json'}: No space") \
            as e:
        run.write_csv("a.csv", pd.DataFrame({"a": [1]}))
    assert e.value.exit_code == 1
    assert not (tmp_path / "run").exists()
    run.mark("failed", "disk full")  # the CLI's error path: nothing to mark, nothing made


def test_a_full_tmpdir_names_the_spill_file(tmp_path):
    """A write through an open file (TokenSpill, in TMPDIR by default) fails without a file name: the line names
    the spill file."""
    import torch

    class FullDisk:
        closed = False

        def write(self, data):
            raise OSError(errno.ENOSPC, FULL["ENOSPC"])

        def close(self):
            pass

    with TokenSpill(tmp_path) as spill:
        spill._fh.close()
        spill._fh = FullDisk()
        with pytest.raises(MoetoolRuntimeError, match="cannot write .*spill.bin: No space left on device") as e:
            spill.append(torch.arange(4))
        assert str(spill.path) in str(e.value)


def test_an_oserror_of_a_full_disk_from_anywhere_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    """A library's own write (no moetool code around it) still gives one line and exit 1 -- in a command, naming
    the file, and before one (the console script), naming TMPDIR when the error names no file."""
    import moetool.commands.app as app_module
    import moetool.loading

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, FULL["ENOSPC"], "/tmp/some-library-cache/x.bin")

    monkeypatch.setattr(moetool.loading, "load_config", full)
    r = runner.invoke(app, ["inspect", "--model", "tiny"])
    assert "cannot write /tmp/some-library-cache/x.bin: No space left on device" in _one_line_error(r, 1)

    def boom(**kwargs):
        raise OSError(errno.ENOSPC, FULL["ENOSPC"])

    monkeypatch.setattr(app_module, "app", boom)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    monkeypatch.delenv("MOETOOL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        app_module.main()
    assert e.value.code == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"temporary files go to {tmp_path}" in err[0] and "No space left" in err[0], err


# ----- timeouts from the environment -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["MOETOOL_HUB_TIMEOUT", "MOETOOL_DIST_TIMEOUT"])
@pytest.mark.parametrize("value", ["-1", "inf", "nan", "0", "1e400"])
def test_timeouts_must_be_positive_finite_seconds(name, value, monkeypatch):
    """-1 / inf / nan were taken (an OverflowError, C++ stack frames from torch): a usage error naming the
    variable, exit 2, before the command runs."""
    monkeypatch.setenv(name, value)
    r = runner.invoke(app, ["inspect", "--aliases"])
    line = _one_line_error(r, 2)
    assert line.startswith(f"error: {name} must be a number of seconds greater than 0") and f"'{value}'" in line


def test_timeouts_from_the_console_script_and_good_values(monkeypatch):
    from moetool.errors import env_seconds

    env = {**os.environ, "MOETOOL_DIST_TIMEOUT": "inf"}
    r = subprocess.run([sys.executable, "-m", "moetool", "inspect", "--aliases"], capture_output=True, text=True,
                       env=env, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == [
        "error: MOETOOL_DIST_TIMEOUT must be a number of seconds greater than 0 and at most 1e+09, not 'inf'"], r.stderr
    for value, want in (("2.5", 2.5), (" 60 ", 60.0), ("", 1.5)):
        monkeypatch.setenv("MOETOOL_HUB_TIMEOUT", value)
        assert env_seconds("MOETOOL_HUB_TIMEOUT", 1.5) == want


# ----- Ctrl-C, many times ----------------------------------------------------------------------------------------
RUNNING = textwrap.dedent("""
    import pathlib, sys, time
    import moetool.engine.runner as runner
    mark, out = sys.argv[1:3]

    def forever(*args, **kwargs):  # the forward loop of a long run (the model and the data are loaded)
        pathlib.Path(mark).write_text("running")
        while True:
            time.sleep(0.001)

    runner.check_token_ids = forever
    from moetool.commands.app import main
    sys.argv = ["moetool", "ppl", "--max-tokens", "256", "--bootstrap", "0", "-q", "--out", out]
    main()
""")


def test_eight_quick_ctrl_c_exit_130_with_one_line(tmp_path):
    """Eight SIGINTs 10 ms apart in the middle of a run: the first stops it; the others used to hit torch's exit
    handlers (two 'Exception ignored in atexit callback' tracebacks) and end the process by the signal."""
    mark = tmp_path / "mark"
    p = subprocess.Popen([sys.executable, "-c", RUNNING, str(mark), str(tmp_path / "out")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=ctrl_c_default)  # a suite started in the background ignores SIGINT
    t0 = time.time()
    while not mark.exists():
        assert p.poll() is None, p.communicate()
        assert time.time() - t0 < 120, "the run did not start"
        time.sleep(0.02)
    for _ in range(8):
        p.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _, err = p.communicate(timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130 and lines == ["interrupted (Ctrl-C)"], (p.returncode, err[-3000:])
