"""--data reading and packing: domains, padding, caps, and one-line errors."""

import re
import json

import pytest
import torch

from moetool.data import Document, load_tokens, pack, read_documents
from moetool.errors import MoetoolError


class CharTokenizer:
    """One token per character (id = ord % 200 + 3); eos 1, pad 2."""

    eos_token_id = 1
    pad_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 200 + 3 for c in text]}


def test_pack_by_domain_with_eos_padding_and_interleave():
    docs = [Document("abcde", "code"), Document("xyz", "prose"), Document("fg", "code")]
    ts = pack(docs, CharTokenizer(), seq_len=4, max_tokens=None)
    t = CharTokenizer()
    code = t("abcde")["input_ids"] + [1] + t("fg")["input_ids"]  # 8 tokens -> rows of 4, 4
    prose = t("xyz")["input_ids"]  # 3 tokens -> one padded row
    # rows interleave domains: code0, prose0, code1
    assert ts.domains == ["code", "prose", "code"]
    assert ts.input_ids.tolist() == [code[:4], prose + [2], code[4:8]]
    assert ts.attention_mask.tolist() == [[1] * 4, [1, 1, 1, 0], [1] * 4]
    assert ts.n_tokens == 11 and ts.has_domains


def test_max_tokens_caps_real_tokens():
    ts = pack([Document("a" * 50, "")], CharTokenizer(), seq_len=8, max_tokens=20)
    assert ts.n_tokens == 20
    assert ts.attention_mask.sum(1).tolist() == [8, 8, 4]
    assert not ts.has_domains


def test_batches_cover_rows_in_order():
    ts = pack([Document("q" * 33, "")], CharTokenizer(), seq_len=4, max_tokens=None)
    got = torch.cat([b.input_ids for b in ts.batches(3)])
    assert torch.equal(got, ts.input_ids) and ts.n_batches(3) == 3


def test_read_text_jsonl_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(
        json.dumps({"text": "one", "domain": "d1"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "ignored.bin").write_bytes(b"\0\1")
    docs = read_documents(tmp_path)
    assert docs == [Document("plain text", ""), Document("one", "d1"), Document("two", "")]


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A file saved with a UTF-8 byte-order mark (Windows editors, Excel's "UTF-8 CSV"): its JSONL was refused
    as "line 1: not valid JSON", its text began with U+FEFF (a token of its own). Read as without it; a U+FEFF
    later in a file is text."""
    bom = "\ufeff"
    (tmp_path / "a.jsonl").write_text(bom + json.dumps({"text": "one", "domain": "d1"}) + "\n" +
                                      json.dumps({"text": bom + "two"}) + "\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text(bom + "plain text", encoding="utf-8")
    assert read_documents(tmp_path) == [Document("one", "d1"), Document(bom + "two", ""), Document("plain text", "")]


@pytest.mark.parametrize("content,msg", [
    ("", "no text"),
    ("{not json}\n", "line 1: not valid JSON"),
    ('{"txt": "x"}\n', "needs a string field 'text'"),
])
def test_bad_jsonl_gives_one_line_error(tmp_path, content, msg):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(MoetoolError, match=msg):
        load_tokens(p, CharTokenizer())


@pytest.mark.parametrize("domain, shown", [
    (0, "the number 0"), (False, "the boolean false"), (True, "the boolean true"), (3, "the number 3"),
    (3.0, "the number 3.0"), (["a", "b"], 'the list ["a", "b"]'), ({"name": "code"}, 'the object {"name": "code"}'),
    (list(range(100)), "the list [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11..."),
])
def test_a_domain_that_is_not_a_string_is_refused_naming_the_line(tmp_path, domain, shown):
    """Issue 21.5: 0 and false merged with undomained text, 3 and 3.0 became two domains, a list became a string.
    Only a string (or null / missing: no domain) is a domain; anything else is one line naming file and line."""
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "fine", "domain": "code"}) + "\n\n" + json.dumps({"text": "x", "domain": domain})
                 + "\n")
    with pytest.raises(MoetoolError) as e:
        load_tokens(p, CharTokenizer())
    assert str(e.value) == (f"{p} line 3: 'domain' must be a string or null, got {shown} (quote it to use it as a "
                            f"domain name)")


def test_string_null_and_missing_domains_are_kept(tmp_path):
    p = tmp_path / "d.jsonl"
    recs = [{"text": "a", "domain": "3"}, {"text": "b", "domain": None}, {"text": "c"}, {"text": "d", "domain": ""},
            {"text": "e", "domain": "0"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [d.domain for d in read_documents(p)] == ["3", "", "", "", "0"]


def test_missing_and_empty_folder(tmp_path):
    with pytest.raises(MoetoolError, match="data not found"):
        read_documents(tmp_path / "nope")
    with pytest.raises(MoetoolError, match="no .txt"):
        read_documents(tmp_path)


def test_a_file_reached_twice_in_a_data_folder_is_refused(tmp_path):
    """A --data folder holding a file and a link to it (symbolic or hard: ``latest.jsonl -> v3.jsonl``) read the
    text twice: 2 documents, 2 x 17 packed characters, each counted as its own (a perplexity over twice the tokens,
    a bootstrap over copies). Refused in one line naming both, as import-trace refuses a dump file given twice; the
    file alone, and two different files, still read."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one unique text!!")
    assert len(read_documents(tmp_path / "d")) == 1
    (tmp_path / "d" / "b.txt").symlink_to("a.txt")
    with pytest.raises(MoetoolError, match=r"a\.txt and .*b\.txt are the same file \(a link\): its text would be "
                                           r"read twice"):
        read_documents(tmp_path / "d")
    (tmp_path / "d" / "b.txt").unlink()
    (tmp_path / "d" / "c.txt").hardlink_to(tmp_path / "d" / "a.txt")
    with pytest.raises(MoetoolError, match="are the same file"):
        read_documents(tmp_path / "d")
    (tmp_path / "d" / "c.txt").unlink()
    (tmp_path / "d" / "c.txt").write_text("one unique text!!")  # the same text in another file: two documents
    docs = read_documents(tmp_path / "d")
    assert docs == [Document("one unique text!!", ""), Document("one unique text!!", "")]
    assert pack(docs, CharTokenizer(), seq_len=40, max_tokens=None).n_tokens == 2 * 17 + 1  # and an EOS between


def test_a_data_folders_hidden_files_and_folders_are_not_data(tmp_path):
    """Jupyter keeps a copy of every file it saves in ``.ipynb_checkpoints/``: a --data folder with one was read
    twice over (both copies, 2 documents). Hidden entries (a name starting with '.') below the folder are left out
    (as ``.git``, ``.DS_Store``); a hidden folder named as --data itself is still read."""
    d = tmp_path / ".corpus"
    (d / ".ipynb_checkpoints").mkdir(parents=True)
    (d / "sub").mkdir()
    (d / "a.txt").write_text("alpha text")
    (d / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("alpha text")
    (d / "sub" / ".draft.txt").write_text("a hidden draft")
    (d / "sub" / "b.jsonl").write_text('{"text": "beta text"}\n')
    assert read_documents(d) == [Document("alpha text", ""), Document("beta text", "")]
    assert read_documents(d / "sub" / ".draft.txt") == [Document("a hidden draft", "")]  # named: read


# ----- lazy --data (issue #15) and special tokens (issue #12) ---------------------------------------------------
import moetool.data as data_mod  # noqa: E402
from moetool.data import DocumentStream, default_data_path  # noqa: E402


@pytest.fixture(scope="module")
def bpe():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_data_path().parents[1] / "tiny"))


def same_rows(a, b):
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask) \
        and a.domains == b.domains


