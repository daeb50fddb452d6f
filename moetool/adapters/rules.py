"""The routing rules of the MoE families in transformers: one small catalogue of pure functions.

A rule maps router logits ``[T, n]`` (and a few parameters read off the router: correction bias, groups,
scale, ...) to the full routing distribution π ``[T, n]``, the top-K indices ``[T, K]`` and the weights
``[T, K]`` the experts' outputs are summed with. Every rule here is one some installed family uses:

=======================  =================================================================================
``softmax-topk``         p = softmax(logits); top-K of p (+ bias) [within the best groups]; w = p x scale
``softmax-topk-renorm``  as above, w = p / sum(p) x scale (Mixtral, Qwen3, ERNIE with clamp(sum, min))
``topk-softmax``         top-K of logits (+ bias); w = softmax over the K chosen logits (gpt-oss, Granite)
``sigmoid-topk``         s = sigmoid(logits); top-K of s + correction bias [within groups]; w = s x scale
``sigmoid-topk-renorm``  as above, w = s / sum(s) x scale (DeepSeek-V3, GLM-4.5, MiniMax-M2)
``topk-sigmoid``         top-K of logits (+ bias); w = sigmoid of the K chosen logits (Llama 4)
``topk-sigmoid-renorm``  as above, w / sum(w) (Kolibri, Cohere2-MoE's sigmoid option)
``sparsemixer``          Phi-3.5-MoE, eval mode: two rounds, each a softmax over the logits within 2 eps
``sqrtsoftplus-topk-renorm``  s = sqrt(softplus(logits)); top-K of s + correction bias; w = s / sum(s) x scale
                         (DeepSeek-V4; its hash-routed layers choose by token id and weight the same way)
=======================  =================================================================================

With ``Params.shared = s`` (Inkling) the logits carry ``s`` shared experts' logits after the ``n`` routed ones: π,
the selection and every index concern the routed ones; a renormalised sigmoid rule's weights are then
``sigmoid(l) / (sum over the chosen and the shared)`` (an extra input of the rule, not a new rule).

π is softmax(logits) for the softmax rules and sparsemixer, sigmoid(logits) (sqrt(softplus(logits)) for
sqrtsoftplus) normalised to sum to one for the sigmoid rules. :func:`identify` picks the rule (and parameter variant) that reproduces a router's own output.
Top-K and renormalisation go through :mod:`moetool.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import torch
import torch.nn.functional as F

from .. import ops
from ..errors import MoetoolError


@dataclass(frozen=True, eq=False)
class Params:
    """What a rule needs beyond the logits (read off the router and its block)."""

    top_k: int
    bias: torch.Tensor | None = None  # correction bias [n]: shifts the selection only, never the weights
    n_group: int = 1  # group-limited top-K: keep the topk_group best of n_group contiguous groups
    topk_group: int = 1
    group_score: str = "top2sum"  # a group's score: the sum of its two best ("top2sum", DeepSeek-V3) or "max"
    scale: float = 1.0  # routed_scaling_factor, applied to the weights last
    renorm_eps: float = 0.0  # w / (sum + eps)
    norm_min: float = 0.0  # w / clamp(sum, norm_min) (ERNIE-4.5)
    jitter_eps: float | None = None  # sparsemixer's threshold (None: not a sparsemixer router)
    weights_dtype: torch.dtype | None = None  # None: fp32
    rank_dtype: torch.dtype | None = None  # scores rounded to this dtype before the top-K, ties to the lowest index
    # (Switch Transformers ranks its fp32 probabilities cast back to the input dtype, with argmax)
    shared: int = 0  # trailing logit columns that are shared experts' (Inkling): never chosen, but their sigmoid
    #                 scores join the chosen ones' in the renormalisation (w = s / (sum s + sum s_shared))

    def describe(self) -> dict:
        d = {"top_k": self.top_k, "correction_bias": self.bias is not None, "routed_scaling_factor": self.scale}
        if self.n_group > 1:
            d.update(n_group=self.n_group, topk_group=self.topk_group, group_score=self.group_score)
        if self.renorm_eps:
            d["renorm_eps"] = self.renorm_eps
        if self.norm_min:
            d["norm_min"] = self.norm_min
        if self.jitter_eps is not None:
            d["jitter_eps"] = self.jitter_eps
        if self.rank_dtype is not None:
            d["rank_dtype"] = str(self.rank_dtype).removeprefix("torch.")
        if self.shared:
            d["normalised_with_shared_logits"] = self.shared
        return d


def group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """``[T, n]`` bool: experts in the ``topk_group`` best of ``n_group`` contiguous groups.

    A group is scored by the sum of its two best scores (``"top2sum"``, V3) or its best (``"max"``, V2).
    """
    T, n = scores.shape
    grouped = scores.view(T, n_group, n // n_group)
    gs = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2sum" else grouped.max(dim=-1).values
    keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1], 1)
    return keep.bool().unsqueeze(-1).expand(T, n_group, n // n_group).reshape(T, n)


def _renorm(w: torch.Tensor, p: Params) -> torch.Tensor:
    if not p.renorm_eps and not p.norm_min:
        return ops.normalize(w)
    return w / (w.sum(dim=-1, keepdim=True) + p.renorm_eps).clamp_min(p.norm_min)


def routed_part(logits: torch.Tensor, p: Params | None) -> torch.Tensor:
    """The routed experts' logits ``[T, n]`` of logits that may carry ``p.shared`` trailing shared columns."""
    return logits[..., :logits.shape[-1] - p.shared] if p is not None and p.shared else logits


