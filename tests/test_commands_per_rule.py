"""Every experiment command runs on a tiny model of each routing rule of the catalogue (``rules.RULES``).

One installed family per rule: its tiny random model (``moetool.adapters.tiny.build_tiny``: the family's own config class,
shrunk; routers re-drawn) is saved with ``save_pretrained`` beside the embedded model's tokenizer, loaded back
by the CLI as ``--model <dir>``, and each command's tables are checked against the same model run by plain
transformers here (no moetool engine): the experts module of every MoE layer is called as
``experts(h, top_k_index, top_k_weights)`` in all these families, so a pre-hook on it gives the model's own
choice and weights. DeepSeek-V4's first layers are hash-routed (experts by token id, weighted by its
``sqrtsoftplus`` rule): commands that recompute the routing from the logits (margin, mass-recall, approx,
offload, topk, prune, super-experts' ablation) refuse them in one line (checked) and run with ``--layers`` on its
top-K layer; the others cover every layer. ``topk-sigmoid-renorm`` has no family using it by default: Kolibri's ``norm_topk_prob=True``
(a config option of the installed family) is that rule, so it is tested on Kolibri with the option set.

Figures are built but not rendered (``RunDir.save_figure`` closes them): rendering PNG/PDF is rule-independent,
covered by the commands' own tests, and would triple this file's time.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEVICE, FP32_ATOL, FP32_RTOL, ON_CUDA, feed
from test_erc import hand_alpha_min
from test_ppl import hand_ppl
from test_rules import EXPECTED_RULE
from typer.testing import CliRunner

from moetool.adapters import find_moe_layers, rules, tiny
from moetool.adapters.generic import hash_table, random_table
from moetool.commands.app import app
from moetool.errors import MoetoolError
from moetool.experiments.registry import EXPERIMENTS
from moetool.policies.attention import softmax_attention
from moetool.loading import EMBEDDED_DIR

pytestmark = pytest.mark.slow  # tiers: pytest -m 'not slow'
XDIST_GROUP_BY = "case"  # one xdist worker per rule: its model fixture made once (conftest)

#: rule -> (model type, config overrides); the type's routers implement that rule (tests/test_rules.py)
CASES: dict[str, tuple[str, dict]] = {
    "softmax-topk": ("olmoe", {}),
    "softmax-topk-renorm": ("mixtral", {}),
    "topk-softmax": ("granitemoe", {}),
    "sigmoid-topk": ("dots1", {}),
    "sigmoid-topk-renorm": ("glm4_moe", {}),  # first decoder layer dense: MoE layers 1..3
    "topk-sigmoid": ("kolibri1", {}),
    "topk-sigmoid-renorm": ("kolibri1", {"norm_topk_prob": True}),  # no installed family's default
    "sparsemixer": ("phimoe", {}),
    "sqrtsoftplus-topk-renorm": ("deepseek_v4", {}),  # layers 0-2 hash-routed (experts by token id), layer 3 top-K
}
#: structure -> (model type, config overrides): families whose rule is in CASES but whose block differs (issue 26's
#: widenings of the adapter contract), every command on one model each
STRUCTURES: dict[str, tuple[str, dict]] = {
    "block-routed": ("dbrx", {}),  # the router returns logits only; DbrxFFN.route_tokens_to_experts routes
    "zero-computation": ("longcat_flash", {}),  # 8 routed + 2 identity experts (output = input)
    "carried-state": ("zaya", {}),  # router logits from h and the previous layer's router state; a skip class
    "product-key": ("doge", {}),  # k^2 product-key logits mixing the batch's tokens; single-neuron experts; dense MLP
    "seq2seq": ("switch_transformers", {}),  # encoder-decoder: both stacks' MoE layers; top-1 with expert capacity
    "post-step": ("axk1", {}),  # a norm after routed + shared (MoELayer.post_step)
    "output-scale": ("beam", {}),  # routed_scaling_factor on the block (MoELayer.output_scale)
    "shared-logits": ("inkling_text", {}),  # weights normalised with the shared experts' logits
    "dispatch-views": ("jetmoe", {}),  # a dispatch-tuple router and grouped experts, through views
    "projected-width": ("muse_spark", {}),  # router and experts in a projected width (a vision-language family)
}
SEQ_LEN, MAX_TOKENS, BATCH = 32, 200, 8  # 7 packed rows: one batch, here and in the commands
SMALL = ["--seq-len", str(SEQ_LEN), "--max-tokens", str(MAX_TOKENS), "--batch-size", str(BATCH), "-q"]
runner = CliRunner()


def test_every_rule_of_the_catalogue_has_a_case():
    assert set(CASES) == {r.name for r in rules.RULES}
    for rule, (mt, overrides) in CASES.items():
        assert overrides or EXPECTED_RULE[mt] == rule
    assert set(EXPECTED_RULE.values()) <= set(CASES)
    for structure, (mt, _) in STRUCTURES.items():  # a structure case runs a family the catalogue's cases do not
        assert mt not in {m for m, _ in CASES.values()} and EXPECTED_RULE[mt] in CASES, structure


#: experiments with no test here, and why (every other experiment of the registry must have ``test_<function>``)
NOT_PER_RULE = {"eval": "lm-eval tasks: tests/test_eval.py (norm-select runs the same harness here)",
                "plan": "reads the config only: tests/test_plan.py"}




@dataclass
class Case:
    rule: str
    path: Path  # the saved tiny model
    perturbed: Path  # the same with every router re-drawn a little (fluctuation's second checkpoint)
    tokens: object  # TokenSet the commands see
    layers: list[int]  # MoE layer indices
    n_experts: int
    top_k: int
    routing: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (idx, w) [real tokens, K], the model's own
    routing_perturbed: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ppl: float
    scored: int  # next-token pairs the perplexity averages over
    logit_layers: list[int]  # the MoE layers whose routing can be recomputed from other inputs (all but hash-routed
    # ones and those with a carried router state)
    n_zero_compute: int  # zero-computation experts (the last indices), 0 for most families
    structure: str  # the CASES / STRUCTURES key
    routed_layers: list[int]  # the MoE layers routed from their logits (all but hash-routed ones): policies run there
    attention: bool  # every MoE layer has token-to-token attention probabilities (policies.attention.softmax_attention)

    @property
    def layer_args(self) -> list[str]:
        """``--layers`` for commands that recompute the routing from the logits (none when every layer is)."""
        if not self.logit_layers or self.logit_layers == self.layers:  # none: such commands refuse (Doge)
            return []
        return ["--layers", ",".join(map(str, self.logit_layers))]

    @property
    def route_args(self) -> list[str]:
        """``--layers`` for commands that route from the events' logits (policies): every layer but hash-routed ones
        (Doge's logits depend on the whole batch: they are the events', so policies run on every layer)."""
        if self.structure == "carried-state":  # zaya: the layers whose logits are the input's alone (layer 0)
            return self.layer_args
        if self.routed_layers == self.layers:
            return []
        return ["--layers", ",".join(map(str, self.routed_layers))]

    @property
    def policy_layers(self) -> list[int]:
        return self.logit_layers if self.structure == "carried-state" else self.routed_layers


def plain_seq2seq_run(path: Path, tokens, dtype: torch.dtype | None = None
                      ) -> tuple[object, dict[int, tuple[torch.Tensor, torch.Tensor]], float]:
    """Switch Transformers by plain transformers: the rows as source and labels (``labels`` = the rows, padding
    -100: transformers builds the decoder input itself); each sparse MLP's dispatch (encoder block ``i`` = layer
    ``i``, decoder block ``j`` = ``n_encoder + j``: the adapter's numbering) and the model's own loss."""
    from transformers import AutoModelForSeq2SeqLM

    model = (AutoModelForSeq2SeqLM.from_pretrained(path).float() if dtype is None else
             AutoModelForSeq2SeqLM.from_pretrained(path, dtype=dtype)).eval().to(DEVICE)
    got, handles = {}, []
    n_enc = len(model.encoder.block)
    for offset, blocks in ((0, model.encoder.block), (n_enc, model.decoder.block)):
        for j, blk in enumerate(blocks):
            if blk.layer[-1].is_sparse:
                handles.append(blk.layer[-1].mlp.experts.register_forward_pre_hook(
                    lambda m, args, i=offset + j: got.__setitem__(i, (args[1].detach().cpu(),
                                                                       args[2].detach().float().cpu()))))
    ids, mask = tokens.input_ids.to(DEVICE), tokens.attention_mask.to(DEVICE)
    with torch.no_grad():
        loss = float(model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss)
    for h in handles:
        h.remove()
    real = mask.reshape(-1).bool().cpu()
    for i, (dispatch, w) in got.items():  # [T, 1, n] one-hot (no capacity drop at these lengths), [T, 1]
        assert dispatch.shape[0] == real.shape[0] and (dispatch.sum(-1) == 1).all()
        got[i] = (dispatch.argmax(-1)[real], w[real])
    return model, got, math.exp(loss)


def plain_run(path: Path, tokens, dtype: torch.dtype | None = None, attn: str | None = None
              ) -> tuple[object, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Plain transformers forward of ``tokens`` (one batch) on the suite's device (where the CLI's ``--device auto``
    runs the commands: CUDA's fp32/bf16 sums are not the CPU's); each MoE layer's experts-module inputs (on the CPU).
    ``dtype``: the model as transformers loads it in that dtype (default: fp32); ``attn``: its attention
    implementation (default: transformers' choice, SDPA where the family has it)."""
    from transformers import AutoConfig

    from moetool.loading import auto_model_class

    config = AutoConfig.from_pretrained(path)
    if config.is_encoder_decoder:
        return plain_seq2seq_run(path, tokens, dtype)[:2]
    cls = auto_model_class(config)  # causal LM, or a vision-language family's image-text-to-text class
    kw = {"attn_implementation": attn} if attn else {}
    model = (cls.from_pretrained(path, **kw).float() if dtype is None else
             cls.from_pretrained(path, dtype=dtype, **kw)).eval()
    model.to(DEVICE)
    got, handles = {}, []
    for L in find_moe_layers(model):  # (only to locate the experts modules)
        handles.append(L.experts.register_forward_pre_hook(
            lambda m, args, i=L.index: got.__setitem__(i, (args[1].detach().cpu(), args[2].detach().float().cpu()))))
    with torch.no_grad():
        feed(model, tokens.input_ids, tokens.attention_mask)
    for h in handles:
        h.remove()
    real = tokens.attention_mask.reshape(-1).bool()
    for i, (idx, w) in got.items():
        assert idx.shape[0] == real.shape[0]
        got[i] = (idx[real], w[real])
    return model, got


