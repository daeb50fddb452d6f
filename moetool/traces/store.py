"""An engine's dump as moetool's own files, and those files read back, streamed.

Per-token routing is written as the trace Parquet ``moetool trace`` writes (:mod:`moetool.experiments.trace.compute`):
``row, pos, token_id, domain, layer, expert_1..expert_K, weight_1..weight_K``, rows layer-major within each chunk.
The engines record ids only: ``weight_k`` are NaN (no gate weights), ``token_id`` is -1 where the dump has no token
ids, ``domain`` is empty. Counts-only dumps are written as ``loads.parquet`` (``layer, expert, count``). The
manifest's ``routing_source`` section says where the routing came from (format, files, ids' kind, order, moetool's
version, notes) and the model's shape (``--config``).

Reading back (:func:`open_trace`) takes a run folder, a ``trace.parquet`` / ``trace.csv.gz`` or a
``loads.parquet``; a trace written by ``moetool trace`` itself gets its model's shape from its manifest. A file whose
rows, bytes or sha256 differ from what its manifest records (:func:`moetool.files.table_problem`) is refused.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import MoetoolError, first_line, spans
from ..experiments.result import SHARED_DEFINITIONS
from ..files import table_problem
from .readers import Chunk, Counts, check_ids
from .shape import ModelShape

TRACE = "trace.parquet"
LOADS = "loads.parquet"
ROWS_PER_READ = 1 << 16  # Parquet rows per streamed read

#: the columns of what import-trace writes (the manifest's definitions): trace.parquet, moetool trace's schema read
#: from an engine's dump, and loads.parquet
DEFINITIONS = {
    "row": "the request (vllm, sglang-routed), the sequence of one forward pass (sglang-dump per_token) or the step's "
           "forward (megatron) the token belongs to, numbered from 0 in the order the files were read",
    "pos": "the token's position in its row, 0-based (sglang-dump per_token: the positions the dump records)",
    "token_id": "the token's id in the vocabulary of --config as the dump records it; -1 where the dump has no token "
                "ids",
    "domain": "empty: an engine's dump has no domains (the column keeps moetool trace's schema)",
    "layer": "index of the MoE layer in the model's layer numbering (the decoder layer index of --config); trace rows "
             "are layer-major within each chunk read",
    "expert_<k>": "the k-th expert the engine recorded for the token (logical ids) in the engine's order: its "
                  "router's top-K order, except megatron's, sorted by expert id (manifest: routing_source.order)",
    "weight_<k>": "NaN: the engines record expert ids only, no gate weights",
    "expert": SHARED_DEFINITIONS["expert"],
    "count": "loads.parquet: the dump's assignments of a token to the expert in the layer (each of a token's top-K "
             "choices counts once; several files, one per rank, summed)",
}


def chunk_columns(chunk: Chunk, layers: list[int]) -> dict[str, Any]:
    """One chunk's trace rows, layer-major (every token at the first MoE layer, then the next...)."""
    T = len(chunk.row)
    L = len(layers)
    idx = np.stack([chunk.experts[li] for li in layers])  # [L, T, K]
    K = idx.shape[-1]
    cols: dict[str, Any] = {"row": np.tile(chunk.row, L), "pos": np.tile(chunk.pos, L),
                            "token_id": np.tile(chunk.token_id, L), "domain": np.full(T * L, "", dtype=object),
                            "layer": np.repeat(np.asarray(layers, dtype=np.int64), T)}
    for k in range(K):
        cols[f"expert_{k + 1}"] = idx[:, :, k].reshape(-1).astype(np.int64)
    for k in range(K):
        cols[f"weight_{k + 1}"] = np.full(T * L, np.nan, dtype=np.float32)
    return cols


