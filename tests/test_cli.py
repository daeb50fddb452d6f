"""The CLI shell: fast help, one-line errors, the run-directory convention, inspect and trace."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import feed
from typer.testing import CliRunner

from moetool.commands.app import app

runner = CliRunner()

HELP_PROBE = """
import sys
from moetool.commands.app import app
for args in {runs!r}:  # one process for all: a module imported by one help stays imported, so each line after the
    sys.argv = ["moetool", *args]  # first that is not empty names the first help that imported it
    try:
        app()
    except SystemExit:
        pass
    print("HEAVY:", args, sorted(m for m in ("torch", "transformers", "pandas", "matplotlib") if m in sys.modules))
"""


def _commands():
    return sorted(c.name or c.callback.__name__ for c in app.registered_commands)


@pytest.mark.slow
def test_help_of_every_command_never_imports_torch():
    runs = [["--help"], ["--version"], *[[c, "--help"] for c in _commands()]]
    out = subprocess.run([sys.executable, "-c", HELP_PROBE.format(runs=runs)], capture_output=True, text=True,
                         check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("HEAVY: ")]
    assert lines == [f"HEAVY: {args} []" for args in runs], [ln for ln in lines if not ln.endswith(" []")][:1]


def test_unknown_model_is_one_line_exit_2():
    r = runner.invoke(app, ["inspect", "--model", "mixtral-8x7"])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'mixtral-8x7'")


@pytest.mark.parametrize("text, says", [
    ('{"model_type": "mixtral", "hidden_size": 64,', "is not a valid JSON file"),
    ('{"hidden_size": 64}', "Should have a `model_type` key"),
    ('{"model_type": "mixtral", "hidden_size": "4096"}',
     "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' expected int, got str"),
    ('{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, '
     '"num_attention_heads": 2}', "no MoE layers found in llama (a dense model?)")])
@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_a_broken_or_dense_config_is_one_line_exit_2(tmp_path, monkeypatch, command, text, says):
    """A config.json on disk that transformers cannot read is a usage error (exit 2), as a config whose top-K is out
    of range is: it exited 1, a runtime error; a field of the wrong type said only "Validation error for field
    'hidden_size':", its reason on the line that was cut."""
    monkeypatch.setenv("MOETOOL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(text)
    r = runner.invoke(app, [command, "--model", str(tmp_path / "m"), "--json"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.output


def test_aliases_listed():
    r = runner.invoke(app, ["inspect", "--aliases", "--json"])
    rows = json.loads(r.output)
    assert {"name": "olmoe", "resolves to": "allenai/OLMoE-1B-7B-0924"} in rows


@pytest.mark.parametrize("args, line", [
    (["--families", "--model", "tiny-fine"], "error: --families lists every MoE family, not one model: drop --model "
                                             "tiny-fine"),
    (["--aliases", "--model", "olmoe"], "error: --aliases lists every alias, not one model: drop --model olmoe"),
    (["--refresh"], "error: --refresh rebuilds the --families table: give --families")])
def test_inspect_listing_flags_refuse_what_they_would_ignore(args, line):
    """--families and --aliases list everything: a --model beside them, or --refresh without --families, was
    silently ignored."""
    r = runner.invoke(app, ["inspect", *args])
    assert r.exit_code == 2 and [ln for ln in r.output.splitlines() if ln.strip()] == [line]


def test_aliases_table_lists_every_alias_and_points_to_no_csv():
    """The table printed every alias after the 20th as '… 37 more rows (every row is in the run's CSV)', but
    inspect writes no CSV: every row is printed."""
    from moetool.loading import ALIASES

    r = runner.invoke(app, ["inspect", "--aliases"], env={"COLUMNS": "100"})
    assert r.exit_code == 0 and len(ALIASES) > 30
    assert "CSV" not in r.output and "more rows" not in r.output
    names = {ln.split("│")[1].strip() for ln in r.output.splitlines() if ln.count("│") >= 3}
    assert set(ALIASES) <= names


def test_inspect_counts_parameters_of_the_real_model():
    from moetool.loading import load

    r = runner.invoke(app, ["inspect", "--model", "tiny", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    lm = load("tiny", tokenizer=False)
    total = sum(p.numel() for p in lm.model.parameters())
    assert info["total_params"] == total
    # active = total minus the (n-K)/n unused share of every MoE layer's routed experts
    inactive = sum(sum(p.numel() for p in L.experts.parameters()) * (L.n_experts - L.top_k) // L.n_experts
                   for L in lm.layers)
    assert info["active_params"] == total - inactive
    assert [L["layer"] for L in info["moe_layers"]] == [L.index for L in lm.layers]
    assert info["moe_layers"][0]["n_experts"] == lm.config.num_local_experts


def test_inspect_says_how_it_counts_active_parameters(tmp_path, monkeypatch):
    """gpt-oss-20b at its published dimensions, counted by hand: 20.91B total; active 4.19B with the embedding table
    and output head, as inspect counts it (and Mistral, Qwen, OLMoE, Phi publish it), 3.61B without the embedding
    table as OpenAI publishes it. inspect printed 4.19B as 'active per token' without saying which (16% over the
    published 3.6B); it now says so and gives the embedding table's size (``embedding_params``)."""
    from transformers import GptOssConfig

    monkeypatch.setenv("MOETOOL_CACHE_DIR", str(tmp_path / "cache"))
    layers, n, k, hidden, inter, vocab, heads, kv, hd = 24, 32, 4, 2880, 2880, 201088, 64, 8, 64
    GptOssConfig(num_hidden_layers=layers, num_local_experts=n, num_experts_per_tok=k, vocab_size=vocab,
                 hidden_size=hidden, intermediate_size=inter, head_dim=hd, num_attention_heads=heads,
                 num_key_value_heads=kv, sliding_window=128, max_position_embeddings=131072,
                 tie_word_embeddings=False).save_pretrained(tmp_path / "gpt-oss-20b")
    attention = hidden * heads * hd * 2 + hidden * kv * hd * 2 + heads * hd + 2 * kv * hd + hidden + heads  # + sinks
    experts = n * (hidden * 2 * inter + 2 * inter + inter * hidden + hidden)  # with their bias rows
    per_layer = attention + experts + n * hidden + n + 2 * hidden  # router weight and bias, two norms
    embed = vocab * hidden
    total = layers * per_layer + hidden + 2 * embed
    active = total - layers * (experts * (n - k) // n)
    assert (total, active, active - embed) == (20_914_757_184, 4_187_440_704, 3_608_307_264)
    r = runner.invoke(app, ["inspect", "--model", str(tmp_path / "gpt-oss-20b"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)  # stdout alone: a logging handler an earlier test's runner closed writes to stderr
    assert (info["total_params"], info["active_params"], info["embedding_params"]) == (total, active, embed)
    r = runner.invoke(app, ["inspect", "--model", str(tmp_path / "gpt-oss-20b")], env={"COLUMNS": "300"})
    assert (f"active per token {active:,} (0.200 of the total; embedding table and output head included, "
            f"{active - embed:,} without the {embed:,} of the embedding table)") in r.stdout


def test_trace_matches_the_routers_own_choice(tmp_path):
    import pandas as pd
    import torch

    from moetool.data import load_tokens
    from moetool.loading import load

    out = tmp_path / "t"
    r = runner.invoke(app, ["trace", "--model", "tiny", "--max-tokens", "300", "--seq-len", "64", "--out", str(out),
                            "--logits", "--quiet"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "trace.csv.gz")
    man = json.loads((out / "manifest.json").read_text())
    assert "trace.csv.gz" in man["files"] and man["model"]["name"] == "tiny"
    lm = load("tiny")
    ts = load_tokens(None, lm.tokenizer, 64, 300)
    assert len(df) == ts.n_tokens * len(lm.layers)  # one row per real token and MoE layer
    # independent check of one layer: plain forward, hidden state into the router by hand
    first = df[(df.row == 0)]
    L = lm.layers[-1]
    got = {}

    def grab(module, args, out):
        got["h"] = args[0]

    handle = L.router.register_forward_hook(grab)
    with torch.no_grad():
        feed(lm.model, ts.input_ids[:1], ts.attention_mask[:1])
    handle.remove()
    logits = torch.nn.functional.linear(got["h"].reshape(-1, got["h"].shape[-1]), L.router.weight).detach().cpu()
    top = torch.topk(torch.softmax(logits.float(), -1), L.top_k).indices
    sel = first[first.layer == L.index].sort_values("pos")
    n_real = int(ts.attention_mask[0].sum())
    assert len(sel) == n_real
    assert (sel[[f"expert_{k + 1}" for k in range(L.top_k)]].to_numpy() == top[:n_real].numpy()).all()
    assert abs(sel["logit_0"].to_numpy() - logits[:n_real, 0].numpy()).max() < 1e-4


def test_out_dir_refused_unless_force(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = runner.invoke(app, ["trace", "--max-tokens", "64", "--out", str(tmp_path), "--quiet"])
    assert r.exit_code == 2 and "not empty" in r.output
    r = runner.invoke(app, ["trace", "--max-tokens", "64", "--out", str(tmp_path), "--quiet", "--force"])
    assert r.exit_code == 0, r.output


def test_bad_policy_is_one_line_error(tmp_path):
    r = runner.invoke(app, ["trace", "--routing", "nrom:gate", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "unknown routing policy 'nrom'" in r.output and "did you mean 'norm'" in r.output


def test_inspect_prints_layers_described_alike_as_one_row():
    """The console table groups the MoE layers whose every column is equal (a 58-layer DeepSeek-V3 is one row, not 58)
    into runs of layer indices, and a scoring rule shared by every layer is one line above it, not a column."""
    from moetool.errors import spans as _spans

    assert _spans([7, 0, 1, 2, 3, 5, 8]) == "0-3, 5, 7-8" and _spans([4]) == "4" and _spans([]) == ""
    for name in ("tiny", str(Path(__file__).parents[1] / "examples" / "configs" / "deepseek-v3")):
        info = json.loads(runner.invoke(app, ["inspect", "--model", name, "--json"]).output)
        r = runner.invoke(app, ["inspect", "--model", name], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in r.output.splitlines() if ln.count("│") >= 3]
        layers = [L["layer"] for L in info["moe_layers"]]
        assert len(rows) == 1 and rows[0][0] == f"{min(layers)}-{max(layers)}" == _spans(layers), r.output
        first = info["moe_layers"][0]
        assert rows[0][1:3] == [str(first["n_experts"]), str(first["top_k"])]
        assert f"scoring (every MoE layer): {first['scoring']}" in r.output
        if info["dense_layers"]:
            assert f"dense (non-MoE) decoder layers: {_spans(info['dense_layers'])}" in r.output


@pytest.mark.parametrize("steps", ["", " ", ",", " , "])
def test_demo_with_no_step_is_one_line_not_every_step(steps, tmp_path):
    """`demo --steps ""` ran all 17 steps (an empty value read as 'not given'), while `--layers ""` was refused."""
    r = runner.invoke(app, ["demo", "--steps", steps, "--out", str(tmp_path / "d")])
    assert r.exit_code == 2
    assert [ln for ln in r.output.splitlines() if ln.strip()] == [f"error: empty list of steps: '{steps}'"]
    assert not (tmp_path / "d").exists()


# headings only (no_figures): the erc step draws erc's figures, tests/test_erc.py's and test_help_files.py's to check
def test_demo_numbers_its_steps(tmp_path, no_figures):
    """A fresh clone's ``moetool demo`` ran for minutes under headings ``== stats``, ``== norm-select``, ... with no
    sign of how many of its 17 steps were left: each heading now says which step of how many it is, counted over
    the steps asked (``--steps erc,inspect``: 2, in the demo's own order, inspect first)."""
    r = runner.invoke(app, ["demo", "--steps", "erc,inspect", "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.output.splitlines() if ln.startswith("== ")] == ["== inspect (1/2)", "== erc (2/2)"]


def test_demo_from_python_with_an_empty_list_is_refused(tmp_path):
    from moetool.demo import demo
    from moetool.errors import MoetoolError

    with pytest.raises(MoetoolError, match=r"^give at least one demo step \(None: every step\); steps: inspect, "):
        demo(tmp_path / "d", [])
    assert not (tmp_path / "d").exists()


def test_python_dash_m_from_the_checkouts_root_finds_the_commands(tmp_path):
    """``python -m moetool`` / ``torchrun -m moetool`` from the repository's root after ``pip install .``: the
    checkout's ``moetool/`` shadows the installed copy, and ``commands/`` sits at the repository's top (installed as
    ``moetool.commands``). Simulated by dropping an editable install's finder: the package still finds its commands
    (before: ``ModuleNotFoundError: No module named 'moetool.commands'``, a raw traceback)."""
    root = Path(__file__).resolve().parents[1]
    code = ("import runpy, sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "sys.argv = ['moetool', '--version']\n"
            "import moetool\n"
            f"assert moetool.__file__ == {str(root / 'moetool' / '__init__.py')!r}, moetool.__file__\n"
            "runpy.run_module('moetool', run_name='__main__', alter_sys=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "moetool 0.1.0", r.stdout + r.stderr


def test_inspect_never_cuts_a_number_at_80_columns(tmp_path, monkeypatch):
    """``inspect``'s layer table is the console's table (paged, numbers whole): at 80 columns Qwen3-30B-A3B's
    expert parameters per layer read 603,979,776 (thousands separators as the parameters line above it; raw
    ``603979776`` before), not ``603,979,7…`` (rich's own table cut the cell)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                   num_experts_per_tok=8, head_dim=128).save_pretrained(tmp_path / "q3")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("MOETOOL_CACHE_DIR", str(tmp_path / "cache"))
    r = runner.invoke(app, ["inspect", "--model", str(tmp_path / "q3")])
    assert r.exit_code == 0, r.output
    assert "603,979,776" in r.output and "…" not in r.output and "603979776" not in r.output, r.output
    assert 128 * 3 * 2048 * 768 == 603979776  # the number by hand: 128 experts x (gate, up, down) x d x width
