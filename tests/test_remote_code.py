"""Checkpoints that ship remote code (``auto_map``), all offline with local folders.

* Kimi-K2's release names model type ``kimi_k2`` (not in transformers) with remote code and architecture
  ``DeepseekV3ForCausalLM`` (transformers' own): read as the native ``deepseek_v3``, no prompt, weights in the
  per-expert layout converted as DeepSeek-V3's are (logits equal to the original model's exactly).
* A tokenizer that is remote code: one line without ``--trust-remote-code`` (transformers would refuse it, or for a
  model type with a tokenizer of its own silently tokenize with its generic class), and with the flag the same
  numbers as the plain tokenizer.
* A config and model of remote code with no native class: one line without the flag; with it, transformers runs the
  checkpoint's code and moetool's adapters decide.

transformers never reads stdin here: ``input`` raises in every test (its "Do you wish to run the custom code?"
prompt)."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from moetool.adapters import find_moe_layers
from moetool.adapters.tiny import build_tiny
from moetool.commands.app import app
from moetool.errors import MoetoolError
from moetool.loading import EMBEDDED_DIR

KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
#: Kimi-K2's FP8 block quantization, as its config.json gives it (read, not applied: configs only)
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
PPL = ["--max-tokens", "512", "--seq-len", "64", "-q"]


@pytest.fixture(autouse=True)
def _no_stdin(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"something read stdin: {args}")

    monkeypatch.setattr(builtins, "input", refuse)


def _rewrite_config(folder: Path, **fields) -> dict:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return config


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(original tiny deepseek_v3 model, its folder, the same folder as Kimi-K2 ships it: model type kimi_k2, the
    auto_map of its remote code, no code files)."""
    model = build_tiny("deepseek_v3")
    root = tmp_path_factory.mktemp("kimi")
    original, kimi = root / "original", root / "kimi-k2"
    model.save_pretrained(original)  # experts per expert on disk (transformers' reverse conversion), as Kimi's
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, original / f)
    shutil.copytree(original, kimi)
    _rewrite_config(kimi, model_type="kimi_k2", auto_map=KIMI_AUTO_MAP)
    return model, original, kimi


def test_the_per_expert_layout_is_what_the_folder_holds(kimi):
    """The folder holds the per-expert layout Kimi-K2's shards have (the load below converts it)."""
    from safetensors import safe_open

    _, _, folder = kimi
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_kimi_config_is_read_as_native_deepseek_v3_with_every_field(kimi, tmp_path, capsys, monkeypatch):
    """Before: transformers' prompt on stdin, then 'cannot read the config ... contains custom code'. Now the native
    DeepseekV3Config, every field as AutoConfig reads the original's (quantization_config included), and one notice
    line on stderr for the process."""
    from transformers import AutoConfig

    from moetool import loading
    from moetool.loading import check_model, load_config

    monkeypatch.setattr(loading, "_NOTICED", set())  # said once per process: this test counts from none
    _, original, folder = kimi
    for f in (original, folder):  # a copy of each with Kimi's quantization_config (configs only)
        (tmp_path / f.name).mkdir()
        shutil.copy(f / "config.json", tmp_path / f.name / "config.json")
        _rewrite_config(tmp_path / f.name, quantization_config=FP8)
    want = AutoConfig.from_pretrained(tmp_path / original.name).to_dict()
    config, _, kind = load_config(str(tmp_path / folder.name))
    assert type(config).__name__ == "DeepseekV3Config" and config.model_type == "deepseek_v3" and kind == "local"
    got = config.to_dict()
    assert got["quantization_config"] == FP8 and "auto_map" not in got
    drop = ("_name_or_path",)
    assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}
    load_config(str(tmp_path / folder.name))
    check_model(str(folder))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "kimi_k2" in ln]
    assert lines == [f"{tmp_path / folder.name}'s config names model type kimi_k2 with remote code; reading it as "
                     f"transformers' native deepseek_v3 (architectures: DeepseekV3ForCausalLM); its code is not run",
                     f"{folder}'s config names model type kimi_k2 with remote code; reading it as transformers' native "
                     f"deepseek_v3 (architectures: DeepseekV3ForCausalLM); its code is not run"], err