def write_trace(chunks: Iterator[Chunk], shape: ModelShape, path: Path) -> dict[str, int]:
    """Stream ``chunks`` into the trace Parquet at ``path`` (:class:`~moetool.engine.stream.TableStream`, one row
    group per chunk); returns the numbers written (tokens, rows, requests)."""
    from ..engine.stream import TableStream

    tokens = rows = 0
    seen_rows: set[int] = set()
    with TableStream(path) as out:
        for c in chunks:
            if len(c.row) == 0:
                continue
            shape.check_token_ids(c.token_id, "the dump")
            out.write(chunk_columns(c, shape.moe_layers))
            tokens += len(c.row)
            rows += len(c.row) * len(shape.moe)
            seen_rows.update(np.unique(c.row).tolist())
    if tokens == 0:
        raise MoetoolError("the dump holds no routed token: nothing to import")
    return {"tokens": tokens, "rows": rows, "requests": len(seen_rows)}


def check_counts(counts: dict[int, np.ndarray], shape: ModelShape, what: str, noun: str = "dump",
                 layers: Any = None) -> None:
    """The one check of counts-only routing (``{MoE layer: [n] assignments}``) against the model's ``shape``, at
    import (``noun`` "dump": refused before anything is written) and where ``stats``/``placement``/``offload``
    read a loads file back (``noun`` "trace", ``layers`` those asked): no negative count, every MoE layer present
    and routing at least one token, each layer's assignments a whole number of top-K choices."""
    at = f"{what}: " if what else ""
    for li, c in sorted(counts.items()):
        if (c < 0).any():
            e = int(np.argmin(c))
            raise MoetoolError(f"{at}the {noun} counts {int(c[e])} assignments for layer {li}, expert {e}: a "
                               f"count cannot be negative")
    if not counts or not any(c.sum() for c in counts.values()):
        raise MoetoolError(f"{at}the {noun} counts no routed token" + (": nothing to import" if noun == "dump"
                                                                           else ""))
    K = shape.top_k()
    for li in shape.moe_layers:
        if layers is not None and li not in layers:
            continue
        if li not in counts:
            raise MoetoolError(f"{at}layer {li} is not in the {noun} (MoE layers of {shape.source}: "
                               f"{spans(shape.moe_layers)}); a counts {noun} covers every MoE layer")
        total = int(counts[li].sum())
        if total == 0:
            raise MoetoolError(f"{at}layer {li} routed no token in the {noun} (MoE layers of {shape.source}: "
                               f"{spans(shape.moe_layers)}); a counts {noun} covers every MoE layer")
        if total % K:
            raise MoetoolError(f"{at}layer {li} counts {total} assignments, not a multiple of top-{K}")


def write_loads(counts: Counts, path: Path, shape: ModelShape) -> dict[str, int]:
    """Counts-only routing as ``layer, expert, count`` Parquet, checked first (:func:`check_counts`)."""
    import pandas as pd

    check_counts(counts.counts, shape, "")
    df = pd.concat([pd.DataFrame({"layer": li, "expert": np.arange(len(c)), "count": c})
                    for li, c in sorted(counts.counts.items())], ignore_index=True)
    df.to_parquet(path, index=False)
    return {"assignments": int(df["count"].sum())}


