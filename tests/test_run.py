"""A run belongs to the library (issue 32 item 3): ``moetool.run(...)`` is the CLI's run from Python, and a run's
state (``--batch-size auto``'s decision and back-off, the ``--tp``/``--ep`` layout, the policies it built) lives in
its :class:`moetool.run.Run`, not in module globals."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner
from test_resume import _same_csvs as same_csvs  # every CSV of two runs equal, wall time aside

import moetool
from moetool import context, sizing
from moetool.commands.app import app
from moetool.errors import MoetoolError
from moetool.report import rundir

SEQ, MAX = 64, 600  # 10 packed rows of the shipped text
TIMING = ("seconds",)
runner = CliRunner()

#: (experiment, its options from Python, the same as CLI flags)
CASES = [("stats", {"bootstrap": 0, "min_count": 2}, ["--bootstrap", "0", "--min-count", "2"]),
         ("ppl", {"routing": "random", "bootstrap": 0}, ["--routing", "random", "--bootstrap", "0"]),
         ("expert-similarity", {}, [])]


@pytest.fixture(scope="module")
def tiny():
    lm = moetool.load("tiny")
    return lm, moetool.tokens(lm, None, seq_len=SEQ, max_tokens=MAX)


def written(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def no_rendering(monkeypatch):
    """Figures are built and their files named, not rendered (rendering is the figures' own tests')."""
    import matplotlib.pyplot as plt

    def save_figure(self, fig, name):
        plt.close(fig)
        (self.path / "figures").mkdir(exist_ok=True)
        paths = [self.path / "figures" / f"{name}.{ext}" for ext in ("png", "pdf")]
        for p in paths:
            p.write_bytes(b"")
        return paths

    monkeypatch.setattr(rundir.RunDir, "save_figure", save_figure)


@pytest.mark.parametrize("name, kw, flags", CASES, ids=[c[0] for c in CASES])
def test_python_run_writes_what_the_cli_writes(tiny, tmp_path, name, kw, flags, no_rendering):
    lm, tokens = tiny
    res = moetool.run(name, lm, tokens, out=tmp_path / "py", batch_size=4, quiet=True, **kw)
    r = runner.invoke(app, [name, "--seq-len", str(SEQ), "--max-tokens", str(MAX), "--batch-size", "4", "-q",
                            "--out", str(tmp_path / "cli"), *flags])
    assert r.exit_code == 0, r.output
    assert res.path == tmp_path / "py" and written(tmp_path / "py") == written(tmp_path / "cli")
    same_csvs(tmp_path / "py", tmp_path / "cli")
    for table, df in res.tables.items():  # the returned tables are the files
        if table.endswith(".csv"):
            keep = [c for c in df.columns if c not in TIMING]
            pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "py" / table)[keep], df[keep].reset_index(drop=True),
                                          check_dtype=False, rtol=1e-12)
    py, cli = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("py", "cli"))
    assert py["status"] == cli["status"] == "complete" and py["command"] == cli["command"] == name
    assert py["options"]["batch_size"] == cli["options"]["batch_size"] == 4


#: (experiment, the model's name(s), its options from Python, the same as CLI arguments and flags)
NAMED = [("ppl", "tiny", {"routing": "norm:gate", "bootstrap": 100}, ["--routing", "norm:gate", "--bootstrap", "100"]),
         ("erc", "tiny", {"samples": 2}, ["--samples", "2"]),
         ("fluctuation", ["tiny-early", "tiny"], {"bootstrap": 0, "routing": ("router", "similarity")},
          ["tiny-early", "tiny", "--bootstrap", "0", "--routing", "router,similarity"]),
         ("agreement", "tiny", {"precisions": ("fp32", "bf16"), "bootstrap": 0},
          ["tiny", "--precisions", "fp32,bf16", "--bootstrap", "0"])]


@pytest.mark.parametrize("name, model, kw, args", NAMED, ids=[c[0] for c in NAMED])
def test_python_run_of_a_name_is_the_command(tmp_path, name, model, kw, args, no_rendering):
    """``moetool.run(name, "tiny", ...)`` loads and reads what the command does and writes the same files: the
    command is this call (issue 32 item 3)."""
    spec = moetool.experiments.registry.get(name)
    sizes = {"seq_len": SEQ, "max_tokens": MAX, "batch_size": 4} if spec.inputs != "weights" else {}
    res = moetool.run(name, model, out=tmp_path / "py", quiet=True, device="cpu", **sizes, **kw)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    r = runner.invoke(app, [name, *(args if isinstance(model, list) or name == "agreement" else ["--model", model, *args]),
                            *flags, "--device", "cpu", "-q", "--out", str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert res.path == tmp_path / "py" and written(tmp_path / "py") == written(tmp_path / "cli")
    same_csvs(tmp_path / "py", tmp_path / "cli")
    py, cli = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("py", "cli"))
    assert py["options"] == cli["options"] and py["status"] == cli["status"] == "complete"
    if spec.inputs != "weights":
        assert res.tokens.n_tokens == MAX and py["options"]["seq_len"] == SEQ


def test_python_run_refuses_in_one_line(tiny, tmp_path):
    lm, tokens = tiny
    for call, says in ((lambda: moetool.run("stats", lm, None), "needs tokens"),
                       (lambda: moetool.run("fluctuation", lm, tokens), "on the names of its checkpoints"),
                       (lambda: moetool.run("stats", lm, tokens, data="x.txt"), "go with a model's name"),
                       (lambda: moetool.run("stats", ["tiny", "tiny-fine"]), "one model: a name, not a list"),
                       (lambda: moetool.run("fluctuation", "tiny"), "two or more checkpoints"),
                       (lambda: moetool.run("erc", "tiny", data="x.txt"), "reads no text .the weights alone.: data"),
                       (lambda: moetool.run("ppl", lm, tokens, batch_size="big"), "neither a number of rows"),
                       (lambda: moetool.run("ppl", lm, tokens, resume=True, out=tmp_path / "r"), "no unit checkpoints"),
                       (lambda: moetool.run("stats", lm, tokens, top_tokenz=3), "unknown option")):
        with pytest.raises(MoetoolError, match=says) as e:
            call()
        assert "\n" not in str(e.value)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    with pytest.raises(MoetoolError, match="is not empty"):
        moetool.run("ppl", lm, tokens, out=tmp_path / "busy", bootstrap=0)
    assert (tmp_path / "busy" / "x.txt").read_text() == "mine" and context.current() is None


def one_row_bytes(lm) -> int:
    """Independent of sizing.estimate_memory: fp32 logits + two hidden states per token of a row, times the slack
    (the weights are loaded already: they count 0)."""
    c = lm.config
    return SEQ * (c.vocab_size + 2 * c.hidden_size) * 4 * sizing.AUTO_SLACK


def limit_rows(monkeypatch, lm, max_rows):
    """``lm``'s forward runs out of memory above ``max_rows`` rows."""
    orig = lm.model.forward

    def forward(*args, **kwargs):
        if kwargs["input_ids"].shape[0] > max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return orig(*args, **kwargs)

    monkeypatch.setattr(lm.model, "forward", forward)