def sparsemixer_weights(logits: torch.Tensor, idx: torch.Tensor, eps: float) -> torch.Tensor:
    """Phi-3.5-MoE's multipliers for the chosen set ``idx``, taken in descending logit order: the r-th is its
    softmax over the logits minus the earlier chosen, dropping every expert ``e`` with
    ``(s_j - s_e) / max(|s_e|, s_j) > 2 eps``. For the router's own top-2 this is sparsemixer (eval) exactly."""
    chosen = logits.gather(-1, idx)
    # descending logits, ties by expert index (the model's max() takes the lowest index first): in bf16 ties occur
    by_index = idx.argsort(dim=-1, stable=True)
    order = by_index.gather(-1, chosen.gather(-1, by_index).argsort(dim=-1, descending=True, stable=True))
    w = torch.empty_like(chosen)
    remaining = logits
    for r in range(idx.shape[-1]):
        k = order[:, r:r + 1]
        j = idx.gather(-1, k)
        top = logits.gather(-1, j)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        w.scatter_(-1, k, torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1).gather(-1, j))
        remaining = remaining.scatter(-1, j, float("-inf"))
    return w


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))``: DeepSeek-V4's router score (transformers' ``ACT2FN["sqrtsoftplus"]``)."""
    return torch.nn.functional.softplus(x).sqrt()


@dataclass(frozen=True)
class Rule:
    """One routing rule. ``score``: what top-K ranks (``softmax`` probabilities, ``sigmoid`` scores or raw
    ``logits``); ``weight``: what the chosen get (``score`` = the ranked score itself, ``softmax`` /
    ``sigmoid`` of the chosen logits, ``sparsemixer``); ``renorm``: weights divided by their sum."""

    name: str
    score: str
    weight: str
    renorm: bool
    template: str  # the scoring in words; {bias}, {groups}, {scale}: the steps a router may or may not have

    @property
    def text(self) -> str:
        """The rule in words, its optional steps marked: ``softmax -> top-K (+ correction bias) [within groups] ->
        weights = p x scale`` (the catalogue's; a router's own is :meth:`scoring`)."""
        return self.template.format(bias=" (+ correction bias)", groups=" [within groups]", scale=" x scale")

    def scoring(self, p: Params) -> str:
        """The routing of a router with parameters ``p`` in words: a correction bias, group-limited top-K and a
        routed scaling factor only where ``p`` has them (``softmax -> top-K -> weights = p / sum`` for Mixtral,
        ``... + correction bias within the best 4 of 8 groups -> score / sum x 2.5`` for DeepSeek-V3)."""
        if self.weight == "sparsemixer":  # its two rounds rank the logits alone
            bias = groups = ""
        else:
            bias = " + correction bias" if p.bias is not None else ""
            groups = f" within the best {p.topk_group} of {p.n_group} groups" if p.n_group > 1 else ""
        return self.template.format(bias=bias, groups=groups, scale=f" x {p.scale:g}" if p.scale != 1.0 else "")

    # ----- the full distribution ---------------------------------------------------------------------------
    def probs(self, logits: torch.Tensor, p: Params | None = None) -> torch.Tensor:
        """π over all n experts (fp32, rows sum to one)."""
        logits = routed_part(logits, p)
        if self.score == "sqrtsoftplus":
            return ops.normalize(sqrtsoftplus(logits.float()))
        if self.score == "sigmoid" or self.weight == "sigmoid":
            return ops.normalize(torch.sigmoid(logits.float()))
        return torch.softmax(logits.float(), dim=-1)

    # ----- selection ---------------------------------------------------------------------------------------
    def scores(self, logits: torch.Tensor, p: Params) -> torch.Tensor:
        """What the rule ranks experts by (correction bias included, before any group restriction)."""
        x = routed_part(logits, p).float()
        s = torch.softmax(x, dim=-1) if self.score == "softmax" else torch.sigmoid(x) if self.score == "sigmoid" \
            else sqrtsoftplus(x) if self.score == "sqrtsoftplus" else x
        return s if p.bias is None else s + p.bias.float().reshape(-1)

    def select(self, logits: torch.Tensor, p: Params, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Top-K indices ``[T, K]`` (largest first). ``keep [n]`` (bool): only these experts can be chosen (the
        others' selection scores are -inf before any group restriction and the top-K)."""
        if self.weight == "sparsemixer":  # two rounds, each the best logit not yet picked (max(): ties as the model)
            if keep is not None:
                logits = logits.masked_fill(~keep, float("-inf"))
            first = logits.max(dim=-1, keepdim=True)[1]
            return torch.cat((first, logits.scatter(-1, first, float("-inf")).max(dim=-1, keepdim=True)[1]), dim=-1)
        s = self.scores(logits, p)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        if p.n_group > 1:
            s = s.masked_fill(~group_mask(s, p.n_group, p.topk_group, p.group_score), float("-inf"))
        if p.rank_dtype is not None:
            return ops.topk(s.to(p.rank_dtype), p.top_k, stable=True)
        return ops.topk(s, p.top_k)

    # ----- weights -----------------------------------------------------------------------------------------
    def weights(self, logits: torch.Tensor, idx: torch.Tensor, p: Params,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's weights for any chosen set ``idx [T, K]`` (in ``idx``'s order). ``mask [T, K]`` (bool):
        a chosen set of its own size per token, the columns where it is False not chosen (weight 0, and left out
        of a softmax over the chosen or a renormalisation). With ``p.shared`` the logits carry the shared experts'
        after the routed ones: sigmoid weights are renormalised together with theirs."""
        if p.shared:
            return self._weights_with_shared(logits, idx, p, mask)
        x = logits.float()
        if self.weight == "sparsemixer":  # in the logits' own dtype, as the model: its 2 eps mask flips in fp32
            if mask is not None:
                raise MoetoolError("sparsemixer weights are defined for its own two rounds, not a chosen set of "
                                   "any size")
            w = sparsemixer_weights(logits, idx, p.jitter_eps or 0.0).float()
        elif self.weight == "softmax":
            chosen = x.gather(-1, idx)
            w = torch.softmax(chosen if mask is None else chosen.masked_fill(~mask, float("-inf")), dim=-1)
        elif self.weight == "sigmoid":
            w = torch.sigmoid(x.gather(-1, idx))
        else:
            w = (torch.softmax(x, dim=-1) if self.score == "softmax" else sqrtsoftplus(x) if self.score == "sqrtsoftplus"
                 else torch.sigmoid(x)).gather(-1, idx)
        if mask is not None:
            w = w * mask
        if self.renorm:
            w = _renorm(w, p)
        if p.scale != 1.0:
            w = w * p.scale
        return w if p.weights_dtype is None else w.to(p.weights_dtype)

    def _weights_with_shared(self, logits: torch.Tensor, idx: torch.Tensor, p: Params,
                             mask: torch.Tensor | None) -> torch.Tensor:
        """``sigmoid(l) / (sum over the chosen and the shared)`` x scale, computed as Inkling's router does (a softmax
        of logsigmoids over the chosen routed logits and the shared ones)."""
        if not (self.renorm and "sigmoid" in (self.score, self.weight)) or p.renorm_eps or p.norm_min:
            raise MoetoolError(f"{self.name}: weights normalised with shared experts' logits are defined for "
                               f"the renormalised sigmoid rules only (no eps, no clamp)")
        x = logits.float()
        chosen = routed_part(x, p).gather(-1, idx)
        if mask is not None:
            chosen = chosen.masked_fill(~mask, float("-inf"))
        lp = F.logsigmoid(torch.cat([chosen, x[..., x.shape[-1] - p.shared:]], dim=-1))
        w = torch.exp(lp - torch.logsumexp(lp, dim=-1, keepdim=True))[..., :idx.shape[-1]]
        if p.scale != 1.0:
            w = w * p.scale
        return w if p.weights_dtype is None else w.to(p.weights_dtype)

    def __call__(self, logits: torch.Tensor, p: Params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(π [T, n], idx [T, K], weights [T, K])``."""
        idx = self.select(logits, p)
        return self.probs(logits, p), idx, self.weights(logits, idx, p)


