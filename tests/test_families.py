"""Every MoE model type of the installed transformers: supported (and checked here) or listed with its reason.

The types are discovered at test time (``moetool.adapters.discovery``), so a transformers upgrade that adds a
family fails here until it is supported or listed in ``UNSUPPORTED``. Each supported type gets a tiny random
model from its own config class (shrunk generically, routers re-drawn so top-K has no ties) and the checks the
hand-written families pass in test_adapters.py / test_engine.py:

* the ``router`` policy through the override path reproduces the unhooked logits bit for bit (padded batch);
* the captured top-K is ``route(logits(h))`` of the adapter;
* batched node norms equal a loop over the experts, one expert at a time, through the model's own experts module;
* an override really runs: the experts' output is Σ w E(h) for the policy's choice;
* padding never counts (events mark it invalid).
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE, ON_CUDA, padded_batch, run
from test_engine import assert_same_routing
from test_rules import EXPECTED_RULE

from moetool import ops
from moetool.adapters import discovery, find_moe_layers
from moetool.adapters.generic import hash_table
from moetool.adapters.tiny import build_tiny
from moetool.engine import node_scores
from moetool.errors import MoetoolError
from moetool.engine.runner import is_seq2seq, seq2seq_inputs
from moetool.policies import make_policy

SEED = 0
SUPPORTED = discovery.supported_types()


def test_every_discovered_type_is_accounted_for():
    """The discovery finds the families the issue names, and UNSUPPORTED lists only discovered types."""
    found = set(discovery.moe_model_types())
    for mt in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_5_moe", "llama4", "jamba",
               "dbrx", "jetmoe", "longcat_flash", "switch_transformers"):
        assert mt in found
    assert "llama" not in found and "qwen3" not in found and "mistral" not in found  # dense
    stale = set(discovery.UNSUPPORTED) - found
    assert not stale, f"UNSUPPORTED lists types transformers no longer has: {sorted(stale)}"
    assert all(isinstance(r, str) and len(r) > 20 for r in discovery.UNSUPPORTED.values())


@functools.lru_cache(maxsize=None)
def tiny(model_type: str):
    """The tiny model of ``model_type`` (routers re-drawn, seeded) and its MoE layers."""
    model = build_tiny(model_type, seed=SEED)
    return model, find_moe_layers(model)


@functools.lru_cache(maxsize=None)
def captured(model_type: str):
    model, layers = tiny(model_type)
    _, events, _ = run(model, layers, model_inputs(model, padded_batch(seq=8)))
    return model, layers, events


def model_inputs(model, batch: dict) -> dict:
    """The forward's inputs: an encoder-decoder's decoder reads the same rows (moetool's seq2seq forward)."""
    if not is_seq2seq(model):
        return batch
    return {**batch, **seq2seq_inputs(model, batch["input_ids"], batch["attention_mask"])}


def one_expert(L, e: int, h: torch.Tensor) -> torch.Tensor:
    """``E_e(h)`` through the model's own experts module (every token sent to expert ``e`` with weight 1)."""
    idx = torch.full((h.shape[0], 1), e, dtype=torch.long)
    w = torch.ones(h.shape[0], 1, dtype=h.dtype)
    if hasattr(L.experts, "identity_expert"):  # LongCat's experts module cannot take K = 1 (it squeezes the K axis): e twice, weights 1 and 0
        idx, w = idx.expand(-1, 2), torch.cat((w, torch.zeros_like(w)), dim=-1)
    with torch.no_grad():
        return L.experts(h, idx, w)


def moe_by_loop(L, h, idx, w) -> torch.Tensor:
    outs = torch.stack([one_expert(L, e, h) for e in range(L.n_experts)])  # [n, T, d]
    T = torch.arange(h.shape[0])
    return sum(w[:, k:k + 1].to(h.dtype) * outs[idx[:, k], T] for k in range(idx.shape[1]))


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_family(model_type):
    model, layers = tiny(model_type)
    batch = model_inputs(model, padded_batch(seq=8))
    assert layers, f"{model_type}: no MoE layer in the tiny model"
    with torch.no_grad():
        want = model(**batch).logits
    assert want.isfinite().all()

    # 1. the router policy through the override path: the unhooked logits bit for bit
    got, events, eng = run(model, layers, batch, policy=make_policy("router"))
    assert torch.equal(got, want)
    assert eng.reported == {L.index: 1 for L in layers}
    mask = batch["attention_mask"].reshape(-1).bool()
    for ev in events.values():  # 5. padding is marked, so it never counts
        assert torch.equal(ev.valid, mask)

    # the routing rule identified on the router is the one its modeling code implements (tests/test_rules.py)
    assert model_type in EXPECTED_RULE, f"{model_type}: add its rule to tests/test_rules.py EXPECTED_RULE"
    assert {L.describe()["rule"].removeprefix("hash:") for L in layers} == {EXPECTED_RULE[model_type]}

    # 2. the captured top-K is the adapter's route(logits(h))
    _, _, events = captured(model_type)
    for L in layers:
        ev = events[L.index]
        logits = L.logits(ev.h, **ev.inputs)  # Zaya: the carried router state too
        assert torch.equal(logits, ev.logits)
        assert torch.equal(L.logits(ev.h.double(), **ev.inputs), logits)  # any input dtype: mass-recall passes fp64 points
        if getattr(L, "hash_routed", False):  # experts by token id: the table's rows, weighted by the rule
            with pytest.raises(MoetoolError, match="hash-routed"):
                L.route(logits)
            idx = hash_table(L.router)[padded_batch(seq=8)["input_ids"].reshape(-1)]
            w = L.weights_for(logits, idx)
        else:
            idx, w = L.route(logits)
        assert_same_routing(idx, w, ev.idx, ev.weights, rtol=1e-6, atol=1e-7)
        p = L.probs(logits)
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]))
        assert L.top_k < L.n_experts

    # the block is routed experts + shared experts (families without one expose None)
    for L in layers:
        if L.block is L.decoder_layer:
            continue
        ev = events[L.index]
        h = ev.h
        with torch.no_grad():
            ids = {"input_ids": padded_batch(seq=8)["input_ids"]} if getattr(L, "hash_routed", False) else {}
            state = [s.unsqueeze(0) for s in ev.inputs.values()]  # Zaya: the carried router state
            out = L.block(h.unsqueeze(0), *state, **ids)
            out = (out[0] if isinstance(out, tuple) else out).reshape(h.shape)
            routed = L.experts(h, ev.idx, ev.weights) * L.output_scale  # set where the block scales it
            expected = routed + (L.shared_experts(h) if L.shared_experts is not None else 0)
            if L.post_step() is not None:  # a step after the sum (axk1: post_mlp_layernorm)
                expected = L.post_step()(expected)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(L.block_output(L.experts(h, ev.idx, ev.weights), h), out, rtol=1e-5, atol=1e-5)

    # 3. batched node norms == a loop over the experts through the model's own module
    L = layers[0]
    h = events[L.index].h
    outs = torch.stack([one_expert(L, e, h) for e in range(L.n_experts)])  # [n, T, d]
    torch.testing.assert_close(node_scores(L, h, "output", "l2"), outs.norm(dim=-1).T, rtol=1e-5, atol=1e-5)
    W, x = L.expert_weights(), L.expert_input(h)  # what the experts compute on (gemma4: a normed copy of h)
    glu = torch.stack([torch.linalg.vector_norm(
        L.glu(torch.nn.functional.linear(x, W.gate[e], None if W.gate_bias is None else W.gate_bias[e]),
              torch.nn.functional.linear(x, W.up[e], None if W.up_bias is None else W.up_bias[e])), dim=-1)
        for e in range(L.n_experts - L.n_zero_compute)]).T
    if L.n_zero_compute:  # zero-computation experts: activations = the input itself (LongCat), 0 (Zaya's skip)
        own = x.norm(dim=-1, keepdim=True) if L.zero_compute_output == "input" else torch.zeros(x.shape[0], 1)
        glu = torch.cat((glu, own.expand(-1, L.n_zero_compute)), dim=-1)
    torch.testing.assert_close(node_scores(L, h, "glu", "l2"), glu, rtol=1e-5, atol=1e-5)

    # 4. an override really runs: the experts' actual output is Σ w E(h) for the policy's choice
    outs_by_layer: dict[int, torch.Tensor] = {}
    _, events, _ = run(model, layers, batch, policy=make_policy("random", seed=0), experts_out=outs_by_layer)
    differs = 0
    for L in layers:
        ev = events[L.index]
        assert ev.chosen_idx.shape == (ev.h.shape[0], L.top_k)
        torch.testing.assert_close(outs_by_layer[L.index], moe_by_loop(L, ev.h, ev.chosen_idx, ev.chosen_weights),
                                   rtol=1e-5, atol=1e-5)
        differs += int((~ops.same_set(ev.chosen_idx, ev.idx))[ev.valid].sum())
    assert differs > 0


