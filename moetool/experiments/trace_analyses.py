"""Analyses of routing read from a trace instead of a forward: ``stats``, ``placement``, ``offload`` and
``fluctuation`` with ``--trace``.

The trace is moetool's own (``moetool trace``) or an engine's dump imported by ``moetool import-trace``
(:mod:`moetool.traces`); it is read streamed (:func:`moetool.traces.store.read_batches`) into per-layer sums on the
host -- real tokens, top-K assignments per expert, co-activation counts -- with the same functions the forward's
consumers use (:func:`moetool.ops.one_hot_counts`, :func:`.specialization.coactivation_counts`), so the tables are
those of the same routing captured by moetool. A counts-only dump (SGLang ``stat`` / ``per_pass``, legacy CSV) gives
the loads alone: real tokens = assignments / K there.

What needs more than the chosen ids refuses or is left out, in one line each (``meta["left_out"]``): the router's
probabilities (router_prob, confidence entropy, aux loss: an engine records ids only), token ids (top tokens,
specialisation), the order of the top-K (``--top-k 1``, ``--coactivation adjacent`` on a Megatron trace, whose ids
are sorted by expert id; on counts), per-token rows (co-activation on counts), the document rows of a forward
(bootstrap intervals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import ops
from ..errors import MoetoolError, layers_of_one, spans
from ..loading import load_tokenizer
from ..sketch import SparseCounter
from ..traces.readers import check_ids
from ..traces.store import TraceSource, check_counts, expert_columns, open_trace, read_batches, read_loads
from ..uncertainty import RowSums, bootstrap_meta
from .fluctuation.compute import (DEFINITIONS as FLUCTUATION_DEFINITIONS, RATES, FluctuationOptions, Routing,
                                  chosen_and_top1, compare_with_intervals, pairs)
from .offload.compute import offload_tables, refuse_zero_compute
from .placement.compute import (DEFINITIONS as PLACEMENT_DEFINITIONS, _loads_table, _placements, eplb_meta,
                                placement_tables)
from .result import Result
from .specialization import coactivation_counts, token_decoder, with_tokens
from .stats.compute import (DEFINITIONS as STATS_DEFINITIONS, ONE_EXPERT, _coactivation_frame, _pair_frame,
                            _rank, zero_compute_column)

#: what a trace cannot give, and why (the lines of ``meta["left_out"]``)
NO_PROBS = ("the router's full probabilities: a trace holds the chosen experts (an engine's dump their ids "
            "only)")


@dataclass
class LayerSums:
    """Host sums of one MoE layer over a trace."""

    n: int
    k: int
    tokens: int
    assign: torch.Tensor  # [n] float64: tokens whose top-K contains e
    co: torch.Tensor | None  # [n, n] float64 (diagonal = assign); None for counts-only
    pairs: Any = None  # SparseCounter of token_id * n + expert (pairs=True, traces with token ids)


def _ordered(src: TraceSource) -> bool:
    return "sorted" not in str(src.routing_source.get("order", ""))


def _weight_columns(src: TraceSource, cols: list[str]) -> list[str]:
    """``weight_1 .. weight_K`` where the trace has gate weights (``moetool trace``), else none."""
    return [c.replace("expert_", "weight_") for c in cols] if src.weights else []


def _expert_ids(src: TraceSource, g: Any, cols: list[str], li: int) -> np.ndarray:
    """A layer's rows' ``expert_1..K`` as ``[t, K]`` int64, checked as an imported dump's ids are
    (:func:`~moetool.traces.readers.check_ids`: every id in ``[0, n)``, a token's K distinct); an id that is no whole
    number (an edited or foreign file) is one line, never truncated to one."""
    raw = g[cols].to_numpy()
    if raw.dtype.kind not in "iu":
        try:
            f = raw.astype(np.float64)
        except (TypeError, ValueError):
            f = np.array([np.nan])
        if not np.isfinite(f).all() or (f != np.round(f)).any():
            raise MoetoolError(f"--trace {src.path}: layer {li} has expert ids that are not whole numbers: not a "
                               f"moetool trace (damaged or edited?)")
    return check_ids(raw.astype(np.int64), src.shape.n_experts(li), f"--trace {src.path}", li, of="the model",
                     unwritten="a damaged or edited trace?")


def _refuse_nan_weights(src: TraceSource, g: Any, wcols: list[str], li: int) -> None:
    """One line where a trace read as having gate weights (no ``routing_source`` in a manifest beside it) has NaN
    ones: ``import-trace`` writes NaN weights (the engines record ids only), so this is an imported trace away from
    its manifest -- whose ids may come sorted by expert id (Megatron) -- or a damaged one; its top-1 (the first
    chosen column) would be an arbitrary one."""
    if wcols and np.isnan(g[wcols].to_numpy(dtype=np.float64)).any():
        raise MoetoolError(f"--trace {src.path}: layer {li} has NaN gate weights: an import-trace trace without the "
                           f"manifest.json written beside it (which says where its ids come from and in what order), "
                           f"or a damaged trace; keep the trace in its run folder")


def _refuse_unrouted(src: TraceSource, g: Any, wcols: list[str], li: int, use: str) -> None:
    """One line where a layer's rows hold a column at weight 0: a policy's column that did not run (``--routing
    topp`` leaves the unchosen at 0, ``capacity`` its dropped assignments), while ``use`` reads every ``expert_k``
    as routed (fluctuation reads the weights and leaves such columns out); NaN weights first
    (:func:`_refuse_nan_weights`)."""
    _refuse_nan_weights(src, g, wcols, li)
    if wcols and (g[wcols].to_numpy(dtype=np.float64) == 0).any():
        raise MoetoolError(f"--trace {src.path}: layer {li} has experts at weight 0 (a routing policy's columns that "
                           f"did not run: top-p's unchosen, capacity's dropped), which {use} would count as routed: "
                           f"not supported; trace the model's own routing")


def _refuse_missing(src: TraceSource, present: Any, layers: tuple[int, ...] | None) -> None:
    """One line where the trace lacks an MoE layer asked for (``layers``; default every MoE layer of the model, as
    a counts trace must cover them: :func:`~moetool.traces.store.check_counts`): its tables would pass for the
    model's while leaving the layer out (placement's and offload's overall figures most of all)."""
    wanted = [li for li in (layers if layers is not None else src.shape.moe_layers) if li in src.shape.moe]
    missing = [li for li in wanted if li not in present]
    if missing:
        raise MoetoolError(f"--trace {src.path}: MoE layer{'s' if len(missing) > 1 else ''} {spans(missing)} not "
                           f"in the trace (MoE layers of {src.shape.source}: {spans(src.shape.moe_layers)}); a trace "
                           f"covers every MoE layer" + (" asked for" if layers is not None else ""))


def trace_sums(src: TraceSource, *, top_k: int | None = None, coactivation: str | None = "all",
               layers: tuple[int, ...] | None = None, pairs: Any = None) -> dict[int, LayerSums]:
    """Per MoE layer of the trace: real tokens, assignments and (``coactivation``) co-activation counts;
    ``top_k=1``: each token's first-ranked expert only. Layers ``layers`` only (default: every layer present).
    ``pairs`` (a :class:`~moetool.sketch.SparseCounter` receiving every token id once, at the first MoE layer):
    also the (token id, expert) counts per layer, as ``stats`` counts them; refused when the trace has no token
    ids."""
    if top_k is not None and not _ordered(src):
        raise MoetoolError(f"--top-k 1 on {src.path}: its ids are sorted by expert id (Megatron's router hook), the "
                           f"first-ranked expert is unknown")
    if coactivation == "adjacent" and not _ordered(src):
        raise MoetoolError(f"--coactivation adjacent on {src.path}: its ids are sorted by expert id (Megatron's "
                           f"router hook), neighbouring ranks are unknown; use --coactivation all")
    if src.kind == "loads":
        if top_k is not None or coactivation == "adjacent":
            raise MoetoolError(f"{src.path} holds counts only: no per-token top-K for --top-k 1 or --coactivation "
                               f"adjacent")
        K = src.shape.top_k()
        counts = read_loads(src)
        check_counts(counts, src.shape, f"--trace {src.path}", noun="trace", layers=layers)  # as at import
        return _one_token_count(src, {li: LayerSums(len(c), K, int(c.sum()) // K, torch.from_numpy(
            c.astype(np.float64)), None) for li, c in counts.items() if layers is None or li in layers})
    cols = expert_columns(src)
    wcols = _weight_columns(src, cols)
    sums: dict[int, dict[str, Any]] = {}
    first_layer = min(layers) if layers else None
    no_ids: list[int] = []
    for df in read_batches(src, ["layer", *cols, *wcols] + (["token_id"] if pairs is not None else [])):
        for li, g in df.groupby("layer", sort=False):
            li = int(li)
            if layers is not None and li not in layers:
                continue
            if li not in src.shape.moe:
                raise MoetoolError(f"--trace {src.path}: layer {li} is not an MoE layer of the model")
            _refuse_unrouted(src, g, wcols, li, "the expert loads")
            n = src.shape.n_experts(li)
            idx = torch.from_numpy(np.array(_expert_ids(src, g, cols, li)))  # [t, K], a writable copy
            if top_k is not None:
                idx = idx[:, :top_k]
            valid = torch.ones(idx.shape[0], dtype=torch.bool)
            s = sums.setdefault(li, {"tokens": 0, "assign": torch.zeros(n, dtype=torch.float64),
                                     "co": torch.zeros(n, n, dtype=torch.float64) if coactivation else None,
                                     "k": idx.shape[1]})
            s["tokens"] += idx.shape[0]
            s["assign"] += ops.one_hot_counts(idx, n, valid)
            ids = (torch.from_numpy(np.array(g["token_id"].to_numpy(dtype=np.int64)))
                   if pairs is not None and not no_ids else None)
            if ids is not None and ids.numel() and ids.min() < 0:  # the responses carried no token ids: no pairs
                no_ids.append(li)
            elif ids is not None:
                src.shape.check_token_ids(ids, f"--trace {src.path}")
                first_layer = li if first_layer is None else first_layer
                if li == first_layer:
                    pairs.add(ids)
                s.setdefault("pairs", SparseCounter()).add(ids.unsqueeze(1) * n + idx)
            if coactivation:
                s["co"] += coactivation_counts(idx, n, valid, coactivation)
    if not sums:
        raise MoetoolError(f"--trace {src.path}: no rows" + (f" in --layers {list(layers)}" if layers else ""))
    _refuse_missing(src, sums, layers)
    return _one_token_count(src, {li: LayerSums(src.shape.n_experts(li), s["k"], s["tokens"], s["assign"], s["co"],
                                                None if no_ids else s.get("pairs")) for li, s in sorted(sums.items())})


