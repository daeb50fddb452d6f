"""Refusals made once forwards ran, followed (as tests/test_suggestions.py follows the others): the rows an
out-of-memory suggests for ``--batch-size``, the ``--dtype`` an fp16 overflow suggests, the ``--layers`` of one
K / n a mixed model is told to choose. Each suggestion is read out of the one line, applied, and the rerun must run
(not be refused again) with the numbers of an independent run: the same rows at that batch size from the start
(rows are independent), an fp32 reference, the chosen layers run alone.

The out-of-memory is simulated on the CPU: the model's forward raises ``torch.OutOfMemoryError`` above a number of
rows (which may drop during a run: memory others took meanwhile).
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from moetool.context import Backoff, RunState
from moetool.data import load_tokens
from moetool.errors import MoetoolError
from moetool.loading import load


@pytest.fixture(scope="module")
def tiny():
    lm = load("tiny")
    return lm, load_tokens(None, lm.tokenizer, 32, 600)  # 16+ packed rows of 32 tokens


def limit(lm, rows_that_fit):
    """``lm``'s forward raises an out-of-memory above ``rows_that_fit()`` rows (re-read at every call); returns the
    row counts it was called with."""
    calls, orig = [], lm.model.forward

    def forward(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        calls.append(rows)
        if rows > rows_that_fit():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return orig(*args, **kwargs)

    lm.model.forward = forward
    return calls


@pytest.fixture
def no_rendering(monkeypatch):
    """Figures built but not rendered (as tests/test_suggestions.py): the commands' own tests draw them."""
    import matplotlib.pyplot as plt

    from moetool.report.rundir import RunDir

    monkeypatch.setattr(RunDir, "save_figure", lambda self, fig, name: plt.close(fig) or [])


def suggested(line: str) -> int:
    return int(re.fullmatch(r".*: rerun with --batch-size (\d+)", line).group(1))


def nll(lm, tokens, batch_size, auto, **kw):
    """Per-row NLL sums of one forward run (``auto``: --batch-size auto's back-off on), in the rows' order."""
    from moetool.engine import runner

    rows = []
    with RunState(backoff=Backoff(enabled=auto)).active():
        runner.forward(lm, tokens, nll=True, batch_size=batch_size, quiet=True,
                       per_row_nll=lambda s, c: rows.append(s), **kw)
    return torch.cat(rows)


