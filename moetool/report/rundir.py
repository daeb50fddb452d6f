"""One run-directory convention for every command that writes results.

``--out DIR`` (default ``runs/<command>-<timestamp>-<4 hex>``) holds the CSVs, ``figures/`` (PNG and PDF) and
``manifest.json``: command line, resolved options, versions, git revision, seed, model id and config, device,
wall time, the files written, ``tables`` (each table's ``rows``, ``bytes`` and ``sha256`` as written: a copy that
lost rows or had values edited is told from the run's own, :func:`moetool.files.table_problem`) and ``status``.

Failing safely:

- :meth:`RunDir.create` only *validates* ``--out`` (a file, an unwritable place, a non-empty folder without
  ``--force`` -> one-line :class:`~moetool.errors.MoetoolError`); the folder is made at the first write, so a run
  that fails before any result leaves nothing behind that blocks its rerun. A folder holding a *failed* moetool run
  is replaced without ``--force``.
- ``--force`` over a previous moetool run removes that run's result files (the files its manifest and its
  sub-runs' list, the folders they leave empty), so no stale CSV sits beside the new manifest; other files are
  left alone, and a listed path outside the folder or through a link is refused before anything is removed.
- One run writes into a folder at a time: an advisory lock (``fcntl.flock`` on ``.moetool-lock``) is held from
  validation or the first write until the run ends; a second run is refused in one line naming the holder.
- Every file is written under a temporary name (``.part-<pid>-<name>``) and renamed when complete.
- ``manifest.json`` says ``"status": "running"`` from the first write, ``"complete"`` only from :meth:`finish`,
  ``"interrupted"`` after Ctrl-C / SIGTERM and ``"failed"`` (with ``"error"``) otherwise: the CLI's error handler
  calls :func:`mark_unfinished` for every run started since the command began (the current-run registry).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from ..checkpoints import CHECKPOINT_TYPES, UNIT_FORMAT, UNITS, Units  # noqa: F401 - rundir.Units: the run's checkpoints
from ..experiments import registry as _registry  # noqa: F401 - discovering the experiments allows their checkpoint types
from ..errors import MoetoolError, MoetoolRuntimeError, one_line, write_error  # noqa: F401 (one_line: rundir.one_line)
from ..files import PART, atomic_path, jsonable as _jsonable  # noqa: F401 - rundir.atomic_path / PART: writers
from ..files import MANIFEST, TABLES, ReproducibleGzip, table_record

LOCK = ".moetool-lock"  # the advisory lock of the process writing the run (removed when the run ends)

# the current-run registry: runs created in this process and not finished yet, by creation number (weak: a run
# dropped unfinished, e.g. in a notebook, leaves it)
_ACTIVE: "weakref.WeakValueDictionary[int, RunDir]" = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("moetool", "torch", "transformers", "accelerate", "lm-eval"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


_GIT: dict[str, Any] = {}


def package_source() -> dict[str, Any]:
    """How moetool was installed, from its distribution metadata: ``version`` and, when pip recorded it
    (``direct_url.json``, PEP 610), ``installed_from`` (a URL), ``editable`` and the VCS ``commit`` of a
    ``pip install git+URL@rev``. A plain ``pip install .`` records no revision (see :func:`git_revision`)."""
    import importlib.metadata as md

    out: dict[str, Any] = {"name": "moetool", "version": None}
    try:
        dist = md.distribution("moetool")
    except md.PackageNotFoundError:
        return out
    out["version"] = dist.version
    try:
        info = json.loads(dist.read_text("direct_url.json") or "null") or {}
    except ValueError:
        info = {}
    if info.get("url"):
        out["installed_from"] = info["url"]
        out["editable"] = bool((info.get("dir_info") or {}).get("editable"))
    vcs = info.get("vcs_info") or {}
    if vcs.get("commit_id"):
        out.update(vcs=vcs.get("vcs", "git"), commit=vcs["commit_id"])
    return out


def git_revision() -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of moetool's own source when it is a git checkout (an editable install
    or the source tree); for a package pip installed from a git URL, the commit pip recorded
    (``{"commit": sha, "dirty": false, "from": "pip direct_url.json"}``); else ``None``: a ``pip install .``
    keeps no revision, the manifest's ``package`` block then has the version and the folder it came from (cached;
    two ``git`` calls with a 2 s timeout, any failure -> ``None``)."""
    if "rev" not in _GIT:
        pkg = package_source()
        _GIT["rev"] = ({"commit": pkg["commit"], "dirty": False, "from": "pip direct_url.json"} if pkg.get("commit")
                       else None)
        root = Path(__file__).resolve().parents[2]
        if (root / ".git").exists() and shutil.which("git"):
            try:
                run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                                timeout=2, check=True).stdout.strip()
                _GIT["rev"] = {"commit": run("rev-parse", "HEAD"),
                               "dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}
            except (OSError, subprocess.SubprocessError):
                pass
    return _GIT["rev"]




def read_manifest(path: Path) -> dict[str, Any] | None:
    """The moetool manifest in folder ``path`` (``None``: none, unreadable, or not moetool's)."""
    try:
        m = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and "command" in m and isinstance(m.get("files", []), list) else None


def manifest_problem(path: Path) -> str | None:
    """Why folder ``path`` holds no readable moetool manifest, in a few words: ``"no manifest.json"``,
    ``"manifest.json is not valid JSON (line 3, column 5: ...)"``, ``"manifest.json is not a moetool manifest"``;
    ``None`` when :func:`read_manifest` reads it."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        return f"no {MANIFEST}"
    try:
        m = json.loads(f.read_text())
    except OSError as e:
        return f"{MANIFEST} is not readable ({e.strerror or e})"
    except UnicodeDecodeError:
        return f"{MANIFEST} is not text"
    except json.JSONDecodeError as e:
        return f"{MANIFEST} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    if read_manifest(path) is None:
        return (f"{MANIFEST} is not a moetool manifest (" +
                ("no command" if not isinstance(m, dict) or "command" not in m else "files is not a list") + ")")
    return None




def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    return probe


def refuse_not_a_folder(path: Path) -> None:
    """``--out`` that is a file, or lies under one: one line. Cheap (no heavy import, nothing written): the
    commands call it before anything loads (:func:`moetool.run.refuse_busy_out`), :meth:`RunDir.create` again. A
    name the file system cannot hold (a part longer than 255 bytes) is one line too, not an ``OSError`` at the end."""
    try:
        path.exists()
    except OSError as e:  # ENAMETOOLONG: exists() raises it, and so would the first write
        raise MoetoolError(f"--out {str(path)[:60]}...: {e.strerror or e} (a shorter folder name)") from None
    if path.exists() and not path.is_dir():
        raise MoetoolError(f"--out {path} exists and is not a folder")
    probe = _nearest_existing(path)
    if probe.exists() and not probe.is_dir():
        raise MoetoolError(f"--out {path}: {probe} is a file, not a folder")


def _check_writable(path: Path) -> None:
    """``--out`` can be made: no ancestor is a file, and the nearest existing ancestor accepts a new folder."""
    refuse_not_a_folder(path)
    probe = _nearest_existing(path)
    if path.is_dir():
        probe = path
    try:  # the one reliable test (root ignores permission bits; read-only file systems): make and remove a folder
        os.rmdir(tempfile.mkdtemp(prefix=PART, dir=probe))
    except OSError as e:
        raise MoetoolError(f"--out {path}: cannot write in {probe} ({e.strerror or e})") from None


def _inside(root: Path, rel: Any, what: str, path: Path) -> Path:
    """``root / rel`` when it lies in the run folder ``root`` through no link (its last part may be a link: that
    link is what gets removed, never its target); else one-line refusal (nothing has been removed yet)."""
    full = root / str(rel)
    lexical = Path(os.path.normpath(full))
    real = full.parent.resolve() / full.name
    if full.name in ("", ".", "..") or lexical != real or root not in real.parents:
        raise MoetoolError(f"--force: the manifest in {path} lists {what} {str(rel)!r}, outside the run folder or "
                           f"through a link: nothing removed (clear the folder yourself or choose another --out)")
    return real


def _not_a_link(p: Path, path: Path) -> None:
    if p.is_symlink():
        raise MoetoolError(f"--force: {p} is a link (to {os.readlink(p)}): nothing removed from {path} "
                           f"(clear the folder yourself or choose another --out)")


def _removal_plan(path: Path, keep_units: bool = False) -> tuple[list[Path], list[Path], list[Path]]:
    """What removing the moetool run in ``path`` deletes: ``(files, folders, trees)`` — the files its manifest
    lists (and its manifest) and those of its sub-runs; the folders they sit in, removed when left empty; and
    ``units/`` (removed whole) unless ``keep_units``. Every path is checked first: a listed path outside the run
    folder or through a link, or ``figures/`` / ``units/`` / a sub-run that is a link, is refused in one line."""
    m = read_manifest(path)
    if m is None:
        return [], [], []
    here = path.resolve()
    files, dirs, trees = [], [], []
    for name in ("figures", UNITS):
        _not_a_link(path / name, path)
    for rel in [*m.get("files", []), MANIFEST]:
        p = _inside(here, rel, "file", path)
        if p.is_file() or p.is_symlink():
            files.append(p)
            for d in p.relative_to(here).parents:  # the folders it sits in (figures/), removed when left empty
                if d != Path("."):
                    dirs.append(here / d)
    for sub in m.get("runs", []):
        child = _inside(here, sub, "sub-run", path)
        _not_a_link(child, path)
        if child.is_dir():
            f, d, t = _removal_plan(child)
            files, dirs, trees = files + f, dirs + [*d, child], trees + t
    if (here / UNITS).is_dir() and not keep_units:
        trees.append(here / UNITS)
    return files, dirs, trees


def _remove_previous(path: Path, keep_units: bool = False) -> None:
    """Delete the result files of the moetool run in ``path`` (:func:`_removal_plan`, checked before anything is
    removed): its manifest's files, its sub-runs', the folders they leave empty and ``units/`` unless
    ``keep_units`` (a resumed run keeps its finished units). Files the run did not list are left alone."""
    files, dirs, trees = _removal_plan(path, keep_units)
    for p in files:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    for d in trees:
        shutil.rmtree(d, ignore_errors=True)
    for d in sorted(set(dirs), key=lambda d: len(d.parts), reverse=True):  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty: a user's own file keeps its folder
    for p in path.glob(f"{PART}*"):
        with contextlib.suppress(OSError):
            p.unlink()


def _lock(folder: Path) -> int | None:
    """Take the run folder's advisory lock (``fcntl.flock`` on ``LOCK``, held until :func:`_unlock` or the
    process ends): a file descriptor; ``None`` where locks do not exist (no ``fcntl``, a file system without
    locks). Held by another process: one-line refusal naming the folder and that process."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks, runs go unlocked
        return None
    p = folder / LOCK
    while True:
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # a folder we cannot write in fails at the first write with its own message
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MoetoolRuntimeError(f"--out {folder} is in use by another moetool run (pid {holder}): wait for it "
                                      "to finish or choose another --out") from None
        except OSError:
            os.close(fd)
            return None  # no locks on this file system
        try:  # the previous holder may have removed the file between our open and lock: lock the new one
            same = os.fstat(fd).st_ino == os.stat(p).st_ino
        except OSError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _unlock(fd: int | None, folder: Path) -> None:
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(folder / LOCK)  # while still held: a waiting run then locks a new file (see _lock)
    with contextlib.suppress(OSError):
        os.close(fd)


