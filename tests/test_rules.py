"""The routing-rule catalogue (moetool/adapters/rules.py) and its identification on a router (generic.py).

* every rule against a hand-written per-token reference (plain Python floats) on random logits;
* identification picks the expected rule for each supported family (asserted in tests/test_families.py
  against :data:`EXPECTED_RULE`, on the same tiny models);
* a router with a rule outside the catalogue (softmax squared) gets one line naming what did not match;
* a "future family" (a model type no registry line names) with a known rule works through the generic adapter.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, run
from torch import nn

from moetool.adapters import check_config, find_moe_layers, get_adapter, rules
from moetool.adapters.generic import GenericAdapter, GenericLayer
from moetool.errors import MoetoolError
from moetool.policies import make_policy

#: the rule each installed family's router reproduces (tiny models of tests/test_families.py)
EXPECTED_RULE = {
    **dict.fromkeys(["mixtral", "minimax", "ernie4_5_moe", "hunyuan_v1_moe", "mellum", "mistral4", "mistral_large4",
                     "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_omni_moe_thinker", "qwen3_vl_moe",
                     "qwen4_exp", "qwen4_exp_text", "lara_mini"], "softmax-topk-renorm"),
    **dict.fromkeys(["olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_ocr2", "unlimited_ocr", "flex_olmo",
                     "jamba"], "softmax-topk"),
    **dict.fromkeys(["gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "cohere2_moe",
                     "aria", "aria_text"], "topk-softmax"),
    **dict.fromkeys(["deepseek_v3", "afmoe", "axk2", "bailing_hybrid", "deepseek_v32", "dots3_note", "dots3_note_text",
                     "exaone_moe", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa", "hy_v3", "kimi_k25",
                     "kimi_linear", "laguna", "lfm2_moe", "mimo_v2_flash", "minimax_m2", "solar_open", "step3p7", "nemotron_h", "nemotron_h_omni",
                     "glm5_next", "hy_v4", "hy_v4_vl", "inkling2", "inkling2_text", "minimax_m3_vl", "minimax_m3_vl_text",
                     "inkling2_loop", "inkling2_loop_text", "sarvam_mla", "sarvam_moe"],
                   "sigmoid-topk-renorm"),
    # issue 26: a step after the experts (axk1, beam), projected experts (muse_spark), weights normalised with the
    # shared experts' logits (inkling), the text group of per-modality groups (ernie4_5_vl_moe)
    **dict.fromkeys(["axk1", "beam", "flint", "hy_v4_vl", "muse_spark", "inkling_text", "inkling_mm_model"],
                    "sigmoid-topk-renorm"),
    "ernie4_5_vl_moe": "softmax-topk-renorm",
    "jetmoe": "topk-softmax",
    "dots1": "sigmoid-topk",
    "kolibri1": "topk-sigmoid",
    "llama4": "topk-sigmoid", "llama4_text": "topk-sigmoid",
    "gemma4": "softmax-topk-renorm", "gemma4_text": "softmax-topk-renorm",  # times per_expert_scale[idx]
    "phimoe": "sparsemixer",
    "switch_transformers": "softmax-topk",  # top-1: argmax of softmax, weight = its probability
    "dbrx": "softmax-topk-renorm",  # routed by its block (DbrxFFN.route_tokens_to_experts), p-norm 1
    "deepseek_v4": "sqrtsoftplus-topk-renorm",  # its hash-routed layers: "hash:" + the rule that weights them
    "longcat_flash": "softmax-topk",  # over n routed + zero_expert_num identity experts
    "zaya": "softmax-topk",  # over n experts + a skip class, logits from h and the carried router state
    "doge": "topk-softmax",  # over the k^2 product-key sums (two-stage top-K = full top-K); logits mix tokens
}


# ----- hand references: one token at a time, plain floats ------------------------------------------------
def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _allowed(scores, n_group, topk_group, how):
    """Experts inside the topk_group best groups (group score: sum of its two best, or its best)."""
    if n_group <= 1:
        return set(range(len(scores)))
    size = len(scores) // n_group
    gs = []
    for g in range(n_group):
        part = sorted(scores[g * size:(g + 1) * size], reverse=True)
        gs.append(part[0] + part[1] if how == "top2sum" else part[0])
    best = sorted(range(n_group), key=lambda g: -gs[g])[:topk_group]
    return {e for g in best for e in range(g * size, (g + 1) * size)}


def reference(rule: str, logits: list[float], k: int, bias=None, n_group=1, topk_group=1, how="top2sum",
              scale=1.0, eps=0.0):
    """(chosen experts, their weights) for one token, written out per rule."""
    n = len(logits)
    b = bias or [0.0] * n
    if rule == "sparsemixer":
        rest, picked, ws = list(logits), [], []
        for _ in range(2):
            j = max((e for e in range(n) if e not in picked), key=lambda e: logits[e])
            keep = [e for e in range(n) if e not in picked and
                    (logits[j] - logits[e]) / max(abs(logits[e]), logits[j]) <= 2 * eps]
            z = sum(math.exp(rest[e]) for e in keep)
            ws.append(math.exp(rest[j]) / z)
            picked.append(j)
        return picked, ws
    if rule.startswith("softmax"):
        base = _softmax(logits)
    elif rule.startswith("sigmoid"):
        base = [_sigmoid(x) for x in logits]
    elif rule.startswith("sqrtsoftplus"):
        base = [math.sqrt(math.log1p(math.exp(x))) for x in logits]
    else:
        base = list(logits)
    rank = [base[e] + b[e] for e in range(n)]
    ok = _allowed(rank, n_group, topk_group, how)
    idx = sorted(ok, key=lambda e: -rank[e])[:k]
    if rule == "topk-softmax":
        w = _softmax([logits[e] for e in idx])
    elif rule.startswith("topk-sigmoid"):
        w = [_sigmoid(logits[e]) for e in idx]
    else:
        w = [base[e] for e in idx]
    if rule.endswith("renorm"):
        s = sum(w)
        w = [x / s for x in w]
    return idx, [x * scale for x in w]


VARIANTS = [dict(), dict(bias=True), dict(n_group=4, topk_group=2, how="top2sum"),
            dict(n_group=4, topk_group=2, how="max", scale=2.5), dict(bias=True, n_group=2, topk_group=1, scale=1.5)]


@pytest.mark.parametrize("rule", [r for r in rules.RULES if r.name != "sparsemixer"], ids=lambda r: r.name)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_rule_matches_hand_reference(rule, variant):
    v = VARIANTS[variant]
    gen = torch.Generator().manual_seed(variant)
    T, n, k = 24, 8, 3
    logits = torch.randn(T, n, generator=gen) * 1.5
    bias = torch.randn(n, generator=gen) * 0.3 if v.get("bias") else None
    p = rules.Params(top_k=k, bias=bias, n_group=v.get("n_group", 1), topk_group=v.get("topk_group", 1),
                     group_score=v.get("how", "top2sum"), scale=v.get("scale", 1.0))
    probs, idx, w = rule(logits, p)
    assert idx.shape == (T, k) and w.shape == (T, k) and w.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(T))
    for t in range(T):
        want_idx, want_w = reference(rule.name, logits[t].tolist(), k, None if bias is None else bias.tolist(),
                                     p.n_group, p.topk_group, p.group_score, p.scale)
        assert idx[t].tolist() == want_idx
        torch.testing.assert_close(w[t], torch.tensor(want_w), rtol=1e-5, atol=1e-6)
    # weights_for an arbitrary set is the same formula on that set (here: the set reversed)
    torch.testing.assert_close(rule.weights(logits, idx.flip(-1), p), w.flip(-1))


def test_sparsemixer_matches_hand_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 8, generator=gen)
    p = rules.Params(top_k=2, jitter_eps=0.1)
    _, idx, w = rules.SPARSEMIXER(logits, p)
    for t in range(32):
        want_idx, want_w = reference("sparsemixer", logits[t].tolist(), 2, eps=0.1)
        assert idx[t].tolist() == want_idx
        torch.testing.assert_close(w[t], torch.tensor(want_w), rtol=1e-5, atol=1e-6)
    assert (w.sum(-1) - 1).abs().max() > 1e-3  # the threshold bites: multipliers do not sum to one


def test_renorm_variants():
    """``/ (sum + eps)`` (LFM2) and ``/ clamp(sum, norm_min)`` (ERNIE) against the closed form."""
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    s = torch.sigmoid(logits)
    idx = rules.SIGMOID_TOPK.select(logits, rules.Params(top_k=2))
    chosen = s.gather(-1, idx)
    got = rules.SIGMOID_TOPK_RENORM.weights(logits, idx, rules.Params(top_k=2, renorm_eps=0.5))
    torch.testing.assert_close(got, chosen / (chosen.sum(-1, keepdim=True) + 0.5))
    got = rules.SIGMOID_TOPK_RENORM.weights(logits, idx, rules.Params(top_k=2, norm_min=5.0))
    torch.testing.assert_close(got, chosen / 5.0)


def test_weights_normalised_with_shared_logits():
    """``Params.shared`` (Inkling): logits [T, n + s], the last s the shared experts'; selection and π over the n
    routed only; w_j = sigmoid(l_j) / (sum of the chosen's sigmoids + sum of the shared's) x scale, per token in
    plain floats; identification recovers s, and without the shared columns no rule reproduces the weights."""
    gen = torch.Generator().manual_seed(9)
    T, n, s, k = 32, 8, 2, 2
    logits = torch.randn(T, n + s, generator=gen)
    bias = torch.randn(n, generator=gen) * 0.3
    p = rules.Params(top_k=k, bias=bias, scale=3.0, shared=s)
    probs, idx, w = rules.SIGMOID_TOPK_RENORM(logits, p)
    assert probs.shape == (T, n) and idx.max() < n
    torch.testing.assert_close(probs.sum(-1), torch.ones(T))
    for t in range(T):
        x = logits[t].tolist()
        rank = [_sigmoid(x[e]) + float(bias[e]) for e in range(n)]
        want_idx = sorted(range(n), key=lambda e: -rank[e])[:k]
        denom = sum(_sigmoid(x[e]) for e in want_idx) + sum(_sigmoid(v) for v in x[n:])
        assert idx[t].tolist() == want_idx
        torch.testing.assert_close(w[t], torch.tensor([_sigmoid(x[e]) / denom * 3.0 for e in want_idx]),
                                   rtol=1e-5, atol=1e-6)
    mask = torch.tensor([[True, False]] * T)  # a chosen set of one: only its own and the shared mass
    one = rules.SIGMOID_TOPK_RENORM.weights(logits, idx, p, mask)
    sg = torch.sigmoid(logits)
    torch.testing.assert_close(one[:, 0], sg.gather(-1, idx[:, :1])[:, 0] /
                               (sg.gather(-1, idx[:, :1])[:, 0] + sg[:, n:].sum(-1)) * 3.0)
    assert (one[:, 1] == 0).all()
    # the model's own formulation: softmax over logsigmoid of the chosen and the shared logits
    lp = torch.nn.functional.logsigmoid(torch.cat([logits[:, :n].gather(-1, idx), logits[:, n:]], -1))
    model_w = torch.exp(lp - torch.logsumexp(lp, -1, keepdim=True))[:, :k] * 3.0
    torch.testing.assert_close(w, model_w)
    cands = [rules.Params(top_k=k, bias=b, scale=3.0, shared=s) for b in (bias, None)]
    got, gp = rules.identify(logits, idx, model_w, cands)
    assert got is rules.SIGMOID_TOPK_RENORM and gp.shared == s
    with pytest.raises(rules.NoRuleMatches):
        rules.identify(logits[:, :n], idx, model_w, [rules.Params(top_k=k, bias=bias, scale=3.0)])
    torch.testing.assert_close(w, model_w, rtol=0, atol=0)  # computed as the model does: bit for bit
    with pytest.raises(MoetoolError, match="renormalised sigmoid"):
        rules.SOFTMAX_TOPK.weights(logits, idx, p)


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.name)
def test_identify_recovers_each_rule(rule):
    """A router computed by a rule (with bias, groups, scale) is identified as that rule and variant, or as one
    mathematically the same (top-K -> softmax == softmax -> top-K -> renorm without a bias)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(256, 8, generator=gen)
    bias = torch.randn(8, generator=gen) * 0.3
    sparse = rule.weight == "sparsemixer"
    truth = rules.Params(top_k=2, bias=None if sparse else bias, n_group=1 if sparse else 2, topk_group=1,
                         scale=1.0 if sparse else 2.0, jitter_eps=0.1 if sparse else None)
    _, idx, w = rule(logits, truth)
    cands = [rules.Params(top_k=2, bias=b, n_group=g, topk_group=1, group_score=gs, scale=s, jitter_eps=j)
             for b in (bias, None) for g, gs in ((2, "top2sum"), (2, "max"), (1, "top2sum")) for s in (2.0, 1.0)
             for j in (None, 0.1)]
    got, p = rules.identify(logits, idx, w, cands)
    assert got is rule
    assert (p.bias is None) == (truth.bias is None) and p.n_group == truth.n_group and p.scale == truth.scale


