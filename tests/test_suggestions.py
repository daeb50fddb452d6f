"""A refusal that says what to do instead is followed here, and what it suggests runs: the suggestions made under
flags other than the defaults, and those made once a forward has seen the numbers (tests/test_commands_per_rule.py
follows every suggestion a refusal at the default flags makes, on every rule and structure).

Each test triggers the refusal on a tiny model (the embedded one, a copy of it with a shorter context, or a family's
tiny config reshaped so the refusal applies), reads the suggestion out of the one line, applies it, and checks the
rerun against a reference computed here: the suggested bound is the bound (a value one past it is refused, the value
runs), and the rerun's numbers are the model's.
"""

from __future__ import annotations

import json
import re
import shutil

import pandas as pd
import pytest
import torch
from conftest import hand_ppl
from typer.testing import CliRunner

import moetool
from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.data import TokenSet
from moetool.errors import MoetoolError
from moetool.loading import EMBEDDED_DIR, LoadedModel

pytestmark = pytest.mark.slow  # CLI runs and forwards (tiers: pytest -m 'not slow')
runner = CliRunner()
SMALL = ["--max-tokens", "64", "--seq-len", "16", "--bootstrap", "0", "-q"]


@pytest.fixture(autouse=True)
def no_rendering(monkeypatch):
    """Figures built but not rendered (as tests/test_commands_per_rule.py): the commands' own tests draw them."""
    import matplotlib.pyplot as plt

    from moetool.report.rundir import RunDir

    monkeypatch.setattr(RunDir, "save_figure", lambda self, fig, name: plt.close(fig) or [])


def refusal(args: list[str], out) -> str:
    """The one line a CLI run refuses with (nothing written)."""
    r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code != 0 and r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1, r.output
    assert not (out / "manifest.json").exists()
    return r.output.strip()


def runs(args: list[str], out) -> dict[str, pd.DataFrame]:
    r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 0, (args, r.output)
    return {p.name: pd.read_csv(p) for p in out.glob("*.csv")}


def in_memory(model: torch.nn.Module, model_type: str, rows: int = 2, seq: int = 8) -> tuple[LoadedModel, TokenSet]:
    """``model`` as a ``LoadedModel`` (fp32, CPU) and ``rows`` random rows of ``seq`` ids, every one real."""
    lm = LoadedModel(model_type, "x", "local", model.float().eval(), None, find_moe_layers(model),
                     torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 30, (rows, seq), generator=torch.Generator().manual_seed(1))
    return lm, TokenSet(ids, torch.ones_like(ids), [""] * rows, "test")


def at_most(line: str) -> int:
    return int(re.fullmatch(r".*; choose at most (\d+)", line).group(1))


