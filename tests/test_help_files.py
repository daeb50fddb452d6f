"""Every file a command's ``--help`` names exists after a run, and every file a run writes is named in its
``--help`` (figures by their name under ``figures/``; a PDF goes with its PNG). One small run per command on the
embedded models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.experiments.registry import EXPERIMENTS

pytestmark = pytest.mark.slow  # tiers: pytest -m 'not slow'

runner = CliRunner()

SMALL = ["--max-tokens", "256", "--seq-len", "64"]
RUNS = {  # command -> its arguments (small, no bootstrap: the files are the point, not the numbers)
    "stats": ["stats", *SMALL, "--bootstrap", "0", "--all-tokens", "--min-count", "2"],
    "ppl": ["ppl", *SMALL, "--bootstrap", "0", "--routing", "norm:gate"],
    "trace": ["trace", "--max-tokens", "128", "--seq-len", "64"],
    "erc": ["erc", "--samples", "2"],
    "approx": ["approx", "--max-tokens", "128", "--seq-len", "64"],
    "mass-recall": ["mass-recall", *SMALL, "--bootstrap", "0"],
    "offload": ["offload", *SMALL, "--bootstrap", "0"],
    "fluctuation": ["fluctuation", "tiny-early", "tiny", *SMALL, "--bootstrap", "0"],
    "norm-select": ["norm-select", "--nodes", "gate", *SMALL, "--bootstrap", "0"],
    "topk": ["topk", *SMALL, "--bootstrap", "0", "--ks", "1", "--ps", "0.9"],
    "margin": ["margin", *SMALL, "--bootstrap", "0", "--eps", "0.05", "--policies", "norm:gate,random"],
    "agreement": ["agreement", *SMALL, "--bootstrap", "0", "--precisions", "fp32,bf16,fp8"],
    "plan": ["plan", "--gpus", "1xH100"],
    "capacity": ["capacity", *SMALL, "--bootstrap", "0", "--cf", "1"],
    "placement": ["placement", *SMALL, "--gpus", "2,4"],
    "prune": ["prune", *SMALL, "--bootstrap", "0", "--fractions", "0.25", "--criteria", "reap", "--ablate", "1",
              "--tasks", "moetool_code", "--limit", "2"],  # prune_eval.csv, figures/prune_accuracy: the shipped task
    "eval": ["eval", "--tasks", "moetool_code", "--limit", "2"],  # the shipped offline task
}
RUNS.update({name: [name, *SMALL, *spec.sample] for name, spec in EXPERIMENTS.items()  # the others: their sample
             if name not in RUNS})
#: import-trace of an engine's dump: a per-token one writes trace.parquet, a counts-only one loads.parquet (each run
#: writes one of the two its --help names, so only the every-column test runs them)
IMPORTS = ("import-trace", "import-trace-loads")
#: named by --help but written only with an option these runs do not take
CONDITIONAL = {"trace": {"trace.parquet"},  # --format parquet
               "norm-select": {"aoe_table1.csv"},  # lm-eval --tasks scored by acc
               "placement": {"sglang_expert_location.json", "eplb_placement.json"}}  # --export
FILE = re.compile(r"(?<![\w/<>.-])([\w-]+\.(?:csv\.gz|csv|parquet|json|html|md|tex))(?![\w])")
FIGURE = re.compile(r"figures/([a-z0-9_]+)")
TEMPLATE = re.compile(r"[\w/.-]*<\w+>[\w/<>.-]*\.(?:csv|tex|png|pdf)")

_done: dict[str, Path] = {}
_printed: dict[str, str] = {}  # what each run printed (every run takes -q)


def one_worker(commands) -> list:
    """The commands as parameters, each in the xdist group of its run (``--dist loadgroup``): both tests of a
    command read one run in one worker, not a run per worker that draws one of them (``_done`` is per process);
    report's run reads stats' run, so it joins stats' group."""
    return [pytest.param(c, marks=pytest.mark.xdist_group(f"help_files-{'stats' if c == 'report' else c}"))
            for c in commands]


def dump(kind: str, root: Path) -> Path:
    """An engine's routing dump of the embedded model's shape (4 MoE layers, 8 experts, top-2): vLLM's
    ``routed_experts`` of one 16-token request (.npy), or SGLang's legacy counts CSV."""
    import numpy as np

    if kind == "import-trace-loads":
        (root / "dump.csv").write_text("layer_id,expert_id,count\n" + "".join(f"{li},{e},{2 * (e + 1)}\n"
                                                                            for li in range(4) for e in range(8)))
        return root / "dump.csv"
    rng = np.random.default_rng(0)
    np.save(root / "dump.npy", np.stack([[rng.permutation(8)[:2] for _ in range(4)] for _ in range(16)]).astype(np.uint8))
    return root / "dump.npy"


def run_dir(command: str, tmp_path_factory) -> Path:
    if command in IMPORTS and command not in _done:
        root = tmp_path_factory.mktemp(command)
        r = runner.invoke(app, ["import-trace", str(dump(command, root)), "--config", "tiny", "--out", str(root / "run"),
                                "-q"])
        assert r.exit_code == 0, r.output
        _done[command], _printed[command] = root / "run", r.output
    if command not in _done:
        out = tmp_path_factory.mktemp(command) / "run"
        args = (RUNS[command] if command != "report" else ["report", str(run_dir("stats", tmp_path_factory))])
        r = runner.invoke(app, [*args, "--out", str(out), "-q"])
        assert r.exit_code == 0, r.output
        _done[command], _printed[command] = out, r.output
    return _done[command]


