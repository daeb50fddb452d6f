"""``--data``: a text file, a JSONL file (``text``, optional ``domain``) or a folder of them (its hidden files and
folders, such as ``.ipynb_checkpoints``, left out), tokenized with the model's tokenizer and packed into ``--seq-len`` rows.

A JSONL ``domain`` is a string (``""`` or null/missing: no domain); a number, boolean, list or object is refused
in one line naming the file and line (coercing them would merge ``0``/``false`` with undomained text and split
``3`` from ``3.0``).

Packing: documents of one domain are concatenated with the EOS token between them and cut
into rows of ``seq_len``; each domain's last row is right-padded (``attention_mask`` 0) so a
row never mixes domains. Rows of different domains are interleaved, and ``max_tokens``
caps the number of real (unpadded) tokens.

Reading is lazy (:func:`load_tokens`): documents are streamed from the files (JSONL line by line), tokenized
in batches of :data:`TOKENIZE_BATCH` (one call of a fast tokenizer; smaller ones first), a domain stops being
tokenized once it holds every token ``max_tokens`` could take from it, and reading stops once the packed rows can
no longer change — after at least :data:`DOMAIN_SCAN_BYTES` of the corpus, so every domain met there takes part in the
interleave exactly as if the corpus had been read whole. A text file larger than :data:`TEXT_PREFIX_BYTES`
(and a JSONL document longer than that many characters) is tokenized by a growing prefix cut at a line break or
a space, so one long line is tokenized in bounded pieces too. Time and memory follow the tokens asked for, not
the corpus.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import MoetoolError, shown

DATA_SUFFIXES = (".txt", ".jsonl", ".md")  # matched case-insensitively (A.TXT, c.JSONL): data_suffix
#: files ``--data`` refuses by name: structured text whose brackets, keys and commas would be tokenized as prose
#: (and a table of them would look like any other); what to give instead
NOT_TEXT_SUFFIXES = {
    ".json": "a .jsonl with one {\"text\": ...} object per line (jq -c '.[]' FILE.json > FILE.jsonl converts a "
             "list of objects)",
    ".ndjson": "the same lines under a .jsonl name (rename it)",
    ".csv": "a .jsonl with one {\"text\": ...} object per line, or the text column as a .txt",
    ".tsv": "a .jsonl with one {\"text\": ...} object per line, or the text column as a .txt",
}
DEFAULT_SEQ_LEN = 256
DEFAULT_MAX_TOKENS = 32768
#: bytes of the corpus read (parsed, not tokenized) before reading may stop early: every domain met in
#: them takes part in the interleave. A domain whose first document lies beyond them and beyond the point
#: where ``max_tokens`` is reached is not read (a corpus shorter than this packs exactly as if read whole).
DOMAIN_SCAN_BYTES = 64 << 20
#: documents per tokenizer call (fast tokenizers encode a batch in parallel, same ids as one by one); the first
#: calls take fewer (:data:`FIRST_BATCH`, doubled per call up to this), so that a domain that already holds every
#: token ``max_tokens`` can take from it is not tokenized 256 documents further
TOKENIZE_BATCH = 256
FIRST_BATCH = 8
#: a text file larger than this (a document longer, in characters) is tokenized by a growing prefix (cut at a
#: line break or a space), not whole
TEXT_PREFIX_BYTES = 8 << 20


def default_data_path() -> Path:
    """The held-out text shipped inside the package (the default ``--data``)."""
    return Path(__file__).parent / "embedded" / "data" / "heldout.jsonl"


@dataclass(frozen=True)
class Document:
    text: str
    domain: str = ""  # empty: the data carries no domain


class LargeText:
    """A text file too large to read whole: ``pack`` tokenizes only the prefix it needs (``text`` reads it all)."""

    domain = ""

    def __init__(self, path: Path):
        self.path = path

    @property
    def text(self) -> str:
        return _read_text(self.path)

    def __repr__(self) -> str:
        return f"LargeText({str(self.path)!r})"


def data_suffix(path: Path) -> str:
    """``path``'s suffix in lower case: ``c.JSONL`` is JSONL (read as plain text it packed its JSON syntax) and a
    folder's ``A.TXT`` is data (it was left out)."""
    return path.suffix.lower()