def test_lazy_read_stops_early_and_never_reads_a_corrupt_tail(tmp_path, monkeypatch):
    """Reading stops once --max-tokens is reached: a corrupt tail past the needed prefix is never parsed, and
    the rows equal packing the valid documents eagerly."""
    monkeypatch.setattr(data_mod, "DOMAIN_SCAN_BYTES", 0)
    monkeypatch.setattr(data_mod, "TOKENIZE_BATCH", 4)
    docs = [Document(f"doc {i} " + "x" * (i % 7), "code" if i % 3 else "prose") for i in range(400)]
    p = tmp_path / "big.jsonl"
    p.write_text("".join(json.dumps({"text": d.text, "domain": d.domain}) + "\n" for d in docs) + "{corrupt\n")
    stream = DocumentStream(p)
    got = pack(stream, CharTokenizer(), seq_len=8, max_tokens=60, source=str(p))
    want = pack(docs, CharTokenizer(), seq_len=8, max_tokens=60)
    assert same_rows(got, want) and got.n_tokens == 60
    assert stream.bytes_read < p.stat().st_size / 10
    with pytest.raises(MoetoolError, match="not valid JSON"):  # the whole file does reach the tail
        load_tokens(p, CharTokenizer(), seq_len=8, max_tokens=None)


def test_domains_met_within_the_scan_bytes_interleave_as_before(tmp_path, monkeypatch):
    """A domain-sorted file: every domain within DOMAIN_SCAN_BYTES joins the interleave (as the eager packing
    did); a domain first met past both the scan and the needed tokens is not read (documented)."""
    monkeypatch.setattr(data_mod, "TOKENIZE_BATCH", 2)
    docs = [Document("a" * 30, "code")] * 20 + [Document("b" * 30, "prose")] * 20
    p = tmp_path / "sorted.jsonl"
    p.write_text("".join(json.dumps({"text": d.text, "domain": d.domain}) + "\n" for d in docs))
    got = load_tokens(p, CharTokenizer(), seq_len=16, max_tokens=64)
    assert same_rows(got, pack(docs, CharTokenizer(), seq_len=16, max_tokens=64))
    assert got.domains == ["code", "prose", "code", "prose"]
    monkeypatch.setattr(data_mod, "DOMAIN_SCAN_BYTES", 0)
    assert load_tokens(p, CharTokenizer(), seq_len=16, max_tokens=64).domains == ["code"] * 4


