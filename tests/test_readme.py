"""The README runs as written: every fenced block says whether it runs (``<!-- runnable -->``) or is a template /
not run by the tests (``<!-- template: … -->``, ``<!-- not run by the tests: … -->``), and the runnable ones are
run here on the embedded models, as a reader would paste them (a fresh folder, the installed ``moetool``). A shell
line ending in ``# … exit N`` must exit N (and print the ``error: …`` line its comment quotes); every other line must
succeed. Every ``moetool <command> --option`` the README mentions names an option that exists."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # tiers: pytest -m 'not slow'


README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!--\s*(runnable|template\b[^>]*|not run by the tests\b[^>]*?)\s*-->\s*$")


def blocks() -> list[tuple[int, str, str, str | None]]:
    """``(line, language, code, marker)`` of every fenced block (marker: the HTML comment on the line before)."""
    text = README.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                    marker.group(1).split(":")[0].strip() if marker else None))
    return out


RUNNABLE = [b for b in blocks() if b[3] == "runnable"]


def test_every_block_says_whether_it_runs():
    unmarked = [line for line, _, _, marker in blocks() if marker is None]
    assert not unmarked, f"README.md blocks at lines {unmarked} need <!-- runnable --> or <!-- template: … -->"
    assert len(RUNNABLE) >= 3


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg", "COLUMNS": "100",
            "MOETOOL_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.parametrize("line, lang, code", [b[:3] for b in RUNNABLE], ids=[f"line{b[0]}" for b in RUNNABLE])
def test_runnable_block_runs_as_written(tmp_path, line, lang, code):
    env = _env(tmp_path)
    if lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"README.md line {line}:\n{r.stderr[-3000:]}"
        return
    assert lang == "bash", f"README.md line {line}: a runnable block is bash or python"
    for cmd in (ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")):
        command, _, comment = cmd.partition("  #")
        code_expected = int(m.group(1)) if (m := re.search(r"\bexit (\d+)\s*$", comment)) else 0
        r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == code_expected, f"README.md line {line}: `{command.strip()}` exited {r.returncode}:\n" \
                                              f"{r.stderr[-3000:]}"
        if (quoted := re.search(r"(error: .*?); exit \d+\s*$", comment)):
            assert quoted.group(1) in r.stderr, f"`{command.strip()}`: {r.stderr[-500:]}"
        elif code_expected:
            assert r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_every_command_and_option_the_readme_names_exists():
    """``moetool offload --cache-sizes`` (README) did not exist (the option is --capacity)."""
    import typer.main

    from moetool.commands.app import app

    group = typer.main.get_command(app)
    text = README.read_text(encoding="utf-8")
    spans = re.findall(r"`(moetool [^`]+)`", text) + [ln for _, _, code, _ in blocks() for ln in code.splitlines()]
    checked = 0
    for span in spans:
        if "moetool " not in span:
            continue
        words = shlex.split(span.split(" #", 1)[0].replace("\\|", "|"), posix=True)
        try:
            words = words[words.index("moetool") + 1:]
        except ValueError:  # "-m moetool ..." (torchrun, accelerate)
            words = words[words.index("-m") + 2:] if "-m" in words and words[words.index("-m") + 1] == "moetool" \
                else []
        if not words or words[0].startswith("-") or "COMMAND" in words[0]:
            continue
        cmd = group.commands.get(words[0])
        assert cmd is not None, f"README names `moetool {words[0]}`: no such command ({span})"
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        bad = [w.split("=")[0] for w in words[1:] if w.startswith("--") and w.split("=")[0] not in opts]
        assert not bad, f"README: `moetool {words[0]}` has no option {bad} ({span})"
        checked += 1
    assert checked > 30


SUITE_ROWS = {"whole": '| `python -m pytest -n auto --dist loadgroup` (', "fast": '| `python -m pytest -m "not slow" -n auto` ('}


def suite_figures() -> dict[str, int]:
    """The test count each tier's row of the README's timing table states (``1,432 tests``)."""
    text = README.read_text()
    out = {}
    for tier, start in SUITE_ROWS.items():
        rows = [ln for ln in text.splitlines() if ln.startswith(start)]
        assert len(rows) == 1, (tier, rows)
        counts = re.findall(r"([\d,]+) tests", rows[0])
        assert len(counts) == 1, (tier, rows[0])
        out[tier] = int(counts[0].replace(",", ""))
    return out


def test_suite_sizes_and_times_are_written_in_one_place():
    """Issue 35 item 14: the README gives each tier's test count and time once, in the timing table (the prose
    once said 790 tests / 1 min 44 s and 1,031 tests / 6 min 46 s beside it)."""
    text = README.read_text()
    counts = re.findall(r"[\d,]+ tests\b", text)
    assert len(counts) == len(SUITE_ROWS), counts
    assert set(suite_figures()) == set(SUITE_ROWS)
    prose = [ln for ln in text.splitlines() if not ln.startswith("|")]
    assert not [ln for ln in prose if re.search(r"\d+ min \d+ s", ln)], "a suite time outside the table"


def whole_suite_counts(config: pytest.Config) -> tuple[int, int] | None:
    """``(fast, whole)``: the tests ``pytest -m "not slow"`` and ``pytest`` run, counted from this session's own
    collection (before any deselection, ``conftest.COLLECTED``) when the session collected the whole suite as the
    README's command does (run from the repository, on its ``testpaths``, no file ignored or skipped by ``--lf``);
    None otherwise. That command collects the suite anyway: collecting it again in a subprocess cost ~25 s of CPU."""
    from conftest import COLLECTED

    items = config.stash.get(COLLECTED, None)
    where = config.invocation_params.dir
    paths = sorted((where / a).resolve() for a in config.args)
    if (items is None or config.rootpath != README.parent or where != README.parent
            or paths != sorted((README.parent / p).resolve() for p in config.getini("testpaths"))
            or config.getoption("ignore") or config.getoption("ignore_glob") or config.getoption("lf", False)):
        return None
    fast = sum(not any(m.name == "slow" for m in item.iter_markers()) for item in items)
    return fast, len(items)


@pytest.mark.slow
def test_suite_counts_in_the_readme_match_the_collected_tests(pytestconfig):
    """The counts the table states are within 15% of what pytest collects now (tests are added all the time:
    a count far off is stale)."""
    import subprocess
    import sys

    stated = suite_figures()
    counts = whole_suite_counts(pytestconfig)
    if counts is None:  # a session of some files: one collection of the whole suite
        # one collection gives both tiers: "FAST/WHOLE tests collected (N deselected)"
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                            "not slow"], cwd=README.parent, capture_output=True, text=True, timeout=600, check=False)
        found = re.search(r"(\d+)/(\d+) tests? (?:collected|selected)", r.stdout)
        assert found, r.stdout[-500:]
        counts = int(found.group(1)), int(found.group(2))
    for tier, n in zip(("fast", "whole"), counts):
        assert abs(n - stated[tier]) <= 0.15 * n, (tier, n, stated[tier])


def test_the_readmes_read_of_a_trace_keeps_every_token(tmp_path):
    """The shipped text has the token "None": pandas' default read of trace.csv.gz made it NaN; the README's
    ``pandas.read_csv(path, keep_default_na=False)`` (and ``moetool trace --help``'s) gives it back as written."""
    import pandas as pd

    import moetool

    text = README.read_text(encoding="utf-8")
    assert "`pandas.read_csv(path, keep_default_na=False)`" in text
    res = moetool.run("trace", "tiny", max_tokens=2048, seq_len=256, out=tmp_path / "trace", quiet=True)
    path = tmp_path / "trace" / "trace.csv.gz"
    got = pd.read_csv(path, keep_default_na=False)
    tok = res.tokens  # the tokens from the tokenizer, independent of the CSV
    lm_tok = moetool.loading.load_tokenizer("tiny")
    ids = tok.input_ids[tok.attention_mask.bool()].tolist()
    want = lm_tok.convert_ids_to_tokens(ids)  # the trace's token column: the vocabulary's own strings
    first_layer = got[got.layer == got.layer.min()]
    assert first_layer.token.tolist() == want and "None" in want
    assert pd.read_csv(path).token.isna().any()  # the default read loses it


def test_the_readme_says_which_commands_write_no_figures_and_quotes_intervals_as_printed():
    """The README said every run folder has figures/ (locality and expert-similarity write none), quoted a
    fluctuation row as 'router 0.250 ± 0.010, ..., reduction 0.0034 ± 0.0029' where the tool prints asymmetric
    intervals ('0.0034 [0.0002, 0.0061]', never with ±), described topk:<k> as 'k < K' (k up to n runs) and promised a git revision that
    `pip install .` does not keep."""
    from moetool.experiments.registry import EXPERIMENTS

    text = " ".join(README.read_text(encoding="utf-8").split())
    for sentence in ("(PNG and PDF; the commands that draw figures: not ", "(PNG and PDF, from the commands that "
                                                                           "draw figures: "):
        start = text.index(sentence) + len(sentence)
        named = set(re.findall(r"`([a-z-]+)`", text[start:text.index(")", start)]))
        assert named == {n for n, s in EXPERIMENTS.items() if s.figures is None} | {"import-trace"}, named
    assert ("router 0.2496 [0.2401, 0.2592], similarity 0.246 [0.236, 0.256], reduction 0.0034 [0.0002, 0.0061]"
            in text)  # `moetool fluctuation tiny-early tiny --routing router,similarity,attention --isolate`
    assert "with k < K experts" not in text
    assert "`null` after `pip install .`" in text and "after `pip install .` it is `null`" in text


def test_the_readme_says_which_trace_analyses_draw_figures(tmp_path):
    """stats, offload and fluctuation --trace drew no figures (their results, ``stats_trace``, ..., named no
    experiment's figures), while placement --trace drew its own: now each draws its experiment's figures of the
    tables a trace gives, as the README says -- the same figures as the forward's, less those of tables a trace
    cannot give (offload's prefetch recall, stats' cross-layer/domain/specialisation, fluctuation's entropies)."""
    import moetool
    from moetool.report.plots import figures

    text = " ".join(README.read_text(encoding="utf-8").split())
    assert ("On a trace, each analysis draws the figures of the tables it has: `placement` all of its own, `stats` its "
            "load, co-activation and balance figures, `offload` all but the prefetch recall, `fluctuation` the top-1 "
            "change by layer (no entropy figures).") in text
    lm = moetool.load("tiny")
    runs = [moetool.run("trace", name, max_tokens=256, seq_len=32, out=tmp_path / name, quiet=True).path
            for name in ("tiny-early", "tiny")]
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=256)
    helps = {}
    for name in ("stats", "offload", "fluctuation", "placement"):
        traced = sorted(figures(moetool.from_trace(name, runs if name == "fluctuation" else runs[1], bootstrap=0)))
        if name == "fluctuation":
            forward = sorted(figures(moetool.fluctuation([moetool.load("tiny-early"), lm], toks, bootstrap=0)))
            assert traced == ["fluctuation_by_layer"] and set(traced) < set(forward), (traced, forward)
            continue
        forward = sorted(figures(getattr(moetool, name)(lm, toks, **({} if name == "placement" else {"bootstrap": 0}))))
        missing = {"offload": ["offload_prefetch_recall"],  # the tables a trace cannot give
                   "stats": ["cross_layer", "domain_load", "specialization"]}.get(name, [])
        assert traced == sorted(set(forward) - set(missing)) and traced, (name, traced, forward)
        if name != "placement":  # (its --help names no trace figures: it draws all of its own)
            helps[name] = (traced, missing)
    helps["fluctuation"] = (["fluctuation_by_layer"], [])
    # each command's --help said "no figures" (stats: "no intervals, specialisation or figures") on a trace while
    # it drew these: its --trace paragraph names the figures drawn, and the one a trace cannot give
    for name, (traced, missing) in helps.items():
        doc = importlib.import_module(f"moetool.experiments.{name}.spec").__doc__
        para = " ".join(next(p for p in doc.split("\n\n") if p.lstrip().startswith("--trace")).split())
        assert "no figures" not in para and all(f in para for f in traced + missing[:1 if name == "offload" else 0]), (
            name, para)


