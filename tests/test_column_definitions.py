"""Every column of the tables a reader compares with the papers (ERC's M and alpha_min, AIR-MoE's mass recall,
Graph of Tokens' fluctuation) has a definition: the report page's header tooltip
(:func:`moetool.report.page.column_definition`), read from the run's manifest ``definitions``.

Before, on the demo's runs: fluctuation's headline ``reduction_vs_router``, ``entropy_ref`` / ``entropy_ckpt`` (their
key ``entropy_ref/entropy_ckpt`` named both) and every ``*_lo`` / ``*_hi`` of fluctuation and mass-recall (no
``*_lo/*_hi`` key) had none; neither had erc's ``erc_loss_clean``, ``m``, ``alpha``."""

from __future__ import annotations

import pytest

import moetool
from moetool.report.page import column_definition

pytestmark = pytest.mark.xdist_group("column_definitions")


def test_a_key_naming_several_columns_and_an_interval_bound_resolve():
    defs = {"entropy_ref/entropy_ckpt": "mean entropy", "i/j (merges)": "merged pair", "top1_change": "share",
            "imbalance_lo/imbalance_hi": "bounds", "margin_bins.margin_lo": "bin edge"}
    assert column_definition(defs, "t", "entropy_ref") == column_definition(defs, "t", "entropy_ckpt") == "mean entropy"
    assert column_definition(defs, "t", "j") == "merged pair"
    assert column_definition(defs, "t", "top1_change_lo") == "lower end of the 95% interval of top1_change: share"
    assert column_definition(defs, "t", "top1_change_hi").startswith("upper end")
    assert column_definition(defs, "t", "imbalance_lo") == "bounds"  # an explicit entry first
    assert column_definition(defs, "margin_bins", "margin_lo") == "bin edge"
    assert column_definition(defs, "t", "entropy") == column_definition(defs, "t", "nothing_lo") == ""


def undefined(res) -> list[tuple[str, str]]:
    defs = res.meta["definitions"]
    return [(name, c) for name, df in res.tables.items() for c in df.columns
            if not column_definition(defs, name.removesuffix(".csv"), c)]


def test_every_column_of_erc_mass_recall_and_fluctuation_is_defined():
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=320)
    erc = moetool.erc(lm, layers=(0,), quiet=True)
    mr = moetool.mass_recall(lm, tokens, codebook_sizes=(4,), shortlists=(2,), layers=(0,), bootstrap=100,
                             quiet=True)
    fl = moetool.fluctuation([moetool.load("tiny-early"), lm], tokens, routing=("router", "similarity"),
                             layers=(0,), bootstrap=100, quiet=True)
    assert {"reduction_vs_router", "entropy_ref", "top1_change_lo"} <= set(fl["fluctuation_summary"].columns) | set(
        fl["fluctuation"].columns)
    assert undefined(erc) + undefined(mr) + undefined(fl) == []
    defs = fl.meta["definitions"]
    assert "router-isolated" in column_definition(defs, "fluctuation_summary", "reduction_vs_router")
    assert "lower end" in column_definition(mr.meta["definitions"], "mass_recall", "mass_recall_mean_lo")
