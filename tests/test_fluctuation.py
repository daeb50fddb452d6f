"""fluctuation: identical checkpoints, a perturbed router against a hand computation, refusals, the CLI."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model, feed
from typer.testing import CliRunner

from moetool import ops
from moetool.adapters import ADAPTERS, find_moe_layers
from moetool.commands.app import app
from moetool.data import TokenSet
from moetool.engine import Engine
from moetool.errors import MoetoolError
from moetool.experiments.fluctuation.compute import (COLUMNS, FluctuationOptions, Routing, check_checkpoints,
                                             compare, pairs, processing_order,
                                             run_fluctuation)
from moetool.loading import load
from moetool.uncertainty import ratio_intervals

J = 2  # the perturbed layer
CHANGE = ["top1_change", "topk_change"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The tiny Mixtral saved as A, and as B with layer J's router perturbed (save_pretrained round trips)."""
    root = tmp_path_factory.mktemp("ckpts")
    model = build_tiny_model("mixtral")
    model.save_pretrained(root / "a")
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(42)
    with torch.no_grad():
        w = find_moe_layers(other)[J].router.weight
        w.add_(0.08 * torch.randn(w.shape, generator=g))
    other.save_pretrained(root / "b")
    cfg = ADAPTERS.get("mixtral").tiny_config()
    cfg.num_local_experts = 4
    cfg.save_pretrained(root / "n4")
    ADAPTERS.get("qwen3_moe").tiny_config().save_pretrained(root / "qwen")
    return {k: str(root / k) for k in ("a", "b", "n4", "qwen")}


def tokens() -> TokenSet:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1024, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 11:] = 0
    return TokenSet(ids, mask, [""] * 4, "test")


def loader(name: str):
    return load(name, attn_implementation="eager", tokenizer=False)


def test_identical_checkpoints_change_nothing(ckpts):
    opts = FluctuationOptions(isolate=True, batch_size=2)
    df, _ = run_fluctuation([ckpts["a"], ckpts["a"]], tokens(), opts, loader)
    assert list(df.columns) == COLUMNS
    assert set(df["routing"]) == {"router", "similarity", "attention", "router-isolated", "similarity-isolated",
                                  "attention-isolated"}
    assert len(df) == 6 * 4 and (df["tokens"] == 64 - 5).all()
    assert (df[CHANGE] == 0).all().all()
    assert (df[["topk_overlap", "jaccard", "entropy_ratio"]] == 1).all().all()
    assert (df["entropy_ref"] > 0).all()


def hand_change(h: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, K: int) -> dict[str, float]:
    """Top-1 / top-K change and mean entropies of softmax(h Wᵀ) for two router weights, by sorting."""
    out = {}
    pa, pb = torch.softmax(h @ wa.T, -1), torch.softmax(h @ wb.T, -1)
    sa, sb = pa.argsort(-1, descending=True), pb.argsort(-1, descending=True)
    out["top1_change"] = sum(int(x != y) for x, y in zip(sa[:, 0].tolist(), sb[:, 0].tolist())) / len(h)
    out["topk_change"] = sum(int(set(x[:K]) != set(y[:K])) for x, y in zip(sa.tolist(), sb.tolist())) / len(h)
    out["topk_overlap"] = sum(len(set(x[:K]) & set(y[:K])) / K for x, y in zip(sa.tolist(), sb.tolist())) / len(h)
    out["entropy_ref"] = float(-(pa * pa.log()).sum(-1).mean())
    out["entropy_ckpt"] = float(-(pb * pb.log()).sum(-1).mean())
    return out


def test_perturbed_router_changes_only_its_layer_and_matches_hand(ckpts):
    opts = FluctuationOptions(routing=("router",), isolate=True, batch_size=2)
    df, _ = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), opts, loader)
    assert (df["reference"] == ckpts["a"]).all() and (df["checkpoint"] == ckpts["b"]).all()
    before = df[df["layer"] < J]
    assert len(before) == 2 * J and (before[CHANGE] == 0).all().all() and (before["entropy_ratio"] == 1).all()
    # hand computation at layer J: the MoE input there is the same in both checkpoints
    a, b = loader(ckpts["a"]), loader(ckpts["b"])
    hs = []
    tk = tokens()
    with torch.no_grad(), Engine(a.model, [a.layers[J]], consumers=[lambda ev: hs.append(ev.h[ev.valid].cpu())]):
        for bt in tk.batches(2):
            feed(a.model, bt.input_ids, bt.attention_mask)
    h = torch.cat(hs).double()
    wa, wb = (m.layers[J].router.weight.detach().double().cpu() for m in (a, b))
    want = hand_change(h, wa, wb, 2)
    want["entropy_ratio"] = want["entropy_ckpt"] / want["entropy_ref"]  # ckpt / ref, not its inverse
    assert want["topk_change"] > 0  # the perturbation really moved some choices
    assert abs(want["entropy_ratio"] - 1) > 1e-4  # ... and the entropy: the ratio's direction shows
    for routing in ("router", "router-isolated"):
        row = df[(df["layer"] == J) & (df["routing"] == routing)].iloc[0]
        for k, v in want.items():
            assert row[k] == pytest.approx(v, abs=1e-6), (routing, k)
    # isolated rows after J: the same h through both routers; later routers are identical -> no change
    after = df[(df["layer"] > J) & (df["routing"] == "router-isolated")]
    assert (after[CHANGE] == 0).all().all()
    # bootstrap interval at J: the hand per-token top-K change summed per packed row, resampled by
    # uncertainty.ratio_intervals with the same replicates and seed (documents = the 4 packed rows)
    sa = torch.softmax(h @ wa.T, -1).argsort(-1, descending=True)[:, :2].sort(-1).values
    sb = torch.softmax(h @ wb.T, -1).argsort(-1, descending=True)[:, :2].sort(-1).values
    flag = (sa != sb).any(-1).double()
    row_of = torch.arange(4).repeat_interleave(16)[tk.attention_mask.reshape(-1).bool()]
    num = torch.zeros(4, dtype=torch.float64).index_add_(0, row_of, flag).numpy()
    den = torch.bincount(row_of, minlength=4).double().numpy()
    iv = ratio_intervals(num, den, n_boot=opts.bootstrap, seed=opts.seed)[0]
    row = df[(df["layer"] == J) & (df["routing"] == "router")].iloc[0]
    assert iv.value == pytest.approx(row["topk_change"], abs=1e-12)
    assert (row["topk_change_lo"], row["topk_change_hi"]) == pytest.approx((iv.lo, iv.hi), abs=1e-12)
    assert row["topk_change_lo"] < row["topk_change"] < row["topk_change_hi"]
    off, _ = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), FluctuationOptions(routing=("router",), batch_size=2,
                                                                                 bootstrap=0), loader)
    assert off["topk_change_lo"].isna().all() and (off["topk_change"] == df[df["routing"] == "router"]
                                                   ["topk_change"].to_numpy()).all()


