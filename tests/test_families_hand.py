"""Hand adapters (families whose experts or blocks differ from the common shape) and hybrid models.

tests/test_families.py runs its generic checks on every supported type; here what those checks cannot see:

* the experts' own activations (clamped SwiGLU, clamped alpha-SwiGLU, softcapped SwiGLU) with limits small
  enough that the clamps and caps really bind on tiny random weights: the batched nodes then still equal the
  model's own experts module, one expert at a time, and the clamp is seen to change the output;
* Nemotron-H's non-gated experts: "glu" is act(up), what the down projection sees;
* MiniMax-M3's block scales the routed output: ``output_scale`` is the block's factor;
* Gemma 4's decoder layers read router / experts through views: bit for bit the original model, the router
  written out by hand (normed input, per-expert scale), the experts on their own normed copy of the input;
* hybrid models: attention routing refuses MoE layers whose decoder layer mixes tokens with Mamba / DeltaNet in
  one line naming the layer and its mixer, and runs on the softmax-attention layers.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, run

from moetool.adapters import discovery, find_moe_layers
from moetool.adapters.tiny import build_tiny
from moetool.engine import node_scores
from moetool.errors import MoetoolError
from moetool.policies import make_policy


@functools.lru_cache(maxsize=None)
def tiny(model_type: str):
    model = build_tiny(model_type, seed=0)
    return model, find_moe_layers(model)


def _h(L, T: int = 12) -> torch.Tensor:
    d = L.router_weight().shape[1]
    return torch.randn(T, d, generator=torch.Generator().manual_seed(3)) * 3.0  # large: clamps bind


def _one_expert(L, e: int, h: torch.Tensor) -> torch.Tensor:
    idx = torch.full((h.shape[0], 1), e, dtype=torch.long)
    with torch.no_grad():
        return L.experts(h, idx, torch.ones(h.shape[0], 1, dtype=h.dtype))


def _assert_nodes_match_model(L, h):
    """Batched output nodes == the model's experts module per expert; glu -> down reproduces them too."""
    outs = torch.stack([_one_expert(L, e, h) for e in range(L.n_experts)])  # [n, T, d]
    torch.testing.assert_close(node_scores(L, h, "output", "l2"), outs.norm(dim=-1).T, rtol=1e-5, atol=1e-5)
    W = L.expert_weights()
    for e in (0, L.n_experts - 1):
        glu = L.glu(F.linear(h, W.gate[e]), F.linear(h, W.up[e]))
        torch.testing.assert_close(F.linear(glu, W.down[e]), outs[e], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type, attr, small", [
    ("glm5_next", "swiglu_limit", 0.05), ("hy_v4", "swiglu_limit", 0.05), ("minimax_m3_vl_text", "swiglu_limit", 0.05)])
def test_clamped_swiglu_binds_and_matches(model_type, attr, small):
    model, layers = tiny(model_type)
    L = layers[0]
    h = _h(L)
    old = getattr(L.experts, attr)
    before = _one_expert(L, 0, h)
    try:
        setattr(L.experts, attr, small)
        if hasattr(L.experts, "limit"):
            L.experts.limit = small
        assert not torch.allclose(_one_expert(L, 0, h), before)  # the clamp binds at this limit
        _assert_nodes_match_model(L, h)
    finally:
        setattr(L.experts, attr, old)
        if hasattr(L.experts, "limit"):
            L.experts.limit = old


def test_softcapped_swiglu_binds_and_matches():
    model, layers = tiny("inkling2_text")
    L = layers[0]
    h = _h(L)
    fn = L.experts.act_fn
    caps = fn.gate_softcap.softcap, fn.up_softcap.softcap
    before = _one_expert(L, 0, h)
    try:
        fn.gate_softcap.softcap, fn.up_softcap.softcap = 0.1, 0.1
        assert not torch.allclose(_one_expert(L, 0, h), before)
        _assert_nodes_match_model(L, h)
        g = torch.randn(5, 7)
        torch.testing.assert_close(L.act(g), torch.tanh(g / 0.1) * 0.1 * torch.sigmoid(g))  # closed form
    finally:
        fn.gate_softcap.softcap, fn.up_softcap.softcap = caps


