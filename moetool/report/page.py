"""``moetool report``: gather run folders (of any command; a ``demo`` folder with its sub-runs included) into one
report for a paper. A report output folder inside a gathered folder (a demo's ``report/``) is not gathered again
(its figures and tables are the runs' beside it); given itself, it is gathered as a run.

``write_report(run_dirs, out)`` writes into ``out``:

- ``report.html``: one self-contained page (figures embedded as base64 PNG, no script, nothing fetched), one
  section per run: its manifest summary (command, status, model, data, options, versions, seed, wall time, git
  revision), a table of contents, every figure at its pixel size (a click opens the PNG copy, a link the PDF; the
  caption says what it shows, the definitions of what it plots and the CSVs it was drawn from), every table in its
  own horizontal scroll box (key columns first, numbers right-aligned, whitespace tokens shown as ␣ ↵; tables of
  more than :data:`HTML_ROWS` rows by their first :data:`PREVIEW_ROWS` and a link to the CSV);
- ``report.md``: the same in Markdown, figures linked to the copies below;
- ``tables/<run>/<name>.csv`` and ``.tex`` (LaTeX ``booktabs``), ``figures/<run>/<name>.png`` and ``.pdf``;
- ``manifest.json`` (``command: report``, the runs gathered, ``not_gathered``: the warnings).

Run folders are shared, so nothing in them is trusted: every text (manifest fields, file names, table cells) is
escaped for the format it is written in (HTML, Markdown, LaTeX; labels and copied file names are slugs), only files
that resolve inside their run folder are read (a manifest entry ``../x``, ``/etc/passwd``, ``figures/../../x.png``
or a symbolic link out of the run is refused with a ``warning:`` line and a note in the page), and no symbolic link
to a folder is followed (``latest -> .`` would gather a run again and again).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import MoetoolError, shown
from ..experiments.result import column_definition  # noqa: F401 - the report page's tooltips
from ..files import table_problem
from .figures import trace_marker
from .rundir import MANIFEST, RunDir, manifest_problem, read_manifest

HTML_ROWS = 20  # a table of up to this many rows is shown whole in the page / Markdown
PREVIEW_ROWS = 10  # a longer one (erc_matrix: 4,096 rows) by its first rows and a link to the CSV; the CSV and
# LaTeX copies hold every row
TABLE_SUFFIXES = (".csv",)  # streamed tables (.csv.gz, .parquet: per-token traces) are listed, not rendered


@dataclass
class Run:
    path: Path
    name: str  # unique slug: the folder relative to the gathered root
    manifest: dict[str, Any]
    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)  # PNGs (a PDF beside each one when written)
    other: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # manifest entries that point outside the run folder
    missing: list[str] = field(default_factory=list)  # files its manifest lists that are not in the folder (deleted)
    rel: str = ""  # the folder relative to the gathered root ("stats/tiny"), what the index shows beside the label

    @property
    def label(self) -> str:
        """What tells this run from the others: ``"stats · tiny"`` (command and model, checkpoints or models)."""
        return run_label(self.manifest)

    @property
    def has_content(self) -> bool:
        """Figures or tables of its own (or files it wrote, now missing), or not complete (a parent holding sub-runs
        only has neither)."""
        return (bool(self.figures or self.tables or self.other or self.missing)
                or self.manifest.get("status") != "complete")

    def inside(self, rel: Any) -> Path | None:
        """``rel`` (a manifest entry) as a path in this run folder, or ``None`` when it is not a relative path
        whose every symbolic link resolves inside the folder (``../x``, ``/etc/passwd``, ``figures/../../x.png``,
        a link to elsewhere)."""
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            return None
        root = self.path.resolve()
        try:
            fp = (self.path / rel).resolve()
        except (OSError, RuntimeError, ValueError):  # a symlink loop
            return None
        return fp if fp != root and fp.is_relative_to(root) else None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _walk(folder: Path, warn: Callable[[str], None], visited: set[Path], top: bool = True) -> Any:
    """Run folders under ``folder``, depth first: a run, then its sub-runs in the order its manifest lists them
    (a demo's step order), then any other sub-folders by name; a sub-folder written by ``report`` (its
    manifest's command; a demo's ``report/``) is not a run of its own: it is gathered only when given. Symbolic links to folders are not followed (a
    ``latest -> .`` link would gather a run again and again; a link out of the run would gather another's)."""
    real = folder.resolve()
    if real in visited:
        return
    visited.add(real)
    m = read_manifest(folder)
    if m is not None and not top and m.get("command") == "report":
        return  # a report's output (a demo's report/) holds the runs beside it again: gathered only when given
    if m is not None:
        yield folder
    elif (folder / MANIFEST).is_file() and not top:  # an unreadable sub-run is said, not skipped in silence
        warn(f"{folder}: {manifest_problem(folder)}: not gathered")
    listed = [str(r) for r in (m or {}).get("runs", [])]
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as e:
        warn(f"{folder}: not read ({e.strerror or e})")
        return
    subs = []
    for p in entries:
        if p.name.startswith(".") or p.name == "figures":
            continue
        if p.is_symlink():
            if p.is_dir():
                warn(f"{p}: a symbolic link to a folder, not followed")
            continue
        if p.is_dir():
            subs.append(p)
    for p in sorted(subs, key=lambda p: (listed.index(p.name) if p.name in listed else len(listed), p.name)):
        yield from _walk(p, warn, visited, top=False)


def find_runs(run_dirs: Sequence[str | Path], exclude: Path | None = None,
              warn: Callable[[str], None] = _warn) -> list[Run]:
    """Every moetool run under the given folders (a folder holding ``manifest.json``, and its sub-runs), in
    folder order; a path that is not a run folder and holds none is an error. Only files that resolve inside
    their run folder are gathered: any other entry of a manifest's ``files`` is refused (``warn`` gets one line,
    the run's :attr:`Run.refused` lists it)."""
    runs: list[Run] = []
    seen: set[Path] = {Path(exclude).resolve()} if exclude is not None else set()
    given: dict[Path, Path] = {}
    for d in run_dirs:
        root = Path(d)
        if not root.is_dir():
            raise MoetoolError(f"{root}: not a folder")
        if root.resolve() in given:  # `report RUN RUN`: gathered once
            warn(f"{root}: given twice (as {given[root.resolve()]}), gathered once")
            continue
        given[root.resolve()] = root
        problem = manifest_problem(root)
        found = list(_walk(root, warn, set()))
        skip = lambda p: p.resolve() in seen or any(q in seen for q in p.resolve().parents)  # noqa: E731
        found = [p for p in found if read_manifest(p) is not None]
        if not found and problem and problem != f"no {MANIFEST}":  # the run itself is unreadable: say why
            raise MoetoolError(f"{root}: {problem}")
        if not found:
            raise MoetoolError(f"{root}: no moetool run (no manifest.json) in it")
        if problem and problem != f"no {MANIFEST}":
            warn(f"{root}: {problem}: not gathered (its sub-runs are)")
        if all(skip(p) for p in found):
            warn(f"{root}: already gathered with a folder given before it")
            continue
        found = [p for p in found if not skip(p)]
        for p in found:
            seen.add(p.resolve())
            m = read_manifest(p) or {}
            rel = p.relative_to(root)
            name = _slug("/".join([root.resolve().name, *rel.parts]))
            while name in {r.name for r in runs}:
                name += "_"
            shown = "/".join([root.resolve().name, *rel.parts] if len(run_dirs) > 1 or not rel.parts else rel.parts)
            run = Run(p, name, m, rel=shown)
            if (p / MANIFEST).is_symlink():  # its files would be read relative to another folder's manifest
                warn(f"{p / MANIFEST}: a symbolic link, run not gathered")
                continue
            real = p.resolve()
            for f in m.get("files", []):
                fp = run.inside(f)
                if fp is None:
                    run.refused.append(str(f))
                    warn(f"{p}: manifest lists {str(f)!r}, outside the run folder: not read")
                    continue
                if not fp.exists():  # the run wrote it: said on the page, never dropped in silence
                    run.missing.append(fp.relative_to(real).as_posix())
                    continue
                if not fp.is_file():
                    continue
                f = fp.relative_to(real).as_posix()
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
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
        ">": r"\textgreater{}", "|": r"\textbar{}", "\n": " ", "\r": " "}