def test_identify_reports_what_did_not_match():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    p = rules.Params(top_k=2)
    _, idx, w = rules.SOFTMAX_TOPK(logits, p)
    with pytest.raises(rules.NoRuleMatches, match=r"indices matched softmax-topk, weights differ by"):
        rules.identify(logits, idx, w ** 2, [p])
    with pytest.raises(rules.NoRuleMatches, match=r"indices match no rule \(closest: .*, same top-2 set on"):
        rules.identify(logits, idx.flip(0), w, [p])


# ----- identification on real routers --------------------------------------------------------------------
class SquaredSoftmaxRouter(nn.Module):
    """A router outside the catalogue: weights = softmax(logits)^2 of the top-K."""

    def __init__(self, weight: torch.Tensor, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.top_k = top_k

    def forward(self, h):
        logits = nn.functional.linear(h.reshape(-1, h.shape[-1]), self.weight)
        w, idx = torch.softmax(logits, -1).topk(self.top_k, -1)
        return logits, w ** 2, idx


def test_unknown_rule_is_one_line_error(tiny_model):
    model = tiny_model("mixtral")
    block = model.model.layers[0].mlp
    saved = block.gate
    block.gate = SquaredSoftmaxRouter(saved.weight, 2)
    try:
        with pytest.raises(MoetoolError) as err:
            GenericAdapter().layers(model)
    finally:
        block.gate = saved
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("mixtral: router output matches no known routing rule")
    assert "indices matched softmax-topk" in msg and "weights differ by" in msg


def test_future_family_needs_no_registry_line(tiny_model, monkeypatch):
    """A model type nobody registered, with a known rule: the generic adapter takes it, routes exactly."""
    model = tiny_model("qwen3_moe")
    monkeypatch.setattr(model.config, "model_type", "qwen9_moe")
    check_config(model.config)
    assert isinstance(get_adapter(model.config), GenericAdapter)
    layers = find_moe_layers(model)
    ref = [L.index for L in find_moe_layers(model) if True]
    assert ref and all(isinstance(L, GenericLayer) for L in layers)
    assert {L.describe()["rule"] for L in layers} == {"softmax-topk-renorm"}  # its tiny config renormalises
    batch = padded_batch(seq=8)
    with torch.no_grad():
        want = model(**batch).logits
    got, events, _ = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    for L in layers:
        ev = events[L.index]
        idx, w = L.route(L.logits(ev.h))
        assert torch.equal(idx.sort(-1).values, ev.idx.sort(-1).values)
        torch.testing.assert_close(w.gather(-1, idx.argsort(-1)), ev.weights.gather(-1, ev.idx.argsort(-1)))


def test_unsupported_and_dense_configs():
    from transformers import JetMoeConfig, LlamaConfig

    from moetool.adapters import discovery

    from transformers import DiffusionGemmaConfig

    assert "jetmoe" not in discovery.UNSUPPORTED  # supported (its MLP MoE): its config passes
    check_config(JetMoeConfig())
    with pytest.raises(MoetoolError, match="unsupported MoE family 'diffusion_gemma'.*Why not diffusion_gemma: "):
        check_config(DiffusionGemmaConfig())  # refused on purpose (issue 26)
    with pytest.raises(MoetoolError, match="no MoE layers found in llama"):
        check_config(LlamaConfig())


@pytest.mark.parametrize("model_type", ["glm4_moe", "inkling_text", "jetmoe", "muse_spark"])
def test_meta_device_model_identifies_the_same_rule(model_type):
    """``inspect`` builds models on the meta device: the rule is identified on a materialised copy (hand
    adapters with views and the shared-logit router too)."""
    from moetool.adapters import discovery

    config = discovery.tiny_config(model_type)
    with torch.device("meta"):
        model = discovery.model_class(model_type).from_config(config)
    layers = find_moe_layers(model)
    assert layers and {L.describe()["rule"] for L in layers} == {EXPECTED_RULE[model_type]}


# ----- the same answer on every device (issue 37.4) ---------------------------------------------------------------
def _split_k(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``h @ w.T (+ b)`` in fp32 summed as two halves of ``d`` then added: what a split-K GEMM (cuBLAS on a GPU)
    computes -- the same value up to the order of the sum."""
    d = h.shape[-1] // 2
    out = F.linear(h[..., :d].float(), w[:, :d].float()) + F.linear(h[..., d:].float(), w[:, d:].float())
    return out if b is None else out + b.float()


@pytest.mark.parametrize("model_type", ["olmoe", "mixtral", "granitemoe", "dots1", "glm4_moe", "kolibri1", "phimoe"])
def test_a_router_summing_in_another_order_identifies_the_same_rule(model_type, monkeypatch):
    """By substitution for a GPU's kernels: transformers' own ``F.linear`` (the routers' projection, and everything
    the router derives from its logits) sums in another order, so its logits are no longer bit-equal to any logits
    mode of moetool's; the rule identified is the same, with the same parameters. Logits off by 0.1% are refused."""
    from moetool.adapters.generic import LOGITS_MODES, identify_layer, linear_logits, router_linear

    from moetool.adapters.tiny import build_tiny

    L = find_moe_layers(build_tiny(model_type, seed=0))[0]  # the per-rule models of tests/test_commands_per_rule.py
    want_rule, want_params, _, _ = identify_layer(L)
    lin = router_linear(L.router)
    w, b = lin.weight, getattr(lin, "bias", None)
    h = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
    assert not any(torch.equal(_split_k(h, w, b), linear_logits(h, w, b, m)) for m in LOGITS_MODES)  # really differs
    plain = F.linear

    def transformers_linear(scale):
        def linear(x, weight, bias=None):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            model_code = caller.startswith("transformers.") or caller == "torch.nn.modules.linear"  # nn.Linear routers
            return _split_k(x, weight, bias).to(x.dtype) * scale if model_code else plain(x, weight, bias)
        return linear

    monkeypatch.setattr(F, "linear", transformers_linear(1.0))
    rule, params, mode, _ = identify_layer(L)
    assert rule.name == want_rule.name == EXPECTED_RULE[model_type] and mode in LOGITS_MODES
    assert params.describe() == want_params.describe()
    monkeypatch.setattr(F, "linear", transformers_linear(1.001))
    with pytest.raises(MoetoolError, match="not a linear map of its input"):
        identify_layer(L)


def test_mm_fp32_mode_is_the_fp32_product_off_cuda():
    """``mm->fp32`` (Kolibri1's CUDA router: a GEMM in the input dtype with fp32 output) is, where that kernel does
    not exist, the fp32 product of the same operands: bf16 inputs give the exact products, summed in fp32."""
    from moetool.adapters.generic import linear_logits

    gen = torch.Generator().manual_seed(1)
    h, w = (torch.randn(s, generator=gen).bfloat16() for s in ((16, 32), (8, 32)))
    got = linear_logits(h, w, None, "mm->fp32")
    assert got.dtype == torch.float32
    assert torch.equal(got, F.linear(h.float(), w.float()))
    torch.testing.assert_close(got.double(), h.double() @ w.double().T, rtol=1e-6, atol=1e-6)