def _one_token_count(src: TraceSource, sums: dict[int, LayerSums]) -> dict[int, LayerSums]:
    """``sums``, or one line where its MoE layers routed different numbers of tokens: every token is routed once in
    every MoE layer, so a row was lost or repeated in some of them (a per-token trace) or a layer's counts are off
    (a counts dump)."""
    tokens = {s.tokens for s in sums.values()}
    if len(tokens) > 1:
        raise MoetoolError(f"--trace {src.path}: the MoE layers routed different numbers of tokens {sorted(tokens)}")
    return sums


def _as_read(res: Result, srcs: list[TraceSource], tokens: int, rows: int | None = None,
             max_tokens: int | None = None) -> Result:
    """``res`` recording what it read as a forward of its command records it, so that the two are told apart only
    where they differ: ``res.model`` the model whose routing the trace holds (the ``moetool trace`` run's model
    entry; fluctuation: the models of the traces, as its forward records its checkpoints), ``meta["data"]`` the text
    (the trace's data entry) with the ``tokens`` (and ``rows``) the analysis read, and ``meta["traced_run"]`` the
    options a forward records of its text (``data``, ``seq_len`` where the trace records them; ``max_tokens``: the
    analysis's cap where it cut the trace, else the trace's own, else the tokens read) -- the manifest's options of
    a ``--trace`` run (``commands/trace_input.py``)."""
    first = srcs[0]
    res.model = ([s.model_name for s in srcs] if len(srcs) > 1
                 else {**(first.recorded.get("model") or {}), "name": first.model_name})
    whole = all(s.recorded.get("tokens") == tokens for s in srcs)  # every token each trace holds was read
    recorded = first.recorded.get("data") or {}
    sources = list(dict.fromkeys(str(s.recorded["data"]["source"]) for s in srcs
                                 if (s.recorded.get("data") or {}).get("source") is not None))
    data: dict[str, Any] = {}
    if sources:
        data["source"] = sources[0] if len(sources) == 1 else sources
    data["tokens"] = int(tokens)
    if rows is None and whole:
        rows = recorded.get("rows")
    if rows is not None:
        data["rows"] = int(rows)
    data.update({k: recorded[k] for k in ("seq_len", "special_tokens") if k in recorded})
    if whole and "domains" in recorded:
        data["domains"] = recorded["domains"]
    given = first.recorded.get("options") or {}
    capped = bool(max_tokens) and tokens >= max_tokens
    res.meta["data"] = data
    res.meta["traced_run"] = {**{k: given[k] for k in ("data", "seq_len") if k in given},
                              "max_tokens": int(max_tokens if capped else given.get("max_tokens") or tokens)}
    return res


