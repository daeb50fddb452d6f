"""Options shared by every command, the one error path, and small parsers.

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

DEFAULT_MODEL = "tiny"  # mirrors moetool.loading.DEFAULT_MODEL without importing it


#: commands that refuse --tp / --ep (one line, before anything loads), by command function
NO_PARALLEL = {"eval_command": "eval runs lm-eval's own request loop, which shards requests over processes, not over "
                               "model groups: --tp/--ep are not supported there (run it with --device-map auto)",
               "agreement": "agreement loads and fake-quantizes one whole model per precision in each process: "
                            "--tp/--ep are not supported there (run it data parallel under torchrun)"}


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Known errors become one line on stderr and exit code 2 (a usage error) or 1 (:class:`MoetoolRuntimeError`;
    a full disk anywhere, even in a library's temporary file, is one: :func:`moetool.errors.write_error`);
    MOETOOL_DEBUG=1: full traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from moetool.report import rundir  # the current-run registry: unfinished runs get their manifest status

        if parallel:
            tp, ep = kwargs.pop("tp", 1), kwargs.pop("ep", 1)
            try:
                if (tp > 1 or ep > 1) and fn.__name__ in NO_PARALLEL:
                    raise MoetoolError(NO_PARALLEL[fn.__name__])
                set_parallel(tp, ep)
            except MoetoolError as e:
                typer.secho(f"error: {e}", fg="red", err=True)
                raise typer.Exit(2) from None
        if kwargs.get("quiet"):
            quiet_libraries()
        since = rundir.run_counter()
        try:
            refuse_busy_out(kwargs)  # before the command imports torch: a used --out is refused in under a second
            with rundir.terminate_as_interrupt():  # SIGTERM (a job's time limit) is handled like Ctrl-C
                if kwargs.get("batch_size") == AUTO_BATCH:
                    with auto_backoff():
                        kwargs["batch_size"] = resolve_batch_size(kwargs)
                        return fn(*args, **kwargs)
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

    # every command that loads a model (it has --dtype) takes --tp / --ep: added to its signature here, so the
    # flags are declared once; the wrapper takes them out and sets moetool.distributed.set_parallel
    sig = inspect.signature(fn)
    parallel = ("dtype" in sig.parameters or fn.__name__ in NO_PARALLEL) and "tp" not in sig.parameters
    if parallel:
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=1,
                                   annotation=Annotated[int, typer.Option(f"--{name}", min=1, help=text)])
                 for name, text in (("tp", TP_HELP), ("ep", EP_HELP))]
        import typing

        hints = typing.get_type_hints(fn, include_extras=True)  # the module's own names (Annotated options)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
        wrapper.__signature__ = sig.replace(parameters=[*params, *extra])  # type: ignore[attr-defined]
    return wrapper


def set_parallel(tp: int, ep: int) -> None:
    """``--tp`` / ``--ep`` for the command about to run (1, 1: nothing split). Imports torch only when asked."""
    if tp == 1 and ep == 1 and "moetool.distributed" not in sys.modules:
        return
    from moetool import distributed

    distributed.set_parallel(tp, ep)


def refuse_busy_out(params: dict[str, Any]) -> None:
    """A command's ``--out`` that holds files and no moetool run, or a complete one, without ``--force`` or
    ``--resume``: refused now, in the command layer, before any heavy import (torch takes seconds to import).
    Every other case (a failed or unfinished run, ``--force``, ``--resume``) is decided where the run starts
    (:meth:`moetool.report.RunDir.create`, which gives the same message for this one)."""
    out = params.get("out")
    if not out or params.get("force") or params.get("resume"):
        return
    from moetool.report.rundir import PART, read_manifest

    path = Path(out)
    if not path.is_dir() or not any(not p.name.startswith(PART) for p in path.iterdir()):
        return
    prev = read_manifest(path)
    if prev is None or prev.get("status") == "complete":
        raise MoetoolError(f"--out {path} is not empty (use --force to write into it)")


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


def preflight(*models: str) -> None:
    """Resolve every ``--model`` (embedded name, alias, directory, hub id) from its config alone, before a command
    imports its experiment (and torch): an unknown name, a dense model or an uncached hub id without network fails
    in about a second of the whole process instead of after the imports."""
    from moetool.loading import load_config, resolve

    kinds = {m: resolve(m)[1] for m in models}  # names alone: an unknown one fails here
    for model in sorted(models, key=lambda m: kinds[m] not in ("hub", "alias")):  # the ones that may need the Hub
        load_config(model)


def check_run(model: str, *, seq_len: int | None = None, batch_size: int | None = None,
              max_tokens: int | None = None, device: str = "auto", dtype: str = "auto", device_map: str | None = None,
              attn_implementation: str | None = None, quantize: str | None = None) -> Any:
    """``sizing.validate_run`` on the model's config: bad sizes, too long --seq-len, no such device, not enough
    memory fail with one line before any weight loads or any run folder exists. Returns the ``RunEstimate``."""
    from moetool.loading import load_config
    from moetool.sizing import validate_run

    config, _, _ = load_config(model)
    return validate_run(config, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                        dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
                        quantize=quantize)


def resolve_batch_size(params: dict[str, Any]) -> int:
    """The wrapper's half of ``--batch-size auto``: :func:`moetool.sizing.auto_batch_size` from the command's own options, the
    minimum over ranks under torchrun (every rank must cut the same global batches), one console line. The
    decision is kept for the manifest in ``BACKOFF.choice`` (:func:`auto_backoff` resets it for each command)."""
    from moetool import distributed
    from moetool.engine.runner import BACKOFF

    model = params.get("model") or params.get("model_arg") or (params.get("checkpoints") or [DEFAULT_MODEL])[0]
    e = distributed.env()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", e.world_size))
    routing = str(params.get("routing") or "")
    from moetool import sizing

    rows, facts = sizing.auto_batch_size(model, seq_len=params.get("seq_len"), max_tokens=params.get("max_tokens"),
                                  device=params.get("device") or "auto", dtype=params.get("dtype") or "auto",
                                  device_map=params.get("device_map"), attention="attention" in routing,
                                  processes=processes, world=e.world_size, quantize=params.get("quantize"))
    if e.distributed:
        import torch

        distributed.init(params.get("device") or "auto")
        rows = int(distributed.all_reduce_world(torch.tensor(rows), "min"))  # a model group shares its batch
        facts["rows"] = rows
    BACKOFF.choice = facts
    if e.rank == 0:
        free = facts.get("free_bytes")
        typer.secho(f"--batch-size auto: {rows} rows per forward ({facts['reason']}; "
                    f"{'?' if free is None else f'{free / 2**30:.1f} GiB'} free on {facts['device']})", err=True)
    return rows


@contextlib.contextmanager
def auto_backoff() -> Any:
    """``--batch-size auto`` for one command: its decision (``BACKOFF.choice``) and, on out-of-memory, the forward
    loop halving the rows, retrying them and going on (:data:`moetool.engine.runner.BACKOFF`); all of it reset
    before and after the command."""
    from moetool.engine.runner import BACKOFF

    BACKOFF.reset(enabled=True)
    try:
        yield
    finally:
        BACKOFF.reset(enabled=False)


class StartedRun:
    """What :func:`start_run` made: the run folder, the model, the tokens (``None`` without ``seq_len``) and the
    run-level manifest options. Unpacks as ``run, lm, tokens``; ``write(result)`` is the one writer call."""

    def __init__(self, run: Any, lm: Any, tokens: Any, options: dict[str, Any], units: Any = None):
        self.run, self.lm, self.tokens, self.options = run, lm, tokens, options
        self.units = units  # moetool.checkpoints.Units: finished units kept for --resume (None: not asked)

    def __iter__(self) -> Any:
        return iter((self.run, self.lm, self.tokens))

    def write(self, result: Any, **kwargs: Any) -> Any:
        """:func:`write_result` with this run's model and run-level options."""
        return write_result(result, self.run, model=self.lm, options=self.options, **kwargs)


