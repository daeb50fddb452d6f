"""Every registered routing policy on every routing rule's tiny model (and every structure case) of
``tests/test_commands_per_rule.py``: a finite perplexity, or a one-line refusal before any forward (issue 32 item 4).

One short forward per pair (2 rows of 16 tokens, the last half padding) on the model as ``moetool.load`` gives it.
``router`` must reproduce the unhooked model's NLL, ``router`` and ``random`` run everywhere, and every policy
runs on at least one model (a policy refused everywhere would make its cases vacuous).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_commands_per_rule import CASES, STRUCTURES

from moetool.data import TokenSet
from moetool.engine.runner import forward
from moetool.errors import MoetoolError
from moetool.policies import POLICIES, build_policy

#: one spec per registered policy (a policy added to POLICIES needs one here: the first test says so)
SPECS = {"router": "router", "norm": "norm:gate", "random": "random", "similarity": "similarity",
         "attention": "attention", "topk": "topk:1", "topp": "topp:0.5", "capacity": "capacity:1.0",
         "prune": "prune:random:0.25"}
EVERYWHERE = ("router", "random")  # need nothing of a layer but its events
MODELS = {**CASES, **STRUCTURES}
ROWS, SEQ = 2, 16
OUTCOMES: dict[tuple[str, str], str] = {}  # (model case, policy) -> "ran" | the refusal (:func:`outcome`)


def test_every_registered_policy_has_a_spec():
    assert set(SPECS) == set(POLICIES.names())


@functools.lru_cache(maxsize=None)
def model_and_tokens(case: str):
    """The case's tiny model saved and loaded back (``moetool.load``: identification as users get it), and 2 rows
    of random token ids (the last half padding)."""
    import tempfile

    from moetool.adapters import tiny
    from moetool.loading import load

    mt, overrides = MODELS[case]
    model = tiny.build_tiny(mt, seed=0)
    cfg = model.config.get_text_config(decoder=True)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    folder = tempfile.mkdtemp(prefix=f"policy-{case}-")
    model.save_pretrained(folder)
    lm = load(folder, tokenizer=False, device="cpu")
    vocab = lm.model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[-1, SEQ // 2:] = 0
    tokens = TokenSet(ids.masked_fill(mask == 0, 0), mask, [""] * ROWS, "random")
    return lm, tokens


def outcome(case: str, policy: str) -> str:
    """Run ``policy`` on ``case`` once per process and check it: ``"ran"`` or its one-line refusal (recorded)."""
    if (case, policy) in OUTCOMES:
        return OUTCOMES[case, policy]
    lm, tokens = model_and_tokens(case)
    try:
        p = build_policy(SPECS[policy], seed=0)
        got = forward(lm, tokens, policy=p, nll=True, batch_size=ROWS, quiet=True)
    except MoetoolError as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg
        assert policy not in EVERYWHERE, f"{policy} refused on {case}: {msg}"
        OUTCOMES[case, policy] = msg
        return msg
    assert got.nll.tokens > 0 and math.isfinite(got.nll.mean), (case, policy, got.nll)
    if policy == "router":  # the model's own routing through the override path: the unhooked model's NLL
        plain = forward(lm, tokens, nll=True, batch_size=ROWS, quiet=True)
        assert got.nll.tokens == plain.nll.tokens
        assert got.nll.mean == pytest.approx(plain.nll.mean, rel=1e-6, abs=1e-6)
    OUTCOMES[case, policy] = "ran"
    return "ran"


@pytest.mark.parametrize("policy", list(SPECS))
@pytest.mark.parametrize("case", list(MODELS))
def test_policy_on_rule(case, policy):
    outcome(case, policy)


def test_every_policy_ran_somewhere():
    """Every policy runs on at least one model: the outcomes the test above recorded in this process, the missing
    ones (this test selected alone, or the module split between pytest-xdist workers) run here."""
    for policy in SPECS:
        ran = [case for case in MODELS if outcome(case, policy) == "ran"]
        assert ran, f"{policy} was refused on every model: {[OUTCOMES[c, policy] for c in MODELS]}"

# ----- what a policy declares it needs, and what --batch-size auto does with it ---------------------------------
@pytest.mark.parametrize("policy", list(SPECS))
def test_a_policy_probes_the_experts_exactly_when_it_declares_needs_probe(policy, monkeypatch):
    """Every expert computed on the tokens (``engine.probes``' expert chunks) during a forward with the policy iff
    its class declares ``needs_probe``; ``needs_attention`` is what the engine asks of the model."""
    from moetool.engine import hooks, probes

    lm, tokens = model_and_tokens("softmax-topk-renorm")
    chunks, eager = probes._chunks, hooks._eager_attention
    probed, attn = [], []
    monkeypatch.setattr(probes, "_chunks", lambda *a, **k: (probed.append(1), chunks(*a, **k))[1])
    monkeypatch.setattr(hooks, "_eager_attention", lambda m: (attn.append(1), eager(m))[1])
    cls = POLICIES.get(policy)
    forward(lm, tokens, policy=build_policy(SPECS[policy], seed=0), nll=True, batch_size=ROWS, quiet=True)
    assert bool(probed) == cls.needs_probe and bool(attn) == cls.needs_attention


@pytest.mark.parametrize("policy", list(SPECS))
def test_batch_size_auto_sizes_for_what_the_policy_declares(policy, monkeypatch):
    """sizing.auto_rows against a hand count: per row fp32 logits and two hidden states, plus the eager attention
    probabilities (heads x S x S) for ``needs_attention``, plus the [S, n] fp32 expert scores for ``needs_probe``
    (which also holds 2^26 fp32 chunk elements once); room for 5 rows and a half. The CLI's ``--routing`` spec
    reaches it as the policy's class, no policy built."""
    from moetool import run, sizing
    from moetool.loading import load_config

    cls = POLICIES.get(policy)
    config = load_config("tiny")[0]
    seq = 64
    row = seq * (config.vocab_size + 2 * config.hidden_size) * 4
    row += cls.needs_attention * config.num_attention_heads * seq * seq * 4
    row += cls.needs_probe * seq * config.num_local_experts * 4
    fixed = cls.needs_probe * 4 * 2 ** 26
    free = fixed + 5.5 * row * sizing.AUTO_SLACK / sizing.AUTO_SHARE
    monkeypatch.setattr(sizing, "available_memory", lambda dev: int(free))
    assert run.routing_policies(SPECS[policy]) == [cls]
    rows, facts = sizing.auto_rows(config, device=torch.device("cpu"), dtype=torch.float32, seq_len=seq,
                                   max_tokens=10 ** 6, policies=run.routing_policies(SPECS[policy]))
    assert rows == 5 and facts["reason"] == "fits memory"
    plain = seq * (config.vocab_size + 2 * config.hidden_size) * 4  # no policy: nothing beyond the forward
    want = int(sizing.AUTO_SHARE * int(free) // (sizing.AUTO_SLACK * plain))
    assert sizing.auto_rows(config, device=torch.device("cpu"), dtype=torch.float32, seq_len=seq,
                            max_tokens=10 ** 6)[0] == want >= 5


def test_one_policy_build_per_run(tmp_path, monkeypatch):
    """The command checks --routing before loading and the experiment routes with the same build: one
    ``from_spec`` per run (--batch-size auto reads the class's declarations, no build). Outside a run each call
    builds its own: a random policy's generator starts afresh, the same table twice."""
    from typer.testing import CliRunner

    import moetool
    from moetool.commands.app import app
    from moetool.policies.basic import RandomPolicy

    built = []
    spec = RandomPolicy.from_spec.__func__
    monkeypatch.setattr(RandomPolicy, "from_spec", classmethod(lambda c, a, **k: (built.append(1), spec(c, a, **k))[1]))
    r = CliRunner().invoke(app, ["ppl", "--routing", "random", "--seq-len", "64", "--max-tokens", "300", "--bootstrap",
                                 "0", "--batch-size", "auto", "-q", "--out", str(tmp_path / "ppl")])
    assert r.exit_code == 0, r.output
    assert len(built) == 1
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=300)
    a, b = (moetool.ppl(lm, tokens, routing="random", bootstrap=0, quiet=True)["ppl"] for _ in range(2))
    assert len(built) == 3 and a["perplexity"][0] == b["perplexity"][0]
