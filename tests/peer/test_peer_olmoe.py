"""Peer cross-check: ``moetool stats``' OLMoE analyses against the OLMoE authors' own scripts (Muennighoff et al.
2024, "OLMoE: Open Mixture-of-Experts Language Models", arXiv 2409.02060, sec. 5).

Ported from allenai/OLMoE @ 357454f4f647385839c0ff6b99a688dc7cd9c13f:

* ``scripts/run_moe_analysis.py`` ``run`` (line 77): one sequence per forward, ``model(input_ids=...,
  output_router_logits=True)``, ``predicted_token_ids = np.argmax(logits, -1)``, ``exp_ids = np.stack([np.argsort(
  -logits, -1)[:, :8] ...], -1)`` ([tokens, K, layers], the first column the largest router logit);
* vocabulary specialisation (``do_token_analysis`` line 327, ``do_token_analysis_experts`` line 458,
  ``do_token_analysis_layers_experts`` line 521 with ``--topk 1``): per token id the first-ranked experts of its
  occurrences, as the input token (``zip(input_ids, exp_ids)``), the ground-truth next token (``zip(input_ids[1:],
  exp_ids)``) and the predicted token (``zip(predicted_token_ids, exp_ids)``); ``print_avg``: ``most_freq_id, val =
  sorted(Counter(exp_ids).items(), key=lambda x: -x[1])[0]``, ``val / len(exp_ids)`` averaged over every token id
  (``do_token_analysis``, ``do_token_analysis_layers_experts``: moetool's ``specialization_all_ids``) or over the ids
  with ``len(exp_ids) >= 10`` (``do_token_analysis_experts``: moetool's ``specialization``, ``--min-count 10``);
  ``exp_id_to_vocabs[most_freq_id]`` (ids with >= 10 occurrences, the 15 highest per expert written out):
  moetool's ``specialized_tokens.csv``;
* ``do_coactivation_analysis`` (line 246): ``pairwise(indices)`` of each token's ranked top-K, both orders counted,
  ``pairwise_counter[(a, b)] / single_counter[a]``: moetool's ``--coactivation adjacent``;
* ``do_ckpt_analysis`` (line 128, router saturation) ``compare_with_early_results``: per layer the share of tokens
  whose first-ranked expert is the same in an early checkpoint and the final one (``--topk 1``), and the mean
  ``len(set(_indices) & set(_e_indices)) / 8`` (``--topk 8``): 1 - moetool ``fluctuation``'s ``top1_change`` and
  its ``topk_overlap`` (the script's 16 layers and 8 experts are the model's L and K here);
* ``scripts/run_routing_analysis.py`` ``run_analysis`` (line 103): ``layer_counters[layer].update(Counter(
  exp_ids[:, :, layer].flatten()))`` per domain, drawn by ``scripts/plot_routing_analysis_v2.ipynb``
  (``load_data_for_model``) as ``v / total_count * 100`` times ``k`` (domain specialisation): moetool's
  ``domain_load.csv`` ``load_fraction`` and ``token_fraction``; ``crosslayer_counters`` (line 159, ``Counter(zip(
  exp_ids[:, :, layer_i].flatten(), exp_ids[:, :, layer_j].flatten()))``) on the first-ranked experts (the
  ``*_crosslayer_top1`` files ``plot_routing_analysis_v2_cross_layer.ipynb`` draws): moetool's ``cross_layer.csv``
  with ``--top-k 1``; ``load_balancing_loss_func`` (line 19, "Fixed aggregating over all layers") per sequence:
  the mean over layers of moetool's per-layer ``aux_loss`` on that sequence.

The scripts load OLMoE or Mixtral from the Hub; here the embedded models, through the same ``output_router_logits``
path, on moetool's packed rows of the shipped held-out text (``moetool.tokens``; two domains, ``code`` and
``prose``, one per row), 8,192 tokens.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from itertools import pairwise  # the script's more_itertools.pairwise: the same pairs (it is itertools' on 3.10+)

import numpy as np
import pytest
import torch
from peer_capture import readme, tokens

pytestmark = pytest.mark.slow
XDIST_GROUP_BY = "case"  # one xdist worker per model: its module fixture (run + reference) made once (conftest)


# ---- port of scripts/run_moe_analysis.py and scripts/run_routing_analysis.py (allenai/OLMoE @ 357454f) -----------
def run(model, rows, top_k):
    """``run``: one forward per sequence; the router logits of every layer, the top-K by ``argsort(-logits)``."""
    results = []
    for input_ids in rows:
        input_ids = torch.LongTensor(input_ids).reshape(1, -1)
        with torch.no_grad():
            out = model(input_ids=input_ids, output_router_logits=True)
        input_ids = input_ids[0].detach().cpu().numpy().tolist()
        logits = out["logits"][0].detach().cpu().numpy()
        predicted_token_ids = np.argmax(logits, -1).tolist()
        router_logits = [l.detach().cpu().numpy() for l in out["router_logits"]]
        exp_ids = np.stack([np.argsort(-logits, -1)[:, :top_k].tolist() for logits in router_logits], -1).tolist()
        results.append({"input_ids": input_ids, "predicted_token_ids": predicted_token_ids, "exp_ids": exp_ids,
                        "router_logits": out["router_logits"]})  # (router_logits added: the aux-loss port reads them)
    return results


def token_to_experts(results, layer_num):
    """The three ``*_to_exp`` dicts of ``do_token_analysis`` (first-ranked expert, ``exp_ids[:, 0, layer_num]``)."""
    input_id_to_exp = defaultdict(list)
    gt_next_token_to_exp = defaultdict(list)
    predicted_next_token_to_exp = defaultdict(list)
    for result in results:
        input_ids = result["input_ids"]
        gt_next_token_ids = input_ids[1:]
        predicted_next_token_ids = result["predicted_token_ids"]
        exp_ids = np.array(result["exp_ids"])[:, 0, layer_num].tolist()

        for _id, exp_id in zip(input_ids, exp_ids):
            input_id_to_exp[_id].append(exp_id)
        for _id, exp_id in zip(gt_next_token_ids, exp_ids):
            gt_next_token_to_exp[_id].append(exp_id)
        for _id, exp_id in zip(predicted_next_token_ids, exp_ids):
            predicted_next_token_to_exp[_id].append(exp_id)
    return {"input": input_id_to_exp, "next_token": gt_next_token_to_exp, "predicted": predicted_next_token_to_exp}


def print_avg_token_analysis(id_to_exp):
    """``do_token_analysis``'s ``print_avg``: the printed average over every id, and ``exp_id_to_vocabs``."""
    probs = []
    exp_id_to_vocabs = defaultdict(list)

    for _id, exp_ids in id_to_exp.items():
        most_freq_id, val = sorted(Counter(exp_ids).items(), key=lambda x: -x[1])[0]
        probs.append(val / len(exp_ids))
        if len(exp_ids) >= 10:
            exp_id_to_vocabs[most_freq_id].append((_id, val/len(exp_ids)))
    return np.mean(probs), exp_id_to_vocabs


