"""--resume (#14): an interrupted run continues from its last finished unit and gives the same files as an
uninterrupted run; other options are refused in one line; the unit checkpoints go once the run is complete."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from conftest import recorded_tables
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.loading import embedded_models
from moetool.report import rundir

runner = CliRunner()
TIMING = {"seconds"}  # wall time differs between any two runs


def _same_csvs(a: Path, b: Path) -> list[str]:
    names = sorted(p.name for p in a.glob("*.csv"))
    assert names and names == sorted(p.name for p in b.glob("*.csv"))
    for n in names:
        x, y = pd.read_csv(a / n), pd.read_csv(b / n)
        keep = [c for c in x.columns if c not in TIMING]
        pd.testing.assert_frame_equal(x[keep], y[keep], check_exact=True)
    return names


def _interrupt_after_saves(monkeypatch, n):
    """Ctrl-C right after the ``n``-th unit save: the process dies between two units (stats/trace checkpoint
    after every batch here)."""
    save = rundir.Units.save
    saved = []

    def save_then_maybe_interrupt(self, name, obj, refs=()):
        save(self, name, obj, refs)
        saved.append(name)
        if len(saved) == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(rundir.Units, "every_seconds", 0.0)
    monkeypatch.setattr(rundir.Units, "save", save_then_maybe_interrupt)
    return saved


def _count_units_run(monkeypatch):
    save = rundir.Units.save
    ran = []

    def counting(self, name, obj, refs=()):
        ran.append(name)
        save(self, name, obj, refs)

    monkeypatch.setattr(rundir.Units, "save", counting)
    return ran


def _whole_then_interrupted(tmp_path, monkeypatch, args, n):
    """``args`` run whole into ``whole/``, then into ``part/`` interrupted right after the ``n``-th unit save
    (exit 130, manifest "interrupted", no table written); returns (whole, part, units saved)."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    r = runner.invoke(app, [*args, "--out", str(whole)])
    assert r.exit_code == 0, r.output
    assert not (whole / "units").exists()  # a complete run keeps no checkpoints
    with monkeypatch.context() as m:
        saved = _interrupt_after_saves(m, n)
        r = runner.invoke(app, [*args, "--out", str(part)])
    assert r.exit_code == 130, r.output
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"
    assert not list(part.glob("*.csv")) and not list(part.rglob(".part-*"))  # nothing half-written
    return whole, part, saved


def _resumed(args, part):
    """``--resume`` of ``part``: complete, its checkpoints gone, and every table it wrote recorded in its manifest
    as on disk (moetool trace's streamed file too)."""
    r = runner.invoke(app, [*args, "--out", str(part), "--resume"])
    assert r.exit_code == 0, r.output
    man = json.loads((part / "manifest.json").read_text())
    assert man["status"] == "complete" and man["resumed"]["previous_status"] == "interrupted"
    assert not (part / "units").exists()
    recorded_tables(part)
    return man


