"""Adapters against independent computations: layer discovery, routing math, probe nodes, errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import captured, reference_expert

from moetool import ops
from moetool.adapters import find_moe_layers
from moetool.engine import NODES, node_scores
from moetool.errors import MoetoolError

#: decoder layers that must be MoE in each family's tiny config (the others dense)
EXPECTED_MOE = {"qwen2_moe": [0, 2, 3], "qwen3_moe": [1, 3], "deepseek_v3": [1, 2, 3], "deepseek_v2": [1, 2, 3]}
_ORD = {"l2": 2.0, "l1": 1.0, "linf": math.inf}


def expected_probs(family: str, logits: torch.Tensor) -> torch.Tensor:
    """π, written out per family."""
    if family == "deepseek_v3":
        s = torch.sigmoid(logits.float())
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1)


def expected_weights(family: str, cfg, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The model's weight rule for an arbitrary chosen set, written out per family from its config."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1).gather(-1, idx)
    if family == "mixtral" or (family in ("qwen2_moe", "qwen3_moe", "olmoe") and cfg.norm_topk_prob):
        return p / p.sum(-1, keepdim=True)
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        return p
    if family == "deepseek_v3":
        s = torch.sigmoid(logits).gather(-1, idx)
        return (s / s.sum(-1, keepdim=True) if cfg.norm_topk_prob else s) * cfg.routed_scaling_factor
    if family == "deepseek_v2":
        return p * cfg.routed_scaling_factor
    if family == "gpt_oss":
        return torch.softmax(logits.gather(-1, idx), dim=-1)
    raise KeyError(family)


def test_moe_layers_found(family, tiny_model):
    model = tiny_model(family)
    layers = find_moe_layers(model)
    structural = [i for i, dl in enumerate(model.model.layers) if hasattr(dl.mlp, "experts")]
    assert [L.index for L in layers] == structural == EXPECTED_MOE.get(family, [0, 1, 2, 3])
    for L in layers:
        dl = model.model.layers[L.index]
        assert L.experts is dl.mlp.experts and L.block is dl.mlp and L.decoder_layer is dl
        assert L.router in list(dl.mlp.children()) and L.attention is dl.self_attn


def test_describe_matches_capture(family):
    model, layers, events = captured(family)
    for L in layers:
        d = L.describe()
        ev = events[L.index]
        assert d["n_experts"] == ev.logits.shape[1] == L.router_weight().shape[0] == 8
        assert d["top_k"] == L.top_k == ev.idx.shape[1]
        assert d["router_bias"] == (family == "gpt_oss")
        assert isinstance(d["scoring"], str) and d["scoring"]


def test_probs_and_model_weights(family):
    """6: ``weights_for`` on the model's own set gives the model's weights; π is a distribution."""
    _, layers, events = captured(family)
    for L in layers:
        ev = events[L.index]
        torch.testing.assert_close(L.weights_for(ev.logits, ev.idx), ev.weights, rtol=1e-6, atol=1e-7)
        assert L.weights_for(ev.logits, ev.idx).dtype == ev.weights.dtype
        p = L.probs(ev.logits)
        assert p.dtype == torch.float32 and (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]))
        torch.testing.assert_close(p, expected_probs(family, ev.logits))


def test_weights_for_arbitrary_sets(family):
    """The weight rule on random chosen sets, against each family's rule written out."""
    model, layers, events = captured(family)
    gen = torch.Generator().manual_seed(5)
    for L in layers:
        ev = events[L.index]
        idx = torch.rand(ev.logits.shape, generator=gen).topk(L.top_k, dim=-1).indices
        got = L.weights_for(ev.logits, idx)
        if family == "phimoe":  # order-free: the set, not its order, decides
            torch.testing.assert_close(L.weights_for(ev.logits, idx.flip(-1)), got.flip(-1))
            assert ((got > 0) & (got <= 1)).all()
        else:
            torch.testing.assert_close(got.float(), expected_weights(family, model.config, ev.logits, idx))


