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
from moetool.report.page import find_runs, png_size, to_latex, write_report

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
    a.write_csv("top_tokens.csv", pd.DataFrame({"count": [9, 8, 7, 6], "token": [" the", "\n", "NA", "x"],
                                                "expert": [0, 0, 1, 1], "layer": [0, 0, 0, 0]}))
    a.finish(options={"model": "tiny", "seq_len": 256}, model={"name": "tiny", "model_type": "mixtral"}, seed=3)
    b = demo.sub("erc")
    b.write_csv("erc.csv", pd.DataFrame({"alpha": [0.5, 1.0], "erc_loss": [0.3, 0.1]}))
    b.write_csv("wide.csv", pd.DataFrame({f"column_{i}": [i / 7] for i in range(40)}))  # wider than any page
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(8.0, 2.2))  # about as wide as a 1400-px window (the demo's widest: 1390 px)
    fig.add_subplot().plot([0.0, 1.0, 2.0], [0.3, 0.1, 0.0])  # a line plot fills the width (a matrix is square)
    b.save_figure(fig, "erc_loss")
    b.add(definitions={"erc_loss": "L_ERC: mean hinge loss over proxies", "erc": "one row per alpha"})
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
        (demo / f).read_bytes() for f in ("stats-tiny/figures/curve.png", "erc/figures/erc_loss.png")}
    assert "<link" not in text and "<script" not in text
    # each run's manifest summary; the failed run says why
    assert "model_type=mixtral" in text and "seq_len=256" in text and "NaN in layer 2, batch 0" in text
    assert "<b>curve</b> Run: tiny. " in text  # the model in the figure caption
    # a figure at its pixel size, a link to the full-size PNG and the PDF; a known figure says what it shows,
    # its definitions (the manifest's, as the CSV's columns) and the data it came from
    w, h = png_size((demo / "erc/figures/erc_loss.png").read_bytes())
    assert 1200 < w <= 1400 and f'width="{w}" height="{h}"' in text
    assert '<a href="figures/demo-stats-tiny/curve.png" title="open at full size">' in text
    assert '<a href="figures/demo-stats-tiny/curve.pdf">PDF</a>' in text
    assert ("<b>erc_loss</b>: ERC loss against the margin α, one line per layer. erc_loss: L_ERC: mean hinge loss "
            'over proxies. Data: <a href="tables/demo-erc/erc.csv">tables/demo-erc/erc.csv</a>.') in text
    assert '<p class="def">one row per alpha</p>' in text  # a table's definition above it
    # every table in its own scroll box; numbers right-aligned; key columns first; whitespace tokens visible
    assert text.count('<div class="scroll"><table>') == text.count("<table>") == 6
    assert text.count('<table class="meta">') == 4  # the manifests
    tokens = re.search(r'<h3 id="demo-stats-tiny--tab-top_tokens">.*?</table>', text, re.S).group(0)
    assert re.findall(r"<th[^>]*>(\w+)</th>", tokens) == ["layer", "expert", "token", "count"]
    assert re.findall(r'<td class="t">([^<]*)</td>', tokens) == ["␣the", "↵", "NA", "x"]
    assert '<td class="n">9</td>' in tokens and '<th class="n">count</th>' in tokens
    # a table of contents per run, every link to an anchor on the page
    assert '<a href="#demo-stats-tiny--tab-top_tokens">top_tokens.csv</a> (4 rows)' in text
    anchors = set(re.findall(r'href="#([^"]+)"', text))
    assert len(anchors) > 8 and anchors <= set(re.findall(r'id="([^"]+)"', text))
    assert 'class="status-failed"' in text
    # tables: every row in CSV and LaTeX, the long one truncated in the page with a note
    load = pd.read_csv(out / "tables/demo-stats-tiny/load.csv")
    assert len(load) == 32 and load.equals(pd.read_csv(demo / "stats-tiny/load.csv"))
    assert "first 10 of 32 rows" in text
    assert text.count("<tr>") >= 10 + 2 + 2
    tex = (out / "tables/demo-stats-tiny/layers.tex").read_text()
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex
    assert r"norm:up:l2 \\" in tex.replace("& ", "") or "norm:up:l2" in tex
    assert r"a\_b\&c" in tex and r"2.075 \\" in tex  # escaped text, 4 significant digits, NaN empty
    assert "policy & layer & load\\_entropy" in tex  # key columns first
    assert (out / "figures/demo-stats-tiny/curve.pdf").read_bytes()[:4] == b"%PDF"
    md = (out / "report.md").read_text()
    assert "![curve](figures/demo-stats-tiny/curve.png)" in md and "| policy | layer | load\\_entropy |" in md
    m = json.loads((out / "manifest.json").read_text())
    assert m["command"] == "report" and m["status"] == "complete" and len(m["gathered"]) == 4


def test_every_figure_has_a_caption_from_the_definitions():
    """Every figure the experiments draw (``out["name"]`` in the plot code) has a caption, and every definition
    a caption cites is one an experiment writes into its manifest (so the page shows it)."""
    import importlib

    from moetool.report import plots

    src = "".join(f.read_text() for f in sorted(Path(plots.__file__).parents[1].glob("experiments/*/figures.py")))
    drawn = set(re.findall(r'out\["(\w+)"\] = ', src)) | set(re.findall(r'"(\w+)": (?:plot_\w+\(|fig\}|ratio_curve\()', src))
    drawn |= set(re.findall(r'for name, \w+ in \(\("(\w+)", "\w+"\),', src))  # for name, y in (("a", "y"),
    drawn |= set(re.findall(r'\),\s+\("(\w+)", "\w+"\)\):', src))  # ("b", "y")):
    assert {"load_heatmap", "coactivation", "erc_matrix", "retention", "offload_coverage"} <= drawn
    assert drawn == set(plots.FIGURE_CAPTIONS)
    defs: set[str] = set()
    from moetool.experiments.registry import EXPERIMENTS

    for spec in EXPERIMENTS.values():
        mod = importlib.import_module(spec.module)
        defs |= {k for n in dir(mod) if n.endswith("DEFINITIONS") and isinstance(getattr(mod, n), dict)
                 for k in getattr(mod, n)}
    for name, (shows, tables, keys) in plots.FIGURE_CAPTIONS.items():
        assert shows and tables and all(t.endswith(".csv") for t in tables), name
        assert set(keys) <= defs, (name, set(keys) - defs)


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


