"""The computation of ``moetool margin``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

# How (the command's --help above is this module's docstring):
# Per MoE layer, over the real tokens of the data with the model's own routing:
#
# * the margin: the gap between the K-th and the (K+1)-th largest selection score (``layer.selection_scores``: the
#   scores the model ranks experts by, correction bias included: softmax, sigmoid, or the logits themselves for a
#   top-K-then-softmax router such as gpt-oss's) of the captured logits;
#   its exact mean, its quantiles from a :class:`~moetool.sketch.QuantileSketch`, the share of tokens below each
#   threshold;
# * the flip rate under noise: the router input ``h`` perturbed as ``h + eps ||h|| z / sqrt(d)``, ``z ~ N(0, I)``
#   drawn per packed row from a generator seeded by (seed, layer, row) (the same ``z`` for every eps), the
#   layer's routing recomputed (``layer.route(layer.logits(h'))``) and compared with the same computation on ``h``:
#   the share of tokens whose top-K set changed and whose top-1 changed; per margin bin too;
# * the agreement with routing policies (``policies``: specs of :mod:`moetool.policies`): each policy's
#   ``select`` on the same routing event, as a side computation (the model still runs its own routing), against the
#   router's choice: the soft (weighted) Jaccard and the plain Jaccard of the chosen sets (:func:`jaccards`).
#
# Capture only: the forward itself is the model's (a consumer reads each routing event on the device, no host
# synchronisation). Intervals: document-level bootstrap over packed rows (:class:`~moetool.uncertainty.RowTable`).

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import torch

from ... import distributed, ops
from ...context import flag
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, check_policy, refuse_recomputed, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...policies import build_policy
from ...policies.base import number_text
from ...policies.basic import uniform_rows
from ...sketch import QuantileSketch
from ...uncertainty import RowTable, bootstrap_meta, fraction_text, ratio_intervals
from ..routing import data_name
from ..result import Result, resolve_options
from .spec import DEFAULT_EPS, DEFAULT_POLICIES, DEFAULT_THRESHOLDS, MarginOptions  # noqa: F401 - its options (declared with their flags in spec.py)

QUANTILES = (0.05, 0.5, 0.95)

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "tokens": "real (non-padding) tokens of the data routed by the layer",
    "margin": "s_(K) - s_(K+1): the K-th minus the (K+1)-th largest selection score of a token (the scores the "
              "model ranks experts by: layer.selection_scores of the captured router logits, correction bias "
              "included -- probabilities for softmax-then-top-K routers, sigmoids for DeepSeek-style ones, the "
              "logits themselves for top-K-then-softmax routers such as gpt-oss's; over all n experts, before any "
              "group limit); >= 0",
    "margin_mean": "mean margin over the real tokens (exact)",
    **{f"margin_p{q}": f"{name} percentile of the margin over the real tokens (QuantileSketch: within its relative "
                         f"error, sketch_rel_error in the manifest, of np.quantile)"
       for q, name in (("05", "5th"), ("50", "50th"), ("95", "95th"))},
    "frac_below_<thr>": "share of real tokens with margin < thr",
    "eps": "relative size of the noise on the router input: h' = h + eps * ||h|| * z / sqrt(d), z ~ N(0, I) "
           "seeded per (seed, layer, packed row), the same z for every eps; an eps whose h' (or ||h' - h||, or its "
           "router logits) overflows the router input's dtype (fp16's 65504: eps about 1e4) is refused",
    "noise_rel": "mean over real tokens of ||h' - h|| / ||h|| as applied: h' is formed in fp32 and rounded to h's "
                 "dtype (the router's input as the model computes it), so in bf16/fp16 a small eps partly rounds "
                 "away and noise_rel falls below eps (fp32: about eps)",
    "topk_flip": "share of real tokens whose top-K set under layer.route(layer.logits(h')) differs from the one "
                 "of layer.route(layer.logits(h))",
    "top1_flip": "share of real tokens whose top-1 (the chosen expert with the largest selection score) differs",
    "margin_lo": "lower edge of the margin bin [margin_lo, margin_hi) of margin_bins.csv (edges: 0, the thresholds, "
                 "inf); not an interval bound",
    "margin_hi": "upper edge (excluded) of the margin bin of margin_bins.csv; not an interval bound",
    "margin_bins.tokens": "real tokens of the layer whose margin falls in the bin",
    "margin_bins.topk_flip": "topk_flip among the tokens of the bin (NaN for an empty bin); no interval",
    "margin_bins.top1_flip": "top1_flip among the tokens of the bin (NaN for an empty bin); no interval",
    "policy": "routing policy spec (moetool.policies) whose choice, computed on the same routing event as a side "
              "computation (the model runs its own routing), is compared with the router's",
    "soft_jaccard": "mean over real tokens of sum_e min(w_r[e], w_p[e]) / sum_e max(w_r[e], w_p[e]) over the n "
                    "experts, w_r (router) and w_p (policy) each a token's weights over its chosen experts "
                    "normalised to sum 1 (0 on the others); 1 = same experts with the same weights",
    "jaccard": "mean over real tokens of |S_r ∩ S_p| / |S_r ∪ S_p|, S the experts a routing chose with non-zero "
               "weight (a policy's masked or dropped columns carry 0)",
    "margin_jaccard.tokens": "real tokens of the layer compared",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


def _thr(t: float) -> str:
    """The column of threshold ``t``, named by the number exactly (``:g`` named 0.05 and 0.0500001 both 0.05)."""
    return f"frac_below_{number_text(t)}"


def token_margins(layer: Any, logits: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32: the K-th minus the (K+1)-th largest selection score of each token."""
    top = torch.topk(layer.selection_scores(logits).float(), layer.top_k + 1, dim=-1).values
    return top[:, layer.top_k - 1] - top[:, layer.top_k]


