"""The demo's console lines (issue 35 item 14): each norm-select line names the model it is for; fluctuation's
summary is a heading per checkpoint pair and one short line per routing, not one line of ~700 characters."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd

from moetool.experiments.fluctuation import compute as fluctuation
from moetool.experiments.norm_select import compute as norm_select
from moetool.uncertainty import format_ci


def test_norm_select_lines_name_the_model():
    summary = pd.DataFrame({"node": ["router", "gate"], "norm": ["-", "l2"], "ppl": [40.5, 83.4],
                            "ppl ratio": [1.0, 83.4 / 40.5], "top-K overlap": [1.0, 0.52], "top-1 agree": [1.0, 0.5],
                            "code acc": [0.8, 0.7], "code retention": [1.0, 0.875]})
    lines = norm_select.summary_lines("tiny-fine", SimpleNamespace(meta={}, summary=summary))
    assert lines == ["tiny-fine, router: ppl 40.5 (x1.00), top-K overlap 1.00, top-1 agree 1.00, code acc 0.80 (x1.00)",
                     "tiny-fine, norm:gate:l2: ppl 83.4 (x2.06), top-K overlap 0.52, top-1 agree 0.50, code acc 0.70 "
                     "(x0.88)"]
    pruned = norm_select.summary_lines("tiny", SimpleNamespace(meta={"pruned": {"name": "prune:random:0.5"}},
                                                               summary=summary))
    assert all(ln.startswith("tiny") for ln in pruned) and pruned[0] == "tiny: on the model pruned by prune:random:0.5"


def test_fluctuation_summary_is_one_short_line_per_routing():
    rows = []
    for checkpoint in ("tiny-early", "tiny-late"):
        for i, routing in enumerate(("router", "similarity", "attention")):
            red = (np.nan, np.nan, np.nan) if routing == "router" else (0.05 * i, 0.01, 0.09 * i)
            rows.append({"reference": "tiny", "checkpoint": checkpoint, "routing": routing,
                         "top1_change": 0.4 - 0.1 * i, "top1_change_lo": 0.38 - 0.1 * i,
                         "top1_change_hi": 0.42 - 0.1 * i, "reduction_vs_router": red[0],
                         "reduction_vs_router_lo": red[1], "reduction_vs_router_hi": red[2]})
    lines = fluctuation.summary_lines("x", {"fluctuation_summary": pd.DataFrame(rows)})
    assert len(lines) == 2 * 4 and max(map(len, lines)) < 120, lines
    assert lines[0] == "tiny -> tiny-early: top-1 change (mean over layers)"
    assert lines[1] == f"  router {format_ci(0.4, 0.38, 0.42)}"
    assert lines[2] == (f"  similarity {format_ci(0.3, 0.28, 0.32)} [reduction vs router "
                        f"{format_ci(0.05, 0.01, 0.09)} (interval excludes 0)]")
    assert lines[4] == "tiny -> tiny-late: top-1 change (mean over layers)"