def test_growing_tokenizer_batches_pack_as_the_eager_read_and_stop_early(tmp_path, monkeypatch):
    """The first tokenizer calls take FIRST_BATCH documents, doubled per call up to TOKENIZE_BATCH: a domain done
    after a few documents is not tokenized a whole large batch further (the shipped text's 378 documents were all
    tokenized for --max-tokens 200). The rows equal the eager packing for every max_tokens, and a small max_tokens
    tokenizes few of the documents."""
    monkeypatch.setattr(data_mod, "DOMAIN_SCAN_BYTES", 0)
    monkeypatch.setattr(data_mod, "FIRST_BATCH", 1)
    monkeypatch.setattr(data_mod, "TOKENIZE_BATCH", 16)
    calls = []

    class Counting(CharTokenizer):
        is_fast = True  # one call per batch (data._encode)

        def __call__(self, text, add_special_tokens=False, **_):
            calls.append(len(text) if isinstance(text, list) else 1)
            if isinstance(text, list):
                return {"input_ids": [super(Counting, self).__call__(t)["input_ids"] for t in text]}
            return super().__call__(text)

    docs = [Document(f"doc {i} " + "y" * (i % 5), "code" if i % 2 else "prose") for i in range(200)]
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": d.text, "domain": d.domain}) + "\n" for d in docs))
    for max_tokens in (20, 100, 700, None):
        calls.clear()
        got = load_tokens(p, Counting(), seq_len=8, max_tokens=max_tokens)
        assert same_rows(got, pack(docs, CharTokenizer(), seq_len=8, max_tokens=max_tokens)), max_tokens
        sizes = [min(2 ** i, 16) for i in range(len(calls))]  # at most 1, 2, 4, 8, 16, 16, ... documents per call
        assert all(0 < c <= m for c, m in zip(calls, sizes)) and calls[:3] == [1, 2, 4][:len(calls[:3])], calls
        if max_tokens == 20:  # 20 tokens: the first few documents of each domain, not a whole 16-document batch
            assert sum(calls) < 16, calls
        if max_tokens is None:
            assert sum(calls) >= len(docs) and max(calls) == 16, calls  # every document read


def test_batched_fast_tokenizer_gives_the_ids_of_one_call_per_document(bpe):
    class OneByOne:  # the same tokenizer without batching
        is_fast = False
        eos_token_id, pad_token_id = bpe.eos_token_id, bpe.pad_token_id

        def __call__(self, text, **kw):
            return bpe(text, **kw)

    for seq_len, cap in [(64, 3000), (256, None)]:
        assert same_rows(load_tokens(None, bpe, seq_len, cap), load_tokens(None, OneByOne(), seq_len, cap))


def test_large_text_file_is_tokenized_by_prefix_with_the_ids_of_the_whole(tmp_path, monkeypatch, bpe):
    """A text file past TEXT_PREFIX_BYTES is read by a growing prefix cut at a line break: the same ids as
    tokenizing it whole, and invalid UTF-8 past the needed prefix is never decoded."""
    text = "\n\n".join(d.text for d in read_documents(None)) * 2
    p = tmp_path / "big.txt"
    p.write_bytes(text.encode("utf-8") + b"\nbad tail \xff\xfe")
    monkeypatch.setattr(data_mod, "TEXT_PREFIX_BYTES", 1000)
    whole = pack([Document(text + "\nbad tail ")], bpe, seq_len=64, max_tokens=None)
    for cap in (200, 3000):
        got = load_tokens(p, bpe, 64, cap)
        keep = got.attention_mask.bool()
        assert got.n_tokens == cap
        assert torch.equal(got.input_ids[keep], whole.input_ids[: keep.shape[0]][keep])
    with pytest.raises(MoetoolError, match=r"big\.txt: not UTF-8 text \(byte 0xff at offset"):
        load_tokens(p, bpe, 64, None)


class BosCharTokenizer(CharTokenizer):
    """Adds BOS (0) unless told not to, as Llama/Mixtral tokenizers do."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([0] if add_special_tokens else []) + super().__call__(text)["input_ids"]}


def test_special_tokens_follow_the_tokenizer_default_and_are_recorded():
    docs = [Document("ab"), Document("cde")]
    t = BosCharTokenizer()
    a, b, c, d, e = (ord(ch) % 200 + 3 for ch in "abcde")
    dflt = pack(docs, t, seq_len=9, max_tokens=None, add_special_tokens=None)
    assert dflt.input_ids.tolist() == [[0, a, b, 1, 0, c, d, e, 2]]
    assert dflt.describe()["special_tokens"] == {"add_special_tokens": "tokenizer default", "added_per_document": [0]}
    off = pack(docs, t, seq_len=9, max_tokens=None)  # today's behaviour stays the default
    assert off.input_ids.tolist() == [[a, b, 1, c, d, e, 2, 2, 2]]
    assert off.describe()["special_tokens"] == {"add_special_tokens": False, "added_per_document": []}


class Recording:
    """A fast tokenizer that records the length of every text it is given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        self.lengths.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return self.tok(text, **kw)


def test_one_long_line_is_tokenized_in_bounded_pieces_with_the_ids_of_its_prefix(tmp_path, monkeypatch, bpe):
    """Issue 21.9: one 52 MB line without a newline took 137 s and 7 GB for 1,024 tokens (the whole line was
    tokenized: no line break to cut at). Now the line is tokenized by a prefix cut at a space: the tokenizer sees
    at most 64k characters for 200 tokens, and the ids are the first ids of the text tokenized whole."""
    words = [d.text.split() for d in read_documents(None)]
    text = " ".join(w for ws in words for w in ws)  # one line, single spaces
    while len(text) < 400_000:
        text = text + " " + text
    assert "\n" not in text
    monkeypatch.setattr(data_mod, "TEXT_PREFIX_BYTES", 1000)
    want = list(bpe(text[: text.index(" ", 20_000)])["input_ids"])[:200]  # the whole text's first tokens
    for name, content in (("line.txt", text), ("line.jsonl", json.dumps({"text": text}) + "\n")):
        (tmp_path / name).write_text(content)
        tok = Recording(bpe)
        got = load_tokens(tmp_path / name, tok, 64, 200)
        assert got.n_tokens == 200 and got.input_ids[got.attention_mask.bool()].tolist() == want
        assert max(tok.lengths) <= 1 << 16, (name, max(tok.lengths))  # not the 400k+ characters of the line