def test_torchrun_out_of_memory_suggests_rows_that_fit(tiny, monkeypatch):
    """Rank 0 of 2 (no back-off under torchrun), 8 rows a process, forwards of more than 1 row out of memory: the
    suggested --batch-size is one that fits (1), and the rerun at it runs and gives the per-row NLL of a run at 1
    row from the start. On BASE half the rows that failed was suggested (4), which ran out of memory again; and 1
    row that failed suggested --batch-size 1 again."""
    from moetool import distributed

    lm, tokens = tiny
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # rank 0 of 2 (no process group: reductions no-op)
    want = nll(lm, tokens, 1, auto=False)
    calls = limit(lm, lambda: 1)
    try:
        with pytest.raises(MoetoolError) as e:
            nll(lm, tokens, 8, auto=True)
        line = str(e.value)
        assert line.startswith("out of memory at 8 rows per process on 2 ranks") and "\n" not in line
        n = suggested(line)
        assert n == 1 and calls == [8, 4, 2, 1]  # the batch, then its halves until one fit
        got = nll(lm, tokens, n, auto=False)  # the rerun: an explicit --batch-size, under the same limit
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert set(calls[4:]) == {1}

        del lm.model.forward
        limit(lm, lambda: 0)  # not even 1 row fits: no size to suggest
        with pytest.raises(MoetoolError, match=r"^out of memory even with 1 row of 32 tokens per forward"):
            nll(lm, tokens, 1, auto=True)
    finally:
        del lm.model.forward


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.xdist_group("oom_model_group")
@pytest.mark.parametrize("world, layout, fits, max_tokens", [
    # --max-tokens: 8 rows of 64 on each data-parallel group (the model groups: 1, then 2)
    (2, ["--tp", "2"], "4,2", 512),  # one model group; its rank 1 runs out of memory where rank 0 does not
    (4, ["--tp", "2", "--ep", "2"], "4,2,8,8", 1024),  # two groups: the first runs out, the second never does
])
def test_model_group_out_of_memory_suggests_rows_every_rank_fits(tmp_path, world, layout, fits, max_tokens):
    """--tp / --ep under torchrun (gloo ranks on CPU, tests/oom_ranks.py: a forward of more rows than the rank's
    ``fits`` runs, collectives included, then raises an out-of-memory, as a batch's NLL does after the model's
    last collective). --batch-size auto takes 8 rows per model group: every rank of the first group runs out, the
    refusal names the model group and the --batch-size every rank of it fits (2: a trial the group's ranks run
    together, the size fitting when it fit on all of them), the same on each rank that says it; the rerun at it
    under the same limits runs, with the perplexity of one process. On BASE one model group said "8 rows per process
    on 1 ranks ... --batch-size 4" (rank 0's lone trial: 4 runs out on rank 1, whose own trial at 2 found no partner
    for its collectives), and two said 4 without a trial (half the rows)."""
    import subprocess
    from pathlib import Path

    from test_distributed_cli import _env, run_cli, torchrun

    target = (str(Path(__file__).with_name("oom_ranks.py")),)
    args = ["ppl", "--model", "tiny", "--max-tokens", str(max_tokens), "--seq-len", "64", "--bootstrap", "0",
            "--quiet"]
    env = dict(_env(), MOETOOL_TEST_OOM_ROWS=fits, MOETOOL_TEST_FREE_BYTES=str(10 ** 12))

    def launch(*more):
        for _ in range(3):  # a taken rendezvous port: launched again (as run_cli)
            p = subprocess.run(torchrun(world, target) + args + layout + list(more), cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=600)
            if "EADDRINUSE" not in p.stderr:
                return p
        return p

    p = launch("--batch-size", "auto", "--out", str(tmp_path / "auto"))
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: out of memory")]
    flags = " ".join(layout)
    assert p.returncode == 1 and lines and set(lines) == {
        f"error: out of memory at 8 rows per model group (2 ranks run each row: {flags}) on {world // 2} "
        f"data-parallel group{'s' * (world > 2)} (no back-off under torchrun): rerun with --batch-size 2"}, \
        p.stderr[-3000:]
    rerun = launch("--batch-size", str(suggested(lines[0])), "--out", str(tmp_path / "rerun"))  # the same limits
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    run_cli([*args, "--batch-size", "8", "--out", str(tmp_path / "one")], tmp_path)  # one process, no limit
    got, want = (pd.read_csv(tmp_path / d / "ppl.csv") for d in ("rerun", "one"))
    assert len(got) == len(want) >= 1
    np.testing.assert_allclose(got["perplexity"], want["perplexity"], rtol=1e-5)
    assert (got["scored_tokens"] == want["scored_tokens"]).all()


def test_out_of_memory_after_the_analysis_saw_rows_suggests_rows_that_fit(tiny):
    """--batch-size auto with a consumer and a ``before_batch`` (it saw the rows before any forward: no retry): the
    sizing trial fits 8 rows, then memory shrinks (2 rows fit from batch 1 on) and batch 1 runs out of memory: the
    refusal's --batch-size is a size that fits now (2, not the 8 that failed), and the rerun at it gives the per-row
    NLL and the routing of a run at 2 rows from the start. On BASE it suggested 4, which ran out of memory again."""
    lm, tokens = tiny
    want_events = []
    want = nll(lm, tokens, 2, auto=False, consumers=[lambda ev: want_events.append(ev.idx.clone())])
    fits, batches = [8], []

    def before_batch(b):
        batches.append(b.input_ids.shape[0])
        if len(batches) == 2:  # batch 1: others took memory meanwhile
            fits[0] = 2

    calls = limit(lm, lambda: fits[0])
    try:
        with pytest.raises(MoetoolError) as e:
            nll(lm, tokens, 8, auto=True, consumers=[lambda ev: None], before_batch=before_batch)
        line = str(e.value)
        assert line.startswith("out of memory at batch 1 (rows 8-15) after the analysis saw part of it") and \
            "\n" not in line
        n = suggested(line)
        assert n == 2 and calls == [8, 8, 8, 4, 2]  # trial, batch 0, batch 1, then its halves until one fit
        got_events = []
        got = nll(lm, tokens, n, auto=False, consumers=[lambda ev: got_events.append(ev.idx.clone())],
                  before_batch=before_batch)
    finally:
        del lm.model.forward
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(got_events) == len(want_events) and all(torch.equal(a, b) for a, b in zip(got_events, want_events))


