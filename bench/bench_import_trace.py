"""``import-trace`` speed and memory: a synthetic vLLM JSONL dump (API responses, base64 ``.npy`` routed experts)
of a Qwen3-30B-A3B-shaped model (48 layers, 128 experts, top-8) read and written as moetool's trace Parquet.

    python bench/bench_import_trace.py                    # 40 requests x 2048 tokens (~40 MB of JSONL)
    python bench/bench_import_trace.py --requests 200     # a larger dump: peak memory should not grow with it

Prints the dump's size, the wall time, tokens/s, the trace's size and the process's peak RSS before and after
the import (peak RSS growth stays about one request plus one Parquet row group, whatever the dump's size: the
import is streamed). Measured on 2 shared CPU cores: 12 and 48 requests of 1024 tokens (6 and 24 MiB of JSONL)
grew the peak RSS by 12 and 13 MiB, at about 9,000 tokens/s (430,000 trace rows/s).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def peak_mib() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    args = ap.parse_args()

    import pyarrow.parquet  # noqa: F401 - imported before the measurement (as torch, by the stream writer)

    from moetool.engine.stream import TableStream  # noqa: F401
    from moetool.traces import readers, store
    from moetool.traces.shape import ModelShape

    shape = ModelShape(args.layers, {i: (args.experts, args.top_k) for i in range(args.layers)}, "synthetic")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "responses.jsonl"
        with open(dump, "w") as f:
            for _ in range(args.requests):
                arr = np.argsort(rng.random((args.tokens, args.layers, args.experts)), -1)[..., :args.top_k]
                buf = io.BytesIO()
                np.save(buf, arr.astype(np.uint8))
                f.write(json.dumps({"choices": [{"routed_experts": base64.b64encode(buf.getvalue()).decode()}]})
                        + "\n")
        before = peak_mib()
        t0 = time.perf_counter()
        written = store.write_trace(readers.read([dump], shape).chunks, shape, Path(tmp) / "trace.parquet")
        wall = time.perf_counter() - t0
        after = peak_mib()
        print(f"dump {dump.stat().st_size / 2**20:.0f} MiB ({args.requests} requests x {args.tokens} tokens, "
              f"{args.layers} layers, top-{args.top_k} of {args.experts})")
        print(f"import {wall:.1f} s, {written['tokens'] / wall:,.0f} tokens/s, {written['rows'] / wall:,.0f} rows/s; "
              f"trace {(Path(tmp) / 'trace.parquet').stat().st_size / 2**20:.0f} MiB")
        print(f"peak RSS {before:.0f} MiB before the import, {after:.0f} MiB after (growth {after - before:.0f} MiB)")


if __name__ == "__main__":
    main()