# ----- stats ------------------------------------------------------------------------------------------------------
def stats_from_trace(src: TraceSource, options: Any) -> Result:
    """``stats`` tables that need only the chosen experts: ``load.csv`` (layer, expert, load_fraction,
    token_fraction, tokens), ``layers.csv`` (layer, n_experts, top_k, tokens, load_entropy[_norm], max_load_ratio)
    and ``coactivation.csv`` (per-token traces), with the definitions of :mod:`.stats`; what they leave out is
    listed in ``meta["left_out"]``. ``options``: :class:`.stats.spec.StatsOptions` (``top_k``, ``coactivation``)."""
    import pandas as pd


    if options.all_tokens:
        raise MoetoolError("--all-tokens: not on --trace (top_tokens.csv is)")
    totals = SparseCounter() if options.top_tokens and src.kind == "trace" else None
    sums = trace_sums(src, top_k=options.top_k, coactivation=options.coactivation, pairs=totals)  # counts: no co
    load, layers, co, top, lift = [], [], [], [], []
    if totals is not None:
        tok_keys, tok_counts = (t.numpy() for t in totals.result())
    for li, a in sums.items():
        if a.tokens == 0:
            raise MoetoolError(f"--trace {src.path}: layer {li} routed no token")
        frac = a.assign / a.assign.sum()  # [n] sums to 1
        load.append(pd.DataFrame({"layer": li, "expert": range(a.n), "load_fraction": frac.numpy(),
                                  "token_fraction": (a.assign / a.tokens).numpy(), "tokens": a.assign.long().numpy()}))
        ent = float(ops.entropy(frac))
        layers.append({"layer": li, "n_experts": a.n, "top_k": a.k, "tokens": a.tokens, "load_entropy": ent,
                       "load_entropy_norm": ent / math.log(a.n), "max_load_ratio": float(frac.max()) * a.n,
                       **zero_compute_column(frac, src.shape.n_zero_compute(li))})
        if a.co is not None and a.k >= 2:  # (ONE_EXPERT: a table of zeros otherwise)
            co.append(_coactivation_frame(li, a.co))
        if a.pairs is not None:  # the forward's own ranking (stats._pair_frame, _rank) on the trace's counts
            pf = _pair_frame(li, a, tok_keys, tok_counts)
            top.append(_rank(pf, "count", options.top_tokens))
            lift.append(_rank(pf[pf["count"] >= options.min_count], "lift", options.top_tokens))
    tables = {"load.csv": pd.concat(load, ignore_index=True), "layers.csv": pd.DataFrame(layers)}
    if co:
        tables["coactivation.csv"] = pd.concat(co, ignore_index=True)
    if top:
        decode = token_decoder(_tokenizer(src))
        cols = ["layer", "expert", "rank", "token_id", "token", "count", "share"]
        tables["top_tokens.csv"] = with_tokens(pd.concat(top, ignore_index=True), decode)[cols]
        lift = with_tokens(pd.concat(lift, ignore_index=True), decode)[cols + ["lift"]]
        if len(lift):  # no (token, expert) pair seen --min-count times: no table, as the forward's stats
            tables["top_tokens_lift.csv"] = lift
    left_out = {"router_prob, confidence_entropy, aux_loss": NO_PROBS,
                "specialization, domain_load": "the next / predicted tokens and the domains of a forward's data",
                "cross_layer": "not computed from a trace",
                "*_lo/*_hi": "the bootstrap resamples a forward's packed rows"}
    if any(a.co is None for a in sums.values()):
        left_out["coactivation"] = "a counts-only dump has no per-token top-K"
    single = [li for li, a in sums.items() if a.co is not None and a.k < 2]
    if single:
        left_out[f"coactivation.csv rows of layers {single}"] = ONE_EXPERT
    if options.top_tokens and not top:
        left_out["top_tokens, top_tokens_lift"] = ("a counts-only dump" if src.kind == "loads" else
                                                   "the trace has no token ids (the responses carried none)")
    defs = {k: v for k, v in STATS_DEFINITIONS.items() if k in ("load_fraction", "token_fraction", "load.tokens",
                                                                "load_entropy", "max_load_ratio", "top_k",
                                                                "first-ranked", "coactivation", "top_tokens",
                                                                "top_tokens_lift", "zero_compute_fraction",
                                                                "layers.tokens", "layers.top_k",
                                                                "coactivation.a/coactivation.b", "coactivation.count",
                                                                "coactivation.p_b_given_a", "share", "lift",
                                                                "top_tokens.rank/top_tokens_lift.rank",
                                                                "top_tokens.count/top_tokens_lift.count")}
    if src.kind == "loads":
        defs["layers.tokens"] = "real tokens = assignments / K (a counts-only dump does not count tokens)"
    summary = pd.DataFrame(layers)[["layer", "n_experts", "top_k", "tokens", "load_entropy_norm",
                                    "max_load_ratio"]].rename(columns={
                                        "n_experts": "n", "top_k": "K", "load_entropy_norm": "Ent_load/log n",
                                        "max_load_ratio": "max load/uniform"}).round(4)
    return _as_read(Result("stats_trace", tables, options, meta=dict(trace=src.describe(), definitions=defs,
                                                                     left_out=left_out), summary=summary),
                    [src], next(iter(sums.values())).tokens)