@pytest.fixture(scope="module", autouse=True)
def no_rendering():
    import matplotlib.pyplot as plt

    from moetool.report.rundir import RunDir

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunDir, "save_figure", lambda self, fig, name: plt.close(fig) or [])
        yield


@pytest.fixture(scope="module", params=[*CASES, *STRUCTURES], ids=[*CASES, *STRUCTURES])
def case(request, tmp_path_factory) -> Case:
    from transformers import AutoTokenizer

    from moetool.data import load_tokens

    mt, overrides = CASES.get(request.param) or STRUCTURES[request.param]
    rule = request.param if request.param in CASES else EXPECTED_RULE[mt]
    root = tmp_path_factory.mktemp(request.param)
    model = tiny.build_tiny(mt, seed=0)
    model.resize_token_embeddings(2048)  # the embedded tokenizer's vocabulary
    gen = torch.Generator().manual_seed(3)
    for L in find_moe_layers(model):  # a hash router's token table follows the vocabulary
        table = hash_table(L.router)
        if table is not None:
            L.router.tid2eid = random_table((2048, table.shape[1]), L.n_experts, gen)
    cfg = model.config.get_text_config(decoder=True)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    path, perturbed = root / "model", root / "perturbed"
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for L in find_moe_layers(model):
            for t in L.router.parameters():
                t.add_(torch.randn(t.shape, generator=gen) * tiny.ROUTER_STD)
    model.save_pretrained(perturbed)
    for p in (path, perturbed):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(EMBEDDED_DIR / "tiny" / f, p / f)

    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    tokens = load_tokens(None, tok, SEQ_LEN, MAX_TOKENS)
    assert tokens.input_ids.shape[0] <= BATCH and tokens.n_tokens == MAX_TOKENS
    ref, routing = plain_run(path, tokens)
    layers = find_moe_layers(ref)
    assert {L.describe()["rule"].removeprefix("hash:") for L in layers} == {rule}  # the saved model routes so
    if ref.config.is_encoder_decoder:  # the model's own seq2seq loss over every real target token (one batch)
        ppl, scored = plain_seq2seq_run(path, tokens)[2], int(tokens.attention_mask.sum())
    else:
        ppl, scored = hand_ppl(ref, tokens, BATCH)
    _, routing_perturbed = plain_run(perturbed, tokens)
    return Case(rule, path, perturbed, tokens, [L.index for L in layers], layers[0].n_experts, layers[0].top_k,
                routing, routing_perturbed, ppl, scored,
                [L.index for L in layers if not getattr(L, "hash_routed", False) and not L.carried_state],
                layers[0].n_zero_compute, request.param,
                [L.index for L in layers if not getattr(L, "hash_routed", False)], attention_probabilities(layers))