def test_batch_size_auto_from_python(tiny, tmp_path, monkeypatch, no_rendering):
    """The rows the free memory holds (3 of them here), recorded as the CLI records them; the tables are the explicit
    run's. Then memory for all 10 rows and an out-of-memory above 2: the run backs off 10 -> 5 -> 2 and equals the
    explicit 2-row run."""
    lm, tokens = tiny
    free = 3.5 * one_row_bytes(lm) / sizing.AUTO_SHARE
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(free))
    ppl = dict(routing="random", bootstrap=0, quiet=True)
    res = moetool.run("ppl", lm, tokens, out=tmp_path / "auto", batch_size="auto", **ppl)
    man = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert res.options.batch_size == 3 == man["options"]["batch_size"] == man["batch_size_auto"]["rows"]
    assert man["batch_size_auto"]["reason"] == "fits memory" and "out_of_memory_at" not in man["batch_size_auto"]
    moetool.run("ppl", lm, tokens, out=tmp_path / "three", batch_size=3, **ppl)
    same_csvs(tmp_path / "auto", tmp_path / "three")

    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(100 * one_row_bytes(lm)))
    limit_rows(monkeypatch, lm, 2)
    res = moetool.run("ppl", lm, tokens, out=tmp_path / "backoff", batch_size="auto", **ppl)
    man = json.loads((tmp_path / "backoff" / "manifest.json").read_text())
    assert man["batch_size_auto"]["rows"] == 2 and man["batch_size_auto"]["out_of_memory_at"] == [10, 5]
    assert res.options.batch_size == 10  # the batches (global rows) stay those of the decision, run 2 rows at a time
    moetool.run("ppl", lm, tokens, out=tmp_path / "two", batch_size=2, **ppl)
    got, want = (pd.read_csv(tmp_path / d / "ppl.csv").drop(columns="seconds") for d in ("backoff", "two"))
    pd.testing.assert_frame_equal(got, want, rtol=1e-6)
    assert context.current() is None  # the runs' state went with them


