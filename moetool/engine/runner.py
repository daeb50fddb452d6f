"""The one forward loop: run a model over batches of packed token rows, with or without routing hooks.

:func:`forward` is what every experiment calls: it installs an :class:`~moetool.engine.hooks.Engine` (a policy in
the chosen MoE layers, consumers seeing every routing event) only when there is something to hook (the
:class:`~moetool.engine.guard.FiniteGuard`'s read-only hooks are always on), runs every batch, and optionally
reduces the next-token NLL on the device (sums and token counts, read once at the end).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from .. import context, distributed
from ..context import Backoff, RunState
from ..data import TokenBatch, check_packed, check_tokenizer
from ..errors import MoetoolError, MoetoolRuntimeError, shown
from ..progress import progress
from ..sizing import check_seq_len, check_sizes
from .guard import FiniteGuard
from .hooks import Engine, hold


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
        """``exp(mean)``; a mean past ``log`` of float64's largest number (709.78 nats: logits no trained model
        gives) stops in one line instead of an ``OverflowError`` or an infinite perplexity."""
        if not self.tokens:
            return float("nan")
        if self.mean > MAX_LOG:
            raise MoetoolRuntimeError(f"mean next-token NLL {self.mean:.4g} nats over {self.tokens} tokens: its "
                                      f"perplexity exp(NLL) is past float64's largest number (1.8e308); the model's "
                                      f"output logits are far outside a trained model's: results would be meaningless")
        return math.exp(self.mean)


#: log of float64's largest number: the largest mean NLL whose perplexity is a number
MAX_LOG = math.log(1.7976931348623157e308)


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


#: fp32 logit elements one step of :func:`batch_nll` holds (x 4 bytes: its log-softmax): 128 MiB; a batch's logits
#: are never copied to fp32 whole (rows x positions x a 150k-250k vocabulary)
NLL_CHUNK_ELEMENTS = 1 << 25


def batch_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              per_row: bool = False, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token NLL and number of scored tokens for one batch (device tensors); ``per_row``: one sum and
    count per row (``[B]`` each; the bootstrap's per-document sums). ``shift=False`` (an encoder-decoder's
    :func:`seq2seq_inputs`): position ``t`` predicts ``input_ids[:, t]`` itself, every real position scored.

    Computed in fp32 over chunks of the ``B x S`` positions taken in memory order (contiguous slices of the logits:
    no copy of them first; rows apart in memory: a row at a time), at most :data:`NLL_CHUNK_ELEMENTS` logits a
    chunk (at least one position), summed in fp64: the same per-token values as one ``cross_entropy`` over the
    whole batch. With ``shift`` each row's last position has no target: it is computed against a stand-in target
    and never scored (its value, even a NaN, never reaches the sums)."""
    B, S, V = logits.shape
    d = int(shift)
    keep = attention_mask[:, d:].bool() & attention_mask[:, :S - d].bool()  # [B, S-d]
    target = input_ids[:, d:]
    if d:  # position S-1 of each row: not scored (a stand-in target in range)
        keep = torch.cat([keep, keep.new_zeros(B, d)], dim=1)
        target = torch.cat([target, input_ids[:, :d]], dim=1)
    nll = torch.empty(B, S, dtype=torch.float32, device=logits.device)
    if B == 1 or logits.stride(0) == S * logits.stride(1):  # the B x S positions as one axis: a view
        parts = [(logits.flatten(0, 1), target.reshape(B * S, 1), nll.view(B * S))]
    else:  # rows apart in memory: each row's positions in turn (never a copy of the whole logits)
        parts = [(logits[b], target[b].unsqueeze(-1), nll[b]) for b in range(B)]
    step = max(1, NLL_CHUNK_ELEMENTS // max(V, 1))
    for x, t, out in parts:
        for r0 in range(0, x.shape[0], step):
            r1 = min(r0 + step, x.shape[0])
            # fp32 log-probabilities read in the logits' own dtype, -log p of the target as cross_entropy's: one
            # [rows, V] fp32 buffer a chunk (no copy of the chunk where its rows are contiguous)
            logp = F.log_softmax(x[r0:r1], dim=-1, dtype=torch.float32)
            torch.neg(logp.gather(-1, t[r0:r1]).squeeze(-1), out=out[r0:r1])
            del logp
    sums = torch.where(keep, nll, 0.0).sum(1, dtype=torch.float64)
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


def is_oom(e: BaseException) -> bool:
    """An allocator's out-of-memory: ``torch.OutOfMemoryError`` (CUDA, MPS) or the CPU allocator's RuntimeError."""
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and any(s in msg for s in ("out of memory", "not enough memory",
                                                                    "DefaultCPUAllocator: can't allocate"))


def free_memory() -> None:
    """What an out-of-memory (or a dropped model: call with no reference to it left) left behind, collected, and the
    CUDA cache emptied."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _no_row_fits(seq_len: int) -> MoetoolRuntimeError:
    return MoetoolRuntimeError(f"out of memory even with 1 row of {seq_len} tokens per forward: lower --seq-len, "
                               f"use --device-map auto or {context.dtype_choice()}")


def _back_off(backoff: Backoff, rows: int, seq_len: int) -> int:
    """Half of ``rows`` after an out-of-memory, kept in the run's ``backoff`` (one console line); 1 row that does
    not fit: one error line."""
    import sys

    free_memory()
    if rows <= 1:
        raise _no_row_fits(seq_len)
    new = backoff.backed_off(rows)
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
    sizes = _vocab_sizes(model)
    return min(sizes) if sizes else None


def id_space(model: Any) -> int | None:
    """A bound on every token id ``model`` reads or predicts (an input id, the argmax of its logits): the most of
    the sizes :func:`vocabulary` takes the fewest of and the config's ``vocab_size`` (``None`` when it has none of
    them)."""
    sizes = _vocab_sizes(model) + [c.vocab_size for c in (model.config, getattr(model.config, "text_config", None))
                                   if isinstance(getattr(c, "vocab_size", None), int)]
    return max(sizes) if sizes else None


def _vocab_sizes(model: Any) -> list[int]:
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
    return sizes


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


def check_weights(model: Any) -> None:
    """Weights that hold numbers, or one line: a model whose parameters are on the meta device (built empty,
    ``model.to("meta")``) has shapes only, and every forward or weight statistic of it would be a traceback from
    inside torch. Weights accelerate keeps offloaded (``device_map`` with CPU/disk offload: on the meta device until
    its hooks load them) are loaded weights."""
    if getattr(model, "hf_device_map", None) is not None:
        return
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise MoetoolError(f"the model's weights are on the meta device ({meta}, ...): shapes without numbers; "
                           "load it with moetool.load(...) (device cpu or cuda)")


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """``model`` in eval mode for the block, each module's own mode back after it: a model left in training mode
    (``lm.model.train()`` after a fine-tuning step) would otherwise run its dropout and router jitter (Mixtral's
    ``jitter_noise``, PhiMoE's sampling) inside moetool's forwards, and every table would be one random draw of
    them, a different number on each call."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


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


class _Step:
    """One forward of packed rows on the model's device and their per-row NLL when asked for: every allocation
    that grows with the rows (what the back-off retries). An encoder-decoder gets the decoder's side
    (:func:`seq2seq_inputs`) and is scored unshifted."""

    def __init__(self, model: Any, engine: Engine | None, guard: FiniteGuard, tokens: Any, want_nll: bool):
        self.model, self.engine, self.guard, self.want_nll = model, engine, guard, want_nll
        self.s2s, self.device = is_seq2seq(model), model.device
        row_ids = getattr(tokens, "row_ids", None)
        self.row_ids = torch.arange(tokens.input_ids.shape[0], device="cpu") if row_ids is None else row_ids

    def __call__(self, b: Any, first: int) -> tuple[Any, tuple[torch.Tensor, torch.Tensor] | None]:
        """The output for the rows ``b`` (the first is local row ``first``) and their NLL ``(sums, counts)`` per row
        (``None`` unless asked for)."""
        ids, mask = b.input_ids.to(self.device), b.attention_mask.to(self.device)
        self.guard.mask = mask
        if self.engine is not None:  # events carry the batch's global packed-row ids (per-row seeded random choices)
            self.engine.rows = self.row_ids[first:first + ids.shape[0]].tolist()  # host ints, before the forward
        extra = seq2seq_inputs(self.model, ids, mask) if self.s2s else {}
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        if not self.want_nll:
            return out, None
        dev = out.logits.device
        return out, batch_nll(out.logits, ids.to(dev), mask.to(dev), per_row=True, shift=not self.s2s)


class _RowsThatFit:
    """The rows of a batch one forward runs: all of them, or under ``--batch-size auto`` (the run's ``backoff``
    enabled, one process) the rows that fit.

    :meth:`run` runs a batch as consecutive sub-batches of :attr:`rows` rows (the whole batch unless the run backed
    off). An out-of-memory in a sub-batch's :class:`_Step` halves :attr:`rows` (:func:`_back_off` remembers them for
    the run's later calls) and retries the same rows. No consumer may see rows twice: with an engine or ``before_batch``
    the first rows run once without them (:func:`_sizing_trial`) until they fit, and an out-of-memory after a
    consumer saw part of a batch is one error line naming the rows to use (:meth:`_rerun`: or, when the analysis
    itself ran out, what makes room for it)."""

    def __init__(self, step: _Step, batch_size: int, *, engine: Engine | None, policy: Any,
                 before_batch: Callable[[Any], None] | None, tokens: Any, world: int, run: RunState):
        self.step, self.engine, self.policy, self.before_batch = step, engine, policy, before_batch
        self.tokens, self.world, self.backoff = tokens, world, run.backoff
        self.layout, self.batch_size = run.layout, batch_size
        self.auto = self.backoff.enabled and world == 1 and not run.layout.active  # a model group shares rows
        self.rows = min(batch_size, self.backoff.rows) if self.auto and self.backoff.rows else batch_size
        self.sized = not self.auto or (engine is None and before_batch is None)  # a retry could not double-feed anyone

    def run(self, b: Any, n: int, first: int) -> Iterator[tuple[int, Any, Any, Any]]:
        """Batch ``n`` (its first row is local row ``first``): ``(first row, sub-batch, output, per-row NLL)`` of each
        sub-batch once it ran, ``before_batch`` called before its forward."""
        start, B, seq_len = 0, b.input_ids.shape[0], b.input_ids.shape[1]
        while start < B:
            sub = b if start == 0 and self.rows >= B else _slice(b, start, self.rows)
            count, at = sub.input_ids.shape[0], first + start
            if not self.sized:  # these rows once without consumers: find what fits before anyone sees a token
                self.sized = _sizing_trial(self.engine, self.policy, lambda: self.step(sub, at))
                if not self.sized:
                    self.rows = _back_off(self.backoff, count, seq_len)
                    continue
            if self.before_batch is not None:
                self.before_batch(sub)
            ran = self._attempt(sub, n, at)
            if ran is None:  # out of memory in the forward or the NLL: nothing of this try was kept
                self.rows = _back_off(self.backoff, count, seq_len)
                continue
            yield (at, sub, *ran)
            del ran  # this output goes before the next forward
            start += count

    def _attempt(self, sub: Any, n: int, at: int) -> tuple[Any, Any] | None:
        """``step(sub)``, or ``None`` after an out-of-memory the back-off may retry (the exception, and the tensors
        its frames held, are gone by then); any other error propagates, an out-of-memory that may not be retried as
        one line naming the rows to use."""
        seen = self._events()
        if self.engine is not None:
            self.engine.consumer_raised = False
        try:
            return self.step(sub, at)
        except Exception as e:
            if not is_oom(e):
                raise
            if not self.auto and not self.backoff.enabled:  # an explicit --batch-size: the allocator's error as it is
                raise
        count = sub.input_ids.shape[0]  # out of the except block: the exception's frames are gone
        if not self.auto:  # torchrun: every rank must cut the same batches
            raise MoetoolRuntimeError(f"out of memory at {count} rows per {self._per()} (no back-off under torchrun): "
                                      f"{self._rerun(sub, n, at)}")
        if self._events() != seen or self.before_batch is not None:
            raise MoetoolRuntimeError(
                f"out of memory at batch {n} ({_rows(self.tokens, at, count)}) after the analysis saw part of "
                f"it: {self._rerun(sub, n, at)}")
        return None

    def _per(self) -> str:
        """What ``--batch-size`` counts the rows of under this launch: a process's, or (``--tp``/``--ep``) a model
        group's, whose ranks all run its rows."""
        if not self.layout.active:
            return f"process on {self.world} ranks"
        flags = f"--tp {self.layout.tp}" + (f" --ep {self.layout.ep}" if self.layout.ep > 1 else "")
        return (f"model group ({self.layout.group} ranks run each row: {flags}) on {self.world} data-parallel "
                f"group{'s' * (self.world != 1)}")

    def _rerun(self, sub: Any, n: int, at: int) -> str:
        """What a refusal after ``sub`` (batch ``n``, first local row ``at``) ran out of memory tells to rerun with.

        When a consumer (the analysis) raised the out-of-memory, the rows' forward and NLL run once without it
        first: when they fit, the analysis is what needs the memory, and no --batch-size is suggested
        (:meth:`_analysis_ran_out`); otherwise (or when the model's forward or the NLL raised it) the --batch-size of
        :meth:`_fitting`. A model group's ranks meet here first (:func:`moetool.distributed.model_group_all`), so no
        trial of theirs pairs with a forward one is still in, and agree whether the analysis raised it."""
        # every rank of the model group met here (alone: nothing); it was the model's on all of them, or the analysis'
        model = distributed.model_group_all(not getattr(self.engine, "consumer_raised", False))
        count, seq_len = sub.input_ids.shape[0], sub.input_ids.shape[1]
        if not model and self._fits(sub, count, at):
            return self._analysis_ran_out(n, count, seq_len)
        return f"rerun with --batch-size {self._fitting(sub, at)}"

    def _fits(self, sub: Any, rows: int, at: int) -> bool:
        """A sizing trial (:func:`_sizing_trial`) of the first ``rows`` rows of ``sub`` fit (under a model group: on
        every rank of it, which all ran the same trial)."""
        free_memory()
        fits = _sizing_trial(self.engine, self.policy, lambda: self.step(_slice(sub, 0, rows), at))
        return distributed.model_group_all(fits)

    def _fitting(self, sub: Any, at: int) -> int:
        """The rows a rerun's ``--batch-size`` may take after ``sub`` ran out of memory where the back-off may not
        retry it: the first of its halves whose forward and NLL fit (:meth:`_fits`, nothing fed to the consumers;
        the run ends after it), as the back-off would have found them; one line when 1 row does not fit. A model
        group (``--tp``/``--ep``) runs collectives in its forward, which no rank runs alone: every rank of the group
        runs the same trials (its rows are theirs), and a size fits when it fit on all of them."""
        count, seq_len = sub.input_ids.shape[0], sub.input_ids.shape[1]
        rows = count
        while rows > 1:
            rows //= 2  # as Backoff.backed_off
            if self._fits(sub, rows, at):
                return rows
        free_memory()
        raise _no_row_fits(seq_len)

    def _analysis_ran_out(self, n: int, count: int, seq_len: int) -> str:
        """The refusal's advice when the analysis (a consumer) ran out of memory and the forward and NLL of its
        ``count`` rows fit without it: the analysis needs the memory, and a smaller --batch-size cannot be checked
        (no trial may feed it rows twice). After batches it got through at this size (its work per batch fit them),
        what it holds grew with the tokens it analysed, which fewer rows per forward do not shrink: the tokens of
        those batches, a run it got through (``--max-tokens`` packs the same first rows). On its first batch: its
        work on one batch does not fit beside the forward; fewer rows give it less, unchecked."""
        head = f"the forward and NLL alone fit these {count} rows, so the analysis ran out of memory"
        if n == 0:
            return (f"{head} on its first batch: rerun with a --batch-size below {count} (unchecked: no trial runs the "
                    f"analysis without feeding it rows twice)")
        done = n * self.batch_size * self.world  # rows of the global batches before this one
        return (f"{head}: its work per batch fit them in the {n} batch{'es' * (n > 1)} before, what grew is what it "
                f"holds of the {done} rows it analysed, which a smaller --batch-size does not shrink: rerun with "
                f"--max-tokens {done * seq_len} (those {done} rows of {seq_len} tokens)")

    def _events(self) -> int:
        """Routing events reported so far (a consumer saw rows once this grew)."""
        return sum(getattr(self.engine, "reported", {}).values())


def _batches(tokens: Any, batch_size: int, start_batch: int, description: str, quiet: bool) -> Iterable[Any]:
    """The batches from ``start_batch`` on under a progress bar (``--resume``: the earlier ones are skipped)."""
    return progress(itertools.islice(tokens.batches(batch_size), start_batch, None),
                    total=tokens.n_batches(batch_size) - start_batch, description=description, quiet=quiet)


def _consumer_list(consumers: Any) -> list[Callable]:
    """``consumers`` as a list, each one callable: one line for a lone function or a non-list (``consumers=print``:
    a TypeError from ``list()`` before), naming what to pass."""
    if callable(consumers) or isinstance(consumers, (str, bytes)) or not isinstance(consumers, Iterable):
        raise MoetoolError(f"consumers is a list of callables (consumers=[c]), not {shown(consumers)}")
    out = list(consumers)
    for c in out:
        if not callable(c):
            raise MoetoolError(f"each of consumers is called with every routing event; {shown(c)} is not callable")
    return out


def forward(lm: Any, tokens: Any, *, policy: Any = None, layers: Iterable[int] | None = None,
            consumers: Iterable[Callable] = (), moe_layers: Iterable[Any] | None = None, batch_size: int = 8,
            before_batch: Callable[[Any], None] | None = None, on_batch: Callable[[Any, Any], None] | None = None,
            nll: bool = False, per_row_nll: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
            attention: bool = False, quiet: bool = False, description: str = "forward",
            start_batch: int = 0, run: RunState | None = None) -> ForwardResult:
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

    The model runs in eval mode (:func:`eval_mode`: no dropout or router jitter), each module's mode restored after.

    ``run`` (a :class:`moetool.context.RunState`, e.g. :class:`moetool.run.Run`; default: the run of this context,
    :func:`moetool.context.current`, else none) carries the ``--batch-size auto`` back-off state across the run's
    forwards. With its ``backoff`` enabled (one process): an out-of-memory halves the rows and retries the
    same rows, each batch of ``batch_size`` rows then runs as consecutive sub-batches of the smaller size
    (numbering unchanged), so the result is the run an explicit smaller ``--batch-size`` gives when it divides
    ``batch_size``. The back-off covers the forward and the NLL of a batch (:func:`batch_nll`, in bounded fp32
    chunks), the allocations that grow with its rows. No consumer may see a batch twice: with consumers (or
    ``before_batch``) the first batch runs once without them (forward and NLL) to find the rows that fit; an
    out-of-memory after a consumer saw part of a batch is one error line naming the rows to use (or, when a
    consumer ran out and the rows' forward fits without it, the tokens the analysis got through).
    """
    check_sizes(batch_size=batch_size)  # as --batch-size: no ZeroDivisionError in the batching
    check_packed(tokens)  # ids, mask, domains of one set of rows (a TokenSet sliced by hand: one line)
    check_weights(lm.model)  # a model on the meta device: one line, not a traceback from inside torch
    check_seq_len(lm.model.config, int(tokens.input_ids.shape[1]))  # rows the positions never covered: refused
    world = distributed.world_size()
    if world > 1 and getattr(tokens, "row_ids", None) is None:  # this rank's slice of every global batch
        tokens = distributed.shard(tokens, batch_size)
    check_token_ids(lm.model, tokens)
    check_tokenizer(tokens, getattr(lm, "tokenizer", None))  # ids of another model's vocabulary: one line
    consumers = _consumer_list(consumers)
    engine = None  # nothing to hook: no hook at all (the unhooked reference)
    if policy is not None or consumers or attention:
        engine = Engine(lm.model, list(lm.layers if moe_layers is None else moe_layers), policy=policy,
                        policy_layers=layers, consumers=consumers, attention=attention)
    # NaN/inf in any MoE layer: one line naming layer, model and batch (and fp16/bf16), never a number
    guard = FiniteGuard(lm.layers, getattr(lm, "name", None))
    step = _Step(lm.model, engine, guard, tokens, want_nll=nll or per_row_nll is not None)
    fit = _RowsThatFit(step, batch_size, engine=engine, policy=policy, before_batch=before_batch, tokens=tokens,
                       world=world, run=context.state(run))
    nll_sum = torch.zeros((), dtype=torch.float64, device=step.device)
    nll_count = torch.zeros((), dtype=torch.long, device=step.device)
    n = start_batch
    t0 = time.perf_counter()
    with hold(lm.model, "a moetool.forward loop"), torch.no_grad(), eval_mode(lm.model), \
            contextlib.nullcontext() if engine is None else engine, guard:
        for b in _batches(tokens, batch_size, start_batch, description, quiet):
            for at, sub, out, nll_rows in fit.run(b, n, n * batch_size):
                if nll_rows is not None:  # the output logits (after the last MoE layer): in the same host read
                    guard.output(nll_rows[0], out.logits.dtype)
                guard.check(n, _rows(tokens, at, sub.input_ids.shape[0]))
                if nll:
                    nll_sum += nll_rows[0].sum().to(step.device)
                    nll_count += nll_rows[1].sum().to(step.device)
                if per_row_nll is not None:
                    per_row_nll(*nll_rows)
                if on_batch is not None:
                    on_batch(sub, out)
                del out, nll_rows  # this output goes before the next forward
            n += 1
    if world > 1:
        if nll:  # no collective otherwise: a caller's own per-batch collectives (k-means EMA) stay lined up
            nll_sum, nll_count = distributed.all_reduce(nll_sum), distributed.all_reduce(nll_count)
        for consumer in consumers:
            if hasattr(consumer, "reduce_across_ranks"):
                consumer.reduce_across_ranks()
    return ForwardResult(NLL(float(nll_sum), int(nll_count)), time.perf_counter() - t0, n - start_batch, world)
