"""bench/bench_gpu.py's printout (``bench.py --gpu``): what the GPU session reads without a chance to debug."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_gpu():
    sys.path.insert(0, str(BENCH))  # bench_gpu imports its neighbour bench.py as ``bench``
    try:
        return importlib.import_module("bench_gpu")
    finally:
        sys.path.remove(str(BENCH))


def test_gpu_report_prints_counts_as_integers():
    """The CLI table's ``tokens`` (ppl's scored tokens, NaN on the other rows) read '2040.00'; the commands table's
    ``tokens`` and the quantized table's counts likewise. Counts print as integers, a missing one as '-'."""
    G = bench_gpu()
    rows = [{"section": "cli", "model": "m", "variant": "inspect --model DIR (first)", "device": "cpu", "seconds": 6.5},
            {"section": "cli", "model": "m", "variant": "ppl --model DIR", "device": "cpu", "seconds": 10.25,
             "forward_seconds": 1.5, "tokens": 2040},
            {"section": "cli", "model": "m", "variant": "load: moetool.load", "device": "cpu", "seconds": 0.5,
             "gb_per_s": 0.25, "bytes": 5e7}]
    text = G.report(pd.DataFrame(rows), SimpleNamespace(gpu_repeat=1, gpu_seq=256, gpu_batch=4, gpu_command_rounds=1))
    lines = {r["variant"]: ln.split() for r in rows for ln in text.splitlines() if ln.strip().startswith(r["variant"])}
    assert lines["ppl --model DIR"][-5:] == ["DIR", "10.25", "1.50", "2040", "-"]
    assert lines["inspect --model DIR (first)"][-4:] == ["6.50", "-", "-", "-"]
    assert lines["load: moetool.load"][-4:] == ["0.50", "-", "-", "0.25"]
    assert "2040.00" not in text
