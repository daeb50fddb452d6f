"""The hook engine on every family: exact reproduction, capture, overrides that really run, --layers."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_model, captured, reference_expert, reference_moe, run

from moetool import ops
from moetool.adapters import find_moe_layers
from moetool.policies import make_policy


class Spy:
    """Wraps a policy and counts its calls (proves the override path ran)."""

    def __init__(self, policy):
        self.policy, self.name, self.needs_attention, self.calls = policy, policy.name, False, 0

    def select(self, ev):
        self.calls += 1
        return self.policy.select(ev)


def _sorted(idx, w):
    """Rows ordered by expert index, to compare top-K sets and their weights."""
    order = idx.argsort(dim=-1)
    return idx.gather(-1, order), w.gather(-1, order)


def assert_same_routing(idx, w, want_idx, want_w, **tol):
    i, a = _sorted(idx, w)
    j, b = _sorted(want_idx, want_w)
    assert torch.equal(i, j)
    torch.testing.assert_close(a, b, **tol)


def test_router_policy_reproduces_model(family, tiny_model, batch):
    """1: the ``router`` policy through the override path gives the unhooked logits bit for bit (padded batch)."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    with torch.no_grad():
        want = model(**batch).logits
    assert not want.isnan().any()
    policy = Spy(make_policy("router"))
    got, events, eng = run(model, layers, batch, policy=policy)
    assert torch.equal(got, want)
    assert policy.calls == len(layers) and eng.reported == {L.index: 1 for L in layers}
    for ev in events.values():
        assert ev.shape == (2, 10) and torch.equal(ev.valid, batch["attention_mask"].reshape(-1).bool())


def test_capture_changes_nothing(family, tiny_model, batch):
    """2: an engine with only a consumer leaves the logits bit for bit unchanged."""
    model = tiny_model(family)
    with torch.no_grad():
        want = model(**batch).logits
    got, events, _ = run(model, find_moe_layers(model), batch)
    assert torch.equal(got, want) and events


def test_captured_routing_matches_adapter(family):
    """3: the captured logits and top-K are exactly the adapter's recomputation from the captured h."""
    _, layers, events = captured(family)
    for L in layers:
        ev = events[L.index]
        logits = L.logits(ev.h)
        assert torch.equal(logits, ev.logits)
        idx, w = L.route(logits)
        assert idx.dtype == ev.idx.dtype and w.dtype == ev.weights.dtype
        assert_same_routing(idx, w, ev.idx, ev.weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["norm:gate", "random"])
def test_override_really_runs(family, tiny_model, batch, spec):
    """5: the experts' actual output is Σ_k w_k E_{idx_k}(h) for the policy's choice (not the router's)."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    outs: dict[int, torch.Tensor] = {}
    _, events, _ = run(model, layers, batch, policy=make_policy(spec, seed=0), experts_out=outs)
    differs = 0
    # policies whose weights sum to one keep the model's scale: DeepSeek multiplies by routed_scaling_factor
    scale = model.config.routed_scaling_factor if family.startswith("deepseek") else 1.0
    for L in layers:
        ev = events[L.index]
        K = L.top_k
        assert ev.chosen_idx.shape == (ev.h.shape[0], K)
        torch.testing.assert_close(outs[L.index], reference_moe(family, L, ev.h, ev.chosen_idx, ev.chosen_weights),
                                   rtol=1e-5, atol=1e-6)
        differs += int((~ops.same_set(ev.chosen_idx, ev.idx))[ev.valid].sum())
        if spec == "random":
            torch.testing.assert_close(ev.chosen_weights, torch.full_like(ev.chosen_weights, scale / K))
        else:  # the K largest ||W_g^e h||, softmax-weighted (AoE Algorithm 1)
            norms = torch.stack([reference_expert(family, L, e, ev.h)["gate"].norm(dim=-1)
                                 for e in range(L.n_experts)], dim=-1)  # [T, n]
            top = norms.topk(K, dim=-1)
            assert_same_routing(ev.chosen_idx, ev.chosen_weights, top.indices, scale * torch.softmax(top.values, dim=-1),
                                rtol=1e-5, atol=1e-6)
    assert differs > 0


def test_policy_layers_only(family, tiny_model, batch):
    """8: ``--layers``: only the given layer is overridden; the others run the router's own choice."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    first = layers[0].index
    outs: dict[int, torch.Tensor] = {}
    _, events, _ = run(model, layers, batch, policy=make_policy("random", seed=0), policy_layers={first},
                       experts_out=outs)
    _, _, plain = captured(family)
    ev = events[first]
    assert (~ops.same_set(ev.chosen_idx, ev.idx))[ev.valid].any()
    for L in layers[1:]:
        ev = events[L.index]
        assert not torch.equal(ev.h, plain[L.index].h)  # downstream of the override
        idx, w = L.route(L.logits(ev.h))
        assert torch.equal(ev.chosen_idx, ev.idx) and torch.equal(ev.chosen_weights, ev.weights)
        assert ops.same_set(idx, ev.chosen_idx).all()
        torch.testing.assert_close(outs[L.index], reference_moe(family, L, ev.h, idx, w), rtol=1e-5, atol=1e-6)