def attention_probabilities(layers) -> bool:
    """Whether every MoE layer of the saved model (read off the fixture's own plain-transformers load: the same
    class and config as a second load) has token-to-token attention probabilities, else attention routing is refused."""
    try:
        [softmax_attention(L) for L in layers]
    except MoetoolError:
        return False
    return True


def invoke(*args: str) -> None:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output


def finite(df: pd.DataFrame) -> bool:
    """Every numeric value finite (interval columns are empty with --bootstrap 0, and lm-eval's stderr for a
    perplexity: left out)."""
    num = df.select_dtypes("number").drop(columns=[c for c in df if c.endswith(("_lo", "_hi")) or c == "stderr"])
    return bool(np.isfinite(num.to_numpy(dtype=float)).all())


def near_tie(w: torch.Tensor) -> torch.Tensor:
    """``[T]``: the two largest of each token's K weights within CUDA's run-to-run noise of each other (they can
    be ordered either way): 1e-4 relative, about the fp32 rounding of Doge's product-key sums accumulated in a
    different order (the H100 showed one such token of 200 at 1e-6)."""
    top2 = w.float().topk(min(2, w.shape[-1]), dim=-1).values
    return (top2[:, 0] - top2[:, -1]).abs() <= 1e-4 * top2[:, 0].abs() + FP32_ATOL if w.shape[-1] > 1 else \
        torch.zeros(w.shape[0], dtype=torch.bool)


