"""``--batch-size auto`` backs off on out-of-memory: the rows are halved, the same rows retried, the run goes on.

The out-of-memory is injected: the model's forward raises ``torch.OutOfMemoryError`` (or the CPU allocator's
RuntimeError) above a number of rows. The results must equal the run with that smaller batch size given explicitly
(every consumer saw every row once), and the console/manifest say what ran.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from moetool.data import load_tokens
from moetool.engine import runner
from moetool.errors import MoetoolError
from moetool.loading import load

CPU_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried "
                       "to allocate 123456789 bytes.")


@pytest.fixture
def backoff():
    """A run with --batch-size auto active for the test (the forwards read it from the context); its back-off."""
    from moetool.context import Backoff, RunState

    run = RunState(backoff=Backoff(enabled=True))
    with run.active():
        yield run.backoff


def limit_rows(lm, max_rows, error=None):
    """``lm``'s forward fails with an out-of-memory above ``max_rows`` rows; returns the row counts it was called
    with (those that ran and those that failed)."""
    calls = []
    orig = lm.model.forward

    def forward(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        calls.append(rows)
        if rows > max_rows:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return orig(*args, **kwargs)

    lm.model.forward = forward
    return calls


@pytest.fixture(scope="module")
def tiny():
    lm = load("tiny")
    return lm, load_tokens(None, lm.tokenizer, 64, 1500)  # 24 packed rows


def tables(res):
    return {k: v.drop(columns=[c for c in ("seconds",) if c in v]) for k, v in res.tables.items()}


def same(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        pd.testing.assert_frame_equal(a[k].reset_index(drop=True), b[k].reset_index(drop=True), check_exact=False,
                                      rtol=1e-6, atol=1e-9, obj=k)


@pytest.mark.parametrize("error", [None, CPU_OOM], ids=["OutOfMemoryError", "cpu-allocator"])
@pytest.mark.slow
def test_ppl_random_policy_backs_off_to_the_explicit_run(tiny, backoff, error, capsys):
    """NLL sums and a random policy's draws (the sizing trial restores its generator) equal --batch-size 2."""
    from moetool.experiments.ppl.compute import ppl

    lm, tokens = tiny
    want = tables(ppl(lm, tokens, routing="random", batch_size=2, bootstrap=100, quiet=True))
    calls = limit_rows(lm, 2, error)
    try:
        got = tables(ppl(lm, tokens, routing="random", batch_size=8, bootstrap=100, quiet=True))
    finally:
        del lm.model.forward
    same(got, want)
    assert backoff.rows == 2 and backoff.events == [8, 4]  # 8 -> 4 -> 2, then every forward at 2
    assert calls[:2] == [8, 4] and set(calls[2:]) == {2}
    err = capsys.readouterr().err
    assert "out of memory at 8 rows per forward; going on with 4" in err and "going on with 2" in err


@pytest.mark.slow
def test_stateful_consumers_see_every_row_once(tiny, backoff):
    """mass-recall (per-batch k-means EMA steps, before_batch row registration) and trace (rows written after
    each batch) with an out-of-memory above 3 rows: the same tables as --batch-size 3 of 6."""
    from moetool.experiments.mass_recall.compute import mass_recall
    from moetool.experiments.trace.compute import trace

    lm, tokens = tiny
    kw = dict(codebook_sizes=(4,), shortlists=(2,), bootstrap=100, quiet=True)
    want = {**tables(mass_recall(lm, tokens, batch_size=3, **kw)), **tables(trace(lm, tokens, batch_size=3,
                                                                                  quiet=True))}
    calls = limit_rows(lm, 3)
    try:
        got = {**tables(mass_recall(lm, tokens, batch_size=6, **kw)), **tables(trace(lm, tokens, batch_size=6,
                                                                                     quiet=True))}
    finally:
        del lm.model.forward
    same(got, want)
    assert backoff.events == [6] and calls.count(6) == 1  # the sizing trial failed once; no consumer saw it
    assert len(got["trace.csv.gz"]) == len(lm.layers) * tokens.n_tokens


def test_off_without_auto_and_one_row_that_does_not_fit(tiny, backoff):
    from moetool.experiments.ppl.compute import ppl

    lm, tokens = tiny
    limit_rows(lm, 0)
    try:
        with pytest.raises(MoetoolError, match="out of memory even with 1 row of 64 tokens"):
            ppl(lm, tokens, batch_size=4, bootstrap=0, quiet=True)
        backoff.enabled = False  # an explicit --batch-size: the allocator's error as it is
        with pytest.raises(torch.OutOfMemoryError):
            ppl(lm, tokens, batch_size=4, bootstrap=0, quiet=True)
    finally:
        del lm.model.forward


