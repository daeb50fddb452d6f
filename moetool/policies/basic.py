"""The model's own routing and the random baseline."""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..engine.hooks import RoutingEvent
from .base import Policy


class RouterPolicy(Policy):
    """``router``: unchanged. Returns the model's own choice through the override path."""

    name = "router"

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        return ev.idx, ev.weights


class RandomPolicy(Policy):
    """``random``: K experts uniformly at random per token (seeded), uniform weights 1/K
    (times the layer's ``weight_scale``, 1 except DeepSeek's routed scaling factor)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._gen: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_spec(cls, args: list[str], seed: int = 0, **_: Any) -> "RandomPolicy":
        if args:
            raise ValueError("'random' takes no arguments (use --seed)")
        return cls(seed)

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        dev = ev.h.device
        if dev not in self._gen:
            self._gen[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        T, n, K = ev.h.shape[0], ev.layer.n_experts, ev.layer.top_k
        idx = ops.topk(torch.rand(T, n, generator=self._gen[dev], device=dev), K)
        return idx, torch.full((T, K), ev.layer.weight_scale / K, device=dev)
