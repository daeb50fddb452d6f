#!/usr/bin/env python3
"""Build the small, offline, domain-labelled text corpus used to train moetool's
embedded default models (see ``examples/train_tiny.py``).

Everything comes from text that ships with every CPython installation, so the
corpus can be rebuilt without network access:

* ``code``  -- Python source files of the standard library
  (``sysconfig.get_paths()["stdlib"]``), chunked at blank lines.
  License: Python Software Foundation License (PSF-2.0).
* ``prose`` -- English prose:
    - ``pydoc_data.topics.topics``: the plain-text rendering of the Python
      Language Reference / Library Reference topics used by ``help()``
      (PSF-2.0; generated from the Python documentation).
    - docstrings (module / class / function, extracted with ``ast``) of
      standard-library modules that are *not* used as ``code`` documents
      (PSF-2.0), with doctest paragraphs (``>>>``) removed.
    - a few plain-text/HTML documents shipped in the standard library
      (``idlelib/help.html`` rendered to text, ``idlelib/README.txt``,
      ``idlelib/extend.txt``, ``email/architecture.rst``, ``LICENSE.txt``)
      (PSF-2.0).

Each source file / pydoc topic is a *group*; a group is assigned as a whole to
either the train or the validation split (held-out documents, never held-out
chunks of a document that is also trained on).  Groups are chunked into
documents of at most ``--max-chars`` characters at blank-line boundaries.

Outputs (in ``--out-dir``): ``train.jsonl``, ``validation.jsonl`` (fields
``text``, ``domain``, ``source``) and ``manifest.json`` (sources, licenses,
sizes, sha256, python version).  ``--heldout`` additionally writes the
validation documents (fields ``text``, ``domain``, ``source``) to the given
path; the embedded ``moetool/embedded/data/heldout.jsonl`` is produced that way.

Deterministic: sorted file lists and a fixed seed; the output only depends on
the CPython version (its stdlib files) and the options.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html.parser
import json
import os
import random
import re
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "moetool-tiny-build", "corpus")

# Directory components never used (tests, data tables, vendored wheels, the
# pydoc topic dump itself, third-party packages).
EXCLUDE_PARTS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "encodings",
    "pydoc_data", "_bundled", "__pycache__", "lib2to3", "turtledemo",
}

# Plain-text / HTML prose files shipped inside the stdlib (relative paths).
STDLIB_PROSE_FILES = [
    "LICENSE.txt",
    "email/architecture.rst",
    "idlelib/README.txt",
    "idlelib/extend.txt",
    "idlelib/help.html",
]

LICENSE = "PSF-2.0 (Python Software Foundation License)"


# --------------------------------------------------------------------------- utils
def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def greedy_join(parts: list[str], sep: str, max_chars: int) -> list[str]:
    """Join consecutive ``parts`` with ``sep`` while the result stays within ``max_chars``."""
    out: list[str] = []
    cur = ""
    for p in parts:
        if cur and len(cur) + len(sep) + len(p) > max_chars:
            out.append(cur)
            cur = p
        else:
            cur = f"{cur}{sep}{p}" if cur else p
    if cur:
        out.append(cur)
    return out


def chunk_blocks(text: str, max_chars: int, min_chars: int) -> list[str]:
    """Split ``text`` at blank lines into chunks of at most ``max_chars``
    characters (a single block longer than that is split at line boundaries,
    a single line longer than that is cut).  Chunks shorter than ``min_chars``
    are dropped."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    pieces: list[str] = []
    for b in blocks:
        if len(b) <= max_chars:
            pieces.append(b)
            continue
        # a line longer than max_chars is cut into full-length segments (each stands alone) + its rest
        segments = [line[i:i + max_chars] if len(line) > max_chars else line
                    for line in b.split("\n") for i in range(0, max(len(line), 1), max_chars)]
        pieces.extend(greedy_join(segments, "\n", max_chars))
    chunks = greedy_join(pieces, "\n\n", max_chars)
    return [c for c in chunks if len(c) >= min_chars]