def test_reference_modes_and_processing_order():
    assert pairs("abc", "previous") == [(0, 1), (1, 2)]
    assert pairs("abc", "first") == [(0, 1), (0, 2)]
    assert pairs("abc", "last") == [(2, 0), (2, 1)]
    for ref in ("previous", "first", "last"):
        order = processing_order(4, ref)
        assert all(order.index(c) < order.index(r) for r, c in pairs("abcd", ref))
    with pytest.raises(MoetoolError):
        pairs(["a"], "previous")
    # the help says in which order they load: a reader of `fluctuation tiny-early tiny` saw 'tiny: router' run first
    from moetool.experiments.fluctuation.spec import __doc__ as help_text
    assert processing_order(2, "previous") == processing_order(2, "first") == [1, 0]
    assert processing_order(3, "last") == [0, 1, 2]
    assert "the last given first\n(--reference last: the first given first)" in help_text


def test_three_checkpoints_reference_last(ckpts):
    """a, b, a with reference last: (a -> a) is all zeros, (a -> b) equals the two-checkpoint run."""
    opts = FluctuationOptions(routing=("router",), reference="last", batch_size=2)
    df, _ = run_fluctuation([ckpts["a"], ckpts["b"], ckpts["a"]], tokens(), opts, loader)
    same = df[df["checkpoint"] == ckpts["a"]]
    assert len(same) == 4 and (same[CHANGE] == 0).all().all()
    moved = df[(df["checkpoint"] == ckpts["b"]) & (df["layer"] == J)]
    assert float(moved["topk_change"].iloc[0]) > 0


