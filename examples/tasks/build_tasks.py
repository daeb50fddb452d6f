#!/usr/bin/env python3
"""Build moetool's two tiny offline multiple-choice tasks (lm-eval YAML + local JSONL).

The items are cut from the TRAINING split of the corpus the embedded models were trained on
(``examples/build_corpus.py``: CPython standard-library code and Python documentation prose), so
a trained embedded model scores above chance and a routing change that hurts the model shows up
as lost accuracy. Each item is "which continuation is the real one?" with four choices:

* the real continuation of the context;
* the same words in a shuffled order (same length, same tokens: only order tells them apart);
* the segment that comes *after* the real one in the same document (plausible, wrong place);
* a segment of the same length class from another training document of the same domain.

Tasks (chance = 25%):
* ``moetool_code``  -- context: up to 8 lines of a Python source file (<= 400 chars); a choice is
  the next non-blank line (indentation kept), target delimiter "" (the context ends in a newline).
* ``moetool_prose`` -- context: 40-60 words of documentation prose; a choice is the next 8 words,
  target delimiter " ".

One item per document, documents drawn with a fixed seed; a few extra items from other documents
form the ``train`` split used for few-shot examples (``--num-fewshot``).

Usage (deterministic for a given corpus file and seed)::

    python examples/build_corpus.py --out-dir /tmp/corpus [same options as the models' training]
    python examples/tasks/build_tasks.py --corpus /tmp/corpus/train.jsonl
    # without --corpus the corpus is rebuilt with build_corpus.py's options given by --corpus-args
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHOICES = 4

YAML = """\
# Built by examples/tasks/build_tasks.py -- see README.md in this folder. Offline: local JSONL.
# moetool passes this config to lm-eval with absolute data-file paths; with plain lm_eval
# run from this folder (relative data_files resolve against the working directory).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task}.test.jsonl
    train: {task}.train.jsonl
