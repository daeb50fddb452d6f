"""The command line's one error path (:func:`handle_errors`: every command's run made, errors as one line), Ctrl-C
handling, and the parsers of list flags (:func:`parse_list`, :func:`parse_layers`).

Nothing here imports torch: ``moetool --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from typing import Any, Callable

import typer

from moetool.errors import MoetoolError, is_disk_full, write_error
from moetool.run import refuse_busy_out, resolve_batch_size

from .options import AUTO_BATCH


#: commands that refuse --tp / --ep (one line, before anything loads), by command name
NO_PARALLEL = {"eval": "eval runs lm-eval's own request loop, which shards requests over processes, not over "
               "model groups: --tp/--ep are not supported there (run it with --device-map auto)",
               "agreement": "agreement loads and fake-quantizes one whole model per precision in each process: "
                            "--tp/--ep are not supported there (run it data parallel under torchrun)"}


#: commands that run in one process, by command name (and every ``--trace`` analysis: recorded routing, no
#: forward to split): under torchrun each rank would run the whole command and write the same --out (or its own
#: default folder), so a launcher's world size above 1 is refused in one line before anything is read or written
ONE_PROCESS = {"plan": "a plan reads a config, no model runs", "report": "a report reads run folders",
               "demo": "the demo's steps run in one process", "import-trace": "an import reads a dump"}


def refuse_launched(name: str, kwargs: dict[str, Any]) -> None:
    """One line under a launcher (world size > 1) for a command of :data:`ONE_PROCESS` or a ``--trace`` run."""
    from moetool.context import launcher_world

    world, name = launcher_world(), name.replace("_", "-")  # (import_trace: the function's name)
    if world > 1 and (name in ONE_PROCESS or kwargs.get("trace")):
        why = ONE_PROCESS.get(name, "--trace analyses recorded routing, no forward to split")
        flag = " --trace" if name not in ONE_PROCESS else ""
        raise MoetoolError(f"moetool {name}{flag} runs in one process ({why}): run it without torchrun / "
                           f"accelerate launch (world size {world})")


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command's run: its :class:`moetool.run.Run` (``--tp`` / ``--ep``, ``--batch-size auto``) made and active
    for the command (:func:`moetool.context.current`), a busy ``--out`` refused before any heavy import; known
    errors become one line on stderr and exit code 2 (a usage error) or 1 (:class:`MoetoolRuntimeError`; a full
    disk anywhere, even in a library's temporary file, is one: :func:`moetool.errors.write_error`);
    MOETOOL_DEBUG=1: full traceback."""
    # a command that loads a model declares --tp / --ep (flags.LOADING: Tp, Ep); the wrapper takes them out into
    # the command's Run, so the command itself never sees them
    parallel = "tp" in inspect.signature(fn).parameters
    trusting = "trust_remote_code" in inspect.signature(fn).parameters  # --trust-remote-code: the run's too
    name = getattr(fn, "command_name", fn.__name__)  # a generated command's name (norm-select), else the function's

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from moetool.report import rundir  # the current-run registry: unfinished runs get their manifest status
        from moetool.run import Run

        tp, ep = (kwargs.pop("tp", 1), kwargs.pop("ep", 1)) if parallel else (1, 1)
        trust = bool(kwargs.pop("trust_remote_code", False)) if trusting else False
        try:
            if (tp > 1 or ep > 1) and name in NO_PARALLEL:
                raise MoetoolError(NO_PARALLEL[name])
            refuse_launched(name, kwargs)
            run = Run.new(name, tp=tp, ep=ep, auto_batch=kwargs.get("batch_size") == AUTO_BATCH,
                          trust_remote_code=trust, cli=True)
        except MoetoolError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
        if kwargs.get("quiet"):
            quiet_libraries()
        since = rundir.run_counter()
        try:
            refuse_busy_out(kwargs)  # before the command imports torch: a used --out is refused in under a second
            with rundir.terminate_as_interrupt(), run.active():  # SIGTERM (a job's time limit) is handled as Ctrl-C
                if run.backoff.enabled:
                    kwargs["batch_size"] = resolve_batch_size(kwargs, run)
                return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            runs = rundir.mark_unfinished(since, *rundir.unfinished(e))
            where = f"; partial results in {runs[-1]._path} (status: interrupted)" if runs else ""
            said_interrupted()
            typer.secho(f"interrupted ({'SIGTERM' if isinstance(e, rundir.Terminated) else 'Ctrl-C'}){where}",
                        err=True)
            raise typer.Exit(143 if isinstance(e, rundir.Terminated) else 130) from None
        except Exception as e:
            error = write_error(e) if is_disk_full(e) else e  # an OSError of a full disk no write turned into one
            if isinstance(error, MoetoolError):
                rundir.mark_unfinished(since, "failed", rundir.one_line(error))
                if os.environ.get("MOETOOL_DEBUG"):  # the traceback, then the same line and exit code as without
                    import traceback

                    traceback.print_exc()
                typer.secho(f"error: {error}", fg="red", err=True)
                raise typer.Exit(getattr(error, "exit_code", 2)) from None
            if not (isinstance(e, typer.Exit) and e.exit_code == 0):  # a deliberate clean exit is no failure
                rundir.mark_unfinished(since, "failed", rundir.one_line(e))
            raise

    return wrapper


