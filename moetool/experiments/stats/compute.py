"""``stats``: how the model's own router uses its experts, per MoE layer, on ``--data``.

:func:`stats` is the experiment (options :class:`StatsOptions`, returns a :class:`~..result.Result`).
A :class:`RoutingStats` consumer rides on :func:`moetool.engine.forward` (no policy) and
reduces every :class:`~moetool.engine.RoutingEvent` on the layer's device into small per-layer
aggregates; padding never counts. At the end :meth:`RoutingStats.tables` turns them into the
tables below (one home for each definition: :data:`DEFINITIONS`, also written to the manifest).

Top tokens per expert need counts of (token id, expert) pairs. A dense ``[n, vocab]`` matrix per
layer does not scale (Qwen3-30B: 128 experts x 151k ids x 48 layers x 8 bytes = 7.4 GB), so the
pairs are counted exactly in a :class:`SparseCounter`: keys ``token_id * n + expert`` buffered on
the device and merged with ``torch.unique`` whenever the buffer outgrows the running table (between forwards:
a merge synchronises with the host), so
memory is proportional to the number of *distinct* pairs seen (at most ``min(n * vocab, tokens * K)``)
and the amortized cost is one sort per element. Where ``n * vocab`` is small (``sketch.dense_space``: Mixtral's
8 x 32,000) the same counter is one dense table per layer instead: ``index_add_``, no merge and no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ... import distributed, ops
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward, id_space
from ...errors import MoetoolError
from ...sketch import MERGE_MIN, SparseCounter, dense_space
from ...uncertainty import (RowTable, bootstrap_meta, format_ci, fraction_text, ratio_intervals,
                           sum_intervals, with_ci)
from ..result import Result, resolve_options
from .spec import StatsOptions  # noqa: F401 - its options (declared with their flags in spec.py)
from ..specialization import (COACTIVATION, CrossLayer, DEFINITIONS as SPECIALIZATION_DEFINITIONS, LoadBalance,
                             VocabSpecialization, _masked_keys, chosen, coactivation_counts, on_device, token_decoder,
                             top_per_group, with_tokens)

NO_DOMAIN = "(none)"
#: why coactivation.csv has no rows for a layer (the manifest's left_out, the summary's line): one expert per token
ONE_EXPERT = ("one expert per token (--top-k 1, or a top-1 router such as Switch Transformers' or Llama 4's): no pair "
              "of experts can co-activate")

DEFINITIONS = {
    "routing": "the model's own top-K (the router, no policy); only real (unpadded) tokens count",
    "load_fraction": "assignments of expert e / (K * tokens): fraction of all top-K assignments, sums to 1 "
                     "over experts; uniform routing gives 1/n",
    "token_fraction": "tokens whose top-K contains e / tokens: sums to K over experts; uniform routing gives K/n",
    "load.tokens": "number of tokens whose top-K contains the expert",
    "load_entropy": "entropy in nats of the load_fraction distribution (AoE Ent_load, eq. 7-8); "
                    "_norm divides by log n (1 = perfectly balanced)",
    "confidence_entropy": "mean over tokens of the entropy in nats of the token's full routing distribution "
                          "pi (AoE Ent_conf); _norm divides by log n (1 = uniform pi)",
    "max_load_ratio": "max over experts of load_fraction / (1/n)",
    "zero_compute_fraction": "layers with zero-computation (identity) experts only (LongCat-Flash): assignments to "
                             "them / (K * tokens), the fraction of routed assignments that take the zero-computation "
                             "route (output = input, no expert MLP); the sum of their load_fraction",
    "top_k": "top_k = None: each token's top-K as the model chose it; top_k = 1: only its first-ranked expert "
             "(OLMoE's *_top1 analyses); every table then counts K = 1",
    "first-ranked": "ranks within the top-K (top_k = 1, coactivation = adjacent, specialization) are the model's "
                    "selection order: the chosen expert with the largest selection score (the score it ranks "
                    "experts by, a correction bias included) first, as torch.topk(sorted=True) returns them, "
                    "whatever order the router returns its top-K in (DeepSeek-V3, GLM-4.5, LongCat and others use "
                    "topk(sorted=False))",
    "coactivation": "coactivation = all (default): count[a,b] = tokens whose top-K contains both a and b (a != b, "
                    "every ordered pair of the top-K); coactivation = adjacent: only experts at neighbouring ranks "
                    "(both orders), as OLMoE's heatmaps count (lower for K > 2); p_b_given_a = count[a,b] / tokens "
                    "whose top-K contains a (empty if none); independent uniform routing gives (K-1)/(n-1) for all",
    "domain_load": "load_fraction computed over the tokens of one domain (rows carry one domain each); "
                   "token_fraction = the domain's tokens whose top-K contains the expert / the domain's tokens "
                   "(K * load_fraction); uniform_token_fraction = K/n; tokens = the domain's tokens whose top-K "
                   "contains the expert",
    "expert_tokens": "expert_tokens.parquet (all_tokens): every (layer, expert, token_id) pair seen with its count "
                     "(occurrences of the token whose top-K contains the expert), not truncated",
    "expert_tokens.count": "occurrences (real tokens) of the token id whose top-K at this layer contains the expert, "
                           "over all the data (every pair seen: not truncated to top_tokens)",
    "top_tokens": "per expert, the token ids most often routed to it (ranked by count, ties by token id); "
                  "count = occurrences of the token whose top-K contains the expert; share = count / all "
                  "occurrences of the token (sums to K over experts)",
    "top_tokens_lift": "as top_tokens but ranked by lift = share / token_fraction(expert) = P(e|token) / P(e) "
                       "(1 = no preference; ties, e.g. tokens always routed to e, by count) among pairs with "
                       "count >= min_count",
    "layers.tokens": "real (unpadded) tokens the layer routed",
    "layers.top_k": "K: experts counted per token in the layer (the model's K; 1 with top_k = 1)",
    "coactivation.a/coactivation.b": "a: the conditioning expert, b: the other expert of the pair (both of the "
                                     "layer; every ordered pair a != b is a row)",
    "coactivation.count": "tokens whose top-K contains both a and b (coactivation = adjacent: with a and b at "
                          "neighbouring ranks); symmetric in a and b",
    "coactivation.p_b_given_a": "count / tokens whose top-K contains a: the fraction (0-1) of a's tokens that also "
                                "choose b (empty if no token chose a); independent uniform routing gives (K-1)/(n-1) "
                                "with coactivation = all",
    "domain_load.domain": "the domain of the rows counted (the JSONL domain of --data; (none): rows without one)",
    "domain_load.load_fraction": "the domain's assignments of expert e / (K * the domain's tokens): sums to 1 over "
                                 "experts per layer and domain",
    "domain_load.token_fraction": "the domain's tokens whose top-K contains e / the domain's real tokens (K * "
                                  "load_fraction): sums to K over experts",
    "uniform_token_fraction": "K/n: token_fraction under uniform routing (the same on every row of a layer), to "
                              "compare token_fraction with",
    "domain_load.tokens": "the domain's real tokens whose top-K contains the expert (a count)",
    "top_tokens.rank/top_tokens_lift.rank": "1 .. top_tokens within the expert: top_tokens by count, top_tokens_lift "
                                            "by lift (ties: count), then the lower token id",
    "top_tokens.count/top_tokens_lift.count": "occurrences (real tokens) of the token id whose top-K at this layer "
                                              "contains the expert",
    "share": "count / every real occurrence of the token id in the data: P(expert in top-K | token), a fraction "
             "0-1 that sums to K over the layer's experts",
    "lift": "share / token_fraction of the expert = P(e in top-K | token) / P(e in top-K): 1 = no preference, "
            "above 1 the token prefers the expert (at most 1 / token_fraction); ranked only among pairs with count "
            ">= min_count",
    "top_tokens.method": "exact counts of (token, expert) pairs in a sparse device table (torch.unique merges; "
                         "memory grows with distinct pairs, not with n * vocab), or a dense one where n * vocab is "
                         "small (moetool.sketch.dense_space): the same counts",
    "*_lo/*_hi": "95% document-level bootstrap interval over packed rows (moetool.uncertainty; bootstrap "
                 "replicates, seeded; all from the same row weights; NaN with bootstrap=0): percentile interval for "
                 "the ratios load.csv load_fraction and token_fraction and layers.csv confidence_entropy_norm; BCa "
                 "(bias-corrected and accelerated, jackknife over rows) for layers.csv load_entropy_norm and "
                 "max_load_ratio, because a max over experts and an entropy are biased under resampling (with "
                 "near-uniform routing the percentile interval of max_load_ratio can lie entirely above the "
                 "estimate); where BCa is degenerate the percentile interval is used, and these two intervals "
                 "are widened to include the estimate",
}


@dataclass
class LayerAccumulator:
    """Device aggregates of one MoE layer."""

    n: int
    k: int
    tokens: torch.Tensor  # [] int64 real tokens
    assign: torch.Tensor  # [n] float64 tokens whose top-K contains e
    conf_sum: torch.Tensor  # [] float64 sum over tokens of entropy(pi)
    co: torch.Tensor  # [n, n] float64 tokens whose top-K contains a and b (diagonal = assign)
    dom_assign: torch.Tensor  # [D, n] float64
    dom_tokens: torch.Tensor  # [D] float64
    pairs: SparseCounter | None  # keys token_id * n + expert

    @classmethod
    def empty(cls, n: int, k: int, n_domains: int, device: Any, pairs: bool, merge_min: int,
              space: int | None = None) -> "LayerAccumulator":
        z = dict(dtype=torch.float64, device=device)
        return cls(n, k, torch.zeros((), dtype=torch.long, device=device), torch.zeros(n, **z),
                   torch.zeros((), **z), torch.zeros(n, n, **z), torch.zeros(n_domains, n, **z),
                   torch.zeros(n_domains, **z),
                   SparseCounter(merge_min, defer=True, space=space) if pairs else None)


class RoutingStats:
    """Consumer for :class:`Engine`: ``begin_batch(batch)`` before each forward, then the events reduce."""

    def __init__(self, layers: list[Any], domains: list[str] = (), top_tokens: bool = True,
                 merge_min: int = MERGE_MIN, top_k: int | None = None, coactivation: str = "all",
                 rows: Any = None, vocab: int | None = None):
        self.layers = {L.index: L for L in layers}
        self.vocab = vocab  # a bound on the token ids (runner.id_space): small key spaces are counted densely
        self.rows = rows  # uncertainty.RowTable: per packed row "tokens", "assign<layer>" [n], "conf<layer>"
        names = sorted(set(domains))
        if "" in names and NO_DOMAIN in names:  # both would be rows labelled NO_DOMAIN, told apart by nothing
            raise MoetoolError(f"the data has text without a domain and text whose domain is '{NO_DOMAIN}', the "
                               f"label domain_load.csv gives text without one: rename that domain")
        self.domains = [d or NO_DOMAIN for d in names] if any(names) else []  # no domain split without labels
        self._dom_id = {d: i for i, d in enumerate(names)} if self.domains else {}
        self.top_tokens = top_tokens
        self.top_k = top_k
        if coactivation not in COACTIVATION:
            raise MoetoolError(f"--coactivation must be one of {', '.join(COACTIVATION)}, got '{coactivation}'")
        self.coactivation = coactivation
        self.merge_min = merge_min
        self.acc: dict[int, LayerAccumulator] = {}
        self.token_totals = SparseCounter(merge_min, space=dense_space(vocab, 1))  # keys: token ids (real tokens)
        self._batch: dict[str, Any] | None = None

    def begin_batch(self, batch: Any) -> Any:
        """Register the token ids and row domains of the next forward (``TokenBatch``); returns it."""
        ids, mask = batch.input_ids, batch.attention_mask  # [B, S]
        try:
            dom = torch.tensor([self._dom_id[d] for d in batch.domains], device="cpu") if self.domains else None  # [B]
        except KeyError as e:
            raise MoetoolError(f"domain {e} was not declared to RoutingStats") from None
        self._batch = {"shape": tuple(ids.shape), "ids": ids.reshape(-1),
                       "dom": None if dom is None else dom.repeat_interleave(ids.shape[1]), "on": {}}
        if self.top_tokens:
            self.token_totals.add(ids[mask.bool()])
        for a in self.acc.values():  # the last forward's (token, expert) keys: merged now, outside the forward
            if a.pairs is not None:
                a.pairs.settle()
        if self.rows is not None:
            self.rows.next_batch(batch)
            self.rows.add("tokens", mask.sum(1))
        return batch

    def _on(self, key: str, device: Any) -> torch.Tensor:
        return on_device(self._batch, key, device)

    def __call__(self, ev: RoutingEvent) -> None:
        L, (B, S) = ev.layer, ev.shape
        if self._batch is None or self._batch["shape"] != (B, S):
            raise MoetoolError("RoutingStats: call begin_batch(batch) before each forward")
        n, dev = L.n_experts, ev.idx.device
        a = self.acc.get(L.index)
        idx = chosen(ev, self.top_k, ranked=self.coactivation == "adjacent").long()  # [T, K] (or first-ranked)
        if a is None:
            vocab = getattr(self, "vocab", None)  # (a state saved before it existed: sparse)
            space = dense_space(None if vocab is None else vocab * n, len(self.layers))
            a = self.acc[L.index] = LayerAccumulator.empty(n, idx.shape[-1], len(self.domains), dev,
                                                          self.top_tokens, self.merge_min, space)
        # padding is weighted out (never indexed away: no device sync inside the forward)
        valid = ev.valid.to(dev)  # [T]
        a.tokens += valid.sum()
        a.assign += ops.one_hot_counts(idx, n, valid)
        conf = ops.entropy(ev.probs.to(dev)).double() * valid  # [T]
        a.conf_sum += conf.sum()
        if self.rows is not None:
            self.rows.add_counts(f"assign{L.index}", idx, n, valid)
            self.rows.add(f"conf{L.index}", conf)
        a.co += coactivation_counts(idx, n, valid, self.coactivation)  # [n, n]
        if self.domains:
            d = self._on("dom", dev)  # [T] domain of each token
            D = len(self.domains)
            w = valid.double()
            a.dom_assign += torch.zeros(D * n, dtype=torch.float64, device=dev).index_add_(
                0, (d.unsqueeze(1) * n + idx).reshape(-1), w.unsqueeze(1).expand(idx.shape).reshape(-1)).view(D, n)
            a.dom_tokens += torch.zeros(D, dtype=torch.float64, device=dev).index_add_(0, d, w)
        if a.pairs is not None:
            tok = self._on("ids", dev).unsqueeze(1).expand(idx.shape)  # [T, K]
            a.pairs.add(_masked_keys(tok, idx, n, valid.unsqueeze(1).expand(idx.shape)))

    def reduce_across_ranks(self) -> None:
        """Data parallel: every rank's layer sums all-reduced, the sparse token counts merged (rows of a rank
        count once); alone a no-op. The row table is reduced by its owner (``collect``)."""
        if distributed.world_size() <= 1:
            return
        dense = distributed.all_reduce_keyed({li: {"tokens": a.tokens, "assign": a.assign, "conf_sum": a.conf_sum,
                                                   "co": a.co, "dom_assign": a.dom_assign,
                                                   "dom_tokens": a.dom_tokens, "n": a.n, "k": a.k}
                                              for li, a in self.acc.items()})
        sparse = distributed.gather_object({"tokens": self.token_totals.host_state(),
                                            **{li: a.pairs.host_state() for li, a in self.acc.items()
                                               if a.pairs is not None}})
        self.token_totals = SparseCounter.merged([p["tokens"] for p in sparse], self.merge_min)
        self.acc = {li: LayerAccumulator(d["n"], d["k"], d["tokens"], d["assign"], d["conf_sum"], d["co"],
                                         d["dom_assign"], d["dom_tokens"],
                                         SparseCounter.merged([p[li] for p in sparse if li in p], self.merge_min)
                                         if self.top_tokens else None)
                    for li, d in dense.items()}

    def intervals(self, n_boot: int, seed: int = 0) -> tuple[Any, Any]:
        """Bootstrap intervals from the per-row sums: ``(load, layers)`` frames keyed by layer (and expert) with
        ``load_fraction``/``token_fraction`` and ``load_entropy_norm``/``confidence_entropy_norm``/``max_load_ratio``
        ``_lo``/``_hi`` columns (every statistic from the same row weights: same seed, same rows)."""
        import numpy as np
        import pandas as pd

        tokens = self.rows.table("tokens")  # [rows]
        kw = dict(n_boot=n_boot, seed=seed)  # one row: no interval (uncertainty.replicates)
        load, layers = [], []
        for li in sorted(self.acc):
            n = self.acc[li].n
            assign = self.rows.table(f"assign{li}").reshape(tokens.shape[0], n)  # [rows, n]
            lf = ratio_intervals(assign, assign.sum(1), **kw)
            tf = ratio_intervals(assign, tokens, **kw)
            row = {"layer": li}
            load.append({"layer": np.full(n, li, dtype=np.int64), "expert": np.arange(n, dtype=np.int64),
                         **{f"{name}_{end}": np.array([getattr(i, end) for i in ci], dtype=np.float64)
                            for name, ci in (("load_fraction", lf), ("token_fraction", tf)) for end in ("lo", "hi")}})

            def shape(s: np.ndarray, n: int = n) -> np.ndarray:  # summed counts [..., n] -> [..., 2]
                frac = s / s.sum(-1, keepdims=True)
                ent = ops.entropy(torch.from_numpy(frac)).double().numpy()
                return np.stack([ent / math.log(n), frac.max(-1) * n], -1)

            ent, mx = sum_intervals(assign, shape, method="bca", **kw)  # biased under resampling: BCa
            conf = ratio_intervals(self.rows.table(f"conf{li}"), tokens, transform=lambda x, n=n: x / math.log(n),
                                   **kw)[0]
            for name, ci in (("load_entropy_norm", ent), ("max_load_ratio", mx), ("confidence_entropy_norm", conf)):
                row.update({f"{name}_lo": ci.lo, f"{name}_hi": ci.hi})
            layers.append(row)
        return _frame(load), pd.DataFrame(layers)

    def pair_counts(self) -> Any:
        """Every (layer, expert, token_id) pair seen with its count (all layers, sorted), not truncated."""
        import pandas as pd

        frames = []
        for li in sorted(self.acc):
            a = self.acc[li]
            pk, pc = (t.cpu().numpy() for t in a.pairs.result())
            keep = pk >= 0
            frames.append(pd.DataFrame({"layer": li, "expert": pk[keep] % a.n, "token_id": pk[keep] // a.n,
                                        "count": pc[keep]}).sort_values(["expert", "token_id"], kind="stable"))
        return pd.concat(frames, ignore_index=True)

    # ----- tables ------------------------------------------------------------------------
    def tables(self, tokenizer: Any = None, top_n: int = 10, min_count: int = 5) -> dict[str, Any]:
        """``{csv name: DataFrame}`` with exactly the documented columns (numpy columns per layer, one DataFrame
        per table)."""
        import numpy as np
        import pandas as pd

        missing = sorted(set(self.layers) - set(self.acc))
        if missing:
            raise MoetoolError(f"no routing events from MoE layers {missing}: nothing ran through them")
        load, layers, co, dom, top, lift = [], [], [], [], [], []
        tok_keys, tok_counts = (t.cpu().numpy() for t in self.token_totals.result())
        decode = token_decoder(tokenizer)
        for li in sorted(self.acc):
            a = self.acc[li]
            tokens = int(a.tokens)
            if tokens == 0:
                raise MoetoolError(f"layer {li}: no real tokens (empty data or all padding)")
            n, k = a.n, a.k
            assign = a.assign.cpu()  # [n]
            frac = assign / assign.sum()  # [n] float64, sums to 1
            load.append({"layer": np.full(n, li, dtype=np.int64), "expert": np.arange(n, dtype=np.int64),
                         "load_fraction": frac.numpy(), "token_fraction": (assign / tokens).numpy(),
                         "tokens": assign.long().numpy()})
            ent, conf = float(ops.entropy(frac)), float(a.conf_sum) / tokens
            layers.append({"layer": li, "n_experts": n, "top_k": k, "tokens": tokens, "load_entropy": ent,
                           "load_entropy_norm": ent / math.log(n), "confidence_entropy": conf,
                           "confidence_entropy_norm": conf / math.log(n), "max_load_ratio": float(frac.max()) * n})
            layers[-1].update(zero_compute_column(frac, getattr(self.layers.get(li), "n_zero_compute", 0)))
            if k >= 2:  # (ONE_EXPERT: a table of zeros otherwise)
                co.append(_coactivation_arrays(li, a.co.cpu()))
            if self.domains:
                dom += _domain_arrays(li, a, self.domains)
            if a.pairs is not None:
                pairs = _pair_arrays(li, a, tok_keys, tok_counts)
                top.append(_rank_arrays(pairs, "count", top_n))
                lift.append(_rank_arrays(_rows(pairs, pairs["count"] >= min_count), "lift", top_n))
        out = {"load.csv": _frame(load), "layers.csv": pd.DataFrame(layers),
               "coactivation.csv": _frame(co) if co else pd.DataFrame()}
        if dom:
            out["domain_load.csv"] = _frame(dom)
        if top:
            cols = ["layer", "expert", "rank", "token_id", "token", "count", "share"]
            out["top_tokens.csv"] = with_tokens(_frame(top), decode)[cols]
            out["top_tokens_lift.csv"] = with_tokens(_frame(lift), decode)[cols + ["lift"]]
        return out


def zero_compute_column(frac: torch.Tensor, z: int) -> dict[str, float]:
    """``{"zero_compute_fraction": ...}`` of a layer whose last ``z`` experts compute nothing (LongCat-Flash's identity
    experts): how often its routing takes that route, the sum of their load fractions ``frac [n]``; ``{}`` when
    ``z`` is 0 (the column exists only for such layers)."""
    return {"zero_compute_fraction": float(frac[frac.shape[0] - z:].sum())} if z else {}


def _frame(parts: list[dict[str, Any]]) -> Any:
    """One DataFrame of the column arrays of ``parts`` (the same columns each), in order: what ``pd.concat`` of
    their frames with ``ignore_index`` gives, without a frame per part."""
    import numpy as np
    import pandas as pd

    return pd.DataFrame({c: np.concatenate([p[c] for p in parts]) if not isinstance(parts[0][c], list)
                         else [x for p in parts for x in p[c]] for c in parts[0]})


def _rows(cols: dict[str, Any], keep: Any) -> dict[str, Any]:
    """The rows ``keep`` (a boolean mask or positions) of every column array."""
    return {c: v[keep] for c, v in cols.items()}


def _domain_arrays(layer: int, a: LayerAccumulator, domains: list[str]) -> list[dict[str, Any]]:
    """The ``domain_load`` columns of each domain that has tokens."""
    import numpy as np

    da = a.dom_assign.cpu()  # [D, n]
    dl = da / da.sum(-1, keepdim=True)  # [D, n] float64, rows sum to 1
    dt = a.dom_tokens.cpu()
    return [{"layer": np.full(a.n, layer, dtype=np.int64), "domain": [name] * a.n,
             "expert": np.arange(a.n, dtype=np.int64), "load_fraction": dl[di].numpy(),
             "token_fraction": (da[di] / dt[di]).numpy(), "uniform_token_fraction": np.full(a.n, a.k / a.n),
             "tokens": da[di].long().numpy()}
            for di, name in enumerate(domains) if dt[di] > 0]


def _pair_arrays(layer: int, a: Any, tok_keys: Any, tok_counts: Any) -> dict[str, Any]:
    """Every (expert, token id) pair seen (sorted by token id, then expert): count, share of the token's
    occurrences, lift -- numpy columns."""
    import numpy as np

    pk, pc = (t.cpu().numpy() for t in a.pairs.result())
    keep = pk >= 0  # -1 = padding
    pk, pc = pk[keep], pc[keep]
    expert, token_id = pk % a.n, pk // a.n
    share = pc / tok_counts[tok_keys.searchsorted(token_id)]  # count / occurrences of the token
    token_fraction = (a.assign.cpu() / int(a.tokens)).numpy()  # [n]
    return {"layer": np.full(len(pk), layer, dtype=np.int64), "expert": expert, "token_id": token_id, "count": pc,
            "share": share, "lift": share / token_fraction[expert]}


def _pair_frame(layer: int, a: Any, tok_keys: Any, tok_counts: Any) -> Any:
    """:func:`_pair_arrays` as a DataFrame."""
    import pandas as pd

    return pd.DataFrame(_pair_arrays(layer, a, tok_keys, tok_counts))


def _coactivation_arrays(layer: int, co: torch.Tensor) -> dict[str, Any]:
    """Ordered pairs a != b of a ``[n, n]`` co-count matrix whose diagonal holds the tokens choosing a."""
    import numpy as np

    n = co.shape[0]
    chose = co.diagonal()  # [n]
    p = co / chose.unsqueeze(1)  # [n, n] row a: P(b | a); nan where nobody chose a
    a, b = torch.meshgrid(torch.arange(n, device="cpu"), torch.arange(n, device="cpu"), indexing="ij")
    off = a != b
    return {"layer": np.full(n * (n - 1), layer, dtype=np.int64), "a": a[off].numpy(), "b": b[off].numpy(),
            "p_b_given_a": p[off].numpy(), "count": co[off].long().numpy()}


def _coactivation_frame(layer: int, co: torch.Tensor) -> Any:
    """:func:`_coactivation_arrays` as a DataFrame."""
    return _frame([_coactivation_arrays(layer, co)])


def _rank_arrays(pairs: dict[str, Any], by: str, top_n: int) -> dict[str, Any]:
    """The ``top_n`` rows per expert by ``by`` (descending; ties by count, then token id), with ``rank`` 1..N."""
    keys = [by] + (["count"] if by != "count" else [])
    pos, rank = top_per_group(pairs["expert"], [(pairs[k], True) for k in keys] + [(pairs["token_id"], False)],
                              top_n)
    return {**_rows(pairs, pos), "rank": rank}


def _rank(pairs: Any, by: str, top_n: int) -> Any:
    """:func:`_rank_arrays` of a DataFrame of pairs."""
    return _frame([_rank_arrays({c: pairs[c].to_numpy() for c in pairs.columns}, by, top_n)])


# ----- the experiment ----------------------------------------------------------------------------
@dataclass
class Collected:
    """The consumers of one ``stats`` forward: :class:`RoutingStats` and the OLMoE-style analyses."""

    routing: RoutingStats
    load_balance: LoadBalance
    cross_layer: CrossLayer
    vocab: VocabSpecialization | None

    def tables(self, tokenizer: Any = None, top_n: int = 10, min_count: int = 10,
               all_tokens: bool = False) -> dict[str, Any]:
        """Every table of :func:`stats` (``{file name: DataFrame}``)."""
        out = self.routing.tables(tokenizer, top_n=top_n, min_count=min_count)
        experts, per_layer = self.load_balance.tables()
        load = joined(out["load.csv"], experts.drop(columns="token_fraction"), ["layer", "expert"])
        out["load.csv"] = load[["layer", "expert", "load_fraction", "token_fraction", "router_prob", "tokens"]]
        out["layers.csv"] = joined(out["layers.csv"], per_layer, ["layer"])
        out.update(self.cross_layer.tables())
        if self.vocab is not None:
            out.update(self.vocab.tables(tokenizer, min_count=min_count, top_n=max(top_n, 1)))
        if all_tokens:
            out["expert_tokens.parquet"] = self.routing.pair_counts()
        return out


def collect(lm: Any, tokens: Any, *, top_tokens: bool = True, batch_size: int = 8, quiet: bool = False,
            merge_min: int = MERGE_MIN, top_k: int | None = None, coactivation: str = "all",
            specialization: bool = True, row_sums: bool = False, units: Any = None,
            layers: tuple[int, ...] | None = None) -> Collected:
    """Forward ``tokens`` through ``lm`` with every ``stats`` consumer attached (one forward). ``row_sums``: keep
    per-packed-row sums for bootstrap intervals (``routing.rows``, a :class:`moetool.uncertainty.RowTable`).
    ``units`` (:class:`moetool.checkpoints.Units`, ``--resume``): the consumers' state after a batch is saved
    now and then (:meth:`~moetool.checkpoints.Units.due`) and after the last one; a saved state is restored
    and the forward goes on from the next batch (the same sums in the same order: the same tables). ``layers``:
    only these MoE layers are hooked and measured (cross-layer pairs: those consecutive in the model)."""
    chosen = layers
    layers = list(lm.layers) if chosen is None else select_layers(lm.layers, chosen)
    shard = distributed.shard(tokens, batch_size)  # alone: the same rows, numbered (the row table's ids)
    rows = RowTable(shard) if row_sums else None
    vocab = id_space(lm.model)  # (token id, expert) keys below vocab x n: a small space is counted densely
    c = Collected(RoutingStats(layers, tokens.domains, top_tokens=top_tokens, merge_min=merge_min, top_k=top_k,
                               coactivation=coactivation, rows=rows, vocab=vocab),
                  LoadBalance(layers, top_k=top_k), CrossLayer(layers, top_k=top_k, model_layers=list(lm.layers)),
                  VocabSpecialization(layers, merge_min=merge_min, vocab=vocab) if specialization else None)
    saved = units.load("batches", refs=layers) if units is not None else None
    start = 0 if saved is None else saved["next_batch"]
    if saved is not None:
        c = saved["state"]
    starters = [x for x in (c.routing, c.cross_layer, c.vocab) if x is not None]
    n_rows, done = shard.input_ids.shape[0], [start * batch_size]  # rows: a backed-off batch runs in parts

    def before(batch: Any) -> None:
        for x in starters:
            x.begin_batch(batch)

    def after(batch: Any, output: Any) -> None:
        if c.vocab is not None:
            c.vocab.on_batch(batch, output)
        done[0] += batch.input_ids.shape[0]
        batch_end = done[0] % batch_size == 0 or done[0] == n_rows
        if units is not None and batch_end and (units.due() or done[0] == n_rows):
            units.save("batches", {"next_batch": -(-done[0] // batch_size), "state": c}, refs=layers)

    forward(lm, shard, consumers=[x for x in (c.routing, c.load_balance, c.cross_layer, c.vocab) if x is not None],
            batch_size=batch_size, before_batch=before, on_batch=after, description="stats", quiet=quiet,
            start_batch=start, moe_layers=None if chosen is None else layers)
    if c.routing.rows is not None:
        c.routing.rows.reduce_across_ranks()
    return c


def stats(lm: Any, tokens: Any, options: StatsOptions | None = None, *, quiet: bool = False,
          units: Any = None, **overrides: Any) -> Result:
    """How the model's own router uses its experts, per MoE layer, on ``tokens``.

    Tables (see :data:`DEFINITIONS`): ``load`` (layer, expert, load_fraction, token_fraction, router_prob, tokens),
    ``layers`` (layer, n_experts, top_k, tokens, load_entropy[_norm], confidence_entropy[_norm], max_load_ratio,
    aux_loss, aux_loss_hf_pooled), ``coactivation`` (layer, a, b, p_b_given_a, count), ``cross_layer`` and
    ``cross_layer_summary``, ``specialization`` and ``specialized_tokens``, ``domain_load`` (when rows carry
    domains), ``top_tokens`` and ``top_tokens_lift`` (unless ``top_tokens=0``), ``expert_tokens.parquet``
    (``all_tokens``). Padding never counts. ``units``: batch checkpoints for ``--resume`` (:func:`collect`).
    """
    opts = resolve_options(StatsOptions, options, overrides)
    require_tokens(tokens)
    acc = collect(lm, tokens, top_tokens=opts.top_tokens > 0 or opts.all_tokens, batch_size=opts.batch_size,
                  quiet=quiet, top_k=opts.top_k, coactivation=opts.coactivation, specialization=opts.specialization,
                  row_sums=opts.bootstrap > 0, units=units, layers=opts.layers)
    frames = acc.tables(lm.tokenizer, top_n=opts.top_tokens, min_count=opts.min_count, all_tokens=opts.all_tokens)
    frames["load.csv"], frames["layers.csv"] = with_intervals(acc.routing, frames["load.csv"], frames["layers.csv"],
                                                              opts.bootstrap, opts.seed)
    if opts.top_tokens == 0:
        for name in ("top_tokens.csv", "top_tokens_lift.csv", "specialized_tokens.csv"):
            frames.pop(name, None)
    tables = {name: df for name, df in frames.items() if len(df)}
    single = frames["layers.csv"].loc[frames["layers.csv"]["top_k"] < 2, "layer"].tolist()
    left_out = {f"coactivation.csv rows of layers {single}": ONE_EXPERT} if single else {}
    routing = "router (the model's own top-K)" if opts.top_k is None else "router, first-ranked expert only (top-1)"
    return Result("stats", tables, opts, meta=dict(data=tokens.describe(),
                                                   definitions={**DEFINITIONS, **SPECIALIZATION_DEFINITIONS},
                                                   routing=routing,
                                                   bootstrap=bootstrap_meta(
                                                       opts.bootstrap, opts.seed, tokens.input_ids.shape[0],
                                                       "percentile interval; BCa for max_load_ratio and "
                                                       "load_entropy_norm (biased under resampling)"),
                                                   **({"left_out": left_out} if left_out else {})),
                  summary=summary_table(tables["layers.csv"]))


#: columns of load.csv / layers.csv that get ``_lo``/``_hi`` (placed right after them)
LOAD_CI = ("load_fraction", "token_fraction")
LAYERS_CI = ("load_entropy_norm", "confidence_entropy_norm", "max_load_ratio")


def with_intervals(routing: RoutingStats, load: Any, layers: Any, n_boot: int, seed: int) -> tuple[Any, Any]:
    """``load`` and ``layers`` with the ``_lo``/``_hi`` columns of :data:`LOAD_CI` / :data:`LAYERS_CI` beside
    their values (NaN when ``n_boot`` is 0)."""
    if n_boot and routing.rows is not None:
        ci_load, ci_layers = routing.intervals(n_boot, seed)
        load = joined(load, ci_load, ["layer", "expert"])
        layers = joined(layers, ci_layers, ["layer"])
    for df, cols in ((load, LOAD_CI), (layers, LAYERS_CI)):
        for c in cols:
            for end in ("_lo", "_hi"):
                if c + end not in df.columns:
                    df[c + end] = float("nan")
    order = lambda df, cols: [x for c in df.columns if not c.endswith(("_lo", "_hi"))
                              for x in ([c, c + "_lo", c + "_hi"] if c in cols else [c])]
    return load[order(load, LOAD_CI)], layers[order(layers, LAYERS_CI)]


def joined(left: Any, right: Any, on: list[str]) -> Any:
    """``left.merge(right, on=on, how="left")``: where both hold the same keys in the same order (one row each, as
    the per-layer and per-expert tables of one run do), ``right``'s other columns are set on ``left`` instead (the
    same frame, no join)."""
    import numpy as np

    if len(left) != len(right) or not all(np.array_equal(left[c].to_numpy(), right[c].to_numpy()) for c in on) \
            or left.duplicated(on).any() or set(left.columns) & (set(right.columns) - set(on)):
        return left.merge(right, on=on, how="left")
    out = left.copy(deep=False)
    for c in right.columns:
        if c not in on:
            out[c] = right[c].to_numpy()
    return out


def summary_table(layers: Any) -> Any:
    """``layers.csv`` with short headings, for the console (``value ± half-width`` where intervals exist)."""
    cols = ["layer", "n_experts", "top_k", "tokens"] + [x for c in LAYERS_CI for x in (c, c + "_lo", c + "_hi")]
    return with_ci(layers[cols]).rename(columns={
        "n_experts": "n", "top_k": "K", "load_entropy_norm": "Ent_load/log n",
        "confidence_entropy_norm": "Ent_conf/log n", "max_load_ratio": "max load/uniform"})


def summary_lines(name: str, res: Any) -> list[str]:
    """Short human-readable lines about one model's run: ``layers.csv``, then :func:`analysis_lines` (a trace's
    statistics hold no confidence entropy: a trace keeps the chosen experts' weights, not every score)."""
    layers = res["layers"]
    worst = layers.loc[layers["max_load_ratio"].idxmax()]
    confidence = (f", confidence entropy / log n {layers['confidence_entropy_norm'].min():.3f}-"
                  f"{layers['confidence_entropy_norm'].max():.3f}" if "confidence_entropy_norm" in layers else "")
    return [f"stats {name}: load entropy / log n {layers['load_entropy_norm'].min():.3f}-"
            f"{layers['load_entropy_norm'].max():.3f}{confidence} over "
            f"{len(layers)} MoE layers; max load "
            f"{format_ci(worst['max_load_ratio'], worst.get('max_load_ratio_lo'), worst.get('max_load_ratio_hi'))}x "
            f"uniform (layer {int(worst['layer'])})"] + analysis_lines(name, res)