def test_bf16_dtypes(family, tiny_model, batch):
    """Router outputs keep the model's dtypes (fp32 logits/weights where the model uses them) in bf16."""
    model = copy.deepcopy(tiny_model(family)).to(torch.bfloat16)
    layers = find_moe_layers(model)
    with torch.no_grad():
        want = model(**batch).logits
    got, events, _ = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    fp32_router = family in ("deepseek_v3", "deepseek_v2")
    for L in layers:
        ev = events[L.index]
        logits = L.logits(ev.h)
        assert logits.dtype == ev.logits.dtype == (torch.float32 if fp32_router else torch.bfloat16)
        assert torch.equal(logits, ev.logits)
        idx, w = L.route(logits)
        assert w.dtype == ev.weights.dtype == L.weights_for(logits, idx).dtype
        assert_same_routing(idx, w, ev.idx, ev.weights, rtol=0, atol=0)
    got, _, _ = run(model, layers, batch, policy=make_policy("norm:output", weights="router"))
    assert got.dtype == torch.bfloat16 and got.isfinite().all()


def test_deepseek_v2_greedy(tiny_model, batch):
    """``topk_method="greedy"`` (V2-Lite) is followed too, and differs from the group-limited choice."""
    model = copy.deepcopy(tiny_model("deepseek_v2"))
    layers = find_moe_layers(model)
    grouped = {L.index: L.route(L.logits(captured("deepseek_v2")[2][L.index].h))[0] for L in layers}
    for L in layers:
        L.router.topk_method = "greedy"
    _, events, _ = run(model, layers, batch)
    differs = 0
    for L in layers:
        ev = events[L.index]
        idx, w = L.route(L.logits(ev.h))
        assert_same_routing(idx, w, ev.idx, ev.weights, rtol=1e-6, atol=1e-7)
        if L.index == layers[0].index:  # same input as the group-limited run
            differs += int((~ops.same_set(idx, grouped[L.index])).sum())
    assert differs > 0


def test_layer_selection_one_meaning():
    from moetool.commands.cli import parse_layers
    from moetool.engine import select_layers
    from moetool.errors import MoetoolError

    layers = find_moe_layers(build_tiny_model("mixtral"))
    idx = [L.index for L in layers]
    assert parse_layers("0,2-3") == (0, 2, 3) and parse_layers(None) is None
    with pytest.raises(MoetoolError, match="empty --layers range '3-1'"):
        parse_layers("3-1")
    assert [L.index for L in select_layers(layers, [idx[-1], idx[0]])] == [idx[0], idx[-1]]  # model order
    assert select_layers(layers, None) == layers
    with pytest.raises(MoetoolError, match="selects no layer"):
        select_layers(layers, [])
    with pytest.raises(MoetoolError, match="not MoE layers"):
        select_layers(layers, [max(idx) + 5])
    for wanted in (idx[0], "0,1"):  # the API's layers=3 or a CLI string: never a TypeError or a set of characters
        with pytest.raises(MoetoolError, match=r"layers= must be decoder layer indices \(a tuple such as"):
            select_layers(layers, wanted)