test_split: test
fewshot_split: train
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: "{delim}"
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  description: "{desc}"
"""


def shuffled(words: list[str], rng: random.Random) -> list[str]:
    """A permutation of ``words`` that differs from the original order (when one exists)."""
    if len(set(words)) < 2:
        return []
    for _ in range(20):
        w = words[:]
        rng.shuffle(w)
        if w != words:
            return w
    return []


def code_segments(text: str) -> tuple[list[str], list[int]]:
    """Lines of a code document and the indices of candidate target lines."""
    lines = text.split("\n")
    cands = [i for i, l in enumerate(lines) if i >= 3 and 12 <= len(l.strip()) <= 80 and len(l.split()) >= 3]
    return lines, cands


def code_item(text: str, pool: list[str], rng: random.Random) -> dict | None:
    """Context: up to 8 lines (<= 400 chars); choices: real next line and three distractors."""
    lines, cands = code_segments(text)
    rng.shuffle(cands)
    for i in cands:
        nxt = [j for j in range(i + 1, len(lines)) if len(lines[j].split()) >= 2 and lines[j] != lines[i]]
        if not nxt:
            continue
        ctx_lines = lines[max(0, i - 8):i]
        context = "\n".join(ctx_lines) + "\n"
        while len(context) > 400 and len(ctx_lines) > 2:
            ctx_lines = ctx_lines[1:]
            context = "\n".join(ctx_lines) + "\n"
        real = lines[i]
        indent = real[: len(real) - len(real.lstrip())]
        sw = shuffled(real.split(), rng)
        if not sw:
            continue
        later = lines[nxt[0]]
        other = rng.choice([p for p in pool if abs(len(p) - len(real)) <= 20 and p not in lines] or pool)
        choices = [real, indent + " ".join(sw), later, other]
        if len(set(choices)) < CHOICES:
            continue
        return {"context": context, "real": real, "distractors": choices[1:]}
    return None


def prose_item(text: str, pool: list[str], rng: random.Random) -> dict | None:
    """Context: 40-60 words; choices: the real next 8 words and three distractors."""
    words = text.split()
    if len(words) < 80:
        return None
    n_ctx = rng.randint(40, 60)
    real, later = words[n_ctx:n_ctx + 8], words[n_ctx + 8:n_ctx + 16]
    sw = shuffled(real, rng)
    if not sw or len(later) < 8:
        return None
    joined = " ".join(words)
    choices = [" ".join(real), " ".join(sw), " ".join(later), rng.choice([p for p in pool if p not in joined])]
    if len(set(choices)) < CHOICES:
        return None
    return {"context": " ".join(words[:n_ctx]), "real": choices[0], "distractors": choices[1:]}


def finish(item: dict, rng: random.Random) -> dict:
    """Shuffle the four choices; ``label`` is the index of the real continuation."""
    choices = [item["real"], *item["distractors"]]
    order = list(range(CHOICES))
    rng.shuffle(order)
    return {"context": item["context"], "choices": [choices[o] for o in order], "label": order.index(0)}


def build(docs: list[dict], domain: str, n_test: int, n_train: int, rng: random.Random) -> tuple[list, list]:
    texts = [d["text"] for d in docs if d.get("domain") == domain]
    if domain == "code":
        pool = [l for t in texts for l in t.split("\n") if 12 <= len(l.strip()) <= 80 and len(l.split()) >= 3]
        make = code_item
    else:
        pool = [" ".join(t.split()[k:k + 8]) for t in texts for k in range(0, max(0, len(t.split()) - 8), 40)]
        make = prose_item
    order = list(range(len(texts)))
    rng.shuffle(order)
    items = []
    for i in order:
        it = make(texts[i], pool, rng)
        if it is not None:
            items.append(finish(it, rng))
        if len(items) == n_test + n_train:
            break
    if len(items) < n_test + n_train:
        raise SystemExit(f"only {len(items)} {domain} items could be built")
    return items[:n_test], items[n_test:]


def load_corpus(args: argparse.Namespace) -> tuple[list[dict], str]:
    if args.corpus:
        path = Path(args.corpus)
        if path.is_dir():
            path = path / "train.jsonl"
    else:
        out = Path(tempfile.mkdtemp(prefix="moetool-corpus-"))
        cmd = [sys.executable, str(HERE.parent / "build_corpus.py"), "--out-dir", str(out), *args.corpus_args.split()]
        subprocess.run(cmd, check=True)
        path = out / "train.jsonl"
    docs = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    return docs, str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", help="train.jsonl of examples/build_corpus.py (or its --out-dir); "
                                     "default: rebuild it in a temporary folder")
    ap.add_argument("--corpus-args", default="--prose-file-fraction 0.75",
                    help="options for build_corpus.py when --corpus is not given (those the models were trained with)")
    ap.add_argument("--out", default=str(HERE), help="output folder (default: this folder)")
    ap.add_argument("--items", type=int, default=60, help="test items per task")
    ap.add_argument("--fewshot-items", type=int, default=10, help="train (few-shot) items per task")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    docs, source = load_corpus(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = {
        "moetool_code": ("code", "", "Which line really comes next in this Python standard-library source? "
                                     "(real / words shuffled / a later line / a line of another file)"),
        "moetool_prose": ("prose", " ", "Which 8 words really come next in this Python documentation text? "
                                        "(real / words shuffled / the following 8 words / another document)"),
    }
    for task, (domain, delim, desc) in specs.items():
        rng = random.Random(f"{args.seed}-{task}")
        test, train = build(docs, domain, args.items, args.fewshot_items, rng)
        for split, rows in (("test", test), ("train", train)):
            (out / f"{task}.{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                        encoding="utf-8")
        (out / f"{task}.yaml").write_text(YAML.format(task=task, delim=delim, desc=desc), encoding="utf-8")
        print(f"{task}: {len(test)} test + {len(train)} few-shot items from {domain} documents of {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