def analysis_lines(name: str, res: Any) -> list[str]:
    """Specialisation per view and cross-layer mutual information, one line each (shares and probabilities as
    fractions, as specialization.csv and cross_layer_summary.csv)."""
    out = []
    if "specialization.csv" in res:
        sp = res["specialization"]
        least = getattr(res.options, "min_count", None)

        def span(s: Any) -> str:  # no layer with a token id seen min_count times: said, not "nan-nan"
            s = s.dropna()
            return (f"{fraction_text(s.min(), 2)}-{fraction_text(s.max(), 2)}" if len(s) else
                    f"none (no token id seen {least} times)" if least else "none")

        views = ", ".join(f"{v} {span(g['specialization'])}" for v, g in sp.groupby("view", sort=False))
        out.append(f"stats {name}: vocabulary specialisation (first-ranked expert) over layers: {views}")
    if "cross_layer_summary.csv" in res:
        cl = res["cross_layer_summary"]
        out.append(f"stats {name}: consecutive layers: mutual information {cl['mutual_information'].min():.3f}-"
                   f"{cl['mutual_information'].max():.3f} nats, mean max P(b|a) "
                   f"{fraction_text(cl['mean_max_p'].mean(), 2)} "
                   f"(uniform {fraction_text(cl['uniform_max_p'].iloc[0])})")
    for what, why in (getattr(res, "meta", None) or {}).get("left_out", {}).items():
        out.append(f"stats {name}: left out: {what} ({why})")
    return out
