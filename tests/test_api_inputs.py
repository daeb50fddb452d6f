"""The Python API's inputs a researcher may pass by mistake, and runs in threads.

Each wrong input is one :class:`MoetoolError` line before any table: tokens packed with another model's tokenizer,
a TokenSet sliced by hand (parts of different rows) or of numpy arrays, a model on the meta device, a model a
``moetool.hook`` block left hooked, ``True`` as a layer. A loaded model runs one run at a time: a second run on it
from another thread (whose forwards would fire the first's hooks) is refused in one line, and runs on two models
in two threads give exactly the tables of the same runs one after the other."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading

import numpy as np
import pytest
import torch

import moetool
from moetool.errors import MoetoolError

from conftest import feed, hand_ppl


@pytest.fixture(scope="module")
def lm():
    return moetool.load("tiny", device="cpu")


@pytest.fixture(scope="module")
def tokens(lm):
    return moetool.tokens(lm, None, seq_len=32, max_tokens=256)


def _ppl(lm, tokens, **kw):
    return moetool.ppl(lm, tokens, bootstrap=0, quiet=True, **kw)["ppl"].iloc[0]


def _other_tokenizer():
    """A word-level tokenizer of 1,502 ids: every id it packs is inside tiny's 2,048-id vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(open(moetool.data.__file__).read().split()))[:1500]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<pad>", *words])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")


