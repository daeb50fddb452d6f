"""ppl: the router reproduces the unhooked perplexity; policies and --layers change it; the CLI."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model
from typer.testing import CliRunner

from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.data import TokenSet
from moetool.experiments.ppl import PPL_COLUMNS, perplexity, ppl_frame
from moetool.policies import build_policy
from moetool.loading import embedded_models

needs_tiny = pytest.mark.skipif("tiny" not in embedded_models(), reason="embedded model not built")


class _LM:
    def __init__(self, model_type="mixtral"):
        self.model = build_tiny_model(model_type)
        self.layers = find_moe_layers(self.model)


def _tokens():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1024, (3, 16), generator=gen)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[2, 9:] = 0
    return TokenSet(ids, mask, [""] * 3, "test")


def hand_ppl(model, tokens, batch_size):
    """Plain forwards (no hooks) and my own next-token cross-entropy over real token pairs."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, tokens.input_ids.shape[0], batch_size):
            ids, mask = tokens.input_ids[s:s + batch_size], tokens.attention_mask[s:s + batch_size]
            logp = F.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1] - 1):
                    if mask[b, t] and mask[b, t + 1]:
                        total -= float(logp[b, t, ids[b, t + 1]])
                        count += 1
    return math.exp(total / count), count


def test_router_reproduces_the_unhooked_perplexity():
    lm, tokens = _LM(), _tokens()
    ref, n = hand_ppl(lm.model, tokens, 2)
    plain = perplexity(lm, tokens, batch_size=2, quiet=True)
    router = perplexity(lm, tokens, policy=build_policy("router"), batch_size=2, quiet=True)
    assert plain.nll.tokens == router.nll.tokens == n == tokens.n_tokens - 3
    assert router.nll.nll_sum == plain.nll.nll_sum  # bit-identical logits through the override path
    assert router.perplexity == pytest.approx(ref, rel=1e-6)


def test_policy_and_layers_change_perplexity_only_where_asked():
    lm, tokens = _LM(), _tokens()
    router = perplexity(lm, tokens, batch_size=2, quiet=True)
    norm = build_policy("norm:gate", weights="uniform")
    every = perplexity(lm, tokens, policy=norm, batch_size=2, quiet=True)
    one = perplexity(lm, tokens, policy=norm, policy_layers=[3], batch_size=2, quiet=True)
    none = perplexity(lm, tokens, policy=norm, policy_layers=[], batch_size=2, quiet=True)
    assert none.nll.nll_sum == router.nll.nll_sum
    assert len({router.perplexity, every.perplexity, one.perplexity}) == 3
    df = ppl_frame(one, model="m", data="d", routing=norm.name, weights="uniform", layers=[3])
    assert list(df.columns) == list(PPL_COLUMNS)
    assert df.loc[0, "layers"] == "3" and df.loc[0, "perplexity"] == pytest.approx(math.exp(df.loc[0, "nll_mean"]))


@needs_tiny
def test_cli_matches_a_hand_perplexity_on_the_embedded_model(tmp_path):
    from moetool.data import load_tokens
    from moetool.loading import load

    runner = CliRunner()
    common = ["--model", "tiny", "--seq-len", "64", "--max-tokens", "300", "--batch-size", "4", "-q"]
    r = runner.invoke(app, ["ppl", *common, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    r2 = runner.invoke(app, ["ppl", *common, "--routing", "norm:gate", "--layers", "0", "--out", str(tmp_path / "b")])
    assert r2.exit_code == 0, r2.output
    a, b = pd.read_csv(tmp_path / "a" / "ppl.csv"), pd.read_csv(tmp_path / "b" / "ppl.csv")
    assert list(a.columns) == list(PPL_COLUMNS) and (tmp_path / "a" / "manifest.json").is_file()
    lm = load("tiny")
    ref, n = hand_ppl(lm.model, load_tokens(None, lm.tokenizer, 64, 300), 4)
    assert a.loc[0, "tokens"] == n and a.loc[0, "perplexity"] == pytest.approx(ref, rel=1e-6)
    assert b.loc[0, "routing"] == "norm:gate:l2" and str(b.loc[0, "layers"]) == "0"
    assert b.loc[0, "perplexity"] != a.loc[0, "perplexity"]