# ----- hostile run folders: a report page is shared, a run folder may come from anyone --------------------------
PAYLOAD = '"><script>alert(1)</script>'
TEX_PAYLOAD = r"\input{/etc/passwd}\write18{touch pwned}"


def hostile_run(tmp_path: Path) -> Path:
    """A finished run whose manifest and files were edited to inject markup and to read files outside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "secret.txt").write_text("TOP-SECRET-TXT")
    (outside / "secret.csv").write_text("secret_col\nTOP-SECRET-CSV\n")
    png = F.new_figure()[0]
    png.savefig(outside / "stolen.png")
    run = RunDir.create("stats", outside / "run")
    run.write_csv("layers.csv", pd.DataFrame({"layer": [0, 1], "policy": [PAYLOAD, TEX_PAYLOAD],
                                              "token": [" the", "\n"]}))
    run.write_csv(r"x}\input{secret}.csv", pd.DataFrame({"v": [1.0]}))  # a file name that is a LaTeX command
    run.finish(options={"model": PAYLOAD})
    d = outside / "run"
    (d / "link.csv").symlink_to(outside / "secret.csv")
    (d / "figures").mkdir()
    (d / "figures" / "link.png").symlink_to(outside / "stolen.png")
    m = json.loads((d / "manifest.json").read_text())
    m["status"] = PAYLOAD
    m["error"] = "<img src=x onerror=alert(2)> [click](javascript:alert(3))"
    m["files"] += ["../../secret.txt", str(outside / "secret.csv"), "figures/../../stolen.png", "link.csv",
                   "figures/link.png", {"not": "a path"}]
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def test_report_escapes_injected_text_and_reads_nothing_outside_the_run(tmp_path, capsys):
    d = hostile_run(tmp_path)
    page = write_report([d], tmp_path / "rep")
    out = page.parent
    text = page.read_text()
    err = capsys.readouterr().err
    # HTML: no markup from the manifest or a cell, in text or in an attribute (status was class="status-<it>")
    assert "<script" not in text and "<img src=x" not in text and PAYLOAD not in text and 'status-"' not in text
    assert 'class="status-other"' in text and html_escaped(PAYLOAD) in text
    # Markdown: no raw HTML, no link from data
    md = (out / "report.md").read_text()
    assert "<script" not in md and "<img" not in md and not re.search(r"(?<!\\)\]\(", md.replace(
        "](figures/", "").replace("](tables/", ""))  # no link from data (the report's own links are to its copies)
    assert "&lt;script&gt;" in md and r"\[click\](javascript:alert(3))" in md
    # LaTeX: no command from a cell, a column or a file name (label included)
    tex = "".join(p.read_text() for p in sorted(out.rglob("*.tex")))
    assert tex.count("\\begin{table}") == 2
    assert "\\input" not in tex and "\\write18" not in tex and "\\textbackslash{}input\\{/etc/passwd\\}" in tex
    assert re.findall(r"\\label\{([^}]*)\}", tex) == ["tab:run-layers", "tab:run-x-input-secret"]
    assert "\\textvisiblespace{}the" in tex  # a whitespace token stays visible in print
    # nothing from outside the run folder: not by ../, an absolute path, figures/../.., nor a symbolic link
    everything = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert b"TOP-SECRET" not in everything
    assert text.count("data:image/png") == 0 and not (out / "figures").exists()
    assert sorted(p.name for p in (out / "tables/run").iterdir()) == [
        "layers.csv", "layers.tex", "x-input-secret.csv", "x-input-secret.tex"]
    for entry in ("../../secret.txt", "figures/../../stolen.png", "link.csv", "figures/link.png", "secret.csv"):
        assert entry in err and entry in text, entry  # one warning line each, and a note in the page
    assert all(ln.startswith("warning: ") for ln in err.strip().splitlines())


def html_escaped(s: str) -> str:
    import html

    return html.escape(s)


def test_report_follows_no_symlink_out_of_or_back_into_a_run(tmp_path, capsys):
    """``latest -> .`` gathered one run 36 times and failed half-written; links to other runs are not followed."""
    demo = make_runs(tmp_path / "a")
    other = RunDir.create("erc", tmp_path / "elsewhere")
    other.write_csv("erc.csv", pd.DataFrame({"alpha": [1.0], "erc_loss": [0.5]}))
    other.finish(options={})
    (demo / "latest").symlink_to(".")
    (demo / "erc" / "up").symlink_to("..")
    (demo / "stats-tiny" / "elsewhere").symlink_to(tmp_path / "elsewhere")
    (demo / "loop").symlink_to("loop")  # a dangling self-loop
    page = write_report([demo], tmp_path / "rep")
    m = json.loads((page.parent / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert [Path(p).relative_to(demo).as_posix() for p in m["gathered"]] == [".", "stats-tiny", "erc", "approx"]
    err = capsys.readouterr().err
    for link in ("latest", "up", "elsewhere"):
        assert f"{link}: a symbolic link to a folder, not followed" in err
    assert "tables/demo-stats-tiny-elsewhere" not in page.read_text()


CHECK = """<img id="control-broken" src="missing-control.png">
<img id="control-small" style="width:20px" src="CONTROL_SRC">
<div style="overflow:hidden"><div id="control-wide" style="width:3000px">x</div></div><script>
console.error("moetool-control");
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const vw = document.documentElement.clientWidth;
  const name = e => e.id || e.alt || e.tagName;
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(name);
  const small = imgs.filter(i => i.naturalWidth > 0 && i.getBoundingClientRect().width < i.naturalWidth - 0.5);
  const out = [...document.body.querySelectorAll("*")].filter(
    e => e.getBoundingClientRect().right > vw + 0.5 && !e.closest(".scroll"));
  const boxes = [...document.querySelectorAll(".scroll")];
  document.body.setAttribute("data-check", JSON.stringify({images: imgs.length, broken: broken,
    below_native: small.map(name), beyond_window: out.map(name), page_scroll: document.documentElement.scrollWidth - vw,
    widths: imgs.filter(i => !i.id).map(i => [i.naturalWidth, Math.round(i.getBoundingClientRect().width)]),
    scrolling_boxes: boxes.filter(b => b.scrollWidth > b.clientWidth)
      .map(b => b.querySelector("th") ? "table" : "figure")}));
});
</script></body>"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian: apt-get install -y chromium)")
@pytest.mark.slow
def test_html_renders_in_headless_chromium(tmp_path):
    """At 1400 px: no broken image, no console message, no horizontal page scroll (a 40-column table scrolls in
    its own box), every figure at its pixel size; a screenshot is taken. Control elements injected into a copy (a
    broken image, a console message, an image shown at 20 px, an element wider than the window) prove the checks
    can fail."""
    page = write_report([make_runs(tmp_path)], tmp_path / "rep")
    text = page.read_text()
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--disable-background-networking", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,1000"]
    check = tmp_path / "check.html"
    src = re.search(r'src="(data:image/png;base64,[^"]*)"', text).group(1)
    check.write_text(text.replace("</body>", CHECK.replace("CONTROL_SRC", src)))
    r = subprocess.run([*flags, "--virtual-time-budget=3000", "--enable-logging=stderr", "--v=0", "--dump-dom",
                        check.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'data-check="([^"]*)"', r.stdout)
    assert found, r.stderr[-2000:]
    res = json.loads(found.group(1).replace("&quot;", '"'))
    widths = res.pop("widths")
    assert res == {"images": 4, "broken": ["control-broken"], "below_native": ["control-small"],
                   "beyond_window": ["control-wide"], "page_scroll": 0, "scrolling_boxes": ["table"]}
    assert len(widths) == 2 and all(w == shown for w, shown in widths) and max(w for w, _ in widths) > 1200
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]
    assert len(console) == 1 and "moetool-control" in console[0], console
    shot = tmp_path / "report.png"
    r = subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]
    assert png_size(shot.read_bytes())[0] == 1400


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
            s = f"{v:.4g}" if isinstance(v, float) else f"{v:,}"  # a count: with its thousands separators
            assert s in text, s
    assert "norm:up:l2" in text and "[bold]x[/bold]" in text  # no emoji, no markup from data
    assert "stats (1/" in text  # split into column blocks that repeat the key column
    assert text.count("norm:up:l2") > 3