#: default run folders this process handed out (their folders are made on first write, so ``exists()`` alone let two
#: runs created in the same second draw the same 4-hex suffix: 1 in 50 for 50 runs)
_ISSUED: set[Path] = set()
_ISSUED_LOCK = threading.Lock()


def _default_path(command: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    with _ISSUED_LOCK:
        while True:  # a short random suffix: two runs started in the same second never collide
            p = Path("runs") / f"{command}-{stamp}-{secrets.token_hex(2)}"
            if p.resolve() not in _ISSUED and not p.exists():
                _ISSUED.add(p.resolve())
                return p


def refuse_empty_out(out: Any, command: str = "<command>") -> None:
    """``out=''`` (an unset shell variable): no folder name, refused in one line -- not the current folder, nor the
    default ``runs/<command>-<time>``. ``out`` of another type than a path (``out=5`` from Python, bytes, a list):
    one line too, not pathlib's TypeError traceback."""
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise MoetoolError(f"out={out!r} ({type(out).__name__}) is not a folder path: give a str or a pathlib.Path "
                           f"(or leave out unset for runs/{command}-<time>)")
    if isinstance(out, str) and not out.strip():
        raise MoetoolError(f"--out {out!r}: an empty path (the current folder is '.'; leave out unset for "
                           f"runs/{command}-<time>)")


class RunDir:
    """A run folder. ``path`` is made on first use (a write, :meth:`file`, or reading ``.path``)."""

    def __init__(self, path: Path, command: str, *, parent: "RunDir | None" = None, replace: bool = False):
        self._path = Path(path)
        self.command = command
        self.started = time.time()
        self.files: list[str] = []
        self.tables: dict[str, dict[str, Any]] = {}  # the manifest's TABLES: each table's rows, bytes, sha256
        self.runs: list[str] = []
        self.sections: dict[str, Any] = {}
        self.status = "new"
        self.parent = parent
        self._replace = replace  # the folder may hold a previous run to clear at the first write
        self._options: Any = None
        self.caption = ""  # written under every figure saved without a caption of its own (model, data, tokens)
        self.resuming: dict[str, Any] | None = None  # the previous manifest when continuing an unfinished run
        self._units: Units | None = None
        self._lock: int | None = None  # the folder's advisory lock (a top-level run, while it runs)
        self._seq = next(_COUNTER)
        _ACTIVE[self._seq] = self

    # ----- creation --------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, command: str, out: str | Path | None = None, force: bool = False,
               resume: bool = False, resumable: bool = False) -> "RunDir":
        """Validate ``--out`` (nothing is written yet); default ``runs/<command>-<time>-<suffix>``.

        ``resume``: continue the unfinished ``command`` run in ``out`` (its finished units, :meth:`units`, are
        kept; its other files are rewritten); an empty or missing ``out`` starts a new run, so a job script can
        pass ``--resume`` every time. ``resumable``: the command takes ``--resume`` (a refusal of an unfinished
        run in ``out`` offers it only then)."""
        refuse_empty_out(out, command)
        if resume and not out:
            raise MoetoolError("--resume needs --out: the folder of the run to continue")
        path = Path(out) if out else _default_path(command)
        refuse_not_a_folder(path)
        lock = _lock(path) if path.is_dir() else None  # a run writing there now: refused before anything else
        try:
            run = cls._validated(path, command, force, resume, resumable)
        except BaseException:
            _unlock(lock, path)
            raise
        run._hold(lock)
        return run

    @classmethod
    def _validated(cls, path: Path, command: str, force: bool, resume: bool, resumable: bool) -> "RunDir":
        replace = False
        if path.is_dir() and any(p for p in path.iterdir() if not p.name.startswith(PART) and p.name != LOCK):
            prev = read_manifest(path)
            if resume and not force:
                if prev is None:
                    raise MoetoolError(f"--resume: {path} holds no moetool run")
                if prev["command"] != command:
                    raise MoetoolError(f"--resume: {path} holds a {prev['command']} run, not {command}")
                if prev.get("status") == "complete":
                    raise MoetoolError(f"--resume: the {command} run in {path} is complete: nothing to resume")
                _check_writable(path)
                _removal_plan(path, keep_units=True)  # what the first write removes: checked now
                run = cls(path, command, replace=True)
                run.resuming = prev
                return run
            if force or (prev is not None and prev.get("status") == "failed"):
                replace = True
                _removal_plan(path)
            elif prev is not None and prev.get("status") in ("interrupted", "running"):
                how = ("use --resume to continue it or --force to start over" if resumable and prev["command"] == command
                       else f"moetool {command} has no --resume: use --force to start over, or another --out"
                       if not resumable else  # it has one, but it continues only a run of its own command
                       f"moetool {command} --resume continues only a {command} run: use --force to start over, or "
                       f"another --out")
                raise MoetoolError(f"--out {path} holds an unfinished {prev['command']} run "
                                   f"(status {prev['status']}); {how}")
            else:
                raise MoetoolError(f"--out {path} is not empty (use --force to write into it)")
        _check_writable(path)
        return cls(path, command, replace=replace)

    def _hold(self, lock: int | None) -> None:
        """Keep the folder's lock until the run ends (:meth:`finish`, :meth:`mark`, or this object is dropped)."""
        self._lock = lock
        if lock is not None:
            self._unlocker = weakref.finalize(self, _unlock, lock, self._path.absolute())

    def _release(self) -> None:
        if self._lock is not None:
            self._unlocker()
            self._lock = None

    @property
    def path(self) -> Path:
        """The run folder (made now if it does not exist yet)."""
        self._ensure()
        return self._path

    @property
    def figures(self) -> Path:
        p = self.path / "figures"
        p.mkdir(exist_ok=True)
        return p

    @property
    def created(self) -> bool:
        return self.status != "new"

    def _ensure(self) -> None:
        if self.created:
            return
        made = not self._path.exists()  # (before the lock makes it)
        if self.parent is not None:
            self.parent._ensure()
        elif self._lock is None:  # a top-level run: lock the folder before anything is removed or written
            try:
                self._path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise MoetoolError(f"cannot create {self._path}: {e.strerror or e}") from None
            self._hold(_lock(self._path))
            if not self._replace and any(p for p in self._path.iterdir()
                                         if not p.name.startswith(PART) and p.name != LOCK):
                self._release()
                raise MoetoolRuntimeError(f"--out {self._path} was filled by another run while this one ran: "
                                          "nothing written (choose another --out)")
        if self._replace and self._path.is_dir():
            _remove_previous(self._path, keep_units=self.resuming is not None)
            if self.resuming is not None:
                self.sections.setdefault("resumed", {"previous_status": self.resuming.get("status"),
                                                     "previous_started": self.resuming.get("started")})
        try:
            self._path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(e, self._path, what="create") from None
        self.status = "running"
        try:
            self._write_manifest()
        except MoetoolError:  # (a full disk) a folder this run made and could not describe is not left behind
            if made:
                self._release()
                shutil.rmtree(self._path, ignore_errors=True)
                self.status = "new"
            raise

    def sub(self, name: str) -> "RunDir":
        """A child run folder (``demo`` puts each experiment in its own); made at its first write."""
        if name not in self.runs:
            self.runs.append(name)
            if self.created:
                self._write_manifest()
        child_path = self._path / name
        # a demo's step is named after its command; a step's per-model runs keep the step's command
        command = name if self.parent is None else self.command
        return RunDir(child_path, command, parent=self, replace=self._replace or read_manifest(child_path) is not None)

    # ----- writing ---------------------------------------------------------------------------------------------
    def _record(self, p: Path, rows: int | None = None) -> Path:
        """List ``p`` in the manifest; with ``rows`` (a table), its :func:`table_record` too. A file written again
        without ``rows`` drops its record: the manifest never keeps counts of a file that is no longer the table."""
        rel = p.relative_to(self._path).as_posix()
        if rel not in self.files:
            self.files.append(rel)
        if rows is not None:
            self.tables[rel] = table_record(p, rows)
        else:
            self.tables.pop(rel, None)
        self._write_manifest()
        return p

    def file(self, name: str) -> Path:
        """A path in the run folder for a file the caller writes itself (listed in the manifest). Prefer
        ``with run.atomic(name) as tmp:`` so an interrupted write leaves no half file."""
        return self._record(self.path / name)

    @contextlib.contextmanager
    def atomic(self, name: str, rows: int | Callable[[], int | None] | None = None) -> Iterator[Path]:
        """``with run.atomic("trace.parquet") as tmp:`` write ``tmp``; renamed to ``name`` and listed on success.
        ``rows``: the file is a table of that many rows (recorded in the manifest's ``tables``, :meth:`_record`);
        a callable: asked once the body is done (a table streamed to ``tmp`` knows its rows only then)."""
        p = self.path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_path(p) as tmp:
                yield tmp
        except OSError as e:
            raise write_error(e, p) from None
        self._record(p, rows() if callable(rows) else rows)

    def write_csv(self, name: str, df: Any) -> Path:
        """Write a pandas DataFrame as ``name`` (``.csv`` or ``.csv.gz``); its rows, bytes and sha256 go to the
        manifest's ``tables``."""
        if len(df) == 0:
            raise MoetoolError(f"nothing to write to {name}: no rows (empty data?)")
        with self.atomic(name, rows=len(df)) as tmp:
            if name.endswith(".gz"):  # no temporary name and no time in the gzip header: same rows, same bytes
                import io

                with ReproducibleGzip(tmp) as gz, io.TextIOWrapper(gz, encoding="utf-8", newline="") as text:
                    df.to_csv(text, index=False)
            else:
                df.to_csv(tmp, index=False)
        return self._path / name

    def write_json(self, name: str, obj: Any) -> Path:
        with self.atomic(name) as tmp:
            tmp.write_text(json.dumps(_jsonable(obj), indent=2))
        return self._path / name

    def save_figure(self, fig: Any, name: str) -> list[Path]:
        """``figures/<name>.png`` and ``.pdf`` (the formats ``MOETOOL_FIGURES`` asks for:
        :func:`moetool.errors.env_figures`) in the house style (:func:`moetool.report.figures.savefig`), with
        :attr:`caption` (e.g. ``describe_run(model, data, tokens)``) under a figure that has none; closes it."""
        import matplotlib.pyplot as plt

        from ..errors import env_figures
        from .figures import finalize, has_caption, savefig, set_caption, tight_bbox

        formats = env_figures()
        paths = []
        try:
            if not formats:
                return paths
            if self.caption and not has_caption(fig):
                set_caption(fig, self.caption)
            finalize(fig)
            bbox = tight_bbox(fig)  # one crop for both files
            for ext in formats:
                with self.atomic(f"figures/{name}.{ext}") as tmp:
                    savefig(fig, tmp, finalized=True, bbox=bbox)
                paths.append(self._path / "figures" / f"{name}.{ext}")
        finally:
            plt.close(fig)
        return paths

    def add(self, **sections: Any) -> None:
        """Extra manifest sections (data description, definitions, per-experiment notes)."""
        self.sections.update(sections)

    def units(self, key: dict[str, Any]) -> "Units":
        """The checkpoints of this run's units (``key``: every option the results depend on). When resuming, a
        ``key`` different from the one the run started with is refused in one line."""
        if self._units is None:
            self._units = Units(self, key)
        return self._units

    # ----- manifest --------------------------------------------------------------------------------------------
    def manifest(self, **extra: Any) -> dict[str, Any]:
        return {
            "command": self.command,
            "status": self.status,
            "argv": sys.argv,
            "options": self._options,
            "seed": extra.pop("seed", None),
            "model": extra.pop("model", None),
            "versions": dict(_versions()),
            "git": git_revision(),
            "package": package_source(),
            "started": datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - self.started, 3),
            **self.sections,
            **extra,
            "runs": self.runs,
            "files": self.files,
            TABLES: self.tables,
        }

    def _write_manifest(self, **extra: Any) -> Path:
        p = self._path / MANIFEST
        if not self._path.is_dir():
            return p
        try:
            with atomic_path(p) as tmp:
                tmp.write_text(json.dumps(_jsonable(self.manifest(**extra)), indent=2))
        except OSError as e:
            raise write_error(e, p) from None
        return p

    def finish(self, *, options: dict[str, Any], model: Any = None, seed: int | None = None) -> Path:
        """Write ``manifest.json`` with ``"status": "complete"`` (call last)."""
        self._ensure()
        self._options = options
        self.status = "complete"
        p = self._write_manifest(model=model.manifest() if hasattr(model, "manifest") else model, seed=seed)
        if (self._path / UNITS).is_dir():  # the results are written: the checkpoints have served
            shutil.rmtree(self._path / UNITS, ignore_errors=True)
        _ACTIVE.pop(self._seq, None)
        self._release()
        return p

    def mark(self, status: str, error: str | None = None) -> None:
        """Record an unfinished run as ``interrupted`` or ``failed`` (only if its folder exists: a run that
        wrote nothing leaves nothing)."""
        _ACTIVE.pop(self._seq, None)
        try:
            if self.status in ("complete", "new"):
                return
            self.status = status
            extra = {"error": error} if error else {}
            with contextlib.suppress(MoetoolError):
                self._write_manifest(**extra)
        finally:
            self._release()

    # a run used as a context manager (the Python API) is marked like a CLI run when the block raises
    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.mark(*unfinished(exc))




