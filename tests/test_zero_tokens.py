"""A statistic over zero tokens is missing, never 0 (#14): every experiment refuses data with no real token in one
line instead of writing a table, and a mean over an empty set of pairs is NaN."""

from dataclasses import fields, replace

import pytest
import torch

from moetool import ops
from moetool.errors import MoetoolError
from moetool.experiments.registry import EXPERIMENTS



@pytest.fixture(scope="module")
def all_padding():
    from moetool.data import load_tokens
    from moetool.loading import load

    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 16, 64)
    return lm, replace(ts, attention_mask=torch.zeros_like(ts.attention_mask))


@pytest.mark.parametrize("name", [n for n, spec in EXPERIMENTS.items() if spec.inputs == "tokens"])
@pytest.mark.parametrize("rows", ["padding", "none"])
def test_no_real_token_is_refused_not_tabulated(all_padding, name, rows):
    """All padding or no row at all (an empty TokenSet from the API), with the bootstrap off too (it refused a zero
    denominator where the tables themselves did not: norm-select tabulated NaN, ppl and offload failed inside)."""
    lm, ts = all_padding
    if rows == "none":
        ts = replace(ts, input_ids=ts.input_ids[:0], attention_mask=ts.attention_mask[:0], domains=[])
    assert ts.n_tokens == 0
    spec = EXPERIMENTS[name]
    off = {"bootstrap": 0} if any(f.name == "bootstrap" for f in fields(spec.options_class())) else {}
    for kw in ({}, off) if off else ({},):
        with pytest.raises(MoetoolError) as e:
            spec.load()(lm, ts, quiet=True, **kw)
        assert "\n" not in str(e.value) and ("token" in str(e.value) or "denominator" in str(e.value)), e.value
        assert "per-row sums" not in str(e.value), e.value


@pytest.mark.parametrize("name", [n for n, spec in EXPERIMENTS.items() if spec.inputs == "tokens"])
def test_one_row_gives_no_interval_never_a_bootstrap_error(all_padding, name):
    """One packed row (a short --data): the bootstrap has nothing to resample, so no interval (as --bootstrap 0,
    the manifest's replicates 0); margin, agreement, mass-recall and fluctuation refused it with "a bootstrap
    needs at least 2 documents/rows" where stats, ppl and the others left the intervals out."""
    lm, ts = all_padding
    one = replace(ts, input_ids=ts.input_ids[:1], attention_mask=torch.ones_like(ts.attention_mask[:1]),
                  domains=ts.domains[:1])
    spec = EXPERIMENTS[name]
    kw = {"codebook_sizes": (2,)} if name == "mass-recall" else {}  # its default 128 codewords > 16 tokens
    spec.load()(lm, one, quiet=True, **kw)  # every one runs: no error at all


def test_mean_abs_cos_over_no_pair_is_nan():
    x = torch.randn(3, 1, 4)  # three groups of a single row: no pair i != j
    assert torch.isnan(ops.abs_cos_mean(x)).all()
    y = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # one pair both ways: |cos| = 1/sqrt(2)
    assert abs(float(ops.abs_cos_mean(y)) - 2 ** -0.5) < 1e-6


def test_real_tokens_without_a_next_token_pair_are_one_line_naming_why(all_padding):
    """A mask with a gap after every real token (real tokens, but no two in a row) left ppl with zero scored pairs:
    'a statistic has zero denominator: no tokens counted', which named neither the pairs nor the mask (break-it
    run 6). It now says why; a mask with some pairs scores exactly its pairs of consecutive real tokens."""
    import moetool

    lm, ts = all_padding
    alternate = torch.ones_like(ts.input_ids)
    alternate[:, 1::2] = 0
    with pytest.raises(MoetoolError, match="no next-token prediction to score: no row has two consecutive real") as e:
        moetool.ppl(lm, replace(ts, attention_mask=alternate), bootstrap=0, quiet=True)
    assert "\n" not in str(e.value)
    some = torch.ones_like(ts.input_ids)
    some[:, 3::4] = 0
    got = moetool.ppl(lm, replace(ts, attention_mask=some), bootstrap=0, quiet=True)["ppl"]
    assert int(got["scored_tokens"].iloc[0]) == int((some[:, :-1] & some[:, 1:]).sum())
