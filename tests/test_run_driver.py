"""The run driver's decisions (``moetool.run``) in process: the rows ``--batch-size auto`` keeps on ``--resume`` and
only then, the RAM a node's processes share, the auto choice in the manifest, eager attention, the unit key's
run-level options, --device-map per node -- against hand counts."""

from __future__ import annotations

import json

import pytest

from moetool import run as R
from moetool import sizing
from moetool.checkpoints import UNITS
from moetool.context import Backoff


def _key(out, **key):
    (out / UNITS).mkdir(parents=True)
    (out / UNITS / "key.json").write_text(json.dumps(key))


def test_resumed_rows_are_the_interrupted_runs_and_only_on_resume(tmp_path):
    """--resume keeps the rows the interrupted run recorded (6); without --resume (a --force over it) the old
    choice is not reused; a recorded 0, a boolean or a string is no number of rows."""
    _key(tmp_path / "a", batch_size=6)
    assert R.resumed_rows(tmp_path / "a", True) == 6
    assert R.resumed_rows(tmp_path / "a", False) is None
    assert R.resumed_rows(None, True) is None and R.resumed_rows(tmp_path / "none", True) is None
    for i, bad in enumerate((0, -2, True, "6", 2.0)):
        _key(tmp_path / f"b{i}", batch_size=bad)
        assert R.resumed_rows(tmp_path / f"b{i}", True) is None, bad


