"""``mass-recall``: how much routing mass an inverted-index (IVF) router keeps (AIR-MoE).

Per MoE layer and codebook size ``G``, a codebook of unit codewords is fitted on the router inputs
``h`` by streaming adaptive spherical k-means (:mod:`..kmeans`; pass 1, plus ``kmeans_iters`` extra
passes over the data); pass 2 evaluates, for every shortlist size ``M`` and expert-centroid mode:

* ``c(h) = argmax_g cos(h, c_g)``; shortlist ``L(c_g)`` = the M experts ranked highest at the codeword;
* ``MassRecall(h) = Σ_{e∈L(c(h))} π_e(h)`` (computed as ``1 − Σ_{e∉L} π_e(h)`` in fp64: exactly 1 when
  ``M = n`` and never smaller for a larger M); top-K recall ``|TopK(h) ∩ L| / K``; exact-top-K rate =
  fraction of tokens with ``TopK(h) ⊆ L`` (then the top-K inside the shortlist is the global top-K);
* ``ε(h) = ||h − c(h)||`` (the raw router input against the unit codeword), ``ρ_M(c) = Σ_{e∈L(c)} π_e(c)``,
  bound ``exp(−2ε) ρ_M(c(h))``; bound_holds_rate = fraction of tokens with
  ``MassRecall >= bound − BOUND_TOL`` (fp64 arithmetic, so the tolerance only absorbs rounding).
* scale-aware bound (:func:`scaled_bound`). The paper's proof bounds ``|z_e(h) − z_e(x)| <= ||h − x||`` for ANY
  point ``x`` (``||w_e|| <= 1``) and a FIXED set L, so for every ``s > 0``
  ``MassRecall(h) >= exp(−2 ||h − s·c||) · ρ_L(s·c)``, ``ρ_L(s·c) = Σ_{e∈L(c)} π_e(s·c)``; (for a bias-free
  router the shortlist of ``c`` is also the shortlist of ``s·c``). ``s = 1`` is the paper's bound; with raw
  token states (norm ≈ sqrt(d)) against unit codewords it is ≈ e^{-2 sqrt(d)}: true and empty. The projection
  ``s = <h, c>`` minimises the distance term, but is NOT optimal in general: ``d/ds log ρ_L(s·c) =
  E_{π|L}[z] − E_π[z] >= 0`` when L is the top-M at c (every z in L is >= every z outside), > 0 unless M = n
  or ties, while the distance term is stationary at ``s = <h, c>``; so the optimum lies at ``s > <h, c>``.
  moetool therefore takes the best of ``s = 1``, ``s = <h, c>`` and a grid of SCALES scales on
  ``[0, 2 max ||h||]`` (max over the layer's data, so the batching never changes it): a maximum over valid bounds
  is a valid bound, so the grid only makes it slightly conservative. bound_scaled_mean / bound_scaled_holds_rate / best_scale_mean (s*/||h||) report it; it
  is a theorem in unit mode (holds rate 1) and by construction >= the paper's bound on every token.

Centroid modes: ``raw`` — the router as the model runs it: ``π = layer.probs(layer.logits(h))`` (the
model's scoring, bias included), ``TopK`` = the model's own top-K, the shortlist ranks experts by the
model's selection scores at the codeword (for a bias-free softmax router: by ``<c_g, w_e>``).
``unit`` — router rows projected to the unit sphere (AIR-MoE Algorithm 1 line 1), logits ``<w_e, h>``
without bias, ``π`` = their softmax, ``TopK`` = top-K of that ``π``, shortlist by ``<c_g, w_e>``; here
Proposition 1 is a theorem (``||w_e|| = 1``), so bound_holds_rate must be 1.

One codebook per (layer, G) serves every M and both modes. dead_codes = codewords with no token in
the evaluation pass; expert_coverage = fraction of experts in at least one shortlist of a used
codeword; router_flops_frac = ``(G + M) / n``; mass_recall_p05 comes from a 4096-bin histogram
(upper bin edge, resolution 1/4096).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ... import distributed, ops
from ...data import require_tokens
from ...adapters.base import MoELayer
from ...engine.hooks import RECOMPUTE_SAID, RoutingEvent, recompute_unable, refuse_unable, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...uncertainty import RowTable, bootstrap_meta, fraction_text, ratio_intervals
from ..kmeans import GlobalBatch, SphericalKMeans
from ..result import Result, resolve_options
from .spec import MODE_WORDS, MassRecallOptions  # noqa: F401 - its options (declared with their flags in spec.py)

BOUND_TOL = 1e-9
SCALES = 64  # grid points of the 1-D search over s (plus s = 1 and s = <h, c>)
HIST_BINS = 4096

COLUMNS = ["layer", "codebook_size", "shortlist_size", "centroids", "tokens", "mass_recall_mean",
           "mass_recall_p05", "topk_recall", "exact_topk_rate", "quant_error_mean", "bound_mean",
           "bound_holds_rate", "bound_scaled_mean", "bound_scaled_holds_rate", "best_scale_mean", "dead_codes", "expert_coverage", "router_flops_frac"]
CI = ("mass_recall_mean", "topk_recall", "exact_topk_rate")  # per-token means with bootstrap intervals
CI_COLUMNS = [f"{c}_{e}" for c in CI for e in ("lo", "hi")]
COLUMNS = [c for col in COLUMNS for c in ((col, f"{col}_lo", f"{col}_hi") if col in CI else (col,))]
# per-(layer, G, mode, M) running sums, in this order
_SUMS = ("tokens", "mass", "topk_recall", "exact", "eps", "bound", "holds", "bound_scaled", "holds_scaled",
         "scale")


# ----- the routing distribution in each centroid mode ----------------------------------------
def token_space(layer: MoELayer, mode: str, h: torch.Tensor, logits: torch.Tensor | None = None,
                idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(π(h) [N, n] fp64, TopK(h) [N, K])`` for router inputs ``h [N, d]``.

    ``raw``: the model's routing (``logits``/``idx``, the model's own, are used when given).
    """
    if mode == "raw":
        logits = layer.logits(h) if logits is None else logits
        if idx is None:
            idx = layer.route(logits)[0]
        return layer.probs(logits).double(), idx
    w = ops.unit(layer.router_weight().double())  # [n, d]
    p = torch.softmax(h.double() @ w.T, dim=-1)  # [N, n]
    return p, ops.topk(p, layer.top_k)