def test_aria_transposed_layout():
    """Aria's experts are (in, out): the canonical gate/up/down views are transposes of the stored tensors."""
    model, layers = tiny("aria_text")
    L = layers[0]
    W, ex = L.expert_weights(), L.experts
    inter = ex.gate_up_proj.shape[-1] // 2
    assert torch.equal(W.gate[1], ex.gate_up_proj[1, :, :inter].T) and torch.equal(W.down[1], ex.down_proj[1].T)
    _assert_nodes_match_model(L, _h(L))


def test_nemotron_h_non_gated_experts():
    model, layers = tiny("nemotron_h")
    L = layers[0]
    h = _h(L)
    up = F.linear(h, L.experts.up_proj[2])
    want = torch.relu(up) ** 2  # relu^2, Nemotron-H's mlp_hidden_act
    assert L.config.mlp_hidden_act == "relu2"
    torch.testing.assert_close(L.glu(up, up), want)
    _assert_nodes_match_model(L, h)


def test_minimax_m3_block_scales_the_routed_output():
    model, layers = tiny("minimax_m3_vl_text")
    L = layers[0]
    assert L.output_scale == L.config.routed_scaling_factor != 1.0
    assert L.weight_scale == 1.0  # the weights the router returns sum to one; the block scales after the experts
    h = _h(L, 6) / 3
    idx, w = L.route(L.logits(h))
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    with torch.no_grad():
        out = L.block(h.unsqueeze(0)).reshape(h.shape)
        want = L.experts(h, idx, w) * L.output_scale + L.shared_experts(h)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


# ----- hybrid models: attention routing on softmax-attention layers only -------------------------------------
@pytest.mark.parametrize("model_type, refused, mixer, ok", [
    ("jamba", [1], "mamba (JambaMambaMixer)", 3),
    ("qwen3_next", [0, 1, 2], "linear_attn (Qwen3NextGatedDeltaNet)", 3),  # every layer without it named at once
])
def test_attention_policy_refuses_non_softmax_layers(model_type, refused, mixer, ok):
    model, layers = tiny(model_type)
    batch = padded_batch(seq=8)
    impl, model.config._attn_implementation = model.config._attn_implementation, "eager"
    try:
        with pytest.raises(MoetoolError) as e:
            run(model, layers, batch, policy=make_policy("attention"))
        msg = str(e.value)
        assert f"MoE layers {refused} have no softmax attention" in msg and mixer in msg and "\n" not in msg
        assert msg.endswith(f": choose the others with --layers {ok}"), msg  # the one it runs on, below
        # on the softmax-attention layer it runs: the scores are the propagation through the chosen head
        got, events, _ = run(model, layers, batch, policy=make_policy("attention"), policy_layers=[ok])
        ev = events[ok]
        assert got.isfinite().all() and ev.scores is not None
        torch.testing.assert_close(ev.scores.sum(-1), torch.ones(ev.scores.shape[0]))
        other = [i for i in events if i != ok]
        assert all(torch.equal(events[i].chosen_idx, events[i].idx) for i in other)  # untouched layers
    finally:
        model.config._attn_implementation = impl


def test_attention_policy_nemotron_moe_layer_has_no_attention():
    """Nemotron-H: a 'moe' decoder layer's one mixer is the MoE block itself."""
    from moetool.policies.attention import softmax_attention

    model, layers = tiny("nemotron_h")
    with pytest.raises(MoetoolError, match=r"MoE layers \[\d+\] have no softmax attention .*MoE block alone: mixer"):
        softmax_attention(layers[0])


# ----- Llama 4: the weight scales the experts' input; the block class swap is bit-exact -------------------------
@functools.lru_cache(maxsize=None)
def llama4_top2():
    """A tiny llama4_text with K = 2 (its default K = 1 cannot tell input from output scaling)."""
    cfg = discovery.tiny_config("llama4_text")
    cfg.num_experts_per_tok = 2
    torch.manual_seed(0)
    model = discovery.model_class("llama4_text").from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for blk in model.modules():
            if type(blk).__name__ == "Llama4TextMoe":
                blk.router.weight.copy_(torch.randn(blk.router.weight.shape, generator=gen) * 0.15)
    return model