SOFTMAX_TOPK = Rule("softmax-topk", "softmax", "score", False,
                    "softmax -> top-K{bias}{groups} -> weights = p{scale}")
SOFTMAX_TOPK_RENORM = Rule("softmax-topk-renorm", "softmax", "score", True,
                           "softmax -> top-K{bias}{groups} -> weights = p / sum{scale}")
TOPK_SOFTMAX = Rule("topk-softmax", "logits", "softmax", False,
                    "top-K of logits{bias}{groups} -> softmax over the K{scale}")
SIGMOID_TOPK = Rule("sigmoid-topk", "sigmoid", "score", False,
                    "sigmoid -> top-K of score{bias}{groups} -> weights = score{scale}")
SIGMOID_TOPK_RENORM = Rule("sigmoid-topk-renorm", "sigmoid", "score", True,
                           "sigmoid -> top-K of score{bias}{groups} -> score / sum{scale}")
TOPK_SIGMOID = Rule("topk-sigmoid", "logits", "sigmoid", False,
                    "top-K of logits{bias}{groups} -> sigmoid of the K{scale}")
TOPK_SIGMOID_RENORM = Rule("topk-sigmoid-renorm", "logits", "sigmoid", True,
                           "top-K of logits{bias}{groups} -> sigmoid of the K / sum{scale}")
