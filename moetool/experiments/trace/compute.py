"""Per-token routing dump: one row per (real token, MoE layer).

Columns: row (packed row index; global under data parallel), pos (position in the row), token_id, token, domain,
layer (decoder layer index), expert_k / weight_k (the k-th chosen expert, the model's ranked by selection score
largest first whatever order its router returned them in, a policy's as it returned them, and its weight), logit_e
(router logit of expert e, with ``logits=True``). Rows are layer-major within each batch.

:class:`TraceCollector` keeps the batch's chosen experts, weights (and logits) on the device and makes one host copy
per batch (the padding mask is read on the host: no device sync inside the forward). With a ``path`` the rows are
streamed to ``.csv.gz`` or ``.parquet`` (:class:`moetool.engine.stream.TableStream`, a background writer), so
memory stays flat in the number of tokens; without one, :func:`trace` returns them as a DataFrame.

Data parallel (``torchrun`` / ``accelerate launch``): each rank traces its rows of every global batch and sends
them to rank 0 after each batch (:func:`moetool.distributed.gather_to_main`); rank 0 merges the ranks' rows
layer-major (:func:`merge_ranks`) and alone writes, so the file equals one process's row for row (a rank with no
row in the last global batches still joins those gathers with nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import distributed
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward
from ...engine.stream import TableStream
from ...errors import MoetoolError
from ..result import Result, resolve_options
from .spec import TraceOptions  # noqa: F401 - its options (declared with their flags in spec.py)

FORMAT = ("one row per real (unpadded) token and MoE layer: row (packed row index), pos (position in row), "
          "token_id, token, domain, layer (decoder layer index), expert_k / weight_k (k-th chosen expert and its "
          "weight: the model's routing ranked by its selection score, largest first, whatever order its router "
          "returned them in; a policy's as the policy returned them, except that one keeping the model's experts "
          "(capacity) is ranked as the model's, with the weights that ran: 0 for a dropped assignment), logit_e "
          "(router logit of expert e, --logits). "
          "Encoder-decoder models (the row as source and target): token is the row's token at pos; the encoder "
          "reads it there, the decoder reads the token at pos-1 and predicts it")

#: trace.csv.gz's columns (the manifest's definitions; FORMAT says the same in one line)
DEFINITIONS = {
    "row": "packed row index of the token (--data's rows in order; global under data parallel)",
    "pos": "the token's position in its row, 0-based (padding positions have no row)",
    "token_id": "the token's id in the tokenizer's vocabulary",
    "token": "the token as the tokenizer spells it: tokenizer.convert_ids_to_tokens (e.g. 'Ġthe' for ' the'), not "
             "decoded text; read with keep_default_na=False",
    "domain": "the row's domain (the JSONL domain of --data; empty without one)",
    "layer": "index of the MoE layer in the model's layer numbering (the decoder layer index); rows are layer-major "
             "within each batch",
    "expert_<k>": "the k-th chosen expert (1 = first): the model's routing ranked by its selection score, largest "
                  "first, whatever order its router returned them in; a policy's as the policy returned them",
    "weight_<k>": "the routing weight of expert_k as it ran (0 for an assignment a capacity policy dropped)",
    "logit_<e>": "the router's logit of expert e (--logits): its raw score, before the routing rule's softmax or "
                 "sigmoid",
}


class TraceCollector:
    """Engine consumer: this batch's chosen experts/weights (and logits) per layer, kept on the device."""

    def __init__(self, logits: bool = False):
        self.logits = logits
        self.events: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __call__(self, ev: RoutingEvent) -> None:
        if ev.chosen_idx is ev.idx:  # the model's own set (router, capacity): ranked, with the weights that ran
            idx = ev.ranked[0]
            w = ev.ranked[1] if ev.chosen_weights is ev.weights else ev.in_rank_order(ev.chosen_weights)
        else:
            idx, w = ev.chosen_idx, ev.chosen_weights
        self.events.append((ev.layer.index, idx, w, ev.logits[..., :ev.layer.n_experts] if self.logits else None))

    def columns(self, batch: Any, row_ids: np.ndarray, tokenizer: Any) -> dict[str, Any]:
        """One batch's rows, layer-major; one host copy per tensor kind."""
        ev, self.events = self.events, []
        B, S = batch.input_ids.shape
        keep = np.flatnonzero(batch.attention_mask.reshape(-1).numpy() != 0)  # host mask: no device sync
        idx = torch.stack([e[1] for e in ev]).cpu().numpy()[:, keep]  # [L, t, K]
        w = torch.stack([e[2].float() for e in ev]).cpu().numpy()[:, keep]  # [L, t, K]
        L, t, K = idx.shape
        ids = batch.input_ids.reshape(-1).numpy()[keep]  # [t]
        rows = np.repeat(row_ids, S)[keep]
        cols: dict[str, Any] = {"row": np.tile(rows, L), "pos": np.tile(np.tile(np.arange(S), B)[keep], L),
                                "token_id": np.tile(ids, L)}
        if tokenizer is not None:
            cols["token"] = tokenizer.convert_ids_to_tokens(ids.tolist()) * L
        cols["domain"] = np.tile(np.asarray(batch.domains, dtype=object)[np.repeat(np.arange(B), S)[keep]], L)
        cols["layer"] = np.repeat(np.array([e[0] for e in ev]), t)
        for k in range(K):
            cols[f"expert_{k + 1}"] = idx[:, :, k].reshape(-1)
        for k in range(K):
            cols[f"weight_{k + 1}"] = w[:, :, k].reshape(-1)
        if self.logits:
            lg = torch.stack([e[3].float() for e in ev]).cpu().numpy()[:, keep]  # [L, t, n]
            for e in range(lg.shape[-1]):
                cols[f"logit_{e}"] = lg[:, :, e].reshape(-1)
        return cols


