"""The computation of ``moetool super-experts``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

# How (the command's --help above is this module's docstring):
# Super Experts (Su et al. 2025, "Unveiling Super Experts in Mixture-of-Experts Large Language Models", arXiv
# 2507.23279): a few experts whose down projection produces rare but extreme activation outliers, which become the
# massive activations of the hidden states; removing them hurts far more than removing others. One pass of the
# model's own routing over the data measures, per (MoE layer, expert), the largest ``|E_e(h)|`` over the output
# dimensions and over the real tokens read (every expert's output from the engine's batched probes in
# memory-bounded token chunks, :func:`moetool.engine.probes.routed_absmax`; a running max on the device; the max
# over data-parallel ranks). The criterion is the public code's (ZunhaiSu/Super-Experts-Profilling @ 573aead,
# eval_utils.py): ``_super_experts_analysis`` keeps the layers ``int(layer_index) < round(total_layers * 0.75)``
# (Python's round: half to even), ``_identify_super_experts`` keeps ``output_max > np.percentile(values, 99.5) and
# output_max > np.max(values) // 10``. Its hook (``experts_down_proj_hook``) records ``output[0].abs().max()`` per
# down-projection call: in transformers' per-expert loop (4.51 and 5.x alike) the first row of the expert's
# gathered tokens, one token per row of the batch (the code runs batches of one sequence) -- --reading first-row.
# It also considers the shared experts' down projections; moetool the routed experts only.
#
# Then the model runs on the same rows with the super experts removed (:class:`moetool.policies.prune.PrunePolicy`:
# their router rows deleted) and with as many random other experts removed in each layer (seeded): perplexity with the
# paired ratio to the model's own routing (document-level bootstrap).

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import distributed
from ...data import require_tokens
from ...adapters import quant
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.probes import DEFAULT_BUDGET, routed_absmax
from ...errors import MoetoolError
from ...policies.prune import PrunePolicy, random_removed
from ...uncertainty import RowTable, bootstrap_meta, format_ci, with_ci
from ..routing import SCORED_TOKENS, data_name, perplexity, ppl_columns
from ..result import Result, resolve_options
from .spec import MAX_RULES, READINGS, SuperExpertsOptions  # its options (declared with their flags there)

SOURCE = "Su et al. 2025, arXiv 2507.23279"
#: the code whose rule is the default (tests/peer/test_peer_super_experts.py ports it and compares)
CODE = ("ZunhaiSu/Super-Experts-Profilling @ 573aead3127ae593ba267758b832944f8fed1485, eval_utils.py "
        "(_super_experts_analysis, _identify_super_experts, experts_down_proj_hook)")

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "expert": "expert index within the layer (computed experts only: zero-computation experts -- LongCat-Flash's "
              "identity experts, Zaya's skip experts -- have no down projection, so they are neither measured, "
              "listed, counted among the maxima nor removed at random)",
    "routed": "real (unpadded) tokens whose top-K (the model's own routing) holds the expert",
    "max_abs_output": "largest |E_e(h)| over the output dimensions of the expert's down projection (the expert's "
                      "output before any routing weight) and over the tokens read: every real token routed to it "
                      "(reading routed), or per packed row the first token routed to it (reading first-row: the "
                      "tokens holding it as first choice in position order, then as second, ...; what the public "
                      f"code's hook reads, {CODE}); 0 if never routed",
    "share_of_max": "max_abs_output / the largest max_abs_output over all chosen MoE layers and experts",
    "rank": "rank of max_abs_output over all chosen MoE layers and experts (1 = largest; ties: lower layer, "
            "then lower expert)",
    "is_super": f"Super Expert ({SOURCE}): among the MoE layers of the first round(include_layers x L) decoder "
                "layers (default 0.75; L the model's decoder layers; Python's round, half to even), max_abs_output > "
                "the percentile-th percentile (default 99.5, numpy's linear interpolation) of every (layer, expert) "
                "maximum AND, max_rule floordiv (default, the code's), > largest // (1 / fraction_of_max) (floor "
                "division: largest // 10), or, max_rule fraction, >= fraction_of_max x the largest",
    "threshold": "the larger of the percentile value and the max rule's value: the value a super expert's maximum "
                 "passes (the same on every row)",
    "can_pass": "at most this many (layer, expert) maxima can be above the percentile: N - 1 - floor((N - 1) x "
                "percentile / 100) for N maxima (the same on every row)",
    "degenerate": "True when can_pass <= 1 (N <= 201 at 99.5): the percentile lets only the single largest maximum "
                  "through, so the rule picks the largest expert or nothing, whatever the data (the same on every "
                  "row)",
    "ablation": "none (the model's own routing), super (the super experts removed), random (as many experts per "
                "layer removed, a seeded permutation of the layer's other experts)",
    "removed": "experts removed, summed over the MoE layers",
    "experts": "the removed experts as layer:expert, space-separated",
    "scored_tokens": SCORED_TOKENS,
    "perplexity": "exp(mean next-token NLL) of the data with the experts removed (as moetool ppl)",
    "ratio": "perplexity / the model's own perplexity on the same rows (paired)",
    "delta_ppl": "perplexity - the model's own perplexity",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


def super_mask(maxima: Any, percentile: float = 99.5, fraction_of_max: float = 0.1,
               max_rule: str = "floordiv") -> tuple[np.ndarray, float, float]:
    """``(is_super, percentile value, the max rule's value)`` of the maxima of every (layer, expert): super when
    strictly above the percentile (numpy's linear interpolation) and, ``max_rule`` floordiv (the paper's code),
    strictly above ``largest // (1 / fraction_of_max)``, or, ``fraction``, at least ``fraction_of_max x largest``."""
    a = np.asarray(maxima, dtype=np.float64)
    if a.size == 0 or not np.isfinite(a).all():
        raise MoetoolError("super-experts: the expert output maxima are empty or not finite")
    p = float(np.percentile(a, percentile))
    if max_rule == "floordiv":
        f = float(a.max() // (1.0 / fraction_of_max)) if fraction_of_max > 0 else 0.0
        return (a > p) & (a > f), p, f
    if max_rule == "fraction":
        f = float(fraction_of_max * a.max())
        return (a > p) & (a >= f), p, f
    raise MoetoolError(f"--max-rule must be one of {', '.join(MAX_RULES)}, not {max_rule!r}")


def can_pass(n: int, percentile: float) -> int:
    """How many of ``n`` values can lie strictly above their ``percentile``-th percentile (linear interpolation:
    the percentile sits at sorted position ``(n - 1) q / 100``, so only the values above ``floor`` of it can)."""
    return int(n - 1 - np.floor((n - 1) * percentile / 100.0))


def included_layers(n_decoder: int, include_layers: float) -> int:
    """The paper's code's layer cut: decoder layers ``< round(n_decoder * include_layers)`` (Python's round, half to
    even, as ``_super_experts_analysis``)."""
    return round(n_decoder * include_layers)


def decoder_layers(lm: Any) -> int:
    """The model's decoder layers L (``num_hidden_layers`` of its text config; at least one past its last MoE
    layer's index)."""
    cfg = getattr(lm, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = next((getattr(text, k) for k in ("num_hidden_layers", "num_layers", "n_layers")
              if isinstance(getattr(text, k, None), int)), 0)
    return max(n, max(L.index for L in lm.layers) + 1)


def first_rows(idx: torch.Tensor, valid: torch.Tensor, shape: tuple[int, int], n: int) -> torch.Tensor:
    """``[T, n]`` bool: per row of the batch and expert, the token the paper's code reads (``output[0]`` of the
    expert's down projection in transformers' per-expert loop: its tokens gathered by ``torch.where`` over the
    ``[K, T]`` mask, i.e. slot-major, then position), the first real token holding the expert in its top-K at the
    lowest slot, then the lowest position."""
    B, S = shape
    T, K = idx.shape
    dev = idx.device
    pos = torch.arange(T, device=dev) % S  # position in the row
    key = torch.arange(K, device=dev).unsqueeze(0) * S + pos.unsqueeze(1)  # [T, K]: slot-major order in the row
    big = K * S
    key = torch.where(valid.to(dev).unsqueeze(1), key, torch.full_like(key, big))
    row = (torch.arange(T, device=dev) // S).unsqueeze(1).expand(T, K)
    first = torch.full((B, n), big, dtype=key.dtype, device=dev)
    first = first.view(-1).scatter_reduce(0, (row * n + idx).reshape(-1), key.reshape(-1), "amin").view(B, n)
    hit = first < big  # [B, n]
    tok = torch.arange(B, device=dev).unsqueeze(1) * S + first % S  # [B, n] the token read
    out = torch.zeros(T, n, dtype=torch.bool, device=dev)
    b, e = torch.nonzero(hit, as_tuple=True)
    out[tok[b, e], e] = True
    return out


class MaxOutput:
    """Per chosen MoE layer: per expert, the routed real tokens and the running max of ``|E_e(h)|`` over the tokens
    read (``reading`` routed: all routed; first-row: :func:`first_rows`) (a forward consumer; device tensors, no
    host sync; over data-parallel ranks: summed counts, max of maxima)."""

    def __init__(self, layers: list[int], budget: int | None = None, reading: str = "routed") -> None:
        if reading not in READINGS:
            raise MoetoolError(f"--reading must be one of {', '.join(READINGS)}, not {reading!r}")
        self.layers = set(layers)
        self.budget = budget or DEFAULT_BUDGET
        self.reading = reading
        self.count: dict[int, torch.Tensor] = {}
        self.max: dict[int, torch.Tensor] = {}
        self.computed: dict[int, int] = {}  # per layer: its computed experts (zero-computation ones have no down proj)

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        idx = ev.idx  # the model's own routing (no policy runs in this pass)
        routed = torch.zeros(idx.shape[0], L.n_experts, dtype=torch.bool, device=idx.device)
        routed.scatter_(1, idx, ev.valid.unsqueeze(-1).expand(idx.shape))
        read = routed if self.reading == "routed" else first_rows(idx, ev.valid, ev.shape, L.n_experts)
        m = routed_absmax(L, ev.h, read, "output", budget=self.budget)
        c = routed.double().sum(0)
        i = L.index
        self.computed[i] = L.n_computed
        self.count[i] = c if i not in self.count else self.count[i] + c
        self.max[i] = m if i not in self.max else torch.maximum(self.max[i], m)

    def merge_across_ranks(self) -> None:
        if distributed.world_size() > 1:
            self.count = distributed.all_reduce_keyed(self.count)
            self.max = distributed.all_reduce_keyed(self.max, op="max")

    def table(self, percentile: float = 99.5, fraction_of_max: float = 0.1,
              max_rule: str = "floordiv") -> tuple[Any, float, float]:
        """``super_experts.csv`` (layer, expert, routed, max_abs_output, share_of_max, rank, is_super, threshold,
        can_pass, degenerate) and the two thresholds (the percentile value, the max rule's value)."""
        import pandas as pd

        if not self.max:
            raise MoetoolError("super-experts: no MoE layer routed a token (empty data?)")
        rows = []
        for layer in sorted(self.max):
            c, m = self.count[layer].cpu(), self.max[layer].cpu()
            rows += [{"layer": layer, "expert": e, "routed": int(c[e]), "max_abs_output": float(m[e])}
                     for e in range(self.computed.get(layer, len(m)))]  # zero-computation experts: not measured
        df = pd.DataFrame(rows)
        is_super, p, f = super_mask(df["max_abs_output"], percentile, fraction_of_max, max_rule)
        top = df["max_abs_output"].max()
        df["share_of_max"] = df["max_abs_output"] / top if top > 0 else 0.0
        order = df.sort_values(["max_abs_output", "layer", "expert"], ascending=[False, True, True]).index
        df.loc[order, "rank"] = np.arange(1, len(df) + 1)
        df["rank"] = df["rank"].astype(int)
        df["is_super"] = is_super
        df["threshold"] = max(p, f)
        df["can_pass"] = can_pass(len(df), percentile)
        df["degenerate"] = df["can_pass"] <= 1
        return df, p, f


def _label(removed: dict[int, list[int]]) -> str:
    return " ".join(f"{layer}:{e}" for layer, es in sorted(removed.items()) for e in es)


def super_experts(lm: Any, tokens: Any, options: SuperExpertsOptions | None = None, *, quiet: bool = False,
                  **overrides: Any) -> Result:
    """Max |expert output| per (MoE layer, expert), the Super Experts among them, and perplexity with them removed
    against as many random experts removed per layer. Tables ``super_experts`` and ``super_experts_ablation``; see
    :data:`DEFINITIONS`."""
    import pandas as pd

    opts = resolve_options(SuperExpertsOptions, options, overrides)
    require_tokens(tokens)
    chosen = select_layers(lm.layers, opts.layers)
    n_decoder = decoder_layers(lm)
    cut = included_layers(n_decoder, opts.include_layers)
    layers = [L for L in chosen if L.index < cut]
    if not layers:  # before any forward: the layer cut leaves nothing to profile
        raise MoetoolError(f"super-experts: --include-layers {opts.include_layers:g} keeps decoder layers < "
                           f"round({opts.include_layers:g} x {n_decoder}) = {cut}, and none of the chosen MoE layers "
                           f"{[L.index for L in chosen]} is among them; raise --include-layers (1: every layer)")
    quant.require_readable(layers, "super-experts")
    indices = [L.index for L in layers]
    shard = distributed.shard(tokens, opts.batch_size)

    def run(policy: Any, description: str, consumers: tuple = (), where: list[int] | None = None) -> Any:
        return perplexity(lm, shard, policy=policy, policy_layers=indices if where is None else where,
                          consumers=consumers,
                          batch_size=opts.batch_size, quiet=quiet, rows=RowTable(shard), description=description)

    probe = MaxOutput(indices, reading=opts.reading)
    base = run(None, "router + max |expert output|", (probe,))
    probe.merge_across_ranks()
    table, p_value, f_value = probe.table(opts.percentile, opts.fraction_of_max, opts.max_rule)
    sup = table[table.is_super]
    removed = {int(layer): sorted(int(e) for e in g.expert) for layer, g in sup.groupby("layer")}
    by_index = {L.index: L for L in layers}
    rand = {layer: random_removed(opts.seed, layer, by_index[layer].n_computed,
                                  len(es), exclude=es)  # computed experts only, as the super experts
            for layer, es in removed.items()}
    short = [layer for layer, es in removed.items() if len(rand[layer]) < len(es)]
    if short:  # a random set smaller than the super set would compare unlike with like
        raise MoetoolError(f"super-experts: layers {short} have more super experts than other experts, so no random "
                           f"set of the same size exists (raise --percentile or --fraction-of-max)")

    def row(ablation: str, res: Any, sets: dict[int, list[int]]) -> dict[str, Any]:
        return {"ablation": ablation, "removed": sum(len(v) for v in sets.values()), "experts": _label(sets),
                "scored_tokens": res.nll.tokens,
                **ppl_columns(res, base, n_boot=opts.bootstrap, seed=opts.seed,
                              between={"delta_ppl": res.perplexity - base.perplexity})}

    hashed = [f"{layer}:{e}" for layer, es in removed.items() if getattr(by_index[layer], "hash_routed", False)
              for e in es]
    others = [L.index for L in chosen if not getattr(L, "hash_routed", False)]
    hint = (f"the layers the router routes are --layers {','.join(map(str, others))}"
            + (" --include-layers 1" if max(others) >= cut else "") if others else
            "no chosen MoE layer is routed by the router")
    if hashed:  # a hash-routed layer's experts are chosen by token id: deleting router rows removes nothing there
        raise MoetoolError(f"super-experts: super expert(s) {' '.join(hashed)} sit in hash-routed layers (experts "
                           f"chosen by token id, not by the router), so the ablation cannot remove them; their "
                           f"maxima are measured, but {hint}")
    rows = [row("none", base, {})]
    if removed:
        for name, sets in (("super", removed), ("random", rand)):
            policy = PrunePolicy(sets, name=f"{name} experts removed")
            for L in layers:
                policy.check(L)
            rows.append(row(name, run(policy, policy.name, where=sorted(removed)), sets))  # only where it removes
    ablation = pd.DataFrame(rows)
    summary = with_ci(ablation[["ablation", "removed", "perplexity", "perplexity_lo", "perplexity_hi", "ratio",
                                "ratio_lo", "ratio_hi"]])
    criterion = {"source": SOURCE, "code": CODE, "percentile": opts.percentile,
                 "fraction_of_max": opts.fraction_of_max, "max_rule": opts.max_rule, "reading": opts.reading,
                 "include_layers": opts.include_layers, "decoder_layers": n_decoder, "layers_below": cut,
                 "percentile_value": p_value, "max_rule_value": f_value,
                 "threshold": max(p_value, f_value), "n_values": len(table),
                 "can_pass": int(table.can_pass.iloc[0]), "degenerate": bool(table.degenerate.iloc[0]),
                 "n_super": int(table.is_super.sum())}
    return Result("super_experts", {"super_experts.csv": table, "super_experts_ablation.csv": ablation}, opts,
                  meta=dict(definitions=DEFINITIONS, criterion=criterion, data=tokens.describe(),
                            data_name=data_name(tokens.source), layers=indices,
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, base.rows.n_rows)),
                  summary=summary)


def summary_lines(name: str, res: Result) -> list[str]:
    """The super experts and the perplexity ratios of removing them and as many random experts."""
    df = res["super_experts"]
    sup = df[df.is_super].sort_values("rank")
    out = [f"super-experts {name}: {len(sup)} super expert(s) of {len(df)}: "
           + (", ".join(f"layer {r.layer} expert {r.expert} (max |out| {r.max_abs_output:.3g})"
                        for r in sup.itertuples()) or "none")]
    if len(df) and bool(df.degenerate.iloc[0]):
        out.append(f"  degenerate: with {len(df)} maxima the percentile lets only the largest through")
    abl = res["super_experts_ablation"].set_index("ablation")
    if "super" in abl.index:
        sup_r, rnd_r = (format_ci(*abl.loc[k, ["ratio", "ratio_lo", "ratio_hi"]]) for k in ("super", "random"))
        out.append(f"  removed: super x{sup_r}, random x{rnd_r} "
                   f"(perplexity / the model's, {int(abl.loc['super', 'removed'])} expert(s))")
    return out
