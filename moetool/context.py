"""The state of one run that the layers below the run read: no module globals.

A run (:class:`moetool.run.Run`, made by the CLI for each command and by ``moetool.run(...)``) is a :class:`RunState`:

* ``backoff`` (:class:`Backoff`): the ``--batch-size auto`` decision and the forward loop's back-off after an
  out-of-memory (:func:`moetool.engine.runner.forward` halves the rows and goes on; the manifest records it);
* ``layout`` (:class:`Parallel`): ``--tp`` / ``--ep``, how one model is split over a group of ranks
  (:mod:`moetool.distributed` reads it);
* ``policies``: the routing policies built for the run, one build per spec and options
  (:func:`moetool.policies.build_once`);
* ``trust_remote_code``: ``--trust-remote-code``, whether a checkpoint's own code may run where transformers has
  no native class for it (:func:`moetool.loading.trusted`: every config, tokenizer and model the run reads);
* ``dtype_flag``: the flag of the run's command that chooses the dtype its models compute in (``--dtype``;
  agreement's ``--precisions``): what the suggestions after an fp16 overflow or an out-of-memory name
  (:func:`dtype_choice`);
* ``cli``: the run is a command's (the CLI's): a message names an option as its flag (``--seq-len 2048``), else as
  the Python keyword the caller passed (``seq_len=2048``): :func:`flag`.

:func:`moetool.engine.runner.forward` takes the run as ``run=``; code that does not pass one (an experiment's own
forward calls) reads the run of its context, :func:`current`: a :class:`contextvars.ContextVar`, so two runs in two
threads (or asyncio tasks) of one process never see each other's state, and no run at all (a plain
``moetool.ppl(lm, tokens)``) is a fresh :class:`RunState` each time, with back-off off and nothing split.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .errors import MoetoolError


@dataclass
class Backoff:
    """``--batch-size auto``'s second half: on out-of-memory the runner halves the rows of the batch, retries the
    same rows and goes on at the smaller size (later forwards of the run start there)."""

    enabled: bool = False  # --batch-size auto (one process; under torchrun an OOM stays fatal)
    rows: int | None = None  # rows per forward after the last back-off (None: never backed off)
    events: list[int] = field(default_factory=list)  # the row counts that ran out of memory
    choice: dict[str, Any] = field(default_factory=dict)  # the --batch-size auto decision (for the manifest)

    def backed_off(self, rows: int) -> int:
        """``rows`` ran out of memory: the run goes on with half of them (returned)."""
        self.rows = rows // 2
        self.events.append(rows)
        return self.rows

    def manifest(self) -> dict[str, Any] | None:
        """The manifest's ``batch_size_auto`` once the run backed off (the rows that ran), else ``None``."""
        if self.rows is None:
            return None
        return {**self.choice, "rows": self.rows, "out_of_memory_at": list(self.events)}