def test_a_cut_the_tokenizer_does_not_split_at_is_never_used(tmp_path, monkeypatch):
    """The prefix is cut only where tokenizing text[:cut] alone gives the ids it has inside the longer text. A
    tokenizer whose ids depend on the whole text (here: on its length) never passes, so the file is tokenized whole
    and the ids are those of the whole text, never ids a whole-text tokenization would not give."""

    class WholeTextTokenizer:
        is_fast, eos_token_id, pad_token_id = True, 1, 2

        def __call__(self, text, return_offsets_mapping=False, add_special_tokens=False):
            out = {"input_ids": [ord(c) * 1_000_000 + len(text) for c in text]}
            if return_offsets_mapping:
                out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
            return out

    text = " ".join(["word"] * 30_000)  # one line of 150k characters
    (tmp_path / "line.txt").write_text(text)
    monkeypatch.setattr(data_mod, "TEXT_PREFIX_BYTES", 1000)
    got = load_tokens(tmp_path / "line.txt", WholeTextTokenizer(), 16, 100)
    assert got.input_ids[got.attention_mask.bool()].tolist() == WholeTextTokenizer()(text)["input_ids"][:100]


def test_a_long_document_packs_without_transformers_length_warning(tmp_path, capfd):
    """Issue 35 item 13: a document longer than the tokenizer's model_max_length (1,024 for the embedded tiny)
    packed into 256-token rows prints no "Token indices sequence length is longer ..." warning (moetool packs the
    rows itself); the ids are those of the tokenizer called on its own (counted here, warning and all)."""
    from moetool.loading import load_tokenizer

    tok = load_tokenizer("tiny")
    assert tok.model_max_length == 1024
    text = " ".join(f"word{i} and more" for i in range(800))
    (tmp_path / "doc.txt").write_text(text)
    ids = tok(text, add_special_tokens=False)["input_ids"]  # transformers warns here: the reference
    assert len(ids) > 2 * tok.model_max_length
    capfd.readouterr()
    tok.deprecation_warnings.clear()  # transformers warns once per tokenizer: armed again for moetool's call
    ts = load_tokens(tmp_path / "doc.txt", tok, seq_len=256, max_tokens=None)
    err = capfd.readouterr().err
    assert "Token indices sequence length" not in err, err
    assert ts.n_tokens == len(ids)
    assert ts.input_ids[ts.attention_mask.bool()].tolist() == ids


@pytest.mark.parametrize("docs, says", [
    ([Document("x", "")], "{src} has 1 token: at least 2 are needed to score a next token"),
    ([Document("x", "a"), Document("y", "b")],
     "{src} has 2 tokens, at most 1 in each of its 2 domains: at least 2 in one domain are needed to score a next "
     "token"),
    ([Document("", "")], "no tokens in {src} (empty text?)"),
    # 1 token over 2 domains (the other's text tokenizes to nothing): one token in all, not "at most 1 in each of
    # its 2 domains" (mutation pass 15: the 'total < 2' check dropped survived)
    ([Document("x", "a"), Document("", "b")], "{src} has 1 token: at least 2 are needed to score a next token"),
])
def test_too_few_tokens_says_how_many(docs, says):
    """'x' is one token, not "no tokens (empty text?)": the line counts what the text gave (CharTokenizer: one token
    per character, so the counts are the texts' lengths)."""
    with pytest.raises(MoetoolError) as e:
        pack(docs, CharTokenizer(), seq_len=4, max_tokens=None, source="one.txt")
    assert str(e.value) == says.format(src="one.txt")
    ts = pack([Document("xy", "")], CharTokenizer(), seq_len=4, max_tokens=None)  # 2 tokens: one scored
    assert ts.n_tokens == 2


@pytest.mark.slow
def test_a_one_token_file_is_refused_by_the_command_in_one_line(tmp_path):
    """The tester's case on the embedded tokenizer: 'x' tokenizes to one token (counted with the tokenizer itself);
    'x\\n' to two, which run."""
    from typer.testing import CliRunner

    import moetool
    from moetool.commands.app import app

    tok = moetool.loading.load_tokenizer("tiny")
    assert len(tok("x", add_special_tokens=False)["input_ids"]) == 1
    (tmp_path / "one.txt").write_text("x")
    r = CliRunner().invoke(app, ["ppl", "--data", str(tmp_path / "one.txt"), "--out", str(tmp_path / "run"), "-q"])
    assert r.exit_code == 2 and r.output.strip() == (f"error: {tmp_path / 'one.txt'} has 1 token: at least 2 are "
                                                     "needed to score a next token"), r.output