def print_avg_experts(id_to_exp):
    """``do_token_analysis_experts``' ``print_avg``: the average over the ids with >= 10 occurrences."""
    probs = []
    exp_id_to_probs = defaultdict(list)
    for _id, exp_ids in id_to_exp.items():
        most_freq_id, val = sorted(Counter(exp_ids).items(), key=lambda x: -x[1])[0]
        if len(exp_ids) >= 10:
            probs.append(val / len(exp_ids))
            exp_id_to_probs[most_freq_id].append(val / len(exp_ids))
    exp_id_to_probs = {k: (np.mean(v), len(v)) for k, v in exp_id_to_probs.items()}
    return exp_id_to_probs, np.mean(probs)


def print_avg_layers_experts(id_to_exp, topk=1, normalize=False, random_prob=None):
    """``do_token_analysis_layers_experts``' ``print_avg`` (the paper's figure, ``--topk 1``)."""
    probs = []
    exp_id_to_probs = defaultdict(list)
    for _id, exp_ids in id_to_exp.items():
        most_freq_id, val = sorted(Counter(exp_ids).items(), key=lambda x: -x[1])[0]
        max_possible = len(exp_ids) // topk
        if normalize:
            prob = (val / max_possible - random_prob) / (1 - random_prob)
        else:
            prob = val / max_possible
        probs.append(prob)
        exp_id_to_probs[most_freq_id].append(prob)
    exp_id_to_probs = {k: (np.mean(v), len(v)) for k, v in exp_id_to_probs.items()}
    return exp_id_to_probs, np.mean(probs)


