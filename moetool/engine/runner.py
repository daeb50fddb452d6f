"""The one forward loop: run a model over batches of packed token rows, with or without routing hooks.

:func:`forward` is what every experiment calls: it installs an :class:`~moetool.engine.hooks.Engine` (a policy in
the chosen MoE layers, consumers seeing every routing event) only when there is something to hook, runs every
batch, and optionally reduces the next-token NLL on the device (sums and token counts, read once at the end).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

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


@dataclass
class ForwardResult:
    """What :func:`forward` measured: the NLL (zero tokens unless ``nll=True``), wall time and forwards run."""

    nll: NLL
    seconds: float  # wall time of the forward passes (hooks, policy, consumers and NLL reduction included)
    batches: int
    world_size: int = 1  # processes that shared the rows (torchrun / accelerate); nll is summed over all of them
    rows: Any = None  # per-row sums (moetool.uncertainty.RowTable) when the caller asked for them (bootstrap)

    @property
    def perplexity(self) -> float:
        return self.nll.ppl


def batch_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token NLL and number of scored tokens for one batch (device tensors); ``per_row``: one sum and
    count per row (``[B]`` each; the bootstrap's per-document sums)."""
    pred = logits[:, :-1].float()  # [B, S-1, V]
    tgt = input_ids[:, 1:]  # [B, S-1]
    keep = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.reshape(-1), reduction="none")
    if per_row:
        return (nll.view(keep.shape) * keep).sum(1, dtype=torch.float64), keep.sum(1)
    keep = keep.reshape(-1)
    return (nll * keep).sum(dtype=torch.float64), keep.sum()


def _rows(tokens: Any, start: int, count: int) -> str:
    """``rows a-b`` of the batch starting at local row ``start`` (global row numbers under data parallel)."""
    ids = getattr(tokens, "row_ids", None)
    rows = list(range(start, start + count)) if ids is None else [int(i) for i in ids[start:start + count]]
    if not rows:
        return ""
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return (f"rows {rows[0]}-{rows[-1]}" if len(rows) > 1 else f"row {rows[0]}") if contiguous else \
        "rows " + ",".join(map(str, rows))


def forward(lm: Any, tokens: Any, *, policy: Any = None, layers: Iterable[int] | None = None,
            consumers: Iterable[Callable] = (), moe_layers: Iterable[Any] | None = None, batch_size: int = 8,
            before_batch: Callable[[Any], None] | None = None, on_batch: Callable[[Any, Any], None] | None = None,
            nll: bool = False, attention: bool = False, quiet: bool = False,
            description: str = "forward", start_batch: int = 0) -> ForwardResult:
    """Run ``lm`` (a loaded model: ``.model``, ``.layers``) over ``tokens`` (a ``TokenSet``) in batches.

    ``policy`` replaces routing in the MoE ``layers`` (decoder indices, ``None`` = every MoE layer; validated by
    :func:`moetool.engine.select_layers`); ``consumers`` see every routing event of the hooked ``moe_layers``
    (``MoELayer`` objects, default ``lm.layers``: an analysis restricted to some layers hooks only those). With
    no policy and no consumers (and ``attention=False``) no hook is installed at all: the unhooked reference a
    ``router`` run reproduces.
    ``before_batch(batch)`` runs before each forward (a consumer registering the batch's token ids),
    ``on_batch(batch, output)`` after it (logits consumers, per-batch checks). ``nll=True`` reduces the
    next-token NLL of the real tokens (padding never counts). ``start_batch``: batches before it are not run
    (``--resume``: the consumers' state up to there was restored); numbering (errors, progress) is unchanged.

    Under a distributed launch (:mod:`moetool.distributed`, ``WORLD_SIZE > 1``) each rank runs its shard of the
    rows (``distributed.shard``: its slice of every global batch) unless ``tokens`` is a shard already; the NLL
    is summed over ranks, and every consumer with a ``reduce_across_ranks()`` method is asked to all-reduce its
    accumulators at the end. Alone, none of this happens.
    """
    from .. import distributed
    from .guard import FiniteGuard
    from .hooks import Engine

    world = distributed.world_size()
    if world > 1 and getattr(tokens, "row_ids", None) is None:
        tokens = distributed.shard(tokens, batch_size)

    consumers = list(consumers)
    hooked = policy is not None or bool(consumers) or attention
    hooked_layers = list(lm.layers if moe_layers is None else moe_layers)
    engine = (Engine(lm.model, hooked_layers, policy=policy, policy_layers=layers, consumers=consumers,
                     attention=attention) if hooked else contextlib.nullcontext())
    model = lm.model
    device = model.device
    guard = FiniteGuard(lm.layers)  # NaN/inf in any MoE layer: one line naming layer and batch, never a number
    s = torch.zeros((), dtype=torch.float64, device=device)
    c = torch.zeros((), dtype=torch.long, device=device)
    n = start_batch
    t0 = time.perf_counter()
    with torch.no_grad(), engine, guard:
        batches = itertools.islice(tokens.batches(batch_size), start_batch, None)
        for b in progress(batches, total=tokens.n_batches(batch_size) - start_batch, description=description,
                          quiet=quiet):
            if before_batch is not None:
                before_batch(b)
            ids, mask = b.input_ids.to(device), b.attention_mask.to(device)
            guard.mask = mask
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
            guard.check(n, _rows(tokens, n * batch_size, ids.shape[0]))
            n += 1
            if nll:
                bs, bc = batch_nll(out.logits, ids, mask.to(out.logits.device))
                s += bs.to(device)
                c += bc.to(device)
            if on_batch is not None:
                on_batch(b, out)
    if world > 1:
        if nll:  # no collective otherwise: a caller's own per-batch collectives (k-means EMA) stay lined up
            s, c = distributed.all_reduce(s), distributed.all_reduce(c)
        for consumer in consumers:
            if hasattr(consumer, "reduce_across_ranks"):
                consumer.reduce_across_ranks()
    result = NLL(float(s), int(c))
    return ForwardResult(result, time.perf_counter() - t0, n - start_batch, world)