def test_native_model_type_is_the_class_own_type():
    """DeepseekV3ForCausalLM is named by two model types' mappings (deepseek_v3, and sarvam_mla which reuses it): the
    type whose package defines it; a class transformers lacks: none."""
    from transformers import CONFIG_MAPPING

    from moetool.loading import native_model_type

    assert native_model_type(["DeepseekV3ForCausalLM"]) == "deepseek_v3"
    assert native_model_type(["MixtralForCausalLM"]) == "mixtral"
    for t in ("deepseek_v3", "mixtral"):
        assert CONFIG_MAPPING[t].model_type == t
    assert native_model_type(["KimiK2ForCausalLM"]) is None and native_model_type(None) is None
    assert native_model_type([]) is None and native_model_type([7]) is None  # none named (pass 17: an IndexError)



def test_a_class_two_types_of_one_package_name_is_no_native_type():
    """Qwen3_5MoeForCausalLM is named by qwen3_5_moe (the composite vision-language config, its text fields nested in
    ``text_config``) and qwen3_5_moe_text, both of package qwen3_5_moe: the package does not tell them apart, so no
    native reading (a remote-code config naming it stays remote), not the first in sorted order -- that would read
    a flat text config as the composite one (pass 17: taking the first passed test_remote_code and test_loading)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from moetool.loading import _native_types_by_class, native_model_type

    types = [t for t in _native_types_by_class().get("Qwen3_5MoeForCausalLM", ()) if t in CONFIG_MAPPING]
    if sorted(types) != ["qwen3_5_moe", "qwen3_5_moe_text"]:
        pytest.skip(f"this transformers names Qwen3_5MoeForCausalLM by {types}")
    assert {model_type_to_module_name(t) for t in types} == {"qwen3_5_moe"}
    assert hasattr(CONFIG_MAPPING["qwen3_5_moe"](), "text_config")  # the composite one
    assert native_model_type(["Qwen3_5MoeForCausalLM"]) is None

def test_kimi_loads_natively_with_the_original_logits_and_moe_layers(kimi):
    """Weights in the per-expert layout converted as DeepSeek-V3's (conversion keyed on the model type): logits equal
    the original model's exactly, and moetool finds the same MoE layers."""
    import moetool

    model, _, folder = kimi
    lm = moetool.load(str(folder), device="cpu")
    assert type(lm.model).__name__ == "DeepseekV3ForCausalLM" and lm.config.model_type == "deepseek_v3"
    assert [L.index for L in lm.layers] == [L.index for L in find_moe_layers(model)] and len(lm.layers) == 3
    ids = torch.arange(3, 67).view(2, 32)
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, model(ids).logits)


def test_plan_and_inspect_read_kimi_without_a_prompt(kimi):
    """``moetool plan`` / ``inspect`` on the Kimi-shaped folder (before: the prompt, then exit 2): inspect's
    parameter count is the original model's."""
    model, _, folder = kimi
    r = CliRunner().invoke(app, ["inspect", "--model", str(folder), "--json"], input="")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout[r.stdout.index("{"):])
    assert info["family"] == "deepseek_v3" and info["total_params"] == sum(p.numel() for p in model.parameters())
    assert [row["layer"] for row in info["moe_layers"]] == [L.index for L in find_moe_layers(model)]
    r = CliRunner().invoke(app, ["plan", "--model", str(folder), "--out", str(folder.parent / "plan")], input="")
    assert r.exit_code == 0, r.output


