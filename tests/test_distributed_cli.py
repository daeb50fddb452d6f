"""The CLI under torchrun: 2 gloo processes on CPU write one run folder whose tables equal one process's.

Each run is bounded (``timeout`` + ``MOETOOL_DIST_TIMEOUT``): a collective mismatch fails in a minute, never hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from test_distributed import free_port


def _env():
    env = dict(os.environ, MOETOOL_DIST_TIMEOUT="60", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def run_cli(args, cwd, world=1):
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", "moetool"] if world > 1
              else [sys.executable, "-m", "moetool"])
    p = subprocess.run(launch + args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def same_tables(one, two, skip=("seconds",)):
    names = sorted(f.name for f in one.glob("*.csv"))
    assert names and names == sorted(f.name for f in two.glob("*.csv"))
    for name in names:
        a, b = pd.read_csv(one / name), pd.read_csv(two / name)
        a, b = a.drop(columns=[c for c in skip if c in a]), b.drop(columns=[c for c in skip if c in b])
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6, atol=1e-9, obj=name)
    return names


def check_manifest(one, two):
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    d = m2["distributed"]
    assert "distributed" not in m1 and d["world_size"] == 2 and d["backend"] == "gloo"
    assert sum(d["tokens_per_rank"]) == m1["data"]["tokens"] == m2["data"]["tokens"]
    assert min(d["tokens_per_rank"]) > 0 and m2["status"] == "complete"


@pytest.mark.parametrize("command, extra", [
    ("ppl", ["--routing", "norm:gate", "--bootstrap", "200"]),
    ("stats", ["--bootstrap", "200", "--top-tokens", "5"]),
])
def test_torchrun_two_ranks_equal_one_process(tmp_path, command, extra):
    """Same global batches (2 ranks x 2 rows = 1 process x 4 rows): every table equal (float32 forwards of 2-row
    and 4-row batches differ in the last bits: rtol 1e-6), one folder, one console."""
    base = [command, "--model", "tiny", "--max-tokens", "3000", "--seq-len", "64", "--quiet", *extra]
    run_cli(base + ["--batch-size", "4", "--out", str(tmp_path / "one")], tmp_path)
    p = run_cli(base + ["--batch-size", "2", "--out", str(tmp_path / "two")], tmp_path, world=2)
    same_tables(tmp_path / "one", tmp_path / "two")
    check_manifest(tmp_path / "one", tmp_path / "two")
    assert p.stdout.count("results in") == 1  # rank 1 prints nothing
    assert not (tmp_path / "runs").exists()  # rank 1 made no folder of its own
