"""One run-directory convention for every command that writes results.

``--out DIR`` (default ``runs/<command>-<timestamp>-<4 hex>``) holds the CSVs, ``figures/`` (PNG and PDF) and
``manifest.json``: command line, resolved options, versions, git revision, seed, model id and config, device,
wall time, the files written, and ``status``.

Failing safely:

- :meth:`RunDir.create` only *validates* ``--out`` (a file, an unwritable place, a non-empty folder without
  ``--force`` -> one-line :class:`~moetool.errors.MoetoolError`); the folder is made at the first write, so a run
  that fails before any result leaves nothing behind that blocks its rerun. A folder holding a *failed* moetool run
  is replaced without ``--force``.
- ``--force`` over a previous moetool run removes that run's result files (the files its manifest lists, its
  sub-runs and ``figures/``), so no stale CSV sits beside the new manifest; other files are left alone.
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
import time
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from ..errors import MoetoolError, write_error

MANIFEST = "manifest.json"
UNITS = "units"  # finished units of an unfinished run (--resume), removed when the run completes
PART = ".part-"  # prefix of a file being written

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


def git_revision() -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of moetool's own source when it is a git checkout, else ``None``
    (cached; two ``git`` calls with a 2 s timeout, any failure -> ``None``)."""
    if "rev" not in _GIT:
        _GIT["rev"] = None
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


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The moetool manifest in folder ``path`` (``None``: none, unreadable, or not moetool's)."""
    try:
        m = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and "command" in m and isinstance(m.get("files", []), list) else None


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


def _check_writable(path: Path) -> None:
    """``--out`` can be made: no ancestor is a file, and the nearest existing ancestor accepts a new folder."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise MoetoolError(f"--out {path}: {probe} is a file, not a folder")
    if path.is_dir():
        probe = path
    try:  # the one reliable test (root ignores permission bits; read-only file systems): make and remove a folder
        os.rmdir(tempfile.mkdtemp(prefix=PART, dir=probe))
    except OSError as e:
        raise MoetoolError(f"--out {path}: cannot write in {probe} ({e.strerror or e})") from None


def _remove_previous(path: Path, keep_units: bool = False) -> None:
    """Delete the result files of the moetool run in ``path`` (its manifest's files, sub-runs, figures/ and
    ``units/`` unless ``keep_units``: a resumed run keeps its finished units)."""
    m = read_manifest(path)
    if m is None:
        return
    root = path.resolve()
    for rel in [*m.get("files", []), MANIFEST]:
        p = (path / str(rel)).resolve()
        if p.is_file() and root in p.parents:  # never outside the run folder
            p.unlink()
    for sub in m.get("runs", []):
        child = (path / str(sub)).resolve()
        if child.is_dir() and root in child.parents:
            _remove_previous(child)
            with contextlib.suppress(OSError):
                child.rmdir()
    if (path / "figures").is_dir():
        shutil.rmtree(path / "figures")
    if (path / UNITS).is_dir() and not keep_units:
        shutil.rmtree(path / UNITS)
    for p in path.glob(f"{PART}*"):
        with contextlib.suppress(OSError):
            p.unlink()


def _default_path(command: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    while True:  # a short random suffix: two runs started in the same second never collide
        p = Path("runs") / f"{command}-{stamp}-{secrets.token_hex(2)}"
        if not p.exists():
            return p


class RunDir:
    """A run folder. ``path`` is made on first use (a write, :meth:`file`, or reading ``.path``)."""

    def __init__(self, path: Path, command: str, *, parent: "RunDir | None" = None, replace: bool = False):
        self._path = Path(path)
        self.command = command
        self.started = time.time()
        self.files: list[str] = []
        self.runs: list[str] = []
        self.sections: dict[str, Any] = {}
        self.status = "new"
        self.parent = parent
        self._replace = replace  # the folder may hold a previous run to clear at the first write
        self._options: Any = None
        self.caption = ""  # written under every figure saved without a caption of its own (model, data, tokens)
        self.resuming: dict[str, Any] | None = None  # the previous manifest when continuing an unfinished run
        self._units: Units | None = None
        self._seq = next(_COUNTER)
        _ACTIVE[self._seq] = self

    # ----- creation --------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, command: str, out: str | Path | None = None, force: bool = False,
               resume: bool = False) -> "RunDir":
        """Validate ``--out`` (nothing is written yet); default ``runs/<command>-<time>-<suffix>``.

        ``resume``: continue the unfinished ``command`` run in ``out`` (its finished units, :meth:`units`, are
        kept; its other files are rewritten); an empty or missing ``out`` starts a new run, so a job script can
        pass ``--resume`` every time."""
        if resume and not out:
            raise MoetoolError("--resume needs --out: the folder of the run to continue")
        path = Path(out) if out else _default_path(command)
        if path.exists() and not path.is_dir():
            raise MoetoolError(f"--out {path} exists and is not a folder")
        replace = False
        if path.is_dir() and any(p for p in path.iterdir() if not p.name.startswith(PART)):
            prev = read_manifest(path)
            if resume and not force:
                if prev is None:
                    raise MoetoolError(f"--resume: {path} holds no moetool run")
                if prev["command"] != command:
                    raise MoetoolError(f"--resume: {path} holds a {prev['command']} run, not {command}")
                if prev.get("status") == "complete":
                    raise MoetoolError(f"--resume: the {command} run in {path} is complete: nothing to resume")
                _check_writable(path)
                run = cls(path, command, replace=True)
                run.resuming = prev
                return run
            if force or (prev is not None and prev.get("status") == "failed"):
                replace = True
            elif prev is not None and prev.get("status") in ("interrupted", "running"):
                raise MoetoolError(f"--out {path} holds an unfinished {prev['command']} run "
                                   f"(status {prev['status']}); use --resume to continue it or --force to start over")
            else:
                raise MoetoolError(f"--out {path} is not empty (use --force to write into it)")
        _check_writable(path)
        return cls(path, command, replace=replace)

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
        if self.parent is not None:
            self.parent._ensure()
        if self._replace and self._path.is_dir():
            _remove_previous(self._path, keep_units=self.resuming is not None)
            if self.resuming is not None:
                self.sections.setdefault("resumed", {"previous_status": self.resuming.get("status"),
                                                     "previous_started": self.resuming.get("started")})
        made = not self._path.exists()
        try:
            self._path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_error(e, self._path, what="create") from None
        self.status = "running"
        try:
            self._write_manifest()
        except MoetoolError:  # (a full disk) a folder this run made and could not describe is not left behind
            if made:
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
    def _record(self, p: Path) -> Path:
        rel = p.relative_to(self._path).as_posix()
        if rel not in self.files:
            self.files.append(rel)
        self._write_manifest()
        return p

    def file(self, name: str) -> Path:
        """A path in the run folder for a file the caller writes itself (listed in the manifest). Prefer
        ``with run.atomic(name) as tmp:`` so an interrupted write leaves no half file."""
        return self._record(self.path / name)

    @contextlib.contextmanager
    def atomic(self, name: str) -> Iterator[Path]:
        """``with run.atomic("trace.parquet") as tmp:`` write ``tmp``; renamed to ``name`` and listed on success."""
        p = self.path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_path(p) as tmp:
                yield tmp
        except OSError as e:
            raise write_error(e, p) from None
        self._record(p)

    def write_csv(self, name: str, df: Any) -> Path:
        """Write a pandas DataFrame as ``name`` (``.csv`` or ``.csv.gz``)."""
        if len(df) == 0:
            raise MoetoolError(f"nothing to write to {name}: no rows (empty data?)")
        with self.atomic(name) as tmp:
            df.to_csv(tmp, index=False)
        return self._path / name

    def write_json(self, name: str, obj: Any) -> Path:
        with self.atomic(name) as tmp:
            tmp.write_text(json.dumps(_jsonable(obj), indent=2))
        return self._path / name

    def save_figure(self, fig: Any, name: str) -> list[Path]:
        """``figures/<name>.png`` and ``.pdf`` in the house style (:func:`moetool.report.figures.savefig`), with
        :attr:`caption` (e.g. ``describe_run(model, data, tokens)``) under a figure that has none; closes it."""
        import matplotlib.pyplot as plt

        from .figures import finalize, has_caption, savefig, set_caption

        if self.caption and not has_caption(fig):
            set_caption(fig, self.caption)
        finalize(fig)
        paths = []
        try:
            for ext in ("png", "pdf"):
                with self.atomic(f"figures/{name}.{ext}") as tmp:
                    savefig(fig, tmp, finalized=True)
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
            "started": datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - self.started, 3),
            **self.sections,
            **extra,
            "runs": self.runs,
            "files": self.files,
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
        return p

    def mark(self, status: str, error: str | None = None) -> None:
        """Record an unfinished run as ``interrupted`` or ``failed`` (only if its folder exists: a run that
        wrote nothing leaves nothing)."""
        _ACTIVE.pop(self._seq, None)
        if self.status in ("complete", "new"):
            return
        self.status = status
        extra = {"error": error} if error else {}
        with contextlib.suppress(MoetoolError):
            self._write_manifest(**extra)

    # a run used as a context manager (the Python API) is marked like a CLI run when the block raises
    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.mark("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", one_line(exc))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return msg if isinstance(exc, MoetoolError) else f"{type(exc).__name__}: {msg}".rstrip(": ")


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


class Units:
    """Finished units of a long run — a policy of ``norm-select``, a checkpoint of ``fluctuation``, a block of
    batches of ``stats`` / ``trace`` — saved in ``<run>/units/`` as they finish, so that ``--resume`` skips them
    and gives the same result as an uninterrupted run. ``load(name)`` is ``None`` until ``save(name, obj)``
    (pickled, written atomically); ``units/key.json`` holds the options the run started with (a resume with other
    options is refused before any work).

    ``refs`` (save and load): live objects a unit's state points to but must not copy — the model's MoE layers
    held by a consumer — pickled by position and put back from the ``refs`` given to ``load`` (a torch module
    not among them is refused: it would copy the model). ``file(name)``: a side file of a unit (a spill, a part
    of a streamed table) the caller writes before ``save`` records it. :meth:`due` paces batch checkpoints
    (at most one per :attr:`every_seconds`)."""

    every_seconds = 60.0  # batch checkpoints (stats, trace): at most this often (0: after every batch)

    def __init__(self, run: RunDir, key: dict[str, Any]):
        self.run = run
        self.key = json.loads(json.dumps(_jsonable(key), sort_keys=True))
        self.dir = run._path / UNITS
        self.resumed: list[str] = []
        self._last = time.monotonic()
        old = self._read_key()
        if run.resuming is not None and old is not None and old != self.key:
            diff = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
            what = ", ".join(f"{k}: {old.get(k)!r} -> {self.key.get(k)!r}" for k in diff[:4])
            raise MoetoolError(f"--resume: {run._path} was started with other options ({what}); "
                               f"rerun with the same options or use --force to start over")

    def _read_key(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / "key.json").read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _file(name: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".pkl"

    def due(self) -> bool:
        """True when the last checkpoint is at least :attr:`every_seconds` old."""
        return time.monotonic() - self._last >= self.every_seconds

    def file(self, name: str) -> Path:
        """Path of side file ``name`` in ``units/`` (write it atomically, then :meth:`save` the unit naming it)."""
        self._open()
        return self.dir / name

    def load(self, name: str, refs: Any = ()) -> Any:
        """The saved result of unit ``name`` (``None``: not finished before the interruption)."""
        import pickle

        if self.run.resuming is None:
            return None
        p = self.dir / self._file(name)
        if not p.is_file():
            return None
        refs = list(refs)

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return refs[pid]

        try:
            with open(p, "rb") as fh:
                obj = Unpickler(fh).load()
        except Exception:  # a unit file from another moetool version or damaged: recompute it
            return None
        self.resumed.append(name)
        return obj

    def save(self, name: str, obj: Any, refs: Any = ()) -> None:
        """Keep unit ``name``'s result (call right after it finished)."""
        import pickle

        self._open()
        ids = {id(r): i for i, r in enumerate(refs)}
        torch = sys.modules.get("torch")

        class Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> Any:
                i = ids.get(id(o))
                if i is None and torch is not None and isinstance(o, torch.nn.Module):
                    raise MoetoolError(f"unit {name}: refusing to copy a {type(o).__name__} into a checkpoint")
                return i

        target = self.dir / self._file(name)
        try:
            with atomic_path(target) as tmp, open(tmp, "wb") as fh:
                Pickler(fh, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except OSError as e:
            self._drop_if_unfinished()
            raise write_error(e, target) from None
        self._last = time.monotonic()

    def _open(self) -> None:
        self.run._ensure()
        target = self.dir
        try:
            self.dir.mkdir(exist_ok=True)
            if self._read_key() is None:
                target = self.dir / "key.json"
                with atomic_path(target) as tmp:
                    tmp.write_text(json.dumps(self.key, indent=1, sort_keys=True))
        except OSError as e:
            self._drop_if_unfinished()
            raise write_error(e, target) from None

    def _drop_if_unfinished(self) -> None:
        """After a failed write (a full disk): ``units/`` goes if it holds no finished unit (nothing a resume
        could use; its key and side files only take room); finished units stay for ``--resume``."""
        if self.dir.is_dir() and not any(self.dir.glob("*.pkl")):
            shutil.rmtree(self.dir, ignore_errors=True)
