"""A token id the model cannot read or predict (tokenizer and model do not match) is one error line before the
forward, never an IndexError inside it or a perplexity over logits that lack the id."""

import math

import pytest
import torch

import moetool
from moetool.data import TokenSet
from moetool.engine.runner import forward, vocabulary
from moetool.errors import MoetoolError



def _tokens(ids, pad_from=None):
    ids = torch.tensor(ids)
    mask = torch.ones_like(ids)
    if pad_from is not None:
        mask[:, pad_from:] = 0
    return TokenSet(ids, mask, [""] * ids.shape[0], "test")


def test_ids_past_the_vocabulary_are_one_line():
    lm = moetool.load("tiny")
    n = lm.model.get_input_embeddings().weight.shape[0]
    assert vocabulary(lm.model) == n == lm.model.lm_head.weight.shape[0]
    ok = forward(lm, _tokens([[5, 6, n - 1, 7]]), nll=True, quiet=True)  # the last id is fine
    assert math.isfinite(ok.perplexity) and ok.perplexity > 1
    with pytest.raises(MoetoolError, match=rf"token id {n} .*vocabulary of {n:,} ids"):
        forward(lm, _tokens([[5, 6, n, 7]]), nll=True, quiet=True)
    with pytest.raises(MoetoolError, match=rf"token id {n + 3} "):  # a padding id goes through the embedding too
        forward(lm, _tokens([[5, 6, 7, n + 3]], pad_from=3), nll=True, quiet=True)


def test_logits_sliced_below_the_embedding_count(monkeypatch):
    lm = moetool.load("tiny")
    n = lm.model.get_input_embeddings().weight.shape[0]
    monkeypatch.setattr(lm.model.config, "unpadded_vocab_size", n - 10, raising=False)  # inkling2's slicing
    assert vocabulary(lm.model) == n - 10
    with pytest.raises(MoetoolError, match=rf"token id {n - 5} "):
        forward(lm, _tokens([[5, n - 5, 7, 8]]), quiet=True)


def test_rows_past_the_positions_or_no_rows_per_forward_are_one_line():
    """A TokenSet with rows longer than the model's positions (packed for another model, or by hand) is refused as
    ``--seq-len`` is, never run silently past the trained positions; ``batch_size=0`` is ``--batch-size``'s
    error, never a ZeroDivisionError."""
    lm = moetool.load("tiny")
    positions = lm.model.config.max_position_embeddings
    long = _tokens([[5] * (positions + 1)])
    with pytest.raises(MoetoolError, match=rf"seq_len={positions + 1} is longer than the model's {positions} "):
        forward(lm, long, nll=True, quiet=True)
    with pytest.raises(MoetoolError, match=rf"seq_len={positions + 1} is longer"):
        moetool.ppl(lm, long, bootstrap=0, quiet=True)
    with pytest.raises(MoetoolError, match="batch_size= must be an integer of at least 1, not 0"):
        forward(lm, _tokens([[5, 6, 7]]), batch_size=0, quiet=True)
    assert forward(lm, _tokens([[5] * positions]), nll=True, quiet=True).nll.tokens == positions - 1