def coactivation(results, layer_num):
    """``do_coactivation_analysis`` up to ``pairwise_probs``."""
    pairwise_counter = Counter()
    single_counter = Counter()
    for result in results:
        for indices in np.array(result["exp_ids"])[:, :, layer_num].tolist():
            for i in indices:
                single_counter[i] += 1
            for (a, b) in pairwise(indices):
                pairwise_counter[(a, b)] += 1
                pairwise_counter[(b, a)] += 1
    return {(a, b): pairwise_counter[(a, b)] / single_counter[a] for (a, b) in pairwise_counter}


def compare_with_early_results(results, early_results, topk, n_layers, k):
    """``do_ckpt_analysis``' ``compare_with_early_results`` up to its per-layer ``result`` (16 -> n_layers,
    8 -> k, (2048, 8) -> each sequence's (length, k))."""
    equals = Counter()
    total = 0
    ratio_per_layer = defaultdict(list)

    for r, er in zip(results, early_results):
        assert r["input_ids"] == er["input_ids"]

        if topk == 1:
            exp_ids = np.array(r["exp_ids"])[:, 0, :]
            e_exp_ids = np.array(er["exp_ids"])[:, 0, :]
            assert exp_ids.shape==e_exp_ids.shape, (exp_ids.shape, e_exp_ids.shape)
            curr_equals = exp_ids==e_exp_ids # [token_cnt, n_layers]
            for i, _curr_equals in enumerate(curr_equals.transpose(1, 0).tolist()):
                equals[i] += np.sum(_curr_equals)
            total += len(curr_equals)
        else:
            exp_ids = np.array(r["exp_ids"])
            e_exp_ids = np.array(er["exp_ids"])
            for layer_idx in range(n_layers):
                indices = exp_ids[:, :, layer_idx]
                e_indices = e_exp_ids[:, :, layer_idx]
                assert indices.shape==e_indices.shape==(len(r["input_ids"]), k)
                for _indices, _e_indices in zip(indices.tolist(), e_indices.tolist()):
                    ratio = len(set(_indices) & set(_e_indices)) / k
                    ratio_per_layer[layer_idx].append(ratio)

    result = []
    for i in range(n_layers):
        if topk == 1:
            result.append(equals[i] / total)
        else:
            result.append(np.mean(ratio_per_layer[i]))
    return result


def routing_analysis(results):
    """``run_analysis``' ``layer_counters`` and ``crosslayer_counters`` over the results of one domain."""
    layer_counters = defaultdict(Counter)
    crosslayer_counters = defaultdict(Counter)
    for result in results:
        exp_ids = np.array(result["exp_ids"])
        for layer in range(exp_ids.shape[2]):
            exp_counts = Counter(exp_ids[:, :, layer].flatten())
            layer_counters[layer].update(exp_counts)

        for layer_i in range(exp_ids.shape[2] - 1):
            for layer_j in range(exp_ids.shape[2]):
                exps_counts = Counter(zip(exp_ids[:, :, layer_i].flatten(), exp_ids[:, :, layer_j].flatten()))
                crosslayer_counters[(layer_i, layer_j)].update(exps_counts)
    return layer_counters, crosslayer_counters


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2):
    """``run_routing_analysis.py``'s ``load_balancing_loss_func`` ("Fixed aggregating over all layers")."""
    compute_device = gate_logits[0].device
    concatenated_gate_logits = torch.stack([layer_gate.to(compute_device) for layer_gate in gate_logits], dim=1)
    routing_weights = torch.nn.functional.softmax(concatenated_gate_logits, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = torch.nn.functional.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(-2)) / len(gate_logits)
    return overall_loss * num_experts
