"""Files written whole or not at all (:func:`atomic_path`: a temporary name beside the target, renamed at the end),
and values made JSON-safe for them (:func:`jsonable`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

PART = ".part-"  # prefix of a file being written

@contextlib.contextmanager
def atomic_path(p: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``p`` (same suffix, so pandas/matplotlib infer the format); rename it to
    ``p`` when the block finishes, delete it when the block raises."""
    p = Path(p)
    tmp = p.with_name(f"{PART}{os.getpid()}-{p.name}")
    try:
        yield tmp
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise

def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
