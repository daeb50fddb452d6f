#!/usr/bin/env python3
"""Build moetool's two tiny offline multiple-choice tasks (lm-eval YAML + local JSONL).

The items are cut from the TRAINING split of the corpus the embedded models were trained on
(``examples/build_corpus.py``: CPython standard-library code and Python documentation prose), so
a trained embedded model scores above chance and a routing change that hurts the model shows up
as lost accuracy. Each item is "which continuation is the real one?": the real continuation of
the context and three corruptions of it (words as split at whitespace):

* ``shuffled`` -- the same words in a random order (easy: only the order tells them apart);
* ``swapped``  -- two of its words exchanged (hard: one local order error);
* ``replaced`` -- one word replaced by a word of similar length from another document of the same
  domain (medium: one wrong word in place).

All four have about the same length, so ``acc`` (summed log-likelihood) is not decided by length.

Tasks (chance = 25%):
* ``moetool_code``  -- context: up to 8 lines of a Python source file (<= 400 chars); a choice is
  the next non-blank line (indentation kept), target delimiter "" (the context ends in a newline).
* ``moetool_prose`` -- context: 40-60 words of documentation prose; a choice is the next 8 words,
  target delimiter " ".

One item per document, documents drawn with a fixed seed; a few extra items from other documents
form the ``train`` split used for few-shot examples (``--num-fewshot``).

Usage (deterministic for a given corpus file and seed)::

    python examples/tasks/build_tasks.py            # rebuilds the corpus with build_corpus.py's defaults,
                                                    # as examples/train_tiny.py does
    python examples/tasks/build_tasks.py --corpus /path/to/corpus/train.jsonl   # reuse a built corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
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


KINDS = ("real", "shuffled", "swapped", "replaced")


def corruptions(words: list[str], vocab: list[str], rng: random.Random) -> list[list[str]] | None:
    """``shuffled``, ``swapped`` and ``replaced`` versions of ``words`` (None if one cannot differ)."""
    if len(set(words)) < 3:
        return None
    shuffled = words[:]
    while shuffled == words:
        rng.shuffle(shuffled)
    i, j = rng.sample([k for k in range(len(words))], 2)
    while words[i] == words[j]:
        i, j = rng.sample(range(len(words)), 2)
    swapped = words[:]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    k = rng.randrange(len(words))
    similar = [v for v in vocab if abs(len(v) - len(words[k])) <= 2 and v != words[k]]
    replaced = words[:]
    replaced[k] = rng.choice(similar or vocab)
    out = [shuffled, swapped, replaced]
    return out if len({tuple(words), *map(tuple, out)}) == CHOICES else None


def code_item(text: str, vocab: list[str], rng: random.Random) -> dict | None:
    """Context: up to 8 lines (<= 400 chars); real: the next line (12-80 chars, >= 3 words)."""
    lines = text.split("\n")
    cands = [i for i, l in enumerate(lines) if i >= 3 and 12 <= len(l.strip()) <= 80 and len(l.split()) >= 3]
    rng.shuffle(cands)
    for i in cands:
        ctx = lines[max(0, i - 8):i]
        while len("\n".join(ctx)) > 400 and len(ctx) > 2:
            ctx = ctx[1:]
        real = lines[i]
        indent = real[: len(real) - len(real.lstrip())]
        parts = re.split(r"(\s+)", real.strip())  # words at even places, the whitespace between at odd
        bad = corruptions(parts[::2], vocab, rng)
        if bad:
            return {"context": "\n".join(ctx) + "\n", "real": real,
                    "distractors": [indent + rejoin(parts, b) for b in bad]}
    return None


def rejoin(parts: list[str], words: list[str]) -> str:
    """``words`` put back between the original whitespace (so spacing never tells the real line apart)."""
    out = parts[:]
    out[::2] = words
    return "".join(out)


def prose_item(text: str, vocab: list[str], rng: random.Random) -> dict | None:
    """Context: 40-60 words; real: the next 8 words."""
    words = text.split()
    if len(words) < 70:
        return None
    n_ctx = rng.randint(40, 60)
    real = words[n_ctx:n_ctx + 8]
    bad = corruptions(real, vocab, rng)
    if not bad:
        return None
    return {"context": " ".join(words[:n_ctx]), "real": " ".join(real), "distractors": [" ".join(b) for b in bad]}


def finish(item: dict, rng: random.Random) -> dict:
    """Shuffle the four choices; ``label`` is the index of the real continuation, ``kinds`` says which is which."""
    choices = [item["real"], *item["distractors"]]
    order = list(range(CHOICES))
    rng.shuffle(order)
    return {"context": item["context"], "choices": [choices[o] for o in order], "label": order.index(0),
            "kinds": [KINDS[o] for o in order]}


def build(docs: list[dict], domain: str, n_test: int, n_train: int, rng: random.Random) -> tuple[list, list]:
    texts = [d["text"] for d in docs if d.get("domain") == domain]
    make = code_item if domain == "code" else prose_item
    order = list(range(len(texts)))
    rng.shuffle(order)
    items = []
    for n, i in enumerate(order):
        # replacement words come from a few other documents of the domain
        vocab = sorted({w for t in (texts[order[(n + k) % len(order)]] for k in range(1, 6)) for w in t.split()})
        it = make(texts[i], vocab, rng)
        if it is not None:
            items.append(finish(it, rng))
        if len(items) == n_test + n_train:
            break
    if len(items) < n_test + n_train:
        raise SystemExit(f"only {len(items)} {domain} items could be built")
    return items[:n_test], items[n_test:]


def load_corpus(args: argparse.Namespace) -> tuple[list[dict], str, str]:
    """The training documents, where they came from, and the sha256 of the train.jsonl read."""
    if args.corpus:
        path = Path(args.corpus)
        if path.is_dir():
            path = path / "train.jsonl"
        raw, source = path.read_text(encoding="utf-8"), str(path)
    else:
        with tempfile.TemporaryDirectory(prefix="moetool-corpus-") as out:
            cmd = [sys.executable, str(HERE.parent / "build_corpus.py"), "--out-dir", out, *args.corpus_args.split()]
            subprocess.run(cmd, check=True)
            raw = (Path(out) / "train.jsonl").read_text(encoding="utf-8")
        source = f"examples/build_corpus.py {args.corpus_args}".strip() + " (train split)"
    docs = [json.loads(l) for l in raw.splitlines() if l.strip()]
    return docs, source, hashlib.sha256(raw.encode("utf-8")).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", help="train.jsonl of examples/build_corpus.py (or its --out-dir); "
                                     "default: rebuild it in a temporary folder")
    ap.add_argument("--corpus-args", default="",
                    help="options for build_corpus.py when --corpus is not given (default: none, i.e. its defaults, "
                         "which examples/train_tiny.py trains the embedded models on)")
    ap.add_argument("--out", default=str(HERE), help="output folder (default: this folder)")
    ap.add_argument("--items", type=int, default=100, help="test items per task")
    ap.add_argument("--fewshot-items", type=int, default=10, help="train (few-shot) items per task")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    docs, source, sha = load_corpus(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = {
        "moetool_code": ("code", "", "Which line really comes next in this Python standard-library source? "
                                     "(real / words shuffled / two words swapped / one word replaced)"),
        "moetool_prose": ("prose", " ", "Which 8 words really come next in this Python documentation text? "
                                        "(real / words shuffled / two words swapped / one word replaced)"),
    }
    info = {"corpus": source, "corpus_train_sha256": sha, "seed": args.seed, "tasks": {}}
    for task, (domain, delim, desc) in specs.items():
        rng = random.Random(f"{args.seed}-{task}")
        test, train = build(docs, domain, args.items, args.fewshot_items, rng)
        for split, rows in (("test", test), ("train", train)):
            (out / f"{task}.{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                        encoding="utf-8")
        (out / f"{task}.yaml").write_text(YAML.format(task=task, delim=delim, desc=desc), encoding="utf-8")
        info["tasks"][task] = {"domain": domain, "test_items": len(test), "fewshot_items": len(train),
                               "label_counts": [sum(r["label"] == i for r in test) for i in range(CHOICES)]}
        print(f"{task}: {len(test)} test + {len(train)} few-shot items from {domain} documents of {source}")
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