def help_text(command: str) -> str:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "3000"}, terminal_width=3000)
    assert r.exit_code == 0
    return r.output


def written(out: Path) -> list[str]:
    return json.loads((out / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("command", one_worker([*RUNS, "report"]))
def test_help_names_exactly_the_files_a_run_writes(command, tmp_path_factory):
    text = help_text(command)
    out = run_dir(command, tmp_path_factory)
    files = written(out)
    named = set(FILE.findall(text)) - CONDITIONAL.get(command, set())
    figures = set(FIGURE.findall(text))
    templates = [re.compile(re.sub(r"<\w+>", "[^/]+", re.escape(t).replace(r"\<", "<").replace(r"\>", ">")) + "$")
                 for t in TEMPLATE.findall(text)]
    missing = sorted(n for n in named if not (out / n).exists())
    missing += sorted(f"figures/{f}.png" for f in figures if not (out / "figures" / f"{f}.png").exists())
    assert not missing, f"{command} --help names files its run did not write: {missing}"

    def described(f: str) -> bool:
        png = f[:-4] + ".png" if f.endswith(".pdf") else f
        if any(t.match(f) for t in templates):
            return True
        if png.startswith("figures/") and png.count("/") == 1:
            return Path(png).stem in figures
        return f in named

    undescribed = [f for f in files if not described(f)]
    assert not undescribed, f"{command} writes files its --help does not name: {undescribed}"
    assert (out / "manifest.json").exists()


COLUMNS = re.compile(r"([\w-]+\.(?:csv\.gz|csv)) \(([^;)]*)")


@pytest.mark.parametrize("command", one_worker([c for c in RUNS if c != "plan"]))
def test_help_names_only_columns_a_run_writes(command, tmp_path_factory):
    """Each plain column name a --help lists for a table (``ppl.csv (model, ..., scored_tokens, ...``, up to its
    first ``;`` or ``)``) is a column of that table in a run (``ppl --help`` listed ``tokens``, a column ppl.csv
    does not have)."""
    import pandas as pd

    out = run_dir(command, tmp_path_factory)
    wrong = {}
    for name, listed in COLUMNS.findall(" ".join(help_text(command).split())):
        if not (out / name).exists():
            continue
        have = set(pd.read_csv(out / name, nrows=0).columns)
        names = [c.strip() for c in listed.split(",")]
        bad = [c for c in names if re.fullmatch(r"[a-z][a-z0-9_]*", c) and c not in have]
        if bad:
            wrong[name] = bad
    assert not wrong, f"{command} --help names columns its tables do not have: {wrong}"


@pytest.mark.parametrize("command", one_worker([*(c for c in RUNS if c != "report"), *IMPORTS]))
def test_every_column_a_run_writes_has_a_definition(command, tmp_path_factory):
    """Every column of every table a run writes (``.csv``, ``.csv.gz``, ``.parquet``) has a definition: the report
    page's header tooltip, :func:`moetool.report.page.column_definition` of the manifest's ``definitions`` -- no
    allow-list (the newcomer's stats run found ``uniform_token_fraction``, ``mean_max_p``, ``mutual_information``,
    ``lift``, ``share`` and ``specialization_all_ids`` with none; eval.csv's ``task`` and ``value`` had none, and an
    import-trace manifest no definitions at all)."""
    import pandas as pd
    import pyarrow.parquet as pq

    from moetool.report.page import column_definition

    out = run_dir(command, tmp_path_factory)
    defs = json.loads((out / "manifest.json").read_text()).get("definitions")
    tables = [f for f in written(out) if f.endswith((".csv", ".csv.gz", ".parquet"))]
    assert tables, f"{command} wrote no table"

    def columns(f: str) -> list[str]:
        return pq.read_schema(out / f).names if f.endswith(".parquet") else list(pd.read_csv(out / f, nrows=0).columns)

    undefined = [f"{f}:{c}" for f in tables for c in columns(f)
                 if not column_definition(defs, f.split("/")[-1].split(".", 1)[0], c)]
    assert not undefined, f"{command}: columns without a definition: {undefined}"


@pytest.mark.parametrize("command", one_worker([*RUNS, "report", *IMPORTS]))
def test_quiet_prints_no_table_only_notes_and_what_was_written(command, tmp_path_factory):
    """--quiet (every run here is given -q): no progress bars and no console tables, only ``note:``, warning and
    ``left out:`` lines and the line naming what the run wrote, last. Before, 7 commands (approx, erc, fluctuation,
    mass-recall, offload, plan, super-experts) printed no table under it and the others printed theirs: a log kept
    clean with -q held stats', ppl's, eval's... tables and not erc's. report and import-trace had no --quiet (a
    script's -q was refused, exit 2); demo's is tests/test_help.py's."""
    out = run_dir(command, tmp_path_factory)
    lines = [ln for ln in _printed[command].splitlines() if ln.strip()]
    named = {"trace": out / "trace.csv.gz", "import-trace": out / "trace.parquet",  # the file, not the folder
             "import-trace-loads": out / "loads.parquet"}.get(command, out)
    assert lines and lines[-1] == f"results in {named}", _printed[command]
    other = [ln for ln in lines[:-1] if not ln.startswith(("note: ", "warning", "left out: "))]
    assert not other, f"{command} -q printed more than notes and the run folder:\n" + "\n".join(other)