SPARSEMIXER = Rule("sparsemixer", "logits", "sparsemixer", False,
                   "sparsemixer (eval): top-2 by logits; weight = softmax over the logits within 2 eps of it{scale}")
SQRTSOFTPLUS_TOPK_RENORM = Rule("sqrtsoftplus-topk-renorm", "sqrtsoftplus", "score", True,
                                "sqrt(softplus) -> top-K of score{bias}{groups} -> score / sum{scale}")

#: the catalogue, in order of preference when two rules reproduce a router equally well
RULES: tuple[Rule, ...] = (SOFTMAX_TOPK, SOFTMAX_TOPK_RENORM, TOPK_SOFTMAX, SIGMOID_TOPK, SIGMOID_TOPK_RENORM,
                           TOPK_SIGMOID, TOPK_SIGMOID_RENORM, SPARSEMIXER, SQRTSOFTPLUS_TOPK_RENORM)
BY_NAME = {r.name: r for r in RULES}


# ----- identification ------------------------------------------------------------------------------------
class NoRuleMatches(ValueError):
    """No rule of the catalogue reproduces the router; the message says what came closest."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing weights of ``dtype`` (torch.testing's defaults)."""
    return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float64: (1e-7, 1e-7)}.get(
        dtype, (1.3e-6, 1e-5))


