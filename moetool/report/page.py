"""``moetool report``: gather run folders (of any command; a ``demo`` folder with its sub-runs included) into one
report for a paper.

``write_report(run_dirs, out)`` writes into ``out``:

- ``report.html``: one self-contained page (figures embedded as base64 PNG, no script, no external file), one
  section per run: its manifest summary (command, status, model, data, options, versions, seed, wall time, git
  revision), every figure, every table (long ones truncated with a note pointing to the CSV);
- ``report.md``: the same in Markdown, figures linked to the copies below;
- ``tables/<run>/<name>.csv`` and ``.tex`` (LaTeX ``booktabs``), ``figures/<run>/<name>.png`` and ``.pdf``;
- ``manifest.json`` (``command: report``, the runs gathered).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import MoetoolError
from .rundir import MANIFEST, RunDir, read_manifest

HTML_ROWS = 20  # rows of a table shown in the page / Markdown (the CSV and LaTeX hold every row)
TABLE_SUFFIXES = (".csv",)  # streamed tables (.csv.gz, .parquet: per-token traces) are listed, not rendered


@dataclass
class Run:
    path: Path
    name: str  # unique slug: the folder relative to the gathered root
    manifest: dict[str, Any]
    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)  # PNGs (a PDF beside each one when written)
    other: list[str] = field(default_factory=list)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


def _walk(folder: Path) -> Any:
    """Run folders under ``folder``, depth first: a run, then its sub-runs in the order its manifest lists them
    (a demo's step order), then any other sub-folders by name."""
    m = read_manifest(folder)
    if m is not None:
        yield folder
    listed = [str(r) for r in (m or {}).get("runs", [])]
    subs = sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)
    for p in sorted(subs, key=lambda p: (listed.index(p.name) if p.name in listed else len(listed), p.name)):
        if p.name != "figures":
            yield from _walk(p)


def find_runs(run_dirs: Sequence[str | Path], exclude: Path | None = None) -> list[Run]:
    """Every moetool run under the given folders (a folder holding ``manifest.json``, and its sub-runs), in
    folder order; a path that is not a run folder and holds none is an error."""
    runs: list[Run] = []
    seen: set[Path] = {Path(exclude).resolve()} if exclude is not None else set()
    for d in run_dirs:
        root = Path(d)
        if not root.is_dir():
            raise MoetoolError(f"{root}: not a folder")
        found = list(_walk(root))
        skip = lambda p: p.resolve() in seen or any(q in seen for q in p.resolve().parents)  # noqa: E731
        found = [p for p in found if read_manifest(p) is not None and not skip(p)]
        if not found:
            raise MoetoolError(f"{root}: no moetool run (no manifest.json) in it")
        for p in found:
            seen.add(p.resolve())
            m = read_manifest(p) or {}
            rel = p.relative_to(root)
            name = _slug("/".join([root.resolve().name, *rel.parts]))
            while name in {r.name for r in runs}:
                name += "_"
            run = Run(p, name, m)
            for f in m.get("files", []):
                fp = p / f
                if not fp.is_file():
                    continue
                if f.startswith("figures/") and fp.suffix == ".png":
                    run.figures.append(fp)
                elif fp.suffix in TABLE_SUFFIXES and not f.endswith(".gz"):
                    run.tables.append(fp)
                elif not f.startswith("figures/"):
                    run.other.append(f)
            runs.append(run)
    return runs


# ----- tables ---------------------------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(c, c) for c in text)