def noise_directions(norm: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``||h|| * z / sqrt(d)`` (``[T, d]`` fp32; ``norm`` = ``||h||`` ``[T]``): the noise at eps = 1, formed once for
    every eps (:func:`noisy_inputs` then adds ``eps`` times it: one pass over ``[T, d]`` per eps)."""
    return z * (norm / math.sqrt(z.shape[-1])).unsqueeze(-1)


def noisy_inputs(hf: torch.Tensor, eps: float, unit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h + eps * ||h|| * z / sqrt(d)`` in fp32 (``hf``; ``unit`` from :func:`noise_directions`), rounded to the
    router's input ``dtype`` as it is stored (no fp32 copy of it first). An eps beyond fp32's largest number is
    inf there (torch refuses such an alpha): the noise overflows, as :class:`MarginCollector` reports."""
    alpha = eps if eps <= torch.finfo(torch.float32).max else math.inf
    return torch.add(hf, unit, alpha=alpha, out=torch.empty_like(hf, dtype=dtype))


def finite_eps(hf: torch.Tensor, unit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T]`` fp32: per token, an eps below which its noisy input ``h' = h + eps * unit`` (:func:`noisy_inputs`,
    rounded to ``dtype``) and ``||h' - h||`` (fp32 sums of squares) stay finite: each coordinate may move by
    ``finfo(dtype).max - h_j sign(unit_j)`` in the noise's direction, the distance up to ``sqrt`` of fp32's largest
    number; a thousandth under the smallest of these (inf where the noise is zero)."""
    a = unit.abs()
    room = torch.finfo(dtype).max - hf * torch.sign(unit)  # how far coordinate j may go along unit_j
    per = torch.where(a > 0, room / a, torch.full_like(a, math.inf)).amin(-1)
    dist = math.sqrt(torch.finfo(torch.float32).max) / ops.vector_norm(unit)
    return torch.minimum(per, dist) * (1 - 1e-3)


def eps_hint(eps: float, bound: float, passed: Sequence[float]) -> str:
    """What to use instead of ``eps``, whose noise overflowed: below ``bound`` (:func:`finite_eps`' smallest over the
    real tokens of every layer) every h' and its distance from h are finite, so ``bound`` rounded down to 2 digits
    where ``eps`` is past it; else the router logits overflowed first: the largest of ``passed`` (the run's eps that
    overflowed no token of the layer) below ``eps``, if any."""
    if eps > bound:
        e = 10.0 ** math.floor(math.log10(bound))
        return (f"h' and ||h' - h|| stay finite for every real token of every layer below eps {bound:.3g} "
                f"(computed from the data): use {flag('eps', f'{math.floor(bound / e * 10) * e / 10:g}')} or less")
    smaller = [e for e in passed if e < eps]
    passed_note = f" ({flag('eps', f'{max(smaller):g}')} of this run passed)" if smaller else ""
    return (f"h' stays finite up to eps {bound:.3g}, its router logits overflow earlier: use an {flag('eps')} below "
            f"{eps:g}{passed_note}")


def routing_of(layer: Any, h: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top-K set [T, K], top-1 [T])`` of the layer's routing recomputed from router inputs ``h``
    (``layer.route(layer.logits(h))``; the top-1 is the chosen expert with the largest selection score).
    ``finite`` (bool ``[T]``, optional) is and-ed in place with whether each token's logits are finite."""
    logits = layer.logits(h)
    if finite is not None:
        finite &= torch.isfinite(logits.reshape(finite.shape[0], -1)).all(-1).to(finite.device)
    idx, _ = layer.route(logits)
    return idx, ops.top1(idx, layer.selection_scores(logits))