# ----- reading back ---------------------------------------------------------------------------------------------
@dataclass
class TraceSource:
    """A trace or loads file to analyse: ``kind`` ``"trace"`` (per-token rows) or ``"loads"`` (counts only),
    the model's shape, and the manifest's ``routing_source`` (empty for a trace of ``moetool trace``)."""

    path: Path
    kind: str
    shape: ModelShape
    routing_source: dict[str, Any] = field(default_factory=dict)
    #: the policy a ``moetool trace`` recorded under (its manifest's ``routing``, with the ``--layers`` it ran in);
    #: ``None``: an engine's dump or a bare file, whose routing is the model's as it served or trained
    routing: dict[str, Any] | None = None
    #: what the trace's manifest says of the run that recorded it (:func:`_recorded`): ``model`` (a ``moetool
    #: trace``'s model entry), ``data`` (its data entry; an import's tokens and requests), ``options`` (the
    #: ``data``, ``seq_len``, ``max_tokens`` it read the text with), ``tokens`` (the tokens it holds, when known)
    recorded: dict[str, Any] = field(default_factory=dict)

    @property
    def weights(self) -> bool:
        """Whether the trace carries gate weights (a trace of ``moetool trace``; never an engine's dump)."""
        return self.kind == "trace" and not self.routing_source

    def describe(self) -> dict[str, Any]:
        return {"trace": str(self.path), "kind": self.kind, "routing_source": self.routing_source or
                "moetool trace", **({"routing": self.routing} if self.routing else {}),
                "shape": self.shape.to_manifest()}

    @property
    def model_name(self) -> str:
        """The model whose routing the trace holds: the name its ``moetool trace`` run loaded, else the model of the
        shape (an import's ``--config``, or ``--trace-config``)."""
        return str((self.recorded.get("model") or {}).get("name") or self.shape.source)


#: the model entry's fields an analysis of a trace records of the model that ran (its config, kept in the trace's
#: manifest, is left there)
MODEL_FIELDS = ("name", "source", "kind", "model_type", "dtype", "device", "moe_layers", "quantization")
#: the options of ``moetool trace`` that say what text it read, as a forward of another command records them
DATA_OPTIONS = ("data", "seq_len", "max_tokens")


def _recorded(man: dict[str, Any], rs: dict[str, Any]) -> dict[str, Any]:
    """:attr:`TraceSource.recorded` from the trace's manifest ``man`` (``rs``: its ``routing_source``, an import's):
    a ``moetool trace`` run's model and data entries and the options that chose its text; an engine's dump the
    tokens and requests import-trace counted (the text it served is not known); ``{}`` without a manifest."""
    if rs:
        return {"data": {k: rs[k] for k in ("tokens", "requests") if isinstance(rs.get(k), int)},
                **({"tokens": rs["tokens"]} if isinstance(rs.get("tokens"), int) else {})}
    model = man.get("model") if isinstance(man.get("model"), dict) else {}
    data = man.get("data") if isinstance(man.get("data"), dict) else {}
    opts = man.get("options") if isinstance(man.get("options"), dict) else {}
    return {"model": {k: model[k] for k in MODEL_FIELDS if k in model}, "data": data,
            "options": {k: opts[k] for k in DATA_OPTIONS if k in opts},
            **({"tokens": data["tokens"]} if isinstance(data.get("tokens"), int) else {})}


def _manifest(folder: Path) -> dict[str, Any]:
    p = folder / "manifest.json"
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise MoetoolError(f"{p}: not valid JSON") from None


def parquet_rows(p: Path) -> int | None:
    """The rows a Parquet file's footer records (``None``: not Parquet, or no readable footer)."""
    if not p.name.endswith(".parquet"):
        return None
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(p).num_rows
    except Exception:  # noqa: BLE001 - pyarrow's errors for a truncated or foreign file: read_batches says it
        return None


