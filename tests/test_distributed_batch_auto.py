"""``--batch-size auto``: rows from the free memory and the model's sizes; results equal an explicit batch size."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from moetool import sizing
from moetool.commands import options as O
from moetool.errors import MoetoolError
from moetool.commands.app import app
from moetool.loading import load_config
from moetool.sizing import count_parameters

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # tiers: pytest -m 'not slow'

runner = CliRunner()


def per_row_and_weights(model="tiny", seq_len=64, probe=False):
    """Independent of estimate_memory: fp32 on CPU, logits + two hidden states per token, times the slack; a policy
    that probes every expert (norm) adds the [seq_len, n] fp32 scores per row and 2^26 fp32 chunk elements once
    (counted with the weights)."""
    config, _, _ = load_config(model)
    row = seq_len * (config.vocab_size + 2 * config.hidden_size + probe * config.num_local_experts) * 4
    return row * sizing.AUTO_SLACK, count_parameters(config) * 4 + probe * 4 * 2 ** 26


@pytest.mark.parametrize("k", [1, 5, 37])
def test_auto_rows_from_free_memory(monkeypatch, k):
    row, weights = per_row_and_weights()
    free = weights + (k + 0.5) * row / sizing.AUTO_SHARE  # room for k rows and a half
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(free))
    rows, facts = sizing.auto_batch_size("tiny", seq_len=64, max_tokens=10 ** 6, device="cpu")
    assert rows == k and facts["memory_rows"] == k and facts["reason"] == "fits memory"
    # two processes on the node share the RAM; the data cap: 300 tokens = 5 rows of 64 (3 per rank on 2 ranks)
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(2 * free))
    assert sizing.auto_batch_size("tiny", seq_len=64, max_tokens=10 ** 6, device="cpu", processes=2)[0] == k
    assert sizing.auto_batch_size("tiny", seq_len=64, max_tokens=300, device="cpu", world=2, processes=2)[0] == min(k, 3)


def test_auto_refuses_when_no_row_fits(monkeypatch):
    row, weights = per_row_and_weights()
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(weights + 0.5 * row / sizing.AUTO_SHARE))
    with pytest.raises(MoetoolError, match="not even one row"):
        sizing.auto_batch_size("tiny", seq_len=64, device="cpu")
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: None)
    assert sizing.auto_batch_size("tiny", seq_len=64, max_tokens=10 ** 6, device="cpu")[0] == 8


def test_parse_batch_size():
    assert O.parse_batch_size("auto") == O.AUTO_BATCH and O.parse_batch_size("12") == 12 == O.parse_batch_size(12)
    for bad in ("0", "-3", "big"):
        with pytest.raises(Exception, match="auto"):
            O.parse_batch_size(bad)


def test_cli_auto_equals_explicit_batch(tmp_path, monkeypatch):
    """On the real CPU: auto picks a valid batch, says so on the console and in the manifest, and ppl's table
    equals the one with that batch size given explicitly and with a different one (4)."""
    row, weights = per_row_and_weights(probe=True)  # norm:gate probes every expert (NormPolicy.needs_probe)
    monkeypatch.setattr("moetool.sizing.available_memory", lambda dev: int(weights + 6.5 * row / sizing.AUTO_SHARE))
    base = ["ppl", "--model", "tiny", "--max-tokens", "1500", "--seq-len", "64", "--routing", "norm:gate",
            "--bootstrap", "0", "--quiet"]
    r = runner.invoke(app, base + ["--batch-size", "auto", "--out", str(tmp_path / "auto")])
    assert r.exit_code == 0, r.output
    assert "--batch-size auto: 6 rows per forward" in r.output
    man = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert man["batch_size_auto"]["rows"] == man["options"]["batch_size"] == 6
    assert man["batch_size_auto"]["device"] == "cpu" and man["batch_size_auto"]["reason"]  # the decision's facts
    got = pd.read_csv(tmp_path / "auto" / "ppl.csv").drop(columns="seconds")
    for bs in ("6", "4"):
        r = runner.invoke(app, base + ["--batch-size", bs, "--out", str(tmp_path / bs)])
        assert r.exit_code == 0, r.output
        want = pd.read_csv(tmp_path / bs / "ppl.csv").drop(columns="seconds")
        pd.testing.assert_frame_equal(got, want, check_exact=bs == "6", rtol=1e-6)


@pytest.mark.xdist_group("auto_model_group")
@pytest.mark.parametrize("world, layout", [(2, ["--tp", "2"]), (4, ["--tp", "2", "--ep", "2"])])
def test_auto_under_tp_ep_sizes_one_model_group(tmp_path, world, layout):
    """torchrun with gloo on CPU (tests/oom_ranks.py: ``MOETOOL_TEST_FREE_BYTES`` is the node's free RAM, shared by
    its ``world`` processes): --batch-size auto takes the rows of one model group from what each rank has beside ITS
    share of the weights (test_run_driver.tiny_rank_weights: room for 5.5 rows), at most the rows --max-tokens fills
    (7) on each of the world / 2 data-parallel groups: 5 rows with --tp 2 (one group), 4 with --tp 2 --ep 2 (two).
    On BASE: 2 memory rows (the whole model's weights counted on each rank) and the data split over every process
    (4 and 2 data rows)."""
    import subprocess
    from pathlib import Path

    from test_distributed_cli import _env, torchrun
    from test_run_driver import tiny_rank_weights

    row = 3 * 64 * (2048 + 2 * 128) * 4  # tiny, fp32: logits over 2,048 tokens and two hidden states of 128, 3x
    free = int(world * (tiny_rank_weights(2) + 5.5 * row / 0.8))
    env = dict(_env(), MOETOOL_TEST_OOM_ROWS=",".join(["1000"] * world), MOETOOL_TEST_FREE_BYTES=str(free))
    args = ["ppl", "--model", "tiny", "--max-tokens", str(7 * 64), "--seq-len", "64", "--bootstrap", "0", "--quiet",
            "--batch-size", "auto", "--out", str(tmp_path / "auto"), *layout]
    for _ in range(3):  # a taken rendezvous port: launched again (as run_cli)
        p = subprocess.run(torchrun(world, (str(Path(__file__).with_name("oom_ranks.py")),)) + args, cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
        if "EADDRINUSE" not in p.stderr:
            break
    assert p.returncode == 0, p.stderr[-3000:]
    dp = world // 2
    m = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    auto = m["batch_size_auto"]
    assert (auto["memory_rows"], auto["data_rows"], auto["rows"]) == (5, -(-7 // dp), min(5, -(-7 // dp)))
    assert auto["weights_bytes"] == tiny_rank_weights(2) and m["options"]["batch_size"] == auto["rows"]
    assert f"--batch-size auto: {auto['rows']} rows per forward" in p.stderr
    assert m["model"]["parallel"]["dp"] == dp