class _HTMLText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "li", "dt", "dd", "pre", "tr", "br", "section"}
    SKIP = {"script", "style", "head"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self._skip += 1
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self._skip:
            self._skip -= 1
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if not self._skip:
            self.out.append(data)


def html_to_text(src: str) -> str:
    p = _HTMLText()
    p.feed(src)
    text = "".join(p.out)
    text = "\n".join(re.sub(r"[ \u00b6]+", " ", line).strip() for line in text.split("\n"))
    return text


# ------------------------------------------------------------------------ sources
def list_stdlib_py(stdlib: Path) -> list[Path]:
    files = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib)
        if any(part in EXCLUDE_PARTS for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith("config-") or rel.name.startswith("test_"):
            continue
        files.append(p)
    return files


def read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    lines = text.split("\n")
    if not lines:
        return None
    long_lines = sum(len(l) > 120 for l in lines)
    if long_lines > 0.05 * len(lines):  # data tables, generated code
        return None
    return text


def docstrings_of(src: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node, clean=True)
            if not d or len(d) < 120:
                continue
            paras = [p for p in normalize(d).split("\n\n") if ">>>" not in p and "..." != p.strip()]
            d = "\n\n".join(paras).strip()
            if len(d) >= 120:
                docs.append(d)
    return "\n\n".join(docs)


def build_groups(stdlib: Path, prose_file_fraction: float, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Return {domain: [(source, text), ...]} with one entry per group."""
    rng = random.Random(seed)
    py_files = list_stdlib_py(stdlib)
    # Partition the stdlib modules: some provide code documents, the others
    # provide docstring prose only (so no docstring is both prose and code).
    order = list(py_files)
    rng.shuffle(order)
    n_prose = int(round(prose_file_fraction * len(order)))
    prose_files = set(order[:n_prose])

    code, prose = [], []
    for p in py_files:
        src = read_source(p)
        if src is None:
            continue
        rel = "stdlib/" + p.relative_to(stdlib).as_posix()
        if p in prose_files:
            d = docstrings_of(src)
            if d:
                prose.append((f"{rel}:docstrings", normalize(d)))
        else:
            code.append((rel, normalize(src)))

    import pydoc_data.topics as topics_mod

    for key in sorted(topics_mod.topics):
        prose.append((f"pydoc_data.topics:{key}", normalize(topics_mod.topics[key])))

    for rel in STDLIB_PROSE_FILES:
        p = stdlib / rel
        if not p.exists():
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix == ".html":
            text = html_to_text(text)
        prose.append((f"stdlib/{rel}", normalize(text)))
    return {"code": code, "prose": prose}


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train-chars-per-domain", type=int, default=1_400_000,
                    help="character budget of the train split per domain")
    ap.add_argument("--val-chars-per-domain", type=int, default=110_000,
                    help="character budget of the validation split per domain")
    ap.add_argument("--max-chars", type=int, default=700, help="max characters per document")
    ap.add_argument("--min-chars", type=int, default=200, help="min characters per document")
    ap.add_argument("--val-max-docs-per-group", type=int, default=3,
                    help="at most this many documents of one held-out group go to validation "
                         "(the group's other documents are discarded, never trained on)")
    ap.add_argument("--prose-file-fraction", type=float, default=0.7,
                    help="fraction of stdlib modules used for docstring prose instead of code")
    ap.add_argument("--heldout", default=None, help="also write the validation split here (JSONL)")
    return ap.parse_args(argv)


def split_domain(domain: str, groups: list[tuple[str, str]], rng: random.Random, args,
                 train: list[dict], val: list[dict]) -> dict:
    """Assign the (shuffled) groups of one domain whole to validation until its character budget is met (at most
    ``--val-max-docs-per-group`` random documents of each), then to train until its budget is met; append the
    documents to ``val`` / ``train`` and return the domain's statistics."""
    g = list(groups)  # already sorted by source
    rng.shuffle(g)
    n_val = n_train = 0
    val_groups = train_groups = 0
    for source, text in g:
        docs = chunk_blocks(text, args.max_chars, args.min_chars)
        if not docs:
            continue
        if n_val < args.val_chars_per_domain:
            k = min(args.val_max_docs_per_group, len(docs))
            for i in sorted(rng.sample(range(len(docs)), k)):
                val.append({"text": docs[i], "domain": domain, "source": f"{source}#{i}"})
                n_val += len(docs[i])
            val_groups += 1
        elif n_train < args.train_chars_per_domain:
            for i, d in enumerate(docs):
                train.append({"text": d, "domain": domain, "source": f"{source}#{i}"})
                n_train += len(d)
            train_groups += 1
        else:
            break
    print(f"[corpus] {domain}: train {n_train:,} chars / {train_groups} groups; "
          f"validation {n_val:,} chars / {val_groups} groups (of {len(g)} groups)", flush=True)
    return {"train_chars": n_train, "train_groups": train_groups,
            "val_chars": n_val, "val_groups": val_groups,
            "available_groups": len(g)}


def split(groups: dict[str, list[tuple[str, str]]], args) -> tuple[list[dict], list[dict], dict]:
    """The train and validation documents of both domains (one random stream for both) and their statistics."""
    rng = random.Random(args.seed + 1)
    train, val = [], []
    stats = {domain: split_domain(domain, groups[domain], rng, args, train, val) for domain in ("code", "prose")}
    train_sources = {r["source"].rsplit("#", 1)[0] for r in train}
    val_sources = {r["source"].rsplit("#", 1)[0] for r in val}
    assert not (train_sources & val_sources), "train/validation group overlap"
    return train, val, stats


def write_jsonl(path: Path, rows: list[dict]) -> dict:
    """Write ``rows`` as JSONL; return the file's entry of the manifest (documents, bytes, sha256)."""
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(payload, encoding="utf-8")
    print(f"[corpus] wrote {path}: {len(rows)} docs, {len(payload.encode()):,} bytes", flush=True)
    return {"docs": len(rows), "bytes": len(payload.encode()), "sha256": sha256_text(payload)}


def manifest(args, stdlib: Path, stats: dict, files: dict) -> dict:
    return {
        "python_version": sys.version.split()[0],
        "stdlib": str(stdlib),
        "seed": args.seed,
        "options": vars(args),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "stats": stats,
        "files": files,
        "sources": [
            {"domain": "code", "origin": "CPython standard library *.py files (sysconfig stdlib path), "
             "tests/encodings/lib2to3/turtledemo/pydoc_data excluded", "license": LICENSE},
            {"domain": "prose", "origin": "pydoc_data.topics.topics (Python documentation topics used by help())",
             "license": LICENSE},
            {"domain": "prose", "origin": "docstrings of CPython stdlib modules not used as code documents",
             "license": LICENSE},
            {"domain": "prose", "origin": "stdlib text files: " + ", ".join(STDLIB_PROSE_FILES),
             "license": LICENSE},
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    print(f"[corpus] python {sys.version.split()[0]}  stdlib={stdlib}", flush=True)
    train, val, stats = split(build_groups(stdlib, args.prose_file_fraction, args.seed), args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"train.jsonl": write_jsonl(out / "train.jsonl", train),
             "validation.jsonl": write_jsonl(out / "validation.jsonl", val)}
    if args.heldout:
        hp = Path(args.heldout)
        hp.parent.mkdir(parents=True, exist_ok=True)
        held = [{"text": r["text"], "domain": r["domain"], "source": r["source"]} for r in val]
        files["heldout"] = {"path": str(hp)} | write_jsonl(hp, held)
    (out / "manifest.json").write_text(json.dumps(manifest(args, stdlib, stats, files), indent=2) + "\n",
                                       encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