def test_topk_suggests_the_smallest_bound_over_every_layer():
    """DeepSeek-V3's group limits with layer 1 allowed two groups (8 experts) and layers 2, 3 one (4): topk:9 is
    refused; the k it suggests is the smallest of the layers' bounds (topk_group x experts per group, read off
    the gates here), so topk:<that> runs and topk:<that + 1> is refused. On BASE each layer was checked alone:
    the first refused layer's bound (8) was suggested, and topk:8 was refused in turn by layer 2."""
    from moetool.adapters.discovery import model_class, tiny_config

    torch.manual_seed(0)
    model = model_class("deepseek_v3").from_config(tiny_config("deepseek_v3"))
    gates = {i: blk.mlp.gate for i, blk in enumerate(model.model.layers) if hasattr(blk.mlp, "gate")}
    first = min(gates)
    gates[first].topk_group = 2  # two of its groups: every expert (n_group 2)
    lm, tokens = in_memory(model, "deepseek_v3")
    bound = {i: g.topk_group * g.num_experts // g.num_group for i, g in gates.items()}
    assert bound[first] == 8 and min(bound.values()) == 4, bound
    with pytest.raises(MoetoolError) as e:
        moetool.topk(lm, tokens, ks=(9,), ps=(0.5,), bootstrap=0, quiet=True)
    k = at_most(str(e.value))
    assert k == min(bound.values())
    with pytest.raises(MoetoolError, match=f"choose at most {k}$"):
        moetool.topk(lm, tokens, ks=(k + 1,), ps=(0.5,), bootstrap=0, quiet=True)
    res = moetool.topk(lm, tokens, ks=(k,), ps=(0.5,), bootstrap=0, quiet=True)
    per_layer = res.tables["topk_layers.csv"].set_index("policy").loc[f"topk:{k}"]
    # every token of every layer runs exactly k experts (counted by the command from the experts module's input)
    assert sorted(per_layer["layer"]) == sorted(gates) and (per_layer[["min_experts", "max_experts"]] == k).all().all()


def test_norm_policy_suggests_the_layers_that_can_rank_and_norm_output():
    """LongCat-Flash with 8 computed (+2 identity) experts and a top-9 in layers 1.. (layer 0 keeps a top-2):
    ``norm:gate`` is refused naming every such layer, and each suggestion runs: ``--layers`` of the others (layer
    0 alone) and ``norm:output``. Its ppl there equals a run of the same policy restricted by hand. On BASE the
    line named one layer and offered a bare ``--layers`` (no layers: nothing to follow)."""
    from moetool.adapters.discovery import model_class, tiny_config

    cfg = tiny_config("longcat_flash")
    cfg.moe_topk = 9
    torch.manual_seed(0)
    model = model_class("longcat_flash").from_config(cfg)
    routers = [L.router for L in find_moe_layers(model)]
    routers[0].top_k = 2
    lm, tokens = in_memory(model, "longcat_flash")
    layers = lm.layers
    assert [L.top_k for L in layers] == [2] + [9] * (len(layers) - 1) and {L.n_computed for L in layers} == {8}
    with pytest.raises(MoetoolError) as e:
        moetool.ppl(lm, tokens, routing="norm:gate", bootstrap=0, quiet=True)
    line = str(e.value)
    assert line.startswith("policy norm:gate:l2: ") and f"MoE layers {[L.index for L in layers[1:]]} have 8 computed "\
        "experts for a top-9" in line, line
    tips = line.rsplit(": ", 1)[-1].split(", or ")
    assert len(tips) == 2, line
    ok = [int(i) for i in re.fullmatch(r"choose the others with --layers ([\d,]+)", tips[0]).group(1).split(",")]
    assert ok == [layers[0].index]
    assert re.fullmatch(r".*\(norm:output\)", tips[1]), line
    some = moetool.ppl(lm, tokens, routing="norm:gate", layers=ok, bootstrap=0, quiet=True).tables["ppl.csv"]
    out = moetool.ppl(lm, tokens, routing="norm:output", bootstrap=0, quiet=True).tables["ppl.csv"]
    assert some.loc[0, "layers"] == str(ok[0]) and out.loc[0, "layers"] == "all"
    for df in (some, out):
        assert df.loc[0, "scored_tokens"] == tokens.input_ids.numel() - tokens.input_ids.shape[0]
        assert torch.isfinite(torch.tensor(df.loc[0, "perplexity"])) and df.loc[0, "perplexity"] > 1


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The embedded tiny model with a config of 24 positions (the rotary embedding needs no table of them)."""
    path = tmp_path_factory.mktemp("short") / "tiny"
    shutil.copytree(EMBEDDED_DIR / "tiny", path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 24
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_seq_len_suggests_the_models_positions_and_that_runs(short_context, tmp_path):
    """``--seq-len`` beyond the config's positions: the line suggests ``--seq-len N or less`` with N the config's
    max_position_embeddings (read here from config.json), and ppl at that length runs: its perplexity is the
    model's own next-token cross-entropy over the same rows (plain transformers, conftest.hand_ppl)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moetool.data import load_tokens

    positions = json.loads((short_context / "config.json").read_text())["max_position_embeddings"]
    base = ["ppl", "--model", str(short_context), "--max-tokens", "96", "--bootstrap", "0", "-q"]
    line = refusal([*base, "--seq-len", str(positions + 1)], tmp_path / "long")
    n = int(re.fullmatch(r".*: use --seq-len (\d+) or less", line).group(1))
    assert n == positions
    df = runs([*base, "--seq-len", str(n)], tmp_path / "ok")["ppl.csv"]
    tok = AutoTokenizer.from_pretrained(short_context)
    tokens = load_tokens(None, tok, n, 96)
    assert tokens.input_ids.shape[1] == n
    want, scored = hand_ppl(AutoModelForCausalLM.from_pretrained(short_context).float().eval(), tokens)
    assert df.loc[0, "scored_tokens"] == scored
    assert df.loc[0, "perplexity"] == pytest.approx(want, rel=1e-5)


def test_margin_eps_that_overflows_is_refused_after_the_forward_and_a_smaller_one_runs(tmp_path):
    """An eps whose noisy router input overflows fp32 is seen only once the forward has computed it: the run is
    refused in one line naming that eps (no table: its flips would read as a measurement), and the eps it suggests
    (the bound computed from the data, rounded down; "use a smaller --eps" on BASE) runs beside the other eps given,
    each noise of the relative size asked for (fp32: noise_rel is ||eps ||h|| z / sqrt(d)|| / ||h||, whose mean
    over z ~ N(0, I_d) is eps within a few percent at d = 128)."""
    line = refusal(["margin", *SMALL, "--eps", "0.1,1e30"], tmp_path / "over")
    assert line.startswith("error: --eps 1e+30: "), line
    eps = float(re.fullmatch(r".*\(computed from the data\): use --eps (\S+) or less", line).group(1))
    flips = runs(["margin", *SMALL, "--eps", f"0.1,{eps:g}"], tmp_path / "ok")["margin_flips.csv"]
    assert len(flips) == 8 and sorted(set(flips["eps"])) == [0.1, eps]
    for e, rows in flips.groupby("eps"):
        assert rows["noise_rel"].to_numpy() == pytest.approx(e, rel=0.05)


def test_cluster_to_suggests_the_computed_experts_and_that_runs(tmp_path):
    """expert-similarity --cluster-to beyond the layers' computed experts: the line names their number (8, the
    embedded model's experts), ``--cluster-to 8`` runs and groups every expert of every layer alone."""
    args = ["expert-similarity", "--max-tokens", "64", "--seq-len", "16", "-q"]
    line = refusal([*args, "--cluster-to", "9"], tmp_path / "over")
    m = int(re.fullmatch(r".*have computed experts \((\d+)\); use at most that many", line).group(1))
    assert m == 8
    groups = runs([*args, "--cluster-to", str(m)], tmp_path / "ok")["expert_similarity_groups.csv"]
    for layer, g in groups.groupby("layer"):  # m groups of m experts: each expert alone, each dominant
        assert sorted(g["expert"]) == list(range(m)) and g["group"].nunique() == m and g["dominant"].all(), layer
    assert groups["layer"].nunique() == 4


@pytest.mark.parametrize("flag, value, tokens", [("--shortlist", 9, 64), ("--codebook-size", 33, 32)])
def test_mass_recall_sizes_suggested_are_the_bound_and_run(flag, value, tokens, tmp_path):
    """mass-recall's shortlist (more than the 8 experts) and codebook (more codewords than the tokens it is fitted
    on) sizes: the line's ``choose sizes up to N`` is the bound (the experts; the tokens read), and N runs."""
    args = ["mass-recall", "--max-tokens", str(tokens), "--seq-len", "16", "--bootstrap", "0", "-q",
            "--codebook-size", str(min(16, tokens))]
    line = refusal([*args, flag, str(value)], tmp_path / "over")
    n = int(re.search(r"choose sizes up to ([\d,]+)", line).group(1).replace(",", ""))
    assert n == (8 if flag == "--shortlist" else tokens)
    tables = runs([*args, flag, str(n)], tmp_path / "ok")
    assert tables


def test_erc_noise_that_overflows_is_refused_and_a_smaller_one_runs(tmp_path):
    """erc's noisy proxies (a fixed --noise eps for every expert) are seen only once drawn: a noise whose M is not
    finite is refused in one line naming it and the noise to use ("choose a smaller noise" on BASE), which runs; its
    alpha_min is the closed form of the matrix it writes (tests/test_erc.py's hand_alpha_min)."""
    from test_erc import hand_alpha_min

    args = ["erc", "--samples", "1", "--layers", "0", "-q"]
    line = refusal([*args, "--noise", "1e30"], tmp_path / "over")
    assert line.startswith("error: --noise 1e+30: "), line
    noise = re.fullmatch(r".*: --noise (\S+) keeps M finite in every layer \(checked on the same seeded draws\)",
                         line).group(1)
    assert 0 < float(noise) < 1e30
    tables = runs([*args, "--noise", noise], tmp_path / "ok")
    per_layer, matrix = tables["erc_layers.csv"], tables["erc_matrix.csv"]
    assert list(per_layer["layer"]) == [0]
    M = matrix[matrix.layer == 0].pivot(index="i", columns="j", values="m").to_numpy()
    assert M.shape == (8, 8) and (M >= 0).all()
    assert per_layer.loc[0, "alpha_min"] == pytest.approx(hand_alpha_min(torch.tensor(M)), rel=1e-5)


@pytest.mark.parametrize("spec", ["attention", "similarity", "topk:1"])
def test_policy_refusals_on_hash_routed_layers_suggest_layers_no_other_check_refuses(spec):
    """DeepSeek-V4: layers 0-2 hash-routed, every layer's attention over compressed key blocks. A policy that
    re-ranks by the router's scores is refused on the hash-routed layers; the ``--layers`` it suggests must pass
    every other check of the same policy. On BASE attention routing suggested ``--layers 3`` (the hash check
    alone), which the attention check then refused; now both are one check: both reasons and no layer left."""
    from moetool.adapters import tiny
    from moetool.engine.hooks import check_policy
    from moetool.policies import make_policy

    layers = find_moe_layers(tiny.build_tiny("deepseek_v4", seed=0))
    hashed = [L.index for L in layers if getattr(L, "hash_routed", False)]
    assert hashed and len(hashed) < len(layers)
    with pytest.raises(MoetoolError) as e:
        check_policy(make_policy(spec), layers, [L.index for L in layers])
    line = str(e.value)
    assert f"MoE layers {hashed} are hash-routed" in line and "\n" not in line, line
    offered = re.findall(r"--layers ([\d,]+)", line)
    if spec == "attention":
        assert "compressed key blocks" in line and line.endswith("no other layer is left") and not offered, line
    else:
        assert offered == [",".join(str(L.index) for L in layers if L.index not in hashed)], line
    for value in offered:  # what it offers passes
        check_policy(make_policy(spec), layers, [int(i) for i in value.split(",")])


def test_too_few_bootstrap_replicates_suggest_the_least_that_runs(tmp_path):
    """--bootstrap below a percentile interval's least replicates: the line's ``use >= N`` is the bound (N - 1 is
    refused), and N runs with an interval around the value."""
    args = ["ppl", "--max-tokens", "64", "--seq-len", "16", "-q"]
    line = refusal([*args, "--bootstrap", "50"], tmp_path / "few")
    n = int(re.fullmatch(r".*\(use >= (\d+) or 0\)", line).group(1))
    refusal([*args, "--bootstrap", str(n - 1)], tmp_path / "one-less")
    df = runs([*args, "--bootstrap", str(n)], tmp_path / "ok")["ppl.csv"]
    assert df.loc[0, "perplexity_lo"] <= df.loc[0, "perplexity"] <= df.loc[0, "perplexity_hi"]