def to_latex(df: Any, caption: str = "", label: str = "") -> str:
    """A ``booktabs`` table (``\\toprule``/``\\midrule``/``\\bottomrule``), numbers right-aligned, 4 significant
    digits, NaN empty. Needs ``\\usepackage{booktabs}``."""
    align = "".join("r" if df[c].dtype.kind in "fiub" else "l" for c in df.columns)
    lines = [r"\begin{table}[t]", r"\centering", rf"\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(tex_escape(str(c)) for c in df.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(tex_escape(_cell(v)) for v in row) + r" \\" for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(rf"\caption{{{tex_escape(caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def to_markdown(df: Any, max_rows: int = HTML_ROWS) -> str:
    head = df.head(max_rows)
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(c) for c in df.columns) + " |",
             "|" + "|".join("---:" if df[c].dtype.kind in "fiub" else ":---" for c in df.columns) + "|"]
    lines += ["| " + " | ".join(esc(_cell(v)) for v in row) + " |" for row in head.itertuples(index=False)]
    return "\n".join(lines)


def to_html_table(df: Any, max_rows: int = HTML_ROWS) -> str:
    head = df.head(max_rows)
    num = [df[c].dtype.kind in "fiub" for c in df.columns]
    out = ["<table>", "<thead><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns) +
           "</tr></thead>", "<tbody>"]
    for row in head.itertuples(index=False):
        out.append("<tr>" + "".join(f'<td class="{"n" if k else "t"}">{html.escape(_cell(v))}</td>'
                                    for v, k in zip(row, num)) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


# ----- manifest summary -----------------------------------------------------------------------------------------
def summary(m: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, text)`` rows of a manifest: what a reader needs to reproduce the run."""
    rows: list[tuple[str, str]] = [("command", str(m.get("command", ""))), ("status", str(m.get("status", "")))]
    if m.get("error"):
        rows.append(("error", str(m["error"])))
    model = m.get("model")
    if isinstance(model, dict):
        rows.append(("model", ", ".join(f"{k}={model[k]}" for k in ("name", "source", "model_type", "dtype", "device")
                                        if model.get(k) is not None) or json.dumps(model)[:200]))
    elif model:
        rows.append(("model", str(model)))
    data = m.get("data")
    if isinstance(data, dict):
        rows.append(("data", ", ".join(f"{k}={data[k]}" for k in ("source", "tokens", "rows", "seq_len",
                                                                   "domains") if data.get(k) is not None)
                     or json.dumps(data)[:200]))
    elif data:
        rows.append(("data", str(data)))
    opts = m.get("options")
    if isinstance(opts, dict) and opts:
        rows.append(("options", ", ".join(f"{k}={v}" for k, v in opts.items())))
    if m.get("seed") is not None:
        rows.append(("seed", str(m["seed"])))
    if m.get("wall_seconds") is not None:
        rows.append(("wall time", f"{float(m['wall_seconds']):.1f} s (started {m.get('started', '?')})"))
    if isinstance(m.get("versions"), dict):
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in m["versions"].items())))
    git = m.get("git")
    if isinstance(git, dict) and git.get("commit"):
        rows.append(("git", git["commit"][:12] + (" (uncommitted changes)" if git.get("dirty") else "")))
    if m.get("argv"):
        rows.append(("command line", " ".join(Path(str(m["argv"][0])).name if i == 0 else str(a)
                                              for i, a in enumerate(m["argv"]))))
    return rows


def _print_width(png: bytes) -> str:
    """`` width="…"``: a PNG saved at the house dpi shown at its print size (96 CSS px per inch)."""
    from .figures import STYLE

    if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 24:
        return ""
    px = int.from_bytes(png[16:20], "big")
    return f' width="{round(px * 96 / STYLE["savefig.dpi"])}"'


def run_context(m: dict[str, Any]) -> str:
    """``"tiny · data: heldout.jsonl · 8,192 tokens"`` from a manifest (the caption of its figures)."""
    from .figures import describe_run

    model, data = m.get("model"), m.get("data")
    name = model.get("name") if isinstance(model, dict) else model
    if not name and isinstance(m.get("options"), dict):
        name = m["options"].get("model")
    src = data.get("source") if isinstance(data, dict) else None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return describe_run(name, src, tokens if isinstance(tokens, int) else None)


# ----- the report -----------------------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{font-size:1.3em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
h3{font-size:1.05em;margin-bottom:.3em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0 1em}
th,td{padding:.15em .6em;border-bottom:1px solid #e3e3e3}th{border-bottom:2px solid #888;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}
table.meta td:first-child{font-weight:600;white-space:nowrap;vertical-align:top}
table.meta td{word-break:break-word}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption,.note{color:#666;font-size:.85em}
.status-complete{color:#1a7f37}.status-failed,.status-interrupted,.status-running{color:#b35900}
nav ul{columns:2;font-size:.9em}
"""


def write_report(run_dirs: Sequence[str | Path], out: str | Path | RunDir, *, force: bool = False,
                 title: str = "moetool report") -> Path:
    """Gather ``run_dirs`` into ``out`` (a folder, or a :class:`RunDir` such as ``demo``'s ``sub("report")``);
    returns the path of ``report.html``."""
    import pandas as pd

    run = out if isinstance(out, RunDir) else RunDir.create("report", out, force)
    runs = find_runs(run_dirs, exclude=run._path)
    md = [f"# {title}", ""]
    body = [f"<h1>{html.escape(title)}</h1>", "<nav><ul>"]
    body += [f'<li><a href="#{r.name}">{html.escape(r.name)}</a> '
             f'({html.escape(str(r.manifest.get("command", "")))}, {html.escape(str(r.manifest.get("status", "?")))})'
             f"</li>" for r in runs]
    body.append("</ul></nav>")
    for r in runs:
        status = str(r.manifest.get("status", "unknown (written before moetool recorded a status)"))
        body.append(f'<h2 id="{r.name}">{html.escape(r.name)}</h2>')
        md += [f"## {r.name}", ""]
        rows = summary(r.manifest)
        body.append('<table class="meta">' + "".join(
            f'<tr><td>{html.escape(k)}</td><td class="{"status-" + status if k == "status" else ""}">'
            f"{html.escape(v)}</td></tr>" for k, v in rows) + "</table>")
        md += [f"- **{k}**: {v}" for k, v in rows] + [""]
        for png in r.figures:
            stem = png.stem
            rel = f"figures/{r.name}/{stem}"
            with run.atomic(f"{rel}.png") as tmp:
                shutil.copyfile(png, tmp)
            pdf = png.with_suffix(".pdf")
            if pdf.is_file():
                with run.atomic(f"{rel}.pdf") as tmp:
                    shutil.copyfile(pdf, tmp)
            raw = png.read_bytes()
            data = base64.b64encode(raw).decode("ascii")
            ctx = run_context(r.manifest)
            cap = f"{r.name}: {stem}" + (f" — {ctx}" if ctx else "") + (f" (PDF: {rel}.pdf)" if pdf.is_file() else "")
            body.append(f'<figure><img alt="{html.escape(stem)}"{_print_width(raw)} src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(cap)}</figcaption></figure>")
            md += [f"![{stem}]({rel}.png)", f"*{cap}*", ""]
        for csv in r.tables:
            try:
                df = pd.read_csv(csv)
            except (OSError, ValueError, pd.errors.ParserError) as e:
                body.append(f'<p class="note">{html.escape(csv.name)}: unreadable ({html.escape(str(e))})</p>')
                continue
            rel = f"tables/{r.name}/{csv.stem}"
            with run.atomic(f"{rel}.csv") as tmp:
                shutil.copyfile(csv, tmp)
            with run.atomic(f"{rel}.tex") as tmp:
                tmp.write_text(to_latex(df, caption=f"{r.name}: {csv.name}", label=f"tab:{_slug(r.name)}-{csv.stem}"))
            more = (f"first {HTML_ROWS} of {len(df)} rows; every row in {rel}.csv (LaTeX: {rel}.tex)"
                    if len(df) > HTML_ROWS else f"{len(df)} rows; {rel}.csv, LaTeX: {rel}.tex")
            body += [f"<h3>{html.escape(csv.name)}</h3>", to_html_table(df), f'<p class="note">{html.escape(more)}</p>']
            md += [f"### {csv.name}", "", to_markdown(df), "", f"*{more}*", ""]
        if r.other:
            note = "other files: " + ", ".join(r.other)
            body.append(f'<p class="note">{html.escape(note)}</p>')
            md += [f"*{note}*", ""]
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) +
            "\n</body></html>\n")
    with run.atomic("report.html") as tmp:
        tmp.write_text(page, encoding="utf-8")
    with run.atomic("report.md") as tmp:
        tmp.write_text("\n".join(md) + "\n", encoding="utf-8")
    run.add(gathered=[str(r.path) for r in runs])
    run.finish(options={"run_dirs": [str(d) for d in run_dirs], "title": title})
    return run.path / "report.html"