def test_an_empty_data_name_is_refused_not_read_as_the_held_out_text_or_the_current_folder(tmp_path, monkeypatch,
                                                                                           capsys):
    """``moetool.tokens(lm, "")`` packed the shipped held-out text (the ids of ``data=None``) and the command's
    ``--data ""`` (Path("") = ".") every text file under the current folder, each a table of text nobody named;
    ``--out ""`` wrote the run into the current folder, ``report ""`` gathered it. A list as the data raised a
    TypeError. Each is one line now, nothing written."""
    import sys

    import moetool
    import moetool.commands.app as app_module

    for name in ("", "  "):
        with pytest.raises(MoetoolError, match=r"^--data is an empty name: give a file or folder"):
            DocumentStream(name)
    lm = moetool.load("tiny")
    with pytest.raises(MoetoolError, match=r"^--data is a file or folder name .*not list \['a.txt'\]"):
        moetool.tokens(lm, ["a.txt"], seq_len=64, max_tokens=128)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOETOOL_DEBUG", raising=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args, flag in ((["ppl", "--data", "", "--max-tokens", "64", "--out", "run", "-q"], "'--data' / '-d'"),
                       (["ppl", "--max-tokens", "64", "--out", " ", "-q"], "'--out' / '-o'"),
                       (["stats", "--trace", "", "--out", "run"], "'--trace'"),
                       (["report", "", "--out", "run"], "'RUN_DIR...'")):
        monkeypatch.setattr(sys, "argv", ["moetool", *args])
        with pytest.raises(SystemExit) as e:
            app_module.main()
        assert e.value.code == 2, args
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert err == [f"error: Invalid value for {flag}: an empty path (the current folder is '.') "
                       f"(see 'moetool {args[0]} --help')"], err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_float_attention_mask_is_named_by_its_dtype():
    """A 0.0/1.0 float mask was refused with "must hold 0 (padding) and 1 (a real token) only", which it does: the
    line names the dtype and the conversion. A mask of 2s is still refused by its values."""
    import dataclasses

    from moetool.data import TokenSet, check_packed

    t = TokenSet(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 0]]), [""], "test")
    check_packed(t)
    with pytest.raises(MoetoolError, match=r"^packed tokens' attention_mask must be an integer \(or bool\) tensor "
                                           r"of 0 and 1, not float32 \(mask.long\(\) converts it\)$"):
        check_packed(dataclasses.replace(t, attention_mask=t.attention_mask.float()))
    check_packed(dataclasses.replace(t, attention_mask=t.attention_mask.float().long()))
    with pytest.raises(MoetoolError, match=r"must hold 0 \(padding\) and 1 \(a real token\) only"):
        check_packed(dataclasses.replace(t, attention_mask=t.attention_mask * 2))


# ----- packing against a hand-written reference (mutation pass 4) -----------------------------------------------
def reference_rows(texts_domains, seq_len, max_tokens):
    """Packing as the module docstring says it, written out: blank documents dropped, a domain's documents joined by
    EOS (1) in order of appearance, cut into rows of ``seq_len``, domains interleaved in order of first appearance,
    at most ``max_tokens`` real tokens, a row of fewer than 2 real tokens dropped, right-padded with 2."""
    t = CharTokenizer()
    streams = {}
    for text, dom in texts_domains:
        if not text.strip():
            continue
        s = streams.setdefault(dom or "", [])
        s += ([1] if s else []) + t(text)["input_ids"]
    cut = [[(s[i:i + seq_len], d) for i in range(0, len(s), seq_len)] for d, s in streams.items()]
    ids, mask, doms, total = [], [], [], 0
    for r in range(max(map(len, cut))):
        for rows in cut:
            if r >= len(rows):
                continue
            toks, d = rows[r]
            if max_tokens is not None:
                toks = toks[:max(max_tokens - total, 0)]
            if len(toks) >= 2:
                total += len(toks)
                ids.append(toks + [2] * (seq_len - len(toks)))
                mask.append([1] * len(toks) + [0] * (seq_len - len(toks)))
                doms.append(d)
    return ids, mask, doms


def test_packing_equals_a_hand_reference_read_whole_and_read_lazily(tmp_path, monkeypatch):
    """Random corpora (3 domains met in an unsorted order, blank documents among them), seq_len and max_tokens: the
    rows packed from a list and from a lazily read JSONL (reading may stop once every domain was met) equal the
    hand reference -- the token count, which domain gets the capped last rows, the EOS joins. Killed mutations: a
    domain stream that stops growing at floor(max_tokens / seq_len) rows (20 tokens asked, 16 packed), domains
    interleaved in sorted order, a stop decided on a partial row counted as full, JSONL bytes never counted (the
    read never stops: the corrupt tail is parsed), blank JSONL documents packed as whitespace tokens."""
    import random

    rng = random.Random(4)
    monkeypatch.setattr(data_mod, "TOKENIZE_BATCH", 3)
    # the closed case first: three 8-token documents, max_tokens 20 in rows of 8 -> rows of 8, 8 and 4 tokens
    docs = [Document("abcdefgh", "")] * 3
    ts = pack(docs, CharTokenizer(), seq_len=8, max_tokens=20)
    assert ts.n_tokens == 20 and ts.attention_mask.sum(1).tolist() == [8, 8, 4]
    stopped_early = 0
    for trial in range(150):
        names = rng.sample(["zeta", "alpha", "mid"], 3)  # first-appearance order, not sorted
        recs = [(rng.choice("abcdefgh") * rng.randint(1, 9), d) for d in names]
        for _ in range(rng.randint(0, 40)):
            text = " \n " if rng.random() < 0.1 else "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 12)))
            recs.append((text, rng.choice(names)))
        seq_len = rng.randint(2, 9)
        max_tokens = rng.choice([None, rng.randint(2, 90)])
        want = reference_rows(recs, seq_len, max_tokens)
        got = pack([Document(t, d) for t, d in recs if t.strip()], CharTokenizer(), seq_len=seq_len,
                   max_tokens=max_tokens)
        assert (got.input_ids.tolist(), got.attention_mask.tolist(), got.domains) == want, (trial, seq_len, max_tokens)
        lines = [json.dumps({"text": t, "domain": d}) + "\n" for t, d in recs]
        monkeypatch.setattr(data_mod, "DOMAIN_SCAN_BYTES", len("".join(lines[:3]).encode()))  # every domain met
        for tail in ("", "{corrupt\n"):
            p = tmp_path / f"c{trial}-{bool(tail)}.jsonl"
            p.write_text("".join(lines) + tail)
            try:
                lazy = load_tokens(p, CharTokenizer(), seq_len=seq_len, max_tokens=max_tokens)
            except MoetoolError as e:  # the rows needed the whole corpus: its corrupt tail is reached, as it must be
                assert tail and "line %d: not valid JSON" % (len(lines) + 1) in str(e)
                continue
            stopped_early += bool(tail)
            assert (lazy.input_ids.tolist(), lazy.attention_mask.tolist(), lazy.domains) == want, (trial, tail)
    assert stopped_early >= 40  # reading stopped before the corrupt tail in many corpora