def _tokenizer(src: TraceSource) -> Any:
    """The model's tokenizer for the ``token`` column (no weights read); ``None`` (empty text) where it cannot be
    read, e.g. off the Hub."""
    try:
        return load_tokenizer(src.shape.source)
    except MoetoolError:
        return None


# ----- placement --------------------------------------------------------------------------------------------------
def placement_from_trace(src: TraceSource, options: Any) -> tuple[Result, dict[str, Any]]:
    """``placement`` tables from the trace's loads (every MoE layer of one n, or ``options.layers``): the same
    placements and tables as :func:`.placement.compute.placement` (no bootstrap: a trace has no packed rows), and
    ``{"load", "layers", "n", "groups"}`` for an export."""
    sums = trace_sums(src, coactivation=None, layers=options.layers)
    idx = list(sums)
    n = layers_of_one({li: sums[li].n for li in idx}, "the trace's MoE layers have different numbers of experts", "n")
    z = layers_of_one({li: src.shape.n_zero_compute(li) for li in idx}, "the trace's MoE layers have different "
                      "numbers of zero-computation experts", "number of zero-computation experts")
    n -= z  # zero-computation experts run nowhere: not placed (their assignments take no GPU)
    K = sums[idx[0]].k
    groups = options.groups or 1
    if n % groups:
        raise MoetoolError(f"--groups {groups} must divide the {n} experts")
    gpu_counts = options.gpu_counts(n)
    load = torch.stack([sums[li].assign[:n] for li in idx])  # [layers, n] float64
    n_tok = sums[idx[0]].tokens  # one count in every layer (trace_sums)
    df, overall = placement_tables(load, None, 0, idx, n, options,
                                   _placements(load, None, n, groups, gpu_counts, options))
    meta = dict(definitions=PLACEMENT_DEFINITIONS, trace=src.describe(), layers=idx, n_experts=n, top_k=K,
                groups=groups, zero_computation_experts_not_placed=z, **eplb_meta(groups, options.nodes))
    meta["left_out"] = {"imbalance_lo/imbalance_hi": "the bootstrap resamples a forward's packed rows",
                        "eplb_stale": "--reference-data / --reference-model need a forward", **meta.get("left_out", {})}
    summary = overall[["gpus", "replicas", "method", "imbalance", "max_layer_imbalance"]].round(3)
    res = Result("placement", {"placement.csv": df, "placement_overall.csv": overall,
                               "placement_loads.csv": _loads_table(idx, n, K, ("data", load, n_tok))},
                 options, meta=meta, summary=summary)
    _as_read(res, [src], n_tok)
    return res, {"load": load, "layers": idx, "n": n, "groups": groups}


