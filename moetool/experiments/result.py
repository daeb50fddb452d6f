"""What every experiment returns: named tables, the options that produced them, and their definitions.

An experiment is a pure function ``<name>(lm, tokens, options=None, *, quiet=False, **overrides) -> Result``: it
writes nothing. :func:`moetool.report.writers.write` turns a :class:`Result` into a run folder (one CSV per
table, the experiment's figures, ``manifest.json``); the CLI command and ``moetool demo`` both call it.
"""

from __future__ import annotations

import dataclasses
import re
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


#: the columns several experiments' tables share, defined once (``layer``, ``expert``, ...): a table's column that its
#: experiment's own ``definitions`` leave undefined gets its entry here (:attr:`Result.definitions`, the manifest's)
SHARED_DEFINITIONS = {
    "layer": "index of the MoE layer in the model's layer numbering (the decoder layer index; what --layers takes)",
    "expert": "routed expert index within the layer, 0 .. n_experts-1 (the router's output order)",
    "n_experts": "routed experts of the layer (n, the router's outputs)",
    "top_k": "experts each token is routed to in the layer (K)",
    "token_id": "the token's id in the tokenizer's vocabulary",
    "token": "the token's text: tokenizer.decode([token_id])",
}


def column_definition(definitions: Any, table: str, column: Any) -> str:
    """The manifest's definition of ``column`` of ``table`` (``"load.tokens"``, ``"tokens"``, ``"*_lo/*_hi"``
    for interval bounds, the base column for ``_norm`` / ``_mean`` / ``_all_ids`` (``specialization_all_ids``:
    ``specialization``), a key naming several columns such as ``"entropy_ref/entropy_ckpt"``, a template such as
    ``"bytes_<format>"`` or ``"expert_<k>/weight_<k>"`` (``<...>``: letters and digits); an interval bound without
    ``"*_lo/*_hi"``: its column's definition), or ``""``."""
    if not isinstance(definitions, dict):
        return ""
    c = str(column)
    named = [(key.split(" ")[0].split("/"), text) for key, text in definitions.items()
             if isinstance(key, str) and isinstance(text, str)]
    if isinstance(definitions.get(f"{table}.{c}"), str):
        return definitions[f"{table}.{c}"]
    for parts, text in named:  # "coactivation.a/coactivation.b": this table's first
        if f"{table}.{c}" in parts:
            return text
    suffix = next((s for s in ("_norm", "_mean", "_all_ids") if c.endswith(s) and len(c) > len(s)), None)
    for key in (c, c[:-len(suffix)] if suffix else None, "*_lo/*_hi" if c.endswith(("_lo", "_hi")) else None):
        if key and isinstance(definitions.get(key), str):
            return definitions[key]
    for parts, text in named:  # "entropy_ref/entropy_ckpt", "layer/expert", "i/j (merges)"
        if len(parts) > 1 and c in parts:
            return text
    for parts, text in named:  # "bytes_<format>", "expert_<k>/weight_<k>"
        if any(re.fullmatch("[A-Za-z0-9]+".join(map(re.escape, re.split(r"<\w+>", p))), c) for p in parts if "<" in p):
            return text
    if c.endswith(("_lo", "_hi")):
        base = column_definition(definitions, table, c[:-3])
        if base:
            return f"{'lower' if c.endswith('_lo') else 'upper'} end of the 95% interval of {c[:-3]}: {base}"
    return ""


def with_shared(definitions: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """``definitions`` plus the :data:`SHARED_DEFINITIONS` entry of every column of ``tables`` (``{file name:
    DataFrame}``) that ``definitions`` leave undefined (:func:`column_definition`); its own entries first."""
    out = dict(definitions)
    for name, df in tables.items():
        for c in getattr(df, "columns", ()):
            if c in SHARED_DEFINITIONS and c not in out and not column_definition(definitions, name.split(".")[0], c):
                out[c] = SHARED_DEFINITIONS[c]
    return out


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
        """Every column's definition: the experiment's (``meta["definitions"]``) and, for a column they leave
        undefined, the shared one (:data:`SHARED_DEFINITIONS`); what the manifest records."""
        return with_shared(self.meta.get("definitions") or {}, self.tables)

    def manifest_options(self) -> dict[str, Any]:
        """The options as the manifest records them (``dataclasses.asdict``; tuples become lists in JSON)."""
        return dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else dict(self.options or {})

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {len(df)}x{len(df.columns)}" for n, df in zip(self.names, self.tables.values()))
        return f"Result({self.name!r}, {shapes})"