def tex_escape(text: str) -> str:
    """``text`` as LaTeX prints it: every special character escaped (no command, group or line break from data)."""
    return "".join(_TEX.get(c, c) for c in str(text))


_MD = set("\\`*_[]|~#")  # with [ ] escaped no link or image can form: ( ) ! stay as they are


def md_escape(text: Any) -> str:
    """``text`` as Markdown prints it on one line: HTML (``<script>``) and Markdown syntax (links, images,
    emphasis, table bars) escaped, line breaks as ``↵``."""
    t = html.escape(str(text), quote=False).replace("\r\n", "\n").replace("\n", "↵").replace("\r", "↵")
    return "".join("\\" + c if c in _MD else c for c in t)


_TEX_VISIBLE = {" ": r"\textvisiblespace{}", "\n": r"$\hookleftarrow$", "\r": r"$\hookleftarrow$",
                "\t": r"$\rightarrowtail$"}


def _tex_cell(v: Any, column: Any) -> str:
    if isinstance(v, str) and _is_token(column):  # a whitespace token stays visible in print too
        return "".join(_TEX_VISIBLE.get(c) or tex_escape(c) for c in v)
    return tex_escape(_cell(v))


def to_latex(df: Any, caption: str = "", label: str = "") -> str:
    """A ``booktabs`` table (``\\toprule``/``\\midrule``/``\\bottomrule``), numbers right-aligned, 4 significant
    digits, NaN empty. Needs ``\\usepackage{booktabs}``."""
    align = "".join("r" if df[c].dtype.kind in "fiub" else "l" for c in df.columns)
    lines = [r"\begin{table}[t]", r"\centering", rf"\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(tex_escape(str(c)) for c in df.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex_cell(v, c) for v, c in zip(row, df.columns)) + r" \\"
              for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(rf"\caption{{{tex_escape(caption)}}}")
    if label:
        lines.append(rf"\label{{{re.sub(r'[^A-Za-z0-9:._-]+', '-', label)}}}")  # a label takes no escapes
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


#: identifying columns, shown first in the page in this order (what is compared, then where in the model, then
#: the swept setting): a row is read from its key; ``reference`` before ``checkpoint``, as the tables, the console and
#: the headline ("tiny-early -> tiny") read a pair
KEY_COLUMNS = ("model", "reference", "checkpoint", "task", "metric", "policy", "routing", "selector", "method",
               "node", "norm", "view", "domain", "layer", "next_layer", "expert", "a", "b", "i", "j", "rank",
               "token_id", "token", "pair", "codebook", "codebook_size", "centroids", "capacity", "shortlist_size",
               "alpha")


def key_first(df: Any) -> Any:
    """``df`` with its key columns (:data:`KEY_COLUMNS`, in that order) first, every other column after them in
    the table's order."""
    keys = sorted((c for c in df.columns if str(c) in KEY_COLUMNS), key=lambda c: KEY_COLUMNS.index(str(c)))
    return df[keys + [c for c in df.columns if c not in keys]] if keys else df


def _is_token(column: Any) -> bool:
    """A column of token text (``token``): every space and newline in it is shown (numeric ``token_id`` /
    ``tokens`` columns never reach the text path)."""
    return "token" in str(column).lower()


_VISIBLE = {" ": "␣", "\n": "↵", "\r": "␍", "\t": "⇥"}


def visible(text: str, every_space: bool = True) -> str:
    """Whitespace shown: ``" the"`` -> ``"␣the"``, a newline token -> ``"↵"``; ``every_space=False`` marks only
    leading and trailing spaces (and every newline / tab), for text that is not a token."""
    if every_space:
        return "".join(_VISIBLE.get(c, c) for c in text)
    core = text.strip(" ")
    if not core:
        return "␣" * len(text)
    lead, trail = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    return "␣" * lead + "".join(_VISIBLE.get(c, c) if c != " " else c for c in core) + "␣" * trail


def _shown(v: Any, column: Any) -> str:
    return _cell(v) if not isinstance(v, str) else visible(v, every_space=_is_token(column))


def to_markdown(df: Any, max_rows: int = HTML_ROWS) -> str:
    """A Markdown table of the first ``max_rows`` rows, every cell escaped (:func:`md_escape`), whitespace
    tokens visible."""
    head = df.head(max_rows)
    lines = ["| " + " | ".join(md_escape(c) for c in df.columns) + " |",
             "|" + "|".join("---:" if df[c].dtype.kind in "fiub" else ":---" for c in df.columns) + "|"]
    lines += ["| " + " | ".join(md_escape(_shown(v, c)) for v, c in zip(row, df.columns)) + " |"
              for row in head.itertuples(index=False)]
    return "\n".join(lines)


def to_html_table(df: Any, max_rows: int = HTML_ROWS, definitions: Any = None, table: str = "") -> str:
    """The first ``max_rows`` rows in a horizontal scroll box of their own: numbers right-aligned, the first
    column kept in view while scrolling, each header's definition as its tooltip, whitespace tokens visible."""
    head = df.head(max_rows)
    num = [df[c].dtype.kind in "fiub" for c in df.columns]

    def th(c: Any, k: bool) -> str:
        d = column_definition(definitions, table, c)
        tip = f' title="{html.escape(d)}"' if d else ""
        return f'<th class="{"n" if k else "t"}"{tip}>{html.escape(str(c))}</th>'

    out = ['<div class="scroll"><table>', "<thead><tr>" + "".join(th(c, k) for c, k in zip(df.columns, num)) +
           "</tr></thead>", "<tbody>"]
    for row in head.itertuples(index=False):
        out.append("<tr>" + "".join(f'<td class="{"n" if k else "t"}">{html.escape(_shown(v, c))}</td>'
                                    for v, c, k in zip(row, df.columns, num)) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)


# ----- manifest summary -----------------------------------------------------------------------------------------
def human(v: Any, run: Path | None = None) -> str:
    """A manifest value as a reader writes it: a list ``tiny, tiny-fine`` (a pair ``tiny-early -> tiny``), a dtype
    ``float32`` (not ``torch.float32``), ``none`` for null, an absolute path relative to the run folder or to the
    installed package (``moetool/embedded/tiny``), a large count with thousands separators."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(f"({human(x, run)})" if isinstance(x, (list, tuple)) else human(x, run) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k}={human(x, run)}" for k, x in v.items())
    text = str(v)
    if text.startswith("torch.") and text[6:].replace("_", "").isalnum():
        return text[6:]  # torch.float32 -> float32
    return shown_path(text, run)


def shown_path(text: str, run: Path | None = None) -> str:
    """An absolute path inside the run folder or the installed moetool package, relative to it (the package's as
    ``moetool/...``); any other text as it is."""
    if not text.startswith("/") or "\n" in text:
        return text
    p = Path(text)
    package = Path(__file__).resolve().parents[1]
    for base, prefix in ((run, ""), (package, "moetool/")):
        if base is None:
            continue
        try:
            return prefix + (p.resolve().relative_to(Path(base).resolve()).as_posix() or ".")
        except (ValueError, OSError, RuntimeError):
            continue
    return text


def run_label(m: dict[str, Any]) -> str:
    """``"stats · tiny"``: the command and what it ran on (the model, the models of a demo step, the checkpoint
    pairs ``tiny-early -> tiny``; ``"stats · tiny (trace)"`` for a ``--trace`` analysis of the routing of tiny
    recorded by ``moetool trace``), what tells runs of one report apart."""
    cmd = str(m.get("command", "?"))
    model, opts = m.get("model"), m.get("options") if isinstance(m.get("options"), dict) else {}
    who = model.get("name") if isinstance(model, dict) else model
    listed = who if isinstance(who, (list, tuple)) else None  # `moetool fluctuation A B` records its checkpoints
    who = None if listed is not None else who or opts.get("model")  # (never shown as a Python list)
    if not who and isinstance(opts.get("pairs") or opts.get("checkpoints"), (list, tuple)):
        items = opts.get("pairs") or [opts["checkpoints"]]
        who = ", ".join(" -> ".join(map(str, p)) if isinstance(p, (list, tuple)) else str(p) for p in items)
    if not who and isinstance(opts.get("models"), (list, tuple)):
        who = ", ".join(map(str, opts["models"]))
    marker = trace_marker(m)  # a --trace analysis: the model whose routing it read, marked as read from a trace
    if not who and listed:  # (fluctuation's traces, compared in their order as its checkpoints are)
        who = (" -> " if marker else ", ").join(map(str, listed))
    return f"{cmd} · {who}{marker}" if who else cmd


def summary(m: dict[str, Any], run: Path | None = None) -> list[tuple[str, str]]:
    """``(field, text)`` rows of a manifest: what a reader needs to reproduce the run, in human values
    (:func:`human`; paths relative to the run folder ``run`` or the package)."""
    rows: list[tuple[str, str]] = [("command", str(m.get("command", ""))), ("status", str(m.get("status", "")))]
    if m.get("error"):
        rows.append(("error", str(m["error"])))
    model = m.get("model")
    if isinstance(model, dict):
        rows.append(("model", ", ".join(f"{k}={human(model[k], run)}" for k in ("name", "source", "model_type",
                                                                                 "dtype", "device")
                                        if model.get(k) is not None) or json.dumps(model)[:200]))
    elif model:
        rows.append(("model", human(model, run)))
    data = m.get("data")
    if isinstance(data, dict):
        rows.append(("data", ", ".join(f"{k}={human(data[k], run)}" for k in ("source", "tokens", "rows", "seq_len",
                                                                               "domains") if data.get(k) is not None)
                     or json.dumps(data)[:200]))
    elif data:
        rows.append(("data", human(data, run)))
    note = interval_note(m)
    if note:
        rows.append(("intervals", note))
    opts = m.get("options")
    if isinstance(opts, dict) and opts:
        rows.append(("options", "; ".join(f"{k}={human(v, run)}" for k, v in opts.items())))
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
        rows.append(("command line", " ".join(Path(str(m["argv"][0])).name if i == 0 else shown_path(str(a), run)
                                              for i, a in enumerate(m["argv"]))))
    return rows


def interval_note(m: dict[str, Any]) -> str | None:
    """The manifest's ``bootstrap`` ``note`` (its intervals come from too few rows to be 95% intervals:
    :func:`moetool.uncertainty.few_rows_note`), or ``None``."""
    boot = m.get("bootstrap")
    note = boot.get("note") if isinstance(boot, dict) else None
    return str(note) if note else None


def png_size(png: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels of a PNG (from its header), or ``None`` when it is not one."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 24:
        return None
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def figure_caption(stem: str, m: dict[str, Any]) -> tuple[str, str, list[str]]:
    """``(what the figure shows, the definitions of what it plots, the tables it is drawn from)`` for figure
    ``stem`` of a run with manifest ``m`` (:data:`moetool.report.plots.FIGURE_CAPTIONS`, the definitions the
    run's CSVs carry); an unknown figure is ``(stem, "", [])``."""
    from .plots import FIGURE_CAPTIONS

    info = FIGURE_CAPTIONS.get(stem)
    if info is None:
        return stem, "", []
    shows, tables, keys = info
    defs = m.get("definitions") if isinstance(m.get("definitions"), dict) else {}
    said = "; ".join(f"{k}: {defs[k]}" for k in keys if isinstance(defs.get(k), str))
    return shows, said, list(tables)


def run_context(m: dict[str, Any]) -> str:
    """``"tiny · data: heldout.jsonl · 8,192 tokens"`` from a manifest (the caption of its figures)."""
    from .figures import describe_run

    model, data = m.get("model"), m.get("data")
    name = model.get("name") if isinstance(model, dict) else model
    if not name and isinstance(m.get("options"), dict):
        name = m["options"].get("model")
    if name and not isinstance(name, (list, tuple)):
        name = f"{name}{trace_marker(m)}"
    src = data.get("source") if isinstance(data, dict) else None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return describe_run(name, src, tokens if isinstance(tokens, int) else None)


# ----- the report -----------------------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;max-width:1400px;margin:1.5em auto;
padding:0 1.5em;color:#222;line-height:1.4}
h1{font-size:1.6em}h2{font-size:1.3em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2.5em}
h3{font-size:1.05em;margin:1.5em 0 .3em}
p,figcaption,ul{max-width:75em}
.scroll{overflow-x:auto;max-width:100%;margin:.4em 0 .6em}
table{border-collapse:collapse;font-size:.85em}
th,td{padding:.15em .6em;border-bottom:1px solid #e3e3e3;white-space:nowrap}
th{border-bottom:2px solid #888;text-align:left;background:#fff}
th.n,td.n{text-align:right;font-variant-numeric:tabular-nums}
.scroll th:first-child,.scroll td:first-child{position:sticky;left:0;background:#fff}
table.meta{margin:.5em 0 1em}table.meta td{white-space:normal;word-break:break-word;vertical-align:top}
table.meta td:first-child{font-weight:600;white-space:nowrap}
table.headline td{white-space:normal;vertical-align:top}table.headline td:last-child{min-width:40em}
figure{margin:1.2em -1.5em 1.8em}figure img{display:block;max-width:none;margin:0 auto}
figcaption{padding:0 1.5em}
figcaption,.note,.def{color:#555;font-size:.85em}figcaption b{color:#222}
.warn{color:#b35900;font-size:.9em}
.status-complete{color:#1a7f37}.status-failed,.status-interrupted,.status-running,.status-other{color:#b35900}
nav.runs ul{columns:2;font-size:.9em}nav.toc{font-size:.9em;margin:.5em 0 1em}nav.toc ul{margin:.2em 0}
"""
STATUSES = ("complete", "failed", "interrupted", "running")


def _unique(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _index(title: str, runs: list[Run], warnings: list[str], body: list[str], md: list[str]) -> None:
    """The title, the list of runs and what was not gathered."""
    md += [f"# {md_escape(title)}", ""]
    body.append(f"<h1>{html.escape(title)}</h1>")
    _headlines(runs, body, md)
    listed = [r for r in runs if r.has_content]  # a parent holding only sub-runs is not an entry of its own
    body += ["<h2>runs</h2>", '<nav class="runs"><ul>']
    body += [f'<li><a href="#{r.name}">{html.escape(r.label)}</a> <span class="note">{html.escape(r.rel)}'
             + (f", {html.escape(str(r.manifest.get('status', '?')))}" if r.manifest.get("status") != "complete"
                else "") + "</span></li>" for r in listed]
    body.append("</ul></nav>")
    md += ["## runs", ""] + [f"- {md_escape(r.label)} ({md_escape(r.rel)})" for r in listed] + [""]
    if warnings:
        body += ['<p class="warn">not gathered:</p><ul class="warn">'] + \
                [f"<li>{html.escape(w)}</li>" for w in warnings] + ["</ul>"]
        md += ["**not gathered:**", ""] + [f"- {md_escape(w)}" for w in warnings] + [""]


def _unfinished(m: dict[str, Any]) -> str:
    """`` (running)`` / `` (failed)`` / ... after a run's name where its manifest ``m`` does not say complete: its
    numbers are not a finished run's (a run still going, one whose figures failed after it recorded its headline,
    or one killed before it could record why)."""
    status = m.get("status")
    return "" if status == "complete" else f" ({status or 'status unknown'})"


#: options of a manifest that say how a run was made, not what it measured (the model is the row's own column)
NOT_SETTINGS = frozenset({"model", "out", "force", "resume", "quiet"})


def differing_settings(manifests: list[dict[str, Any]]) -> list[str]:
    """Per manifest, ``"seq_len=16, dtype=bfloat16"``: its options (``options`` of the manifest, but
    :data:`NOT_SETTINGS`) whose values differ among the manifests of the same command -- two runs of one
    experiment side by side whose numbers were measured on other data, sequence lengths, precisions or
    options say so; ``""`` where they agree, where the command has one run, and for a run that recorded no
    options (one that failed before it could: nothing to compare). An option is compared among the runs that
    record it, and named only for them: a run that does not record it (a demo step records no ``dtype``) says
    nothing of it, not ``dtype=none``; a run's data is the text it read (its manifest's ``data.source``)."""
    def opts(m: dict[str, Any]) -> dict[str, Any] | None:
        o = m.get("options")
        if not isinstance(o, dict) or not o:
            return None
        o = {k: v for k, v in o.items() if k not in NOT_SETTINGS}
        data = m.get("data")  # --data left out: the text the run read (the shipped one), as a path given names it
        if o.get("data") is None and isinstance(data, dict) and isinstance(data.get("source"), str):
            o["data"] = data["source"]
        return o

    given = [opts(m) for m in manifests]
    by_command: dict[str, list[dict[str, Any]]] = {}
    for m, o in zip(manifests, given):
        if o is not None:
            by_command.setdefault(str(m.get("command", "")), []).append(o)
    out = []
    for m, own in zip(manifests, given):
        if own is None:
            out.append("")
            continue
        group = by_command[str(m.get("command", ""))]
        keys = list(dict.fromkeys(k for o in group for k in o))  # in the order the runs record them
        keys = [k for k in keys if k in own and len({json.dumps(o[k], sort_keys=True, default=str)
                                                      for o in group if k in o}) > 1]
        out.append(", ".join(f"{k}={human(own[k])}" for k in keys))
    return out


def _headlines(runs: list[Run], body: list[str], md: list[str]) -> None:
    """The page's first table: each run's headline numbers (its manifest's ``headline``, the lines its
    experiment prints, intervals where it gives them), linking to the run's section, the experiment marked with
    the run's status when it did not complete (:func:`_unfinished`); a demo folder written before
    runs recorded them falls back on the demo's step summaries. Nothing when no run has any."""
    rows = [(r.name, str(r.manifest.get("command", "")) + _unfinished(r.manifest), r.label.partition(" · ")[2],
             list(r.manifest["headline"]) + [f"note: {n}" for n in [interval_note(r.manifest)] if n], r.manifest)
            for r in runs if isinstance(r.manifest.get("headline"), list) and r.manifest["headline"]]
    if not rows:
        by_path = {r.path.resolve(): r for r in runs}
        for r in runs:
            for step in r.manifest.get("steps") or []:
                if not isinstance(step, dict) or not step.get("summary"):
                    continue
                target = next((by_path[Path(f).resolve()] for f in step.get("folders") or []
                               if Path(f).resolve() in by_path), r)
                rows.append((target.name, str(step.get("step", "")) + _unfinished(target.manifest),
                             target.label.partition(" · ")[2],
                             [str(x) for x in step["summary"]], target.manifest))
    if not rows:
        return
    settings = differing_settings([m for *_, m in rows])
    rows = [(name, cmd, " · ".join(x for x in (who, said) if x), lines)
            for (name, cmd, who, lines, _), said in zip(rows, settings)]
    who_head = "model · options that differ from its other runs"
    body += ['<h2 id="results">results at a glance</h2>', '<div class="scroll"><table class="headline">',
             f"<thead><tr><th>experiment</th><th>{who_head}</th><th>headline numbers (± the 95% interval where the "
             "experiment gives one)</th></tr></thead><tbody>"]
    body += [f'<tr><td><a href="#{name}">{html.escape(cmd)}</a></td><td>{html.escape(who)}</td><td>'
             + "<br>".join(html.escape(line) for line in lines) + "</td></tr>" for name, cmd, who, lines in rows]
    body.append("</tbody></table></div>")
    md += ["## results at a glance", "", f"| experiment | {who_head} | headline numbers |", "|:---|:---|:---|"]
    md += [f"| [{md_escape(cmd)}](#{name}) | {md_escape(who)} | " + "<br>".join(md_escape(x) for x in lines) + " |"
           for name, cmd, who, lines in rows]
    md.append("")


def _run_header(r: Run, body: list[str], md: list[str]) -> None:
    """A run's heading, its manifest summary and the files it lists outside its folder."""
    status = str(r.manifest.get("status", "unknown (written before moetool recorded a status)"))
    css = "status-" + (status if status in STATUSES else "other")
    body.append(f'<h2 id="{r.name}">{html.escape(r.label)} <span class="note">{html.escape(r.rel)}</span></h2>')
    md += [f"## {md_escape(r.label)} ({md_escape(r.rel)})", ""]
    rows = summary(r.manifest, r.path)
    body.append('<table class="meta">' + "".join(
        f'<tr><td>{html.escape(k)}</td><td class="{css if k == "status" else ""}">'
        f"{html.escape(v)}</td></tr>" for k, v in rows) + "</table>")
    md += [f"- **{md_escape(k)}**: {md_escape(v)}" for k, v in rows] + [""]
    if r.refused:
        note = "files listed in the manifest outside the run folder, not read: " + ", ".join(r.refused)
        body.append(f'<p class="warn">{html.escape(note)}</p>')
        md += [f"*{md_escape(note)}*", ""]
    if r.missing:
        note = ("files the run wrote, missing from its folder (deleted or not copied?), not shown: "
                + ", ".join(r.missing))
        body.append(f'<p class="warn">{html.escape(note)}</p>')
        md += [f"*{md_escape(note)}*", ""]


def _copy_figures(run: RunDir, r: Run) -> list[tuple[Path, str, str, bool]]:
    """``(png, stem, rel, has_pdf)`` of each figure of ``r``, copied to ``rel.png`` (and ``rel.pdf``) under
    ``figures/<run>/`` with a safe, unique stem."""
    taken: set[str] = set()
    figs = []
    for png in r.figures:
        stem = _unique(_slug(png.stem), taken)
        rel = f"figures/{r.name}/{stem}"
        with run.atomic(f"{rel}.png") as tmp:
            shutil.copyfile(png, tmp)
        pdf = png.with_suffix(".pdf")
        has_pdf = pdf.is_file() and not pdf.is_symlink()
        if has_pdf:
            with run.atomic(f"{rel}.pdf") as tmp:
                shutil.copyfile(pdf, tmp)
        figs.append((png, stem, rel, has_pdf))
    return figs


def _cut_short(csv: Path) -> bool:
    """True when ``csv`` is not empty and its last byte is not a line break: a run's tables are written whole
    (pandas ends every row with one), so the file was cut (a copy or a sync interrupted)."""
    with open(csv, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return False
        fh.seek(-1, 2)
        return fh.read(1) not in (b"\n", b"\r")


def _read_tables(r: Run) -> list[tuple[Path, str, Any, str]]:
    """``(csv, stem, table or None, why not)`` of each table of ``r`` (stems safe and unique for
    ``tables/<run>/<stem>.csv``; key columns first). A table that is not the one the run wrote (cut short, or
    rows, bytes or sha256 other than its manifest records: :func:`~moetool.files.table_problem`) is
    ``None`` with the reason: the page says it in place of numbers that are not the run's."""
    import pandas as pd

    tables, taken = [], set()
    for csv in r.tables:
        stem = _unique(_slug(csv.stem), taken)
        try:  # text as written ("NA", "null" and "nan" are tokens): only an empty cell is missing
            if _cut_short(csv):  # its last row would be read as a row: 25 for 256, blanks for numbers
                raise ValueError("cut short: its last line ends without a line break (every table a run writes "
                                 "ends with one); a truncated copy?")
            df = pd.read_csv(csv, keep_default_na=False, na_values=[""])
        except (OSError, ValueError, pd.errors.ParserError) as e:
            tables.append((csv, stem, None, f"unreadable ({e})"))
            continue
        problem = table_problem(csv, len(df), folder=r.path, manifest=r.manifest)
        if problem:  # whole rows lost at a line break, or values edited: read cleanly, but not the run's numbers
            tables.append((csv, stem, None, f"not shown (it {problem})"))
            continue
        tables.append((csv, stem, key_first(df), ""))
    return tables


def _toc(r: Run, figs: list[tuple[Path, str, str, bool]], tables: list[tuple[Path, str, Any, str]]) -> list[str]:
    """The run's table of contents (none without figures or tables)."""
    rows_of = lambda df: f" ({len(df):,} row{'s' if len(df) != 1 else ''})" if df is not None else ""  # noqa: E731
    toc = [("figures", [(f"{r.name}--fig-{stem}", stem, "") for _, stem, _, _ in figs]),
           ("tables", [(f"{r.name}--tab-{stem}", csv.name, rows_of(df)) for csv, stem, df, _ in tables])]
    toc = [f"<li>{what}: " + ", ".join(f'<a href="#{a}">{html.escape(t)}</a>{n}' for a, t, n in items) + "</li>"
           for what, items in toc if items]
    return ['<nav class="toc"><b>contents</b><ul>' + "".join(toc) + "</ul></nav>"] if toc else []


def _figure(r: Run, fig: tuple[Path, str, str, bool], table_stem: dict[str, str], ctx: str, body: list[str],
            md: list[str]) -> None:
    """A figure embedded at its pixel size, with its caption: what it shows, the definitions of what it plots,
    the tables it was drawn from (``table_stem``: their copies' stems) and the run (``ctx``)."""
    png, stem, rel, has_pdf = fig
    raw = png.read_bytes()
    size = png_size(raw)
    dims = f' width="{size[0]}" height="{size[1]}"' if size else ""
    shows, said, data = figure_caption(png.stem, r.manifest)
    srcs = [f"tables/{r.name}/{table_stem[t]}.csv" for t in data if t in table_stem]
    data64 = base64.b64encode(raw).decode("ascii")
    text = [f": {shows}." if shows != png.stem else "", f" {said}." if said else ""]
    run_ctx = f" Run: {ctx}." if ctx else ""
    cap_html = (f"<b>{html.escape(png.stem)}</b>" + html.escape("".join(text)) +
                (" Data: " + ", ".join(f'<a href="{s}">{s}</a>' for s in srcs) + "." if srcs else "") +
                html.escape(run_ctx) + f' <a href="{rel}.png">full size</a>' +
                (f' · <a href="{rel}.pdf">PDF</a>' if has_pdf else ""))
    body.append(f'<figure id="{r.name}--fig-{stem}"><div class="scroll"><a href="{html.escape(rel)}.png" '
                f'title="open at full size"><img alt="{html.escape(png.stem)}"{dims} '
                f'src="data:image/png;base64,{data64}"></a></div><figcaption>{cap_html}</figcaption></figure>')
    cap_md = (f"**{md_escape(png.stem)}**" + md_escape("".join(text)) +
              (" Data: " + ", ".join(f"[{s}]({s})" for s in srcs) + "." if srcs else "") +
              md_escape(run_ctx) + (f" PDF: [{rel}.pdf]({rel}.pdf)" if has_pdf else ""))
    md += [f"![{md_escape(png.stem)}]({rel}.png)", "", cap_md, ""]


def _table(run: RunDir, r: Run, table: tuple[Path, str, Any, str], defs: dict[str, Any], body: list[str],
           md: list[str]) -> None:
    """A table copied as CSV and LaTeX under ``tables/<run>/`` and shown (a long one by its first rows), with
    its definition; an unreadable one, or one that is not the run's (:func:`_read_tables`), as a note."""
    csv, stem, df, err = table
    if df is None:
        body.append(f'<p class="note" id="{r.name}--tab-{stem}">{html.escape(csv.name)}: {html.escape(err)}</p>')
        md += [f"*{md_escape(csv.name)}: {md_escape(err)}*", ""]
        return
    rel = f"tables/{r.name}/{stem}"
    with run.atomic(f"{rel}.csv", rows=len(df)) as tmp:  # the copy is the run's table: its record as any table's
        shutil.copyfile(csv, tmp)
    with run.atomic(f"{rel}.tex") as tmp:
        tmp.write_text(to_latex(df, caption=f"{r.name}: {csv.name}", label=f"tab:{r.name}-{stem}"))
    shown = len(df) if len(df) <= HTML_ROWS else PREVIEW_ROWS
    what = defs.get(csv.stem) if isinstance(defs.get(csv.stem), str) else ""
    more = (f"first {shown} of {len(df):,} rows; every row in " if len(df) > shown else f"{len(df)} rows; ")
    body += [f'<h3 id="{r.name}--tab-{stem}">{html.escape(csv.name)}</h3>']
    body += [f'<p class="def">{html.escape(what)}</p>'] if what else []
    body += [to_html_table(df, shown, defs, csv.stem),
             f'<p class="note">{html.escape(more)}<a href="{rel}.csv">{html.escape(rel)}.csv</a> '
             f'(LaTeX: <a href="{rel}.tex">{html.escape(rel)}.tex</a>)</p>']
    md += [f"### {md_escape(csv.name)}", ""] + ([md_escape(what), ""] if what else [])
    md += [to_markdown(df, shown), "", f"*{md_escape(more)}[{rel}.csv]({rel}.csv) (LaTeX: {rel}.tex)*", ""]


def _run_section(run: RunDir, r: Run, body: list[str], md: list[str]) -> None:
    """One run: its header, then its files copied (names made safe and unique), then its contents, figures,
    tables and other files."""
    defs = r.manifest.get("definitions") if isinstance(r.manifest.get("definitions"), dict) else {}
    _run_header(r, body, md)
    figs = _copy_figures(run, r)
    tables = _read_tables(r)
    body += _toc(r, figs, tables)
    ctx = run_context(r.manifest)
    table_stem = {csv.name: stem for csv, stem, df, _ in tables if df is not None}
    for fig in figs:
        _figure(r, fig, table_stem, ctx, body, md)
    for table in tables:
        _table(run, r, table, defs, body, md)
    if r.other:
        note = "other files: " + ", ".join(r.other)
        body.append(f'<p class="note">{html.escape(note)}</p>')
        md += [f"*{md_escape(note)}*", ""]


def refuse_out_over_runs(out: str | Path | None, run_dirs: Sequence[str | Path]) -> None:
    """An ``out`` that is one of ``run_dirs``, contains one, or lies inside a run folder among them (one with a
    manifest: a RUN_DIR or a run under it; a plain folder of runs may hold the report): one line, before anything is
    touched -- ``--force`` would remove a run's own results, and a report inside a run becomes a sub-run of it.
    Paths resolved (links followed); ``None`` (a new folder under ``runs/``) passes, ``''`` is refused."""
    from .rundir import refuse_empty_out

    refuse_empty_out(out, "report")
    if out is None:
        return
    target = Path(out).resolve()
    for d in run_dirs:
        root = Path(d).resolve()
        if target == root or target in root.parents:
            how = "is" if target == root else "contains"
            raise MoetoolError(f"--out {out} {how} the folder {d} it gathers: write the report elsewhere")
        inside = [a for a in target.parents if a == root or root in a.parents]  # empty: not inside this RUN_DIR
        run = next((a for a in inside if (a / MANIFEST).is_file()), None)
        if run is not None:
            raise MoetoolError(f"--out {out} lies inside the run folder {Path(d) / run.relative_to(root)} it "
                               "gathers: write the report elsewhere")


def write_report(run_dirs: Sequence[str | Path], out: str | Path | RunDir | None, *, force: bool = False,
                 title: str = "moetool report", warn: Callable[[str], None] = _warn) -> Path:
    """Gather ``run_dirs`` into ``out`` (a folder, or a :class:`RunDir` such as ``demo``'s ``sub("report")``);
    returns the path of ``report.html``. Every text from a run (manifest fields, file names, table cells) is
    escaped for the format it is written in; only files inside each run folder are read (others: one ``warn``
    line each, and a note in the page). No ``run_dirs``: one line (the command requires RUN_DIR), nothing written."""
    if isinstance(run_dirs, (str, Path)) or not list(run_dirs):  # a str would be gathered letter by letter
        raise MoetoolError(f"give the run folders to gather as a list (RUN_DIR...), not {shown(run_dirs)}")
    if not isinstance(out, RunDir):
        refuse_out_over_runs(out, run_dirs)
    run = out if isinstance(out, RunDir) else RunDir.create("report", out, force)
    warnings: list[str] = []

    def warned(msg: str) -> None:
        warnings.append(msg)
        warn(msg)

    runs = find_runs(run_dirs, exclude=run._path, warn=warned)
    body: list[str] = []
    md: list[str] = []
    _index(title, runs, warnings, body, md)
    for r in runs:
        _run_section(run, r, body, md)
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) +
            "\n</body></html>\n")
    with run.atomic("report.html") as tmp:
        tmp.write_text(page, encoding="utf-8")
    with run.atomic("report.md") as tmp:
        tmp.write_text("\n".join(md) + "\n", encoding="utf-8")
    run.add(gathered=[str(r.path) for r in runs], not_gathered=warnings)
    run.finish(options={"run_dirs": [str(d) for d in run_dirs], "title": title})
    return run.path / "report.html"