def test_tokens_of_another_tokenizer_are_refused_not_scored(lm, tokens, tmp_path):
    """Ids packed by another vocabulary that the model's happens to cover were scored as other tokens (a
    perplexity of text the model never saw); the same vocabulary (tiny's tokens on tiny-fine) is the same tokens."""
    other = moetool.tokens(dataclasses.replace(lm, tokenizer=_other_tokenizer()), None, seq_len=32, max_tokens=256)
    assert int(other.input_ids.max()) < 2048  # inside tiny's vocabulary: the id range check cannot see it
    for call in (lambda: _ppl(lm, other), lambda: moetool.stats(lm, other, bootstrap=0, quiet=True),
                 lambda: moetool.forward(lm, other, nll=True, quiet=True),
                 lambda: moetool.run("topk", lm, other, out=str(tmp_path / "topk"), quiet=True)):
        with pytest.raises(MoetoolError, match="another tokenizer"):
            call()
    assert not (tmp_path / "topk").exists()
    fine = moetool.load("tiny-fine", device="cpu")  # one tokenizer for both embedded models: accepted
    ref, n = hand_ppl(fine.model, tokens, 64)
    row = _ppl(fine, tokens)
    assert row["scored_tokens"] == n and row["perplexity"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("experiment", ["ppl", "stats", "approx", "margin", "placement", "locality", "topk"])
def test_a_token_set_sliced_by_hand_is_one_line(lm, tokens, experiment):
    """Rows of ``input_ids[:2]`` with the mask or the domains of all 8 rows gave tracebacks from inside the
    experiments, or tables (approx, margin, placement, locality: the mask's rows; every experiment but stats
    and mass-recall: the domains of other rows); numpy arrays an AttributeError."""
    t = tokens
    bad = {
        "mask of other rows": dataclasses.replace(t, input_ids=t.input_ids[:2]),
        "domains of other rows": dataclasses.replace(t, input_ids=t.input_ids[:2], attention_mask=t.attention_mask[:2]),
        "numpy": dataclasses.replace(t, input_ids=t.input_ids.numpy(), attention_mask=t.attention_mask.numpy()),
        "float ids": dataclasses.replace(t, input_ids=t.input_ids.float()),
        "int16 ids": dataclasses.replace(t, input_ids=t.input_ids.to(torch.int16)),  # torch's embedding traceback
        "uint8 ids": dataclasses.replace(t, input_ids=(t.input_ids % 256).to(torch.uint8)),
        "mask of 2s": dataclasses.replace(t, attention_mask=t.attention_mask * 2),
    }
    for what, given in bad.items():
        with pytest.raises(MoetoolError, match="packed tokens") as e:
            getattr(moetool, experiment)(lm, given, quiet=True)
        assert "\n" not in str(e.value), what


def test_int32_ids_are_the_int64_ids_numbers(lm, tokens):
    """int32 ids (an embedding takes them, as int64) run and give the same numbers; narrower ones are refused."""
    narrow = dataclasses.replace(tokens, input_ids=tokens.input_ids.int())
    ref, _ = hand_ppl(lm.model, tokens)
    assert _ppl(lm, narrow)["perplexity"] == _ppl(lm, tokens)["perplexity"] == pytest.approx(ref, rel=1e-6)


def test_a_token_set_sliced_alike_is_those_rows(lm, tokens):
    """Every part sliced alike is accepted, and is the perplexity of those rows."""
    t = tokens
    two = dataclasses.replace(t, input_ids=t.input_ids[2:4], attention_mask=t.attention_mask[2:4],
                              domains=t.domains[2:4])
    ref, n = hand_ppl(lm.model, two, 64)
    row = _ppl(lm, two)
    assert row["scored_tokens"] == n == 62 and row["perplexity"] == pytest.approx(ref, rel=1e-5)


def test_a_model_on_the_meta_device_is_one_line(tokens):
    meta = moetool.load("tiny", device="cpu")
    meta.model.to("meta")
    for call in (lambda: _ppl(meta, tokens), lambda: moetool.stats(meta, tokens, bootstrap=0, quiet=True),
                 lambda: moetool.erc(meta, samples=2, quiet=True),
                 lambda: moetool.expert_similarity(meta, tokens, quiet=True),
                 lambda: moetool.forward(meta, tokens, nll=True, quiet=True)):
        with pytest.raises(MoetoolError, match="meta device"):
            call()


def test_a_model_left_hooked_is_refused_then_free(lm, tokens):
    """A ``moetool.hook(policy=...)`` entered and not left rerouted every later run of the model: ``ppl`` with
    the router's routing gave the norm policy's perplexity (95.5 instead of 52.8). Now refused until it is left."""
    ref, n = hand_ppl(lm.model, tokens, 64)
    hook = moetool.hook(lm, policy="norm:gate")
    hook.__enter__()
    try:
        for call in (lambda: _ppl(lm, tokens), lambda: moetool.forward(lm, tokens, nll=True, quiet=True),
                     lambda: moetool.hook(lm).__enter__()):
            with pytest.raises(MoetoolError, match="moetool.hook block in this thread"):
                call()
    finally:
        hook.__exit__(None, None, None)
    row = _ppl(lm, tokens)
    assert row["scored_tokens"] == n and row["perplexity"] == pytest.approx(ref, rel=1e-5)
    with pytest.raises(RuntimeError, match="inside"):  # an error inside a block frees the model too
        with moetool.hook(lm, policy="norm:gate"):
            raise RuntimeError("inside")
    assert _ppl(lm, tokens)["perplexity"] == row["perplexity"]


def test_layers_are_integers_not_true(lm, tokens):
    """``layers=[True]`` hooked layer 1; numpy integers are layer numbers."""
    with pytest.raises(MoetoolError, match="integers"):
        moetool.hook(lm, policy="norm:gate", layers=[True])
    seen = set()
    with torch.no_grad(), moetool.hook(lm, policy="norm:gate", layers=np.array([1, 3]),
                                       consumers=[lambda ev: seen.add(ev.layer.index)]):
        feed(lm.model, tokens.input_ids[:1], tokens.attention_mask[:1])
    assert seen == {0, 1, 2, 3}  # consumers see every layer; the policy layers are 1 and 3
    assert moetool.hook(lm, policy="norm:gate", layers=np.array([1, 3])).policy_layers == {1, 3}


@contextlib.contextmanager
def paused_thread(body, name, ready, release):
    """Runs ``body`` in thread ``name`` until it sets ``ready`` (or fails); yields the list of its errors (checked by
    the caller after the block: the thread has then been released and joined)."""
    errors = []

    def target():
        try:
            body()
        except BaseException as e:  # pragma: no cover - reported by the caller
            errors.append(e)
            ready.set()

    t = threading.Thread(target=target, name=name)
    t.start()
    try:
        assert ready.wait(60)
        yield errors
    finally:
        release.set()
        t.join(60)

def test_a_second_run_on_a_busy_model_is_refused_in_one_line(lm, tokens, tmp_path):
    """Thread A holds the model in a ``moetool.hook(policy="norm:gate")`` block; a ``ppl`` of the main thread ran its
    forwards through A's hooks (the norm policy's perplexity under ``routing router``). Now it is one line, and
    once A is done the model gives the plain perplexity again."""
    ref, _ = hand_ppl(lm.model, tokens, 64)
    entered, release = threading.Event(), threading.Event()

    def hold():
        with moetool.hook(lm, policy="norm:gate"):
            entered.set()
            release.wait(60)

    with paused_thread(hold, "holder", entered, release) as errors:
        assert not errors
        with pytest.raises(MoetoolError, match="in use by a moetool.hook block in thread 'holder'"):
            _ppl(lm, tokens)
        with pytest.raises(MoetoolError, match="in thread 'holder'"):
            moetool.run("stats", lm, tokens, out=str(tmp_path / "stats"), quiet=True, bootstrap=0)
        assert not (tmp_path / "stats").exists()  # refused before its run folder
    assert _ppl(lm, tokens)["perplexity"] == pytest.approx(ref, rel=1e-5)


def test_a_run_in_another_thread_never_feeds_the_first_runs_consumers(lm, tokens):
    """Thread A's ``moetool.forward`` with a consumer (paused inside its first event); a ``ppl`` of the main thread
    meanwhile ran through A's hooks, handing A's consumer the main thread's tokens (A's counts then covered both
    runs). Now the ppl is one line and A's consumer sees exactly its own forward: 4 MoE layers x 8 rows."""
    first, release, seen = threading.Event(), threading.Event(), []

    def consume(ev):
        seen.append((threading.current_thread().name, ev.layer.index, int(ev.valid.sum())))
        if not first.is_set():
            first.set()
            release.wait(60)

    with paused_thread(lambda: moetool.forward(lm, tokens, consumers=[consume], batch_size=1, quiet=True), "A",
                       first, release) as errors:
        with pytest.raises(MoetoolError, match="in use by a moetool.forward loop in thread 'A'"):
            _ppl(lm, tokens)
    assert not errors
    assert {name for name, _, _ in seen} == {"A"}
    assert len(seen) == 4 * tokens.input_ids.shape[0]
    assert sum(n for _, layer, n in seen if layer == 0) == tokens.n_tokens


def test_runs_in_threads_on_two_models_equal_the_runs_in_turn(lm, tokens):
    """Two experiments, and one experiment with two routings, at once in threads on two loaded models: each
    table equals the same run's alone, and the router perplexity the hand-computed one."""
    other = moetool.load("tiny", device="cpu")
    ref, _ = hand_ppl(lm.model, tokens, 64)
    jobs = {
        "ppl router": (lm, lambda m: moetool.ppl(m, tokens, bootstrap=0, quiet=True, batch_size=1)),
        "ppl norm": (other, lambda m: moetool.ppl(m, tokens, routing="norm:gate", bootstrap=0, quiet=True,
                                                   batch_size=1)),
        "stats": (lm, lambda m: moetool.stats(m, tokens, bootstrap=0, quiet=True, batch_size=1)),
        "topk": (other, lambda m: moetool.topk(m, tokens, quiet=True, batch_size=1)),
    }

    def tables(res):
        return {k: v.drop(columns=[c for c in v.columns if c == "seconds"]) for k, v in res.tables.items()}

    alone = {name: tables(f(m)) for name, (m, f) in jobs.items()}
    for pair in (("ppl router", "ppl norm"), ("stats", "topk")):
        got = {}

        def go(name):
            m, f = jobs[name]
            try:
                got[name] = tables(f(m))
            except BaseException as e:  # pragma: no cover - reported below
                got[name] = e

        threads = [threading.Thread(target=go, args=(name,)) for name in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for name in pair:
            assert not isinstance(got[name], BaseException), got[name]
            assert got[name].keys() == alone[name].keys()
            for table in got[name]:
                pd_equal = got[name][table].equals(alone[name][table])
                assert pd_equal, (name, table)
    assert alone["ppl router"]["ppl.csv"]["perplexity"].iloc[0] == pytest.approx(ref, rel=1e-5)
    assert alone["ppl norm"]["ppl.csv"]["perplexity"].iloc[0] > ref  # another routing: another number


def test_hook_and_forward_name_what_they_take(lm, tokens):
    """``moetool.hook(lm, consumers=print)`` was a TypeError from inside the engine, ``moetool.forward("tiny", t)``
    and ``moetool.forward(lm, "text.txt")`` AttributeErrors: one line each. The forward given a loaded model and
    packed tokens is the hand-computed NLL."""
    for call, match in ((lambda: moetool.hook(lm, consumers=print), "list of callables"),
                        (lambda: moetool.hook("tiny"), "loaded model"),
                        (lambda: moetool.forward("tiny", tokens, quiet=True), "loaded model"),
                        (lambda: moetool.forward(lm, "text.txt", quiet=True), "packed tokens")):
        with pytest.raises(MoetoolError, match=match):
            call()
    ref, n = hand_ppl(lm.model, tokens, 64)
    res = moetool.forward(lm, tokens, nll=True, quiet=True)
    assert res.nll.tokens == n and math.exp(res.nll.nll_sum / n) == pytest.approx(ref, rel=1e-5)


def test_tokens_of_another_tokenizer_with_named_checkpoints(lm, tokens, tmp_path):
    """fluctuation and agreement load named models without their tokenizers: tokens of another vocabulary were
    routed as other tokens. ``moetool.run(name, model_name, tokens)`` ignored the tokens (ppl scored 32,640 tokens
    of the held-out text for 64 given): one line, before a run folder. The same tokens given with the loaded model
    are scored: the hand-computed perplexity."""
    other = moetool.tokens(dataclasses.replace(lm, tokenizer=_other_tokenizer()), None, seq_len=32, max_tokens=256)
    with pytest.raises(MoetoolError, match="another tokenizer"):
        moetool.fluctuation(["tiny-early", "tiny"], other, quiet=True)
    with pytest.raises(MoetoolError, match="another tokenizer"):
        moetool.agreement("tiny", other, quiet=True, precisions=("fp32", "bf16"))
    few = moetool.tokens(lm, None, seq_len=32, max_tokens=64)
    with pytest.raises(MoetoolError, match="tokens go with a loaded model"):
        moetool.run("ppl", "tiny", few, out=str(tmp_path / "named"), quiet=True, bootstrap=0)
    assert not (tmp_path / "named").exists()
    ref, n = hand_ppl(lm.model, few, 64)
    res = moetool.run("ppl", lm, few, out=str(tmp_path / "loaded"), quiet=True, bootstrap=0)
    assert res["ppl"]["scored_tokens"].iloc[0] == n == 62
    assert res["ppl"]["perplexity"].iloc[0] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("bad", [5, b"runs/x", ["runs/x"]], ids=["int", "bytes", "list"])
def test_an_out_that_is_not_a_path_is_one_line(lm, tokens, tmp_path, monkeypatch, bad):
    """``out=5`` (or bytes, or a list) from Python ended in pathlib's ``TypeError: expected str, bytes or
    os.PathLike object, not int`` traceback (moetool.run by name or with a loaded model, moetool.write,
    moetool.write_report); now one line naming the value, and nothing is written. The same run with a path as out
    writes the run's perplexity, the one of a plain moetool.ppl."""
    monkeypatch.chdir(tmp_path)
    line = rf"^out={re.escape(repr(bad))} \({type(bad).__name__}\) is not a folder path: give a str or a pathlib.Path"
    res = moetool.ppl(lm, tokens, bootstrap=0, quiet=True)
    for call in (lambda: moetool.run("ppl", "tiny", out=bad, seq_len=32, max_tokens=64, quiet=True),
                 lambda: moetool.run("ppl", lm, tokens, out=bad, bootstrap=0, quiet=True),
                 lambda: moetool.write(res, bad),
                 lambda: moetool.write_report([tmp_path], out=bad)):
        with pytest.raises(MoetoolError, match=line):
            call()
    assert not list(tmp_path.iterdir())
    got = moetool.run("ppl", lm, tokens, out=tmp_path / "ok", bootstrap=0, quiet=True)
    assert got["ppl"].perplexity.iloc[0] == res["ppl"].perplexity.iloc[0] == _ppl(lm, tokens).perplexity


def test_a_model_left_in_training_mode_gives_the_eval_numbers_and_keeps_its_modes(tokens):
    """``lm.model.train()`` (after a fine-tuning step) left dropout and Mixtral's router jitter on inside moetool's
    forwards: each call was one random draw (ppl 68.9 then 66.7 for 56.4 in eval mode, every table moving). The
    forwards run in eval mode, the model's modes (one submodule left in eval too) as they were after."""
    import pandas as pd

    own = moetool.load("tiny", device="cpu")  # its dropout is changed below
    ref_ppl, ref_count = hand_ppl(own.model, tokens)  # plain forwards in eval mode
    ref_layers = moetool.stats(own, tokens, bootstrap=0, quiet=True)["layers.csv"]
    for layer in own.model.model.layers:
        layer.self_attn.attention_dropout = 0.5
        layer.mlp.jitter_noise = 0.5
    own.model.train()
    own.model.model.norm.eval()
    for _ in range(2):
        row = moetool.ppl(own, tokens, bootstrap=0, quiet=True)["ppl.csv"].iloc[0]
        assert (row.perplexity, row.scored_tokens) == (pytest.approx(ref_ppl, rel=1e-9), ref_count)
        pd.testing.assert_frame_equal(moetool.stats(own, tokens, bootstrap=0, quiet=True)["layers.csv"], ref_layers)
    assert own.model.training and own.model.model.layers[0].mlp.training and not own.model.model.norm.training


def test_a_prune_policy_object_reused_on_a_model_of_other_width_routes_by_that_models_sets(lm, tokens):
    """A ``prune:random`` policy object used on tiny (8 experts) cached its kept-expert masks by layer number: on
    tiny-fine (32 experts) next it was a RuntimeError from inside the routing rule (sizes 8 and 32). Each model's
    layers get their own sets: the choices equal a fresh policy's, none of them a removed expert."""
    from moetool.policies import build_policy
    from moetool.policies.prune import n_removed, random_removed

    fine = moetool.load("tiny-fine", device="cpu")
    reused = build_policy("prune:random:0.25")

    def chosen(model, policy):
        ids = moetool.tokens(model, None, seq_len=32, max_tokens=64).input_ids
        events = []
        with torch.no_grad(), moetool.hook(model, policy=policy, consumers=[events.append]):
            model.model(input_ids=ids, use_cache=False)
        return [(ev.layer.index, ev.layer.n_experts, ev.chosen_idx.clone()) for ev in events]

    for model in (lm, fine, lm):
        got, fresh = chosen(model, reused), chosen(model, build_policy("prune:random:0.25"))
        assert len(got) == len(fresh) == len(model.layers)
        for (layer, n, idx), (_, _, ref) in zip(got, fresh):
            assert torch.equal(idx, ref)
            removed = set(random_removed(0, layer, n, n_removed(0.25, n)))
            assert len(removed) == n // 4 and not removed & set(idx.unique().tolist())


def test_a_model_cast_after_the_load_is_recorded_in_the_dtype_it_ran_in(tokens, tmp_path):
    """``lm.model.to(torch.bfloat16)`` after ``moetool.load("tiny")``: the forwards ran in bf16, and manifest.json
    said float32 (the model's dtype, the options' and the memory estimate's): a run recorded as the fp32 one it is
    not. ``lm.dtype`` and ``lm.device`` are the model's now; a load's own dtype is kept as it was asked for."""
    import json

    own = moetool.load("tiny", device="cpu")
    assert (own.dtype, own.device) == (torch.float32, torch.device("cpu"))
    own.model.to(torch.bfloat16)
    res = moetool.run("ppl", own, tokens, out=tmp_path / "run", quiet=True, bootstrap=0)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["model"]["dtype"], manifest["options"]["dtype"]) == ("torch.bfloat16", "bfloat16")
    assert manifest["memory_estimate"]["dtype"] == "bfloat16"
    ref, _ = hand_ppl(own.model, tokens)  # the bf16 model's own forwards
    assert res["ppl"].perplexity.item() == pytest.approx(ref, rel=1e-6)
    moetool.write(moetool.ppl(own, tokens, bootstrap=0, quiet=True), tmp_path / "api")
    assert json.loads((tmp_path / "api" / "manifest.json").read_text())["model"]["dtype"] == "torch.bfloat16"
    assert own.dtype == torch.bfloat16 and own.loaded_dtype == torch.float32
    own.model.float()
    assert own.dtype == torch.float32
    assert moetool.load("tiny", dtype="bf16", device="cpu").dtype == torch.bfloat16


def test_a_loaded_model_given_for_a_models_name_is_named_in_one_line(lm):
    """``moetool.inspect_model(lm)`` (or ``moetool.load(lm)``) dumped the model's whole repr, its modules over
    several lines, into the message: one line naming what was passed."""
    for call in (moetool.inspect_model, moetool.load):
        with pytest.raises(MoetoolError) as e:
            call(lm)
        assert str(e.value) == ("a model is named by a string (an embedded name, an alias, a directory or a hub id) "
                                "or a path, not a LoadedModel")
    with pytest.raises(MoetoolError, match=r"or a path, not 5$"):
        moetool.load(5)