@pytest.mark.parametrize("other,field", [("n4", "num_local_experts"), ("qwen", "model_type")])
def test_mismatched_checkpoints_refused_in_one_line(ckpts, other, field):
    with pytest.raises(MoetoolError, match=field):
        check_checkpoints([ckpts["a"], ckpts[other]])
    r = CliRunner().invoke(app, ["fluctuation", ckpts["a"], ckpts[other], "-q"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: checkpoints differ in architecture"), r.output


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A checkpoint shaped as the embedded ``tiny`` (Mixtral, 4 layers, 8 experts, top-2, its tokenizer) but 64 wide
    (tiny: 128): the same layers, experts and K, routers that take 64 features."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from moetool.loading import EMBEDDED_DIR

    root = tmp_path_factory.mktemp("narrow")
    cfg = AutoConfig.from_pretrained(EMBEDDED_DIR / "tiny")
    cfg.hidden_size, cfg.head_dim = 64, 16
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, root / f)
    return str(root)


def test_checkpoints_of_another_width_refused_in_one_line(narrow):
    """Layers, experts, K and vocabulary agree, the width does not: ``--isolate`` fed tiny's 128-wide MoE inputs to
    the 64-wide routers (exit 1, a raw RuntimeError 'mat1 and mat2 shapes cannot be multiplied', after the first
    checkpoint's forward). Refused from the configs, and for loaded models (no config check) before any forward."""
    with pytest.raises(MoetoolError, match="has hidden_size=128, .* has hidden_size=64"):
        check_checkpoints(["tiny", narrow])
    opts = FluctuationOptions(routing=("router",), isolate=True, batch_size=2)
    with pytest.raises(MoetoolError, match="hidden_size"):
        run_fluctuation(["tiny", narrow], tokens(), opts, loader)
    r = CliRunner().invoke(app, ["fluctuation", "tiny", narrow, "--isolate", "--max-tokens", "64", "-q"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines == [f"error: checkpoints differ in architecture: tiny has hidden_size=128, {narrow} has hidden_size=64"]


@pytest.fixture(scope="module")
def retokenized(tmp_path_factory):
    """The embedded ``tiny`` with two ids of its tokenizer swapped: the same architecture and weights, another
    vocabulary (text -> ids), so the same ids are other text to it."""
    import json
    import shutil

    from moetool.loading import EMBEDDED_DIR

    root = tmp_path_factory.mktemp("retok") / "tiny-retok"
    shutil.copytree(EMBEDDED_DIR / "tiny", root)
    tok = json.loads((root / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (root / "tokenizer.json").write_text(json.dumps(tok))
    return str(root)


def test_the_api_refuses_what_the_command_refuses_before_any_forward(retokenized, tmp_path):
    """``moetool.run("fluctuation", names)`` and ``moetool.fluctuation(names, tokens)`` skipped the command's check
    of the checkpoints: another tokenizer gave a table (top-1 change 0 on these ids, which are other text to it),
    and another architecture was refused only after the first checkpoint's forward, leaving a failed run folder.
    Both are the command's line now, before any weight loads or any folder exists."""
    import moetool

    retok = f"error: checkpoints differ in tokenizer: tiny and {retokenized} have different vocabularies"
    arch = "error: checkpoints differ in architecture: tiny has model_type=mixtral, tiny-fine has model_type=qwen3_moe"
    for other, line in ((retokenized, retok), ("tiny-fine", arch)):
        r = CliRunner().invoke(app, ["fluctuation", "tiny", other, "--max-tokens", "64", "-q",
                                     "--out", str(tmp_path / "cli")])
        assert r.exit_code == 2 and r.output.splitlines()[0].startswith(line), r.output
        with pytest.raises(MoetoolError) as e:
            moetool.run("fluctuation", ["tiny", other], max_tokens=64, out=tmp_path / "run", quiet=True)
        assert ("error: " + str(e.value)).startswith(line)
        assert not (tmp_path / "run").exists() and not (tmp_path / "cli").exists()
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    with pytest.raises(MoetoolError, match="checkpoints differ in tokenizer"):
        moetool.fluctuation(["tiny", retokenized], tokens, routing=("router",), bootstrap=0, quiet=True)


def test_similarity_rows_report_the_entropy_of_the_policy_scores(ckpts):
    """entropy_ref for similarity routing = mean -Σ s log s of the policy's normalised scores (layer 0, whose
    input does not depend on any routing), not the entropy of π."""
    from moetool.policies import make_policy

    opts = FluctuationOptions(routing=("similarity",), tau=40.0, batch_size=2)
    df, _ = run_fluctuation([ckpts["a"], ckpts["a"]], tokens(), opts, loader)
    a = loader(ckpts["a"])
    pol = make_policy("similarity", tau=40.0)
    ent, ent_pi = [], []
    with torch.no_grad(), Engine(a.model, [a.layers[0]], consumers=[
            lambda ev: (ent.append(pol.scores(ev)[ev.valid].double().cpu()), ent_pi.append(ev.probs[ev.valid].cpu()))]):
        for bt in tokens().batches(2):
            feed(a.model, bt.input_ids, bt.attention_mask)
    s = torch.cat(ent)
    want = float((-(s * s.clamp_min(1e-300).log()).sum(-1)).mean())
    got = float(df[df["layer"] == 0]["entropy_ref"].iloc[0])
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(got - float(ops.entropy(torch.cat(ent_pi)).mean())) > 1e-3


def test_prune_rows_report_the_entropy_of_the_pruned_router(ckpts):
    """entropy_ref under prune:random:0.5 = mean entropy of the pruned router's distribution, a softmax over the kept
    experts' logits (layer 0, whose input no routing changes), at most log(kept). It was the full model's π over all
    n experts, removed ones included: 1.33-1.82 nats on tiny-early -> tiny, above log 4 = 1.386, the largest entropy
    any routing among 4 experts can have."""
    from moetool.policies import make_policy

    opts = FluctuationOptions(routing=("prune:random:0.5",), batch_size=2, bootstrap=0)
    df, _ = run_fluctuation([ckpts["a"], ckpts["a"]], tokens(), opts, loader)
    a = loader(ckpts["a"])
    L = a.layers[0]
    removed = make_policy("prune:random:0.5").removed_in(L)
    ent = []
    with torch.no_grad(), Engine(a.model, [L], consumers=[lambda ev: ent.append(ev.logits[ev.valid].double().cpu())]):
        for bt in tokens().batches(2):
            feed(a.model, bt.input_ids, bt.attention_mask)
    logits = torch.cat(ent)
    logits[:, removed] = -math.inf
    s = torch.softmax(logits, -1)
    want = float((-(s * s.clamp_min(1e-300).log()).sum(-1)).mean())
    got = df[df["layer"] == 0]
    assert len(removed) == L.n_experts // 2
    assert float(got["entropy_ref"].iloc[0]) == pytest.approx(want, rel=1e-5)
    assert (df["entropy_ref"] <= math.log(L.n_experts - len(removed)) + 1e-6).all()


@pytest.mark.parametrize("early,final", [("tiny-early", "tiny"), ("tiny-fine-early", "tiny-fine")])
@pytest.mark.slow
def test_cli_on_embedded_checkpoints(tmp_path, early, final):
    import pandas as pd

    out = tmp_path / "f"
    r = CliRunner().invoke(app, ["fluctuation", early, final, final, "--max-tokens", "384", "--seq-len", "128",
                                 "--isolate", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "fluctuation.csv")
    assert list(df.columns) == COLUMNS
    same = df[(df["reference"] == final) & (df["checkpoint"] == final)]
    assert len(same) == 6 * df["layer"].nunique() and (same[CHANGE] == 0).all().all()
    moved = df[(df["reference"] == early) & (df["routing"] == "router")]
    assert (moved["top1_change"] > 0).any()
    assert (out / "figures" / "fluctuation_by_layer.png").exists()


def test_pooled_summary_matches_the_layers_and_a_hand_bootstrap(ckpts):
    """fluctuation_summary: mean over layers of top-1 change with its bootstrap interval (hand per-row sums at the
    only changed layer for router-isolated) and the paired reduction of a policy against the router."""
    from moetool.experiments.fluctuation.compute import SUMMARY_COLUMNS

    opts = FluctuationOptions(routing=("router", "similarity"), isolate=True, batch_size=2, bootstrap=500, seed=5)
    df, pooled = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), opts, loader)
    assert list(pooled.columns) == SUMMARY_COLUMNS and len(pooled) == 4 and (pooled["layers"] == 4).all()
    assert (pooled["tokens"] == 64 - 5).all()  # real tokens of the pair (per layer), not tokens x layers
    means = df.groupby("routing")["top1_change"].mean()
    by = pooled.set_index("routing")
    for label in means.index:
        assert by.loc[label, "top1_change"] == pytest.approx(means[label], abs=1e-12)
    for base, other in (("router", "similarity"), ("router-isolated", "similarity-isolated")):
        assert by.loc[base, "reduction_vs_router"] != by.loc[base, "reduction_vs_router"]  # NaN for the router
        want = by.loc[base, "top1_change"] - by.loc[other, "top1_change"]
        assert by.loc[other, "reduction_vs_router"] == pytest.approx(want, abs=1e-12)
        lo, hi = by.loc[other, ["reduction_vs_router_lo", "reduction_vs_router_hi"]]
        assert lo <= by.loc[other, "reduction_vs_router"] <= hi
    # router-isolated changes only at layer J: per row, the hand top-1 flags there over 4 layers' tokens
    a, b = loader(ckpts["a"]), loader(ckpts["b"])
    hs, tk = [], tokens()
    with torch.no_grad(), Engine(a.model, [a.layers[J]], consumers=[lambda ev: hs.append(ev.h[ev.valid].cpu())]):
        for bt in tk.batches(2):
            feed(a.model, bt.input_ids, bt.attention_mask)
    h = torch.cat(hs).double()
    wa, wb = (m.layers[J].router.weight.detach().double().cpu() for m in (a, b))
    flag = ((h @ wa.T).argmax(-1) != (h @ wb.T).argmax(-1)).double()
    row_of = torch.arange(4).repeat_interleave(16)[tk.attention_mask.reshape(-1).bool()]
    num = torch.zeros(4, dtype=torch.float64).index_add_(0, row_of, flag).numpy()
    den = 4 * torch.bincount(row_of, minlength=4).double().numpy()
    iv = ratio_intervals(num, den, n_boot=500, seed=5)[0]
    assert iv.value > 0
    assert tuple(by.loc["router-isolated", ["top1_change", "top1_change_lo", "top1_change_hi"]]) == pytest.approx(
        (iv.value, iv.lo, iv.hi), abs=1e-12)


def test_layers_rows_are_the_full_runs_rows_of_those_layers_for_the_router(ckpts):
    """--layers with the model's own routing changes no hidden state: the chosen layers' rows (rates, intervals,
    entropies) are exactly the full run's rows of those layers, and the summary pools those layers only."""
    opts = FluctuationOptions(routing=("router",), isolate=True, batch_size=2, bootstrap=200, seed=1)
    full, _ = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), opts, loader)
    import moetool

    res = moetool.fluctuation([loader(ckpts["a"]), loader(ckpts["b"])], tokens(), routing=("router",), isolate=True,
                              batch_size=2, bootstrap=200, seed=1, layers=(1, J), quiet=True)  # the Python API
    df, pooled = res["fluctuation"], res["fluctuation_summary"]
    assert sorted(set(df["layer"])) == [1, J] and len(df) == 2 * 2
    want = full[full["layer"].isin([1, J])].reset_index(drop=True)
    import pandas as pd

    pd.testing.assert_frame_equal(df.reset_index(drop=True), want, check_exact=True)
    assert (df[(df["layer"] == J) & (df["routing"] == "router")]["topk_change"] > 0).all()  # not a 0 == 0 check
    assert (pooled["layers"] == 2).all()
    by = pooled.set_index("routing")["top1_change"]
    for label, d in df.groupby("routing"):
        assert by[label] == pytest.approx(d["top1_change"].mean(), abs=1e-12)


def test_layers_policy_runs_in_the_chosen_layers_only(ckpts):
    """similarity with --layers J: layers before J run the model's own (identical) routers, so layer J's MoE input
    is the plain model's, the same in both checkpoints; the policy applied by hand to that input (a's and b's
    routers) gives the row's changes and entropies. The full run (policy in every layer) feeds layer J other
    hidden states, so its row differs."""
    opts = FluctuationOptions(routing=("similarity",), tau=40.0, batch_size=2, bootstrap=0, layers=(J,))
    df, pooled = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), opts, loader)
    assert list(df["layer"]) == [J] and (pooled["layers"] == 1).all()
    pol = opts.policy("similarity")
    chosen, ents = {}, {}
    for k in ("a", "b"):
        m = loader(ckpts[k])
        sets, top1, ent = [], [], []

        def see(ev):
            idx, w = pol.select(ev)
            v = ev.valid
            sets.extend(set(r) for r in idx[v].tolist())
            top1.extend(idx[v].gather(1, w[v].float().argmax(-1, keepdim=True))[:, 0].tolist())
            s = pol.scores(ev)[v].double()
            ent.append(-(s * s.clamp_min(1e-300).log()).sum(-1))

        with torch.no_grad(), Engine(m.model, [m.layers[J]], consumers=[see]):  # no policy: the model's routing
            for bt in tokens().batches(2):
                feed(m.model, bt.input_ids, bt.attention_mask)
        chosen[k], ents[k] = (sets, top1), float(torch.cat(ent).mean())
    n = len(chosen["a"][0])
    assert n == 64 - 5
    row = df.iloc[0]
    assert row["tokens"] == n
    assert row["top1_change"] == pytest.approx(sum(x != y for x, y in zip(chosen["a"][1], chosen["b"][1])) / n,
                                               abs=1e-12)
    topk = sum(x != y for x, y in zip(chosen["a"][0], chosen["b"][0])) / n
    assert row["topk_change"] == pytest.approx(topk, abs=1e-12) and topk > 0
    assert row["topk_overlap"] == pytest.approx(
        sum(len(x & y) / 2 for x, y in zip(chosen["a"][0], chosen["b"][0])) / n, abs=1e-12)
    assert (row["entropy_ref"], row["entropy_ckpt"]) == pytest.approx((ents["a"], ents["b"]), rel=1e-5)
    full, _ = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), FluctuationOptions(
        routing=("similarity",), tau=40.0, batch_size=2, bootstrap=0), loader)
    assert abs(float(full[full["layer"] == J]["entropy_ref"].iloc[0]) - row["entropy_ref"]) > 1e-4


