"""MoE as the best k-term approximation of a dense sum (Su 2025, "MoE Travelogue 1: Starting from Geometric
Meaning", https://kexue.fm/archives/10699).

Per MoE layer and real token, all ``n`` experts run (batched probes): ``u_e = π_e(h) E_e(h)``, the dense target
``y = Σ_e u_e``. A selector picks ``K`` experts ``S``; its relative error is ``||y_S − y|| / ||y||`` with
``y_S = Σ_{e∈S} u_e``, computed directly from the ``u_e`` (fp32) as ``||Σ_{e∉S} u_e|| / ||Σ_e u_e||``, its two
norms in fp64; the other squares come from the outputs (``||u_e|| = π_e ||E_e||``, ``cos(u_i, u_j) = cos(E_i, E_j)``,
``G = π_i π_j E Eᵀ``): a confident router's ``u_e`` are ~1e-20 and smaller, and their squares underflow fp32.

Selectors: ``router`` (the model's routing math on the captured logits: TopK of π for softmax routers, the
biased/grouped choice of DeepSeek-V3), ``norm_oracle`` (TopK of ``||u_e||``, the paper's rule),
``best_subset`` (exhaustive over all C(n, K) subsets where C(n, K) <= ``max_subsets``: the Gram matrix
``G = U Uᵀ`` per token, fp64, scores every subset at once as ``cᵀ G c`` with ``c`` its complement indicator),
``random`` (K distinct experts uniformly, seeded). Reductions stay on the device and never synchronise with
the host inside the forward (padding is weighted out, not indexed out). Memory is flat in the number of tokens:
per layer and selector the errors go into an exact :class:`~moetool.sketch.Moments` (mean) and a
:class:`~moetool.sketch.QuantileSketch` (median within :data:`MEDIAN_REL_TOL` relative, see there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ... import distributed, ops
from ...adapters import quant
from ...adapters.base import MoELayer
from ...engine import guard, probes
from ...engine.hooks import refuse_hash_routed, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError
from ...policies.basic import uniform_rows
from ...sketch import QuantileSketch
from ...uncertainty import fraction_text
from ..result import Result, resolve_options
from .spec import MAX_SUBSETS, SELECTORS, ApproxOptions, check_selectors  # noqa: F401 - its options (declared with their flags in spec.py)

#: elements of one per-chunk intermediate (U [T_c, n, d], or subset scores [T_c, C, n]) -> 128 MB fp32
BUDGET = 1 << 25
#: relative error bound of rel_error_median (QuantileSketch defaults: 32768 log bins over [2^-149, 1e4])
MEDIAN_REL_TOL = QuantileSketch().rel_error

DEFINITIONS = {
    "selector": "how the row's K experts are picked per token: router, norm_oracle, best_subset or random (each "
                "defined under its name)",
    "tokens": "real (unpadded) tokens the layer routed",
    "u_e": "u_e = pi_e(h) * E_e(h): pi the model's full routing distribution (softmax; DeepSeek-style sigmoid "
           "scores normalised to sum to one), E_e the expert's output before any routing weight",
    "rel_error": "||y_S - y|| / ||y||, y = sum of all n u_e, y_S = sum over the K chosen; computed as "
                 "||sum_{e not in S} u_e|| / ||y||, the sums in fp32 and the norms in fp64 (a confident router's "
                 "left-out u_e are ~1e-20: their squares underflow fp32)",
    "router": "the model's own routing rule applied to the captured logits (TopK of pi for softmax routers; "
              "bias-corrected, group-restricted top-K for DeepSeek-V3)",
    "norm_oracle": "TopK of ||u_e|| (the paper's rule, needs all experts), the norms in fp64",
    "best_subset": "argmin over all C(n, K) subsets of ||y_S - y||, via the per-token Gram matrix G = U U^T in fp64 "
                   "(error^2 * ||y||^2 = c^T G c, c the complement indicator); only where C(n, K) <= max_subsets, "
                   "other layers have no best_subset row",
    "random": "K distinct experts uniformly at random per token, seeded per layer and packed row (the same draws "
              "whatever the batch size or number of processes)",
    "same_set_as_router": "fraction of tokens whose selected set equals the model's own top-K as captured from the "
                          "running model (so 1.0 for router checks that the routing math matches the model)",
    "rel_error_median": "median (mean of the two middle values) of the per-token errors from a streaming log-binned "
                        f"sketch (moetool.sketch.QuantileSketch): within {MEDIAN_REL_TOL:.2%} relative of the exact "
                        "median, memory flat in the number of tokens",
    "spearman_prob_vs_norm": "per token, the Spearman rank correlation across the n experts between pi_e and "
                             "||E_e(h)|| (average ranks for ties), then the mean over tokens (tokens with a "
                             "constant pi or norm, where it is undefined, are left out)",
    "mean_abs_cos": "per token, the mean |cos(u_i, u_j)| over ordered pairs i != j, then the mean over tokens; "
                    "computed as |cos(E_i, E_j)| (equal: pi > 0) from the outputs' Gram matrix, so a pi_e below "
                    "fp32's range does not make u_e a zero vector (cosine 0)",
}


_SUBSETS: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def subset_matrix(n: int, k: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All C(n, k) subsets in lexicographic order: ``(idx [C, k] long, indicator [C, n] fp64)``.

    Built once on the host (itertools) and cached per ``(n, k, device)``: no data-dependent op on the device."""
    key = (n, k, str(torch.device(device) if device is not None else "cpu"))
    if key not in _SUBSETS:
        idx = torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.long, device="cpu").view(-1, k)
        _SUBSETS[key] = ops.to_device(idx, key[2]), ops.to_device(ops.multi_hot(idx, n, torch.float64), key[2])
    return _SUBSETS[key]


