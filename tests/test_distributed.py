"""Data parallelism on 2 gloo processes (CPU): sharding + all-reduce equal one process over the same rows."""

from __future__ import annotations

import socket

import pytest
import torch

from moetool import distributed as D
from moetool.data import Document, pack
from moetool.errors import MoetoolError
from moetool.sketch import QuantileSketch

# tiers: pytest -m 'not slow'; one xdist worker runs this module and the two others whose work is a job of the one
# launch below (tests/test_distributed_empty_rank.py, tests/test_bootstrap_distributed.py): --dist loadgroup
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("gloo_ranks")]


class CharTokenizer:
    eos_token_id = 1
    pad_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 + 3 for c in text]}


def tokens():
    gen = torch.Generator().manual_seed(0)
    docs = [Document("".join(chr(97 + int(i)) for i in torch.randint(0, 26, (int(n),), generator=gen)),
                     "ab"[k % 2]) for k, n in enumerate(torch.randint(5, 40, (30,), generator=gen))]
    return pack(docs, CharTokenizer(), seq_len=8, max_tokens=None)


def statistics(ts, batch_size):
    """A command's accumulators: token counts per id, per-domain sums, a quantile sketch, per-batch sums."""
    acc = {"count": torch.zeros(60, dtype=torch.float64), "sum_sq": torch.zeros((), dtype=torch.float64),
           "per_batch": []}
    sk = QuantileSketch()
    rows = []
    for b in ts.batches(batch_size):
        m = b.attention_mask
        acc["count"].index_add_(0, b.input_ids.reshape(-1), m.reshape(-1).double())
        acc["sum_sq"] += ((b.input_ids.double() ** 2) * m).sum()
        sk.add(b.input_ids.double() / 7, m)
        rows.append(b.input_ids)
    return acc, sk, rows


def statistics_job():
    """One rank's accumulators of :func:`statistics` over its shard (global batches of 2 x 3 rows), all-reduced."""
    dev, world = D.init("cpu"), D.world_size()  # (init again: the group the launch joined, its device returned)
    ts = D.shard(tokens(), batch_size=3)
    acc, sk, _ = statistics(ts, 3)
    steps = D.n_steps(tokens().input_ids.shape[0], 3, world)
    # a sequential per-batch reduction (the k-means EMA shape): every rank runs `steps` batches
    ema = torch.zeros(())
    for s in range(steps):
        part = ts.input_ids[s * 3:(s + 1) * 3].double().sum().reshape(())
        ema = 0.5 * ema + D.all_reduce(part)
    red = D.all_reduce_dict({"count": acc["count"], "sum_sq": acc["sum_sq"]})
    D.all_reduce_state(sk)
    lo = D.all_reduce(torch.tensor(float(D.global_rank())), "min")
    ids = D.gather_object(ts.row_ids.tolist())
    return {"count": red["count"], "sum_sq": red["sum_sq"], "median": sk.median(), "n": sk.n, "ema": ema, "min": lo,
            "row_ids": ids, "device": str(dev), "world": D.world_size()}


#: every test's work on 2 gloo ranks (``name: "module:function"``), run in this order by ONE launch of 2 processes
#: (:func:`two_ranks`): one process start, import of torch / transformers / lm-eval and process group for all of
#: them, not one launch per test. The models' jobs last but lm-eval's, which patches lm-eval (moetool/lmeval_compat.py).
JOBS = {"statistics": "test_distributed:statistics_job", "uneven": "test_distributed:uneven_job",
        "kmeans": "test_distributed:kmeans_job",
        "forward": "test_distributed:model_run", "empty_rank": "test_distributed_empty_rank:experiments",
        "bootstrap": "test_bootstrap_distributed:bootstrap_run", "eval": "test_distributed:eval_run"}


class JobFailed(str):
    """The traceback of a job that raised on a rank (its test fails with it; the later jobs did not run)."""