def test_the_version_the_readme_prints_is_the_packages():
    """The runnable block's ``moetool --version  # moetool 0.1.0`` ran (exit 0) but its printed version was checked
    nowhere: a version bump would leave the README quoting the old one."""
    import moetool

    said = re.findall(r"^moetool --version\s+#\s*(.+?)\s*$", README.read_text(encoding="utf-8"), re.M)
    assert said == [f"moetool {moetool.__version__}"], said


def test_what_the_readme_says_plan_answers_for_the_shipped_configs():
    """The README quotes `moetool plan`'s memory per GPU for the shipped configs (rows of 2048 tokens x 8): Mixtral-8x7B
    88 GiB in bf16 and 45 GiB with --quantize fp8 on one H100, DeepSeek-V3 83 GiB per GPU with --device-map auto on
    8 H100, none of which was checked against the plan (tests/test_plan.py checks only what fits)."""
    from moetool.experiments.plan import compute as plan
    from moetool.loading import load_config

    text = " ".join(README.read_text(encoding="utf-8").split())
    said = re.search(r"Mixtral-8x7B needs (\d+) GiB per GPU in bf16, so one 80 GB H100 holds it only in FP8 "
                     r"\((\d+) GiB\).*? one node of 8 H100 \((\d+) GiB per GPU\)", text)
    assert said, "the README's plan paragraph changed: update this test"

    def gib(name, gpus, layout):
        df = plan.plan(load_config(str(README.parent / "examples" / "configs" / name))[0], gpus, 1, seq_len=2048,
                       rows=8)["layouts"]
        return df[df.layout.str.startswith(layout)].gib_per_gpu.item()

    got = (gib("mixtral-8x7b", "1xH100", "1 GPU per replica, data parallel"),
           gib("mixtral-8x7b", "1xH100", "1 GPU per replica, --quantize fp8"),
           gib("deepseek-v3", "8xH100", "--device-map auto"))
    assert [int(x) for x in said.groups()] == [round(x) for x in got], got