def test_resume_from_python_equals_an_uninterrupted_run(tiny, tmp_path, monkeypatch, no_rendering):
    lm, tokens = tiny
    kw = dict(batch_size=2, bootstrap=0, min_count=2, quiet=True)  # 10 rows: 5 batches, a checkpoint after each
    moetool.run("stats", lm, tokens, out=tmp_path / "whole", **kw)
    save, saved = rundir.Units.save, []

    def save_then_interrupt(self, name, obj, refs=()):
        save(self, name, obj, refs)
        saved.append(name)
        if len(saved) == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(rundir.Units, "every_seconds", 0.0)
        m.setattr(rundir.Units, "save", save_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            moetool.run("stats", lm, tokens, out=tmp_path / "part", **kw)
    assert json.loads((tmp_path / "part" / "manifest.json").read_text())["status"] == "interrupted"
    with pytest.raises(MoetoolError, match="min_count: 2 -> 3"):  # other options: refused, nothing run
        moetool.run("stats", lm, tokens, out=tmp_path / "part", resume=True, **{**kw, "min_count": 3})
    from moetool.engine import guard

    check, ran = guard.FiniteGuard.check, []
    monkeypatch.setattr(guard.FiniteGuard, "check", lambda self, b, rows="": (ran.append(b), check(self, b, rows))[1])
    moetool.run("stats", lm, tokens, out=tmp_path / "part", resume=True, **kw)
    assert ran == [2, 3, 4]  # batches 0-1 restored from the checkpoint, not run again
    assert {"load.csv", "layers.csv", "coactivation.csv"} <= set(same_csvs(tmp_path / "whole", tmp_path / "part"))
    assert json.loads((tmp_path / "part" / "manifest.json").read_text())["status"] == "complete"


def test_no_module_global_holds_a_runs_state():
    """No ``engine.runner.BACKOFF`` / ``distributed._PARALLEL``: no module of moetool holds a back-off, a layout
    or a run at module level, and no source names the old globals."""
    import moetool.commands.cli  # noqa: F401
    import moetool.commands.options  # noqa: F401
    import moetool.experiments.capacity.compute  # noqa: F401
    import moetool.run  # noqa: F401
    from moetool import distributed
    from moetool.context import Backoff, Parallel, RunState
    from moetool.engine import runner as engine_runner

    assert not hasattr(engine_runner, "BACKOFF") and not hasattr(distributed, "_PARALLEL")
    assert not hasattr(distributed, "set_parallel")
    held = [f"{name}.{k}" for name, mod in list(sys.modules.items()) if name.startswith("moetool")
            for k, v in vars(mod).items() if isinstance(v, (Backoff, RunState, Parallel))]
    assert not held, held
    root = Path(moetool.__file__).resolve().parents[1]
    named = [str(p.relative_to(root)) for d in ("moetool", "commands") for p in (root / d).rglob("*.py")
             if re.search(r"\bBACKOFF\b|\b_PARALLEL\b|\bset_parallel\(", p.read_text())]
    assert not named, named
    assert distributed.parallel() == Parallel(1, 1) and context.current() is None


def test_concurrent_runs_do_not_share_back_off(tmp_path, monkeypatch, no_rendering):
    """Two ``moetool.run`` in two threads of one process, overlapping (each waits for the other before its first
    forward): the one whose model runs out of memory above 2 rows backs off, the other runs its 10 rows, and
    both give the same perplexity."""
    models = {"oom": moetool.load("tiny"), "fits": moetool.load("tiny")}
    tokens = moetool.tokens(models["fits"], None, seq_len=SEQ, max_tokens=MAX)
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(100 * one_row_bytes(models["fits"])))
    both = threading.Barrier(2, timeout=120)
    for key, lm in models.items():
        orig, first = lm.model.forward, []

        def forward(*args, _orig=orig, _first=first, _oom=key == "oom", **kwargs):
            if not _first:
                _first.append(1)
                both.wait()  # both runs are in progress before either forwards
            if _oom and kwargs["input_ids"].shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return _orig(*args, **kwargs)

        monkeypatch.setattr(lm.model, "forward", forward)
    errors: list[BaseException] = []

    def go(key: str) -> None:
        try:
            moetool.run("ppl", models[key], tokens, out=tmp_path / key, batch_size="auto", bootstrap=0,
                        quiet=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(k,)) for k in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    oom, fits = (json.loads((tmp_path / k / "manifest.json").read_text())["batch_size_auto"] for k in models)
    assert oom["rows"] == 2 and oom["out_of_memory_at"] == [10, 5]
    assert fits["rows"] == 10 and "out_of_memory_at" not in fits
    a, b = (pd.read_csv(tmp_path / k / "ppl.csv") for k in models)
    assert a["perplexity"][0] == pytest.approx(b["perplexity"][0], rel=1e-6)
    assert context.current() is None