def flips(clean: tuple[torch.Tensor, torch.Tensor], noisy: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_flip [T], top1_flip [T])`` bool between two :func:`routing_of` results."""
    return ~ops.same_set(clean[0], noisy[0]), clean[1] != noisy[1]


def weight_vectors(idx: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """``[T, n]`` fp32: each token's weights ``w [T, K]`` on its experts ``idx [T, K]``, normalised to sum 1 (0 on the
    experts not chosen; an all-zero row stays 0)."""
    dense = torch.zeros(idx.shape[0], n, dtype=torch.float32, device=idx.device)
    return ops.normalize(dense.scatter_add_(1, idx.long(), w.float().to(idx.device)))


def jaccards(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(soft [T], plain [T])`` float64 between two :func:`weight_vectors`: ``sum min / sum max`` (of the fp32
    weights) and ``|A ∩ B| / |A ∪ B|`` of their supports (0 where both are empty; a ratio of counts, exact in
    float64, 2/3 read 0.6666666865 in fp32)."""
    tiny = torch.finfo(torch.float32).tiny
    soft = torch.minimum(a, b).sum(-1) / torch.maximum(a, b).sum(-1).clamp_min(tiny)
    sa, sb = a > 0, b > 0
    plain = (sa & sb).sum(-1).double() / (sa | sb).sum(-1).clamp_min(1).double()
    return soft.double(), plain


def make_policies(specs: Sequence[str], moe_layers: Sequence[Any], layers: Sequence[Any], seed: int) -> list[Any]:
    """The policies of ``specs`` (seeded by ``seed``), each checked on ``layers`` (of the model's ``moe_layers``)
    before any forward as the engine checks an override; one line for a policy that needs attention probabilities (margin does not capture them)."""
    out = []
    for spec in specs:
        p = build_policy(spec, seed=seed)
        if p.needs_attention:
            raise MoetoolError(f"--policies: '{spec}' needs attention probabilities, which margin does not capture")
        check_policy(p, moe_layers, {L.index for L in layers})
        out.append(p)
    return out


