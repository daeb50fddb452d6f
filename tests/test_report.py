"""``moetool report`` (HTML/Markdown/LaTeX/CSV from run folders, rendered in headless Chromium) and console
tables that read well in an 80-column log."""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.report import RunDir
from moetool.report import console as C
from moetool.report import figures as F
from moetool.report.page import find_runs, to_latex, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def make_runs(root: Path) -> Path:
    """A demo-like folder: a parent run with two finished sub-runs (tables + a figure) and a failed one."""
    demo = RunDir.create("demo", root / "demo")
    a = demo.sub("stats-tiny")
    a.write_csv("layers.csv", pd.DataFrame({"layer": [0, 1], "load_entropy": [2.0751, float("nan")],
                                            "policy": ["norm:up:l2", "a_b&c"]}))
    a.write_csv("load.csv", pd.DataFrame({"layer": np.repeat(np.arange(4), 8), "expert": np.tile(np.arange(8), 4),
                                          "load_fraction": np.linspace(0.01, 0.3, 32)}))
    fig, (ax,) = F.new_figure()
    F.line_by(ax, pd.DataFrame({"layer": [0, 1, 0, 1], "policy": ["r", "r", "r-isolated", "r-isolated"],
                                "top1_change": [0.1, 0.2, 0.15, 0.25]}), "layer", "top1_change", "policy")
    a.save_figure(fig, "curve")
    a.finish(options={"model": "tiny", "seq_len": 256}, model={"name": "tiny", "model_type": "mixtral"}, seed=3)
    b = demo.sub("erc")
    b.write_csv("erc.csv", pd.DataFrame({"alpha": [0.5, 1.0], "erc_loss": [0.3, 0.1]}))
    fig, (ax,) = F.new_figure()
    F.heatmap(ax, np.eye(3), title="M", xlabel="expert", ylabel="layer")
    b.save_figure(fig, "matrix")
    b.finish(options={})
    c = demo.sub("approx")
    c.write_csv("approx.csv", pd.DataFrame({"x": [1]}))
    c.mark("failed", "NaN in layer 2, batch 0")
    demo.finish(options={"steps": ["stats", "erc", "approx"]})
    return root / "demo"


def test_report_gathers_every_run_figure_and_table(tmp_path):
    demo = make_runs(tmp_path)
    assert [r.name for r in find_runs([demo])] == ["demo", "demo-stats-tiny", "demo-erc", "demo-approx"]  # steps
    page = write_report([demo], tmp_path / "rep")
    out = page.parent
    text = page.read_text()
    # self-contained: every image inline, nothing fetched from elsewhere
    srcs = re.findall(r'src="([^"]*)"', text)
    assert len(srcs) == 2 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert {base64.b64decode(s.split(",", 1)[1]) for s in srcs} == {
        (demo / f).read_bytes() for f in ("stats-tiny/figures/curve.png", "erc/figures/matrix.png")}
    assert "<link" not in text and "<script" not in text
    # each run's manifest summary; the failed run says why
    assert "model_type=mixtral" in text and "seq_len=256" in text and "NaN in layer 2, batch 0" in text
    assert "demo-stats-tiny: curve — tiny (PDF" in text  # the model in the figure caption
    assert 'class="status-failed"' in text
    # tables: every row in CSV and LaTeX, the long one truncated in the page with a note
    load = pd.read_csv(out / "tables/demo-stats-tiny/load.csv")
    assert len(load) == 32 and load.equals(pd.read_csv(demo / "stats-tiny/load.csv"))
    assert "first 20 of 32 rows" in text
    assert text.count("<tr>") >= 20 + 2 + 2
    tex = (out / "tables/demo-stats-tiny/layers.tex").read_text()
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex
    assert r"norm:up:l2 \\" in tex.replace("& ", "") or "norm:up:l2" in tex
    assert r"a\_b\&c" in tex and "2.075 &" in tex  # escaped text, 4 significant digits, NaN empty
    assert (out / "figures/demo-stats-tiny/curve.pdf").read_bytes()[:4] == b"%PDF"
    md = (out / "report.md").read_text()
    assert "![curve](figures/demo-stats-tiny/curve.png)" in md and "| layer | load_entropy | policy |" in md
    m = json.loads((out / "manifest.json").read_text())
    assert m["command"] == "report" and m["status"] == "complete" and len(m["gathered"]) == 4


