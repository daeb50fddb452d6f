"""The Python API: light import, the example tour runs, and each command writes exactly its API function's tables."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import moetool
from moetool.commands.app import app
from moetool.errors import MoetoolError

ROOT = Path(__file__).resolve().parents[1]


def test_import_is_light_and_names_resolve_lazily():
    code = ("import sys, moetool; assert 'torch' not in sys.modules; f = moetool.stats; o = moetool.load; "
            "assert 'torch' not in sys.modules, 'resolving an API function imported torch'; print(f.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stats"
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        moetool.nonsense  # noqa: B018
    from moetool.api import EXPORTS

    assert set(EXPORTS) <= set(dir(moetool))
    for name in ("load", "tokens", "stats", "norm_select", "erc", "approx", "mass_recall", "fluctuation", "trace",
                 "ppl", "evaluate", "hook"):
        assert callable(getattr(moetool, name)) and getattr(moetool, name).__doc__, name


def test_star_import_and_the_readme_give_the_public_api():
    """``moetool`` had no ``__all__``: ``from moetool import *`` bound ``annotations``, ``importlib`` and whatever
    submodules were loaded, and none of the API. ``moetool.__all__`` is every name of ``import moetool``
    (:data:`moetool.api.EXPORTS`), and the README's "Python API" section names every one of its functions and types
    (it left out 9 of the 20 experiments' functions, and said "every command has its function")."""
    import re

    from moetool.api import EXPORTS

    assert sorted(moetool.__all__) == sorted(EXPORTS)
    code = ("import sys; ns = {}; exec('from moetool import *', ns); names = {n for n in ns if not n.startswith('_')}; "
            "print(' '.join(sorted(names)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == set(EXPORTS)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):text.index("\n## ", text.index("## Python API") + 1)]
    blocks = re.findall(r"```.*?```", section, flags=re.S)  # the example, then the names in `code` in the text
    code = " ".join([*blocks, *re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", section, flags=re.S))])
    named = set(re.findall(r"[A-Za-z_]\w*", code))
    wanted = {n for n in EXPORTS if not n.endswith("Options")}  # the options as `moetool.<Name>Options`
    assert wanted <= named, sorted(wanted - named)
    assert "moetool.<Name>Options" in section


def test_options_are_checked_before_any_work():
    with pytest.raises(MoetoolError, match="unknown option"):
        moetool.stats(None, None, top_n=3)
    with pytest.raises(MoetoolError, match="must be a StatsOptions"):
        moetool.stats(None, None, moetool.ErcOptions())


@pytest.mark.parametrize("call, kw, message", [
    ("margin", {"eps": "0.1"}, "MarginOptions eps (--eps) must be a tuple of numbers, not '0.1' (str)"),
    ("margin", {"eps": 0.1}, "MarginOptions eps (--eps) must be a tuple of numbers, not 0.1 (float)"),
    ("margin", {"policies": "norm:gate"}, "MarginOptions policies (--policies) must be a tuple of strings, not"),
    ("stats", {"layers": 3}, "StatsOptions layers must be a tuple of integers or None, not 3 (int)"),
    ("topk", {"ks": 2}, "TopkOptions ks (--ks) must be a tuple of integers or None, not 2 (int)"),
    ("stats", {"top_tokens": "5"}, "StatsOptions top_tokens (--top-tokens) must be an integer, not '5' (str)"),
    ("ppl", {"bootstrap": "0"}, "PplOptions bootstrap must be an integer, not '0' (str)"),
    ("ppl", {"baseline": "no"}, "PplOptions baseline (--baseline) must be True or False, not 'no'"),
    ("ppl", {"routing": 3}, "PplOptions routing must be a string, not 3 (int)"),
    ("ppl", {"batch_size": 0}, "batch_size= must be an integer of at least 1, not 0"),
    ("margin", {"batch_size": -1}, "batch_size= must be an integer of at least 1, not -1"),
])
def test_options_of_the_wrong_type_or_size_are_one_line_before_any_work(call, kw, message):
    """A keyword of the wrong type (which the command line's parsing never lets through) or no rows per forward
    names the option before the model is touched (``None`` here): never a TypeError from the options' own checks
    or a ZeroDivisionError in the batching."""
    with pytest.raises(MoetoolError) as e:
        getattr(moetool, call)(None, None, **kw)
    assert message in str(e.value)


def test_tokens_refuses_sizes_and_models_it_cannot_pack_for():
    """``moetool.tokens`` checks its sizes as ``--seq-len`` / ``--max-tokens`` are (a string or a float is not a
    size, rows longer than the model's positions are refused before reading), and its model."""
    lm = moetool.load("tiny")
    for kw, message in (({"seq_len": 100000}, "seq_len=100000 is longer than the model's 1024 positions"),
                        ({"seq_len": "64"}, "seq_len= must be an integer of at least 2, not '64'"),
                        ({"max_tokens": 0}, "max_tokens= must be an integer of at least 2, not 0")):
        with pytest.raises(MoetoolError) as e:
            moetool.tokens(lm, None, **{"seq_len": 64, "max_tokens": 256, **kw})
        assert message in str(e.value)
    with pytest.raises(MoetoolError, match=r"takes a loaded model \(moetool.load\(...\)\), not 'tiny'"):
        moetool.tokens("tiny", None)


def test_an_experiment_given_a_name_or_a_path_for_its_model_or_tokens_says_what_to_pass():
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    with pytest.raises(MoetoolError, match=r"moetool.ppl takes a loaded model \(lm = moetool.load\(...\)\), not 'tiny'"):
        moetool.ppl("tiny", tokens, bootstrap=0)
    with pytest.raises(MoetoolError, match=r"moetool.erc takes a loaded model"):
        moetool.erc("tiny")
    for wrong in ("my.jsonl", tokens.input_ids):
        with pytest.raises(MoetoolError, match=r"moetool.stats takes packed tokens \(moetool.tokens\(lm, data, ...\)\)"):
            moetool.stats(lm, wrong, bootstrap=0)


def test_inputs_of_the_wrong_kind_are_one_line_not_a_raw_error(tmp_path):
    """Each of these raised an AttributeError or a TypeError from inside: no tokens at all (after the options are
    checked), a file name as ``moetool.run``'s tokens, a number as a model's name, a lone function as consumers."""
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    for call in ("ppl", "stats", "margin", "placement"):
        with pytest.raises(MoetoolError, match=r"^no tokens given: pass packed tokens \(moetool.tokens\(lm, data"):
            getattr(moetool, call)(lm, None, quiet=True)
    with pytest.raises(MoetoolError, match="unknown option"):  # the options still come first
        moetool.ppl(lm, None, nope=1)
    with pytest.raises(MoetoolError, match=r"^moetool.run\('ppl', ...\) takes packed tokens .*not str 'text.txt'"):
        moetool.run("ppl", lm, "text.txt", out=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    for name in (5, None, ["tiny"]):
        with pytest.raises(MoetoolError, match=r"^a model is named by a string .* or a path, not "):
            moetool.load(name)
    assert moetool.load(Path(lm.source)).name  # a path object is a name
    for consumers, message in [(print, r"^consumers is a list of callables \(consumers=\[c\]\), not <built-in"),
                               (3, r"^consumers is a list of callables"),
                               ([lambda ev: None, 1], r"^each of consumers .* 1 is not callable")]:
        with pytest.raises(MoetoolError, match=message):
            moetool.forward(lm, tokens, consumers=consumers)
    seen = []
    moetool.forward(lm, tokens, consumers=(seen.append,), quiet=True)  # any iterable of callables
    assert len(seen) == len(lm.layers) * tokens.n_batches(8)


def test_a_model_tensor_or_table_passed_by_mistake_is_named_in_one_line(tmp_path):
    """A newcomer's likeliest slips: the transformers model (``lm.model``) for the loaded one, the ids tensor for the
    packed tokens, one loaded model for fluctuation's list, a DataFrame or a name for a Result. Each message
    embedded the object's repr cut at 300 characters: 3 to 7 lines of a module or tensor dump
    (``...not MixtralForCausalLM(\\n  (model): MixtralModel(...``); ``moetool.figures('stats')`` was an
    AttributeError from the plots."""
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    hf, ids = lm.model, tokens.input_ids
    table = moetool.aliases()
    model_kind, ids_kind = f"a {type(hf).__name__}", f"a Tensor of shape ({ids.shape[0]}, {ids.shape[1]})"
    cases = [(lambda: moetool.stats(hf, tokens, quiet=True), model_kind),
             (lambda: moetool.stats(lm, ids, quiet=True), ids_kind),
             (lambda: moetool.hook(lm.model), model_kind),
             (lambda: moetool.forward(hf, tokens), model_kind),
             (lambda: moetool.forward(lm, ids), ids_kind),
             (lambda: moetool.forward(lm, tokens, consumers=hf), model_kind),
             (lambda: moetool.fluctuation(lm, tokens, quiet=True), f"a {type(lm).__name__}"),
             (lambda: moetool.run("stats", hf, tokens, out=tmp_path / "r"), model_kind),
             (lambda: moetool.placement(lm, tokens, reference=ids, quiet=True), ids_kind),
             (lambda: moetool.placement(lm, tokens, reference_model=hf, quiet=True), model_kind),
             (lambda: moetool.tokens(lm, ids), ids_kind),
             (lambda: moetool.tokens(hf), model_kind),
             (lambda: moetool.write(table, tmp_path / "w"), f"a DataFrame of shape ({len(table)}, 2)"),
             (lambda: moetool.figures(table), f"a DataFrame of shape ({len(table)}, 2)"),
             (lambda: moetool.figures("stats"), "'stats'")]
    for call, kind in cases:
        with pytest.raises(MoetoolError) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).endswith(f", not {kind}"), str(e.value)[:400]
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


def test_forward_refuses_layers_without_a_policy_and_hooks_only_moe_layers():
    """``moetool.forward(lm, t, layers=[1], consumers=[c])`` ignored ``layers`` (it says where a policy routes) and
    hooked every MoE layer: a consumer counting events saw all of them. It is refused; ``moe_layers`` hooks some."""
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    seen = []
    with pytest.raises(MoetoolError, match=r"^moetool.forward: layers= picks the layers a policy= routes in"):
        moetool.forward(lm, tokens, layers=[1], consumers=[seen.append], quiet=True)
    assert seen == []
    moetool.forward(lm, tokens, moe_layers=[lm.layers[1]], consumers=[seen.append], quiet=True)
    assert {ev.layer.index for ev in seen} == {lm.layers[1].index} and len(seen) == tokens.n_batches(8)


def test_hook_refuses_layers_without_a_policy():
    """``moetool.hook(lm, layers=[1], consumers=[c])`` ignored ``layers`` (it says where a policy routes), as
    ``moetool.forward`` did: one forward of the 4-MoE-layer tiny model handed 4 events, not layer 1's one."""
    import torch

    lm = moetool.load("tiny")
    ids = moetool.tokens(lm, None, seq_len=32, max_tokens=64).input_ids[:1]
    seen = []
    with pytest.raises(MoetoolError, match=r"^moetool.hook: layers= picks the layers a policy= routes in"):
        with moetool.hook(lm, layers=[1], consumers=[seen.append]):
            lm.model(input_ids=ids)
    assert seen == []
    with moetool.hook(lm, policy="random", layers=[1], consumers=[seen.append]):  # with a policy: where it routes
        lm.model(input_ids=ids)
    assert [ev.layer.index for ev in seen] == [L.index for L in lm.layers]
    rerouted = [ev.chosen_idx is not None and not torch.equal(ev.chosen_idx, ev.idx) for ev in seen]
    assert rerouted == [L.index == 1 for L in lm.layers]


def test_fluctuation_given_one_name_mixed_checkpoints_or_no_tokens_says_what_to_pass():
    """``moetool.fluctuation("tiny", tokens)`` read the name letter by letter ('unknown model 'y''); a str, None or a
    tensor for its tokens raised an AttributeError (no ``describe``); names mixed with a loaded model an
    AttributeError after the first checkpoint's forward. Each is one line before any model loads."""
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    for checkpoints in ("tiny", Path("tiny")):
        for call in (lambda: moetool.fluctuation(checkpoints, tokens, bootstrap=0),
                     lambda: moetool.fluctuation(checkpoints=checkpoints, tokens=tokens, bootstrap=0)):
            with pytest.raises(MoetoolError, match=r"^moetool.fluctuation takes a list of two or more checkpoints "
                                                   r"\(names or paths, or models from moetool.load\), not 'tiny'"):
                call()
    with pytest.raises(MoetoolError, match=r"^moetool.fluctuation takes checkpoints all named or all loaded "
                                           r"\(moetool.load\(...\)\), not str, LoadedModel"):
        moetool.fluctuation(["tiny-early", lm], tokens, bootstrap=0)
    with pytest.raises(MoetoolError, match=r"^moetool.fluctuation takes checkpoints all named or all loaded"):
        moetool.fluctuation([1, 2], tokens, bootstrap=0)
    for wrong in ("my.jsonl", tokens.input_ids):
        with pytest.raises(MoetoolError, match=r"^moetool.fluctuation takes packed tokens \(moetool.tokens"):
            moetool.fluctuation(["tiny-early", "tiny"], wrong, bootstrap=0)
    with pytest.raises(MoetoolError, match=r"^no tokens given: pass packed tokens"):
        moetool.fluctuation(["tiny-early", "tiny"], None, bootstrap=0)
    with pytest.raises(MoetoolError, match="unknown option"):  # the options still come first
        moetool.fluctuation(["tiny-early", "tiny"], None, nope=1)


def test_options_of_the_right_type_in_other_containers_still_run():
    """Lists, ranges and numpy values fit the tuple fields as before."""
    import numpy as np

    from moetool.experiments.result import resolve_options

    opts = resolve_options(moetool.MarginOptions, None, {"eps": [0.1], "layers": range(1, 3),
                                                         "thresholds": np.array([0.01])})
    assert list(opts.layers) == [1, 2]
    assert resolve_options(moetool.CapacityOptions, moetool.CapacityOptions(cfs=(1, float("inf"))), {}).cfs[0] == 1
    assert resolve_options(moetool.MarginOptions, None, {"batch_size": np.int64(4)}).batch_size == 4  # a size too
    with pytest.raises(MoetoolError, match=r"batch_size= must be an integer of at least 1, not np.int64\(0\)"):
        resolve_options(moetool.MarginOptions, None, {"batch_size": np.int64(0)})


def test_a_list_value_given_twice_is_one_line_not_a_row_computed_twice():
    """The command line's list parser keeps a repeated value once (``--codebook-size 8,8`` runs 8 once); the library
    ran it twice: mass_recall(codebook_sizes=(8, 8)) wrote one row per (G, M) with every token counted twice
    (tokens 2x the real tokens), margin and offload wrote each row twice, norm_select(nodes=('gate', 'gate'))
    stopped in a pandas ValueError. A repeat in any list option is one line naming its flag, before any work."""
    from moetool.experiments.result import resolve_options

    with pytest.raises(MoetoolError, match=r"^--codebook-size: 8 is given twice in \[8, 4, 8\]"):
        resolve_options(moetool.MassRecallOptions, None, {"codebook_sizes": [8, 4, 8]})
    with pytest.raises(MoetoolError, match=r"^--centroids: 'unit' is given twice in \['unit', 'raw', 'unit'\]"):
        resolve_options(moetool.MassRecallOptions, moetool.MassRecallOptions(centroids=("unit", "raw", "unit")), {})
    with pytest.raises(MoetoolError, match=r"^--nodes: 'gate' is given twice"):
        resolve_options(moetool.NormSelectOptions, None, {"nodes": ("gate", "up", "gate")})
    assert resolve_options(moetool.MarginOptions, None, {"eps": (0.1, 0.2)}).eps == (0.1, 0.2)  # no repeat: as given
    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=16, max_tokens=64)
    for call, kw in (("mass_recall", {"codebook_sizes": (4, 4), "shortlists": (2,), "layers": (1,)}),
                     ("offload", {"capacities": (4, 4), "layers": (1,)}), ("margin", {"eps": (0.1, 0.1)}),
                     ("norm_select", {"norms": ("l2", "l2")})):
        with pytest.raises(MoetoolError, match="is given twice"):
            getattr(moetool, call)(lm, toks, bootstrap=0, quiet=True, **kw)


def _tables_equal(frame: pd.DataFrame, path: Path, drop: tuple[str, ...] = ()) -> None:
    """The API frame, through the same CSV round trip, equals the command's file."""
    buf = io.StringIO()
    frame.to_csv(buf, index=False)
    buf.seek(0)
    api = pd.read_csv(buf, keep_default_na=False).drop(columns=list(drop))
    cli = pd.read_csv(path, keep_default_na=False).drop(columns=list(drop))
    pd.testing.assert_frame_equal(api, cli)


@pytest.mark.slow
def test_api_tour_runs_and_its_probe_matches_the_trace(tmp_path):
    spec = importlib.util.spec_from_file_location("api_tour", ROOT / "examples" / "api_tour.py")
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    got = tour.main(tmp_path)
    assert (tmp_path / "load_by_expert.png").stat().st_size > 0
    assert (tmp_path / "stats" / "figures" / "load_heatmap.png").is_file()
    for name in got["stats"].tables:
        _tables_equal(got["stats"].tables[name], tmp_path / "stats" / name)
    # independent check of the custom consumer: the same rate from moetool.trace's per-token rows
    lm = moetool.load("tiny")
    tr = moetool.trace(lm, moetool.tokens(lm, None, seq_len=128, max_tokens=2048), quiet=True)["trace"]
    tr = tr.sort_values(["layer", "row", "pos"])
    prev = tr.groupby(["layer", "row"])["expert_1"].shift()
    adjacent = tr.groupby(["layer", "row"])["pos"].diff() == 1
    for layer, rate in got["repeat_rate"].items():
        sel = (tr["layer"] == layer) & adjacent
        assert got["pairs"][layer] == int(sel.sum())
        assert rate == pytest.approx(float((tr.loc[sel, "expert_1"] == prev[sel]).mean()), abs=0)


@pytest.mark.slow
def test_api_tour_help_and_an_empty_out_dir_write_nothing(tmp_path, monkeypatch, capsys):
    """``api_tour.py --help`` prints its usage (it wrote the tour into a folder named '--help'); an empty OUT_DIR
    (Path('') = the current folder) is refused in one line, exit 2: nothing is written in either case. The script
    runs in this process as ``python api_tour.py ARGS`` runs it (``runpy`` as ``__main__``, its ``sys.argv``, its
    folder): what is checked is argparse's exit code and output, not a start of python (a fresh one importing torch
    and matplotlib cost ~5 s of CPU for the two calls)."""
    import runpy

    tour = str(ROOT / "examples" / "api_tour.py")
    monkeypatch.chdir(tmp_path)

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", [tour, *args])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            runpy.run_path(tour, run_name="__main__")
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    code, out, err = run("--help")
    assert code == 0, err
    assert out.startswith("usage: api_tour.py [-h] [OUT_DIR]")
    code, out, err = run(" ")
    assert code == 2 and err.strip().splitlines()[-1] == "api_tour.py: error: OUT_DIR is empty"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_commands_write_exactly_the_api_tables(tmp_path, no_figures):
    # tables only (no_figures): the figures these commands draw are checked by tests/test_help_files.py
    runner = CliRunner()
    data = ["--max-tokens", "512", "--seq-len", "64"]
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=512)

    r = runner.invoke(app, ["stats", *data, "--top-tokens", "3", "--min-count", "2", "--out", str(tmp_path / "s"),
                            "-q"])
    assert r.exit_code == 0, r.output
    res = moetool.stats(lm, tokens, top_tokens=3, min_count=2, quiet=True)
    assert sorted(res.tables) == sorted(p.name for p in (tmp_path / "s").glob("*.csv"))
    for name, frame in res.tables.items():
        _tables_equal(frame, tmp_path / "s" / name)

    r = runner.invoke(app, ["norm-select", *data, "--nodes", "gate,output", "--layers", "1-2",
                            "--out", str(tmp_path / "n"), "-q"])
    assert r.exit_code == 0, r.output
    res = moetool.norm_select(lm, tokens, nodes=("gate", "output"), layers=(1, 2), quiet=True)
    _tables_equal(res["agreement"], tmp_path / "n" / "agreement.csv")
    _tables_equal(res["quality"], tmp_path / "n" / "quality.csv", drop=("seconds",))  # wall time

    r = runner.invoke(app, ["erc", "--samples", "2", "--layers", "0,3", "--out", str(tmp_path / "e"), "-q"])
    assert r.exit_code == 0, r.output
    res = moetool.erc(lm, samples=2, layers=(0, 3), quiet=True)
    for name in ("erc", "erc_layers", "erc_matrix"):
        _tables_equal(res[name], tmp_path / "e" / f"{name}.csv")
    assert sorted(res["erc_layers"]["layer"]) == [0, 3]


def test_every_command_has_its_python_function():
    """`import moetool` offers what the CLI offers: one API function per command (eval -> evaluate; inspect,
    report and demo are also subpackage names, so their functions are inspect_model, write_report, run_demo)."""
    import moetool
    from moetool.commands.app import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert names >= {"stats", "norm-select", "offload", "report", "demo", "inspect"}
    for name in names:
        fn = getattr(moetool, {"eval": "evaluate", "inspect": "inspect_model", "report": "write_report",
                               "demo": "run_demo"}.get(name, name.replace("-", "_")))
        assert callable(fn) and fn.__doc__, name


@pytest.mark.slow
def test_inspect_and_families_from_python(monkeypatch):
    """``moetool.families()`` is the families table (built, cached, read back) as a DataFrame. Each row is
    ``inspect.family_row``'s, which tests/test_families.py (test_readme_families_agree_with_the_source) checks for
    every model type against the README on the same tiny models: here mixtral's and an unsupported type's rows are
    real and the others stand-ins (building all ~86 tiny models again cost 12-25 s of CPU)."""
    import moetool
    import moetool.inspect as mi
    from test_rules import EXPECTED_RULE

    from moetool.adapters import discovery

    assert moetool.inspect_model("tiny")["family"] == "mixtral"
    real, unsupported = mi.family_row, sorted(discovery.UNSUPPORTED)[0]
    mixtral = real("mixtral")
    monkeypatch.setattr(mi, "family_row", lambda mt: real(mt) if mt in ("mixtral", unsupported) else
                        {**mixtral, "model_type": mt})
    df = moetool.families()
    rows = mi.families()  # the cached table
    assert list(df.model_type) == [r["model_type"] for r in rows] == discovery.moe_model_types() and len(df) > 50
    assert df.to_dict(orient="records") == rows
    by_type = df.set_index("model_type")
    assert by_type.loc["mixtral", "routing"] == EXPECTED_RULE["mixtral"] and by_type.loc["mixtral", "supported"] == "yes"
    assert by_type.loc[unsupported, "supported"] == "no: " + discovery.UNSUPPORTED[unsupported]


def test_write_records_the_results_model_and_compute_time(tmp_path):
    """moetool.write(res, out) with no model= records the model the result was computed on, and a wall time from
    the start of the computation (it was model: null and the seconds of the write)."""
    import json
    import time
    from datetime import datetime

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=256)
    res = moetool.ppl(lm, tokens, quiet=True)
    assert res.model["name"] == "tiny" and res.wall_seconds > 0
    time.sleep(1.2)  # a result written later still records when its computation ran
    m = json.loads((moetool.write(res, tmp_path / "p") / "manifest.json").read_text())
    assert m["model"]["name"] == "tiny" and m["model"]["model_type"] == "mixtral"
    assert m["started"] == datetime.fromtimestamp(res.started).isoformat(timespec="seconds")
    assert m["wall_seconds"] >= res.wall_seconds + 1.2


def test_demo_sub_runs_record_the_wall_time_of_their_work(tmp_path, monkeypatch):
    """A demo step's per-model run starts before its model loads and its work runs (the norm-select demo
    recorded 4.4 s for a 126 s step: its folder was made at the write)."""
    import json
    import time

    from moetool.demo import run_step
    from moetool.experiments.registry import Demo, Experiment
    from moetool.experiments.result import Result
    from moetool.report import RunDir

    def one(lm, options, quiet=False):
        time.sleep(1.5)
        return Result("custom", {"x.csv": pd.DataFrame({"a": [1]})})

    spec = Experiment(name="custom", module="-", function="one", inputs="weights", lines=None,
                      demo=Demo(models=("tiny",), seq_len=None))
    monkeypatch.setattr(Experiment, "load", lambda self, attr=None: one)
    parent = RunDir.create("demo", tmp_path / "demo")
    run_step(parent, spec)
    sub = json.loads((tmp_path / "demo" / "custom" / "tiny" / "manifest.json").read_text())
    step = json.loads((tmp_path / "demo" / "custom" / "manifest.json").read_text())
    assert sub["wall_seconds"] >= 1.5 and step["wall_seconds"] >= sub["wall_seconds"]


def test_moetool_run_is_the_callable_module_whichever_import_comes_first():
    """``moetool.run`` is the run module, callable as :func:`moetool.run.run`, whether ``moetool.run`` was reached as
    the package's attribute first (it once became the bare function then, and ``from moetool import run`` lost the
    module's ``start_run``) or imported as a module first."""
    for first in ("import moetool; moetool.run", "import moetool.run"):
        code = f"{first}; from moetool import run; print(callable(run), hasattr(run, 'start_run'))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "True"], first


def test_moetool_run_shows_the_signature_and_parameters_of_the_run():
    """``inspect.signature(moetool.run)`` (what a notebook's ``moetool.run?`` and an editor show) was
    ``(*args, **kwargs)``, and ``help(moetool.run)`` opened on the module's internals without the call's
    parameters; now the signature is :func:`moetool.run.run`'s and the module's doc names how to call it."""
    import inspect

    sig = inspect.signature(moetool.run)
    assert list(sig.parameters)[:4] == ["experiment", "lm", "tokens", "options"]
    assert sig.parameters["batch_size"].default is None and sig.parameters["resume"].default is False
    assert "help(moetool.run.run)" in inspect.getdoc(moetool.run)
    assert moetool.run.__call__.__doc__ == moetool.run.run.__doc__


def test_agreement_takes_a_models_name_as_its_docstring_says():
    """``moetool.agreement("tiny", tokens)``: the experiment loads the model once per precision from its name (its
    docstring and the command do this); the API wrapper refused the name as "takes a loaded model"."""
    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=128)
    kw = dict(precisions=("fp32", "bf16"), bootstrap=0, layers=(1,), quiet=True)
    by_name = moetool.agreement("tiny", toks, **kw)
    loaded = moetool.agreement(lm, toks, **kw)
    pd.testing.assert_frame_equal(by_name["agreement"], loaded["agreement"])
    with pytest.raises(MoetoolError, match="takes packed tokens"):
        moetool.agreement("tiny", "text.jsonl", **kw)


