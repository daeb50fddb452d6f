"""Routing recorded elsewhere (``moetool import-trace``, ``stats``/``placement --trace``, ``placement --export``).

Routing captured by moetool on the embedded model is written in each engine's own format by the writers ported
from the engines' source (``tests/engine_writers.py``), imported, and read back: the trace rows equal the captured
ones, and the tables of ``stats --trace`` / ``placement --trace`` equal those of the same routing measured by a
forward (``moetool.stats`` / ``moetool.placement`` on the model). Exports are read back as the engines read them.
Bad dumps: one line, exit 2, nothing written."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import engine_writers as ew  # noqa: E402

from moetool.commands.app import app  # noqa: E402
from moetool.errors import MoetoolError  # noqa: E402
from moetool.experiments.placement.compute import PlacementOptions, gpu_loads, imbalance  # noqa: E402
from moetool.experiments.stats.compute import StatsOptions  # noqa: E402
from moetool.experiments.trace_analyses import placement_from_trace, stats_from_trace  # noqa: E402
from moetool.traces import readers  # noqa: E402
from moetool.traces.export import read_eplb, read_sglang_location  # noqa: E402
from moetool.traces.shape import ModelShape  # noqa: E402
from moetool.traces.store import open_trace  # noqa: E402

runner = CliRunner()
REDUNDANT = 4  # extra physical slots of the SGLang dumps' expert location (a non-trivial physical -> logical map)
PER_TOKEN = ("vllm", "vllm-npy", "sglang-routed", "sglang-per-token", "megatron")
COUNTS = ("sglang-stat", "sglang-per-pass")


def _requests(tr: pd.DataFrame, cols: list[str]) -> list[tuple[dict[int, np.ndarray], list[int]]]:
    """Per packed row of a captured trace: the experts per layer ``[T, K]`` and the token ids ``[T]``."""
    out = []
    for _, g in tr.groupby("row", sort=True):
        experts = {int(li): gg.sort_values("pos")[cols].to_numpy() for li, gg in g.groupby("layer")}
        out.append((experts, g[g.layer == g.layer.min()].sort_values("pos").token_id.tolist()))
    return out


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The embedded model's routing captured by moetool (trace), the forward's own stats and placement tables, and
    that routing written in every engine's format."""
    import moetool
    from moetool.experiments.offload.compute import OffloadOptions, offload
    from moetool.experiments.placement.compute import placement
    from moetool.experiments.stats.compute import stats
    from moetool.experiments.trace.compute import trace

    lm = moetool.load("tiny")
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    tr = trace(lm, toks, quiet=True)["trace"]
    st = stats(lm, toks, StatsOptions(top_tokens=5, min_count=2, specialization=False, bootstrap=0), quiet=True)
    pl = placement(lm, toks, PlacementOptions(gpus=(2, 4), extra_slots=(0, 1), bootstrap=0), quiet=True)
    off = offload(lm, toks, OffloadOptions(bootstrap=0), quiet=True)
    shape = ModelShape.from_config("tiny")
    K, n, L = shape.top_k(), 8, shape.num_layers
    cols = [f"expert_{k + 1}" for k in range(K)]
    requests = _requests(tr, cols)
    root = tmp_path_factory.mktemp("dumps")
    files: dict[str, list[Path]] = {}
    # vLLM: OpenAI responses (T + 1 tokens: T forwarded), and bare .npy files of RequestOutput's array
    lines = [json.dumps(ew.vllm_response(ew.vllm_routed_experts(ex, L, n), ids, [ids[0]])) for ex, ids in requests]
    (root / "vllm.jsonl").write_text("\n".join(lines) + "\n")
    files["vllm"] = [root / "vllm.jsonl"]
    files["vllm-npy"] = []
    for i, (ex, _) in enumerate(requests):
        p = root / f"vllm-{i:03d}.npy"
        np.save(p, ew.vllm_routed_experts(ex, L, n))
        files["vllm-npy"].append(p)
    # SGLang /generate responses
    lines = [json.dumps(ew.sglang_routed_response(ex, L, len(ids) + 1)) for ex, ids in requests]
    (root / "sglang.jsonl").write_text("\n".join(lines) + "\n")
    files["sglang-routed"] = [root / "sglang.jsonl"]
    # SGLang recorder: one forward pass per packed row
    p2l = ew.physical_map(L, n, REDUNDANT)
    for mode, per_token in (("per-token", True), ("per-pass", False)):
        recs = [ew.sglang_per_token_record(i, ex, ids, list(range(len(ids))), L, p2l, per_token=per_token)
                for i, (ex, ids) in enumerate(requests)]
        ew.sglang_detail_dump(root / f"expert_distribution_recorder_{mode}_0.pt", recs, p2l)
        files[f"sglang-{mode}"] = [root / f"expert_distribution_recorder_{mode}_0.pt"]
    recs = [ew.sglang_per_token_record(i, ex, ids, list(range(len(ids))), L, p2l, per_token=False)
            for i, (ex, ids) in enumerate(requests)]
    ew.sglang_stat_dump(root / "expert_distribution_recorder_stat.pt", recs, p2l, n)
    files["sglang-stat"] = [root / "expert_distribution_recorder_stat.pt"]
    # Megatron: one step per packed row
    (root / "mcore").mkdir()
    for step, (ex, _) in enumerate(requests):
        ew.megatron_flush(root / "mcore" / "router_trace_rank0.jsonl", ew.megatron_records(step, ex, n))
    files["megatron"] = [root / "mcore"]
    return dict(lm=lm, tokens=toks, trace=tr, stats=st, placement=pl, offload=off, shape=shape, files=files,
                root=root, requests=requests, p2l=p2l,
                cols=cols)


