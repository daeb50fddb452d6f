"""``norm:<node>[:<norm>]`` — Autonomy-of-Experts' training-free pilot.

The router is ignored; every expert computes ``node`` for the token (batched over experts)
and the K with the largest norm run. Weights (``--weights``): ``softmax`` over the chosen
norms (AoE Algorithm 1, default), ``router`` (the model's probabilities of the chosen set,
renormalised as the model does), ``uniform`` (1/K). ``softmax`` and ``uniform`` weights are
multiplied by the layer's ``weight_scale`` (DeepSeek's ``routed_scaling_factor``; 1 elsewhere) so the
routed output keeps the model's scale. Equal norms (e.g. two experts whose node is exactly zero for a token) are
ordered as ``torch.topk`` orders them, as the models' own routers do: which of the tied experts runs is not
specified and may differ between CPU and CUDA.

Zero-computation experts (LongCat-Flash's identity experts, Zaya's skip expert: ``layer.n_zero_compute``, the last
indices) have no activation at an internal node (gate, up, act, glu: they compute nothing), so at those nodes the
policy ranks the computed experts only and never chooses them; at ``output`` they are ranked by the norm of what they
output (``||x||`` for an identity expert, 0 for a skip expert), as the router's choice of them would run. (The probes
give them ``||x||`` at every node, :mod:`moetool.engine.probes`; ranked that way on the tiny LongCat-Flash they won
every choice at every node, so ``norm:gate`` ran no computed expert and equalled ``norm:output``.) A layer with
fewer than K computed experts cannot be routed so at an internal node: one line before any forward.

``among`` (a :class:`moetool.policies.prune.PrunePolicy`): the policy on a pruned model — it chooses the K largest
norms among the experts the pruning keeps (``norm-select --prune``). ``router`` weights of a kept set are the
model's own for that set: the pruned router gives its chosen experts the same weights.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..adapters import quant
from ..engine.hooks import RoutingEvent
from ..engine.probes import NODES, node_scores
from .base import Policy

WEIGHTS = ("softmax", "router", "uniform")


class NormPolicy(Policy):
    """``norm:<node>[:<norm>]`` with ``weights`` softmax | router | uniform."""

    needs_probe = True  # the node's norm of every expert on every token (engine.probes.node_scores)

    def __init__(self, node: str = "gate", norm: str = "l2", weights: str = "softmax", among: Any = None):
        if node not in NODES:
            raise ValueError(f"unknown node '{node}' (choose from {', '.join(NODES)})")
        if norm not in ops.NORMS:
            raise ValueError(f"unknown norm '{norm}' (choose from {', '.join(ops.NORMS)})")
        if weights not in WEIGHTS:
            raise ValueError(f"unknown --weights '{weights}' (choose from {', '.join(WEIGHTS)})")
        self.node, self.norm, self.weights, self.among = node, norm, weights, among
        self.name = f"norm:{node}:{norm}"

    @classmethod
    def from_spec(cls, args: list[str], weights: str = "softmax", norm: str | None = None, **_: Any) -> "NormPolicy":
        if not args or len(args) > 2:
            raise ValueError("use norm:<node>[:<norm>], e.g. norm:gate or norm:output:l1")
        return cls(args[0], args[1] if len(args) > 1 else (norm or "l2"), weights)

    #: :func:`moetool.engine.hooks.check_policy`'s alternative where an internal node refuses: the output ranks all
    unable_alt = ("norm:output", "rank every expert at the output node")

    def unable(self, layers: Any, at_output: bool = False) -> dict[int, tuple[str, str]]:
        """The layers of ``layers`` with fewer computed experts than their top-k, where this node (``at_output``:
        ``norm:output``, which ranks every expert) has fewer activations to rank than experts to choose: refused
        in one line by :func:`moetool.engine.hooks.check_policy`, with the other layers and ``norm:output``."""
        if self.node == "output" or at_output:
            return {}
        return {L.index: ("few", f"{L.n_computed} computed experts for a top-{L.top_k} (the other "
                                 f"{L.n_zero_compute} compute nothing")
                for L in layers if L.n_zero_compute and L.n_computed < L.top_k}

    @property
    def unable_said(self) -> dict[str, str]:
        return {"few": f"MoE layers {{layers}} have {{detail}}, so have no '{self.node}' activation to rank)"}

    def check(self, layer: Any) -> None:
        """Experts in a format moetool cannot read, and (on a pruned model) the pruning's own check: one line before
        any forward."""
        quant.require_readable(layer, f"--routing {self.name}")
        if self.among is not None:
            self.among.check(layer)

    def scores(self, ev: RoutingEvent) -> torch.Tensor:
        """Node norm of every expert ``[T, n]``."""
        return node_scores(ev.layer, ev.h, self.node, self.norm)

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(ev)  # [T, n]
        z = ev.layer.n_zero_compute
        if z and self.node != "output":  # zero-computation experts have no activation at an internal node
            s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) >= s.shape[-1] - z, float("-inf"))
        if self.among is not None:  # removed experts are never chosen
            s = s.masked_fill(~self.among.keep(ev.layer, s.device), float("-inf"))
        idx = ops.topk(s, ev.layer.top_k)  # [T, K]
        if self.weights == "router":  # on a pruned model its router's: the removed experts' logits gone
            return idx, ev.layer.weights_for(ev.logits if self.among is None else self.among.logits(ev), idx)
        if self.weights == "softmax":
            w = torch.softmax(s.gather(-1, idx), dim=-1)
        else:
            w = torch.full(idx.shape, 1.0 / idx.shape[-1], device=idx.device)
        return idx, w * ev.layer.weight_scale

    def check_layers(self, policy_layers: list[int], moe_layers: list[int]) -> None:
        if self.among is not None:
            self.among.check_layers(policy_layers, moe_layers)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        return out if self.among is None else {**out, "among": self.among.describe()}