@pytest.mark.slow
def test_cli_auto_records_the_rows_that_ran(tmp_path, monkeypatch, no_figures):
    """The CLI: --batch-size auto picks 8 rows, the forward fails above 2, the run goes on; manifest and console
    name the rows that ran; ppl.csv equals --batch-size 2; the back-off is off again for the next command."""
    # manifest, console and ppl.csv only (no_figures): ppl's figures are checked in tests/test_help_files.py
    from transformers import PreTrainedModel

    from moetool import sizing
    from moetool.commands.app import app

    monkeypatch.setattr(sizing, "auto_batch_size", lambda model, **kw: (8, {"rows": 8, "reason": "test", "device": "cpu",
                                                                         "free_bytes": None}))
    orig = PreTrainedModel.__call__

    def call(self, *args, **kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return orig(self, *args, **kwargs)

    base = ["ppl", "--model", "tiny", "--max-tokens", "1500", "--seq-len", "64", "--bootstrap", "0", "--quiet"]
    cli = CliRunner()
    monkeypatch.setattr(PreTrainedModel, "__call__", call)
    r = cli.invoke(app, base + ["--batch-size", "auto", "--out", str(tmp_path / "auto")])
    assert r.exit_code == 0, r.output
    assert "going on with 2" in r.output
    man = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert man["batch_size_auto"]["rows"] == 2 and man["batch_size_auto"]["out_of_memory_at"] == [8, 4]
    from moetool import context

    assert context.current() is None  # the command's run (and its back-off) ended with it
    monkeypatch.setattr(PreTrainedModel, "__call__", orig)
    r = cli.invoke(app, base + ["--batch-size", "2", "--out", str(tmp_path / "two")])
    assert r.exit_code == 0, r.output
    got, want = (pd.read_csv(tmp_path / d / "ppl.csv").drop(columns="seconds") for d in ("auto", "two"))
    pd.testing.assert_frame_equal(got, want, rtol=1e-6)


def test_no_back_off_under_torchrun(tiny, backoff, monkeypatch):
    """Several ranks must cut the same global batches: an out-of-memory there is one line naming the rows to use."""
    from moetool import distributed
    from moetool.experiments.ppl.compute import ppl

    lm, tokens = tiny
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # rank 0 of 2 (no process group: reductions no-op)
    limit_rows(lm, 2)
    try:
        with pytest.raises(MoetoolError, match="out of memory at 4 rows per process on 2 ranks .* --batch-size 2"):
            ppl(lm, tokens, batch_size=4, bootstrap=0, quiet=True)
    finally:
        del lm.model.forward
    assert backoff.rows is None


# ----- the NLL step (#21.8): chunked, and inside the back-off ---------------------------------------------------
def test_chunked_nll_equals_one_cross_entropy_and_never_copies_the_whole_logits(tiny, monkeypatch):
    """batch_nll over chunks of positions gives the per-token NLL sums of one cross_entropy over the whole batch;
    no step holds more than NLL_CHUNK_ELEMENTS fp32 logits (it held rows x positions x vocab), and each step reads
    a contiguous slice of the logits themselves (a strided slice made log_softmax copy it first)."""
    import torch.nn.functional as F

    lm, tokens = tiny
    ids, mask = tokens.input_ids[:4].clone(), tokens.attention_mask[:4].clone()
    mask[1, :5] = 0  # a padded row
    ids, mask = ids.to(lm.device), mask.to(lm.device)  # where --device auto put the model
    with torch.no_grad():
        logits = lm.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.to(torch.bfloat16)
    B, S, V = logits.shape
    keep = (mask[:, 1:].bool() & mask[:, :-1].bool())
    ref = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    ref = (ref.view(B, S - 1).double() * keep).sum(1)

    seen = []
    orig = F.log_softmax
    lo, hi = logits.data_ptr(), logits.data_ptr() + logits.numel() * logits.element_size()

    def spy(pred, *args, **kwargs):  # the one full-vocabulary step: fp32 log-probabilities of a chunk
        seen.append((pred.numel(), pred.is_contiguous() and lo <= pred.data_ptr() < hi))
        return orig(pred, *args, **kwargs)

    monkeypatch.setattr(runner.F, "log_softmax", spy)
    monkeypatch.setattr(runner, "NLL_CHUNK_ELEMENTS", 5 * B * V, raising=False)  # 5·B positions a step
    sums, counts = runner.batch_nll(logits, ids, mask, per_row=True)
    total, n = runner.batch_nll(logits, ids, mask)
    torch.testing.assert_close(sums, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(counts, keep.sum(1)) and int(n) == int(keep.sum())
    assert float(total) == pytest.approx(float(ref.sum()), rel=1e-6)
    assert max(k for k, _ in seen) <= 5 * B * V and len(seen) == 2 * -(-(B * S) // (5 * B))
    assert all(view for _, view in seen)  # slices of the logits, not copies

    # positions never scored (each row's last, the padded ones) do not reach the sums, even as NaN
    bad = logits.clone()
    bad[:, -1] = float("nan")
    bad[1, 2] = float("inf")  # predicts padded position 3
    monkeypatch.setattr(runner, "NLL_CHUNK_ELEMENTS", 1 << 25, raising=False)
    torch.testing.assert_close(runner.batch_nll(bad, ids, mask, per_row=True)[0], ref, rtol=1e-6, atol=1e-6)
    bad[2, 3] = float("nan")  # a scored position: the NaN shows
    assert torch.isnan(runner.batch_nll(bad, ids, mask, per_row=True)[0][2])

    # rows apart in memory (a slice of longer rows): each row in turn, still slices of the logits, the same sums
    wide = torch.cat([logits, logits[:, :3]], dim=1)[:, :S]
    assert wide.stride(0) != S * wide.stride(1)
    lo, hi = wide.data_ptr(), wide.data_ptr() + wide.untyped_storage().nbytes()
    seen.clear()
    monkeypatch.setattr(runner, "NLL_CHUNK_ELEMENTS", 5 * V, raising=False)
    torch.testing.assert_close(runner.batch_nll(wide, ids, mask, per_row=True)[0], ref, rtol=1e-6, atol=1e-6)
    assert all(view for _, view in seen) and len(seen) == B * -(-S // 5)


@pytest.mark.parametrize("bootstrap", [0, 100], ids=["total", "per-row"])
def test_out_of_memory_in_the_nll_step_backs_off(tiny, backoff, bootstrap, capsys, monkeypatch):
    """The fp32 NLL of a batch was computed outside the back-off: an out-of-memory there ended the run. Now it
    halves the rows like one in the forward, and the result equals --batch-size 2 (with and without the
    bootstrap's per-row sums)."""
    from moetool.experiments.ppl.compute import ppl

    lm, tokens = tiny
    want = tables(ppl(lm, tokens, batch_size=2, bootstrap=bootstrap, quiet=True))
    orig, calls = runner.batch_nll, []

    def nll(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        if logits.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return orig(logits, *args, **kwargs)

    monkeypatch.setattr(runner, "batch_nll", nll)
    got = tables(ppl(lm, tokens, batch_size=8, bootstrap=bootstrap, quiet=True))
    same(got, want)
    assert backoff.rows == 2 and backoff.events == [8, 4] and calls[:2] == [8, 4]
    assert "out of memory at 8 rows per forward; going on with 4" in capsys.readouterr().err


# ----- the retry inside the run (no sizing trial: nothing hooked) and its refusal once a consumer saw rows ---------
def test_unhooked_forward_retries_the_same_rows(tiny, backoff, capsys):
    """Nothing hooked and no before_batch: no sizing trial, the out-of-memory comes in the run itself; the same
    rows are retried at half the rows, and the per-row and total NLL equal the explicit --batch-size 2 run."""
    lm, tokens = tiny
    want_rows, got_rows = [], []
    backoff.enabled = False
    want = runner.forward(lm, tokens, nll=True, batch_size=2, quiet=True,
                          per_row_nll=lambda s, c: want_rows.append((s, c)))
    backoff.enabled = True
    calls = limit_rows(lm, 2)
    try:
        got = runner.forward(lm, tokens, nll=True, batch_size=8, quiet=True,
                             per_row_nll=lambda s, c: got_rows.append((s, c)))
    finally:
        del lm.model.forward
    assert calls == [8, 4] + [2] * 12 and backoff.events == [8, 4] and backoff.rows == 2  # 24 rows, 2 a forward
    assert got.batches == 3 and want.batches == 12
    torch.testing.assert_close(torch.cat([s for s, _ in got_rows]), torch.cat([s for s, _ in want_rows]),
                               rtol=1e-12, atol=0)
    assert torch.equal(torch.cat([c for _, c in got_rows]), torch.cat([c for _, c in want_rows]))
    m = tokens.attention_mask.bool()
    assert got.nll.tokens == want.nll.tokens == int((m[:, 1:] & m[:, :-1]).sum())  # next-token targets
    assert got.nll.nll_sum == pytest.approx(want.nll.nll_sum, rel=1e-12)
    assert "out of memory at 8 rows per forward; going on with 4" in capsys.readouterr().err


def test_out_of_memory_after_a_consumer_saw_rows_is_one_line(tiny, backoff, monkeypatch):
    """The sizing trial fits 8 rows; the run's NLL of batch 1 then runs out of memory after the consumer saw its
    routing events: a retry would feed it the rows twice, so one line names the batch, its rows and the size that
    fits (the first half of the rows whose forward and NLL a trial ran: tests/test_suggestions_runtime.py)."""
    lm, tokens = tiny
    orig, nll_calls, seen = runner.batch_nll, [], []

    def nll(logits, *args, **kwargs):
        nll_calls.append(logits.shape[0])
        if len(nll_calls) == 3:  # the trial (batch 0), batch 0, then batch 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return orig(logits, *args, **kwargs)

    monkeypatch.setattr(runner, "batch_nll", nll)
    with pytest.raises(MoetoolError, match=r"^out of memory at batch 1 \(rows 8-15\) after the analysis saw part of "
                                           r"it: rerun with --batch-size 4$"):
        runner.forward(lm, tokens, nll=True, batch_size=8, quiet=True, consumers=[lambda ev: seen.append(ev.shape)])
    assert nll_calls == [8, 8, 8, 4] and backoff.events == [] and backoff.rows is None  # 4: the trial that fit
    assert seen == [(8, 64)] * (2 * len(lm.layers))  # batches 0 and 1, once each (the trials fed no one)


def test_sizing_trial_leaves_a_policys_generator_as_it_found_it(tiny, backoff):
    """A policy drawing from its own generator in call order (not seeded per row): the sizing trial that fits (2
    rows) draws too, and the generator is put back, so the run draws what the explicit --batch-size 2 run draws."""
    import dataclasses

    from moetool.policies.basic import RandomPolicy

    class InCallOrder(RandomPolicy):
        def select(self, ev):
            return super().select(dataclasses.replace(ev, rows=None))  # its per-device generator, not the rows

    lm, tokens = tiny
    backoff.enabled = False
    want = runner.forward(lm, tokens, policy=InCallOrder(3), nll=True, batch_size=2, quiet=True)
    backoff.enabled = True
    calls = limit_rows(lm, 2)
    try:
        got = runner.forward(lm, tokens, policy=InCallOrder(3), nll=True, batch_size=8, quiet=True)
    finally:
        del lm.model.forward
    assert calls == [8, 4, 2] + [2] * 12 and backoff.events == [8, 4]  # the trials, then 12 forwards of 2 rows
    assert got.nll.tokens == want.nll.tokens
    assert got.nll.nll_sum == pytest.approx(want.nll.nll_sum, rel=1e-12)


@pytest.mark.parametrize("chunk", [1 << 25, 2, 4], ids=["one-step", "2-positions", "4-positions"])
def test_unshifted_nll_scores_every_real_position_up_to_the_last_one(chunk, monkeypatch):
    """``shift=False`` (an encoder-decoder: position t predicts token t) scores every real position, each row's last
    and the batch's very last included, whatever the chunking: the sums equal -log softmax(logits)[target] by hand
    in fp64 (a last chunk cut one position short left that position's NLL unwritten and no test saw it)."""
    import math

    gen = torch.Generator().manual_seed(11)
    B, S, V = 3, 7, 13
    logits = torch.randn(B, S, V, generator=gen)
    ids = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 5:] = 0  # one right-padded row; the last row real to its end
    ref = torch.zeros(B, dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            if mask[b, t]:
                row = [float(x) for x in logits[b, t]]
                top = max(row)
                lse = top + math.log(sum(math.exp(x - top) for x in row))
                ref[b] += lse - row[int(ids[b, t])]
    monkeypatch.setattr(runner, "NLL_CHUNK_ELEMENTS", chunk * V, raising=False)
    wide = torch.cat([logits, logits[:, :2]], dim=1)[:, :S]  # rows apart in memory: each row's chunks in turn
    for x in (logits, wide):
        sums, counts = runner.batch_nll(x, ids, mask, per_row=True, shift=False)
        torch.testing.assert_close(sums, ref, rtol=1e-6, atol=1e-6)
        assert counts.tolist() == [S, 5, S]
        total, n = runner.batch_nll(x, ids, mask, shift=False)
        assert int(n) == 2 * S + 5 and float(total) == pytest.approx(float(ref.sum()), rel=1e-6)