# ---- end of the port ------------------------------------------------------------------------------------------


def config_of(lm):
    cfg = lm.model.config
    return cfg.num_hidden_layers, cfg.num_experts_per_tok, getattr(cfg, "num_local_experts", None) or cfg.num_experts


@pytest.fixture(scope="module", params=["tiny", "tiny-fine"])
def case(request):
    lm, ts = tokens(request.param)
    assert bool(ts.attention_mask.bool().all())  # whole rows: the scripts' sequences have no padding
    L, K, n = config_of(lm)
    results = run(lm.model, ts.input_ids.tolist(), K)
    return request.param, lm, ts, results, (L, K, n)


def test_vocabulary_specialisation_is_olmoes(case):
    """``specialization.csv`` per layer and view: ``specialization_all_ids`` is the scripts' printed average over
    every token id (``do_token_analysis``, and ``do_token_analysis_layers_experts --topk 1``, the paper's figure),
    ``specialization`` the average over ids with >= 10 occurrences (``do_token_analysis_experts``); and
    ``specialized_tokens.csv`` lists per expert exactly the ids of ``exp_id_to_vocabs``, with their shares."""
    import moetool

    name, lm, ts, results, (L, K, n) = case
    res = moetool.stats(lm, ts, bootstrap=0, quiet=True, min_count=10, top_tokens=1_000_000)
    spec, best = res["specialization.csv"], res["specialized_tokens.csv"]
    ties = 0
    for layer in range(L):
        for view, id_to_exp in token_to_experts(results, layer).items():
            row = spec[(spec.layer == layer) & (spec.view == view)].iloc[0]
            all_ids, exp_id_to_vocabs = print_avg_token_analysis(id_to_exp)
            _, kept = print_avg_experts(id_to_exp)
            _, figure = print_avg_layers_experts(id_to_exp, topk=1)
            assert row.token_ids_all == len(id_to_exp), (name, layer, view)
            assert row.token_ids == sum(len(v) >= 10 for v in id_to_exp.values()), (name, layer, view)
            np.testing.assert_allclose(row.specialization_all_ids, all_ids, rtol=1e-12, err_msg=f"{name} {layer} {view}")
            np.testing.assert_allclose(row.specialization_all_ids, figure, rtol=1e-12)
            np.testing.assert_allclose(row.specialization, kept, rtol=1e-12, err_msg=f"{name} {layer} {view}")
            # exp_id_to_vocabs: which expert lists which ids (>= 10 occurrences) and with which share. The script
            # gives an id tied between experts to the one it met first, moetool to the lowest expert id
            got = best[(best.layer == layer) & (best.view == view)]
            got_share = dict(zip(got.token_id, got.specialization))
            got_expert = dict(zip(got.token_id, got.expert))
            want = {tid: (e, p) for e, vocabs in exp_id_to_vocabs.items() for tid, p in vocabs}
            assert set(got_share) == set(want), (name, layer, view)
            tied = set()
            for tid, (e, p) in want.items():
                assert got_share[tid] == pytest.approx(p, rel=1e-12), (name, layer, view, tid)
                counts = Counter(id_to_exp[tid])
                top = sorted(x for x, c in counts.items() if c == max(counts.values()))
                assert e in top and got_expert[tid] == top[0], (name, layer, view, tid)
                if len(top) > 1:
                    tied.add(tid)
            ties += len(tied)
            # the 15 ids the script writes per expert, highest share first: the shares of moetool's first 15
            # (experts whose lists hold no tied id)
            for e, vocabs in exp_id_to_vocabs.items():
                mine = got[got.expert == e].sort_values("rank")
                if tied & ({t for t, _ in vocabs} | set(mine.token_id)):
                    continue
                top15 = [p for _, p in sorted(vocabs, key=lambda x: -x[1])[:15]]
                np.testing.assert_allclose(mine["specialization"].to_numpy()[:15], top15, rtol=1e-12)
    print(f"{name}: {ties} (layer, view, id) with tied most frequent experts")
    said = {"tiny": f"({ties} (layer, view, id) on `tiny`,", "tiny-fine": f", {ties} on `tiny-fine`)"}[name]
    assert said in readme(), said  # the README's stats row quotes the ties of both models