def test_latex_table_hand_check():
    df = pd.DataFrame({"policy": ["x_1"], "ratio": [1.23456]})
    assert to_latex(df) == ("\\begin{table}[t]\n\\centering\n\\begin{tabular}{lr}\n\\toprule\n"
                            "policy & ratio \\\\\n\\midrule\nx\\_1 & 1.235 \\\\\n\\bottomrule\n\\end{tabular}\n"
                            "\\end{table}\n")


def test_report_command_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 2 and r.output.strip().startswith("error: ") and "no moetool run" in r.output
    assert not (tmp_path / "rep").exists()


def test_report_command(tmp_path):
    demo = make_runs(tmp_path)
    r = CliRunner().invoke(app, ["report", str(demo), "--out", str(tmp_path / "rep"), "--title", "demo"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rep/report.html").exists() and "<title>demo</title>" in (tmp_path / "rep/report.html").read_text()


CHECK = """<img id="control-broken" src="missing-control.png"><script>
console.error("moetool-control");
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.id || i.alt);
  document.body.setAttribute("data-check", JSON.stringify({images: imgs.length, broken: broken}));
});
</script></body>"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
def test_html_renders_in_headless_chromium(tmp_path):
    """No broken image and no console message; a screenshot is taken. A control image and a control console
    message injected into a copy prove the checks can fail."""
    page = write_report([make_runs(tmp_path)], tmp_path / "rep")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    check = tmp_path / "check.html"
    check.write_text(page.read_text().replace("</body>", CHECK))
    r = subprocess.run([*flags, "--virtual-time-budget=3000", "--enable-logging=stderr", "--v=0", "--dump-dom",
                        check.as_uri()], capture_output=True, text=True, timeout=60)
    found = re.search(r'data-check="([^"]*)"', r.stdout)
    assert found, r.stderr[-2000:]
    res = json.loads(found.group(1).replace("&quot;", '"'))
    assert res == {"images": 3, "broken": ["control-broken"]}  # 2 figures + the control
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]
    assert len(console) == 1 and "moetool-control" in console[0], console
    shot = tmp_path / "report.png"
    r = subprocess.run([*flags, "--window-size=1000,1400", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=60)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]


# ----- console --------------------------------------------------------------------------------------------------
def rendered(df, **kw):
    from rich.console import Console

    con = Console(width=80, file=open("/dev/null", "w"), emoji=False, markup=False, record=True)
    for r in C.render_table(df, width=80, **kw):
        con.print(r)
    return con.export_text()


def test_tables_fit_80_columns_without_truncating_numbers():
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"policy": ["norm:up:l2", "[bold]x[/bold]"] * 3, "layer": range(6),
                       **{f"confidence_entropy_{i}": rng.random(6) * 1e4 / 7 for i in range(6)},
                       "tokens": rng.integers(10**6, 10**7, 6)})
    text = rendered(df, title="stats")
    assert max(len(ln) for ln in text.splitlines()) <= 80
    assert "…" not in text
    for c in df.columns[1:]:  # every number printed in full (4 significant digits)
        for v in df[c]:
            s = f"{v:.4g}" if isinstance(v, float) else str(v)
            assert s in text, s
    assert "norm:up:l2" in text and "[bold]x[/bold]" in text  # no emoji, no markup from data
    assert "stats (1/" in text  # split into column blocks that repeat the key column
    assert text.count("norm:up:l2") > 3


def test_every_part_of_a_split_table_keeps_the_row_labels():
    """fluctuation's console table (layer, routing, reference, checkpoint, then values as 'v ± h' text) split for
    80 columns: every part repeats all four label columns, so router/similarity rows can be told apart (parts 2-3
    showed only 'layer')."""
    rows = [(layer, routing) for routing in ("router", "similarity", "attention") for layer in range(4)]
    df = pd.DataFrame({"layer": [r[0] for r in rows], "routing": [r[1] for r in rows],
                       "reference": "tiny-early", "checkpoint": "tiny",
                       **{c: [f"0.{i}{j}1 ± 0.022" for i, j in rows] for c in
                          ("top1_change", "topk_change", "topk_overlap", "jaccard", "entropy_ratio_of_ckpt")},
                       "entropy_ref": np.linspace(1, 2, 12), "entropy_ckpt": np.linspace(2, 3, 12)})
    assert C.key_columns(df) == 4
    parts = C.render_table(df, title="routing fluctuation", width=80)
    assert len(parts) >= 3
    text = rendered(df, title="routing fluctuation")
    assert max(len(ln) for ln in text.splitlines()) <= 80
    for part in parts:
        assert [c.header.plain for c in part.columns[:4]] == ["layer", "routing", "reference", "checkpoint"]
        assert list(part.columns[1].cells)[4].plain == "similarity"
    assert C.key_columns(df[["layer", "entropy_ref", "routing"]]) == 1  # labels lead; a number column ends them


def test_long_text_cells_wrap_whole_instead_of_being_cut_at_the_edge():
    """inspect --families' reasons (up to 300 characters) were cut at the console width: every word is printed."""
    reason = ("no: the router's weights are normalised over the K chosen routed logits together with the shared "
              "experts' logits (logsigmoid softmax), which the router does not return: the weights are no function")
    df = pd.DataFrame({"model_type": ["inkling_text", "mixtral"], "head": ["causal-lm", "causal-lm"],
                       "supported": [reason, "yes"], "routing": ["", "softmax-topk-renorm"]})
    text = rendered(df, title="MoE model types")
    assert max(len(ln) for ln in text.splitlines()) <= 80
    words = " ".join(ln.split("│")[3] for ln in text.splitlines() if ln.count("│") >= 4).split()
    assert " ".join(words).startswith(reason)


def test_long_tables_are_summarised_with_a_pointer():
    df = pd.DataFrame({"layer": range(100), "v": np.arange(100) / 3})
    text = rendered(df, csv="mass_recall.csv")
    assert "… 80 more rows in mass_recall.csv" in text
    assert "… 80 more rows not shown" in rendered(df)  # no CSV named: none promised
    assert "19 " in text and " 20 " not in text.split("…")[0].replace("│", " ")


def test_format_ci():
    assert C.format_ci(0.51234, 0.4993, 0.5253) == "0.512 ± 0.013"
    assert C.format_ci(12.3456, 11.0, 14.0) == "12.3 ± 1.5"  # near symmetric
    assert C.format_ci(12.3456, 12.0, 14.0) == "12.3 [12.0, 14.0]"  # asymmetric: the interval itself
    assert C.format_ci(1234.5, 1200.5, 1268.5) == "1234 ± 34"
    assert C.format_ci(float("nan"), 0, 1) == ""
    assert C.format_ci(0.5, float("nan"), float("nan")) == "0.5"


def test_demo_ends_with_its_report(tmp_path):
    out = tmp_path / "demo"
    r = CliRunner().invoke(app, ["demo", "--steps", "inspect", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    text = (out / "report/report.html").read_text()
    assert 'id="demo"' in text and 'id="demo-inspect"' in text and "models=" in text
    assert json.loads((out / "manifest.json").read_text())["runs"] == ["inspect", "report"]
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


def test_progress_prints_policy_specs_verbatim(capsys):
    from moetool.progress import progress

    assert list(progress(range(3), total=3, description="ppl norm:up:l2 [x]")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "ppl norm:up:l2 [x]" in err and "\U0001f199" not in err  # not "ppl norm🆙l2"


def test_demo_norm_select_step_uses_the_one_demo_layout(tmp_path, monkeypatch):
    """Every demo step: <step>/<model>/ with <step>/manifest.json (norm-select was <step>/ alone). The sweep is
    cut to one node without tasks here (the layout, not the numbers, is under test)."""
    from moetool.experiments import norm_select as ns
    from moetool.loading import embedded_models

    if "tiny" not in embedded_models():
        pytest.skip("embedded model not built")
    real = ns.norm_select
    monkeypatch.setattr(ns, "norm_select", lambda lm, tokens, opts, quiet: real(
        lm, tokens, ns.NormSelectOptions(nodes=("gate",), norms=("l2",), batch_size=16, bootstrap=0), quiet=True))
    parent = RunDir.create("demo", tmp_path / "demo")
    lines = ns.demo(parent, quiet=True)
    parent.finish(options={})
    step = tmp_path / "demo" / "norm-select"
    assert json.loads((step / "manifest.json").read_text())["status"] == "complete"
    assert json.loads((step / "manifest.json").read_text())["runs"] == ["tiny"]
    assert (step / "tiny" / "agreement.csv").is_file() and not (step / "agreement.csv").exists()
    # the per-model run is a norm-select run (the report's "command" row), not a run of a command named "tiny"
    assert [json.loads((d / "manifest.json").read_text())["command"] for d in (step, step / "tiny")] == \
        ["norm-select", "norm-select"]
    assert lines and "norm:gate:l2" in "\n".join(lines)
