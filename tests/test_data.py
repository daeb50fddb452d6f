"""--data reading and packing: domains, padding, caps, and one-line errors."""

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


def test_missing_and_empty_folder(tmp_path):
    with pytest.raises(MoetoolError, match="data not found"):
        read_documents(tmp_path / "nope")
    with pytest.raises(MoetoolError, match="no .txt"):
        read_documents(tmp_path)
