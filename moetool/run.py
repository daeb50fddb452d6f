"""A run: what the CLI and ``moetool.run(...)`` do around an experiment's compute function.

``moetool.run(experiment, lm, tokens=None, options=None, *, out=None, force=False, batch_size=None, resume=False,
...)`` is ``moetool <experiment>`` from Python: :func:`run` below says what each parameter does
(``help(moetool.run.run)``); ``inspect.signature(moetool.run)`` is its signature.

Preflight (the model resolved from its config), the checks before anything loads (sizes, positions, device,
memory: :func:`check_run`), the run folder (:func:`open_run`: refused when busy, ``--resume`` of an unfinished one
with unit checkpoints), ``--batch-size auto`` (:func:`resolve_batch_size`; the back-off after an out-of-memory
lives in the run's state), the distributed layout (``--tp`` / ``--ep``, each rank's rows in the manifest:
:func:`rank_layout`) and the one writer call (:func:`write_result`).

:class:`Run` is one run's state (a :class:`moetool.context.RunState`: back-off, layout, the policies built once);
it is active in its context for the run's duration, so :func:`moetool.engine.runner.forward` and
:mod:`moetool.distributed` read it without module globals, and two runs in two threads never share it. A loaded
model is held by one run at a time (:func:`moetool.engine.hooks.hold`, in :func:`moetool.api._timed`): its hooks
are installed on the model, so a second run of it from another thread is refused in one line.

:func:`run` is the Python equivalent of ``moetool <experiment>`` on a loaded model and tokens::

    res = moetool.run("stats", lm, tokens, out="runs/stats", batch_size="auto", resume=True)

The commands (``commands/``) parse flags and call into here. Nothing here imports torch at import time
(``moetool --help`` stays fast).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .context import Backoff, Parallel, RunState, current, state
from .errors import MoetoolError, shown
from .progress import say

DEFAULT_MODEL = "tiny"  # mirrors moetool.loading.DEFAULT_MODEL without importing it


@dataclass
class Run(RunState):
    """One run of a command or of :func:`run`: its name and the state the engine reads (``backoff`` with
    ``--batch-size auto``, ``layout`` with ``--tp`` / ``--ep``, ``policies`` built once). ``with run.active():``
    makes it the run of this context (:func:`moetool.context.current`)."""

    command: str = ""

    @classmethod
    def new(cls, command: str, *, tp: int = 1, ep: int = 1, auto_batch: bool = False,
            trust_remote_code: bool = False, cli: bool = False) -> "Run":
        """A run of ``command`` (``cli``: the command line's, its messages naming flags); a layout that cannot exist
        (``--ep`` other than ``--tp``) is one line here."""
        return cls(backoff=Backoff(enabled=auto_batch), layout=Parallel(tp, ep), command=command,
                   trust_remote_code=bool(trust_remote_code), cli=cli)


# ----- before anything loads -----------------------------------------------------------------------------------
def refuse_busy_out(params: dict[str, Any], command: str = "<command>") -> None:
    """A command's ``--out`` that is a file or lies under one (even with ``--force``), or that holds files and no
    moetool run, or a complete one, without ``--force`` or ``--resume``: refused now, before any heavy import (torch
    takes seconds to import) or any model loads. Every other case (a failed or unfinished run, ``--force``,
    ``--resume``) is decided where the run starts (:meth:`moetool.report.RunDir.create`, which gives the same
    messages for these)."""
    from .report.rundir import PART, read_manifest, refuse_empty_out, refuse_not_a_folder

    out = params.get("out")
    refuse_empty_out(out, command)
    if not out:
        return

    path = Path(out)
    refuse_not_a_folder(path)
    if params.get("force") or params.get("resume"):
        return
    if not path.is_dir() or not any(not p.name.startswith(PART) for p in path.iterdir()):
        return
    prev = read_manifest(path)
    if prev is None or prev.get("status") == "complete":
        raise MoetoolError(f"--out {path} is not empty (use --force to write into it)")


def preflight(*models: str) -> None:
    """Resolve every ``--model`` (embedded name, alias, directory, hub id) from its config alone, before a command
    imports its experiment (and torch): an unknown name, a dense model or an uncached hub id without network fails
    in about a second of the whole process instead of after the imports (a model on disk whose config passed the
    checks before: from the per-installation cache, :func:`moetool.loading.check_model`)."""
    from .loading import check_model, resolve

    kinds = {m: resolve(m)[1] for m in models}  # names alone: an unknown one fails here
    for model in sorted(models, key=lambda m: kinds[m] not in ("hub", "alias")):  # the ones that may need the Hub
        check_model(model)


def check_run(model: str, *, seq_len: int | None = None, batch_size: int | None = None,
              max_tokens: int | None = None, device: str = "auto", dtype: str = "auto", device_map: str | None = None,
              attn_implementation: str | None = None, quantize: str | None = None) -> Any:
    """``sizing.validate_run`` on the model's config: bad sizes, too long --seq-len, no such device, not enough
    memory fail with one line before any weight loads or any run folder exists. Returns the ``RunEstimate``."""
    from .loading import load_config
    from .sizing import validate_run

    config, _, _ = load_config(model)
    return validate_run(config, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens, device=device,
                        dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
                        quantize=quantize)


# ----- --batch-size auto -----------------------------------------------------------------------------------------
def routing_policies(routing: Any) -> list[Any]:
    """The policy classes of a ``--routing`` value (one spec, or a comma-separated list of them): what they declare
    they need (``needs_attention``, ``needs_probe``) is what ``--batch-size auto`` sizes for, without building them."""
    if not routing:
        return []
    from .policies import POLICIES

    names = [s.strip().split(":", 1)[0] for s in str(routing).split(",") if s.strip()]
    return [POLICIES.get(n) for n in names if n in POLICIES.names()]


def resolve_batch_size(params: dict[str, Any], run: RunState | None = None) -> int:
    """``--batch-size auto`` from a command's own options: :func:`moetool.sizing.auto_batch_size` (sized for what the
    ``--routing`` policies need; under ``--tp`` / ``--ep`` the rows of one model group, from the memory each rank has
    beside its share of the weights, the data split over the data-parallel groups only), the minimum over ranks under
    torchrun (every rank must cut the same global batches), one console line. The decision is kept for the manifest
    in the run's ``backoff.choice``."""
    from . import distributed, sizing

    run = state(run)
    resumed = resumed_rows(params.get("out"), params.get("resume"))
    if resumed is not None:
        return resumed_choice(resumed, run)
    model = params.get("model") or params.get("model_arg") or (params.get("checkpoints") or [DEFAULT_MODEL])[0]
    e = distributed.env()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", e.world_size))
    layout = run.layout  # --tp/--ep: a model group's ranks run the same rows, each holding its share of the weights
    rows, facts = sizing.auto_batch_size(model, seq_len=params.get("seq_len"), max_tokens=params.get("max_tokens"),
                                         device=params.get("device") or "auto", dtype=params.get("dtype") or "auto",
                                         device_map=params.get("device_map"),
                                         policies=routing_policies(params.get("routing")), processes=processes,
                                         world=max(1, e.world_size // layout.group), quantize=params.get("quantize"),
                                         tp=layout.tp, ep=layout.ep)
    if e.distributed:
        import torch

        distributed.init(params.get("device") or "auto")
        rows = int(distributed.all_reduce_world(torch.tensor(rows), "min"))  # a model group shares its batch
        facts["rows"] = rows
    run.backoff.choice = facts
    if e.rank == 0:
        announce_batch_size(rows, facts)
    return rows


def resumed_rows(out: Any, resume: Any) -> int | None:
    """``--batch-size auto`` with ``--resume``: the rows per forward the interrupted run in ``out`` started with (its
    unit checkpoints' ``key.json``), not a new choice from the free memory now, which may differ and would refuse the
    resume (its options must be the run's); ``None`` when not resuming or the run recorded none."""
    from .checkpoints import UNITS

    if not resume or out is None:
        return None
    try:
        key = json.loads((Path(out) / UNITS / "key.json").read_text())
    except (OSError, ValueError):
        return None  # no checkpoint to continue: the resume itself says so
    rows = key.get("batch_size") if isinstance(key, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1 else None


def resumed_choice(rows: int, run: RunState) -> int:
    """The auto batch decision of a resumed run (:func:`resumed_rows`), announced and kept for the manifest."""
    from . import distributed

    run.backoff.choice = {"rows": rows, "reason": "the interrupted run's choice, kept by --resume"}
    if distributed.env().rank == 0:
        say(f"--batch-size auto: {rows} rows per forward (the interrupted run's choice, kept by --resume)")
    return rows


def announce_batch_size(rows: int, facts: dict[str, Any]) -> None:
    free = facts.get("free_bytes")
    say(f"--batch-size auto: {rows} rows per forward ({facts['reason']}; "
        f"{'?' if free is None else f'{free / 2**30:.1f} GiB'} free on {facts['device']})")


# ----- the run folder, the model, the tokens ---------------------------------------------------------------------
class StartedRun:
    """What :func:`start_run` made: the run folder, the model, the tokens (``None`` without ``seq_len``) and the
    run-level manifest options. Unpacks as ``run, lm, tokens``; ``write(result)`` is the one writer call."""

    def __init__(self, run: Any, lm: Any, tokens: Any, options: dict[str, Any], units: Any = None,
                 state: RunState | None = None):
        self.run, self.lm, self.tokens, self.options = run, lm, tokens, options
        self.units = units  # moetool.checkpoints.Units: finished units kept for --resume (None: not asked)
        self.state = state  # the Run (back-off, layout); None: the run of the context

    def __iter__(self) -> Any:
        return iter((self.run, self.lm, self.tokens))

    def write(self, result: Any, **kwargs: Any) -> Any:
        """:func:`write_result` with this run's model, run-level options and state."""
        return write_result(result, self.run, model=self.lm, options=self.options, state=self.state, **kwargs)


def write_result(result: Any, run: Any, *, state: RunState | None = None, **kwargs: Any) -> Any:
    """The one writer call of every run: :func:`moetool.report.writers.write`, the ``--batch-size auto``
    back-off of the run (the rows that ran after an out-of-memory) recorded in the manifest first."""
    from .context import state as run_state
    from .report.writers import write

    backed_off = run_state(state).backoff.manifest()
    if backed_off is not None:  # --batch-size auto backed off on out-of-memory: the rows that ran
        run.add(batch_size_auto=backed_off)
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
    from . import distributed
    from .data import DocumentStream, load_tokens
    from .loading import check_quantize, load, weights_fingerprint

    check_quantize(quantize, device)  # --quantize on CPU: one line before anything
    attn = "eager" if attention else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if device_map and per_node > 1:  # every rank would spread its own copy over the same GPUs
        raise MoetoolError(f"--device-map spreads one model over this node's GPUs: launch one process per node "
                           f"(torchrun --nproc-per-node 1), not {per_node}")
    if distributed.parallel().active:  # --tp / --ep: a layout that cannot work is one line before any folder
        from .loading import load_config

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
    if checkpoints is not None:  # --dtype/--device auto resolve per machine: the key keeps 'auto', not what loaded
        checkpoints.check_inputs(precision=str(lm.dtype).removeprefix("torch."), device=lm.device.type)
    note = lm.quantization().get("note")
    if note and distributed.rank() == 0:
        say(f"note: {note}")
    tokens = (load_tokens(data, lm.tokenizer, seq_len, max_tokens, add_special_tokens=add_special_tokens)
              if seq_len is not None else None)
    _say_unpacked(tokens, data)
    if checkpoints is not None and tokens is not None:  # --resume: refused when other data was read
        checkpoints.check_inputs(data=tokens.fingerprint())
    if distributed.world_size() > 1 or distributed.parallel().active:
        run.add(distributed=rank_layout(tokens, batch_size))
    return StartedRun(run, lm, tokens, options, checkpoints, state=state())


def _say_unpacked(tokens: Any, data: Any) -> None:
    """A line on the console (rank 0) for each domain of the user's ``--data`` that got no row
    (:func:`data.unpacked_lines`). The shipped held-out text (``data`` None) says nothing: its two domains are no
    choice of the user's, and a small ``--max-tokens`` fills its first row with code."""
    from . import distributed
    from .data import unpacked_lines

    if data is not None and distributed.rank() == 0:
        for line in unpacked_lines(tokens):
            say(line)


def open_run(command: str, out: Any, force: bool, *, resume: bool, device: Any, estimate: Any,
             batch_size: int | None, units: dict[str, Any] | None = None,
             run: RunState | None = None) -> tuple[Any, Any]:
    """The run folder on rank 0 (a :class:`NullRun` on the other ranks, whose stdout goes to /dev/null: one
    console), the process group joined (alone: nothing), the memory estimate and the run's ``--batch-size auto``
    choice in the manifest; ``units`` (the key of unit checkpoints) -> ``(run folder, Units | None)``."""
    from . import distributed
    from .report.rundir import NullRun, RunDir

    alone = check_resume(resume)
    main = distributed.is_main()
    folder = (RunDir.create(command, out, force, resume=resume, resumable=units is not None) if main
              else NullRun(command, out))
    checkpoints = folder.units(units) if units is not None and alone else None
    distributed.init(str(device))  # alone: a no-op; cuda:LOCAL_RANK is then the current CUDA device
    if not main:
        sys.stdout = open(os.devnull, "w")  # one console: rank 0's
    folder.add(memory_estimate=estimate.as_dict())
    choice = state(run).backoff.choice
    if choice and choice.get("rows") == batch_size:
        folder.add(batch_size_auto=dict(choice))
    return folder, checkpoints


def check_resume(resume: bool) -> bool:
    """True when unit checkpoints are kept: one process. Under ``torchrun`` (world size > 1) none are kept (a
    rank's partial state is not the run's) and ``--resume`` is refused in one line on every rank."""
    from . import distributed

    world = distributed.env().world_size
    if resume and world > 1:
        raise MoetoolError(f"--resume is not supported under torchrun (world size {world}): no unit checkpoints are "
                           "kept there; start the run over with --force")
    return world == 1


def unit_key(options: Any) -> dict[str, Any]:
    """The experiment options a resumed run must share (a dataclass or a dict)."""
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)


def rank_layout(tokens: Any, batch_size: int | None) -> dict[str, Any]:
    """The manifest's ``distributed`` section: world size, backend and (with tokens) each rank's rows and real
    tokens, gathered from the ranks themselves (a collective: every rank calls it)."""
    from . import distributed

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
    """The run-level manifest options (model, data, loading; ``trust_remote_code`` when the run trusts a
    checkpoint's code, :func:`moetool.loading.trusted`); paths as strings. The experiment's own options come from its
    options dataclass (see :func:`moetool.report.writers.write`)."""
    from .loading import trusted

    return {**{k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
            **({"trust_remote_code": True} if trusted() else {})}


# ----- moetool.run(...) -------------------------------------------------------------------------------------------
#: loading keywords of :func:`run` with a model's name (they also fill option fields of the same name: an
#: experiment that loads its checkpoints itself, e.g. fluctuation, keeps them in its options)
LOADING = ("dtype", "device", "device_map", "quantize")


def run(experiment: str, lm: Any, tokens: Any = None, options: Any = None, *, out: str | Path | None = None,
        force: bool = False, batch_size: int | str | None = None, resume: bool = False, quiet: bool = False,
        data: Any = None, seq_len: int | None = None, max_tokens: int | None = None, dtype: Any = "auto",
        device: str = "auto", device_map: str | None = None, quantize: str | None = None,
        trust_remote_code: bool = False, add_special_tokens: bool | None | str = "command",
        manifest: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None, call: Any = None,
        **overrides: Any) -> Any:
    """``moetool <experiment>``, from Python: the run every command makes.

    ``experiment`` is a command name (``"stats"``, ``"expert-similarity"``) or its function's; ``options`` the
    experiment's options dataclass, or its fields as keywords. ``lm`` is either

    * a **model's name** (embedded name, alias, directory, hub id; a list of them for ``fluctuation``): the run
      does what the command does -- the sizes, positions and memory checked from the config before anything loads
      (:func:`check_run`), the run folder, the model loaded (``dtype``, ``device``, ``device_map``, ``quantize``,
      ``trust_remote_code`` as ``--trust-remote-code``: :func:`moetool.loading.read_config`; eager attention where
      the options' policies read attention) and ``max_tokens`` of ``data`` packed in rows of ``seq_len`` -- not
      given, the command's defaults (:func:`text_defaults`: the shipped held-out text, 256, and
      8192 tokens or the experiment's own, 32768 for ppl and stats); a size given is checked as the command checks
      it (0 included); or
    * a **loaded model** (:func:`moetool.load`) with ``tokens`` packed rows (:func:`moetool.tokens`; not for
      experiments of the weights alone).

    ``batch_size``: rows per forward (default: the options' own) or ``"auto"`` (the largest the free memory holds,
    backing off on out-of-memory as the CLI does; the manifest records it). ``out`` must be free (or ``force``);
    ``resume=True`` continues the unfinished run in ``out`` from its unit checkpoints (experiments that keep them:
    same options, model -- a loaded one in the same dtype, device and quantization -- and tokens, else one error).
    Writes the command's files (CSVs, figures, manifest.json) into ``out`` (default ``runs/<experiment>-<time>``)
    and returns the :class:`~moetool.experiments.result.Result`, its ``path`` the run folder. The command line
    adds: ``manifest`` (run-level manifest options of its own flags), ``inputs`` (keywords of the compute function:
    a task plan, reference tokens) and ``call`` (``call(compute, args, kwargs, folder) -> Result``: the compute call
    made by the command, e.g. streaming into the run folder).
    ``add_special_tokens`` (a model's name): the text tokenized as the command does (``"command"``: the spec's
    ``special_tokens``; stats: the tokenizer's own default, a BOS where it adds one, recorded in the manifest), or
    ``True`` / ``False`` / ``None`` (the tokenizer's default).
    """
    from .experiments.registry import get
    from .experiments.result import resolve_options

    # before the experiment's imports and model
    refuse_busy_out({"out": out, "force": force, "resume": resume}, str(experiment).replace("_", "-"))
    spec = get(experiment)
    if spec.inputs == "config":  # plan: a config alone, no weights, no text
        with _this_run(spec.name, False, trust_remote_code).active():
            return _run_config(spec, lm, tokens, options, out=out, force=force, batch_size=batch_size, resume=resume,
                               data=data, seq_len=seq_len, max_tokens=max_tokens, overrides=overrides)
    auto = isinstance(batch_size, str)
    if auto and batch_size.strip().lower() != "auto":
        raise MoetoolError(f"batch_size='{batch_size}' is neither a number of rows nor 'auto'")
    compute = spec.load()
    resumable = "units" in inspect.signature(compute).parameters
    if resume and not resumable:
        raise MoetoolError(f"'{spec.name}' keeps no unit checkpoints: resume=True is not supported there")
    named = isinstance(lm, (str, Path)) or (isinstance(lm, (list, tuple)) and all(isinstance(m, (str, Path))
                                                                                for m in lm))
    if named and tokens is not None:  # never read: the run would score its own --data, not these tokens
        raise MoetoolError(f"moetool.run('{spec.name}', ...) reads the text itself for a model's name (data=..., "
                           f"seq_len=..., max_tokens=...): tokens go with a loaded model (moetool.load(...))")
    if add_special_tokens == "command":
        add_special_tokens = spec.special_tokens
    elif not (add_special_tokens is None or isinstance(add_special_tokens, bool)):
        raise MoetoolError(f"add_special_tokens must be True, False, None or 'command', not {add_special_tokens!r}")
    if named and spec.special_tokens is None:  # the command exposes the choice: the manifest (and --resume) keep it
        manifest = {"special_tokens": {None: "tokenizer default", False: "none", True: "added"}[add_special_tokens],
                    **(manifest or {})}
    from .loading import dtype_name

    # a torch dtype or a long name ("bfloat16") as its --dtype choice: the manifest and a resume's key read the same
    loading = dict(dtype=dtype_name(dtype), device=device, device_map=device_map, quantize=quantize)
    if named:
        fields = {f.name for f in dataclasses.fields(spec.options_class())} if spec.options else set()
        overrides = {**{k: v for k, v in loading.items() if k in fields and k not in overrides}, **overrides}
    elif data is not None or seq_len is not None or max_tokens is not None or trust_remote_code or \
            any(v != run_default for v, run_default in zip(loading.values(), ("auto", "auto", None, None))):
        raise MoetoolError("data, seq_len, max_tokens and the loading keywords go with a model's name; a loaded "
                           "model runs on the tokens given")
    opts = resolve_options(spec.options_class(), options, overrides) if spec.options else None
    if auto and not hasattr(opts, "batch_size"):
        raise MoetoolError(f"'{spec.name}' runs no batches: batch_size='auto' does not apply")
    this = _this_run(spec.name, auto, trust_remote_code)
    this.dtype_flag = spec.dtype_flag  # what an fp16 overflow's or an out-of-memory's suggestion names
    with this.active():
        if named:
            return _run_named(spec, compute, lm, opts, this, resumable=resumable, out=out, force=force,
                              batch_size=batch_size, resume=resume, quiet=quiet, data=data, seq_len=seq_len,
                              max_tokens=max_tokens, loading=loading, add_special_tokens=add_special_tokens,
                              manifest=manifest or {}, inputs=inputs or {}, call=call)
        return _run_loaded(spec, compute, lm, tokens, opts, this, resumable=resumable, out=out, force=force,
                           batch_size=batch_size, resume=resume, quiet=quiet, manifest=manifest or {},
                           inputs=inputs or {}, call=call)


def _this_run(name: str, auto: bool, trust_remote_code: bool) -> Run:
    """The run of the command calling :func:`run` (its --tp/--ep layout, its --batch-size auto, its
    --trust-remote-code), if any, trusting the checkpoint's code when ``trust_remote_code`` asks; else a new one."""
    this = current() or Run.new(name, auto_batch=auto, trust_remote_code=trust_remote_code)
    this.trust_remote_code = this.trust_remote_code or bool(trust_remote_code)
    return this


def _run_config(spec: Any, model: Any, tokens: Any, options: Any, *, out: Any, force: bool, batch_size: Any,
                resume: bool, data: Any, seq_len: int | None, max_tokens: int | None,
                overrides: dict[str, Any]) -> Any:
    """:func:`run` of an experiment of a model's config alone (``plan``: no weight or text is read): the command's
    flags as keywords (``gpus``, ``nodes``, ``seq_len``, ``batch_size``; its defaults where not given), each checked
    as the command checks it, the run folder, the result written with the model -- what ``moetool plan`` does."""
    from .report import RunDir

    flags = {f.name: f for f in spec.command_flags() if f.name != "json"}  # --json prints instead of writing
    given = {"seq_len": seq_len, "batch_size": batch_size, **overrides}
    bad = sorted(k for k, v in given.items() if k not in flags and v is not None)
    wrong = [k for k, v in (("tokens", tokens), ("options", options), ("data", data), ("max_tokens", max_tokens))
             if v is not None] + (["resume"] if resume else [])
    if bad or wrong:
        raise MoetoolError(f"'{spec.name}' reads a config alone: {', '.join(wrong + bad)} do not apply (it takes "
                           f"{', '.join(flags)})")
    if not isinstance(model, (str, Path)):
        raise MoetoolError(f"moetool.run('{spec.name}', ...) takes a model's name (embedded, alias, directory, hub "
                           f"id), not {shown(model)}")
    values = {name: flag.default if given.get(name) is None else given[name] for name, flag in flags.items()}
    if isinstance(values["batch_size"], str):
        raise MoetoolError(f"'{spec.name}' runs no batches: batch_size='{values['batch_size']}' does not apply "
                           "(a number of rows the commands would run)")
    for name, flag in flags.items():
        flag.check(values[name])
    compute = spec.load()
    spec.load("parse_gpus")(values["gpus"])  # a bad --gpus fails before the config is read
    preflight(str(model))
    folder = RunDir.create(spec.name, out, force)  # a busy --out fails before the work
    this = current() or Run.new(spec.name)
    with this.active():
        return _compute_and_write(compute, (str(model), values["gpus"], values["nodes"]),
                                  {"seq_len": values["seq_len"], "rows": values["batch_size"]}, folder, None, this,
                                  {"model": str(model)}, None)


def _compute_and_write(compute: Any, args: tuple[Any, ...], kwargs: dict[str, Any], folder: Any, call: Any,
                       this: "Run", options: dict[str, Any], model: Any, before: Any = None) -> Any:
    """The end every run shares, inside the run folder (an error marks it failed): ``before()`` (checks), the
    compute call (``call`` the command's own way of making it), timed (:func:`moetool.api._timed`), written with the
    run-level ``options`` (``model``: the loaded model for the manifest, ``None`` where the experiment loads its
    own)."""
    from .api import _timed

    with folder if hasattr(type(folder), "__exit__") else contextlib.nullcontext():
        if before is not None:
            before()
        res = (_timed(args[0], compute, *args, **kwargs) if call is None
               else _timed(args[0], call, compute, args, kwargs, folder))
        write_result(res, folder, state=this, **({} if model is None else {"model": model}), options=options)
    res.path = folder.path
    return res


def _run_loaded(spec: Any, compute: Any, lm: Any, tokens: Any, opts: Any, this: "Run", *, resumable: bool, out: Any,
                force: bool, batch_size: Any, resume: bool, quiet: bool, manifest: dict[str, Any],
                inputs: dict[str, Any], call: Any) -> Any:
    """:func:`run` on a loaded model and its tokens."""
    from . import distributed
    from .api import check_inputs
    from .sizing import validate_run

    if spec.inputs not in ("tokens", "weights", "model"):
        raise MoetoolError(f"moetool.run runs '{spec.name}' on the names of its {spec.inputs}: "
                           f"moetool.run('{spec.name}', [name, ...], data=...)")
    check_inputs(spec, lm, tokens, call=f"moetool.run('{spec.name}', ...)")  # a path or text: one line
    if spec.inputs == "tokens" and tokens is None:
        from .data import packing_hint

        raise MoetoolError(f"'{spec.name}' needs tokens: {packing_hint(lm, f'moetool.run({spec.name!r}, lm, {{}})')}")
    resumed = resumed_rows(out, resume) if isinstance(batch_size, str) else None
    rows = (batch_size if not isinstance(batch_size, str) else resumed_choice(resumed, this) if resumed is not None
            else auto_rows(lm, tokens, opts, this))
    if rows is not None and hasattr(opts, "batch_size"):
        opts = dataclasses.replace(opts, batch_size=rows)
    rows = getattr(opts, "batch_size", rows)
    seq_len = int(tokens.input_ids.shape[1]) if tokens is not None else None
    est = validate_run(lm.config, seq_len=seq_len, batch_size=rows, device=lm.device, dtype=lm.dtype,
                       weights_loaded=True)
    options_run = run_options(model=lm.name, **({"data": tokens.source, "seq_len": seq_len,
                                                 "max_tokens": tokens.n_tokens} if tokens is not None else {}),
                              dtype=str(lm.dtype).replace("torch.", ""), device=str(lm.device), **manifest)
    # a loaded model's precision, device and --quantize are no option of the experiment's: the key keeps them, so a
    # resume with the model loaded otherwise (fp32 units + bf16 batches) is refused, as the command line refuses it
    key = ({"model": lm.name, "dtype": options_run["dtype"], "device": options_run["device"],
            "quantize": getattr(lm, "quantize", None), **manifest, **unit_key(opts)} if resumable else None)
    folder, units = open_run(spec.name, out, force, resume=resume, device=lm.device, estimate=est, batch_size=rows,
                             units=key, run=this)

    def before() -> None:
        if units is not None:  # resume: refused when the weights or the tokens differ from the run's
            from .loading import weights_fingerprint

            units.check_inputs(model=weights_fingerprint(lm.name))
            if tokens is not None:
                units.check_inputs(data=tokens.fingerprint())
        if distributed.world_size() > 1:
            folder.add(distributed=rank_layout(tokens, rows))

    args = (lm, tokens, opts) if spec.inputs == "tokens" else (lm, opts)
    return _compute_and_write(compute, args, {"quiet": quiet, **inputs, **({"units": units} if resumable else {})},
                              folder, call, this, options_run, lm, before)


def _run_named(spec: Any, compute: Any, names: Any, opts: Any, this: "Run", *, resumable: bool, out: Any,
               force: bool, batch_size: Any, resume: bool, quiet: bool, data: Any, seq_len: int | None,
               max_tokens: int | None, loading: dict[str, Any], add_special_tokens: bool | None,
               manifest: dict[str, Any], inputs: dict[str, Any], call: Any) -> Any:
    """:func:`run` on a model's name (a list of them for checkpoints): checked, folder made, loaded, computed,
    written -- what a command does."""
    many = isinstance(names, (list, tuple))
    if many != (spec.inputs == "checkpoints"):
        raise MoetoolError(f"'{spec.name}' runs on " + ("two or more checkpoints: a list of names" if not many
                                                          else "one model: a name, not a list"))
    models = [str(m) for m in names] if many else [str(names)]
    reads = spec.inputs in ("tokens", "checkpoints")
    given = [k for k, v in (("data", data), ("seq_len", seq_len), ("max_tokens", max_tokens)) if v is not None]
    if given and not reads:  # never read: a silently ignored --data would describe text the run never saw
        raise MoetoolError(f"'{spec.name}' reads no text ({'the weights alone' if spec.inputs == 'weights' else 'its own'}"
                           f"): {', '.join(given)} do not apply")
    if reads:  # the command's defaults; a value given (0 too) is checked as the command checks it (check_run)
        sizes = text_defaults(spec)
        seq_len = sizes["seq_len"] if seq_len is None else seq_len
        max_tokens = sizes["max_tokens"] if max_tokens is None else max_tokens
        from .sizing import check_sizes

        check_sizes(seq_len=seq_len, max_tokens=max_tokens)
    else:
        seq_len = max_tokens = None
    preflight(*models)
    if spec.inputs == "checkpoints":  # they agree (configs, vocabularies) before any weight loads or run folder
        spec.load("check_checkpoints")(models)
    if isinstance(batch_size, str):  # "auto": from the config, as the command line decides it
        batch_size = resolve_batch_size({"model": models[0], "seq_len": seq_len, "max_tokens": max_tokens,
                                         "routing": getattr(opts, "routing", None), "out": out, "resume": resume,
                                         **loading}, this)
    if batch_size is not None and hasattr(opts, "batch_size"):
        opts = dataclasses.replace(opts, batch_size=batch_size)
    rows = getattr(opts, "batch_size", batch_size)
    attention = needs_attention(opts)
    key = {**manifest, **unit_key(opts)} if resumable else None
    if spec.inputs == "checkpoints" or not spec.loads_model:
        folder, lm, tokens, units, options_run = _start_names(spec, models, opts, out, force, resume=resume,
                                                               data=data, seq_len=seq_len, max_tokens=max_tokens,
                                                               rows=rows, loading=loading, attention=attention,
                                                               key=key, add_special_tokens=add_special_tokens)
        options_run.update(manifest)
    else:
        started = start_run(spec.name, out, force, models[0], data=data, seq_len=seq_len, max_tokens=max_tokens,
                            batch_size=rows, **loading, attention=attention,
                            tokenizer=spec.inputs != "weights", add_special_tokens=add_special_tokens,
                            resume=resume, units=key)
        folder, lm, tokens, units = started.run, started.lm, started.tokens, started.units
        options_run = {**started.options, **manifest}
    args = (lm, tokens, opts) if reads else (lm, opts)
    res = _compute_and_write(compute, args, {"quiet": quiet, **inputs, **({"units": units} if resumable else {})},
                             folder, call, this, options_run, None if isinstance(lm, (str, list)) else lm)
    res.tokens = tokens
    return res


def text_defaults(spec: Any) -> dict[str, Any]:
    """``data``, ``seq_len``, ``max_tokens`` a run of ``spec`` by name reads when not given: its command's defaults
    (:func:`moetool.defaults.text_sizes`, the spec's ``defaults`` over the standard flags')."""
    from .defaults import text_sizes

    return text_sizes(spec.defaults)


def needs_attention(opts: Any) -> bool:
    """Whether the options' routing reads attention probabilities (the model then loads with eager attention):
    the options say so (``needs_attention``), else their ``routing`` policies declare it."""
    said = getattr(opts, "needs_attention", None)
    if said is not None:
        return bool(said)
    return any(p.needs_attention for p in routing_policies(getattr(opts, "routing", None)))


def _start_names(spec: Any, models: list[str], opts: Any, out: Any, force: bool, *, resume: bool, data: Any,
                 seq_len: int | None, max_tokens: int | None, rows: int | None, loading: dict[str, Any],
                 attention: bool, key: dict[str, Any] | None, add_special_tokens: bool | None) -> tuple[Any, ...]:
    """The start of an experiment that loads its models itself (checkpoints one at a time, a model once per
    precision): checks on the first model's config, the run folder, the tokens with the first model's tokenizer;
    the names are what the compute function gets."""
    from . import distributed
    from .data import DocumentStream, load_tokens
    from .loading import load_tokenizer

    DocumentStream(data)  # a missing --data fails before anything is loaded
    est = check_run(models[0], seq_len=seq_len, batch_size=rows, max_tokens=max_tokens, device=loading["device"],
                    dtype=loading["dtype"], device_map=loading["device_map"], quantize=loading["quantize"],
                    attn_implementation="eager" if attention else None)
    sizes = dict(data=data, seq_len=seq_len, max_tokens=max_tokens)
    options = run_options(**({"checkpoints": models} if spec.inputs == "checkpoints" else {"model": models[0]}),
                          **sizes)
    folder, units = open_run(spec.name, out, force, resume=resume, device=loading["device"], estimate=est,
                             batch_size=rows, units=None if key is None else {**options, **key})
    tokens = load_tokens(data, load_tokenizer(models[0]), seq_len, max_tokens, add_special_tokens=add_special_tokens)
    _say_unpacked(tokens, data)
    if units is not None:  # --resume: refused when the data or a model's weights differ from what the run read
        from .loading import load_config, pick_device, pick_dtype, weights_fingerprint

        # --dtype/--device auto resolve per machine: the precision each checkpoint loads in, not only 'auto'
        dev = pick_device(loading["device"])
        units.check_inputs(data=tokens.fingerprint(), model=[weights_fingerprint(c) for c in models],
                           precision=[str(pick_dtype(loading["dtype"], load_config(c)[0], dev)).removeprefix("torch.")
                                      for c in models], device=dev.type)
    if distributed.world_size() > 1:
        folder.add(distributed=rank_layout(tokens, rows))
    return folder, (models if spec.inputs == "checkpoints" else models[0]), tokens, units, options


def auto_rows(lm: Any, tokens: Any, opts: Any, run: Run) -> int:
    """``batch_size="auto"`` on a loaded model: the rows the free memory left beside its weights holds
    (:func:`moetool.sizing.auto_rows`, sized for the options' routing policies), the same on every rank."""
    from . import distributed, sizing

    seq_len = int(tokens.input_ids.shape[1]) if tokens is not None else None
    rows, facts = sizing.auto_rows(lm.config, device=lm.device, dtype=lm.dtype, seq_len=seq_len,
                                   max_tokens=None if tokens is None else int(tokens.input_ids.shape[0]) * seq_len,
                                   params=None, policies=routing_policies(getattr(opts, "routing", None)),
                                   world=distributed.world_size())
    if distributed.world_size() > 1:
        import torch

        rows = int(distributed.all_reduce_world(torch.tensor(rows), "min"))
        facts["rows"] = rows
    run.backoff.choice = facts
    return rows


class _CallableModule(type(sys)):  # type: ignore[misc]
    """``moetool.run`` is both this module and :func:`run`: once the module is imported it is the package's
    attribute ``run``, so calling it calls :func:`run`, and its signature is :func:`run`'s (``inspect.signature``,
    a notebook's ``moetool.run?`` and an editor's hints showed ``(*args, **kwargs)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(run)


_CallableModule.__call__.__doc__ = run.__doc__  # what a notebook shows as the call's docstring


sys.modules[__name__].__class__ = _CallableModule