def test_phimoe_weights_worked_example(tiny_model):
    """Sparsemixer multipliers by hand: eps=0.1 drops experts more than 20% (relative) below the pick."""
    L = find_moe_layers(tiny_model("phimoe"))[0]
    assert L.router.router_jitter_noise == pytest.approx(0.1)
    logits = torch.tensor([[3.0, 2.9, 1.0, 2.8, -1.0, 0.0, 0.5, 2.0]])
    e = torch.exp
    t = torch.tensor
    # the router's own pick: 0 (softmax over 3.0, 2.9, 2.8) then 1 (over 2.9, 2.8; 2.0 is 31% below)
    idx, w = L.route(logits)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, t([[e(t(3.0)) / (e(t(3.0)) + e(t(2.9)) + e(t(2.8))),
                                      e(t(2.9)) / (e(t(2.9)) + e(t(2.8)))]]))
    # an arbitrary set {3, 0}: 0 as above; 3 after removing 0: 2.9 stays (above it), 2.0 is 29% below
    w = L.weights_for(logits, torch.tensor([[3, 0]]))
    torch.testing.assert_close(w, t([[e(t(2.8)) / (e(t(2.9)) + e(t(2.8))),
                                      e(t(3.0)) / (e(t(3.0)) + e(t(2.9)) + e(t(2.8)))]]))