def import_cli(files, out, *extra):
    return runner.invoke(app, ["import-trace", *map(str, files), "--config", "tiny", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def imported(captured, tmp_path_factory):
    out = {}
    for fmt, files in captured["files"].items():
        run = tmp_path_factory.mktemp("imp") / fmt
        r = import_cli(files, run)
        assert r.exit_code == 0, r.output
        out[fmt] = run
    return out


EXPECTED_FORMAT = {"vllm": "vllm", "vllm-npy": "vllm", "sglang-routed": "sglang-routed",
                   "sglang-per-token": "sglang-dump", "sglang-per-pass": "sglang-dump", "sglang-stat": "sglang-dump",
                   "megatron": "megatron"}


@pytest.mark.parametrize("fmt", list(EXPECTED_FORMAT))
def test_sniffed(captured, fmt):
    files = readers.expand(captured["files"][fmt])
    assert readers.resolve_format(files, None) == EXPECTED_FORMAT[fmt]


def test_megatron_folder_sidecars_ignored(captured, tmp_path):
    """A Megatron trace folder also holds router_state_rank*.pt (--dump-router-weights) and bf16 sidecars: they are
    no routing dump; the folder is read as the trace alone."""
    import shutil

    shutil.copytree(captured["files"]["megatron"][0], tmp_path / "t")
    torch.save({"weight": torch.zeros(2, 2)}, tmp_path / "t" / "router_state_rank0.pt")
    (tmp_path / "t" / "logits_rank0.bin").write_bytes(b"\0" * 8)
    files = readers.expand([tmp_path / "t"])
    assert [f.name for f in files] == ["router_trace_rank0.jsonl"]
    dump = readers.read([tmp_path / "t"], captured["shape"])
    assert dump.format == "megatron" and any("logits sidecar" in n for n in dump.notes)


@pytest.mark.parametrize("fmt", PER_TOKEN)
def test_trace_rows_read_back(captured, imported, fmt):
    """Every (row, position, layer) of the captured routing, with its experts (Megatron: as a set, its hook sorts
    them) and token id where the format carries one."""
    cols = captured["cols"]
    key = ["row", "layer", "pos"]
    a = captured["trace"].sort_values(key).reset_index(drop=True)
    b = pd.read_parquet(imported[fmt] / "trace.parquet").sort_values(key).reset_index(drop=True)
    assert list(b.columns) == ["row", "pos", "token_id", "domain", "layer", *cols, *[f"weight_{k + 1}"
                                                                                     for k in range(len(cols))]]
    assert len(a) == len(b)
    assert (a[key].to_numpy() == b[key].to_numpy()).all()
    ea, eb = a[cols].to_numpy(), b[cols].to_numpy()
    if fmt == "megatron":
        ea = np.sort(ea, 1)
        assert (np.diff(eb, axis=1) > 0).all()  # sorted by expert id, as the hook path gives them
    assert (ea == eb).all()
    has_ids = fmt in ("vllm", "sglang-per-token")
    assert ((b.token_id.to_numpy() == a.token_id.to_numpy()).all() if has_ids else (b.token_id == -1).all())
    assert b[[f"weight_{k + 1}" for k in range(len(cols))]].isna().all().all()  # no gate weights recorded
    man = json.loads((imported[fmt] / "manifest.json").read_text())["routing_source"]
    assert man["format"] == EXPECTED_FORMAT[fmt] and man["tokens"] == len(a) // 4
    assert ("uint8" in man["engine_version"]) == fmt.startswith("vllm")  # 8 experts: vLLM's narrow ids


@pytest.mark.parametrize("fmt", ["vllm", "sglang-stat"])
def test_an_imported_trace_that_lost_rows_is_refused(captured, imported, fmt, tmp_path):
    """import-trace records its Parquet's rows, bytes and sha256 in the manifest; a copy rewritten without its last
    layer's rows (a shorter trace read as the whole: every rate from other tokens) or cut in the middle is refused
    in one line (moetool.files.table_problem), by the API and the CLI alike."""
    import shutil

    from conftest import recorded_tables

    name = "trace.parquet" if fmt == "vllm" else "loads.parquet"
    run = tmp_path / fmt
    shutil.copytree(imported[fmt], run)
    n = len(pd.read_parquet(run / name))
    assert recorded_tables(run) == {name: n}
    assert n == (len(captured["trace"]) if fmt == "vllm" else 4 * 8)  # every (token, MoE layer); every expert
    assert open_trace(run).path == run / name
    df = pd.read_parquet(run / name)
    df[df.layer < 3].to_parquet(run / name, index=False)
    with pytest.raises(MoetoolError) as e:
        open_trace(run)
    assert str(e.value) == (f"--trace {run / name} has {n * 3 // 4:,} rows, the run wrote {n:,}; a truncated or "
                            "edited copy?")
    r = runner.invoke(app, ["stats", "--trace", str(run), "-q", "--out", str(tmp_path / "stats")])
    assert r.exit_code == 2 and r.output.strip() == f"error: {e.value}" and not (tmp_path / "stats").exists()
    shutil.copyfile(imported[fmt] / name, run / name)
    data = (run / name).read_bytes()
    (run / name).write_bytes(data[:len(data) // 2])
    with pytest.raises(MoetoolError) as e:
        open_trace(run)
    assert str(e.value) == (f"--trace {run / name} has {len(data) // 2:,} bytes, the run wrote {len(data):,}; a "
                            "truncated or edited copy?")


@pytest.mark.parametrize("fmt", ["parquet", "csv.gz"])
def test_moetool_traces_streamed_file_is_recorded_and_a_copy_that_lost_rows_refused(fmt, tmp_path):
    """``moetool trace`` streams its file while the model runs: its rows (counted by the stream), bytes and sha256
    still reach the manifest, so a copy rewritten without a layer's rows is refused by ``--trace`` as an imported
    trace's is (before, the streamed file had no record and the shorter trace was read as the whole)."""
    from conftest import recorded_tables

    run = tmp_path / "trace"
    r = runner.invoke(app, ["trace", "--max-tokens", "128", "--seq-len", "32", "--batch-size", "2", "--format", fmt,
                            "-q", "--out", str(run)])
    assert r.exit_code == 0, r.output
    name = f"trace.{fmt}"
    read = pd.read_parquet if fmt == "parquet" else pd.read_csv
    df = read(run / name)
    assert recorded_tables(run) == {name: len(df)} and len(df) == 128 * df["layer"].nunique()
    assert open_trace(run).path == run / name
    short = df[df.layer != df.layer.max()]
    short.to_parquet(run / name, index=False) if fmt == "parquet" else short.to_csv(run / name, index=False)
    r = runner.invoke(app, ["stats", "--trace", str(run), "-q", "--out", str(tmp_path / "stats")])
    assert r.exit_code == 2 and f"--trace {run / name} has " in r.output and "a truncated or edited copy?" in \
        r.output and not (tmp_path / "stats").exists()


@pytest.mark.parametrize("fmt", ["parquet", "csv.gz"])
def test_an_unreadable_trace_without_a_record_is_one_line_exit_2(fmt, tmp_path):
    """A trace cut short or overwritten in a run folder whose manifest records no ``tables`` (written before
    manifests did): ``stats --trace`` printed ``error: ArrowInvalid: Parquet magic bytes not found ...`` (exit 1,
    'MOETOOL_DEBUG=1 shows the traceback') for a Parquet and a bare ``aborted`` (click's answer to the gzip's
    EOFError, exit 1) for a ``.csv.gz``. Now one line naming the file, exit 2, nothing written, as a truncated
    ``.npy`` given to import-trace."""
    run = tmp_path / "trace"
    r = runner.invoke(app, ["trace", "--max-tokens", "128", "--seq-len", "32", "--batch-size", "2", "--format", fmt,
                            "-q", "--out", str(run)])
    assert r.exit_code == 0, r.output
    man = json.loads((run / "manifest.json").read_text())
    man.pop("tables")
    (run / "manifest.json").write_text(json.dumps(man))
    name = run / f"trace.{fmt}"
    data = name.read_bytes()
    for damaged in (data[: len(data) * 2 // 3], data[:2] + b"x" * len(data)):  # cut short; another file's bytes
        name.write_bytes(damaged)
        for command in ("stats", "offload"):
            r = runner.invoke(app, [command, "--trace", str(run), "-q", "--out", str(tmp_path / "o")])
            lines = [ln for ln in r.output.splitlines() if ln.strip()]
            assert r.exit_code == 2 and len(lines) == 1, r.output
            assert lines[0].startswith(f"error: --trace {name}: not a readable ") and "(truncated or damaged?)" in \
                lines[0], lines[0]
            assert not (tmp_path / "o").exists()


# tables, headlines and refusals only (no_figures) here and in the trace tests below that take it: the figures of
# each analysis on a trace are tests/test_readme.py's (test_the_readme_says_which_trace_analyses_draw_figures)
def test_model_and_max_tokens_that_a_trace_would_ignore_are_refused(tmp_path, no_figures):
    """``stats --trace RUN --model tiny-fine`` and ``--max-tokens 100`` ran on the trace's own model and every token
    it holds, exit 0, as if asked for (a table of 2,048 tokens of tiny under a command line naming 100 tokens of
    tiny-fine); now one line, as --data. offload --trace still caps at --max-tokens (README: --max-tokens 100000);
    a flag at its default changes nothing and passes."""
    run = tmp_path / "trace"
    r = runner.invoke(app, ["trace", "--max-tokens", "128", "--seq-len", "32", "--format", "parquet", "-q", "--out",
                            str(run)])
    assert r.exit_code == 0, r.output
    for argv, flag in ((["stats", "--model", "tiny-fine"], "--model"),
                       (["stats", "--max-tokens", "100"], "--max-tokens"),
                       (["placement", "--gpus", "4", "--max-tokens", "100"], "--max-tokens"),
                       (["placement", "--gpus", "4", "--model", "tiny-early"], "--model"),
                       (["offload", "--model", "tiny-fine"], "--model")):
        r = runner.invoke(app, [*argv, "--trace", str(run), "-q", "--out", str(tmp_path / "o")])
        line = f"error: {flag} needs a forward of the model: not with --trace"
        assert r.exit_code == 2 and r.output.strip() == line, (argv, r.output)
        assert not (tmp_path / "o").exists()
    r = runner.invoke(app, ["stats", "--model", "tiny", "--max-tokens", "32768", "--trace", str(run), "-q", "--out",
                            str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["offload", "--max-tokens", "64", "--trace", str(run), "-q", "--out", str(tmp_path / "o2")])
    assert r.exit_code == 0, r.output


def test_a_trace_of_a_policy_with_unrun_columns_is_refused_where_every_column_counts(tmp_path):
    """``moetool trace --routing topp:0.5`` writes every expert column, the unchosen at weight 0 (capacity: its
    dropped assignments): stats, placement and offload on it would count those as routed (before: loads and hit
    rates of experts that never ran); refused in one line. fluctuation reads the weights and leaves them out."""
    run = tmp_path / "topp"
    r = runner.invoke(app, ["trace", "--routing", "topp:0.5", "--max-tokens", "128", "--seq-len", "32", "--format",
                            "parquet", "-q", "--out", str(run)])
    assert r.exit_code == 0, r.output
    df = pd.read_parquet(run / "trace.parquet")
    assert (df.filter(like="weight_") == 0).to_numpy().any()  # the policy left columns out
    for cmd, use in (("stats", "the expert loads"), ("placement", "the expert loads"),
                     ("offload", "the cache simulation")):
        r = runner.invoke(app, [cmd, "--trace", str(run), "-q", "--out", str(tmp_path / cmd)])
        assert r.exit_code == 2 and "has experts at weight 0" in r.output and use in r.output, (cmd, r.output)
        assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / cmd).exists()
    copy = tmp_path / "topp-copy"  # the same file twice is refused: a copy of it is another checkpoint's trace
    shutil.copytree(run, copy)
    r = runner.invoke(app, ["fluctuation", "--trace", str(run), "--trace", str(copy), "-q", "--out",
                            str(tmp_path / "fl")])
    assert r.exit_code == 0, r.output
    assert (pd.read_csv(tmp_path / "fl" / "fluctuation.csv")["topk_change"] == 0).all()  # the same routing


@pytest.mark.parametrize("policy", ["topk:1", "prune:random:0.25"])
def test_an_analysis_of_a_policys_trace_counts_its_choices_and_names_it(tmp_path, policy):
    """stats and placement on a trace of ``moetool trace --routing POLICY`` count the policy's choices -- the loads
    equal a hand count of the experts it chose in a hooked forward of the same rows (topk:1: one per token; prune:
    none of the removed experts) -- and say whose routing it is: the manifest's ``trace.routing`` and the headline
    name the policy. Both said ``routing_source: moetool trace`` and 'stats tiny (trace)' only, as for the
    model's own top-2."""
    import moetool
    from moetool.policies import make_policy

    run = tmp_path / "trace"
    r = runner.invoke(app, ["trace", "--routing", policy, "--max-tokens", "128", "--seq-len", "32", "--batch-size",
                            "4", "--format", "parquet", "-q", "--out", str(run)])
    assert r.exit_code == 0, r.output
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=32, max_tokens=128)
    counts: dict[int, np.ndarray] = {}

    def count(ev):
        chosen = ev.chosen_idx[ev.valid].cpu().numpy()
        c = counts.setdefault(ev.layer.index, np.zeros(ev.layer.n_experts, dtype=np.int64))
        np.add.at(c, chosen.reshape(-1), 1)

    with torch.no_grad(), moetool.hook(lm, policy=policy, consumers=[count]):
        for s in range(0, tokens.input_ids.shape[0], 4):
            lm.model(input_ids=tokens.input_ids[s:s + 4], attention_mask=tokens.attention_mask[s:s + 4])
    real = int(tokens.attention_mask.sum())
    for cmd in ("stats", "placement"):
        out = tmp_path / cmd
        r = runner.invoke(app, [cmd, "--trace", str(run), "-q", "--out", str(out)])
        assert r.exit_code == 0, r.output
        m = json.loads((out / "manifest.json").read_text())
        assert m["trace"]["routing"]["name"] == make_policy(policy).name
        assert all(f"(trace, routing {make_policy(policy).name})" in line for line in m["headline"]), m["headline"]
        load = pd.read_csv(out / ("load.csv" if cmd == "stats" else "placement_loads.csv"))
        for li, c in counts.items():
            got = load[load.layer == li].sort_values("expert")["tokens" if cmd == "stats" else "load"].to_numpy()
            assert np.array_equal(got, c), (cmd, li, got, c)
            assert c.sum() == real * (1 if policy == "topk:1" else 2)
            if policy.startswith("prune"):
                removed = make_policy(policy).removed_in(lm.layers[[L.index for L in lm.layers].index(li)])
                assert len(removed) == 2 and (c[removed] == 0).all()


def test_a_per_token_trace_missing_an_moe_layer_is_refused(captured, tmp_path, no_figures):
    """A per-token trace without one MoE layer's rows (a bare file, ``--trace-config``): stats, placement and offload
    wrote the model's tables without that layer (placement's overall imbalance over 3 of 4 layers) and fluctuation
    compared the layers present, without a word. Refused in one line naming the layer, as a counts trace's missing
    layer is; placement's ``--layers`` of the layers present reads the same as the whole trace does."""
    full, bare = tmp_path / "full.parquet", tmp_path / "bare.parquet"
    captured["trace"].to_parquet(full, index=False)
    captured["trace"][captured["trace"]["layer"] != 1].to_parquet(bare, index=False)
    cfg = ["--trace-config", "tiny", "-q"]
    for args in (["stats", "--trace", str(bare)], ["placement", "--trace", str(bare)],
                 ["offload", "--trace", str(bare)], ["fluctuation", "--trace", str(full), "--trace", str(bare)]):
        out = tmp_path / args[0]
        _refused(runner.invoke(app, [*args, *cfg, "--out", str(out)]), out,
                 f"--trace {bare}: MoE layer 1 not in the trace (MoE layers of tiny: 0-3)")
    tables = []
    for f in (bare, full):
        out = tmp_path / f"pl-{f.stem}"
        r = runner.invoke(app, ["placement", "--trace", str(f), "--layers", "0,2-3", *cfg, "--out", str(out)])
        assert r.exit_code == 0, r.output
        tables.append([pd.read_csv(out / t) for t in ("placement.csv", "placement_overall.csv")])
    assert sorted(tables[0][0]["layer"].unique()) == [0, 2, 3]
    for a, b in zip(*tables):
        pd.testing.assert_frame_equal(a, b)


def test_a_per_token_trace_with_a_row_repeated_in_one_layer_is_refused(captured, tmp_path):
    """A bare trace file (``--trace-config``) whose first row is repeated in layer 0 only: stats counted 257 tokens
    in layer 0 beside 256 in the other layers (layer 0's expert of that row one assignment heavier) while placement
    refused the file in one line. Now stats refuses it as placement does (trace_sums: a token is routed once in every
    MoE layer); the untouched file counts 256 in every layer."""
    tr = captured["trace"].reset_index(drop=True)
    n_tok = int((tr["layer"] == 0).sum())
    bad = pd.concat([tr.iloc[:1], tr], ignore_index=True)  # tr's first line is layer 0's
    assert int(bad.loc[0, "layer"]) == 0 and int((bad["layer"] == 0).sum()) == n_tok + 1
    (tmp_path / "bad").mkdir()
    bad.to_parquet(tmp_path / "bad" / "trace.parquet", index=False)
    for cmd in ("stats", "placement"):
        out = tmp_path / cmd
        _refused(runner.invoke(app, [cmd, "--trace", str(tmp_path / "bad"), "--trace-config", "tiny", "-q", "--out",
                                     str(out)]), out,
                 f"the MoE layers routed different numbers of tokens [{n_tok}, {n_tok + 1}]")
    (tmp_path / "ok").mkdir()
    tr.to_parquet(tmp_path / "ok" / "trace.parquet", index=False)
    res = stats_from_trace(open_trace(tmp_path / "ok", "tiny"), StatsOptions(top_tokens=0, bootstrap=0))
    assert res["layers"]["tokens"].tolist() == [n_tok] * 4


def test_a_trace_without_manifest_names_the_flag_that_gives_the_model(captured, tmp_path, no_figures):
    """A bare trace file and no --trace-config: the line said 'give --config', a flag stats, placement, offload and
    fluctuation do not have (their --trace-config; import-trace's --config is another command's). Now it names
    --trace-config, and that flag reads the file."""
    (tmp_path / "bare").mkdir()
    captured["trace"].to_parquet(tmp_path / "bare" / "trace.parquet", index=False)
    out = tmp_path / "out"
    r = runner.invoke(app, ["stats", "--trace", str(tmp_path / "bare"), "-q", "--out", str(out)])
    _refused(r, out, "no manifest.json beside it naming the model: give --trace-config")
    assert "--config" not in r.output.replace("--trace-config", "")
    r = runner.invoke(app, ["stats", "--trace", str(tmp_path / "bare"), "--trace-config", "tiny", "-q", "--out",
                            str(out)])
    assert r.exit_code == 0, r.output


def test_token_ids_beyond_the_vocabulary_of_the_config_are_refused(captured, tmp_path):
    """A vLLM response whose prompt holds token id 50000 with --config tiny (a vocabulary of 2,048 ids, the config's
    vocab_size): import-trace wrote it and stats --trace listed token 50000 (no text) among an expert's top tokens;
    a bare trace file with such an id and --trace-config the same. The forward refuses such an id (the data's
    tokenizer is another model's); now import-trace and stats --trace do too, in one line. The largest id of the
    vocabulary, 2047, is read."""
    assert ModelShape.from_config("tiny").vocab_size == 2048 == captured["lm"].model.config.vocab_size
    ex, ids = captured["requests"][0]
    cases = {}
    for name, big in (("far", 50000), ("edge", 2048), ("last", 2047)):
        routed = ew.vllm_routed_experts(ex, 4, 8)
        prompt = [int(i) for i in ids[:len(routed)]]
        prompt[3] = big
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(ew.vllm_response(routed, prompt, [7])) + "\n")
        cases[name] = big
    for name in ("far", "edge"):
        _refused(import_cli([tmp_path / f"{name}.jsonl"], tmp_path / "out"), tmp_path / "out",
                 f"token id {cases[name]} is outside the 2,048 ids of the vocabulary of tiny")
    assert import_cli([tmp_path / "last.jsonl"], tmp_path / "last").exit_code == 0
    res = stats_from_trace(open_trace(tmp_path / "last"), StatsOptions(top_tokens=50, min_count=1, bootstrap=0))
    assert 2047 in set(res["top_tokens"]["token_id"])
    tr = captured["trace"].copy()
    tr.loc[tr.index[0], "token_id"] = 50000
    (tmp_path / "bare").mkdir()
    tr.to_parquet(tmp_path / "bare" / "trace.parquet", index=False)
    out = tmp_path / "st"
    _refused(runner.invoke(app, ["stats", "--trace", str(tmp_path / "bare"), "--trace-config", "tiny", "-q", "--out",
                                 str(out)]), out, "token id 50000 is outside the 2,048 ids of the vocabulary of tiny")


def _same(a: pd.DataFrame, b: pd.DataFrame, cols: list[str]) -> None:
    pd.testing.assert_frame_equal(a[cols].reset_index(drop=True), b[cols].reset_index(drop=True), check_dtype=False,
                                  rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", PER_TOKEN + COUNTS + ("moetool",))
def test_stats_tables_equal_forward(captured, imported, fmt, tmp_path):
    """load.csv, layers.csv (the columns that need only the chosen experts) and coactivation.csv of the trace equal
    the forward's stats tables of the same routing."""
    if fmt == "moetool":  # moetool's own trace (with weights), shape from --trace-config
        captured["trace"].to_parquet(tmp_path / "trace.parquet", index=False)
        src = open_trace(tmp_path, "tiny")
        assert src.weights
    else:
        src = open_trace(imported[fmt])
        assert not src.weights and src.kind == ("loads" if fmt in COUNTS else "trace")
    res = stats_from_trace(src, StatsOptions(top_tokens=5, min_count=2, bootstrap=0))
    ref = captured["stats"]
    if fmt in ("vllm", "sglang-per-token", "moetool"):  # token ids in the trace: the same top tokens, as ranked
        for name in ("top_tokens", "top_tokens_lift"):
            pd.testing.assert_frame_equal(res[name].reset_index(drop=True), ref[name].reset_index(drop=True),
                                          check_dtype=False, rtol=1e-12, atol=1e-12)
    else:
        assert "top_tokens.csv" not in res.tables and "top_tokens, top_tokens_lift" in res.meta["left_out"]
    _same(res["load"], ref["load"], ["layer", "expert", "load_fraction", "token_fraction", "tokens"])
    _same(res["layers"], ref["layers"], ["layer", "n_experts", "top_k", "tokens", "load_entropy", "load_entropy_norm",
                                         "max_load_ratio"])
    if fmt in COUNTS:
        assert "coactivation.csv" not in res.tables and "coactivation" in res.meta["left_out"]
    else:
        _same(res["coactivation"], ref["coactivation"], ["layer", "a", "b", "p_b_given_a", "count"])


def test_stats_top_k_1_of_a_trace_counts_its_first_ranked_expert(captured, tmp_path):
    """stats --trace --top-k 1 on moetool's own trace (expert_1..K largest first): the loads of expert_1 only, by
    hand from the trace's rows (K = 2 in the tiny model, so the last column differs). The last K column read as the
    first-ranked survived the suite."""
    tr = captured["trace"]
    tr.to_parquet(tmp_path / "trace.parquet", index=False)
    res = stats_from_trace(open_trace(tmp_path, "tiny"), StatsOptions(top_k=1, top_tokens=0, bootstrap=0))
    load, layers = res["load"].set_index(["layer", "expert"]), res["layers"].set_index("layer")
    assert sorted(set(tr["layer"])) == sorted(layers.index)
    for li, g in tr.groupby("layer"):
        counts = np.bincount(g["expert_1"].to_numpy(), minlength=8)
        assert layers.loc[li, "top_k"] == 1 and layers.loc[li, "tokens"] == len(g)
        assert load.loc[li]["tokens"].tolist() == counts.tolist()
        assert load.loc[li]["load_fraction"].tolist() == pytest.approx((counts / len(g)).tolist(), abs=1e-15)
        assert (counts != np.bincount(g["expert_2"].to_numpy(), minlength=8)).any()  # the columns tell apart


@pytest.mark.parametrize("fmt", ("vllm", "megatron", "sglang-stat"))
def test_placement_tables_equal_forward(captured, imported, fmt):
    res, _ = placement_from_trace(open_trace(imported[fmt]), PlacementOptions(gpus=(2, 4), extra_slots=(0, 1),
                                                                              bootstrap=0))
    ref = captured["placement"]
    for name in ("placement", "placement_overall", "placement_loads"):
        cols = [c for c in ref[name].columns if not c.endswith(("_lo", "_hi"))]
        _same(res[name], ref[name], cols)


def test_zero_computation_experts_on_a_trace(tmp_path):
    """LongCat-Flash (8 routed + 2 identity experts, the last ids): the trace's shape, read from the config alone,
    knows the identity experts, so stats --trace gives zero_compute_fraction and placement --trace places the computed
    experts only, as the forward's stats and placement do (the same tables; before, placement --trace placed the
    identity experts as GPUs' experts and stats --trace dropped the column)."""
    from types import SimpleNamespace

    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.data import TokenSet
    from moetool.experiments.placement.compute import placement
    from moetool.experiments.stats.compute import stats
    from moetool.experiments.trace.compute import trace

    model = build_tiny("longcat_flash")
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None, name="longcat")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 40, (6, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, -7:] = 0
    toks = TokenSet(ids, mask, [""] * 6, "test")
    model.config.save_pretrained(tmp_path / "config")  # the shape from the config alone (no weights)
    (tmp_path / "t").mkdir()
    trace(lm, toks, quiet=True)["trace"].to_parquet(tmp_path / "t" / "trace.parquet", index=False)
    src = open_trace(tmp_path / "t", str(tmp_path / "config"))
    live = stats(lm, toks, quiet=True, bootstrap=0, top_tokens=0, specialization=False)
    res = stats_from_trace(src, StatsOptions(top_tokens=0, bootstrap=0))
    _same(res["layers"], live["layers"], ["layer", "n_experts", "tokens", "max_load_ratio", "zero_compute_fraction"])
    opts = PlacementOptions(gpus=(2, 4), extra_slots=(0, 1), bootstrap=0, groups=1)
    got, loads = placement_from_trace(src, opts)
    ref = placement(lm, toks, opts, quiet=True)
    assert loads["n"] == 8 and got.meta["zero_computation_experts_not_placed"] == 2
    for name in ("placement", "placement_overall", "placement_loads"):
        _same(got[name], ref[name], [c for c in ref[name].columns if not c.endswith(("_lo", "_hi"))])
    assert src.shape.zero == {L.index: 2 for L in lm.layers}
    assert ModelShape.from_manifest(src.shape.to_manifest()) == src.shape
    # offload: the identity experts hold no weights (nothing to load or cache), while the cache simulation serves
    # K loaded experts per token: refused in one line, live and on the trace (before: their requests were cached
    # and their misses billed a real expert's bytes)
    from moetool.experiments.offload.compute import OffloadOptions, offload
    from moetool.experiments.trace_analyses import offload_from_trace

    first = min(L.index for L in lm.layers)
    why = (f"offload: layer {first} routes to 2 zero-computation (identity) experts, which hold no weights to load or "
           "cache; the cache simulation loads K experts per token and would count them: not supported")
    for run in (lambda: offload(lm, toks, quiet=True, bootstrap=0), lambda: offload_from_trace(src, OffloadOptions(
            bootstrap=0), None)):
        with pytest.raises(MoetoolError) as e:
            run()
        assert str(e.value) == why


@pytest.mark.parametrize("fmt", ("vllm", "megatron", "sglang-per-token"))
def test_offload_tables_equal_forward(captured, imported, fmt):
    """Coverage, per-layer shares and every cache policy's hits on the trace's token stream equal the forward's
    (Megatron's sorted ids: a token's K requests are served together, so their order does not change a hit)."""
    from moetool.experiments.offload.compute import OffloadOptions
    from moetool.experiments.trace_analyses import offload_from_trace

    res = offload_from_trace(open_trace(imported[fmt]), OffloadOptions(bootstrap=0), None)
    ref = captured["offload"]
    assert set(res.tables) == {"offload_coverage.csv", "offload_layers.csv", "offload_cache.csv"}
    for name in ("offload_coverage", "offload_layers", "offload_cache"):
        cols = [c for c in ref[name].columns if c not in ("expert_bytes", "bytes_per_token")
                and not c.endswith(("_lo", "_hi"))]
        assert "bytes_per_token" not in res[name].columns and "expert_bytes" not in res[name].columns
        _same(res[name], ref[name], cols)
    few = offload_from_trace(open_trace(imported[fmt]), OffloadOptions(bootstrap=0), 40)
    assert (few["offload_layers"]["tokens"] == 40).all()


def test_max_tokens_of_a_trace_read_in_small_batches(imported, monkeypatch):
    """offload --trace --max-tokens 40 read 7 rows at a time (every layer's 40 tokens spread over several reads):
    each layer keeps its first 40 tokens, the tables those of one read. Cutting each read at 40 rather than at
    what the layer still needs survived the suite (its traces fit one read)."""
    from moetool.experiments.offload.compute import OffloadOptions
    from moetool.experiments.trace_analyses import offload_from_trace
    from moetool.traces import store

    whole = offload_from_trace(open_trace(imported["vllm"]), OffloadOptions(bootstrap=0), 40)
    monkeypatch.setattr(store, "ROWS_PER_READ", 7)
    small = offload_from_trace(open_trace(imported["vllm"]), OffloadOptions(bootstrap=0), 40)
    assert (small["offload_layers"]["tokens"] == 40).all()
    for name in ("offload_coverage", "offload_layers", "offload_cache"):
        _same(small[name], whole[name], list(whole[name].columns))


def test_fluctuation_between_traces_equals_forward(captured, imported, tmp_path):
    """Two recorded routings of the same tokens (tiny-early and tiny): with gate weights (moetool trace) every rate
    of the forward's fluctuation for the router; from engine dumps (vLLM) the set rates, top1_change left out."""
    import moetool
    from moetool.experiments.fluctuation.compute import FluctuationOptions, fluctuation
    from moetool.experiments.trace.compute import trace
    from moetool.experiments.trace_analyses import fluctuation_from_traces
    from moetool.uncertainty import bootstrap_meta

    early = moetool.load("tiny-early")
    toks = captured["tokens"]
    tr_early = trace(early, toks, quiet=True)["trace"]
    opts = FluctuationOptions(routing=("router",), bootstrap=0)
    fwd = fluctuation([early, captured["lm"]], toks, opts, quiet=True)
    ref = fwd["fluctuation"].sort_values("layer")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tr_early.to_parquet(tmp_path / "a" / "trace.parquet", index=False)
    captured["trace"].to_parquet(tmp_path / "b" / "trace.parquet", index=False)
    rates = ["topk_change", "topk_overlap", "jaccard"]
    res = fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), open_trace(tmp_path / "b", "tiny")],
                                  ["a", "b"], opts, None)
    got = res["fluctuation"]
    _same(got, ref, ["layer", "tokens", "top1_change", *rates])
    # the bootstrap section (its few-rows note) of both: the rows of the tokens
    assert res.meta["bootstrap"]["rows"] == fwd.meta["bootstrap"]["rows"] == toks.input_ids.shape[0]
    few = bootstrap_meta(1000, 0, toks.input_ids.shape[0])
    assert fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), open_trace(tmp_path / "b", "tiny")], ["a", "b"],
                                   FluctuationOptions(routing=("router",)), None).meta["bootstrap"] == few
    # the same routing through vLLM's format: ids only
    lines = [json.dumps(ew.vllm_response(ew.vllm_routed_experts(ex, 4, 8), ids, [ids[0]]))
             for ex, ids in _requests(tr_early, captured["cols"])]
    (tmp_path / "early.jsonl").write_text("\n".join(lines) + "\n")
    assert import_cli([tmp_path / "early.jsonl"], tmp_path / "early").exit_code == 0
    got = fluctuation_from_traces([open_trace(tmp_path / "early"), open_trace(imported["vllm"])], ["a", "b"], opts,
                                  None)
    assert "top1_change" not in got["fluctuation"].columns and "top1_change" in got.meta["left_out"]
    _same(got["fluctuation"], ref, ["layer", "tokens", *rates])


