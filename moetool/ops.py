"""The one home of the small routing math: norms, top-K, entropies, set overlaps.

Every experiment, policy and test imports these; nothing re-implements them.
Shapes: ``T`` tokens, ``n`` experts, ``K`` chosen experts.
"""

from __future__ import annotations

import math

import torch

NORMS = ("l2", "l1", "linf")
_ORD = {"l2": 2.0, "l1": 1.0, "linf": math.inf}


def vector_norm(x: torch.Tensor, norm: str = "l2", dim: int = -1) -> torch.Tensor:
    """``l2`` / ``l1`` / ``linf`` norm along ``dim``, accumulated in fp32 (fp64 input stays fp64)."""
    if norm not in _ORD:
        raise ValueError(f"unknown norm '{norm}' (choose from {', '.join(NORMS)})")
    # dtype=float32: a CUDA bf16/fp16 input is accumulated in fp32 by the reduction itself (no fp32 copy of x)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(x, ord=_ORD[norm], dim=dim, dtype=dtype)


def topk(scores: torch.Tensor, k: int, *, stable: bool = False) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, largest first. ``[T, n] -> [T, k]``. ``stable``: equal
    scores in index order (the lowest first, as ``argmax``), by a stable sort."""
    if stable:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.topk(scores, k, dim=-1).indices


def normalize(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``p / sum(p)`` along ``dim`` (fp32), safe for an all-zero row."""
    p = p.float()
    return p / p.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy in nats of a distribution along ``dim`` (``0 log 0 = 0``), in float32 or, for a float64
    distribution (exact counts' fractions), in float64: never rounded below the input's precision."""
    p = p if p.dtype == torch.float64 else p.float()
    return -torch.special.xlogy(p, p).sum(dim=dim)


def argmax(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``x.argmax(-1)`` (the first largest value; NaN counts as largest) over blocks of ``block`` values: each block's
    ``amax``, the first block holding the largest, then the first largest inside it. The same indices as
    ``torch.argmax`` in one vectorised pass over ``x`` (a CPU's ``argmax`` of a ``[rows, vocab]`` logit matrix
    is about five times slower than its ``amax``); a last dim not a multiple of ``block``, or another device (a GPU's
    ``argmax`` is one pass already): ``torch.argmax``."""
    V = x.shape[-1]
    if V < 2 * block or V % block or not x.is_floating_point() or x.device.type != "cpu":
        return x.argmax(-1)
    blocks = x.reshape(*x.shape[:-1], V // block, block)  # [..., V / block, block] (a view of contiguous rows)
    first = blocks.amax(-1).argmax(-1, keepdim=True)  # [..., 1] the first block that holds the largest value
    inside = blocks.gather(-2, first.unsqueeze(-1).expand(*first.shape, block)).squeeze(-2)  # [..., block]
    return first.squeeze(-1) * block + inside.argmax(-1)


def set_size(a: torch.Tensor) -> torch.Tensor:
    """Members of each row's index set ``a [T, K]``: its ids >= 0 (a negative id pads a set smaller than K)."""
    return (a >= 0).sum(-1)


def overlap_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|A ∩ B|`` per row for index sets ``a [T, Ka]`` and ``b [T, Kb]`` (no repeats in a row; negative ids pad a
    row's set and are no member of it: :func:`set_size`)."""
    return ((a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1) & (a >= 0)).sum(-1)


def same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise set equality of two index tensors (negative ids pad, as in :func:`overlap_count`)."""
    n = overlap_count(a, b)
    return (n == set_size(a)) & (n == set_size(b))


def jaccard(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``|A ∩ B| / |A ∪ B|`` per row in ``dtype`` (negative ids pad; 1 where both sets are empty: the same set, as
    :func:`same_set` says -- a token capacity dropped in both routings)."""
    inter = overlap_count(a, b).to(dtype)
    union = set_size(a) + set_size(b) - inter
    return torch.where(union == 0, torch.ones_like(inter), inter / union.clamp_min(1))


def one_hot_counts(idx: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """How often each expert appears in ``idx [T, K]`` over valid tokens: ``[n]`` float64 (on device)."""
    # index_add_ with 0/1 weights, not boolean indexing + bincount: both size their output from the data and
    # would wait for the device (CUDA) inside the forward
    w = (valid.to(torch.float64).unsqueeze(-1) if valid is not None
         else torch.ones((), dtype=torch.float64, device=idx.device)).expand(idx.shape)
    return torch.zeros(n, dtype=torch.float64, device=idx.device).index_add_(0, idx.reshape(-1).long(), w.reshape(-1))


def multi_hot(idx: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Indicator matrix of index sets: ``idx [T, K] -> [T, n]`` with 1 where expert e is in row t's set."""
    return torch.zeros(idx.shape[0], n, dtype=dtype, device=idx.device).scatter_(1, idx.long(), 1)


def unique_counts(keys: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``counts`` (default 1 each) per distinct key: ``keys [N] -> (sorted unique keys [U], sums [U])`` (int64)."""
    uniq, inv = torch.unique(keys.reshape(-1), return_inverse=True)
    w = torch.ones_like(inv) if counts is None else counts.reshape(-1).long()
    return uniq, torch.zeros(uniq.shape[0], dtype=torch.long, device=keys.device).index_add_(0, inv, w)


def ranks(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """1-based ranks along ``dim``, ties get their average rank (as ``scipy.stats.rankdata``). fp64."""
    x = x.double().transpose(dim, -1).contiguous()
    s = x.sort(dim=-1).values
    lo = torch.searchsorted(s, x, right=False)  # values strictly below
    hi = torch.searchsorted(s, x, right=True)  # values at or below
    return ((lo + hi + 1).double() / 2).transpose(dim, -1)


def spearman(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Spearman rank correlation of ``a`` and ``b`` along ``dim`` (Pearson of average ranks); NaN if constant."""
    ra, rb = ranks(a, dim), ranks(b, dim)
    ra = ra - ra.mean(dim=dim, keepdim=True)
    rb = rb - rb.mean(dim=dim, keepdim=True)
    return (ra * rb).sum(dim) / ((ra * ra).sum(dim) * (rb * rb).sum(dim)).sqrt()


def abs_cos_mean(x: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
    """Mean ``|cos|`` over the ``m(m-1)`` ordered pairs of distinct rows of ``x [..., m, d]`` -> ``[...]``.

    Pass ``gram = x xᵀ [..., m, m]`` instead if it is already computed (``x`` is then ignored). A zero
    row has cosine 0 with everything; fewer than two rows (no pair) gives NaN.
    """
    g = (x.float() @ x.float().transpose(-1, -2)) if gram is None else gram  # [..., m, m]
    norm = g.diagonal(dim1=-2, dim2=-1).clamp_min(0).sqrt()  # [..., m]
    cos = g / (norm.unsqueeze(-1) * norm.unsqueeze(-2)).clamp_min(torch.finfo(g.dtype).tiny)
    m = g.shape[-1]
    off = ~torch.eye(m, dtype=torch.bool, device=g.device)
    return (cos.abs() * off).sum((-2, -1)) / (m * (m - 1))  # no pair (m < 2): NaN, not 0


def median(x: torch.Tensor) -> float:
    """Median of all elements (the mean of the two middle values for an even count), NaN if empty."""
    v = x.reshape(-1).double().sort().values
    n = v.numel()
    if n == 0:
        return float("nan")
    return float((v[(n - 1) // 2] + v[n // 2]) / 2)


def unit(x: torch.Tensor, dim: int = -1, *, scaled: bool = False) -> torch.Tensor:
    """Project onto the unit sphere along ``dim`` (``x / ||x||_2``, keeps a float dtype, fp32 otherwise); a zero row stays 0.

    A bf16/fp16 row is divided by its norm in fp32 (:func:`vector_norm`), then rounded back: an fp16 norm past 65504
    (entries ~1000 over 4096 dims) is inf, which made the row a zero vector.
    ``scaled``: divide each row by its largest magnitude first (one more pass), so a row of tiny entries (below
    about 1e-19 in fp32, whose squares underflow: a norm of 0) still comes out a unit vector, not 0 or ``x / tiny``."""
    x = x if x.is_floating_point() else x.float()
    dtype = x.dtype
    if x.element_size() < 4:  # half precision: the division in fp32 (the norm need not fit the input's range)
        x = x.float()
    tiny = torch.finfo(x.dtype).tiny
    if scaled:
        x = x / x.abs().amax(dim=dim, keepdim=True).clamp_min(tiny)
    return (x / vector_norm(x, dim=dim).unsqueeze(dim).clamp_min(tiny)).to(dtype)


def hist_quantile(counts: torch.Tensor, q: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """``q``-quantile of values binned into ``counts [B]`` equal bins over ``[lo, hi]``: the upper edge of the
    first bin where the cumulative count reaches ``q`` of the total (exact to one bin width; NaN if empty)."""
    c = counts.double().cumsum(0)
    if c.numel() == 0 or c[-1] <= 0:
        return float("nan")
    b = int(torch.searchsorted(c, c[-1] * q).clamp_max(c.numel() - 1))
    return lo + (hi - lo) * (b + 1) / c.numel()


def rank_order(idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Positions ``[T, K]`` that put each row of a chosen set ``idx [T, K]`` in descending ``scores [T, n]`` order
    (``idx.gather(-1, rank_order(idx, scores))``): the order ``torch.topk(sorted=True)`` returns, whatever order the
    set came in (DeepSeek-V3's, GLM-4.5's, LongCat's routers return theirs unsorted). Stable: equal scores keep
    their order, so the first is :func:`top1`'s."""
    return topk(scores.gather(-1, idx.long()), idx.shape[-1], stable=True)


def top1(idx: torch.Tensor, scores: torch.Tensor | None = None, chosen: torch.Tensor | None = None) -> torch.Tensor:
    """The top-1 expert of each row of a chosen set ``idx [T, K]``: ``[T]``. moetool's one definition of "the top-1"
    (fluctuation, offload, agreement, margin, norm-select, locality, stats): the routing decision, the chosen expert
    ranked first by ``scores [T, n]``, the scores the routing selected on -- a model's router: its selection scores
    (``layer.selection_scores``: correction bias included, before any per-expert scale or renormalisation of the
    weights); a policy: the scores it chose from. Not the largest routing weight: Gemma 4's learned per-expert scale,
    PhiMoE's sparsemixer weights and DeepSeek-V3's unbiased sigmoid weights order the chosen experts otherwise.
    ``chosen [T, K]`` (bool): the columns that count (a column a policy left at weight 0 -- top-p's unchosen,
    capacity's dropped -- is no chosen expert); ``scores`` None: the first chosen column (a set already in its
    ranking's order, best first: random's and norm's, a recorded trace's). Equal scores: the first column. A row
    with nothing chosen: its first column (the caller marks it)."""
    if scores is None:
        pos = (torch.ones_like(idx, dtype=torch.bool) if chosen is None else chosen).int().argmax(-1, keepdim=True)
    else:
        s = scores.gather(-1, idx.long())
        if chosen is not None:
            s = s.float().masked_fill(~chosen, float("-inf"))
        pos = s.argmax(-1, keepdim=True)
    return idx.gather(-1, pos).squeeze(-1)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without a host synchronisation: a CPU tensor bound for a GPU is pinned and copied
    asynchronously (a copy from pageable host memory makes the host wait for the GPU: a sync inside the forward).
    Already there: ``t`` itself."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