@pytest.mark.parametrize("layers, says", [("7", "not MoE layers"), ("1-0", "empty --layers range"),
                                          ("x", "bad --layers item")])
def test_cli_bad_layers_is_one_line(tmp_path, layers, says):
    r = CliRunner().invoke(app, ["fluctuation", "tiny-early", "tiny", "--layers", layers, "--max-tokens", "128",
                                 "--seq-len", "64", "--bootstrap", "0", "--device", "cpu", "-q",
                                 "--out", str(tmp_path / "x")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and says in lines[0], r.output
    assert not (tmp_path / "x").exists()


def test_isolate_with_a_policy_reading_the_experts_is_one_line(tmp_path, ckpts):
    """--isolate keeps only the other checkpoint's routers (router_copy, no experts): norm:<node> there read
    'AttributeError: 'NoneType' object has no attribute 'named_parameters'' after the first checkpoint ran. It is
    refused with the options, before any model loads; without --isolate the policy runs (identical: no change)."""
    with pytest.raises(MoetoolError, match=r"^--isolate with --routing norm:gate: .*drop --isolate or that policy$"):
        FluctuationOptions(routing=("router", "norm:gate"), isolate=True)
    r = CliRunner().invoke(app, ["fluctuation", "tiny-early", "tiny", "--routing", "norm:gate", "--isolate",
                                 "--max-tokens", "64", "--seq-len", "32", "--bootstrap", "0", "--device", "cpu",
                                 "-q", "--out", str(tmp_path / "x")])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "--isolate with --routing norm:gate" in lines[0], r.output
    df, _ = run_fluctuation([ckpts["a"], ckpts["a"]], tokens(), FluctuationOptions(
        routing=("norm:gate",), batch_size=2, bootstrap=0), loader)
    assert set(df["routing"]) == {"norm:gate"} and (df[CHANGE] == 0).all().all()


@pytest.mark.parametrize("routing", ["topp:0.5", "capacity:0.5"])
def test_a_policys_chosen_set_is_its_nonzero_weights(ckpts, routing):
    """topp / capacity hand the experts columns at weight 0 (top-p's unchosen: every one of n columns goes; capacity's
    dropped): the chosen set is the experts that ran with a nonzero weight, read here off the arguments transformers'
    experts module received. (Every column counted as chosen: topp's sets were all n experts, topk_change 0 and
    jaccard 1 in every layer.)"""
    import math

    opts = FluctuationOptions(routing=(routing,), batch_size=2, bootstrap=0)
    df, _ = run_fluctuation([ckpts["a"], ckpts["b"]], tokens(), opts, loader)
    ran = {}
    for k in ("a", "b"):
        m = loader(ckpts[k])
        seen, hooks = {}, []
        try:
            with torch.no_grad(), Engine(m.model, m.layers, policy=opts.policy(routing)):
                for i, dl in enumerate(m.model.model.layers):  # after the engine's own hook: what it handed on
                    hooks.append(dl.mlp.experts.register_forward_pre_hook(
                        lambda mod, args, i=i: seen.setdefault(i, []).append((args[1].clone(), args[2].clone()))))
                for bt in tokens().batches(2):
                    feed(m.model, bt.input_ids, bt.attention_mask)
        finally:
            for h in hooks:
                h.remove()
        ran[k] = seen
    valid = tokens().attention_mask.reshape(-1).bool().tolist()
    for i in ran["a"]:
        rows = []
        for k in ("a", "b"):
            parts = ran[k][i]
            idx, w = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            sets = [{e for e, x in zip(r, q) if x != 0} for r, q in zip(idx.tolist(), w.tolist())]
            rows.append([s for s, v in zip(sets, valid) if v])
        A, B = rows
        n = len(A)
        row = df[df.layer == i].iloc[0]
        assert row["topk_change"] == pytest.approx(sum(a != b for a, b in zip(A, B)) / n, abs=1e-12)
        # a token dropped in both routings (capacity): two empty sets, the same set (overlap and Jaccard 1)
        assert row["topk_overlap"] == pytest.approx(
            sum(len(a & b) / len(a) if a else float(not b) for a, b in zip(A, B)) / n, abs=1e-12)
        assert row["jaccard"] == pytest.approx(sum(len(a & b) / len(a | b) if a | b else 1.0 for a, b in zip(A, B)) / n,
                                               abs=1e-6)  # per token in fp32
        assert not math.isclose(row["jaccard"], 1.0) or i < J


def test_random_isolated_draws_per_row_not_per_batch():
    """The isolated event carried no global row ids, so ``random`` fell back to one generator run batch by batch:
    random-isolated rows changed with --batch-size (and differed between 2 torchrun ranks and one process: top-1
    change 0.871 vs 0.869, 0.0133 in one layer). Seeded per packed row, as every other random draw: any batch size
    gives the same table."""
    import pandas as pd

    from moetool.data import load_tokens
    from moetool.experiments.fluctuation.compute import fluctuation

    tokens = load_tokens(None, load("tiny").tokenizer, 32, 320)
    got = [fluctuation(["tiny-early", "tiny"], tokens, routing=("random",), isolate=True, batch_size=bs,
                       quiet=True)["fluctuation"] for bs in (1, 3)]
    assert set(got[0]["routing"]) == {"random", "random-isolated"}
    pd.testing.assert_frame_equal(got[0], got[1], check_exact=False, rtol=1e-6)  # (float32 forwards of 1 and 3 rows)


def test_random_routing_is_said_to_be_unchanged_by_construction():
    """``--routing random`` draws per (seed, layer, packed row), not from the model: both checkpoints route every
    token alike, so its change is 0 and its 'reduction vs router' is the router's whole change -- true, but it read as
    a policy that removes fluctuation (break-it run 6). The console line says why it is 0."""
    from moetool.data import load_tokens
    from moetool.experiments.fluctuation.compute import fluctuation, summary_lines

    tokens = load_tokens(None, load("tiny").tokenizer, 32, 128)
    res = fluctuation(["tiny-early", "tiny"], tokens, routing=("router", "random"), isolate=True, batch_size=4,
                      bootstrap=0, quiet=True)
    per_layer = res["fluctuation"].set_index("routing")
    assert (per_layer.loc[["random", "random-isolated"], ["top1_change", "topk_change"]] == 0).all().all()
    assert (per_layer.loc["router", "topk_change"] > 0).any()
    lines = summary_lines("fluctuation", res)
    said = [ln for ln in lines if "no change by construction" in ln]
    assert [ln.split()[0] for ln in said] == ["random", "random-isolated"]
    assert not any("no change by construction" in ln for ln in lines if ln.split()[0].startswith("router"))


def test_top1_is_the_first_ranked_by_the_scores_not_the_first_column_nor_the_largest_weight():
    """compare reads the top-1 of chosen_and_top1 (ops.top1: the chosen expert ranked first by the scores the routing
    selected on), not the set's first column nor its largest weight: two routings with the same experts, each with
    its own scores, columns out of score order (as routers with topk(sorted=False) return them) and weights heaviest
    in column 0 whatever the scores (as a per-expert scale can make them, Gemma 4's). Tokens 0 and 3 keep their
    columns while their best score moves (1 -> 0, 7 -> 6), token 1's columns swap while its top-1 stays 3, token 2 is
    unchanged. By hand: top-1s [1, 3, 4, 7] and [0, 3, 4, 6], top1_change 2/4, topk_change 0, topk_overlap and
    jaccard 1. The largest weight (= column 0 here) gave 1/4 (token 1 only)."""
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    idx_ck = torch.tensor([[0, 1], [3, 2], [4, 5], [6, 7]])
    w = torch.tensor([[0.9, 0.1]] * 4)
    s_ref, s_ck = torch.zeros(4, 8), torch.zeros(4, 8)
    s_ref[torch.arange(4).repeat_interleave(2), idx.reshape(-1)] = torch.tensor([.3, .7, .4, .6, .9, .1, .2, .8])
    s_ck[torch.arange(4).repeat_interleave(2), idx.reshape(-1)] = torch.tensor([.8, .2, .4, .6, .9, .1, .7, .3])

    ref, ck = _routing((idx, w), scores=s_ref), _routing((idx_ck, w), scores=s_ck)
    got = compare(ref, ck)[0]
    assert next(ref.batches())[0][0, :, -1].tolist() == [1, 3, 4, 7]
    assert next(ck.batches())[0][0, :, -1].tolist() == [0, 3, 4, 6]
    assert got["tokens"] == 4
    assert got["top1_change"] == pytest.approx(2 / 4, abs=1e-12)
    assert (got["topk_change"], got["topk_overlap"], got["jaccard"]) == (0.0, 1.0, 1.0)


def _routing(*batches, scores=None) -> Routing:
    """A one-layer :class:`Routing` fed, through :meth:`Routing.add` and :meth:`Routing.flush` (no forward), one
    packed row per batch of ``(idx [T, K], w [T, K])``, every token real; ``scores`` (default uniform over 8)."""
    r = Routing([0])
    for idx, w in batches:
        s = torch.full((len(idx), 8), 1 / 8) if scores is None else scores
        r.add(0, idx, w, s, torch.ones(len(idx), dtype=torch.bool), s)
        r.flush(1)
    return r


def test_a_token_that_lost_every_expert_has_no_top1():
    """A token whose every weight is 0 (capacity dropped all its columns) has no top-1, so a checkpoint that keeps
    it routed changes its top-1. Tokens: 0 dropped in the reference only (the checkpoint keeps experts 2, 5), 1
    dropped in both, 2 dropped in the checkpoint only, 3 routed alike. By hand: the top-1 changes for tokens 0 and 2
    (2/4), the chosen sets differ for 0 and 2 (2/4); token 1's two empty sets are the same set, so its overlap and
    Jaccard are 1 as its topk_change is 0: (0 + 1 + 0 + 1) / 4 both (they read 0 for it, 1/4: a token counted as
    unchanged by one column and as sharing nothing by the next). Reading a dropped token's first column as its
    top-1 (2 = 2, 1 = 1, 3 = 3) gave top1_change 0."""
    idx = torch.tensor([[2, 5], [1, 4], [3, 6], [0, 7]])
    w_ref = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.6, 0.4], [0.9, 0.1]])
    w_ck = torch.tensor([[0.7, 0.3], [0.0, 0.0], [0.0, 0.0], [0.9, 0.1]])
    got = compare(_routing((idx, w_ref)), _routing((idx, w_ck)))[0]
    assert got["top1_change"] == pytest.approx(2 / 4, abs=1e-12)
    assert got["topk_change"] == pytest.approx(2 / 4, abs=1e-12)
    assert got["topk_overlap"] == pytest.approx(2 / 4, abs=1e-12)
    assert got["jaccard"] == pytest.approx(2 / 4, abs=1e-12)