def test_fluctuation_between_traces_follows_the_reference(captured, tmp_path):
    """Three recorded routings a (tiny-early), b (tiny), c (a copy of a) with reference first: the pairs (a, b)
    and (a, c), so c's rows compare identical routings (no change, overlap 1) and b's are the two-trace comparison
    of a and b. The pairs of 'previous' ((a, b), (b, c)) ran whatever the reference survived the suite."""
    import moetool
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace.compute import trace
    from moetool.experiments.trace_analyses import fluctuation_from_traces

    tr_early = trace(moetool.load("tiny-early"), captured["tokens"], quiet=True)["trace"]
    for name, tr in (("a", tr_early), ("b", captured["trace"]), ("c", tr_early)):
        (tmp_path / name).mkdir()
        tr.to_parquet(tmp_path / name / "trace.parquet", index=False)
    srcs = [open_trace(tmp_path / name, "tiny") for name in "abc"]
    rates = ["top1_change", "topk_change", "topk_overlap", "jaccard"]
    got = fluctuation_from_traces(srcs, ["a", "b", "c"], FluctuationOptions(reference="first", bootstrap=0),
                                  None)["fluctuation"]
    assert sorted(set(zip(got.reference, got.checkpoint))) == [("a", "b"), ("a", "c")]
    same = got[got.checkpoint == "c"]
    assert (same[["top1_change", "topk_change"]] == 0).all().all()
    assert (same[["topk_overlap", "jaccard"]] == 1).all().all()
    two = fluctuation_from_traces(srcs[:2], ["a", "b"], FluctuationOptions(bootstrap=0), None)["fluctuation"]
    _same(got[got.checkpoint == "b"], two, ["layer", "tokens", *rates])
    assert (two["topk_change"] > 0).any()  # a and b differ: a wrong pair would show


@pytest.mark.parametrize("kind", ("sglang", "eplb"))
def test_export_read_back(captured, imported, kind, tmp_path, no_figures):
    """The exported placement, read back as SGLang / EPLB's outputs are read, puts on each GPU the loads
    placement.csv reports for EPLB at that G and R."""
    out = tmp_path / "pl"
    r = runner.invoke(app, ["placement", "--trace", str(imported["vllm"]), "--gpus", "4", "--extra-slots", "1",
                            "--export", kind, "--out", str(out)])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(out / "placement.csv")
    eplb = table[(table.method == "eplb") & (table.gpus == 4)].sort_values("layer")
    loads = pd.read_csv(out / "placement_loads.csv")
    load = torch.tensor(np.stack([g.sort_values("expert")["load"].to_numpy() for _, g in loads.groupby("layer")]))
    if kind == "sglang":
        got = read_sglang_location(out / "sglang_expert_location.json", 8)
        phy2log = got["physical_to_logical_map"]
        assert phy2log.shape == (4, 8 + 4)
        count = (got["logical_to_all_physical_map"] >= 0).sum(-1)
    else:
        got = read_eplb(out / "eplb_placement.json")
        phy2log, count = got["phy2log"], got["logcnt"]
        assert got["num_gpus"] == 4 and got["num_replicas"] == 12 and got["layers"] == [0, 1, 2, 3]
    assert torch.equal(count, torch.stack([torch.bincount(p, minlength=8) for p in phy2log]))
    per_gpu = gpu_loads(load, phy2log, count, 4)
    assert np.allclose(imbalance(per_gpu).numpy(), eplb.imbalance.to_numpy(), rtol=1e-12)
    assert np.allclose(per_gpu.max(-1).values.numpy(), eplb.max_gpu_load.to_numpy(), rtol=1e-12)


