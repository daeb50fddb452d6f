"""Streamed tables: rows round-trip in order through Parquet and gzip CSV; writer-thread errors surface."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moetool.engine.stream import TableStream
from moetool.errors import MoetoolError


def batches(n_batches=25, rows=37, seed=0):
    rng = np.random.default_rng(seed)
    out, start = [], 0
    for b in range(n_batches):
        k = rows + b % 5  # batches of different sizes
        out.append({"row": np.arange(start, start + k), "layer": np.full(k, b % 3, dtype=np.int16),
                    "token": [f"t{i},\"q\"\n" for i in range(start, start + k)],  # commas, quotes, newlines
                    "weight_1": rng.random(k).astype(np.float32)})
        start += k
    return out


@pytest.mark.parametrize("suffix", ["parquet", "csv.gz"])
def test_rows_round_trip_in_order(tmp_path, suffix):
    path = tmp_path / f"t.{suffix}"
    data = batches()
    with TableStream(path, max_pending=2) as out:
        for i, b in enumerate(data):
            out.write(b if i % 2 else pd.DataFrame(b))  # mappings and DataFrames alike
    want = pd.concat([pd.DataFrame(b) for b in data], ignore_index=True)
    got = pd.read_parquet(path) if suffix == "parquet" else pd.read_csv(path)
    assert out.rows == len(want) and out.batches == len(data)
    assert got["row"].tolist() == list(range(len(want)))
    assert got["token"].tolist() == want["token"].tolist()
    assert got["layer"].tolist() == want["layer"].tolist()
    np.testing.assert_allclose(got["weight_1"].to_numpy(), want["weight_1"].to_numpy(), rtol=1e-6)
    if suffix == "parquet":
        import pyarrow.parquet as pq

        assert pq.ParquetFile(path).num_row_groups == len(data)  # one row group per batch


def test_writer_error_surfaces_in_the_calling_thread(tmp_path):
    out = TableStream(tmp_path / "t.parquet", max_pending=1)
    out.write({"a": np.arange(3)})
    out.write({"b": np.arange(3)})  # other columns: the writer thread fails on it
    with pytest.raises(MoetoolError, match="has columns"):
        for _ in range(100):  # raised at a later write (or at close), never lost
            out.write({"a": np.arange(3)})
        out.close()
    with pytest.raises(MoetoolError, match="has columns"):
        out.close()


def test_type_error_in_a_batch_is_reported_with_the_path(tmp_path):
    path = tmp_path / "t.csv.gz"
    with pytest.raises(MoetoolError, match="t.csv.gz"):
        with TableStream(path) as out:
            out.write({"a": np.arange(3)})
            out.write({"a": ["x", "y", "z"]})  # cannot cast to int64


def test_bad_suffix():
    with pytest.raises(MoetoolError, match="parquet or .csv.gz"):
        TableStream("trace.csv")


def test_csv_gz_bytes_depend_on_the_rows_only(tmp_path, monkeypatch):
    """A trace.csv.gz of an uninterrupted run and of a resumed one (same rows) had other bytes, so the manifest's
    sha256 differed: gzip's header held the time and the temporary name (.part-<pid>-trace.csv). Now neither."""
    import gzip
    import time

    rows = {"a": np.arange(10), "b": np.linspace(0, 1, 10)}
    paths = [tmp_path / ".part-11-trace.csv.gz", tmp_path / ".part-22-trace.csv.gz"]
    for i, p in enumerate(paths):
        monkeypatch.setattr(time, "time", lambda i=i: 1_700_000_000.0 + 1000 * i)
        with TableStream(p) as out:
            out.write(rows)
    a, b = (p.read_bytes() for p in paths)
    assert a == b and a[3] & 0x08 == 0 and a[4:8] == bytes(4)  # no FNAME flag, MTIME 0
    assert gzip.decompress(a).decode().splitlines()[0] == '"a","b"'


def test_a_writer_that_falls_behind_holds_the_producer_at_max_pending_batches(tmp_path, monkeypatch):
    """Memory stays flat: with ``max_pending=2`` and the writer stuck in its first batch, the producer's fourth
    ``write`` waits (the writer holds batch 0, the queue batches 1 and 2) until the writer moves on; then every row
    arrives in order. An unbounded queue let all six writes return at once."""
    import threading
    import time

    gate = threading.Event()
    opened = TableStream._open

    def stuck_open(self, schema):
        writer, sink = opened(self, schema)

        class Stuck:
            def write_table(self, table):
                gate.wait(10)
                writer.write_table(table)

            def close(self):
                writer.close()
        return Stuck(), sink

    monkeypatch.setattr(TableStream, "_open", stuck_open)
    out = TableStream(tmp_path / "t.parquet", max_pending=2)
    done = []

    def produce():
        for i in range(6):
            out.write({"a": np.arange(3 * i, 3 * i + 3)})
            done.append(i)

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 5
    while len(done) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # time for a fourth write to return, were it free to
    assert done == [0, 1, 2] and out._queue.qsize() == 2 and t.is_alive()
    gate.set()
    t.join(10)
    out.close()
    assert done == list(range(6)) and pd.read_parquet(tmp_path / "t.parquet")["a"].tolist() == list(range(18))