def test_routings_of_different_token_counts_are_refused_not_compared_on_the_shorter():
    """A checkpoint whose routing holds fewer batches (here only the reference's first one, identical) saw other
    tokens: one line, not rates summed over the 2 tokens both hold and divided by the reference's 5."""
    idx, w = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    more = (torch.tensor([[4, 5], [6, 7], [0, 2]]), torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]]))
    for ref, ckpt in ((_routing((idx, w), more), _routing((idx, w))), (_routing((idx, w)), _routing((idx, w), more))):
        with pytest.raises(MoetoolError, match="different tokens"):
            compare(ref, ckpt)


def test_entropy_leaves_out_padding_rows_even_where_their_scores_are_nan():
    """A padding row's scores may be NaN (a fully masked row's hidden state; the NaN guard leaves padding alone):
    the entropy is the mean over the real rows only, here a uniform 4-way (log 4) and a one-hot (0) distribution:
    log(4) / 2 (NaN when the padding row's NaN entropy was weighted by 0 instead of replaced)."""
    import math

    r = Routing([0])
    scores = torch.tensor([[0.25] * 4, [1.0, 0.0, 0.0, 0.0], [float("nan")] * 4])
    idx, w = torch.tensor([[0, 1], [0, 2], [0, 1]]), torch.full((3, 2), 0.5)
    r.add(0, idx, w, scores, torch.tensor([True, True, False]), scores)
    assert r.entropy_mean(0) == pytest.approx(math.log(4) / 2, abs=1e-6)


