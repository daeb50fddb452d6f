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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from .. import distributed
from ..data import TokenBatch
from ..errors import MoetoolError, MoetoolRuntimeError
from ..progress import progress
from .guard import FiniteGuard
from .hooks import Engine


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


#: fp32 logit elements one step of :func:`batch_nll` holds (x 4 bytes, twice: the fp32 copy and its log-softmax):
#: 128 MiB each; a batch's logits are never copied to fp32 whole (rows x positions x a 150k-250k vocabulary)
NLL_CHUNK_ELEMENTS = 1 << 25


def batch_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              per_row: bool = False, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token NLL and number of scored tokens for one batch (device tensors); ``per_row``: one sum and
    count per row (``[B]`` each; the bootstrap's per-document sums). ``shift=False`` (an encoder-decoder's
    :func:`seq2seq_inputs`): position ``t`` predicts ``input_ids[:, t]`` itself, every real position scored.

    Computed in fp32 over chunks of positions of at most :data:`NLL_CHUNK_ELEMENTS` logits (at least one
    position), summed in fp64: the same per-token values as one ``cross_entropy`` over the whole batch."""
    B, S, V = logits.shape
    d = int(shift)
    keep = attention_mask[:, d:].bool() & attention_mask[:, :S - d].bool()  # [B, S-d]
    sums = torch.zeros(B, dtype=torch.float64, device=logits.device)
    step = max(1, NLL_CHUNK_ELEMENTS // max(B * V, 1))
    for p0 in range(0, S - d, step):
        p1 = min(p0 + step, S - d)
        pred = logits[:, p0:p1].float()  # [B, p, V]: a bounded fp32 copy
        nll = F.cross_entropy(pred.reshape(-1, V), input_ids[:, p0 + d:p1 + d].reshape(-1), reduction="none")
        sums += (nll.view(B, p1 - p0) * keep[:, p0:p1]).sum(1, dtype=torch.float64)
        del pred, nll
    if per_row:
        return sums, keep.sum(1)
    return sums.sum(), keep.sum()


def is_seq2seq(model: Any) -> bool:
    """An encoder-decoder model (Switch Transformers): its forward takes the decoder's input too."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def seq2seq_inputs(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The decoder's side of an encoder-decoder forward over packed text rows: **the text as both source and target**.

    The encoder reads the row ``ids [B, S]``; the decoder is teacher-forced on the same row shifted right
    (``decoder_start_token_id`` at each row's first real position), so decoder position ``t`` reads token ``t-1``
    and predicts token ``t``; its mask is the row's. Both stacks' routing events have the row's shape and padding,
    so every analysis reads them like a causal LM's; the loss is the model's own seq2seq cross-entropy with
    ``labels = ids`` (padding ignored): :func:`batch_nll` with ``shift=False``.
    """
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(model.config, "pad_token_id", None) or 0
    dec = ids.roll(1, dims=1)
    first = (mask.cumsum(dim=1) == 1) & mask.bool()  # each row's first real position
    dec[:, 0] = start
    dec = dec.masked_fill(first, start)
    return {"decoder_input_ids": dec, "decoder_attention_mask": mask}


@dataclass
class Backoff:
    """``--batch-size auto``'s second half: on out-of-memory the runner halves the rows of the batch, retries the
    same rows and goes on at the smaller size (later :func:`forward` calls of the run start there)."""

    enabled: bool = False  # set by the CLI for --batch-size auto (one process; under torchrun an OOM stays fatal)
    rows: int | None = None  # rows per forward after the last back-off (None: never backed off)
    events: list[int] = field(default_factory=list)  # the row counts that ran out of memory


BACKOFF = Backoff()


def is_oom(e: BaseException) -> bool:
    """An allocator's out-of-memory: ``torch.OutOfMemoryError`` (CUDA, MPS) or the CPU allocator's RuntimeError."""
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and any(s in msg for s in ("out of memory", "not enough memory",
                                                                    "DefaultCPUAllocator: can't allocate"))


def _back_off(rows: int, seq_len: int) -> int:
    """Half of ``rows`` after an out-of-memory (one console line); 1 row that does not fit: one error line."""
    import gc
    import sys

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if rows <= 1:
        raise MoetoolRuntimeError(f"out of memory even with 1 row of {seq_len} tokens per forward: lower --seq-len, "
                                  "use --device-map auto or a smaller --dtype")
    new = rows // 2
    BACKOFF.rows = new
    BACKOFF.events.append(rows)
    if distributed.is_main():
        print(f"--batch-size auto: out of memory at {rows} rows per forward; going on with {new}", file=sys.stderr)
    return new


def _rng_snapshot(policy: Any) -> list[tuple[Any, Any]]:
    """The states of the random generators a policy holds (attributes, or dicts of them per device)."""
    snap: list[tuple[Any, Any]] = []
    for v in vars(policy).values() if policy is not None and hasattr(policy, "__dict__") else ():
        if isinstance(v, torch.Generator):
            snap.append((v, v.get_state()))
        elif isinstance(v, dict) and all(isinstance(g, torch.Generator) for g in v.values()):
            snap.append((v, {k: g.get_state() for k, g in v.items()}))
    return snap


def _rng_restore(snap: list[tuple[Any, Any]]) -> None:
    """Back to :func:`_rng_snapshot` (generators made since then are dropped: they start afresh later)."""
    for obj, st in snap:
        if isinstance(obj, torch.Generator):
            obj.set_state(st)
            continue
        for k in list(obj):
            if k in st:
                obj[k].set_state(st[k])
            else:
                del obj[k]


def _slice(b: Any, start: int, count: int) -> Any:
    return TokenBatch(b.input_ids[start:start + count], b.attention_mask[start:start + count],
                      b.domains[start:start + count])


def _rows(tokens: Any, start: int, count: int) -> str:
    """``rows a-b`` of the batch starting at local row ``start`` (global row numbers under data parallel)."""
    ids = getattr(tokens, "row_ids", None)
    rows = list(range(start, start + count)) if ids is None else [int(i) for i in ids[start:start + count]]
    if not rows:
        return ""
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return (f"rows {rows[0]}-{rows[-1]}" if len(rows) > 1 else f"row {rows[0]}") if contiguous else \
        "rows " + ",".join(map(str, rows))


def vocabulary(model: Any) -> int | None:
    """How many token ids ``model`` reads and predicts: the fewest of its input embedding rows, its LM head's
    outputs and a ``unpadded_vocab_size`` its forward slices the logits to (``None`` when it has none of them)."""
    sizes = []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        sizes.append(int(emb.num_embeddings))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "out_features"):
        sizes.append(int(head.out_features))
    for c in (model.config, getattr(model.config, "text_config", None)):
        if isinstance(getattr(c, "unpadded_vocab_size", None), int):
            sizes.append(c.unpadded_vocab_size)
    return min(sizes) if sizes else None


def check_token_ids(model: Any, tokens: Any) -> None:
    """A token id the model cannot read or predict (a tokenizer that does not match the model) is one
    error line, not an index error deep in the forward or a perplexity over clipped logits."""
    n = vocabulary(model)
    ids = tokens.input_ids  # padding too: every id goes through the embedding
    if n is None or not ids.numel():
        return
    top = int(ids.max())
    if top >= n or int(ids.min()) < 0:
        raise MoetoolError(f"token id {top if top >= n else int(ids.min())} of the data is outside the model's "
                           f"vocabulary of {n:,} ids: the tokenizer does not match the model")


def _sizing_trial(engine: Any, policy: Any, attempt: Callable[[], Any]) -> bool:
    """Run ``attempt`` (a batch's forward and NLL) once with the engine's consumers detached and the policy's random
    state restored after it: ``True`` when it fits, ``False`` on an out-of-memory (the caller backs off once the
    exception, and the tensors its frames hold, are gone); any other error propagates."""
    saved, rng = getattr(engine, "consumers", None), _rng_snapshot(policy)
    if saved is not None:
        engine.consumers = []
    try:
        attempt()
        return True
    except Exception as e:
        if not is_oom(e):
            raise
        return False
    finally:
        if saved is not None:
            engine.consumers = saved
        _rng_restore(rng)  # a random policy draws the same again after the trial


def forward(lm: Any, tokens: Any, *, policy: Any = None, layers: Iterable[int] | None = None,
            consumers: Iterable[Callable] = (), moe_layers: Iterable[Any] | None = None, batch_size: int = 8,
            before_batch: Callable[[Any], None] | None = None, on_batch: Callable[[Any, Any], None] | None = None,
            nll: bool = False, per_row_nll: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
            attention: bool = False, quiet: bool = False, description: str = "forward",
            start_batch: int = 0) -> ForwardResult:
    """Run ``lm`` (a loaded model: ``.model``, ``.layers``) over ``tokens`` (a ``TokenSet``) in batches.

    ``policy`` replaces routing in the MoE ``layers`` (decoder indices, ``None`` = every MoE layer; validated by
    :func:`moetool.engine.select_layers`); ``consumers`` see every routing event of the hooked ``moe_layers``
    (``MoELayer`` objects, default ``lm.layers``: an analysis restricted to some layers hooks only those). With
    no policy and no consumers (and ``attention=False``) no hook is installed at all: the unhooked reference a
    ``router`` run reproduces.
    ``before_batch(batch)`` runs before each forward (a consumer registering the batch's token ids),
    ``on_batch(batch, output)`` after it (logits consumers, per-batch checks). ``nll=True`` reduces the
    next-token NLL of the real tokens (padding never counts); ``per_row_nll(sums, counts)`` receives it per row
    of each batch (``[B]`` each; the bootstrap's per-document sums). ``start_batch``: batches before it are not run
    (``--resume``: the consumers' state up to there was restored); numbering (errors, progress) is unchanged.

    Under a distributed launch (:mod:`moetool.distributed`, ``WORLD_SIZE > 1``) each rank runs its shard of the
    rows (``distributed.shard``: its slice of every global batch) unless ``tokens`` is a shard already; the NLL
    is summed over ranks, and every consumer with a ``reduce_across_ranks()`` method is asked to all-reduce its
    accumulators at the end. Alone, none of this happens.

    ``--batch-size auto`` (:data:`BACKOFF` enabled, one process): an out-of-memory halves the rows and retries the
    same rows, each batch of ``batch_size`` rows then runs as consecutive sub-batches of the smaller size
    (numbering unchanged), so the result is the run an explicit smaller ``--batch-size`` gives when it divides
    ``batch_size``. The back-off covers the forward and the NLL of a batch (:func:`batch_nll`, in bounded fp32
    chunks), the allocations that grow with its rows. No consumer may see a batch twice: with consumers (or
    ``before_batch``) the first batch runs once without them (forward and NLL) to find the rows that fit; an
    out-of-memory after a consumer saw part of a batch is one error line naming the rows to use.
    """
    world = distributed.world_size()
    if world > 1 and getattr(tokens, "row_ids", None) is None:
        tokens = distributed.shard(tokens, batch_size)

    check_token_ids(lm.model, tokens)
    consumers = list(consumers)
    hooked = policy is not None or bool(consumers) or attention
    hooked_layers = list(lm.layers if moe_layers is None else moe_layers)
    engine = (Engine(lm.model, hooked_layers, policy=policy, policy_layers=layers, consumers=consumers,
                     attention=attention) if hooked else contextlib.nullcontext())
    model = lm.model
    s2s = is_seq2seq(model)
    device = model.device
    guard = FiniteGuard(lm.layers)  # NaN/inf in any MoE layer: one line naming layer and batch, never a number
    s = torch.zeros((), dtype=torch.float64, device=device)
    c = torch.zeros((), dtype=torch.long, device=device)
    n = start_batch
    t0 = time.perf_counter()
    backoff = BACKOFF.enabled and world == 1 and not distributed.parallel().active  # a model group shares rows
    rows = min(batch_size, BACKOFF.rows) if backoff and BACKOFF.rows else batch_size
    sized = not backoff or (not hooked and before_batch is None)  # a retry could not double-feed anyone

    row_ids = getattr(tokens, "row_ids", None)
    row_ids = torch.arange(tokens.input_ids.shape[0]) if row_ids is None else row_ids

    def run(b: Any, first: int) -> Any:
        ids, mask = b.input_ids.to(device), b.attention_mask.to(device)
        guard.mask = mask
        if hooked:  # events carry the batch's global packed-row ids (per-row seeded random choices)
            engine.rows = row_ids[first:first + ids.shape[0]].tolist()  # host ints, before the forward
        extra = seq2seq_inputs(model, ids, mask) if s2s else {}
        return model(input_ids=ids, attention_mask=mask, use_cache=False, **extra), ids, mask

    def events() -> int:
        return sum(getattr(engine, "reported", {}).values())

    want_nll = nll or per_row_nll is not None

    def run_nll(b: Any, first: int) -> tuple[Any, Any]:
        """The forward of ``b`` and its NLL (``None`` unless asked for): every large allocation of a batch."""
        out, ids, mask = run(b, first)
        if not want_nll:
            return out, None
        return out, batch_nll(out.logits, ids.to(out.logits.device), mask.to(out.logits.device), per_row=True,
                              shift=not s2s)

    with torch.no_grad(), engine, guard:
        batches = itertools.islice(tokens.batches(batch_size), start_batch, None)
        for b in progress(batches, total=tokens.n_batches(batch_size) - start_batch, description=description,
                          quiet=quiet):
            start, B = 0, b.input_ids.shape[0]
            while start < B:
                sub = b if start == 0 and rows >= B else _slice(b, start, rows)
                count = sub.input_ids.shape[0]
                if not sized:  # these rows once without consumers: find what fits before anyone sees a token
                    sized = _sizing_trial(engine, policy, lambda: run_nll(sub, n * batch_size + start))
                    if not sized:
                        rows = _back_off(count, b.input_ids.shape[1])
                        continue
                if before_batch is not None:
                    before_batch(sub)
                seen = events()
                out = nll_rows = None
                try:
                    out, nll_rows = run_nll(sub, n * batch_size + start)
                except Exception as e:
                    if not (backoff and is_oom(e)):
                        if BACKOFF.enabled and is_oom(e):  # torchrun: every rank must cut the same batches
                            raise MoetoolRuntimeError(
                                f"out of memory at {count} rows per process on {world} ranks (no back-off under "
                                f"torchrun): rerun with --batch-size {max(count // 2, 1)}") from None
                        raise
                    if events() != seen or before_batch is not None:
                        raise MoetoolRuntimeError(
                            f"out of memory at batch {n} ({_rows(tokens, n * batch_size + start, count)}) after the "
                            f"analysis saw part of it: rerun with --batch-size {max(count // 2, 1)}") from None
                if out is None:  # out of memory in the forward or the NLL: nothing of this try was kept
                    rows = _back_off(count, b.input_ids.shape[1])
                    continue
                guard.check(n, _rows(tokens, n * batch_size + start, count))
                if nll:
                    s += nll_rows[0].sum().to(device)
                    c += nll_rows[1].sum().to(device)
                if per_row_nll is not None:
                    per_row_nll(*nll_rows)
                if on_batch is not None:
                    on_batch(sub, out)
                start += count
            n += 1
    if world > 1:
        if nll:  # no collective otherwise: a caller's own per-batch collectives (k-means EMA) stay lined up
            s, c = distributed.all_reduce(s), distributed.all_reduce(c)
        for consumer in consumers:
            if hasattr(consumer, "reduce_across_ranks"):
                consumer.reduce_across_ranks()
    result = NLL(float(s), int(c))
    return ForwardResult(result, time.perf_counter() - t0, n - start_batch, world)