def test_integer_and_column_formats_make_big_numbers_readable():
    """``intfmt`` formats integer cells (not booleans), ``formats`` a column's own format (its NaN stays empty, a
    column the table lacks is passed over); by default an integer count has its thousands separators (the default
    wrote ``1342052808704`` on BASE) and floats ``{:.4g}``; ``intfmt="{}"`` writes plain digits."""
    df = pd.DataFrame({"group": ["a", "b"], "params": [1342052808704, 7], "ok": [True, False],
                       "bytes": [1476838.4, float("nan")], "rate": [0.37381, 0.5]})
    text = rendered(df, intfmt="{:,}", formats={"bytes": "{:,.0f}", "absent": "{:.1f}"})
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in text.splitlines() if ln.startswith("│")]
    assert rows == [["a", "1,342,052,808,704", "True", "1,476,838", "0.3738"], ["b", "7", "False", "", "0.5"]]
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in rendered(df).splitlines() if ln.startswith("│")]
    assert rows[0] == ["a", "1,342,052,808,704", "True", "1.477e+06", "0.3738"]
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in rendered(df, intfmt="{}").splitlines()
            if ln.startswith("│")]
    assert rows[0] == ["a", "1342052808704", "True", "1.477e+06", "0.3738"]


def test_identifier_columns_past_999_stay_plain_and_a_columns_own_format_wins_for_integers():
    """Identifiers that reach 1000 in real tables (stats' and trace's token_id, trace's row and pos, a seed, an
    index) print plain; a count whose name starts like an identifier (``experts``, not ``expert_<k>``) keeps its
    separators; a column's own ``formats`` entry applies to an integer column too, over the default (mutation pass
    22: K4, K5 and dropping an id column survived). Expected cells by hand."""
    df = pd.DataFrame({"token_id": [50256], "row": [1500], "pos": [2047], "seed": [1234], "index": [4096],
                       "expert_12": [3000], "experts": [1024], "count": [65536]})
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in rendered(df).splitlines() if ln.startswith("│")]
    assert rows == [["50256", "1500", "2047", "1234", "4096", "3000", "1,024", "65,536"]]
    text = rendered(df, formats={"count": "{:08d}", "row": "{:,}"})
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in text.splitlines() if ln.startswith("│")]
    assert rows == [["50256", "1,500", "2047", "1234", "4096", "3000", "1,024", "00065536"]]


def test_console_counts_have_thousands_separators_and_identifiers_do_not(tmp_path):
    """stats' tokens and ppl's scored_tokens printed 2048 / 2016 on BASE while the titles and inspect / plan wrote
    counts with separators: every integer count now has them (the CSVs keep plain integers), identifiers (layer,
    expert, token ids, steps) stay plain. The counts by hand: the packed rows' real tokens and scored pairs."""
    from typer.testing import CliRunner

    from moetool.commands.app import app
    from moetool.data import load_tokens
    from moetool.loading import load

    df = pd.DataFrame({"layer": [1024], "expert": [1500], "token": [12345], "expert_0": [1001], "step": [20000],
                       "tokens": [2048], "scored_tokens": [1000000]})
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in rendered(df).splitlines() if ln.startswith("│")]
    assert rows == [["1024", "1500", "12345", "1001", "20000", "2,048", "1,000,000"]]
    ts = load_tokens(None, load("tiny").tokenizer, 64, 1100)
    tokens = int(ts.attention_mask.sum())
    m = ts.attention_mask.bool()
    scored = int((m[:, 1:] & m[:, :-1]).sum())
    assert tokens >= 1000 and scored >= 1000
    common = ["--model", "tiny", "--seq-len", "64", "--max-tokens", "1100", "--bootstrap", "0"]
    for cmd, column, want in (("stats", "tokens", tokens), ("ppl", "scored_tokens", scored)):
        r = CliRunner(env={"COLUMNS": "200", "MOETOOL_FIGURES": "none"}).invoke(
            app, [cmd, *common, "--out", str(tmp_path / cmd)])
        assert r.exit_code == 0, r.output
        table = [ln for ln in r.output.splitlines() if ln.startswith(("┃", "│"))]
        head = [c.strip() for c in table[0].strip("┃").split("┃")]
        cells = [[c.strip() for c in ln.strip("│").split("│")] for ln in table[1:]]
        assert {row[head.index(column)] for row in cells} == {f"{want:,}"}, r.output
        if "layer" in head:
            assert [row[head.index("layer")] for row in cells] == ["0", "1", "2", "3"]
        csv = pd.read_csv(tmp_path / cmd / ("layers.csv" if cmd == "stats" else "ppl.csv"))
        assert csv[column].dtype.kind == "i" and set(csv[column]) == {want}


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