def codeword_space(layer: MoELayer, mode: str, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(π(c) [G, n] fp64, experts ranked at each codeword [G, n], best first)``."""
    if mode == "raw":
        logits = layer.logits(codebook)
        rank_by = layer.selection_scores(logits)
        p = layer.probs(logits).double()
    else:
        w = ops.unit(layer.router_weight().double())  # [n, d]
        rank_by = codebook.double() @ w.T  # [G, n]
        p = torch.softmax(rank_by, dim=-1)
    return p, torch.argsort(rank_by, dim=-1, descending=True, stable=True)


def shortlist_mask(order: torch.Tensor, m: int) -> torch.Tensor:
    """``[G, n]`` bool: expert e is in the top-``m`` shortlist of codeword g."""
    return torch.zeros(order.shape, dtype=torch.bool, device=order.device).scatter_(1, order[:, :m], True)


def token_metrics(probs_h: torch.Tensor, topk_h: torch.Tensor, g: torch.Tensor, eps: torch.Tensor,
                  probs_c: torch.Tensor, in_list: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token mass recall, top-K recall, exact flag and Proposition-1 bound for one shortlist table.

    ``probs_h [N, n]``, ``topk_h [N, K]``, codeword ids ``g [N]``, ``eps [N]``, ``probs_c [G, n]``,
    ``in_list [G, n]`` bool -> each ``[N]`` (fp64 / bool).
    """
    member = in_list[g]  # [N, n]
    mass = 1.0 - (probs_h * ~member).sum(-1)  # [N]
    hits = member.gather(1, topk_h.long()).sum(-1)  # [N]
    rho = (probs_c * in_list).sum(-1)  # [G]
    bound = torch.exp(-2.0 * eps) * rho[g]  # [N]
    K = topk_h.shape[-1]
    return {"mass": mass, "topk_recall": hits.double() / K, "exact": (hits == K).double(), "bound": bound,
            "holds": (mass >= bound - BOUND_TOL).double()}


def codeword_probs_at(layer: MoELayer, mode: str, points: torch.Tensor) -> torch.Tensor:
    """π at arbitrary points ``x [..., d]`` in a centroid mode (fp64 ``[..., n]``): raw = the model's scoring of
    ``layer.logits(x)``; unit = softmax of ``<unit(w_e), x>``."""
    if mode == "raw":  # an adapter's logits take rows [T, d] (Zaya's flatten whatever they get)
        flat = points.reshape(-1, points.shape[-1])
        return layer.probs(layer.logits(flat)).double().reshape(*points.shape[:-1], -1)
    w = ops.unit(layer.router_weight().double())
    return torch.softmax(points.double() @ w.T, dim=-1)


def scaled_bound(layer: MoELayer, mode: str, h: torch.Tensor, codebook: torch.Tensor, g: torch.Tensor,
                 in_lists: Sequence[torch.Tensor], scales: int = SCALES,
                 hmax: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Scale-aware Proposition 1 for each shortlist table in ``in_lists`` ([G, n] bool):
    ``max_s exp(−2 ||h − s·c||) ρ_L(s·c)`` over s ∈ {1, <h, c>} ∪ grid -> ``[(bound [N], s* [N]), ...]``; the grid
    spans [0, 2·hmax], ``hmax`` = the largest ||h|| of the layer's data (None: of this batch)."""
    h = h.double()
    cb = codebook.double()
    c = cb[g]  # [N, d]
    p = (h * c).sum(-1)  # [N] projection <h, c> (unit codewords)
    hn2 = (h * h).sum(-1)
    top = hn2.max().sqrt() if hmax is None else hmax.to(h.device, torch.float64)
    grid = torch.linspace(0.0, 2.0, scales, dtype=torch.float64, device=h.device) * top  # no sync
    grid = torch.cat([grid, torch.ones(1, dtype=torch.float64, device=h.device)])  # s = 1: the paper's bound
    # ||h − s·c||² = (a − s·||c||)² + ||h_⊥||², a = <h, c>/||c||, h_⊥ computed directly (no cancellation when h ∥ c;
    # codewords are unit only up to fp32 rounding, so ||c|| is kept)
    cn = c.norm(dim=-1)  # [N]
    a = p / cn
    perp2 = (h - (p / cn ** 2)[:, None] * c).pow(2).sum(-1)  # [N]
    dist = ((a[:, None] - grid[None, :] * cn[:, None]) ** 2 + perp2[:, None]).sqrt()  # [N, S]
    dist_p = torch.linalg.vector_norm(h - p[:, None] * c, dim=-1)  # [N] at s = <h, c>
    pi_grid = codeword_probs_at(layer, mode, grid[:, None, None] * cb[None].to(grid.dtype))  # [S, G, n]
    pi_p = codeword_probs_at(layer, mode, p[:, None] * c)  # [N, n]
    out = []
    for in_list in in_lists:
        rho = (pi_grid * in_list).sum(-1)  # [S, G]
        b = torch.exp(-2.0 * dist) * rho[:, g].T  # [N, S]
        bp = torch.exp(-2.0 * dist_p) * (pi_p * in_list[g]).sum(-1)  # [N]
        best, j = b.max(-1)
        s_best = torch.where(bp > best, p, grid[j])
        out.append((torch.maximum(best, bp), s_best))
    return out


# ----- streaming passes ----------------------------------------------------------------------
class RealTokens:
    """The real (non-padding) tokens of each batch without a host sync: their number comes from the batch's HOST
    attention mask (``before_batch``), their positions from a stable device-side argsort of the padding mask, so
    :meth:`take` equals ``x[ev.valid]`` (same tokens, same order) with no boolean-mask indexing."""

    def __init__(self) -> None:
        self.n = 0

    def before_batch(self, batch: Any) -> None:
        self.n = int(batch.attention_mask.sum())  # a CPU tensor: no device synchronisation

    def take(self, ev: RoutingEvent, *xs: torch.Tensor) -> list[torch.Tensor]:
        pos = torch.argsort((~ev.valid).to(torch.uint8), stable=True)[: self.n]  # real positions, in order
        self.pos, self.positions = pos, ev.valid.shape[0]
        return [x.index_select(0, pos.to(x.device)) for x in xs]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-real-token ``values [N, k]`` of the last :meth:`take` back at their positions ``[T, k]`` (0 on
        padding): per-row sums for the bootstrap."""
        full = torch.zeros(self.positions, values.shape[1], dtype=values.dtype, device=values.device)
        return full.index_copy_(0, self.pos.to(values.device), values)


def fit_codebooks(lm: Any, tokens: Any, layers: Sequence[MoELayer], opts: MassRecallOptions,
                  quiet: bool = False, steps: int | None = None,
                  norms: dict[int, torch.Tensor] | None = None) -> dict[tuple[int, int], SphericalKMeans]:
    """Pass 1 (+ ``kmeans_iters``): one streaming k-means per (layer, G).

    Data parallel (``tokens`` this rank's shard, ``steps`` = batches of the global run): every EMA step runs on
    the global batch (:class:`~..kmeans.GlobalBatch`: per-batch sums all-reduced, drawn tokens fetched from their
    rank), so the codebooks equal one process's over the same global batches; a rank out of rows joins the
    remaining steps with no token. ``norms`` (filled when given): the largest ||h|| per layer over all ranks,
    the scale grid of :func:`scaled_bound` (so the bound does not depend on how rows are batched)."""
    fits = {(L.index, G): SphericalKMeans(G, seed=opts.seed + 7919 * L.index + G)
            for L in layers for G in opts.codebook_sizes}
    world = distributed.world_size()
    real = RealTokens()
    pending: dict[int, torch.Tensor] = {}
    done = [0]

    def consume(ev: RoutingEvent) -> None:  # inside the forward: keep the batch's real states on the device
        pending[ev.layer.index] = real.take(ev, ev.h)[0].float()  # [N, d]

    def update(_batch: Any, _out: Any) -> None:  # after the forward: the sequential EMA steps (k-means++ init and
        for L in layers:                          # dead-code draws are data-dependent, so they run here)
            h = pending.get(L.index)
            if h is None:
                if world == 1:
                    continue
                w = L.router_weight()
                h = torch.zeros(0, w.shape[-1], device=w.device)  # no token here: join the global step
            if norms is not None and h.shape[0]:
                top = h.double().norm(dim=-1).max()
                norms[L.index] = torch.maximum(norms[L.index], top) if L.index in norms else top
            gb = GlobalBatch(h.shape[0], h.device) if world > 1 else None
            for G in opts.codebook_sizes:
                fits[(L.index, G)].update(h, gb)
        pending.clear()
        done[0] += 1

    for p in range(1 + opts.kmeans_iters):
        done[0] = 0
        forward(lm, tokens, consumers=[consume], moe_layers=layers, batch_size=opts.batch_size,
                before_batch=real.before_batch, on_batch=update,
                description=f"k-means pass {p + 1}/{1 + opts.kmeans_iters}", quiet=quiet)
        while world > 1 and steps is not None and done[0] < steps:
            update(None, None)
    if norms is not None and world > 1:
        norms.update({k: v.to(layers[0].router_weight().device) for k, v in distributed.all_reduce_keyed(
            {k: v.cpu() for k, v in norms.items()}, "max").items()})
    return fits


@dataclass
class _Acc:
    sums: torch.Tensor  # [len(_SUMS)] fp64
    hist: torch.Tensor  # [HIST_BINS] fp64, mass recall histogram


@dataclass
class MassRecallResult:
    table: Any  # DataFrame with COLUMNS
    reinits: dict[str, int] = field(default_factory=dict)  # "layer/G" -> dead-code re-initialisations


class RecallCollector:
    """Pass 2's streaming reducer (a forward consumer): per (layer, G, centroids, M) the sums of the token metrics
    and a histogram of mass recall, codeword use per (layer, G), and the per-row sums the bootstrap needs.
    Reductions stay on the device; :meth:`merge_across_ranks` then :meth:`table`."""

    def __init__(self, tokens: Any, layers: Sequence[MoELayer], fits: dict[tuple[int, int], SphericalKMeans],
                 opts: MassRecallOptions, norms: dict[int, torch.Tensor] | None = None):
        self.layers, self.fits, self.opts, self.norms = list(layers), fits, opts, norms or {}
        self.ms: dict[int, list[int]] = {L.index: opts.shortlist_sizes(L.n_experts) for L in self.layers}
        with torch.no_grad():
            self.spaces = {(L.index, G, mode): codeword_space(L, mode, fits[(L.index, G)].codebook)
                           for L in self.layers for G in opts.codebook_sizes for mode in opts.centroids}
            self.masks = {key + (m,): shortlist_mask(order, m)
                          for key, (_, order) in self.spaces.items() for m in self.ms[key[0]]}
        self.acc: dict[tuple[int, int, str, int], _Acc] = {}
        self.used: dict[tuple[int, int], torch.Tensor] = {}
        self.real = RealTokens()
        self.rows = RowTable(tokens) if opts.bootstrap else None
        self.first = self.layers[0].index

    def before_batch(self, batch: Any) -> None:
        self.real.before_batch(batch)
        if self.rows is not None:
            self.rows.next_batch(batch)

    def __call__(self, ev: RoutingEvent) -> None:
        L, opts, rows = ev.layer, self.opts, self.rows
        h, logits, idx = self.real.take(ev, ev.h, ev.logits, ev.idx)  # [N, d], [N, n], [N, K]: the real tokens
        if rows is not None and L.index == self.first:
            rows.add("tokens", ev.valid.double())
        tok = {mode: token_space(L, mode, h, logits, idx) for mode in opts.centroids}
        for G in opts.codebook_sizes:
            cb = self.fits[(L.index, G)].codebook  # [G, d]
            g = self.fits[(L.index, G)].assign(h)  # [N]
            eps = ops.vector_norm(h.double() - cb.double()[g])  # [N] fp64
            cnt = torch.zeros(G, dtype=torch.long, device=g.device).index_add_(0, g, torch.ones_like(g))
            self.used[(L.index, G)] = self.used[(L.index, G)] + cnt if (L.index, G) in self.used else cnt
            hnorm = ops.vector_norm(h.double())
            for mode in opts.centroids:
                probs_c, _ = self.spaces[(L.index, G, mode)]
                scaled = scaled_bound(L, mode, h, cb, g, [self.masks[(L.index, G, mode, m)] for m in self.ms[L.index]],
                                      hmax=self.norms.get(L.index))
                for m, (sb, s_best) in zip(self.ms[L.index], scaled):
                    t = token_metrics(tok[mode][0], tok[mode][1], g, eps, probs_c, self.masks[(L.index, G, mode, m)])
                    sb = torch.maximum(sb, t["bound"])  # s = 1 is in the grid; guards rounding only
                    row = torch.stack([torch.full((), float(h.shape[0]), dtype=torch.float64, device=h.device),
                                       t["mass"].sum(), t["topk_recall"].sum(), t["exact"].sum(), eps.sum(),
                                       t["bound"].sum(), t["holds"].sum(), sb.sum(),
                                       (t["mass"] >= sb - BOUND_TOL).double().sum(),
                                       (s_best / hnorm.clamp_min(1e-30)).sum()])
                    bins = (t["mass"] * HIST_BINS).long().clamp(0, HIST_BINS - 1)
                    hist = torch.zeros(HIST_BINS, dtype=torch.float64, device=bins.device).index_add_(
                        0, bins, torch.ones(bins.shape, dtype=torch.float64, device=bins.device))
                    key = (L.index, G, mode, m)
                    if rows is not None:
                        rows.add(f"{L.index}/{G}/{mode}/{m}", self.real.scatter(torch.stack(
                            [t["mass"], t["topk_recall"], t["exact"]], -1)))
                    if key in self.acc:
                        self.acc[key].sums += row
                        self.acc[key].hist += hist
                    else:
                        self.acc[key] = _Acc(row, hist)

    def merge_across_ranks(self) -> None:
        """Data parallel: sums, histograms and codeword use over ranks (a rank may lack keys); alone: nothing."""
        if distributed.world_size() > 1:
            self.used = distributed.all_reduce_keyed(self.used)
            self.acc = {k: _Acc(v["sums"], v["hist"]) for k, v in distributed.all_reduce_keyed(
                {k: {"sums": a.sums, "hist": a.hist} for k, a in self.acc.items()}).items()}
        if self.rows is not None:
            self.rows.reduce_across_ranks()

    def table(self) -> Any:
        """The ``mass_recall`` table (columns of DEFINITIONS), intervals from the per-row sums."""
        import pandas as pd

        if not self.acc:
            raise MoetoolError("no tokens evaluated (empty data?)")
        table_rows = []
        n_of = {L.index: L.n_experts for L in self.layers}
        for (layer, G, mode, m), a in self.acc.items():
            s = dict(zip(_SUMS, a.sums.tolist()))
            count = self.used[(layer, G)]
            _, order = self.spaces[(layer, G, mode)]
            covered = torch.unique(order[count > 0, :m])
            n = n_of[layer]
            table_rows.append({"layer": layer, "codebook_size": G, "shortlist_size": m, "centroids": mode,
                               "tokens": int(s["tokens"]), "mass_recall_mean": s["mass"] / s["tokens"],
                               "mass_recall_p05": ops.hist_quantile(a.hist, 0.05),
                               "topk_recall": s["topk_recall"] / s["tokens"],
                               "exact_topk_rate": s["exact"] / s["tokens"],
                               "quant_error_mean": s["eps"] / s["tokens"], "bound_mean": s["bound"] / s["tokens"],
                               "bound_holds_rate": s["holds"] / s["tokens"],
                               "bound_scaled_mean": s["bound_scaled"] / s["tokens"],
                               "bound_scaled_holds_rate": s["holds_scaled"] / s["tokens"],
                               "best_scale_mean": s["scale"] / s["tokens"], "dead_codes": int((count == 0).sum()),
                               "expert_coverage": covered.numel() / n, "router_flops_frac": (G + m) / n})
        ci = {}
        if self.rows is not None:
            rows, keys = self.rows, list(self.acc)
            num = torch.cat([torch.as_tensor(rows.table(f"{k[0]}/{k[1]}/{k[2]}/{k[3]}"), device="cpu")
                             .reshape(rows.n_rows, -1) for k in keys], 1).numpy()
            ivs = ratio_intervals(num, rows.table("tokens"), n_boot=self.opts.bootstrap, seed=self.opts.seed)
            for i, k in enumerate(keys):
                ci[k] = {f"{c}_{e}": getattr(ivs[3 * i + j], e) for j, c in enumerate(CI) for e in ("lo", "hi")}
        for r in table_rows:
            r.update(ci.get((r["layer"], r["codebook_size"], r["centroids"], r["shortlist_size"]),
                            dict.fromkeys(CI_COLUMNS, float("nan"))))
        df = pd.DataFrame(table_rows, columns=COLUMNS).sort_values(
            ["layer", "centroids", "codebook_size", "shortlist_size"])
        return df.reset_index(drop=True)


def evaluate(lm: Any, tokens: Any, layers: Sequence[MoELayer], fits: dict[tuple[int, int], SphericalKMeans],
             opts: MassRecallOptions, quiet: bool = False,
             norms: dict[int, torch.Tensor] | None = None) -> MassRecallResult:
    """Pass 2: every (layer, G, centroids, M) on the same tokens (:class:`RecallCollector`); returns the table with
    the columns of DEFINITIONS. ``norms``: the largest ||h|| per layer (:func:`fit_codebooks`), the scale grid of
    the bound."""
    col = RecallCollector(tokens, layers, fits, opts, norms)
    forward(lm, tokens, consumers=[col], moe_layers=layers, batch_size=opts.batch_size,
            before_batch=col.before_batch, description="mass recall", quiet=quiet)
    col.merge_across_ranks()
    return MassRecallResult(col.table())


def refuse_codebooks_above_tokens(tokens: Any, sizes: Sequence[int]) -> None:
    """A codebook of more codewords than the tokens it is fitted on (every layer fits on every real token) leaves
    G - tokens of them with no token by construction: refused in one line before any forward, never a table of
    dead codes. Data parallel: the tokens of every rank (this rank's shard when ``tokens`` is one)."""
    total = tokens.n_tokens if tokens.row_ids is None else int(distributed.rank_counts(tokens.n_tokens).sum())
    over = [g for g in sizes if g > total]
    if over:
        raise MoetoolError(f"--codebook-size {max(over)}: more codewords than the {total:,} tokens the codebook is "
                           f"fitted on (k-means with more clusters than points); choose sizes up to {total:,} or "
                           "read more tokens (--max-tokens, --data)")


def run_mass_recall(lm: Any, tokens: Any, opts: MassRecallOptions, layers: Sequence[MoELayer] | None = None,
                    quiet: bool = False) -> MassRecallResult:
    """Fit the codebooks, then evaluate: the whole experiment on one model."""
    layers = list(lm.layers if layers is None else layers)
    require_tokens(tokens)  # no codebook can be fitted on nothing: one line, not a crash in the scoring
    for L in layers:  # a shortlist of more experts than the layer has: refused before any forward, never skipped
        over = [m for m in opts.shortlist_sizes(L.n_experts) if m > L.n_experts]
        if over:
            raise MoetoolError(f"--shortlist {over[0]}: more than the {L.n_experts} experts of MoE layer {L.index}; "
                               f"choose sizes up to {L.n_experts}")
    refuse_codebooks_above_tokens(tokens, opts.codebook_sizes)

    steps = None
    if distributed.world_size() > 1 and tokens.row_ids is None:  # shard once: global row ids for the bootstrap
        steps = distributed.n_steps(tokens.input_ids.shape[0], opts.batch_size, distributed.world_size())
        tokens = distributed.shard(tokens, opts.batch_size)
    norms: dict[int, torch.Tensor] = {}
    fits = fit_codebooks(lm, tokens, layers, opts, quiet, steps, norms)
    res = evaluate(lm, tokens, layers, fits, opts, quiet, norms)
    res.reinits = {f"{k[0]}/{k[1]}": v.reinits for k, v in fits.items()}
    return res


# ----- report --------------------------------------------------------------------------------
DEFINITIONS = {
    "tokens": "real (unpadded) tokens the layer routed",
    "layer": "decoder layer index of the MoE layer",
    "codebook_size": "G: codewords in the layer's codebook (--codebook-size)",
    "shortlist_size": "M: experts in each codeword's shortlist (--shortlist)",
    "mass_recall_mean": "mean over real tokens of Σ_{e∈L(c(h))} π_e(h), computed as 1 − Σ_{e∉L} π_e(h) in fp64",
    "mass_recall_p05": "5th percentile of mass recall (4096-bin histogram, upper bin edge)",
    "topk_recall": "mean |TopK(h) ∩ L(c(h))| / K",
    "exact_topk_rate": "fraction of tokens with TopK(h) ⊆ L(c(h)) (top-K inside the shortlist = global top-K)",
    "quant_error_mean": "mean ε(h) = ||h − c(h)||, raw router input h against its unit codeword; ε >= | ||h|| − 1 |, "
                        "so for router inputs of norm ≈ sqrt(d) (after RMSNorm) the bound is ≈ 0 (true but vacuous)",
    "bound_mean": "mean exp(−2ε(h)) ρ_M(c(h)), ρ_M(c) = Σ_{e∈L(c)} π_e(c) with the mode's scoring",
    "bound_holds_rate": f"fraction of tokens with mass recall >= bound − {BOUND_TOL} (a theorem in unit mode)",
    "bound_scaled_mean": "mean over tokens of max_s exp(−2||h − s·c(h)||) ρ_L(s·c(h)), L = L(c(h)) fixed, over "
                         "s ∈ {1, <h, c>} ∪ 64-point grid on [0, 2 max||h||] (max over the layer's data): "
                         "Proposition 1 at the best scale (valid for every s > 0; s = <h, c> is not optimal in general, see module docstring)",
    "bound_scaled_holds_rate": f"fraction of tokens with mass recall >= bound_scaled − {BOUND_TOL} "
                               "(a theorem in unit mode)",
    "best_scale_mean": "mean s*/||h|| of the scale that gave bound_scaled",
    "dead_codes": "codewords with no token assigned in the evaluation pass",
    "expert_coverage": "fraction of experts in at least one shortlist of a codeword used in evaluation",
    "router_flops_frac": "(G + M) / n: IVF router inner products relative to exact routing (n); above 1 the IVF "
                         "router costs more than exact routing (a codebook and shortlist larger than the experts)",
    "centroids": "raw: the model's router (its bias/scoring; TopK = the model's own; shortlist ranked by the "
                 "model's selection scores at the codeword); unit: rows on the unit sphere, logits <w_e, h>, "
                 "π = softmax, shortlist by <c_g, w_e>",
    "codebook": "adaptive spherical k-means (AIR-MoE Alg. 2): γ=0.95, dead-code τ=1 re-initialised on a random "
                "token of the current batch; k-means++ init on the first batch with n_g=1, m_g=c_g; one forward "
                "batch = one k-means batch; fitted on the same data it is evaluated on",
}


BOUND_DERIVATION = (
    "Proposition 1 (AIR-MoE): for softmax logits z_e(x) = <w_e, x> + b_e with ||w_e|| <= 1, Cauchy-Schwarz gives "
    "|z_e(h) − z_e(x)| <= ||h − x|| for ANY point x; with a FIXED shortlist L, numerator >= e^{-||h−x||} Σ_L e^{z(x)} "
    "and denominator <= e^{||h−x||} Σ e^{z(x)}, so MassRecall_L(h) >= exp(−2||h − x||) ρ_L(x). The paper takes "
    "x = c(h) (s = 1): with raw token states (norm ≈ sqrt(d)) against unit codewords this is ≈ e^{-2 sqrt(d)}, true "
    "and empty. Taking x = s·c(h) for any s > 0 keeps L (for a bias-free router the top-M of s·c is the top-M of c) "
    "and gives bound_scaled = max_s exp(−2||h − s·c||) ρ_L(s·c). s = <h, c> minimises the distance but is not "
    "optimal: d/ds log ρ_L(s·c) = E_{π|L}[z] − E_π[z] > 0 for L = top-M at c (M < n, no ties) while the distance "
    "term is stationary there, so the optimum is at s > <h, c>; moetool maximises over s ∈ {1, <h, c>} ∪ "
    f"{SCALES} grid points on [0, 2 max||h||] (max over the layer's data, whatever the batching; a maximum of "
    "valid bounds is valid). A theorem in unit mode; in raw "
    "mode (router rows of any norm, the model's scoring) it is checked per token like the paper's bound.")


def unrecalled(layers: Sequence[MoELayer], centroids: Sequence[str]) -> dict[int, tuple[str, str]]:
    """The layers of ``layers`` whose mass recall cannot be computed in the centroid modes ``centroids``, each with
    ``(kind, detail)``: the one set of checks mass-recall's refusal reports and its suggestion is computed from
    (:func:`refuse_unrecalled`). Every mode recomputes the routing at codebook points from them alone, which a layer
    whose router logits depend on more than its input (``carried``: ``routing_context``) or whose experts are chosen
    by token id (``hash``) does not allow; ``unit`` also needs the router as a matrix over the layer input
    (``matrix``: the adapter's reason, where ``router_weight`` has none)."""
    out = recompute_unable(layers)
    for L in layers:
        if L.index in out:
            continue
        if "unit" in centroids:
            try:
                L.router_weight()
            except MoetoolError as e:
                out[L.index] = ("matrix", str(e))
    return out


#: what mass-recall's refusal says of each kind of layer :func:`unrecalled` lists
#: (:func:`~moetool.engine.hooks.refuse_unable`)
UNRECALLED_SAID = {
    **RECOMPUTE_SAID,
    "matrix": "{detail}; --centroids unit needs one: MoE layers {layers} have none"}


def refuse_unrecalled(layers: Sequence[MoELayer], centroids: Sequence[str], model_layers: Sequence[MoELayer]) -> None:
    """One line, before any forward, naming every layer of ``layers`` (those asked for) mass-recall cannot run on in
    the modes ``centroids`` (:func:`unrecalled`) and why, and an invocation that runs, computed from the same checks
    (:func:`~moetool.engine.hooks.refuse_unable`): the others (``--layers``), the ``raw`` mode alone (``--centroids
    raw``) where that leaves more of them, or the model's MoE layers that are left; where none is, it says so."""
    refuse_unable(layers, model_layers, lambda among, alt: unrecalled(among, ("raw",) if alt else centroids),
                  UNRECALLED_SAID, "mass-recall needs the routing recomputed from the layer input alone, but ",
                  alt=("--centroids raw", "use the raw centroids alone") if "unit" in centroids else None,
                  shared=("matrix",))


def mass_recall(lm: Any, tokens: Any, options: MassRecallOptions | None = None, *, quiet: bool = False,
                **overrides: Any) -> Result:
    """Mass recall of an IVF router per MoE layer, codebook size G, shortlist size M and centroid mode.

    Table ``mass_recall`` with :data:`COLUMNS` (see :data:`DEFINITIONS`); a shortlist size larger than a
    layer's n is refused before any forward (the default sizes stop at n).
    """
    opts = resolve_options(MassRecallOptions, options, overrides)
    layers = select_layers(lm.layers, opts.layers)
    refuse_unrecalled(layers, opts.centroids, lm.layers)
    res = run_mass_recall(lm, tokens, opts, layers=layers, quiet=quiet)
    described = tokens.describe()
    return Result("mass_recall", {"mass_recall.csv": res.table}, opts,
                  meta=dict(definitions=DEFINITIONS, bound_derivation=BOUND_DERIVATION, kmeans_reinits=res.reinits,
                            data=described, bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, described["rows"]),
                            kmeans={"gamma": 0.95, "dead_code_tau": 1.0,
                                                            "extra_passes": opts.kmeans_iters, "seed": opts.seed}),
                  summary=res.table.drop(columns=["tokens"]))


def summary_lines(name: str, res: Any) -> list[str]:
    """Mass recall (layer mean) per centroids mode at the largest G and two shortlist sizes; bound check. Each line
    names its mode and what it means (``tiny, raw centroids (the model's router as is): ...``). Recall and the
    bound's rates are fractions, as in mass_recall.csv."""
    df = res["mass_recall"]
    lines = []
    for mode, d in df.groupby("centroids", sort=False):
        G = d["codebook_size"].max()
        parts = []
        for m in sorted(d["shortlist_size"].unique())[:2] + sorted(d["shortlist_size"].unique())[-1:]:
            sel = d[(d["codebook_size"] == G) & (d["shortlist_size"] == m)]
            parts.append(f"M={m}: {fraction_text(sel['mass_recall_mean'].mean())}")
        lines.append(f"{name}, {mode} centroids ({MODE_WORDS[mode]}): mass recall (G={G}, mean over layers) "
                     + ", ".join(dict.fromkeys(parts))
                     + f"; bound holds on {fraction_text(d['bound_holds_rate'].min())} of tokens (lowest over layers, "
                     "G and M), "
                     f"scale-aware bound on {fraction_text(d['bound_scaled_holds_rate'].min())}; mean bound paper "
                     f"{d['bound_mean'].mean():.2g} vs scale-aware {d['bound_scaled_mean'].mean():.2g}"
                     + (f"; every row's router_flops_frac (G + M) / n is at least 1 (lowest "
                        f"{d['router_flops_frac'].min():.3g}): the IVF router costs no less than exact routing here"
                        if "router_flops_frac" in d and (d["router_flops_frac"] >= 1).all() else ""))
    return lines
