"""The per-installation cache's keys (mutation testing, part 7): every component that changes a cached answer is
in its key, so a changed installation, code file, config or argument is computed anew, never answered stale."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pytest

from moetool import files
from moetool import inspect as mi


def _code_hash(paths) -> str:
    """By hand: sha256 over the files sorted by path, each its name, a NUL and its bytes; the first 16 hex."""
    h = hashlib.sha256()
    for f in sorted(paths):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def test_installation_key_holds_every_version_and_the_codes_content(tmp_path, monkeypatch):
    import importlib.metadata as md

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    key = files.installation_key([b, a])
    assert key == {"python": platform.python_version(), "transformers": md.version("transformers"),
                   "torch": md.version("torch"), "moetool": md.version("moetool"), "code": _code_hash([a, b])}
    a.write_text("x = 3\n")  # same name and size, other content: another key
    assert files.installation_key([a, b])["code"] == _code_hash([a, b]) != key["code"]
    real = md.version
    for pkg in ("transformers", "torch", "moetool"):  # another version of any one of them: another key
        monkeypatch.setattr(md, "version", lambda p, pkg=pkg: "0.0.1" if p == pkg else real(p))
        assert files.installation_key([a, b])[pkg] == "0.0.1"
    monkeypatch.setattr(md, "version", real)
    monkeypatch.setattr(platform, "python_version", lambda: "2.7.18")
    assert files.installation_key([a, b])["python"] == "2.7.18"


def test_families_key_covers_inspect_the_loader_and_every_adapter_file():
    """``loading.py`` builds the model a description counts (its config read, its class chosen): it was not in the
    key, so an edit of it (or a reinstall of another commit, same version) kept the old cached answers."""
    here = Path(mi.__file__).resolve().parent
    code = [here / "inspect.py", here / "loading.py", *(here / "adapters").glob("*.py")]
    assert len(code) > 10 and mi.families_cache_key()["code"] == _code_hash(code)


def test_the_parameter_counts_key_covers_the_loader(monkeypatch):
    """plan's parameter counts (``parameter_groups``, cached per config) build the model with ``loading.py`` too."""
    from moetool.experiments.plan import compute as P
    from moetool.loading import load_config

    seen = []
    monkeypatch.setattr(files, "cached", lambda kind, key, compute: seen.append((kind, key)) or {})
    real = files.installation_key
    codes = []
    monkeypatch.setattr(files, "installation_key", lambda code: codes.append(list(code)) or real(code))
    P.parameter_groups(load_config("tiny")[0])
    pkg = Path(files.__file__).resolve().parent
    assert seen and seen[0][0] == "plan-params"
    assert {"experiments/plan/compute.py", "loading.py", "adapters/base.py"} <= \
        {p.resolve().relative_to(pkg).as_posix() for p in codes[0]}


def test_read_cached_answers_only_the_exact_key_and_kind(tmp_path):
    p = tmp_path / "v.json"
    p.write_text(json.dumps({"key": {"a": 1}, "value": {"n": 4}}))
    assert files.read_cached(p, {"a": 1}, "value") == {"n": 4}
    assert files.read_cached(p, {"a": 2}, "value") is None  # another key at the same path (a collision, an edit)
    assert files.read_cached(p, {"a": 1}, "value", list) is None  # a dict where a list is wanted
    p.write_text(json.dumps({"key": {"a": 1}, "value": [1, 2]}))
    assert files.read_cached(p, {"a": 1}, "value") is None and files.read_cached(p, {"a": 1}, "value", list) == [1, 2]


def test_a_value_json_does_not_give_back_is_computed_again_not_kept():
    calls = []

    def compute():
        calls.append(1)
        return {"pair": (1, 2)}  # JSON would give back a list

    for _ in range(2):
        got = files.cached("tuples", {"k": 1}, compute)
        assert got == {"pair": (1, 2)} and isinstance(got["pair"], tuple)
    assert len(calls) == 2 and not list(files.cache_dir().glob("tuples-*.json"))
    assert files.cached("plain", {"k": 1}, lambda: {"n": [1, 2]}) == {"n": [1, 2]}
    assert len(list(files.cache_dir().glob("plain-*.json"))) == 1  # (a JSON-exact value is kept)


def test_families_of_some_types_is_not_the_cached_whole_table(monkeypatch):
    from moetool.adapters import discovery

    monkeypatch.setattr(discovery, "moe_model_types", lambda: ["mixtral", "nllb-moe"])
    monkeypatch.setattr(mi, "family_row", lambda mt: {"model_type": mt, "supported": "yes"})
    whole = mi.families()
    assert [r["model_type"] for r in whole] == ["mixtral", "nllb-moe"]
    assert mi.families(["nllb-moe"]) == [{"model_type": "nllb-moe", "supported": "yes"}]
    assert mi.families() == whole  # the subset did not replace the cached whole table


def _moe_dir(d: Path) -> Path:
    from transformers import MixtralConfig

    MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=512).save_pretrained(d)
    return d


def test_check_model_of_an_edited_config_checks_it_again(tmp_path):
    """A config that passed, rewritten as a dense model's: refused, not answered 'supported' from the cache."""
    from transformers import LlamaConfig

    from moetool.errors import MoetoolError
    from moetool.loading import check_model

    d = _moe_dir(tmp_path / "m")
    check_model(str(d))
    (d / "config.json").unlink()
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(d)
    with pytest.raises(MoetoolError):
        check_model(str(d))


@pytest.mark.parametrize("change", [{"nodes": 2}, {"seq_len": 128}, {"rows": 4}])
def test_plan_with_another_argument_is_planned_anew(tmp_path, change):
    """plan of a model on disk planned before, with one argument changed: the tables of a fresh plan with it."""
    import pandas as pd

    from moetool.experiments.plan import compute as P

    d = str(_moe_dir(tmp_path / "m"))
    base = {"nodes": 1, "seq_len": 256, "rows": 2}
    first = P.plan(d, "1xH100", **base)
    args = {**base, **change}
    fresh = P._plan(d, "1xH100", args["nodes"], seq_len=args["seq_len"], rows=args["rows"])
    got = P.plan(d, "1xH100", **args)
    assert got.options == fresh.options != first.options
    for name in fresh.tables:
        pd.testing.assert_frame_equal(got.tables[name], fresh.tables[name], check_exact=True)


def test_plan_key_covers_the_code_it_computes_with(tmp_path, monkeypatch):
    from moetool.experiments.plan import compute as P

    seen = []
    real = files.installation_key
    monkeypatch.setattr(files, "installation_key", lambda code: seen.append(list(code)) or real(code))
    P.plan(str(_moe_dir(tmp_path / "m")), "1xH100", seq_len=256)
    pkg = Path(files.__file__).resolve().parent
    names = {p.resolve().relative_to(pkg).as_posix() for p in seen[0]}
    assert {"experiments/plan/compute.py", "sizing.py", "configs.py", "loading.py", "adapters/base.py"} <= names