def test_a_huge_layers_range_is_one_line_at_once_and_bad_layers_read_as_spans():
    """--layers 0-100000000 built a list of 10^8 layer indices (a minute and gigabytes, the run killed before it
    said anything); --layers 0-1000 on a 4-layer model listed 996 numbers in its error. Now the range is refused at
    once and bad layers read as spans."""
    import time

    from moetool.commands.cli import parse_layers
    from moetool.engine import select_layers
    from moetool.errors import MoetoolError

    t = time.perf_counter()
    with pytest.raises(MoetoolError) as e:
        parse_layers("0,2-100000000")
    assert str(e.value) == ("--layers item '2-100000000': layer 100000000 is beyond any model's layers (decoder "
                            "indices up to 100,000)") and time.perf_counter() - t < 1
    layers = find_moe_layers(build_tiny_model("mixtral"))
    idx = [L.index for L in layers]
    with pytest.raises(MoetoolError) as e:
        select_layers(layers, parse_layers(f"0-{max(idx) + 1000}"))
    assert str(e.value) == (f"layers= names {max(idx) + 1}-{max(idx) + 1000}: not MoE layers (MoE layers: "
                            f"{idx[0]}-{idx[-1]})")  # called from Python: the keyword (the CLI's: test_layers_name_the_flag_or_the_keyword)


def test_hook_refuses_a_policy_option_no_policy_reads():
    """``moetool.hook(lm, policy=..., **options)``: a misspelt option (``wieghts=``) is one line, not ignored as
    build_policy ignores the options a policy does not read; options without a spec to build are refused too."""
    import moetool
    from moetool.errors import MoetoolError

    lm = moetool.load("tiny")
    assert moetool.hook(lm, policy="norm:gate", weights="uniform").policy.weights == "uniform"
    with pytest.raises(MoetoolError, match=r"unknown policy option\(s\) \['wieghts'\] \(known: causal, norm, seed, "):
        moetool.hook(lm, policy="norm:gate", wieghts="uniform")
    with pytest.raises(MoetoolError, match=r"policy options \['weights'\] go with a policy spec"):
        moetool.hook(lm, weights="uniform")


def test_attention_routing_switches_an_sdpa_model_to_eager_for_the_run(tiny_model, batch):
    """Issue 37.3: SDPA (CUDA's default, and the CPU's) never materialises attention probabilities; the engine
    switches the model to eager attention itself for an attention-reading policy and gives it back after. Same
    choices and logits as the model loaded eager."""
    import copy

    model = copy.deepcopy(tiny_model("mixtral"))
    assert model.config._attn_implementation == "sdpa"
    layers = find_moe_layers(model)
    got, events, _ = run(model, layers, batch, policy=make_policy("attention"))
    assert model.config._attn_implementation == "sdpa"  # given back
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    want, want_events, _ = run(eager, find_moe_layers(eager), batch, policy=make_policy("attention"))
    assert torch.equal(got, want)
    for i, ev in events.items():
        assert ev.attn is not None and torch.equal(ev.chosen_idx, want_events[i].chosen_idx)
    plain, _, _ = run(model, layers, batch)  # capture only: no probabilities asked, SDPA again
    assert model.config._attn_implementation == "sdpa" and plain.isfinite().all()


def test_ranked_reorders_a_router_order_by_the_selection_scores(tiny_model):
    """``RoutingEvent.ranked`` (the trace's expert_k / weight_k, specialization's first-ranked expert): a router
    that returns its top-K unsorted (``topk(sorted=False)``: DeepSeek-V3 on CUDA) is put in the order of the scores
    the model selects by -- sigmoid + correction bias, not π -- each weight moving with its expert. The CPU's topk
    returns them sorted, so the router's order is reversed by hand here (K = 2: the ranking must not be skipped)."""
    from moetool.engine.hooks import RoutingEvent

    model = tiny_model("deepseek_v3")
    layers = find_moe_layers(model)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 1000, (2, 40), generator=gen)
    _, events, _ = run(model, layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    L = layers[0]
    ev = events[L.index]
    assert ev.idx.shape[-1] == 2
    rev = RoutingEvent(layer=L, h=ev.h, logits=ev.logits, idx=ev.idx.flip(-1), weights=ev.weights.flip(-1),
                       valid=ev.valid, shape=ev.shape)
    score = torch.sigmoid(ev.logits.float()) + L.router.e_score_correction_bias.float()  # what DeepSeek-V3 ranks by
    order = score.gather(-1, rev.idx).argsort(dim=-1, descending=True)
    want_idx, want_w = rev.idx.gather(-1, order), rev.weights.gather(-1, order)
    idx, w = rev.ranked
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)
    assert not torch.equal(idx, rev.idx)  # the router's order really was not the rank order
    by_pi = torch.softmax(ev.logits.float(), -1).gather(-1, rev.idx).argsort(dim=-1, descending=True)
    assert not torch.equal(by_pi, order)  # ranking by π would put some tokens' experts the other way round
    chosen = torch.rand(rev.idx.shape, generator=gen)  # a policy's weights for the model's set: ranked alike
    assert torch.equal(rev.in_rank_order(chosen), chosen.gather(-1, order))