def test_write_report_refuses_no_run_folders_and_defaults_out_as_the_command(tmp_path, monkeypatch):
    """``moetool report`` with no RUN_DIR is refused; ``moetool.write_report([], out)`` wrote an empty report, and
    ``out`` had no default (the command's --out is runs/report-<time>)."""
    import inspect

    with pytest.raises(MoetoolError, match="run folders to gather"):
        moetool.write_report([], tmp_path / "rep")
    with pytest.raises(MoetoolError, match="run folders to gather"):
        moetool.write_report(str(tmp_path), tmp_path / "rep")
    assert not (tmp_path / "rep").exists()
    assert inspect.signature(moetool.write_report).parameters["out"].default is None
    res = moetool.erc(moetool.load("tiny", tokenizer=False), quiet=True)
    run = moetool.write(res, tmp_path / "erc")
    monkeypatch.chdir(tmp_path)
    page = moetool.write_report([run])
    assert page.name == "report.html" and page.resolve().parent.parent == tmp_path / "runs"


def test_inspect_aliases_and_families_refresh_from_python(monkeypatch):
    """``moetool inspect --aliases`` and ``--families --refresh`` had no Python equivalent (``moetool.aliases`` did
    not exist, ``moetool.families()`` took no ``refresh``); now the same rows as the command's --json."""
    import json

    out = CliRunner().invoke(app, ["inspect", "--aliases", "--json"])
    assert out.exit_code == 0, out.output
    assert moetool.aliases().to_dict(orient="records") == json.loads(out.output)
    import moetool.inspect as mi

    seen = []
    monkeypatch.setattr(mi, "families", lambda model_types=None, *, cache=True: seen.append(cache) or [])
    moetool.families(refresh=True)
    moetool.families()
    assert seen == [False, True]


