"""``offload``: can caching or prefetching experts work? Answers from the model's real routing (issue #11).

Everything comes from one forward pass over the packed rows with the model's own router (no policy):

* **activation coverage**: ``first_seen[layer, e]`` = index of the first real token (rows concatenated in data
  order, padding skipped) that routed to expert ``e`` in that layer; coverage(N) = fraction of the
  (layer, expert) slots with ``first_seen < N``. Per layer the **hottest expert's share** of the ``T·K``
  activations against the uniform share ``1/n`` (``hottest_vs_uniform = share · n``).
* **cache simulation** (:func:`simulate`): per layer an expert cache of capacity ``C`` (``K <= C <= n``) serves
  the token stream in order; a token requests its ``K`` experts together (they are all needed for that
  token, so none of them is evicted to make room for another). A request is a **hit** when the expert is
  resident before the token; hit rate = hits / requests (``T·K`` requests, within-token requests counted one by
  one; caches start empty, so cold misses count). Policies, evicting among resident experts the current token
  does not request: ``lru`` — least recently requested (ties: the lowest id first); ``lfu`` — fewest requests
  so far (every past request counts, resident or not; ties: least recently requested); ``belady`` — next
  request furthest in the future (never requested again = infinitely far; ties: lowest id), Belady's optimal
  offline policy: no policy can have fewer misses on the trace. Bytes moved per token = misses / tokens ×
  expert bytes, expert bytes = parameters of one expert (gate, up, down and their biases, from the adapter's
  canonical expert weights) × the bytes of their dtype.
* **next-layer prediction**: a prefetcher running a layer ahead sees ``x_ℓ``, the residual stream leaving
  decoder layer ``ℓ`` (= the input of decoder layer ``ℓ+1``, captured by a forward pre-hook on it). The
  prediction for MoE layer ``ℓ+1`` is its own routing (``route``: the model's scoring, bias, groups) applied to
  ``pre_router_norm_{ℓ+1}(x_ℓ)`` — exactly the router input except for layer ``ℓ+1``'s attention
  update (``predict_norm=False``: to ``x_ℓ`` itself; the norm is the layer's ``pre_router_norm``: with sandwich
  norms, Muse Spark's and Beam's, ``pre_feedforward_layernorm``; Gemma 4's router reads the stream itself;
  Switch Transformers: the feed-forward's own layer norm, and the decoder's cross-attention update too). top-1 recall = fraction of real tokens whose
  predicted top-1 is the layer's real top-1, both the routing decision (:func:`moetool.ops.top1`: the chosen expert
  ranked first by the router's selection scores, a correction bias included, before any per-expert scale -- not the
  largest weight, which Gemma 4's per-expert scale, PhiMoE's sparsemixer and DeepSeek-V3's unbiased weights order
  otherwise); top-K recall = mean
  ``|predicted top-K ∩ chosen| / K``. The first decoder layer has no layer ahead of it and is skipped.

Memory: the cache simulation needs each layer's whole request sequence (Belady looks ahead): one ``[T, K]``
int16/int32 tensor per layer (T = real tokens, bounded by ``--max-tokens``; 4 bytes × K per token and layer at
most); while one layer is simulated, its eviction keys (8 bytes per request and policy), every expert's key over a
chunk of tokens (:data:`RANK_KEYS` keys), the key ranks of the requests (2 bytes per request and policy) and,
per LFU/Belady capacity, the hits (K bytes per token) and the cache state entering each token (n bits); up to 64
experts also each token's rank masks and their bit segments (about 3K + 8 words of n bits per token and policy,
5K + 10 while blocks are stepped again; :func:`bit_hits`); everything else is a streamed sum. Intervals
(``--bootstrap``): document-level bootstrap over packed rows (:mod:`moetool.uncertainty`) of per-row hit and recall
sums; for hit rates the cache state is carried across rows, so the interval is the spread over documents of the
same simulation (cache warm-up not re-run).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from ... import distributed, ops
from ...data import require_tokens
from ...adapters import quant
from ...adapters.base import MoELayer
from ...engine.hooks import RECOMPUTE_SAID, RoutingEvent, recompute_unable, refuse_unable, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...uncertainty import RowTable, bootstrap_meta, fraction_text, ratio_intervals
from ..result import Result, resolve_options
from .spec import POLICIES, OffloadOptions  # its options (declared with their flags in spec.py)

# ----- cache simulation (pure) ----------------------------------------------------------------
def lru_ranks(trace: Any, req: ByExpert | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(seen [T, K] bool, rank [T, K] int)`` of every request of ``trace [T, K]``: whether the expert was
    requested before the token, and (for one that was) how many experts were used more recently than it before the
    token (ties within one earlier token: the higher id counts as more recent, the order LRU evicts them in).

    With requests grouped per token (a token's experts never evict each other), the LRU cache of capacity C
    holds, before token t, exactly the C experts of highest (last request, id): each token's misses evict the
    least recent residents it does not request, which keeps that set. So a request hits iff ``seen and rank < C``
    for every C at once: the ranks of the ``lru`` keys (:func:`key_ranks`), linear in tokens x n. ``req``: the
    trace's :func:`requests_by_expert`, when the caller has it."""
    trace = np.ascontiguousarray(trace)
    if not trace.size:
        return np.zeros(trace.shape, dtype=bool), np.zeros(trace.shape, dtype=np.int64)
    n = int(trace.max()) + 1
    req = requests_by_expert(trace) if req is None else req
    seen, pos, _, _, _ = key_ranks(trace, expert_keys(trace, "lru", req), req, after=False)
    return seen, n - 1 - pos.astype(np.int64)


def simulate(trace: Any, capacity: int, policy: str, *, lru: tuple[np.ndarray, np.ndarray] | None = None,
             keys: np.ndarray | None = None) -> np.ndarray:
    """Hits of an expert cache over a request trace: ``trace [T, K]`` expert ids (one row per token, distinct
    within a row) -> ``hits [T, K]`` bool (request ``trace[t, j]`` found resident). See the module docstring.
    ``lru`` / ``keys``: :func:`lru_ranks` / the policy's :func:`request_keys` of the trace, when the caller already
    has them (several capacities). :func:`simulate_all` gives every (capacity, policy) of one trace at once."""
    return simulate_all(trace, (capacity,), (policy,), lru=lru,
                        keys=None if keys is None else {policy: keys})[(capacity, policy)]


def check_trace(trace: np.ndarray, capacities: Sequence[int], policies: Sequence[str]) -> None:
    if trace.ndim != 2:
        raise MoetoolError(f"cache trace must be [tokens, K], got shape {trace.shape}")
    for policy in policies:
        if policy not in POLICIES:
            raise MoetoolError(f"unknown cache policy {policy!r} (choose from {', '.join(POLICIES)})")
    for capacity in capacities:
        if capacity < trace.shape[1]:
            raise MoetoolError(f"cache capacity {capacity} < K = {trace.shape[1]}: a token's experts cannot all "
                               f"be resident")