#: the token mixers of a decoder layer, by attribute name (attention, linear attention, Mamba, short convolution,
#: Qwen4-Exp's per-layer embeddings; Switch's and DBRX's attentions inside their sublayers)
MIXERS = ("self_attn", "self_attention", "linear_attn", "mamba", "conv", "ple", "SelfAttention", "EncDecAttention",
          "attn")
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_pre_router_norm_of_the_stream_is_the_router_input(model_type):
    """Invariant, the one offload's next-layer prediction rests on: with every token mixer's output zeroed, the
    stream entering a decoder layer's MoE sublayer is the stream entering the decoder layer (pre-hook), and
    ``pre_router_norm`` of it is the router input ``h`` of the layer's events -- every norm weight moved off its init
    so that two norms are told apart, and Muse Spark's residual gates off theirs (per channel, a norm does not undo
    them). Or the layer is refused in one line (its MoE block reads no norm of one stream: hyper-connections,
    Inkling-2's block attention residuals). Before: AFMoE, Jamba, LFM2-MoE, Nemotron-H, Cohere2-MoE had no or the
    wrong norm, FlexOlmo's post-norm was applied, Qwen4-Exp had none, Muse Spark's gate and MiniMax's normed
    residual were left out."""
    model = build_tiny(model_type, seed=SEED)
    layers = find_moe_layers(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name and name.endswith("weight")) or name.endswith("residual_gate.gate"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    checked, refused, streams, handles = [], [], {}, []

    def zero(module, args, out):
        return torch.zeros_like(out) if torch.is_tensor(out) else (torch.zeros_like(out[0]), *out[1:])

    for L in layers:
        try:
            norm = L.pre_router_norm
        except MoetoolError as e:
            assert "\n" not in str(e) and f"layer {L.index}" in str(e)
            refused.append(L.index)
            continue
        checked.append((L, norm))
        inside = {id(m) for part in (L.router, L.experts) for m in part.modules()}  # Gemma 4: the block is the layer
        handles += [m.register_forward_hook(zero) for name, m in L.decoder_layer.named_modules()
                    if id(m) not in inside and not isinstance(m, torch.nn.ModuleList) and  # LongCat: two attentions
                    any(n in MIXERS for n in name.split(".")[-2:])]

        def stream(module, args, kwargs, i=L.index):
            streams[i] = args[0] if args else kwargs["hidden_states"]
        handles.append(L.decoder_layer.register_forward_pre_hook(stream, with_kwargs=True))
    try:
        _, events, _ = run(model, layers, model_inputs(model, padded_batch(seq=8)))
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for L, norm in checked:
            h = events[L.index].h
            got = norm(streams[L.index]).reshape(h.shape)
            torch.testing.assert_close(got, h, rtol=1e-4, atol=1e-5, msg=lambda m, i=L.index: f"layer {i}: {m}")
    assert checked or refused


def test_readme_families_table_says_its_rows_are_default_configs_and_the_example_holds():
    """The families table's ``qwen3_moe`` row reads ``softmax-topk`` (transformers' default config), while
    Qwen3-30B-A3B, and the embedded ``tiny-fine`` of that type, route ``softmax-topk-renorm`` (their configs set
    ``norm_topk_prob``): a reader took the row for the family's rule. The table now says what its rows are, and the
    example it gives is checked here against ``moetool inspect`` of the shipped config."""
    from pathlib import Path

    from moetool.inspect import FAMILIES_CAVEAT, describe_model, family_row, readme_block

    root = Path(__file__).parents[1]
    block = readme_block((root / "README.md").read_text(encoding="utf-8"))
    assert block is not None and FAMILIES_CAVEAT in block.splitlines()[1]
    assert "| qwen3_moe | causal-lm | yes | softmax-topk |" in block
    assert family_row("qwen3_moe")["routing"] == "softmax-topk"
    for name in (str(root / "examples/configs/qwen3-30b-a3b"), "tiny-fine"):
        rules = {m["rule"] for m in describe_model(name)["moe_layers"]}
        assert rules == {"softmax-topk-renorm"}, (name, rules)


def test_readme_families_agree_with_the_source():
    """The README's family table is what ``moetool inspect --families`` computes (same tiny models)."""
    from pathlib import Path

    from moetool.inspect import family_row, families_markdown, readme_block

    rows = [family_row(mt, *tiny(mt)) if mt in SUPPORTED else family_row(mt) for mt in discovery.moe_model_types()]
    readme = readme_block((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8"))
    assert readme is not None, "README.md lacks the families block (python -m moetool.inspect --readme)"
    assert readme == families_markdown(rows), "README families block is stale: python -m moetool.inspect --readme"
    assert sum(r["supported"] == "yes" for r in rows) == len(SUPPORTED)


@pytest.mark.parametrize("model_type, n_layers, dense", [
    ("mixtral", 4, []),
    ("kimi_k25", 4, [0]),  # a vision-language config: num_hidden_layers in its text config; first_k_dense_replace 1
    ("nemotron_h_omni", 4, [0, 2, 3]),  # text config's hybrid pattern "ME*-": only layer 1 is MoE
    ("longcat_flash", 4, []),  # num_layers 4, each with two attention sublayers: num_hidden_layers is 8
])
def test_inspect_counts_the_decoder_layers_of_the_config(model_type, n_layers, dense):
    """``inspect``'s decoder layers and dense layers are the config's: a vision-language config (no
    num_hidden_layers at its top) was described as len(MoE layers) layers with its dense layers missing, and
    LongCat-Flash as 8 layers with 4 that do not exist listed as dense."""
    from moetool.configs import text_config
    from moetool.inspect import describe_layers

    config = discovery.tiny_config(model_type)
    text = text_config(config)
    assert (text.num_layers if model_type == "longcat_flash" else text.num_hidden_layers) == n_layers
    with torch.device("meta"):
        model = discovery.model_class(model_type).from_config(config)
    info = describe_layers(model, find_moe_layers(model))
    assert (info["num_layers"], info["dense_layers"]) == (n_layers, dense)
    assert sorted([L["layer"] for L in info["moe_layers"]] + dense) == list(range(n_layers))


def test_inspect_counts_the_configs_layers_where_no_decoder_list_is_found(monkeypatch):
    """A model whose adapter finds no list of decoder layers: their number is the config's (num_hidden_layers,
    num_layers or n_layers of the MoE layers' config), 5 here, else one past the last MoE layer's index (7 + 1)."""
    from types import SimpleNamespace

    import moetool.adapters
    from moetool.inspect import _decoder_layer_count

    monkeypatch.setattr(moetool.adapters, "get_adapter", lambda config: SimpleNamespace(decoder_layers=lambda m: []))
    model = SimpleNamespace(config=SimpleNamespace())
    for key in ("num_hidden_layers", "num_layers", "n_layers"):
        layers = [SimpleNamespace(index=i, config=SimpleNamespace(**{key: 5})) for i in (1, 3)]
        assert _decoder_layer_count(model, layers) == range(5)
    assert _decoder_layer_count(model, [SimpleNamespace(index=i, config=SimpleNamespace()) for i in (2, 7)]) == range(8)


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_inspect_on_the_meta_device_describes_the_model_as_its_weights_do(model_type):
    """``inspect --model`` and ``plan`` build the model on the meta device: every supported family's description
    there (layers, each MoE layer's rule and sizes, parameters) is the one its tiny model with real weights gives.
    gemma4 and zaya identified their routing on the router's own (meta) weights and stopped in
    ``aten::equal`` / ``Tensor.item()`` errors; they identify on a CPU copy with seeded random weights, as the
    generic layers do, in eval mode (phimoe's SparseMixer sampled in the training mode a built model starts in, and
    matched no rule). A learned multiplier the config cannot give (Inkling's ``global_scale``) is said to be
    unread, at its init 1, never a random draw (it read ``x -1.31``): compared with the model at that value."""
    import copy

    from moetool.inspect import describe_layers

    model, layers = tiny(model_type)
    with torch.device("meta"):
        meta = type(model)(model.config)
    got = describe_layers(meta, find_moe_layers(meta))
    learned = [L for L in layers if hasattr(L.router, "global_scale")]
    if learned:
        model = copy.deepcopy(model)
        layers = find_moe_layers(model)
        with torch.no_grad():
            for L in layers:
                L.router.global_scale.fill_(1.0)
        layers = find_moe_layers(model)
        for row in got["moe_layers"]:
            assert row.pop("global_scale").startswith("learned: not read from the config")
    want = describe_layers(model, layers)
    for row in want["moe_layers"]:
        assert learned or "global_scale" not in row
        row.pop("global_scale", None)
    assert got == want


def test_inspect_families_cli(monkeypatch):
    """``moetool inspect --families --json``: one row per type, supported or the reason (two types, for speed)."""
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app

    monkeypatch.setattr(discovery, "moe_model_types", lambda: ["mixtral", "nllb-moe"])
    res = CliRunner().invoke(app, ["inspect", "--families", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["model_type"]: r for r in json.loads(res.output)}
    assert rows["mixtral"]["supported"] == "yes" and rows["mixtral"]["shared_experts"] == "no"
    assert rows["mixtral"]["dense_layers"] == "none" and "Experts" in rows["mixtral"]["experts"]
    assert rows["nllb-moe"]["supported"] == "no: " + discovery.UNSUPPORTED["nllb-moe"]
    res = CliRunner().invoke(app, ["inspect", "--families"])
    assert res.exit_code == 0 and "1 supported of 2" in res.output


def test_inspect_families_piped_is_one_table_one_line_a_type(monkeypatch):
    """``moetool inspect --families > file`` (or ``| less -S``, ``| grep``) printed the 90-type table in 80-column
    parts (5 parts, 620 lines, a reason wrapped over 8 lines): piped with no COLUMNS it is one table, one line per
    type with its whole reason; COLUMNS (a terminal's width) still splits and wraps it."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    monkeypatch.setattr(discovery, "moe_model_types", lambda: ["mixtral", "nllb-moe"])
    monkeypatch.delenv("COLUMNS", raising=False)
    res = CliRunner().invoke(app, ["inspect", "--families", "--refresh"])
    assert res.exit_code == 0, res.output
    rows = [ln for ln in res.output.splitlines() if ln.startswith("│")]
    reason = "no: " + discovery.UNSUPPORTED["nllb-moe"]
    assert len(reason) > 80 and [ln.split("│")[1].strip() for ln in rows] == ["mixtral", "nllb-moe"], res.output
    assert rows[1].split("│")[3].strip() == reason and "(1/" not in res.output
    assert "\nMoE model types: 1 supported of 2" in "\n" + res.output  # the title at column 0, not centred
    narrow = CliRunner().invoke(app, ["inspect", "--families"], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0 and max(len(ln) for ln in narrow.output.splitlines()) <= 80, narrow.output
    assert len([ln for ln in narrow.output.splitlines() if ln.startswith("│")]) > 2  # the reason wraps


def test_families_answer_from_a_cache_keyed_by_the_installation(monkeypatch):
    """The table is built once (a tiny model per family: 14 s idle, minutes under load) and then read from the
    cache; a different transformers version (or adapter code) is another key and builds it again."""
    import moetool.inspect as mi

    built = []
    monkeypatch.setattr(discovery, "moe_model_types", lambda: ["mixtral", "nllb-moe"])
    monkeypatch.setattr(mi, "family_row", lambda mt: built.append(mt) or {"model_type": mt, "supported": "yes"})
    first = mi.families()
    assert built == ["mixtral", "nllb-moe"] and mi.families() == first and len(built) == 2
    key = mi.families_cache_key()
    monkeypatch.setattr(mi, "families_cache_key", lambda: {**key, "transformers": "0.0.1"})
    assert mi.families() == first and len(built) == 4  # another transformers: built again
    assert mi.families(cache=False) == first and len(built) == 6  # --refresh


def test_inspect_families_from_the_cache_imports_no_torch(tmp_path):
    """A cached table answers without torch or transformers, whole reasons and --json kept."""
    import json
    import subprocess
    import sys

    import moetool.inspect as mi

    reason = "no: " + "a long reason that a terminal of 80 columns cannot hold on one line " * 3 + "END"
    rows = [{"model_type": "mixtral", "head": "causal-lm", "supported": "yes", "routing": "softmax-topk-renorm",
             "shared_experts": "no", "dense_layers": "none", "experts": "MixtralExperts"},
            {"model_type": "zzz_moe", "head": "causal-lm", "supported": reason, "routing": "", "shared_experts": "",
             "dense_layers": "", "experts": ""}]
    cache = tmp_path / "cache"
    mi_key = mi.families_cache_key()
    digest = __import__("hashlib").sha256(json.dumps(mi_key, sort_keys=True).encode()).hexdigest()[:16]
    cache.mkdir()
    (cache / f"families-{digest}.json").write_text(json.dumps({"key": mi_key, "rows": rows}))
    code = ("import atexit, sys; atexit.register(lambda: print('heavy:', 'torch' in sys.modules or 'transformers' "
            "in sys.modules, file=sys.stderr)); from moetool.commands.app import main; "
            "sys.argv = ['moetool', 'inspect', '--families'] + sys.argv[1:]; main()")
    env = {**__import__("os").environ, "MOETOOL_CACHE_DIR": str(cache), "COLUMNS": "80"}
    for extra in ([], ["--json"]):
        r = subprocess.run([sys.executable, "-c", code, *extra], capture_output=True, text=True, timeout=120,
                           env=env)
        assert r.returncode == 0 and r.stderr.strip() == "heavy: False", r.stderr
        if extra:
            assert json.loads(r.stdout) == rows
        else:
            assert "1 supported of 2" in r.stdout
            words = " ".join(seg.split("│")[3] for seg in r.stdout.splitlines() if seg.count("│") >= 4).split()
            assert reason in " ".join(words)


@pytest.mark.parametrize("model_type", ["dbrx", "deepseek_v4"])
def test_bf16_routers_that_rank_in_bf16_are_identified(model_type):
    """DBRX's block and DeepSeek-V4's sqrtsoftplus rank in bf16 with their own order of near-ties: the rule is
    identified on the router in fp32 for the call, and the model is left bit for bit as it was."""
    model = build_tiny(model_type, seed=SEED).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = find_moe_layers(model)
    assert {L.describe()["rule"].removeprefix("hash:") for L in layers} == {EXPECTED_RULE[model_type]}
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    _, events, _ = run(model, layers, padded_batch(seq=8))
    for L in layers:  # the events are the model's own choice
        ev = events[L.index]
        assert ev.weights.dtype == torch.bfloat16 and ev.idx.shape[-1] == L.top_k


@pytest.mark.skipif(not ON_CUDA, reason="compares the GPU with the CPU (on the CPU: test_rules' substitution test)")
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_family_on_the_gpu_identifies_the_cpu_rule_and_routes_as_the_model(model_type):
    """Issue 37.4: the same rule identified on the GPU as on the CPU, and the router policy through the override
    path gives the unhooked model's logits there (to fp32 rounding: CUDA's index_add_ in the experts sums duplicates
    with atomics, in no fixed order) and the model's own top-K."""
    import copy

    model, layers = tiny(model_type)
    gpu = copy.deepcopy(model).to(DEVICE)
    gpu_layers = find_moe_layers(gpu)
    assert [L.describe()["rule"] for L in gpu_layers] == [L.describe()["rule"] for L in layers]
    batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
             for k, v in model_inputs(model, padded_batch(seq=8)).items()}
    chosen = {}
    handles = [L.experts.register_forward_pre_hook(lambda m, a, i=L.index: chosen.__setitem__(i, a[1].clone()))
               for L in gpu_layers if not hasattr(L.experts, "identity_expert")]
    with torch.no_grad():
        want = gpu(**batch).logits
    for h in handles:
        h.remove()
    got, events, _ = run(gpu, gpu_layers, batch, policy=make_policy("router"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for i, idx in chosen.items():
        if idx.dtype in (torch.int64, torch.int32) and idx.shape == events[i].idx.shape:
            assert torch.equal(idx.sort(-1).values, events[i].idx.sort(-1).values), i


def test_inspect_families_says_when_it_builds_the_table(monkeypatch):
    """A first ``moetool inspect --families`` built the table for 15 s to minutes (77 s at load 4) with nothing on
    the screen: it now says so in one line, once; a call answered from the cache, and ``--json``, print no such line."""
    import json

    from typer.testing import CliRunner

    import moetool.inspect as mi
    from moetool.commands.app import app

    built = []
    monkeypatch.setattr(discovery, "moe_model_types", lambda: ["mixtral", "nllb-moe", "olmoe"])
    monkeypatch.setattr(mi, "family_row", lambda mt: built.append(mt) or {"model_type": mt, "supported": "yes"})
    first = CliRunner().invoke(app, ["inspect", "--families"])
    assert first.exit_code == 0, first.output
    lines = [ln for ln in first.output.splitlines() if "building the families table" in ln]
    assert len(lines) == 1 and "each of 3 MoE model types" in lines[0] and len(built) == 3
    again = CliRunner().invoke(app, ["inspect", "--families"])
    assert again.exit_code == 0 and "building" not in again.output and len(built) == 3  # from the cache
    fresh = CliRunner().invoke(app, ["inspect", "--families", "--json", "--refresh"])
    assert fresh.exit_code == 0 and len(built) == 6  # rebuilt, and the output stays JSON alone
    assert [r["model_type"] for r in json.loads(fresh.output)] == ["mixtral", "nllb-moe", "olmoe"]


def test_inspect_families_counts_the_model_types_while_it_builds(monkeypatch):
    """A fresh clone's first ``moetool inspect --families`` ran 334 s at load average 10 with one line and then
    nothing until the table: a bar now counts the model types built (the last state reads 3/3 for three types);
    the cached answer and ``--json`` show none."""
    from typer.testing import CliRunner

    import moetool.inspect as mi
    from moetool.commands.app import app

    types = ["mixtral", "nllb-moe", "olmoe"]
    monkeypatch.setattr(discovery, "moe_model_types", lambda: list(types))
    monkeypatch.setattr(mi, "family_row", lambda mt: {"model_type": mt, "supported": "yes"})
    first = CliRunner().invoke(app, ["inspect", "--families", "--refresh"])
    assert first.exit_code == 0, first.output
    bars = [ln for ln in first.output.splitlines() if ln.startswith("families ")]
    assert bars and f"{len(types)}/{len(types)}" in bars[-1], first.output
    again = CliRunner().invoke(app, ["inspect", "--families"])
    assert again.exit_code == 0 and not [ln for ln in again.output.splitlines() if ln.startswith("families ")]
    fresh = CliRunner().invoke(app, ["inspect", "--families", "--json", "--refresh"])
    assert fresh.exit_code == 0 and fresh.output.lstrip().startswith("[")


def test_pre_router_norm_is_refused_only_where_no_norm_of_one_stream_feeds_the_router():
    """The invariant test above accepts a one-line refusal as an outcome, so a family whose rule was lost (Qwen4-Exp
    without its hyper-connection mixer: no norm left to name, refused; mutation pass 13) still passed. A layer is
    refused exactly where its block reads no norm of one residual stream, told from the config and the family
    alone: ``hc_mult`` > 1 residual streams per token (DeepSeek-V4, GLM-5-Next, HY-V4) or Inkling-2's block
    attention residuals; every other supported family's every MoE layer has a pre_router_norm."""
    refused, expected = {}, {}
    for model_type in SUPPORTED:
        model = build_tiny(model_type, seed=SEED)
        layers = find_moe_layers(model)
        hc = getattr(model.config.get_text_config(decoder=True), "hc_mult", None) or 1
        if hc > 1 or model_type.startswith("inkling2"):
            expected[model_type] = [L.index for L in layers]
        bad = []
        for L in layers:
            try:
                L.pre_router_norm
            except MoetoolError:
                bad.append(L.index)
        if bad:
            refused[model_type] = bad
    assert len(expected) == 8 and refused == expected


@pytest.mark.parametrize("model_type, name", [("nemotron_h", "norm"), ("cohere2_moe", "input_layernorm")])
def test_pre_router_norm_takes_a_decoder_layers_only_norm_and_refuses_to_choose_between_two(model_type, name):
    """The last rule: a decoder layer with one norm and none of the named ones (Nemotron-H's one mixer per layer,
    Cohere2-MoE's parallel block) feeds it to the router; with a second norm beside it (named like neither rule's)
    which one the block reads cannot be told: one line, never the first of them (mutation pass 13: 'len(norms) >= 1'
    took the first and passed every family test)."""
    import copy

    model = build_tiny(model_type, seed=SEED)
    L = find_moe_layers(model)[0]
    d = L.decoder_layer
    assert L.pre_router_norm is getattr(d, name)
    d.add_module("extra_norm", copy.deepcopy(getattr(d, name)))  # registered after it: named_children's last
    with pytest.raises(MoetoolError, match=rf"^layer {L.index}: cannot tell which norm of {type(d).__name__} its MoE "
                                           r"block reads$"):
        L.pre_router_norm
