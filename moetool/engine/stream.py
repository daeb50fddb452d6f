"""Streaming table writer: Parquet (one row group per batch) or gzip CSV, written on a background thread.

The forward hands each batch's columns (host numpy arrays, or a DataFrame) to :meth:`TableStream.write` and goes
on; a writer thread converts them to Arrow and writes them. The queue between the two is bounded
(``max_pending`` batches), so memory stays flat in the number of tokens whatever the speed of the disk: when
the writer falls behind, ``write`` waits for it instead of piling batches up. An error in the writer thread
(disk full, a column whose type changed) is raised again in the calling thread at the next ``write`` or at
``close``, never lost.

Format by suffix: ``.parquet`` (pyarrow ``ParquetWriter``, zstd, the first batch fixes the schema) or
``.csv.gz`` (pyarrow's CSV writer into a gzip stream; ``pandas.read_csv`` reads it).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Mapping

from ..errors import MoetoolError
from ..files import ReproducibleGzip

_STOP = object()


class TableStream:
    """``with TableStream(path) as out: out.write({"col": array, ...})`` — rows kept in the order written."""

    def __init__(self, path: str | Path, *, max_pending: int = 4, csv_compression_level: int = 1):
        self.path = Path(path)
        name = self.path.name
        if name.endswith(".parquet"):
            self.format = "parquet"
        elif name.endswith(".csv.gz"):
            self.format = "csv.gz"
        else:
            raise MoetoolError(f"{self.path}: a streamed table must end in .parquet or .csv.gz")
        self.level = csv_compression_level
        self.rows = 0
        self.batches = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"moetool-writer-{name}", daemon=True)
        self._thread.start()

    # ----- producer side (the forward's thread) --------------------------------------------------------
    def write(self, columns: Mapping[str, Any] | Any) -> None:
        """Queue one batch of rows: a mapping column -> 1-D array (numpy / list) or a pandas DataFrame."""
        if self._closed:
            raise MoetoolError(f"{self.path}: write after close")
        self._raise_if_failed()
        while True:
            try:
                self._queue.put(columns, timeout=0.1)
                return
            except queue.Full:  # the writer is behind: wait for it (memory stays bounded), unless it died
                self._raise_if_failed()
                if not self._thread.is_alive():
                    raise MoetoolError(f"{self.path}: the writer thread stopped")

    def close(self) -> None:
        """Write what is queued, close the file, raise the writer's error if it had one."""
        if not self._closed:
            self._closed = True
            while self._thread.is_alive():
                try:
                    self._queue.put(_STOP, timeout=0.1)
                    break
                except queue.Full:
                    continue
            self._thread.join()
        self._raise_if_failed()

    def __enter__(self) -> "TableStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller's error wins; still stop the thread and close the file
            try:
                self.close()
            except Exception:
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, MoetoolError):
                raise err
            raise MoetoolError(f"writing {self.path} failed: {type(err).__name__}: {err}") from err

    # ----- writer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        writer: Any = None
        sink: Any = None
        try:
            import pyarrow as pa

            schema = None
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if self._error is not None:
                    continue  # drain so the producer never blocks on a dead writer
                table = (pa.Table.from_pandas(item, preserve_index=False) if hasattr(item, "to_numpy")
                         and hasattr(item, "columns") else pa.table(dict(item)))
                if schema is None:
                    schema = table.schema
                    writer, sink = self._open(schema)
                elif table.schema != schema:
                    if table.schema.names != schema.names:
                        raise MoetoolError(f"{self.path}: batch {self.batches} has columns {table.schema.names}, "
                                           f"the first had {schema.names}")
                    table = table.cast(schema)
                writer.write_table(table)
                self.rows += table.num_rows
                self.batches += 1
        except BaseException as e:  # noqa: BLE001 - surfaced in the producer thread
            self._error = e
            self._drain()
        finally:
            try:
                if writer is not None:
                    writer.close()
                if sink is not None:
                    sink.close()
            except BaseException as e:  # noqa: BLE001
                if self._error is None:
                    self._error = e

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return

    def _open(self, schema: Any) -> tuple[Any, Any]:
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetWriter(str(self.path), schema, compression="zstd"), None
        import pyarrow.csv as pcsv

        # no name and time in the gzip header (gzip.open wrote the temporary .part-<pid>- name and the clock):
        # the same rows give the same bytes, so the manifest's sha256 of an identical table is the same
        sink = ReproducibleGzip(self.path, self.level)
        return pcsv.CSVWriter(sink, schema), sink