# ----- Ctrl-C: the first one interrupts, more of them never print a traceback ----------------------------------
#: seconds after the first Ctrl-C in which more of them are ignored (the run's manifests are being marked and the
#: interpreter is shutting down: torch's exit handlers print a traceback when a KeyboardInterrupt hits them); a
#: Ctrl-C later than that ends the process at once (exit 130), in case shutting down hangs
INTERRUPT_GRACE = 2.0
_INTERRUPT: dict[str, Any] = {"at": None, "said": False}


def said_interrupted() -> None:
    """The one ``interrupted`` line is printed (a later Ctrl-C adds none)."""
    _INTERRUPT["said"] = True


def _more_sigint(signum: int, frame: Any) -> None:
    import time

    if time.monotonic() - _INTERRUPT["at"] < INTERRUPT_GRACE:
        return
    if not _INTERRUPT["said"]:
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def _first_sigint(signum: int, frame: Any) -> None:
    import signal
    import time

    _INTERRUPT["at"] = time.monotonic()
    signal.signal(signal.SIGINT, _more_sigint)
    raise KeyboardInterrupt


@contextlib.contextmanager
def quiet_repeated_interrupts() -> Any:
    """For the console script (main thread): the first SIGINT raises :class:`KeyboardInterrupt` as Python's own
    handler does; later ones are handled by :func:`_more_sigint` while the run stops. Python's handler is back
    after the block unless an interrupt came: then SIGINT is ignored for the interpreter's shutdown (Python resets
    its own handlers to the default late in it, and a Ctrl-C there ended the process by the signal, not 130)."""
    import signal

    try:
        previous = signal.getsignal(signal.SIGINT)
        installed = previous is not signal.SIG_IGN  # started with Ctrl-C ignored (nohup, a background job): keep it
        if installed:
            signal.signal(signal.SIGINT, _first_sigint)
    except ValueError:  # not the main thread
        installed = False
    if not installed:  # (outside the try: an error of the block must not reach its except)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if _INTERRUPT["at"] is None else signal.SIG_IGN)


def quiet_libraries() -> None:
    """``--quiet``: no progress bars from transformers' weight loading either."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def parse_list(text: str | None, cast: Callable[[str], Any] = str, what: str = "value") -> list[Any]:
    """``"a,b,c"`` -> list, in the order given; a clear error for a bad item. The one parser of every
    comma-separated flag. A value given twice (``0.5,0.5``, ``0.5,.50``: equal once cast) is kept as given: the
    flag's check refuses it in one line, as the library refuses it (:func:`moetool.registry.refuse_repeats`);
    ``--layers`` names a set of layers (:func:`parse_layers`; ``select_layers`` in the library), where ranges may
    overlap. ``what``: a singular noun (``"layer"``) or the flag itself (``"--eps"``), as the errors name it."""
    if text is None:
        return []
    flag = what.startswith("--")
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            out.append(cast(item))
        except ValueError:
            raise MoetoolError(f"{what}: bad value '{item}' in '{text}'" if flag
                               else f"bad {what} '{item}' in '{text}'") from None
    if not out:
        raise MoetoolError(f"{what}: no value in '{text}'" if flag else f"empty list of {what}s: '{text}'")
    return out


#: the largest decoder layer index --layers takes (models have hundreds of layers at most)
MAX_LAYER = 100_000


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"0,2,5-7"`` -> ``(0, 2, 5, 6, 7)``; ``None`` -> every MoE layer. A reversed range (``3-1``) is an error."""
    if text is None:
        return None
    out: list[int] = []
    for item in parse_list(text, str, "layer"):
        lo, sep, hi = item.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(lo), int(lo))
        except ValueError:
            raise MoetoolError(f"bad --layers item '{item}' (use e.g. 0,2,5-7)") from None
        if b < a:
            raise MoetoolError(f"empty --layers range '{item}' (use low-high, e.g. {b}-{a})")
        if b > MAX_LAYER:  # 0-100000000 built a list of 10^8 layers (a minute, gigabytes) before the check
            raise MoetoolError(f"--layers item '{item}': layer {b} is beyond any model's layers (decoder indices "
                               f"up to {MAX_LAYER:,})")
        out.extend(range(a, b + 1))
    return tuple(sorted(set(out)))


def echo_run(path: Any) -> None:
    typer.secho(f"results in {path}", fg="green", err=False)


def finish(res: Any, path: Any, quiet: bool, tables: Any = None) -> None:
    """The end of a run's console output, every command's: its tables and lines (``tables()``; none under
    ``--quiet``: every table is in the run folder), what the run left out and why (always: a warning), then the
    line naming what it wrote. ``res``: the run's :class:`~moetool.experiments.result.Result`, or ``None`` for
    a command that writes no experiment's result (``demo``, ``report``, ``import-trace``)."""
    if tables is not None and not quiet:
        tables()
    left_out = (res.meta.get("left_out") or {}) if res is not None else {}  # tables or rows not written, and why
    for what, why in left_out.items():
        typer.echo(f"left out: {what} ({why})")
    echo_run(path)