def test_llama4_views_are_bit_exact_and_weights_scale_the_input():
    import copy

    from moetool.adapters.llama4 import restore

    model = llama4_top2()
    batch = padded_batch(seq=8)
    with torch.no_grad():
        want = copy.deepcopy(model)(**batch).logits  # the original Llama4TextMoe forward
    layers = find_moe_layers(model)
    assert [L.top_k for L in layers] == [2] * len(layers) and layers[0].describe()["rule"] == "topk-sigmoid"
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    got, events, _ = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    L = layers[0]
    ev = events[L.index]
    logits = L.logits(ev.h)
    top, idx = torch.topk(logits, 2, dim=1)  # Llama4Router by hand: sigmoid of the top-2 logits
    assert torch.equal(ev.idx, idx) and torch.equal(ev.weights, torch.sigmoid(top))
    ridx, rw = L.route(logits)
    assert torch.equal(ridx, idx) and torch.equal(rw, ev.weights)

    outs: dict[int, torch.Tensor] = {}
    _, events, _ = run(model, layers, batch, policy=make_policy("random", seed=0), experts_out=outs)
    ev = events[L.index]
    w, i = ev.chosen_weights, ev.chosen_idx
    assert (w < 0.99).any()
    input_scaled = sum(torch.stack([_one_expert(L, e, ev.h * w[:, k:k + 1]) for e in range(L.n_experts)])[
        i[:, k], torch.arange(ev.h.shape[0])] for k in range(2))
    output_scaled = sum(w[:, k:k + 1] * torch.stack([_one_expert(L, e, ev.h) for e in range(L.n_experts)])[
        i[:, k], torch.arange(ev.h.shape[0])] for k in range(2))
    torch.testing.assert_close(outs[L.index], input_scaled, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outs[L.index], output_scaled, rtol=1e-3, atol=1e-5)
    restore(model)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)


def gemma4_tiny():
    """A tiny gemma4_text with its MoE block; router scale and per-expert scale drawn away from their init (ones)."""
    torch.manual_seed(0)
    model = discovery.model_class("gemma4_text").from_config(discovery.tiny_config("gemma4_text")).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Gemma4TextRouter":
                m.proj.weight.copy_(torch.randn(m.proj.weight.shape, generator=gen) * 0.5)
                for t in (m.scale, m.per_expert_scale):
                    t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
    return model


def test_gemma4_views_are_bit_exact_and_route_as_the_router_by_hand():
    """The swapped decoder layers compute the original model bit for bit; the router, written out here from its
    raw parameters (weightless RMS norm, x scale / sqrt(d), projection, softmax, top-K, renormalised, x
    per_expert_scale), is what the adapter routes by; the experts see pre_feedforward_layernorm_2(h)."""
    import copy
    import math

    from test_engine import assert_same_routing

    from moetool.adapters.gemma4 import restore
    from moetool.engine import expert_outputs

    model = gemma4_tiny()
    batch = padded_batch(seq=8)
    with torch.no_grad():
        want = copy.deepcopy(model)(**batch).logits  # the original decoder layers
    layers = find_moe_layers(model)
    assert layers and {L.describe()["rule"] for L in layers} == {"softmax-topk-renorm"}
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
    got, events, _ = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    for L in layers:
        ev, r = events[L.index], L.decoder_layer._modules["router"]
        h = ev.h
        x = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + r.norm.eps, -0.5) * r.scale / math.sqrt(h.shape[-1])
        logits = x @ r.proj.weight.T
        torch.testing.assert_close(ev.logits, logits, rtol=1e-5, atol=1e-5)
        top, idx = torch.softmax(logits, -1).topk(L.top_k, dim=-1)
        w = top / top.sum(-1, keepdim=True) * r.per_expert_scale[idx]
        assert_same_routing(ev.idx, ev.weights, idx, w, rtol=1e-5, atol=1e-6)
        ridx, rw = L.route(L.logits(h))
        assert_same_routing(ridx, rw, ev.idx, ev.weights, rtol=0, atol=0)
        assert torch.equal(L.logits(h.double()), L.logits(h))  # any input dtype (mass-recall passes fp64 points)
        assert not torch.allclose(w.sum(-1), torch.ones(w.shape[0]))  # the per-expert scale is really applied

    L = layers[0]
    h = events[L.index].h
    experts, norm2 = L.decoder_layer._modules["experts"], L.decoder_layer._modules["pre_feedforward_layernorm_2"]
    with torch.no_grad():
        own = torch.stack([experts(norm2(h), torch.full((h.shape[0], 1), e), torch.ones(h.shape[0], 1))
                           for e in range(L.n_experts)])
        raw = torch.stack([experts(h, torch.full((h.shape[0], 1), e), torch.ones(h.shape[0], 1))
                           for e in range(L.n_experts)])
    torch.testing.assert_close(expert_outputs(L, h), own, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(own, raw, rtol=1e-3, atol=1e-4)  # the norm matters
    restore(model)
    assert type(L.decoder_layer).__name__ == "Gemma4TextDecoderLayer"
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)


