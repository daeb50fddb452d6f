"""The Python API speaks Python: a refusal of a keyword names the keyword passed (``layers=``, ``seq_len=2048``), the
command line its flag (``--layers``, ``--seq-len 2048``) -- :func:`moetool.context.flag`, by the run's ``cli``."""

from __future__ import annotations

import pytest

import moetool
from moetool.errors import MoetoolError


@pytest.fixture(scope="module")
def lm():
    return moetool.load("tiny")


@pytest.fixture(scope="module")
def toks(lm):
    return moetool.tokens(lm, None, seq_len=32, max_tokens=256)


def test_refusals_of_the_api_name_its_keywords(lm, toks):
    """``moetool.stats(lm, t, layers=[])`` said "--layers selects no layer", ``topk(..., ks=[])`` "--ks",
    ``tokens(lm, seq_len=2048)`` "--seq-len 2048": flags a Python caller never typed."""
    cases = [(lambda: moetool.stats(lm, toks, layers=[], quiet=True),
              "layers= selects no layer (MoE layers: [0, 1, 2, 3])"),
             (lambda: moetool.stats(lm, toks, layers=[0, 9], quiet=True),
              "layers= names 9: not MoE layers (MoE layers: 0-3)"),
             (lambda: moetool.topk(lm, toks, ks=[], quiet=True), "ks= must be positive integers, not []"),
             (lambda: moetool.tokens(lm, None, seq_len=2048),
              "seq_len=2048 is longer than the model's 1024 positions (mixtral max_position_embeddings): use "
              "seq_len=1024 or less"),
             (lambda: moetool.tokens(lm, None, max_tokens=1), "max_tokens= must be an integer of at least 2, not 1"),
             (lambda: moetool.ppl(lm, toks, batch_size=0), "batch_size= must be an integer of at least 1, not 0"),
             (lambda: moetool.margin(lm, toks, eps=(-1.0,)), "eps= must be finite non-negative numbers, not [-1.0]"),
             (lambda: moetool.run("stats", lm, toks, layers=[], quiet=True, out=None),
              "layers= selects no layer (MoE layers: [0, 1, 2, 3])")]
    for call, want in cases:
        with pytest.raises(MoetoolError) as e:
            call()
        assert str(e.value) == want


def test_the_command_line_still_names_its_flags(cli, tmp_path):
    """The same refusals from the command line: the flags, as before."""
    for args, want in ((["stats", "--layers", "9"], "--layers 9: not MoE layers (MoE layers: 0-3)"),
                       (["ppl", "--seq-len", "2048"], "--seq-len 2048 is longer than the model's 1024 positions "
                                                      "(mixtral max_position_embeddings): use --seq-len 1024 or less"),
                       (["topk", "--ks", "0"], "--ks must be positive integers, not [0]"),
                       (["margin", "--eps", "-1"], "--eps must be finite non-negative numbers, not [-1.0]")):
        r = cli(*args, "--model", "tiny", "--max-tokens", "64", "-q", "--out", str(tmp_path / args[0]))
        assert r.returncode == 2 and r.stderr.strip() == f"error: {want}", (args, r.stderr)


def test_agreement_called_directly_names_its_precisions(monkeypatch):
    """``moetool.agreement(...)`` outside ``moetool.run``: its fp16 hint said ``--dtype`` (a fresh run's flag, which
    agreement does not take); now its run is agreement's, in Python's words: ``precisions=``. Another experiment
    called directly: ``dtype=``."""
    from moetool import context
    from moetool.experiments.registry import EXPERIMENTS

    class Stop(Exception):
        pass

    def compute(*args, **kwargs):
        raise Stop(context.dtype_choice("bf16 or fp32"), context.dtype_choice())

    monkeypatch.setattr(type(EXPERIMENTS["agreement"]), "load", lambda self, attr=None: compute)
    for call, want in ((moetool.agreement, ("bf16 or fp32 in precisions=", "a smaller dtype in precisions=")),
                       (moetool.ppl, ("dtype='bf16' or dtype='fp32'", "a smaller dtype (dtype=)"))):
        with pytest.raises(Stop) as e:
            call()
        assert e.value.args == want
    with context.RunState(cli=True, dtype_flag="--precisions").active(), pytest.raises(Stop) as e:
        moetool.agreement()  # inside a command's run: the command's words
    assert e.value.args == ("bf16 or fp32 in --precisions", "a smaller dtype in --precisions")


def test_a_model_without_its_tokenizer_is_told_what_packs_tokens_for_it(lm):
    """``moetool.run("stats", moetool.load("tiny", tokenizer=False))`` suggested ``moetool.tokens(lm, ...)``, which
    refuses that model: the line says what works instead, and each way it names runs."""
    bare = moetool.load("tiny", tokenizer=False)
    with pytest.raises(MoetoolError) as e:
        moetool.tokens(bare)  # what the old suggestion led to
    assert "without a tokenizer" in str(e.value)
    with pytest.raises(MoetoolError) as e:
        moetool.run("stats", bare)
    assert str(e.value) == ("'stats' needs tokens: this model was loaded without a tokenizer (moetool.load(..., "
                            "tokenizer=False)), which moetool.tokens cannot pack with: load it with its tokenizer "
                            "(lm = moetool.load('tiny')) and pass moetool.run('stats', lm, moetool.tokens(lm, ...)), "
                            "or run it by name: moetool.run('stats', 'tiny')")
    with pytest.raises(MoetoolError) as e:
        moetool.run("stats", lm)  # a model with its tokenizer: moetool.tokens(lm, ...) works, and is what it says
    assert str(e.value) == "'stats' needs tokens: moetool.run('stats', lm, moetool.tokens(lm, ...))"
    assert moetool.tokens(lm, None, seq_len=16, max_tokens=32).n_tokens == 32
