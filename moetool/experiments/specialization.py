"""Streaming consumers behind ``stats``' OLMoE-style analyses: vocabulary specialisation, cross-layer
co-activation and the load-balancing view. Each rides on :func:`moetool.engine.forward` beside
:class:`~moetool.experiments.stats.compute.RoutingStats`, keeps its aggregates on the layer's device (padding is weighted
out, never indexed away, so nothing waits for the device inside the forward) and turns them into DataFrames at
the end with the pure functions below.

Conventions (also in :data:`DEFINITIONS`, written to the manifest):

* vocabulary specialisation counts each token's **first-ranked** expert, as allenai/OLMoE
  ``scripts/run_moe_analysis.py`` (``do_token_analysis``: ``exp_ids[:, 0, layer]``) does: the chosen expert with
  the largest selection score (:func:`chosen`), whatever order the router returned the top-K in;
* cross-layer co-activation counts every pair (top-K at layer l) x (top-K at the next MoE layer) of a token;
* the load-balancing view follows transformers' ``load_balancing_loss_func`` (f_e counts top-K assignments per
  token, so it sums to K; P_e is the mean routing probability).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import distributed, ops
from ..engine.hooks import RoutingEvent
from ..errors import MoetoolError
from ..sketch import MERGE_MIN, SparseCounter, dense_space

VIEWS = ("input", "next_token", "predicted")

DEFINITIONS = {
    "specialization": "per layer and view, mean over token ids with >= min_count occurrences of the share of the "
                      "token's occurrences whose first-ranked expert is the token's most frequent first-ranked "
                      "expert (OLMoE sec. 5; top-1 as allenai/OLMoE run_moe_analysis.py: the chosen expert with the "
                      "largest selection score, a correction bias included, whatever order the router returned its "
                      "top-K in). Views: input = the "
                      "token at the position, next_token = the ground-truth next token (positions whose next "
                      "position is real), predicted = argmax of the model's logits at the position. Encoder-decoder "
                      "models (the row as source and target): an encoder position t reads token t, its next_token "
                      "is token t+1 and its predicted the decoder's argmax for token t+1; a decoder position t reads "
                      "token t-1 (input; the first real position reads the start token: left out), its next_token "
                      "is token t and its predicted the argmax of the logits at t. "
                      "specialization_all_ids = the same mean over every token id (OLMoE's printed average); "
                      "specialization is empty when no token id reaches min_count",
    "specialized_tokens": "per layer, view and expert: token ids (>= min_count occurrences) whose most frequent "
                          "first-ranked expert it is (an id with two equally frequent experts goes to the lower "
                          "expert id; OLMoE's script takes the one it met first; specialization is the same either "
                          "way), ranked by specialization (ties: occurrences, token id)",
    "cross_layer": "for consecutive MoE layers l -> next (of one stack in an encoder-decoder: its encoder and "
                   "decoder read different tokens at a position): count[a,b] = tokens with a in the top-K at l and b in "
                   "the top-K at next (every pair of the two top-K sets); p_b_given_a = count / tokens with a at l "
                   "(sums to K over b; independent uniform routing gives K/n)",
    "cross_layer_summary": "mean_max_p = mean over experts a chosen at l of max_b p_b_given_a (uniform: K/n); "
                           "mutual_information = MI in nats of the pair distribution count / sum(count) against "
                           "the product of its marginals (0 = independent layers); _norm divides by log n",
    "view": "which token a position's routing is attributed to: input, next_token or predicted (see "
            "specialization)",
    "token_ids": "distinct token ids of the view with >= min_count occurrences: the ids specialization averages",
    "token_ids_all": "distinct token ids seen in the view: the ids specialization_all_ids averages",
    "specialization_all_ids": "specialization's mean over every token id of the view (token_ids_all, min_count "
                              "ignored), each id weighted equally whatever its occurrences (OLMoE's printed average)",
    "specialized_tokens.expert": "the token id's most frequent first-ranked expert in the view (ties: the lower id)",
    "specialized_tokens.rank": "1 .. top_tokens within the expert: by specialization, then occurrences, then the "
                               "lower token id",
    "occurrences": "positions of the view that read the token id (real tokens)",
    "specialized_tokens.count": "of those occurrences, the ones whose first-ranked expert is expert",
    "specialized_tokens.specialization": "count / occurrences: the share (0-1) of the token id's occurrences routed "
                                         "first to its most frequent first-ranked expert",
    "next_layer": "the MoE layer after layer (of the same stack), where b is chosen",
    "cross_layer.a/cross_layer.b": "a: an expert chosen at layer, b: an expert chosen at next_layer (every pair of "
                                   "the two layers' experts is a row)",
    "cross_layer.count": "tokens with a in their top-K at layer and b in their top-K at next_layer",
    "cross_layer.p_b_given_a": "count / tokens with a in their top-K at layer (empty if none): the fraction of a's "
                               "tokens that choose b at next_layer; sums to K (next_layer's) over b",
    "cross_layer_summary.tokens": "real tokens routed by both layers: sum(count) / (K * K of next_layer)",
    "mean_max_p": "max over b of p_b_given_a, averaged over the experts a chosen at layer at least once, each expert "
                  "weighted equally (not by its tokens): a fraction 0-1, how well one expert at layer predicts one "
                  "at next_layer",
    "uniform_max_p": "K / n of next_layer: mean_max_p under independent uniform routing",
    "mutual_information": "mutual information in nats between the expert pairs' two sides: the pair distribution "
                          "count / sum(count) against the product of its marginals (0 = independent layers); _norm "
                          "divides by log n of next_layer",
    "router_prob": "P_e: mean over real tokens of the router probability of e (the model's full routing "
                   "distribution pi; softmax of the logits for softmax routers, as load_balancing_loss_func)",
    "aux_loss": "n * sum_e f_e * P_e for the layer, f_e = token_fraction (tokens whose top-K contains e / tokens, "
                "sums to K: transformers' convention); uniform routing gives K",
    "aux_loss_hf_pooled": "the same loss pooled over the measured MoE layers (every MoE layer unless layers / "
                          "--layers chose some: then over those only, not the model's loss) as transformers' "
                          "load_balancing_loss_func pools it: f and P averaged over every (layer, token) first, then "
                          "n * sum f * P (not the mean of the per-layer losses); same value on every row",
}


def on_device(batch: dict[str, Any], key: str, device: Any) -> torch.Tensor:
    """``batch[key]`` copied to ``device`` once per batch (cached in ``batch["on"]``: one copy per device)."""
    cache = batch["on"]
    if (key, device) not in cache:
        cache[key, device] = ops.to_device(batch[key], device)
    return cache[key, device]


def chosen(ev: RoutingEvent, top_k: int | None = None, ranked: bool = False) -> torch.Tensor:
    """The event's top-K ``[T, K]`` as a table counts it: with ``top_k`` (1: OLMoE's ``*_top1``) its first ``top_k``
    in rank order (:attr:`~moetool.engine.hooks.RoutingEvent.ranked`: the largest selection score first, whatever
    order the router returned them in); without, every chosen expert, in rank order where ``ranked`` (neighbouring
    ranks count), else as the router returned them (a set: the order does not count)."""
    if top_k is None and not ranked:
        return ev.idx
    idx = ev.ranked[0]
    return idx[:, :top_k] if top_k else idx


def _masked_keys(ids: torch.Tensor, expert: torch.Tensor, n: int, keep: torch.Tensor) -> torch.Tensor:
    """``ids * n + expert`` where ``keep``, else -1 (dropped when the counts are read): no boolean indexing."""
    return torch.where(keep, ids.long() * n + expert.long(), torch.full_like(expert, -1, dtype=torch.long))


# ----- vocabulary specialisation -------------------------------------------------------------------
class VocabSpecialization:
    """Counts (token id, first-ranked expert) per layer for the three :data:`VIEWS`.

    ``begin_batch(batch)`` before each forward, the events during it, ``on_batch(batch, output)`` after it (the
    predicted view needs the logits).
    """

    def __init__(self, layers: list[Any], merge_min: int = MERGE_MIN, vocab: int | None = None):
        self.layers = {L.index: L for L in layers}
        self.merge_min = merge_min
        self.vocab = vocab  # a bound on the token ids (runner.id_space): small key spaces are counted densely
        self.counters: dict[int, dict[str, Any]] = {}
        self.n: dict[int, int] = {}
        self._batch: dict[str, Any] | None = None
        self._top1: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_batch(self, batch: Any) -> Any:
        ids, mask = batch.input_ids, batch.attention_mask.bool()  # [B, S]
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        nmask = torch.zeros_like(mask)
        nmask[:, :-1] = mask[:, 1:] & mask[:, :-1]
        self._batch = {"shape": tuple(ids.shape), "ids": ids.reshape(-1), "next": nxt.reshape(-1),
                       "next_ok": nmask.reshape(-1), "on": {}}
        if any(getattr(L, "stack", None) == "decoder" for L in self.layers.values()):  # decoder position t reads t-1
            prev = torch.zeros_like(ids)
            prev[:, 1:] = ids[:, :-1]
            pmask = torch.zeros_like(mask)
            pmask[:, 1:] = mask[:, 1:] & mask[:, :-1]
            self._batch.update(prev=prev.reshape(-1), prev_ok=pmask.reshape(-1))
        self._top1 = {}
        for views in self.counters.values():  # the last batch's keys: merged now, outside the forward
            for c in views.values():
                c.settle()
        return batch

    def _on(self, key: str, device: Any) -> torch.Tensor:
        return on_device(self._batch, key, device)

    def _counter(self, li: int, n: int) -> dict[str, Any]:
        if li not in self.counters:
            vocab = getattr(self, "vocab", None)  # (a state saved before it existed: sparse)
            space = dense_space(None if vocab is None else vocab * n, len(VIEWS) * len(self.layers))
            self.counters[li] = {v: SparseCounter(self.merge_min, defer=True, space=space)  # fed in the forward
                                 for v in VIEWS}
            self.n[li] = n
        return self.counters[li]

    def __call__(self, ev: RoutingEvent) -> None:
        if self._batch is None or self._batch["shape"] != tuple(ev.shape):
            raise MoetoolError("VocabSpecialization: call begin_batch(batch) before each forward")
        n, dev = ev.layer.n_experts, ev.idx.device
        top1 = chosen(ev, 1)[:, 0].long()  # [T] first-ranked expert (largest selection score)
        valid = ev.valid.to(dev)
        c = self._counter(ev.layer.index, n)
        if getattr(ev.layer, "stack", None) == "decoder":  # reads the previous token, predicts this one
            c["input"].add(_masked_keys(self._on("prev", dev), top1, n, valid & self._on("prev_ok", dev)))
            c["next_token"].add(_masked_keys(self._on("ids", dev), top1, n, valid))
        else:
            c["input"].add(_masked_keys(self._on("ids", dev), top1, n, valid))
            c["next_token"].add(_masked_keys(self._on("next", dev), top1, n, valid & self._on("next_ok", dev)))
        self._top1[ev.layer.index] = (top1, valid)

    def on_batch(self, batch: Any, output: Any) -> None:
        pred = ops.argmax(output.logits)  # [B, S] predicted next token at every position (torch.argmax's)
        seq2seq = any(getattr(L, "stack", None) is not None for L in self.layers.values())
        if seq2seq:  # an encoder-decoder: the logits at t predict token t itself; encoder layers get t+1's
            nxt = torch.zeros_like(pred)
            nxt[:, :-1] = pred[:, 1:]
            nxt = nxt.reshape(-1)
        pred = pred.reshape(-1)
        for li, (top1, valid) in self._top1.items():
            keys = pred
            if seq2seq and getattr(self.layers[li], "stack", None) == "encoder":
                keys, valid = nxt, valid & self._on("next_ok", valid.device)
            self.counters[li]["predicted"].add(_masked_keys(keys.to(top1.device), top1, self.n[li], valid))
        self._top1 = {}

    def reduce_across_ranks(self) -> None:
        """Data parallel: the (token, expert) counts of every rank merged (one exchange); alone a no-op."""
        if distributed.world_size() <= 1:
            return
        parts = distributed.gather_object({li: (self.n[li], {v: c.host_state() for v, c in views.items()})
                                           for li, views in self.counters.items()})
        merged: dict[int, dict[str, Any]] = {}
        for li in sorted({li for p in parts for li in p}):
            have = [p[li] for p in parts if li in p]
            self.n[li] = have[0][0]
            merged[li] = {v: SparseCounter.merged([h[1][v] for h in have], self.merge_min) for v in VIEWS}
        self.counters = merged

    def token_table(self, li: int, view: str) -> Any:
        """Per token id of one layer and view: see :func:`token_specialization`."""
        keys, counts = self.counters[li][view].result()
        return token_specialization(keys, counts, self.n[li])

    def tables(self, tokenizer: Any = None, min_count: int = 10, top_n: int = 10) -> dict[str, Any]:
        """``specialization.csv`` and ``specialized_tokens.csv`` (numpy per layer and view, one DataFrame each)."""
        import numpy as np
        import pandas as pd

        missing = sorted(set(self.layers) - set(self.counters))
        if missing:
            raise MoetoolError(f"no routing events from MoE layers {missing}: nothing ran through them")
        rows, best = [], []
        for li in sorted(self.counters):
            for view in VIEWS:
                keys, counts = self.counters[li][view].result()
                tok = _token_arrays(keys, counts, self.n[li])
                if not len(tok["token_id"]):
                    raise MoetoolError(f"layer {li}: no tokens for the {view} view (sequences of length 1?)")
                kept = {c: v[tok["occurrences"] >= min_count] for c, v in tok.items()}
                rows.append({"layer": li, "view": view, "token_ids": len(kept["token_id"]),
                             "specialization": float(kept["specialization"].mean()) if len(kept["token_id"])
                             else math.nan, "token_ids_all": len(tok["token_id"]),
                             "specialization_all_ids": float(tok["specialization"].mean())})
                # per expert its top_n token ids: specialization, then occurrences, highest first; ties lowest id
                pos, rank = top_per_group(kept["expert"], [(kept["specialization"], True),
                                                           (kept["occurrences"], True), (kept["token_id"], False)],
                                          top_n)
                best.append({"layer": np.full(len(pos), li, dtype=np.int64), "view": [view] * len(pos),
                             "rank": rank, **{c: v[pos] for c, v in kept.items()}})
        spec = pd.DataFrame(rows)
        cols = ["layer", "view", "expert", "rank", "token_id", "token", "occurrences", "count", "specialization"]
        merged = pd.DataFrame({c: np.concatenate([b[c] for b in best]) for c in cols if c != "token"})
        tokens = with_tokens(merged, token_decoder(tokenizer))[cols]
        return {"specialization.csv": spec, "specialized_tokens.csv": tokens}


def top_per_group(group: Any, keys: list[tuple[Any, bool]], top_n: int) -> tuple[Any, Any]:
    """``(positions, rank)``: the first ``top_n`` rows of each group (numpy ``group`` ids, in ascending order of
    group) when each group's rows are ordered by ``keys`` -- ``(values, descending)`` pairs, the first deciding
    first (NaN last; rows equal in every key in their order) -- and their rank 1..N within the group.

    Only the rows that can be among the first ``top_n`` of their group are sorted in full (:func:`_contenders`),
    and a last key already in order along the rows is left to the sort's stability: the same rows and ranks as
    one ``lexsort`` of every row by every key."""
    import numpy as np

    group = np.asarray(group)
    sort_keys = [-np.asarray(v) if desc else np.asarray(v) for v, desc in keys]  # ascending = first
    while len(sort_keys) > 1 and _in_order(sort_keys[-1]):  # ties already in this key's order: stability keeps it
        sort_keys.pop()
    rows = _contenders(group, sort_keys[0], top_n) if sort_keys else None
    if rows is not None:
        group, sort_keys = group[rows], [v[rows] for v in sort_keys]
    order = np.lexsort(sort_keys[::-1] + [group])
    g = group[order]
    at = np.arange(len(order))
    start = np.maximum.accumulate(np.where(np.r_[True, g[1:] != g[:-1]], at, 0)) if len(order) else at
    rank = at - start + 1
    keep = rank <= top_n
    if rows is not None:
        order = rows[order]
    return order[keep], rank[keep]


def _in_order(v: Any) -> bool:
    """``v`` ascending along the rows (ties allowed; NaN never)."""
    import numpy as np

    return bool(len(v) < 2 or np.all(v[1:] >= v[:-1]))


def _contenders(group: Any, first: Any, top_n: int) -> Any:
    """Sorted positions of the rows whose ``first`` sort key (ascending = first) is at most the ``top_n``-th
    smallest of their group: every row that can rank ``top_n`` or better (its ties included); ``None`` where that
    would not cut much or cannot be computed exactly (NaN keys, non-integer groups)."""
    import numpy as np

    N = len(first)
    if top_n < 1 or N < 4 * top_n or group.dtype.kind not in "iu" or first.dtype.kind not in "iuf":
        return None
    if first.dtype.kind == "f":
        if np.isnan(first).any():
            return None
        by = np.argsort(first)  # rank of each row's key (ties: any order; the cut below is by value)
        r = np.empty(N, dtype=np.int64)
        r[by] = np.arange(N)
        span = N
    else:
        lo = int(first.min())
        r, span = first.astype(np.int64) - lo, int(first.max()) - lo + 1
    glo, ghi = int(group.min()), int(group.max())
    if (ghi - glo + 1) * span >= 1 << 62:
        return None
    composite = np.sort((group.astype(np.int64) - glo) * span + r)  # by group, then key
    gs = composite // span
    seg = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])  # each group's first position
    size = np.diff(np.r_[seg, N])
    cut = composite[seg + np.minimum(size, top_n) - 1] - gs[seg] * span  # the top_n-th smallest rank per group
    limit = (first[by[cut]] if first.dtype.kind == "f" else cut + lo)[np.searchsorted(gs[seg], group - glo)]
    return np.flatnonzero(first <= limit)


def _token_arrays(keys: torch.Tensor, counts: torch.Tensor, n: int) -> dict[str, Any]:
    """:func:`token_specialization`'s columns as numpy arrays. Keys sorted (a :class:`SparseCounter`'s): each token
    id's keys are consecutive, its experts ascending, so its most frequent expert (ties: lowest id) is the first
    key at its largest count -- reductions over the runs of equal token ids, no sort."""
    import numpy as np

    k, c = keys.cpu().numpy(), counts.cpu().numpy()
    k, c = k[k >= 0], c[k >= 0]
    if not _in_order(k):  # not a counter's sorted keys
        by = np.argsort(k, kind="stable")
        k, c = k[by], c[by]
    tid, ex = k // n, k % n
    if not len(k):
        return {"token_id": tid, "occurrences": c, "expert": ex, "count": c, "specialization": c.astype(np.float64)}
    new = np.r_[True, tid[1:] != tid[:-1]]
    start = np.flatnonzero(new)
    occ = np.add.reduceat(c, start)
    best = np.maximum.reduceat(c, start)[np.cumsum(new) - 1]  # each key's token id's largest count
    top = np.minimum.reduceat(np.where(c == best, np.arange(len(c)), len(c)), start)
    return {"token_id": tid[start], "occurrences": occ, "expert": ex[top], "count": c[top],
            "specialization": c[top] / occ.astype(np.float64)}


def token_specialization(keys: torch.Tensor, counts: torch.Tensor, n: int) -> Any:
    """From counts of keys ``token_id * n + expert`` (negative keys = padding, dropped): per token id its
    ``occurrences``, most frequent ``expert`` (ties: lowest id), its ``count`` and ``specialization`` =
    count / occurrences. Sorted by token id."""
    import pandas as pd

    return pd.DataFrame(_token_arrays(keys, counts, n))


# ----- cross-layer co-activation ---------------------------------------------------------------------
class CrossLayer:
    """``count[a, b]`` for consecutive hooked MoE layers (l, next): tokens with a in the top-K at l and b at next.
    With ``model_layers`` (every MoE layer of the model; ``layers`` a subset) only pairs consecutive in the model.

    ``top_k=1`` counts only the first-ranked expert at both layers. Events of one forward arrive in model
    order; ``begin_batch`` clears the previous layer's indicator.
    """

    def __init__(self, layers: list[Any], top_k: int | None = None, model_layers: list[Any] | None = None):
        self.order = [L.index for L in layers]
        every = list(layers if model_layers is None else model_layers)  # the model's MoE layers
        # the MoE layer before each one in the model, within one stack: an encoder-decoder's last encoder layer and
        # first decoder layer see position t as different tokens (the decoder reads t-1), so they make no pair
        self.previous = {b.index: a.index for a, b in zip(every, every[1:])
                         if getattr(a, "stack", None) == getattr(b, "stack", None)}
        self.expected = sum(self.previous.get(li) in self.order for li in self.order)  # pairs both hooked
        self.top_k = top_k
        self.counts: dict[tuple[int, int], torch.Tensor] = {}
        self.k: dict[int, int] = {}
        self._prev: tuple[int, torch.Tensor] | None = None

    def begin_batch(self, batch: Any) -> Any:
        self._prev = None
        return batch

    def __call__(self, ev: RoutingEvent) -> None:
        li, n, dev = ev.layer.index, ev.layer.n_experts, ev.idx.device
        idx = chosen(ev, self.top_k)  # [T, K]
        self.k[li] = idx.shape[-1]
        m = ops.multi_hot(idx, n, dtype=torch.float64) * ev.valid.to(dev).unsqueeze(-1)  # [T, n], padding rows 0
        prev, self._prev = self._prev, (li, m)
        if prev is None:
            return
        pl, pm = prev
        pos = self.order.index(li)
        if pos == 0 or self.order[pos - 1] != pl:
            raise MoetoolError(f"CrossLayer: layer {li} reported after layer {pl}, expected model order "
                               "(call begin_batch before each forward)")
        if self.previous.get(li) != pl:  # --layers left out the MoE layers between: not a consecutive pair
            return
        c = ops.to_device(pm, dev).T @ m  # [n_prev, n]
        key = (pl, li)
        self.counts[key] = c if key not in self.counts else self.counts[key] + c

    def reduce_across_ranks(self) -> None:
        """Data parallel: the pair counts all-reduced (a rank may lack a pair it never saw); alone a no-op."""
        if distributed.world_size() <= 1:
            return
        for part in distributed.gather_object(self.k):
            self.k.update(part)
        self.counts = distributed.all_reduce_keyed(self.counts)

    def tables(self) -> dict[str, Any]:
        """``cross_layer.csv`` (layer, next_layer, a, b, count, p_b_given_a) and ``cross_layer_summary.csv``."""
        import pandas as pd

        if len(self.counts) != self.expected:
            raise MoetoolError("CrossLayer: no events for some consecutive MoE layers (nothing ran?)")
        pairs, summary = [], []
        for (l0, l1), c in sorted(self.counts.items()):
            c = c.cpu()
            p, s = cross_layer_matrix(c, self.k[l0], self.k[l1])
            a, b = torch.meshgrid(torch.arange(c.shape[0], device="cpu"), torch.arange(c.shape[1], device="cpu"),
                                  indexing="ij")
            pairs.append(pd.DataFrame({"layer": l0, "next_layer": l1, "a": a.reshape(-1).numpy(),
                                       "b": b.reshape(-1).numpy(), "count": c.reshape(-1).long().numpy(),
                                       "p_b_given_a": p.reshape(-1).numpy()}))
            summary.append({"layer": l0, "next_layer": l1, **s})
        if not pairs:
            return {}
        return {"cross_layer.csv": pd.concat(pairs, ignore_index=True),
                "cross_layer_summary.csv": pd.DataFrame(summary)}


def cross_layer_matrix(count: torch.Tensor, k: int, k_next: int) -> tuple[torch.Tensor, dict[str, float]]:
    """``count [n, m]`` of (expert a at l, expert b at next) pairs of tokens counting ``k`` experts at l and
    ``k_next`` at next -> ``(P(b | a) [n, m]`` (NaN rows for experts never chosen), summary dict)``."""
    count = count.double()
    total = float(count.sum())
    if not total > 0:
        raise MoetoolError("cross-layer co-activation: no tokens")
    chose = count.sum(1, keepdim=True) / k_next  # [n, 1] tokens with a at l
    p = count / chose  # NaN where nobody chose a
    seen = chose.squeeze(1) > 0
    joint = count / total
    pa, pb = joint.sum(1, keepdim=True), joint.sum(0, keepdim=True)
    mi = float(torch.special.xlogy(joint, joint / (pa * pb)).nan_to_num(0.0).sum())
    m = count.shape[1]
    return p, {"tokens": int(round(total / (k * k_next))), "mean_max_p": float(p[seen].max(1).values.mean()),
               "uniform_max_p": k_next / m, "mutual_information": mi, "mutual_information_norm": mi / math.log(m)}


# ----- load-balancing view ---------------------------------------------------------------------------
class LoadBalance:
    """Per layer: sum over real tokens of the routing probabilities ``[n]`` and the top-K assignment counts
    ``[n]`` (``top_k=1``: first-ranked expert only), and the real-token count."""

    def __init__(self, layers: list[Any], top_k: int | None = None):
        self.layers = {L.index: L for L in layers}
        self.top_k = top_k
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        n, dev = ev.layer.n_experts, ev.idx.device
        valid = ev.valid.to(dev)
        idx = chosen(ev, self.top_k)  # [T, K]
        a = self.acc.setdefault(ev.layer.index, {
            "prob": torch.zeros(n, dtype=torch.float64, device=dev),
            "assign": torch.zeros(n, dtype=torch.float64, device=dev),
            "tokens": torch.zeros((), dtype=torch.float64, device=dev), "k": idx.shape[-1]})
        a["prob"] += (ev.probs.to(dev).double() * valid.unsqueeze(-1)).sum(0)
        a["assign"] += ops.one_hot_counts(idx, n, valid)
        a["tokens"] += valid.sum()

    def reduce_across_ranks(self) -> None:
        """Data parallel: per-layer sums all-reduced; alone a no-op."""
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def tables(self) -> tuple[Any, Any]:
        """``(per expert: layer, expert, router_prob, token_fraction; per layer: layer, aux_loss,
        aux_loss_hf_pooled)``."""
        import pandas as pd

        missing = sorted(set(self.layers) - set(self.acc))
        if missing:
            raise MoetoolError(f"no routing events from MoE layers {missing}: nothing ran through them")
        experts, layers = [], []
        sums = {k: [] for k in ("prob", "assign", "tokens")}
        for li in sorted(self.acc):
            a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in self.acc[li].items()}
            tokens = float(a["tokens"])
            if tokens <= 0:
                raise MoetoolError(f"layer {li}: no real tokens (empty data or all padding)")
            P, f = a["prob"] / tokens, a["assign"] / tokens  # [n]
            experts.append(pd.DataFrame({"layer": li, "expert": range(len(P)), "router_prob": P.numpy(),
                                         "token_fraction": f.numpy()}))
            layers.append({"layer": li, "aux_loss": aux_loss(f, P)})
            for k in sums:
                sums[k].append(a[k])
        if len({len(p) for p in sums["prob"]}) == 1:
            tokens = sum(float(t) for t in sums["tokens"])
            pooled = aux_loss(torch.stack(sums["assign"]).sum(0) / tokens, torch.stack(sums["prob"]).sum(0) / tokens)
        else:
            pooled = math.nan  # layers with different expert counts cannot be pooled
        out = pd.DataFrame(layers)
        out["aux_loss_hf_pooled"] = pooled
        return pd.concat(experts, ignore_index=True), out


def aux_loss(f: torch.Tensor, P: torch.Tensor) -> float:
    """Switch / transformers auxiliary loss ``n * sum_e f_e P_e``."""
    return float(len(P) * (f.double() * P.double()).sum())


# ----- co-activation within a layer ------------------------------------------------------------------
COACTIVATION = ("all", "adjacent")


def coactivation_counts(idx: torch.Tensor, n: int, valid: torch.Tensor, mode: str = "all") -> torch.Tensor:
    """``[n, n]`` float64: diagonal = valid tokens whose ``idx [T, K]`` contains e; off-diagonal ``[a, b]`` =

    * ``all``: tokens whose top-K contains both a and b (every ordered pair of the top-K);
    * ``adjacent``: tokens where a and b sit at neighbouring ranks (``idx[:, i]``, ``idx[:, i+1]``, both
      orders), as allenai/OLMoE ``run_moe_analysis.py`` (``more_itertools.pairwise``) counts it.
    """
    v = valid.to(torch.float64).unsqueeze(-1)  # [T, 1]
    m = ops.multi_hot(idx, n, dtype=torch.float64) * v  # [T, n]
    if mode == "all":
        return m.T @ m
    if mode != "adjacent":
        raise MoetoolError(f"--coactivation must be one of {', '.join(COACTIVATION)}, got '{mode}'")
    co = torch.diag(m.sum(0))
    for i in range(idx.shape[-1] - 1):
        a = ops.multi_hot(idx[:, i:i + 1], n, dtype=torch.float64) * v
        b = ops.multi_hot(idx[:, i + 1:i + 2], n, dtype=torch.float64)
        ab = a.T @ b
        co = co + ab + ab.T
    return co


def token_decoder(tokenizer: Any):
    """``decode(token id) -> text`` of one id, cached (``""`` without a tokenizer)."""
    cache: dict[int, str] = {}

    def decode(i: int) -> str:
        if i not in cache:
            cache[i] = tokenizer.decode([i]) if tokenizer is not None else ""
        return cache[i]
    return decode


def with_tokens(df: Any, decode: Any) -> Any:
    """``df`` with a ``token`` column: the text of each ``token_id``."""
    df = df.reset_index(drop=True)
    df["token"] = [decode(int(i)) for i in df["token_id"]]
    return df