def test_domain_specialisation_and_cross_layer_are_olmoes(case):
    """``domain_load.csv``: per domain, layer and expert, ``load_fraction`` is the notebook's ``v / total_count``
    and ``token_fraction`` its Proportion x k (experts the Counter never met: 0); ``cross_layer.csv`` with
    ``--top-k 1`` is ``crosslayer_counters`` of consecutive layers on the first-ranked experts."""
    import moetool

    name, lm, ts, results, (L, K, n) = case
    res = moetool.stats(lm, ts, bootstrap=0, quiet=True, top_tokens=0, specialization=False)
    dom = res["domain_load.csv"]
    assert sorted(set(dom.domain)) == sorted(set(ts.domains)) == ["code", "prose"]
    for domain in sorted(set(ts.domains)):
        layer_counters, _ = routing_analysis([r for r, d in zip(results, ts.domains) if d == domain])
        for layer in range(L):
            total_count = sum(layer_counters[layer].values())
            proportion = np.array([layer_counters[layer].get(e, 0) / total_count for e in range(n)])
            got = dom[(dom.domain == domain) & (dom.layer == layer)].sort_values("expert")
            np.testing.assert_allclose(got.load_fraction, proportion, rtol=1e-12, err_msg=f"{name} {domain} {layer}")
            np.testing.assert_allclose(got.token_fraction, proportion * K, rtol=1e-12)
            np.testing.assert_array_equal(got.tokens, [layer_counters[layer].get(e, 0) for e in range(n)])
    top1 = [dict(r, exp_ids=np.array(r["exp_ids"])[:, :1, :].tolist()) for r in results]
    _, cross = routing_analysis(top1)
    res1 = moetool.stats(lm, ts, bootstrap=0, quiet=True, top_tokens=0, specialization=False, top_k=1)
    cl = res1["cross_layer.csv"]
    for layer in range(L - 1):
        got = cl[cl.layer == layer]
        assert set(got.next_layer) == {layer + 1}
        got_counts = {(a, b): c for a, b, c in zip(got.a, got.b, got["count"]) if c}
        want = {(int(a), int(b)): c for (a, b), c in cross[(layer, layer + 1)].items()}
        assert got_counts == want, (name, layer)


def test_coactivation_adjacent_is_olmoes(case):
    """``coactivation.csv`` with ``--coactivation adjacent``: ``p_b_given_a`` is ``pairwise_probs`` (0 where the
    script never counted the pair)."""
    import moetool

    name, lm, ts, results, (L, K, n) = case
    res = moetool.stats(lm, ts, bootstrap=0, quiet=True, top_tokens=0, specialization=False, coactivation="adjacent")
    co = res["coactivation.csv"]
    for layer in range(L):
        want = coactivation(results, layer)
        got = co[co.layer == layer]
        assert len(got) == n * (n - 1)
        for a, b, p in zip(got.a, got.b, got.p_b_given_a):
            assert p == pytest.approx(want.get((a, b), 0.0), rel=1e-12, abs=0), (name, layer, a, b)