def test_doge_product_keys_by_hand_and_views_bit_exact():
    """Doge's CDMoE: the logits are the k^2 product-key sums written out from ``router_gate``'s raw weight, with the
    model's token mixing (``view(2, T, k)`` of the flattened ``[T, 2k]`` projection: token t's x is half t mod 2 of
    token t // 2, its y half (T + t) mod 2 of token (T + t) // 2); the model's two-stage top-K is the full top-K of
    the sums; the experts by hand from the embedding rows; the swapped block is ``DogeCDMoE.forward`` bit for bit;
    and what recomputes routing from other inputs is refused in one line."""
    from moetool.engine.hooks import refuse_recomputed

    model, layers = tiny("doge")
    L = layers[0]
    k = L.router.num_keys
    assert L.n_experts == k * k == 16 and L.rule_name() == "topk-softmax"
    T, d = 10, L.block.router_gate.weight.shape[1]
    h = torch.randn(T, d, generator=torch.Generator().manual_seed(5))
    W = L.block.router_gate.weight.detach().double()  # [2k, d]
    proj = h.double() @ W.T  # [T, 2k]
    want = torch.empty(T, k, k, dtype=torch.float64)
    for t in range(T):
        x = proj[t // 2, (t % 2) * k:(t % 2 + 1) * k]
        u = T + t
        y = proj[u // 2, (u % 2) * k:(u % 2 + 1) * k]
        want[t] = x[:, None] + y[None, :]
    logits = L.logits(h)
    torch.testing.assert_close(logits.double(), want.reshape(T, k * k), rtol=1e-6, atol=1e-6)
    # not a function of a token's own input: the first half of the tokens routed alone gets other logits
    assert not torch.allclose(L.logits(h[:T // 2]), logits[:T // 2])
    _, w, idx, _ = L.router(h)  # the model's own two-stage selection
    ridx, rw = L.route(logits)
    assert torch.equal(ridx, idx) and torch.equal(idx, logits.topk(L.top_k, dim=-1).indices)
    torch.testing.assert_close(rw, w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w, torch.softmax(logits.gather(-1, idx), dim=-1))
    # experts by hand: sum_e w_e act(down_embed[e] . h) up_embed[e]
    D, U = L.block.down_embed.weight.detach(), L.block.up_embed.weight.detach()
    by_hand = torch.einsum("tk,tkd->td", F.silu(torch.einsum("tkd,td->tk", D[idx], h)) * w, U[idx])
    torch.testing.assert_close(L.experts(h, idx, w), by_hand, rtol=1e-5, atol=1e-6)
    x = h.unsqueeze(0)
    with torch.no_grad():
        for a, b in zip(type(L.block)._moetool_original.forward(L.block, x), L.block(x)):
            assert torch.equal(a, b)
    with pytest.raises(MoetoolError, match="other tokens of the batch"):
        refuse_recomputed(layers, "margin")
    with pytest.raises(MoetoolError, match="not a matrix R"):
        L.router_weight()