class MarginCollector:
    """Forward consumer: margins (sketch, threshold counts), flips per eps (per-row sums for the bootstrap) and
    flips per margin bin, per MoE layer; device tensors only."""

    def __init__(self, tokens: Any, layers: Sequence[Any], opts: MarginOptions, policies: Sequence[Any] = ()):
        self.opts, self.layers, self.policies = opts, {L.index: L for L in layers}, list(policies)
        self.rows = RowTable(tokens)
        self.edges = torch.tensor(opts.thresholds, dtype=torch.float32, device="cpu")
        nb, E = len(opts.thresholds) + 1, len(opts.eps)
        self.sketch = {i: QuantileSketch() for i in self.layers}  # every positive fp32 gap up to 1e4
        # the sums start on the host and move to the router input's device at its first event (ops.to_device)
        self.bins = {i: torch.zeros(nb, 1 + 2 * E, dtype=torch.float64, device="cpu")
                     for i in self.layers}  # tokens, flips
        self.noise = {i: torch.zeros(E, dtype=torch.float64, device="cpu")
                      for i in self.layers}  # sum of ||h' - h|| / ||h||
        # real tokens whose noisy input overflowed (h' or ||h' - h|| or its logits not finite), per eps
        self.overflow = {i: torch.zeros(E, dtype=torch.float64, device="cpu") for i in self.layers}
        # the smallest finite_eps over the real tokens: the eps below which no noisy input overflows (the refusal's)
        self.bound = {i: torch.full((), math.inf, dtype=torch.float64, device="cpu") for i in self.layers}
        self.dtype: Any = None  # the router input's dtype (named when the noise overflows it)

    def before_batch(self, batch: Any) -> None:
        self.rows.next_batch(batch)

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        h = ev.h.reshape(-1, ev.h.shape[-1])
        logits = ev.logits.reshape(-1, ev.logits.shape[-1])
        valid = ev.valid.reshape(-1).to(h.device)
        w = valid.double()
        m = token_margins(L, logits).to(h.device)
        self.sketch[L.index].add(m, valid)
        self.edges = edges = ops.to_device(self.edges, m.device)  # once: a pageable copy would sync
        below = (m.unsqueeze(-1) < edges).double() * w.unsqueeze(-1)  # [T, thresholds]
        if ev.rows is None:
            raise MoetoolError("margin: the forward gave no packed-row ids (the noise is seeded per row)")
        z = uniform_rows(self.opts.seed, L.index, ev.rows, h.shape[0] // len(ev.rows), h.shape[-1], h.device,
                         draw=torch.randn)
        cols, rel = [], []
        hf = h.float()  # the noise's arithmetic is fp32 whatever the router's dtype; hf, unit read once per eps
        hnorm = ops.vector_norm(hf)
        unit = noise_directions(hnorm, z)
        del z
        safe = torch.where(valid, finite_eps(hf, unit, h.dtype), math.inf).amin().double()
        self.bound[L.index] = torch.minimum(ops.to_device(self.bound[L.index], h.device), safe)
        hnorm = hnorm.clamp_min(torch.finfo(torch.float32).tiny)
        clean = routing_of(L, h)
        self.dtype, over = h.dtype, []
        for eps in self.opts.eps:
            hn = noisy_inputs(hf, eps, unit, h.dtype)
            rel_t = ops.vector_norm(hn - hf) / hnorm  # as applied (after rounding); fp32
            finite = torch.isfinite(rel_t)  # h' overflowed, or its distance from h did
            k, one = flips(clean, routing_of(L, hn, finite))
            cols += [k.double() * w, one.double() * w]
            rel.append(rel_t.double() @ w)
            over.append((~finite).double() @ w)
        noise = self.noise[L.index] = ops.to_device(self.noise[L.index], h.device)
        noise += torch.stack(rel)
        overflow = self.overflow[L.index] = ops.to_device(self.overflow[L.index], h.device)
        overflow += torch.stack(over)
        fl = torch.stack(cols, -1)  # [T, 2E]
        self.rows.add(f"{L.index}/tokens", w)
        self.rows.add(f"{L.index}/below", below)
        self.rows.add(f"{L.index}/flips", fl)
        b = torch.bucketize(m, edges, right=True)  # [T] bin of [0, t1), [t1, t2), ..., [t_last, inf)
        per = torch.cat([w.unsqueeze(-1), fl], -1)
        acc = self.bins[L.index] = ops.to_device(self.bins[L.index], h.device)
        acc.index_add_(0, b, per)
        if self.policies:
            n = L.n_experts
            mine = weight_vectors(ev.idx.reshape(-1, ev.idx.shape[-1]), ev.weights.reshape(-1, ev.weights.shape[-1]), n)
            cols = []
            for p in self.policies:  # on a copy: a policy's notes (scores, extra) stay off the shared event
                pidx, pw = p.select(replace(ev, scores=None, extra={}))
                cols += list(jaccards(mine, weight_vectors(pidx, pw, n)))
            self.rows.add(f"{L.index}/jaccard", torch.stack(cols, -1).double() * w.unsqueeze(-1))

    def reduce_across_ranks(self) -> None:
        if distributed.world_size() <= 1:
            return
        for i in sorted(self.layers):
            distributed.all_reduce_state(self.sketch[i])
            self.bins[i] = distributed.all_reduce(self.bins[i])
            self.noise[i] = distributed.all_reduce(self.noise[i])
            self.overflow[i] = distributed.all_reduce(self.overflow[i])
            self.bound[i] = distributed.all_reduce(self.bound[i], "min")
        self.rows.reduce_across_ranks()

    def tables(self) -> tuple[Any, Any, Any]:
        import pandas as pd

        opts, nan = self.opts, float("nan")
        margins, flip_rows, bin_rows, jac_rows = [], [], [], []
        for i in sorted(self.layers):
            sk = self.sketch[i]
            tok = self.rows.table(f"{i}/tokens")
            n = float(tok.sum())
            if n == 0:
                raise MoetoolError(f"layer {i}: no real tokens (empty data or all padding)")
            below = self.rows.table(f"{i}/below").reshape(tok.shape[0], -1).sum(0)
            row = {"layer": i, "tokens": int(n), "margin_mean": sk.mean}
            row.update({f"margin_p{round(q * 100):02d}": sk.quantile(q) for q in QUANTILES})
            row.update({_thr(t): float(c) / n for t, c in zip(opts.thresholds, below)})
            margins.append(row)
            fl = self.rows.table(f"{i}/flips").reshape(tok.shape[0], -1)
            ci = ratio_intervals(fl, tok, n_boot=opts.bootstrap, seed=opts.seed)
            noise = self.noise[i].cpu().tolist()
            over = self.overflow[i].cpu().tolist()  # (the bound: every layer's, as --eps applies to all)
            for eps, bad in zip(opts.eps, over):
                if bad:  # a routing of inf / NaN inputs is no routing: its flips would read as a measurement
                    passed = [e for e, b in zip(opts.eps, over) if not b]
                    raise MoetoolError(f"{flag('eps', f'{eps:g}')}: the noisy router input h + eps ||h|| z / sqrt(d) "
                                       "overflows "
                                       f"{str(self.dtype).replace('torch.', '')} for {int(bad)} of layer {i}'s "
                                       f"{int(n)} real tokens (it, its distance from h or its router logits are "
                                       f"not finite): no routing to compare; "
                                       f"{eps_hint(eps, min(float(b) for b in self.bound.values()), passed)}")
            for j, eps in enumerate(opts.eps):
                k, one = ci[2 * j], ci[2 * j + 1]
                flip_rows.append({"layer": i, "eps": eps, "tokens": int(n), "noise_rel": noise[j] / n,
                                  "topk_flip": k.value, "topk_flip_lo": k.lo,
                                  "topk_flip_hi": k.hi, "top1_flip": one.value, "top1_flip_lo": one.lo,
                                  "top1_flip_hi": one.hi})
            acc = self.bins[i].cpu().numpy()
            edges = [0.0, *opts.thresholds, float("inf")]
            for j, eps in enumerate(opts.eps):
                for b in range(len(edges) - 1):
                    t = acc[b, 0]
                    bin_rows.append({"layer": i, "eps": eps, "margin_lo": edges[b], "margin_hi": edges[b + 1],
                                     "tokens": int(t), "topk_flip": acc[b, 1 + 2 * j] / t if t else nan,
                                     "top1_flip": acc[b, 2 + 2 * j] / t if t else nan})
            if self.policies:
                jac = self.rows.table(f"{i}/jaccard").reshape(tok.shape[0], -1)
                ci = ratio_intervals(jac, tok, n_boot=opts.bootstrap, seed=opts.seed)
                for j, spec in enumerate(opts.policies):
                    soft, plain = ci[2 * j], ci[2 * j + 1]
                    jac_rows.append({"layer": i, "policy": spec, "soft_jaccard": soft.value, "soft_jaccard_lo": soft.lo,
                                     "soft_jaccard_hi": soft.hi, "jaccard": plain.value, "jaccard_lo": plain.lo,
                                     "jaccard_hi": plain.hi, "tokens": int(n)})
        return pd.DataFrame(margins), pd.DataFrame(flip_rows), pd.DataFrame(bin_rows), pd.DataFrame(jac_rows)


