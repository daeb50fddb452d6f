"""``locality`` against a hand count from a plain transformers forward (a hook on each MoE block's router, no
moetool hook or adapter): first choices and top-K sets of consecutive real tokens counted token by token."""

from __future__ import annotations


import numpy as np
import pytest
from peer.peer_capture import capture  # the router's own outputs, hooked on the plain model (no moetool)


def hand_locality(logits, idx, mask):
    """The table's numbers counted pair by pair in Python."""
    R, S = mask.shape
    n, K = logits.shape[1], idx.shape[1]
    first = [int(idx[t][int(np.argmax([float(logits[t, e]) for e in idx[t]]))]) for t in range(R * S)]
    pairs = same = shared = 0
    counts = [0] * n
    for r in range(R):
        for s in range(S):
            t = r * S + s
            if mask[r, s]:
                counts[first[t]] += 1
            if s and mask[r, s] and mask[r, s - 1]:
                pairs += 1
                same += first[t] == first[t - 1]
                shared += len(set(idx[t].tolist()) & set(idx[t - 1].tolist()))
    tokens = sum(counts)
    return {"tokens": tokens, "pairs": pairs, "top1_repeat": same / pairs,
            "top1_repeat_independent": sum((c / tokens) ** 2 for c in counts), "top1_repeat_uniform": 1 / n,
            "topk_overlap": shared / (pairs * K), "topk_overlap_uniform": K / n}


@pytest.mark.parametrize("name", ["tiny", "tiny-fine"])
def test_locality_matches_a_hand_count(name):
    import moetool

    lm = moetool.load(name, device="cpu")
    ts = moetool.tokens(lm, None, seq_len=48, max_tokens=700)  # the last row partly padding
    assert not bool(ts.attention_mask.all())
    res = moetool.locality(lm, ts, batch_size=4)
    seen = {i: (c["logits"], c["idx"]) for i, c in capture(lm.model, ts.input_ids, ts.attention_mask).items()}
    df = res["locality"]
    assert sorted(df.layer) == sorted(seen)
    for row in df.itertuples():
        logits, idx = seen[row.layer]
        ref = hand_locality(logits, idx, ts.attention_mask.bool())
        for col, want in ref.items():
            assert getattr(row, col) == pytest.approx(want, abs=1e-12), (row.layer, col)
    assert (df.top1_repeat > df.top1_repeat_uniform).any()  # the embedded text is not uniform noise


def test_a_pair_needs_both_tokens_real_with_left_padding():
    """Left padding (a real token right after a padding one) forms no pair: the pairs, repeats and overlaps are the
    hand count's on a batch whose rows start with padding."""
    import dataclasses

    import moetool

    lm = moetool.load("tiny", device="cpu")
    ts = moetool.tokens(lm, None, seq_len=24, max_tokens=200)
    mask = ts.attention_mask.clone()
    mask[0, :5] = 0  # left padding in two rows
    mask[2, :1] = 0
    ts = dataclasses.replace(ts, attention_mask=mask)
    df = moetool.locality(lm, ts, batch_size=4)["locality"]
    seen = {i: (c["logits"], c["idx"]) for i, c in capture(lm.model, ts.input_ids, ts.attention_mask).items()}
    for row in df.itertuples():
        ref = hand_locality(*seen[row.layer], mask.bool())
        for col, want in ref.items():
            assert getattr(row, col) == pytest.approx(want, abs=1e-12), (row.layer, col)


def test_layers_and_batch_size_change_nothing_but_the_rows(tmp_path):
    """--layers keeps exactly the asked layers with the same numbers; the batch size does not change a sum."""
    import moetool

    lm = moetool.load("tiny", device="cpu")
    ts = moetool.tokens(lm, None, seq_len=32, max_tokens=512)
    every = moetool.locality(lm, ts, batch_size=3)["locality"].set_index("layer")
    one = moetool.locality(lm, ts, layers=(2,), batch_size=16)["locality"].set_index("layer")
    assert list(one.index) == [2]
    assert one.loc[2].to_dict() == pytest.approx(every.loc[2].to_dict(), abs=1e-12)