def test_a_split_table_has_no_part_of_labels_alone():
    """fluctuation's console table with real, asymmetric intervals (``0.0518 [0.0443, 0.0602]``, 23 characters):
    the four labels leave no room for one beside them at 80 columns, so ``checkpoint`` left the keys and, a column
    of its own, made part 1 of 7 with no value in it (a newcomer's ``moetool fluctuation tiny-early tiny``). Its
    one value (``tiny``) now goes to the title; every part holds a value column beside layer, routing, reference."""
    routings = [f"{r}{i}" for i in ("", "-isolated") for r in ("router", "similarity", "attention")]  # --isolate
    rows = [(layer, routing) for routing in routings for layer in range(4)]
    labels = ["layer", "routing", "reference", "checkpoint"]
    df = pd.DataFrame({"layer": [r[0] for r in rows], "routing": [r[1] for r in rows],
                       "reference": "tiny-early", "checkpoint": "tiny",
                       **{c: [f"0.{k:02d}18 [0.0443, 0.0602]" for k in range(24)] for c in
                          ("top1_change", "topk_change", "topk_overlap", "jaccard")},
                       "entropy_ref": np.linspace(1, 2, 24), "entropy_ckpt": np.linspace(2, 3, 24),
                       "entropy_ratio": np.linspace(0.5, 1.5, 24)})
    parts = C.render_table(df, title="routing fluctuation", width=80)
    heads = [[c.header.plain for c in part.columns] for part in parts]
    assert all(h[:3] == labels[:3] and len(h) > 3 and "checkpoint" not in h for h in heads), heads
    assert [h[3] for h in heads] == ["top1_change", "topk_change", "topk_overlap", "jaccard", "entropy_ref",
                                     "entropy_ratio"]
    assert heads[4] == [*labels[:3], "entropy_ref", "entropy_ckpt"]
    assert [p.title.plain for p in parts] == [f"routing fluctuation; checkpoint tiny ({b}/6)" for b in range(1, 7)]
    several = df.assign(checkpoint=["tiny", "tiny-fine"] * 12)  # not one value: stays a column, as before
    assert "checkpoint" in [c.header.plain for c in C.render_table(several, title="t", width=80)[0].columns]
    text = rendered(df, title="routing fluctuation")
    assert max(len(ln) for ln in text.splitlines()) <= 80 and text.count("0.1118 [0.0443, 0.0602]") == 4


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
    assert C.format_ci(12.34, 11.24, 13.46) == "12.3 ± 1.1"  # symmetric to the digit shown (1.10 below, 1.12 above)
    assert C.format_ci(12.3456, 11.0, 14.0) == "12.3 [11.0, 14.0]"  # '± 1.5' would say [10.8, 13.8]
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


def test_the_page_reads_a_checkpoint_pair_as_the_run_does():
    """The page put ``checkpoint`` before ``reference``: fluctuation's rows read ``tiny | tiny-early`` under a headline
    ``tiny-early -> tiny`` and beside a CSV whose columns are reference, checkpoint. Key columns now keep that order."""
    from moetool.experiments.fluctuation.compute import COLUMNS, SUMMARY_COLUMNS
    from moetool.report.page import key_first

    for cols in (COLUMNS, SUMMARY_COLUMNS):
        df = pd.DataFrame([dict.fromkeys(cols, 0)], columns=cols).assign(reference="tiny-early", checkpoint="tiny")
        shown = list(key_first(df).columns)
        assert shown.index("reference") < shown.index("checkpoint"), shown
        assert key_first(df).iloc[0][["reference", "checkpoint"]].tolist() == ["tiny-early", "tiny"]


def test_status_leaves_one_finished_line_in_a_log(capsys):
    """lm-eval's loop runs under ``progress.status``, a spinner: piped into a log (``moetool demo 2> log``) it drew
    nothing, so norm-select's lm-eval (minutes under load) left no line at all, like a hang. Off a terminal it now
    leaves one line when done, with the loop's own wall time (as a progress bar leaves its finished bar); nothing
    under --quiet, nothing when the loop fails."""
    import time

    from moetool.progress import status

    t0 = time.perf_counter()
    with status("lm-eval moetool_code (norm:gate:l2)"):
        time.sleep(0.3)
    elapsed = time.perf_counter() - t0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    m = re.fullmatch(r"lm-eval moetool_code \(norm:gate:l2\): done in (\d+\.\d) s", lines[0])
    assert m, lines[0]
    assert 0.3 <= float(m.group(1)) + 0.05 and float(m.group(1)) <= elapsed + 0.05
    with status("quiet", quiet=True):
        pass
    with pytest.raises(RuntimeError), status("lm-eval failing"):
        raise RuntimeError("boom")
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_demo_norm_select_step_uses_the_one_demo_layout(tmp_path, monkeypatch):
    """Every demo step: <step>/<model>/ with <step>/manifest.json (norm-select was <step>/ alone). The sweep is
    cut to one node without tasks here (the layout, not the numbers, is under test)."""
    from moetool.demo import run_step
    from moetool.experiments.norm_select import compute as ns
    from moetool.experiments.registry import EXPERIMENTS
    real = ns.norm_select
    monkeypatch.setattr(ns, "norm_select", lambda lm, tokens, opts, quiet: real(
        lm, tokens, ns.NormSelectOptions(nodes=("gate",), norms=("l2",), batch_size=16, bootstrap=0), quiet=True))
    parent = RunDir.create("demo", tmp_path / "demo")
    lines = run_step(parent, EXPERIMENTS["norm-select"], quiet=True)
    parent.finish(options={})
    step = tmp_path / "demo" / "norm-select"
    assert json.loads((step / "manifest.json").read_text())["status"] == "complete"
    assert json.loads((step / "manifest.json").read_text())["runs"] == ["tiny"]
    assert (step / "tiny" / "agreement.csv").is_file() and not (step / "agreement.csv").exists()
    # the per-model run is a norm-select run (the report's "command" row), not a run of a command named "tiny"
    assert [json.loads((d / "manifest.json").read_text())["command"] for d in (step, step / "tiny")] == \
        ["norm-select", "norm-select"]
    assert lines and "norm:gate:l2" in "\n".join(lines)


