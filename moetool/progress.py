"""Progress bars (rich) for long loops; silent when asked or when not on a terminal and quiet."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def _other_rank() -> bool:
    """A data-parallel rank other than 0 (torchrun / accelerate set RANK): one display, rank 0's."""
    return any(os.environ.get(n, "0") not in ("", "0")  # torchrun / accelerate, or mpirun (moetool.distributed)
               for n in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"))


def say(line: str) -> None:
    """One console line on stderr (progress facts: the auto batch size, a back-off, a loading note, intervals from
    too few rows)."""
    print(line, file=sys.stderr, flush=True)


def progress(items: Iterable[T], total: int | None = None, description: str = "working",
             quiet: bool = False) -> Iterator[T]:
    if quiet or _other_rank():
        yield from items
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    # the description is data (a policy spec such as "norm:up:l2"): no markup, no emoji codes
    cols = [TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn()]
    from rich.console import Console

    with Progress(*cols, console=Console(file=sys.stderr, emoji=False), transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


@contextlib.contextmanager
def status(description: str, quiet: bool = False) -> Iterator[None]:
    """A spinner with ``description`` and the elapsed time while a library runs its own loop (lm-eval): the one
    progress display when that library's bars are silenced. Binds to the real stderr on entry, so a caller may
    redirect ``sys.stderr`` inside it. Off a terminal (stderr piped into a log), where a spinner draws nothing, one
    line when the loop has finished, as a progress bar leaves its finished bar: ``<description>: done in 42.1 s``."""
    if quiet or _other_rank():
        yield
        return
    import time

    from rich.console import Console
    from rich.text import Text

    console = Console(file=sys.stderr, emoji=False)
    if console.is_terminal:
        with console.status(Text(description)):
            yield
        return
    stream, t0 = sys.stderr, time.perf_counter()
    yield
    print(f"{description}: done in {time.perf_counter() - t0:.1f} s", file=stream, flush=True)


@contextlib.contextmanager
def logger_level(name: str, level: int) -> Iterator[None]:
    """The ``logging`` logger ``name`` at ``level`` for the block, its own level restored after it: library code
    never changes a user's logging configuration for good."""
    import logging

    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