def test_out_of_memory_in_the_analysis_suggests_what_makes_room(tiny, monkeypatch):
    """--batch-size auto, offload (its collector keeps every token's chosen experts on the device: the analysis'
    accumulation), the collector out of memory once it would hold more than 2.5 batches of 4 rows: batch 2 runs out
    in the analysis (the collector raises it), not in the forward (which alone fits its 4 rows: a trial). The
    refusal suggests no --batch-size: the one
    BASE suggested (2, half the rows, fitted by a forward without the analysis) runs out again under the same limit;
    it suggests the --max-tokens of the batches the analysis got through, which packs those same first rows and
    runs under the limit, with the tables of a run without it. Out of memory on the analysis' first batch names
    no size either (none could be checked)."""
    from moetool.experiments.offload.compute import OffloadCollector, offload

    lm, tokens = tiny
    kw = dict(bootstrap=0, policies=("lru",), quiet=True)
    held, call = [10 ** 9], OffloadCollector.__call__

    def collect(self, ev):
        if sum(t.shape[0] for ts in self.trace.values() for t in ts) + ev.idx.shape[0] > held[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return call(self, ev)

    monkeypatch.setattr(OffloadCollector, "__call__", collect)
    held[0] = int(2.5 * 4 * 32 * len(lm.layers))  # tokens x MoE layers of 2.5 batches of 4 rows of 32
    with RunState(backoff=Backoff(enabled=True)).active(), pytest.raises(MoetoolError) as e:
        offload(lm, tokens, batch_size=4, **kw)
    line = str(e.value)
    assert line == ("out of memory at batch 2 (rows 8-11) after the analysis saw part of it: the forward and NLL alone "
                    "fit these 4 rows, so the analysis ran out of memory: its work per batch fit them in the 2 batches "
                    "before, what grew is what it holds of the 8 rows it analysed, which a smaller --batch-size does "
                    "not shrink: rerun with --max-tokens 256 (those 8 rows of 32 tokens)")
    with RunState(backoff=Backoff(enabled=False)).active(), pytest.raises(torch.OutOfMemoryError):
        offload(lm, tokens, batch_size=2, **kw)  # BASE's suggestion: out of memory again
    fewer = load_tokens(None, lm.tokenizer, 32, int(re.search(r"--max-tokens (\d+)", line).group(1)))
    assert torch.equal(fewer.input_ids, tokens.input_ids[:8])  # the rows it got through
    with RunState(backoff=Backoff(enabled=False)).active():
        got = offload(lm, fewer, batch_size=4, **kw).tables
    held[0] = 10 ** 9
    with RunState(backoff=Backoff(enabled=False)).active():
        want = offload(lm, fewer, batch_size=4, **kw).tables
    assert got.keys() == want.keys()
    for k in got:
        pd.testing.assert_frame_equal(got[k], want[k], obj=k)

    held[0] = 4 * 32 * len(lm.layers) // 2  # not even one batch of 4 rows
    with RunState(backoff=Backoff(enabled=True)).active(), pytest.raises(MoetoolError) as e:
        offload(lm, tokens, batch_size=4, **kw)
    assert str(e.value) == ("out of memory at batch 0 (rows 0-3) after the analysis saw part of it: the forward and "
                            "NLL alone fit these 4 rows, so the analysis ran out of memory on its first batch: rerun "
                            "with a --batch-size below 4 (unchecked: no trial runs the analysis without feeding it "
                            "rows twice)")


def test_capacity_cut_by_the_back_off_suggests_the_rows_that_ran(tiny):
    """capacity is per batch of --batch-size rows: --batch-size auto backing off from 8 to 2 rows is refused, naming
    the rows the back-off went on with; the rerun at them (explicit, under the same limit) runs and its tables
    equal capacity at 2 rows without any limit."""
    from moetool.experiments.capacity.compute import capacity

    lm, tokens = tiny
    kw = dict(cfs=(1.0,), bootstrap=0, quiet=True)
    want = capacity(lm, tokens, batch_size=2, **kw).tables
    limit(lm, lambda: 2)
    try:
        with RunState(backoff=Backoff(enabled=True)).active(), pytest.raises(MoetoolError) as e:
            capacity(lm, tokens, batch_size=8, **kw)
        n = suggested(str(e.value))
        assert str(e.value).startswith("capacity is per batch of --batch-size rows, but out of memory cut the batches "
                                       "to 2 rows") and n == 2
        with RunState(backoff=Backoff(enabled=False)).active():
            got = capacity(lm, tokens, batch_size=n, **kw).tables
    finally:
        del lm.model.forward
    assert got.keys() == want.keys()
    for k in got:
        pd.testing.assert_frame_equal(got[k].drop(columns="seconds", errors="ignore"),
                                      want[k].drop(columns="seconds", errors="ignore"), obj=k)


# ----- --dtype: fp16 activations that overflow --------------------------------------------------------------------
def _cli(args, out):
    from typer.testing import CliRunner

    from moetool.commands.app import app

    return CliRunner().invoke(app, [*args, "--out", str(out)])


def _big_experts(tmp_path):
    """The tiny model with MoE layer 1's expert weights x30, saved in ``tmp_path / "big"``: (model, path)."""
    lm = load("tiny")
    with torch.no_grad():
        for p in lm.model.model.layers[1].mlp.experts.parameters():
            p.mul_(30)
    model = tmp_path / "big"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    return lm, model


def _layer1_overflow(args, out, hint: str) -> tuple[str, tuple[str, ...]]:
    """The command ``args`` refused in one line for :func:`_big_experts`' fp16 overflow in MoE layer 1's experts,
    its suggestion matching ``hint`` (a pattern whose groups are the dtypes it names: bf16 and fp32)."""
    r = _cli(args, out)
    line = r.output.strip()
    assert r.exit_code == 1 and len(line.splitlines()) == 1, r.output
    m = re.fullmatch(r"error: non-finite experts output in MoE layer 1 of \S+ at batch 0 \(rows 0-\d+\), computed in "
                     rf"float16 \(fp16's largest number is 65504: {hint}\): results would be meaningless", line)
    assert m and m.groups() == ("bf16", "fp32"), line
    return line, m.groups()


@pytest.mark.slow
def test_fp16_overflow_in_an_expert_suggests_a_dtype_that_runs(tmp_path, no_rendering):
    """The tiny model with MoE layer 1's expert weights x30 (their outputs x27000, past fp16's 65504; the final norm
    brings the logits back): ppl --dtype fp16 is refused in one line naming the layer, the batch and the --dtype to
    use (on BASE the line had no hint: "...: results would be meaningless"); each suggested --dtype runs, with a
    finite perplexity equal to a hand-computed fp32 one (bf16 within its rounding)."""
    from conftest import hand_ppl

    lm, model = _big_experts(tmp_path)
    args = ["ppl", "--model", str(model), "--max-tokens", "64", "--seq-len", "16", "--bootstrap", "0", "-q"]
    tokens = load_tokens(None, lm.tokenizer, 16, 64)
    want, count = hand_ppl(lm.model, tokens)
    h = {}
    hook = lm.model.model.layers[1].mlp.experts.register_forward_hook(lambda m, a, o: h.setdefault("out", o))
    with torch.no_grad():  # the reference: fp16 experts of layer 1 overflow on the first batch, fp32 do not
        lm.model.half()(input_ids=tokens.input_ids[:8], attention_mask=tokens.attention_mask[:8])
    hook.remove()
    assert not torch.isfinite(h["out"]).all() and h["out"].dtype == torch.float16

    _, dtypes = _layer1_overflow([*args, "--dtype", "fp16"], tmp_path / "fp16", r"try --dtype (\w+) or (\w+)")
    for dtype, rtol in zip(dtypes, (2e-2, 1e-5)):
        r = _cli([*args, "--dtype", dtype], tmp_path / dtype)
        assert r.exit_code == 0, r.output
        got = pd.read_csv(tmp_path / dtype / "ppl.csv")
        assert int(got.scored_tokens[0]) == count and np.isfinite(got.perplexity[0])
        assert float(got.perplexity[0]) == pytest.approx(want, rel=rtol), dtype


@pytest.mark.slow
def test_fp16_overflow_in_agreement_names_its_precisions_and_the_suggestion_runs(tmp_path, no_rendering):
    """agreement has no --dtype (its --precisions choose the dtypes): the same fp16 overflow (layer 1's experts x30)
    said "try --dtype bf16 or fp32" on BASE, a flag agreement refuses. The line names --precisions and only flags
    agreement has; the suggested precision put in place of fp16 runs, its flips against fp32 finite."""
    import typer

    from moetool.commands.app import app

    _, model = _big_experts(tmp_path)
    args = ["agreement", "--model", str(model), "--max-tokens", "64", "--seq-len", "16", "--bootstrap", "0", "-q"]
    line, (smaller, _) = _layer1_overflow([*args, "--precisions", "fp32,fp16"], tmp_path / "fp16",
                                          r"try (\w+) or (\w+) in --precisions")
    have = {o for p in typer.main.get_command(app).commands["agreement"].params for o in p.opts}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line))
    assert named == {"--precisions"} and named <= have and "--dtype" not in have
    r = _cli([*args, "--precisions", f"fp32,{smaller}"], tmp_path / smaller)
    assert r.exit_code == 0, r.output
    got = pd.read_csv(tmp_path / smaller / "agreement_summary.csv")
    assert list(got.precision) == ["bf16"] and np.isfinite(got[["top1_flip", "topk_flip", "delta_nll"]]).all().all()