def simulate_all(trace: Any, capacities: Sequence[int], policies: Sequence[str], *,
                 lru: tuple[np.ndarray, np.ndarray] | None = None,
                 keys: dict[str, np.ndarray] | None = None) -> dict[tuple[int, str], np.ndarray]:
    """``{(capacity, policy): hits [T, K]}`` of :func:`simulate` for every capacity and policy over one trace.

    LRU, and any policy whose capacity holds every expert of the trace (nothing is ever evicted: a request
    hits iff it was requested before), come from :func:`lru_ranks` (vectorised); capacity K (any policy: the
    cache holds the previous token's experts) is closed-form; LFU and Belady between, all at once, by
    :func:`evicting_hits` (vectorised over blocks of tokens, linear in tokens)."""
    trace = np.ascontiguousarray(trace)
    check_trace(trace, capacities, policies)
    T, K = trace.shape
    distinct = int(np.count_nonzero(np.bincount(trace.reshape(-1)))) if trace.size else 0
    req = requests_by_expert(trace) if trace.size else None
    out: dict[tuple[int, str], np.ndarray] = {}
    evicting: list[tuple[int, str]] = []
    previous = None
    for C in capacities:
        for pol in policies:
            if pol == "lru" or C >= distinct:
                if lru is None:
                    lru = lru_ranks(trace, req)
                seen, rank = lru
                out[(C, pol)] = seen & (rank < C) if pol == "lru" else seen.copy()
            elif C == K:  # the cache holds exactly the previous token's experts, whatever the policy
                if previous is None:
                    previous = np.zeros((T, K), dtype=bool)
                    previous[1:] = (trace[1:, :, None] == trace[:-1, None, :]).any(-1)
                out[(C, pol)] = previous.copy()
            else:
                evicting.append((C, pol))
    if evicting:
        keys = dict(keys or {})
        for pol in {p for _, p in evicting} - set(keys):
            keys[pol] = request_keys(trace, pol, req)
        pols = sorted({p for _, p in evicting})
        hits = evicting_hits(trace, np.array([C for C, _ in evicting]),
                             np.stack([keys[p] for p in pols]), np.array([pols.index(p) for _, p in evicting]),
                             req)
        out.update(zip(evicting, hits))
    return {(C, p): out[(C, p)] for C in capacities for p in policies}


def by_expert(trace: np.ndarray) -> np.ndarray:
    """The requests of ``trace [T, K]`` (flattened row by row) ordered by (expert, token): a stable sort of the expert
    ids (a token requests an expert once, and its rows come in token order)."""
    flat = trace.reshape(-1)
    if flat.size and int(flat.max()) < 2 ** 15:
        flat = flat.astype(np.int16)  # a radix sort
    return np.argsort(flat, kind="stable")


class ByExpert(NamedTuple):
    """The requests of a trace ``[T, K]`` (flattened row by row) sorted by (expert, token): their places ``order``
    (:func:`by_expert`), experts ``e`` and tokens ``tok``; expert x's requests are ``start[x]:start[x + 1]``, and
    ``first`` marks each expert's first request."""
    order: np.ndarray
    e: np.ndarray
    tok: np.ndarray
    start: np.ndarray
    first: np.ndarray