@dataclass(frozen=True)
class Parallel:
    """How one model is split over a group of ranks: ``tp`` = tensor parallel size (attention heads and expert
    intermediate features split), ``ep`` = expert parallel size (whole experts split instead). transformers needs
    ``ep`` to be 1 or ``tp``: its expert groups are its tensor-parallel groups (the ranks sharing one batch), and
    it refuses a tensor-parallel size without a tensor-parallel plan, so there is no ``--ep`` without ``--tp``.
    A layout that cannot exist is refused here, in one line (its fit to the model: ``distributed.check_parallel``)."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise MoetoolError(f"--tp and --ep take a number of ranks >= 1, not --tp {self.tp} --ep {self.ep}")
        if self.ep > 1 and self.ep != self.tp:
            raise MoetoolError(f"--ep {self.ep} with --tp {self.tp}: transformers splits the experts over the ranks "
                               f"of one tensor parallel group, so --ep must equal --tp (--tp {self.ep} --ep "
                               f"{self.ep}), or be left out (--ep 1)")

    @property
    def group(self) -> int:
        """Ranks holding one copy of the model (they see the same tokens)."""
        return max(self.tp, self.ep)

    @property
    def active(self) -> bool:
        return self.group > 1


@dataclass
class RunState:
    """What one run carries into the engine and the layers below it (see the module docstring)."""

    backoff: Backoff = field(default_factory=Backoff)
    layout: Parallel = field(default_factory=Parallel)
    policies: dict[Any, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    dtype_flag: str = "--dtype"  # the command's flag choosing the dtype (the spec's ``dtype_flag``)
    cli: bool = False  # a command's run: options named as flags (:func:`flag`), else as Python keywords

    def policy(self, key: Any, build: Callable[[], Any]) -> Any:
        """The run's policy for ``key`` (a spec and its options), built by ``build()`` the first time only."""
        if key not in self.policies:
            self.policies[key] = build()
        return self.policies[key]

    @contextlib.contextmanager
    def active(self) -> Iterator["RunState"]:
        """This run is :func:`current` in this context for the block (the previous one after it)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


# torchrun and ``accelerate launch --multi_gpu`` set RANK / WORLD_SIZE / LOCAL_RANK; ``accelerate launch --cpu
# --mpirun_hostfile ...`` starts the ranks with mpirun (Open MPI, MPICH / Intel MPI, MVAPICH names) and sets only
# MASTER_ADDR / MASTER_PORT itself: the same fallbacks accelerate's own PartialState reads (moetool.distributed.env)
_RANK = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
_WORLD = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


def _first(names: tuple[str, ...], default: str) -> str:
    return next((os.environ[n] for n in names if os.environ.get(n)), default)


def launcher_world() -> int:
    """The processes a launcher started (its world size variable; 1 alone or unreadable), without importing torch:
    the CLI's refusal of one-process commands under torchrun (:mod:`moetool.distributed` validates it later)."""
    try:
        return int(_first(_WORLD, "1"))
    except ValueError:
        return 1


#: the run of this context (thread, asyncio task); ``None``: no run
_CURRENT: ContextVar[RunState | None] = ContextVar("moetool_run", default=None)


def current() -> RunState | None:
    """The run in progress in this context, or ``None``."""
    return _CURRENT.get()


def state(run: RunState | None = None) -> RunState:
    """``run``, else the run of this context, else a fresh :class:`RunState` (no back-off, nothing split; not kept)."""
    if run is not None:
        return run
    got = _CURRENT.get()
    return got if got is not None else RunState()


_NO_VALUE = object()


def flag(name: str, value: Any = _NO_VALUE) -> str:
    """The option ``name`` (``"seq_len"`` or ``"--seq-len"``) as a message names it to the user of the run of this
    context: on the command line (:attr:`RunState.cli`) its flag, ``--seq-len`` (with ``value``: ``--seq-len
    2048``); in Python the keyword passed, ``seq_len=`` (``seq_len=2048``, ``layers=[5, 6]``). A string ``value``
    is shown as it is in both (a number formatted by the caller, ``f"{eps:g}"``)."""
    key = name.lstrip("-").replace("-", "_")
    if state().cli:
        shown = "--" + key.replace("_", "-")
        return shown if value is _NO_VALUE else f"{shown} {value}"
    return f"{key}=" if value is _NO_VALUE else f"{key}={value if isinstance(value, str) else repr(value)}"


def dtype_choice(dtypes: str | None = None) -> str:
    """The change of dtype a suggestion names, in the option of the run of this context that chooses it
    (:attr:`RunState.dtype_flag`, as :func:`flag` names it): ``dtypes`` (``"bf16 or fp32"``) as ``--dtype bf16 or
    fp32`` (Python: ``dtype='bf16' or dtype='fp32'``), or ``bf16 or fp32 in --precisions`` (agreement: its models
    load in the dtypes of that list; ``precisions=``); ``None``: a smaller dtype, ``a smaller --dtype`` / ``a
    smaller dtype in --precisions``."""
    run = state()
    if run.dtype_flag == "--dtype":
        if not dtypes:
            return f"a smaller {flag('dtype')}" if run.cli else "a smaller dtype (dtype=)"
        return flag("dtype", dtypes) if run.cli else " or ".join(flag("dtype", repr(d)) for d in dtypes.split(" or "))
    return f"{dtypes or 'a smaller dtype'} in {flag(run.dtype_flag)}"
