"""Files written whole or not at all (:func:`atomic_path`: a temporary name beside the target, renamed at the end),
values made JSON-safe for them (:func:`jsonable`), and what moetool computes once per installation and keeps in
:func:`cache_dir` (:func:`cached`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
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


# ----- the per-installation cache ---------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where moetool keeps what it computes once per installation: ``MOETOOL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/moetool``, else ``~/.cache/moetool``."""
    if os.environ.get("MOETOOL_CACHE_DIR"):
        return Path(os.environ["MOETOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetool"


def installation_key(code: list[Path]) -> dict[str, Any]:
    """The installed transformers, torch, moetool and Python versions and a hash of the ``code`` files, read
    without importing torch or transformers: what a cached answer computed by that code depends on."""
    import importlib.metadata as md
    import platform

    key: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("transformers", "torch", "moetool"):
        try:
            key[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            key[pkg] = None
    h = hashlib.sha256()
    for f in sorted(code):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key["code"] = h.hexdigest()[:16]
    return key


def cached(name: str, key: dict[str, Any], compute: Any, kind: type = dict) -> Any:
    """``compute()``, or what it returned before for the same ``key`` (an :func:`installation_key` and what the
    value depends on), kept in :func:`cache_dir` as ``<name>-<digest>.json``; only JSON-exact values are kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.json"
    value = read_cached(path, key, "value", kind)
    if value is None:
        value = compute()
        write_cached(path, key, value, "value")
    return value


def read_cached(path: Path, key: dict[str, Any], field: str = "info", kind: type = dict) -> Any:
    """The ``field`` stored at ``path`` under exactly ``key`` (None: absent, stale or unreadable)."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get(field), kind):
        return None
    return stored[field]


def write_cached(path: Path, key: dict[str, Any], value: Any, field: str = "info") -> None:
    """Atomically, and only what JSON gives back unchanged (else the next answer would differ in type)."""
    try:
        text = json.dumps({"key": key, field: value})
        if json.loads(text)[field] != value:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except (OSError, TypeError, ValueError):  # an unwritable cache only costs the next call the time again
        pass
