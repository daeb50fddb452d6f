"""The CLI under torchrun: 2 gloo processes on CPU write one run folder whose tables equal one process's.

Each run is bounded (``timeout`` + ``MOETOOL_DIST_TIMEOUT``): a collective mismatch fails in a minute, never hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import recorded_tables
from test_distributed import free_port

from moetool.experiments.registry import EXPERIMENTS

# tiers: pytest -m 'not slow'; one xdist worker runs this module (--dist loadgroup): its launches are one module
# fixture, which each worker given some of the tests would otherwise run again (about 2.5 min of 2 cores)
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("distributed_cli")]


def _env(figures=False):
    """The launches' environment; without ``figures`` the runs draw no figure (``MOETOOL_FIGURES=none``): these
    tests compare tables, and drawing is rank 0's alone (no collective), checked once with figures below."""
    env = dict(os.environ, MOETOOL_DIST_TIMEOUT="60", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               MOETOOL_FIGURES="png,pdf" if figures else "none")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def torchrun(world, target=("-m", "moetool")):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *target]


def accelerate_launch(world, target=("-m", "moetool")):
    """``accelerate launch --multi_gpu``: accelerate's own launcher (torch's elastic agent underneath, the same
    RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT); without CUDA moetool joins with gloo on CPU.
    (``--cpu`` would start ONE process unless an MPI ``--mpirun_hostfile`` is given.)"""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(free_port()), *target]


def run_cli(args, cwd, world=1, launcher=torchrun, target=("-m", "moetool"), timeout=240, figures=False):
    for _ in range(3):  # free_port() frees the port it found: another test may take it before the launcher binds
        launch = launcher(world, target) if world > 1 else [sys.executable, *target]
        p = subprocess.run(launch + args, cwd=cwd, env=_env(figures), capture_output=True, text=True,
                           timeout=timeout)
        if not (world > 1 and p.returncode != 0 and "EADDRINUSE" in p.stderr):
            break  # (the launcher failed at its rendezvous, before any rank started: nothing was written)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def _read(path):
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)


def same_tables(one, two, skip=("seconds",)):
    """Every table of run ``one`` (CSV, gzipped CSV trace, Parquet) equals run ``two``'s, row for row."""
    names = sorted(f.name for p in ("*.csv", "*.csv.gz", "*.parquet") for f in one.glob(p))
    assert names and names == sorted(f.name for p in ("*.csv", "*.csv.gz", "*.parquet") for f in two.glob(p))
    for name in names:
        a, b = _read(one / name), _read(two / name)
        a, b = a.drop(columns=[c for c in skip if c in a]), b.drop(columns=[c for c in skip if c in b])
        # traces keep float32 weights/logits at full precision: last-bit forward differences show (rtol 1e-5 there)
        trace = not name.endswith(".csv")
        rtol = 1e-5 if trace else 1e-6
        # atol: a value near 0 computed from float32 outputs of size ~1 (expert-similarity's cosines of 0.0158 or
        # -0.0015) carries their last-bit differences (float32 eps 1.2e-7) as an absolute error: 3e-8 seen; a trace's
        # logit near 0 carries the rounding of its layer's logits (up to ~3 here: 3.6e-7 per ulp; 1.3e-7 seen on an
        # AVX-512 CPU, whose GEMM kernels block the rows of a 2-row and a 4-row batch differently)
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=rtol, atol=1e-6 if trace else 1e-7, obj=name)
    return names


def check_manifest(one, two, data=True):
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    d = m2["distributed"]
    assert "distributed" not in m1 and d["world_size"] == 2 and d["backend"] == "gloo"
    assert m2["status"] == "complete"
    if data:
        assert sum(d["tokens_per_rank"]) == m1["data"]["tokens"] == m2["data"]["tokens"]
        assert min(d["tokens_per_rank"]) > 0