def test_bad_batch_size_is_one_line():
    from moetool.errors import MoetoolError
    from moetool.experiments.locality.compute import LocalityOptions

    with pytest.raises(MoetoolError, match="batch_size= must be >= 1"):
        LocalityOptions(batch_size=0)


def test_first_choice_is_the_first_ranked_not_the_routers_first_column():
    """LongCat-Flash's router returns its top-K unsorted (``topk(sorted=False)``): the first column of idx is often
    not its first-ranked chosen expert. top1_repeat and top1_repeat_independent count the first-ranked one by what the
    router selects on, softmax(logits) + its correction bias (the definition: the routing decision), as the hand
    count does from the router's own logits and bias buffer, on rows with padding."""
    import torch
    from types import SimpleNamespace

    from conftest import longcat_unsorted_router_model, router_outputs
    from moetool.adapters import find_moe_layers
    from moetool.data import TokenSet
    from moetool.experiments.locality.compute import locality

    model, routers, ids = longcat_unsorted_router_model(6, torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, -6:], mask[5, -3:] = 0, 0
    seen = router_outputs(model, routers, ids, mask)
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    df = locality(lm, TokenSet(ids, mask, [""] * 6, "test"), batch_size=6, quiet=True)["locality"].set_index("layer")
    keep = mask.reshape(-1).bool()
    for i, (logits, _, idx) in seen.items():
        scores = logits.float().softmax(-1) + routers[i].e_score_correction_bias.float()  # what it selects on
        assert (scores.gather(1, idx).argmax(-1) != 0)[keep].any()  # the case: the first column is not the first
        ref = hand_locality(scores, idx, mask.bool())
        for col in ("tokens", "pairs", "top1_repeat", "top1_repeat_independent", "topk_overlap"):
            assert df.loc[i, col] == pytest.approx(ref[col], abs=1e-12), (i, col)


def test_rows_of_one_real_token_each_are_one_line():
    """Every row holds a single real token (one right-, one left-padded): no pair of consecutive real tokens, so
    top1_repeat = same / pairs is 0 / 0: one line naming the fix, not a ZeroDivisionError."""
    import torch

    import moetool
    from moetool.data import TokenSet
    from moetool.errors import MoetoolError

    lm = moetool.load("tiny", device="cpu")
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[1, 0, 0], [0, 0, 1]])
    with pytest.raises(MoetoolError, match="no two consecutive real tokens"):
        moetool.locality(lm, TokenSet(ids, mask, [""] * 2, "test"), batch_size=2, quiet=True)


def test_first_choice_is_the_routing_decision_of_a_biased_router():
    """DeepSeek-V3 selects by sigmoid(logits) + its correction bias and weighs by the sigmoid alone: the first choice
    is the chosen expert ranked first by what it selects on, as fluctuation and offload read the top-1 (ops.top1),
    counted by hand from the router module's own outputs and bias buffer. The largest router probability (the
    sigmoid alone, what locality read) gives another top1_repeat in some layer."""
    import torch
    from types import SimpleNamespace

    from conftest import feed
    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.data import TokenSet
    from moetool.experiments.locality.compute import locality

    model = build_tiny("deepseek_v3", seed=0)
    ids = torch.randint(3, model.config.vocab_size, (6, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    seen, hooks = [], []
    for mod in (m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"):
        hooks.append(mod.register_forward_hook(lambda m, a, out: seen.append(
            (out[0].float().sigmoid(), m.e_score_correction_bias.float(), out[2]))))
    with torch.no_grad():
        feed(model, ids, mask)
    for h in hooks:
        h.remove()
    lm = SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)
    df = locality(lm, TokenSet(ids, mask, [""] * 6, "test"), batch_size=6, quiet=True)["locality"]
    assert len(df) == len(seen)
    differs = False
    for row, (sig, bias, idx) in zip(df.itertuples(), seen):
        ref = hand_locality(sig + bias, idx, mask.bool())
        for col in ("tokens", "pairs", "top1_repeat", "top1_repeat_independent", "topk_overlap"):
            assert getattr(row, col) == pytest.approx(ref[col], abs=1e-12), (row.layer, col)
        differs |= hand_locality(sig, idx, mask.bool())["top1_repeat"] != ref["top1_repeat"]
    assert differs  # the test bites: the largest probability is another first choice somewhere