def test_a_blank_text_file_in_a_data_folder_adds_no_tokens(tmp_path):
    """A whitespace-only .txt beside a real one is no document: the packed tokens are the real file's alone (no
    whitespace ids, no EOS joining it)."""
    (tmp_path / "a.txt").write_text("  \n\t\n")
    (tmp_path / "b.txt").write_text("hello")
    ts = load_tokens(tmp_path, CharTokenizer(), seq_len=8, max_tokens=None)
    assert ts.input_ids.tolist() == [[ord(c) % 200 + 3 for c in "hello"] + [2, 2, 2]] and ts.n_tokens == 5


def test_describe_and_fingerprint_record_what_was_packed():
    """The manifest's data block counts real tokens (11 of 12 positions here, not the padded 12), and the resume
    fingerprint changes with the ids, the padding mask and the domains each (same ids under other domain labels
    would resume per-domain tables of other rows); --max-tokens 1 is refused as such, not as 'too few tokens'."""
    from dataclasses import replace

    docs = [Document("abcde", "code"), Document("xyz", "prose"), Document("fg", "code")]
    ts = pack(docs, CharTokenizer(), seq_len=4, max_tokens=None, source="s")
    d = ts.describe()
    assert (d["tokens"], d["rows"], d["seq_len"], d["domains"]) == (11, 3, 4, ["code", "prose"])
    fp = ts.fingerprint()
    assert (fp["rows"], fp["tokens"]) == (3, 11)
    mask = ts.attention_mask.clone()
    mask[1, 2] = 0
    ids = ts.input_ids.clone()
    ids[0, 0] += 1
    others = [replace(ts, domains=["prose", "code", "code"]), replace(ts, attention_mask=mask),
              replace(ts, input_ids=ids)]
    hashes = {fp["sha256"], *(o.fingerprint()["sha256"] for o in others)}
    assert len(hashes) == 4 and replace(ts).fingerprint() == fp
    with pytest.raises(MoetoolError, match="--max-tokens must be at least 2"):
        pack(docs, CharTokenizer(), seq_len=4, max_tokens=1)


def test_a_domain_that_gets_no_row_is_named_with_why():
    """A domain whose text is one token, or that --max-tokens leaves without a row, is in no per-domain table: the
    TokenSet records it with the reason (before: it vanished without a word; break-it run 4)."""
    from moetool.data import unpacked_lines

    docs = [Document("abcdefgh", "a"), Document("x", "b"), Document("mnop", "c")]
    ts = pack(docs, CharTokenizer(), seq_len=4, max_tokens=None)
    assert sorted(set(ts.domains)) == ["a", "c"] and ts.n_tokens == 12  # 8 + 4; b's one token makes no row
    assert ts.unpacked == {"b": "its text has 1 token (a row needs 2)"}
    assert unpacked_lines(ts) == ["note: --data domain 'b' has no row, so no per-domain result: its text has 1 "
                                  "token (a row needs 2)"]
    ts = pack(docs, CharTokenizer(), seq_len=4, max_tokens=4)  # a's first row takes the 4 tokens
    assert ts.domains == ["a"] and ts.n_tokens == 4
    assert ts.unpacked == {"b": "its text has 1 token (a row needs 2)",
                           "c": "--max-tokens 4 was reached before its first row"}
    ts = pack(docs[:1] + docs[2:], CharTokenizer(), seq_len=4, max_tokens=None)
    assert ts.unpacked == {} and unpacked_lines(ts) == []


@pytest.mark.slow
def test_a_command_says_which_domain_got_no_row(tmp_path, no_figures):
    """``stats`` on a JSONL whose domain 'short' is one token: its domain table has no 'short' row, and the console
    says so in one line."""
    # console and domain_load.csv only (no_figures): stats' figures are checked in tests/test_help_files.py
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 20, "domain": "long"}) + "\n"
                    + json.dumps({"text": "x", "domain": "short"}) + "\n")
    r = CliRunner().invoke(app, ["stats", "--data", str(data), "--max-tokens", "256", "--bootstrap", "0", "-q",
                                 "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert ("note: --data domain 'short' has no row, so no per-domain result: its text has 1 token (a row needs 2)"
            in r.output.splitlines()), r.output
    assert set(pd.read_csv(tmp_path / "run" / "domain_load.csv")["domain"]) == {"long"}


# ----- break-it run 13: what a researcher feeds --data -------------------------------------------------------------
def test_an_upper_case_suffix_is_read_by_its_format(tmp_path):
    """``c.JSONL`` given as --data was read as plain text: its JSON syntax packed as tokens ('{"text": "alpha"...',
    30 characters where the text is 5), a plausible table of the wrong text; a folder's ``A.TXT`` was left out
    (1 of 2 documents). Suffixes match whatever their case."""
    (tmp_path / "c.JSONL").write_text(json.dumps({"text": "alpha", "domain": "d"}) + "\n")
    assert read_documents(tmp_path / "c.JSONL") == [Document("alpha", "d")]
    ts = load_tokens(tmp_path / "c.JSONL", CharTokenizer(), seq_len=8, max_tokens=None)
    assert ts.n_tokens == 5 and ts.input_ids[0, :5].tolist() == [ord(c) % 200 + 3 for c in "alpha"]
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "A.TXT").write_text("upper")
    (tmp_path / "f" / "b.txt").write_text("lower")
    (tmp_path / "f" / "c.Md").write_text("mixed")
    assert read_documents(tmp_path / "f") == [Document("upper"), Document("lower"), Document("mixed")]
    assert load_tokens(tmp_path / "f", CharTokenizer(), seq_len=32, max_tokens=None).n_tokens == 3 * 5 + 2  # 2 EOS


