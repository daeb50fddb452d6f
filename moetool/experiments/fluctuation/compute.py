"""``fluctuation``: how routing changes between checkpoints (Graph of Tokens Fig. 3).

The same token ids go through every checkpoint (one loaded at a time). Per checkpoint, routing (a policy spec as
everywhere: ``router`` = the model's own top-K; ``similarity`` / ``attention``: that training-free policy applied
in every chosen MoE layer of the checkpoint, so its choice is what runs) and chosen MoE layer (``layers``, as
``--layers`` everywhere: the layers measured and the layers a policy replaces routing in; the others run the
model's own router and are not measured), the chosen sets and
the top-1 expert (the routing decision, :func:`moetool.ops.top1`: the chosen expert ranked first by the scores the
routing selected on -- the router's selection scores, a correction bias included, before any per-expert scale of
the weights; a policy's own scores; random's and norm's own order --, not the largest weight) stay on the device
during the forward
(padding weighted out, no host sync), are copied to the host once per batch (all layers stacked, indices as
int16/int32) and spilled to a temporary file (:class:`moetool.sketch.TokenSpill`), so host memory holds one
batch, not the run; the entropy is an exact device-side sum (:class:`moetool.sketch.Moments`). Comparisons read
two spills back batch by batch (the same tokens in the same order) and keep per-row sums only (one row of
numbers per packed row): that is what the document-level bootstrap (``*_lo``/``*_hi``) resamples. Entropy: of ``π`` for ``router``; of the policy's normalised
score distribution ``s_i`` for ``similarity`` / ``attention``; of the pruned router's π (a softmax over the kept
experts) for ``prune:``; of the model's ``π`` for any other policy (the distribution they rank or keep experts by;
``norm:`` and ``random`` choose by none of it).

For each pair (reference, checkpoint) — ``reference`` ``previous`` (i-1, i), ``first`` (0, i) or ``last``
(last, i) — and layer: ``top1_change`` (fraction of real tokens whose top-1 differs), ``topk_change``
(chosen sets differ; a set is the experts with a nonzero weight, so top-p's unchosen and capacity's dropped
columns are none of it), ``topk_overlap`` (mean ``|A ∩ B| / |A|``: ``/ K`` for a fixed top-K), ``jaccard`` (mean
``|A ∩ B| / |A ∪ B|``),
``entropy_ref`` / ``entropy_ckpt`` (mean entropy in nats) and ``entropy_ratio`` (ckpt / ref).

``isolate``: while the reference runs, its own MoE inputs ``h`` (and, for ``attention``, its attention
probabilities) are also fed to a copy of the other checkpoint's routers and the same routing is
applied; the reference's choice is compared with that. Rows ``<routing>-isolated``: only the router
weights differ, so they measure router drift; the plain rows add the drift of the hidden states.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ... import distributed, ops
from ...adapters import _MOE_CONFIG_KEYS
from ...adapters.base import MoELayer
from ...configs import text_config
from ...data import check_tokenizer, require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...loading import load, load_config, load_tokenizer
from ...sketch import Moments, TokenSpill
from ...uncertainty import Interval, RowSums, bootstrap_meta, format_ci, ratio_intervals
from ..result import Result, resolve_options
from .spec import REFERENCES, ROUTINGS, FluctuationOptions  # noqa: F401 - its options (declared with their flags in spec.py)

RATES = ("top1_change", "topk_change", "topk_overlap", "jaccard")  # per-token means, with bootstrap intervals
COLUMNS = ["layer", "routing", "reference", "checkpoint", "tokens",
           *(c for r in RATES for c in (r, f"{r}_lo", f"{r}_hi")), "entropy_ref", "entropy_ckpt", "entropy_ratio"]
#: the headline table: mean over layers per pair and routing, and its paired difference from the router's
SUMMARY_COLUMNS = ["routing", "reference", "checkpoint", "tokens", "layers", "top1_change", "top1_change_lo",
                   "top1_change_hi", "reduction_vs_router", "reduction_vs_router_lo", "reduction_vs_router_hi"]


def pairs(names: Sequence[str], reference: str) -> list[tuple[int, int]]:
    """``(reference index, checkpoint index)`` pairs."""
    n = len(names)
    if n < 2:
        raise MoetoolError("fluctuation needs at least two checkpoints")
    if reference == "previous":
        return [(i - 1, i) for i in range(1, n)]
    if reference == "first":
        return [(0, i) for i in range(1, n)]
    return [(n - 1, i) for i in range(n - 1)]


# ----- compatibility -------------------------------------------------------------------------
def architecture(config: Any) -> dict[str, Any]:
    """What must agree between checkpoints, read from a config (the language model's, for a multimodal one): the
    width too, since ``isolate`` feeds one checkpoint's MoE inputs to another's routers."""
    text = text_config(config)
    keys = ("num_hidden_layers", "hidden_size", "vocab_size", *_MOE_CONFIG_KEYS)
    return {"model_type": config.model_type, **{k: getattr(text, k, getattr(config, k, None)) for k in keys}}


def check_same(what: str, names: Sequence[str], values: Sequence[dict[str, Any]]) -> None:
    """One-line error naming the first field where a checkpoint differs from the first."""
    for name, v in zip(names[1:], values[1:]):
        for k in values[0]:
            if v.get(k) != values[0].get(k):
                raise MoetoolError(f"checkpoints differ in {what}: {names[0]} has {k}={values[0].get(k)}, "
                                   f"{name} has {k}={v.get(k)}")


def layer_signature(lm: Any) -> dict[str, Any]:
    """What a loaded checkpoint must share with the others: its MoE layers and its width."""
    return {"moe layers (index, n experts, K)": [(L.index, L.n_experts, L.top_k) for L in lm.layers],
            "hidden_size": getattr(text_config(lm.config), "hidden_size", None)}


def router_copy(layer: MoELayer) -> MoELayer:
    """The same layer class around a copy of the router only (no experts): ``logits``/``probs``/``route`` work."""
    out = copy.copy(layer)
    out.router = copy.deepcopy(layer.router)
    out.decoder_layer = out.block = out.experts = None
    return out


# ----- capture -------------------------------------------------------------------------------
def chosen_and_top1(idx: torch.Tensor, w: torch.Tensor, ranking: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, K + 1]``: the chosen set (``idx [T, K]``, a column at weight 0 as -1: no expert) and the top-1
    (:func:`moetool.ops.top1`: the chosen expert ranked first by ``ranking [T, n]``, the scores the set was selected
    on; None: the first chosen column, a set in its own ranking's order; -1 where every weight is 0, a token that
    lost all its experts). The weights mark what was chosen, never the order."""
    chosen = w != 0
    top1 = ops.top1(idx, ranking, chosen).unsqueeze(-1).masked_fill(~chosen.any(-1, keepdim=True), -1)
    return torch.cat([idx.masked_fill(~chosen, -1), top1], 1)


class Routing:
    """One checkpoint's routing under one policy, every MoE layer, over all real tokens.

    Inside the forward (:meth:`add`, per layer) everything stays on the device; :meth:`flush` (after each batch,
    outside the forward) makes the batch's one host copy ``[layers, N, K + 1]`` (chosen set, top-1; real tokens
    only) and spills it with the tokens' packed-row ids, so host memory is one batch whatever the run's length."""

    def __init__(self, layers: Sequence[int], row_ids: Any = None):
        self.layers = list(layers)
        self.entropy = {li: Moments() for li in self.layers}
        self.spill = TokenSpill()
        self.tokens = 0
        self._row_ids = row_ids  # global packed-row numbers (data parallel shard) or None: 0, 1, 2, ...
        self._rows_done = 0
        self._batch: dict[int, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None

    def add(self, layer: int, idx: torch.Tensor, w: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor,
            ranking: torch.Tensor | None) -> None:
        """Chosen ``idx [T, K]`` / weights ``w [T, K]``, the distribution ``scores [T, n]`` (its entropy) and
        ``valid [T]``. The chosen set is the experts with a nonzero weight: a column a policy leaves at weight 0
        (top-p's unchosen, capacity's dropped) is kept as -1, no expert (:func:`moetool.ops.set_size`). The top-1 is
        the chosen expert ranked first by ``ranking [T, n]`` (the scores the set was selected on, :func:`routing_of`);
        None: the first chosen column (a policy's own order, best first: random, norm)."""
        small = torch.int16 if scores.shape[-1] < 2 ** 15 else torch.int32
        self._batch[layer] = chosen_and_top1(idx, w, ranking).to(small)  # [T, K + 1]
        self._valid = valid
        ent = ops.entropy(scores).double()
        self.entropy[layer].add(torch.where(valid, ent, 0.0), valid)

    def flush(self, batch_rows: int) -> None:
        """The batch's host copy (one per batch, after the forward) -> the spill."""
        if not self._batch:
            return
        host = torch.stack([self._batch[li] for li in self.layers]).cpu()  # [L, T, K + 1]
        valid = self._valid.cpu()
        S = valid.shape[0] // batch_rows
        start = self._rows_done
        rows = (torch.arange(start, start + batch_rows, device="cpu") if self._row_ids is None
                else torch.as_tensor(self._row_ids[start:start + batch_rows]).long())
        self._rows_done += batch_rows
        self.spill.append(host[:, valid])  # [L, N, K + 1]
        self.spill.append(rows.repeat_interleave(S)[valid].int())  # [N] packed-row id of each token
        self.tokens += int(valid.sum())
        self._batch, self._valid = {}, None

    def batches(self) -> Any:
        """``(routing [L, N, K + 1] int64, rows [N] int64)`` per batch, in the order they ran."""
        it = iter(self.spill)
        for r in it:
            yield r.long(), next(it).long()

    def entropy_mean(self, layer: int) -> float:
        return self.entropy[layer].mean

    def checkpoint(self, path: Path) -> dict[str, Any]:
        """The finished routing as a picklable state, its spill copied to ``path`` (``--resume``)."""
        return {"layers": self.layers, "entropy": {li: m.state() for li, m in self.entropy.items()},
                "tokens": self.tokens, "row_ids": self._row_ids, "rows_done": self._rows_done,
                "spill": self.spill.save(path)}

    @classmethod
    def restore(cls, state: dict[str, Any], path: Path) -> "Routing":
        """The routing :meth:`checkpoint` saved (its spill read back from ``path``)."""
        out = cls(state["layers"], state["row_ids"])
        for li, m in state["entropy"].items():
            out.entropy[li].load_state(m)
        out.tokens, out._rows_done = state["tokens"], state["rows_done"]
        out.spill.close()
        out.spill = TokenSpill.restore(path, state["spill"])
        return out

    def reduce_across_ranks(self) -> None:
        """Entropy sums over ranks (the spilled routing is compared per rank, then its per-row sums merge)."""
        for m in self.entropy.values():
            distributed.all_reduce_state(m)


def routing_of(ev: RoutingEvent, policy: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor | None]:
    """``(chosen idx, chosen weights, distribution, valid, ranking)`` of an event (every position), after any
    ``policy``: the distribution is π or the policy's scores (the entropy's); the ranking is what the top-1 is read
    by (:func:`moetool.ops.top1`): the router's selection scores for the model's own routing, else the policy's
    (:meth:`moetool.policies.base.Policy.ranking`; None: random's and norm's own column order)."""
    scores = ev.scores if ev.scores is not None else ev.probs  # [T, n]
    ranking = ev.layer.selection_scores(ev.logits) if policy is None else policy.ranking(ev)
    return ev.chosen_idx, ev.chosen_weights, scores, ev.valid, ranking


def isolated_event(ev: RoutingEvent, other: MoELayer, policy: Any) -> RoutingEvent:
    """``ev``'s router inputs (and attention) through ``other``'s router, then ``policy`` (None: its top-K)."""
    dev = next(other.router.parameters()).device
    h = ev.h.to(dev)
    logits = other.logits(h, **{k: v.to(dev) for k, v in ev.inputs.items()})  # [T, n] (Zaya: the carried state too)
    idx, w = other.route(logits, ev.token_ids) if getattr(other, "hash_routed", False) else other.route(logits)
    iso = RoutingEvent(layer=other, h=h, logits=logits, idx=idx, weights=w, valid=ev.valid.to(dev), shape=ev.shape,
                       attn=None if ev.attn is None else ev.attn.to(dev),
                       rows=ev.rows)  # the global row ids: a seeded policy (random) draws per row, not per batch
    iso.chosen_idx, iso.chosen_weights = policy.select(iso) if policy is not None else (idx, w)
    return iso


def capture(lm: Any, tokens: Any, policy: Any, *, others: dict[Any, dict[int, MoELayer]] | None = None,
            layers: Sequence[int] | None = None, batch_size: int = 8, description: str = "routing",
            quiet: bool = False) -> tuple[Routing, dict[Any, Routing]]:
    """Run ``tokens`` through ``lm`` with ``policy`` applied in the MoE ``layers`` (decoder indices, None: every MoE
    layer; the others keep the model's own routing) and only those measured; return its :class:`Routing`, and per
    key of ``others`` (router copies by layer index) the isolated routing on this run's ``h``."""
    chosen = select_layers(lm.layers, layers)
    layers = [L.index for L in chosen]
    row_ids = getattr(tokens, "row_ids", None)
    own = Routing(layers, row_ids)
    iso = {name: Routing(layers, row_ids) for name in (others or {})}

    def consume(ev: RoutingEvent) -> None:
        own.add(ev.layer.index, *routing_of(ev, policy))
        for name, routers in (others or {}).items():
            iso[name].add(ev.layer.index, *routing_of(isolated_event(ev, routers[ev.layer.index], policy), policy))

    def flush(batch: Any, _out: Any) -> None:
        for r in (own, *iso.values()):
            r.flush(batch.input_ids.shape[0])

    forward(lm, tokens, policy=policy, layers=layers, consumers=[consume], moe_layers=chosen, on_batch=flush,
            batch_size=batch_size, description=description, quiet=quiet)
    for r in (own, *iso.values()):
        r.reduce_across_ranks()
    return own, iso


# ----- comparison ----------------------------------------------------------------------------
def compare(ref: Routing, ckpt: Routing, rows: RowSums | None = None) -> dict[int, dict[str, float]]:
    """The metrics per layer between two routings of the same tokens (read back batch by batch).

    Per-token rates are summed per packed row into ``rows`` (name ``"rates"``: ``[L * len(RATES)]`` per row, and
    ``"tokens"``) when given, for the bootstrap."""
    if ref.tokens != ckpt.tokens or len(ref.spill) != len(ckpt.spill):
        raise MoetoolError(f"the checkpoints saw different tokens ({ref.tokens} vs {ckpt.tokens})")
    L = len(ref.layers)
    sums = torch.zeros(L, len(RATES), dtype=torch.float64)
    for (a, rows_a), (b, _) in zip(ref.batches(), ckpt.batches()):
        if a.shape != b.shape:
            raise MoetoolError(f"the checkpoints saw different tokens ({a.shape[1]} vs {b.shape[1]}) or K")
        A, B = a[..., :-1], b[..., :-1]  # [L, N, K] (-1: no expert)
        size_a = ops.set_size(A)
        overlap = torch.where(size_a == 0, (ops.set_size(B) == 0).double(),  # both empty: the same (empty) set
                              ops.overlap_count(A, B).double() / size_a.clamp_min(1))  # / K for a fixed top-K
        per = torch.stack([(a[..., -1] != b[..., -1]).double(), (~ops.same_set(A, B)).double(),
                           overlap, ops.jaccard(A, B, torch.float64)], -1)  # [L, N, 4]
        sums += per.sum(1)
        if rows is not None and per.shape[1]:
            rows.add(rows_a.numpy(), rates=per.permute(1, 0, 2).reshape(per.shape[1], -1).numpy(),
                     tokens=torch.ones(per.shape[1], dtype=torch.float64).numpy())

    sums = distributed.all_reduce(sums)  # data parallel: every rank compared its own rows (no-op alone)
    n = int(distributed.all_reduce(torch.tensor(float(ref.tokens), dtype=torch.float64)))
    if rows is not None:
        rows.merge_across_ranks()  # every rank's rows (global ids)
    out = {}
    for j, li in enumerate(ref.layers):
        e_ref, e_ck = ref.entropy_mean(li), ckpt.entropy_mean(li)
        out[li] = {"tokens": n, **{r: float(sums[j, k]) / n if n else float("nan") for k, r in enumerate(RATES)},
                   "entropy_ref": e_ref, "entropy_ckpt": e_ck,
                   "entropy_ratio": e_ck / e_ref if e_ref > 0 else float("nan")}
    return out


def compare_with_intervals(ref: Routing, ckpt: Routing, n_boot: int, seed: int,
                           top1_rows: dict[int, np.ndarray] | None = None) -> dict[int, dict[str, float]]:
    """:func:`compare` plus ``*_lo``/``*_hi`` of every rate: document-level bootstrap over packed rows
    (moetool.uncertainty.ratio_intervals on the per-row sums; NaN with ``n_boot = 0``). ``top1_rows`` receives
    each packed row's top-1 changes summed over layers and its real tokens (row id -> [changes, tokens]), for
    the pooled summary."""
    rows = RowSums()
    out = compare(ref, ckpt, rows)
    if top1_rows is not None and rows.rows:
        per = rows.table("rates").reshape(len(rows.rows), len(ref.layers), len(RATES))[:, :, 0].sum(1)
        top1_rows.update(zip(rows.rows, np.stack([per, rows.table("tokens")], 1)))
    if not n_boot:
        rows = None
    if rows is not None and rows.rows:
        ivs = ratio_intervals(rows.table("rates").reshape(len(rows.rows), -1), rows.table("tokens"),
                              n_boot=n_boot, seed=seed)
    else:
        ivs = None
    for j, li in enumerate(ref.layers):
        for k, r in enumerate(RATES):
            iv = ivs[j * len(RATES) + k] if ivs is not None else None
            out[li][f"{r}_lo"] = iv.lo if iv is not None else float("nan")
            out[li][f"{r}_hi"] = iv.hi if iv is not None else float("nan")
    return out


def processing_order(n: int, reference: str) -> list[int]:
    """Every checkpoint before the references it is compared with (so ``isolate`` already holds its routers)."""
    return list(range(n)) if reference == "last" else list(range(n - 1, -1, -1))


def run_fluctuation(names: Sequence[str], tokens: Any, opts: FluctuationOptions, load_fn: Callable[[str], Any],
                    quiet: bool = False, units: Any = None) -> Any:
    """Load each checkpoint in turn with ``load_fn(name) -> LoadedModel`` and compare; returns the table.

    ``units`` (:class:`moetool.checkpoints.Units`, ``--resume``): each checkpoint's captured routing (every
    routing, and the isolated ones it fed) is saved once captured; a checkpoint saved before an interruption is
    read back instead of being loaded and run again (with ``isolate``, a later checkpoint still needing its
    routers loads it for them only)."""
    import pandas as pd

    plist = pairs(names, opts.reference)
    runs: dict[tuple[int, str], Routing] = {}
    isolated: dict[tuple[int, int, str], Routing] = {}  # (ref, ckpt, routing)
    routers: dict[int, dict[int, MoELayer]] = {}
    signature: dict[str, Any] | None = None

    def routers_of(c: int) -> dict[int, MoELayer]:
        if c not in routers:  # captured before an interruption: its routers only
            lm = load_fn(names[c])
            routers[c] = {L.index: router_copy(L) for L in select_layers(lm.layers, opts.layers)}
        return routers[c]

    for i in processing_order(len(names), opts.reference):
        saved = units.load(f"checkpoint-{i}") if units is not None else None
        if saved is not None:
            for key, (state, spill) in saved.items():
                rt = Routing.restore(state, units.file(spill))
                if len(key) == 1:
                    runs[(i, key[0])] = rt
                else:
                    isolated[(i, key[0], key[1])] = rt
            continue
        lm = load_fn(names[i])
        sig = layer_signature(lm)
        if signature is None:
            signature, first = sig, names[i]
        check_same("architecture", [first, names[i]], [signature, sig])
        partners = {c: routers_of(c) for r, c in plist if r == i and opts.isolate}
        for routing in opts.routing:
            own, iso = capture(lm, tokens, opts.policy(routing),
                               others=partners, layers=opts.layers, batch_size=opts.batch_size,
                               description=f"{names[i]}: {routing}", quiet=quiet)
            runs[(i, routing)] = own
            for c in partners:
                isolated[(i, c, routing)] = iso[c]
        if opts.isolate and any(c == i for _, c in plist):
            routers[i] = {L.index: router_copy(L) for L in select_layers(lm.layers, opts.layers)}
        del lm
        if units is not None:
            done = {(routing,): runs[(i, routing)] for routing in opts.routing}
            done.update({(c, routing): isolated[(i, c, routing)] for c in partners for routing in opts.routing})
            state = {}
            for n, (key, rt) in enumerate(done.items()):
                spill = f"checkpoint-{i}-{n}.spill"
                state[key] = (rt.checkpoint(units.file(spill)), spill)
            units.save(f"checkpoint-{i}", state)
    rows, pooled = [], []
    for r, c in plist:
        labels = [(routing, routing, runs[(c, routing)]) for routing in opts.routing]
        if opts.isolate:
            labels += [(f"{routing}-isolated", routing, isolated[(r, c, routing)]) for routing in opts.routing]
        per_row: dict[str, dict[int, np.ndarray]] = {}
        for label, routing, other in labels:
            per_row[label] = {}
            for layer, m in compare_with_intervals(runs[(r, routing)], other, opts.bootstrap, opts.seed,
                                                   per_row[label]).items():
                rows.append({"layer": layer, "routing": label, "reference": names[r], "checkpoint": names[c], **m})
        pooled += pooled_rows(per_row, runs[(r, opts.routing[0])], names[r], names[c], opts.bootstrap, opts.seed)
    for rt in (*runs.values(), *isolated.values()):
        rt.spill.close()
    return pd.DataFrame(rows, columns=COLUMNS), pd.DataFrame(pooled, columns=SUMMARY_COLUMNS)


def pooled_rows(per_row: dict[str, dict[int, np.ndarray]], ref: Routing, reference: str, checkpoint: str,
                n_boot: int, seed: int) -> list[dict[str, Any]]:
    """Mean over layers of the top-1 change per routing, and ``reduction_vs_router`` = router's − this routing's
    (the same tokens: a paired difference). Both intervals are document-level bootstraps with one set of row
    weights (same rows, same seed), so the difference's interval accounts for the pairing."""
    L = len(ref.layers)
    out = []
    for label, rows in per_row.items():
        ids = sorted(rows)
        if not ids:
            raise MoetoolError(f"no tokens compared for {reference} -> {checkpoint} ({label})")
        num, tok = np.array([rows[i] for i in ids], dtype=np.float64).T
        tok = tok * L
        (mean,) = ratio_intervals(num, tok, n_boot=n_boot, seed=seed)
        ref_label = "router-isolated" if label.endswith("-isolated") else "router"
        base = per_row.get(ref_label)
        if base is None or label == ref_label:
            red = Interval(float("nan"))
        else:
            if sorted(base) != ids:
                raise MoetoolError(f"{label} and {ref_label} compared different rows")
            (red,) = ratio_intervals(np.array([base[i][0] for i in ids]) - num, tok, n_boot=n_boot, seed=seed)
        out.append({"routing": label, "reference": reference, "checkpoint": checkpoint, "tokens": int(tok.sum()) // L,
                    "layers": L, **mean.columns("top1_change"), **red.columns("reduction_vs_router")})
    return out


# ----- the whole command ---------------------------------------------------------------------
def check_checkpoints(names: Sequence[str]) -> Any:
    """Configs (before any weight loads) and tokenizer vocabularies must agree; returns the first tokenizer."""
    pairs(names, "previous")  # at least two
    loaded = [load_config(n) for n in names]
    check_same("architecture", names, [architecture(cfg) for cfg, _, _ in loaded])
    toks = [load_tokenizer(n) for n in names]  # as the run reads them (remote code only when trusted): one line each
    vocab = toks[0].get_vocab()
    for name, tok in zip(names[1:], toks[1:]):
        v = tok.get_vocab()
        if v != vocab:
            raise MoetoolError(f"checkpoints differ in tokenizer: {names[0]} and {name} have different vocabularies "
                               f"({len(vocab)} vs {len(v)} entries)")
    return toks[0]


#: the top-1, as every experiment reads it (moetool.ops.top1)
TOP1 = ("the routing decision: the chosen expert ranked first by the scores the routing selected on -- routing router: "
        "the model's selection scores (layer.selection_scores: π, sigmoids plus any correction bias, the logits for "
        "sparsemixer; before any per-expert scale or renormalisation of the weights, so not the largest weight); "
        "similarity/attention: their distribution s_i; topk/prune/capacity: the router's selection scores; topp: π; "
        "random and norm: their own order (the first column); a token with no chosen expert has none")

DEFINITIONS = {
    "top1_change": "fraction of real tokens whose top-1 expert differs (see top1: the routing decision, not the "
                   "largest weight)",
    "topk_change": "fraction of real tokens whose chosen set differs (the experts with a nonzero weight: the top-K, "
                   "or a policy's set, top-p's unchosen and capacity's dropped columns left out)",
    "topk_overlap": "mean |A ∩ B| / |A| (A the reference's chosen set: |A| = K for a fixed top-K; 1 where A and B "
                    "are both empty, a token capacity dropped in both routings: the same set, as topk_change says)",
    "jaccard": "mean |A ∩ B| / |A ∪ B| (1 where both sets are empty)",
    "entropy_ref/entropy_ckpt": "mean entropy (nats) over real tokens of π (routing router), of the policy's "
                                "normalised score distribution s_i = Σ_j S[i,j] π(h_j) (similarity, attention), of "
                                "the pruned router's π over the kept experts (prune:), or of the model's π on the "
                                "hidden states the policy reached (any other policy: topk, topp and capacity rank "
                                "or keep experts by it; norm and random choose by none of it)",
    "entropy_ratio": "entropy_ckpt / entropy_ref",
    "reference": "the checkpoint compared with (--reference: previous, first or last of the checkpoints given)",
    "checkpoint": "the checkpoint whose routing is compared with the reference's, on the same token ids",
    "layers": "MoE layers averaged over (fluctuation_summary.csv)",
    "fluctuation_summary.top1_change": "top-1 change (the paper's fluctuation rate) averaged over the MoE layers, "
                                       "a fraction of real tokens (the paper's 10-33% is 0.10-0.33 here)",
    "reduction_vs_router": "the router's top1_change minus this routing's (router-isolated's for a "
                           "<routing>-isolated row), the same tokens: a paired difference, > 0 where the policy "
                           "fluctuates less than the router",
    "routing": "router: the model's own top-K; similarity/attention: the policy applied in every MoE layer of "
               "each checkpoint (with --layers: in the chosen layers only; the others keep the model's router), "
               "what runs, so hidden states downstream follow the policy; "
               "<routing>-isolated: the reference's own MoE inputs h (and attention probabilities) fed to the "
               "checkpoint's routers, compared with the reference's choice on the same h (router drift only)",
    "top1": TOP1,
    "attention head": "chosen per batch and layer (lowest mean row entropy over the batch's real tokens)",
    "layer": "the MoE layers measured (--layers; default every MoE layer): the rows' layers, the summary's count",
    "tokens": "real (unpadded) tokens the layer routed in both runs (fluctuation_summary.csv: per MoE layer); "
              "token ids from the first checkpoint's tokenizer, the same for every checkpoint",
}


def fluctuation(checkpoints: Sequence[Any], tokens: Any, options: FluctuationOptions | None = None, *,
                quiet: bool = False, units: Any = None, **overrides: Any) -> Result:
    """Routing change between checkpoints of one architecture on the same ``tokens``.

    ``checkpoints``: loaded models (``moetool.load(...)``; ``attention`` routing switches them to eager attention
    for its forwards) or names/paths, loaded one at a time. Table ``fluctuation`` with :data:`COLUMNS`
    (see :data:`DEFINITIONS`): per MoE layer, pair (reference, checkpoint) and routing; ``fluctuation_summary``:
    per routing and pair, the top-1 change averaged over layers and its reduction against the router. ``units``:
    per-checkpoint captures kept for ``--resume`` (:func:`run_fluctuation`).
    """
    opts = resolve_options(FluctuationOptions, options, overrides)
    described = require_tokens(tokens).describe()
    if distributed.world_size() > 1 and tokens.row_ids is None:  # data parallel: this rank's rows, global ids
        tokens = distributed.shard(tokens, opts.batch_size)
    if all(isinstance(c, (str, Path)) for c in checkpoints):
        names = [str(c) for c in checkpoints]
        check_tokenizer(tokens, check_checkpoints(names))  # configs and vocabularies (the tokens' too), no weights
        attn = "eager" if opts.needs_attention else None
        df, pooled = run_fluctuation(names, tokens, opts,
                                     lambda n: load(n, dtype=opts.dtype, device=opts.device, device_map=opts.device_map,
                                                    quantize=opts.quantize, attn_implementation=attn, tokenizer=False),
                                     quiet=quiet, units=units)
    else:
        models = {str(i): lm for i, lm in enumerate(checkpoints)}
        df, pooled = run_fluctuation(list(models), tokens, opts, models.__getitem__, quiet=quiet, units=units)
        names = [getattr(lm, "name", str(i)) for i, lm in enumerate(checkpoints)]
        for t in (df, pooled):
            for col in ("reference", "checkpoint"):
                t[col] = [names[int(i)] for i in t[col]]
    return Result("fluctuation", {"fluctuation.csv": df, "fluctuation_summary.csv": pooled}, opts,
                  meta=dict(definitions=DEFINITIONS, data=described, checkpoints=names,
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, described["rows"]),
                            similarity={"tau": opts.tau if opts.tau is not None else "sqrt(d)", "sim": opts.sim,
                                        "causal": opts.causal}),
                  summary=df.drop(columns=["tokens"]))


def summary_lines(name: str, res: Any) -> list[str]:
    """Per pair, a heading line, then one line per routing: its top-1 change (mean over layers, ± the 95%
    half-width) and, for a policy, its paired reduction against the router with whether the interval excludes 0
    (``name`` is not needed: the pairs name themselves). Recorded routings (``--trace``): per pair, their change
    (mean over layers) in one line."""
    if "fluctuation_summary" not in res:
        rates = [c for c in ("top1_change", "topk_change") if c in res.summary]
        return [f"{row.reference} -> {row.checkpoint} (recorded routing): "
                + ", ".join(f"{c.replace('_', ' ').replace('topk', 'top-K').replace('top1', 'top-1')} "
                            f"{getattr(row, c):.4f}" for c in rates) + " (mean over layers)"
                for row in res.summary.itertuples()]
    pooled = res["fluctuation_summary"]

    lines = []
    for (r, c), d in pooled.groupby(["reference", "checkpoint"], sort=False):
        lines.append(f"{r} -> {c}: top-1 change (mean over layers)")
        for row in d.itertuples():
            text = f"{row.routing} {format_ci(row.top1_change, row.top1_change_lo, row.top1_change_hi)}"
            if np.isfinite(row.reduction_vs_router):
                lo, hi = row.reduction_vs_router_lo, row.reduction_vs_router_hi
                verdict = "" if not np.isfinite(lo) else (" (0 inside the interval)" if lo <= 0 <= hi
                                                          else " (interval excludes 0)")
                base = "router-isolated" if row.routing.endswith("-isolated") else "router"  # its baseline
                text += (f" [reduction vs {base} "
                         f"{format_ci(row.reduction_vs_router, lo, hi)}{verdict}]")
            if row.routing in ("random", "random-isolated"):  # its draws depend on the seed and the token's place, not on the model
                text += " (random: the same seeded draws in both checkpoints, so no change by construction)"
            lines.append(f"  {text}")
    return lines