def open_trace(path: str | Path, config: str | None = None) -> TraceSource:
    """The trace or loads file at ``path`` (or in the run folder ``path``), with the model's shape from the
    manifest (imported: ``routing_source.shape``; ``moetool trace``: its model) or from ``config``."""
    p = Path(path)
    if p.is_dir():
        found = [p / n for n in (TRACE, "trace.csv.gz", LOADS) if (p / n).is_file()]
        if not found:
            raise MoetoolError(f"{p}: no trace.parquet, trace.csv.gz or loads.parquet in the folder (write one with "
                               f"moetool trace or moetool import-trace)")
        p = found[0]
    elif not p.is_file():
        raise MoetoolError(f"--trace {p}: no such file or folder")
    if not (p.name.endswith(".parquet") or p.name.endswith(".csv.gz")):
        raise MoetoolError(f"--trace {p}: a trace is a .parquet or .csv.gz file (moetool trace / import-trace)")
    man = _manifest(p.parent)
    rows = parquet_rows(p)
    problem = table_problem(p, rows, manifest=man)
    if problem:  # rows lost or edited: every number drawn from it would be another routing's
        raise MoetoolError(f"--trace {p} {problem}")
    if p.name.endswith(".parquet") and rows is None:  # unreadable, and no record said so (an older manifest)
        _open_parquet(p)  # raises the one line naming why, before any work
    rs = man.get("routing_source") or {}
    kind = "loads" if p.name == LOADS or rs.get("kind") == "loads" else "trace"
    recorded = None  # the shape the manifest records (import-trace) or names (moetool trace's model)
    if rs.get("shape"):
        recorded = ModelShape.from_manifest(rs["shape"])
    elif (man.get("model") or {}).get("name"):
        try:
            recorded = ModelShape.from_config(man["model"]["name"])
        except MoetoolError:
            if config is None:
                raise
    routing = None
    if not rs and isinstance(man.get("routing"), dict):  # moetool trace: the policy whose choices it recorded
        layers = (man.get("options") or {}).get("layers")
        routing = {**man["routing"], **({"layers": layers} if layers is not None else {})}
    if config is None:
        if recorded is None:
            raise MoetoolError(f"--trace {p}: no manifest.json beside it naming the model: give --trace-config")
        return TraceSource(p, kind, recorded, rs, routing, _recorded(man, rs))
    shape = ModelShape.from_config(config)
    if recorded is not None and ((shape.num_layers, shape.moe, shape.zero)
                                 != (recorded.num_layers, recorded.moe, recorded.zero)):
        raise MoetoolError(f"--trace-config {config}: {_describe(shape)}, but the trace's manifest records "
                           f"{_describe(recorded)} ({recorded.source}): drop --trace-config, or give the model whose "
                           f"routing it is")
    return TraceSource(p, kind, shape, rs, routing, _recorded(man, rs))


def _describe(shape: ModelShape) -> str:
    """``4 layers, MoE layers 0-3 of 8 experts, top-2`` (each distinct (n, K, zero-computation experts) with its
    layers)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for li, (n, k) in sorted(shape.moe.items()):
        groups.setdefault((n, k, shape.n_zero_compute(li)), []).append(li)
    return f"{shape.num_layers} layers, " + "; ".join(
        f"MoE layers {_span(ls)} of {n} experts" + (f" ({z} of them zero-computation)" if z else "") + f", top-{k}"
        for (n, k, z), ls in groups.items())


def _span(layers: list[int]) -> str:
    return (f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1))
            else ",".join(map(str, layers)))


def read_batches(src: TraceSource, columns: list[str] | None = None) -> Iterator[Any]:
    """The trace's rows as pandas DataFrames of at most :data:`ROWS_PER_READ` rows, in file order; a column asked
    for that the file lacks, or a ``layer`` that is no whole number, is one line (never a KeyError, never layer 0.5
    read as 0)."""
    if columns is not None:
        names = set(column_names(src))  # the schema or header read once, not once per column
        missing = [c for c in columns if c not in names]
        if missing:
            raise MoetoolError(f"--trace {src.path}: no {', '.join(missing)} column{'s' if len(missing) > 1 else ''}"
                               f" (a trace of moetool trace or import-trace has them; damaged or edited?)")
    import pandas as pd

    for df in _batches(src, columns):
        if "layer" in df.columns and len(df) and not pd.api.types.is_integer_dtype(df["layer"]):
            raise MoetoolError(f"--trace {src.path}: the layer column holds values that are not whole numbers "
                               f"(damaged or edited?)")
        yield df


def _batches(src: TraceSource, columns: list[str] | None) -> Iterator[Any]:
    if src.path.name.endswith(".parquet"):
        f = _open_parquet(src.path)
        batches = f.iter_batches(batch_size=ROWS_PER_READ, columns=columns)
        while True:
            try:
                b = next(batches, None)
            except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged page
                raise _unreadable(src.path, "Parquet", e) from None
            if b is None:
                return
            yield b.to_pandas()
    else:
        import pandas as pd

        with _reading_csv(src.path):
            reader = pd.read_csv(src.path, chunksize=ROWS_PER_READ, usecols=columns)
        while True:
            with _reading_csv(src.path):  # a truncated gzip fails only where it ends
                df = next(reader, None)
            if df is None:
                return
            yield df


def _unreadable(p: Path, kind: str, e: BaseException) -> MoetoolError:
    """One line for a trace file that cannot be read (a truncated copy, another file under the name)."""
    return MoetoolError(f"--trace {p}: not a readable {kind} file (truncated or damaged?): {first_line(e)}")


def _open_parquet(p: Path) -> Any:
    """``pyarrow.parquet.ParquetFile(p)``, or the one line of :func:`_unreadable`."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(p)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a truncated or foreign file
        raise _unreadable(p, "Parquet", e) from None


