"""eval: the shipped offline tasks through lm-eval's HFLM, with the routing policy really applied."""

from __future__ import annotations

import json
import math
import os
import re
import socket
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import build_tiny_model, wilson_by_hand
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.engine.hooks import Engine
from moetool import lmeval_compat
from moetool.experiments.eval import compute as lmeval
from moetool.experiments.norm_select import compute as ns
from moetool.loading import embedded_models, load
from moetool.policies import make_policy

TASK = "moetool_prose"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The conftest tiny Mixtral with a small byte-level BPE tokenizer trained on the shipped task text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = lmeval.shipped_tasks_dir()
    texts = [json.loads(l)["context"] for f in sorted(root.glob("*.jsonl")) for l in f.read_text().splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tiny_model("mixtral").save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>").save_pretrained(path)
    return path


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_plan_finds_the_shipped_tasks_offline(no_network):
    plan = lmeval.plan_tasks(["moetool_code", TASK])
    assert plan.offline and not plan.include_defaults
    assert [s["task"] for s in plan.specs] == ["moetool_code", TASK]
    for spec in plan.specs:
        files = spec["dataset_kwargs"]["data_files"]
        assert set(files) == {"test", "train"}
        for f in files.values():
            rows = [json.loads(l) for l in open(f)]
            assert len(rows) >= 10 and all(len(r["choices"]) == 4 and 0 <= r["label"] < 4 for r in rows)


def test_include_path_and_tasks_env(tmp_path, monkeypatch):
    shipped = lmeval.shipped_tasks()[TASK]
    own = {**shipped, "task": "my_task"}  # data files already absolute
    (tmp_path / "my_task.yaml").write_text(yaml.safe_dump(own))
    plan = lmeval.plan_tasks(["my_task", TASK], include_path=tmp_path)
    assert plan.specs[0] == "my_task" and plan.specs[1]["task"] == TASK
    assert not plan.include_defaults and not plan.offline  # own tasks may need the network: not forced offline
    monkeypatch.setenv(lmeval.TASKS_ENV, str(tmp_path))
    assert lmeval.shipped_tasks_dir() == tmp_path and list(lmeval.shipped_tasks()) == ["my_task"]


def test_hub_offline_is_restored(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for m, a in ((datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                 (huggingface_hub.constants, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(m, a, False)  # online before the block, whatever this machine's environment says
    flags = lambda: (datasets.config.HF_DATASETS_OFFLINE, datasets.config.HF_HUB_OFFLINE,  # noqa: E731
                     huggingface_hub.constants.HF_HUB_OFFLINE)
    before = flags()
    with lmeval_compat.hub_offline():
        assert flags() == (True, True, True)  # datasets reads its own copy of HF_HUB_OFFLINE too
        assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert flags() == before
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_results_frame_reads_lm_eval_results():
    res = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict": 0.25,
                             "exact_match_stderr,strict": "N/A"}}}
    df = lmeval.results_frame(res)
    assert list(df.columns) == list(lmeval.EVAL_COLUMNS)
    assert df.values.tolist()[0][:4] == ["t", "acc", 0.5, 0.1]  # lm-eval's stderr as it gave it
    # no n-samples: the items lm-eval's stderr implies for 0/1 scores, se² = p(1-p)/(n-1): n = 26
    assert df.values.tolist()[0][4:] == pytest.approx(wilson_by_hand(0.5, 26), abs=1e-6)
    assert df.values.tolist()[1][:3] == ["t", "exact_match[strict]", 0.25] and math.isnan(df.values.tolist()[1][3])
    assert math.isnan(df.value_lo[1]) and math.isnan(df.value_hi[1])  # no stderr, no item count: no interval
    from moetool.experiments.eval.compute import eval_summary
    assert eval_summary(df).value.tolist() == ["0.50 ± 0.18", "0.25"]  # Wilson at p = 0.5: symmetric
    twelve = lmeval.results_frame({"results": {"t": {"acc,none": 0.6, "acc_stderr,none": math.sqrt(0.24 / 19)}},
                                   "n-samples": {"t": {"effective": 20}}})
    lo, hi = wilson_by_hand(0.6, 20)  # [0.387, 0.781]: not 0.60 ± 0.20
    assert eval_summary(twelve).value.tolist() == [f"0.60 [{lo:.2f}, {hi:.2f}]"] == ["0.60 [0.39, 0.78]"]


def test_accuracy_intervals_stay_inside_0_1():
    """eval --limit 10: an accuracy of 0.9 or 1.0 over 10 items has a Wilson interval inside [0, 1] (p ± 1.96 se
    gave an upper bound of 1.06); a group's items are its subtasks'; a metric that is no proportion keeps
    value ∓ 1.96 stderr; the stderr column stays lm-eval's."""
    se9 = math.sqrt(0.9 * 0.1 / 9)  # lm-eval's sample standard error of a mean of ten 0/1 scores
    res = {"results": {"a": {"acc,none": 0.9, "acc_stderr,none": se9, "acc_norm,none": 1.0,
                             "acc_norm_stderr,none": 0.0},
                       "g": {"acc,none": 0.26, "acc_stderr,none": 0.05},  # (8 + 18) / 100: lm-eval's pooled mean
                       "b": {"acc,none": 0.2, "acc_stderr,none": 0.1},
                       "c": {"acc,none": 0.3, "acc_stderr,none": 0.1},
                       "p": {"word_perplexity,none": 12.5, "word_perplexity_stderr,none": 0.5}},
           "n-samples": {"a": {"original": 100, "effective": 10}, "b": {"effective": 40}, "c": {"effective": 60}},
           "group_subtasks": {"g": ["b", "c"]}}
    df = lmeval.results_frame(res).set_index(["task", "metric"])
    assert (df.value_lo >= 0).all() and (df.loc[df.index != ("p", "word_perplexity"), "value_hi"] <= 1).all()
    assert [df.loc[("a", "acc"), c] for c in ("value_lo", "value_hi")] == pytest.approx(wilson_by_hand(0.9, 10))
    assert df.loc[("a", "acc"), "stderr"] == se9 and 0.9 + 1.96 * se9 > 1  # what the Wald bound gave
    lo, hi = df.loc[("a", "acc_norm"), ["value_lo", "value_hi"]]  # 10 of 10: upper bound 1, lower z²-closed form
    assert hi == 1 and lo == pytest.approx(10 / (10 + 1.959964 ** 2), abs=1e-6)
    assert [df.loc[("g", "acc"), c] for c in ("value_lo", "value_hi")] == pytest.approx(wilson_by_hand(0.26, 100))
    assert [df.loc[("p", "word_perplexity"), c] for c in ("value_lo", "value_hi")] == pytest.approx(
        [12.5 - 1.959964 * 0.5, 12.5 + 1.959964 * 0.5])
    assert "Wilson" in lmeval.EVAL_DEFINITIONS["value_lo"]


def test_a_groups_unweighted_mean_is_no_share_of_its_pooled_items():
    """lm-eval's results (0.4.13, run by hand with simple_evaluate on the embedded tiny model) of two groups of the
    same subtasks, 81 of 100 and 36 of 50 right: weight_by_size true reports 117/150 = 0.78, the pooled share, whose
    Wilson interval is over the 150 items (statsmodels' proportion_confint(117, 150, method="wilson"));
    weight_by_size false reports (0.81 + 0.72) / 2 = 0.765, no share of 150 items (114.75 of them): its interval
    is Wilson's over the items lm-eval's stderr implies, p(1-p)/se² + 1 = 127.85 (statsmodels: [0.6844, 0.8301]),
    not over 150 ([0.6911, 0.8257], 8% narrower than lm-eval's own stderr says). Skewed, 0.9 of 1000 items and 0.5 of
    10, the unweighted 0.7 over 1010 items was [0.671, 0.727]: 5x narrower than [0.525, 0.831]."""
    se_u = 0.03764582038165448  # lm-eval's unweighted_mean_stderr of the two subtasks' stderrs
    res = {"results": {"c": {"acc,none": 0.81, "acc_stderr,none": 0.039427724440366234},
                       "p": {"acc,none": 0.72, "acc_stderr,none": 0.06414269805898186},
                       "c2": {"acc,none": 0.81, "acc_stderr,none": 0.039427724440366234},
                       "p2": {"acc,none": 0.72, "acc_stderr,none": 0.06414269805898186},
                       "weighted": {"acc,none": 0.78, "acc_stderr,none": 0.0338717772975865},
                       "unweighted": {"acc,none": 0.765, "acc_stderr,none": se_u}},
           "n-samples": {"c": {"original": 100, "effective": 100}, "p": {"original": 50, "effective": 50},
                         "c2": {"original": 100, "effective": 100}, "p2": {"original": 50, "effective": 50}},
           "group_subtasks": {"weighted": ["c", "p"], "unweighted": ["c2", "p2"]}}
    df = lmeval.results_frame(res).set_index(["task", "metric"])
    assert list(df.loc[("weighted", "acc"), ["value_lo", "value_hi"]]) == pytest.approx(
        [0.7071769001714163, 0.8388397629824609], abs=1e-12)
    assert list(df.loc[("unweighted", "acc"), ["value_lo", "value_hi"]]) == pytest.approx(
        [0.6844431262179154, 0.8300968789882575], abs=1e-12)
    se1 = math.sqrt(900 * 0.1 ** 2 + 100 * 0.9 ** 2) / math.sqrt(999) / math.sqrt(1000)  # 0.9 of 1000
    se2 = math.sqrt(10 * 0.25) / 3 / math.sqrt(10)  # 0.5 of 10
    skew = {"results": {"a": {"acc,none": 0.9, "acc_stderr,none": se1}, "b": {"acc,none": 0.5, "acc_stderr,none": se2},
                        "g": {"acc,none": 0.7, "acc_stderr,none": math.sqrt(se1 ** 2 + se2 ** 2) / 2}},
            "n-samples": {"a": {"effective": 1000}, "b": {"effective": 10}}, "group_subtasks": {"g": ["a", "b"]}}
    g = lmeval.results_frame(skew).set_index(["task", "metric"]).loc[("g", "acc")]
    assert [g.value_lo, g.value_hi] == pytest.approx([0.5246052192032453, 0.8314719390306498], abs=1e-12)


def plan_file(task):
    return lmeval.plan_tasks([task]).specs[0]["dataset_kwargs"]["data_files"]["test"]


def _loglikelihoods(res):
    return {(s["doc_id"], i): r[0][0] for s in res for i, r in enumerate(s["resps"])}


def hand_loglikelihood(lm, context, continuation, policy):
    """log P(continuation | context) with my own forward under ``policy``, split as lm-eval splits the pair."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = lm.tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx_len = len(lm.tokenizer(context, add_special_tokens=False).input_ids)
    ids = torch.tensor([whole[:-1]])
    with torch.no_grad(), Engine(lm.model, lm.layers, policy=policy):
        logp = torch.log_softmax(lm.model(ids.to(lm.device)).logits[0].float().cpu(), -1)  # [S, V]
    return sum(float(logp[t - 1, whole[t]]) for t in range(ctx_len, len(whole)))


@pytest.mark.slow
def test_routing_reaches_lm_eval_loglikelihoods(model_dir, no_network):
    from lm_eval import evaluator

    lm = load(str(model_dir))
    plan = lmeval.plan_tasks([TASK])
    hflm = lmeval.make_hflm(lm, batch_size=4)
    with lmeval_compat.hub_offline(plan.offline):  # the unhooked reference: lm-eval alone
        plain = evaluator.simple_evaluate(model=hflm, tasks=list(plan.specs), limit=2, log_samples=True,
                                          task_manager=plan.task_manager())["samples"][TASK]
    router = lmeval.evaluate(lm, plan, policy=make_policy("router"), limit=2, hflm=hflm, log_samples=True,
                             quiet=True)
    norm = make_policy("norm:gate")
    normed = lmeval.evaluate(lm, plan, policy=norm, limit=2, hflm=hflm, log_samples=True, quiet=True)
    ref, a, b = (_loglikelihoods(x) for x in (plain, router.samples[TASK], normed.samples[TASK]))
    assert len(ref) == 8 and a == ref  # router: exactly lm-eval's unhooked numbers
    assert all(not math.isclose(b[k], ref[k], rel_tol=1e-6) for k in ref)  # the policy really ran
    s = normed.samples[TASK][0]
    ctx, cont = s["arguments"][1]
    assert b[(s["doc_id"], 1)] == pytest.approx(hand_loglikelihood(lm, ctx, cont, norm), abs=2e-3)
    for res in (router, normed):
        samples = res.samples[TASK]
        hand_acc = sum(max(range(4), key=lambda i: d["resps"][i][0][0]) == d["target"] for d in samples) / 2
        assert res.value(TASK, "acc") == pytest.approx(hand_acc) and 0.0 <= hand_acc <= 1.0
        assert res.n_samples[TASK]["effective"] == 2


@pytest.mark.slow
def test_few_shot_examples_are_lm_evals_own_by_default(model_dir, no_network):
    """With few-shot examples, moetool's prompts and log-likelihoods are those of lm-eval run with its own default
    seeds (before: the few-shot sampler was seeded with --seed 0, other examples than lm_eval's); ``fewshot_seed``
    reaches lm-eval's sampler."""
    from lm_eval import evaluator

    lm = load(str(model_dir))
    plan = lmeval.plan_tasks([TASK])
    hflm = lmeval.make_hflm(lm, batch_size=4)

    def prompts(samples):
        return {(d["doc_id"], i): a["arguments"] if isinstance(a, dict) else a
                for d in samples for i, a in enumerate(d["arguments"])}

    got = {}
    for seed in (None, 7):
        with lmeval_compat.hub_offline(plan.offline):  # lm-eval alone, its defaults unless a seed is given
            ref = evaluator.simple_evaluate(model=hflm, tasks=list(plan.specs), limit=3, num_fewshot=2,
                                            log_samples=True, task_manager=plan.task_manager(),
                                            **({} if seed is None else {"fewshot_random_seed": seed}))
        ours = lmeval.evaluate(lm, plan, policy=make_policy("router"), limit=3, num_fewshot=2, hflm=hflm,
                               log_samples=True, quiet=True, **({} if seed is None else {"fewshot_seed": seed}))
        ref, ours = ref["samples"][TASK], ours.samples[TASK]
        assert prompts(ours) == prompts(ref)
        assert _loglikelihoods(ours) == _loglikelihoods(ref)
        got[seed] = prompts(ours)
    assert got[None] != got[7]  # the seed chooses other examples: it reached the sampler


@pytest.mark.slow
def test_eval_and_norm_select_cli_offline(model_dir, tmp_path, no_network):
    runner = CliRunner()
    r = runner.invoke(app, ["eval", "--model", str(model_dir), "--tasks", TASK, "--limit", "2", "--routing",
                            "norm:up", "--out", str(tmp_path / "e"), "-q"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "e" / "eval.csv")
    assert list(df.columns) == list(lmeval.EVAL_COLUMNS) and set(df.metric) == {"acc", "acc_norm"}
    assert df.value.between(0, 1).all()
    man = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert man["eval"]["offline"] and man["routing"]["name"] == "norm:up:l2"
    text = tmp_path / "text.txt"
    text.write_text(" ".join(json.loads(l)["context"] for l in open(plan_file(TASK))))
    r = runner.invoke(app, ["norm-select", "--model", str(model_dir), "--nodes", "gate", "--tasks", TASK,
                            "--limit", "2", "--data", str(text), "--seq-len", "32", "--max-tokens", "64",
                            "--out", str(tmp_path / "n"), "-q"])
    assert r.exit_code == 0, r.output
    q = pd.read_csv(tmp_path / "n" / "quality.csv")
    a = pd.read_csv(tmp_path / "n" / "agreement.csv")
    assert list(q.columns) == list(ns.QUALITY_COLUMNS) and list(a.columns) == list(ns.AGREEMENT_COLUMNS)
    assert set(q.policy) == set(a.policy) == {"router", "norm:gate:l2"}
    assert set(q.metric) == {"perplexity", "acc", "acc_norm"} and set(q.task) == {"text", TASK}
    acc = q[q.metric == "acc"].set_index("policy")
    assert acc.loc["norm:gate:l2", "router_value"] == acc.loc["router", "value"]
    assert (a[a.policy == "router"][["topk_overlap", "top1_agree"]] == 1.0).all().all()
    assert (tmp_path / "n" / "figures" / "retention.png").is_file()
    assert (tmp_path / "n" / "figures" / "agreement_by_layer.png").is_file()


@pytest.mark.slow
def test_embedded_model_is_above_chance_on_the_shipped_tasks(no_network):
    lm = load("tiny")
    tasks = ["moetool_code", "moetool_prose"]
    res = lmeval.evaluate(lm, lmeval.plan_tasks(tasks), limit=40, batch_size=16, quiet=True)
    for task in tasks:  # chance is 0.25; 40 items: p(>= 18 right by chance) < 1e-3
        assert res.value(task, "acc") >= 0.45


def test_shipped_tasks_come_from_the_embedded_models_training_text():
    root = lmeval.shipped_tasks_dir()
    built = json.loads((root / "build_info.json").read_text())["corpus_train_sha256"]
    meta = json.loads((Path(embedded_models()["tiny"]) / "train_meta.json").read_text())
    assert built == meta["corpus"]["files"]["train.jsonl"]["sha256"]  # rebuild the tasks after a retrain


def test_lm_eval_compat_is_pinned_to_the_installed_version():
    installed = lmeval_compat.installed_version()
    assert installed == lmeval_compat.TESTED_VERSION, (
        f"lm-eval {installed} is installed but moetool/lmeval_compat.py was written for "
        f"{lmeval_compat.TESTED_VERSION}: re-check every patch there (evaluator.{', evaluator.'.join(lmeval_compat.EVALUATOR_PATCHES)}, "
        f"datasets.config / huggingface_hub.constants offline flags), then update TESTED_VERSION")
    lmeval_compat.check()
    from lm_eval import evaluator

    original = evaluator.add_env_info
    with lmeval_compat.no_env_report():
        assert evaluator.add_env_info({}) is None and evaluator.add_env_info is not original
    assert evaluator.add_env_info is original


@pytest.mark.slow
def test_few_shot_beyond_the_split_and_an_empty_task_file_are_one_line(model_dir, no_network, tmp_path):
    """--num-fewshot larger than a task's few-shot split was 'ValueError: Sample larger than population or is
    negative' (random.sample inside lm-eval); a task whose data file has no rows was 'StopIteration'."""
    from moetool.errors import MoetoolError

    root = lmeval.shipped_tasks_dir()
    pool = len((root / f"{TASK}.train.jsonl").read_text().splitlines())  # the few-shot split (fewshot_split: train)
    lm = load(str(model_dir))
    plan = lmeval.plan_tasks([TASK])
    assert lmeval.evaluate(lm, plan, num_fewshot=pool, limit=1, quiet=True).value(TASK) in (0.0, 1.0)
    with pytest.raises(MoetoolError, match=rf"^--num-fewshot {pool + 1}: more few-shot examples than the few-shot "
                                           rf"split of {TASK} holds$"):
        lmeval.evaluate(lm, plan, num_fewshot=pool + 1, limit=1, quiet=True)
    cfg = yaml.safe_load((root / f"{TASK}.yaml").read_text())
    (tmp_path / "empty.jsonl").write_text("")
    cfg["task"] = "empty_task"
    cfg["dataset_kwargs"]["data_files"] = {"test": str(tmp_path / "empty.jsonl"),
                                           "train": str(root / f"{TASK}.train.jsonl")}
    (tmp_path / "empty_task.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(MoetoolError, match=r"^lm-eval could not load the tasks \['empty_task'\]: a data file has no "
                                           r"rows$"):
        lmeval.evaluate(lm, lmeval.plan_tasks(["empty_task"], tmp_path), limit=1, quiet=True)


def test_lm_evals_own_bars_are_silenced_under_moetools_display(model_dir, no_network, capfd):
    """#14 'one progress display': lm-eval alone prints its tqdm bars on stderr; through moetool (not quiet) none."""
    from lm_eval import evaluator

    lm = load(str(model_dir))
    plan = lmeval.plan_tasks([TASK])
    hflm = lmeval.make_hflm(lm, batch_size=4)
    capfd.readouterr()
    with lmeval_compat.hub_offline(plan.offline):
        evaluator.simple_evaluate(model=hflm, tasks=list(plan.specs), limit=2, task_manager=plan.task_manager())
    alone = capfd.readouterr().err
    assert "it/s]" in alone or "%|" in alone  # what would interleave with moetool's progress
    lmeval.evaluate(lm, plan, limit=2, hflm=hflm, quiet=False)
    err = capfd.readouterr().err
    assert "it/s]" not in err and "%|" not in err and "lm_eval" not in err, err
    # off a terminal (captured, as in a log) moetool's spinner leaves its one finished line (before: none at all)
    assert re.fullmatch(rf"lm-eval {TASK}: done in \d+\.\d s\n", err), err


@pytest.mark.parametrize("side", ["right", "left"])
def test_lmeval_padding_is_made_on_the_batch_device(side):
    """The padding mask the eval bridge hands the engine (``engine.padding``: its ``valid`` for a forward lm-eval
    passes no mask) is made on the device of lm-eval's batch, so the engine's model pre-hook never copies it from the
    host (on CUDA a pageable host-to-device copy, a synchronisation per lm-eval forward). By substitution: rows on the
    meta device (a mask built on the CPU is on another device than the rows, as it would be beside CUDA rows); its
    values against a hand-written mask of the same rows on the CPU."""
    from types import SimpleNamespace

    from lm_eval.models import huggingface

    lens, width = [3, 5, 2, 6], 6
    want = torch.tensor([[(s < n) if side == "right" else (s >= width - n) for s in range(width)] for n in lens])
    for device in ("meta", "cpu"):
        engine = SimpleNamespace(padding=None, policy=None)
        rows = [torch.arange(1, n + 1, device=device).unsqueeze(0) for n in lens]  # ids 1..n: padding is id 0
        with lmeval.lmeval_padding(engine):
            out = huggingface.pad_and_concat(width, rows, padding_side=side)
        assert out.device.type == device and engine.padding.device == out.device
        assert engine.padding.shape == (len(lens), width) and engine.padding.dtype == torch.bool
        if device == "cpu":
            assert torch.equal(engine.padding, want) and torch.equal(out != 0, want)


def test_capacity_in_eval_counts_real_tokens_only(model_dir, no_network, monkeypatch):
    """lm-eval's loglikelihood forwards carry no attention mask; their right padding (id 0 after each row's last
    token) must not count as tokens: per forward, the engine's valid tokens are the test's own read of the rows
    (up to the last non-zero id; the task text holds no id 0) and capacity = ⌈cf · real · K / n⌉ of those. (Every
    padded position counted as a real token: valid 600 of 569 real in one batch.)"""
    from moetool.policies.capacity import CapacityPolicy

    seen = []
    select = CapacityPolicy.select

    def record(self, ev):
        out = select(self, ev)
        seen.append((ev.token_ids.reshape(ev.shape).cpu(), ev.valid.cpu(), float(ev.extra["capacity"]),
                     ev.idx.shape[-1], ev.layer.n_experts))
        return out

    monkeypatch.setattr(CapacityPolicy, "select", record)
    lm = load(str(model_dir))
    lmeval.evaluate(lm, lmeval.plan_tasks([TASK]), policy=make_policy("capacity:1"), limit=4, batch_size=4,
                    quiet=True)
    padded = 0
    for ids, valid, cap, K, n in seen:
        last = [max((s for s in range(ids.shape[1]) if ids[b, s] != 0), default=-1) for b in range(ids.shape[0])]
        want = torch.tensor([[s <= last[b] for s in range(ids.shape[1])] for b in range(ids.shape[0])])
        assert torch.equal(valid, want.reshape(-1))
        assert cap == math.ceil(1.0 * int(want.sum()) * K / n)
        padded += int((~want).sum())
    assert seen and padded > 0  # the batches were padded


def test_a_zero_stderr_without_an_item_count_gives_no_interval():
    """A proportion with stderr 0 and no n-samples (10 of 10 right, or a task reporting 0): the stderr implies no
    item count (p(1-p)/se² is 0/0), so the interval is NaN, as without a stderr -- no division by zero, no bound."""
    df = lmeval.results_frame({"results": {"t": {"acc,none": 1.0, "acc_stderr,none": 0.0,
                                                 "acc_norm,none": 0.0, "acc_norm_stderr,none": 0.0}}})
    assert df.value.tolist() == [1.0, 0.0] and df.stderr.tolist() == [0.0, 0.0]
    assert df.value_lo.isna().all() and df.value_hi.isna().all()


def test_a_filtered_metric_takes_the_stderr_of_its_own_filter():
    """exact_match under the 'strict' filter has its own stderr (exact_match_stderr,strict), not the 'none' filter's:
    0.05 implies 0.3 x 0.7 / 0.05² + 1 = 85 items, and the Wilson interval is over those."""
    df = lmeval.results_frame({"results": {"t": {"exact_match,strict": 0.3, "exact_match_stderr,strict": 0.05,
                                                 "exact_match,none": 0.9, "exact_match_stderr,none": 0.01}}})
    row = df.set_index("metric").loc["exact_match[strict]"]
    assert row.stderr == 0.05
    assert [row.value_lo, row.value_hi] == pytest.approx(wilson_by_hand(0.3, 0.3 * 0.7 / 0.05 ** 2 + 1), abs=1e-6)


def test_a_patched_attribute_gone_from_lm_eval_is_one_line(monkeypatch):
    """lm-eval without an attribute moetool patches: one MoetoolError naming it and the tested version, not an
    AttributeError from inside mock."""
    from lm_eval import evaluator

    from moetool.errors import MoetoolError

    monkeypatch.delattr(evaluator, "get_git_commit_hash")
    with pytest.raises(MoetoolError, match=r"has no evaluator\.get_git_commit_hash: .* written for lm-eval "):
        with lmeval_compat.no_env_report():
            pass


def _generate_task(tmp_path, docs: int = 4, max_gen_toks: int = 8) -> Path:
    """A generate_until task (greedy, ``max_gen_toks`` tokens, a stop string never generated) on the shipped prose
    contexts: a folder for ``--include-path``."""
    rows = [json.loads(l) for l in Path(plan_file(TASK)).read_text().splitlines()[:docs]]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps({"context": r["context"], "answer": r["choices"][r["label"]]})
                                                + "\n" for r in rows))
    (tmp_path / "gen.yaml").write_text(yaml.safe_dump({
        "task": "moetool_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "gen.jsonl")}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "context", "doc_to_target": "answer",
        "generation_kwargs": {"until": ["@@@"], "max_gen_toks": max_gen_toks, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))
    return tmp_path


@pytest.mark.slow
def test_generation_under_a_policy_reading_the_sequence_routes_every_step_by_it(no_network, tmp_path):
    """generate_until under similarity / attention: lm-eval's ``model.generate(use_cache=True)`` fed each decoding
    step's forward the new token alone, so similarity routed every generated token by itself (its own π: the router's
    choice, a text the policy did not write -- on doc 2 the router's '\\nthere is not supported by' instead of the
    policy's '\\nthere is a string. ') and attention stopped the run ('attention probabilities of shape (1, 4, 1, ..)
    ... pass use_cache=False'). Each generated text must be the greedy decode with the policy applied to whole-sequence
    forwards, by hand."""
    lm = load("tiny")
    plan = lmeval.plan_tasks(["moetool_gen"], _generate_task(tmp_path))
    hflm = lmeval.make_hflm(lm, batch_size=1)  # one row per forward: no padding in lm-eval's generation

    def by_hand(context: str, spec: str, n: int = 8) -> str:
        ids = hflm.tok_encode(context)
        with torch.no_grad(), Engine(lm.model, lm.layers, policy=make_policy(spec)):
            for _ in range(n):
                ids.append(int(lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        return hflm.tok_decode(ids[-n:])

    differs = 0
    for spec in ("similarity", "attention"):
        res = lmeval.evaluate(lm, plan, policy=make_policy(spec), hflm=hflm, log_samples=True, quiet=True)
        for d in res.samples["moetool_gen"]:
            context = d["arguments"][0][0]  # (context, generation kwargs)
            assert d["resps"][0][0] == by_hand(context, spec)
            differs += by_hand(context, spec) != by_hand(context, "router")
    assert differs >= 2  # the policies wrote other text than the router: the comparison can tell them apart
    assert "generate" not in vars(lm.model)  # the model's own generate back after the run


@pytest.mark.parametrize("what, value", [("limit", 0), ("limit", -1), ("num_fewshot", -1), ("num_fewshot", -5)])
def test_lm_eval_counts_out_of_range_are_one_line_in_the_library(what, value):
    """The command line's ``--limit`` (min 1) and ``--num-fewshot`` (min 0), in the library too: ``limit=0`` was
    lm-eval's traceback 'ValueError: task.build_requests() did not find any docs!', ``limit=-1`` islice's 'Indices for
    islice() must be None or an integer', and ``num_fewshot=-1`` ran silently (as zero-shot). Every options class of
    the lm-eval group refuses them before any model work (prune refused --limit 0 alone)."""
    from moetool import evaluate
    from moetool.errors import MoetoolError
    from moetool.experiments.norm_select.spec import NormSelectOptions
    from moetool.experiments.prune.spec import PruneOptions
    from moetool.experiments.result import resolve_options

    flag = "--" + what.replace("_", "-")
    least = {"limit": 1, "num_fewshot": 0}[what]
    line = rf"^{flag} must be at least {least}, not {value}$"
    with pytest.raises(MoetoolError, match=line):
        evaluate(load("tiny"), tasks=(TASK,), **{what: value})
    for cls in (NormSelectOptions, PruneOptions):
        with pytest.raises(MoetoolError, match=line):
            resolve_options(cls, None, {what: value})
    assert resolve_options(lmeval.EvalOptions, None, {"tasks": (TASK,), what: least + 1}).__dict__[what] == least + 1


@pytest.mark.parametrize("spec", ["similarity", "attention"])
def test_a_cached_decoding_step_under_a_policy_reading_the_sequence_is_one_line(spec):
    """Through ``moetool.hook`` a researcher's own ``model.generate`` keeps its KV cache: each decoding step's forward
    holds the new token alone, so similarity routed it by itself (the router's choice, silently) and attention refused
    in the middle of the generation. The engine refuses the first cached step in one line; without the cache the
    generation is the greedy decode under the policy over whole-sequence forwards, by hand; a policy that routes each
    token by itself (norm:gate) keeps the cache and generates what it generates without one."""
    from moetool.errors import MoetoolError

    lm = load("tiny")
    prompt = torch.tensor([[5, 17, 29, 41, 3, 8]])
    with torch.no_grad(), Engine(lm.model, lm.layers, policy=make_policy(spec)):
        with pytest.raises(MoetoolError, match=rf"^the {spec} policy routes a token by the earlier tokens of its "
                                               r"sequence, but this forward continues a KV cache of 6 tokens"):
            lm.model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=True)
        out = lm.model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False)[0, 6:].tolist()
        ids = prompt[0].tolist()
        for _ in range(3):
            ids.append(int(lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert out == ids[6:]
    with torch.no_grad(), Engine(lm.model, lm.layers, policy=make_policy("norm:gate")):
        cached = lm.model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=True)
        plain = lm.model.generate(prompt, max_new_tokens=3, do_sample=False, use_cache=False)
    assert cached.tolist() == plain.tolist()


def test_a_forward_given_a_filled_cache_by_its_old_name_past_key_values_is_refused_too():
    """transformers 5.x renamed the forward's ``past_key_values`` to ``cache`` and still accepts the old name (a
    deprecation warning): a researcher's loop passing ``past_key_values=`` a 4-token cache ran the new token alone
    under similarity, routed by itself. The engine reads either name (pass 17: reading ``cache`` alone passed
    test_eval); a forward with an empty cache, or none, runs."""
    import warnings

    from transformers import DynamicCache

    from moetool.errors import MoetoolError

    lm = load("tiny")
    with torch.no_grad():
        filled = lm.model(input_ids=torch.tensor([[5, 17, 29, 41]]), use_cache=True)
        cache = filled.get("cache", None) or filled.get("past_key_values", None)
        assert cache.get_seq_length() == 4
        with Engine(lm.model, lm.layers, policy=make_policy("similarity")), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with pytest.raises(MoetoolError, match=r"^the similarity policy routes a token by the earlier tokens of "
                                                   r"its sequence, but this forward continues a KV cache of 4 tokens"):
                lm.model(input_ids=torch.tensor([[3]]), past_key_values=cache)
            lm.model(input_ids=torch.tensor([[3, 8]]), past_key_values=DynamicCache(config=lm.model.config))