def test_from_trace_gives_the_commands_trace_tables(tmp_path, no_figures):
    """``moetool stats|placement|offload --trace RUN`` had no Python equivalent (only internal modules); now
    ``moetool.from_trace(name, RUN, ...)`` returns the same tables, and refuses what needs a forward in one line."""
    # tables only (no_figures): the figures of runs from a trace are tests/test_readme.py's (which_trace_analyses)
    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    moetool.run("trace", lm, toks, out=tmp_path / "tr", quiet=True)
    runner = CliRunner()
    for name, flags, kw in (("stats", ["--top-tokens", "3", "--min-count", "2"], dict(top_tokens=3, min_count=2)),
                            ("placement", ["--gpus", "2,4"], dict(gpus=(2, 4))),
                            ("offload", ["--max-tokens", "100", "--bootstrap", "0"], dict(max_tokens=100,
                                                                                          bootstrap=0))):
        out = runner.invoke(app, [name, "--trace", str(tmp_path / "tr"), "--out", str(tmp_path / name), "--quiet",
                                  *flags])
        assert out.exit_code == 0, out.output
        res = moetool.from_trace(name, tmp_path / "tr", **kw)
        csvs = sorted(p.name for p in (tmp_path / name).glob("*.csv"))
        assert csvs == sorted(res.tables) and csvs, name
        for csv in csvs:
            pd.testing.assert_frame_equal(pd.read_csv(tmp_path / name / csv), pd.read_csv(io.StringIO(
                res.tables[csv].to_csv(index=False))), obj=f"{name} {csv}")
    with pytest.raises(MoetoolError, match="layers needs a forward"):
        moetool.from_trace("stats", tmp_path / "tr", layers=(1,))
    with pytest.raises(MoetoolError, match="two or more traces"):
        moetool.from_trace("fluctuation", tmp_path / "tr")
    with pytest.raises(MoetoolError, match="no analysis of recorded routing"):
        moetool.from_trace("ppl", tmp_path / "tr")