def _remote_tokenizer_folder(root: Path) -> Path:
    """The embedded tiny model with its tokenizer declared as the checkpoint's own code: tokenizer_config.json names
    TinyRemoteTokenizer through auto_map (Kimi-K2's form: [slow, fast]), tokenization_tiny.py wraps tokenizer.json."""
    folder = root / "remote-tokenizer"
    shutil.copytree(EMBEDDED_DIR / "tiny", folder)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.update(tokenizer_class="TinyRemoteTokenizer",
              auto_map={"AutoTokenizer": ["tokenization_tiny.TinyRemoteTokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    (folder / "tokenization_tiny.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TinyRemoteTokenizer(PreTrainedTokenizerFast):\n"
        "    \"\"\"The embedded tiny tokenizer, as a checkpoint's own code.\"\"\"\n")
    return folder


def _ppl(args: list[str], out: Path) -> pd.DataFrame:
    r = CliRunner().invoke(app, ["ppl", *args, *PPL, "--out", str(out)], input="")
    assert r.exit_code == 0, r.output
    return pd.read_csv(out / "ppl.csv")


def test_a_remote_tokenizer_needs_the_flag_and_then_tokenizes_as_the_plain_one(tmp_path):
    """Before: transformers' generic class replaced the checkpoint's tokenizer without a word (Mixtral has a tokenizer
    class of its own), and there was no --trust-remote-code. Now one line without the flag, before any run folder;
    with it the checkpoint's class runs, with the numbers of the same model and its plain tokenizer."""
    folder = _remote_tokenizer_folder(tmp_path)
    r = CliRunner().invoke(app, ["ppl", "--model", str(folder), *PPL, "--out", str(tmp_path / "refused")], input="")
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "tokenization_tiny.TinyRemoteTokenizer" in lines[0] and "--trust-remote-code" in lines[0]
    assert not (tmp_path / "refused" / "ppl.csv").exists()

    import moetool

    with pytest.raises(MoetoolError, match="trust-remote-code"):
        moetool.load(str(folder), device="cpu")
    tok = moetool.load(str(folder), device="cpu", trust_remote_code=True).tokenizer
    assert type(tok).__name__ == "TinyRemoteTokenizer"

    trusted = _ppl(["--model", str(folder), "--trust-remote-code"], tmp_path / "trusted")
    plain = _ppl(["--model", "tiny"], tmp_path / "plain")
    cols = ["scored_tokens", "nll_mean", "perplexity", "perplexity_lo", "perplexity_hi"]
    assert trusted[cols].equals(plain[cols]) and int(plain["scored_tokens"].iloc[0]) > 400
    manifest = json.loads((tmp_path / "trusted" / "manifest.json").read_text())
    assert manifest["options"]["trust_remote_code"] is True


def _remote_model_folder(root: Path) -> Path:
    """The embedded tiny Mixtral as a model of remote code with no native class: model type foo_moe, architecture
    FooMoeForCausalLM, config and model classes in the folder (subclasses of Mixtral's), the weights as the model
    holds them."""
    import moetool
    from safetensors.torch import save_file

    folder = root / "remote-model"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, folder / f)
    shutil.copy(EMBEDDED_DIR / "tiny" / "config.json", folder / "config.json")
    _rewrite_config(folder, model_type="foo_moe", architectures=["FooMoeForCausalLM"],
                    auto_map={"AutoConfig": "configuration_foo.FooMoeConfig",
                              "AutoModelForCausalLM": "modeling_foo.FooMoeForCausalLM"})
    (folder / "configuration_foo.py").write_text("from transformers import MixtralConfig\n\n\n"
                                                 "class FooMoeConfig(MixtralConfig):\n    model_type = \"foo_moe\"\n")
    (folder / "modeling_foo.py").write_text("from transformers import MixtralForCausalLM\n\n"
                                            "from .configuration_foo import FooMoeConfig\n\n\n"
                                            "class FooMoeForCausalLM(MixtralForCausalLM):\n"
                                            "    config_class = FooMoeConfig\n")
    model = moetool.load("tiny", device="cpu", tokenizer=False).model
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in tied},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_remote_model_code_without_a_native_class_runs_only_when_trusted(tmp_path):
    """Before: the prompt on stdin, then 'cannot read the config'. Now one line naming --trust-remote-code (plan
    included); trusted, transformers runs the folder's own classes and moetool's adapters take the model: the same
    perplexity as the embedded tiny model it wraps."""
    folder = _remote_model_folder(tmp_path)
    for args in (["ppl", "--model", str(folder), *PPL, "--out", str(tmp_path / "refused")],
                 ["plan", "--model", str(folder)], ["inspect", "--model", str(folder)]):
        r = CliRunner().invoke(app, args, input="")
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1, (args, r.output)
        assert "configuration_foo.FooMoeConfig" in lines[0] and "--trust-remote-code" in lines[0], r.output

    import moetool

    lm = moetool.load(str(folder), device="cpu", trust_remote_code=True)
    assert type(lm.model).__name__ == "FooMoeForCausalLM" and len(lm.layers) == 4
    trusted = _ppl(["--model", str(folder), "--trust-remote-code"], tmp_path / "trusted")
    plain = _ppl(["--model", "tiny"], tmp_path / "plain")
    cols = ["scored_tokens", "nll_mean", "perplexity"]
    assert trusted[cols].equals(plain[cols])
    r = CliRunner().invoke(app, ["plan", "--model", str(folder), "--trust-remote-code", "--out",
                                 str(tmp_path / "plan")], input="")
    assert r.exit_code == 0, r.output
    with pytest.raises(MoetoolError, match="trust-remote-code"):
        moetool.run("plan", str(folder), out=tmp_path / "plan-refused")
    res = moetool.run("plan", str(folder), out=tmp_path / "plan-api", trust_remote_code=True)
    plain = moetool.run("plan", "tiny", out=tmp_path / "plan-tiny")
    assert res.tables["params.csv"].equals(plain.tables["params.csv"])  # the same parameters, by group and format
    assert int(plain.tables["params.csv"]["params"].sum()) > 0