# ----- offload ----------------------------------------------------------------------------------------------------
class TraceStream:
    """A trace's token stream in the shape :func:`.offload.compute.offload_tables` reads from its collector: per layer
    the requests ``[T, K]`` in (row, position) order, the row of each token, the first request and the count of each
    expert; no next-layer prediction (that needs the hidden states of a forward)."""

    def __init__(self, rows: np.ndarray, requests: dict[int, np.ndarray], n: dict[int, int],
                 keys: np.ndarray | None = None, weights: dict[int, np.ndarray] | None = None,
                 token_ids: np.ndarray | None = None):

        self.keys = keys  # [T] (row, position) of each token, for aligning two traces
        self.token_ids = token_ids  # [T] token id of each token (-1: the dump carried none), or None
        self.weights = weights  # per layer [T, K] gate weights (a trace of moetool trace), else None
        self.merged: dict[Any, np.ndarray] = {"rows": rows, **requests}
        self.first, self.counts = {}, {}
        for i, req in requests.items():
            T = req.shape[0]
            first = np.full(n[i], np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(first, req.reshape(-1), np.repeat(np.arange(T), req.shape[1]))
            self.first[i] = torch.from_numpy(first)
            self.counts[i] = ops.one_hot_counts(torch.from_numpy(req), n[i])
        self.pred = RowSums()

    def requests(self, i: int) -> np.ndarray:
        return self.merged[i]

    def token_rows(self) -> np.ndarray:
        return self.merged["rows"]


def token_stream(src: TraceSource, layers: tuple[int, ...] | None, max_tokens: int | None,
                 weights: bool = False, *, use: str, token_ids: bool = False) -> TraceStream:
    """The trace's first ``max_tokens`` tokens of every MoE layer in (row, position) order, read streamed (the
    file holds each layer's tokens in that order: ``moetool trace`` and ``import-trace`` write them so). ``use``:
    what needs them, as a counts-only trace's refusal names it; ``token_ids``: the tokens' ids read too (every
    layer routes the same tokens: kept from the first)."""
    if src.kind == "loads":
        raise MoetoolError(f"{src.path} holds counts only: {use} needs each token's experts in order")
    cols = expert_columns(src)
    wcols = _weight_columns(src, cols)  # read to mask (weights) or to refuse (not): a column at weight 0 never ran
    parts: dict[int, list[tuple[np.ndarray, ...]]] = {}
    taken: dict[int, int] = {}
    last: dict[int, tuple[int, int]] = {}
    for df in read_batches(src, ["row", "pos", *(["token_id"] if token_ids else []), "layer", *cols, *wcols]):
        for li, g in df.groupby("layer", sort=False):
            li = int(li)
            if (layers is not None and li not in layers) or (max_tokens and taken.get(li, 0) >= max_tokens):
                continue
            if li not in src.shape.moe:
                raise MoetoolError(f"--trace {src.path}: layer {li} is not an MoE layer of the model")
            if max_tokens:
                g = g.iloc[: max_tokens - taken.get(li, 0)]
            if not weights:
                _refuse_unrouted(src, g, wcols, li, use)
            else:
                _refuse_nan_weights(src, g, wcols, li)
            key = g["row"].to_numpy() * (1 << 32) + g["pos"].to_numpy()
            if (np.diff(key) < 0).any() or (li in last and key[0] < last[li][0] * (1 << 32) + last[li][1]):
                raise MoetoolError(f"--trace {src.path}: layer {li}'s tokens are not in (row, position) order")
            last[li] = (int(g["row"].iloc[-1]), int(g["pos"].iloc[-1]))
            parts.setdefault(li, []).append((g["row"].to_numpy(), key, _expert_ids(src, g, cols, li),
                                             g[wcols].to_numpy(dtype=np.float64) if weights and wcols else None,
                                             g["token_id"].to_numpy(dtype=np.int64) if token_ids else None))
            taken[li] = taken.get(li, 0) + len(g)
        if max_tokens and parts and all(taken.get(li, 0) >= max_tokens for li in (layers or src.shape.moe_layers)):
            break
    if not parts:
        raise MoetoolError(f"--trace {src.path}: no rows" + (f" in --layers {list(layers)}" if layers else ""))
    _refuse_missing(src, parts, layers)
    keys = {li: np.concatenate([p[1] for p in ps]) for li, ps in parts.items()}
    first = next(iter(keys.values()))
    if any(len(k) != len(first) or (k != first).any() for k in keys.values()):
        raise MoetoolError(f"--trace {src.path}: the MoE layers routed different tokens")
    rows = np.concatenate([p[0] for p in next(iter(parts.values()))])
    _, rows = np.unique(rows, return_inverse=True)  # packed-row numbers 0.. in order (the bootstrap's units)
    reqs = {li: np.concatenate([p[2] for p in ps]) for li, ps in sorted(parts.items())}
    w = {li: np.concatenate([p[3] for p in ps]) for li, ps in sorted(parts.items())} if weights and wcols else None
    ids = np.concatenate([p[4] for p in next(iter(parts.values()))]) if token_ids else None
    return TraceStream(rows.astype(np.int64), reqs, {li: src.shape.n_experts(li) for li in reqs}, first, w, ids)


def offload_from_trace(src: TraceSource, options: Any, max_tokens: int | None) -> Result:
    """``offload``'s coverage, per-layer and cache tables on the trace's first ``max_tokens`` tokens; expert bytes
    (the serving precision) and the next-layer prediction (hidden states) are left out."""
    from types import SimpleNamespace


    stream = token_stream(src, options.layers, max_tokens, use="the cache simulation")
    refuse_zero_compute({li: src.shape.n_zero_compute(li) for li in stream.merged if li != "rows"})
    layers = [SimpleNamespace(index=li, n_experts=src.shape.n_experts(li), top_k=stream.requests(li).shape[1])
              for li in sorted(k for k in stream.merged if k != "rows")]
    res = offload_tables(stream, layers, options, {"trace": str(src.path), "tokens": int(len(stream.token_rows()))},
                         None)
    res.tables.pop("offload_prefetch.csv")
    res.name = "offload_trace"
    res.meta.update(trace=src.describe(), left_out={
        "offload_prefetch": "the next-layer prediction needs a forward's hidden states",
        "expert_bytes, bytes_per_token": "an expert's bytes depend on the serving precision, not in a trace"})
    return _as_read(res, [src], len(stream.token_rows()), int(np.unique(stream.token_rows()).size), max_tokens)


# ----- fluctuation ------------------------------------------------------------------------------------------------
def fluctuation_from_traces(srcs: list[TraceSource], names: list[str], options: Any,
                            max_tokens: int | None) -> Result:
    """``fluctuation`` between recorded routings of the same tokens (the traces' (row, position) must agree, and
    their token ids where both have them), e.g. a model's routing at two training steps: per pair and layer the
    top-K change, overlap and Jaccard of :func:`.fluctuation.compute.compare` with its bootstrap intervals;
    top1_change only when every trace has gate weights (``moetool trace``: its columns ranked by selection score,
    the top-1 is the first chosen column -- a nonzero weight --, as :func:`moetool.ops.top1` reads a forward's;
    an engine's dump has no weights and its ids' order is not the router's ranking), entropies never (they need the router's probabilities)."""
    import pandas as pd


    streams = [token_stream(src, None, max_tokens, weights=True, use="the token-by-token comparison", token_ids=True)
               for src in srcs]
    layers = sorted(k for k in streams[0].merged if k != "rows")
    shape = {li: srcs[0].shape.moe[li] for li in layers}
    for name, src, st in zip(names[1:], srcs[1:], streams[1:]):
        if sorted(k for k in st.merged if k != "rows") != layers or not np.array_equal(st.keys, streams[0].keys):
            raise MoetoolError(f"--trace {name}: not the same tokens (rows, positions, MoE layers) as {names[0]}")
        other = {li: src.shape.moe[li] for li in layers}
        if other != shape:
            li = next(li for li in layers if other[li] != shape[li])
            raise MoetoolError(f"--trace {name}: another model's routing: layer {li} has {other[li][0]} experts, "
                               f"top-{other[li][1]}, {names[0]} {shape[li][0]} experts, top-{shape[li][1]}")
        same = [n for n, other in zip(names, srcs) if other is not src and other.path.resolve() == src.path.resolve()]
        if same:  # one file twice: its routing compared with itself, a table of zeros
            raise MoetoolError(f"--trace {name}: the same trace file as --trace {same[0]} ({src.path}): a routing "
                               f"compared with itself changes nothing; give the traces of different checkpoints or "
                               f"steps")
        k0, k = streams[0].requests(layers[0]).shape[1], st.requests(layers[0]).shape[1]
        if k != k0:  # e.g. a trace of --routing topk:1 beside the model's own top-2
            raise MoetoolError(f"--trace {name}: {k} expert column(s) per token (expert_1..expert_{k}), {names[0]} "
                               f"{k0}: compare traces of the same top-K")
        a, b = streams[0].token_ids, st.token_ids
        differ = np.flatnonzero((a >= 0) & (b >= 0) & (a != b))
        if len(differ):
            t = differ[0]
            raise MoetoolError(f"--trace {name}: not the same text as {names[0]}: row {int(st.keys[t] >> 32)}, "
                               f"position {int(st.keys[t] & 0xFFFFFFFF)} is token {int(b[t])} there, {int(a[t])} in "
                               f"{names[0]} ({len(differ):,} of {len(a):,} tokens differ)")
    top1 = all(st.weights is not None for st in streams)
    routings = []
    for st in streams:
        r = Routing(layers)
        per = []
        for li in layers:
            req = torch.from_numpy(st.requests(li))  # [T, K]
            if top1:  # a column at weight 0 (a top-p or capacity trace) is no chosen expert, as in a forward
                per.append(chosen_and_top1(req, torch.from_numpy(st.weights[li])))
            else:  # no top-1: its column is dropped
                per.append(torch.cat([req, torch.full((req.shape[0], 1), -1, dtype=torch.int64)], 1))
        r.spill.append(torch.stack(per).to(torch.int32))  # [L, T, K + 1], one batch
        r.spill.append(torch.from_numpy(st.token_rows()).to(torch.int32))
        r.tokens = int(len(st.token_rows()))
        routings.append(r)
    rows = []
    for i, j in pairs(names, options.reference):
        res = compare_with_intervals(routings[i], routings[j], options.bootstrap, options.seed)
        for li in layers:
            row = {"layer": li, "routing": "recorded", "reference": names[i], "checkpoint": names[j],
                   "tokens": res[li]["tokens"]}
            for rate in RATES:
                if rate == "top1_change" and not top1:
                    continue
                row.update({c: res[li][c] for c in (rate, f"{rate}_lo", f"{rate}_hi")})
            rows.append(row)
    df = pd.DataFrame(rows)
    left_out = {"entropy_ref, entropy_ckpt, entropy_ratio": NO_PROBS,
                "isolated rows": "--isolate feeds one checkpoint's inputs to another's routers: a forward"}
    if not top1:
        left_out["top1_change"] = ("the top-1 is the first chosen column of a moetool trace (ranked by selection "
                                   "score, weights marking the chosen): an engine's dump has no weights and its "
                                   "ids' order is not the router's ranking")
    summary = df.groupby(["reference", "checkpoint"], sort=False)[
        [c for c in ("top1_change", "topk_change", "jaccard") if c in df]].mean().reset_index().round(4)
    defs = {**{k: v for k, v in FLUCTUATION_DEFINITIONS.items() if k in df.columns or k == "top1"},
            "routing": "recorded: the routing each trace recorded, as it ran (no policy applied here; a trace of "
                       "moetool trace --routing POLICY recorded that policy's choice: traces[].routing names it)",
            "reference": "the trace compared with (--reference: previous, first or last of the traces given)",
            "checkpoint": "the trace whose recorded routing is compared with the reference's, on the same token ids"}
    n_rows = int(np.unique(streams[0].token_rows()).size)
    res = Result("fluctuation_trace", {"fluctuation.csv": df}, options,
                 meta=dict(traces=[s.describe() for s in srcs], left_out=left_out, definitions=defs,
                           bootstrap=bootstrap_meta(options.bootstrap, options.seed, n_rows)),
                 summary=summary)
    return _as_read(res, srcs, len(streams[0].token_rows()), n_rows, max_tokens)



# ----- one entry: moetool <experiment> --trace and moetool.from_trace ----------------------------------------------
#: the experiments with a --trace analysis, and the option fields that need a forward of the model (refused)
TRACE_EXPERIMENTS = {"stats": ("layers",), "placement": (), "offload": (), "fluctuation": ("routing", "isolate", "layers")}


def analyse(experiment: str, traces: list[Any], config: str | None, options: Any,
            max_tokens: int | None = None) -> tuple[Result, dict[str, Any] | None]:
    """``moetool <experiment> --trace ...`` (and :func:`moetool.from_trace`): the analysis of recorded routing with
    the options as the command applies them -- no intervals for stats and placement (one recorded routing, no
    resampling of rows), the recorded routing alone for fluctuation -> ``(Result, loads)``, ``loads`` the
    placement's (for ``--export``), else ``None``."""
    import dataclasses

    if experiment == "fluctuation":
        opts = FluctuationOptions(routing=("router",), reference=options.reference, bootstrap=options.bootstrap,
                                  seed=options.seed)
        return fluctuation_from_traces([open_trace(t, config) for t in traces], [str(t) for t in traces], opts,
                                       max_tokens), None
    src = open_trace(traces[0], config)
    if experiment == "stats":
        return stats_from_trace(src, dataclasses.replace(options, bootstrap=0)), None
    if experiment == "placement":
        return placement_from_trace(src, dataclasses.replace(options, bootstrap=0))
    if experiment == "offload":
        return offload_from_trace(src, options, max_tokens), None
    raise MoetoolError(f"'{experiment}' has no analysis of recorded routing (--trace): {', '.join(TRACE_EXPERIMENTS)}")
