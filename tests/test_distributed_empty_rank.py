"""A rank with no row at all (2 packed rows, 2 ranks x 2 rows per global batch: rank 1 gets nothing) still joins
every collective, and every experiment's tables equal one process's (2 gloo processes on CPU)."""

from __future__ import annotations

import pandas as pd
import pytest

from test_distributed import two_ranks

# tiers: pytest -m 'not slow'; experiments() is a job of tests/test_distributed.py's one launch of 2 gloo ranks, made
# once in the worker that runs this xdist group
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("gloo_ranks")]


def experiments():
    """Every data experiment through the API on 2 packed rows, 2 rows per global batch; rank 0's tables."""
    from moetool import distributed
    from moetool.data import load_tokens
    from moetool.experiments.approx.compute import approx
    from moetool.experiments.fluctuation.compute import fluctuation
    from moetool.experiments.mass_recall.compute import mass_recall
    from moetool.experiments.norm_select.compute import norm_select
    from moetool.experiments.offload.compute import offload
    from moetool.experiments.ppl.compute import ppl
    from moetool.experiments.stats.compute import stats
    from moetool.experiments.trace.compute import trace
    from moetool.loading import load

    lm = load("tiny")
    tokens = load_tokens(None, lm.tokenizer, 64, 120)
    assert tokens.input_ids.shape[0] == 2
    bs = 4 // distributed.world_size()  # alone: both rows in one batch; 2 ranks: rank 0 has them, rank 1 none
    results = [ppl(lm, tokens, routing="random", batch_size=bs, bootstrap=100, quiet=True),
               stats(lm, tokens, batch_size=bs, bootstrap=100, quiet=True),
               norm_select(lm, tokens, nodes=("gate",), batch_size=bs, bootstrap=100, quiet=True),
               approx(lm, tokens, selectors=("router", "random"), batch_size=bs, quiet=True),
               mass_recall(lm, tokens, codebook_sizes=(4,), shortlists=(2,), batch_size=bs, bootstrap=100,
                           quiet=True),
               offload(lm, tokens, batch_size=bs, bootstrap=100, quiet=True),
               trace(lm, tokens, batch_size=bs, quiet=True),
               fluctuation(["tiny-early", "tiny"], tokens, routing=("router",), batch_size=bs, bootstrap=100,
                           quiet=True)]
    return {k: v.drop(columns=[c for c in ("seconds",) if c in v]) for r in results for k, v in r.tables.items()}


def test_rank_without_rows_equals_one_process(tmp_path_factory):
    got, want = two_ranks(tmp_path_factory, "empty_rank"), experiments()
    assert sorted(got) == sorted(want) and len(want) >= 10
    for name in want:
        pd.testing.assert_frame_equal(got[name], want[name], check_exact=False, rtol=1e-6, atol=1e-9, obj=name)