def margin(lm: Any, tokens: Any, options: MarginOptions | None = None, *, quiet: bool = False,
           **overrides: Any) -> Result:
    """Routing margin and brittleness per MoE layer. Tables ``margin`` (margin mean, quantiles, shares below the
    thresholds), ``margin_flips`` (top-K and top-1 flip rates per eps with intervals) and ``margin_bins`` (flip
    rates per margin bin) and, with ``policies``, ``margin_jaccard`` (soft and plain Jaccard between the router and
    each policy per layer, with intervals); see :data:`DEFINITIONS`."""
    opts = resolve_options(MarginOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    refuse_recomputed(layers, "margin", lm.layers)
    for L in layers:
        if L.top_k >= L.n_experts:
            raise MoetoolError(f"layer {L.index}: routes all {L.n_experts} experts (K = n): no (K+1)-th score, "
                               "no margin")
    policies = make_policies(opts.policies, lm.layers, layers, opts.seed)
    shard = distributed.shard(tokens, opts.batch_size)
    col = MarginCollector(shard, layers, opts, policies)
    forward(lm, shard, consumers=[col], moe_layers=layers, batch_size=opts.batch_size, before_batch=col.before_batch,
            quiet=quiet, description="margin")  # the forward all-reduces the collector (reduce_across_ranks)
    df, fl, bins, jac = col.tables()
    summary = fl[["layer", "eps", "topk_flip", "top1_flip"]].merge(df[["layer", "margin_p50"]], on="layer")
    tables = {"margin.csv": df, "margin_flips.csv": fl, "margin_bins.csv": bins}
    if policies:
        tables["margin_jaccard.csv"] = jac
    return Result("margin", tables, opts,
                  meta=dict(definitions={**DEFINITIONS, **{_thr(t): f"share of real tokens with margin < {number_text(t)}"
                                                         for t in opts.thresholds}}, data=tokens.describe(), data_name=data_name(tokens.source),
                            layers=[L.index for L in layers], policies=[p.describe() for p in policies],
                            sketch_rel_error=col.sketch[layers[0].index].rel_error,
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, col.rows.n_rows)),
                  summary=summary)


def summary_lines(name: str, res: Result) -> list[str]:
    """One line: the median margin over layers, then the top-K flip rate at each eps (mean over layers), a fraction
    as in margin_flips.csv (:func:`~moetool.report.console.fraction_text`)."""
    df, fl = res["margin"], res["margin_flips"]
    parts = [f"eps {eps:g}: {fraction_text(g.topk_flip.mean())}" for eps, g in fl.groupby("eps")]
    return [f"margin {name}: median margin {df.margin_p50.median():.3g}; top-K flips " + ", ".join(parts)]