@pytest.mark.slow
def test_norm_select_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, no_figures):
    args = ["norm-select", "--nodes", "gate,output", "--max-tokens", "400", "--seq-len", "32", "--batch-size", "4",
            "--bootstrap", "100", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 1)
    assert saved == ["router"] and (part / "units" / "router.unit").is_file()

    # without --resume the unfinished run is not overwritten by accident
    r = runner.invoke(app, [*args, "--out", str(part)])
    assert r.exit_code == 2 and "--resume" in r.output
    # other options: refused in one line, the unfinished run left as it was
    r = runner.invoke(app, [*args[:-3], "--bootstrap", "101", "--quiet", "--out", str(part), "--resume"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "other options (bootstrap: 100 -> 101)" in lines[0], r.output
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"

    with monkeypatch.context() as m:
        ran = _count_units_run(m)
        _resumed(args, part)
    assert ran == ["norm:gate:l2", "norm:output:l2"]  # the router was not run again
    assert _same_csvs(whole, part) == ["agreement.csv", "quality.csv"]
    # a complete run has nothing to resume
    r = runner.invoke(app, [*args, "--out", str(part), "--resume"])
    assert r.exit_code == 2 and "nothing to resume" in r.output


def test_resume_needs_out_and_a_run_of_the_same_command(tmp_path):
    from moetool.errors import MoetoolError

    with pytest.raises(MoetoolError, match="--resume needs --out"):
        rundir.RunDir.create("stats", None, resume=True)
    fresh = rundir.RunDir.create("stats", tmp_path / "new", resume=True)  # nothing there: a new run
    assert fresh.resuming is None
    other = rundir.RunDir.create("ppl", tmp_path / "ppl")
    other.write_json("x.json", {})
    other.mark("interrupted")
    with pytest.raises(MoetoolError, match="holds a ppl run, not stats"):
        rundir.RunDir.create("stats", tmp_path / "ppl", resume=True)


def _batches_run(monkeypatch):
    """Batch numbers the resumed forward runs (from the NaN guard's per-batch check)."""
    from moetool.engine import guard

    check = guard.FiniteGuard.check
    ran = []

    def counting(self, batch, rows=""):
        ran.append(batch)
        return check(self, batch, rows)

    monkeypatch.setattr(guard.FiniteGuard, "check", counting)
    return ran


@pytest.mark.slow
def test_stats_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, no_figures):
    # 12 rows of 32 tokens in batches of 2: 6 batches; interrupted after the 3rd batch's checkpoint. Tables only
    # (no_figures): stats' figures are tests/test_stats.py's and tests/test_help_files.py's to check
    args = ["stats", "--max-tokens", "384", "--seq-len", "32", "--batch-size", "2", "--bootstrap", "100",
            "--min-count", "2", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 3)
    assert saved == ["batches"] * 3 and (part / "units" / "batches.unit").is_file()

    r = runner.invoke(app, [*args[:-3], "--min-count", "3", "--quiet", "--out", str(part), "--resume"])
    assert r.exit_code == 2 and "other options (min_count: 2 -> 3)" in r.output, r.output

    with monkeypatch.context() as m:
        ran = _batches_run(m)
        _resumed(args, part)
    assert ran == [3, 4, 5]  # batches 0-2 were restored, not run again
    names = _same_csvs(whole, part)
    assert {"load.csv", "layers.csv", "coactivation.csv", "top_tokens.csv", "specialization.csv"} <= set(names)
    rows = recorded_tables(part)
    assert rows == recorded_tables(whole) and rows["load.csv"] == 4 * 8 and rows["layers.csv"] == 4


def test_resume_refused_under_torchrun(monkeypatch):
    from moetool.run import check_resume
    from moetool.errors import MoetoolError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert check_resume(False) is False  # no unit checkpoints: a rank's partial state is not the run's
    with pytest.raises(MoetoolError, match="not supported under torchrun \\(world size 2\\)"):
        check_resume(True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert check_resume(True) is True


@pytest.mark.slow
def test_fluctuation_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, no_figures):
    from moetool.experiments.fluctuation import compute as fl

    # order of work (--reference previous): tiny (checkpoint 1) first, then tiny-early fed to tiny's routers too
    args = ["fluctuation", "tiny-early", "tiny", "--routing", "router,similarity", "--isolate", "--max-tokens", "256",
            "--seq-len", "32", "--batch-size", "4", "--bootstrap", "100", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 1)
    assert saved == ["checkpoint-1"]
    assert sorted(p.name for p in (part / "units").iterdir()) == [
        "checkpoint-1-0.spill", "checkpoint-1-1.spill", "checkpoint-1.unit", "inputs.json", "key.json"]

    with monkeypatch.context() as m:
        captured = []
        capture = fl.capture

        def counting(lm, tokens, policy, **kw):
            captured.append((kw["description"], sorted(kw.get("others") or {})))
            return capture(lm, tokens, policy, **kw)

        m.setattr(fl, "capture", counting)
        _resumed(args, part)
    # only tiny-early ran (tiny was read back; its routers were reloaded for the isolated rows)
    assert captured == [("tiny-early: router", [1]), ("tiny-early: similarity", [1])]
    assert _same_csvs(whole, part) == ["fluctuation.csv", "fluctuation_summary.csv"]


@pytest.mark.slow
def test_fluctuation_resumed_from_every_checkpoint_reads_the_isolated_routing_back(tmp_path, monkeypatch, no_figures):
    """Interrupted after both checkpoints' units: the resume runs no checkpoint (nothing captured) and its tables
    equal the uninterrupted run's. tiny-early (checkpoint 0, the reference) saved its own routing and the routing
    it fed to tiny's routers (--isolate): read back under (reference 0, checkpoint 1), not (1, 0), which no table
    would find (the 1-unit test above restores tiny only, whose unit holds no isolated routing)."""
    from moetool.experiments.fluctuation import compute as fl

    args = ["fluctuation", "tiny-early", "tiny", "--routing", "router", "--isolate", "--max-tokens", "256",
            "--seq-len", "32", "--batch-size", "4", "--bootstrap", "100", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 2)
    assert saved == ["checkpoint-1", "checkpoint-0"]
    with monkeypatch.context() as m:
        captured = []
        m.setattr(fl, "capture", lambda *a, **kw: captured.append(kw["description"]))
        _resumed(args, part)
    assert captured == []
    assert _same_csvs(whole, part) == ["fluctuation.csv", "fluctuation_summary.csv"]
    iso = pd.read_csv(part / "fluctuation.csv").query("routing == 'router-isolated'")
    assert len(iso) > 0 and set(iso.reference) == {"tiny-early"} and set(iso.checkpoint) == {"tiny"}


@pytest.mark.parametrize("fmt", ["csv.gz", "parquet"])
@pytest.mark.slow
def test_trace_resume_gives_the_same_file_row_for_row(tmp_path, monkeypatch, fmt):
    # 8 rows of 32 tokens in batches of 2: 4 batches; interrupted after the 2nd batch's checkpoint
    args = ["trace", "--max-tokens", "256", "--seq-len", "32", "--batch-size", "2", "--logits", "--format", fmt,
            "--quiet"]
    read = pd.read_parquet if fmt == "parquet" else pd.read_csv
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 2)
    assert saved == ["batches"] * 2 and not (part / f"trace.{fmt}").exists()
    assert sorted(p.name for p in (part / "units").glob("trace-*")) == ["trace-00000.parquet", "trace-00001.parquet"]

    with monkeypatch.context() as m:
        ran = _batches_run(m)
        m.setattr(rundir.Units, "every_seconds", 0.0)
        _resumed(args, part)
    assert ran == [2, 3]
    a, b = read(whole / f"trace.{fmt}"), read(part / f"trace.{fmt}")
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert sorted(set(a["row"])) == list(range(8)) and a["layer"].value_counts().nunique() == 1
    batch = (a["row"] // 2).to_numpy()
    assert (batch[1:] >= batch[:-1]).all()  # batches in order across the parts (layer-major within a batch)


@pytest.mark.parametrize("command", ["stats", "trace"])
@pytest.mark.slow
def test_checkpoints_fall_on_whole_batches_when_a_batch_is_backed_off(tmp_path, monkeypatch, command):
    """--batch-size auto after an out-of-memory runs each batch in parts (on_batch per part): a checkpoint is only
    taken at the end of a whole batch, numbered in batches of --batch-size (what --resume skips)."""
    import torch

    from moetool.data import load_tokens
    from moetool.experiments.stats import compute as stats
    from moetool.experiments.trace import compute as trace
    from moetool.loading import load

    lm = load("tiny")
    tokens = load_tokens(None, lm.tokenizer, 32, 384)  # 12 rows: 3 batches of 4
    from moetool.context import Backoff, RunState

    auto = RunState(backoff=Backoff(enabled=True))  # --batch-size auto's run, passed to the forwards by context
    forward = lm.model.forward

    def at_most_two_rows(*args, **kwargs):  # out of memory above 2 rows: every batch runs as two parts
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    lm.model.forward = at_most_two_rows
    run = rundir.RunDir.create(command, tmp_path / "r")
    units = run.units({"batch_size": 4})
    monkeypatch.setattr(rundir.Units, "every_seconds", 0.0)
    saved, save = [], rundir.Units.save

    def recording(self, name, obj, refs=()):
        saved.append(obj["next_batch"])
        save(self, name, obj, refs)

    monkeypatch.setattr(rundir.Units, "save", recording)
    with auto.active():
        if command == "stats":
            stats.collect(lm, tokens, batch_size=4, units=units, quiet=True)
        else:
            trace.trace(lm, tokens, trace.TraceOptions(batch_size=4), path=tmp_path / "t.parquet", units=units,
                        quiet=True)
            assert len(pd.read_parquet(tmp_path / "t.parquet")) == 4 * tokens.n_tokens  # every row once (4 layers)
    assert auto.backoff.events == [4] and saved == [1, 2, 3]
    run.finish(options={})  # leaves no unfinished run in this process's registry


# ----- #21: a resume reads back only what this run wrote, from the same data and weights, and runs no code ------
STATS = ["stats", "--max-tokens", "256", "--seq-len", "32", "--batch-size", "2", "--bootstrap", "0", "--min-count", "2",
         "--quiet"]


def _interrupted(monkeypatch, args, out, n=1):
    with monkeypatch.context() as m:
        _interrupt_after_saves(m, n)
        r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 130, r.output


def _one_line_error(r, code):
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.slow
def test_resume_refuses_other_data_read_from_the_same_path(tmp_path, monkeypatch, no_figures):
    data = tmp_path / "data.txt"
    data.write_text("The old text about rivers and the sea, told again and again. " * 40)
    part = tmp_path / "part"
    _interrupted(monkeypatch, [*STATS, "--data", str(data)], part)
    data.write_text("A new text: numbers, prices and a shopping list for the week. " * 40)  # same path
    r = runner.invoke(app, [*STATS, "--data", str(data), "--out", str(part), "--resume"])
    line = _one_line_error(r, 2)
    assert "--resume: the data changed since" in line and "data.sha256" in line and "--force" in line
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"  # left as it was
    r = runner.invoke(app, [*STATS, "--data", str(data), "--out", str(part), "--force"])
    assert r.exit_code == 0, r.output


def test_resume_refuses_weights_changed_since_the_run_started(tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(embedded_models()["tiny"], model)
    part = tmp_path / "part"
    args = [*STATS, "--model", str(model)]
    _interrupted(monkeypatch, args, part)
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes())  # rewritten (a new conversion): same size, new time
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10**9))
    r = runner.invoke(app, [*args, "--out", str(part), "--resume"])
    line = _one_line_error(r, 2)
    assert "--resume: the model's weights changed since" in line and "model.safetensors" in line, line