def test_entropy_ratio_of_two_one_hot_routings_is_nan_not_a_division_by_zero():
    """Routers whose every distribution is one-hot (entropy exactly 0 in both checkpoints): entropy_ratio = 0 / 0
    is undefined (NaN), not a ZeroDivisionError that stops the run."""
    import math

    idx, w = torch.tensor([[1, 0], [3, 0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 3]), 8).float()
    got = compare(_routing((idx, w), scores=one_hot), _routing((idx, w), scores=one_hot))[0]
    assert (got["entropy_ref"], got["entropy_ckpt"]) == (0.0, 0.0) and math.isnan(got["entropy_ratio"])
    assert (got["top1_change"], got["topk_change"]) == (0.0, 0.0)


def test_equal_bf16_weights_are_told_apart_by_the_scores_not_the_column_order():
    """Two routings of the same tokens with the same sets and the same bf16 weights, in other column orders (a router
    with topk(sorted=False)): token 0's weights 0.2588 / 0.2598 (the tiny DBRX's in bf16) both round to 0.2598 -- a
    tie the router's probabilities (0.40 vs 0.60 for expert 6) break; token 1's differ in bf16 and keep their order.
    By hand: the top-1 of token 0 is 6 in both, of token 1 3 in both: top1_change 0. The argmax of the weights took
    the first column on the tie (1 in one routing, 6 in the other): top1_change 1/2."""
    w_a = torch.tensor([[0.2588, 0.2598], [0.3, 0.7]]).bfloat16()
    assert w_a[0, 0] == w_a[0, 1]  # the rounding tie
    scores = torch.zeros(2, 8)
    scores[0, 1], scores[0, 6], scores[1, 2], scores[1, 3] = 0.4, 0.6, 0.3, 0.7
    a = _routing((torch.tensor([[1, 6], [2, 3]]), w_a), scores=scores)
    b = _routing((torch.tensor([[6, 1], [3, 2]]), w_a.flip(-1)), scores=scores)
    got = compare(a, b)[0]
    assert got["top1_change"] == 0.0 and got["topk_change"] == 0.0
    assert a._rows_done == 1 and next(a.batches())[0][0, :, -1].tolist() == [6, 3]


