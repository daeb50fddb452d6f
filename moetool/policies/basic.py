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


def uniform_rows(seed: int, layer: int, rows: Any, per_row: int, width: int, device: Any,
                 draw: Any = torch.rand) -> torch.Tensor:
    """``[len(rows) * per_row, width]`` uniform draws, packed row r's from a generator seeded by (seed, layer, r):
    what a random choice draws for a token depends on its row, not on how rows are batched or split over ranks.
    ``draw=torch.randn``: standard normal draws, seeded the same way."""
    base = (seed * 1_000_003 + layer) * 1_000_000_007
    out = torch.empty(len(rows) * per_row, width, device=device)
    for i, r in enumerate(rows):  # each row's block drawn in place (no concatenated copy of [T, width])
        draw((per_row, width), out=out[i * per_row:(i + 1) * per_row],  # a generator's seed is 64 bits: modulo 2**64
             generator=torch.Generator(device=device).manual_seed((base + int(r)) % 2**64))
    return out


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
        T, n, K = ev.h.shape[0], ev.layer.n_experts, ev.layer.top_k
        if ev.rows is not None:  # seeded per (layer, packed row): the same draws for any batch size or rank count
            u = uniform_rows(self.seed, ev.layer.index, ev.rows, T // len(ev.rows), n, dev)
        else:
            if dev not in self._gen:
                self._gen[dev] = torch.Generator(device=dev).manual_seed(self.seed)
            u = torch.rand(T, n, generator=self._gen[dev], device=dev)
        idx = ops.topk(u, K)
        return idx, torch.full((T, K), ev.layer.weight_scale / K, device=dev)
