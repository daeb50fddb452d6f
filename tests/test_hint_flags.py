"""Every flag a refusal or a suggestion names is a flag of the command that prints it (agreement's fp16 overflow
said "try --dtype bf16 or fp32" on BASE; agreement has no --dtype, its --precisions choose the dtypes).

Two parts: the messages an experiment's own files raise (its folder and ``commands/<name>.py``), read from their
source; and the suggestions shared by every command (an fp16 overflow, an out-of-memory: ``engine/guard.py``,
``engine/runner.py``, ``sizing.py``) that name the flag choosing the dtype, built under a run of each command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import typer

from moetool.commands.app import app
from moetool.experiments.registry import EXPERIMENTS
from moetool.run import Run

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
RAISED = ("MoetoolError", "MoetoolRuntimeError", "BadParameter")
#: experiments that never run moetool's forward loop (engine.runner.forward), whose out-of-memory line names
#: --seq-len: erc reads weights alone, eval's forwards are lm-eval's own batches
NO_FORWARD_LOOP = {"erc", "eval"}


def command_flags() -> dict[str, set[str]]:
    cmd = typer.main.get_command(app)
    return {name: {o for p in c.params for o in (*p.opts, *p.secondary_opts)} for name, c in cmd.commands.items()}


def raised_texts(path: Path):
    """(line, text) of every string constant inside a MoetoolError / MoetoolRuntimeError / BadParameter call."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in RAISED:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub.lineno, sub.value


def test_an_experiments_own_messages_name_only_its_commands_flags():
    have, bad, seen = command_flags(), [], 0
    for name in EXPERIMENTS:
        own = ROOT / "commands" / f"{name.replace('-', '_')}.py"
        files = sorted((ROOT / "moetool" / "experiments" / name.replace("-", "_")).glob("*.py"))
        for f in files + ([own] if own.exists() else []):
            for line, text in raised_texts(f):
                for flag in FLAG.findall(text):
                    seen += 1
                    if flag not in have[name]:
                        bad.append(f"{f.relative_to(ROOT)}:{line} ({name}): {flag}")
    assert seen > 50  # the reading finds the flags (117 at the time of writing)
    assert not bad, bad


def shared_suggestions(loop: bool) -> list[str]:
    """The fp16 overflow's, the out-of-memory's of the forward loop (``loop``) and of the memory check, in this
    context."""
    from moetool.engine.guard import _dtype_hint
    from moetool.engine.runner import _no_row_fits
    from moetool.errors import MoetoolRuntimeError
    from moetool.loading import load_config
    from moetool.sizing import validate_run

    texts = [_dtype_hint(torch.float16), *([str(_no_row_fits(16))] if loop else [])]
    with pytest.raises(MoetoolRuntimeError, match="the weights alone need") as e:
        validate_run(load_config("tiny")[0], seq_len=16, batch_size=1, device="cpu", dtype="fp32")
    return [*texts, str(e.value)]


@pytest.mark.parametrize("name", [n for n, s in EXPERIMENTS.items() if s.inputs != "config"])
def test_the_shared_dtype_suggestions_name_the_commands_flag(name, monkeypatch):
    import moetool.sizing as sizing

    monkeypatch.setattr(sizing, "available_memory", lambda dev: 1)  # nothing fits: the weights' refusal
    spec, have = EXPERIMENTS[name], command_flags()[name]
    with Run(command=name, dtype_flag=spec.dtype_flag, cli=True).active():  # a command's run: its flags
        texts = shared_suggestions(name not in NO_FORWARD_LOOP)
    named = {f for t in texts for f in FLAG.findall(t)}
    assert spec.dtype_flag in named and named <= have, (texts, sorted(named - have))


def test_a_demo_step_runs_with_its_experiments_dtype_flag(monkeypatch):
    """``moetool demo`` runs each step in a run of its own: agreement's step names --precisions as its command does
    (a plain RunState named --dtype), another step --dtype."""
    from moetool import context, demo

    class Stop(Exception):
        pass

    class Folder:
        def sub(self, name):
            return self

    def compute(*args, **kwargs):
        seen.append(context.dtype_choice("bf16"))
        raise Stop

    monkeypatch.setattr(type(EXPERIMENTS["agreement"]), "load",
                        lambda self, attr=None: compute if attr is None else (lambda name, res: []))
    other = next(n for n, s in EXPERIMENTS.items() if s.demo is not None and s.inputs == "tokens" and n != "agreement")
    for cli, name, want in ((True, "agreement", "bf16 in --precisions"), (True, other, "--dtype bf16"),
                            (False, "agreement", "bf16 in precisions="), (False, other, "dtype='bf16'")):
        seen: list[str] = []
        with context.RunState(cli=cli).active(), pytest.raises(Stop):  # the command's run (flags), or Python's
            demo.run_step(Folder(), EXPERIMENTS[name], quiet=True)
        assert seen == [want], name