def best_subsets(G: torch.Tensor, subsets: tuple[torch.Tensor, torch.Tensor], budget: int = BUDGET) -> torch.Tensor:
    """``argmin_S ||Σ_{e∉S} u_e||²`` per token from the Gram matrices ``G [T, n, n]`` -> ``idx [T, K]``."""
    idx, ind = subsets
    comp = (1 - ind).to(G.dtype)  # [C, n]: experts left out
    step = max(1, budget // (comp.shape[0] * comp.shape[1]))
    best = []
    for s in range(0, G.shape[0], step):
        cg = torch.matmul(comp, G[s:s + step])  # [T_c, C, n]
        best.append((cg * comp).sum(-1).argmin(-1))  # [T_c]: cᵀ G c per subset, minimised
    return idx[torch.cat(best)]


def rel_error(U: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``||y_S − y|| / ||y||`` for chosen sets ``idx [T, K]`` of contributions ``U [T, n, d]`` -> ``[T]`` fp32.

    The two norms in fp64: a confident router's left-out ``u_e = π_e E_e`` are ~1e-20 and smaller, whose squares
    underflow fp32 (an fp32 norm of them is 0: an error of 1e-22 read as exactly 0)."""
    left_out = 1 - ops.multi_hot(idx, U.shape[1], U.dtype)  # [T, n]
    resid = (U * left_out.unsqueeze(-1)).sum(1)  # [T, d] = y − y_S
    y = ops.vector_norm(U.sum(1).double())
    return (ops.vector_norm(resid.double()) / y.clamp_min(torch.finfo(torch.float64).tiny)).float()


@dataclass
class TokenApprox:
    """Per-token results of one chunk of tokens."""

    idx: dict[str, torch.Tensor]  # selector -> [T, K]
    error: dict[str, torch.Tensor]  # selector -> [T] relative error
    spearman: torch.Tensor  # [T] Spearman(π_e, ||E_e(h)||) across experts
    abs_cos: torch.Tensor  # [T] mean |cos(u_i, u_j)|, i != j
    finite: torch.Tensor  # [T] bool: every expert's output finite (an unchosen expert can overflow fp16)
    dtype: torch.dtype  # the experts' outputs' as computed


def best_subset_applies(n: int, k: int, max_subsets: int = MAX_SUBSETS) -> bool:
    return math.comb(n, k) <= max_subsets


def _chunk(layer: MoELayer, h: torch.Tensor, logits: torch.Tensor, selectors: Sequence[str],
           generator: torch.Generator | None, subsets: tuple[torch.Tensor, torch.Tensor] | None,
           noise: torch.Tensor | None = None) -> TokenApprox:
    K = layer.top_k
    pi = layer.probs(logits)  # [T, n] fp32
    E = probes.expert_outputs(layer, h)  # [n, T, d] in the experts' dtype
    dtype = E.dtype
    E = E.float()
    p = pi.to(E.device)
    Et = E.transpose(0, 1)  # [T, n, d]
    U = Et * p.unsqueeze(-1)  # [T, n, d]
    # squares from the outputs, never from the u_e: ||u_e|| = π_e ||E_e||, cos(u_i, u_j) = cos(E_i, E_j) (π > 0) and
    # G = U Uᵀ = π_i π_j E Eᵀ (fp64). A confident router's u_e (π_e ~1e-20, or 0 where π_e underflows fp32) have fp32
    # squares of 0: the norm oracle ranked them as a tie, and G's zero diagonal made |cos| = g / tiny (billions)
    enorm = ops.vector_norm(E).T  # [T, n]
    finite = torch.isfinite(enorm).all(-1)  # [T]: a NaN/inf output makes its norm one (no pass over [n, T, d])
    GE = Et.double() @ Et.double().transpose(1, 2) if subsets is not None else Et @ Et.transpose(1, 2)  # [T, n, n]
    idx: dict[str, torch.Tensor] = {}
    for sel in selectors:
        if sel == "router":
            idx[sel] = layer.route(logits)[0].to(U.device)
        elif sel == "norm_oracle":
            idx[sel] = ops.topk(p.double() * enorm.double(), K)
        elif sel == "random":
            u = noise.to(U.device) if noise is not None else torch.rand(U.shape[:2], generator=generator,
                                                                         device=U.device)
            idx[sel] = ops.topk(u, K)
        elif sel == "best_subset" and subsets is not None:
            pd = p.double()
            idx[sel] = best_subsets(GE * (pd.unsqueeze(-1) * pd.unsqueeze(-2)), subsets)  # G = U Uᵀ
    return TokenApprox(idx=idx, error={s: rel_error(U, i) for s, i in idx.items()},
                       spearman=ops.spearman(p, enorm).float(),
                       abs_cos=ops.abs_cos_mean(Et, gram=GE).float(), finite=finite, dtype=dtype)


@torch.no_grad()
def approx_tokens(layer: MoELayer, h: torch.Tensor, logits: torch.Tensor, selectors: Sequence[str] = SELECTORS,
                  generator: torch.Generator | None = None, max_subsets: int = MAX_SUBSETS,
                  budget: int = BUDGET, noise: torch.Tensor | None = None) -> TokenApprox:
    """Selections, errors, Spearman and |cos| for router inputs ``h [T, d]`` with router ``logits [T, n]``.

    ``best_subset`` is left out (absent from ``idx``/``error``) where C(n, K) > ``max_subsets``. ``random`` ranks
    the experts by ``noise [T, n]`` when given (uniform draws), else by draws of ``generator``.
    """
    check_selectors(selectors)
    n, K = layer.n_experts, layer.top_k
    subsets = None
    if "best_subset" in selectors and best_subset_applies(n, K, max_subsets):
        subsets = subset_matrix(n, K, h.device)
    d = h.shape[-1]
    step = max(1, budget // max(n * d, (subsets[0].shape[0] * n) if subsets is not None else 1))
    parts = [_chunk(layer, h[s:s + step], logits[s:s + step], selectors, generator, subsets,
                    None if noise is None else noise[s:s + step]) for s in range(0, h.shape[0], step)]
    return TokenApprox(idx={k: torch.cat([p.idx[k] for p in parts]) for k in parts[0].idx},
                       error={k: torch.cat([p.error[k] for p in parts]) for k in parts[0].error},
                       spearman=torch.cat([p.spearman for p in parts]), abs_cos=torch.cat([p.abs_cos for p in parts]),
                       finite=torch.cat([p.finite for p in parts]), dtype=parts[0].dtype)


class ApproxReducer:
    """Engine consumer: per layer and selector an error sketch (exact mean, sketched median) and same-set counts,
    per layer Spearman and |cos| sums; everything on the device, padding weighted out (no host sync)."""

    def __init__(self, selectors: Sequence[str] = SELECTORS, seed: int = 0, max_subsets: int = MAX_SUBSETS,
                 layers: Sequence[int] | None = None):
        self.selectors = tuple(selectors)
        self.seed = seed
        self.max_subsets = max_subsets
        self.layers = None if layers is None else set(layers)
        self.errors: dict[int, dict[str, QuantileSketch]] = {}
        self.same: dict[int, dict[str, torch.Tensor]] = {}
        self.stats: dict[int, torch.Tensor] = {}  # [4]: spearman sum, spearman count, |cos| sum, tokens
        self._gen: dict[int, torch.Generator] = {}
        self.skipped: dict[int, str] = {}

    def _noise(self, L: MoELayer, ev: Any, device: torch.device) -> torch.Tensor | None:
        """``[B*S, n]`` uniform draws for ``random``, row r's seeded by (seed, layer, r) (the batch's global rows
        from engine.forward), so neither the batch size nor the number of ranks changes them; None without rows."""
        if "random" not in self.selectors or ev.rows is None:
            return None

        return uniform_rows(self.seed, L.index, ev.rows, ev.shape[1], L.n_experts, device)

    def __call__(self, ev: Any) -> None:
        L = ev.layer
        if self.layers is not None and L.index not in self.layers:
            return
        # every token position (padding too) is computed; padding is weighted out of every sum
        h, logits = ev.h.reshape(-1, ev.h.shape[-1]), ev.logits.reshape(-1, ev.logits.shape[-1])  # [T, d], [T, n]
        captured, keep = ev.idx.reshape(-1, ev.idx.shape[-1]), ev.valid.reshape(-1)  # [T, K], [T]
        if L.index not in self._gen:
            self._gen[L.index] = torch.Generator(device=h.device).manual_seed(self.seed * 1_000_003 + L.index)
            self.errors[L.index] = {}
            self.same[L.index] = {}
            self.stats[L.index] = torch.zeros(4, dtype=torch.float64, device=h.device)
            if "best_subset" in self.selectors and not best_subset_applies(L.n_experts, L.top_k, self.max_subsets):
                self.skipped[L.index] = (f"C({L.n_experts},{L.top_k}) = {math.comb(L.n_experts, L.top_k)} "
                                         f"> {self.max_subsets}")
        r = approx_tokens(L, h, logits, self.selectors, self._gen[L.index], self.max_subsets,
                          noise=self._noise(L, ev, h.device))
        keep = ops.to_device(keep, h.device)
        captured = ops.to_device(captured, h.device)
        guard.flag(L.index, (~r.finite & keep).any(), r.dtype)  # read with the forward's own NaN/inf flags
        for sel, err in r.error.items():
            self.errors[L.index].setdefault(sel, QuantileSketch(device=h.device)).add(err, keep)
            same = (ops.same_set(r.idx[sel], captured) & keep).sum().double()
            self.same[L.index][sel] = self.same[L.index].get(sel, 0) + same
        ok = torch.isfinite(r.spearman) & keep
        self.stats[L.index] += torch.stack([torch.where(ok, r.spearman.double(), 0.0).sum(), ok.sum().double(),
                                            torch.where(keep, r.abs_cos.double(), 0.0).sum(), keep.sum().double()])

    def reduce_across_ranks(self) -> None:
        """Sum every rank's sketches and counters (data parallel); a no-op in one process."""
        if distributed.world_size() <= 1:
            return
        seen: dict[int, list[str]] = {}  # a rank with no row saw no layer: the ranks agree on (layer, selector)
        for part in distributed.gather_object({li: sorted(e) for li, e in self.errors.items()}):
            for li, sels in part.items():
                seen[li] = sorted(set(seen.get(li, [])) | set(sels))
        for li in sorted(seen):
            errors, same = self.errors.setdefault(li, {}), self.same.setdefault(li, {})
            self.stats.setdefault(li, torch.zeros(4, dtype=torch.float64))
            for sel in seen[li]:
                distributed.all_reduce_state(errors.setdefault(sel, QuantileSketch()))
                same[sel] = distributed.all_reduce(torch.as_tensor(same.get(sel, 0), dtype=torch.float64))
        self.stats = distributed.all_reduce_dict({li: self.stats[li] for li in sorted(self.stats)})

    def tables(self) -> tuple[Any, Any]:
        """``(approx, approx_layers)`` DataFrames with exactly the columns of DEFINITIONS."""
        import pandas as pd

        if not self.errors:
            raise MoetoolError("no tokens reached the analysed MoE layers (empty data?)")
        rows, layer_rows = [], []
        for li in sorted(self.errors):
            sp_sum, sp_n, cos_sum, tok = self.stats[li].tolist()
            if tok == 0:
                continue
            for sel in self.selectors:
                if sel not in self.errors[li]:
                    continue
                sk = self.errors[li][sel]
                rows.append({"layer": li, "selector": sel, "tokens": sk.n,
                             "rel_error_mean": sk.mean, "rel_error_median": sk.median(),
                             "same_set_as_router": float(self.same[li][sel]) / sk.n})
            layer_rows.append({"layer": li, "spearman_prob_vs_norm": sp_sum / sp_n if sp_n else float("nan"),
                               "mean_abs_cos": cos_sum / tok})
        if not rows:
            raise MoetoolError("no tokens reached the analysed MoE layers (empty data?)")
        return pd.DataFrame(rows), pd.DataFrame(layer_rows)


def run_approx(lm: Any, tokens: Any, *, selectors: Sequence[str] = SELECTORS, seed: int = 0,
               max_subsets: int = MAX_SUBSETS, layers: Sequence[int] | None = None, batch_size: int = 8,
               quiet: bool = False) -> ApproxReducer:
    """Run the model with the plain router over ``tokens`` and reduce every MoE layer's events."""
    chosen = select_layers(lm.layers, layers)  # validates the indices
    quant.require_readable(chosen, "approx")
    if "router" in selectors:
        refuse_hash_routed(chosen, "approx's router selector")
    if set(selectors) == {"best_subset"} and not any(best_subset_applies(L.n_experts, L.top_k, max_subsets)
                                                     for L in chosen):  # no row at all: say why before the forward
        L = chosen[0]
        raise MoetoolError(f"--selectors best_subset: C(n, K) > --max-subsets {max_subsets} in every analysed MoE "
                           f"layer (layer {L.index}: C({L.n_experts},{L.top_k}) = {math.comb(L.n_experts, L.top_k)}), "
                           "so no layer has a best subset; raise --max-subsets or add another selector")
    red = ApproxReducer(selectors, seed, max_subsets, layers)
    forward(lm, tokens, consumers=[red], batch_size=batch_size, description="approx", quiet=quiet)
    return red


def approx(lm: Any, tokens: Any, options: ApproxOptions | None = None, *, quiet: bool = False,
           **overrides: Any) -> Result:
    """MoE as the best k-term approximation of the dense sum of all experts, per MoE layer and selector.

    Tables ``approx`` (layer, selector, tokens, rel_error_mean, rel_error_median, same_set_as_router) and
    ``approx_layers`` (layer, spearman_prob_vs_norm, mean_abs_cos); see :data:`DEFINITIONS`.
    """
    opts = resolve_options(ApproxOptions, options, overrides)
    red = run_approx(lm, tokens, selectors=opts.selectors, seed=opts.seed, max_subsets=opts.max_subsets,
                     layers=opts.layers, batch_size=opts.batch_size, quiet=quiet)
    table, per_layer = red.tables()
    return Result("approx", {"approx.csv": table, "approx_layers.csv": per_layer}, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(),
                            approx={"selectors": list(red.selectors), "max_subsets": red.max_subsets,
                                    "median": f"QuantileSketch, within {MEDIAN_REL_TOL:.4%} relative of the exact median",
                                    "best_subset_skipped": red.skipped}),
                  summary=table)


def summary_lines(name: str, res: Any) -> list[str]:
    """One line: the mean relative error per selector; the share of tokens (a fraction, as approx.csv's
    same_set_as_router) where the norm oracle picks the router's set; Spearman and mean |cos| over layers."""
    approx, per_layer = res["approx"], res["approx_layers"]
    by = approx.groupby("selector", sort=False)["rel_error_mean"].mean()
    rate = approx[approx["selector"] == "norm_oracle"]["same_set_as_router"].mean()
    errs = ", ".join(f"{s} {v:.3f}" for s, v in by.items())
    return [f"approx {name}: mean rel. error {errs}; norm oracle = router set on {fraction_text(rate)} of tokens; "
            f"Spearman(π, ||E||) {per_layer['spearman_prob_vs_norm'].mean():.2f}; "
            f"mean |cos| {per_layer['mean_abs_cos'].mean():.3f}"]