@pytest.mark.parametrize("kind", ("sglang", "eplb"))
def test_export_placement_api(captured, imported, kind, tmp_path, no_figures):
    """``moetool.export_placement`` writes the file ``placement --export`` writes (same bytes, from a trace), and
    from a forward's result a placement whose per-GPU loads are the result's EPLB row; bad inputs raise one
    MoetoolError."""
    import moetool
    from moetool.traces.export import FILES

    out = tmp_path / "pl"
    r = runner.invoke(app, ["placement", "--trace", str(imported["vllm"]), "--gpus", "4", "--extra-slots", "1",
                            "--export", kind, "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = moetool.from_trace("placement", imported["vllm"], gpus=[4], extra_slots=[1])
    got = moetool.export_placement(res, kind, tmp_path / FILES[kind])
    assert got.read_bytes() == (out / FILES[kind]).read_bytes()
    res = moetool.placement(captured["lm"], captured["tokens"], gpus=[4], extra_slots=[1], bootstrap=0)
    path = moetool.export_placement(res, kind, tmp_path / ("fwd-" + FILES[kind]))
    if kind == "sglang":
        phy2log = read_sglang_location(path, 8)["physical_to_logical_map"]
        count = torch.stack([torch.bincount(p, minlength=8) for p in phy2log])
    else:
        back = read_eplb(path)
        phy2log, count = back["phy2log"], back["logcnt"]
    df = res["placement_loads"]
    load = torch.tensor(np.stack([g.sort_values("expert")["load"].to_numpy() for _, g in df.groupby("layer")]))
    eplb = res["placement"]
    eplb = eplb[(eplb.method == "eplb") & (eplb.gpus == 4)].sort_values("layer")
    assert np.allclose(gpu_loads(load, phy2log, count, 4).max(-1).values.numpy(), eplb.max_gpu_load.to_numpy(),
                       rtol=1e-12)
    with pytest.raises(moetool.MoetoolError, match="exists"):
        moetool.export_placement(res, kind, path)
    with pytest.raises(moetool.MoetoolError, match="one --gpus"):
        moetool.export_placement(captured["placement"], kind, tmp_path / "two.json")
    with pytest.raises(moetool.MoetoolError, match="placement result"):
        moetool.export_placement(captured["stats"], kind, tmp_path / "stats.json")
    with pytest.raises(moetool.MoetoolError, match="one of"):
        moetool.export_placement(res, "vllm", tmp_path / "v.json")


def test_an_export_takes_the_data_loads_not_the_reference_ones():
    """placement_loads of a placement with --reference-data: placement_loads.csv holds the reference's loads too
    (data_set 'reference', eplb_stale's); the export places the data's (data_set 'data'), layer by layer in expert
    order, as float64 -- here a hand table whose reference rows differ and whose rows are out of order."""
    from moetool.experiments.result import Result
    from moetool.traces.export import placement_loads

    rows = [("reference", 1, e, 100.0 + e) for e in range(3)] + [("data", 3, e, 10.0 * e + 1) for e in (2, 0, 1)] + \
        [("data", 1, e, 1.0 / (e + 3)) for e in (1, 2, 0)] + [("reference", 3, e, 7.0) for e in range(3)]
    df = pd.DataFrame(rows, columns=["data_set", "layer", "expert", "load"])
    got = placement_loads(Result("placement", {"placement_loads.csv": df}, None, meta={"n_experts": 3, "groups": 1}))
    assert got["layers"] == [1, 3] and got["n"] == 3 and got["groups"] == 1
    assert got["load"].dtype == torch.float64
    assert got["load"].tolist() == [[1 / 3, 1 / 4, 1 / 5], [1.0, 11.0, 21.0]]


def test_export_of_a_forward_uses_its_loads(captured, imported):
    """``placement --export`` after a forward exports from the result's own loads: the trace's, per layer."""
    from moetool.traces.export import placement_loads

    got = placement_loads(captured["placement"])
    _, ref = placement_from_trace(open_trace(imported["vllm"]), PlacementOptions(gpus=(2,), bootstrap=0))
    assert got["layers"] == ref["layers"] and got["n"] == ref["n"] and got["groups"] == ref["groups"] == 1
    assert torch.equal(got["load"], ref["load"])


def test_sglang_map_keeps_dense_layers_trivial(tmp_path):
    """A dense layer gets SGLang's own trivial row (arange(P) % n); the MoE layers EPLB's."""
    from moetool.traces.export import eplb_placement, write_export

    shape = ModelShape(3, {1: (4, 2), 2: (4, 2)}, "hand")
    load = torch.tensor([[9.0, 1, 1, 1], [1.0, 1, 1, 9]])
    placed = eplb_placement(load, 2, 2, 1, 1)
    write_export("sglang", tmp_path / "m.json", placed, [1, 2], shape, {})
    got = read_sglang_location(tmp_path / "m.json", 4)["physical_to_logical_map"]
    assert got[0].tolist() == [0, 1, 2, 3, 0, 1]
    assert torch.equal(got[1:], placed["phy2log"])
    assert (got[1] == 0).sum() == 3 and (got[2] == 3).sum() == 3  # the heavy expert replicated: 9 / 3 = 3 per slot


def test_an_exported_map_is_read_back_as_sglang_does_and_a_bad_one_is_one_line(tmp_path):
    """read_sglang_location: logical_to_all_physical_map by hand (each expert's slots in slot order, -1 padded to the
    most replicated); an id outside 0..n-1 (n itself included) or an expert without a slot is one line, never an
    IndexError nor a map that sends an expert's tokens nowhere. read_eplb: a logcnt or log2phy that disagrees with
    phy2log is one line."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3, 1, 1], [3, 2, 1, 0, 0, 3]]}))
    got = read_sglang_location(path, 4)["logical_to_all_physical_map"]
    assert got.tolist() == [[[0, -1, -1], [1, 4, 5], [2, -1, -1], [3, -1, -1]],
                            [[3, 4, -1], [2, -1, -1], [1, -1, -1], [0, 5, -1]]]
    for bad, words in (([[0, 1, 2, 3, 4]], "ids in 0..3"), ([[0, 1, 2, -1]], "ids in 0..3"),
                       ([[0, 1, 2, 2]], "no physical slot")):
        path.write_text(json.dumps({"physical_to_logical_map": bad}))
        with pytest.raises(MoetoolError, match=words):
            read_sglang_location(path, 4)
    good = {"layers": [1], "phy2log": [[0, 1, 2, 0]], "log2phy": [[[0, 3], [1, -1], [2, -1]]], "logcnt": [[2, 1, 1]]}
    path.write_text(json.dumps(good))
    assert read_eplb(path)["logcnt"].tolist() == [[2, 1, 1]]
    for key, value, words in (("logcnt", [[1, 2, 1]], "logcnt of layer 1"),
                              ("log2phy", [[[0, 3], [2, -1], [1, -1]]], "log2phy of layer 1 expert 1"),
                              ("log2phy", [[[0, -1], [1, -1], [2, -1]]], "log2phy of layer 1 expert 0")):
        path.write_text(json.dumps({**good, key: value}))
        with pytest.raises(MoetoolError, match=words):
            read_eplb(path)


# ----- bad input: one line, exit 2, nothing written --------------------------------------------------------------
def _refused(r, out: Path, words: str) -> None:
    assert r.exit_code == 2, r.output
    assert words in r.output and len([ln for ln in r.output.splitlines() if ln.startswith("error")]) == 1
    assert not out.exists()


def test_truncated_npy(captured, tmp_path):
    data = captured["files"]["vllm-npy"][0].read_bytes()
    (tmp_path / "t.npy").write_bytes(data[: len(data) - 7])
    _refused(import_cli([tmp_path / "t.npy"], tmp_path / "out"), tmp_path / "out", "truncated")


def test_truncated_pt(captured, tmp_path):
    data = captured["files"]["sglang-stat"][0].read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    _refused(import_cli([tmp_path / "t.pt"], tmp_path / "out"), tmp_path / "out", "truncated")


def test_a_dump_file_given_twice_is_refused(captured, tmp_path):
    """import-trace req.npy req.npy (or a folder and a file in it) read the file twice: '2 requests', every count
    doubled, exit 0. Now one line, exit 2, nothing written."""
    import shutil

    (tmp_path / "d").mkdir()
    f = shutil.copy(captured["files"]["vllm-npy"][0], tmp_path / "d" / "req.npy")
    for sources in ([f, f], [tmp_path / "d", f]):
        _refused(import_cli(sources, tmp_path / "out"), tmp_path / "out", "the same dump file given twice")


def test_empty_pt_is_one_line(tmp_path):
    """A 0-byte .pt (a dump whose writer died): torch.load's EOFError has no text, and taking its first line raised
    IndexError inside the error message: 'error: IndexError: list index out of range', exit 1. Now one line, exit 2,
    as a truncated .pt."""
    (tmp_path / "expert_distribution_recorder_0.pt").write_bytes(b"")
    r = import_cli([tmp_path / "expert_distribution_recorder_0.pt"], tmp_path / "out")
    _refused(r, tmp_path / "out", "not a readable .pt file (truncated?): EOFError")


def test_pt_with_code_refused(tmp_path):
    """A .pt holding a pickled object (not tensors and plain data) is never unpickled."""
    torch.save({"logical_count": torch.zeros(1, 4, 8), "hook": PlacementOptions()}, tmp_path / "x.pt")
    _refused(import_cli([tmp_path / "x.pt"], tmp_path / "out"), tmp_path / "out", "weights_only")


def test_layer_count_disagrees(captured, tmp_path):
    ex, _ = captured["requests"][0]
    np.save(tmp_path / "r.npy", ew.vllm_routed_experts(ex, 6, 8))  # a 6-layer model's dump, --config tiny has 4
    _refused(import_cli([tmp_path / "r.npy"], tmp_path / "out"), tmp_path / "out", "6 layers in the dump, 4")


def test_expert_count_disagrees(captured, tmp_path):
    ex, _ = captured["requests"][0]
    ex = {li: v + 8 for li, v in ex.items()}  # ids of a 16-expert model
    np.save(tmp_path / "r.npy", ew.vllm_routed_experts(ex, 4, 16))
    _refused(import_cli([tmp_path / "r.npy"], tmp_path / "out"), tmp_path / "out", "outside the 8 experts")


def test_physical_ids_without_map(captured, tmp_path):
    d = torch.load(captured["files"]["sglang-per-token"][0], weights_only=True)
    d.pop("last_physical_to_logical_map")
    torch.save(d, tmp_path / "nomap.pt")
    _refused(import_cli([tmp_path / "nomap.pt"], tmp_path / "out"), tmp_path / "out", "without last_physical")


def test_mixed_formats(captured, tmp_path):
    files = [captured["files"]["vllm"][0], captured["files"]["sglang-routed"][0]]
    _refused(import_cli(files, tmp_path / "out"), tmp_path / "out", "mixed formats")


def test_sglang_routed_wrong_model(captured, tmp_path):
    """Raw int32 of a model with another layers x top-K product cannot be reshaped from --config."""
    import base64

    raw = base64.b64encode(np.zeros(5 * 3, dtype=np.int32).tobytes()).decode()
    (tmp_path / "s.jsonl").write_text(json.dumps({"meta_info": {"routed_experts": raw}}) + "\n")
    _refused(import_cli([tmp_path / "s.jsonl"], tmp_path / "out"), tmp_path / "out", "no whole number")


def test_megatron_bad_records(tmp_path):
    """A record of another model's layer, another top-K, or ragged top_indices: one line each."""
    good = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2, "topk": 2,
            "top_indices": [[0, 1], [2, 3]]}
    for bad, words in (({"layer": 7}, "not an MoE layer"), ({"topk": 3, "top_indices": [[0, 1, 2], [1, 2, 3]]},
                                                                "top-3 in the trace"),
                       ({"top_indices": [[0, 1], [2]]}, "not a [num_tokens]"), ({"top_indices": [[0, 9], [2, 3]]},
                                                                                 "outside the 8 experts")):
        (tmp_path / "router_trace_rank0.jsonl").write_text(json.dumps({**good, **bad}) + "\n")
        _refused(import_cli([tmp_path / "router_trace_rank0.jsonl"], tmp_path / "out"), tmp_path / "out", words)


def test_dense_layers_masked_and_checked(captured):
    """With a dense layer (index 4 here) the dump's zero rows there are dropped; routed rows there are refused."""
    ex, ids = captured["requests"][0]
    shape = ModelShape(5, {i: (8, 2) for i in range(4)}, "hand")
    arr = ew.vllm_routed_experts(ex, 5, 8)
    got = readers.split_layers(arr, shape, "t")
    assert sorted(got) == [0, 1, 2, 3] and all((got[li] == ex[li]).all() for li in got)
    arr[:, 4] = 1
    with pytest.raises(MoetoolError, match="layer 4 is dense"):
        readers.split_layers(arr, shape, "t")


def test_trace_refusals(captured, imported, tmp_path):
    """What needs a forward, probabilities or the top-K order refuses in one line."""
    out = tmp_path / "out"
    cases = [(["stats", "--trace", str(imported["megatron"]), "--top-k", "1"], "sorted by expert id"),
             (["stats", "--trace", str(imported["megatron"]), "--coactivation", "adjacent"], "sorted by expert id"),
             (["stats", "--trace", str(imported["sglang-stat"]), "--coactivation", "adjacent"], "counts only"),
             (["stats", "--trace", str(imported["vllm"]), "--all-tokens"], "--all-tokens"),
             (["placement", "--trace", str(imported["vllm"]), "--reference-model", "tiny-early"], "--reference-model"),
             (["placement", "--trace", str(imported["vllm"]), "--export", "eplb"], "one --gpus G"),
             (["offload", "--trace", str(imported["sglang-stat"])], "counts only: the cache simulation needs"),
             (["fluctuation", "--trace", str(imported["vllm"]), "--trace", str(imported["sglang-stat"])],
              "counts only: the token-by-token comparison needs"),  # (it named offload's cache simulation)
             (["fluctuation", "--trace", str(imported["vllm"])],  # (it said "needs at least two checkpoints")
              "fluctuation --trace compares two or more recorded routings"),
             (["fluctuation", "tiny", "tiny-early", "--trace", str(imported["vllm"]), "--trace", str(imported["vllm"])],
              "checkpoints (a forward of each) or --trace runs, not both")]  # (it said "checkpoints needs a forward")
    for args, words in cases:
        _refused(runner.invoke(app, [*args, "--out", str(out)]), out, words)


def test_counts_duplicated_across_ranks(captured, tmp_path):
    """Two ranks' per_pass dumps of the same tokens: counts double, load fractions do not move; a note says so."""
    import shutil

    src = captured["files"]["sglang-per-pass"][0]
    for r in (0, 1):
        shutil.copy(src, tmp_path / f"expert_distribution_recorder_{r}.pt")
    shape = captured["shape"]
    two = readers.read([tmp_path], shape)
    one = readers.read([src], shape)
    for li in shape.moe_layers:
        assert (two.counts.counts[li] == 2 * one.counts.counts[li]).all()
    assert any("relative loads are unaffected" in n for n in two.notes)


def test_legacy_csv_counts_must_be_whole_and_not_negative(tmp_path):
    """SGLang's legacy CSV: a NaN, fractional or non-numeric count, or a negative one, is one line (it read
    'ValueError: cannot convert float NaN to integer', exit 1, or imported '-5 assignments')."""
    for i, (count, words) in enumerate((("nan", "count must be whole numbers"), ("1.5", "count must be whole numbers"),
                                        ("abc", "count must be whole numbers"),
                                        ("-5", "counts -5 assignments for layer 0, expert 1: a count cannot be "
                                               "negative"))):
        (tmp_path / f"d{i}.csv").write_text(f"layer_id,expert_id,count\n0,1,{count}\n")
        _refused(import_cli([tmp_path / f"d{i}.csv"], tmp_path / "out"), tmp_path / "out", words)


def test_counted_singular(tmp_path):
    """One request, one assignment: the summary line says so ('1 requests', '1 assignments' before)."""
    np.save(tmp_path / "r.npy", np.tile(np.array([0, 1]), (3, 4, 1)))
    r = import_cli([tmp_path / "r.npy"], tmp_path / "a")
    assert r.exit_code == 0, r.output
    assert "vllm: 3 tokens, 12 rows, 1 request\n" in r.output
    # one assignment is no counts dump of a top-2 model (refused at import since issue 5 item 4): 2 per layer
    (tmp_path / "d.csv").write_text("layer_id,expert_id,count\n" + "".join(f"{li},1,2\n" for li in range(4)))
    r = import_cli([tmp_path / "d.csv"], tmp_path / "b")
    assert r.exit_code == 0, r.output
    assert "sglang-dump: 8 assignments\n" in r.output


def test_repeated_expert_in_a_top_k(captured, tmp_path):
    """A token naming one expert twice in its top-K is no routing (vLLM's zero-filled buffer where nothing was
    written: every token [0, 0]); it was imported as two assignments of expert 0."""
    ex, ids = captured["requests"][0]
    ex = {li: v.copy() for li, v in ex.items()}
    ex[2][3:] = 0  # tokens 3.. of layer 2 never written
    T = len(ids)
    (tmp_path / "v.jsonl").write_text(json.dumps(ew.vllm_response(ew.vllm_routed_experts(ex, 4, 8), ids,
                                                                   [ids[0]])) + "\n")
    _refused(import_cli([tmp_path / "v.jsonl"], tmp_path / "out"), tmp_path / "out",
             f"v.jsonl:1 choice 0: layer 2, token 3 has expert 0 twice in its top-2 ({T - 3} of {T} tokens): a top-K "
             f"names K distinct experts")
    rec = {"step": 0, "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2, "topk": 2,
           "top_indices": [[0, 1], [5, 5]]}
    (tmp_path / "router_trace_rank0.jsonl").write_text(json.dumps(rec) + "\n")
    _refused(import_cli([tmp_path / "router_trace_rank0.jsonl"], tmp_path / "out"), tmp_path / "out",
             "layer 0, token 1 has expert 5 twice in its top-2 (1 of 2 tokens)")


def test_json_lines_that_are_not_objects(captured, tmp_path):
    """A line (or a choice) that is no JSON object after a good first line: one line, not an AttributeError
    traceback."""
    ex, ids = captured["requests"][0]
    vllm = json.dumps(ew.vllm_response(ew.vllm_routed_experts(ex, 4, 8), ids, [ids[0]]))
    sgl = json.dumps(ew.sglang_routed_response(ex, 4, len(ids) + 1))
    rec = json.dumps({"step": 0, "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2, "topk": 2,
                      "top_indices": [[0, 1], [2, 3]]})
    for name, text, words in (("v.jsonl", vllm + "\n42\n", "v.jsonl:2: a number, not a vLLM response"),
                              ("c.jsonl", vllm + '\n{"choices": ["x"]}\n',
                               "c.jsonl:2 choice 0: a string, not a completion choice"),
                              ("d.jsonl", vllm + '\n{"choices": {"a": 1}}\n', "d.jsonl:2: choices / outputs is not"),
                              ("s.jsonl", sgl + "\n[1]\n", "s.jsonl:2[0]: a number, not an SGLang response"),
                              ("router_trace_rank0.jsonl", rec + "\n[1]\n",
                               "router_trace_rank0.jsonl:2: an array, not a Megatron router trace record")):
        (tmp_path / name).write_text(text)
        _refused(import_cli([tmp_path / name], tmp_path / "out"), tmp_path / "out", words)


def test_a_pretty_printed_response_reads_as_its_one_line(captured, tmp_path):
    """A vLLM or SGLang response saved as one indented JSON document (``json.dump(r, f, indent=2)``, ``.json``) was
    refused ('the first line is not JSON'); it imports as the same response on one line does, row for row. A file
    that is neither stays one line."""
    ex, ids = captured["requests"][0]
    for kind, obj in (("vllm", ew.vllm_response(ew.vllm_routed_experts(ex, 4, 8), ids, [ids[0]])),
                      ("sglang", ew.sglang_routed_response(ex, 4, len(ids) + 1))):
        (tmp_path / f"{kind}.jsonl").write_text(json.dumps(obj) + "\n")
        (tmp_path / f"{kind}.json").write_text(json.dumps(obj, indent=2) + "\n")
        tables = []
        for suffix in ("jsonl", "json"):
            out = tmp_path / f"{kind}-{suffix}"
            r = import_cli([tmp_path / f"{kind}.{suffix}"], out)
            assert r.exit_code == 0, r.output
            tables.append(pd.read_parquet(out / "trace.parquet"))
        assert len(tables[0]) == 4 * len(ids)  # every token of every layer
        pd.testing.assert_frame_equal(tables[0], tables[1])
    (tmp_path / "bad.json").write_text("{\n  \"choices\": [\n")  # cut short
    _refused(import_cli([tmp_path / "bad.json"], tmp_path / "out"), tmp_path / "out", "the first line is not JSON")


def test_ids_and_counts_must_be_integers(tmp_path):
    """Float (or string) expert ids and counts were truncated to integers (SGLang routed_experts_dtype float32:
    2.7 read as expert 2; Megatron [[0.5, 1.9]] as [0, 1]; a stat dump's 1.5 counts as 1): one line each."""
    import base64

    raw = base64.b64encode(np.tile(np.array([0.7, 1.7], dtype=np.float32), (3, 4, 1)).tobytes()).decode()
    (tmp_path / "s.jsonl").write_text(json.dumps({"meta_info": {"routed_experts": raw,
                                                                "routed_experts_dtype": "float32"}}) + "\n")
    _refused(import_cli([tmp_path / "s.jsonl"], tmp_path / "out"), tmp_path / "out",
             "routed_experts_dtype 'float32' is not an integer type")
    recs = [{"step": 0, "block": "decoder", "layer": li, "rank": 0, "num_tokens": 2, "topk": 2,
             "top_indices": [[0.5, 1.9], [2, 3]]} for li in range(4)]
    (tmp_path / "router_trace_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _refused(import_cli([tmp_path / "router_trace_rank0.jsonl"], tmp_path / "out"), tmp_path / "out",
             "top_indices is not a [num_tokens][2] list of expert ids (integers)")
    torch.save({"rank": 0, "logical_count": torch.full((1, 4, 8), 1.5)}, tmp_path / "stat.pt")
    _refused(import_cli([tmp_path / "stat.pt"], tmp_path / "out"), tmp_path / "out",
             "logical_count: integer counts / expert ids expected, got dtype float32")
    p2l = ew.physical_map(4, 8, REDUNDANT)
    ew.sglang_detail_dump(tmp_path / "pass.pt", [{"global_physical_count": torch.full((4, 12), 0.5)}], p2l)
    _refused(import_cli([tmp_path / "pass.pt"], tmp_path / "out"), tmp_path / "out",
             "global_physical_count: integer counts / expert ids expected, got dtype float32")


def test_sglang_dump_malformed(captured, tmp_path):
    """Records without counts or not a list, sequence lengths that disagree with the tokens (they were read as a
    decode pass: one row per token), a negative map entry (the message named the map's largest entry), a CSV
    line with a fourth field (pandas made the first field the index: '0,1,3,4' counted 4 for layer 1, expert 3):
    one line each."""
    p2l = ew.physical_map(4, 8, REDUNDANT)
    ew.sglang_detail_dump(tmp_path / "a.pt", [{"forward_pass_id": 0}], p2l)
    _refused(import_cli([tmp_path / "a.pt"], tmp_path / "out"), tmp_path / "out",
             "a per_pass record without global_physical_count")
    torch.save({"records": "x", "last_physical_to_logical_map": p2l}, tmp_path / "b.pt")
    _refused(import_cli([tmp_path / "b.pt"], tmp_path / "out"), tmp_path / "out",
             "records is not a list of per-pass records")
    ex, ids = captured["requests"][0]
    rec = ew.sglang_per_token_record(0, ex, ids, list(range(len(ids))), 4, p2l)
    rec["extend_seq_lens"] = [2, 2]
    ew.sglang_detail_dump(tmp_path / "c.pt", [rec], p2l)
    _refused(import_cli([tmp_path / "c.pt"], tmp_path / "out"), tmp_path / "out",
             f"c.pt forward pass 0: extend_seq_lens [2, 2] sum to 4, not the {len(ids)} tokens")
    bad = p2l.clone()
    bad[0, 0] = -3
    ew.sglang_detail_dump(tmp_path / "d.pt", [{"global_physical_count": torch.ones(4, 12, dtype=torch.int64)}], bad)
    _refused(import_cli([tmp_path / "d.pt"], tmp_path / "out"), tmp_path / "out",
             "the physical-to-logical map names expert -3, outside the 8 experts")
    (tmp_path / "e.csv").write_text("layer_id,expert_id,count\n0,1,3,4\n")
    _refused(import_cli([tmp_path / "e.csv"], tmp_path / "out"), tmp_path / "out",
             "a line with more fields than layer_id,expert_id,count")


def test_trace_config_must_agree_with_the_manifest(imported, tmp_path):
    """--trace-config of another model than the one the trace's manifest records was taken as is: offload simulated
    caches of up to 32 experts on an 8-expert trace, stats reported n = 32."""
    out = tmp_path / "out"
    for cmd in ("stats", "offload", "placement"):
        _refused(runner.invoke(app, [cmd, "--trace", str(imported["vllm"]), "--trace-config", "tiny-fine", "--out",
                                     str(out)]), out,
                 "--trace-config tiny-fine: 4 layers, MoE layers 0-3 of 32 experts, top-4, but the trace's manifest "
                 "records 4 layers, MoE layers 0-3 of 8 experts, top-2 (tiny)")
    assert open_trace(imported["vllm"], "tiny-early").shape.moe == open_trace(imported["vllm"]).shape.moe


def test_stats_trace_without_lift_pairs(captured, imported):
    """No (token, expert) pair reaches --min-count: no top_tokens_lift table, as the forward's stats (the run
    failed with 'nothing to write to top_tokens_lift.csv')."""
    from moetool.experiments.stats.compute import stats

    opts = StatsOptions(top_tokens=5, min_count=10 ** 6, bootstrap=0)
    res = stats_from_trace(open_trace(imported["vllm"]), opts)
    ref = stats(captured["lm"], captured["tokens"], opts, quiet=True)
    assert "top_tokens_lift.csv" not in ref.tables and "top_tokens_lift.csv" not in res.tables
    assert all(len(df) for df in res.tables.values())
    pd.testing.assert_frame_equal(res["top_tokens"].reset_index(drop=True), ref["top_tokens"].reset_index(drop=True),
                                  check_dtype=False)


def test_fluctuation_traces_of_other_text_or_model(captured, tmp_path):
    """Traces with the same (row, position) keys but other token ids (another text) or another model's shape were
    compared: a table of 'routing change' between unrelated tokens."""
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace_analyses import fluctuation_from_traces
    from moetool.traces.store import TraceSource

    tr = captured["trace"]
    other = tr.copy()
    sel = (other.row == 1) & (other.pos == 4)
    old = int(other.loc[sel, "token_id"].iloc[0])
    other.loc[sel, "token_id"] = old + 1
    for name, df in (("a", tr), ("b", other)):
        (tmp_path / name).mkdir()
        df.to_parquet(tmp_path / name / "trace.parquet", index=False)
    opts = FluctuationOptions(routing=("router",), bootstrap=0)
    with pytest.raises(MoetoolError, match=rf"^--trace b: not the same text as a: row 1, position 4 is token "
                                           rf"{old + 1} there, {old} in a \(1 of 256 tokens differ\)$"):
        fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), open_trace(tmp_path / "b", "tiny")], ["a", "b"],
                                opts, None)
    wide = TraceSource(tmp_path / "a" / "trace.parquet", "trace", ModelShape(4, {i: (16, 2) for i in range(4)}, "x"))
    with pytest.raises(MoetoolError, match=r"^--trace c: another model's routing: layer 0 has 16 experts, top-2, a 8 "
                                           r"experts, top-2$"):
        fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), wide], ["a", "c"], opts, None)