def not_utf8(path: Path, e: UnicodeDecodeError, line: int | None = None) -> MoetoolError:
    """The one line for a ``--data`` file that is not UTF-8 (latin-1 or UTF-16 text, a compressed or binary file)."""
    at = f"line {line}: " if line is not None else ""
    utf16 = e.start == 0 and bytes(e.object[:2]) in (b"\xff\xfe", b"\xfe\xff")  # UTF-16's byte-order mark
    return MoetoolError(f"data file {path}: {at}not UTF-8 text ("
                        + ("UTF-16, by its byte-order mark" if utf16 else
                           f"byte 0x{e.object[e.start]:02x} at offset {e.start}")
                        + f"): save it as UTF-8 (e.g. iconv -f {'utf-16' if utf16 else 'latin1'} -t utf-8); a "
                          f"compressed or binary file is not read")


def refuse_nul(path: Any, text: str) -> str:
    """``text``, or one line when it holds a NUL character: UTF-16 text without a byte-order mark (every other byte
    0) or a binary file decodes as UTF-8 and would be packed as a NUL after every character."""
    if "\x00" in text:
        raise MoetoolError(f"data file {path}: holds NUL characters, so it is not UTF-8 text (UTF-16? a binary file?): "
                           f"save it as UTF-8 (e.g. iconv -f utf-16 -t utf-8)")
    return text


