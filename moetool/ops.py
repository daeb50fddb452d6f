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
    """``l2`` / ``l1`` / ``linf`` norm along ``dim``, accumulated in fp32."""
    if norm not in _ORD:
        raise ValueError(f"unknown norm '{norm}' (choose from {', '.join(NORMS)})")
    return torch.linalg.vector_norm(x.float(), ord=_ORD[norm], dim=dim)


def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, largest first. ``[T, n] -> [T, k]``."""
    return torch.topk(scores, k, dim=-1).indices


def normalize(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``p / sum(p)`` along ``dim`` (fp32), safe for an all-zero row."""
    p = p.float()
    return p / p.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon entropy in nats of a distribution along ``dim`` (``0 log 0 = 0``)."""
    p = p.float()
    return -torch.special.xlogy(p, p).sum(dim=dim)


def overlap_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|A ∩ B|`` per row for index sets ``a [T, Ka]`` and ``b [T, Kb]`` (no repeats in a row)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1)


def same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise set equality of two ``[T, K]`` index tensors."""
    return overlap_count(a, b) == a.shape[-1]


def jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|A ∩ B| / |A ∪ B|`` per row, fp32."""
    inter = overlap_count(a, b).float()
    return inter / (a.shape[-1] + b.shape[-1] - inter)


def one_hot_counts(idx: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """How often each expert appears in ``idx [T, K]`` over valid tokens: ``[n]`` float64 (on device)."""
    if valid is not None:
        idx = idx[valid]
    return torch.bincount(idx.reshape(-1), minlength=n).double()
