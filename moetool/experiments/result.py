"""What every experiment returns: named tables, the options that produced them, and their definitions.

An experiment is a pure function ``<name>(lm, tokens, options=None, *, quiet=False, **overrides) -> Result``: it
writes nothing. :func:`moetool.report.writers.write` turns a :class:`Result` into a run folder (one CSV per
table, the experiment's figures, ``manifest.json``); the CLI command and ``moetool demo`` both call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import MoetoolError
from .experiment import check_options, check_types

O = TypeVar("O")


def resolve_options(cls: type[O], options: O | None, overrides: dict[str, Any]) -> O:
    """``options`` (default ``cls()``) with keyword ``overrides`` applied; an unknown keyword, or a value not of its
    field's type (:func:`~moetool.experiments.experiment.check_types`), is one clear error."""
    base = cls() if options is None else options
    if not isinstance(base, cls):
        raise MoetoolError(f"options must be a {cls.__name__}, not {type(base).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise MoetoolError(f"unknown option(s) {bad} for {cls.__name__} (known: {', '.join(sorted(known))})")
    check_types(cls, {**{f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}, **overrides})
    opts = dataclasses.replace(base, **overrides) if overrides else base
    check_options(opts)  # NaN / inf / out-of-range numbers and the seed, as the command line refuses them
    return opts


@dataclass
class Result:
    """Named DataFrames of one experiment run.

    ``tables`` maps the file name each table is written to (``"load.csv"``) to its DataFrame; ``result["load"]``
    and ``result["load.csv"]`` both work. ``options`` is the experiment's options dataclass (the manifest's
    options), ``meta`` the manifest sections (``definitions`` of every column, ``data`` description, ...),
    ``summary`` the table the command prints (a DataFrame, may be ``None``). The Python API's functions also
    record ``model`` (the model's manifest entry, or the checkpoint names), ``started`` (Unix time the computation
    began) and ``wall_seconds`` (its wall time), so ``moetool.write(result, out)`` records them, not the time of the
    write.
    """

    name: str
    tables: dict[str, Any]
    options: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    summary: Any = None
    model: Any = None
    started: float | None = None
    wall_seconds: float | None = None
    path: Any = None  # the run folder moetool.run wrote it to (None: not written)
    tokens: Any = None  # the packed tokens moetool.run read from a model's --data (None: given, or none read)

    def _key(self, key: str) -> str:
        if key in self.tables:
            return key
        for name in self.tables:
            if name.split(".", 1)[0] == key:
                return name
        raise KeyError(f"{self.name} has no table '{key}' (tables: {', '.join(self.names)})")

    def __getitem__(self, key: str) -> Any:
        return self.tables[self._key(key)]

    def __contains__(self, key: object) -> bool:
        try:
            self._key(str(key))
        except KeyError:
            return False
        return True

    @property
    def names(self) -> list[str]:
        """Short table names (file names without extension)."""
        return [name.split(".", 1)[0] for name in self.tables]

    @property
    def definitions(self) -> dict[str, str]:
        return self.meta.get("definitions", {})

    def manifest_options(self) -> dict[str, Any]:
        """The options as the manifest records them (``dataclasses.asdict``; tuples become lists in JSON)."""
        return dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else dict(self.options or {})

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {len(df)}x{len(df.columns)}" for n, df in zip(self.names, self.tables.values()))
        return f"Result({self.name!r}, {shapes})"