def test_a_counts_dump_stats_would_refuse_is_refused_at_import(tmp_path):
    """A legacy SGLang CSV whose layer counts are not a multiple of K, or that covers layers 0-1 of the 4 of
    --config, imported (exit 0, 'sglang-dump: 1,804 assignments'); stats/placement --trace then refused it
    ('not a multiple of top-2', 'layer 2 routed no token'). Now import-trace refuses it in one line, nothing
    written, with the check stats uses (store.check_counts): reading a loads file back says the same."""
    lines = "".join(f"{li},{e},{3 if (li, e) == (0, 0) else 2}\n" for li in range(4) for e in range(8))
    (tmp_path / "odd.csv").write_text("layer_id,expert_id,count\n" + lines)
    _refused(import_cli([tmp_path / "odd.csv"], tmp_path / "out"), tmp_path / "out",
             "layer 0 counts 17 assignments, not a multiple of top-2")
    two = "".join(f"{li},{e},2\n" for li in range(2) for e in range(8))
    (tmp_path / "two.csv").write_text("layer_id,expert_id,count\n" + two)
    _refused(import_cli([tmp_path / "two.csv"], tmp_path / "out"), tmp_path / "out",
             "layer 2 is not in the dump (MoE layers of tiny: 0-3); a counts dump covers every MoE layer")
    zero = two + "".join(f"{li},{e},0\n" for li in (2, 3) for e in range(8))
    (tmp_path / "zero.csv").write_text("layer_id,expert_id,count\n" + zero)
    _refused(import_cli([tmp_path / "zero.csv"], tmp_path / "out"), tmp_path / "out", "layer 2 routed no token")
    from moetool.traces.store import check_counts

    shape = ModelShape.from_config("tiny")
    counts = {li: np.full(8, 2, dtype=np.int64) for li in (0, 1)}
    with pytest.raises(MoetoolError, match=r"^--trace t: layer 2 is not in the trace \(MoE layers of tiny: 0-3\)"):
        check_counts(counts, shape, "--trace t", noun="trace")
    check_counts(counts, shape, "--trace t", noun="trace", layers=(0, 1))  # the layers asked are there
    (tmp_path / "all.csv").write_text("layer_id,expert_id,count\n" + "".join(f"{li},{e},2\n" for li in range(4)
                                                                             for e in range(8)))
    assert import_cli([tmp_path / "all.csv"], tmp_path / "ok").exit_code == 0