def test_forward_takes_the_run_explicitly(tiny, monkeypatch):
    """``engine.forward(run=...)``: that run's back-off, not the context's."""
    from moetool.context import Backoff, RunState
    from moetool.engine.runner import forward

    lm, tokens = tiny
    limit_rows(monkeypatch, lm, 4)
    mine, other = RunState(backoff=Backoff(enabled=True)), RunState(backoff=Backoff(enabled=True))
    with other.active():
        got = forward(lm, tokens, batch_size=8, nll=True, run=mine, quiet=True)
    assert mine.backoff.events == [8] and mine.backoff.rows == 4 and other.backoff.events == []
    monkeypatch.undo()
    want = forward(lm, tokens, batch_size=4, nll=True, quiet=True)
    assert got.nll.tokens == want.nll.tokens and got.nll.mean == pytest.approx(want.nll.mean, rel=1e-6)


def test_moetool_run_is_the_module_and_the_function(tiny):
    """``moetool.run`` is this package's module ``moetool/run.py`` once imported; calling it calls the function."""
    import importlib

    mod = importlib.import_module("moetool.run")
    assert moetool.run in (mod, mod.run) and mod.run.__module__ == "moetool.run"
    lm, tokens = tiny
    with pytest.raises(MoetoolError, match="needs tokens"):
        mod("ppl", lm)  # the module called: the function's own checks


class _Started(Exception):
    """Raised by the patched start of a run: what ``moetool.run`` by name would read, before anything loads."""


def _capture_start(monkeypatch) -> None:
    import importlib

    mod = importlib.import_module("moetool.run")

    def start(*args, **kw):
        raise _Started({k: kw[k] for k in ("data", "seq_len", "max_tokens")})

    monkeypatch.setattr(mod, "start_run", start)
    monkeypatch.setattr(mod, "_start_names", start)