def test_run_by_name_tokenizes_as_the_command_with_a_bos_adding_tokenizer(tmp_path, no_figures):
    """``moetool stats`` tokenizes with the tokenizer's own default (a BOS per document here); ``moetool.run("stats",
    NAME)`` must read the same tokens (before: no special tokens, so other tables), record the same choice, and
    ``add_special_tokens=False`` is ``--no-special-tokens``."""
    import json

    from tokenizers.processors import TemplateProcessing

    lm = moetool.load("tiny")
    tok = lm.tokenizer
    bos = tok.convert_ids_to_tokens(0)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    assert tok("a b")["input_ids"][0] == 0 and tok("a b", add_special_tokens=False)["input_ids"][0] != 0
    ck = tmp_path / "bos"
    lm.model.save_pretrained(ck)
    tok.save_pretrained(ck)
    args = ["--max-tokens", "512", "--seq-len", "32", "--bootstrap", "0", "--quiet"]
    for cli_flags, api_kw in (([], {}), (["--no-special-tokens"], {"add_special_tokens": False})):
        cli, api = tmp_path / f"cli{len(cli_flags)}", tmp_path / f"api{len(cli_flags)}"
        r = CliRunner().invoke(app, ["stats", "--model", str(ck), *args, *cli_flags, "--out", str(cli)])
        assert r.exit_code == 0, r.output
        moetool.run("stats", str(ck), out=api, max_tokens=512, seq_len=32, bootstrap=0, quiet=True, **api_kw)
        mans = [json.loads((d / "manifest.json").read_text()) for d in (cli, api)]
        added = [m["data"]["special_tokens"]["added_per_document"] for m in mans]
        assert added[0] == added[1] and bool(added[0]) == (not cli_flags)  # a BOS per document, or none
        assert mans[0]["options"]["special_tokens"] == mans[1]["options"]["special_tokens"] == \
            ("none" if cli_flags else "tokenizer default")
        for name in ("load.csv", "layers.csv", "coactivation.csv"):
            pd.testing.assert_frame_equal(pd.read_csv(cli / name), pd.read_csv(api / name))
    with pytest.raises(MoetoolError, match="add_special_tokens"):
        moetool.run("stats", str(ck), out=tmp_path / "bad", add_special_tokens="yes")