def _jobs_worker(rank, world, port, out, jobs):
    """One rank: init gloo, run every job of ``jobs`` in order, save ``{job: its result}`` to ``out.<rank>``. A job
    that raises ends the sequence (the other rank may be inside its collectives: no later job runs out of step)."""
    import importlib
    import os
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MOETOOL_DIST_TIMEOUT="60")  # a mismatch fails in a minute
    torch.set_num_threads(1)
    D.init("cpu")
    results = {}
    try:
        for name, target in jobs.items():
            module, fn = target.split(":")
            try:
                results[name] = getattr(importlib.import_module(module), fn)()
            except Exception:  # noqa: BLE001 - the job's own test reports it
                results[name] = JobFailed(traceback.format_exc())
                break
            # both ranks done with a job before the next one's collectives, and before the group goes: a rank
            # destroying it while the other still had gloo work in flight aborted ("terminate called without an
            # active exception", seen once in CI)
            torch.distributed.barrier()
    finally:
        torch.save(results, f"{out}.{rank}")
        D.shutdown()


_LAUNCH: dict = {}


def two_ranks(tmp_path_factory, job: str, rank: int = 0):
    """What ``job`` of :data:`JOBS` returned on ``rank`` of the one launch of 2 gloo ranks (made on first use in
    this process; the modules using it are one xdist group, so one worker makes it once)."""
    import torch.multiprocessing as mp

    if "results" not in _LAUNCH:
        out = tmp_path_factory.mktemp("gloo") / "res"
        try:
            port_retry(lambda: mp.spawn(_jobs_worker, args=(2, free_port(), str(out), JOBS), nprocs=2, join=True))
            _LAUNCH["results"] = [torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)]
        except Exception as e:  # noqa: BLE001 - every test of the launch reports it, none launches again
            _LAUNCH["results"] = e
    got = _LAUNCH["results"]
    if isinstance(got, Exception):
        pytest.fail(f"the launch of 2 gloo ranks failed: {got!r}")
    if isinstance(got[rank].get(job), JobFailed):
        pytest.fail(f"{job} raised on rank {rank}:\n{got[rank][job]}")
    if job not in got[rank]:
        pytest.fail(f"{job} did not run on rank {rank}: an earlier job of the launch failed "
                    f"({[k for k, v in got[rank].items() if isinstance(v, JobFailed)]})")
    return got[rank][job]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_retry(start, tries: int = 3):
    """``start()`` again (it asks :func:`free_port` afresh) when its rendezvous found the port taken: free_port frees
    the port it found, and another process (a test's gloo ranks, an outgoing connection) may take it before rank 0
    listens - seen in CI as EADDRINUSE. Rank 0 fails at ``init_process_group``, before any job: nothing ran twice."""
    for attempt in range(tries):
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - only the rendezvous's taken port is retried
            if "EADDRINUSE" not in str(e) or attempt == tries - 1:
                raise


def test_two_gloo_ranks_equal_one_process(tmp_path_factory):
    got = two_ranks(tmp_path_factory, "statistics")
    ts = tokens()
    acc, sk, _ = statistics(ts, 6)  # one process, global batches of 2 × 3 rows
    ema = torch.zeros((), dtype=torch.float64)
    for b in ts.batches(6):
        ema = 0.5 * ema + b.input_ids.double().sum()
    assert got["world"] == 2 and got["device"] == "cpu"
    assert torch.equal(got["count"], acc["count"]) and got["sum_sq"] == acc["sum_sq"]
    assert got["n"] == sk.n == ts.n_tokens and got["median"] == sk.median()
    assert float(got["ema"]) == float(ema) and float(got["min"]) == 0.0
    r0, r1 = got["row_ids"]
    assert sorted(r0 + r1) == list(range(ts.input_ids.shape[0])) and not set(r0) & set(r1)
    assert r0[:3] == [0, 1, 2] and r1[:3] == [3, 4, 5]  # each rank's slice of global batch 0