def sorted_choice(idx: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    order = idx.argsort(dim=-1)
    return idx.gather(-1, order).numpy(), w.gather(-1, order).numpy()


def test_stats(case, tmp_path):
    invoke("stats", "--model", str(case.path), *SMALL, "--bootstrap", "0", "--out", str(tmp_path))
    per_layer, load = pd.read_csv(tmp_path / "layers.csv"), pd.read_csv(tmp_path / "load.csv")
    assert list(per_layer["layer"]) == case.layers and finite(per_layer) and finite(load)
    assert (per_layer["tokens"] == case.tokens.n_tokens).all() and (per_layer["top_k"] == case.top_k).all()
    identity = case.n_experts - case.n_zero_compute  # the first zero-computation expert (none: n)
    assert ("zero_compute_fraction" in per_layer) == (case.n_zero_compute > 0)
    for layer in case.layers:  # tokens per expert == the model's own choices, counted by hand
        idx = case.routing[layer][0]
        want = torch.bincount(idx.reshape(-1), minlength=case.n_experts).numpy()
        got = load[load.layer == layer].sort_values("expert")
        assert list(got["tokens"]) == list(want), layer
        np.testing.assert_allclose(got["load_fraction"], want / idx.numel(), rtol=1e-9)
        if case.n_zero_compute:  # the share of routed assignments taking the zero-computation route
            row = per_layer.set_index("layer").loc[layer]
            assert row["zero_compute_fraction"] == pytest.approx(float((idx >= identity).double().mean()), abs=1e-12)


def test_placement(case, tmp_path):
    """Expert loads == the model's own choices counted by hand (tokens * K per layer); the contiguous and
    round-robin GPU loads summed by hand from them; EPLB's imbalance from the hand loads."""
    import json

    from moetool.experiments.placement.compute import gpu_loads, imbalance, rebalance_experts

    n, K, G = case.n_experts - case.n_zero_compute, case.top_k, 2  # zero-computation experts are not placed
    invoke("placement", "--model", str(case.path), *SMALL, "--gpus", str(G), "--extra-slots", "0,1",
           "--out", str(tmp_path))
    df, load = pd.read_csv(tmp_path / "placement.csv"), pd.read_csv(tmp_path / "placement_loads.csv")
    assert finite(df) and sorted(df["layer"].unique()) == case.layers
    groups = json.loads((tmp_path / "manifest.json").read_text())["groups"]  # the routing's n_group, else 1
    for layer in case.layers:
        every = torch.bincount(case.routing[layer][0].reshape(-1), minlength=case.n_experts).double()
        want = every[:n]
        got = load[load.layer == layer].sort_values("expert")
        assert list(got["load"]) == want.tolist() and every.sum() == case.tokens.n_tokens * K, layer
        rows = df[df.layer == layer].set_index(["method", "replicas"])
        for method, gpu_of in (("contiguous", lambda e: e * G // n), ("round_robin", lambda e: e % G)):
            per_gpu = [float(want[[e for e in range(n) if gpu_of(e) == g]].sum()) for g in range(G)]
            assert rows.loc[(method, 0), "imbalance"] == pytest.approx(max(per_gpu) * G / sum(per_gpu), rel=1e-12)
        for R in (0, G):
            phy2log, _, count = rebalance_experts(want[None], n + R, groups, 1, G)
            assert rows.loc[("eplb", R), "imbalance"] == pytest.approx(
                float(imbalance(gpu_loads(want[None], phy2log, count, G))), rel=1e-12)
            assert rows.loc[("eplb", R), "imbalance"] >= 1


def test_trace(case, tmp_path):
    invoke("trace", "--model", str(case.path), *SMALL, "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "trace.csv.gz")
    assert len(df) == case.tokens.n_tokens * len(case.layers)
    K = case.top_k
    for layer in case.layers:
        got = df[df.layer == layer].sort_values(["row", "pos"])
        g_idx, g_w = sorted_choice(torch.tensor(got[[f"expert_{k + 1}" for k in range(K)]].to_numpy()),
                                   torch.tensor(got[[f"weight_{k + 1}" for k in range(K)]].to_numpy()))
        w_idx, w_w = sorted_choice(*case.routing[layer])
        assert (g_idx == w_idx).all(), layer
        np.testing.assert_allclose(g_w, w_w, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_ppl(case, tmp_path):
    invoke("ppl", "--model", str(case.path), *SMALL, "--routing", "router", "--bootstrap", "0",
           "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "ppl.csv")
    assert len(df) == 1 and df.loc[0, "scored_tokens"] == case.scored
    assert df.loc[0, "perplexity"] == pytest.approx(case.ppl, rel=1e-6)


def test_norm_select(case, tmp_path):
    invoke("norm-select", "--model", str(case.path), *SMALL, "--bootstrap", "0", "--out", str(tmp_path))
    agree, quality = pd.read_csv(tmp_path / "agreement.csv"), pd.read_csv(tmp_path / "quality.csv")
    assert finite(agree) and finite(quality) and len(agree.policy.unique()) > 1
    for policy, rows in agree.groupby("policy"):
        assert list(rows["layer"]) == case.layers, policy
        assert rows[["topk_overlap", "top1_agree"]].stack().between(0, 1).all()
    router = agree[agree.policy == "router"]
    assert (router["topk_overlap"] == 1).all() and (router["top1_agree"] == 1).all()
    q = quality.set_index("policy")
    assert q.loc["router", "value"] == pytest.approx(case.ppl, rel=1e-6)
    assert (quality["value"] > 1).all()


def refused(case, tmp_path, *args: str, match: str) -> bool:
    """Where the case's router has no matrix over the layer input (Zaya, Doge) or its logits depend on more than the
    layer input: the command refuses in one line."""
    if case.structure not in ("carried-state", "product-key"):
        return False
    r = runner.invoke(app, [args[0], "--model", str(case.path), *args[1:], "--out", str(tmp_path)])
    assert r.exit_code != 0 and match in r.output and len(r.output.strip().splitlines()) == 1, r.output
    return True


def test_erc(case, tmp_path):
    if refused(case, tmp_path, "erc", "-q", match="not a matrix R [n, d]"):
        return
    invoke("erc", "--model", str(case.path), "--noise", "none", "--samples", "1", "-q", "--out", str(tmp_path))
    per_layer, matrix = pd.read_csv(tmp_path / "erc_layers.csv"), pd.read_csv(tmp_path / "erc_matrix.csv")
    assert list(per_layer["layer"]) == case.layers and finite(per_layer) and finite(matrix)
    for layer in case.layers:  # alpha_min is the closed form of the written matrix
        M = matrix[matrix.layer == layer].pivot(index="i", columns="j", values="m").to_numpy()
        m = case.n_experts - case.n_zero_compute  # the computed experts: identity experts have no weights
        assert M.shape == (m, m) and (M >= 0).all()
        got = per_layer.set_index("layer").loc[layer, "alpha_min"]
        assert got == pytest.approx(hand_alpha_min(torch.tensor(M)), rel=1e-5)


def test_approx(case, tmp_path):
    invoke("approx", "--model", str(case.path), *SMALL, *case.route_args, "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "approx.csv")
    assert finite(df)
    for layer in case.policy_layers:
        rows = df[df.layer == layer].set_index("selector")
        assert set(rows.index) == {"router", "norm_oracle", "best_subset", "random"}  # C(8, 2) subsets: exhaustive
        assert (rows["tokens"] == case.tokens.n_tokens).all() and rows.loc["router", "same_set_as_router"] == 1
        err = rows["rel_error_mean"]
        assert (err >= 0).all() and err["best_subset"] <= err.min() + 1e-6  # per-token argmin: the smallest mean


def test_mass_recall(case, tmp_path):
    if case.structure == "product-key":
        assert refused(case, tmp_path, "mass-recall", *SMALL, match="also depend on")
        return
    # Zaya's router is no matrix over the layer input: the unit centroids are refused, the raw ones run (layer 0)
    raw = ["--centroids", "raw"] if case.structure == "carried-state" else []
    if raw:
        assert refused(case, tmp_path, "mass-recall", *SMALL, *case.layer_args, match="not a matrix R [n, d]")
    n = str(case.n_experts)
    invoke("mass-recall", "--model", str(case.path), *SMALL, *case.layer_args, *raw, "--bootstrap", "0", "-G", "4",
           "-M", f"1,4,{n}", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "mass_recall.csv")
    assert finite(df) and sorted(df.layer.unique()) == case.logit_layers
    assert (df["tokens"] == case.tokens.n_tokens).all()
    everything = df[df.shortlist_size == case.n_experts]  # a shortlist of all experts recalls everything
    assert len(everything) and np.allclose(everything["mass_recall_mean"], 1) and (everything["topk_recall"] == 1).all()
    for _, rows in df.groupby(["layer", "codebook_size", "centroids"]):
        assert rows.sort_values("shortlist_size")["mass_recall_mean"].is_monotonic_increasing


def test_fluctuation(case, tmp_path):
    same, other = str(case.path), str(case.perturbed)
    # attention routing where every MoE layer has token-to-token attention probabilities (else refused); otherwise
    # similarity, which ranks by π: not on hash-routed layers (DeepSeek-V4's first), refused there
    routing = [] if case.attention else ["--routing", "router,similarity"]
    layers = case.routed_layers if routing else case.layers
    only = ["--layers", ",".join(map(str, layers))] if layers != case.layers else []
    invoke("fluctuation", same, same, other, "--reference", "previous", *SMALL, *routing, *only, "--bootstrap", "0",
           "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "fluctuation.csv")
    df = df[df.routing == "router"]
    assert finite(df) and (df["tokens"] == case.tokens.n_tokens).all()
    # on CUDA two forwards of Doge's product-key router may differ in the last bits (its logits mix the batch's
    # tokens, summed in another order): a token near a tie at the K-th expert may take either set, which the top-K
    # weights cannot show -- the H100 showed 1 token of 200 -- so 1% of the tokens there; on the CPU: exact
    pk = 0.01 if ON_CUDA and case.structure == "product-key" else 0.0
    unchanged = df[df.checkpoint == same]
    assert list(unchanged["layer"]) == layers
    assert (unchanged[["top1_change", "topk_change"]] <= pk).all().all() and \
        (unchanged["topk_overlap"] >= 1 - pk).all()
    changed = df[df.checkpoint == other].set_index("layer")
    assert list(changed.index) == layers
    K = case.top_k
    before, after = case.routing, case.routing_perturbed
    if not routing and (ON_CUDA or case.structure == "product-key"):
        # attention routing asked: the command's forwards run in eager attention (the only one that gives the
        # probabilities); on CUDA SDPA's kernels sum otherwise, which moved 5 of 200 of Doge's top-1 on an H100
        before, after = (plain_run(p, case.tokens, attn="eager")[1] for p in (case.path, case.perturbed))
    for layer in layers:  # by hand from the two models' own choices
        (a, wa), (b, wb) = before[layer], after[layer]
        inter = np.array([len(set(x) & set(y)) for x, y in zip(a.tolist(), b.tolist())])
        # the top-1 is the routing decision, the chosen expert ranked first by the selection scores: these routers
        # hand the experts their top-K in that order (torch.topk, sorted; sparsemixer's first round first), so the
        # first column -- not the largest weight (a per-expert output scale, unbiased sigmoid weights, sparsemixer's
        # weights order them otherwise)
        top1 = a[:, :1] != b[:, :1]
        row = changed.loc[layer]
        assert row["topk_change"] == pytest.approx((inter < K).mean(), abs=1e-9 + pk)
        assert row["topk_overlap"] == pytest.approx(inter.mean() / K, abs=1e-9 + pk)
        # a token whose two largest weights are within CUDA's noise may take either top-1; on the CPU: exact
        slack = float((near_tie(wa) | near_tie(wb)).double().mean()) if ON_CUDA else 0.0
        assert row["top1_change"] == pytest.approx(top1.numpy().mean(), abs=1e-9 + slack + pk)
    assert changed["topk_change"].max() > 0
    assert not math.isnan(changed["entropy_ratio"].mean())


def test_offload(case, tmp_path):
    K, n = case.top_k, case.n_experts
    if case.n_zero_compute:  # no weights to load or cache (LongCat-Flash's identity experts, Zaya's skip class):
        # refused first, whatever --layers (so never a refusal offering --layers that this refusal stops)
        r = runner.invoke(app, ["offload", "--model", str(case.path), *SMALL, *case.layer_args, "--out", str(tmp_path)])
        assert r.exit_code == 2 and "zero-computation (identity) experts" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
        return
    if refused(case, tmp_path, "offload", *SMALL, match="also depend on"):  # prediction needs layer 0's successors
        return
    if case.rule == "sqrtsoftplus-topk-renorm":  # DeepSeek-V4: hyper-connected residual streams (hc_mult per token)
        r = runner.invoke(app, ["offload", "--model", str(case.path), *SMALL, *case.layer_args, "--out", str(tmp_path)])
        assert r.exit_code != 0 and "residual streams per token" in r.output, r.output
        return
    invoke("offload", "--model", str(case.path), *SMALL, *case.layer_args, "--bootstrap", "0", "--capacity",
           f"{K},{n}", "--out", str(tmp_path))
    lay = pd.read_csv(tmp_path / "offload_layers.csv").set_index("layer")
    cache = pd.read_csv(tmp_path / "offload_cache.csv")
    assert list(lay.index) == case.logit_layers and finite(cache)
    T = case.tokens.n_tokens
    for layer in case.logit_layers:  # by hand from the model's own choices, tokens in data order
        sets = [set(row) for row in case.routing[layer][0].tolist()]
        counts = np.bincount(case.routing[layer][0].reshape(-1).numpy(), minlength=n)
        assert lay.loc[layer, "experts_used"] == (counts > 0).sum()
        assert lay.loc[layer, "hottest_share"] == pytest.approx(counts.max() / (T * K))
        rows = cache[cache.layer == layer]
        assert (rows["requests"] == T * K).all()
        # capacity K: after each token the cache holds exactly its K experts, whatever the policy
        assert (rows[rows.capacity == K]["hits"] == sum(len(a & b) for a, b in zip(sets[1:], sets))).all()
        # capacity n: only first requests miss
        assert (rows[rows.capacity == n]["hits"] == T * K - (counts > 0).sum()).all()


def test_topk(case, tmp_path):
    K, n = case.top_k, case.n_experts
    sparse = case.rule == "sparsemixer"  # its weights are defined for its own K rounds only (refused otherwise)
    invoke("topk", "--model", str(case.path), *SMALL, *case.route_args, "--bootstrap", "0",
           "--ks", str(K) if sparse or K == 1 else f"1,{K}", "--ps", "none" if sparse else "1", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "topk.csv").set_index("policy")
    assert df.loc["router", "perplexity"] == pytest.approx(case.ppl, rel=1e-6)
    assert df.loc[f"topk:{K}", "perplexity"] == df.loc["router", "perplexity"]  # the model's own routing
    m = n - case.n_zero_compute  # zero-computation experts cost nothing: not counted as experts used
    computed = [float((case.routing[i][0] < m).sum(-1).double().mean()) for i in case.policy_layers]
    assert df.loc[f"topk:{K}", "mean_experts"] == pytest.approx(np.mean(computed), abs=1e-12)
    if case.n_zero_compute and not sparse:  # the top-1 may be a zero-computation expert; top-p 1 holds all n
        assert 0 < df.loc["topk:1", "mean_experts"] <= 1 and df.loc["topp:1", "mean_experts"] == m
    elif not sparse:
        # over the layers the policy ran in (--layers: DeepSeek-V4's hash-routed layers run the model's own K)
        assert df.loc["topk:1", "mean_experts"] == 1 and df.loc["topp:1", "mean_experts"] == n
        per_layer = pd.read_csv(tmp_path / "topk_layers.csv").set_index(["policy", "layer"])["mean_experts"]
        assert [per_layer.loc[("topk:1", i)] for i in case.layers] == [1 if i in case.policy_layers else K
                                                                       for i in case.layers]
        assert finite(df.drop(columns=["kind"]))


def test_margin(case, tmp_path):
    if not case.logit_layers:  # Doge: no layer's routing is a function of its own input (refused: the last test)
        pytest.skip("no MoE layer's routing can be recomputed from its input alone")
    invoke("margin", "--model", str(case.path), *SMALL, *case.layer_args, "--bootstrap", "100", "--eps", "0,0.05",
           "--thresholds", "0.01,0.1", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "margin.csv").set_index("layer")
    fl = pd.read_csv(tmp_path / "margin_flips.csv")
    bins = pd.read_csv(tmp_path / "margin_bins.csv")
    real = int(case.tokens.attention_mask.sum())
    assert sorted(df.index) == case.logit_layers and (df["tokens"] == real).all()
    assert (df[["margin_mean", "margin_p05", "margin_p50", "margin_p95"]] >= 0).all().all()
    assert (df["margin_p05"] <= df["margin_p50"]).all() and (df["margin_p50"] <= df["margin_p95"]).all()
    assert (df["frac_below_0.01"] <= df["frac_below_0.1"]).all()
    zero = fl[fl.eps == 0]
    assert len(zero) == len(case.logit_layers)
    assert (zero[["topk_flip", "topk_flip_lo", "topk_flip_hi", "top1_flip"]] == 0).all().all()
    assert fl[["topk_flip", "top1_flip"]].stack().between(0, 1).all()
    # the bins split the layer's real tokens; their flips add up to the layer's
    for (layer, eps), g in bins.groupby(["layer", "eps"]):
        assert g["tokens"].sum() == real
        row = fl[(fl.layer == layer) & (fl.eps == eps)].iloc[0]
        assert (g["topk_flip"].fillna(0) * g["tokens"]).sum() == pytest.approx(row["topk_flip"] * real)
        below = g[g.margin_hi <= 0.01]["tokens"].sum()
        assert below == round(df.loc[layer, "frac_below_0.01"] * real)


def test_agreement(case, tmp_path):
    invoke("agreement", "--model", str(case.path), *SMALL, "--bootstrap", "100", "--precisions", "bf16,fp32,fp8",
           "--thresholds", "0.01,0.1", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "agreement.csv").set_index(["precision", "layer"])
    s = pd.read_csv(tmp_path / "agreement_summary.csv").set_index("precision")
    bins = pd.read_csv(tmp_path / "agreement_bins.csv")
    real = int(case.tokens.attention_mask.sum())
    assert sorted(s.index) == ["bf16", "fp8"] and (s["reference"] == "fp32").all() and s.loc["fp8", "simulated"]
    assert set(df.index.get_level_values("layer")) == set(case.layers) and (df["tokens"] == real).all()
    assert finite(df.drop(columns=["reference"])) and finite(s.drop(columns=["reference"]))
    assert df[["top1_flip", "topk_flip"]].stack().between(0, 1).all() and (df["margin_mean"] >= 0).all()
    # bf16 top-K sets against the model loaded in bf16 by plain transformers, compared with the fp32 routing
    _, bf16 = plain_run(case.path, case.tokens, torch.bfloat16)
    for i in case.layers:
        ref, mine = case.routing[i][0], bf16[i][0]
        flips = int((ref.sort(-1).values != mine.sort(-1).values).any(-1).sum())
        assert round(df.loc[("bf16", i), "topk_flip"] * real) == flips, i
        for p in ("bf16", "fp8"):  # the margin bins split the layer's real tokens; their flips add up
            g = bins[(bins.layer == i) & (bins.precision == p)]
            assert g["tokens"].sum() == real
            assert (g["topk_flip"].fillna(0) * g["tokens"]).sum() == pytest.approx(df.loc[(p, i), "topk_flip"] * real)


def test_capacity(case, tmp_path):
    K, n = case.top_k, case.n_experts
    m = n - case.n_zero_compute  # zero-computation experts take no capacity: C over the m computed, never dropped
    big = n / K  # every expert can take every real token: nothing dropped
    invoke("capacity", "--model", str(case.path), *SMALL, "--bootstrap", "0", "--cf", f"0.5,{big!r}",
           "--order", "order,score", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "capacity.csv").set_index(["cf", "order"])
    lay = pd.read_csv(tmp_path / "capacity_layers.csv")
    exp = pd.read_csv(tmp_path / "capacity_experts.csv")
    assert finite(df.reset_index().drop(columns=["order"])) and finite(lay.drop(columns=["order"]))
    T = case.tokens.n_tokens  # one batch: C = ceil(cf * T * K / m)
    for order in ("order", "score"):
        assert df.loc[(big, order), "dropped"] == 0
        assert df.loc[(big, order), "perplexity"] == pytest.approx(case.ppl, rel=1e-6)  # the model's own routing
        assert df.loc[(0.5, order), "router_perplexity"] == pytest.approx(case.ppl, rel=1e-6)
        first = exp[(exp.cf == 0.5) & (exp.order == order) & (exp.layer == case.layers[0])].sort_values("expert")
        load = torch.bincount(case.routing[case.layers[0]][0].reshape(-1), minlength=n).numpy()[:m]
        cap = math.ceil(0.5 * T * K / m)
        assert list(first["load"]) == list(load) and (first["capacity"] == cap).all()
        assert list(first["dropped"]) == list(np.maximum(load - cap, 0))  # the first layer: by hand
        rows = lay[(lay.cf == 0.5) & (lay.order == order)]
        assert list(rows["layer"]) == case.layers and (rows["tokens"] == T).all()
    idx = case.routing[case.layers[0]][0]  # token order: an expert keeps the first C real tokens routed to it
    seen, lost = {}, 0
    for row in idx.tolist():
        kept = []
        for e in row:
            seen[e] = seen.get(e, 0) + 1
            kept.append(e >= m or seen[e] <= math.ceil(0.5 * T * K / m))
        lost += not any(kept)
    got = lay[(lay.cf == 0.5) & (lay.order == "order") & (lay.layer == case.layers[0])]
    assert int(got["tokens_dropped_all"].iloc[0]) == lost


def test_prune(case, tmp_path):
    """Importance against the model's own routing counted by hand; removing nothing is the model exactly; a
    quarter of the experts removed by REAP and at random: finite."""
    invoke("prune", "--model", str(case.path), *SMALL, *case.route_args, "--bootstrap", "0", "--fractions", "0,0.25",
           "--criteria", "reap,random", "--ablate", "1", "--out", str(tmp_path))
    df = pd.read_csv(tmp_path / "prune.csv").set_index(["criterion", "fraction"])
    assert df.loc[("router", 0.0), "perplexity"] == pytest.approx(case.ppl, rel=1e-6)
    assert df.loc[("reap", 0.0), "perplexity"] == df.loc[("router", 0.0), "perplexity"]
    m = case.n_experts - case.n_zero_compute  # zero-computation experts: not measured, counted or removed
    assert df.loc[("reap", 0.25), "removed"] == len(case.policy_layers) * (m // 4)
    assert finite(df)
    imp = pd.read_csv(tmp_path / "prune_importance.csv")
    assert finite(imp) and (imp["reap"] >= 0).all()
    for layer in case.policy_layers:
        idx, w = case.routing[layer]
        got = imp[imp.layer == layer].sort_values("expert")
        assert list(got["frequency"]) == torch.bincount(idx.reshape(-1), minlength=case.n_experts).tolist()[:m]
        want = torch.zeros(case.n_experts, dtype=torch.float64).index_add_(0, idx.reshape(-1),
                                                                           w.double().reshape(-1))[:m]
        np.testing.assert_allclose(got["weighted"], want.numpy(), rtol=1e-5)
    abl = pd.read_csv(tmp_path / "prune_ablation.csv")
    assert len(abl) == 1 and abl["reap"].iloc[0] == imp["reap"].max()


def test_super_experts(case, tmp_path):
    """Routed counts against the model's own routing by hand; the super flags by the criterion over the maxima;
    nothing removed is the model's perplexity; the super and random ablations remove as many experts, finite."""
    from moetool.experiments.super_experts.compute import super_mask

    invoke("super-experts", "--model", str(case.path), *SMALL, *case.route_args, "--bootstrap", "0", "--include-layers",
           "1", "--out", str(tmp_path))  # every layer (the default, the paper's code's, profiles the first 75%)
    table = pd.read_csv(tmp_path / "super_experts.csv")
    assert finite(table) and (table["max_abs_output"] >= 0).all() and sorted(set(table.layer)) == case.policy_layers
    for layer in case.policy_layers:
        got = table[table.layer == layer].sort_values("expert")
        m = case.n_experts - case.n_zero_compute  # zero-computation experts have no down projection: not listed
        want = torch.bincount(case.routing[layer][0].reshape(-1), minlength=case.n_experts)[:m]
        assert list(got["expert"]) == list(range(m)) and list(got["routed"]) == want.tolist()
        assert ((got["max_abs_output"] > 0) == (want > 0).numpy()).all()
    assert list(table["is_super"]) == list(super_mask(table["max_abs_output"])[0])
    abl = pd.read_csv(tmp_path / "super_experts_ablation.csv").set_index("ablation")
    assert abl.loc["none", "perplexity"] == pytest.approx(case.ppl, rel=1e-6)
    assert abl.loc["super", "removed"] == abl.loc["random", "removed"] == int(table["is_super"].sum())
    assert np.isfinite(abl[["perplexity", "ratio"]].to_numpy()).all()


def test_hash_and_carried_state_layers_are_refused_in_one_line(case, tmp_path):
    """Where the routing must be recomputed from the logits, hash-routed layers are refused before any work, in one
    line naming them and the layers to choose instead (the other commands above ran on every layer). offload
    recomputes the routing of the layers it predicts only: never the first decoder layer's (none ahead of it)."""
    if case.logit_layers == case.layers:
        pytest.skip("every layer's routing can be recomputed from its input")
    others = [i for i in case.layers if i not in case.logit_layers]
    if case.structure == "carried-state":  # the logits need the carried state: policies (on the events) still run
        commands = (["margin"], ["mass-recall"], ["offload"])
        says = "the router logits of MoE layers {} also depend on the previous layer's router state"
    elif case.structure == "product-key":  # the logits of a token depend on the batch's other tokens (Doge)
        commands = (["margin"], ["mass-recall"], ["offload"])
        says = "the router logits of MoE layers {} also depend on the other tokens of the batch"
    else:
        commands = (["margin"], ["mass-recall"], ["approx"], ["offload"], ["topk", "--ks", "1"],
                    ["prune", "--fractions", "0.25", "--criteria", "random"])
        says = "MoE layers {} are hash-routed"
    if case.n_zero_compute:  # offload refuses the model's zero-computation experts first (test_offload)
        commands = tuple(c for c in commands if c[0] != "offload")
    config = json.loads((case.path / "config.json").read_text())
    streams = (config.get("text_config") or config).get("hc_mult") or 1  # hyper-connections: offload predicts none
    for args in commands:
        # offload predicts the layers with a decoder layer ahead (all but 0): from one hidden state (hc_mult 1) only
        bad = [i for i in case.layers if i != 0 and (i in others or streams > 1)] if args[0] == "offload" else others
        assert bad, (args, others)
        ok = [i for i in case.layers if i not in bad]
        r = runner.invoke(app, [args[0], "--model", str(case.path), *args[1:], *SMALL, "--out", str(tmp_path / args[0])])
        assert r.exit_code != 0, (args, r.output)
        assert says.format([i for i in bad if i in others]) in r.output, (args, r.output)
        assert ("--layers " + ",".join(map(str, ok)) if ok else "no other layer is left") in r.output
        assert re.findall(r"--layers ([\d,]+)", r.output) == ([",".join(map(str, ok))] if ok else []), r.output
        assert not (tmp_path / args[0] / "manifest.json").exists()
        if ok and args[0] in ("offload", "mass-recall"):  # what its refusal offers runs (mass-recall on Zaya: the
            # raw centroids alone, its router being no matrix over the layer input)
            extra = re.findall(r"--centroids \w+", r.output)[-1:]  # the suggested mode (the last named)
            r = runner.invoke(app, [args[0], "--model", str(case.path), *args[1:], *SMALL, "--layers",
                                    ",".join(map(str, ok)), *" ".join(extra).split(),
                                    "--out", str(tmp_path / f"{args[0]}-ok")])
            assert r.exit_code == 0, (args, r.output)


#: experiments of the registry with no ``test_<function>`` above: the generic check below runs them on every case
GENERIC = [name for name, spec in EXPERIMENTS.items() if name not in NOT_PER_RULE and f"test_{spec.function}"
           not in globals()]


@pytest.mark.parametrize("name", GENERIC)
def test_every_other_experiment_runs_or_refuses_in_one_line(name, case, tmp_path):
    """An experiment with no check of its own here (its numbers are checked by its own test file on the embedded
    model): on every routing rule and structure it either writes tables whose numbers are all finite and whose
    ``layer`` column holds exactly the MoE layers it ran on (no inf; an undefined value is an empty cell, never a
    whole column of them), or refuses in one line before writing anything -- and
    then runs on the layers whose routing can be recomputed from their input (``--layers``), if any."""
    spec = EXPERIMENTS[name]
    small = [*SMALL, *spec.sample]
    r = runner.invoke(app, [name, "--model", str(case.path), *small, "--out", str(tmp_path / "all")])
    layers = case.layers
    if r.exit_code != 0:
        assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("error: "), r.output
        assert not (tmp_path / "all" / "manifest.json").exists()
        if not case.layer_args:
            return
        layers = case.logit_layers
        r = runner.invoke(app, [name, "--model", str(case.path), *small, *case.layer_args, "--out", str(tmp_path / "some")])
        assert r.exit_code == 0, r.output
    out = tmp_path / ("all" if layers is case.layers else "some")
    tables = {p.name: pd.read_csv(p) for p in sorted(out.glob("*.csv"))}
    assert tables, f"{name} wrote no table"
    for file, df in tables.items():  # empty cells (undefined values, as the definitions say) but never inf
        num = df.select_dtypes("number").to_numpy(dtype=float)
        assert not np.isinf(num).any() and (~np.isnan(num)).any(axis=0).all(), f"{file}: inf or an empty column"
        if "layer" in df:
            assert sorted(set(df["layer"])) == sorted(layers), file


class ForwardReached(BaseException):
    """Raised where a command's first forward of the model would begin (not an ``Exception``: no handler turns it into
    a refusal): the refusals before any forward, without the forwards' cost."""


def stop_at_forward(mp: pytest.MonkeyPatch) -> None:
    """Every call of a whole model (a ``PreTrainedModel``) raises :class:`ForwardReached`."""
    from transformers import PreTrainedModel

    call = torch.nn.Module.__call__

    def guarded(self, *args, **kwargs):
        if isinstance(self, PreTrainedModel):
            raise ForwardReached
        return call(self, *args, **kwargs)

    mp.setattr(torch.nn.Module, "__call__", guarded)


#: a flag (and its value, when the next word is one) a refusal's line names
SUGGESTED_FLAG = re.compile(r"(--[a-z][a-z0-9-]*)(?: ((?!--)[\w.:,-]*\w))?")


def suggestions(line: str) -> list[list[str]]:
    """The invocations a refusal's line offers: its last clause (after the last ': '), split at ', or ', each
    alternative's flags with their values (``choose the others with --layers 0,3`` -> ``[["--layers", "0,3"]]``);
    ``[]`` where it offers none (``no other layer is left``)."""
    out = []
    for alt in line.rsplit(": ", 1)[-1].split(", or "):
        flags = [w for flag, value in SUGGESTED_FLAG.findall(alt) for w in (flag, value) if w]
        if flags:
            out.append(flags)
    return out


def with_flags(args: list[str], flags: list[str]) -> list[str]:
    """``args`` with each flag of ``flags`` set to its value there (replaced where ``args`` gives it, else added)."""
    args = list(args)
    i = 0
    while i < len(flags):
        flag, value = flags[i], flags[i + 1:i + 2]
        value = value if value and not value[0].startswith("--") else []
        if flag in args:
            j = args.index(flag)
            del args[j:j + 1 + (j + 1 < len(args) and not args[j + 1].startswith("-"))]
        args += [flag, *value]
        i += 1 + len(value)
    return args


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n not in NOT_PER_RULE])
def test_every_refusal_that_suggests_flags_suggests_something_that_runs(name, case, tmp_path):
    """A command run with its defaults (its spec's sample flags) on every rule and structure: where it refuses before
    any forward and its line suggests flags (``choose the others with --layers 0,3``, ``--no-predict-norm``), each
    suggested invocation runs to its end (forwards included): never another refusal of the same run. A line that
    suggests nothing (``no other layer is left``) is not checked here."""
    spec = EXPERIMENTS[name]
    model = ([str(case.path), str(case.path), str(case.perturbed), "--reference", "previous"]
             if name == "fluctuation" else ["--model", str(case.path)])
    small = SMALL if {"tokens", "checkpoints"} & set(spec.inputs) else ["-q"]  # erc reads weights only
    args = [name, *model, *small, *spec.sample]
    with pytest.MonkeyPatch.context() as mp:
        stop_at_forward(mp)
        try:
            r = runner.invoke(app, [*args, "--out", str(tmp_path / "first")])
        except ForwardReached:  # (the runner passes on what is no Exception)
            return
    if r.exit_code == 0:
        return
    assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
    for k, flags in enumerate(suggestions(r.output.strip())):
        again = runner.invoke(app, [*with_flags(args, flags), "--out", str(tmp_path / f"suggested{k}")])
        assert again.exit_code == 0, (r.output, flags, again.output)