def test_report_says_an_invalid_manifest_and_a_folder_given_twice(tmp_path):
    """Issue 35 item 11: a run whose manifest.json is not JSON is refused with the line of the error (not "no
    manifest.json in it"); a sub-run's is a warning; the same folder given twice is gathered once and said."""
    demo = make_runs(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text('{\n  "command": "stats",\n  "files": [,]\n}\n')
    err = json.JSONDecodeError
    try:
        json.loads((bad / "manifest.json").read_text())
    except err as e:
        where = f"line {e.lineno}, column {e.colno}"
    assert where == "line 3, column 13"
    r = CliRunner().invoke(app, ["report", str(bad), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert f"manifest.json is not valid JSON ({where}" in r.output
    shutil.copytree(bad, demo / "erc-broken")
    warnings: list[str] = []
    runs = find_runs([demo, demo], warn=warnings.append)
    assert [r.name for r in runs] == ["demo", "demo-stats-tiny", "demo-erc", "demo-approx"]  # each run once
    assert any("erc-broken: manifest.json is not valid JSON (line 3" in w for w in warnings), warnings
    assert any("given twice" in w and "gathered once" in w for w in warnings), warnings
    r = CliRunner().invoke(app, ["report", str(demo), str(demo), "--out", str(tmp_path / "rep2")])
    assert r.exit_code == 0, r.output
    assert "given twice" in (tmp_path / "rep2/report.html").read_text()


def test_page_opens_with_headline_numbers_and_an_index_of_what_differs(tmp_path):
    """Issue 35 item 16: the page starts with one table of each run's headline numbers (its manifest's
    ``headline``, as ``write`` records it from the experiment's own summary lines) linking to its section; the
    index labels runs by command and model, without the repeated folder prefix, and skips parents with metadata
    only."""
    import moetool
    from moetool.experiments.registry import EXPERIMENTS
    from moetool.report.writers import write

    demo = make_runs(tmp_path)
    lm = moetool.load("tiny")
    res = moetool.erc(lm)
    run = RunDir.create("erc", demo / "erc-real")
    write(res, run, model=lm, options={"model": "tiny"})
    expected = EXPERIMENTS["erc"].load("summary_lines")("tiny", res)
    assert json.loads((demo / "erc-real/manifest.json").read_text())["headline"] == expected and expected
    text = write_report([demo], tmp_path / "rep").read_text()
    head = text[text.index("<h1>"):text.index('<h2 id="demo"')]
    table = re.search(r'<table class="headline">.*?</table>', head, re.S).group(0)
    assert '<a href="#demo-erc-real">erc</a></td><td>tiny</td>' in table
    assert all(html_escaped(line) in table for line in expected)
    index = re.search(r'<nav class="runs">.*?</nav>', head, re.S).group(0)
    entries = re.findall(r'<li><a href="#([^"]+)">([^<]*)</a> <span class="note">([^<]*)</span>', index)
    assert entries == [("demo-stats-tiny", "stats-tiny · tiny", "stats-tiny"), ("demo-erc", "erc", "erc"),
                       ("demo-approx", "approx", "approx, failed"), ("demo-erc-real", "erc · tiny", "erc-real")]
    assert '<h2 id="demo-stats-tiny">stats-tiny · tiny <span class="note">stats-tiny</span></h2>' in text


def test_metadata_shows_human_values_and_relative_paths(tmp_path):
    """Issue 35 item 17: no raw Python values (torch.float32, ['tiny', 'tiny-fine'], None, True) and no absolute
    paths inside the run or the package in a run's metadata rows."""
    from moetool.loading import embedded_models
    from moetool.report.page import summary

    src = embedded_models()["tiny"]
    m = {"command": "stats", "status": "complete",
         "model": {"name": "tiny", "source": str(src), "dtype": "torch.float32", "device": "cpu"},
         "data": {"source": str(tmp_path / "data" / "x.jsonl"), "tokens": 32768, "domains": ["code", "prose"]},
         "options": {"models": ["tiny", "tiny-fine"], "top_k": None, "all_tokens": False,
                     "pairs": [["tiny-early", "tiny"]]},
         "argv": ["/venv/bin/moetool", "stats", "--out", str(tmp_path)]}
    rows = dict(summary(m, tmp_path))
    assert rows["model"] == "name=tiny, source=moetool/embedded/tiny, dtype=float32, device=cpu"
    assert rows["data"] == "source=data/x.jsonl, tokens=32,768, domains=code, prose"
    assert rows["options"] == "models=tiny, tiny-fine; top_k=none; all_tokens=no; pairs=(tiny-early, tiny)"
    assert rows["command line"] == "moetool stats --out ."
    assert "torch." not in str(rows) and "[" not in str(rows) and str(tmp_path) not in str(rows)


def _real_run(tmp_path_factory, command: str, *args: str) -> Path:
    """A real finished run folder of ``command`` on the embedded model (on the CPU, no bootstrap)."""
    out = tmp_path_factory.mktemp("real") / command
    r = CliRunner().invoke(app, [command, *args, "--bootstrap", "0", "-q", "--device", "cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A real finished run folder (ppl on the embedded model, 512 tokens)."""
    return _real_run(tmp_path_factory, "ppl", "--seq-len", "64", "--max-tokens", "512")


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_report_refuses_an_out_over_the_runs_it_gathers(small_run, tmp_path):
    """``report selfrep --out selfrep --force`` removed the run's ppl.csv and manifest (exit 0, a warning): an --out
    that is a RUN_DIR, contains one or lies inside a run among them is one line, exit 2, nothing touched."""
    runs = tmp_path / "runs"
    shutil.copytree(small_run, runs / "selfrep")
    (tmp_path / "link").symlink_to(runs / "selfrep")
    before = _tree(tmp_path)
    assert {"ppl.csv", "manifest.json"} <= set(_tree(runs / "selfrep"))
    for given, out, says in ((runs / "selfrep", runs / "selfrep", "is the folder"),
                             (runs / "selfrep", tmp_path / "link", "is the folder"),  # the same folder by a link
                             (runs / "selfrep", runs, "contains the folder"),
                             (runs / "selfrep", runs / "selfrep" / "rep", "lies inside the run folder"),
                             (runs, runs / "selfrep" / "rep", "lies inside the run folder"),
                             (runs, runs, "is the folder")):
        r = CliRunner().invoke(app, ["report", str(given), "--out", str(out), "--force"])
        assert r.exit_code == 2, (given, out, r.output)
        assert r.output.startswith("error: ") and says in r.output and len(r.output.strip().splitlines()) == 1
        assert _tree(tmp_path) == before and not (runs / "selfrep" / "rep").exists()
    # a plain folder of runs may hold the report: gathered without the report itself
    r = CliRunner().invoke(app, ["report", str(runs), "--out", str(runs / "paper")])
    assert r.exit_code == 0, r.output
    m = json.loads((runs / "paper" / "manifest.json").read_text())
    assert m["gathered"] == [str(runs / "selfrep")] and _tree(runs / "selfrep") == _tree(small_run)


def test_an_asymmetric_interval_is_never_shown_as_plus_minus():
    """eval printed ``0.60 ± 0.20`` for the Wilson interval [0.387, 0.781] of 12/20 (read back: [0.40, 0.80]).
    ``±`` only where it gives both bounds to the digits shown; at p = 0.5 the Wilson interval is symmetric."""
    import random

    from conftest import wilson_by_hand

    lo, hi = wilson_by_hand(0.6, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.387, 0.781)
    assert C.format_ci(0.6, lo, hi) == "0.60 [0.39, 0.78]"
    assert C.format_ci(0.5, *wilson_by_hand(0.5, 26)) == "0.50 ± 0.18"
    rng = random.Random(0)
    for _ in range(2000):
        value, below, above = rng.uniform(-5, 5), rng.uniform(1e-3, 2), rng.uniform(1e-3, 2)
        if rng.random() < 0.3:
            above = below  # exactly symmetric: always ±
        text = C.format_ci(value, value - below, value + above)
        if above == below:
            assert "±" in text, text
        if "±" in text:  # read back, '± h' gives each bound to within the rounding of the two numbers shown
            v, h = map(float, text.split(" ± "))
            unit = 10.0 ** -len(text.split(" ± ")[1].partition(".")[2])
            assert abs((v - h) - (value - below)) <= 1.5 * unit and abs((v + h) - (value + above)) <= 1.5 * unit
        else:  # the interval itself, to the digits shown
            shown_lo, shown_hi = text.split(" [")[1].rstrip("]").split(", ")
            unit = 10.0 ** -len(shown_lo.partition(".")[2])
            assert abs(float(shown_lo) - (value - below)) <= 0.5 * unit + 1e-12
            assert abs(float(shown_hi) - (value + above)) <= 0.5 * unit + 1e-12


def test_report_reads_tokens_that_pandas_takes_for_missing_as_text(tmp_path):
    """pandas' default read turns the tokens "None", "NaN", "null", "N/A", "<NA>" into NaN; the report reads a
    run's tables as written (only an empty cell is missing), in the page, the Markdown and the copied CSV."""
    words = ["None", "NaN", "nan", "null", "N/A", "<NA>", "#N/A", "NULL"]
    run = RunDir.create("stats", tmp_path / "run")
    run.write_csv("top_tokens.csv", pd.DataFrame({"layer": 0, "expert": range(len(words)), "token": words,
                                                  "count": range(len(words), 0, -1)}))
    run.finish(options={"model": "tiny"})
    assert pd.read_csv(tmp_path / "run" / "top_tokens.csv").token.isna().all()  # the trap this avoids
    page = write_report([tmp_path / "run"], tmp_path / "rep")
    text = page.read_text()
    import html as html_module

    assert [html_module.unescape(t) for t in re.findall(r'<td class="t">([^<]*)</td>', text)] == words
    md = (page.parent / "report.md").read_text()
    assert all(f"| {w} |" in md for w in ("None", "NaN", "nan", "null", "NULL")), md
    copied = next((page.parent / "tables").rglob("top_tokens.csv"))
    assert pd.read_csv(copied, keep_default_na=False).token.tolist() == words


def test_report_refuses_a_table_cut_short_instead_of_showing_its_last_row(tmp_path):
    """A run's CSV cut inside its last row (a copy interrupted) was read as a row: tokens 256 cut to 25 shown as
    a number, the cut-off columns as blanks. Every table a run writes ends with a line break: one that does not is
    a note in the page, not a table."""
    run = RunDir.create("stats", tmp_path / "run")
    run.write_csv("layers.csv", pd.DataFrame({"layer": [0, 1], "tokens": [256, 256], "load_entropy": [2.0, 1.5]}))
    run.write_csv("load.csv", pd.DataFrame({"layer": [0], "expert": [0]}))
    run.finish(options={"model": "tiny"})
    csv = tmp_path / "run" / "layers.csv"
    csv.write_bytes(csv.read_bytes()[:csv.read_bytes().index(b"\n1,256") + 5])  # "...\n1,25"
    page = write_report([tmp_path / "run"], tmp_path / "rep")
    md = (page.parent / "report.md").read_text()
    assert "*layers.csv: unreadable (cut short: its last line ends without a line break" in md, md
    assert "| 25 |" not in md and "### load.csv" in md  # the whole table below it still shown
    assert not list((page.parent / "tables").rglob("layers.csv"))


@pytest.fixture(scope="module")
def stats_run(tmp_path_factory) -> Path:
    """A real finished stats run on the embedded model (256 tokens): load.csv has 4 MoE layers x 8 experts rows."""
    return _real_run(tmp_path_factory, "stats", "--max-tokens", "256", "--seq-len", "32")


#: the tests reading ``stats_run`` run in one xdist worker (``--dist loadgroup``): one run, not one per worker
STATS_RUN_GROUP = pytest.mark.xdist_group("test_report-stats_run")


def _sections(md: str) -> dict[str, str]:
    """The Markdown page's table sections by file name (``### load.csv`` up to the next heading)."""
    return {s.split("\n", 1)[0]: s.split("\n##", 1)[0] for s in md.split("\n### ")[1:]}


@STATS_RUN_GROUP
@pytest.mark.slow
def test_report_refuses_a_table_that_lost_whole_rows(stats_run, tmp_path):
    """A copy of load.csv that lost whole rows at a line break (a sync cut short between two rows, rows deleted by
    hand) read cleanly and was shown as the run's table: 3 plausible rows of 32. Its rows against the manifest's
    record: a note in place of the table; every other table of the page as it is with the run's own CSV."""
    intact, cut = tmp_path / "a" / "stats", tmp_path / "b" / "stats"
    shutil.copytree(stats_run, intact)
    shutil.copytree(stats_run, cut)
    lines = (cut / "load.csv").read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 + 32
    (cut / "load.csv").write_bytes(b"".join(lines[:4]))  # the header and 3 rows, ending with a line break
    want = write_report([intact], tmp_path / "rep-a")
    page = write_report([cut], tmp_path / "rep-b")
    md, html_text = (page.parent / "report.md").read_text(), page.read_text()
    note = "load.csv: not shown (it has 3 rows, the run wrote 32; a truncated or edited copy?)"
    assert f"*{note}*" in md and f'<p class="note" id="stats--tab-load">{note}</p>' in html_text  # (contents link)
    assert "### load.csv" not in md and '<h3 id="stats--tab-load">' not in html_text and "/load.csv" not in md
    assert not list((page.parent / "tables").rglob("load.csv"))
    got, shown = _sections(md), _sections((want.parent / "report.md").read_text())
    assert "load.csv" in shown and {k: v for k, v in shown.items() if k != "load.csv"} == got
    assert len(got) == 9


@STATS_RUN_GROUP
@pytest.mark.slow
def test_report_refuses_a_table_whose_values_were_edited(stats_run, tmp_path):
    """The same rows with other values are not the run's numbers either: layer 0's tokens 256 edited to 2560 (other
    bytes) or to 255 (the same size, another sha256), each a note in place of the table."""
    run = tmp_path / "stats"
    shutil.copytree(stats_run, run)
    recorded = json.loads((run / "manifest.json").read_text())["tables"]["layers.csv"]
    text = (run / "layers.csv").read_text()
    assert recorded["rows"] == 4 and recorded["bytes"] == len(text.encode()) and "\n0,8,2,256," in text
    for tokens, says in (("2560", f"has the 4 rows the run wrote but {recorded['bytes'] + 1:,} bytes, not its "
                                  f"{recorded['bytes']:,}: values edited since the run?"),
                         ("255", f"has the 4 rows and the {recorded['bytes']:,} bytes the run wrote but not its "
                                 "content (the sha256 differs): values edited since the run?")):
        (run / "layers.csv").write_text(text.replace("\n0,8,2,256,", f"\n0,8,2,{tokens},", 1))
        page = write_report([run], tmp_path / f"rep-{tokens}")
        md = (page.parent / "report.md").read_text()
        assert f"*layers.csv: not shown (it {says})*" in md and "### layers.csv" not in md, md
        assert "### load.csv" in md and f"| {tokens} |" not in md


@STATS_RUN_GROUP
@pytest.mark.slow
def test_a_run_written_before_manifests_recorded_tables_reads_as_before(stats_run, tmp_path):
    """A manifest without ``tables`` (every run folder written before them) checks nothing: the same page as the
    run with its record; a table of it that lost rows is shown as it is, as it always was (nothing to tell it by)."""
    new, old = tmp_path / "a" / "stats", tmp_path / "b" / "stats"
    shutil.copytree(stats_run, new)
    shutil.copytree(stats_run, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["tables"]
    (old / "manifest.json").write_text(json.dumps(m, indent=2))
    pages = [write_report([run], tmp_path / f"rep-{run.parent.name}") for run in (new, old)]
    md_new, md_old = ((p.parent / "report.md").read_text() for p in pages)
    assert md_old == md_new and pages[1].read_text() == pages[0].read_text() and len(_sections(md_old)) == 10
    lines = (old / "load.csv").read_bytes().splitlines(keepends=True)
    (old / "load.csv").write_bytes(b"".join(lines[:4]))
    md = (write_report([old], tmp_path / "rep-cut").parent / "report.md").read_text()
    assert "### load.csv" in md and "*3 rows; [tables/stats/load.csv]" in md and "not shown" not in md


@STATS_RUN_GROUP
@pytest.mark.slow
@pytest.mark.parametrize("status", ["running", "interrupted", None])
def test_headline_numbers_of_an_unfinished_run_say_so(stats_run, tmp_path, status):
    """The page's first table showed a run's headline numbers under its bare command name whatever its manifest's
    status: a run still going (or killed before it could record why) read as a finished one. Its row now names the
    status; a complete run's row does not."""
    run = tmp_path / "r" / "stats"
    shutil.copytree(stats_run, run)
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "complete" and m["headline"]
    if status is None:
        del m["status"]
    else:
        m["status"] = status
    (run / "manifest.json").write_text(json.dumps(m, indent=2))
    md = (write_report([run], tmp_path / "rep").parent / "report.md").read_text()
    glance = md[md.index("## results at a glance"):].split("\n## ", 1)[0]
    label = status or "status unknown"
    assert f"| [stats ({label})](#" in glance, glance
    md = (write_report([stats_run], tmp_path / "rep-complete").parent / "report.md").read_text()
    assert "| [stats](#" in md[md.index("## results at a glance"):]


def test_a_report_inside_a_gathered_folder_is_not_gathered_again(tmp_path):
    """`moetool report runs/x runs/demo-* --out paper/` gathered each demo's own report/ as one more run (every
    figure and table twice, under mangled names); given itself, a report folder is gathered like any run."""
    demo = make_runs(tmp_path)
    write_report([demo / "stats-tiny", demo / "erc"], RunDir.create("report", demo / "report"))
    assert json.loads((demo / "report" / "manifest.json").read_text())["command"] == "report"
    names = [r.name for r in find_runs([demo])]
    assert names == ["demo", "demo-stats-tiny", "demo-erc", "demo-approx"]
    page = write_report([demo], tmp_path / "paper")
    assert not [p for p in (tmp_path / "paper" / "tables").iterdir() if "report" in p.name]
    assert json.loads((page.parent / "manifest.json").read_text())["gathered"].__len__() == 4
    assert [r.name for r in find_runs([demo / "report"])] == ["report"]  # given explicitly: gathered


@pytest.mark.parametrize("exc, error", [(KeyboardInterrupt(), "SIGINT"), (None, "SIGTERM")])
def test_an_interrupted_run_records_the_signal_as_the_readme_says(tmp_path, exc, error):
    """The README: an interrupted run's manifest "error" is SIGINT / SIGTERM; a run stopped inside its block (the
    CLI's run.active(), the API's `with RunDir`) recorded "KeyboardInterrupt" and "Terminated: SIGTERM"."""
    from moetool.report import rundir

    exc = exc if exc is not None else rundir.Terminated("SIGTERM")
    with pytest.raises(KeyboardInterrupt):
        with RunDir.create("stats", tmp_path / "run") as run:
            run.write_csv("load.csv", pd.DataFrame({"layer": [0]}))
            raise exc
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (m["status"], m["error"]) == ("interrupted", error)


def test_results_at_a_glance_marks_a_run_that_did_not_complete(tmp_path, monkeypatch):
    """A stats run whose figures failed (status failed, exit 1, every table written) records its headline numbers
    before it fails: the page's first table showed them as any finished run's, the experiment cell a plain
    "stats"; it now says "stats (failed)" (HTML and Markdown), a finished run's cell stays the command."""
    from unittest import mock

    import moetool.report.plots as P

    runs = tmp_path / "runs"
    with mock.patch.object(P, "figures", side_effect=RuntimeError("no figures today")):
        r = CliRunner().invoke(app, ["stats", "--max-tokens", "2048", "--bootstrap", "0", "-q", "--device", "cpu",
                                     "--out", str(runs / "failed")])
    assert r.exit_code == 1
    m = json.loads((runs / "failed/manifest.json").read_text())
    assert m["status"] == "failed" and m["headline"]
    monkeypatch.setenv("MOETOOL_FIGURES", "none")  # the finished run: its headline is the point, not its figures
    r = CliRunner().invoke(app, ["stats", "--max-tokens", "2048", "--bootstrap", "0", "-q", "--device", "cpu",
                                 "--out", str(runs / "done")])
    assert r.exit_code == 0, r.output
    page = write_report([runs], tmp_path / "rep")
    table = re.search(r'<table class="headline">.*?</table>', page.read_text(), re.S).group(0)
    assert '<a href="#runs-failed">stats (failed)</a>' in table and '<a href="#runs-done">stats</a>' in table
    md = (tmp_path / "rep/report.md").read_text()
    assert "| [stats (failed)](#runs-failed) |" in md and "| [stats](#runs-done) | tiny |" in md


def test_page_shows_a_table_of_html_rows_whole_and_aligns_integer_columns(tmp_path):
    """A table of exactly HTML_ROWS (20) rows is shown whole ("20 rows"), one of 21 by its first 10; LaTeX
    right-aligns integer columns as numbers; a manifest count of 10,000 gets its separator."""
    from moetool.report.page import HTML_ROWS, PREVIEW_ROWS, human

    run = RunDir.create("stats", tmp_path / "run")
    for n in (HTML_ROWS, HTML_ROWS + 1):
        run.write_csv(f"t{n}.csv", pd.DataFrame({"layer": range(n), "load": np.linspace(0, 1, n)}))
    run.finish(options={"model": "tiny"})
    md = (write_report([tmp_path / "run"], tmp_path / "rep").parent / "report.md").read_text()
    assert f"*{HTML_ROWS} rows; " in md and f"*first {PREVIEW_ROWS} of {HTML_ROWS + 1} rows; every row in " in md
    assert "\\begin{tabular}{rrl}" in to_latex(pd.DataFrame({"a": [1], "b": [True], "c": ["x"]}))
    assert (human(10_000), human(9_999)) == ("10,000", "9999")


def test_run_label_of_a_fluctuation_run_names_its_checkpoints_as_a_chain():
    """``moetool fluctuation tiny-early tiny`` records ``"model": ["tiny-early", "tiny"]``: the report listed it as
    ``fluctuation · ['tiny-early', 'tiny']`` (a Python list) where the demo's step (``model`` null, ``checkpoints``
    in the options) reads ``fluctuation · tiny-early -> tiny``; both now read the same."""
    from moetool.report.page import run_label

    cli = {"command": "fluctuation", "model": ["tiny-early", "tiny"],
           "options": {"checkpoints": ["tiny-early", "tiny"], "seq_len": 256}}
    demo = {"command": "fluctuation", "model": None, "options": {"checkpoints": ["tiny-early", "tiny"]}}
    assert run_label(cli) == run_label(demo) == "fluctuation · tiny-early -> tiny"
    three = {"command": "fluctuation", "model": ["a", "b", "c"], "options": {"checkpoints": ["a", "b", "c"]}}
    assert run_label(three) == "fluctuation · a -> b -> c"
    bare = {"command": "fluctuation", "model": ["a", "b"], "options": {}}  # no options to read: the list, plainly
    assert run_label(bare) == "fluctuation · a, b"
    assert run_label({"command": "stats", "model": {"name": "tiny"}, "options": {}}) == "stats · tiny"