DATA = ["--max-tokens", "560", "--seq-len", "64"]  # 9 packed rows: global batches of 4, 4 and 1 row; rank 1 has no
# row in the last and must still join every per-batch collective (k-means EMA sums, trace rows). (It was 1300
# tokens, 21 rows = 5 full batches + 1 row: the same shapes; the forwards are about half these launches' CPU.)
CASES = [
    ("ppl", ["--model", "tiny", *DATA, "--routing", "norm:gate", "--bootstrap", "200"]),
    ("stats", ["--model", "tiny", *DATA, "--bootstrap", "200", "--top-tokens", "5"]),
    ("norm-select", ["--model", "tiny", *DATA, "--nodes", "gate", "--norm", "l2", "--bootstrap", "100"]),
    ("erc", ["--model", "tiny", "--alpha", "0.5,1", "--samples", "2"]),
    ("approx", ["--model", "tiny", *DATA, "--selectors", "router,norm_oracle,random"]),
    ("mass-recall", ["--model", "tiny", *DATA, "-G", "4,16", "-M", "2,4", "--kmeans-iters", "1",
                     "--bootstrap", "100"]),
    ("fluctuation", ["tiny-early", "tiny", *DATA, "--routing", "router,similarity", "--bootstrap", "100"]),
    ("trace", ["--model", "tiny", *DATA, "--logits"]),
    ("trace", ["--model", "tiny", *DATA, "--format", "parquet", "--routing", "norm:gate"]),
    ("offload", ["--model", "tiny", *DATA, "--bootstrap", "100"]),
    ("topk", ["--model", "tiny", *DATA, "--ks", "1", "--ps", "0.8", "--bootstrap", "100"]),
    ("margin", ["--model", "tiny", *DATA, "--eps", "0,0.05", "--bootstrap", "100"]),
    ("agreement", ["--model", "tiny", *DATA, "--precisions", "fp32,bf16,fp8", "--bootstrap", "100"]),
    # capacity is per forward batch of --batch-size rows: the same 2 rows per batch on both sides (a rank's batches
    # are the one-process batches), not the 4-row one-process batches of the other cases
    ("capacity", ["--model", "tiny", *DATA, "--batch-size", "2", "--cf", "0.5,1.25", "--order", "order,score",
                  "--bootstrap", "100"]),
    ("prune", ["--model", "tiny", *DATA, "--fractions", "0.25", "--criteria", "reap,random", "--ablate", "1",
               "--bootstrap", "100"]),
    ("placement", ["--model", "tiny", *DATA, "--gpus", "2,4", "--extra-slots", "0,1", "--reference-data",
                   str(Path(__file__).parents[1] / "README.md")]),  # other text: the stale placement
]
NOT_DISTRIBUTED = {"eval": "lm-eval's own loop: tests/test_eval.py", "plan": "no model runs"}
# every other experiment of the registry: a short run with its spec's sample flags
CASES += [(name, ["--model", "tiny", *DATA, *spec.sample]) for name, spec in EXPERIMENTS.items()
          if name not in {c for c, _ in CASES} | set(NOT_DISTRIBUTED)]