# ----- --layers of one K / n: MoE layers that differ ------------------------------------------------------------
def _mixed(change) -> tuple:
    """The tiny model with layer 0's MoE block changed by ``change(block)`` (its adapter identified afresh), and
    16 rows of 16 tokens."""
    import dataclasses

    from moetool.adapters import find_moe_layers

    lm = load("tiny")
    with torch.no_grad():
        change(lm.model.model.layers[0].mlp)
    lm = dataclasses.replace(lm, layers=find_moe_layers(lm.model))
    return lm, load_tokens(None, lm.tokenizer, 16, 240)


def _fewer_experts(block, n=4):
    block.gate.weight = torch.nn.Parameter(block.gate.weight[:n].clone())
    block.gate.num_experts = block.experts.num_experts = n
    block.experts.gate_up_proj = torch.nn.Parameter(block.experts.gate_up_proj[:n].clone())
    block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj[:n].clone())


def offered(line: str, symbol: str) -> list[tuple[tuple[int, ...], int]]:
    """The ``(layers, K / n)`` choices ``--layers <a-b,c> (<symbol> = <value>)`` a refusal's line offers, in order."""
    def layers(value):
        return tuple(i for part in value.split(",") for i in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))

    return [(layers(v), int(k)) for v, k in re.findall(rf"--layers (\S+) \({symbol} = (\d+)\)", line)]