@contextmanager
def _reading_csv(p: Path) -> Iterator[None]:
    """pandas and gzip's errors of a truncated or foreign ``.csv.gz`` as the one line of :func:`_unreadable`."""
    import zlib

    try:
        yield
    except (EOFError, OSError, ValueError, zlib.error) as e:  # BadGzipFile is an OSError, ParserError a ValueError
        raise _unreadable(p, "CSV (gzip)", e) from None


def column_names(src: TraceSource) -> list[str]:
    """The trace file's column names (its Parquet schema or its CSV header)."""
    if src.path.name.endswith(".parquet"):
        return list(_open_parquet(src.path).schema_arrow.names)
    import pandas as pd

    with _reading_csv(src.path):
        return list(pd.read_csv(src.path, nrows=0).columns)


def expert_columns(src: TraceSource) -> list[str]:
    """``expert_1 .. expert_K`` of the trace (K from its schema)."""
    names = column_names(src)
    cols = [c for c in names if c.startswith("expert_")]
    if "layer" not in names or not cols:
        raise MoetoolError(f"--trace {src.path}: no layer / expert_k columns: not a moetool trace")
    return sorted(cols, key=lambda c: int(c.split("_")[1]))


def read_loads(src: TraceSource) -> dict[int, np.ndarray]:
    """``{layer: [n] counts}`` of a loads file."""
    f = _open_parquet(src.path)
    try:
        df = f.read().to_pandas()
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged page
        raise _unreadable(src.path, "Parquet", e) from None
    import pandas as pd

    what = f"--trace {src.path}"
    missing = [c for c in ("layer", "expert", "count") if c not in df.columns]
    if missing:
        raise MoetoolError(f"{what}: no {', '.join(missing)} column: not a loads file (layer, expert, count)")
    bad = [c for c in ("layer", "expert", "count") if len(df) and not pd.api.types.is_integer_dtype(df[c])]
    if bad:  # 10.5 would be truncated to 10, an expert 2.5 or NaN has no row to count in
        raise MoetoolError(f"{what}: {', '.join(bad)} must be whole numbers in every row (damaged or edited?)")
    out = {}
    for li, g in df.groupby("layer", sort=True):
        li = int(li)
        if li not in src.shape.moe:
            raise MoetoolError(f"{what}: layer {li} is not an MoE layer of the model")
        e = check_ids(g["expert"].to_numpy(dtype=np.int64), src.shape.n_experts(li), what, li, of="the model")
        u, k = np.unique(e, return_counts=True)
        if (k > 1).any():  # moetool writes one row per (layer, expert): which count is the run's is unknown
            raise MoetoolError(f"{what}: layer {li}, expert {int(u[k > 1][0])} has {int(k.max())} rows: a loads "
                               f"file counts each expert once (damaged or edited?)")
        c = np.zeros(src.shape.n_experts(li), dtype=np.int64)
        c[e] = g["count"].to_numpy(dtype=np.int64)
        out[li] = c
    return out