def finish_command(started: StartedRun, result: Any, title: str, csv: str) -> None:
    """The end every experiment command shares: write the result (:meth:`StartedRun.write`), print its summary
    table under ``title`` (long tables point to ``csv``) and the run folder."""
    from moetool.report.console import print_table

    started.write(result)
    print_table(result.summary, title, csv=csv)
    echo_run(started.run.path)


def write_result(result: Any, run: Any, **kwargs: Any) -> Any:
    """The one writer call of every command: :func:`moetool.report.writers.write`, the ``--batch-size auto``
    back-off (the rows that ran after an out-of-memory) recorded in the manifest first."""
    from moetool.engine.runner import BACKOFF
    from moetool.report.writers import write

    if BACKOFF.rows is not None:  # --batch-size auto backed off on out-of-memory: the rows that ran
        run.add(batch_size_auto={**BACKOFF.choice, "rows": BACKOFF.rows, "out_of_memory_at": BACKOFF.events})
    return write(result, run, **kwargs)


def start_run(command: str, out: Any, force: bool, model: str, *, data: Any = None, seq_len: int | None = None,
              max_tokens: int | None = None, batch_size: int | None = None, dtype: str = "auto", device: str = "auto",
              device_map: str | None = None, attention: bool = False, tokenizer: bool = True,
              add_special_tokens: bool | None = False, resume: bool = False, units: Any = None,
              quantize: str | None = None) -> StartedRun:
    """The start every command shares: ``--data`` must exist and the run must fit (:func:`check_run`) before the
    run folder exists; then the folder (with the memory estimate), the model (eager attention for ``attention``),
    and with ``seq_len`` the packed tokens of ``--data``. Unpacks as ``run, lm, tokens`` (tokens ``None`` without
    ``seq_len``); ``.write(result)`` writes the result with the run-level options (model, data, sizes, device).

    Under ``torchrun`` / ``accelerate launch`` (:mod:`moetool.distributed`) every rank joins the process group
    (gloo on CPU, nccl on ``cuda:LOCAL_RANK``) before loading; rank 0 alone gets the run folder, the others a
    :class:`NullRun` (nothing written) and a silent stdout; the manifest records the world size and each rank's
    rows and tokens (its shard of ``--batch-size`` rows of every global batch).

    ``units`` (the experiment's options dataclass) asks for unit checkpoints (``.units``) keyed by every option;
    ``resume`` continues the unfinished run in ``out`` (other options: refused in one line before loading)."""
    from moetool import distributed
    from moetool.data import DocumentStream, load_tokens
    from moetool.loading import check_quantize, load, weights_fingerprint

    check_quantize(quantize, device)  # --quantize on CPU: one line before anything
    attn = "eager" if attention else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if device_map and per_node > 1:  # every rank would spread its own copy over the same GPUs
        raise MoetoolError(f"--device-map spreads one model over this node's GPUs: launch one process per node "
                           f"(torchrun --nproc-per-node 1), not {per_node}")
    if distributed.parallel().active:  # --tp / --ep: a layout that cannot work is one line before any folder
        from moetool.loading import load_config

        distributed.check_parallel(load_config(model)[0], device_map)
    if seq_len is not None:
        DocumentStream(data)  # a missing --data fails before anything is loaded
    est = check_run(model, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device, dtype=dtype,
                    device_map=device_map, attn_implementation=attn, quantize=quantize)
    sizes = dict(data=data, seq_len=seq_len, max_tokens=max_tokens) if seq_len is not None else {}
    options = run_options(model=model, **sizes, dtype=dtype, device=device, device_map=device_map,
                          **({"quantize": quantize} if quantize else {}))
    run, checkpoints = open_run(command, out, force, resume=resume, device=device, estimate=est,
                                batch_size=batch_size, units=None if units is None else {**options, **unit_key(units)})
    if checkpoints is not None:  # --resume: refused when the weights changed since the run started
        checkpoints.check_inputs(model=weights_fingerprint(model))
    lm = load(model, dtype=dtype, device=device, device_map=device_map, attn_implementation=attn, tokenizer=tokenizer,
              quantize=quantize)
    note = lm.quantization().get("note")
    if note and distributed.rank() == 0:
        typer.secho(f"note: {note}", err=True)
    tokens = (load_tokens(data, lm.tokenizer, seq_len, max_tokens, add_special_tokens=add_special_tokens)
              if seq_len is not None else None)
    if checkpoints is not None and tokens is not None:  # --resume: refused when other data was read
        checkpoints.check_inputs(data=tokens.fingerprint())
    if distributed.world_size() > 1 or distributed.parallel().active:
        run.add(distributed=rank_layout(tokens, batch_size))
    return StartedRun(run, lm, tokens, options, checkpoints)


