"""The structures issue 26 added to the adapter contract, checked where tests/test_families.py cannot see them.

* views (jetmoe's dispatch-tuple block, muse_spark's projected experts) compute the original model bit for bit,
  and ``restore`` brings the original classes back;
* jetmoe: the router written out from its raw parameters (top-K of the logits, softmax over the K) is what the
  layer routes by; the block's bias is added after the experts' sum;
* muse_spark: each expert's output, written out from raw parameters (projection in, centred norm, SwiGLU, down,
  per-expert norm, projection out), is what the probes compute; the router's ``output_multiplier`` is applied;
* inkling: the shared experts' gammas the layer computes are the router's own fourth output, and the routed
  weights are the model's only when the shared logits join the normalisation;
* beam / axk1: the block's routed scaling factor / post-MoE norm are the layer's ``output_scale`` / ``post_step``;
* ernie4_5_vl_moe: the layer is the text group (its router and experts), the vision group's parameters are not.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from conftest import padded_batch, run

from moetool.adapters import find_moe_layers
from moetool.adapters.generic import restore_views
from moetool.adapters.tiny import build_tiny
from moetool.engine import expert_outputs
from moetool.policies import make_policy


@functools.lru_cache(maxsize=None)
def tiny(model_type: str):
    model = build_tiny(model_type, seed=0)
    return model, find_moe_layers(model)


def _views_bit_exact(model_type: str):
    """(model, layers, events of a router-policy run): the swapped model equals the original one bit for bit."""
    model = build_tiny(model_type, seed=0)  # routers re-drawn (this swaps the classes in)
    restore_views(model)
    batch = padded_batch(seq=8)
    with torch.no_grad():
        want = copy.deepcopy(model)(**batch).logits  # the original blocks
    layers = find_moe_layers(model)
    assert any("WithViews" in type(m).__name__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    got, events, _ = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    restore_views(model)
    assert not any("WithViews" in type(m).__name__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    return model, layers, events


def test_jetmoe_views_bit_exact_router_by_hand_and_bias_after_the_sum():
    model, _, _ = _views_bit_exact("jetmoe")
    layers = find_moe_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    moa = layers[0].describe()["attention_experts"]  # the attention experts' router: the same rule, identified apart
    assert moa["rule"] == "topk-softmax" and not moa["analysed"] and moa["n_experts"] == model.config.num_local_experts
    assert moa["top_k"] == model.config.num_experts_per_tok
    _, events, _ = run(model, layers, padded_batch(seq=8), policy=make_policy("router"))
    for L in layers:
        ev, gating = events[L.index], L.block._modules["router"]
        logits = ev.h @ gating.layer.weight.T
        top, idx = logits.topk(L.top_k, dim=-1)
        torch.testing.assert_close(ev.logits, logits, rtol=1e-6, atol=1e-6)
        assert torch.equal(ev.idx, idx)
        torch.testing.assert_close(ev.weights, torch.softmax(top, -1), rtol=1e-6, atol=1e-7)
    L = layers[0]
    h = events[L.index].h
    own = L.block
    with torch.no_grad():  # E_e(h) from the raw weights: silu(gate) * up, down; the block adds its bias once
        W_in, W_out = own.input_linear.weight, own.output_linear.weight
        gate, up = torch.einsum("td,nid->nti", h, W_in).chunk(2, dim=-1)
        by_hand = torch.einsum("nti,ndi->ntd", own.activation(gate) * up, W_out)
        torch.testing.assert_close(expert_outputs(L, h), by_hand, rtol=1e-5, atol=1e-5)
        ev = events[L.index]
        routed = L.experts(h, ev.idx, ev.weights)
        torch.testing.assert_close(own(h.unsqueeze(0))[0], routed + own.bias, rtol=1e-6, atol=1e-6)
    assert own.bias.abs().max() > 0


def test_muse_spark_projected_experts_by_hand():
    model, _, _ = _views_bit_exact("muse_spark")
    layers = find_moe_layers(model)
    _, events, _ = run(model, layers, padded_batch(seq=8), policy=make_policy("router"))
    L = layers[0]
    h = events[L.index].h
    b = L.block
    pre, norm, post = b._modules["pre_expert_proj"], b._modules["pre_expert_norm"], b._modules["post_expert_proj"]
    ex = b._modules["experts"]
    d, d_e = h.shape[-1], ex.gate_up_proj.shape[-1]
    assert d_e != d and L.describe()["expert_width"] == d_e
    with torch.no_grad():
        x = h @ pre.weight.T
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)
        gate, up = torch.einsum("td,nid->nti", x, ex.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("nti,ndi->ntd", F.silu(gate) * up, ex.down_proj)
        pn = ex.post_expert_norm
        y = y * (1 + pn.weight)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + pn.eps)
        by_hand = y @ post.weight.T  # [n, T, d]
    torch.testing.assert_close(expert_outputs(L, h), by_hand, rtol=1e-4, atol=1e-5)
    r = b._modules["gate"]
    assert r.output_multiplier != 1.0
    torch.testing.assert_close(L.logits(h), (h @ r.weight.T) * r.output_multiplier, rtol=1e-6, atol=1e-6)


def test_inkling_shared_gammas_are_the_routers_and_need_the_shared_logits():
    model, layers = tiny("inkling_text")
    _, events, _ = run(model, layers, padded_batch(seq=8), policy=make_policy("router"))
    for L in layers:
        ev, r = events[L.index], L.router
        n, s = L.n_experts, L.n_shared
        assert ev.logits.shape[-1] == n + s and L.probs(ev.logits).shape[-1] == n
        with torch.no_grad():
            routed, w, idx, gammas = r(ev.h)
        torch.testing.assert_close(L.shared_gammas(ev.logits), gammas, rtol=1e-5, atol=1e-6)
        sg = torch.sigmoid(ev.logits)  # by hand: the chosen and the shared sigmoid scores, normalised together
        chosen = sg[:, :n].gather(-1, idx)
        scale = r.route_scale * float(r.global_scale.detach())
        torch.testing.assert_close(w, chosen / (chosen.sum(-1, keepdim=True) + sg[:, n:].sum(-1, keepdim=True))
                                   * scale, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(w, chosen / chosen.sum(-1, keepdim=True) * scale, rtol=1e-3)  # the shared bite
        ridx, rw = L.route(ev.logits)
        assert torch.equal(ridx.sort(-1).values, idx.sort(-1).values)


def test_beam_output_scale_and_axk1_post_step():
    _, (L,) = tiny("beam")[0], tiny("beam")[1][:1]
    assert L.output_scale == float(L.block.routed_scaling_factor) != 1.0 and L.weight_scale == 1.0
    _, layers = tiny("axk1")
    assert all(type(L.post_step()).__name__ == "AXK1RMSNorm" and L.post_step() is L.block.post_mlp_layernorm
               for L in layers)


def test_ernie4_5_vl_moe_routes_the_text_group():
    model, layers = tiny("ernie4_5_vl_moe")
    from moetool.inspect import family_row

    assert family_row("ernie4_5_vl_moe", model, layers)["routing"] == \
        "softmax-topk-renorm (text tokens within the text expert group)"
    for L in layers:
        assert L.router is L.block.text_moe.gate and L.experts is L.block.text_moe.experts
        assert L.describe()["expert_group"].startswith("text")
        assert L.shared_experts is L.block.shared_experts
    assert not any(p is q for L in layers for p in L.experts.parameters()
                   for q in L.block.vision_moe.experts.parameters())