def model_run():
    """engine.forward on the embedded model: perplexity (plain and norm:gate) and a consumer's token count."""
    from moetool.data import load_tokens
    from moetool.engine import forward
    from moetool.loading import load
    from moetool.policies import make_policy

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 32, 300)

    class Count:  # a consumer whose accumulator is all-reduced at the end
        def __init__(self):
            self.n = torch.zeros((), dtype=torch.float64)

        def __call__(self, ev):
            self.n += ev.valid.sum()

        def reduce_across_ranks(self):
            self.n = D.all_reduce(self.n)

    cnt = Count()
    plain = forward(lm, ts, nll=True, batch_size=3, quiet=True)
    norm = forward(lm, ts, nll=True, batch_size=3, policy=make_policy("norm:gate"), consumers=[cnt], quiet=True)
    return {"plain": (plain.nll.nll_sum, plain.nll.tokens), "norm": (norm.nll.nll_sum, norm.nll.tokens),
            "events": float(cnt.n), "world": plain.world_size, "tokens": ts.n_tokens, "layers": len(lm.layers)}


def test_forward_on_two_ranks_equals_one_process(tmp_path_factory):
    """engine.forward shards the rows itself and sums the NLL and the consumers' accumulators over ranks."""
    got, want = two_ranks(tmp_path_factory, "forward"), model_run()
    assert got["world"] == 2 and want["world"] == 1
    for k in ("plain", "norm"):
        assert got[k][1] == want[k][1] and got[k][0] == pytest.approx(want[k][0], rel=1e-9)
    assert got["events"] == want["events"] == want["tokens"] * want["layers"]


def eval_run():
    """lm-eval on the shipped offline task through moetool's HFLM: values and the rows each rank forwarded."""
    from moetool.experiments.eval import compute as lmeval
    from moetool.loading import load
    from moetool.policies import make_policy

    lm = load("tiny")
    rows = [0]
    lm.model.register_forward_hook(lambda m, args, out: rows.__setitem__(0, rows[0] + out.logits.shape[0]))
    res = lmeval.evaluate(lm, lmeval.plan_tasks(["moetool_code"]), policy=make_policy("norm:gate"), limit=24,
                          batch_size=4, quiet=True)
    return {"values": res.frame.value.tolist(), "stderr": res.frame.stderr.tolist(),
            "rows": D.gather_object(rows[0])}


def test_eval_uses_lm_evals_own_split(tmp_path_factory):
    """Under 2 ranks lm-eval itself splits the requests (HFLM rank/world): each rank forwards about half the
    rows one process forwards, and the gathered metrics equal one process's."""
    got, want = two_ranks(tmp_path_factory, "eval"), eval_run()
    assert got["values"] == want["values"] and got["stderr"] == want["stderr"]
    (alone,), (r0, r1) = want["rows"], got["rows"]
    assert 0 < r0 < alone and 0 < r1 < alone and r0 + r1 >= alone  # lm-eval pads the shorter rank