@pytest.mark.parametrize("name, content, hint", [
    ("list.json", json.dumps([{"text": "hello there"}]), r"jq -c '\.\[\]' FILE\.json > FILE\.jsonl"),
    ("obj.JSON", json.dumps({"text": "hello there"}), "jq -c"),
    ("rows.csv", "text,label\nhello there,1\n", "or the text column as a .txt"),
    ("rows.tsv", "text\tlabel\nhello there\t1\n", "or the text column as a .txt"),
    ("lines.ndjson", json.dumps({"text": "hello there"}) + "\n", r"under a \.jsonl name \(rename it\)"),
])
def test_a_structured_file_is_refused_not_packed_as_text(tmp_path, name, content, hint):
    """A .json list of records (or a .csv with a text column) given as --data was read as one text document: its
    brackets, keys and header packed as tokens (``[{"text": "hello there"}]``: 28 tokens of 11 characters of text)
    into a table like any other. Refused by name in one line saying what to give; in a folder such files are
    still left out, as before."""
    (tmp_path / name).write_text(content)
    with pytest.raises(MoetoolError, match=rf"^data file .*{name}: a \.{name.split('.')[-1].lower()} file is not "
                                           rf"read as text \(its syntax would be packed as tokens\): give .*{hint}"):
        load_tokens(tmp_path / name, CharTokenizer(), seq_len=8, max_tokens=None)
    (tmp_path / "a.txt").write_text("hello there")
    assert read_documents(tmp_path) == [Document("hello there")]


def test_text_that_is_not_utf8_is_refused_naming_what_it_is(tmp_path, monkeypatch, bpe):
    """UTF-16 text without a byte-order mark (every other byte 0) decoded as UTF-8 and packed a NUL after each
    character: 'hello' gave 10 tokens, a perplexity of text nobody wrote. Refused in one line, as is UTF-16 with its
    mark, latin-1 and a NUL past the prefix of a large file (read by prefix)."""
    (tmp_path / "le.txt").write_bytes("hello".encode("utf-16-le"))
    assert len("hello".encode("utf-16-le").decode("utf-8")) == 10  # what was packed before
    with pytest.raises(MoetoolError, match=r"le\.txt: holds NUL characters, so it is not UTF-8 text \(UTF-16\? a "
                                           r"binary file\?\): save it as UTF-8 \(e\.g\. iconv -f utf-16 -t utf-8\)$"):
        load_tokens(tmp_path / "le.txt", CharTokenizer(), seq_len=8, max_tokens=None)
    (tmp_path / "bom.txt").write_bytes("hello".encode("utf-16"))
    with pytest.raises(MoetoolError, match=r"bom\.txt: not UTF-8 text \(UTF-16, by its byte-order mark\): save it "
                                           r"as UTF-8 \(e\.g\. iconv -f utf-16 -t utf-8\)"):
        read_documents(tmp_path / "bom.txt")
    (tmp_path / "l1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(MoetoolError, match=r"l1\.jsonl: line 2: not UTF-8 text \(byte 0xe9 at offset 13\).*iconv "
                                           r"-f latin1 -t utf-8"):
        read_documents(tmp_path / "l1.jsonl")
    monkeypatch.setattr(data_mod, "TEXT_PREFIX_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("plain words here\n" * 12000 + "x\x00y\n")  # 204 kB: read by prefix (64k characters first)
    with pytest.raises(MoetoolError, match="big\\.txt: holds NUL characters"):
        load_tokens(big, bpe, 64, None)
    assert load_tokens(big, bpe, 16, 32).n_tokens == 32  # a prefix before the NUL is text: read as before
    early = tmp_path / "early.txt"  # the NUL inside the prefix read for 32 tokens (pass 17: packed silently)
    early.write_text("plain words here\n" * 100 + "x\x00y\n" + "plain words here\n" * 12000)
    with pytest.raises(MoetoolError, match="early\\.txt: holds NUL characters"):
        load_tokens(early, bpe, 16, 32)


def test_an_unpaired_surrogate_escape_in_jsonl_is_refused_naming_the_line(tmp_path, bpe):
    """``{"text": "a \\ud800 b"}`` decodes to a string no tokenizer encodes: the fast tokenizer raised a TypeError
    traceback ('TextEncodeInput must be Union[...]'); in ``domain`` it reached the CSV writer after the whole run.
    One line naming the file, line and field; a valid escape (\\u00e9) still reads."""
    p = tmp_path / "s.jsonl"
    p.write_text('{"text": "caf\\u00e9 ok"}\n{"text": "a \\ud800 b"}\n')
    with pytest.raises(MoetoolError, match=r"s\.jsonl line 2: 'text' holds an unpaired surrogate escape"):
        load_tokens(p, bpe, 16, None)
    p.write_text('{"text": "caf\\u00e9 ok"}\n{"text": "b", "domain": "x\\udfff"}\n')
    with pytest.raises(MoetoolError, match=r"s\.jsonl line 2: 'domain' holds an unpaired surrogate escape"):
        read_documents(p)
    p.write_text('{"text": "caf\\u00e9 ok"}\n{"text": "\\ud83d\\ude00 smile"}\n')  # a pair: one character
    assert read_documents(p) == [Document("caf\u00e9 ok"), Document("\U0001F600 smile")]
    assert load_tokens(p, bpe, 16, None).n_tokens == sum(
        len(bpe(t, add_special_tokens=False)["input_ids"]) for t in ("caf\u00e9 ok", "\U0001F600 smile")) + 1


def test_a_domain_whose_text_is_blank_is_named_not_left_out_in_silence(tmp_path):
    """A JSONL domain whose every document is whitespace ('   ', '\\n') vanished from the per-domain tables without
    the note a one-token domain gets. It is named now, with why; a blank document beside real text of its domain
    adds nothing and says nothing."""
    from moetool.data import unpacked_lines

    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": "abcdefgh", "domain": "a"}, {"text": "   ", "domain": "empty"}, {"text": "\n", "domain": "empty"},
        {"text": " ", "domain": "a"}, {"text": "xy", "domain": "c"}, {"text": "\t", "domain": ""}]))
    ts = load_tokens(p, CharTokenizer(), seq_len=4, max_tokens=None)
    assert ts.domains == ["a", "c", "a"] and ts.n_tokens == 8 + 2
    assert ts.unpacked == {"empty": "its text is blank (whitespace only)"}
    assert unpacked_lines(ts) == ["note: --data domain 'empty' has no row, so no per-domain result: its text is blank "
                                  "(whitespace only)"]


