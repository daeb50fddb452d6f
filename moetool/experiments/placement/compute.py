"""``placement``: expert-parallel placement what-if (issue: interventions, item 6).

The model's own routing is counted per (layer, expert) on the data during one forward (the top-K assignments of
real tokens, :class:`moetool.experiments.specialization.LoadBalance`, on the device). For G GPUs, each placement
puts ``(n + R) / G`` expert replicas on every GPU; a GPU's load is the sum of its replicas' loads, an expert with
c replicas sending each ``load / c`` (EPLB's own assumption: tokens split evenly over the replicas). The per-GPU
load imbalance is ``max / mean`` over the GPUs (1 = perfectly balanced; the MoE layer waits for its busiest GPU).

Placements:

* ``contiguous``: expert e on GPU ``e * G // n`` (the static layout: consecutive experts per GPU), R = 0;
* ``round_robin``: expert e on GPU ``e % G``, R = 0;
* ``eplb``: DeepSeek's expert-parallel load balancer (:func:`rebalance_experts`, a port of ``eplb.py`` of
  DeepSeek-AI, EPLB, 2025, https://github.com/deepseek-ai/EPLB, MIT licence): R redundant replicas for the
  heaviest experts, then a balanced packing of the replicas onto GPUs (hierarchical: groups of experts to nodes
  first when the expert groups divide into the nodes), computed from the loads it is evaluated on;
* ``eplb_stale``: the EPLB placement computed from another data set's loads (``reference``) and/or another
  checkpoint's (``reference_model``), evaluated on the data's under the model: what a placement fitted once loses
  when the traffic or the weights change.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import distributed
from ...data import require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward
from ...errors import MoetoolError, layers_of_one, shown
from ...uncertainty import (LEVEL, RowTable, bootstrap_meta, bootstrap_weights, format_ci, percentile, replicates,
                           sum_intervals, with_ci)
from ..routing import data_name
from ..result import Result, resolve_options
from ..specialization import LoadBalance
from .spec import PlacementOptions  # noqa: F401 - its options (declared with their flags in spec.py)

METHODS = ("contiguous", "round_robin", "eplb", "eplb_stale")

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "zero_computation_experts": "experts with no computation (LongCat-Flash's identity experts, Zaya's skip class) "
                                "are not placed: n counts the computed experts, their loads leave out the "
                                "assignments to zero-computation experts (load_fraction then sums to 1 minus "
                                "stats' zero_compute_fraction)",
    "gpus": "G, the GPUs the layer's experts are spread over (expert parallelism)",
    "nodes": "server nodes the GPUs sit in (EPLB's hierarchical packing: expert groups to nodes first)",
    "replicas": "R, the redundant expert replicas beyond the n experts (extra_slots x G); 0 for contiguous and "
                "round_robin",
    "slots_per_gpu": "(n + R) / G expert replicas on every GPU",
    "method": "contiguous (expert e on GPU e*G//n), round_robin (e on GPU e % G), eplb (DeepSeek's EPLB, "
              "github.com/deepseek-ai/EPLB, from the data's own loads), eplb_stale (EPLB from the loads of the "
              "reference data and/or reference model, evaluated on the data's under the model)",
    "imbalance": "max over GPUs of the GPU load / mean GPU load (1 = balanced); placement_overall.csv: sum over "
                 "layers of the max / sum of the mean (the time of the layers, each waiting for its busiest GPU, "
                 "over the balanced time; every layer routes the same tokens, so also the mean over layers)",
    "imbalance_lo/imbalance_hi": "95% interval of the imbalance: document-level bootstrap over the packed rows of "
                                 "--data (--bootstrap replicates, seeded; NaN with --bootstrap 0). contiguous, "
                                 "round_robin, eplb_stale: the placement held fixed (eplb_stale: fitted on the "
                                 "reference) and evaluated on every resample's loads, BCa (a max is biased under "
                                 "resampling). eplb, fitted on the data it is evaluated on: its imbalance is "
                                 "in-sample (optimistic), so the interval is of the imbalance the fitting procedure "
                                 "achieves out of sample: replicate b fits EPLB on resample b's loads and serves "
                                 "resample b+1's (another independent draw; mod the replicates), percentile interval "
                                 "widened to include the estimate (the in-sample imbalance sits at or near its low "
                                 "end); eplb_stale whose reference data is --data (fitted on the same rows' loads "
                                 "under the reference model) likewise, fitted on resample b's reference loads",
    "max_gpu_load/min_gpu_load": "the busiest / least busy GPU's load: routed token assignments, an expert with c "
                                 "replicas giving each replica load / c (tokens split evenly over replicas, "
                                 "EPLB's assumption)",
    "mean_gpu_load": "tokens * K / G: the layer's assignments over the GPUs",
    "max_replicas": "the most replicas any expert of the layer has",
    "max_layer_imbalance": "the largest per-layer imbalance over the MoE layers",
    "layers": "MoE layers summed over",
    "data_set": "data (--data under --model: the loads the placements are evaluated on) or reference "
                "(--reference-data under --reference-model, each defaulting to the data / model: the loads "
                "eplb_stale is computed from)",
    "load": "top-K assignments of real tokens routed to the expert by the model's own routing (sums to tokens * K "
            "per layer)",
    "load_fraction": "load / (tokens * K)",
    "tokens": "real tokens of the data set",
}


# ----- DeepSeek's EPLB, ported (DeepSeek-AI, EPLB, 2025, github.com/deepseek-ai/EPLB, eplb.py, MIT) ----------
# Same steps and tie-breaking as eplb.py (its torch sort and first-of-equal choices: the same placement and replica
# ranks, tests/test_placement.py; float32 loads as there); differences: MoetoolError instead of assert and no
# logical_to_physical map (a relabelling of phy2log and the replica ranks). The imbalance is evaluated in float64.
def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the m items of each row into ``num_packs`` packs of exactly ``m / num_packs`` items, balancing the packs'
    weights: heaviest item first, each into the lightest pack that still has room (the first such pack on ties).
    ``weight [X, m] -> (pack index [X, m], rank in pack [X, m])`` (int64, CPU)."""
    rows, m = weight.shape
    per_pack = m // num_packs
    if per_pack == 1:
        return (torch.arange(m, dtype=torch.int64, device="cpu").expand(rows, m).clone(),
                torch.zeros(rows, m, dtype=torch.int64, device="cpu"))
    order = weight.sort(-1, descending=True).indices  # [X, m] heaviest first (eplb.py's sort: its ties)
    w = weight.float()  # float32: the packs' sums rounded as eplb.py's float32 tensors are
    load = torch.zeros(rows, num_packs, dtype=torch.float32, device="cpu")
    count = torch.zeros(rows, num_packs, dtype=torch.int64, device="cpu")
    pack = torch.empty(rows, m, dtype=torch.int64, device="cpu")
    rank = torch.empty(rows, m, dtype=torch.int64, device="cpu")
    one, inf = torch.ones(rows, 1, dtype=torch.int64, device="cpu"), torch.tensor(float("inf"))
    for k in range(m):  # every row's k-th heaviest item at once (rows are independent)
        item = order[:, k:k + 1]  # [X, 1]
        p = torch.where(count < per_pack, load, inf).argmin(-1, keepdim=True)  # lightest pack with room, first on ties
        pack.scatter_(1, item, p)
        rank.scatter_(1, item, count.gather(1, p))
        load.scatter_add_(1, p, w.gather(1, item))  # one float32 addition per row, as eplb.py's
        count.scatter_add_(1, p, one)
    return pack, rank


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate the ``num_log`` experts of each row into ``num_phy`` replicas, one extra replica at a time for the
    expert of largest load per replica (minimising the largest replica load).
    ``weight [X, num_log] -> (phy2log [X, num_phy], replica rank [X, num_phy], replica count [X, num_log])``."""
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64, device="cpu").repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64, device="cpu")
    logcnt = torch.ones(rows, num_log, dtype=torch.int64, device="cpu")
    r = torch.arange(rows, device="cpu")
    for i in range(num_log, num_phy):
        top = (weight / logcnt).max(dim=-1).indices  # [X] (the first of equal maxima)
        phy2log[:, i] = top
        rank[:, i] = logcnt[r, top]
        logcnt[r, top] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations ``[X, m]``."""
    return torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1], device="cpu")
                                           .expand(perm.shape).contiguous())


def rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's hierarchical policy: (1) pack expert groups onto nodes, (2) replicate experts within each node,
    (3) pack the node's replicas onto its GPUs. ``weight [L, n]`` -> ``(phy2log [L, P], replica rank [L, P],
    replica count [L, n])``; physical slot s sits on GPU ``s // (P / num_gpus)``."""
    L, n = weight.shape
    group_size, groups_per_node = n // num_groups, num_groups // num_nodes
    per_gpu = num_physical // num_gpus
    # (1) groups -> nodes; log2mlog: expert -> its position in node-major ("middle logical") order
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, groups]
    g_pack, g_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (((g_pack * groups_per_node + g_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size, device="cpu")).flatten(-2)  # [L, n]
    mlog2log = _inverse(log2mlog)
    # (2) replicas within each node: [L * nodes, n / nodes]
    mlog_load = weight.gather(-1, mlog2log).view(-1, n // num_nodes)
    phy2mlog, phy_rank, mlog_cnt = replicate_experts(mlog_load, num_physical // num_nodes)
    # (3) a node's replicas -> its GPUs: [L * nodes, P / nodes]
    phy_load = (mlog_load / mlog_cnt).gather(-1, phy2mlog)
    pack, rank = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)  # [L * nodes, P / nodes]
    pphy2mlog = (pphy2mlog.view(L, num_nodes, -1)
                 + torch.arange(0, n, n // num_nodes, device="cpu").view(1, -1, 1)).flatten(-2)  # [L, P]
    phy2log = mlog2log.gather(-1, pphy2mlog)
    phy_rank = phy_rank.gather(-1, pphy2phy).view(L, -1)
    logcnt = mlog_cnt.view(L, -1).gather(-1, log2mlog)
    return phy2log, phy_rank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point: ``weight [L, n]`` loads, ``num_replicas`` physical expert slots P (n + R, a multiple of
    ``num_gpus``) -> ``(phy2log [L, P]`` the expert in each slot, ``replica rank [L, P]``, ``replica count [L, n])``.
    Hierarchical when the groups divide into the nodes, else the global policy (one group, one node)."""
    L, n = weight.shape
    weight = weight.detach().float().cpu()  # float32 as eplb.py: the same decisions (counts exact below 2^24)
    if num_replicas < n or num_replicas % num_gpus:
        raise MoetoolError(f"EPLB: {num_replicas} expert slots for {n} experts on {num_gpus} GPUs (need >= n and "
                           f"a multiple of the GPUs)")
    if n % num_groups or num_gpus % num_nodes:
        raise MoetoolError(f"EPLB: {num_groups} groups must divide the {n} experts and {num_nodes} nodes the "
                           f"{num_gpus} GPUs")
    if num_groups % num_nodes == 0:
        return rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    return rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)


# ----- placements and their per-GPU loads -------------------------------------------------------------------
def static_placement(L: int, n: int, gpus: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phy2log [L, n], count [L, n])`` of a placement without replicas: ``contiguous`` (slots of GPU g hold
    experts g*n/G .. (g+1)*n/G - 1, i.e. e -> e*G//n) or ``round_robin`` (GPU g holds e = g, g+G, ...)."""
    e = torch.arange(n, device="cpu")
    phy2log = e if method == "contiguous" else e.view(n // gpus, gpus).T.reshape(-1)
    return phy2log.expand(L, n).clone(), torch.ones(L, n, dtype=torch.int64, device="cpu")


def gpu_loads(load: torch.Tensor, phy2log: torch.Tensor, count: torch.Tensor, gpus: int) -> torch.Tensor:
    """Per-GPU load ``[..., L, G]`` of a placement (slot s on GPU ``s // (P / G)``) under ``load [..., L, n]``: each
    replica of expert e carries ``load[e] / count[e]``. ``phy2log [..., L, P]`` / ``count [..., L, n]`` may stack
    placements of one G and P on leading dims, broadcast against the load's."""
    P = phy2log.shape[-1]
    share = load.double() / count  # [..., L, n]
    share = share.gather(-1, phy2log.expand(*share.shape[:-1], P))  # [..., L, P]
    return share.view(*share.shape[:-1], gpus, P // gpus).sum(-1)


def imbalance(per_gpu: torch.Tensor) -> torch.Tensor:
    """``max / mean`` over the GPUs (last dim) of ``[..., G]`` loads."""
    return per_gpu.max(-1).values / per_gpu.mean(-1)


def layer_and_overall(per_gpu: torch.Tensor) -> torch.Tensor:
    """``[..., L + 1]`` from ``[..., L, G]`` loads: each layer's imbalance, then the overall one (the sum over the
    layers of the max / the sum of the mean)."""
    mx, mean = per_gpu.max(-1).values, per_gpu.mean(-1)  # [..., L]
    return torch.cat([mx / mean, (mx.sum(-1) / mean.sum(-1)).unsqueeze(-1)], -1)


Placement = tuple  # (G, R, method, phy2log [L, P], count [L, n]), as :func:`_placements` yields them


def _stacks(placements: list[Placement]) -> list[tuple[int, list[int], torch.Tensor, torch.Tensor]]:
    """The placements of one G and one number of slots P stacked (their per-GPU loads in one :func:`gpu_loads`):
    ``(G, their positions in placements, phy2log [m, L, P], count [m, L, n])``."""
    by: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(placements):
        by.setdefault((p[0], p[3].shape[-1]), []).append(i)
    return [(G, ix, torch.stack([placements[i][3] for i in ix]), torch.stack([placements[i][4] for i in ix]))
            for (G, _), ix in by.items()]


def imbalance_statistic(placements: list[Placement]) -> Any:
    """``statistic(loads [..., L * n]) -> [..., M * (L + 1)]`` for :func:`moetool.uncertainty.sum_intervals`: per
    placement (in order), the per-layer imbalance of the fixed placement under summed loads, then the overall one
    (sum over layers of the max / sum of the mean); vectorised over the bootstrap replicates and over the stacked
    placements of one G and P (:func:`_stacks`: every placement's numbers as from it alone)."""
    stacks = _stacks(placements)
    L = placements[0][3].shape[0]
    # stacked order -> placements' order (on the host: it orders the bootstrap's numpy replicates)
    back = torch.tensor([i for _, ix, _, _ in stacks for i in ix], device="cpu").argsort()

    def statistic(s: np.ndarray) -> np.ndarray:
        lead = s.shape[:-1]
        flat = torch.from_numpy(np.ascontiguousarray(s)).reshape(-1, 1, L, s.shape[-1] // L)  # [b, 1, L, n]
        outs = []
        for G, _, phy2log, count in stacks:
            outs.append(layer_and_overall(gpu_loads(flat, phy2log, count, G)))  # [b, m, L + 1]
        return torch.cat(outs, 1)[:, back].reshape(*lead, -1).numpy()

    return statistic


def refit_interval(data_rows: np.ndarray, fit_rows: np.ndarray, layers: int, n_boot: int, seed: int, slots: int,
                   groups: int, nodes: int, gpus: int, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """``(lo [L + 1], hi [L + 1])``: the interval of an EPLB placement FITTED on the data's rows (``eplb``; eplb_stale
    fitted on the reference model's loads of the same rows), per layer then overall, from the per-row loads it is
    fitted on ``fit_rows [rows, L * n]`` (``eplb``: the data's) and the data's ``data_rows`` (the same rows; L =
    ``layers``).
    Its imbalance on the loads it was fitted on is in-sample (optimistic): resampling rows with it held fixed gives
    replicates mostly above it, which BCa reads as bias and shifts the interval below the estimate. Instead the whole
    procedure is bootstrapped out of sample: replicate b (the row weights of
    :func:`moetool.uncertainty.bootstrap_weights`, as every interval of the run) fits EPLB on resample b's loads and
    serves resample b + 1's (mod n_boot: another independent draw of the same rows): the imbalance a placement
    fitted on N rows of this traffic achieves on another N rows of it. It carries both the fit's variation and the
    traffic's (with one expert per GPU, where the placement cannot matter, it is the fixed placements' resampled
    imbalance). Percentile interval (no BCa: a refit is no smooth
    function of the loads), widened to include the estimate by :func:`placement_tables` (against the tables' own
    values). All replicates' placements in one :func:`rebalance_experts` call (``[n_boot * L, n]`` rows;
    :func:`balanced_packing` vectorised over them)."""
    n = data_rows.shape[1] // layers
    w = bootstrap_weights(data_rows.shape[0], n_boot, seed)
    fit = torch.from_numpy(w @ fit_rows).reshape(n_boot * layers, n)  # every replicate's loads, one EPLB row per layer
    phy2log, _, count = rebalance_experts(fit, slots, groups, nodes, gpus)
    served = torch.from_numpy(np.roll(w, -1, 0) @ data_rows).reshape(n_boot, layers, n)  # resample b + 1's loads
    per_gpu = gpu_loads(served, phy2log.view(n_boot, layers, slots), count.view(n_boot, layers, n), gpus)  # [B, L, G]
    return percentile(layer_and_overall(per_gpu).numpy(), level)  # [B, L + 1] replicates


# ----- the experiment ---------------------------------------------------------------------------------------
class RowLoads:
    """Consumer: per packed row, the top-K assignment counts of every hooked layer (``rows`` names "load<layer>",
    ``[rows, n]``): the bootstrap's per-document loads."""

    def __init__(self, rows: RowTable) -> None:
        self.rows = rows

    def begin_batch(self, batch: Any) -> None:
        self.rows.next_batch(batch)

    def __call__(self, ev: RoutingEvent) -> None:
        self.rows.add_counts(f"load{ev.layer.index}", ev.idx, ev.layer.n_experts, ev.valid.to(ev.idx.device))


def expert_loads(lm: Any, tokens: Any, layers: list[Any], batch_size: int, quiet: bool, description: str,
                 row_sums: bool = False) -> tuple[torch.Tensor, int, np.ndarray | None]:
    """``(loads [layers, n] float64, real tokens, per-row loads [rows, layers * n] or None)``: the model's own
    top-K assignments per (layer, expert), counted on the device in one forward (summed over data-parallel
    ranks); ``row_sums``: also per packed row, for the bootstrap."""
    counter = LoadBalance(layers)
    shard = distributed.shard(tokens, batch_size)
    per_row = RowLoads(RowTable(shard)) if row_sums else None
    forward(lm, shard, consumers=[c for c in (counter, per_row) if c is not None], moe_layers=layers,
            batch_size=batch_size, quiet=quiet, description=description,
            before_batch=per_row.begin_batch if per_row is not None else None)
    missing = [L.index for L in layers if L.index not in counter.acc]
    if missing:
        raise MoetoolError(f"no routing events from MoE layers {missing}: nothing ran through them")
    load = torch.stack([counter.acc[L.index]["assign"].cpu() for L in layers])  # [layers, n]
    rows = None
    if per_row is not None:
        per_row.rows.reduce_across_ranks()
        rows = np.concatenate([per_row.rows.table(f"load{L.index}").reshape(-1, L.n_experts) for L in layers], 1)
    return load, int(counter.acc[layers[0].index]["tokens"].item()), rows


def model_groups(layer: Any) -> int:
    """The routing's expert groups (``n_group`` of group-limited routing, as ``inspect`` describes it), 1 without."""
    return int(layer.describe().get("n_group", 1) or 1)


def _placed_experts(layers: list[Any], groups: int | None) -> tuple[int, int, int, int]:
    """``(n, z, K, groups)`` of the chosen MoE layers: the experts placed (zero-computation experts, ``z``, run
    nowhere: not placed), top-K, and the expert groups (``groups``, else the model's routing groups); layers of
    different n, z or K, or groups that do not divide n, are refused."""
    n = layers_of_one({L.index: L.n_computed for L in layers}, "the chosen MoE layers have different numbers of "
                      "experts", "n")
    z = layers_of_one({L.index: L.n_zero_compute for L in layers}, "the chosen MoE layers have different numbers of "
                      "zero-computation experts", "number of zero-computation experts")  # one [n + z] load per layer
    K = layers_of_one({L.index: L.top_k for L in layers}, "the chosen MoE layers route different numbers of "
                      "experts", "K")  # load_fraction = load / (tokens * K)
    groups = groups if groups is not None else model_groups(layers[0])
    if n % groups:
        raise MoetoolError(f"--groups {groups} must divide the {n} experts")
    return n, z, K, groups


def _data_loads(lm: Any, tokens: Any, layers: list[Any], opts: PlacementOptions, n: int, z: int,
                quiet: bool) -> tuple[torch.Tensor, int, np.ndarray | None]:
    """:func:`expert_loads` on the data, the computed experts' only (zero-computation assignments take no GPU)."""
    load, n_tok, row_loads = expert_loads(lm, tokens, layers, opts.batch_size, quiet, "placement",
                                          row_sums=opts.bootstrap > 0)
    if row_loads is not None:
        row_loads = row_loads.reshape(row_loads.shape[0], len(layers), n + z)[:, :, :n].reshape(row_loads.shape[0], -1)
    return load[:, :n], n_tok, row_loads


def _check_reference_model(lm: Any, reference_model: Any, layers: list[Any], opts: PlacementOptions) -> None:
    """``reference_model`` is a loaded checkpoint with the model's MoE layers (index, n experts) and, where both
    were loaded with their tokenizers, its vocabulary: the same ids are the same text to both."""
    if not (hasattr(reference_model, "model") and hasattr(reference_model, "layers")):
        raise MoetoolError(f"reference_model takes a loaded model (moetool.load(...)), not {shown(reference_model)}")
    ref_layers = select_layers(reference_model.layers, opts.layers)
    if [(L.index, L.n_experts) for L in ref_layers] != [(L.index, L.n_experts) for L in layers]:
        raise MoetoolError("the reference model's MoE layers (index, n experts) differ from the model's")
    tok, ref_tok = getattr(lm, "tokenizer", None), getattr(reference_model, "tokenizer", None)
    if tok is not None and ref_tok is not None and tok.get_vocab() != ref_tok.get_vocab():
        raise MoetoolError(f"the reference model's tokenizer differs from the model's ({reference_model.name} and "
                           f"{lm.name} have different vocabularies): the same token ids are other text to it")


def _reference_loads(lm: Any, tokens: Any, layers: list[Any], opts: PlacementOptions, n: int, reference: Any,
                     reference_model: Any, quiet: bool) -> tuple[torch.Tensor | None, int | None, np.ndarray | None]:
    """The loads (and real tokens) of the reference model (default ``lm``) on the reference data (default
    ``tokens``) that ``eplb_stale`` is fitted on, and, where the reference data IS the data (``reference`` None,
    ``tokens``, or a TokenSet of the same rows: the same :meth:`~moetool.data.TokenSet.fingerprint`) and intervals
    are on, their per-row loads ``[rows, layers * n]`` (the same rows as the data's: eplb_stale is then fitted on
    the data's rows, and :func:`refit_interval` resamples them); ``(None, None, None)`` without a reference."""
    if reference is None and reference_model is None:
        return None, None, None
    ref_lm = lm if reference_model is None else reference_model
    ref_layers = select_layers(ref_lm.layers, opts.layers)
    # the data's own rows: no reference data, or reference data holding the same rows (the same token ids, padding
    # and domains: --reference-data naming the --data file reads it again into another TokenSet)
    same_rows = (reference is None or reference is tokens
                 or reference.fingerprint() == tokens.fingerprint()) and opts.bootstrap > 0
    ref_load, ref_tok, ref_rows = expert_loads(ref_lm, tokens if reference is None else reference, ref_layers,
                                               opts.batch_size, quiet, "placement (reference)", row_sums=same_rows)
    if ref_rows is not None:
        ref_rows = ref_rows.reshape(ref_rows.shape[0], len(layers), -1)[:, :, :n].reshape(ref_rows.shape[0], -1)
    return ref_load[:, :n], ref_tok, ref_rows


def eplb_meta(groups: int, nodes: int) -> dict[str, Any]:
    """The manifest's ``eplb`` section (the source and the policy EPLB takes) and, where ``--nodes`` cannot shape the
    placement (the expert groups are no multiple of the nodes: EPLB's global policy, as eplb.py), a ``left_out``
    line saying so (the ``nodes`` column then names nodes the placement did not see)."""
    hierarchical = groups % nodes == 0
    meta: dict[str, Any] = dict(eplb=dict(source="DeepSeek-AI, EPLB, 2025, https://github.com/deepseek-ai/EPLB "
                                                 "(eplb.py, MIT); ported in moetool.experiments.placement",
                                          policy="hierarchical" if hierarchical else "global"))
    if not hierarchical:
        meta["left_out"] = {f"hierarchical placement (--nodes {nodes})": (
            f"EPLB packs expert groups onto nodes only when the {groups} group(s) divide into the {nodes} nodes "
            f"(--groups): as eplb.py does, the global policy placed the replicas over all GPUs, across nodes")}
    return meta


def _placements(load: torch.Tensor, ref_load: torch.Tensor | None, n: int, groups: int, gpu_counts: list[int],
                opts: PlacementOptions) -> Any:
    """``(G, R, method, phy2log, count)`` of every placement evaluated, in the tables' order."""
    for G in gpu_counts:
        for method in ("contiguous", "round_robin"):
            yield (G, 0, method, *static_placement(load.shape[0], n, G, method))
        for extra in sorted(set(opts.extra_slots)):
            R = extra * G
            phy2log, _, count = rebalance_experts(load, n + R, groups, opts.nodes, G)
            yield G, R, "eplb", phy2log, count
            if ref_load is not None:
                phy2log, _, count = rebalance_experts(ref_load, n + R, groups, opts.nodes, G)
                yield G, R, "eplb_stale", phy2log, count


def placement_tables(load: torch.Tensor, row_loads: np.ndarray | None, n_boot: int, idx: list[int], n: int,
                     opts: PlacementOptions, placements: Any, groups: int = 1, ref_rows: np.ndarray | None = None
                     ) -> tuple[Any, Any]:
    """``(placement.csv, placement_overall.csv)`` of the placements ``(G, R, method, phy2log, count)`` under the
    data's loads ``[layers, n]``: per layer and placement, and per placement the sum over layers of the max / sum of
    the mean GPU load; with ``n_boot`` the BCa intervals of one bootstrap of every fixed placement's imbalances (per
    layer and overall) from the per-row loads ``[rows, layers * n]``; for the placements fitted on these rows, ``eplb``
    (on ``row_loads``) and ``eplb_stale`` when its reference data is the data (on ``ref_rows``, the reference model's
    per-row loads of the same rows), :func:`refit_interval`'s (EPLB's ``groups``)."""
    import pandas as pd

    placements = list(placements)
    M, L, nan = len(placements), len(idx), float("nan")
    imb, mx, mean, mn, reps = ([None] * M for _ in range(5))  # per placement: [L] each
    for G, ix, phy2log, count in _stacks(placements):
        per_gpu = gpu_loads(load, phy2log, count, G)  # [m, L, G]
        cols = (imbalance(per_gpu), per_gpu.max(-1).values, per_gpu.mean(-1), per_gpu.min(-1).values,
                count.max(-1).values)
        for out, col in zip((imb, mx, mean, mn, reps), cols):
            for i, v in zip(ix, col.tolist()):
                out[i] = v
    fitted_on = {"eplb": row_loads, "eplb_stale": ref_rows}  # the per-row loads a placement was fitted on, if the data's
    refitted = [m for m, rows in fitted_on.items() if rows is not None]
    bound = [(nan, nan)] * (M * (L + 1))  # per placement: its layers, then overall
    fixed = [i for i, p in enumerate(placements) if p[2] not in refitted]  # BCa around the placement held fixed
    if n_boot and fixed:
        ci = sum_intervals(row_loads, imbalance_statistic([placements[i] for i in fixed]), n_boot=n_boot,
                           seed=opts.seed, method="bca")
        for j, i in enumerate(fixed):
            bound[i * (L + 1):(i + 1) * (L + 1)] = [(c.lo, c.hi) for c in ci[j * (L + 1):(j + 1) * (L + 1)]]
    for i, (G, R, method, _, _) in enumerate(placements):  # fitted on the data's rows: refitted per replicate instead
        if n_boot and method in refitted:
            lo, hi = refit_interval(row_loads, fitted_on[method], L, n_boot, opts.seed, n + R, groups, opts.nodes, G)
            bound[i * (L + 1):(i + 1) * (L + 1)] = list(zip(lo.tolist(), hi.tolist()))
    key = [(G, R, method) for G, R, method, _, _ in placements]
    flat = {name: np.array([v for i in range(M) for v in col[i]])
            for name, col in (("imbalance", imb), ("max", mx), ("mean", mean), ("min", mn))}
    df = pd.DataFrame({"layer": idx * M, "gpus": [G for G, _, _ in key for _ in idx], "nodes": opts.nodes,
                       "replicas": [R for _, R, _ in key for _ in idx],
                       "slots_per_gpu": [(n + R) // G for G, R, _ in key for _ in idx],
                       "method": [m for _, _, m in key for _ in idx], "imbalance": flat["imbalance"],
                       "imbalance_lo": [bound[i * (L + 1) + j][0] for i in range(M) for j in range(L)],
                       "imbalance_hi": [bound[i * (L + 1) + j][1] for i in range(M) for j in range(L)],
                       "max_gpu_load": flat["max"], "mean_gpu_load": flat["mean"], "min_gpu_load": flat["min"],
                       "max_replicas": [v for i in range(M) for v in reps[i]]})

    def per_placement(name: str) -> Any:  # over the layers: pandas' group reductions (its compensated sum)
        return pd.Series(flat[name]).groupby(np.repeat(np.arange(M), L), sort=False)

    overall = pd.DataFrame({"gpus": [G for G, _, _ in key], "nodes": opts.nodes, "replicas": [R for _, R, _ in key],
                            "slots_per_gpu": [(n + R) // G for G, R, _ in key], "method": [m for _, _, m in key],
                            "imbalance": per_placement("max").sum().to_numpy() / per_placement("mean").sum().to_numpy(),
                            "imbalance_lo": [bound[i * (L + 1) + L][0] for i in range(M)],
                            "imbalance_hi": [bound[i * (L + 1) + L][1] for i in range(M)],
                            "max_layer_imbalance": per_placement("imbalance").max().to_numpy(), "layers": L})
    for frame in (df, overall):  # a refit interval widened to include its (in-sample) estimate; NaN stays NaN
        fitted = frame["method"].isin(refitted)
        frame.loc[fitted, "imbalance_lo"] = np.minimum(frame.loc[fitted, "imbalance_lo"], frame.loc[fitted, "imbalance"])
        frame.loc[fitted, "imbalance_hi"] = np.maximum(frame.loc[fitted, "imbalance_hi"], frame.loc[fitted, "imbalance"])
    return df, overall


def _loads_table(idx: list[int], n: int, K: int, *loads: tuple[str, torch.Tensor | None, int | None]) -> Any:
    """``placement_loads.csv``: per data set (name, loads, real tokens; ``None`` loads left out), layer and expert."""
    import pandas as pd

    loads = [(name, lo, t) for name, lo, t in loads if lo is not None]
    L = len(idx)
    return pd.DataFrame({"data_set": np.repeat([name for name, _, _ in loads], L * n),
                         "layer": np.tile(np.repeat(np.asarray(idx, dtype=np.int64), n), len(loads)),
                         "expert": np.tile(np.arange(n, dtype=np.int64), L * len(loads)),
                         "tokens": np.repeat(np.asarray([t for _, _, t in loads], dtype=np.int64), L * n),
                         "load": torch.cat([lo.reshape(-1) for _, lo, _ in loads]).numpy(),
                         "load_fraction": torch.cat([(lo / (t * K)).reshape(-1) for _, lo, t in loads]).numpy()})


def placement(lm: Any, tokens: Any, options: PlacementOptions | None = None, *, reference: Any = None,
              reference_model: Any = None, quiet: bool = False, **overrides: Any) -> Result:
    """Per-GPU load imbalance of expert-parallel placements (contiguous, round-robin, DeepSeek's EPLB with R
    redundant replicas) under the model's measured per-expert loads on ``tokens``; with ``reference`` (another
    TokenSet) and/or ``reference_model`` (another checkpoint of the same architecture and tokenizer, loaded) also
    EPLB fitted on the loads of the reference model (default ``lm``) on the reference data (default ``tokens``),
    evaluated on ``tokens``' loads under ``lm`` (staleness). Tables ``placement`` (per layer, G, R, method),
    ``placement_overall`` (over the layers) and ``placement_loads`` (layer, expert loads); see
    :data:`DEFINITIONS`."""
    opts = resolve_options(PlacementOptions, options, overrides)
    require_tokens(tokens)
    if reference is not None:
        if not hasattr(reference, "require_tokens"):
            raise MoetoolError(f"reference takes packed tokens (moetool.tokens(lm, data, ...)), not "
                               f"{shown(reference, typed=True)}")
        reference.require_tokens()
    layers = select_layers(lm.layers, opts.layers)
    if reference_model is not None:  # before any forward
        _check_reference_model(lm, reference_model, layers, opts)
    n, z, K, groups = _placed_experts(layers, opts.groups)
    gpu_counts = opts.gpu_counts(n)
    load, n_tok, row_loads = _data_loads(lm, tokens, layers, opts, n, z, quiet)
    ref_load, ref_tok, ref_rows = _reference_loads(lm, tokens, layers, opts, n, reference, reference_model, quiet)
    idx = [L.index for L in layers]
    n_boot = replicates(opts.bootstrap, row_loads.shape[0]) if row_loads is not None else 0
    df, overall = placement_tables(load, row_loads, n_boot, idx, n, opts,
                                   _placements(load, ref_load, n, groups, gpu_counts, opts), groups, ref_rows)
    meta = dict(definitions=DEFINITIONS, data=tokens.describe(), data_name=data_name(tokens.source), layers=idx,
                n_experts=n, top_k=K, groups=groups, zero_computation_experts_not_placed=z,
                bootstrap=bootstrap_meta(n_boot, opts.seed, tokens.input_ids.shape[0],
                                          "BCa interval (eplb: refitted on each resample, serving the next one, "
                                          "percentile interval)"),
                **eplb_meta(groups, opts.nodes))
    if ref_load is not None:
        ref_tokens = tokens if reference is None else reference
        meta.update(reference=dict(data=ref_tokens.describe(), data_name=data_name(ref_tokens.source),
                                   model=(lm if reference_model is None else reference_model).name))
    summary = with_ci(overall[["gpus", "replicas", "method", "imbalance", "imbalance_lo", "imbalance_hi",
                               "max_layer_imbalance"]], digits=2)
    loads = _loads_table(idx, n, K, ("data", load, n_tok), ("reference", ref_load, ref_tok))
    return Result("placement", {"placement.csv": df, "placement_overall.csv": overall, "placement_loads.csv": loads},
                  opts, meta=meta, summary=summary.round(3))


def headline_gpus(df: Any) -> int:
    """The largest G below n in a placement table (with one expert per GPU every placement without replicas is the
    same), else the largest."""
    below = df[df["slots_per_gpu"] > 1 + df["replicas"] // df["gpus"]]["gpus"]
    return int((below if len(below) else df["gpus"]).max())


def summary_lines(name: str, res: Result) -> list[str]:
    """One line: at :func:`headline_gpus`, the overall imbalance of each method (and R)."""
    df = res["placement_overall"]
    G = headline_gpus(df)
    parts = [f"{r.method}{f' R={r.replicas}' if r.replicas else ''} "
             f"{format_ci(r.imbalance, r.imbalance_lo, r.imbalance_hi)}x"
             for r in df[df.gpus == G].itertuples()]
    return [f"placement {name}: max/mean GPU load on {G} GPUs: " + ", ".join(parts)]