def test_batch_size_auto_shares_the_ram_among_the_nodes_processes(tmp_path, monkeypatch):
    """LOCAL_WORLD_SIZE=2 on CPU: each process sizes its rows from half the free RAM (hand count on tiny: fp32
    logits + two hidden states per token, 3x per row, 80 % of what the weights leave)."""
    from transformers import AutoModelForCausalLM
    import torch

    from moetool.loading import load_config

    config = load_config("tiny")[0]
    with torch.device("meta"):
        weights = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * 4
    row = 3 * 64 * (config.vocab_size + 2 * config.hidden_size) * 4
    free = int(2 * (weights + 4.5 * row / 0.8))  # each of 2 processes: room for 4.5 rows beside its weights
    monkeypatch.setattr(sizing, "available_memory", lambda dev: free)
    from moetool.context import _LOCAL, _RANK, _WORLD

    for var in (*_WORLD, *_RANK, *_LOCAL, "LOCAL_WORLD_SIZE"):  # one process
        monkeypatch.delenv(var, raising=False)
    params = {"model": "tiny", "seq_len": 64, "max_tokens": 10 ** 6, "device": "cpu", "out": None, "resume": False}
    alone = R.resolve_batch_size(params, R.Run(backoff=Backoff(enabled=True)))
    assert alone == int(0.8 * (free - weights) // row) > 9
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    run = R.Run(backoff=Backoff(enabled=True))
    assert R.resolve_batch_size(params, run) == 4 == run.backoff.choice["rows"]
    assert run.backoff.choice["processes_per_node"] == 2


def tiny_rank_weights(group: int) -> int:
    """Bytes of fp32 weights ONE rank holds of the tiny Mixtral (vocabulary V, hidden H, L layers, E experts of I
    features, key/value width KV) split over a ``--tp`` / ``--ep`` model group of ``group`` ranks, written out from
    its config: transformers' plans split the (tied) embedding over the vocabulary, q/k/v/o over the heads and the
    experts (their features under --tp, whole experts under --ep) ``group`` ways; the router and the norms stay whole
    on every rank. (Measured on the loaded model under gloo: 1,414,272 local parameters per rank for both layouts.)"""
    from moetool.loading import load_config

    c = load_config("tiny")[0]
    V, H, L, E, I = c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_local_experts, c.intermediate_size
    KV = c.num_key_value_heads * H // c.num_attention_heads
    split = V * H + L * (2 * H * H + 2 * H * KV + 3 * E * H * I)
    whole = L * (E * H + 2 * H) + H
    return (-(-split // group) + whole) * 4


@pytest.mark.parametrize("world, tp, ep", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (4, 2, 2)])
def test_batch_size_auto_under_tp_ep_sizes_a_model_group(monkeypatch, world, tp, ep):
    """--batch-size auto under torchrun: the rows of ONE model group (--tp/--ep) from the RAM each of the node's
    ``world`` processes gets (free / world on CPU) less the weights IT holds (its share, ``tiny_rank_weights``), and
    at most the rows --max-tokens fills on each DATA-PARALLEL group (world / group of them), not on each process.
    Hand count: 5.5 rows fit beside a rank's share, 7 rows of data. A group of 1 (one process, plain data parallel)
    sizes as before: the whole model on each process. On BASE --tp 2 took 2 rows (the whole model's weights counted
    on each rank) and the data split over all 2 or 4 processes (4, 2 rows)."""
    from moetool import distributed
    from moetool.context import _LOCAL, _RANK, _WORLD, Parallel

    group = max(tp, ep)
    row = 3 * 64 * (2048 + 2 * 128) * 4  # tiny: fp32 logits over 2,048 tokens and two hidden states of 128, 3x
    weights = tiny_rank_weights(group)
    assert weights == (1414272 if group == 2 else 2823296) * 4  # the local sizes the gloo launches hold
    free = int(world * (weights + 5.5 * row / 0.8))  # each process: room for 5.5 rows beside its weights
    monkeypatch.setattr(sizing, "available_memory", lambda dev: free)
    for var in (*_WORLD, *_RANK, *_LOCAL):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setattr(distributed, "init", lambda device=None: None)  # one rank stands for all (same numbers)
    monkeypatch.setattr(distributed, "all_reduce_world", lambda t, op="sum": t)
    params = {"model": "tiny", "seq_len": 64, "max_tokens": 7 * 64, "device": "cpu", "out": None, "resume": False}
    run = R.Run(backoff=Backoff(enabled=True), layout=Parallel(tp, ep))
    rows = R.resolve_batch_size(params, run)
    dp = world // group
    facts = run.backoff.choice
    assert facts["memory_rows"] == int(0.8 * (free / world - weights) // row) == 5
    assert facts["weights_bytes"] == weights and facts["data_rows"] == -(-7 // dp)
    assert rows == facts["rows"] == min(5, -(-7 // dp))
    if group > 1:
        assert (facts["model_group"], facts["data_parallel"], facts["weights"]) == (group, dp, "this rank's share")


def test_the_auto_choice_is_recorded_only_for_the_rows_that_run(tmp_path):
    """open_run puts the run's ``--batch-size auto`` decision in the manifest when the run uses its rows (6);
    a run of the same context with another batch size (4: given explicitly) does not claim it."""
    from moetool.sizing import RunEstimate

    est = RunEstimate(device="cpu", dtype="float32", max_positions=128, rows_per_batch=6, params=None,
                      weights_bytes=0, activation_bytes=0, available_bytes=None)
    state = R.Run(backoff=Backoff(enabled=True, choice={"rows": 6, "reason": "fits memory"}))
    for rows in (6, 4):
        folder, units = R.open_run("stats", tmp_path / str(rows), False, resume=False, device="cpu", estimate=est,
                                   batch_size=rows, run=state)
        assert units is None and folder.sections["memory_estimate"]["rows_per_batch"] == 6
        got = folder.sections.get("batch_size_auto")
        folder.mark("interrupted")  # (nothing written: nothing to mark)
        assert got == ({"rows": 6, "reason": "fits memory"} if rows == 6 else None), rows


def test_the_options_say_whether_attention_is_read_before_their_routing():
    """Options that declare ``needs_attention`` (fluctuation's, over its list of routings) are taken at their word;
    otherwise the ``--routing`` policies' declarations decide (``attention`` reads the probabilities)."""
    from types import SimpleNamespace as NS

    assert R.needs_attention(NS(needs_attention=True, routing="router"))
    assert not R.needs_attention(NS(needs_attention=False, routing="attention"))
    assert R.needs_attention(NS(routing="router,attention")) and not R.needs_attention(NS(routing="router"))


def test_a_resume_with_another_dtype_or_seq_len_is_refused_before_any_unit_is_read(tmp_path):
    """The unit key of a run holds the run-level options (model, sizes, dtype, device) beside the experiment's:
    resuming an fp32 run in bf16 (or with other rows) would mix checkpoints computed in two precisions."""
    from moetool.errors import MoetoolError

    kw = dict(seq_len=64, max_tokens=256, batch_size=2, dtype="fp32", device="cpu", units={"top_k": 2})
    started = R.start_run("stats", tmp_path / "r", False, "tiny", **kw)
    key = started.units.key
    assert (key["model"], key["seq_len"], key["max_tokens"], key["dtype"], key["top_k"]) == ("tiny", 64, 256, "fp32", 2)
    started.units.save("batches", {"n": 1})
    started.run.mark("interrupted")
    for change, said in ((dict(dtype="bf16"), "dtype: 'fp32' -> 'bf16'"), (dict(seq_len=32), "seq_len: 64 -> 32")):
        with pytest.raises(MoetoolError, match=f"started with other options \\({said}\\)"):
            R.start_run("stats", tmp_path / "r", False, "tiny", **{**kw, **change}, resume=True)


def test_device_map_is_refused_only_with_several_processes_on_the_node(tmp_path, monkeypatch):
    """``--device-map auto`` spreads one model over the node: refused with LOCAL_WORLD_SIZE=2, not in one process
    (there the next check, the missing --data, is what stops this call)."""
    from moetool.errors import MoetoolError

    kw = dict(data=tmp_path / "missing.txt", seq_len=64, max_tokens=256, batch_size=2, device="cpu", device_map="auto")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(MoetoolError) as e:
        R.start_run("stats", tmp_path / "r", False, "tiny", **kw)
    assert "missing.txt" in str(e.value) and "--device-map" not in str(e.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(MoetoolError, match="launch one process per node .*not 2"):
        R.start_run("stats", tmp_path / "r", False, "tiny", **kw)