def test_a_trace_read_with_trace_config_has_its_ids_checked(captured, tmp_path):
    """A trace file given with --trace-config (no manifest recording its rows): an id beyond n, a negative one, a
    token naming one expert twice or a fractional id. offload --trace crashed (IndexError traceback, exit 1), stats
    and placement counted a repeated expert twice (layer 0 expert 2: load 74 of 512 assignments instead of the 73 a
    forward counts, in the run of this fixture) and truncated 1.5 to 1. Now one line each, exit 2, nothing written, as import-trace refuses such
    ids (readers.check_ids)."""
    tr = captured["trace"].reset_index(drop=True)
    first = tr.index[tr.layer == 0][5]  # layer 0, the 6th token
    e1, e2 = int(tr.loc[first, "expert_1"]), int(tr.loc[first, "expert_2"])
    cases = {"dup": ("expert_2", e1, f"layer 0, token 5 has expert {e1} twice in its top-2 (1 of 256 tokens): a "
                                     f"top-K names K distinct experts (a damaged or edited trace?)"),
             "frac": ("expert_2", e2 + 0.5, "layer 0 has expert ids that are not whole numbers"),
             "big": ("expert_1", 8, "layer 0 has expert id 8, outside the 8 experts of the model"),
             "neg": ("expert_2", -1, "layer 0 has expert id -1, outside the 8 experts of the model")}
    out = tmp_path / "out"
    for name, (col, value, words) in cases.items():
        bad = tr.copy()
        if isinstance(value, float):
            bad[col] = bad[col].astype(np.float64)
        bad.loc[first, col] = value
        (tmp_path / name).mkdir()
        bad.to_parquet(tmp_path / name / "trace.parquet", index=False)
        for cmd in ("stats", "placement", "offload"):
            _refused(runner.invoke(app, [cmd, "--trace", str(tmp_path / name), "--trace-config", "tiny", "--out",
                                         str(out)]), out, words)
    # the untouched file gives the forward's loads (the reference: moetool.stats on the model)
    (tmp_path / "ok").mkdir()
    tr.to_parquet(tmp_path / "ok" / "trace.parquet", index=False)
    res = stats_from_trace(open_trace(tmp_path / "ok", "tiny"), StatsOptions(top_tokens=0, bootstrap=0))
    _same(res["load"], captured["stats"]["load"], ["layer", "expert", "tokens", "load_fraction"])


def test_an_imported_trace_away_from_its_manifest_is_refused(captured, imported, tmp_path):
    """An import-trace trace.parquet copied without its manifest.json and given with --trace-config was read as a
    trace of moetool trace (gate weights, ids ranked): fluctuation took the top-1 of its NaN weights, i.e. its first
    column -- for Megatron's ids, sorted by expert id, the smallest -- and reported top1_change of about 0.4 per layer
    between two copies of the same routing (0 by definition; the manifest-backed import leaves it out), and stats
    --top-k 1 ran on sorted ids. Now a NaN gate weight is one line naming the lost manifest."""
    import shutil

    (tmp_path / "bare").mkdir()
    shutil.copy(imported["megatron"] / "trace.parquet", tmp_path / "bare" / "trace.parquet")
    (tmp_path / "own").mkdir()
    captured["trace"].to_parquet(tmp_path / "own" / "trace.parquet", index=False)
    out = tmp_path / "out"
    words = "layer 0 has NaN gate weights: an import-trace trace without the manifest.json written beside it"
    for args in (["fluctuation", "--trace", str(tmp_path / "bare"), "--trace", str(tmp_path / "own"), "--bootstrap",
                  "0"], ["stats", "--top-k", "1", "--trace", str(tmp_path / "bare")], ["offload", "--trace",
                                                                                       str(tmp_path / "bare")]):
        _refused(runner.invoke(app, [*args, "--trace-config", "tiny", "--out", str(out)]), out, words)
    # with its manifest: the same routing, so no set changes, and top1_change left out (the engines record no weights)
    r = runner.invoke(app, ["fluctuation", "--trace", str(imported["megatron"]), "--trace", str(tmp_path / "own"),
                            "--trace-config", "tiny", "--bootstrap", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out / "fluctuation.csv")
    assert "top1_change" not in df.columns and (df["topk_change"] == 0).all() and (df["jaccard"] == 1).all()


def test_malformed_token_ids_and_record_fields_are_one_line(captured, tmp_path):
    """Token ids that are no vocabulary entries, an sglext that is no object, Megatron record fields that are no
    whole numbers. A string or null token id was a raw ValueError/TypeError traceback (exit 1); 1.5 was imported as
    token 1 and -7 as a token id (where -1 means 'no ids'); an sglext string an AttributeError traceback; Megatron's
    layer 0.5 was read as layer 0, topk 2.9 as top-2, num_tokens true as 1 token. Now one line each, exit 2, nothing
    written."""
    ex, ids = captured["requests"][0]
    routed = ew.vllm_routed_experts(ex, 4, 8)
    T = routed.shape[0]
    words = "the token ids must be a list of whole numbers 0 or more"
    for i, bad in enumerate(("a", None, 1.5, -7)):
        prompt = list(ids)
        prompt[1] = bad
        (tmp_path / f"v{i}.jsonl").write_text(json.dumps(ew.vllm_response(routed, prompt, [ids[0]])) + "\n")
        _refused(import_cli([tmp_path / f"v{i}.jsonl"], tmp_path / "out"), tmp_path / "out", words)
    sgl = ew.sglang_routed_response(ex, 4, T + 1)["meta_info"]["routed_experts"]
    (tmp_path / "s.jsonl").write_text(json.dumps({"choices": [{"sglext": {"routed_experts": sgl}},
                                                              {"sglext": "x"}]}) + "\n")
    _refused(import_cli([tmp_path / "s.jsonl"], tmp_path / "out"), tmp_path / "out",
             "s.jsonl:1 choice 1 sglext: a string, not SGLang's extension fields (a JSON object)")
    good = {"step": 0, "stage": "pre_dispatch", "block": "decoder", "rank": 0, "num_tokens": 1, "topk": 2,
            "top_indices": [[0, 1]]}
    for i, bad in enumerate(({"layer": 0.5}, {"topk": 2.9}, {"num_tokens": True}, {"layer": "0"})):
        recs = [{**good, "layer": li, **(bad if li == 0 else {})} for li in range(4)]
        (tmp_path / f"m{i}").mkdir()
        (tmp_path / f"m{i}" / "router_trace_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        _refused(import_cli([tmp_path / f"m{i}"], tmp_path / "out"), tmp_path / "out",
                 "router_trace_rank0.jsonl:1: not a Megatron router trace record (layer, topk, num_tokens: whole "
                 "numbers; top_indices)")
    # the same lines with whole numbers import, token ids and experts as written (the reference: the dump itself)
    r = import_cli([captured["files"]["vllm"][0]], tmp_path / "ok")
    assert r.exit_code == 0, r.output
    tr = pd.read_parquet(tmp_path / "ok" / "trace.parquet")
    first = tr[(tr.row == 0) & (tr.layer == 0)].sort_values("pos")
    assert first.token_id.tolist() == list(ids) and (first[captured["cols"]].to_numpy() == ex[0]).all()


def test_a_placement_of_a_trace_names_the_trace_s_model_in_its_headline(imported, tmp_path, no_figures):
    """placement --trace recorded the headline 'placement placement: max/mean GPU load ...' (no model loaded: the
    experiment's name stood in for the model's), the first line of moetool report's summary table. Now the model
    whose routing the trace is, marked as a trace; the numbers are those of placement_overall.csv."""
    out = tmp_path / "pl"
    r = runner.invoke(app, ["placement", "--trace", str(imported["vllm"]), "--gpus", "2,4", "--extra-slots", "0,1",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    headline = json.loads((out / "manifest.json").read_text())["headline"]
    df = pd.read_csv(out / "placement_overall.csv")
    four = df[df.gpus == 4]
    parts = [f"{m}{f' R={R}' if R else ''} {x:.4g}x" for m, R, x in zip(four.method, four.replicas, four.imbalance)]
    assert headline == ["placement tiny (trace): max/mean GPU load on 4 GPUs: " + ", ".join(parts)]


def test_stats_offload_and_fluctuation_of_traces_record_their_headlines(captured, tmp_path, no_figures):
    """stats, offload and fluctuation --trace recorded no headline (their results' names, ``stats_trace``, ..., found
    no experiment, and stats' and offload's lines read tables a trace does not have), so moetool report's summary
    table left them out. Each now records its experiment's lines of the tables it wrote, with their numbers."""
    runs = {}
    for name, lm in (("a", "tiny-early"), ("b", "tiny")):
        runs[name] = tmp_path / name
        r = runner.invoke(app, ["trace", "--model", lm, "--max-tokens", "256", "--seq-len", "32", "--out",
                                str(runs[name]), "-q"])
        assert r.exit_code == 0, r.output
    heads = {}
    for cmd, args in (("stats", [str(runs["b"])]), ("offload", [str(runs["b"])]),
                      ("fluctuation", [str(runs["a"]), str(runs["b"])])):
        out = tmp_path / cmd
        r = runner.invoke(app, [cmd, *sum((["--trace", a] for a in args), []), "--out", str(out), "-q"])
        assert r.exit_code == 0, r.output
        heads[cmd] = (json.loads((out / "manifest.json").read_text()).get("headline"), out)
    (st, out) = heads["stats"]
    layers = pd.read_csv(out / "layers.csv")
    assert st[0].startswith(f"stats tiny (trace): load entropy / log n {layers.load_entropy_norm.min():.3f}-"
                            f"{layers.load_entropy_norm.max():.3f} over 4 MoE layers")
    (off, out) = heads["offload"]
    cache = pd.read_csv(out / "offload_cache.csv")
    c4 = cache[cache.capacity == 4]
    assert f"tiny (trace) offload C=4: hit rate (mean over layers) lru {c4[c4.policy == 'lru'].hit_rate.mean():.3f}" \
        in off[1]
    (fl, out) = heads["fluctuation"]
    df = pd.read_csv(out / "fluctuation.csv")
    assert fl == [f"{runs['a']} -> {runs['b']} (recorded routing): top-1 change {df.top1_change.mean():.4f}, "
                  f"top-K change {df.topk_change.mean():.4f} (mean over layers)"]


def test_sglang_per_token_record_fields_are_checked(captured, tmp_path):
    """A per_token dump whose records are not what SGLang's recorder writes: a record without topk_ids_of_layer
    among per_token ones (KeyError traceback, exit 1), negative extend_seq_lens (numpy's ValueError traceback),
    fractional or negative positions / input_ids and float expert ids or map (truncated to integers: position 0.5
    imported as 0). Now one line each, exit 2, nothing written; the untouched dump imports its tokens' positions and
    ids as written."""
    d = torch.load(captured["files"]["sglang-per-token"][0], weights_only=True)
    T = len(d["records"][0]["input_ids"])

    def edited(name, change):
        e = {**d, "records": [dict(r) for r in d["records"]]}
        change(e, e["records"][1])
        torch.save(e, tmp_path / f"{name}.pt")
        return tmp_path / f"{name}.pt"

    where = "forward pass 1: "
    cases = [("notopk", lambda e, r: r.pop("topk_ids_of_layer"),
              where + "a record without topk_ids_of_layer among per_token records"),
             ("lens", lambda e, r: r.update(extend_seq_lens=[T + 1, -1]),
              where + "extend_seq_lens must be whole numbers 0 or more"),
             ("pos", lambda e, r: r.update(positions=[p + 0.5 for p in r["positions"]]),
              where + f"positions must be {T} whole numbers 0 or more (one per token of topk_ids_of_layer)"),
             ("ids", lambda e, r: r.update(input_ids=[-3] + r["input_ids"][1:]),
              where + f"input_ids must be {T} whole numbers 0 or more"),
             ("topk", lambda e, r: r.update(topk_ids_of_layer=r["topk_ids_of_layer"].float()),
              where + "topk_ids_of_layer: integer counts / expert ids expected, got dtype float32"),
             ("map", lambda e, r: e.update(last_physical_to_logical_map=e["last_physical_to_logical_map"].float()),
              "last_physical_to_logical_map: integer counts / expert ids expected, got dtype float32")]
    for name, change, words in cases:
        _refused(import_cli([edited(name, change)], tmp_path / "out"), tmp_path / "out", words)
    r = import_cli(captured["files"]["sglang-per-token"], tmp_path / "ok")
    assert r.exit_code == 0, r.output
    tr = pd.read_parquet(tmp_path / "ok" / "trace.parquet")
    rec = d["records"][1]
    got = tr[(tr.row == 1) & (tr.layer == 0)]
    assert got.pos.tolist() == list(rec["positions"]) and got.token_id.tolist() == list(rec["input_ids"])


def test_trace_config_must_agree_on_zero_computation_experts(tmp_path, monkeypatch):
    """--trace-config of a model with the trace's layers, n and K but no zero-computation experts was taken as is:
    placement --trace then placed LongCat's 2 identity experts as GPU experts (n_experts 10, not the 8 the trace's
    manifest implies). Now refused in one line naming the difference; without --trace-config the 8 computed experts
    are placed."""
    from moetool.traces.readers import Chunk
    from moetool.traces.store import write_trace

    recorded = ModelShape(8, {i: (10, 2) for i in range(4)}, "longcat", {i: 2 for i in range(4)})
    gen = np.random.default_rng(0)
    experts = {li: np.stack([gen.permutation(10)[:2] for _ in range(12)]) for li in range(4)}
    (tmp_path / "t").mkdir()
    write_trace(iter([Chunk(np.zeros(12, dtype=np.int64), np.arange(12), np.full(12, -1), experts)]), recorded,
                tmp_path / "t" / "trace.parquet")
    (tmp_path / "t" / "manifest.json").write_text(json.dumps({"routing_source": {"kind": "trace", "order": "as the "
                                                                                 "router returned them",
                                                                                 "shape": recorded.to_manifest()}}))
    plain = ModelShape(8, {i: (10, 2) for i in range(4)}, "plain")
    monkeypatch.setattr(ModelShape, "from_config", classmethod(lambda cls, name: plain))
    with pytest.raises(MoetoolError, match=r"^--trace-config plain: 8 layers, MoE layers 0-3 of 10 experts, top-2, but "
                                           r"the trace's manifest records 8 layers, MoE layers 0-3 of 10 experts \(2 of "
                                           r"them zero-computation\), top-2 \(longcat\)"):
        open_trace(tmp_path / "t", "plain")
    res, loads = placement_from_trace(open_trace(tmp_path / "t"), PlacementOptions(gpus=(2,), bootstrap=0))
    assert loads["n"] == 8 and res.meta["zero_computation_experts_not_placed"] == 2


def test_fluctuation_top1_of_a_token_that_lost_all_its_experts(captured, tmp_path):
    """A capacity trace's token can lose all K experts (every weight 0): a forward's fluctuation gives it no top-1
    (-1, fluctuation.compute.chosen_and_top1), --trace took the argmax of its zeros, i.e. its first column. Two traces
    of the same routing that list such a token's dropped experts in another order then differed in top1_change
    (3 / 256 tokens at layer 0); by the definition they do not: every rate is 0 but on the tokens where they differ."""
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace_analyses import fluctuation_from_traces

    a = captured["trace"].reset_index(drop=True)
    lost = a.index[a.layer == 0][[3, 50, 200]]
    a.loc[lost, ["weight_1", "weight_2"]] = 0.0  # these tokens lost both experts at layer 0
    b = a.copy()
    b.loc[lost, ["expert_1", "expert_2"]] = a.loc[lost, ["expert_2", "expert_1"]].to_numpy()
    for name, df in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        df.to_parquet(tmp_path / name / "trace.parquet", index=False)
    res = fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), open_trace(tmp_path / "b", "tiny")],
                                  ["a", "b"], FluctuationOptions(bootstrap=0), None)["fluctuation"]
    assert (res["top1_change"] == 0).all() and (res["topk_change"] == 0).all() and (res["tokens"] == 256).all()