def test_from_trace_import_trace_and_write_report_refuse_sizes_and_names_the_command_line_refuses(tmp_path):
    """``from_trace(..., max_tokens=0)`` returned the tables of every token of the trace (0 read as no cap) where
    ``--max-tokens 0`` is refused, a negative cap 'no rows'; ``from_trace("stats", "")`` read the current folder,
    ``None`` a TypeError; ``import_trace("dump.jsonl", ...)`` read the name letter by letter ('d: no such file'),
    ``import_trace([])`` an IndexError; ``write_report([""])`` gathered the current folder. Each is one line."""
    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    moetool.run("trace", lm, toks, out=tmp_path / "tr", quiet=True)
    whole = moetool.from_trace("offload", tmp_path / "tr", bootstrap=0)
    assert int(whole["offload_layers"]["tokens"].iloc[0]) == toks.n_tokens  # the cap below is not read as none
    for cap in (0, -5, 1, 2.5, True):
        with pytest.raises(MoetoolError, match=rf"^max_tokens= must be an integer of at least 2, not {cap!r}$"):
            moetool.from_trace("offload", tmp_path / "tr", max_tokens=cap, bootstrap=0)
    capped = moetool.from_trace("offload", tmp_path / "tr", max_tokens=100, bootstrap=0)
    assert int(capped["offload_layers"]["tokens"].iloc[0]) == 100
    for traces in ("", " ", None, 3, ["", tmp_path / "tr"]):
        with pytest.raises(MoetoolError, match=r"^traces are file or folder names \(one, or a list\), not "):
            moetool.from_trace("stats" if not isinstance(traces, list) else "fluctuation", traces)
    with pytest.raises(MoetoolError, match=r"^dump.jsonl: no such file or folder$"):
        moetool.import_trace("dump.jsonl", "tiny", tmp_path / "imp")
    with pytest.raises(MoetoolError, match=r"^import_trace takes the dump files or folders to read \(a list\)"):
        moetool.import_trace([], "tiny", tmp_path / "imp")
    assert not (tmp_path / "imp").exists()
    moetool.run("ppl", lm, toks, out=tmp_path / "runs" / "ppl", bootstrap=0, quiet=True)
    # '' gathered the current folder; a table its column names ('name: not a folder'), 3 a TypeError from list()
    for run_dirs in ([""], [" "], [None], [tmp_path / "runs" / "ppl", ""], pd.DataFrame({"name": [1]}), 3):
        with pytest.raises(MoetoolError, match=r"^run_dirs are file or folder names \(a list\), not "):
            moetool.write_report(run_dirs, tmp_path / "rep")
    assert not (tmp_path / "rep").exists()
    for wrong in (None, whole["offload_layers"]):  # an AttributeError ('NoneType' has no attribute 'name')
        with pytest.raises(MoetoolError, match=r"^moetool.write takes a Result \(what moetool.stats\(...\) and the"):
            moetool.write(wrong, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_an_empty_out_is_refused_not_the_default_folder(tmp_path, monkeypatch):
    """``out=''`` (an unset shell variable) ran into the default ``runs/<command>-<time>`` where the command line
    refuses ``--out ''``: one line now, before anything loads, for ``moetool.run``, ``write`` and ``write_report``."""
    monkeypatch.chdir(tmp_path)
    for out in ("", "  "):
        with pytest.raises(MoetoolError, match=r"^--out '\s*': an empty path .* runs/ppl-<time>\)$"):
            moetool.run("ppl", "no-such-model", out=out)  # refused before the model's name is even read
        with pytest.raises(MoetoolError, match=r"^--out '\s*': an empty path"):
            moetool.write_report([tmp_path], out)
    assert not (tmp_path / "runs").exists()


def test_what_the_readme_says_inspect_model_and_aliases_return():
    """The README listed ``inspect_model(name)``, ``families()`` and ``aliases()`` as "(DataFrames)";
    ``inspect_model`` returns a dict (its docstring: "as a dict")."""
    import re
    from pathlib import Path

    import pandas as pd

    import moetool

    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8").split())
    said = dict(re.findall(r"`(inspect_model|aliases)\(\w*\)`[^(]*?\((a dict|DataFrames)\)", text))
    kinds = {"a dict": dict, "DataFrames": pd.DataFrame}
    assert set(said) == {"inspect_model", "aliases"}, said
    assert isinstance(moetool.inspect_model("tiny"), kinds[said["inspect_model"]])
    assert isinstance(moetool.aliases(), kinds[said["aliases"]])


def test_attention_routing_needs_no_eager_load_as_the_docstrings_say():
    """``moetool.load``'s docstring said ``attn_implementation="eager"`` is needed for attention routing, and
    ``moetool.fluctuation``'s told to load checkpoints so: the engine switches a loaded model to eager attention for
    the policy's forwards (and back). The perplexity under ``attention`` of a default (SDPA) load equals an eager
    load's, and the model's own attention is given back."""
    import inspect
    import math

    lm = moetool.load("tiny")
    ts = moetool.tokens(lm, None, seq_len=64, max_tokens=512)
    was = lm.model.config._attn_implementation
    assert was != "eager"
    got = moetool.ppl(lm, ts, routing="attention", bootstrap=0, quiet=True)["ppl"].perplexity.iloc[0]
    assert lm.model.config._attn_implementation == was
    eager = moetool.load("tiny", attn_implementation="eager")
    want = moetool.ppl(eager, ts, routing="attention", bootstrap=0, quiet=True)["ppl"].perplexity.iloc[0]
    router = moetool.ppl(lm, ts, bootstrap=0, quiet=True)["ppl"].perplexity.iloc[0]
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-6) and abs(got / router - 1) > 0.01
    for fn in (moetool.load, moetool.fluctuation):
        doc = " ".join(inspect.getdoc(fn).split())
        assert "is needed for" not in doc and "with ``attn_implementation=\"eager\"`` for" not in doc, fn.__name__
        assert "switches" in doc and "eager attention" in doc, fn.__name__


