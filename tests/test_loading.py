"""Resolving --model: embedded names, aliases, local dirs, hub ids, and the one-line errors."""

import pytest

from moetool import sizing
from moetool.errors import MoetoolError
from moetool.loading import ALIASES, load_config, pick_dtype, pick_device, resolve


def test_alias_and_hub_id_resolve_without_network():
    assert resolve("mixtral-8x7b") == ("mistralai/Mixtral-8x7B-v0.1", "alias")
    assert resolve("olmoe")[0] == "allenai/OLMoE-1B-7B-0924"
    assert resolve("some-org/some-model") == ("some-org/some-model", "hub")
    assert set(ALIASES) >= {"mixtral-8x7b", "olmoe", "qwen1.5-moe", "qwen3-30b-a3b", "deepseek-v2-lite",
                            "gpt-oss-20b", "phi-3.5-moe"}


#: the original families' aliases (lines without a ``# model_type`` comment)
ORIGINAL_ALIASES = {"mixtral": "mixtral-8x7b", "olmoe": "olmoe", "qwen2_moe": "qwen1.5-moe",
                    "qwen3_moe": "qwen3-30b-a3b", "deepseek_v2": "deepseek-v2-lite", "deepseek_v3": "deepseek-v3",
                    "gpt_oss": "gpt-oss-20b", "phimoe": "phi-3.5-moe"}
#: supported types with no alias: their installed docs name no checkpoint of their own
NO_ALIAS = {
    "glm4_moe_lite": "its docs name zai-org/GLM-4.5, a glm4_moe checkpoint",
    "granitemoeshared": "its docs name a speech model and ibm/PowerMoE-3b (granitemoe)",
    "minimax_m2": "its docs name MiniMaxAI/MiniMax-Text-01-hf, a minimax checkpoint",
    "inkling": "inkling_text is the text decoder of inkling_mm_model's checkpoint (alias inkling)",
}


def _family_aliases() -> dict[str, str]:
    """model type -> alias, from the ``# model_type`` comments of the ALIASES lines, and the original ones."""
    import re
    from pathlib import Path

    import moetool.loading

    src = Path(moetool.loading.__file__).read_text()
    found = {mt: alias for alias, mt in re.findall(r'^ +"([^"]+)": "[^"]+", +# (\w+)$', src, re.M)}
    return {**found, **ORIGINAL_ALIASES}


def test_every_supported_family_has_an_alias_named_in_its_installed_docs():
    """An alias resolves to a checkpoint the family's own transformers files name (the docs' example), never an
    invented one; every supported family (``*_text`` sub-types go with theirs) has one or a reason in NO_ALIAS."""
    import re
    from pathlib import Path

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from moetool.adapters import discovery

    by_type = _family_aliases()
    assert set(by_type.values()) <= set(ALIASES)
    models = Path(transformers.__file__).parent / "models"
    for mt, alias in by_type.items():
        if mt in ORIGINAL_ALIASES:  # chosen before, by the families' model cards
            continue
        files = (models / model_type_to_module_name(mt)).glob("*.py")
        named = re.compile(re.escape(ALIASES[alias]) + r"(?![\w.-])")  # the whole id, not a prefix of another
        assert any(named.search(f.read_text()) for f in files), (alias, mt)
    for mt in discovery.supported_types():
        family = mt.removesuffix("_text")
        assert family in by_type or family in NO_ALIAS or mt in by_type, mt


def test_unknown_model_suggests_alias():
    with pytest.raises(MoetoolError, match="did you mean 'mixtral-8x7b'"):
        resolve("mixtral-8x7")


@pytest.mark.parametrize("name", ["nosuchmodel", "foo", "model", "qwerty-9000"])
def test_an_unrelated_name_gets_no_suggestion(name):
    """difflib's 0.5 suggested 'olmoe' for 'nosuchmodel' (and 'foo', 'model'): a guess that misleads."""
    with pytest.raises(MoetoolError) as e:
        resolve(name)
    assert str(e.value).startswith(f"unknown model '{name}': give an embedded name"), str(e.value)


@pytest.mark.parametrize("typo, meant", [("mixtrl", "mixtral-8x7b"), ("olmo", "olmoe"), ("tinyy", "tiny"),
                                         ("qwen3-30b", "qwen3-30b-a3b")])