def test_shard_layout_and_single_process_noop(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ts = tokens()
    n = ts.input_ids.shape[0]
    assert D.env() == D.DistEnv(0, 1, 0) and D.is_main() and D.world_size() == 1
    alone = D.shard(ts, 4)
    assert torch.equal(alone.input_ids, ts.input_ids) and alone.row_ids.tolist() == list(range(n))
    parts = [D.shard(ts, 4, r, 3) for r in range(3)]
    assert sorted(sum((p.row_ids.tolist() for p in parts), [])) == list(range(n))
    for p in parts:
        assert torch.equal(p.input_ids, ts.input_ids[p.row_ids]) and p.domains == [ts.domains[i] for i in p.row_ids]
    assert parts[1].row_ids[:4].tolist() == [4, 5, 6, 7] and parts[0].row_ids[4:8].tolist() == [12, 13, 14, 15]
    assert D.n_steps(n, 4, 3) == -(-n // 12)
    x = torch.arange(3.0)
    assert D.all_reduce(x) is x and D.gather_object(5) == [5]


def test_bad_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(MoetoolError, match="bad launcher environment"):
        D.env()


def uneven_job():
    """Rank r holds 3 + 2r rows and keyed accumulators of its own keys and shapes: what each rank gets back."""
    rank = D.global_rank()
    n = 3 + 2 * rank
    t = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2) + 100 * rank
    counts = D.rank_counts(n)
    keyed = ({(0, 4): torch.tensor([1.0, 2.0]), (1, 4): {"s": torch.ones(1, 3), "n": 5}} if rank == 0 else
             {(1, 4): {"s": 2 * torch.ones(1, 3), "n": 5}, (2, 8): torch.arange(1, 5)})
    return {"counts": counts, "rows": D.all_gather_rows(t, counts), "rows_found": D.all_gather_rows(t),
            "keyed": D.all_reduce_keyed(keyed), "keyed_max": D.all_reduce_keyed(keyed, op="max"),
            "main": D.gather_to_main([rank] * n)}


def test_gathers_and_keyed_reductions_over_ranks_of_uneven_rows_and_keys(tmp_path_factory):
    """rank_counts / all_gather_rows with 3 and 5 rows (a rank's rows written at its own index, the buffer as long
    as the longest rank, each rank's padding cut off), all_reduce_keyed where each rank lacks a key the other has
    (zeros of that key's own shape joined: [2], {[1, 3]}, [4]), gather_to_main on rank 0 only. Killed mutations:
    every rank counted at index 0 (rank 1's rows lost), a buffer sized by rank 0's rows, the zeros of the first
    key's shape."""
    want_rows = torch.cat([torch.arange(6, dtype=torch.float64).reshape(3, 2),
                           torch.arange(10, dtype=torch.float64).reshape(5, 2) + 100])
    for rank in (0, 1):
        got = two_ranks(tmp_path_factory, "uneven", rank)
        assert got["counts"].tolist() == [3, 5]
        assert torch.equal(got["rows"], want_rows) and torch.equal(got["rows_found"], want_rows)
        k = got["keyed"]
        assert list(k) == [(0, 4), (1, 4), (2, 8)]
        assert k[(0, 4)].tolist() == [1.0, 2.0] and k[(1, 4)]["s"].tolist() == [[3.0, 3.0, 3.0]]
        assert k[(1, 4)]["n"] == 5 and k[(2, 8)].tolist() == [1, 2, 3, 4] and k[(2, 8)].dtype == torch.long
        assert got["keyed_max"][(1, 4)]["s"].tolist() == [[2.0, 2.0, 2.0]]
        assert got["main"] == ([[0] * 3, [1] * 5] if rank == 0 else None)


def test_a_key_this_rank_lacks_joins_on_the_device_kind_the_other_rank_keeps_it(monkeypatch):
    """A rank without a key joins the reduction with zeros on the kind of device the reporting rank holds that
    tensor (its accumulator on the GPU there: this rank's GPU; a host accumulator: the host), so the reduced dict
    holds every key where the ranks that saw it hold theirs. Without a second GPU: two ranks by substitution, the
    "GPU" being the meta device (the backend's device) and the reduction the identity. Before, the zeros were
    always made on the host: a GPU accumulator came back on the CPU on a rank that had not seen its key."""
    other = {1: ("tensor", (3,), torch.float64, "meta"), 2: ("tensor", (2,), torch.int64, "cpu"),
             3: {"s": ("tensor", (1, 2), torch.float32, "meta"), "n": ("value", 5)}}
    monkeypatch.setattr(D, "_reduces", lambda: True)
    monkeypatch.setattr(D, "_backend_device", lambda: torch.device("meta"))
    monkeypatch.setattr(D, "gather_object", lambda obj: [obj, other])
    monkeypatch.setattr(D, "all_reduce", lambda t, op="sum": t)
    mine = torch.ones(2)
    out = D.all_reduce_keyed({0: mine})
    assert list(out) == [0, 1, 2, 3] and out[0] is mine
    assert (out[1].device.type, out[1].shape, out[1].dtype) == ("meta", (3,), torch.float64)
    assert torch.equal(out[2], torch.zeros(2, dtype=torch.int64)) and out[2].device.type == "cpu"
    assert (out[3]["s"].device.type, out[3]["s"].shape, out[3]["n"]) == ("meta", (1, 2), 5)


#: k-means global batches as (rank 0's rows, rank 1's rows): uneven, and a batch where one rank has none
KMEANS_SPLITS = [(3, 5), (4, 0), (0, 6), (2, 3), (5, 1)]


def kmeans_batches():
    """The global batches of :func:`kmeans_job` ([rows, 8] each, rank 0's rows first): 4 well-spread directions
    plus noise, so 5 codewords with a high dead-code threshold re-initialise on drawn tokens every batch."""
    gen = torch.Generator().manual_seed(11)
    centres = torch.randn(4, 8, generator=gen)
    out = []
    for a, b in KMEANS_SPLITS:
        lab = torch.randint(0, 4, (a + b,), generator=gen)
        out.append(centres[lab] + 0.3 * torch.randn(a + b, 8, generator=gen))
    return out


def kmeans_fit(parts, gb_of=None):
    """Fit :class:`SphericalKMeans` (G=5, gamma=0.5, tau=1.5: a codeword of fewer than 2 tokens in a batch dies) on ``parts``; each step's assignments."""
    from moetool.experiments.kmeans import SphericalKMeans

    km = SphericalKMeans(5, gamma=0.5, tau=1.5, seed=2)
    assigned = [km.update(x, None if gb_of is None else gb_of(x)) for x in parts]
    return km, assigned


def kmeans_job():
    """Each rank fits on its slice of every global batch through :class:`GlobalBatch` (k-means++ from the gathered
    distances, batch sums all-reduced, drawn rows fetched from their owner); its codebook and every rank's
    assignments, gathered in rank order."""
    from moetool.experiments.kmeans import GlobalBatch

    rank = D.global_rank()
    parts = [x[: a] if rank == 0 else x[a:] for x, (a, _) in zip(kmeans_batches(), KMEANS_SPLITS)]
    km, assigned = kmeans_fit(parts, lambda x: GlobalBatch(x.shape[0], x.device))
    return {"codebook": km.codebook, "counts": km.counts, "reinits": km.reinits,
            "assigned": [D.all_gather_rows(g) for g in assigned]}


def test_kmeans_on_two_ranks_of_uneven_slices_equals_one_process(tmp_path_factory):
    """Data-parallel k-means (2 ranks holding 3/5, 4/0, 0/6, 2/3, 5/1 rows of each global batch) keeps the codebook,
    EMA counts, re-initialisations and assignments one process fits on the same global batches. Some codewords
    live on their EMA sums, others are re-initialised on drawn tokens (GlobalBatch.rows across ranks)."""
    km, assigned = kmeans_fit(kmeans_batches())
    assert len(KMEANS_SPLITS) <= km.reinits < 5 * len(KMEANS_SPLITS)  # both the EMA sums and the row fetch matter
    for rank in (0, 1):
        got = two_ranks(tmp_path_factory, "kmeans", rank)
        assert got["reinits"] == km.reinits
        assert [g.tolist() for g in got["assigned"]] == [g.tolist() for g in assigned]
        torch.testing.assert_close(got["counts"], km.counts, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["codebook"], km.codebook, rtol=1e-5, atol=1e-6)


def test_a_shard_keeps_the_global_numbers_of_rows_already_numbered():
    """shard() of a TokenSet that already carries row_ids (rows 100.. of a larger set) keeps those numbers for the
    rows it takes, not their positions in this set."""
    from dataclasses import replace

    ts = tokens()
    n = ts.input_ids.shape[0]
    numbered = replace(ts, row_ids=torch.arange(n) + 100)
    for r in range(3):
        p = D.shard(numbered, 4, r, 3)
        keep = D.shard_indices(n, 4, r, 3)
        assert p.row_ids.tolist() == (keep + 100).tolist() and torch.equal(p.input_ids, ts.input_ids[keep])
    assert D.shard(numbered, 4).row_ids.tolist() == list(range(100, 100 + n))  # alone: unchanged