def test_top1_on_a_bf16_model_is_its_fp32_weights_largest():
    """The tiny ERNIE-4.5-VL-MoE (top-K unsorted, weights returned in the model's dtype) in bf16: the top-1 that
    fluctuation records is, on every token, the chosen expert of largest fp32 weight -- by hand, the chosen expert of
    largest softmax(logits) (its weights are those probabilities renormalised over the chosen set, so they order
    alike) -- although on 6 of 1536 (token, layer) the two largest bf16 weights are equal. The argmax of the bf16
    weights took the first column there, another expert on 2 of them."""
    from moetool.adapters.tiny import build_tiny

    model = build_tiny("ernie4_5_vl_moe").to(torch.bfloat16)
    ids = torch.randint(3, 1024, (8, 64), generator=torch.Generator().manual_seed(3))
    events = []
    with torch.no_grad(), Engine(model, find_moe_layers(model), consumers=[events.append]):
        feed(model, ids)
    ties = 0
    for ev in events:
        assert ev.weights.dtype == torch.bfloat16
        got = Routing([0])
        got.add(0, ev.idx, ev.weights, ev.probs, ev.valid, ev.probs)
        top1 = got._batch[0][:, -1].long()
        pi = torch.softmax(ev.logits.float(), -1).gather(-1, ev.idx)  # by hand, fp32
        assert torch.equal(top1, ev.idx.gather(-1, pi.argmax(-1, keepdim=True)).squeeze(-1))
        two = ev.weights.float().topk(2, -1).values
        ties += int(((two[:, 0] == two[:, 1]) & (pi.topk(2, -1).values.diff(dim=-1).squeeze(-1) != 0)).sum())
    assert ties >= 2  # the test bites: rounding ties are there


#: per family, the model's own router module (its class) and the selection scores of its first output: the scores the
#: router ranks experts by, written from transformers' modeling code (not moetool's rules)
ROUTERS = {
    "gemma4": ("Gemma4TextRouter", lambda out, mod: out[0]),  # (π, w x per_expert_scale, idx): top-K of π
    "phimoe": ("PhimoeTopKRouter", lambda out, mod: out[0]),  # (logits, w, idx): sparsemixer's first round, argmax
    "deepseek_v3": ("DeepseekV3TopkRouter",  # (logits, w, idx): sigmoid + correction bias, the w unbiased
                    lambda out, mod: out[0].float().sigmoid() + mod.e_score_correction_bias.float()),
}


def router_top1s(model, ids, family):
    """Per MoE layer, in order, ``(top-1 by selection score, top-1 by largest weight)`` ``[T]`` of a plain forward
    (no moetool hook): forward hooks on the model's own router modules, their outputs read as above."""
    cls, scores = ROUTERS[family]

    def read(m, out):
        idx = out[2].reshape(-1, out[2].shape[-1])
        s = scores(out, m).reshape(idx.shape[0], -1)
        return (idx.gather(-1, s.gather(-1, idx).argmax(-1, keepdim=True))[:, 0],
                idx.gather(-1, out[1].reshape(idx.shape).float().argmax(-1, keepdim=True))[:, 0])
    return router_outputs(model, ids, (cls,), read)


def router_outputs(model, ids, classes, read):
    """Per router module of a class named in ``classes``, in order, ``read(module, its output)`` of a plain forward
    of ``ids`` (forward hooks on the model's own routers, removed after)."""
    got, hooks = [], []
    for mod in (m for m in model.modules() if type(m).__name__ in classes):
        def hook(m, a, out, slot=len(got)):
            got[slot] = read(m, out)
        got.append(None)
        hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        feed(model, ids)
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("fam", sorted(ROUTERS))
def test_top1_change_is_the_selection_score_top1s_not_the_largest_weights(fam):
    """The tiny Gemma 4 (a learned per-expert scale on the weights after routing), PhiMoE (sparsemixer weights) and
    DeepSeek-V3 (selection by sigmoid + correction bias, weights without it), fp32 against bf16 of the same
    checkpoint: top1_change per layer is, by hand from the model's own router outputs, the share of tokens whose
    chosen expert of largest selection score differs -- the routing decision (the paper's "switch their expert
    choice"). The largest weight gives other numbers (before: Gemma 4 12/512 vs 8/512 in layer 1, PhiMoE 11 vs 5,
    DeepSeek-V3 3 vs 5 in its last layer)."""
    from types import SimpleNamespace

    from moetool.adapters.tiny import build_tiny
    from moetool.experiments.fluctuation.compute import fluctuation

    model = build_tiny(fam, seed=0)
    vocab = getattr(model.config, "text_config", model.config).vocab_size
    ids = torch.randint(3, vocab, (8, 64), generator=torch.Generator().manual_seed(3))
    lms, hand = [], []
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(model).to(dtype)
        hand.append(router_top1s(m, ids, fam))
        lms.append(SimpleNamespace(model=m, layers=find_moe_layers(m), tokenizer=None, name=str(dtype),
                                   config=m.config))
    tokens = TokenSet(ids, torch.ones_like(ids), [""] * 8, "test")
    df = fluctuation(lms, tokens, bootstrap=0, routing=("router",), batch_size=8, quiet=True)["fluctuation"]
    assert len(df) == len(hand[0]) == len(lms[0].layers)
    by_weight = []
    for row, (s32, w32), (s16, w16) in zip(df.itertuples(), hand[0], hand[1]):
        assert row.tokens == ids.numel()
        assert row.top1_change == pytest.approx(float((s32 != s16).double().mean()), abs=1e-12)
        by_weight.append(float((w32 != w16).double().mean()))
    assert list(df.top1_change) != pytest.approx(by_weight, abs=1e-12)  # the test bites: the weights order otherwise


