"""Peer cross-check: ``moetool prune``'s REAP saliency and pruned sets against REAP's own code (Lasby et al. 2025,
"REAP the Experts: Why Pruning Prevails for One-Shot MoE Compression", arXiv 2510.13999).

Ported from CerebrasResearch/reap @ 1970473c51ca3caeb98c10392f15b3a08a672974:

* ``src/reap/pruning_metrics.py`` ``update_pruning_state`` (line 133): ``routing_weights =
  F.softmax(router_logits, dim=1, dtype=torch.float)`` (line 172), divided by its sum over the token's
  ``selected_experts`` when ``renormalize_router_weights`` (lines 175-183); per expert over its active tokens
  ``reap[i] = (ean_norm * active_router_weights).mean()`` with ``ean_norm = torch.linalg.norm(selected_activations,
  dim=-1)`` (line 198); ``layer_state["reap"].update(reap, expert_frequency)`` (line 209), a count-weighted running
  mean (``src/reap/metrics.py`` ``OnlineStatsTracker.update``);
* ``src/reap/observer.py`` (lines 376-380): ``selected_experts`` = ``torch.topk(router_logits, top_k)``,
  ``activations[idx] = expert(flat_input)`` (every expert on every token, before any weight);
* ``src/reap/prune.py`` (line 101): ``torch.topk(saliency_data, n_experts_to_prune, largest=False)`` with
  ``n_experts_to_prune = int(total_experts * compression_ratio)`` (line 261).

Which weight REAP uses: ``renormalize_router_weights`` defaults to True (``src/reap/args.py`` line 141);
``src/reap/main.py`` ``_setup_observer`` (line 121) applies it only when ``model.config.norm_topk_prob`` is set
(Qwen3-MoE sets it, Mixtral's config has none: raw softmax there), ``src/reap/layerwise_prune.py`` (line 174)
always; REAP's README (2026-03-11) calls renormalised correct. moetool: ``--reap-weights renormalised`` (default)
and ``softmax``. The router logits and expert outputs come from a plain forward (tests/peer/peer_capture.py), one
sequence per batch as REAP's observer sees it. Compared on the embedded models with 8,192 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from peer_capture import blocks, capture, expert_output, readme, tokens

pytestmark = pytest.mark.slow


# ---- port of src/reap/pruning_metrics.py update_pruning_state (CerebrasResearch/reap @ 1970473) -----------------
def update_pruning_state(layer_state, *, activations, selected_experts, router_logits, num_experts,
                         renormalize_router_weights=False):
    expert_frequency = torch.bincount(selected_experts.reshape(-1), minlength=num_experts)
    reap = torch.zeros(num_experts, dtype=torch.float64)  # the reference accumulates float32; float64 here
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    if renormalize_router_weights and selected_experts.numel() > 0:
        topk_weights = torch.gather(
            routing_weights,
            1,
            selected_experts,
        )
        routing_weights = routing_weights / topk_weights.sum(dim=-1, keepdim=True)
        routing_weights = torch.clamp(
            routing_weights, min=torch.finfo(routing_weights.dtype).eps
        )
    for i in range(num_experts):
        active_mask = (selected_experts == i).any(dim=-1)
        if not active_mask.any():
            continue
        selected_activations = activations[i, active_mask, :]
        active_router_weights = routing_weights[active_mask, i]
        ean_norm = torch.linalg.norm(selected_activations, dim=-1)
        reap[i] = (ean_norm * active_router_weights).mean()
    # layer_state["reap"].update(reap, expert_frequency): OnlineStatsTracker's count-weighted mean
    count = layer_state["count"] + expert_frequency
    delta = reap - layer_state["mean"]
    layer_state["mean"] = layer_state["mean"] + (delta * expert_frequency / count).nan_to_num(0)
    layer_state["count"] = count
# ---- end of the port ------------------------------------------------------------------------------------------


def reap_saliency(lm, ts) -> dict[bool, dict[int, torch.Tensor]]:
    """Per ``renormalize_router_weights`` (True, False) and MoE layer, REAP's saliency from the port, one sequence
    per batch (the observer's hook per forward). The observer's inputs (router logits, every expert's output) do not
    depend on the gate weight: captured and computed once, then fed to one state per setting."""
    seen = capture(lm.model, ts.input_ids, ts.attention_mask)
    out = {True: {}, False: {}}
    for layer, blk in blocks(lm.model).items():
        c = seen[layer]
        R, S = c["shape"]
        n, K = c["logits"].shape[1], c["idx"].shape[1]
        states = {r: {"count": torch.zeros(n, dtype=torch.long), "mean": torch.zeros(n, dtype=torch.float64)}
                  for r in out}
        for r in range(R):
            flat_input, router_logits = c["h"][r * S:(r + 1) * S], c["logits"][r * S:(r + 1) * S]
            _, selected_experts = torch.topk(router_logits, K, dim=-1)
            activations = torch.stack([expert_output(blk, e, flat_input) for e in range(n)])  # [n, S, d]
            for renormalize, state in states.items():
                update_pruning_state(state, activations=activations, selected_experts=selected_experts,
                                     router_logits=router_logits, num_experts=n,
                                     renormalize_router_weights=renormalize)
        for renormalize, state in states.items():
            out[renormalize][layer] = state["mean"]
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-fine"])
def test_saliency_and_pruned_sets_are_reaps(name):
    """For both gate weights: moetool's ``reap`` column is REAP's saliency, and the experts it removes at 25% and
    50% per layer are REAP's ``topk(saliency, int(n x ratio), largest=False)``."""
    import moetool

    lm, ts = tokens(name)
    assert bool(ts.attention_mask.bool().all())  # whole rows: no padding for REAP's observer to see
    removed_by, ratio_of = {}, {}
    saliency = reap_saliency(lm, ts)
    for weights, renormalize in (("renormalised", True), ("softmax", False)):
        res = moetool.prune(lm, ts, fractions=(0.25, 0.5), criteria=("reap",), ablate=0, reap_weights=weights,
                            bootstrap=0, quiet=True)
        imp, removed = res["prune_importance"], res["prune_removed"]
        ref = saliency[renormalize]
        for layer, want in ref.items():
            got = imp[imp.layer == layer].sort_values("expert")["reap"].to_numpy()
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, err_msg=f"{name} {weights} layer {layer}")
            for ratio in (0.25, 0.5):
                k = int(len(want) * ratio)
                _, experts_to_prune = torch.topk(want, k, largest=False)
                sel = removed[(removed.fraction == ratio) & (removed.layer == layer)]
                assert sorted(sel.expert) == sorted(experts_to_prune.tolist()), (name, weights, layer, ratio)
                removed_by[(weights, layer, ratio)] = sorted(sel.expert)
        ratio_of[weights] = res["prune"].set_index(["criterion", "fraction"]).loc[("reap", 0.25), "ratio"]
    # the two gate weights are not interchangeable: on these models they remove different experts somewhere
    assert any(removed_by[("renormalised", *k[1:])] != v for k, v in removed_by.items() if k[0] == "softmax")
    if name == "tiny":  # the README's prune row quotes layer 0's removed experts and the ratios at 25%
        (a, b), (c, d) = removed_by[("renormalised", 0, 0.25)], removed_by[("softmax", 0, 0.25)]
        said = (f"on `tiny`, 25% removed: layer 0 loses experts {a} and {b} renormalised, {c} and {d} softmax; "
                f"perplexity ratio {ratio_of['renormalised']:.2f} against {ratio_of['softmax']:.2f}")
        assert said in readme(), said