def active_runs() -> list[RunDir]:
    """Runs created in this process that have not finished (oldest first)."""
    return [_ACTIVE[k] for k in sorted(_ACTIVE.keys())]


def run_counter() -> int:
    """The creation number the next run gets (a command notes it when it starts)."""
    global _COUNTER
    n = next(_COUNTER)
    _COUNTER = itertools.count(n)
    return n


def mark_unfinished(since: int, status: str, error: str | None = None) -> list[RunDir]:
    """Mark every unfinished run created since creation number ``since`` (:func:`run_counter` when the command
    started) ``status``; returns those whose folder exists, newest first."""
    marked = []
    for run in reversed([r for r in active_runs() if r._seq >= since]):
        existed = run.created
        run.mark(status, error)
        if existed:
            marked.append(run)
    return marked


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cluster job's time limit) raised where the program is, handled like Ctrl-C."""


def unfinished(exc: BaseException) -> tuple[str, str]:
    """``(status, error)`` a run stopped by ``exc`` records: ``("interrupted", "SIGTERM")`` (:class:`Terminated`),
    ``("interrupted", "SIGINT")`` (Ctrl-C, any other ``KeyboardInterrupt``), else ``("failed", its one line)``."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    return "failed", one_line(exc)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` (main thread only; restored afterwards)."""
    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    try:
        old = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class NullRun:
    """The run folder of a rank other than 0 under data parallelism: every write is dropped (rank 0 writes the
    one run directory); ``path`` names rank 0's folder without creating anything."""

    discard = True

    def __init__(self, command: str, out: Any = None):
        self.command, self._path, self.caption = command, Path(out) if out else Path("runs") / command, ""

    @property
    def path(self) -> Path:
        return self._path

    def __getattr__(self, name: str) -> Any:  # add, write_csv, save_figure, finish, mark, ...: nothing happens
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    @contextlib.contextmanager
    def atomic(self, name: str, rows: Any = None) -> Iterator[Path]:
        """``with run.atomic(name) as tmp:`` (placement's ``--export`` file): the body writes into a temporary
        folder removed after it, dropped like every other write (``__getattr__``'s ``None`` is no context manager)."""
        with tempfile.TemporaryDirectory(prefix="moetool-rank-") as d:
            yield Path(d) / Path(name).name