READS_TEXT = [s for s in moetool.experiments.registry.EXPERIMENTS.values() if s.inputs in ("tokens", "checkpoints")]


@pytest.mark.parametrize("spec", READS_TEXT, ids=[s.name for s in READS_TEXT])
def test_a_run_by_name_reads_the_commands_defaults(spec, monkeypatch):
    """``moetool.run(name, model)`` with no sizes reads what ``moetool <name>`` with no flags reads: the generated
    command's parameter defaults (the spec's ``defaults=`` over the flag groups'), e.g. ppl's 32768 tokens, never a
    library default of its own (ppl read 8,192 tokens from Python and 32,768 from the CLI: another perplexity)."""
    from moetool.commands.generated import parameters

    cli = {name: default for name, _, default in parameters(spec) if name in ("data", "seq_len", "max_tokens")}
    cli.setdefault("data", None)  # checkpoints: --data has the same default (the shipped text)
    _capture_start(monkeypatch)
    model = ["tiny-early", "tiny"] if spec.inputs == "checkpoints" else "tiny"
    with pytest.raises(_Started) as got:
        moetool.run(spec.name, model, quiet=True)
    assert got.value.args[0] == cli


def test_ppl_by_name_reads_32768_tokens_as_its_command(monkeypatch):
    _capture_start(monkeypatch)
    with pytest.raises(_Started) as got:
        moetool.run("ppl", "tiny")
    assert got.value.args[0]["max_tokens"] == 32768 and got.value.args[0]["seq_len"] == 256


@pytest.mark.parametrize("size", ["seq_len", "max_tokens"])
@pytest.mark.parametrize("value", [0, 1, -5])
def test_a_run_by_name_refuses_the_sizes_the_command_refuses(size, value, monkeypatch, tmp_path):
    """0 is a value given, not "the default" (``max_tokens=0`` ran on 8,192 tokens): refused as 1 and -5 are, in
    the same line, before anything starts; the command refuses each of them too."""
    _capture_start(monkeypatch)
    flag = "--" + size.replace("_", "-")
    with pytest.raises(MoetoolError) as e:
        moetool.run("ppl", "tiny", **{size: value})
    assert str(e.value) == f"{size}= must be an integer of at least 2, not {value}"  # the keyword passed
    r = runner.invoke(app, ["ppl", flag, str(value), "--out", str(tmp_path / "never")])
    assert r.exit_code == 2 and flag in r.output and not (tmp_path / "never").exists()


def test_auto_resume_from_python_keeps_the_interrupted_runs_rows(tiny, tmp_path, monkeypatch, no_rendering):
    """``batch_size="auto"`` with ``resume=True`` on a loaded model: the 2 rows the interrupted run started with, not
    the 10 the free memory now holds (a new choice would refuse the resume: other options); the tables are the
    uninterrupted 2-row run's."""
    lm, tokens = tiny
    kw = dict(bootstrap=0, min_count=2, quiet=True)
    moetool.run("stats", lm, tokens, out=tmp_path / "whole", batch_size=2, **kw)
    save, saved = rundir.Units.save, []

    def save_then_interrupt(self, name, obj, refs=()):
        save(self, name, obj, refs)
        saved.append(name)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(rundir.Units, "every_seconds", 0.0)
        m.setattr(rundir.Units, "save", save_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            moetool.run("stats", lm, tokens, out=tmp_path / "part", batch_size=2, **kw)
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(100 * one_row_bytes(lm)))
    res = moetool.run("stats", lm, tokens, out=tmp_path / "part", resume=True, batch_size="auto", **kw)
    man = json.loads((tmp_path / "part" / "manifest.json").read_text())
    assert res.options.batch_size == 2 == man["batch_size_auto"]["rows"] and man["status"] == "complete"
    assert man["batch_size_auto"]["reason"] == "the interrupted run's choice, kept by --resume"
    assert "load.csv" in same_csvs(tmp_path / "whole", tmp_path / "part")