def test_a_linked_folder_in_a_data_folder_is_read_once_and_a_loop_is_not_followed(tmp_path):
    """``corpus/code -> /datasets/code`` was left out without a word (``Path.rglob`` follows no folder link): a table
    over ``m.txt`` alone, 9 of 26 characters. Links to folders are followed now, each folder read once (a second
    link to it adds nothing, so nothing is counted twice), and a link back up (``self -> ..``) is never followed
    (it would read the corpus' neighbours: ``outside.txt``)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "e.txt").write_text("elsewhere text")
    (tmp_path / "outside.txt").write_text("not in the corpus")
    c = tmp_path / "corpus"
    c.mkdir()
    (c / "m.txt").write_text("main text")
    (c / "code").symlink_to(tmp_path / "elsewhere")
    assert read_documents(c) == [Document("elsewhere text"), Document("main text")]
    (c / "again").symlink_to(tmp_path / "elsewhere")  # a second name for the same folder: read once
    (c / "self").symlink_to("..")
    (c / "loop").symlink_to(".")
    docs = read_documents(c)
    assert docs == [Document("elsewhere text"), Document("main text")]
    assert pack(docs, CharTokenizer(), seq_len=64, max_tokens=None).n_tokens == 14 + 1 + 9


def test_a_large_file_read_by_prefix_that_is_not_utf8_names_the_byte_and_its_offset(tmp_path, monkeypatch, bpe):
    """A file read by prefix (over TEXT_PREFIX_BYTES, --max-tokens reached within it) whose prefix holds a latin-1
    byte: the same one line as a small file's, naming the byte and its offset (5: 'plain' then 0xe9), not 'cannot
    read data file ...: 'utf-8' codec can't decode' (mutation pass 16: _encode_prefix's own decoding error); a bad
    byte past what is read leaves the prefix read as before, and read whole it is named at its offset (204000)."""
    monkeypatch.setattr(data_mod, "TEXT_PREFIX_BYTES", 1000)
    lines = b"plain words here\n" * 12000
    big = tmp_path / "big.txt"
    big.write_bytes(lines[:5] + b"\xe9" + lines[5:])
    with pytest.raises(MoetoolError, match=r"^data file .*big\.txt: not UTF-8 text \(byte 0xe9 at offset 5\): "
                                           r"save it as UTF-8 \(e\.g\. iconv -f latin1 -t utf-8\)"):
        load_tokens(big, bpe, 16, 64)
    big.write_bytes(lines + b"\xe9\n")
    assert load_tokens(big, bpe, 16, 32).n_tokens == 32
    with pytest.raises(MoetoolError, match=r"big\.txt: not UTF-8 text \(byte 0xe9 at offset 204000\)"):
        load_tokens(big, bpe, 64, None)


def test_a_broken_link_in_a_data_folder_is_one_line_not_left_out(tmp_path):
    """``corpus/b.txt -> /datasets/b.txt`` whose target is gone (a moved dataset, an unmounted disk) was skipped in
    silence (mutation pass 16, D12): the tables covered ``a.txt`` alone, 6 characters where the corpus named two
    files. Now one line naming the link and its target; a link to a file that exists is read (its text counted)."""
    c = tmp_path / "corpus"
    c.mkdir()
    (c / "a.txt").write_text("a text")
    (tmp_path / "b_real.txt").write_text("b words")
    (c / "b.txt").symlink_to(tmp_path / "b_real.txt")
    assert read_documents(c) == [Document("a text"), Document("b words")]
    assert pack(read_documents(c), CharTokenizer(), seq_len=64, max_tokens=None).n_tokens == 6 + 1 + 7
    (tmp_path / "b_real.txt").unlink()
    with pytest.raises(MoetoolError, match=rf"^data file {re.escape(str(c / 'b.txt'))} is a link to "
                                           rf"{re.escape(str(tmp_path / 'b_real.txt'))}, which does not exist: "
                                           r"mend or remove it"):
        read_documents(c)
