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