def test_events_carry_the_forwards_token_ids_for_hash_routed_layers(tiny_model):
    """Each event carries the forward's input ids ``[B*S]`` (a hash-routed layer's routing is a function of them:
    fluctuation re-routes it with ``route(logits, ev.token_ids)``), None for a forward given embeddings."""
    from moetool.adapters.tiny import build_tiny

    model = build_tiny("deepseek_v4")
    layers = find_moe_layers(model)
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(6))
    _, events, _ = run(model, layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    hashed = [L for L in layers if getattr(L, "hash_routed", False)]
    assert hashed
    for L in layers:
        assert torch.equal(events[L.index].token_ids.cpu(), ids.reshape(-1))
    for L in hashed:  # the table's rows for those ids: the experts the model ran
        ev = events[L.index]
        idx, _ = L.route(ev.logits, ev.token_ids)
        assert torch.equal(idx.sort(-1).values, ev.idx.long().sort(-1).values)
    model = tiny_model("mixtral")  # deepseek_v4's hash routers need the ids themselves
    layers = find_moe_layers(model)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    _, events, _ = run(model, layers, {"inputs_embeds": embeds, "attention_mask": torch.ones_like(ids)})
    assert len(events) == len(layers) and all(ev.token_ids is None for ev in events.values())


def test_one_expert_per_token_on_longcat_runs_w_times_that_expert():
    """A policy giving each token one expert (``topk:1``) on LongCat-Flash, whose experts module cannot take K = 1
    (``experts_args`` hands it the expert twice, the second time at weight 0): the experts' output is ``w E_e(h)``
    by hand from the raw parameters (an identity expert: ``w h``), not twice that."""
    from moetool.adapters.tiny import build_tiny

    model = build_tiny("longcat_flash")
    layers = find_moe_layers(model)
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(8))
    outs: dict[int, torch.Tensor] = {}
    _, events, _ = run(model, layers, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                       policy=make_policy("topk:1"), experts_out=outs)
    computed, identity = 0, 0
    for L in layers:
        ev = events[L.index]
        assert ev.chosen_idx.shape == (24, 1)
        m = L.n_experts - L.n_zero_compute
        with torch.no_grad():
            want = torch.stack([ev.chosen_weights[t, 0] * (
                reference_expert("longcat_flash", L, int(e), ev.h[t:t + 1])["output"][0] if e < m else ev.h[t])
                for t, e in enumerate(ev.chosen_idx[:, 0].tolist())])
        torch.testing.assert_close(outs[L.index], want, rtol=1e-5, atol=1e-6)
        computed += int((ev.chosen_idx < m).sum())
        identity += int((ev.chosen_idx >= m).sum())
    assert computed and identity  # both kinds of expert were chosen


def test_a_recomputation_refusal_names_carried_state_and_hash_layers_at_once_and_suggests_what_runs():
    """A model with a carried-router-state layer and a hash-routed one: the refusal of an experiment that recomputes
    routing from the layer input (margin) names both in one line and offers only the layers that can be recomputed
    (before, the carried-state line came alone and offered the hash-routed layer, refused in turn); none of those
    asked for left: the model's layers that are."""
    from types import SimpleNamespace

    from moetool.engine.hooks import refuse_recomputed
    from moetool.errors import MoetoolError

    def layer(i, carried=False, hashed=False):
        return SimpleNamespace(index=i, carried_state=carried, hash_routed=hashed,
                               routing_context="the previous layer's router state")

    model = [layer(0), layer(1, carried=True), layer(2, hashed=True), layer(3)]
    with pytest.raises(MoetoolError) as e:
        refuse_recomputed(model, "margin", model)
    msg = str(e.value)
    assert "the router logits of MoE layers [1] also depend on the previous layer's router state" in msg
    assert "MoE layers [2] are hash-routed" in msg
    assert msg.endswith(": choose the others with --layers 0,3") and msg.count("--layers") == 1
    with pytest.raises(MoetoolError) as e:
        refuse_recomputed(model[1:3], "margin", model)
    assert str(e.value).endswith(": no layer asked for is left: choose --layers 0,3")
    refuse_recomputed([model[0], model[3]], "margin", model)  # nothing to refuse