def test_a_typo_still_gets_its_suggestion(typo, meant):
    with pytest.raises(MoetoolError, match=f"^unknown model '{typo}' \\(did you mean '{meant}'"):
        resolve(typo)


@pytest.mark.parametrize("name", ["examples/configs/deepseek-v3", "./deepseek-v3", "../x", "/no/such/dir", "~/nope-x",
                                  "nope/", "a/b/c", "org/name/"])
def test_a_path_that_is_not_there_is_no_such_directory(name, tmp_path, monkeypatch):
    """A name only a folder can have (./ ../ / ~ at the start, a / at the end, two or more /) that does not exist:
    'no such directory', not 'unknown model' (run outside the repository, examples/configs/deepseek-v3 was
    'unknown model ... did you mean deepseek-v3')."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MoetoolError) as e:
        resolve(name)
    line = str(e.value)
    assert line.startswith(f"no such directory: {name}") and "\n" not in line, line
    if name.endswith("deepseek-v3"):  # its last part is an alias: named beside the path
        assert "(did you mean 'deepseek-v3'" in line
    else:
        assert "did you mean" not in line


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_model_name_is_refused_not_the_current_folder(name, tmp_path, monkeypatch):
    """``--model ""`` (an unset shell variable) was the current folder: " is not a model directory" (a line starting
    with a blank), or, run inside a checkpoint's folder, that checkpoint. It is refused as an empty name; '.' still
    names the current folder."""
    import shutil

    from moetool.loading import EMBEDDED_DIR

    shutil.copytree(EMBEDDED_DIR / "tiny", tmp_path / "m")
    monkeypatch.chdir(tmp_path / "m")
    with pytest.raises(MoetoolError) as e:
        resolve(name)
    assert str(e.value).startswith(f"--model {name!r} is an empty name: give an embedded name (tiny, "), e.value
    assert resolve(".") == (".", "local")


def test_a_hub_id_is_still_a_hub_id():
    assert resolve("org/name") == ("org/name", "hub") and resolve("Org-1/na.me_2") == ("Org-1/na.me_2", "hub")


def test_local_dir_without_config(tmp_path):
    with pytest.raises(MoetoolError, match="no config.json"):
        resolve(str(tmp_path))


def test_a_peft_adapter_folder_names_its_base_and_how_to_use_it(tmp_path):
    """A LoRA adapter folder (adapter_config.json + adapter_model.safetensors, no config.json) was "not a model
    directory (no config.json in it)": it now says it is a PEFT adapter of its base, to merge it or pass the base --
    from the CLI in one line, exit 2, before any weight."""
    import json

    from typer.testing import CliRunner

    from moetool.commands.app import app

    folder = tmp_path / "my lora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/Base-MoE",
                                                            "peft_type": "LORA", "r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(MoetoolError) as e:
        resolve(str(folder))
    assert str(e.value) == (f"{folder} is a PEFT adapter of org/Base-MoE (adapter_config.json, no config.json) and "
                            f"moetool loads whole models: merge it into its base first (peft: PeftModel.from_pretrained"
                            f"(base, '{folder}').merge_and_unload().save_pretrained(DIR), then --model DIR), or pass "
                            f"the base model itself (--model org/Base-MoE)")
    for cmd in ("plan", "ppl"):
        out = CliRunner().invoke(app, [cmd, "--model", str(folder), "--out", str(tmp_path / cmd)])
        assert out.exit_code == 2 and out.output.strip() == f"error: {e.value}", out.output
    (folder / "adapter_config.json").write_text("{not json")  # unreadable: an adapter still, base unnamed
    with pytest.raises(MoetoolError, match=r"is a PEFT adapter \(adapter_config.json, no config.json\)"):
        resolve(str(folder))


def test_an_adapter_folder_with_a_config_but_adapter_weights_only_is_an_adapter(tmp_path):
    """An adapter saved with its base's config.json beside it: ppl said transformers' "OSError: Error no file named
    model.safetensors, or pytorch_model.bin, found in directory": it says it is a PEFT adapter of its base (exit 2);
    plan, which reads the config alone, still answers."""
    import json
    import shutil

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.loading import EMBEDDED_DIR

    folder = tmp_path / "lora"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, folder / f)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/Base-MoE"}))
    (folder / "adapter_model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # an empty safetensors
    out = CliRunner().invoke(app, ["ppl", "--model", str(folder), "--out", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert out.output.strip() == (f"error: {folder} is a PEFT adapter of org/Base-MoE (adapter_config.json and adapter "
                                  f"weights only) and moetool loads whole models: merge it into its base first (peft: "
                                  f"PeftModel.from_pretrained(base, '{folder}').merge_and_unload().save_pretrained(DIR)"
                                  f", then --model DIR), or pass the base model itself (--model org/Base-MoE)")
    assert CliRunner().invoke(app, ["plan", "--json", "--model", str(folder)]).exit_code == 0


def test_a_file_is_refused_naming_its_folder_or_its_format(tmp_path):
    """--model given a file (config.json, one .safetensors shard, a GGUF or ONNX file, or a folder of GGUF files)
    was "<file> is not a model directory (no config.json in it)" -- even for config.json itself. A file of a
    checkpoint now names the folder to pass (quoted for the shell: a path with spaces); another runtime's format is
    named as such."""
    import shutil

    from moetool.loading import EMBEDDED_DIR

    folder = tmp_path / "my model"
    shutil.copytree(EMBEDDED_DIR / "tiny", folder)
    for f in ("config.json", "model.safetensors"):
        with pytest.raises(MoetoolError) as e:
            resolve(str(folder / f))
        assert str(e.value) == f"{folder / f} is a file; --model takes the folder that holds it: --model '{folder}'"
    assert resolve(str(folder)) == (str(folder), "local")
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "m.onnx").write_bytes(b"\0")
    checkpoint = "a transformers checkpoint (a folder with config.json and *.safetensors or *.bin)"
    for name, what in ((gguf / "m-Q4_K_M.gguf", "is a GGUF file (llama.cpp's format);"),
                       (gguf, "holds a GGUF file (llama.cpp's format) and no config.json;"),
                       (tmp_path / "m.onnx", "is an ONNX export;")):
        with pytest.raises(MoetoolError) as e:
            resolve(str(name))
        assert str(e.value) == f"{name} {what} moetool loads {checkpoint}: pass the original model's folder or hub id"


@pytest.mark.parametrize("name, repo, rev", [("org/name@abc123", "org/name", "abc123"),
                                             ("olmoe@main", "allenai/OLMoE-1B-7B-0924", "main")])
def test_a_hub_id_with_a_revision_says_how_to_get_that_revision(name, repo, rev):
    """``org/name@rev`` (a revision as other tools spell it) was "unknown model ...: give ... a hub id org/name",
    which it looks like: it now says --model takes no revision and how to download that one."""
    with pytest.raises(MoetoolError) as e:
        resolve(name)
    line = str(e.value)
    assert line.startswith(f"'{name}': --model takes no revision (@{rev}); download that revision (hf download {repo} "
                           f"--revision {rev} --local-dir DIR)"), line


def test_a_config_only_folder_says_it_has_no_weights_and_what_reads_a_config_alone(tmp_path):
    """A folder of config and tokenizer (what ``plan`` needs) given to a command that loads weights said "OSError:
    no file named model.safetensors ..." (newcomer run 4): it now says the folder holds no weight files and which
    commands read a config alone, quoted for the shell (a folder with a space in its name). With a weight file beside
    it, the load runs."""
    import shutil

    import moetool
    from moetool.loading import EMBEDDED_DIR

    src = EMBEDDED_DIR / "tiny"
    tmp_path = tmp_path / "config only"
    tmp_path.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(MoetoolError) as e:
        moetool.load(str(tmp_path))
    assert str(e.value) == (f"cannot load the weights of {tmp_path}: it holds a config and no weight files "
                            f"(*.safetensors, *.bin, *.pt, *.pth); plan and inspect read a config alone (moetool plan "
                            f"--model '{tmp_path}')")
    for f in src.glob("*.safetensors"):
        shutil.copy(f, tmp_path / f.name)
    assert moetool.load(str(tmp_path)).layers


def test_weights_under_a_name_transformers_does_not_read_are_named(tmp_path):
    """A folder of config, tokenizer and the weights as ``model.pt`` (a state dict saved by hand) said transformers'
    "OSError: Error no file named model.safetensors, or pytorch_model.bin, found" -- beside a weight file. It now
    names the file and the names transformers reads; renamed to pytorch_model.bin, it loads the same weights."""
    import shutil

    import torch
    from safetensors.torch import load_file

    import moetool
    from moetool.loading import EMBEDDED_DIR

    src = EMBEDDED_DIR / "tiny"
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    weights = load_file(src / "model.safetensors")
    torch.save(weights, tmp_path / "model.pt")
    with pytest.raises(MoetoolError) as e:
        moetool.load(str(tmp_path), tokenizer=False)
    assert str(e.value) == (f"cannot load the weights of {tmp_path}: it holds model.pt but transformers reads a "
                            f"checkpoint's weights from model.safetensors or pytorch_model.bin (or their sharded "
                            f"model.safetensors.index.json / pytorch_model.bin.index.json): save them so "
                            f"(model.save_pretrained) or rename the file")
    (tmp_path / "model.pt").rename(tmp_path / "pytorch_model.bin")
    got = moetool.load(str(tmp_path), tokenizer=False, device="cpu").model.state_dict()
    want = moetool.load("tiny", tokenizer=False, device="cpu").model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_dense_model_is_refused_before_weights(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(MoetoolError, match="no MoE layers found in llama"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_a_config_dtype_no_model_is_built_in_is_one_line_for_every_command(dtype, tmp_path):
    """A config.json recording dtype float8_e4m3fn or int8 (a quantized checkpoint's dtype written where the dtype of
    its other layers goes) was a traceback from inspect and plan ("TypeError: couldn't find storage object
    Float8_e4m3fnStorage", "ValueError: ... cannot be instantiated under dtype=torch.int8") while ppl ran: one line,
    exit 2, from each; with bfloat16 recorded, inspect describes the model."""
    import json
    import shutil

    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.loading import EMBEDDED_DIR

    shutil.copytree(EMBEDDED_DIR / "tiny", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    want = (f"error: the config of {tmp_path / 'm'} records dtype {dtype}, which no model is built in (float32, "
            f"float16, bfloat16): a quantized checkpoint records its quantization in quantization_config and the dtype "
            f"of its other layers in dtype -- fix config.json (e.g. \"dtype\": \"bfloat16\")")
    for cmd in (["inspect"], ["plan", "--json"], ["ppl", "--out", str(tmp_path / "run")]):
        out = CliRunner().invoke(app, [*cmd, "--model", str(tmp_path / "m")])
        assert out.exit_code == 2 and out.output.strip() == want, (cmd, out.output)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    out = CliRunner().invoke(app, ["inspect", "--json", "--model", str(tmp_path / "m")])
    assert out.exit_code == 0 and json.loads(out.output)["model_type"] == "mixtral", out.output


def test_unsupported_moe_family_names_supported_ones(tmp_path):
    from transformers import DiffusionGemmaConfig

    DiffusionGemmaConfig().save_pretrained(tmp_path)  # refused on purpose (issue 26)
    with pytest.raises(MoetoolError, match="unsupported MoE family 'diffusion_gemma'; supported: .*mixtral"):
        load_config(str(tmp_path))


def test_dtype_and_device_choices():
    import torch
    from transformers import MixtralConfig

    cfg = MixtralConfig()
    cfg.dtype = torch.bfloat16
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cfg, cpu) == torch.float32  # upcast on CPU
    assert pick_dtype("auto", cfg, torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("fp16", cfg, cpu) == torch.float16
    with pytest.raises(MoetoolError, match="^dtype= must be one of auto, bf16, fp16, fp32, bfloat16, "):
        pick_dtype("int8", cfg, cpu)  # from Python: the keyword and what it takes
    with pytest.raises(MoetoolError, match="--device"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(MoetoolError, match="no CUDA"):
            pick_device("cuda")


# ----- validate_run: refuse before any weight loads --------------------------------------------------------------
def _mixtral(**kw):
    from transformers import MixtralConfig

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    return MixtralConfig(**{**base, **kw})


def test_validate_run_refuses_bad_sizes_as_usage_errors():
    from moetool.sizing import validate_run

    cfg = _mixtral()
    assert validate_run(cfg, seq_len=128, batch_size=4, max_tokens=1000, device="cpu").max_positions == 128
    for kw, message in [(dict(seq_len=129), "seq_len=129 is longer than the model's 128 positions "
                                             "\\(mixtral max_position_embeddings\\): use seq_len=128 or less"),
                        (dict(seq_len=0), "seq_len= must be an integer of at least 2, not 0"),
                        (dict(seq_len=-5), "seq_len= must be"),
                        (dict(max_tokens=0), "max_tokens= must be an integer of at least 2, not 0"),
                        (dict(max_tokens=-1), "max_tokens= must be"),
                        (dict(batch_size=0), "batch_size= must be")]:
        with pytest.raises(MoetoolError, match=message) as e:
            validate_run(cfg, **{"seq_len": 64, "batch_size": 2, "max_tokens": 256, "device": "cpu", **kw})
        assert e.value.exit_code == 2


def test_validate_run_reads_positions_from_the_text_config_of_a_multimodal_model():
    from transformers import LlavaConfig

    from moetool.sizing import max_positions, validate_run

    cfg = LlavaConfig(text_config={**_mixtral(max_position_embeddings=77).to_dict(), "model_type": "mixtral"})
    assert getattr(cfg, "max_position_embeddings", None) is None and max_positions(cfg) == 77
    with pytest.raises(MoetoolError, match="longer than the model's 77 positions"):
        validate_run(cfg, seq_len=78, device="cpu", check_memory=False)


def test_a_config_with_no_positions_is_refused_not_skipped():
    """``max_position_embeddings: 0`` (a corrupt or hand-edited config) let every ``--seq-len`` through unchecked:
    the key was skipped as if absent. It is now one line naming the key, and so is a negative count."""
    from moetool.sizing import check_seq_len, validate_run

    for bad in (0, -3):
        cfg = _mixtral(max_position_embeddings=bad)
        with pytest.raises(MoetoolError, match=f"the config's max_position_embeddings is {bad} \\(mixtral\\): "
                                               "not a number of positions; fix config.json"):
            validate_run(cfg, seq_len=64, device="cpu", check_memory=False)
        with pytest.raises(MoetoolError, match="max_position_embeddings"):
            check_seq_len(cfg, None)
    assert check_seq_len(_mixtral(max_position_embeddings=128), 128) == 128


def test_validate_run_device_without_cuda_is_a_runtime_error():
    import torch

    from moetool.errors import MoetoolRuntimeError
    from moetool.sizing import validate_run

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MoetoolRuntimeError, match="no CUDA device") as e:
        validate_run(_mixtral(), seq_len=16, device="cuda")
    assert e.value.exit_code == 1


def test_memory_estimate_is_the_hand_formula_and_a_lower_bound_of_the_real_logits(monkeypatch):
    """weights = parameters x 4 bytes (fp32), activations = logits rows*S*V + two hidden states rows*S*d; rows =
    min(batch, ceil(max_tokens / S)). Refused exactly when weights + activations exceed the free memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from moetool.errors import MoetoolRuntimeError

    cfg = _mixtral()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    params = sum(p.numel() for p in model.parameters())
    S, batch, max_tokens = 100, 16, 250  # 250 tokens fill ceil(250/100) = 3 rows: batches hold 3, not 16
    weights, act = params * 4, 3 * S * 64 * 4 + 2 * 3 * S * 32 * 4
    monkeypatch.setattr(sizing, "available_memory", lambda dev: weights + act)
    est = sizing.validate_run(cfg, seq_len=S, batch_size=batch, max_tokens=max_tokens, device="cpu", dtype="fp32")
    assert (est.params, est.rows_per_batch, est.weights_bytes, est.activation_bytes) == (params, 3, weights, act)
    with torch.no_grad():  # the logits term is real: the forward's own logits tensor has exactly that size
        out = model(input_ids=torch.zeros(3, S, dtype=torch.long))
    assert out.logits.numel() * out.logits.element_size() == 3 * S * 64 * 4 <= act
    monkeypatch.setattr(sizing, "available_memory", lambda dev: weights + act - 1)
    with pytest.raises(MoetoolRuntimeError, match="a batch of 3 rows x --seq-len 100 needs at least") as e:
        sizing.validate_run(cfg, seq_len=S, batch_size=batch, max_tokens=max_tokens, device="cpu", dtype="fp32")
    assert e.value.exit_code == 1
    monkeypatch.setattr(sizing, "available_memory", lambda dev: weights - 1)
    with pytest.raises(MoetoolRuntimeError, match=f"the weights alone need .*{params:,} parameters in float32"):
        sizing.validate_run(cfg, seq_len=S, batch_size=batch, device="cpu", dtype="fp32")
    # bf16 halves both terms; device_map="auto" (accelerate offloads) and unknown free memory refuse nothing
    monkeypatch.setattr(sizing, "available_memory", lambda dev: (weights + act) // 2)
    assert sizing.validate_run(cfg, seq_len=S, batch_size=batch, max_tokens=max_tokens, device="cpu",
                                dtype="bf16").activation_bytes == act // 2
    monkeypatch.setattr(sizing, "available_memory", lambda dev: 1)
    sizing.validate_run(cfg, seq_len=S, batch_size=batch, device="cpu", device_map="auto")
    monkeypatch.setattr(sizing, "available_memory", lambda dev: None)
    sizing.validate_run(cfg, seq_len=S, batch_size=batch, device="cpu")


def test_available_ram_is_read_from_meminfo():
    from pathlib import Path

    from moetool.sizing import _meminfo_available

    avail = _meminfo_available()
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    total = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemTotal:"))
    assert avail is not None and 0 < avail <= total


def test_the_embedded_models_are_shipped():
    """The tests run on the embedded models and never skip without them: a package or checkout that lost them
    fails here (and in every test that loads one), instead of turning green by skipping."""
    from moetool.loading import embedded_models

    models = embedded_models()
    assert {"tiny", "tiny-early", "tiny-fine", "tiny-fine-early"} <= set(models)
    for path in models.values():
        assert (path / "config.json").is_file() and any(path.glob("*.safetensors")), path


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "glm4v_moe"])
def test_vision_language_families_load_and_run_from_the_cli(model_type, tmp_path):
    """A vision-language MoE family (no causal-LM head class in transformers) loads through the CLI with its own
    image-text-to-text class and is fed text only: ``moetool ppl``'s perplexity is the plain model's, by hand."""
    import json
    import shutil

    import torch
    from test_ppl import hand_ppl
    from transformers import AutoModelForImageTextToText
    from typer.testing import CliRunner

    from moetool.adapters.tiny import build_tiny
    from moetool.commands.app import app
    from moetool.data import load_tokens
    from moetool.loading import EMBEDDED_DIR

    model = build_tiny(model_type, seed=0)
    model.resize_token_embeddings(2048)  # the embedded tokenizer's vocabulary
    path = tmp_path / "model"
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_DIR / "tiny" / f, path / f)
    out = CliRunner().invoke(app, ["ppl", "--model", str(path), "--seq-len", "32", "--max-tokens", "200",
                                   "--batch-size", "8", "--bootstrap", "0", "-q", "--out", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    got = json.loads((tmp_path / "run" / "manifest.json").read_text())
    import pandas as pd

    row = pd.read_csv(tmp_path / "run" / "ppl.csv").iloc[0]
    ref = AutoModelForImageTextToText.from_pretrained(path).float().eval()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    want, n = hand_ppl(ref, load_tokens(None, tok, 32, 200), 8)
    assert got["model"]["model_type"] == model_type
    assert int(row["scored_tokens"]) == n and float(row["perplexity"]) == pytest.approx(want, rel=1e-5)
    assert torch.isfinite(torch.tensor(want))


def test_a_missing_tokenizer_file_is_named(tmp_path):
    """Issue 35 item 10: a model folder whose tokenizer.json was deleted fails in one line naming the file
    (transformers' own first line stops at "...backend tokenizer from one of:"); with the file back it loads."""
    import shutil

    from moetool.errors import MoetoolRuntimeError
    from moetool.loading import embedded_models, load_tokenizer

    src = embedded_models()["tiny"]
    folder = tmp_path / "tiny"
    folder.mkdir()
    for f in ("config.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, folder / f)
    with pytest.raises(MoetoolRuntimeError) as e:
        load_tokenizer(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and f"no tokenizer.json in {folder}" in msg, msg
    shutil.copyfile(src / "tokenizer.json", folder / "tokenizer.json")
    assert load_tokenizer(str(folder))("hello world")["input_ids"]


def test_config_fingerprint_is_the_hash_of_the_config_and_code_files_by_name(tmp_path):
    """sha256 over (name, NUL, bytes, NUL) of config.json and every *.py beside it, in path order -- written out here
    with hashlib; a code file added, edited or renamed changes it; embedded models have one, hub ids none."""
    import hashlib
    import shutil

    from moetool.loading import config_fingerprint, embedded_models

    def by_hand(folder):
        h = hashlib.sha256()
        for name in sorted(p.name for p in folder.iterdir() if p.name == "config.json" or p.suffix == ".py"):
            h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
        return h.hexdigest()

    shutil.copyfile(embedded_models()["tiny"] / "config.json", tmp_path / "config.json")
    seen = [config_fingerprint(str(tmp_path))]
    assert seen[0] == by_hand(tmp_path)
    (tmp_path / "modeling_a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not code")
    seen.append(config_fingerprint(str(tmp_path)))
    (tmp_path / "modeling_a.py").write_text("x = 2\n")
    seen.append(config_fingerprint(str(tmp_path)))
    (tmp_path / "modeling_a.py").rename(tmp_path / "modeling_b.py")
    seen.append(config_fingerprint(str(tmp_path)))
    assert seen[-1] == by_hand(tmp_path) and len(set(seen)) == 4
    tiny = embedded_models()["tiny"]
    assert config_fingerprint("tiny") == by_hand(tiny)
    assert config_fingerprint("mixtral-8x7b") is None and config_fingerprint("org/some-model") is None


def test_a_refused_load_report_names_three_keys_and_counts_the_rest():
    from moetool.loading import _keys_sample

    assert _keys_sample(["e", "b", "d", "a", "c"]) == "a, b, c, ... (2 more)"
    assert _keys_sample(["c", "a", "b"]) == "a, b, c"
    assert _keys_sample([("w", (2, 3), (3, 2))]) == "w (checkpoint [2, 3], model [3, 2])"


def test_a_header_length_past_the_file_end_is_a_bad_header(tmp_path):
    """A safetensors header length between the file's size less 8 and its size cannot be read whole: the header
    is named corrupt or truncated (not read short and called unreadable JSON)."""
    from moetool.errors import MoetoolRuntimeError
    from moetool.loading import check_safetensors

    f = tmp_path / "model.safetensors"
    for n in (13, 20):  # 20 bytes in all: at most 12 of header
        f.write_bytes(n.to_bytes(8, "little") + b"{" + b" " * 11)
        with pytest.raises(MoetoolRuntimeError, match="not a safetensors file \\(corrupt or truncated header, 20 bytes"):
            check_safetensors(tmp_path)


def test_weights_fingerprint_lists_every_weight_file_with_its_size_and_time_to_the_microsecond(tmp_path):
    """The files --resume compares: weights and config.json, each with its size in bytes and its modification time
    to the microsecond (a rewrite a quarter second later changes it); a hub id not cached is its id alone."""
    import os
    import shutil
    from datetime import datetime

    from moetool.loading import embedded_models, weights_fingerprint

    shutil.copytree(embedded_models()["tiny"], tmp_path / "m")
    folder = tmp_path / "m"
    fp = weights_fingerprint(str(folder))
    want = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    assert "config.json" in want and sorted(fp["files"]) == want
    for name, facts in fp["files"].items():
        st = os.stat(folder / name)
        assert facts["bytes"] == st.st_size > 0
        assert datetime.fromisoformat(facts["modified"]).timestamp() == pytest.approx(st.st_mtime_ns / 1e9, abs=1e-6)
    w = folder / "config.json"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 250_000_000))
    assert weights_fingerprint(str(folder))["files"]["config.json"] != fp["files"]["config.json"]
    assert weights_fingerprint("org/never-cached-model-x") == {"source": "org/never-cached-model-x"}