def test_aux_loss_per_sequence_is_olmoes(case):
    """On one sequence, the mean over layers of ``layers.csv``'s ``aux_loss`` is the script's
    ``load_balancing_loss_func`` (its per-layer f and P, not transformers' pooled ``aux_loss_hf_pooled``)."""
    import moetool

    name, lm, ts, results, (L, K, n) = case
    for r in (0, 5):
        one = dataclasses.replace(ts, input_ids=ts.input_ids[r:r + 1], attention_mask=ts.attention_mask[r:r + 1],
                                  domains=ts.domains[r:r + 1])
        res = moetool.stats(lm, one, bootstrap=0, quiet=True, top_tokens=0, specialization=False)
        want = load_balancing_loss_func(results[r]["router_logits"], n, K).item()
        assert res["layers.csv"]["aux_loss"].mean() == pytest.approx(want, rel=1e-5), (name, r)
    if name == "tiny":  # the README quotes, on all of tiny's 256-token rows, the script's printed aux loss (the mean
        # of its per-sequence losses), the mean over layers of moetool's aux_loss and aux_loss_hf_pooled
        script = np.mean([load_balancing_loss_func(r["router_logits"], n, K).item() for r in results])
        layers = moetool.stats(lm, ts, bootstrap=0, quiet=True, top_tokens=0, specialization=False)["layers.csv"]
        said = (f"on `tiny`'s 256-token rows {script:.2f}, moetool's `aux_loss` (all tokens pooled per layer) "
                f"{layers.aux_loss.mean():.2f} on average over layers, `aux_loss_hf_pooled` "
                f"{layers.aux_loss_hf_pooled.mean():.2f}")
        assert said in readme(), said


@pytest.mark.parametrize("early,final", [("tiny-early", "tiny"), ("tiny-fine-early", "tiny-fine")])
def test_router_saturation_is_olmoes(early, final):
    """``fluctuation`` of an early checkpoint against the final one (the same token ids through each, as the
    script's ``c4_results_<step>.jsonl``): per layer ``1 - top1_change`` is the script's top-1 router saturation
    and ``topk_overlap`` its top-K one."""
    import moetool

    lm, ts = tokens(final)
    lm_early = moetool.load(early, device="cpu")
    L, K, n = config_of(lm)
    rows = ts.input_ids.tolist()
    results, early_results = run(lm.model, rows, K), run(lm_early.model, rows, K)
    sat1 = compare_with_early_results(results, early_results, 1, L, K)
    satk = compare_with_early_results(results, early_results, K, L, K)
    res = moetool.fluctuation([lm_early, lm], ts, bootstrap=1000, seed=0, quiet=True)  # the command's defaults
    fl = res["fluctuation.csv"]
    fl = fl[fl.routing == "router"].sort_values("layer")
    assert list(fl.layer) == list(range(L)) and set(fl.tokens) == {ts.n_tokens}
    np.testing.assert_allclose(1 - fl.top1_change.to_numpy(), sat1, rtol=1e-12, err_msg=final)
    np.testing.assert_allclose(fl.topk_overlap.to_numpy(), satk, rtol=1e-12, err_msg=final)
    assert min(sat1) < 1  # the checkpoints route differently somewhere
    if final == "tiny":  # the README quotes the summary of `moetool fluctuation tiny-early tiny` (8,192 tokens in
        # rows of 256, these rows): each number as printed, to the digits it shows
        said = re.search(r"on `tiny-early → tiny`: router (\S+) \[(\S+), (\S+)\], similarity (\S+) \[(\S+), (\S+)\], "
                         r"reduction (\S+) \[(\S+), (\S+)\]", readme())
        assert said, "the README's fluctuation figures moved: update this test"
        s = res["fluctuation_summary.csv"].set_index("routing")
        got = [*s.loc["router", ["top1_change", "top1_change_lo", "top1_change_hi"]],
               *s.loc["similarity", ["top1_change", "top1_change_lo", "top1_change_hi", "reduction_vs_router",
                                     "reduction_vs_router_lo", "reduction_vs_router_hi"]]]
        for quoted, value in zip(said.groups(), got, strict=True):
            assert float(quoted) == round(value, len(quoted.split(".")[1])), (quoted, value)