def refused(compute, lm, tokens, what: str, symbol: str) -> list[tuple[tuple[int, ...], int]]:
    """The choices :func:`offered` by the one line ``compute`` over every MoE layer refuses with (``what`` differs)."""
    with pytest.raises(MoetoolError) as e:
        compute(lm, tokens, bootstrap=0, quiet=True)
    line = str(e.value)
    assert line.startswith(f"{what}: choose layers of one {symbol}: ") and "\n" not in line, line
    return offered(line, symbol)


def test_topk_on_layers_of_different_k_names_the_layers_of_each_k():
    """Layer 0 routes 1 expert, layers 1-3 route 2: topk over every layer is refused in one line that offers the
    --layers of each K (on BASE: "choose layers of one K with --layers", naming none); each offered choice runs, and
    its topk:K (the model's own routing, K of those layers) has the perplexity of plain forwards by hand."""
    from conftest import hand_ppl

    from moetool.experiments.topk.compute import topk

    lm, tokens = _mixed(lambda b: setattr(b.gate, "top_k", 1))
    assert [L.top_k for L in lm.layers] == [1, 2, 2, 2]
    choices = refused(topk, lm, tokens, "the chosen MoE layers route different numbers of experts", "K")
    assert choices == [((1, 2, 3), 2), ((0,), 1)]
    want, _ = hand_ppl(lm.model, tokens)
    for layers, K in choices:
        got = topk(lm, tokens, layers=layers, ks=(K,), ps=(), bootstrap=0, quiet=True).tables["topk.csv"]
        row = got[got.policy == f"topk:{K}"]
        assert len(row) == 1 and float(row.perplexity.iloc[0]) == pytest.approx(want, rel=1e-5), (layers, got)


