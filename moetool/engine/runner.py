"""Run a model over batches of token ids, with or without an engine attached.

Perplexity is reduced on the device (sums of NLL and token counts) and read once at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from ..progress import progress


@dataclass
class NLL:
    """Streaming next-token negative log-likelihood. Padding never counts."""

    nll_sum: float = 0.0
    tokens: int = 0

    @property
    def mean(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.mean) if self.tokens else float("nan")


def batch_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token NLL and number of scored tokens for one batch (device tensors)."""
    pred = logits[:, :-1].float()  # [B, S-1, V]
    tgt = input_ids[:, 1:]  # [B, S-1]
    keep = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.reshape(-1), reduction="none")
    keep = keep.reshape(-1)
    return (nll * keep).sum(dtype=torch.float64), keep.sum()


@torch.no_grad()
def run_batches(model, batches: Iterable, *, total: int | None = None, nll: bool = False,
                description: str = "forward", quiet: bool = False) -> NLL:
    """Forward every batch (``.input_ids``, ``.attention_mask``); returns the NLL (if asked)."""
    device = model.device
    s = torch.zeros((), dtype=torch.float64, device=device)
    c = torch.zeros((), dtype=torch.long, device=device)
    for b in progress(batches, total=total, description=description, quiet=quiet):
        ids, mask = b.input_ids.to(device), b.attention_mask.to(device)
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        if nll:
            bs, bc = batch_nll(out.logits, ids, mask.to(out.logits.device))
            s += bs.to(device)
            c += bc.to(device)
    return NLL(float(s), int(c))