def merge_ranks(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One global batch's columns from the ranks' parts (rank order = global row order): layer-major like one
    process's batch (every layer's rows of rank 0, then rank 1, ...). ``None`` parts (no rows) are skipped."""
    parts = [p for p in parts if p]
    if len(parts) <= 1:
        return parts[0] if parts else None
    n_layers = len(np.unique(parts[0]["layer"]))
    key = np.concatenate([np.repeat(np.arange(n_layers), len(p["layer"]) // n_layers) for p in parts])
    order = np.argsort(key, kind="stable")  # by layer; within a layer ranks stay in order
    out: dict[str, Any] = {}
    for name, col in parts[0].items():
        if isinstance(col, list):
            merged = sum((p[name] for p in parts), [])
            out[name] = [merged[i] for i in order]
        else:
            out[name] = np.concatenate([p[name] for p in parts])[order]
    return out


class PartStream:
    """The trace streamed in parts under ``units/`` (``--resume``): the part being written is closed and recorded
    at each batch checkpoint (:meth:`~moetool.checkpoints.Units.due`, and after the last batch); a resumed run
    starts a new part at the next batch; :meth:`assemble` copies the parts' row groups (one per batch) in order
    into the final file, so it equals an uninterrupted run's row for row."""

    def __init__(self, units: Any, n_rows: int, batch_size: int):
        saved = units.load("batches") or {"next_batch": 0, "rows": 0, "parts": []}
        self.units, self.n_rows, self.batch_size = units, n_rows, batch_size
        self.next_batch, self.rows, self.parts = saved["next_batch"], saved["rows"], list(saved["parts"])
        self._out: Any = None

    def _name(self) -> str:
        return f"trace-{len(self.parts):05d}.parquet"

    def write(self, columns: dict[str, Any]) -> None:
        if self._out is None:
            self._out = TableStream(self.units.file(".part-" + self._name()))
        self._out.write(columns)

    def batch_done(self, rows: int) -> None:
        """After a batch's rows were written (``rows``: packed rows done so far; a batch backed off after an
        out-of-memory comes in parts: a checkpoint only at the end of a whole batch)."""
        import os

        if rows % self.batch_size and rows != self.n_rows:
            return
        self.next_batch = -(-rows // self.batch_size)
        if self._out is not None and (self.units.due() or rows == self.n_rows):
            self._out.close()
            self._out = None
            os.replace(self.units.file(".part-" + self._name()), self.units.file(self._name()))
            self.parts.append(self._name())
            self.units.save("batches", {"next_batch": self.next_batch, "rows": rows, "parts": self.parts})

    def abort(self) -> None:
        if self._out is not None:
            try:
                self._out.close()
            except Exception:  # noqa: BLE001 - the caller's error wins
                pass
            self.units.file(".part-" + self._name()).unlink(missing_ok=True)
            self._out = None

    def assemble(self, path: str | Path) -> int:
        """The parts into ``path``; returns its rows."""
        import pyarrow.parquet as pq

        with TableStream(path) as out:
            for name in self.parts:
                f = pq.ParquetFile(self.units.file(name))
                for g in range(f.num_row_groups):
                    t = f.read_row_group(g)
                    out.write({c: t.column(c) for c in t.column_names})
        return out.rows


def trace(lm: Any, tokens: Any, options: TraceOptions | None = None, *, path: str | Path | None = None,
          quiet: bool = False, units: Any = None, **overrides: Any) -> Result:
    """Per-token routing of every MoE layer (what ran: the ``routing`` policy's choice in ``layers``).

    Without ``path``: table ``trace`` (columns in the module docstring) in memory. With ``path``
    (``.csv.gz`` or ``.parquet``): streamed there batch by batch; the result then holds no table,
    ``meta["files"]`` names the file and ``meta["trace_rows"]`` counts its rows (the manifest's record of it).
    ``units`` (with ``path``, one process; ``--resume``): streamed in parts checkpointed now and then
    (:class:`PartStream`), a resumed run goes on from the next batch.
    """
    opts = resolve_options(TraceOptions, options, overrides)
    require_tokens(tokens)
    if path is None and getattr(getattr(units, "run", None), "resuming", None) is not None:
        raise MoetoolError("resume=True: a trace held in memory (no path) keeps no checkpoints to continue from; "
                           "`moetool trace --out RUN --resume` streams the trace to RUN and continues it")
    policy = opts.policy()
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    col = TraceCollector(opts.logits)
    meta = dict(format={"trace": FORMAT}, definitions=DEFINITIONS, data=tokens.describe(),
                routing=policy.describe())
    world = distributed.world_size()
    steps = distributed.n_steps(tokens.input_ids.shape[0], opts.batch_size, world)
    if world > 1 and getattr(tokens, "row_ids", None) is None:
        tokens = distributed.shard(tokens, opts.batch_size)
    row_ids = (tokens.row_ids.numpy() if getattr(tokens, "row_ids", None) is not None
               else np.arange(tokens.input_ids.shape[0]))
    start, sent = [0], [0]
    parts: list[dict[str, Any]] = []

    def send(sink: Any, cols: dict[str, Any] | None) -> None:
        if world > 1:  # every rank, every global batch: rank 0 gets the batch's rows of all ranks
            cols = merge_ranks(distributed.gather_to_main(cols) or [])
            sent[0] += 1
        if cols is not None and distributed.is_main():
            sink(cols)

    def emit(sink: Any, after: Any = None) -> Any:
        def on_batch(batch: Any, _out: Any) -> None:
            B = batch.input_ids.shape[0]
            send(sink, col.columns(batch, row_ids[start[0]:start[0] + B], lm.tokenizer))
            start[0] += B
            if after is not None:
                after(start[0])
        return on_batch

    def finish(sink: Any) -> None:
        while world > 1 and sent[0] < steps:  # this rank ran out of rows: join the remaining gathers
            send(sink, None)

    run = dict(policy=policy, layers=layers, consumers=[col], batch_size=opts.batch_size, description="trace",
               quiet=quiet)
    if path is not None and units is not None and world == 1:
        ps = PartStream(units, tokens.input_ids.shape[0], opts.batch_size)
        start[0] = ps.rows
        try:
            forward(lm, tokens, on_batch=emit(ps.write, ps.batch_done), start_batch=ps.next_batch, **run)
        finally:
            ps.abort()
        rows = ps.assemble(path)
        return Result("trace", {}, opts, meta={**meta, "files": {"trace": Path(path).name}, "trace_rows": rows})
    if path is not None:
        with TableStream(path) as out:
            forward(lm, tokens, on_batch=emit(out.write), **run)
            finish(out.write)
        rows = out.rows if distributed.is_main() else None  # (another rank's rows went to rank 0's file)
        return Result("trace", {}, opts, meta={**meta, "files": {"trace": Path(path).name}, "trace_rows": rows})
    forward(lm, tokens, on_batch=emit(parts.append), **run)
    finish(parts.append)
    import pandas as pd

    if not parts:  # a rank other than 0 under data parallel: rank 0 holds the table
        return Result("trace", {}, opts, meta=meta)

    df = pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True)
    return Result("trace", {"trace.csv.gz": df}, opts, meta=meta)