def test_the_docstrings_name_every_table_their_function_returns():
    """``moetool.expert_similarity``'s docstring named two of its three tables (not ``expert_similarity_merges``,
    nor ``expert_similarity_groups`` of ``cluster_to``), ``moetool.fluctuation``'s one of two (not
    ``fluctuation_summary``)."""
    import inspect
    import re

    lm = moetool.load("tiny")
    ts = moetool.tokens(lm, None, seq_len=64, max_tokens=256)
    runs = {moetool.expert_similarity: moetool.expert_similarity(lm, ts, cluster_to=2, quiet=True),
            moetool.fluctuation: moetool.fluctuation([moetool.load("tiny-early"), lm], ts, routing=("router",),
                                                     bootstrap=0, quiet=True),
            moetool.locality: moetool.locality(lm, ts, quiet=True)}
    for fn, res in runs.items():
        named = set(re.findall(r"``(\w+)``", inspect.getdoc(fn)))
        tables = {name.split(".")[0] for name in res.tables}
        assert len(tables) >= 1 and tables <= named, (fn.__name__, sorted(tables - named))


#: parameters every function of the API shares (README, Python API) or that its docstring describes in other words
#: (export_placement's ``sglang|eplb``, from_trace's ``--trace PATH``)
OBVIOUS = {"lm", "tokens", "options", "quiet", "force", "name", "result", "format", "traces", "sources", "run_dirs",
           "title"}