def test_under_prune_the_top1_is_the_biased_routers_first_ranked_kept_expert():
    """prune: runs the model's rule among the kept experts, so its top-1 is the kept chosen expert of largest
    selection score: on DeepSeek-V3 sigmoid(logits) + the correction bias, by hand from the router's own buffer. The
    pruned π the policy leaves for the entropy (the kept experts' scores, no bias) ranks otherwise on some tokens:
    reading the top-1 by it (Policy.ranking's ev.scores) gave another expert there."""
    from moetool.adapters.tiny import build_tiny
    from moetool.experiments.fluctuation.compute import routing_of
    from moetool.policies import make_policy

    model = build_tiny("deepseek_v3", seed=0)
    layers = find_moe_layers(model)
    policy = make_policy("prune:random:0.25", seed=1)
    ids = torch.randint(3, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5))
    got, differs = [], 0

    def grab(ev):
        idx, w, _, _, ranking = routing_of(ev, policy)
        got.append((ev.layer, ev.logits.float(), idx, w, ops.top1(idx, ranking, w != 0), ev.scores))

    with torch.no_grad(), Engine(model, layers, policy=policy, consumers=[grab]):
        feed(model, ids)
    for L, logits, idx, w, top1, pruned_pi in got:
        bias = next(b for n, b in L.router.named_buffers() if n.endswith("e_score_correction_bias")).float()
        sel = (logits.sigmoid() + bias).gather(-1, idx).masked_fill(w == 0, float("-inf"))
        assert top1.tolist() == idx.gather(-1, sel.argmax(-1, keepdim=True))[:, 0].tolist()
        by_pi = idx.gather(-1, pruned_pi.gather(-1, idx).masked_fill(w == 0, -1.0).argmax(-1, keepdim=True))[:, 0]
        differs += int((by_pi != top1).sum())
    assert len(got) == len(layers) and differs > 0  # the test bites: the unbiased pruned π ranks otherwise


def test_top1_on_hash_routed_layers_is_the_heaviest_of_the_token_ids_experts():
    """DeepSeek-V4's first layers are hash-routed: the experts are the token id's row of a fixed table
    (``tid2eid``), weighted by sqrtsoftplus of the logits renormalised; no score selects them, so their top-1 is the
    chosen expert of largest weight (``selection_scores`` there: the scores the weights are). The tiny model fp32
    against bf16, by hand from the model's own routers' outputs (forward hooks, no moetool hook): top1_change per
    layer is the share of tokens whose heaviest expert differs (hash layers 0-2: 0, 0, 4 of 512; layer 3, routed by
    sqrtsoftplus + correction bias: the biased scores' first, 5 of 512); a hash layer's set never changes
    (topk_change 0), so reading its top-1 in the table's column order gives 0 there: the test bites. moetool trace's
    expert_1 on the same rows is that heaviest expert too."""
    from types import SimpleNamespace

    from moetool.adapters.tiny import build_tiny
    from moetool.experiments.fluctuation.compute import fluctuation
    from moetool.experiments.trace.compute import trace

    model = build_tiny("deepseek_v4", seed=0)
    assert model.config.mlp_layer_types == ["hash_moe", "hash_moe", "hash_moe", "moe"]  # the case
    ids = torch.randint(3, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(3))

    def read(r, out):  # per MoE layer: (chosen [T, K], top-1 by hand [T])
        idx = out[2].reshape(-1, out[2].shape[-1])
        if hasattr(r, "tid2eid"):  # the table's row, ranked by the weights the router returns
            assert torch.equal(idx, r.tid2eid[ids.reshape(-1)])
            rank = out[1].reshape(idx.shape).float()
        else:  # selected on sqrtsoftplus(logits) + the correction bias
            s = F.softplus(out[0].float()).sqrt() + r.e_score_correction_bias.float()
            rank = s.reshape(idx.shape[0], -1).gather(-1, idx)
        return idx, idx.gather(-1, rank.argmax(-1, keepdim=True))[:, 0]

    lms, hand = [], []
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(model).to(dtype)
        hand.append(router_outputs(m, ids, ("DeepseekV4HashRouter", "DeepseekV4TopKRouter"), read))
        lms.append(SimpleNamespace(model=m, layers=find_moe_layers(m), tokenizer=None, name=str(dtype),
                                   config=m.config))
    assert [bool(L.hash_routed) for L in lms[0].layers] == [True, True, True, False]
    tokens = TokenSet(ids, torch.ones_like(ids), [""] * 8, "test")
    df = fluctuation(lms, tokens, bootstrap=0, routing=("router",), batch_size=8, quiet=True)["fluctuation"]
    assert list(df.layer) == [0, 1, 2, 3] and (df.tokens == ids.numel()).all()
    expect = [float((a[1] != b[1]).double().mean()) for a, b in zip(*hand)]
    assert list(df.top1_change) == pytest.approx(expect, abs=1e-12)
    assert expect[2] == 4 / 512 and expect[3] == 5 / 512  # hash layer 2 has changes: the case is not all zeros
    for li in range(3):  # a hash layer's set is its table's: no precision changes it
        assert torch.equal(hand[0][li][0], hand[1][li][0]) and df.topk_change[li] == 0
    assert df.top1_change[2] != float((hand[0][2][0][:, 0] != hand[1][2][0][:, 0]).double().mean())  # bites
    tr = trace(lms[0], tokens, quiet=True)["trace"]
    for li, (_, top1) in enumerate(hand[0]):
        rows = tr[tr.layer == li].sort_values(["row", "pos"])
        assert rows.expert_1.tolist() == top1.tolist()
