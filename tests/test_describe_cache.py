"""``inspect --model DIR`` from its config alone, answered from the cache when the same config was described
before (issue #36: seconds of torch/transformers imports the answer does not depend on)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetool import inspect as mi


@pytest.fixture
def model_dir(tmp_path):
    from transformers import MixtralConfig

    d = tmp_path / "m"
    MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2).save_pretrained(d)
    return d  # a config only: describing it reads no weight


def _expected() -> dict:
    """The structure by hand from the config: 3 MoE layers of 4 experts (gate/up/down 3 * 48 * 32 each), top-2."""
    per_expert = 3 * 48 * 32
    return {"layers": [0, 1, 2], "n_experts": 4, "top_k": 2, "expert_params": 4 * per_expert}


def test_second_answer_comes_from_the_cache(model_dir, monkeypatch):
    first = mi.describe_model(str(model_dir))
    want = _expected()
    assert [L["layer"] for L in first["moe_layers"]] == want["layers"]
    assert all(L["n_experts"] == 4 and L["top_k"] == 2 and L["expert_params"] == want["expert_params"]
               for L in first["moe_layers"])
    assert len(list(mi.cache_dir().glob("describe-*.json"))) == 1

    import moetool.loading

    def no_build(name):
        raise AssertionError("built the model again")

    monkeypatch.setattr(moetool.loading, "load_config", no_build)
    assert mi.describe_model(str(model_dir)) == first  # the same answer, nothing rebuilt
    with pytest.raises(AssertionError, match="built the model again"):
        mi.describe_model(str(model_dir), cache=False)


def test_an_edited_config_is_described_anew(model_dir):
    first = mi.describe_model(str(model_dir))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (model_dir / "config.json").write_text(json.dumps(cfg))
    second = mi.describe_model(str(model_dir))
    assert len(first["moe_layers"]) == 3 and len(second["moe_layers"]) == 2
    assert second["total_params"] < first["total_params"]


def test_cached_answer_imports_no_torch(model_dir):
    want = mi.describe_model(str(model_dir))
    code = ("import json, sys; from moetool.inspect import describe_model; "
            f"info = describe_model({str(model_dir)!r}); "
            "print(json.dumps({'torch': 'torch' in sys.modules, 'info': info}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False and got["info"] == want


def test_plan_parameter_counts_from_the_cache(model_dir, monkeypatch):
    """plan's counts of a config seen before come from the cache (no model built), the same numbers; another
    config is counted anew."""
    from transformers import AutoConfig

    from moetool.experiments.plan import compute as P

    config = AutoConfig.from_pretrained(model_dir)
    first = P.parameter_groups(config)
    per_expert = 3 * 48 * 32
    assert first["groups"]["routed_experts"] == 3 * 4 * per_expert and first["moe_layers"] == 3
    monkeypatch.setattr(P, "_parameter_groups", lambda c: (_ for _ in ()).throw(AssertionError("counted again")))
    assert P.parameter_groups(AutoConfig.from_pretrained(model_dir)) == first
    config.num_hidden_layers = 2
    with pytest.raises(AssertionError, match="counted again"):
        P.parameter_groups(config)


def test_plan_of_a_model_on_disk_from_the_cache(model_dir, monkeypatch):
    """plan of a model on disk planned before with the same arguments: the same tables (values and dtypes), meta
    and options as computed afresh, nothing computed again; other arguments or an edited config: computed anew."""
    import pandas as pd

    from moetool.experiments.plan import compute as P

    fresh = P._plan(str(model_dir), "1xH100", 1, seq_len=256, rows=2)
    first = P.plan(str(model_dir), "1xH100", seq_len=256, rows=2)
    assert len(list(mi.cache_dir().glob("plan-[0-9a-f]*.json"))) == 1
    monkeypatch.setattr(P, "_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("planned again")))
    again = P.plan(str(model_dir), "1xH100", seq_len=256, rows=2)
    for res in (first, again):
        assert list(res.tables) == list(fresh.tables) and res.meta == fresh.meta and res.options == fresh.options
        for name in fresh.tables:
            pd.testing.assert_frame_equal(res.tables[name], fresh.tables[name], check_exact=True)
        pd.testing.assert_frame_equal(res.summary, fresh.summary, check_exact=True)
    # the layouts by hand: one H100, bf16 weights of the 3 MoE layers + attention + embeddings fit easily
    assert bool(again["layouts"].fits.iloc[0]) and again.meta["plan"]["moe_layers"] == 3
    with pytest.raises(AssertionError, match="planned again"):
        P.plan(str(model_dir), "2xH100", seq_len=256, rows=2)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_local_experts"] = 8
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError, match="planned again"):
        P.plan(str(model_dir), "1xH100", seq_len=256, rows=2)


def test_cached_plan_and_check_import_no_torch(model_dir):
    """A second process plans a model on disk and checks it (what a command's preflight does) from the cache alone:
    no torch, no transformers; the same plan as the first process's."""
    code = ("import json, sys; from moetool.experiments.plan.compute import plan; from moetool.loading import "
            f"check_model; check_model({str(model_dir)!r}); res = plan({str(model_dir)!r}, '1xH100'); "
            "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules, "
            "'layouts': res['layouts'].to_dict(orient='records')}))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      timeout=300).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["torch"] is True  # the first computed it
    assert runs[1]["torch"] is False and runs[1]["transformers"] is False
    assert runs[1]["layouts"] == runs[0]["layouts"]


def test_check_model_refuses_a_dense_model_every_time(tmp_path):
    """check_model caches only a config that passed: a dense model is refused on every call, in one line."""
    from transformers import LlamaConfig

    from moetool.errors import MoetoolError
    from moetool.loading import check_model

    d = tmp_path / "dense"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(d)
    for _ in range(2):
        with pytest.raises(MoetoolError):
            check_model(str(d))
    assert not list(mi.cache_dir().glob("checked-*.json"))