def test_fluctuation_jaccard_is_exact_where_every_token_shares_one_of_two_experts(captured, tmp_path):
    """Two traces whose layer-0 top-2 sets share exactly one expert for every token (b's second expert replaced by
    one in neither set): the Jaccard of every token is 1/3, so the layer's mean is 1/3. It read 0.3333333432674408
    (1/3 in fp32, ops.jaccard's dtype, carried into the float64 mean: 1e-8 off, the fluctuation tables printed
    0.72135417070 where the rational mean is 0.72135416667); now the per-token ratio is float64, as topk_overlap
    already was. The other layers, unchanged, read 1 and topk_overlap 1/2 at layer 0 (hand values)."""
    from moetool.experiments.fluctuation.compute import FluctuationOptions
    from moetool.experiments.trace_analyses import fluctuation_from_traces

    a = captured["trace"].reset_index(drop=True)
    b = a.copy()
    l0 = a.index[a.layer == 0]
    e1, e2 = a.loc[l0, "expert_1"].to_numpy(), a.loc[l0, "expert_2"].to_numpy()
    third = np.array([min({0, 1, 2} - {x, y}) for x, y in zip(e1, e2)])  # an expert in neither set
    b.loc[l0, "expert_2"] = third
    for name, df in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        df.to_parquet(tmp_path / name / "trace.parquet", index=False)
    res = fluctuation_from_traces([open_trace(tmp_path / "a", "tiny"), open_trace(tmp_path / "b", "tiny")],
                                  ["a", "b"], FluctuationOptions(bootstrap=0), None)["fluctuation"]
    res = res.set_index("layer")
    assert abs(res.loc[0, "jaccard"] - 1 / 3) < 1e-15, res.loc[0, "jaccard"]
    assert abs(res.loc[0, "topk_overlap"] - 1 / 2) < 1e-15
    assert (res.loc[[1, 2, 3], "jaccard"] == 1).all() and (res["tokens"] == len(l0)).all()


# ----- hand-built dumps (mutation pass 4): layer mapping, rows of a pass, micro-batches, what is refused ------------
HAND = ModelShape(4, {i: (8, 2) for i in range(4)}, "hand")


def _hand_experts(T: int, layers, seed: int = 0) -> dict[int, np.ndarray]:
    """Distinct top-2 logical ids per token and layer."""
    g = np.random.default_rng(seed)
    return {li: np.stack([g.permutation(8)[:2] for _ in range(T)]) for li in layers}


def _per_token_pt(path: Path, records: list[dict], p2l: torch.Tensor) -> None:
    torch.save(dict(records=records, last_physical_to_logical_map=p2l), str(path))


def _per_token_record(experts: dict[int, np.ndarray], T: int, L: int = 4, **fields) -> dict:
    """A per_token record over an identity physical map: ``topk_ids_of_layer [L, T, 8]`` -1 padded."""
    topk = torch.full((L, T, 8), -1, dtype=torch.int32)
    for li, ids in experts.items():
        topk[li, :, :2] = torch.from_numpy(ids)
    return dict(forward_pass_id=0, topk_ids_of_layer=topk, **fields)


def test_a_dense_first_layer_maps_every_moe_layer_to_its_own_column():
    """DeepSeek's layout (layer 0 dense, 1-4 MoE): layer li's experts are the dump's column li, not the li-th MoE
    layer's position (column li - 1: every layer's routing one layer off)."""
    shape = ModelShape(5, {i: (8, 2) for i in range(1, 5)}, "hand")
    ex = _hand_experts(6, range(1, 5), seed=1)
    arr = np.zeros((6, 5, 2), dtype=np.uint8)
    for li, ids in ex.items():
        arr[:, li] = ids
    got = readers.split_layers(arr, shape, "t")
    assert sorted(got) == [1, 2, 3, 4] and all((got[li] == ex[li]).all() for li in got)


def test_sglang_per_token_dense_layers_stay_unrouted_through_the_physical_map(tmp_path):
    """A per_token dump of a model with a dense first layer: its -1 ids are kept as -1 by the physical-to-logical
    map (not read as physical slot 0's expert), so the dense layer is not taken for a routed one."""
    shape = ModelShape(5, {i: (8, 2) for i in range(1, 5)}, "hand")
    ex = _hand_experts(4, range(1, 5), seed=4)
    p2l = torch.arange(8).flip(0).repeat(5, 1)  # physical slot s holds logical expert 7 - s
    _per_token_pt(tmp_path / "d.pt", [_per_token_record({li: 7 - v for li, v in ex.items()}, 4, L=5)], p2l)
    chunks = list(readers.read([tmp_path / "d.pt"], shape).chunks)
    assert len(chunks) == 1 and sorted(chunks[0].experts) == [1, 2, 3, 4]
    assert all((chunks[0].experts[li] == ex[li]).all() for li in range(1, 5))


def test_sglang_per_token_rows_follow_extend_seq_lens_and_decode_passes(tmp_path):
    """A prefill pass of two sequences (extend_seq_lens [2, 3]) is rows 0 and 1 (tokens 2 + 3), the decode pass
    after it (no lengths: one token per request) rows 2, 3, 4; positions and input ids as recorded."""
    ex1, ex2 = _hand_experts(5, range(4), 2), _hand_experts(3, range(4), 3)
    recs = [_per_token_record(ex1, 5, extend_seq_lens=[2, 3], positions=[0, 1, 0, 1, 2], input_ids=[5, 6, 7, 8, 9]),
            _per_token_record(ex2, 3, positions=[2, 3, 3], input_ids=[10, 11, 12])]
    _per_token_pt(tmp_path / "d.pt", recs, torch.arange(8).repeat(4, 1))
    chunks = list(readers.read([tmp_path / "d.pt"], HAND).chunks)
    assert [c.row.tolist() for c in chunks] == [[0, 0, 1, 1, 1], [2, 3, 4]]
    assert [c.pos.tolist() for c in chunks] == [[0, 1, 0, 1, 2], [2, 3, 3]]
    assert [c.token_id.tolist() for c in chunks] == [[5, 6, 7, 8, 9], [10, 11, 12]]
    assert all((chunks[0].experts[li] == ex1[li]).all() and (chunks[1].experts[li] == ex2[li]).all() for li in range(4))


def test_sglang_per_token_ids_beyond_top_k_or_the_map_are_one_line(tmp_path):
    """A third id in a token's row (more than the config's top-2) and a physical id equal to the map's width (8
    slots: ids 0-7) are refused in one line (not dropped, not an IndexError)."""
    ex = _hand_experts(2, range(4), 4)
    rec = _per_token_record(ex, 2)
    rec["topk_ids_of_layer"][1, 0, 2] = 5
    _per_token_pt(tmp_path / "a.pt", [rec], torch.arange(8).repeat(4, 1))
    with pytest.raises(MoetoolError, match=r"more than top-2 \(--config hand\) ids per token"):
        list(readers.read([tmp_path / "a.pt"], HAND).chunks)
    rec = _per_token_record(ex, 2)
    rec["topk_ids_of_layer"][2, 1, 0] = 8
    _per_token_pt(tmp_path / "b.pt", [rec], torch.arange(8).repeat(4, 1))
    with pytest.raises(MoetoolError, match="physical expert id 8 beyond the map's 8 slots"):
        list(readers.read([tmp_path / "b.pt"], HAND).chunks)