def _error(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float:
    """How far ``got`` is from ``want`` in units of the tolerance (<= 1: allclose)."""
    diff = (got.double() - want.double()).abs()
    return float((diff / (atol + rtol * want.double().abs())).max()) if diff.numel() else 0.0


def identify(logits: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
             candidates: Iterable[Params], rules: Iterable[Rule] = RULES, *,
             fixed_selection: bool = False) -> tuple[Rule, Params]:
    """The rule and parameters that reproduce a router's own ``(logits, weights, idx)``.

    Indices must be the same set per token, exactly; weights (compared in the router's own order) must be
    allclose at the tolerance of their dtype. Among the matches: one that uses the correction bias (when a
    candidate carries one) before one that ignores it, then the closest weights, then catalogue order, then
    candidate order. None -> :class:`NoRuleMatches` naming the closest rule and what differed.
    ``fixed_selection``: the indices were not chosen by the rule (a hash router's table): only the weights count,
    and rules whose weights are not the score of the chosen (softmax over the K, sparsemixer) are not tried.
    """
    candidates = list(candidates)
    has_bias = any(p.bias is not None for p in candidates)
    rtol, atol = tolerance(weights.dtype)
    matches: list[tuple[tuple, Rule, Params]] = []
    idx_miss: tuple[float, str] = (-1.0, "")  # best index agreement of a rule whose indices differ
    w_miss: tuple[float, str, float] = (float("inf"), "", 0.0)  # (error, rule, max |diff|) with the same indices
    selected: dict[tuple, torch.Tensor] = {}
    for r, rule in enumerate(rules):
        for c, p in enumerate(candidates):
            if rule.weight == "sparsemixer" and (p.jitter_eps is None or p.bias is not None or p.n_group > 1):
                continue  # sparsemixer ranks the raw logits: no bias, no groups
            if rule.weight != "sparsemixer" and p.jitter_eps is not None:
                continue
            if p.shared and not (rule.renorm and "sigmoid" in (rule.score, rule.weight)) or \
                    p.shared and (p.renorm_eps or p.norm_min):
                continue  # normalised with the shared experts' scores: the renormalised sigmoid rules only
            key = (rule.score, rule.weight == "sparsemixer", id(p.bias), p.n_group, p.topk_group, p.group_score,
                   p.rank_dtype, p.shared)
            if key not in selected:
                selected[key] = rule.select(logits, p)
            sel = selected[key]
            if fixed_selection and rule.weight != "score":
                continue
            if sel.shape != idx.shape:
                continue
            agree = 1.0 if fixed_selection else float(ops.same_set(sel, idx).float().mean())
            if agree < 1.0:
                idx_miss = max(idx_miss, (agree, rule.name))
                continue
            got = rule.weights(logits, idx, replace(p, weights_dtype=None)).to(weights.dtype)
            err = _error(got, weights, rtol, atol)
            if err < w_miss[0]:
                w_miss = (err, rule.name, float((got.double() - weights.double()).abs().max()))
            if err <= 1.0:
                matches.append(((has_bias and p.bias is None, err, r, c), rule, p))
    if matches:
        _, rule, p = min(matches, key=lambda m: m[0])
        return rule, replace(p, weights_dtype=weights.dtype)
    if w_miss[1]:
        raise NoRuleMatches(f"indices matched {w_miss[1]}, weights differ by {w_miss[2]:.1e}")
    if idx_miss[1]:
        raise NoRuleMatches(f"indices match no rule (closest: {idx_miss[1]}, same top-{idx.shape[-1]} set on "
                            f"{idx_miss[0]:.0%} of tokens)")
    raise NoRuleMatches(f"no rule selects {idx.shape[-1]} experts")
