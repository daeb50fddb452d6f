"""The public wrappers pass each argument to the option it names (mutation testing, part 7)."""

from __future__ import annotations

import pytest
import torch

import moetool


@pytest.fixture(scope="module")
def lm():
    return moetool.load("tiny")


def test_load_passes_its_dtype():
    for dtype, want in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        m = moetool.load("tiny", dtype=dtype, tokenizer=False)
        assert {p.dtype for p in m.model.parameters()} == {want} and m.tokenizer is None


def test_tokens_adds_no_special_token_by_default():
    """The default is ``add_special_tokens=False`` (every command but stats): a BOS-adding tokenizer adds none."""
    from tokenizers.processors import TemplateProcessing

    lm = moetool.load("tiny")
    tok = lm.tokenizer
    bos = tok.convert_ids_to_tokens(0)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    kw = {"seq_len": 32, "max_tokens": 256}
    plain, none_added = moetool.tokens(lm, None, **kw), moetool.tokens(lm, None, add_special_tokens=False, **kw)
    with_bos = moetool.tokens(lm, None, add_special_tokens=None, **kw)
    assert torch.equal(plain.input_ids, none_added.input_ids)
    assert int((with_bos.input_ids == 0).sum()) > int((plain.input_ids == 0).sum())  # (the BOS is there to add)


def test_hook_hands_attention_when_asked(lm):
    ids = torch.randint(0, lm.model.config.vocab_size, (1, 12))
    for attention in (True, False):
        events = []
        with moetool.hook(lm, consumers=[events.append], attention=attention):
            lm.model(input_ids=ids)
        assert len(events) == len(lm.layers)
        for ev in events:
            assert (ev.attn is not None) == attention
            if attention:  # [B, heads, S, S] probabilities: each row sums to 1
                assert ev.attn.shape[-2:] == (12, 12)
                torch.testing.assert_close(ev.attn.float().sum(-1), torch.ones(ev.attn.shape[:-1]))


def test_from_trace_of_stats_or_placement_refuses_a_token_cap(tmp_path, lm):
    """stats and placement from a trace read every token it holds (as ``--trace`` with ``--max-tokens`` is
    refused): a cap is one line, not tables of fewer tokens than asked or more."""
    from moetool.errors import MoetoolError

    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=128)
    moetool.run("trace", lm, toks, out=tmp_path / "tr", quiet=True)
    for name in ("stats", "placement"):
        with pytest.raises(MoetoolError, match=f"{name} from a trace reads every token"):
            moetool.from_trace(name, tmp_path / "tr", max_tokens=64)
    assert moetool.from_trace("offload", tmp_path / "tr", max_tokens=64, bootstrap=0).tables


def test_a_result_that_names_its_model_keeps_it(lm):
    """agreement given a model's name records the model it loaded (its manifest: name, source, dtype...), not the
    bare name the wrapper was given."""
    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    res = moetool.agreement("tiny", toks, precisions=("fp32", "bf16"), bootstrap=0, layers=(1,), quiet=True)
    assert isinstance(res.model, dict) and res.model["name"] == "tiny" and res.model.get("source")
    assert moetool.erc(lm, quiet=True).model == lm.manifest()  # a loaded model: its own manifest


def test_write_report_replaces_an_existing_out_only_with_force(tmp_path):
    from moetool.errors import MoetoolError

    run = moetool.write(moetool.erc(moetool.load("tiny", tokenizer=False), quiet=True), tmp_path / "erc")
    out = tmp_path / "rep"
    page = moetool.write_report([run], out)
    assert page == out / "report.html" and page.is_file()
    with pytest.raises(MoetoolError):
        moetool.write_report([run], out)
    assert moetool.write_report([run], out, force=True) == page and page.is_file()


def test_run_demo_runs_only_the_steps_asked(tmp_path):
    import json

    folder = moetool.run_demo(tmp_path / "demo", steps=["inspect"], quiet=True)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["options"]["steps"] == ["inspect"] and [s["step"] for s in m["steps"]] == ["inspect"]


def test_import_trace_refuses_a_dense_config_before_reading_the_dump(tmp_path):
    from transformers import LlamaConfig

    from moetool.errors import MoetoolError

    d = tmp_path / "dense"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2).save_pretrained(d)
    dump = tmp_path / "dump.pt"
    dump.write_bytes(b"not read")
    with pytest.raises(MoetoolError, match="no MoE layer"):
        moetool.import_trace([dump], str(d), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_placement_reads_the_config_given_before_the_results_model(tmp_path, lm):
    """sglang's file is laid out by ``config`` when given (the result's model only when not): a config that cannot
    be read is refused, not replaced by the result's model."""
    from moetool.errors import MoetoolError

    toks = moetool.tokens(lm, None, seq_len=32, max_tokens=128)
    res = moetool.placement(lm, toks, gpus=[2], extra_slots=[0], bootstrap=0, quiet=True)
    with pytest.raises(MoetoolError, match="no-such-model"):
        moetool.export_placement(res, "sglang", tmp_path / "a.json", config="no-such-model")
    assert not (tmp_path / "a.json").exists()
    assert moetool.export_placement(res, "sglang", tmp_path / "b.json", config="tiny").is_file()
    assert moetool.export_placement(res, "sglang", tmp_path / "c.json").read_bytes() == \
        (tmp_path / "b.json").read_bytes()
