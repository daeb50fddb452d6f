"""Published numbers beside measured ones: values come from the table, the layout is right."""

from __future__ import annotations

import pandas as pd
import pytest

from moetool.errors import MoetoolError
from moetool.experiments.published import PUBLISHED, aoe_table1, erc_alpha_min, paper_model, published


def _measured():
    # the shape of norm_select.table1(): router row first, one row per norm policy
    return pd.DataFrame([
        {"node": "router", "norm": "-", "mmlu acc": 0.70, "mmlu retention": 1.0, "arc_challenge acc": 0.62,
         "arc_challenge retention": 1.0},
        {"node": "gate", "norm": "l2", "mmlu acc": 0.63, "mmlu retention": 0.90, "arc_challenge acc": 0.60,
         "arc_challenge retention": 0.9677},
        {"node": "up", "norm": "l2", "mmlu acc": 0.665, "mmlu retention": 0.95, "arc_challenge acc": 0.55,
         "arc_challenge retention": 0.887},
    ])


def test_published_values_are_consistent_ratios():
    df = published("mixtral-8x7b")
    get = lambda task, metric, pol: df[(df.task == task) & (df.metric == metric) & (df.policy == pol)].value.item()
    for task, ret in (("mmlu", 94.8), ("arc_challenge", 94.6)):
        assert get(task, "retention", "best node") == ret
        # the paper's retention is its two accuracies' ratio, rounded to 0.1
        assert round(100 * get(task, "acc", "best node") / get(task, "acc", "router"), 1) == ret
    assert all(p.source.startswith(p.paper) for p in PUBLISHED)


def test_aoe_table1_layout():
    t = aoe_table1(_measured(), "mistralai/Mixtral-8x7B-v0.1")
    assert t.row.tolist() == ["router", "best node"]
    best = t.set_index("row").loc["best node"]
    assert best["mmlu node"] == "up:l2" and best["arc_challenge node"] == "gate:l2"  # best per task
    # one unit with quality.csv: fractions (the paper's 94.8% is 0.948)
    assert best["mmlu retention paper"] == pytest.approx(0.948) and best["arc_challenge retention paper"] == 0.946
    assert best["mmlu acc paper"] == pytest.approx(0.6666) and best["mmlu acc measured"] == 0.665
    assert best["mmlu retention Δ"] == pytest.approx(0.95 - 0.948)
    router = t.set_index("row").loc["router"]
    assert router["arc_challenge acc paper"] == pytest.approx(0.6212) and router["mmlu retention paper"] == 1.0
    assert all(0 <= v <= 1 for c, v in router.items() if ("acc" in c or "retention" in c) and "Δ" not in c)
    assert "Table 1" in t.attrs["source"]


def test_unknown_model_has_no_paper_numbers_and_errors_are_clear():
    t = aoe_table1(_measured(), "tiny")
    assert paper_model("tiny") is None
    assert not [c for c in t.columns if "paper" in c or "Δ" in c]  # no numbers: no empty column written
    assert t.set_index("row").loc["best node", "mmlu retention measured"] == 0.95
    with pytest.raises(MoetoolError):
        aoe_table1(_measured(), "mixtral-8x7b", tasks=("hellaswag",))
    with pytest.raises(MoetoolError):
        aoe_table1(_measured()[:1], "mixtral-8x7b")


def test_erc_alpha_min_layout():
    layers = pd.DataFrame({"layer": [0, 1], "alpha_min": [4.2, 5.6], "n_experts": [8, 8]})
    t = erc_alpha_min(layers)
    assert t.columns.tolist() == ["layer", "alpha_min measured", "alpha_min paper", "source"]
    assert (t["alpha_min paper"] == 5.0).all() and t["alpha_min measured"].tolist() == [4.2, 5.6]


def test_papers_are_cited_as_papers():
    """No 'paper 001'-style numbers (they mean something only inside this repository's notes) in the README, the
    --help texts or the package; every reference of published.REFERENCES is in the README's Citing section."""
    import re
    from pathlib import Path

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.experiments.published import REFERENCES

    root = Path(__file__).resolve().parents[1]
    texts = {str(p): p.read_text(encoding="utf-8") for p in [root / "README.md", *(root / "moetool").rglob("*.py"),
                                                             *(root / "commands").glob("*.py")]}
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        r = CliRunner().invoke(app, [name, "--help"], terminal_width=200)
        assert r.exit_code == 0, r.output
        texts[f"{name} --help"] = r.output
    bad = [where for where, text in texts.items() if re.search(r"\bpapers? 00\d", text)]
    assert not bad, bad
    readme = texts[str(root / "README.md")]
    citing = readme[readme.index("## Citing"):]
    for ref in REFERENCES.values():
        ident = re.search(r"arXiv:(\d{4}\.\d{5})|(https://\S+)", ref)
        assert ident and (ident.group(1) or ident.group(2)) in citing, ref
