"""Peer cross-check: ``moetool super-experts`` against the Super Experts paper's own code (Su et al. 2025,
"Unveiling Super Experts in Mixture-of-Experts Large Language Models", arXiv 2507.23279).

Ported from ZunhaiSu/Super-Experts-Profilling @ 573aead3127ae593ba267758b832944f8fed1485, ``eval_utils.py``:

* ``experts_down_proj_hook`` (line 126): per call of an expert's down projection, ``outps_max =
  output[0].abs().max()`` (line 140) -- ``output[0]`` is the first row of the call's output: in transformers'
  per-expert loop (``MixtralExperts.forward``: ``top_k_pos, token_idx = torch.where(expert_mask[expert_idx])``,
  4.51 and 5.x alike) the first token the loop gathers for the expert, per forward of one sequence
  (``_layer_wise_evaluate`` runs ``batch_size = 1``, line 68); ``_outliers_info_to_json`` (line 379) keeps the max
  over the calls, ``torch.max(output_max_value_stack, dim=0)``;
* ``_super_experts_analysis`` (line 470): ``include_layers = round(total_layers * include_layers)`` (0.75 from
  run.py), entries with ``int(each['layer_index']) < include_layers``;
* ``_identify_super_experts`` (line 619): ``percentile = np.percentile(output_max_values, quantile)`` (99.5) and
  ``item['output_max'] > percentile and item['output_max'] > np.max(output_max_values) // times`` (times 10).

The public code considers the shared experts' down projections too (none in these models). The expert outputs
come from a plain forward (tests/peer/peer_capture.py), not from moetool's probes. Compared on the embedded models
with 8,192 tokens: moetool's --reading first-row gives the code's maxima and picks; its default (every routed
token) gives the maxima over all routed tokens, and the same rule picks from them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from peer_capture import blocks, capture, expert_output, readme, tokens

pytestmark = pytest.mark.slow
XDIST_GROUP_BY = "both"  # one xdist worker per model: its module fixture (run + reference) made once (conftest)


# ---- port of eval_utils.py (ZunhaiSu/Super-Experts-Profilling @ 573aead) ----------------------------------------
def super_experts_analysis(data, total_layers, include_layers=0.75):
    include_layers = round(total_layers * include_layers)
    new_data = []
    for each in data:
        if int(each['layer_index']) < include_layers:
            new_data.append(each)
    return new_data


def identify_super_experts(results, quantile=99.5, times=10):
    output_max_values = [item['output_max'] for item in results]
    percentile = np.percentile(output_max_values, quantile)
    Super_Experts = []
    for item in results:
        if item['output_max'] > percentile and item['output_max'] > np.max(output_max_values) // times:
            Super_Experts.append({
                'expert_index': item['expert_index'],
                'layer_index': item['layer_index'],
                'output_max': item['output_max']
            })
    Super_Experts.sort(key=lambda x: x['output_max'], reverse=True)
    return Super_Experts
# ---- end of the port ------------------------------------------------------------------------------------------


def hook_maxima(blk, c) -> tuple[list[float], list[float]]:
    """Per expert: the code's reading (``output[0].abs().max()`` per call, one call per sequence, max over the
    calls) and the max over every routed token, from the rows' captured input and top-K."""
    R, S = c["shape"]
    n = blk.experts.gate_up_proj.shape[0]
    first, every = [0.0] * n, [0.0] * n
    for r in range(R):
        h, idx = c["h"][r * S:(r + 1) * S], c["idx"][r * S:(r + 1) * S]
        expert_mask = F.one_hot(idx, num_classes=n).permute(2, 1, 0)  # transformers' loop: [n, K, S]
        for expert_idx in range(n):
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.numel() == 0:  # the hook's input_shape[0] == 0 branch: 0
                continue
            output = expert_output(blk, expert_idx, h[token_idx])  # the down projection's output rows
            first[expert_idx] = max(first[expert_idx], float(output[0].abs().max()))
            every[expert_idx] = max(every[expert_idx], float(output.abs().max()))
    return first, every


@pytest.fixture(scope="module", params=["tiny", "tiny-fine"])
def both(request):
    import moetool

    lm, ts = tokens(request.param)
    assert bool(ts.attention_mask.bool().all())  # whole rows, as the code's: no padding to leave out
    runs = {reading: moetool.super_experts(lm, ts, reading=reading, bootstrap=0, quiet=True)
            for reading in ("routed", "first-row")}
    seen = capture(lm.model, ts.input_ids, ts.attention_mask)
    ref = {"first-row": [], "routed": []}
    for layer, blk in blocks(lm.model).items():
        first, every = hook_maxima(blk, seen[layer])
        for e in range(len(first)):
            ref["first-row"].append({"expert_index": e, "layer_index": layer, "output_max": first[e]})
            ref["routed"].append({"expert_index": e, "layer_index": layer, "output_max": every[e]})
    return request.param, lm.config.num_hidden_layers, runs, ref


@pytest.mark.parametrize("reading", ["first-row", "routed"])
def test_maxima_layers_and_picks_are_the_codes(both, reading):
    """Each reading's maxima equal the port's over the code's layers (the first round(0.75 L)); the super experts
    moetool picks by default are those ``identify_super_experts`` picks from the same maxima."""
    name, total_layers, runs, ref = both
    table = runs[reading]["super_experts"]
    kept = super_experts_analysis(ref[reading], total_layers)
    assert sorted({int(d["layer_index"]) for d in kept}) == sorted(set(table.layer)) == [0, 1, 2]
    want = {(d["layer_index"], d["expert_index"]): d["output_max"] for d in kept}
    got = {(int(r.layer), int(r.expert)): r.max_abs_output for r in table.itertuples()}
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5)
    picks = [(d["layer_index"], d["expert_index"]) for d in identify_super_experts(kept)]
    assert picks  # the rule picks something here: a rule that picked nothing could not tell the readings apart
    assert [(int(r.layer), int(r.expert)) for r in table[table.is_super].sort_values("rank").itertuples()] == picks
    # the port's rule on moetool's own maxima: the same set (the comparison, not only the maxima, is the code's)
    mine = [{"expert_index": int(r.expert), "layer_index": int(r.layer), "output_max": float(r.max_abs_output)}
            for r in table.itertuples()]
    assert {(d["layer_index"], d["expert_index"]) for d in identify_super_experts(mine)} == set(picks)
    assert table.degenerate.all() and (table.can_pass == 1).all()  # <= 201 maxima: only the largest can pass


def test_the_readme_quotes_the_picks_of_both_readings(both):
    """The README's super-experts row: on tiny-fine the code's reading picks one expert, every routed token
    another; the experts it names are the picks of the two readings."""
    name, _, runs, _ = both
    if name != "tiny-fine":
        pytest.skip("the README quotes tiny-fine")
    pick = {r: [(int(x.layer), int(x.expert)) for x in runs[r]["super_experts"].query("is_super").itertuples()]
            for r in ("first-row", "routed")}
    assert len(pick["first-row"]) == len(pick["routed"]) == 1 and pick["first-row"] != pick["routed"], pick
    (l1, e1), (l2, e2) = pick["first-row"][0], pick["routed"][0]
    said = f"(on `tiny-fine`: the code's reading picks layer {l1} expert {e1}, every routed token expert {e2})"
    assert l1 == l2 and said in readme(), said