# data parallel only (tests/test_tensor_parallel.py reuses CASES): rank 1 writes --export through its NullRun (a
# TypeError there); random-isolated draws per global row (they were per rank's batch sequence)
DP_CASES = CASES + [
    ("placement", ["--model", "tiny", *DATA, "--gpus", "4", "--extra-slots", "1", "--export", "eplb"]),
    ("fluctuation", ["tiny-early", "tiny", *DATA, "--routing", "router,random", "--isolate", "--bootstrap", "100"]),
]
IDS = [f"{c}{i}" for i, (c, _) in enumerate(DP_CASES)]
SEQUENCE = (str(Path(__file__).with_name("cli_sequence.py")),)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case once alone (one process, batches of 4 rows) and once on 2 torchrun ranks (2 rows each: the same
    global batches); a case giving its own --batch-size keeps it on both sides. Each side runs all the commands one
    after another in ONE process per rank (tests/cli_sequence.py), so the launcher, the process group and the
    imports are paid once, not per command."""
    root = tmp_path_factory.mktemp("dist")
    for side, rows in (("one", "4"), ("two", "2")):
        seq = [[command, "--quiet", *extra] + ["--batch-size", rows] * ("--max-tokens" in extra
                                                                        and "--batch-size" not in extra)
               + ["--out", str(root / f"{side}{i}")] for i, (command, extra) in enumerate(DP_CASES)]
        (root / f"{side}.json").write_text(json.dumps(seq))
    run_cli([str(root / "one.json")], root, target=SEQUENCE, timeout=600)
    return root, run_cli([str(root / "two.json")], root, world=2, target=SEQUENCE, timeout=600)


def test_torchrun_one_folder_one_console(runs):
    root, p = runs
    assert p.stdout.count("results in") == len(DP_CASES)  # rank 1 prints nothing
    assert not (root / "runs").exists()  # rank 1 made no folder of its own


@pytest.mark.parametrize("i", range(len(DP_CASES)), ids=IDS)
def test_torchrun_two_ranks_equal_one_process(runs, i):
    """Same global batches (2 ranks x 2 rows = 1 process x 4 rows): every table equal (float32 forwards of 2-row
    and 4-row batches differ in the last bits: rtol 1e-6), traces row for row; erc (weights only): each rank
    computes its share of the layers, rank 0 writes."""
    root, _ = runs
    same_tables(root / f"one{i}", root / f"two{i}")
    check_manifest(root / f"one{i}", root / f"two{i}", data="--max-tokens" in DP_CASES[i][1])
    # rank 0's manifest records every table it wrote, rows as one process's (moetool trace's streamed file too:
    # its rows are every rank's, gathered to rank 0)
    assert recorded_tables(root / f"two{i}") == recorded_tables(root / f"one{i}")


def test_accelerate_launch_two_ranks_equal_one_process(runs, tmp_path):
    """``accelerate launch -m moetool stats`` with 2 processes: the same tables and manifest as one process (the
    one-process stats run of the torchrun cases)."""
    pytest.importorskip("accelerate")
    root, _ = runs
    command, extra = CASES[1]
    assert command == "stats"
    p = run_cli([command, "--quiet", *extra, "--batch-size", "2", "--out", str(tmp_path / "two")], tmp_path,
                world=2, launcher=accelerate_launch, figures=True)
    same_tables(root / "one1", tmp_path / "two")
    check_manifest(root / "one1", tmp_path / "two")
    assert p.stdout.count("results in") == 1
    # the one launch here that draws figures: rank 0 saves each as PNG and PDF, listed in its manifest
    drawn = {f.name for f in (tmp_path / "two" / "figures").iterdir()}
    files = json.loads((tmp_path / "two" / "manifest.json").read_text())["files"]
    assert drawn and {f.rsplit(".", 1)[0] for f in drawn if f.endswith(".png")} == \
        {f.rsplit(".", 1)[0] for f in drawn if f.endswith(".pdf")}
    assert {f"figures/{f}" for f in drawn} <= set(files)
    assert not (root / "one1" / "figures").exists()  # the fixture's runs drew none (MOETOOL_FIGURES=none)


LAUNCHER_VARS = [("RANK", "WORLD_SIZE", "LOCAL_RANK"),  # torchrun, accelerate launch --multi_gpu
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # mpirun (Open MPI)
                 ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH / Intel MPI
                 ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK")]  # MVAPICH


@pytest.mark.parametrize("names", LAUNCHER_VARS, ids=[n[0] for n in LAUNCHER_VARS])
def test_launcher_environment(monkeypatch, names):
    """What each launcher sets is what moetool reads (accelerate launch --cpu --mpirun_hostfile starts the ranks
    with mpirun: only the MPI names are set, MASTER_ADDR/PORT by accelerate); one progress display, rank 0's."""
    from moetool import distributed, progress

    for var in sum(LAUNCHER_VARS, ()):
        monkeypatch.delenv(var, raising=False)
    assert distributed.env() == distributed.DistEnv(0, 1, 0) and not progress._other_rank()
    for var, value in zip(names, ("3", "4", "1")):
        monkeypatch.setenv(var, value)
    assert distributed.env() == distributed.DistEnv(3, 4, 1) and progress._other_rank()
    monkeypatch.setenv(names[0], "4")
    with pytest.raises(distributed.MoetoolError, match="RANK=4 WORLD_SIZE=4"):
        distributed.env()


def test_device_map_needs_one_process_per_node(tmp_path, monkeypatch):
    """--device-map spreads one model over a node's GPUs: several ranks per node would share them; refused in one
    line before anything is loaded or created."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    r = CliRunner().invoke(app, ["ppl", "--device-map", "auto", "--max-tokens", "256", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "launch one process per node (torchrun --nproc-per-node 1), not 2" in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args", [["plan", "--model", "tiny"], ["report", "RUN"], ["demo"],
                                  ["import-trace", "dump.jsonl", "--config", "tiny"],
                                  ["stats", "--trace", "RUN"], ["placement", "--trace", "RUN"],
                                  ["offload", "--trace", "RUN"], ["fluctuation", "--trace", "RUN", "RUN"]],
                         ids=lambda a: "-".join(a[:2]))
def test_one_process_commands_refuse_a_launcher(tmp_path, monkeypatch, args):
    """plan, report, demo, import-trace and the --trace analyses create their run folder on every rank (no rank
    split, no rank-0 writer): under torchrun 2 ranks each ran the whole command into the same --out, one of them
    failing ('filled by another run' / 'not empty', torchrun exit 1, rank 0's folder then marked interrupted), or
    into two default folders. Refused in one line (exit 2) before anything is read or written."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    for var in sum(LAUNCHER_VARS, ()):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "RUN").mkdir()
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "runs in one process" in r.output and "(world size 2)" in r.output, r.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()