def test_placement_on_layers_of_different_n_names_the_layers_of_each_n():
    """Layer 0 keeps 4 of its 8 experts: placement over every layer is refused in one line offering the --layers of
    each n (on BASE it named none); each choice runs, with the per-expert loads of a hand count of the routers'
    top-2 over the real tokens."""
    from moetool.experiments.placement.compute import placement

    lm, tokens = _mixed(_fewer_experts)
    assert [L.n_experts for L in lm.layers] == [4, 8, 8, 8]
    choices = refused(placement, lm, tokens, "the chosen MoE layers have different numbers of experts", "n")
    assert choices == [((1, 2, 3), 8), ((0,), 4)]

    counts, hooks = {}, []
    for i, blk in enumerate(lm.model.model.layers):
        def hook(m, a, out, i=i):
            counts[i] = counts.get(i, 0) + torch.bincount(out[2][mask.reshape(-1).bool()].reshape(-1),
                                                          minlength=m.num_experts)
        hooks.append(blk.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        for s in range(0, tokens.input_ids.shape[0], 8):
            mask = tokens.attention_mask[s:s + 8]
            lm.model(input_ids=tokens.input_ids[s:s + 8], attention_mask=mask)
    for h in hooks:
        h.remove()
    for layers, n in choices:
        got = placement(lm, tokens, layers=layers, bootstrap=0, quiet=True).tables["placement_loads.csv"]
        for i in layers:
            rows = got[(got.layer == i) & (got.data_set == "data")].sort_values("expert")
            assert list(rows.expert) == list(range(n)) and rows.load.tolist() == counts[i].tolist(), (i, rows)


def test_layers_of_one_names_each_value_with_its_layers():
    """The one home of these refusals: the shared value, or each value's --layers (the most layers first) in a form
    --layers parses; the trace's zero-computation refusal names that count (on BASE it said "choose layers of one
    n", which the layers already were)."""
    from moetool.errors import layers_of_one

    assert layers_of_one({3: 8, 5: 8}, "x", "n") == 8
    with pytest.raises(MoetoolError, match=r"^the trace's MoE layers have different numbers of zero-computation "
                                           r"experts: choose layers of one number of zero-computation experts: "
                                           r"--layers 1-2,5 \(number of zero-computation experts = 0\) or --layers 3 "
                                           r"\(number of zero-computation experts = 2\)$"):
        layers_of_one({5: 0, 1: 0, 3: 2, 2: 0}, "the trace's MoE layers have different numbers of zero-computation "
                      "experts", "number of zero-computation experts")


def test_out_of_memory_under_torchrun_names_the_launch_and_the_rows_the_analysis_got_through(tiny, monkeypatch):
    """Rank 0 of 2 (no back-off under torchrun), 4 rows a process: the analysis (a consumer) runs out of memory on
    its second batch (batch 1), the forward alone fitting. The line counts the rows of the global batches before it
    on every rank (1 batch x 4 rows x 2 ranks = 8, "1 batch", not "batches", not the first batch's advice), and
    its --max-tokens packs exactly those first 8 rows. ``_per`` names a process or a model group (its flags, the
    data-parallel groups), by hand (mutation pass 22: R2, R3, R11, R13, R14 survived)."""
    from moetool import distributed
    from moetool.context import Parallel
    from moetool.engine.runner import _RowsThatFit

    lm, tokens = tiny
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # rank 0 of 2 (no process group: reductions no-op)
    forwards: set[tuple[int, ...]] = set()

    def analysis(ev):
        forwards.add(tuple(ev.rows))
        if len(forwards) > 1:  # the second forward's rows: the analysis' memory is gone
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(MoetoolError) as e:
        nll(lm, tokens, 4, auto=True, consumers=[analysis])
    assert str(e.value) == (
        "out of memory at 4 rows per process on 2 ranks (no back-off under torchrun): the forward and NLL alone fit "
        "these 4 rows, so the analysis ran out of memory: its work per batch fit them in the 1 batch before, what "
        "grew is what it holds of the 8 rows it analysed, which a smaller --batch-size does not shrink: rerun with "
        "--max-tokens 256 (those 8 rows of 32 tokens)")
    first = sorted(forwards)[0]
    assert len(first) == 4  # rank 0's 4 rows of global batch 0 (8 rows: rank 1 ran the other 4)
    fewer = load_tokens(None, lm.tokenizer, 32, 256)
    assert torch.equal(fewer.input_ids, tokens.input_ids[:2 * len(first)])

    def per(world, **layout):
        return _RowsThatFit(None, 8, engine=None, policy=None, before_batch=None, tokens=tokens, world=world,
                            run=RunState(layout=Parallel(**layout)))._per()

    assert per(3) == "process on 3 ranks"
    assert per(1, tp=2) == "model group (2 ranks run each row: --tp 2) on 1 data-parallel group"
    assert per(2, tp=4) == "model group (4 ranks run each row: --tp 4) on 2 data-parallel groups"
    assert per(2, tp=2, ep=2) == "model group (2 ranks run each row: --tp 2 --ep 2) on 2 data-parallel groups"


@pytest.mark.distributed
@pytest.mark.slow
def test_margin_overflow_bound_on_two_ranks_is_the_one_process_bound(tmp_path):
    """margin's overflow refusal names the eps below which every real token's noise stays finite: on 2 torchrun
    ranks it is the smallest over both ranks' tokens (an all-reduce min), the same line as one process over all
    the rows (mutation pass 22: a sum reduction, twice the bound on 2 ranks, survived every other test)."""
    import subprocess

    from test_distributed_cli import _env, torchrun

    args = ["margin", "--model", "tiny", "--max-tokens", "560", "--seq-len", "64", "--eps", "0.1,1e30",
            "--bootstrap", "0", "-q"]

    def errors(world):
        for _ in range(3):  # a taken rendezvous port: launched again (as run_cli)
            cmd = torchrun(world) if world > 1 else [sys.executable, "-m", "moetool"]
            p = subprocess.run(cmd + args + ["--batch-size", str(4 // world), "--out", str(tmp_path / str(world))],
                               cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
            if "EADDRINUSE" not in p.stderr:
                break
        lines = {ln for ln in p.stderr.splitlines() if ln.startswith("error: --eps 1e+30")}
        assert p.returncode == 2 if world == 1 else p.returncode != 0, p.stderr[-3000:]  # (torchrun's own code)
        assert len(lines) == 1, p.stderr[-3000:]
        return lines.pop()

    one = errors(1)
    assert "(computed from the data): use --eps" in one
    assert errors(2) == one