class _Payload:
    """A pickle that runs a shell command when it is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("suffix", ["unit", "pkl"])
def test_resume_never_unpickles_a_tampered_checkpoint(tmp_path, monkeypatch, suffix):
    import pickle

    part, marker = tmp_path / "part", tmp_path / "pwned"
    _interrupted(monkeypatch, STATS, part)
    # the checkpoint replaced by a payload: under the unit's own name, or as a pickle an older moetool wrote
    (part / "units" / f"batches.{suffix}").write_bytes(pickle.dumps(_Payload(marker)))
    r = runner.invoke(app, [*STATS, "--out", str(part), "--resume"])
    assert not marker.exists(), "the checkpoint ran code"
    line = _one_line_error(r, 1)
    assert "unsafe" in line and "--force" in line and "batches" in line, line


def test_resume_with_a_missing_unit_part_says_the_checkpoint_is_damaged(tmp_path, monkeypatch):
    part = tmp_path / "part"
    args = ["trace", "--max-tokens", "256", "--seq-len", "32", "--batch-size", "2", "--format", "parquet", "--quiet"]
    _interrupted(monkeypatch, args, part, n=2)
    (part / "units" / "trace-00000.parquet").unlink()
    for _ in range(2):  # not "cannot write" (again and again): the damage is named, and how to start over
        r = runner.invoke(app, [*args, "--out", str(part), "--resume"])
        line = _one_line_error(r, 1)
        assert "is damaged" in line and "trace-00000.parquet is missing" in line and "--force" in line, line
    r = runner.invoke(app, [*args, "--out", str(part), "--force"])
    assert r.exit_code == 0, r.output
    assert len(pd.read_parquet(part / "trace.parquet")) > 0


def test_unit_checkpoints_round_trip_without_pickle_and_refuse_foreign_types(tmp_path):
    import numpy as np
    import torch

    from moetool.engine.runner import NLL, ForwardResult
    from moetool.errors import MoetoolError
    from moetool.experiments.eval.compute import EvalResult

    layer = torch.nn.Linear(2, 2)  # a live object a unit points to: stored by position, never copied
    shared = [1, 2]
    frame = pd.DataFrame({"task": ["a", "b"], "value": [0.5, float("nan")], "n": [1, 2]})
    obj = {("router",): (ForwardResult(NLL(1.5, 3), 0.25, 2, rows=None), {"x", "y"}),
           "eval": EvalResult(frame=frame, seconds=1.0, n_samples={"a": {"original": 2}}),
           "np": np.arange(6, dtype=np.int32).reshape(2, 3), "f": np.float64(0.1), "t": torch.arange(4),
           "same": (shared, shared), "slice": slice(1, None), "dev": torch.device("cpu"), "dtype": torch.int16,
           "layer": layer, 7: None}
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    units.save("u", obj, refs=[layer])
    with pytest.raises(MoetoolError, match="unit v: refusing to copy a Linear"):
        units.save("v", {"m": layer})
    with pytest.raises(MoetoolError, match="unit w: cannot checkpoint a pathlib"):
        units.save("w", tmp_path)
    run.mark("interrupted")
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    back = again.units({"a": 1}).load("u", refs=[layer])
    assert back["layer"] is layer and back[7] is None and back["dtype"] is torch.int16
    fr, tags = back[("router",)]
    assert isinstance(fr, ForwardResult) and fr.nll == NLL(1.5, 3) and fr.seconds == 0.25 and tags == {"x", "y"}
    pd.testing.assert_frame_equal(back["eval"].frame, frame)
    assert back["eval"].n_samples == {"a": {"original": 2}}
    assert back["np"].dtype == np.int32 and (back["np"] == obj["np"]).all() and type(back["f"]) is np.float64
    assert torch.equal(back["t"], obj["t"]) and back["same"][0] is back["same"][1] == [1, 2]
    assert back["slice"] == slice(1, None) and back["dev"] == torch.device("cpu")
    # a unit naming a type outside the checkpoint types is refused, not built
    torch.save({"format": rundir.UNIT_FORMAT, "files": {},
                "unit": {"__t": "obj", "c": "subprocess.Popen", "s": {"__t": "dict", "k": [], "v": []}}},
               tmp_path / "r" / "units" / "u.unit")
    with pytest.raises(MoetoolError, match="u.unit is damaged or unsafe .type 'subprocess.Popen' is not one"):
        again.units({"a": 1}).load("u")
    again.mark("interrupted")


@pytest.mark.parametrize("name", ["key.json", "inputs.json"])
@pytest.mark.parametrize("damage", ["missing", "not JSON", "a list"])
def test_resume_refuses_units_whose_options_or_inputs_record_is_damaged(tmp_path, name, damage):
    """Without units/key.json (the options) or units/inputs.json (the data's fingerprint) beside finished units,
    a resume with other options or data restored them unchecked (stats on another file printed the old data's
    token counts); unreadable as a JSON object, an AttributeError. Now: a damaged checkpoint, one line."""
    from moetool.errors import MoetoolRuntimeError

    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"top_k": 2})
    units.check_inputs(data={"rows": 8, "sha256": "a"})
    units.save("batches", {"n": 1})
    run.mark("interrupted")
    f = tmp_path / "r" / "units" / name
    if damage == "missing":
        f.unlink()
    else:
        f.write_text("{" if damage == "not JSON" else "[1]")
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    why = "missing" if damage == "missing" else "not readable as a JSON object"
    with pytest.raises(MoetoolRuntimeError, match=rf"units/{name} is damaged or unsafe \({why}\): start over"):
        # other options with key.json damaged, other data with inputs.json damaged: each caught by the one damaged
        again.units({"top_k": 1 if name == "key.json" else 2}).check_inputs(data={"rows": 1, "sha256": "b"})
    again.mark("interrupted")


def test_an_unfinished_run_is_offered_resume_only_by_a_command_that_has_it(tmp_path):
    """Issue 35 item 12: `demo` (no --resume) into the folder of an interrupted demo says to use --force, not
    "use --resume"; stats (which takes --resume) still offers it."""
    import typer.main

    commands = typer.main.get_command(app).commands
    assert "resume" not in {p.name for p in commands["demo"].params}  # what the message says is true
    assert "resume" in {p.name for p in commands["stats"].params}
    for command in ("demo", "stats"):
        d = rundir.RunDir.create(command, tmp_path / command)
        d.write_csv("part.csv", pd.DataFrame({"x": [1]}))  # the folder exists: mark() records the status
        d.mark("interrupted", "Ctrl-C")
        assert rundir.read_manifest(tmp_path / command)["status"] == "interrupted"
    r = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "--resume to" not in r.output and "moetool demo has no --resume: use --force to start over" in r.output
    r = runner.invoke(app, ["stats", "--max-tokens", "64", "--seq-len", "32", "--out", str(tmp_path / "stats")])
    assert r.exit_code == 2 and "use --resume to continue it or --force to start over" in r.output, r.output
    # stats (which has --resume) into the interrupted demo's folder: its --resume would refuse a demo run, and
    # "moetool stats has no --resume" (pass 17) was false
    r = runner.invoke(app, ["stats", "--max-tokens", "64", "--seq-len", "32", "--out", str(tmp_path / "demo")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.strip().endswith(
        "holds an unfinished demo run (status interrupted); moetool stats --resume continues only a stats run: use "
        "--force to start over, or another --out"), r.output



def test_an_in_memory_trace_refuses_resume_rather_than_start_again(tmp_path):
    """``moetool.run("trace", ..., resume=True)`` holds the trace in memory and keeps no checkpoints: a resume of an
    interrupted one was accepted and quietly started again, where the README said it continued. Refused in one line
    naming ``moetool trace --resume`` (which streams and continues); the run is not marked complete."""
    import moetool
    from moetool.errors import MoetoolError

    out = tmp_path / "tr"
    moetool.run("trace", "tiny", out=out, max_tokens=128, seq_len=32, quiet=True)
    m = json.loads((out / "manifest.json").read_text())
    m["status"] = "interrupted"  # as a Ctrl-C leaves it
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MoetoolError, match=r"a trace held in memory \(no path\) keeps no checkpoints.*moetool trace "
                                           r"--out RUN --resume"):
        moetool.run("trace", "tiny", out=out, max_tokens=128, seq_len=32, quiet=True, resume=True)
    assert json.loads((out / "manifest.json").read_text())["status"] != "complete"


def _free_memory_says(monkeypatch, rows):
    """``--batch-size auto`` chooses ``rows`` (as if the free memory held that many), by name and on a loaded model."""
    from moetool import sizing

    facts = {"rows": rows, "reason": "test", "device": "cpu", "free_bytes": None}
    monkeypatch.setattr(sizing, "auto_batch_size", lambda *a, **k: (rows, dict(facts)))
    monkeypatch.setattr(sizing, "auto_rows", lambda *a, **k: (rows, dict(facts)))


@pytest.mark.slow
def test_auto_batch_size_resume_keeps_the_interrupted_runs_rows(tmp_path, monkeypatch, no_figures):
    """``--batch-size auto --resume`` when the free memory now holds another number of rows: the resume continues
    with the interrupted run's rows (before: refused, 'other options (batch_size: 2 -> 5)') and gives the tables of
    an uninterrupted run of 2 rows per batch; the same through ``moetool.run(..., batch_size="auto", resume=True)``."""
    import moetool

    args = ["stats", "--max-tokens", "384", "--seq-len", "32", "--bootstrap", "100", "--min-count", "2", "--quiet"]
    whole = tmp_path / "whole"
    assert runner.invoke(app, [*args, "--batch-size", "2", "--out", str(whole)]).exit_code == 0
    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, seq_len=32, max_tokens=384)
    for way in ("cli", "api by name", "api loaded"):
        part = tmp_path / way.replace(" ", "-")
        with monkeypatch.context() as m:
            _free_memory_says(m, 2)
            if way == "api loaded":
                _interrupt_after_saves(m, 3)
                with pytest.raises(KeyboardInterrupt):
                    moetool.run("stats", lm, toks, out=part, batch_size="auto", quiet=True, bootstrap=100,
                                min_count=2)
            else:
                _interrupted(m, [*args, "--batch-size", "auto"], part, n=3)
        with monkeypatch.context() as m:
            _free_memory_says(m, 5)
            ran = _batches_run(m)
            if way == "cli":
                man = _resumed([*args, "--batch-size", "auto"], part)
            else:
                moetool.run("stats", *(("tiny",) if way == "api by name" else (lm, toks)), out=part,
                            batch_size="auto", resume=True, quiet=True, bootstrap=100, min_count=2,
                            **({"seq_len": 32, "max_tokens": 384} if way == "api by name" else {}))
                man = json.loads((part / "manifest.json").read_text())
                assert man["status"] == "complete" and not (part / "units").exists()
        assert ran == [3, 4, 5]  # 6 batches of 2 rows; the first 3 restored
        assert man["batch_size_auto"]["rows"] == 2 and "interrupted run" in man["batch_size_auto"]["reason"]
        _same_csvs(whole, part)


@pytest.mark.slow
def test_api_resume_of_a_loaded_model_refuses_another_precision(tmp_path, monkeypatch, no_figures):
    """``moetool.run("stats", lm, tokens, resume=True)`` with a loaded model: its dtype is no option of the
    experiment's, so the units' key must keep it. Interrupted in fp32 after 2 of 4 batches, a resume with the model
    loaded in bf16 (same weights files, same token ids) is refused in one line naming the dtype (before: accepted,
    fp32 units and bf16 batches summed into one table whose manifest said bfloat16); the fp32 resume gives the tables
    of an uninterrupted fp32 run exactly."""
    import moetool
    from moetool.errors import MoetoolError

    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, seq_len=32, max_tokens=256)  # 8 rows: 4 batches of 2
    kw = dict(batch_size=2, quiet=True, bootstrap=100, min_count=2)
    whole, part = tmp_path / "whole", tmp_path / "part"
    moetool.run("stats", lm, toks, out=whole, **kw)
    with monkeypatch.context() as m:
        _interrupt_after_saves(m, 2)
        with pytest.raises(KeyboardInterrupt):
            moetool.run("stats", lm, toks, out=part, **kw)
    lm16 = moetool.load("tiny", dtype="bf16")
    toks16 = moetool.tokens(lm16, seq_len=32, max_tokens=256)
    assert toks16.fingerprint() == toks.fingerprint()  # the same text: only the precision differs
    with pytest.raises(MoetoolError, match=r"other options \(dtype: 'float32' -> 'bfloat16'\)"):
        moetool.run("stats", lm16, toks16, out=part, resume=True, **kw)
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"
    with monkeypatch.context() as m:
        ran = _batches_run(m)
        moetool.run("stats", lm, toks, out=part, resume=True, **kw)
    assert ran == [2, 3]  # batches 0-1 restored
    _same_csvs(whole, part)


@pytest.mark.slow
def test_resume_refuses_a_dtype_auto_that_resolves_to_another_precision(tmp_path, monkeypatch, no_figures):
    """``--dtype auto`` is fp32 on a CPU and the checkpoint's own dtype on a GPU: the units' key kept 'auto', so a
    run interrupted on one machine and resumed on another (auto -> bf16 here, pick_dtype standing in for the GPU)
    was accepted and summed fp32 units with bf16 batches into one table. Now the precision the model loaded in is
    one of the run's inputs: the resume in bf16 is refused in one line, nothing written; the one in fp32 gives the
    uninterrupted run's tables exactly."""
    args = ["stats", "--max-tokens", "256", "--seq-len", "32", "--batch-size", "2", "--bootstrap", "100",
            "--min-count", "2", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 2)
    assert saved == ["batches"] * 2
    _refused_where_auto_is_bf16(monkeypatch, args, part, "precision")
    assert json.loads((part / "manifest.json").read_text())["status"] == "interrupted"
    assert not list(part.glob("*.csv"))
    with monkeypatch.context() as m:
        ran = _batches_run(m)
        _resumed(args, part)
    assert ran == [2, 3]  # batches 0-1 restored
    _same_csvs(whole, part)


@pytest.mark.slow
def test_fluctuation_resume_refuses_a_dtype_auto_that_resolves_to_another_precision(tmp_path, monkeypatch,
                                                                                    no_figures):
    """fluctuation loads its checkpoints itself, with --dtype auto as given: a resume where auto resolves to bf16
    (another machine; pick_dtype stands in for it) compared the fp32 routing read back from a unit with bf16 routing
    of the other checkpoint. Now refused in one line naming the precision; the fp32 resume equals the whole run."""
    args = ["fluctuation", "tiny-early", "tiny", "--routing", "router", "--max-tokens", "256", "--seq-len", "32",
            "--batch-size", "4", "--bootstrap", "100", "--quiet"]
    whole, part, saved = _whole_then_interrupted(tmp_path, monkeypatch, args, 1)
    assert saved == ["checkpoint-1"]
    _refused_where_auto_is_bf16(monkeypatch, args, part, "precision[0]")
    assert not list(part.glob("*.csv"))
    _resumed(args, part)
    assert _same_csvs(whole, part) == ["fluctuation.csv", "fluctuation_summary.csv"]


def _refused_where_auto_is_bf16(monkeypatch, args, part, where):
    """``--resume`` of ``part`` where ``--dtype auto`` resolves to bf16 (pick_dtype standing in for a GPU machine):
    exit 2, one line naming the precision at ``where``."""
    import torch

    from moetool import loading

    pick = loading.pick_dtype
    with monkeypatch.context() as m:
        m.setattr(loading, "pick_dtype", lambda dtype, config, device: (torch.bfloat16 if dtype == "auto"
                                                                        else pick(dtype, config, device)))
        r = runner.invoke(app, [*args, "--out", str(part), "--resume"])
    assert r.exit_code == 2, r.output
    assert [ln for ln in r.output.splitlines() if ln.strip()] == [
        f"error: --resume: the model's loaded precision changed since {part} was started ({where}: 'float32' -> "
        f"'bfloat16'); resume with what the run read or use --force to start over"], r.output