def test_megatron_micro_batches_and_mtp_records(tmp_path):
    """Two micro-batches in one step (every layer fires twice: 3 tokens, then 2) are two forwards, rows 0 and 1;
    an MTP record (mtp_idx set) between them is skipped and counted in the notes, not read as layer 0 again."""
    def recs(ex, mtp=None):
        return [{"step": 0, "block": "decoder", "layer": li, "rank": 0, "num_tokens": len(ids), "topk": 2,
                 "top_indices": np.sort(ids, 1).tolist(), **({"mtp_idx": mtp} if mtp is not None else {})}
                for li, ids in ex.items()]

    ex1, ex2 = _hand_experts(3, range(4), 5), _hand_experts(2, range(4), 6)
    lines = recs(ex1) + recs({0: ex1[0]}, mtp=0) + recs(ex2)
    (tmp_path / "router_trace_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    dump = readers.read([tmp_path / "router_trace_rank0.jsonl"], HAND)
    chunks = list(dump.chunks)
    assert [c.row.tolist() for c in chunks] == [[0, 0, 0], [1, 1]]
    assert [c.pos.tolist() for c in chunks] == [[0, 1, 2], [0, 1]]
    assert all((c.experts[li] == np.sort(e[li], 1)).all() for c, e in zip(chunks, (ex1, ex2)) for li in range(4))
    assert "1 MTP records skipped (not decoder layers)" in dump.notes


def test_counts_dumps_sum_repeated_csv_lines_and_refuse_counts_on_dense_layers(tmp_path):
    """A legacy CSV naming (layer 0, expert 1) twice (3 and 4) counts 7 there; a stat dump with counts on layer 4,
    dense in the config, is refused; SGLang routed bytes that are no whole [layers x top-K] rows (one row of 4 x 2
    int32 plus 2 ids) are refused in one line."""
    lines = ["layer_id,expert_id,count"] + [f"{li},0,1" for li in range(4)] + [f"{li},1,3" for li in range(4)] + \
        [f"{li},1,4" for li in range(4)]
    (tmp_path / "c.csv").write_text("\n".join(lines) + "\n")
    counts = readers.read([tmp_path / "c.csv"], HAND).counts.counts
    assert {li: c.tolist() for li, c in counts.items()} == {li: [1, 7, 0, 0, 0, 0, 0, 0] for li in range(4)}
    five = ModelShape(5, {i: (8, 2) for i in range(4)}, "hand")
    lc = torch.zeros(5, 8, dtype=torch.int64)
    lc[:4, :2] = 1
    lc[4, 3] = 2
    torch.save(dict(rank=0, logical_count=lc), str(tmp_path / "s.pt"))
    with pytest.raises(MoetoolError, match="layer 4 is dense in --config hand but has counts"):
        readers.read([tmp_path / "s.pt"], five)
    import base64

    raw = np.concatenate([np.tile([0, 1], 4), [2, 3]]).astype(np.int32).tobytes()
    (tmp_path / "r.jsonl").write_text(json.dumps({"meta_info": {"routed_experts": base64.b64encode(raw).decode()}})
                                      + "\n")
    with pytest.raises(MoetoolError, match="40 bytes are no whole number of int32 rows of 4 layers x top-2"):
        list(readers.read([tmp_path / "r.jsonl"], HAND).chunks)


def test_vllm_token_ids_are_the_forwarded_rows_or_one_more(tmp_path):
    """T routed rows take T or T + 1 token ids (the last token is never forwarded); T + 2 are another request's."""
    ex = _hand_experts(3, range(4), 7)
    arr = ew.vllm_routed_experts(ex, 4, 8)
    for n_ids, ok in ((3, True), (4, True), (5, False)):
        (tmp_path / "v.jsonl").write_text(json.dumps(ew.vllm_response(arr, list(range(10, 10 + n_ids - 1)), [99]))
                                          + "\n")
        if ok:
            (c,) = readers.read([tmp_path / "v.jsonl"], HAND).chunks
            assert c.token_id.tolist() == (list(range(10, 10 + n_ids - 1)) + [99])[:3] and c.pos.tolist() == [0, 1, 2]
        else:
            with pytest.raises(MoetoolError, match="5 token ids but 3 routed rows"):
                list(readers.read([tmp_path / "v.jsonl"], HAND).chunks)


def test_write_trace_counts_moe_rows_and_expert_columns_sort_by_rank(tmp_path):
    """write_trace's rows (the manifest's routing_source.rows) are tokens x MoE layers -- a dense layer has no rows
    (3 tokens x 4 MoE layers of 5 = 12, equal to the Parquet's rows); expert_1..expert_10 of a top-10 trace read in
    rank order (expert_10 last, not after expert_1 as text sorts it)."""
    from moetool.traces import store

    five = ModelShape(5, {i: (8, 2) for i in range(4)}, "hand")
    ex = _hand_experts(3, range(4), 8)
    chunk = readers.Chunk(np.zeros(3, dtype=np.int64), np.arange(3), np.full(3, -1), ex)
    got = store.write_trace(iter([chunk]), five, tmp_path / "trace.parquet")
    assert got == {"tokens": 3, "rows": 12, "requests": 1} and store.parquet_rows(tmp_path / "trace.parquet") == 12
    cols = [f"expert_{k}" for k in (3, 10, 1, 2, 4, 5, 6, 7, 8, 9)]
    df = pd.DataFrame({"layer": [0], **{c: [0] for c in cols}})
    for name in ("t.parquet", "t.csv.gz"):
        df.to_parquet(tmp_path / name) if name.endswith("parquet") else df.to_csv(tmp_path / name, index=False)
        src = store.TraceSource(tmp_path / name, "trace", five)
        assert store.expert_columns(src) == [f"expert_{k}" for k in range(1, 11)]


def _loads_file(folder: Path, rows: list[tuple]) -> Path:
    folder.mkdir()
    pd.DataFrame(rows, columns=["layer", "expert", "count"]).to_parquet(folder / "loads.parquet", index=False)
    return folder


@pytest.mark.parametrize("edit, message", [
    ("negative", "layer 0 has expert id -1, outside the 8 experts of the model"),
    ("beyond", "layer 0 has expert id 8, outside the 8 experts of the model"),
    ("twice", "layer 0, expert 3 has 2 rows: a loads file counts each expert once"),
    ("half", "count must be whole numbers in every row"),
    ("float_id", "expert must be whole numbers in every row"),
])
def test_a_hand_written_loads_file_with_bad_rows_is_refused(tmp_path, edit, message):
    """A bare ``loads.parquet`` (``--trace-config``, no manifest to check it against) edited the same way in every
    layer: an expert id -1 was read as expert 7 (numpy's negative index: the loads of a file without expert 7 as if
    it had it), a second row for expert 3 replaced the first (loads 30 for 10 + 30), a count 10.5 was cut to 10, an
    id 8 or 2.5 was an IndexError traceback. Now each is one line; the untouched file gives its own fractions."""
    counts = np.arange(1, 9) * 2  # 2, 4, ..., 16 per expert: 72 assignments, 36 tokens at top-2
    ok = [(li, e, int(counts[e])) for li in range(4) for e in range(8)]
    res = stats_from_trace(open_trace(_loads_file(tmp_path / "ok", ok), "tiny"),
                           StatsOptions(top_tokens=0, bootstrap=0))
    load0 = res["load"].query("layer == 0").sort_values("expert")
    np.testing.assert_allclose(load0["load_fraction"].to_numpy(), counts / counts.sum())
    assert res["layers"]["tokens"].tolist() == [36] * 4
    rows = {"negative": [(li, -1 if e == 7 else e, c) for li, e, c in ok],
            "beyond": [(li, 8 if e == 7 else e, c) for li, e, c in ok],
            "twice": ok + [(li, 3, 10) for li in range(4)],
            "half": [(li, e, c + 0.5 if e == 0 else c) for li, e, c in ok],
            "float_id": [(li, e + 0.5 if e == 7 else e, c) for li, e, c in ok]}[edit]
    src = open_trace(_loads_file(tmp_path / edit, rows), "tiny")
    with pytest.raises(MoetoolError, match=re.escape(message)):
        stats_from_trace(src, StatsOptions(top_tokens=0, bootstrap=0))


def _hand_trace(T: int = 12) -> pd.DataFrame:
    """A moetool-trace-shaped table for ``tiny`` (4 MoE layers, top-2 of 8): token t routes to experts t % 8 and
    (t + 1) % 8 in every layer, weights 0.75 / 0.25."""
    t = np.arange(T)
    return pd.concat([pd.DataFrame({"row": t // 4, "pos": t % 4, "token_id": t, "token": "x", "domain": "",
                                    "layer": li, "expert_1": t % 8, "expert_2": (t + 1) % 8, "weight_1": 0.75,
                                    "weight_2": 0.25}) for li in range(4)], ignore_index=True)


@pytest.mark.parametrize("edit, message", [
    ("half_layer", "the layer column holds values that are not whole numbers"),
    ("no_weights", "no weight_1, weight_2 columns"),
])
def test_a_hand_written_trace_with_a_bad_layer_or_without_weights_is_one_line(tmp_path, edit, message):
    """A bare trace file (``--trace-config``) whose layers read 0.5, 1.5, ... was counted as layers 0, 1, ... (int()
    truncation: the tables of a file that names no real layer), and one without weight columns was a KeyError
    traceback. Now one line each; the untouched file's loads are its own counts."""
    tr = _hand_trace()
    (tmp_path / "ok").mkdir()
    tr.to_parquet(tmp_path / "ok" / "trace.parquet", index=False)
    res = stats_from_trace(open_trace(tmp_path / "ok", "tiny"), StatsOptions(top_tokens=0, bootstrap=0))
    expect = np.bincount(np.r_[np.arange(12) % 8, (np.arange(12) + 1) % 8], minlength=8) / 24
    np.testing.assert_allclose(res["load"].query("layer == 1").sort_values("expert")["load_fraction"], expect)
    bad = tr.assign(layer=tr["layer"] + 0.5) if edit == "half_layer" else tr.drop(columns=["weight_1", "weight_2"])
    (tmp_path / edit).mkdir()
    bad.to_parquet(tmp_path / edit / "trace.parquet", index=False)
    src = open_trace(tmp_path / edit, "tiny")
    for run in (lambda: stats_from_trace(src, StatsOptions(top_tokens=0, bootstrap=0)),
                lambda: placement_from_trace(src, PlacementOptions(gpus=(2,), bootstrap=0))):
        with pytest.raises(MoetoolError, match=re.escape(message)):
            run()


def test_fluctuation_of_a_trace_with_itself_or_of_another_top_k_is_one_line(tmp_path):
    """``fluctuation --trace A --trace A/trace.parquet`` compared a routing with itself and wrote a table of zeros
    (topk_change 0 in every layer, as if the checkpoints agreed); traces of another top-K (a ``--routing topk:1``
    trace beside the model's top-2) stopped on 'the checkpoints saw different tokens (12 vs 12) or K'. Now one
    line naming each; two different traces give the hand-counted change (3 of 12 tokens' top-2 changed)."""
    import moetool

    a = _hand_trace()
    b = a.copy()
    moved = b["pos"].eq(0) & b["row"].lt(3)  # token 0, 4, 8 (position 0 of rows 0-2): expert_2 moved to another
    b.loc[moved, "expert_2"] = (b.loc[moved, "expert_1"] + 2) % 8
    for name, df in (("a", a), ("b", b), ("k1", a.drop(columns=["expert_2", "weight_2"]))):
        (tmp_path / name).mkdir()
        df.to_parquet(tmp_path / name / "trace.parquet", index=False)
    res = moetool.from_trace("fluctuation", [tmp_path / "a", tmp_path / "b"], config="tiny", bootstrap=0)
    df = res["fluctuation"]
    assert df["topk_change"].tolist() == [3 / 12] * 4 and df["top1_change"].tolist() == [0.0] * 4
    with pytest.raises(MoetoolError, match="the same trace file as --trace .*: a routing compared with itself changes nothing"):
        moetool.from_trace("fluctuation", [tmp_path / "a", tmp_path / "a" / "trace.parquet"], config="tiny")
    with pytest.raises(MoetoolError, match=r"1 expert column\(s\) per token .* 2: compare traces of the same top-K"):
        moetool.from_trace("fluctuation", [tmp_path / "a", tmp_path / "k1"], config="tiny")


def test_dump_checks_at_their_boundaries():
    """Refusals at the edge of what they check: a dense layer's row routed for one token only (the others zeros)
    is refused, not passed because some of the layer's ids are its fill; id n (8 of 8 experts) is outside; a repeat
    in the last two of three sorted ids ([1, 4, 4]) is a repeat, not only one in the first two."""
    shape = ModelShape(3, {1: (8, 2), 2: (8, 2)}, "hand")
    arr = np.zeros((3, 3, 2), dtype=np.uint8)
    arr[:, 1:] = [0, 1]
    arr[2, 0] = [3, 5]  # layer 0 is dense: zero rows only
    with pytest.raises(MoetoolError, match="layer 0 is dense in --config hand but routed in the dump"):
        readers.split_layers(arr, shape, "t")
    arr[2, 0] = 0
    assert readers.split_layers(arr, shape, "t")[2].tolist() == [[0, 1]] * 3
    with pytest.raises(MoetoolError, match="layer 2 has expert id 8, outside the 8 experts of --config"):
        readers.check_ids(np.array([[0, 8], [1, 2]]), 8, "t", 2)
    assert readers.check_ids(np.array([[0, 7]]), 8, "t", 2).tolist() == [[0, 7]]
    with pytest.raises(MoetoolError, match=r"layer 1, token 1 has expert 4 twice in its top-3 \(1 of 2 tokens\)"):
        readers.check_ids(np.array([[0, 1, 2], [4, 1, 4]]), 8, "t", 1)


def test_stat_dumps_sum_their_window_rows_and_their_ranks(tmp_path):
    """``logical_count [buffer rows, layers, n]`` (the recorder's window) is the sum of its rows, and two ranks'
    files are summed: the hand sums of random counts, not the last row or the last file."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 50, (3, 4, 8), generator=g)
    b = torch.randint(0, 50, (4, 8), generator=g)
    torch.save(dict(rank=0, logical_count=a), str(tmp_path / "expert_distribution_recorder_0.pt"))
    torch.save(dict(rank=1, logical_count=b), str(tmp_path / "expert_distribution_recorder_1.pt"))
    counts = readers.read([tmp_path], HAND).counts.counts
    want = a.sum(0) + b
    assert sorted(counts) == [0, 1, 2, 3] and all(counts[li].tolist() == want[li].tolist() for li in range(4))


def test_megatron_records_of_another_step_start_another_forward(tmp_path):
    """A step whose records stop after layers 0-1 (the rest lost) and the next step's layers 2-3 are no one forward
    (equal token counts could join them): the step change closes the first, whose missing layers are one line."""
    ex = _hand_experts(3, range(4), 8)
    lines = [{"step": s, "block": "decoder", "layer": li, "rank": 0, "num_tokens": 3, "topk": 2,
              "top_indices": np.sort(ex[li], 1).tolist()} for s, lis in ((0, (0, 1)), (1, (2, 3))) for li in lis]
    (tmp_path / "router_trace_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(MoetoolError, match=r"MoE layers \[2, 3\] of --config hand have no record in this step"):
        list(readers.read([tmp_path / "router_trace_rank0.jsonl"], HAND).chunks)


def test_a_report_labels_trace_analyses_like_the_forward_runs_of_the_same_model_and_text(tmp_path):
    """stats, offload and fluctuation of tiny on the same 256 tokens, each run forward and on ``moetool trace``
    recordings of those tokens: moetool report listed the trace runs with a blank model, fluctuation's with no data
    or token count, and offload's and fluctuation's with max_tokens=8192 (the --trace cap, not the tokens read) as
    an option differing from the forward's 256. Each trace run now records the model, the data and the tokens it read
    (the trace's manifest), so the report's model/options column reads as the forward's plus ' (trace)'; stats'
    one difference is real: its forward computed intervals (bootstrap=1000), the trace analysis none. An offload of
    the trace's first 128 tokens (--max-tokens 128) differs in what it read, and says so."""
    from moetool.report.page import write_report

    size = ["--max-tokens", "256", "--seq-len", "32"]
    runs: dict[str, Path] = {}

    def run(name, *args):
        runs[name] = tmp_path / name
        r = runner.invoke(app, [*args, "--out", str(runs[name]), "-q"])
        assert r.exit_code == 0, r.output

    run("trace-early", "trace", "--model", "tiny-early", *size)
    run("trace", "trace", "--model", "tiny", *size)
    run("stats-fwd", "stats", "--model", "tiny", *size)
    run("stats-tr", "stats", "--trace", str(runs["trace"]))
    run("offload-fwd", "offload", "--model", "tiny", *size)
    run("offload-tr", "offload", "--trace", str(runs["trace"]))
    run("offload-tr128", "offload", "--trace", str(runs["trace"]), "--max-tokens", "128")
    run("fluct-fwd", "fluctuation", "tiny-early", "tiny", "--routing", "router", *size)
    run("fluct-tr", "fluctuation", "--trace", str(runs["trace-early"]), "--trace", str(runs["trace"]))
    man = {k: json.loads((p / "manifest.json").read_text()) for k, p in runs.items()}
    traced = man["trace"]["data"]  # what moetool trace read: the text, its 256 tokens in 8 rows of 32
    assert (traced["tokens"], traced["rows"], traced["seq_len"]) == (256, 8, 32)
    for fwd, tr in (("stats-fwd", "stats-tr"), ("offload-fwd", "offload-tr"), ("fluct-fwd", "fluct-tr")):
        for k in ("source", "tokens", "rows", "seq_len"):
            assert man[tr]["data"][k] == man[fwd]["data"][k] == traced[k], (tr, k)
        assert man[tr]["options"]["max_tokens"] == man[fwd]["options"]["max_tokens"] == 256, tr
    for tr in ("stats-tr", "offload-tr"):
        assert man[tr]["model"]["name"] == "tiny" and man[tr]["model"]["model_type"] == "mixtral"
    assert man["fluct-tr"]["model"] == man["fluct-fwd"]["model"] == ["tiny-early", "tiny"]
    read = man["offload-tr128"]  # the first 128 tokens: the trace's first 4 rows of 32
    assert (read["data"]["tokens"], read["data"]["rows"], read["options"]["max_tokens"]) == (128, 4, 128)
    assert int(pd.read_csv(runs["offload-tr128"] / "offload_cache.csv").requests.max()) == 128 * 2  # K = 2

    page = write_report(list(runs.values())[2:], tmp_path / "report")
    md = (page.parent / "report.md").read_text()
    who = {m.group(1): m.group(2) for m in re.finditer(r"^\| \[\w+\]\(#([\w-]+)\) \| (.*?) \| ", md, re.M)}
    listed = dict((m.group(2), m.group(1)) for m in re.finditer(r"^- (.*) \(([\w-]+)\)$", md, re.M))
    assert who["offload-tr"] == who["offload-fwd"].replace("tiny", "tiny (trace)", 1), who
    assert "max\\_tokens=256" in who["offload-fwd"] and "max\\_tokens=128" in who["offload-tr128"], who
    assert who["fluct-tr"] == who["fluct-fwd"] + " (trace)" == "tiny-early -&gt; tiny (trace)", who
    assert (who["stats-fwd"], who["stats-tr"]) == ("tiny · bootstrap=1000", "tiny (trace) · bootstrap=0"), who
    for fwd, tr in (("stats-fwd", "stats-tr"), ("offload-fwd", "offload-tr"), ("fluct-fwd", "fluct-tr")):
        assert listed[tr] == listed[fwd] + " (trace)", listed
