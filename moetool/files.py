"""Files written whole or not at all (:func:`atomic_path`: a temporary name beside the target, renamed at the end),
values made JSON-safe for them (:func:`jsonable`), the record a run folder's manifest keeps of each table and the
one check of a table read back against it (:func:`table_record`, :func:`table_problem`), and what moetool computes
once per installation and keeps in :func:`cache_dir` (:func:`cached`)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

PART = ".part-"  # prefix of a file being written
MANIFEST = "manifest.json"  # a run folder's record (moetool.report.rundir)
TABLES = "tables"  # the manifest's record of each table written: {"load.csv": {"rows": 16, "bytes": 412, ...}}


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


# ----- a run's tables as written ---------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def table_record(path: Path, rows: int) -> dict[str, Any]:
    """What the manifest records of the table just written at ``path`` with ``rows`` rows (:data:`TABLES`): its
    rows, bytes and sha256. The hash reads the file once more (a table is at most a few MB; the largest, a Parquet
    table of ``stats --all-tokens``, costs about a second per GB), and it tells edited values from the run's even
    where the rows and the size are the same."""
    return {"rows": int(rows), "bytes": path.stat().st_size, "sha256": _sha256(path)}


def table_problem(path: Path, rows: int | None = None, *, folder: Path | None = None,
                  manifest: dict[str, Any] | None = None) -> str | None:
    """Why the table at ``path`` (``rows``: the rows the caller read from it, ``None`` when it did not count them)
    is not the one its run wrote, in a few words: ``"has 3 rows, the run wrote 16; a truncated or edited copy?"``,
    or its size or sha256 differ (values edited, line endings converted); ``None`` when it is, or when the run
    recorded nothing of it (a run folder written before manifests recorded tables, a file the run did not write as
    a table). ``folder`` / ``manifest``: the run folder and its manifest (default: ``path``'s folder, its
    ``manifest.json``). Every reader of a run's tables as the run's numbers asks this one function."""
    folder = Path(path).parent if folder is None else Path(folder)
    if manifest is None:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return None  # no run beside it
    try:
        rel = Path(path).resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:
        return None
    recorded = manifest.get(TABLES) if isinstance(manifest, dict) else None
    entry = recorded.get(rel) if isinstance(recorded, dict) else None
    if not (isinstance(entry, dict) and isinstance(entry.get("rows"), int) and isinstance(entry.get("bytes"), int)):
        return None  # (a manifest's values are not trusted: one that is not a record checks nothing)
    n = entry["rows"]
    if rows is not None and rows != n:
        return f"has {_rows(rows)}, the run wrote {n:,}; a truncated or edited copy?"
    size, wrote = Path(path).stat().st_size, entry["bytes"]
    if size != wrote:
        return (f"has {size:,} bytes, the run wrote {wrote:,}; a truncated or edited copy?" if rows is None else
                f"has the {_rows(n)} the run wrote but {size:,} bytes, not its {wrote:,}: values edited since the run?")
    if isinstance(entry.get("sha256"), str) and _sha256(Path(path)) != entry["sha256"]:
        return (f"has the {'' if rows is None else _rows(n) + ' and the '}{size:,} bytes the run wrote but not its "
                "content (the sha256 differs): values edited since the run?")
    return None


def _rows(n: int) -> str:
    return f"{n:,} row{'s' if n != 1 else ''}"


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


class ReproducibleGzip(gzip.GzipFile):
    """A gzip file written at ``path`` whose header holds no file name and time 0 (``gzip.open`` and pandas write
    the temporary ``.part-<pid>-`` name and the clock): the same rows give the same bytes, so an identical table
    has the same sha256 in its manifest (a resumed run's, a rerun's)."""

    def __init__(self, path: str | Path, level: int = 9):
        self._raw = open(path, "wb")
        try:
            super().__init__(filename="", mode="wb", compresslevel=level, fileobj=self._raw, mtime=0)
        except BaseException:
            self._raw.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()
