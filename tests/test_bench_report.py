"""bench/bench_gpu.py's printout (``bench.py --gpu``): what the GPU session reads without a chance to debug."""

from __future__ import annotations

import importlib
import os
import subprocess
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


def test_cpu_report_prints_counts_as_integers(tmp_path, monkeypatch, capsys):
    """``bench.py``'s printout, sections whose rows lack ``tokens`` (--load) beside those that have it: the engine
    header read '512.0 tokens per pass', the --lazy-data and --cache-sim tables '20000.00' tokens, --rss's columns
    '2000.0'. Counts print as integers (the sections stood in by rows of known values)."""
    bench_gpu()
    import bench as B

    engine = [{"section": "engine", "model": "m", "variant": v, "device": "cpu", "tokens": 512, "ratio": r,
               "ratio_min": r, "ratio_max": r, "flop_ideal": f, "flop_ideal_recompute": f, "seconds": 1.5 * r}
              for v, r, f in (("plain", 1.0, 1.0), ("norm:gate", 1.25, 1.5))]
    monkeypatch.setattr(B, "bench_shapes", lambda a: engine)
    monkeypatch.setattr(B, "bench_load", lambda a: [{"section": "load", "model": "m", "variant": "moetool.load",
                                                     "device": "cpu", "seconds": 0.5, "gb_per_s": 0.25}])
    monkeypatch.setattr(B, "bench_lazy_data", lambda a: [
        {"section": "lazy_data", "model": "tiny", "variant": "load_tokens 20 MB", "device": "cpu", "tokens": 20000,
         "seconds": 0.5, "mib_read": 20.0, "read_whole_file_seconds": 0.25, "eager_seconds_estimate": 10.0}])
    monkeypatch.setattr(B, "bench_rss", lambda a: [
        {"section": "rss", "model": "tiny", "variant": "stats", "device": "cpu", "tokens": 2000, "peak_rss_mib": 512.0,
         "seconds": 3.0, "exit": 0}])
    monkeypatch.setattr(sys, "argv", ["bench.py", "--load", "--lazy-data", "--rss", "--csv", str(tmp_path / "b.csv")])
    B.main()
    out = capsys.readouterr().out
    assert "m (512 tokens per pass, plain 1.50s)" in out
    lazy = [ln.split() for ln in out.splitlines() if ln.startswith("load_tokens 20 MB")]
    assert lazy == [["load_tokens", "20", "MB", "20000", "0.50", "20.00", "0.25", "10.00"]]
    assert [ln.split() for ln in out.splitlines() if ln.startswith("tokens")] == [["tokens", "2000"]]
    assert pd.read_csv(tmp_path / "b.csv").tokens.tolist()[:2] == [512, 512]
    assert ".0 tokens" not in out and "20000.00" not in out


def test_gpu_check_keeps_the_bench_console_and_its_report_apart(tmp_path):
    """gpu_check.sh sent bench.py's console into $OUT/bench.txt, the file bench.py writes its report to
    (``--csv $OUT/bench.csv``): the report truncated the console mid-run and the buffered stdout copy landed at the
    console's offset (the stderr progress lost, the report spliced into itself). Run the script with a stand-in
    python that runs only bench.py (pip, the probes and the suite are no-ops): bench.txt is the report once,
    bench.log the console (its stderr lines, the same report, the exit code)."""
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/bash\n[ "$1" = bench/bench.py ] && exec env -u PYTHONUNBUFFERED {sys.executable} "$@"\n'
                    "exit 0\n")
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stub), "BENCH_ARGS": "--gpu --quick --gpu-sections"}
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (out / "bench.txt").read_text()
    assert report.count("moetool bench --gpu") == 1 and "\0" not in report
    assert report.splitlines()[0] == "moetool bench --gpu (issue #36)" and "wrote " + str(out / "bench.csv") in report
    log = (out / "bench.log").read_text()
    stderr_env = [ln for ln in log.splitlines() if ln.startswith("date: ") or ln.startswith("device: ")]
    assert len(stderr_env) == 2  # the environment bench.py prints on stderr before the report
    assert log.endswith(report + "bench exit 0\n") and log.count("moetool bench --gpu") == 1


def test_rss_figure_is_the_commands_own_peak(tmp_path):
    """``bench.py --rss``'s peak of a command: the command was started straight from the benchmark's process, whose
    own peak RSS Linux carries over exec into the child's ``ru_maxrss``: after ``--real`` (3 GB) every command read
    4178 MiB. Here this process peaks at 600 MiB first; a command that touches 100 MiB reports its own high-water
    mark (VmHWM, read by the command itself just before it exits)."""
    bench_gpu()
    import bench as B

    big = bytearray(600 * 2**20)
    big[::4096] = b"\1" * len(big[::4096])  # resident, page by page
    del big
    hwm = tmp_path / "hwm"
    code = (f"x = bytearray(100 * 2**20); x[::4096] = b'1' * len(x[::4096]); import re; "
            f"open({str(hwm)!r}, 'w').write(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    peak, _, exit_code = B.child_peak_rss([sys.executable, "-c", code], dict(os.environ))
    own = int(hwm.read_text()) * 1024
    assert exit_code == 0 and own > 100 * 2**20
    assert abs(peak - own) < 4 * 2**20, (peak / 2**20, own / 2**20)


def test_gpu_report_prints_each_quantized_token_count_on_its_rows():
    """``--quant-tokens`` takes several counts (``--gpu``: 1,024 and a batch's 16,384, the dequantization amortised):
    every row of the quantized table names its own count, the heading all of them."""
    G = bench_gpu()
    rows = [{"section": "quant", "model": "mixtral-d1024-8x2048", "variant": v, "probe": "expert_outputs",
             "device": "cuda:0", "tokens": t, "ratio": r, "ratio_min": r, "ratio_max": r, "seconds": 0.001}
            for t, v, r in ((1024, "plain", 1.0), (1024, "fp8", 1.5), (16384, "plain", 1.0), (16384, "fp8", 1.04))]
    text = G.report(pd.DataFrame(rows), SimpleNamespace(gpu_repeat=1, gpu_seq=256, gpu_batch=4, gpu_command_rounds=1))
    assert "same tokens per call (1024, 16384)" in text
    got = [ln.split()[:4] for ln in text.splitlines() if "expert_outputs" in ln]
    assert got == [["1024", "expert_outputs", "plain", "1.00"], ["1024", "expert_outputs", "fp8", "1.50"],
                   ["16384", "expert_outputs", "plain", "1.00"], ["16384", "expert_outputs", "fp8", "1.04"]]