@pytest.mark.slow
def test_a_trusted_remote_model_is_planned_in_a_fresh_process(tmp_path):
    """``moetool plan --trust-remote-code`` on a folder whose model class is its own code, in a process that has not
    loaded the model before (the test above plans after ``moetool.load``, which registers the class with
    transformers): the meta-device model is built with its code trusted, the parameters those of the tiny model it
    wraps. Pass 17: telling transformers trust_remote_code=False there passed test_remote_code (the class already
    registered) and failed a plain ``moetool plan`` with "contains custom code which must be executed"."""
    import os
    import subprocess
    import sys

    import moetool

    folder = _remote_model_folder(tmp_path)
    env = {**os.environ, "MOETOOL_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "moetool", "plan", "--model", str(folder), "--trust-remote-code", "-q",
                        "--out", str(tmp_path / "plan")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    got = pd.read_csv(tmp_path / "plan" / "params.csv")
    want = moetool.run("plan", "tiny", out=tmp_path / "plan-tiny").tables["params.csv"]
    assert got["params"].tolist() == want["params"].tolist() and int(got["params"].sum()) > 0

def test_trusting_a_folder_is_another_fingerprint_and_an_explicit_answer_beats_the_run(tmp_path):
    """``loading.config_fingerprint`` of a folder with code beside its config: untrusted, sha256 over (name, NUL,
    bytes, NUL) of config.json and the *.py files in name order (hashlib here); trusted -- explicitly or by the run's
    ``--trust-remote-code`` (``loading.trusted``) -- the same bytes followed by ``trust_remote_code``: an answer cached
    with the checkpoint's code run is never served to a run that does not run it. An explicit answer beats the run's."""
    import hashlib

    from moetool.context import RunState
    from moetool.loading import config_fingerprint, trusted

    shutil.copy(EMBEDDED_DIR / "tiny" / "config.json", tmp_path / "config.json")
    (tmp_path / "modeling_foo.py").write_text("X = 1\n")
    (tmp_path / "configuration_foo.py").write_text("Y = 2\n")

    def by_hand(trust: bool) -> str:
        h = hashlib.sha256()
        for name in ("config.json", "configuration_foo.py", "modeling_foo.py"):
            h.update(name.encode() + b"\0" + (tmp_path / name).read_bytes() + b"\0")
        if trust:
            h.update(b"trust_remote_code")
        return h.hexdigest()

    plain, trust = by_hand(False), by_hand(True)
    assert plain != trust
    assert not trusted() and trusted(True) and not trusted(False)
    assert config_fingerprint(str(tmp_path)) == config_fingerprint(str(tmp_path), False) == plain
    assert config_fingerprint(str(tmp_path), True) == trust
    with RunState(trust_remote_code=True).active():
        assert trusted() and not trusted(False)
        assert config_fingerprint(str(tmp_path)) == trust and config_fingerprint(str(tmp_path), False) == plain
    with RunState().active():
        assert not trusted() and trusted(True)
        assert config_fingerprint(str(tmp_path)) == plain


def test_which_tokenizers_are_the_checkpoints_own_code(tmp_path):
    """loading.remote_tokenizer on tokenizer_config.json variants: the auto_map's fast class first, else its slow
    one; none without an auto_map, when the tokenizer_class it names is transformers' own (then transformers reads it
    so), or for a model type whose hub tokenizer class transformers replaces on purpose (qwen2 is in
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, mixtral is not)."""
    from types import SimpleNamespace

    from transformers.models.auto import tokenization_auto as ta

    from moetool.loading import remote_tokenizer

    folder = _remote_tokenizer_folder(tmp_path)
    mixtral, qwen2 = SimpleNamespace(model_type="mixtral"), SimpleNamespace(model_type="qwen2")
    assert "qwen2" in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert "mixtral" not in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    path = folder / "tokenizer_config.json"
    base = json.loads(path.read_text())

    def ask(config=mixtral, **fields):
        path.write_text(json.dumps({**base, **fields}))
        return remote_tokenizer(str(folder), {}, config)

    assert ask() == "tokenization_tiny.TinyRemoteTokenizer"  # [slow, None]: the slow one
    assert ask(auto_map={"AutoTokenizer": ["tokenization_tiny.Slow", "tokenization_tiny.Fast"]}) == \
        "tokenization_tiny.Fast"
    assert ask(qwen2) is None
    assert ask(tokenizer_class="PreTrainedTokenizerFast") is None
    assert ask(auto_map={}) is None and ask(auto_map={"AutoTokenizer": [None, None]}) is None


def test_an_unknown_model_type_without_remote_code_is_not_read_as_its_architecture(tmp_path, capsys):
    """The architecture reading is for remote code only (an auto_map): a config.json of a model type transformers
    lacks and no code of its own is a config transformers cannot read -- one line, 'cannot read the config' -- even
    when its architectures name a class transformers has (never a notice saying it has remote code)."""
    from moetool.loading import load_config

    shutil.copy(EMBEDDED_DIR / "tiny" / "config.json", tmp_path / "config.json")
    config = _rewrite_config(tmp_path, model_type="foo_moe")
    assert config["architectures"] == ["MixtralForCausalLM"] and "auto_map" not in config
    with pytest.raises(MoetoolError, match="cannot read the config of"):
        load_config(str(tmp_path))
    assert "remote code" not in capsys.readouterr().err


def test_a_native_config_json_is_read_once(kimi, tmp_path, monkeypatch):
    """``read_config`` read a native checkpoint's config.json twice (its fields to tell native from remote code,
    then AutoConfig again; on the Hub a second request): now once, AutoConfig's own read, with the same config. The
    cases that need the fields read them after AutoConfig refuses (Kimi's kimi_k2: read as deepseek_v3 with every
    field; remote code without a native class: refused untrusted, its own class trusted)."""
    from transformers import AutoConfig, PretrainedConfig

    from moetool.loading import read_config

    reads: list[str] = []
    real = PretrainedConfig._dict_from_json_file.__func__

    def counted(cls, path):
        reads.append(str(path))
        return real(cls, path)

    monkeypatch.setattr(PretrainedConfig, "_dict_from_json_file", classmethod(counted))
    _, original, folder = kimi
    for source in (EMBEDDED_DIR / "tiny", original):
        reads.clear()
        config, how = read_config(str(source))
        assert how == "native" and reads == [str(source / "config.json")]
        assert config.to_dict() == AutoConfig.from_pretrained(source).to_dict()
    config, how = read_config(str(folder))
    assert how == "architecture" and config.model_type == "deepseek_v3"
    remote = _remote_model_folder(tmp_path)
    with pytest.raises(MoetoolError, match="trust-remote-code"):
        read_config(str(remote))
    config, how = read_config(str(remote), trust_remote_code=True)
    assert how == "remote" and type(config).__name__ == "FooMoeConfig"