def test_every_public_functions_docstring_names_its_parameters():
    """``moetool.tokens``' docstring did not say what ``add_special_tokens`` does (its default, no special tokens,
    is not what ``moetool stats`` does: the tokenizer's own default, a BOS), ``moetool.hook``'s not ``attention``,
    ``moetool.plan``'s not ``rows``, ``moetool.run_demo``'s not ``steps``."""
    import inspect
    import re

    from moetool.api import EXPORTS

    missing = {}
    for name in EXPORTS:
        fn = getattr(moetool, name)
        if inspect.isclass(fn):
            continue
        fn = fn.run if inspect.ismodule(fn) else fn
        doc = inspect.getdoc(fn) or ""
        params = [p for p, v in inspect.signature(fn).parameters.items()
                  if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL) and p not in OBVIOUS]
        gone = [p for p in params if not re.search(rf"``{p}\b|\b{p}=", doc)]
        if gone:
            missing[name] = gone
    assert not missing, missing


def test_the_ppl_docstring_names_the_columns_of_its_table():
    """``help(moetool.ppl)`` listed a ``tokens`` column (``res["ppl"]["tokens"]``: a KeyError; the column is
    ``scored_tokens``) and none of router_perplexity, ratio or the intervals."""
    import inspect
    import re

    lm = moetool.load("tiny")
    res = moetool.ppl(lm, moetool.tokens(lm, None, seq_len=64, max_tokens=128), routing="topk:1", bootstrap=0,
                      quiet=True)
    listed = re.search(r"Table ``ppl`` \(one row[^)]*\): ([\w,\s]+?)\s*[;(]", inspect.getdoc(moetool.ppl))
    named = [w.strip() for w in listed.group(1).split(",")]
    columns = list(res["ppl"].columns)
    assert [c for c in named if c not in columns] == []
    assert [c for c in columns if c not in named and not c.endswith(("_lo", "_hi"))] == []
    assert res["ppl"]["scored_tokens"].iloc[0] == 2 * 63  # two rows of 64 tokens: 63 next-token predictions each


def test_the_tokens_docstring_gives_each_commands_max_tokens_default():
    """``moetool.tokens``' default of 32,768 tokens is ``moetool stats``' and ``ppl``'s ``--max-tokens``;
    ``moetool topk`` and most others read 8,192 (approx 4,096, mass-recall 16,384), which its docstring did not
    say: ``moetool.topk(lm, moetool.tokens(lm))`` scored 4x the text of ``moetool topk``. The defaults it states are
    the commands' flags."""
    import inspect
    import re

    from typer.main import get_command

    cli = get_command(app)
    flags = {name: p.default for name, c in cli.commands.items() for p in c.params if p.name == "max_tokens"}
    said = re.search(r"``--max-tokens`` defaults: ([^)]*)\)", " ".join(inspect.getdoc(moetool.tokens).split()))
    assert said, "moetool.tokens' docstring does not give the commands' --max-tokens defaults"
    stated = {}
    for part in said.group(1).split("; "):
        names, n = part.rsplit(" ", 1)
        for name in names.split(" and "):
            stated[name] = int(n)
    others = stated.pop("the others")
    assert {c: stated.get(c, others) for c in flags} == flags
    default = inspect.signature(moetool.tokens).parameters["max_tokens"].default
    assert default == flags["stats"] == flags["ppl"]