def _read_text(path: Path) -> str:
    try:
        # a leading byte-order mark (Windows editors) is no text
        return refuse_nul(path, path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    except OSError as e:
        raise MoetoolError(f"cannot read data file {path}: {e}") from None


def _surrogate(s: str) -> bool:
    """True when ``s`` holds an unpaired surrogate (a JSON ``\\ud800`` escape): no tokenizer encodes it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def folder_files(root: Path) -> list[Path]:
    """The data files of folder ``root``, sorted by path: every ``.txt``/``.jsonl``/``.md`` below it, through links to
    folders too (``corpus/code -> /datasets/code``: ``Path.rglob`` does not follow them, and their text was left out
    without a word), each folder read once (a link back up, ``self -> ..``, or a second link to one folder adds
    nothing; a link to a folder above ``root`` is a loop, never followed: it would read ``root``'s neighbours).
    Hidden files and folders (``.ipynb_checkpoints``, ``.git``, editor backups) are not data: they hold copies of its
    files, read and counted twice. A data name that is no regular file (a link whose target is gone, a pipe) is one
    line: it was skipped, its text left out of the tables in silence."""
    files, seen = [], {root.resolve(), *root.resolve().parents}
    for top, folders, names in os.walk(root, followlinks=True):
        keep = []
        for d in sorted(folders):
            real = (Path(top) / d).resolve()
            if not d.startswith(".") and real not in seen:
                seen.add(real)
                keep.append(d)
        folders[:] = keep
        for f in names:
            path = Path(top) / f
            if f.startswith(".") or data_suffix(path) not in DATA_SUFFIXES:
                continue
            if not path.is_file():  # its text would be left out without a word
                what = (f"a link to {os.readlink(path)}, which does not exist" if path.is_symlink()
                        else "not a regular file")
                raise MoetoolError(f"data file {path} is {what}: mend or remove it (a {'/'.join(DATA_SUFFIXES)} "
                                   f"name in a --data folder is read as data)")
            files.append(path)
    return sorted(files)


class DocumentStream:
    """Documents of ``--data`` in order, read lazily; ``bytes_read`` counts the bytes consumed so far."""

    def __init__(self, path: str | Path | None):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise MoetoolError(f"--data is a file or folder name (or None: the shipped held-out text), not "
                               f"{shown(path, typed=True)}")
        if isinstance(path, str) and not path.strip():  # not the held-out text, nor Path("") = the current folder
            raise MoetoolError("--data is an empty name: give a file or folder (or None: the shipped held-out text)")
        self.path = Path(path) if path is not None else default_data_path()
        try:
            found = self.path.exists()
        except OSError as e:  # a name too long for the file system
            raise MoetoolError(f"--data {str(self.path)[:80]}...: {e.strerror or e}") from None
        if not found:
            raise MoetoolError(f"data not found: {self.path}")
        p = self.path
        if not p.is_dir() and data_suffix(p) in NOT_TEXT_SUFFIXES:
            raise MoetoolError(f"data file {p}: a {data_suffix(p)} file is not read as text (its syntax would be packed "
                               f"as tokens): give {NOT_TEXT_SUFFIXES[data_suffix(p)]}")
        self.files = folder_files(p) if p.is_dir() else [p]
        if p.is_dir() and not self.files:
            raise MoetoolError(f"no {'/'.join(DATA_SUFFIXES)} files in {p}")
        seen: dict[tuple[int, int], Path] = {}
        for f in self.files:  # a file reached under two names (a link) would be read, and counted, twice
            st = f.stat()
            first = seen.setdefault((st.st_dev, st.st_ino), f)
            if first is not f:
                raise MoetoolError(f"--data {p}: {first} and {f} are the same file (a link): its text would be read "
                                   f"twice; leave one name in the folder")
        self.bytes_read = 0
        self.documents = 0
        #: JSONL domains met with a blank (whitespace-only) text: one whose every document read is blank gets no row,
        #: which :func:`pack` says (:attr:`TokenSet.unpacked`) rather than leave the domain out without a word
        self.blank_domains: dict[str, None] = {}

    def __iter__(self) -> Iterator[Document]:
        for f in self.files:
            for d in self._read_file(f):
                self.documents += 1
                yield d

    def _read_file(self, path: Path) -> Iterator[Document]:
        if data_suffix(path) != ".jsonl":
            size = path.stat().st_size
            if size > TEXT_PREFIX_BYTES:
                self.bytes_read += size  # read on demand by pack; counted whole (reading may stop here)
                yield LargeText(path)
                return
            raw = _read_text(path)
            self.bytes_read += size
            if raw.strip():
                yield Document(raw)
            return
        try:
            with open(path, "rb") as fh:
                for n, line in enumerate(fh, 1):
                    self.bytes_read += len(line)
                    try:
                        text = line.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM: not JSON, no text
                    except UnicodeDecodeError as e:
                        raise not_utf8(path, e, n) from None
                    if not text.strip():
                        continue
                    try:
                        rec = json.loads(text)
                    except json.JSONDecodeError:
                        raise MoetoolError(f"{path} line {n}: not valid JSON") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise MoetoolError(f"{path} line {n}: needs a string field 'text'")
                    domain = rec.get("domain")
                    if domain is not None and not isinstance(domain, str):  # 0/false would merge with no domain,
                        kind = {bool: "boolean", int: "number", float: "number", list: "list", dict: "object"}.get(
                            type(domain), type(domain).__name__)  # 3 and 3.0 split: never coerced
                        shown = json.dumps(domain)
                        shown = shown if len(shown) <= 40 else shown[:37] + "..."
                        raise MoetoolError(f"{path} line {n}: 'domain' must be a string or null, got the {kind} "
                                           f"{shown} (quote it to use it as a domain name)")
                    for key in ("text", "domain"):  # only a \\u escape makes one: checked where there is one
                        if "\\u" in text and isinstance(rec.get(key), str) and _surrogate(rec[key]):
                            raise MoetoolError(f"{path} line {n}: '{key}' holds an unpaired surrogate escape (such as "
                                               f"\\ud800): not Unicode text, which no tokenizer encodes")
                    if rec["text"].strip():
                        yield Document(rec["text"], domain or "")
                    elif domain:
                        self.blank_domains.setdefault(domain)
        except OSError as e:
            raise MoetoolError(f"cannot read data file {path}: {e}") from None


def read_documents(path: str | Path | None) -> list[Document]:
    """Every document of ``--data`` (eager; :func:`load_tokens` reads only what ``--max-tokens`` needs)."""
    stream = DocumentStream(path)
    docs = list(stream)
    if not docs:
        raise MoetoolError(f"no text in {stream.path}")
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
    special_tokens: dict[str, Any] = field(default_factory=lambda: {"add_special_tokens": False})
    row_ids: Any = None  # [N] long: global packed-row numbers of a rank's shard (moetool.distributed.shard)
    tokenizer: str | None = None  # the vocabulary that packed them (tokenizer_id; None: not known, e.g. by hand)
    #: domains of the data that got no row, and why (a text of fewer than 2 tokens, or --max-tokens reached first):
    #: their per-domain tables have no row, which a run says on the console (:func:`unpacked_lines`)
    unpacked: dict[str, str] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def require_tokens(self) -> "TokenSet":
        """``self``, or one line when no position is a real token (empty data or all padding): a statistic over
        zero tokens is missing, never a table."""
        if self.n_tokens == 0:
            raise MoetoolError("no real tokens in the data")
        return self

    @property
    def has_domains(self) -> bool:
        return any(self.domains)

    def n_batches(self, batch_size: int) -> int:
        return -(-self.input_ids.shape[0] // batch_size)

    def batches(self, batch_size: int) -> Iterator[TokenBatch]:
        for s in range(0, self.input_ids.shape[0], batch_size):
            yield TokenBatch(self.input_ids[s:s + batch_size], self.attention_mask[s:s + batch_size],
                             self.domains[s:s + batch_size])

    def fingerprint(self) -> dict[str, Any]:
        """What was read, not where from: rows, tokens and a SHA-256 of the token ids, padding mask and domains
        (``--resume`` refuses other data read from the same path)."""
        import hashlib

        h = hashlib.sha256()
        for t in (self.input_ids, self.attention_mask):
            h.update(t.detach().cpu().long().contiguous().numpy().tobytes())
        h.update(json.dumps(list(self.domains)).encode())
        return {"rows": int(self.input_ids.shape[0]), "tokens": self.n_tokens, "sha256": h.hexdigest()}

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "rows": int(self.input_ids.shape[0]), "seq_len": int(self.input_ids.shape[1]),
                "tokens": self.n_tokens, "domains": sorted(set(self.domains)),
                "special_tokens": self.special_tokens}


def check_packed(tokens: Any) -> None:
    """Packed rows whose parts agree, or one line: ``input_ids`` and ``attention_mask`` torch tensors of one shape
    ``[N, S]`` (integer ids, a 0/1 mask), one domain per row (and one ``row_ids`` entry, where there are any). A
    TokenSet sliced by hand (``input_ids[:2]`` with the mask or domains of every row) or of numpy arrays would
    otherwise give a traceback from deep inside an experiment, or a table over rows paired with another row's
    mask or domain."""
    import torch

    ids, mask = tokens.input_ids, tokens.attention_mask
    for name, t in (("input_ids", ids), ("attention_mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise MoetoolError(f"packed tokens' {name} must be a torch tensor (moetool.tokens(lm, data, ...) packs "
                               f"them; torch.as_tensor converts an array), not {type(t).__name__}")
        if t.dim() != 2:
            raise MoetoolError(f"packed tokens' {name} must be rows of tokens [rows, seq_len], not of shape "
                               f"{tuple(t.shape)}")
    if ids.shape != mask.shape:
        raise MoetoolError(f"packed tokens' input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} "
                           f"differ in shape: slice every part of a TokenSet alike (or pack them with moetool.tokens)")
    if ids.dtype not in (torch.int64, torch.int32):  # what an embedding takes: uint8/int16 ids were torch's traceback
        raise MoetoolError(f"packed tokens' input_ids must be integer token ids (int64 or int32; ids.long() converts "
                           f"them), not {str(ids.dtype).replace('torch.', '')}")
    if mask.is_floating_point() or mask.is_complex():  # 0.0/1.0 floats: said as a dtype, not as their values
        raise MoetoolError(f"packed tokens' attention_mask must be an integer (or bool) tensor of 0 and 1, not "
                           f"{str(mask.dtype).replace('torch.', '')} (mask.long() converts it)")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise MoetoolError("packed tokens' attention_mask must hold 0 (padding) and 1 (a real token) only")
    rows = int(ids.shape[0])
    for name in ("domains", "row_ids"):
        part = getattr(tokens, name, None)
        if part is None and name == "row_ids":
            continue
        n = len(part) if hasattr(part, "__len__") and not isinstance(part, (str, bytes)) else None
        if n != rows:
            raise MoetoolError(f"packed tokens have {rows} rows but {n if n is not None else repr(part)} {name}: "
                               f"slice every part of a TokenSet alike (or pack them with moetool.tokens)"[:300])


def require_tokens(tokens: Any) -> TokenSet:
    """``tokens`` (:meth:`TokenSet.require_tokens`: at least one real token), or one line when none were given
    (``moetool.ppl(lm, None)``): the experiments call this after checking their options (:func:`check_packed` is
    the API's and the forward's)."""
    if tokens is None:
        raise MoetoolError("no tokens given: pass packed tokens (moetool.tokens(lm, data, ...))")
    return tokens.require_tokens()


def packing_hint(lm: Any, call: str) -> str:
    """How to give ``call`` (``moetool.run('stats', lm, {})``: ``{}`` where the tokens go) packed tokens for the
    loaded model ``lm``: ``moetool.tokens(lm, ...)``, or, for a model loaded without its tokenizer (which
    ``moetool.tokens`` cannot pack with), the model loaded with it, or the run by the model's name."""
    if getattr(lm, "tokenizer", None) is not None:
        return call.format("moetool.tokens(lm, ...)")
    name = getattr(lm, "name", None) or "<model>"
    return (f"this model was loaded without a tokenizer (moetool.load(..., tokenizer=False)), which moetool.tokens "
            f"cannot pack with: load it with its tokenizer (lm = moetool.load({name!r})) and pass "
            f"{call.format('moetool.tokens(lm, ...)')}, or run it by name: {call.replace('lm, {}', repr(name))}")


def _call_options(tokenizer: Any, add_special_tokens: bool | None) -> dict[str, Any]:
    """Keyword arguments of every tokenizer call: the special-token choice (``None``: the tokenizer's default) and,
    for a transformers tokenizer, ``verbose=False`` -- moetool packs the ids into rows itself, so transformers'
    "Token indices sequence length is longer than the specified maximum ... indexing errors" about a long
    document is noise."""
    quiet = {"verbose": False} if hasattr(tokenizer, "deprecation_warnings") else {}  # transformers' own only
    return {**quiet, **({} if add_special_tokens is None else {"add_special_tokens": add_special_tokens})}


def _encode(tokenizer: Any, texts: list[str], add_special_tokens: bool | None) -> list[list[int]]:
    """Token ids of each text; one batched call with a fast tokenizer (ids identical to one call per text)."""
    kw = _call_options(tokenizer, add_special_tokens)
    if getattr(tokenizer, "is_fast", False) and len(texts) > 1:
        return list(tokenizer(texts, **kw)["input_ids"])
    return [list(tokenizer(t, **kw)["input_ids"]) for t in texts]


def _safe_cut(text: str, before: int) -> int:
    """Index of the last line break or space before ``before`` with non-blank characters on both sides (0: none).

    Every tokenizer moetool supports splits its pre-tokens there (byte-level BPE regexes, Metaspace
    SentencePiece), so the tokens of ``text[:cut]`` are the first tokens of any longer text with that prefix. A
    space counts as well as a line break: a long line without one (a 52 MB line) is cut as early as a paragraph.
    """
    best = 0
    for sep in ("\n", " "):
        i = before
        while i > best:
            i = text.rfind(sep, best + 1, i)
            if i <= 0:
                break
            if i + 1 < len(text) and not text[i - 1].isspace() and not text[i + 1].isspace():
                best = i
                break
            i -= 1
    return best


def _encode_prefix(tokenizer: Any, doc: LargeText | Document, want: int,
                   add_special_tokens: bool | None) -> list[int]:
    """At least ``want`` leading tokens of a large text file or a long document (all of them if it holds fewer),
    tokenized by a growing prefix (``16 * want`` characters at first, doubled while too short) cut at a line break
    or a space (:func:`_safe_cut`): time and memory follow ``want``, not the length of a line."""
    if not getattr(tokenizer, "is_fast", False):
        return _encode(tokenizer, [doc.text], add_special_tokens)[0]
    kw = _call_options(tokenizer, add_special_tokens)
    chars, text = max(16 * want, 1 << 16), ""
    try:
        with (open(doc.path, encoding="utf-8-sig") if isinstance(doc, LargeText) else io.StringIO(doc.text)) as fh:
            while True:
                more = refuse_nul(getattr(doc, "path", "document"), fh.read(chars - len(text)))
                text += more
                if len(text) < chars:  # end of file: the whole text
                    return list(tokenizer(text, **kw)["input_ids"])
                cut = _safe_cut(text, len(text) - 1024)
                if cut:
                    enc = tokenizer(text, return_offsets_mapping=True, **kw)
                    ids = []
                    for t, (_, end) in zip(enc["input_ids"], enc["offset_mapping"]):
                        if end > cut:
                            break
                        ids.append(t)
                    # the cut is a token boundary for this tokenizer: text[:cut] alone gives the same ids (else
                    # grow: never ids that tokenizing the whole text would not give)
                    if len(ids) >= want and list(tokenizer(text[:cut], **kw)["input_ids"])[:len(ids)] == ids:
                        return ids
                chars *= 2
    except UnicodeDecodeError as e:  # a file only: a document is in memory already
        raise not_utf8(doc.path, e) from None
    except OSError as e:
        raise MoetoolError(f"cannot read data file {getattr(doc, 'path', '')}: {e}") from None


def _rows_final(lengths: list[int], seq_len: int, max_tokens: int, open_: list[bool]) -> bool:
    """True when the packed rows are final: ``max_tokens`` is reached using only complete rows of the domain
    streams (a stream that may still grow changes nothing before its first incomplete row)."""
    total, full_rows = 0, [n // seq_len for n in lengths]
    for r in range(max(full_rows, default=0) + 1):
        for n_full, growing in zip(full_rows, open_):
            if r < n_full:
                total += seq_len
                if total >= max_tokens:
                    return True
            elif growing:
                return False
    return False


def pack(docs: Iterable[Document | LargeText], tokenizer: Any, seq_len: int = DEFAULT_SEQ_LEN,
         max_tokens: int | None = DEFAULT_MAX_TOKENS, source: str = "",
         add_special_tokens: bool | None = False) -> TokenSet:
    """Tokenize and pack ``docs`` (read lazily: a :class:`DocumentStream` stops being read once the rows are
    final, see :data:`DOMAIN_SCAN_BYTES`). ``add_special_tokens``: None = the tokenizer's own default (a BOS
    per document where the model's tokenizer adds one), False = none."""
    import torch

    if seq_len < 2:
        raise MoetoolError("--seq-len must be at least 2")
    if max_tokens is not None and max_tokens < 2:
        raise MoetoolError("--max-tokens must be at least 2")
    streams = _domain_streams(docs, tokenizer, seq_len, max_tokens, add_special_tokens)
    if not streams:
        raise MoetoolError(f"no text in {source or 'the data'}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    ids_out, mask_out, doms = _pack_rows(streams, seq_len, max_tokens, pad)
    if not ids_out:
        raise MoetoolError(too_few_tokens(streams, source or "the data"))
    packed = set(doms)
    unpacked = {d: (f"its text has {len(s)} token{'s' if len(s) != 1 else ''} (a row needs 2)" if len(s) < 2 else
                    f"--max-tokens {max_tokens} was reached before its first row") for d, s in streams.items()
                if d not in packed}
    unpacked.update({d: "its text is blank (whitespace only)" for d in getattr(docs, "blank_domains", {})
                     if d not in streams})
    return TokenSet(torch.tensor(ids_out, dtype=torch.long), torch.tensor(mask_out, dtype=torch.long), doms, source,
                    special_tokens=_special_meta(tokenizer, add_special_tokens), tokenizer=tokenizer_id(tokenizer),
                    unpacked=unpacked)


def unpacked_lines(tokens: Any) -> list[str]:
    """One console line per domain of the data that got no row (:attr:`TokenSet.unpacked`): it is in no
    per-domain table, and the run says why rather than leave it out without a word."""
    return [f"note: --data domain '{d}' has no row, so no per-domain result: {why}"
            for d, why in getattr(tokens, "unpacked", {}).items()]


#: tokenizer -> (its length, :func:`tokenizer_id`): a 150k vocabulary hashes in ~0.25 s, and every forward checks
_TOKENIZER_IDS: Any = None


def tokenizer_id(tokenizer: Any) -> str | None:
    """A SHA-256 of the tokenizer's vocabulary (token -> id), what packed ids mean: two models' tokenizers agree on
    every id exactly when these are equal (``None`` for a tokenizer without ``get_vocab``). Kept per tokenizer
    while its length is unchanged (``add_tokens`` changes it)."""
    import hashlib
    import weakref

    global _TOKENIZER_IDS
    if _TOKENIZER_IDS is None:
        _TOKENIZER_IDS = weakref.WeakKeyDictionary()
    try:
        size = len(tokenizer)
    except TypeError:  # no length (a stand-in, or a __getattr__ that answers hasattr but not len)
        size = None
    try:
        kept = _TOKENIZER_IDS.get(tokenizer)
    except TypeError:  # not weakly referable (or unhashable): computed each time
        kept = None
    if kept is not None and size is not None and kept[0] == size:
        return kept[1]
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if not isinstance(vocab, dict):
        return None
    found = hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()
    try:
        _TOKENIZER_IDS[tokenizer] = (size, found)
    except TypeError:
        pass
    return found


def check_tokenizer(tokens: Any, tokenizer: Any) -> None:
    """Tokens packed with the model's own vocabulary (:func:`tokenizer_id`), or one line: ids of another model's
    tokenizer (``moetool.tokens(other_lm, ...)``) that its vocabulary happens to cover would be read as other
    tokens, a perplexity or a routing statistic of text the model never saw. Tokens of unknown origin (packed by
    hand) and a model without a tokenizer are not checked (a token id outside the vocabulary still is, by the
    forward)."""
    packed = getattr(tokens, "tokenizer", None)
    if packed is None or tokenizer is None:
        return
    own = tokenizer_id(tokenizer)
    if own is not None and own != packed:
        raise MoetoolError("these tokens were packed with another tokenizer than this model's (another vocabulary: "
                           "their ids name other tokens here); pack them with this model: moetool.tokens(lm, data, "
                           "...)")


def too_few_tokens(streams: dict[str, list[int]], source: str) -> str:
    """Why no row could be packed from ``streams`` (every domain's text tokenized to fewer than 2 tokens): the
    line that says how many there were."""
    total = sum(len(s) for s in streams.values())
    if total == 0:
        return f"no tokens in {source} (empty text?)"
    if len(streams) == 1 or total < 2:
        return f"{source} has {total} token{'s' if total != 1 else ''}: at least 2 are needed to score a next token"
    return (f"{source} has {total} tokens, at most 1 in each of its {len(streams)} domains: at least 2 in one domain "
            "are needed to score a next token")


def _domain_streams(docs: Iterable[Document | LargeText], tokenizer: Any, seq_len: int, max_tokens: int | None,
                    add_special_tokens: bool | None) -> dict[str, list[int]]:
    """One token stream per domain, documents joined by EOS; a domain stops growing once it holds every row
    ``max_tokens`` can use, and reading stops once no later document can change the rows."""
    eos = tokenizer.eos_token_id
    # a domain stream of `need` tokens holds every row max_tokens can use: later documents change nothing
    need = None if max_tokens is None else -(-max_tokens // seq_len) * seq_len
    streams: dict[str, list[int]] = {}
    done: set[str] = set()
    batch: list[Document] = []
    limit = [FIRST_BATCH]  # documents of the next tokenizer call: doubled per call, up to TOKENIZE_BATCH

    def add(dom: str, ids: list[int]) -> None:
        s = streams[dom]
        if dom in done:
            return
        if s and eos is not None:
            s.append(eos)
        s.extend(ids)
        if need is not None and len(s) >= need:
            done.add(dom)

    def flush() -> None:
        if batch:
            limit[0] *= 2
        for d, ids in zip(batch, _encode(tokenizer, [d.text for d in batch], add_special_tokens)):
            add(d.domain, ids)
        batch.clear()

    def final() -> bool:
        scanned = getattr(docs, "bytes_read", 0) >= DOMAIN_SCAN_BYTES
        return need is not None and scanned and _rows_final(
            [len(s) for s in streams.values()], seq_len, max_tokens, [d not in done for d in streams])

    for d in docs:
        streams.setdefault(d.domain, [])
        if d.domain in done:
            if final():
                break
            continue
        if isinstance(d, LargeText) or (need is not None and len(d.text) > TEXT_PREFIX_BYTES):  # a long document
            flush()
            s = streams[d.domain]
            add(d.domain, _encode_prefix(tokenizer, d, (need - len(s)) if need is not None else 1 << 62,
                                         add_special_tokens) if need is not None else
                _encode(tokenizer, [d.text], add_special_tokens)[0])
        else:
            batch.append(d)
            if len(batch) < min(limit[0], TOKENIZE_BATCH):
                continue
            flush()
        if final():
            break
    flush()
    return streams


def _pack_rows(streams: dict[str, list[int]], seq_len: int, max_tokens: int | None,
               pad: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Rows of ``seq_len`` cut from each domain's stream, domains interleaved, at most ``max_tokens`` real tokens
    (a row of fewer than 2 tokens has no next-token prediction and is dropped): ``(ids, mask, domains)``."""
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
    return ids_out, mask_out, doms


def _special_meta(tokenizer: Any, add_special_tokens: bool | None) -> dict[str, Any]:
    """What the manifest records about special tokens: the choice and what it meant for this tokenizer."""
    kw = _call_options(tokenizer, add_special_tokens)
    try:
        added = list(tokenizer("", **kw)["input_ids"])
    except Exception:  # a tokenizer that cannot encode "" : record the choice only
        added = None
    return {"add_special_tokens": "tokenizer default" if add_special_tokens is None else add_special_tokens,
            "added_per_document": added}


def load_tokens(path: str | Path | None, tokenizer: Any, seq_len: int = DEFAULT_SEQ_LEN,
                max_tokens: int | None = DEFAULT_MAX_TOKENS, add_special_tokens: bool | None = False) -> TokenSet:
    """Read ``--data`` (default: the shipped held-out text) lazily and pack it: reading and tokenizing stop
    once ``max_tokens`` is reached (see :data:`DOMAIN_SCAN_BYTES`)."""
    stream = DocumentStream(path)
    return pack(stream, tokenizer, seq_len, max_tokens, source=str(stream.path), add_special_tokens=add_special_tokens)
