"""Unit checkpoints of an unfinished run (``--resume``): finished units saved in formats that cannot run code.

A unit is ``torch.save`` of plain containers and tensors, read back with ``torch.load(weights_only=True)``; the
project's own types in :data:`CHECKPOINT_TYPES` are stored as their attributes and rebuilt from that list only,
DataFrames as Parquet. :class:`Units` belongs to a run folder (:meth:`moetool.report.RunDir.units`) and is handed
to the experiments that checkpoint their work; it sits below them.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .errors import MoetoolError, MoetoolRuntimeError, one_line, write_error
from .files import PART, atomic_path, jsonable as _jsonable

UNITS = "units"  # the folder of finished units of an unfinished run (--resume), removed when the run completes

#: the project's own types below the experiments a unit checkpoint may hold, stored as their attributes
#: (:func:`_encode`); a resumed checkpoint builds nothing else (no pickle: a tampered checkpoint cannot run code).
#: The experiments' own are in their specs (``checkpoint_types``), added by :func:`allow_types` when
#: :mod:`moetool.experiments.registry` discovers them
CHECKPOINT_TYPES = frozenset({
    "moetool.engine.runner.NLL", "moetool.engine.runner.ForwardResult", "moetool.uncertainty.RowTable",
    "moetool.sketch.SparseCounter",
})
_ALLOWED: set[str] = set(CHECKPOINT_TYPES)


def allow_types(names: Any) -> None:
    """Let unit checkpoints hold the types ``names`` (``"module.Class"``; an experiment's spec lists them)."""
    _ALLOWED.update(names)


def checkpoint_types() -> frozenset[str]:
    """Every type a unit checkpoint may hold: :data:`CHECKPOINT_TYPES` and those :func:`allow_types` added."""
    return frozenset(_ALLOWED)


UNIT_FORMAT = 1  # the layout of a unit file (``<name>.unit``: torch.save of plain containers and tensors)


class _Damaged(Exception):
    """A unit checkpoint that cannot be read back as :func:`_encode` wrote it."""


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _encode(x: Any, refs: dict[int, int], memo: dict[int, tuple[int, Any]], unit: str) -> Any:
    """``x`` as plain containers and tensors only (what ``torch.load(weights_only=True)`` reads without running
    code): tuples, dicts, sets, numpy, pandas frames, slices, devices and :data:`CHECKPOINT_TYPES` objects become
    tagged dicts (``{"__t": kind, ...}``); ``refs`` (id -> position) are stored by position; lists, dicts, sets and
    objects seen twice are stored once (``memo``, in the order :func:`_decode` meets them)."""
    import torch

    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t in (torch.Tensor, torch.nn.Parameter):
        return x
    if id(x) in refs:
        return {"__t": "ref", "i": refs[id(x)]}
    if isinstance(x, torch.nn.Module):
        raise MoetoolError(f"unit {unit}: refusing to copy a {t.__name__} into a checkpoint")
    if id(x) in memo:
        return {"__t": "same", "i": memo[id(x)][0]}
    enc = functools.partial(_encode, refs=refs, memo=memo, unit=unit)
    if t in (list, dict, set) or _type_name(t) in _ALLOWED:
        memo[id(x)] = (len(memo), x)  # x kept alive: its id is not reused while encoding
    if t is list:
        return [enc(v) for v in x]
    if t is dict:
        return {"__t": "dict", "k": [enc(k) for k in x], "v": [enc(v) for v in x.values()]}
    if t is set:
        return {"__t": "set", "v": [enc(v) for v in x]}
    if t is tuple:
        return {"__t": "tuple", "v": [enc(v) for v in x]}
    if t is slice:
        return {"__t": "slice", "v": [enc(x.start), enc(x.stop), enc(x.step)]}
    if t is torch.device:
        return {"__t": "device", "v": str(x)}
    if t is torch.dtype:
        return {"__t": "dtype", "v": str(x).removeprefix("torch.")}
    if _type_name(t) in _ALLOWED:
        return {"__t": "obj", "c": _type_name(t), "s": enc(dict(vars(x)))}
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray and x.dtype != object:
        return {"__t": "np", "d": x.dtype.str, "s": list(x.shape),
                "v": torch.frombuffer(bytearray(np.ascontiguousarray(x).tobytes()) or bytearray(1), dtype=torch.uint8)}
    if np is not None and isinstance(x, np.generic) and x.dtype != object:
        return {"__t": "npscalar", "d": x.dtype.str, "v": x.item()}
    pd = sys.modules.get("pandas")
    if pd is not None and t is pd.DataFrame:
        import io

        buf = io.BytesIO()
        x.to_parquet(buf)
        return {"__t": "frame", "v": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    raise MoetoolError(f"unit {unit}: cannot checkpoint a {_type_name(t)} (add it to the experiment spec's checkpoint_types if "
                       "it holds only plain data)")


def _decode(x: Any, refs: list[Any], memo: list[Any]) -> Any:
    """The object :func:`_encode` stored (``refs``: the live objects given to ``load``); any other structure
    raises :class:`_Damaged`."""
    import torch

    if x is None or type(x) in (bool, int, float, str, torch.Tensor, torch.nn.Parameter):
        return x
    dec = functools.partial(_decode, refs=refs, memo=memo)
    if type(x) is list:
        return _decode_into([], memo, dec, x)
    if type(x) is not dict or not isinstance(x.get("__t"), str):
        raise _Damaged(f"unexpected {type(x).__name__}")
    decoder = _DECODERS.get(x["__t"])
    if decoder is None:
        raise _Damaged(f"unknown entry {x['__t']!r}")
    return decoder(x, dec, refs, memo)


def _indexed(x: dict[str, Any], pool: list[Any], what: str) -> Any:
    """``pool[x["i"]]``: a live object (``ref``) or one decoded before (``same``)."""
    i = x.get("i")
    if type(i) is not int or not 0 <= i < len(pool):
        raise _Damaged(what.format(i=i))
    return pool[i]


def _decode_into(out: Any, memo: list[Any], dec: Callable[[Any], Any], entries: Any) -> Any:
    """A list or set: ``out`` recorded in ``memo`` first (a ``same`` entry inside it finds it), then filled."""
    memo.append(out)
    if type(out) is list:
        out.extend(dec(v) for v in entries)
    else:
        out.update(dec(v) for v in entries)
    return out


def _decode_dict(x: dict[str, Any], dec: Callable[[Any], Any], memo: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    memo.append(out)
    keys, values = x.get("k"), x.get("v")
    if type(keys) is not list or type(values) is not list or len(keys) != len(values):
        raise _Damaged("malformed dict")
    for k, val in zip(keys, values):
        out[dec(k)] = dec(val)
    return out


def _decode_dtype(v: Any) -> Any:
    import torch

    d = getattr(torch, str(v), None)
    if not isinstance(d, torch.dtype):
        raise _Damaged(f"unknown dtype {v!r}")
    return d


def _decode_obj(x: dict[str, Any], dec: Callable[[Any], Any], memo: list[Any]) -> Any:
    """A :data:`CHECKPOINT_TYPES` object rebuilt from its attributes (no other type is built)."""
    import importlib

    name = x.get("c")
    if name not in _ALLOWED:
        raise _Damaged(f"type {name!r} is not one a checkpoint may hold")
    module, _, qual = name.rpartition(".")
    out = object.__new__(getattr(importlib.import_module(module), qual))
    memo.append(out)
    state = dec(x.get("s"))
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise _Damaged(f"malformed {qual}")
    vars(out).update(state)
    return out


def _decode_numpy(x: dict[str, Any]) -> Any:
    """A numpy array (``np``: raw bytes and shape) or scalar (``npscalar``); object dtypes are refused."""
    import numpy as np

    dtype = np.dtype(str(x.get("d")))
    if dtype == object:
        raise _Damaged("numpy object array")
    if x["__t"] == "npscalar":
        return dtype.type(x.get("v"))
    shape = tuple(int(n) for n in x.get("s"))
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer(x.get("v").numpy().tobytes()[:n], dtype=dtype).reshape(shape).copy()


def _decode_frame(v: Any) -> Any:
    import io

    import pandas as pd

    return pd.read_parquet(io.BytesIO(v.numpy().tobytes()))


def _decode_device(v: Any) -> Any:
    import torch

    return torch.device(v)


#: per tag of :func:`_encode`, ``decoder(entry, dec, refs, memo)`` (``dec``: :func:`_decode` of a nested entry)
_DECODERS: dict[str, Callable[[dict[str, Any], Callable[[Any], Any], list[Any], list[Any]], Any]] = {
    "ref": lambda x, dec, refs, memo: _indexed(x, refs, "reference {i!r} to a live object out of range"),
    "same": lambda x, dec, refs, memo: _indexed(x, memo, "back-reference {i!r} out of range"),
    "dict": lambda x, dec, refs, memo: _decode_dict(x, dec, memo),
    "set": lambda x, dec, refs, memo: _decode_into(set(), memo, dec, x.get("v")),
    "tuple": lambda x, dec, refs, memo: tuple(dec(e) for e in x.get("v")),
    "slice": lambda x, dec, refs, memo: slice(*(dec(e) for e in x.get("v"))),
    "device": lambda x, dec, refs, memo: _decode_device(x.get("v")),
    "dtype": lambda x, dec, refs, memo: _decode_dtype(x.get("v")),
    "obj": lambda x, dec, refs, memo: _decode_obj(x, dec, memo),
    "np": lambda x, dec, refs, memo: _decode_numpy(x),
    "npscalar": lambda x, dec, refs, memo: _decode_numpy(x),
    "frame": lambda x, dec, refs, memo: _decode_frame(x.get("v")),
}


class Units:
    """Finished units of a long run — a policy of ``norm-select``, a checkpoint of ``fluctuation``, a block of
    batches of ``stats`` / ``trace`` — saved in ``<run>/units/`` as they finish, so that ``--resume`` skips them
    and gives the same result as an uninterrupted run. ``load(name)`` is ``None`` until ``save(name, obj)``
    (``<name>.unit``, written atomically: ``torch.save`` of plain containers and tensors — the project's own
    types of :data:`CHECKPOINT_TYPES` stored as their attributes — read back with ``weights_only=True``, so a
    tampered checkpoint cannot run code); ``units/key.json`` holds the options the run started with (a resume
    with other options is refused before any work), ``units/inputs.json`` the fingerprints of the data and
    weights it read (:meth:`check_inputs`).

    ``refs`` (save and load): live objects a unit's state points to but must not copy — the model's MoE layers
    held by a consumer — stored by position and put back from the ``refs`` given to ``load`` (a torch module
    not among them is refused: it would copy the model). ``file(name)``: a side file of a unit (a spill, a part
    of a streamed table) the caller writes before ``save`` records it (with its size: a side file missing or
    changed on resume is a damaged checkpoint). A unit that cannot be read back is refused in one line
    (damaged: start over with ``--force``). :meth:`due` paces batch checkpoints (at most one per
    :attr:`every_seconds`)."""

    every_seconds = 60.0  # batch checkpoints (stats, trace): at most this often (0: after every batch)

    def __init__(self, run: Any, key: dict[str, Any]):  # run: the moetool.report.RunDir it belongs to
        self.run = run
        self.key = json.loads(json.dumps(_jsonable(key), sort_keys=True))
        self.dir = run._path / UNITS
        self.resumed: list[str] = []
        self.inputs: dict[str, Any] = {}
        self._side: set[str] = set()  # side files handed out (file()) or read back with a unit
        self._last = time.monotonic()
        old = self._recorded("key.json")
        if run.resuming is not None and old is not None and old != self.key:
            diff = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
            what = ", ".join(f"{k}: {old.get(k)!r} -> {self.key.get(k)!r}" for k in diff[:4])
            raise MoetoolError(f"--resume: {run._path} was started with other options ({what}); "
                               f"rerun with the same options or use --force to start over")
        if run.resuming is not None and self.dir.is_dir():
            old_units = sorted(p.name for p in self.dir.glob("*.pkl"))
            if old_units:  # an older moetool's pickles: never unpickled
                raise MoetoolRuntimeError(
                    f"--resume: the checkpoint {self.dir / old_units[0]} is a pickle (an older moetool's, or "
                    "tampered): unsafe to load, not read (unpickling can run code); start over with --force")

    def _read_key(self, name: str = "key.json") -> dict[str, Any] | None:
        try:
            value = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _recorded(self, name: str) -> dict[str, Any] | None:
        """``units/<name>`` (``key.json``: the options, ``inputs.json``: the fingerprints) of the run being resumed;
        with finished units beside it, one missing or unreadable is a damaged checkpoint (refused in one line:
        without it, units of other options or data would be restored unchecked). ``None`` when not resuming."""
        if self.run.resuming is None:
            return None
        old = self._read_key(name)
        if old is None and self.dir.is_dir() and any(self.dir.glob("*.unit")):
            p = self.dir / name
            raise self._damaged(p, "missing" if not p.exists() else "not readable as a JSON object")
        return old

    def check_inputs(self, **inputs: Any) -> None:
        """Record the fingerprints of what the run reads (``data=``: its token ids, ``model=``: its weight files,
        see :func:`moetool.loading.weights_fingerprint`); when resuming, fingerprints other than those the run
        started with are refused in one line (checkpoints of other data or weights would mix into the
        tables)."""
        inputs = json.loads(json.dumps(_jsonable(inputs), sort_keys=True))
        self.inputs.update(inputs)
        old = self._recorded("inputs.json")
        for what, new in inputs.items():
            before = (old or {}).get(what)
            if before is None or before == new:
                continue
            where = _first_difference(before, new, what)
            label = {"data": "the data", "model": "the model's weights", "precision": "the model's loaded precision",
                     "device": "the model's device"}.get(what, what)
            raise MoetoolError(f"--resume: {label} changed since {self.run._path} was started ({where}); resume "
                               "with what the run read or use --force to start over")
        if self.run.resuming is not None and self.dir.is_dir():
            self._write_inputs()  # a resumed run's checkpoints: what they were made from (else at the first save)

    def _write_inputs(self) -> None:
        merged = {**(self._read_key("inputs.json") or {}), **self.inputs}
        with atomic_path(self.dir / "inputs.json") as tmp:
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))

    @staticmethod
    def _file(name: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".unit"

    def due(self) -> bool:
        """True when the last checkpoint is at least :attr:`every_seconds` old."""
        return time.monotonic() - self._last >= self.every_seconds

    def file(self, name: str) -> Path:
        """Path of side file ``name`` in ``units/`` (write it atomically, then :meth:`save` the unit naming it)."""
        self._open()
        if not name.startswith(PART):
            self._side.add(name)
        return self.dir / name

    def _damaged(self, p: Path, why: str) -> MoetoolRuntimeError:
        return MoetoolRuntimeError(f"--resume: the checkpoint {p} is damaged or unsafe ({why}): start over with "
                                   "--force")

    def load(self, name: str, refs: Any = ()) -> Any:
        """The saved result of unit ``name`` (``None``: not finished before the interruption). A unit file that
        cannot be read back (damaged, tampered, a side file missing) is refused in one line."""
        import torch

        if self.run.resuming is None:
            return None
        p = self.dir / self._file(name)
        if not p.is_file():
            return None
        try:
            with warnings.catch_warnings():  # torch's remarks on a foreign file: the one line below says it
                warnings.simplefilter("ignore")
                stored = torch.load(p, map_location=None, weights_only=True)
        except Exception as e:  # noqa: BLE001 - refused by the safe unpickler, truncated, not a torch file
            why = ("the safe loader refused it: it asks to run code or build objects" if "Weights only" in str(e)
                   else one_line(e)[:100])
            raise self._damaged(p, why) from None
        try:
            if type(stored) is not dict or stored.get("format") != UNIT_FORMAT or type(stored.get("files")) is not dict:
                raise _Damaged("not a moetool unit")
            for side, size in stored["files"].items():
                f = self.dir / str(side)
                if Path(str(side)).name != str(side) or not f.is_file():
                    raise _Damaged(f"its file {side} is missing")
                if f.stat().st_size != size:
                    raise _Damaged(f"its file {side} has {f.stat().st_size:,} bytes, not {size:,}")
            obj = _decode(stored.get("unit"), list(refs), [])
        except (_Damaged, MoetoolError, ValueError, TypeError, KeyError, ImportError, AttributeError,
                OSError) as e:
            raise self._damaged(p, str(e) or type(e).__name__) from None
        self._side.update(stored["files"])
        self.resumed.append(name)
        return obj

    def save(self, name: str, obj: Any, refs: Any = ()) -> None:
        """Keep unit ``name``'s result (call right after it finished); the side files written so far
        (:meth:`file`) are recorded with their sizes."""
        import torch

        self._open()
        ids = {id(r): i for i, r in enumerate(refs)}
        unit = _encode(obj, ids, {}, name)
        files = {f: (self.dir / f).stat().st_size for f in sorted(self._side) if (self.dir / f).is_file()}
        target = self.dir / self._file(name)
        try:
            with atomic_path(target) as tmp:
                torch.save({"format": UNIT_FORMAT, "files": files, "unit": unit}, tmp)
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
            if self.inputs and self._read_key("inputs.json") is None:
                target = self.dir / "inputs.json"
                self._write_inputs()
        except OSError as e:
            self._drop_if_unfinished()
            raise write_error(e, target) from None

    def _drop_if_unfinished(self) -> None:
        """After a failed write (a full disk): ``units/`` goes if it holds no finished unit (nothing a resume
        could use; its key and side files only take room); finished units stay for ``--resume``."""
        if self.dir.is_dir() and not any(self.dir.glob("*.unit")):
            shutil.rmtree(self.dir, ignore_errors=True)


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    """``path: old -> new`` of the first place two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    short = lambda v: (repr(v)[:24] + "…") if len(repr(v)) > 24 else repr(v)  # noqa: E731
    return f"{where or 'fingerprint'}: {short(a)} -> {short(b)}"
