"""Fewer (or more) experts per token than the model's K: ``topk:<k>`` and ``topp:<p>``.

``topk:<k>``: the model's own routing with k experts per token instead of K (its ranking, group limits and
correction bias; weights as its rule gives them to the chosen set, renormalised where the rule renormalises):
``topk:K`` reproduces the model exactly.

``topp:<p>[:<kmax>]``: per token, the smallest set of experts, taken in decreasing order of the model's routing
distribution π, whose mass reaches p (at least one, at most ``kmax``, default n): dynamic-K / top-p routing
(Huang et al. 2024, "Harder Tasks Need More Experts: Dynamic Routing in MoE Models", arXiv 2403.07652). Weights
as the rule gives them to that set (a softmax over the chosen, a renormalisation over them, or the scores
alone), times the routed scaling factor. Ranking by π ignores DeepSeek's group limits and correction bias.
The experts module receives as many columns per token as the batch's largest set (at most ``kmax``); a token's
unchosen columns carry weight 0 (what runs is still computed, what counts is the mass the chosen carry).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..engine.hooks import RoutingEvent, refuse_above_max_k
from ..errors import MoetoolError
from .base import Policy, number_text, spec_number


def _sparsemixer(layer: Any) -> bool:
    return getattr(getattr(layer, "rule", None), "weight", "") == "sparsemixer"


class TopKPolicy(Policy):
    """``topk:<k>``: the model's routing with k experts per token (module docstring)."""

    routes_by_scores = True
    name = "topk"

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"k must be at least 1, not {k}")
        self.k = k
        self.name = f"topk:{k}"

    @classmethod
    def from_spec(cls, args: list[str], **_: Any) -> "TopKPolicy":
        if len(args) != 1:
            raise ValueError("use topk:<k>, e.g. topk:1")
        return cls(spec_number(args[0], int, "k"))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "k": self.k}

    def check_moe_layers(self, layers: list[Any]) -> None:
        """One line before any forward where some of ``layers`` (every MoE layer it runs in, at once: the bound it
        suggests is the smallest of them all, never one a further layer refuses in turn) cannot route k experts."""
        refuse_above_max_k(self.name, self.k, layers)

    def check(self, layer: Any) -> None:
        """One line before any forward where ``layer`` has no top-k for this k (sparsemixer's rounds; more experts
        than it can route: :meth:`check_moe_layers`)."""
        if _sparsemixer(layer) and self.k != layer.top_k:
            raise MoetoolError(f"{self.name}: layer {layer.index} routes by sparsemixer, whose {layer.top_k} rounds "
                               f"define no top-{self.k}")

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        return ev.layer.route_k(ev.logits, self.k)


class TopPPolicy(Policy):
    """``topp:<p>[:<kmax>]``: the smallest set of experts whose routing mass reaches p (module docstring)."""

    routes_by_scores = True
    name = "topp"

    def __init__(self, p: float, kmax: int | None = None):
        if not 0.0 < p <= 1.0:
            raise ValueError(f"p must be in (0, 1], not {p}")
        if kmax is not None and kmax < 1:
            raise ValueError(f"kmax must be at least 1, not {kmax}")
        self.p, self.kmax = p, kmax
        self.name = f"topp:{number_text(p)}" + (f":{kmax}" if kmax is not None else "")  # p exactly (0.9999999, not 1)

    @classmethod
    def from_spec(cls, args: list[str], **_: Any) -> "TopPPolicy":
        if len(args) not in (1, 2):
            raise ValueError("use topp:<p>[:<kmax>], e.g. topp:0.9")
        return cls(spec_number(args[0], float, "p"), spec_number(args[1], int, "kmax") if len(args) == 2 else None)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "p": self.p, "kmax": self.kmax}

    def check_moe_layers(self, layers: list[Any]) -> None:
        """One line before any forward where ``kmax`` is more experts than some of ``layers`` (all it runs in, at
        once) have."""
        if self.kmax is not None:
            refuse_above_max_k(f"{self.name} (kmax)", self.kmax, layers, groups=False)  # π ranks every expert

    def check(self, layer: Any) -> None:
        """One line before any forward where ``layer``'s weights are not defined for a set of any size (``kmax``:
        :meth:`check_moe_layers`)."""
        if _sparsemixer(layer):
            raise MoetoolError(f"{self.name}: layer {layer.index} routes by sparsemixer, whose weights are defined "
                               f"for its own {layer.top_k} rounds only")

    def ranking(self, ev: RoutingEvent) -> torch.Tensor:
        """π, the mass it accumulates (not the selection scores: a correction bias is no routing mass)."""
        return ev.probs

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        L = ev.layer
        width = self.kmax or L.n_experts
        idx, mask = top_p(ev.probs, self.p, width)
        # every one of the ``width`` columns goes to the experts module (the unchosen at weight 0): cutting them to the
        # batch's largest set would need that size on the host -- a sync per layer and batch inside the forward
        # (issue 37). ``kmax`` bounds the columns, and so the experts' work and memory, without one.
        return idx, L.weights_for(ev.logits, idx, mask)


def top_p(probs: torch.Tensor, p: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx [T, width], mask [T, width])``: experts in decreasing ``probs``; ``mask`` keeps the smallest prefix
    whose mass reaches ``p`` (at least one expert; all ``width`` when the mass within them stays below p)."""
    idx = ops.topk(probs, width)
    mass = probs.gather(-1, idx).cumsum(-1)
    before = mass - probs.gather(-1, idx)  # the mass of the experts ranked above each one
    mask = before < p  # an expert is kept while the mass above it has not reached p yet
    mask[:, 0] = True
    return idx, mask
