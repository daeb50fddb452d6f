"""--bootstrap under data parallelism: the per-row sums (uncertainty.RowTable, numbered by global row id) of two
gloo ranks, all-reduced, equal one process's, so the intervals are the same."""

from __future__ import annotations

import numpy as np
import pytest
from test_distributed import two_ranks

# tiers: pytest -m 'not slow'; bootstrap_run() is a job of tests/test_distributed.py's one launch of 2 gloo ranks,
# made once in the worker that runs this xdist group
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("gloo_ranks")]


def bootstrap_run():
    """ppl (norm:gate, paired with the router) and stats' per-row sums on the embedded model, 13 rows of 32."""
    from moetool.data import load_tokens
    from moetool.experiments.ppl.compute import ppl
    from moetool.experiments.stats.compute import collect
    from moetool.loading import load

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 32, 400)
    row = ppl(lm, ts, routing="norm:gate", batch_size=3, bootstrap=200, quiet=True)["ppl"].iloc[0].to_dict()
    c = collect(lm, ts, batch_size=3, quiet=True, row_sums=True, specialization=False, top_tokens=False)
    rows = {name: c.routing.rows.table(name) for name in c.routing.rows.names}
    return {"ppl": row, "rows": rows, "n_rows": int(ts.input_ids.shape[0])}


def test_two_gloo_ranks_give_one_process_intervals(tmp_path_factory):
    got, want = two_ranks(tmp_path_factory, "bootstrap"), bootstrap_run()
    assert want["n_rows"] >= 10  # rows split over ranks by global batches of 3
    for k in ("scored_tokens", "perplexity", "perplexity_lo", "perplexity_hi", "ratio", "ratio_lo", "ratio_hi"):
        assert got["ppl"][k] == pytest.approx(want["ppl"][k], rel=1e-9), k
    assert sorted(got["rows"]) == sorted(want["rows"])
    for name, table in want["rows"].items():
        assert table.shape[0] == want["n_rows"]
        np.testing.assert_allclose(got["rows"][name], table, rtol=1e-9, atol=1e-9)