def test_deepseek_v3_grouped_selection():
    """The correction bias and the group restriction both change the choice (so both are exercised)."""
    _, layers, events = captured("deepseek_v3")
    changed_by_bias = changed_by_groups = 0
    for L in layers:
        ev = events[L.index]
        s = torch.sigmoid(ev.logits)
        plain = s.topk(L.top_k, dim=-1).indices
        biased = (s + L.router.e_score_correction_bias).topk(L.top_k, dim=-1).indices
        changed_by_bias += int((~ops.same_set(plain, biased)).sum())
        changed_by_groups += int((~ops.same_set(biased, ev.idx)).sum())
        half = L.n_experts // 2  # n_group=2, topk_group=1: all chosen experts share a group
        assert ((ev.idx // half)[:, :1] == ev.idx // half).all()
    assert changed_by_bias > 0 and changed_by_groups > 0


def test_node_scores_match_reference(family):
    """4: batched node norms == a per-expert loop over the raw parameters, for every node and norm."""
    _, layers, events = captured(family)
    for L in layers:
        h = events[L.index].h
        ref = [reference_expert(family, L, e, h) for e in range(L.n_experts)]
        for node in NODES:
            stacked = torch.stack([r[node] for r in ref])  # [n, T, X]
            for norm, ord_ in _ORD.items():
                want = torch.linalg.vector_norm(stacked, ord=ord_, dim=-1).T  # [T, n]
                torch.testing.assert_close(node_scores(L, h, node, norm), want, rtol=1e-5, atol=1e-5)


def test_expert_weights_are_views(family):
    """The canonical layout shares storage with the model's parameters (no copies)."""
    _, layers, _ = captured(family)
    for L in layers:
        W = L.expert_weights()
        params = {p.untyped_storage().data_ptr() for p in L.experts.parameters()}
        for t in (W.gate, W.up, W.down, W.gate_bias, W.up_bias, W.down_bias):
            assert t is None or t.untyped_storage().data_ptr() in params
        n, inter, d = W.gate.shape
        assert W.up.shape == (n, inter, d) and W.down.shape == (n, d, inter) and d == 128
        assert (W.gate_bias is not None) == (family == "gpt_oss")


def test_block_is_routed_plus_shared(family):
    """The block's output == experts(h, idx, w) + shared_experts(h); families without one expose None."""
    _, layers, events = captured(family)
    has_shared = family in ("qwen2_moe", "deepseek_v3", "deepseek_v2")
    for L in layers:
        h = events[L.index].h
        with torch.no_grad():
            block = L.block(h.unsqueeze(0))
            block = (block[0] if isinstance(block, tuple) else block).squeeze(0)
            _, w, idx = L.router(h)
            expected = L.experts(h, idx, w)
            assert (L.shared_experts is not None) == has_shared
            if has_shared:
                expected = expected + L.shared_experts(h)
        torch.testing.assert_close(block, expected, rtol=1e-5, atol=1e-6)


def _tiny(config_cls, **kw):
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return AutoModelForCausalLM.from_config(config_cls(**{**common, **kw}))


def test_dense_model_error():
    """7: a dense model gets one line naming it."""
    from transformers import LlamaConfig

    with pytest.raises(MoetoolError, match="no MoE layers found in llama"):
        find_moe_layers(_tiny(LlamaConfig))


def test_unsupported_family_error():
    """7: an MoE family moetool refuses names the supported ones (before any layer is read: the config decides)."""
    from types import SimpleNamespace

    from transformers import DiffusionGemmaConfig

    with pytest.raises(MoetoolError) as err:
        find_moe_layers(SimpleNamespace(config=DiffusionGemmaConfig()))  # refused on purpose (issue 26)
    msg = str(err.value)
    assert "diffusion_gemma" in msg and "\n" not in msg
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "gpt_oss", "phimoe"):
        assert family in msg


@pytest.mark.parametrize("top_k", [0, 9, -1])
def test_top_k_outside_one_to_n_experts_is_one_line_config_error_even_in_inspect(tmp_path, top_k):
    """Issue 21.4: num_experts_per_tok = 0 or > experts gave "RuntimeError: selected index k out of range" (even
    in inspect, which loads no weights): now one line naming the field, exit 2, before any model is built."""
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.loading import embedded_models

    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((embedded_models()["tiny"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": top_k}))
    r = CliRunner().invoke(app, ["inspect", "--model", str(d)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0] == (f"error: num_experts_per_tok = {top_k} in the mixtral config, but the model has 8 experts: "
                        f"top-K must be between 1 and 8 (fix config.json)")


@pytest.mark.parametrize("experts", [0, -3])
def test_no_experts_in_the_config_names_the_expert_count(tmp_path, experts):
    """num_local_experts = -3 (or 0) read 'num_experts_per_tok = 2 ..., but the model has -3 experts: top-K must be
    between 1 and -3': the line blamed the top-K. Now it names the expert count, one line, exit 2."""
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.loading import embedded_models

    d = tmp_path / "model"
    d.mkdir()
    cfg = json.loads((embedded_models()["tiny"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_local_experts": experts}))
    r = CliRunner().invoke(app, ["inspect", "--model", str(d)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and lines == [f"error: num_local_experts = {experts} in the mixtral config: an MoE layer "
                                          f"needs at least 1 expert (fix config.json)"], r.output


def test_top_k_check_reads_per_layer_lists_and_counts_zero_experts():
    from transformers import MixtralConfig

    from moetool.adapters import check_top_k

    cfg = MixtralConfig(num_local_experts=4, num_experts_per_tok=4)
    check_top_k(cfg)  # top-K = n: every expert, allowed
    cfg.moe_topk = [2, 5, 1]  # a per-layer list (Hunyuan's moe_topk): each entry
    with pytest.raises(MoetoolError, match="moe_topk = 5 .* 4 experts"):
        check_top_k(cfg)
    cfg.zero_expert_num = 1  # zero-computation experts the router may pick (LongCat): 5 choices
    check_top_k(cfg)


def test_no_top_k_refusal_for_any_supported_model_type():
    """No false refusal: the tiny config and the default config (the released model's shape) of every supported
    model type pass the top-K check."""
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from moetool.adapters import check_top_k, discovery, supported_model_types

    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mt in supported_model_types():
            for cfg in (discovery.tiny_config(mt), CONFIG_MAPPING[mt]()):
                check_top_k(cfg)
                checked += 1
    assert checked >= 2 * 60


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3", "dbrx"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_router_weights_are_named_first(tiny_model, kind, value):
    """A NaN or inf router weight is found before any routing rule is identified on it: one line naming the MoE
    layer and the tensor, a runtime error (exit 1, as the README says for NaN/inf), whatever the family
    (a hand adapter's router view too)."""
    import copy

    from moetool.errors import MoetoolRuntimeError

    from moetool.adapters.tiny import build_tiny

    # the session's cached model stays intact; dbrx: a hand adapter whose router is a view over the block's
    model = build_tiny(kind) if kind == "dbrx" else copy.deepcopy(tiny_model(kind))
    second = find_moe_layers(model)[1]
    name, t = next((n, t) for n, t in second.router.named_parameters() if t.dim() == 2)
    with torch.no_grad():
        t[0, 1] = value
        t[1, 0] = value
    with pytest.raises(MoetoolRuntimeError) as e:
        find_moe_layers(model)
    msg = str(e.value)
    assert e.value.exit_code == 1 and "\n" not in msg
    assert f"MoE layer {second.index}:" in msg and name.rsplit(".", 1)[-1] in msg and "non-finite" in msg
    assert ("2 NaN and 0 inf" if value != value else "0 NaN and 2 inf") in msg


def test_scoring_names_only_the_steps_the_router_has(family):
    """``inspect`` showed ``softmax -> top-K (+ bias) -> weights = p / sum x scale`` for Mixtral, whose router has
    no correction bias, no groups and a scale of 1: the words name a step only where the model has it (read here
    off the router's own buffers and the config, not off moetool's parameters)."""
    model, layers, _ = captured(family)
    c = getattr(model.config, "text_config", None) or model.config
    for L in layers:
        text = L.describe()["scoring"]
        assert "(+" not in text and "[within" not in text and "x scale" not in text, text
        has_bias = getattr(L.router, "e_score_correction_bias", None) is not None
        assert ("correction bias" in text) == has_bias, (text, has_bias)
        scale = float(getattr(c, "routed_scaling_factor", None) or 1.0)
        if L.describe()["rule"] != "sparsemixer":
            assert (f"x {scale:g}" in text) == (scale != 1.0), (text, scale)
        groups = int(getattr(c, "n_group", None) or 1)
        assert ("groups" in text) == (groups > 1), text


def test_scoring_of_mixtral_and_deepseek_v3_in_words():
    from conftest import build_tiny_model

    (mixtral,) = {L.describe()["scoring"] for L in find_moe_layers(build_tiny_model("mixtral"))}
    assert mixtral == "softmax -> top-K -> weights = p / sum"
    v3 = build_tiny_model("deepseek_v3")
    c = v3.config
    assert c.routed_scaling_factor == 2.5 and (c.n_group, c.topk_group) == (2, 1)
    assert {L.describe()["scoring"] for L in find_moe_layers(v3)} == {
        "sigmoid -> top-K of score + correction bias within the best 1 of 2 groups -> score / sum x 2.5"}


def test_inspect_of_the_embedded_model_shows_no_step_it_lacks():
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app

    r = CliRunner().invoke(app, ["inspect", "--model", "tiny", "--json"])
    assert r.exit_code == 0, r.output
    layers = json.loads(r.output)["moe_layers"]
    assert all(not L["correction_bias"] and L["routed_scaling_factor"] == 1.0 for L in layers)
    assert {L["scoring"] for L in layers} == {"softmax -> top-K -> weights = p / sum"}


def test_longcat_pre_router_norm_is_the_norm_whose_output_the_router_reads():
    """LongCat-Flash's decoder layer has two sublayers, each with its own ``post_attention_layernorm``: the MoE
    (shortcut) reads the first's output. ``pre_router_norm`` (what offload predicts the next layer's routing
    through) is the norm whose output is the router input ``h`` of the layer's events, bit for bit."""
    from conftest import padded_batch, run

    from moetool.adapters.tiny import build_tiny

    model = build_tiny("longcat_flash")
    layers = find_moe_layers(model)
    seen = {}
    hooks = [L.pre_router_norm.register_forward_hook(lambda m, a, out, i=L.index: seen.setdefault(i, out))
             for L in layers]
    try:
        _, events, _ = run(model, layers, padded_batch())
    finally:
        for h in hooks:
            h.remove()
    for L in layers:
        assert torch.equal(seen[L.index].reshape(events[L.index].h.shape), events[L.index].h)