def test_the_readme_names_every_command_with_intervals_and_every_bca_user():
    """The README's "Confidence intervals" paragraph named six commands (stats, ppl, norm-select, fluctuation,
    mass-recall, offload) where thirteen take --bootstrap, and gave stats as the only user of BCa where placement's
    fixed placements are BCa too (``method="bca"`` in its compute.py)."""
    import typer.main

    from moetool.commands.app import app
    from moetool.experiments.registry import EXPERIMENTS

    text = " ".join(README.read_text(encoding="utf-8").split())
    start = text.index("**Confidence intervals (`--bootstrap N`).**")
    para = text[start:text.index("report a 95% interval", start)]
    group = typer.main.get_command(app)
    with_bootstrap = {n for n, c in group.commands.items() if any("--bootstrap" in p.opts for p in c.params)}
    assert len(with_bootstrap) >= 13
    assert set(re.findall(r"`([a-z-]+)`", para)) == with_bootstrap
    bca = text[text.index("The interval is the percentile interval, except", start):]
    bca = bca[:bca.index("so they get the BCa")]
    root = README.parent / "moetool" / "experiments"
    users = {n for n in EXPERIMENTS if 'method="bca"' in (root / n.replace("-", "_") / "compute.py").read_text()}
    assert users >= {"stats", "placement"}
    assert {n for n in users if f"`{n}`'" in bca} == users, bca


def test_what_the_readme_says_stats_top_k_1_writes(tmp_path):
    """The README's OLMoE row said `--top-k 1` gives "the `*_top1` tables": moetool writes no file of that name
    (OLMoE's scripts do); the tables keep their names and there is no coactivation.csv."""
    import json

    import moetool

    text = " ".join(README.read_text(encoding="utf-8").split())
    row = text.split("| OLMoE §5:")[1]
    said = row[row.index("(`--top-k 1`:"):row.index(")", row.index("(`--top-k 1`:"))]
    res = moetool.run("stats", "tiny", max_tokens=512, seq_len=64, top_k=1, bootstrap=0, out=tmp_path / "s",
                      quiet=True)
    files = json.loads((res.path / "manifest.json").read_text())["files"]
    assert "load.csv" in files and "coactivation.csv" not in files and not [f for f in files if "_top1" in f]
    assert "OLMoE's `*_top1`" in said and "no `coactivation.csv`" in said, said
