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


def test_the_suffix_rule_a_table_qualified_pair_and_a_template_resolve():
    """``specialization_all_ids`` looked up ``specialization_all`` (``rsplit("_", 1)``: the last word only) and found
    nothing: its base is ``specialization``. A key naming two columns of one table (``coactivation.a/coactivation.b``)
    and a template (``bytes_<format>``, ``expert_<k>/weight_<k>``: plan's and trace's columns) resolve too."""
    defs = {"specialization": "share", "mutual_information": "MI", "coactivation.a/coactivation.b": "pair",
            "a": "other", "bytes_<format>": "bytes", "expert_<k>/weight_<k>": "k-th"}
    assert column_definition(defs, "specialization", "specialization_all_ids") == "share"
    assert column_definition(defs, "t", "mutual_information_norm") == "MI"
    assert column_definition(defs, "coactivation", "b") == column_definition(defs, "coactivation", "a") == "pair"
    assert column_definition(defs, "cross_layer", "a") == "other"
    assert column_definition(defs, "params", "bytes_bf16") == "bytes"
    assert column_definition(defs, "trace", "weight_2") == column_definition(defs, "trace", "expert_10") == "k-th"
    assert column_definition(defs, "trace", "expert_") == column_definition(defs, "trace", "_all_ids") == ""


def test_every_column_of_the_trace_analyses_is_defined(tmp_path):
    """``stats`` / ``offload`` / ``placement`` / ``fluctuation --trace`` (the forward's runs are
    tests/test_help_files.py's ``test_every_column_a_run_writes_has_a_definition``): each column of their tables has
    a definition, the shared ones (``layer``, ``expert``) included."""
    runs = [moetool.run("trace", name, max_tokens=128, seq_len=32, out=tmp_path / name, quiet=True).path
            for name in ("tiny-early", "tiny")]
    results = [moetool.from_trace(name, runs if name == "fluctuation" else runs[1], bootstrap=0)
               for name in ("stats", "offload", "fluctuation")] + [moetool.from_trace("placement", runs[1])]
    assert all(len(r.tables) for r in results)
    assert [(r.name, u) for r in results for u in undefined(r)] == []
    # the trace's own file: every column of trace.csv.gz defined in its manifest
    import json

    import pandas as pd

    defs = json.loads((runs[1] / "manifest.json").read_text())["definitions"]
    cols = pd.read_csv(runs[1] / "trace.csv.gz", nrows=0).columns
    assert {"row", "expert_1", "weight_2"} <= set(cols)
    assert [c for c in cols if not column_definition(defs, "trace", c)] == []
    assert "convert_ids_to_tokens" in column_definition(defs, "trace", "token")  # not decoded text, as stats' token


def undefined(res) -> list[tuple[str, str]]:
    defs = res.definitions  # the experiment's and the shared ones (layer, expert, ...): what the manifest records
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