def requests_by_expert(trace: np.ndarray) -> ByExpert:
    """:class:`ByExpert` of ``trace [T, K]``."""
    order = by_expert(trace)
    e = trace.reshape(-1)[order].astype(np.int64)
    start = np.concatenate([[0], np.cumsum(np.bincount(e, minlength=int(trace.max()) + 1))])
    return ByExpert(order, e, order // trace.shape[1], start, np.arange(e.size) == start[e])


def request_keys(trace: np.ndarray, policy: str, req: ByExpert | None = None) -> np.ndarray:
    """``[T, K]`` int64: the eviction order of the expert each request loads, from then until its next request
    (lowest evicted first; an expert's order changes only when it is requested, and then it is protected):
    :func:`expert_keys` in the trace's layout (``req``: its :func:`requests_by_expert`, when the caller has it)."""
    req = requests_by_expert(trace) if req is None else req
    keys = np.empty(trace.size, dtype=np.int64)
    keys[req.order] = expert_keys(trace, policy, req)
    return keys.reshape(trace.shape)


def expert_keys(trace: np.ndarray, policy: str, req: ByExpert) -> np.ndarray:
    """The eviction key of every request of ``trace [T, K]``, in :func:`requests_by_expert` order (int64, >= 0,
    distinct among the experts at any time; lowest evicted first):

    * lru: ``(this token, id)``;
    * lfu: ``(requests up to and including this one, this token, id)``;
    * belady: next request furthest ahead first (never again = ``T + 1``), ties lowest id first.

    From the trace alone, vectorised over the requests sorted by (expert, token)."""
    T, K = trace.shape
    n = int(trace.max()) + 1 if trace.size else 1
    e, tok = req.e, req.tok
    if policy == "lru":
        return tok * n + e
    if policy == "lfu":
        return ((np.arange(e.size) - req.start[e] + 1) * (T + 1) + tok) * n + e
    nxt = np.full(e.size, T + 1, dtype=np.int64)
    same = ~req.first[1:]
    nxt[:-1][same] = tok[1:][same]
    return (T + 1 - nxt) * n + e


#: tokens per block of :func:`_row_hits` (None: from the trace's length, about its square root) and each block's
#: warm-up as a share of the block (bit-packed: :data:`BIT_BLOCK`)
EVICT_BLOCK: int | None = None
EVICT_WARMUP: float = 0.25


def block_guess(keyv: np.ndarray) -> np.ndarray:
    """:func:`evicting_hits`' guess of a cache's residents at a block's warm-up token s, from ``keyv [L, n]`` (each
    expert's key at s, -1 if not requested before s): every expert requested before s. The step of token s then
    keeps s's experts and the ``m`` highest-keyed others -- a full cache, as the true one is once C distinct
    experts were requested. Any guess gives exact hits (a wrong one costs re-stepped tokens)."""
    return keyv >= 0


def _cache_step(res: np.ndarray, keyv: np.ndarray, rows: np.ndarray, rkeys: np.ndarray, m: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """One token of many independent caches (lanes): ``res [L, n]`` residents before the token, ``keyv [L, n]`` each
    expert's key (:func:`request_keys` of its last request; read for residents only), ``rows [L, K]`` the token's
    experts and ``rkeys [L, K]`` their keys, ``m [L]`` the residents kept beside the token's experts (capacity - K).
    Returns ``(hits [L, K], residents after)``: the token's experts, and of the residents it does not request the
    ``m`` highest-keyed (its misses evict the lowest). ``keyv`` is updated in place."""
    L, n = res.shape
    flat = (np.arange(L) * n)[:, None] + rows
    hits = res.reshape(-1)[flat]
    req = np.zeros_like(res)
    req.reshape(-1)[flat] = True
    cand = res & ~req
    ck = np.where(cand, keyv, -1)  # keys are >= 0
    thr = np.sort(ck, axis=1).reshape(-1)[np.arange(L) * n + n - m]  # the m-th highest key
    keyv.reshape(-1)[flat] = rkeys
    return hits, (cand & (ck >= thr[:, None])) | req


class KeyIndex:
    """Each expert's key (``keys [T, K]`` of ``trace``, all >= 0) at its last request strictly before a time."""

    def __init__(self, trace: np.ndarray, keys: np.ndarray, width: int):
        T, K = trace.shape
        own = trace.astype(np.int64) * (T + 1) + np.arange(T, dtype=np.int64)[:, None]
        order = by_expert(trace)
        self.flat, self.kflat = own.reshape(-1)[order], keys.reshape(-1)[order]
        self.T, self.e = T, np.arange(width, dtype=np.int64)

    def at(self, times: np.ndarray) -> np.ndarray:
        """``[len(times), width]``: the keys before each time, -1 where the expert has no request before it."""
        T1 = self.T + 1
        pos = np.searchsorted(self.flat, self.e[None, :] * T1 + np.asarray(times, dtype=np.int64)[:, None]) - 1
        ok = (pos >= 0) & (self.flat[np.maximum(pos, 0)] // T1 == self.e[None, :])
        return np.where(ok, self.kflat[np.maximum(pos, 0)], -1)


def _int32_order(keys: np.ndarray) -> np.ndarray:
    """``keys`` (>= 0) as int32 in the same order: themselves where they fit, else their ranks."""
    if not keys.size or int(keys.max()) < 2 ** 31:
        return keys.astype(np.int32)
    ranks = np.empty(keys.size, dtype=np.int32)
    ranks[np.argsort(keys.reshape(-1))] = np.arange(keys.size, dtype=np.int32)
    return ranks.reshape(keys.shape)


# ----- bit-packed simulation (at most 64 experts) ------------------------------------------------
#: widest trace (experts) that :func:`evicting_hits` simulates bit-packed (:func:`bit_hits`: a cache state is one
#: unsigned word of 8 to 64 bits); wider ones are stepped as boolean rows (:func:`_row_hits`)
BIT_EXPERTS = 64


def word_type(n: int) -> type:
    """The narrowest unsigned integer with at least ``n`` bits (``n <= 64``)."""
    return np.uint8 if n <= 8 else np.uint16 if n <= 16 else np.uint32 if n <= 32 else np.uint64


_BITWISE_COUNT = hasattr(np, "bitwise_count")  # numpy >= 2.0


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each unsigned word of ``x`` (uint8)."""
    if _BITWISE_COUNT:
        return np.bitwise_count(x)
    return np.unpackbits(np.ascontiguousarray(x)[..., None].view(np.uint8), axis=-1).sum(-1, dtype=np.uint8)


def bit_segments(mask: np.ndarray, K: int) -> np.ndarray:
    """``[K+1, ...]`` from unsigned words ``mask`` of at most ``K`` set bits: segment ``i`` holds the unset bits with
    exactly ``i`` set bits below them (mask 0: everything in segment 0). Removing the set bits from a word ``x`` is
    then ``OR_i (x & seg_i) >> i``, spreading a word's low bits over the unset ones ``OR_i (y << i) & seg_i``."""
    segs = np.empty((K + 1,) + mask.shape, dtype=mask.dtype)
    below, rest, one = np.zeros_like(mask), mask.copy(), mask.dtype.type(1)
    for i in range(K):
        low = rest & (~rest + one)  # the lowest set bit left (0 when none)
        segs[i] = (low - one) & ~below
        below |= low | (low - one)
        rest ^= low
    segs[K] = ~below
    return segs


#: keys held at once by :func:`key_ranks` (n experts x tokens per chunk)
RANK_KEYS = 1 << 21


def key_ranks(trace: np.ndarray, keys: np.ndarray, req: ByExpert, at: Any = (), after: bool = True
              ) -> tuple[np.ndarray, ...]:
    """Each expert's key rank before a token: with every expert's key before token t (``keys``: :func:`expert_keys`,
    ``req`` the trace's :func:`requests_by_expert`; an expert never requested before t: below every key, by id),
    its place among them, lowest 0.
    Returns ``(seen [T, K], pos [T, K], new [T, K] or None, keyv [len(at), n], rank [len(at), n])``: whether each
    request's expert was requested before its token; the ranks of token t's experts before t and (``after``) before
    t+1 (their new keys among the others'); the keys (-1: never requested) and ranks before each token of ``at``.
    Counting, one expert at a time, the keys below (chunks of tokens: :data:`RANK_KEYS` keys at once): linear in
    tokens x n."""
    T, K = trace.shape
    n = int(trace.max()) + 1
    order, e, tok, start, first = req
    kdt = np.int32 if keys.size and int(keys.max()) < 2 ** 31 and n < 2 ** 31 else np.int64
    prev = np.empty(T * K, dtype=kdt)  # the key of each request's expert before its token, the trace's layout
    prev[order[1:]] = keys[:-1]
    prev[order[first]] = e[first] - n
    prev = prev.reshape(T, K)
    if after:
        own = np.empty(T * K, dtype=kdt)
        own[order] = keys
        own = own.reshape(T, K)
    rdt = np.uint8 if n <= 256 else np.uint16
    pos = np.zeros((T, K), dtype=rdt)
    new = np.zeros((T, K), dtype=rdt) if after else None
    at = np.asarray(at, dtype=np.int64)
    keyv = np.empty((len(at), n), dtype=np.int64)
    chunk = max(1, RANK_KEYS // n)
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        here = (at >= a) & (at <= b)
        cols = at[here] - a
        for x in range(n):  # expert x's keys before tokens a..b
            t, k = tok[start[x]:start[x + 1]], keys[start[x]:start[x + 1]]
            i, j = np.searchsorted(t, [a, b])
            row = np.repeat(np.concatenate([[k[i - 1] if i else x - n], k[i:j]]).astype(kdt),
                            np.diff(np.concatenate([[a], t[i:j] + 1, [b + 1]])))
            pos[a:b] += row[:-1, None] < prev[a:b]
            if after:
                new[a:b] += row[1:, None] < own[a:b]
            keyv[here, x] = row[cols]
    rank = np.argsort(np.argsort(keyv, axis=1), axis=1).astype(rdt)
    seen = (prev >= 0)
    return seen, pos, new, np.where(keyv >= 0, keyv, -1), rank


#: tokens per block of :func:`bit_hits` and each block's warm-up as a share of the block (steps cost little per
#: lane, so blocks are short, whatever the trace's length)
BIT_BLOCK = 64
BIT_WARMUP = 0.5
#: blocks :func:`bit_hits` steps a restepped stretch across before it gives its cache to :func:`_row_hits` (which
#: steps from miss to miss: a cache whose states meet only after long stretches, e.g. few misses)
BIT_RESTEP_BLOCKS = 8


def _bit_step(x: np.ndarray, C: np.ndarray, M: np.ndarray, notM: np.ndarray, segM: np.ndarray, segN: np.ndarray,
              N: np.ndarray) -> np.ndarray:
    """One token of many caches (lanes), bit-packed: ``x`` unsigned words, bit r set iff the expert of key rank r
    before the token is resident; ``C`` the capacities (int16); the token's ``M`` bits (its experts' ranks before
    it; ``notM = ~M``), ``N`` bits (their ranks after it) and ``segM``/``segN [K+1, ...]`` their
    :func:`bit_segments`, broadcast with ``x``. Returns the residents after the token, in the ranks after it: the
    token's experts, and of the residents it does not request the ``C - K`` of highest rank (its misses evict the
    lowest). The others keep their keys, so their order: they move to the rank bits the token's experts leave free."""
    cand = x & notM
    evict = popcount(x | M).astype(np.int16) - C
    for i in range(int(evict.max(initial=0))):  # drop the lowest set bits beyond the capacity
        cand &= cand - (evict > i)
    shift = np.arange(len(segM), dtype=x.dtype).reshape((-1,) + (1,) * x.ndim)
    kept = np.bitwise_or.reduce((cand & segM) >> shift, axis=0)  # without the M bits
    return np.bitwise_or.reduce((kept << shift) & segN, axis=0) | N  # spread around the N bits


def bit_hits(trace: np.ndarray, capacities: np.ndarray, keys: np.ndarray, which: np.ndarray,
             req: ByExpert | None = None) -> list[np.ndarray]:
    """:func:`evicting_hits` for at most :data:`BIT_EXPERTS` experts: a cache state is one unsigned word in the
    key-rank order before the token it enters (:func:`key_ranks`), so a token of every cache is a few word
    operations (:func:`_bit_step`), and a request hits iff its rank's bit is set in the state entering its token.

    The tokens are cut into blocks; every block of every cache steps at once, each from its guess
    (:func:`block_guess`) a warm-up before it (block 0: the true empty cache at token 0), recording the state
    entering each token and leaving each block. Then every block entered in a state its predecessor did not leave
    it in is stepped again from that state, all such blocks at once, each on across the blocks after it until its
    state equals the recorded one (equal states give equal futures; passing a block's end it records the state
    leaving it, and goes on into the next block only if that was entered otherwise). Each boundary is then checked
    by whichever stepping last crossed it, so by induction from block 0 every state, and so every hit, is exact,
    whatever the guesses. Linear in tokens: ``block + warm-up`` vectorised steps, then as many as the longest
    stretch of restepped tokens (the stepping lanes narrowing as they meet the recorded states), at most
    :data:`BIT_RESTEP_BLOCKS` blocks: a cache with a longer one is simulated again by :func:`_row_hits`."""
    T, K = trace.shape
    S, P = len(capacities), len(keys)
    B = BIT_BLOCK
    W = min(int(np.ceil(BIT_WARMUP * B)), B)
    nb = -(-T // B)
    guess_at = np.maximum(np.arange(nb) * B - W, 0)
    req = requests_by_expert(trace) if req is None else req
    word = word_type(int(trace.max()) + 1)
    one = word(1)
    # per policy and token, padded: row u is token u - W (the rows before and after the trace's: nothing requested,
    # no change)
    rows = W + nb * B
    pos = np.zeros((P, rows, K), dtype=np.uint8)
    new = np.zeros((P, rows, K), dtype=np.uint8)
    keyv, rank = [], []
    for p, k in enumerate(keys):
        _, pos[p, W:W + T], new[p, W:W + T], kv, rk = key_ranks(trace, k.reshape(-1)[req.order], req, guess_at)
        keyv.append(kv)
        rank.append(rk)
    M, N = np.zeros((P, rows), dtype=word), np.zeros((P, rows), dtype=word)
    M[:, W:W + T] = np.bitwise_or.reduce(one << pos[:, W:W + T].astype(word), axis=-1)
    N[:, W:W + T] = np.bitwise_or.reduce(one << new[:, W:W + T].astype(word), axis=-1)
    # block-major: [step j, ..., block b] = row b * B + j, the token of block b's lane at step j
    at = np.arange(W + B)[:, None] + np.arange(nb) * B
    Mb, Nb = M[:, at].swapaxes(0, 1)[:, :, None], N[:, at].swapaxes(0, 1)[:, :, None]  # [step, P, 1, block]
    segMb, segNb = bit_segments(Mb, K).swapaxes(0, 1), bit_segments(Nb, K).swapaxes(0, 1)  # [step, K+1, P, 1, block]
    # the caches as a grid [policy, G]: lane (p, g) is cache grid[p, g] (-1: none, never evicting)
    G = max(int((which == p).sum()) for p in range(P))
    grid = np.full((P, G), -1)
    for p in range(P):
        grid[p, :int((which == p).sum())] = np.nonzero(which == p)[0]
    real = grid >= 0
    C = np.where(real, np.asarray(capacities)[grid], 64).astype(np.int16)
    X = np.zeros((P, G, nb * B + 1), dtype=word)  # the state entering each token
    left = np.zeros((P, G, nb), dtype=word)  # ... and leaving each block

    # every block of every cache at once from its guess, through its warm-up and its tokens
    guess = block_guess(np.stack([np.tile(kv, (G, 1)) for kv in keyv])).reshape(P, G, nb, -1)
    guess &= (guess_at > 0)[:, None]  # a warm-up from token 0 starts from the true empty cache
    x = np.bitwise_or.reduce(np.where(guess, one << np.stack(rank)[:, None].astype(word), word(0)), axis=-1)
    for j in range(W + B):
        if j >= W:
            X[:, :, j - W:nb * B:B] = x
        x = _bit_step(x, C[:, :, None], Mb[j], ~Mb[j], segMb[j], segNb[j], Nb[j])
    left[:] = x
    # the blocks entered wrongly, stepped again (lanes: policy p, cache g, token t, state x), all at once: they
    # start at block boundaries and step in lockstep, so they cross the next ones together (every B steps)
    p, g, b = np.nonzero((X[:, :, B:nb * B:B] != left[:, :, :-1]) & real[:, :, None])
    t, x = (b + 1) * B, left[p, g, b]
    if len(t):
        segM, segN = bit_segments(M, K).reshape(K + 1, -1), bit_segments(N, K).reshape(K + 1, -1)  # [K+1, P * rows]
    Xf, Mf, Nf = X.reshape(-1), M.reshape(-1), N.reshape(-1)
    at_x, at_m, cap = (p * G + g) * X.shape[2] + t, p * rows + W + t, C[p, g]  # flat places of X[p, g, t], M[p, t]
    for j in range(BIT_RESTEP_BLOCKS * B):
        if j and j % B == 0:  # the lanes cross a block boundary: the state leaving the block before it
            left[p, g, t // B - 1] = x
        go = ((Xf[at_x] != x) | (j == 0)) & (t < T)  # not (yet) met the recorded states
        if not go.all():
            p, g, t, x, at_x, at_m, cap = (a[go] for a in (p, g, t, x, at_x, at_m, cap))
        if not len(t):
            break
        Xf[at_x] = x
        x = _bit_step(x, cap, Mf[at_m], ~Mf[at_m], segM[:, at_m], segN[:, at_m], Nf[at_m])
        t, at_x, at_m = t + 1, at_x + 1, at_m + 1
    slow = {int(grid[a, c]) for a, c in zip(p.tolist(), g.tolist())}  # caches still being restepped
    rows_of = dict(zip(sorted(slow), _row_hits(trace, np.asarray(capacities)[sorted(slow)], keys,
                                               which[sorted(slow)]))) if slow else {}
    lane = {s: (p, g) for (p, g), s in np.ndenumerate(grid)}
    return [rows_of[s] if s in slow else ((X[lane[s]][:T, None] >> pos[which[s], W:W + T]) & one).astype(bool)
            for s in range(S)]


def evicting_hits(trace: np.ndarray, capacities: np.ndarray, keys: np.ndarray, which: np.ndarray,
                  req: ByExpert | None = None) -> list[np.ndarray]:
    """Hits of caches that evict the lowest keys (:func:`request_keys`), one per capacity ``capacities[s]`` with the
    keys ``keys[which[s]]`` (``keys [P, T, K]``): ``[hits [T, K] per s]``. Bit-packed (:func:`bit_hits`) up to
    :data:`BIT_EXPERTS` experts, else boolean rows (:func:`_row_hits`); the same hits."""
    if int(trace.max()) < BIT_EXPERTS:
        return bit_hits(trace, capacities, keys, which, req)
    return _row_hits(trace, capacities, keys, which)


def _row_hits(trace: np.ndarray, capacities: np.ndarray, keys: np.ndarray, which: np.ndarray) -> list[np.ndarray]:
    """:func:`evicting_hits` as boolean rows (any number of experts): a cache's residents [n] bool, each expert's key
    kept per cache.

    Before token t a cache holds token t-1's experts and at most ``m = C - K`` others; the others after t are the
    ``m`` highest-keyed of (the others before t and token t-1's experts) that token t does not request (its misses
    evict the lowest, and only as many as the capacity needs): the cache's next state is a function of its state
    (the resident set) and the trace alone, as every key is. So the tokens are cut into blocks, and every block of
    every cache steps at once (a vector operation per token of a block, not per token of the trace), each block from
    a guess (:func:`block_guess`) a warm-up before the block (the first block: the true empty cache at token 0).
    Then, block by block in order, one entered in a state its predecessor (exact by then) did not leave in is
    stepped again from that state (``restep``: from miss to miss, as only a miss changes the
    state) until its state equals the recorded one at some token (equal states give equal futures: from there on
    the recorded hits hold) or the block ends (its new end state is what its successor is checked against): by
    induction from block 0, every hit is then exact, whatever the guesses. Linear in tokens: ``block + warm-up``
    vectorised steps, plus a step per miss of the re-stepped stretches (short where misses are frequent: caches
    started apart soon hold the same experts; where misses are rare, apart for long, but then steps are few)."""
    T, K = trace.shape
    S = len(capacities)
    n = int(trace.max()) + 1
    B = EVICT_BLOCK or max(128, int(np.sqrt(T)))
    W = int(np.ceil(EVICT_WARMUP * B))
    nb = -(-T // B)
    trace = trace.astype(np.int32 if n < 2 ** 31 else np.int64)
    m_of = np.asarray(capacities, dtype=np.int64) - K
    keys = np.stack([_int32_order(k) for k in keys])  # the keys' order is all that counts: int32 sorts faster
    w8 = -(-n // 8) * 8  # lanes hold w8 >= n experts (never requested beyond n): a state is whole bytes of bits
    width, dtype = w8 // 8, np.uint8

    def code(r: np.ndarray) -> np.ndarray:  # [L, w8] bool -> [L, width] bits (packed flat: rows are whole bytes)
        return np.packbits(r.reshape(-1)).reshape(len(r), width)

    def decode(c: np.ndarray) -> np.ndarray:
        return np.unpackbits(c.reshape(-1)).reshape(len(c), w8).astype(bool)
    hits = np.zeros((S, T, K), dtype=bool)
    rec = np.zeros((S, T, width), dtype=dtype)  # the recorded state entering each token
    rec_end = np.zeros((S, nb, width), dtype=dtype)  # ... and leaving each block
    b0 = np.arange(nb) * B
    ends = np.minimum(b0 + B, T)

    def run(sim: np.ndarray, blk: np.ndarray, start: np.ndarray, res: np.ndarray, keyv: np.ndarray) -> None:
        """Step lanes (cache ``sim``, block ``blk``, from token ``start`` in state ``res`` to the block's end) in
        lockstep, recording hits and entering states within the block and the state leaving it."""
        L = len(sim)
        stop = ends[blk]
        steps = int((stop - start).max())
        pk, m = which[sim], m_of[sim]
        H = np.zeros((steps, L, K), dtype=bool)
        R = np.zeros((steps + 1, L, width), dtype=dtype)  # the state entering each step
        for j in range(steps):
            R[j] = code(res)
            t = np.minimum(start + j, T - 1)  # a lane past its stop steps on a repeated token, unrecorded
            H[j], res = _cache_step(res, keyv, trace[t], keys[pk, t], m)
        R[steps] = code(res)
        for lane, (s_, b_, t0, t1) in enumerate(zip(sim.tolist(), b0[blk].tolist(), start.tolist(), stop.tolist())):
            hits[s_, b_:t1] = H[b_ - t0:t1 - t0, lane]  # the block's tokens: a contiguous run of steps
            rec[s_, b_:t1] = R[b_ - t0:t1 - t0, lane]
        rec_end[sim, blk] = R[stop - start, np.arange(L)]

    def restep(s: int, b: int, res: np.ndarray) -> None:
        """Step block ``b`` of cache ``s`` again from state ``res`` entering it, until its state equals the recorded
        one (the recorded rest of the block then holds) or the block ends (the state leaving it recorded). Only a
        token with a miss changes the state (one whose experts are all resident keeps it: nothing is evicted), so
        it jumps from miss to miss: a step per miss, the tokens between written at once."""
        t, end, m = int(b0[b]), int(ends[b]), m_of[s:s + 1]
        keys_s, index = keys[which[s]], indexes[int(which[s])]
        while True:
            c = code(res[None])[0]
            stay = res[trace[t:end]].all(1)  # tokens whose experts are all resident
            miss = t + (int(np.argmin(stay)) if not stay.all() else end - t)
            same = (rec[s, t:miss + (miss < end)] == c).all(-1)  # the state entering t..miss is res
            if same.any():  # met the recorded trajectory
                u = t + int(np.argmax(same))
                hits[s, t:u] = True
                rec[s, t:u] = c
                return
            hits[s, t:miss] = True
            rec[s, t:miss] = c
            if miss == end:
                rec_end[s, b] = c
                return
            keyv = index.at([miss])
            h, new = _cache_step(res[None], keyv, trace[miss][None], keys_s[miss][None], m)
            hits[s, miss] = h[0]
            rec[s, miss] = c
            res, t = new[0], miss + 1

    # every block of every cache at once, each from its guess at token b0 - W - 1 (block 0: the true empty cache
    # at token 0), with every expert's true key there
    indexes = {p: KeyIndex(trace, keys[p], w8) for p in set(which.tolist())}
    sim, blk = np.repeat(np.arange(S), nb), np.tile(np.arange(nb), S)
    start = np.where(blk == 0, 0, np.maximum(b0[blk] - W - 1, 0))
    key_at = {p: index.at(np.maximum(b0 - W - 1, 0)) for p, index in indexes.items()}
    keyv = np.stack([key_at[p][b] for p, b in zip(which[sim].tolist(), blk.tolist())])
    res = block_guess(keyv) & (blk != 0)[:, None]
    run(sim, blk, start, res, keyv)
    entered = rec[:, b0]  # [S, nb, width]: the state each block's recorded run entered it in
    # in order, every block entered in a state its predecessor (exact by then) did not leave in, stepped again
    bad = np.zeros((S, nb), dtype=bool)
    bad[:, 1:] = (entered[:, 1:] != rec_end[:, :-1]).any(-1)
    for s in np.nonzero(bad.any(1))[0].tolist():
        for b in range(int(np.argmax(bad[s])), nb):
            if (rec[s, b0[b]] != rec_end[s, b - 1]).any():
                restep(s, b, decode(rec_end[s, b - 1:b])[0])
    return list(hits)


def default_capacities(n: int, k: int) -> tuple[int, ...]:
    return tuple(sorted({c for c in (k, 2 * k, n // 4, n // 2, 3 * n // 4, n) if k <= c <= n}))


def expert_bytes(layer: MoELayer) -> int:
    """Bytes of one expert's weights (gate, up, down and biases) as stored (codes and scales when quantized)."""
    return quant.stored_bytes_per_expert(layer)


# ----- streaming consumer ---------------------------------------------------------------------
class OffloadCollector:
    """Consumer + decoder-layer pre-hooks: per layer, the real tokens' chosen experts (kept for the cache
    simulation), first-activation token index, activation counts and next-layer prediction sums per row."""

    def __init__(self, layers: Sequence[MoELayer], opts: OffloadOptions, tokens: Any):
        self.layers = {L.index: L for L in layers}
        self.row_ids = tokens.row_ids  # global packed-row numbers of this rank's rows (data parallel) or None: 0, 1, ...
        self.merged: dict[Any, np.ndarray] | None = None
        self.opts = opts
        self.norms = prediction_norms(layers, opts.predict_norm)  # before the forward: a refusal costs none
        self.trace: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self.valid: list[torch.Tensor] = []  # host [B*S] bool per batch
        self.rows: list[torch.Tensor] = []  # host [B*S] row id per batch
        self.first = {i: None for i in self.layers}
        self.counts = {i: None for i in self.layers}
        self.pred = RowTable(tokens)  # next-layer prediction sums per row, on the device (no host sync per event)
        self._x: dict[int, torch.Tensor] = {}
        self._base = 0
        self._row0 = 0
        self._rows_now: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None

    # -- hooks
    def before_batch(self, batch: Any) -> None:
        mask = batch.attention_mask.reshape(-1).bool()
        B, S = batch.attention_mask.shape
        self._rows_now = (torch.arange(self._row0, self._row0 + B, device="cpu") if self.row_ids is None
                          else torch.as_tensor(self.row_ids[self._row0:self._row0 + B])).repeat_interleave(S)
        self._row0 += B
        self.pred.next_batch(batch)
        self.valid.append(mask.cpu())
        self.rows.append(self._rows_now)
        self._pos = (self._base + torch.cumsum(mask.long(), 0) - 1)
        self._base += int(mask.sum())

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Forward pre-hooks on the analysed MoE layers' decoder layers: their input = the previous layer's output."""
        handles = []
        for i, L in self.layers.items():
            if not has_layer_ahead(L):
                continue

            def hook(module, args, kwargs, i=i):
                x = args[0] if args else kwargs["hidden_states"]
                self._x[i] = x.reshape(-1, x.shape[-1])
            handles.append(L.decoder_layer.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        i = L.index
        idx = ev.chosen_idx if ev.chosen_idx is not None else ev.idx
        n = L.n_experts
        self.trace[i].append(idx.to(torch.int16 if n < 2 ** 15 else torch.int32))
        valid = ev.valid
        pos = ops.to_device(self._pos, idx.device)
        big = torch.iinfo(torch.int64).max
        p = torch.where(valid, pos, torch.full_like(pos, big)).unsqueeze(-1).expand(idx.shape)
        first = torch.full((n,), big, dtype=torch.int64, device=idx.device).scatter_reduce(
            0, idx.reshape(-1).long(), p.reshape(-1), reduce="amin")
        self.first[i] = first if self.first[i] is None else torch.minimum(self.first[i], first)
        c = ops.one_hot_counts(idx, n, valid)
        self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
        x = self._x.pop(i, None)
        if x is None:
            return
        if x.shape[0] != ev.h.shape[0]:  # DeepSeek-V4's hyper-connections: hc_mult residual streams per token
            raise MoetoolError(f"offload's next-layer prediction: decoder layer {i}'s input carries "
                               f"{x.shape[0] // max(ev.h.shape[0], 1)} residual streams per token (hyper-"
                               f"connections), not one hidden state: layer {i}'s routing cannot be predicted from it")
        if self.norms:
            x = self.norms[i](x)
        if x.shape[-1] != ev.h.shape[-1]:  # Qwen4-Exp's hyper-connections side by side, without their mixer
            raise MoetoolError(f"offload's next-layer prediction: decoder layer {i}'s input is {x.shape[-1]} wide, "
                               f"its router reads {ev.h.shape[-1]}: predict through its norm (--predict-norm)")
        logits = L.logits(x)
        pred_idx = L.route(logits)[0]
        # each the routing decision: the chosen expert ranked first by the router's selection scores (ops.top1)
        pred_top1 = ops.top1(pred_idx, L.selection_scores(logits))
        real_top1 = ops.top1(idx, L.selection_scores(ev.logits))
        v = valid.double()
        top1 = (pred_top1 == real_top1).double() * v
        topk = ops.overlap_count(pred_idx, idx).double() / idx.shape[-1] * v
        for name, value in ((f"top1_{i}", top1), (f"topk_{i}", topk), (f"n_{i}", v)):  # per token -> per row
            self.pred.add(name, value)

    # -- results
    def requests(self, i: int) -> np.ndarray:
        """Layer ``i``'s request trace of real tokens ``[T, K]`` (rows concatenated in order, padding dropped)."""
        if self.merged is not None:
            return self.merged[i]
        idx = torch.cat([t.cpu() for t in self.trace[i]])
        return idx[torch.cat(self.valid)].numpy()

    def token_rows(self) -> np.ndarray:
        if self.merged is not None:
            return self.merged["rows"]
        return torch.cat(self.rows)[torch.cat(self.valid)].numpy()

    def merge_across_ranks(self) -> None:
        """Data parallel: the token stream of every rank in global order (packed rows in order, each row's tokens
        in order), the activation counts and first requests recomputed from it, the prediction sums merged, on
        every rank, so the cache simulation and coverage see one process's stream (alone: nothing)."""
        if distributed.world_size() <= 1:
            return
        empty = not self.valid  # a rank with no row at all
        mine = {"rows": np.zeros(0, np.int64) if empty else self.token_rows(),
                **{i: None if empty else self.requests(i) for i in self.layers}}
        parts = distributed.gather_object(mine)
        rows = np.concatenate([p["rows"] for p in parts])
        order = np.argsort(rows, kind="stable")  # a row lives on one rank, its tokens in order
        merged: dict[Any, np.ndarray] = {"rows": rows[order]}
        for i, L in self.layers.items():
            req = np.concatenate([p[i] for p in parts if p[i] is not None])[order]
            merged[i] = req
            n, T = L.n_experts, req.shape[0]
            first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(first, req.reshape(-1).astype(np.int64), np.repeat(np.arange(T), req.shape[1]))
            self.first[i] = torch.from_numpy(first)
            self.counts[i] = torch.from_numpy(np.bincount(req.reshape(-1).astype(np.int64), minlength=n))
        self.merged = merged
        self.pred.reduce_across_ranks()


def has_layer_ahead(L: MoELayer) -> bool:
    """Whether a decoder layer precedes ``L``'s in its stack (the first of a stack, of either in an encoder-decoder
    model, has none: its routing is not predicted)."""
    return getattr(L, "stack_layer", L.index) != 0


def prediction_norms(layers: Sequence[MoELayer], predict_norm: bool) -> dict[int, Any]:
    """Each predicted layer's ``pre_router_norm`` (what its router reads of the stream); ``{}`` without
    ``predict_norm`` (the router applied to ``x_ℓ`` itself). The layers are checked first
    (:func:`refuse_unpredicted`)."""
    return {L.index: L.pre_router_norm for L in layers if has_layer_ahead(L)} if predict_norm else {}


def unpredicted(layers: Sequence[MoELayer], predict_norm: bool) -> dict[int, tuple[str, str]]:
    """The layers of ``layers`` whose routing offload's next-layer prediction cannot recompute, each with ``(kind,
    detail)``: the one set of checks its refusal reports and its suggestion is computed from
    (:func:`refuse_unpredicted`). Only a layer with a decoder layer ahead is predicted (:func:`has_layer_ahead`); it
    cannot be where its router logits depend on more than its input (``carried``: ``routing_context``), where its
    experts are chosen by token id (``hash``), where a token carries several residual streams into it
    (``streams``: hyper-connections, no one hidden state; with or without the norm), or, predicting through the
    norm, where what its router reads is no norm of one stream (``norm``: the adapter's reason)."""
    ahead = [L for L in layers if has_layer_ahead(L)]
    out = recompute_unable(ahead)
    for L in ahead:
        if L.index in out:
            continue
        if L.residual_streams > 1:
            out[L.index] = ("streams", str(L.residual_streams))
        elif predict_norm:
            try:
                L.pre_router_norm
            except MoetoolError as e:
                out[L.index] = ("norm", str(e))
    return out


#: what offload's refusal says of each kind of layer :func:`unpredicted` lists (:func:`~moetool.engine.hooks.refuse_unable`)
UNPREDICTED_SAID = {
    **RECOMPUTE_SAID,
    "streams": "MoE layers {layers} carry {detail} residual streams per token (hyper-connections): no one hidden "
               "state to predict their routing from, with or without the norm",
    "norm": "{detail}; MoE layers {layers} cannot be predicted through their norm"}


def refuse_unpredicted(layers: Sequence[MoELayer], predict_norm: bool, model_layers: Sequence[MoELayer]) -> None:
    """One line, before any forward, naming every layer of ``layers`` (those analysed) whose next-layer prediction
    cannot be made (:func:`unpredicted`) and why, and an invocation that runs, computed from the same checks
    (:func:`~moetool.engine.hooks.refuse_unable`): the others (``--layers``), predicting from the stream itself
    (``--no-predict-norm``) where that leaves more of them, or the model's MoE layers that are left. A layer with
    zero-computation experts is never suggested (:func:`refuse_zero_compute`)."""
    refuse_unable(layers, model_layers, lambda among, alt: unpredicted(among, predict_norm and not alt),
                  UNPREDICTED_SAID, "offload's next-layer prediction: ",
                  alt=("--no-predict-norm", "predict from the stream itself") if predict_norm else None,
                  shared=("norm",), usable=lambda L: not getattr(L, "n_zero_compute", 0))


def refuse_zero_compute(zero: dict[int, int]) -> None:
    """One line for MoE layers with zero-computation experts (``zero``: layer -> their number; LongCat-Flash's
    identity experts): they hold no weights, so nothing is loaded or cached for them, while the simulation serves K
    loaded experts per token: its hit rates and bytes would count them as experts."""
    bad = {i: z for i, z in sorted(zero.items()) if z}
    if bad:
        i, z = next(iter(bad.items()))
        raise MoetoolError(f"offload: layer {i} routes to {z} zero-computation (identity) experts, which hold no "
                           f"weights to load or cache; the cache simulation loads K experts per token and would "
                           f"count them: not supported")


def offload(lm: Any, tokens: Any, options: OffloadOptions | None = None, *, quiet: bool = False,
            **overrides: Any) -> Result:
    """Expert offloading analysis: tables ``offload_coverage``, ``offload_layers``, ``offload_cache``,
    ``offload_prefetch`` (see :data:`DEFINITIONS`)."""
    opts = resolve_options(OffloadOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    refuse_zero_compute({L.index: getattr(L, "n_zero_compute", 0) for L in layers})  # no --layers helps here
    # only a layer with a decoder layer ahead is predicted (its routing recomputed); the first of a stack is simulated
    # from the model's own routing, whatever its router reads (hash-routed: DeepSeek-V4's first layers)
    refuse_unpredicted(layers, opts.predict_norm, lm.layers)
    for L in layers:  # before any forward
        for C in opts.capacities or ():
            if C < L.top_k or C > L.n_experts:
                raise MoetoolError(f"--capacity {C} outside [K={L.top_k}, n={L.n_experts}] for layer {L.index}")

    described = tokens.describe()
    if distributed.world_size() > 1 and tokens.row_ids is None:  # data parallel: this rank's rows, global ids
        tokens = distributed.shard(tokens, opts.batch_size)
    col = OffloadCollector(layers, opts, tokens)
    with col.capture():
        forward(lm, tokens, consumers=[col], moe_layers=layers, batch_size=opts.batch_size,
                before_batch=col.before_batch, quiet=quiet, description="offload")
    col.merge_across_ranks()
    res = offload_tables(col, layers, opts, described, {L.index: expert_bytes(L) for L in layers})
    if not len(res.tables["offload_prefetch.csv"]):  # every analysed layer first of its stack: no layer ahead of it
        res.tables.pop("offload_prefetch.csv")  # (--layers 0): the cache and coverage tables stand without it
        res.meta["left_out"] = {"offload_prefetch": f"no analysed MoE layer has a decoder layer ahead of it to "
                                                    f"predict from (--layers {','.join(str(L.index) for L in layers)})"}
    return res


def offload_tables(col: Any, layers: Sequence[Any], opts: OffloadOptions, described: dict[str, Any],
                   nbytes_of: dict[int, int] | None) -> Result:
    """The tables of :func:`offload` from a collector's token stream (``token_rows``, ``requests(i)``, ``first``,
    ``counts``, ``pred``) over ``layers`` (``index``, ``n_experts``, ``top_k``); ``nbytes_of``: each layer's expert
    bytes, ``None`` when unknown (a recorded trace: expert_bytes and bytes_per_token are left out)."""
    import pandas as pd

    rows = col.token_rows()
    T = int(rows.shape[0])
    if T < 2:
        raise MoetoolError(f"offload needs at least 2 real tokens, got {T}")
    n_rows = int(rows.max()) + 1
    kw = dict(n_boot=opts.bootstrap, seed=opts.seed)  # one row: no interval (uncertainty.replicates)

    def ci(num: np.ndarray, den: np.ndarray) -> list:
        return ratio_intervals(num, den, **kw)

    # coverage
    first = torch.stack([col.first[L.index].cpu() for L in layers])  # [L, n] (equal n per model)
    Ns = sorted({min(N, T) for N in (opts.coverage_tokens or [4 ** k for k in range(2, 20) if 4 ** k < T] + [T])})
    cov = pd.DataFrame([{"tokens": N, "coverage": float((first < N).double().mean()),
                         "coverage_min_layer": float((first < N).double().mean(1).min()),
                         "coverage_max_layer": float((first < N).double().mean(1).max())} for N in Ns])
    # per layer: hottest expert, expert size
    lay, cache, pref = [], [], []
    for L in layers:
        i, n, K = L.index, L.n_experts, L.top_k
        c = col.counts[L.index].cpu().double()
        share = c / c.sum()
        nbytes = nbytes_of[i] if nbytes_of is not None else None
        lay.append({"layer": i, "n_experts": n, "top_k": K, "tokens": T, "hottest_expert": int(share.argmax()),
                    "hottest_share": float(share.max()), "uniform_share": 1.0 / n,
                    "hottest_vs_uniform": float(share.max() * n), "experts_used": int((c > 0).sum()),
                    **({"expert_bytes": nbytes} if nbytes is not None else {})})
        req = col.requests(i)
        capacities = opts.capacities or default_capacities(n, K)
        sims = simulate_all(req, capacities, opts.policies)
        combos = [(C, pol) for C in capacities for pol in opts.policies]
        per_token = np.zeros((len(combos), T), dtype=np.int64)  # hits per token ([T, K] sums, a column at a time)
        for c, combo in enumerate(combos):
            for j in range(K):
                per_token[c] += sims[combo][:, j]
        per_row = np.bincount((rows[None, :] * len(combos) + np.arange(len(combos))[:, None]).reshape(-1),
                              weights=per_token.reshape(-1), minlength=n_rows * len(combos))
        requests = np.bincount(rows, minlength=n_rows).astype(np.float64) * K  # shared by every combination
        for (C, pol), iv, hits in zip(combos, ci(per_row.reshape(n_rows, len(combos)), requests),
                                      per_token.sum(1).tolist()):
            misses = T * K - hits
            cache.append({"layer": i, "policy": pol, "capacity": C, "requests": T * K, "hits": hits,
                          **iv.columns("hit_rate"), "misses_per_token": misses / T,
                          **({"bytes_per_token": misses / T * nbytes} if nbytes is not None else {})})
        if f"n_{i}" in col.pred._sums:
            num = np.stack([col.pred.table(f"top1_{i}"), col.pred.table(f"topk_{i}")], 1)
            den = col.pred.table(f"n_{i}")
            t1, tk = ci(num, den)
            pref.append({"layer": i, "source_layer": i - 1, "tokens": int(den.sum()), **t1.columns("top1_recall"),
                         **tk.columns("topk_recall")})
    tables = {"offload_coverage.csv": cov, "offload_layers.csv": pd.DataFrame(lay),
              "offload_cache.csv": pd.DataFrame(cache),
              "offload_prefetch.csv": pd.DataFrame(pref, columns=["layer", "source_layer", "tokens", "top1_recall",
                                                                  "top1_recall_lo", "top1_recall_hi", "topk_recall",
                                                                  "topk_recall_lo", "topk_recall_hi"])}
    cache_df = tables["offload_cache.csv"]
    summary = (cache_df.groupby(["policy", "capacity"], sort=False)
               .agg(hit_rate=("hit_rate", "mean"), **({"bytes_per_token": ("bytes_per_token", "sum")}
                                                      if nbytes_of is not None else {})).reset_index())
    return Result("offload", tables, opts,
                  meta=dict(definitions=DEFINITIONS, data=described,
                            bootstrap={**bootstrap_meta(opts.bootstrap, opts.seed, n_rows), "unit": "packed row"}),
                  summary=summary)


DEFINITIONS = {
    "tokens": "real (unpadded) tokens the layer routed (offload_layers.csv, offload_prefetch.csv)",
    "offload_coverage.tokens": "N: the first N real tokens of the data, in row order",
    "coverage": "fraction of (layer, expert) slots activated by at least one of the first N real tokens "
                "(rows concatenated in data order, padding skipped)",
    "coverage_min_layer/coverage_max_layer": "coverage of the least / the most covered MoE layer: the fraction of "
                                             "that layer's experts activated by the first N real tokens",
    "hottest_expert": "the expert with the largest share of the layer's T·K activations (ties: the lower id)",
    "uniform_share": "1/n: each expert's share of the activations under perfectly balanced routing",
    "experts_used": "experts activated by at least one real token of the data (out of n_experts)",
    "capacity": "experts the layer's cache holds (C)",
    "requests": "T·K: the layer's expert requests, K per real token",
    "hits": "requests served by the cache (the expert already resident), summed over the layer's tokens",
    "misses_per_token": "(requests - hits) / T: experts loaded into the cache per real token in the layer",
    "source_layer": "the decoder layer ℓ = layer - 1 whose output predicts layer's routing (top1_recall, "
                    "topk_recall)",
    "hottest_share": "largest fraction of the layer's T·K activations taken by one expert",
    "hottest_vs_uniform": "hottest_share × n (1 = perfectly balanced)",
    "expert_bytes": "parameters of one expert (gate, up, down, biases) × bytes of their dtype",
    "hit_rate": "hits / requests of a per-layer expert cache of `capacity` experts; a token's K experts are "
                "requested together and none of them is evicted for another; caches start empty",
    "policy": "lru: evict least recently requested (ties, experts last requested by the same token: the lowest id "
              "first); lfu: fewest requests so far, every past request counting, resident or not (ties: LRU); "
              "belady: next request furthest ahead (optimal offline; ties, e.g. never requested again: the lowest "
              "id first)",
    "bytes_per_token": "misses per token × expert_bytes (summed over layers in the summary)",
    "top1_recall": "fraction of tokens whose predicted top-1 (of layer ℓ+1's routing applied to "
                   "pre_router_norm_{ℓ+1}(x_ℓ) -- what the MoE block reads of the stream when attention adds "
                   "nothing --, x_ℓ = output of decoder layer ℓ) is layer ℓ+1's real top-1; the top-1 is the routing "
                   "decision, both the same way: the chosen expert ranked first by the router's selection scores "
                   "(a correction bias included, before any per-expert scale; not the largest weight)",
    "topk_recall": "mean |predicted top-K ∩ chosen top-K| / K",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows (moetool.uncertainty)",
}


def summary_lines(name: str, res: Result) -> list[str]:
    """Per cache capacity the hit rate of each policy, then the next-layer prediction recall (fractions, as
    offload_cache.csv and offload_prefetch.csv; means over layers)."""
    cache = res["offload_cache"]
    lines = []
    for C, d in cache.groupby("capacity"):
        parts = [f"{p} {fraction_text(d[d.policy == p].hit_rate.mean())}" for p in res.options.policies]
        lines.append(f"{name} offload C={C}: hit rate (mean over layers) " + ", ".join(parts))
    pref = res["offload_prefetch"] if "offload_prefetch" in res else ()  # a trace's: no router to predict with
    if len(pref):
        lines.append(f"{name} offload: next-layer prediction top-1 recall {fraction_text(pref.top1_recall.mean())}, "
                     f"top-K recall {fraction_text(pref.topk_recall.mean())} (mean over layers)")
    return lines