def open_run(command: str, out: Any, force: bool, *, resume: bool, device: str, estimate: Any,
             batch_size: int | None, units: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The run folder on rank 0 (a :class:`NullRun` on the other ranks, whose stdout goes to /dev/null: one
    console), the process group joined (alone: nothing), the memory estimate and any ``--batch-size auto``
    choice in the manifest; ``units`` (the key of unit checkpoints) -> ``(run, Units | None)``."""
    from moetool import distributed
    from moetool.report.rundir import NullRun, RunDir

    alone = check_resume(resume)
    main = distributed.is_main()
    run = (RunDir.create(command, out, force, resume=resume, resumable=units is not None) if main
           else NullRun(command, out))
    checkpoints = run.units(units) if units is not None and alone else None
    distributed.init(device)  # alone: a no-op; cuda:LOCAL_RANK is then the current CUDA device
    if not main:
        sys.stdout = open(os.devnull, "w")  # one console: rank 0's
    run.add(memory_estimate=estimate.as_dict())
    from moetool.engine.runner import BACKOFF

    if BACKOFF.choice and BACKOFF.choice.get("rows") == batch_size:
        run.add(batch_size_auto=dict(BACKOFF.choice))
    return run, checkpoints


def check_resume(resume: bool) -> bool:
    """True when unit checkpoints are kept: one process. Under ``torchrun`` (world size > 1) none are kept (a
    rank's partial state is not the run's) and ``--resume`` is refused in one line on every rank."""
    from moetool import distributed

    world = distributed.env().world_size
    if resume and world > 1:
        raise MoetoolError(f"--resume is not supported under torchrun (world size {world}): no unit checkpoints are "
                           "kept there; start the run over with --force")
    return world == 1


def unit_key(options: Any) -> dict[str, Any]:
    """The experiment options a resumed run must share (a dataclass or a dict)."""
    import dataclasses

    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)


def rank_layout(tokens: Any, batch_size: int | None) -> dict[str, Any]:
    """The manifest's ``distributed`` section: world size, backend and (with tokens) each rank's rows and real
    tokens, gathered from the ranks themselves (a collective: every rank calls it)."""
    from moetool import distributed

    info: dict[str, Any] = {"world_size": distributed.world_size(), "backend": distributed.backend()}
    par = distributed.parallel()
    if par.active:  # world_size above counts data-parallel groups; each group is tp/ep ranks holding one model
        info.update(tp=par.tp, ep=par.ep, dp=distributed.world_size(), processes=distributed.world_size() * par.group)
    if tokens is not None and batch_size:
        mine = distributed.shard(tokens, batch_size)
        got = distributed.gather_object((int(mine.input_ids.shape[0]), int(mine.n_tokens)))
        info.update(rows_per_rank=[r for r, _ in got], tokens_per_rank=[t for _, t in got],
                    rows_per_global_batch=batch_size * distributed.world_size())
    return info


def run_options(**options: Any) -> dict[str, Any]:
    """The run-level manifest options (model, data, loading); paths as strings. The experiment's own options
    come from its options dataclass (see :func:`moetool.report.writers.write`)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}


def echo_run(path: Any) -> None:
    typer.secho(f"results in {path}", fg="green", err=False)