def test_tokens_given_to_an_experiment_of_the_weights_say_it_takes_none(tmp_path):
    """``moetool.erc(lm, tokens)`` (the call every other experiment takes) said "options must be a ErcOptions, not
    TokenSet"; it now says erc reads the weights alone, from the function and from ``moetool.run``, before any
    folder is made. Without tokens the same call gives the numbers of the keywords' run."""
    import re

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=128)
    for call, name in ((lambda: moetool.erc(lm, tokens, quiet=True), "moetool.erc"),
                       (lambda: moetool.run("erc", lm, tokens, out=tmp_path / "e", quiet=True), "moetool.run('erc', ...)")):
        with pytest.raises(MoetoolError, match=rf"^{re.escape(name)} reads the weights alone: it takes no tokens"):
            call()
    assert not (tmp_path / "e").exists()
    a = moetool.erc(lm, moetool.ErcOptions(samples=1, layers=(0,)), quiet=True)["erc"]
    b = moetool.erc(lm, samples=1, layers=(0,), quiet=True)["erc"]
    pd.testing.assert_frame_equal(a, b)


def test_forward_says_what_it_returns_and_its_nll_is_the_hand_computed_one():
    """``help(moetool.forward)`` said "batches, optional policy and consumers, NLL" with a ``**kwargs`` signature:
    not that the NLL needs ``nll=True`` (the default's ``perplexity`` is NaN), its unit, or what comes back."""
    import inspect
    import math

    from conftest import hand_ppl

    doc = " ".join(inspect.getdoc(moetool.forward).split())
    for said in ("Returns a ``ForwardResult``", "``nll=True``", "in nats per token", "``perplexity``",
                 "NaN without ``nll=True``", "``batch_size`` rows (default 8)"):
        assert said in doc, said
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=256)
    assert math.isnan(moetool.forward(lm, tokens, quiet=True).perplexity)
    res = moetool.forward(lm, tokens, nll=True, quiet=True)
    ppl, count = hand_ppl(lm.model, tokens)
    assert res.nll.tokens == count and math.isclose(res.perplexity, ppl, rel_tol=1e-4)
    assert math.isclose(res.nll.mean, math.log(ppl), rel_tol=1e-4)


def test_help_of_each_options_class_gives_every_fields_default_and_its_flags_help():
    """``help(moetool.TopkOptions)`` said only "Options of topk, each with the flag of ``moetool topk`` that sets
    it": what ``ks``, ``ps`` or ``kmax`` mean was in the command's ``--help`` alone. Each field is now listed with
    its default, and a field of the command's own flag with that flag and its ``--help`` text, checked here
    against the command line's options."""
    import dataclasses
    import inspect
    import re

    from typer.main import get_command

    from moetool.experiments.registry import EXPERIMENTS

    cli = get_command(app)
    checked = 0
    for spec in EXPERIMENTS.values():
        if not spec.options or spec.name not in cli.commands:
            continue
        cls = getattr(moetool, spec.options)
        doc = inspect.getdoc(cls)
        params = {o: p for p in cli.commands[spec.name].params for o in p.opts}
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            line = re.search(rf"^\* ``{f.name}`` = ``(.*?)``(?: \(``(--[\w-]+)``\): (.*))?$", doc, re.M)
            assert line, (spec.options, f.name)
            assert line.group(1) == repr(default), (spec.options, f.name, line.group(1))
            if line.group(2):
                p = params[line.group(2)]  # a flag the command takes
                assert p.name == f.name and " ".join(p.help.split()) == line.group(3), (spec.options, f.name)
                checked += 1
    assert checked >= 40


def test_forward_takes_a_policy_spec_and_its_options_as_its_docstring_says():
    """``moetool.forward(lm, tokens, policy="norm:gate")``, the docstring's own form, was an AttributeError from the
    engine (``'str' object has no attribute 'needs_attention'``): only a policy object ran. A spec is built with its
    options, as ``moetool.hook`` builds it: the perplexity ``moetool.ppl`` gives for the same routing and weights."""
    import math

    from moetool.policies import build_policy

    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=64, max_tokens=256)
    got = {}
    for weights in ("softmax", "uniform"):
        res = moetool.forward(lm, tokens, policy="norm:gate", weights=weights, nll=True, quiet=True)
        ref = moetool.ppl(lm, tokens, routing="norm:gate", weights=weights, bootstrap=0, quiet=True)["ppl"].iloc[0]
        obj = moetool.forward(lm, tokens, policy=build_policy("norm:gate", weights=weights), nll=True, quiet=True)
        assert res.nll.tokens == ref.scored_tokens == obj.nll.tokens
        assert res.perplexity == obj.perplexity and math.isclose(res.perplexity, ref.perplexity, rel_tol=1e-12)
        got[weights] = res.perplexity
    plain = moetool.forward(lm, tokens, nll=True, quiet=True).perplexity
    assert len({got["softmax"], got["uniform"], plain}) == 3  # the policy and its weights ran
    attention = moetool.forward(lm, tokens, policy="attention", layers=[1], nll=True, quiet=True).perplexity
    assert math.isclose(attention, moetool.ppl(lm, tokens, routing="attention", layers=[1], bootstrap=0,
                                               quiet=True)["ppl"].perplexity.item(), rel_tol=1e-12)
    with pytest.raises(MoetoolError, match=r"unknown policy option\(s\) \['temperature'\]"):
        moetool.forward(lm, tokens, policy="norm:gate", temperature=2, quiet=True)
    with pytest.raises(MoetoolError, match="go with a policy spec"):
        moetool.forward(lm, tokens, weights="uniform", quiet=True)


def test_plan_of_a_loaded_model_is_its_configs_plan_and_a_wrong_keyword_is_pythons_own_error():
    """``moetool.plan(lm)`` (a model from ``moetool.load``) was an AttributeError from inside the parameter count
    (``'LoadedModel' object has no attribute 'to_json_string'``): it plans the model's config, under its name, as
    ``moetool.plan("tiny")``; anything else is one line. ``moetool.stats(model=lm, ...)`` said ``_timed() got
    multiple values for argument 'model'`` (moetool's internal helper): now Python's own word for the call."""
    lm = moetool.load("tiny")
    by_model, by_name = moetool.plan(lm), moetool.plan("tiny")
    assert by_model.names == by_name.names
    for name in by_name.names:
        pd.testing.assert_frame_equal(by_model[name], by_name[name])
    assert "ppl --model tiny " in by_model["layouts"].command.iloc[0]
    with pytest.raises(MoetoolError, match=r"plan takes a model's name, its transformers config or a loaded model"):
        moetool.plan(3)
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    with pytest.raises(TypeError, match=r"stats\(\) missing 1 required positional argument: 'lm'"):
        moetool.stats(model=lm, tokens=tokens)
