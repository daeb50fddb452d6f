"""``--data``: a text file, a JSONL file (``text``, optional ``domain``) or a folder of them,
tokenized with the model's tokenizer and packed into ``--seq-len`` rows.

Packing: documents of one domain are concatenated with the EOS token between them and cut
into rows of ``seq_len``; each domain's last row is right-padded (``attention_mask`` 0) so a
row never mixes domains. Rows of different domains are interleaved, and ``max_tokens``
caps the number of real (unpadded) tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import MoetoolError

DATA_SUFFIXES = (".txt", ".jsonl", ".md")
DEFAULT_SEQ_LEN = 256
DEFAULT_MAX_TOKENS = 32768


def default_data_path() -> Path:
    """The held-out text shipped inside the package (the default ``--data``)."""
    return Path(__file__).parent / "embedded" / "data" / "heldout.jsonl"


@dataclass(frozen=True)
class Document:
    text: str
    domain: str = ""  # empty: the data carries no domain


def _read_file(path: Path) -> list[Document]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoetoolError(f"cannot read data file {path}: {e}") from None
    if path.suffix != ".jsonl":
        return [Document(raw)] if raw.strip() else []
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise MoetoolError(f"{path} line {n}: not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise MoetoolError(f"{path} line {n}: needs a string field 'text'")
        if rec["text"].strip():
            docs.append(Document(rec["text"], str(rec.get("domain") or "")))
    return docs


def read_documents(path: str | Path | None) -> list[Document]:
    p = Path(path) if path else default_data_path()
    if not p.exists():
        raise MoetoolError(f"data not found: {p}")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES) if p.is_dir() else [p]
    if p.is_dir() and not files:
        raise MoetoolError(f"no {'/'.join(DATA_SUFFIXES)} files in {p}")
    docs = [d for f in files for d in _read_file(f)]
    if not docs:
        raise MoetoolError(f"no text in {p}")
    return docs


@dataclass
class TokenBatch:
    input_ids: Any  # [B, S] long
    attention_mask: Any  # [B, S] long, 0 on padding
    domains: list[str]  # per row


@dataclass
class TokenSet:
    """Packed token rows: ``input_ids [N, S]``, ``attention_mask [N, S]``, a domain per row."""

    input_ids: Any
    attention_mask: Any
    domains: list[str]
    source: str

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def has_domains(self) -> bool:
        return any(self.domains)

    def n_batches(self, batch_size: int) -> int:
        return -(-self.input_ids.shape[0] // batch_size)

    def batches(self, batch_size: int) -> Iterator[TokenBatch]:
        for s in range(0, self.input_ids.shape[0], batch_size):
            yield TokenBatch(self.input_ids[s:s + batch_size], self.attention_mask[s:s + batch_size],
                             self.domains[s:s + batch_size])

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "rows": int(self.input_ids.shape[0]), "seq_len": int(self.input_ids.shape[1]),
                "tokens": self.n_tokens, "domains": sorted(set(self.domains))}


def pack(docs: list[Document], tokenizer: Any, seq_len: int = DEFAULT_SEQ_LEN,
         max_tokens: int | None = DEFAULT_MAX_TOKENS, source: str = "") -> TokenSet:
    import torch

    if seq_len < 2:
        raise MoetoolError("--seq-len must be at least 2")
    if max_tokens is not None and max_tokens < 2:
        raise MoetoolError("--max-tokens must be at least 2")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    streams: dict[str, list[int]] = {}
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        s = streams.setdefault(d.domain, [])
        if s and eos is not None:
            s.append(eos)
        s.extend(ids)
    per_domain: list[list[tuple[list[int], str]]] = []
    for dom, s in streams.items():
        per_domain.append([(s[i:i + seq_len], dom) for i in range(0, len(s), seq_len)])
    rows: list[tuple[list[int], str]] = []
    for r in range(max((len(x) for x in per_domain), default=0)):  # interleave domains
        rows.extend(x[r] for x in per_domain if r < len(x))
    ids_out, mask_out, doms, total = [], [], [], 0
    for toks, dom in rows:
        if max_tokens is not None:
            toks = toks[: max_tokens - total]
        if len(toks) < 2:  # a row needs one next-token prediction to count
            if max_tokens is not None and total >= max_tokens:
                break
            continue
        total += len(toks)
        ids_out.append(toks + [pad] * (seq_len - len(toks)))
        mask_out.append([1] * len(toks) + [0] * (seq_len - len(toks)))
        doms.append(dom)
    if not ids_out:
        raise MoetoolError(f"no tokens in {source or 'the data'} (empty text?)")
    return TokenSet(torch.tensor(ids_out, dtype=torch.long), torch.tensor(mask_out, dtype=torch.long), doms, source)


def load_tokens(path: str | Path | None, tokenizer: Any, seq_len: int = DEFAULT_SEQ_LEN,
                max_tokens: int | None = DEFAULT_MAX_TOKENS) -> TokenSet:
    """Read ``--data`` (default: the shipped held-out text) and pack it."""
    p = Path(path) if path else default_data_path()
    return pack(read_documents(p), tokenizer, seq_len, max_tokens, source=str(p))
