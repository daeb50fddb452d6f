"""Options shared by every command, the one error path, and small parsers; the run is :mod:`moetool.run`'s.

Nothing here imports torch: ``moetool --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from moetool.errors import MoetoolError, is_disk_full, write_error
from moetool.registry import unique
# the run itself (preflight, checks, run folder, resume, --batch-size auto, layout, writing) is the library's
from moetool.run import (DEFAULT_MODEL, StartedRun, check_resume, check_run, open_run, preflight,  # noqa: F401
                         rank_layout, refuse_busy_out, resolve_batch_size, run_options, start_run, unit_key,
                         write_result)

Model = Annotated[str, typer.Option("--model", "-m", help="Embedded name (tiny, tiny-fine, ...), alias "
                                    "(moetool inspect --aliases), local directory or hub id.")]
Data = Annotated[Optional[Path], typer.Option("--data", "-d", help="Text file, JSONL (text, optional domain: a "
                                              "string or null; a number, boolean, list or object is refused) or a "
                                              "folder of them. Default: the held-out text shipped with moetool.")]
SeqLen = Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per packed row.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=2, help="Cap on real (unpadded) tokens read from --data.")]
AUTO_BATCH = 0  # what --batch-size auto parses to; handle_errors replaces it by the chosen number of rows


def parse_batch_size(value: Any) -> int:
    """``--batch-size N`` (N >= 1) or ``auto`` (:data:`AUTO_BATCH`, resolved by :func:`resolve_batch_size`)."""
    if isinstance(value, int):
        return value
    if str(value).strip().lower() == "auto":
        return AUTO_BATCH
    try:
        n = int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is neither a number of rows nor 'auto'") from None
    if n < 1:
        raise typer.BadParameter(f"{n} is not a number of rows (at least 1) nor 'auto'")
    return n


BatchSize = Annotated[int, typer.Option("--batch-size", "-b", parser=parse_batch_size, metavar="N|auto",
                                        help="Rows per forward pass (per process under torchrun). 'auto': the "
                                             "largest batch the device's free memory holds (see README, Scale).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto|bf16|fp16|fp32 (auto: the checkpoint's; fp32 on CPU).")]
Device = Annotated[str, typer.Option("--device", help="auto|cuda|cpu.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="'auto': let accelerate spread a model "
                                                  "larger than one GPU over GPUs and CPU.")]
Quantize = Annotated[Optional[str], typer.Option("--quantize", metavar="fp8", help="fp8: load a bf16 checkpoint with "
                                                 "transformers' block-scaled FP8 quantization (CUDA only; "
                                                 "Mixtral-8x7B then fits one 80 GB GPU).")]
TP_HELP = ("Tensor parallel: split attention heads and every expert's features over N processes with transformers' "
           "own engine (under torchrun; world = data parallel x N). See README, Several GPUs and nodes.")
EP_HELP = ("Expert parallel: whole experts split over the N processes of the --tp group instead of each "
           "expert's features (N must equal --tp). Under torchrun.")
Tp = Annotated[int, typer.Option("--tp", min=1, help=TP_HELP)]
Ep = Annotated[int, typer.Option("--ep", min=1, help=EP_HELP)]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", help="Run directory (default runs/<command>-<time>).")]
Force = Annotated[bool, typer.Option("--force", help="Write into a non-empty --out.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the interrupted run in --out from its last "
                                      "finished unit (same options; same result as an uninterrupted run).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of every random choice.")]
Layers = Annotated[Optional[str], typer.Option("--layers", help="MoE layers the command acts on (decoder "
                                               "indices): where the policy replaces routing, or the layers an "
                                               "analysis covers; e.g. '0,2,5-7' (default: every MoE layer).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
DEFAULT_BOOTSTRAP = 1000  # mirrors moetool.uncertainty.DEFAULT_BOOTSTRAP (a test checks) without importing numpy
Bootstrap = Annotated[int, typer.Option("--bootstrap", min=0, help="Replicates of the document-level bootstrap "
                                        "over packed rows (seeded by --seed) for 95% intervals: *_lo/*_hi CSV "
                                        "columns, error bars, 'value ± half-width' in tables. 0 = off; else >= 100.")]

# routing: a policy spec everywhere ("router" = the model's own routing) and the options policies read
Routing = typer.Option("router", "--routing", "-r", help="Routing policy: router, norm:<node>[:<norm>], random, ...")
Weights = typer.Option("softmax", "--weights", help="Weights of the experts a norm policy chose: softmax (over "
                       "their norms, AoE Algorithm 1), router (the model's probabilities, renormalised as the "
                       "model does) or uniform (1/K). Ignored by router.")
Sim = typer.Option("dot", "--sim", help="similarity policy: dot (raw h_i·h_j, the paper) or cosine.")
Causal = typer.Option(True, "--causal/--no-causal", help="similarity policy: only tokens j <= i (default).")

# lm-eval
NumFewshot = typer.Option(None, "--num-fewshot", min=0, help="Few-shot examples per item (default: the task's own).")
Limit = typer.Option(None, "--limit", min=1, help="At most this many items per task (default: all).")
IncludePath = typer.Option(None, "--include-path", help="Folder of extra lm-eval task YAMLs.")

#: commands that refuse --tp / --ep (one line, before anything loads), by command function
NO_PARALLEL = {"eval_command": "eval runs lm-eval's own request loop, which shards requests over processes, not over "
                               "model groups: --tp/--ep are not supported there (run it with --device-map auto)",
               "agreement": "agreement loads and fake-quantizes one whole model per precision in each process: "
                            "--tp/--ep are not supported there (run it data parallel under torchrun)"}


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command's run: its :class:`moetool.run.Run` (``--tp`` / ``--ep``, ``--batch-size auto``) made and active
    for the command (:func:`moetool.context.current`), a busy ``--out`` refused before any heavy import; known
    errors become one line on stderr and exit code 2 (a usage error) or 1 (:class:`MoetoolRuntimeError`; a full
    disk anywhere, even in a library's temporary file, is one: :func:`moetool.errors.write_error`);
    MOETOOL_DEBUG=1: full traceback."""
    # a command that loads a model declares --tp / --ep (flags.LOADING: Tp, Ep); the wrapper takes them out into
    # the command's Run, so the command itself never sees them
    parallel = "tp" in inspect.signature(fn).parameters

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from moetool.report import rundir  # the current-run registry: unfinished runs get their manifest status
        from moetool.run import Run

        tp, ep = (kwargs.pop("tp", 1), kwargs.pop("ep", 1)) if parallel else (1, 1)
        try:
            if (tp > 1 or ep > 1) and fn.__name__ in NO_PARALLEL:
                raise MoetoolError(NO_PARALLEL[fn.__name__])
            run = Run.new(fn.__name__, tp=tp, ep=ep, auto_batch=kwargs.get("batch_size") == AUTO_BATCH)
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
            runs = rundir.mark_unfinished(since, "interrupted", "SIGTERM" if isinstance(e, rundir.Terminated)
                                          else "SIGINT")
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
    """``"a,b,c"`` -> list; a clear error for a bad item. The one parser of every comma-separated flag: a value
    given twice (``0.5,0.5``, ``0.5,.50``: equal once cast) is kept once, at its first place, so no table has a
    row computed twice."""
    if text is None:
        return []
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            out.append(cast(item))
        except ValueError:
            raise MoetoolError(f"bad {what} '{item}' in '{text}'") from None
    if not out:
        raise MoetoolError(f"empty list of {what}s: '{text}'")
    return unique(out)


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
        out.extend(range(a, b + 1))
    return tuple(sorted(set(out)))


def finish_command(started: StartedRun, result: Any, title: str, csv: str) -> None:
    """The end every experiment command shares: write the result (:meth:`StartedRun.write`), print its summary
    table under ``title`` (long tables point to ``csv``) and the run folder."""
    from moetool.report.console import print_table

    started.write(result)
    print_table(result.summary, title, csv=csv)
    echo_run(started.run.path)


def echo_run(path: Any) -> None:
    typer.secho(f"results in {path}", fg="green", err=False)

