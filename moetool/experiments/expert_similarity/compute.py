"""The computation of ``moetool expert-similarity``: what it measures, its sources and the files it writes are in
``spec.py``'s docstring (the command's ``--help``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import distributed, ops
from ...data import require_tokens
from ...adapters import quant
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.probes import DEFAULT_BUDGET, expert_outputs
from ...engine.runner import forward
from ...errors import MoetoolError, MoetoolRuntimeError
from ...uncertainty import fraction_text
from ..routing import data_name, zero_computation_meta
from ..result import Result, resolve_options
from .spec import ExpertSimilarityOptions  # noqa: F401 - its options (declared with their flags in spec.py)

SOURCE = "Chen et al. 2024, HC-SMoE, arXiv 2410.08589"
#: the code the distance and the clustering follow (tests/peer/test_peer_hcsmoe.py ports it and compares)
CODE = ("wazenmai/HC-SMoE @ bd77eba1b55ca58606a47e2d0807a24218da73c3, hcsmoe/merging/clustering.py "
        "(pairwise_distances, hierarchical_clustering, linkage 'average') on the mean expert outputs of "
        "hcsmoe/merging/grouping_mixtral.py group_experts_by_clustering_output")

LAYER_COLUMNS = ("layer", "n_experts", "tokens", "mean_output_cos", "max_output_cos", "max_output_pair",
                 "min_output_dist", "min_dist_pair", "mean_token_cos", "max_token_cos", "max_token_pair",
                 "mean_co_selection", "max_co_selection")
PAIR_COLUMNS = ("layer", "i", "j", "output_dist", "output_cos", "token_cos", "co_selection")
MERGE_COLUMNS = ("layer", "step", "i", "j", "distance", "size", "clusters")
GROUP_COLUMNS = ("layer", "expert", "group", "dominant")

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "n_experts": "computed experts of the layer, the ones compared (zero-computation experts left out: see "
                 "zero_computation_experts)",
    "zero_computation_experts": "experts with no computation (LongCat-Flash's identity experts, Zaya's skip class, "
                                "the last indices) have no weights to compare or merge: an identity expert outputs "
                                "its input (two of them are the same vector: output_cos 1, output_dist 0, the "
                                "'most alike pair' and HC-SMoE's first merge of every layer), a skip 0. They are "
                                "left out of every table (manifest: zero_computation_experts_not_compared)",
    "tokens": "real (unpadded) tokens of the data, every expert applied to each",
    "i/j": "the pair's experts, i < j (every pair of the layer's computed experts)",
    "expert output": "E_e(x): expert e's output on the layer's expert input x, before any routing weight; every "
                     "computed expert on every real token (not only the tokens routed to it)",
    "output_dist": f"Euclidean distance ||mean_t E_i(x_t) - mean_t E_j(x_t)||_2 between the mean outputs of experts "
                   f"i and j over the real tokens: what {SOURCE} clusters experts by (its code: {CODE})",
    "output_cos": "cosine of the same mean outputs, mean_t E_i(x_t) against mean_t E_j(x_t) (scale-free; HC-SMoE's "
                  "code groups by output_dist, not by this cosine: it maps (cos+1)/2 only where it picks "
                  "frequency-dominant experts); empty if a mean output is 0",
    "token_cos": "mean over real tokens of cos(E_i(x_t), E_j(x_t)), the two experts' outputs on the same token "
                 "(tokens where either output is 0 left out; empty if none is left)",
    "co_selection": "Jaccard overlap of the real tokens the model's own routing sends to i and to j: tokens whose "
                    "top-K holds both / tokens whose top-K holds either; empty if neither is ever chosen",
    "mean_output_cos/mean_token_cos/mean_co_selection": "mean over the layer's pairs i < j (empty ones left out; "
                                                        "empty with no pair)",
    "max_output_cos/max_token_cos/max_co_selection": "largest value over the layer's pairs i < j",
    "max_output_pair/max_token_pair": "the pair with the largest output_cos / token_cos, as i-j (ties: the "
                                      "lowest i, then j)",
    "min_output_dist": "smallest output_dist over the layer's pairs: the first merge of HC-SMoE's clustering",
    "min_dist_pair": "the pair with the smallest output_dist, as i-j (ties: the lowest i, then j): the two experts "
                     "HC-SMoE merges first",
    "step": "merge number of the average-linkage clustering (1 = first; n_experts - 1 merges to one cluster)",
    "i/j (merges)": "the two clusters merged at this step, each named by its lowest expert (i < j); the merged "
                    "cluster is named i",
    "distance": "average-linkage distance of the merged clusters: the mean output_dist over the pairs of experts "
                "one from each (the smallest of all pairs of clusters at this step; ties: the lowest i, then j)",
    "size": "experts in the merged cluster",
    "clusters": "clusters left after this step",
    "group": "with --cluster-to N: the expert's group among the N of HC-SMoE's clustering (groups numbered 0.. in "
             "the order of their lowest expert, as HC-SMoE's code numbers them)",
    "dominant": "the group's member closest (Euclidean) to the mean of its members' mean outputs (HC-SMoE's "
                "dominant expert, center_indices; ties: the lowest expert)",
}


class SimilaritySums:
    """Forward consumer: per chosen MoE layer, streaming sums over the real tokens (device tensors, no host sync;
    summed over data-parallel ranks):

    over the layer's ``n`` computed experts (``layer.n_computed``: zero-computation experts, the last indices, are
    not compared):

    * ``out``  ``[n, d]``: ``Σ_t E_e(x_t)`` (the mean output up to the token count);
    * ``cos``  ``[n, n]``: ``Σ_t cos(E_i(x_t), E_j(x_t))`` (0 where either output is 0);
    * ``both`` ``[n, n]``: tokens where both outputs are non-zero (the count ``cos`` is a sum over);
    * ``co``   ``[n, n]``: tokens whose top-K holds both i and j (the diagonal: tokens routed to i);
    * ``tokens``: real tokens.

    Every expert's output comes from :func:`moetool.engine.probes.expert_outputs` over token chunks of at most
    ``budget / 4`` output elements ``[n, T_c, d]`` (the outputs, their unit vectors and the probe's own buffers live
    at once; the probe bounds its intermediates by ``budget`` itself). The unit vectors are scaled first
    (``ops.unit(scaled=True)``): an fp32 norm of an output of ~1e-20 and below (an expert with tiny weights)
    underflows to 0, which read the output as zero (its token_cos NaN)."""

    def __init__(self, layers: list[int], budget: int | None = None) -> None:
        self.layers = set(layers)
        self.budget = budget or DEFAULT_BUDGET
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        n, dev = L.n_computed, ev.h.device
        valid = ev.valid.to(dev)
        a = self.acc.get(L.index)
        h = ev.h
        step = max(1, self.budget // (4 * L.n_experts * h.shape[-1]))
        out = cos = both = None
        for s in range(0, h.shape[0], step):  # token chunks: [n, T_c, d] at a time
            v = valid[s:s + step]  # [T_c]
            y = expert_outputs(L, h[s:s + step], self.budget)[:n].float()  # [n, T_c, d], the computed experts
            y = torch.where(v[None, :, None], y, torch.zeros((), dtype=y.dtype, device=y.device))  # padding: 0
            u = ops.unit(y, scaled=True)  # [n, T_c, d]; a zero output stays 0, a tiny one is a unit vector
            nz = (ops.vector_norm(u) > 0).float()  # [n, T_c]
            parts = (y.sum(1).double(), (u.flatten(1) @ u.flatten(1).T).double(), (nz @ nz.T).double())
            out, cos, both = parts if out is None else (out + parts[0], cos + parts[1], both + parts[2])
        # [T, n]: the model's own top-K among the computed experts, real tokens only
        m = ops.multi_hot(ev.idx, L.n_experts)[:, :n] * valid.to(ev.idx.device).unsqueeze(-1).float()
        co = (m.T @ m).double().to(dev)
        new = {"out": out, "cos": cos, "both": both, "co": co, "tokens": valid.double().sum()}
        self.acc[L.index] = new if a is None else {k: a[k] + new[k] for k in new}

    def reduce_across_ranks(self) -> None:
        """Data parallel (called by ``engine.forward``): the per-layer sums all-reduced; alone a no-op."""
        if distributed.world_size() > 1:
            self.acc = distributed.all_reduce_keyed(self.acc)

    def matrices(self) -> dict[int, dict[str, Any]]:
        """Per layer: ``output_cos``, ``token_cos``, ``co_selection`` (``[n, n]`` float64 numpy, NaN where
        undefined) and ``tokens``; one line if a layer saw no real token or a sum is not finite."""
        missing = sorted(self.layers - set(self.acc))
        if missing:
            raise MoetoolError(f"no routing events from MoE layers {missing}: nothing ran through them")
        res = {}
        for layer in sorted(self.acc):
            a = {k: v.cpu() for k, v in self.acc[layer].items()}
            tokens = float(a["tokens"])
            if tokens <= 0:
                raise MoetoolError(f"layer {layer}: no real tokens (empty data or all padding)")
            bad = [k for k in ("out", "cos", "co") if not torch.isfinite(a[k]).all()]
            if bad:
                raise MoetoolRuntimeError(f"expert-similarity: layer {layer}: an expert output is NaN or inf on the "
                                          f"data (its sums of {', '.join(bad)} are not finite); try --dtype fp32")
            nan = torch.tensor(float("nan"), dtype=torch.float64)
            norm = ops.vector_norm(a["out"])  # [n]
            u = ops.unit(a["out"])
            output_cos = torch.where((norm[:, None] > 0) & (norm[None, :] > 0), u @ u.T, nan)
            mean = a["out"] / tokens  # [n, d] float64 mean outputs
            output_dist = torch.stack([ops.vector_norm(mean - mean[e]) for e in range(len(mean))])  # [n, n]
            token_cos = torch.where(a["both"] > 0, a["cos"] / a["both"].clamp_min(1), nan)
            c = a["co"]
            union = c.diagonal()[:, None] + c.diagonal()[None, :] - c  # |A ∪ B| = |A| + |B| - |A ∩ B|
            co_selection = torch.where(union > 0, c / union.clamp_min(1), nan)
            res[layer] = {"output_dist": output_dist.numpy(), "output_cos": output_cos.numpy(),
                          "token_cos": token_cos.numpy(), "co_selection": co_selection.numpy(),
                          "mean": mean.numpy(), "tokens": int(round(tokens))}
        return res


def _upper(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(i, j, values)`` of the pairs ``i < j`` of a square matrix, row-major (i, then j)."""
    i, j = np.triu_indices(m.shape[0], k=1)
    return i, j, m[i, j]


def _mean_max(i: np.ndarray, j: np.ndarray, v: np.ndarray) -> tuple[float, float, str]:
    """Mean and max of the defined values and the first pair reaching the max (``i-j``; NaN / "" if none)."""
    ok = np.isfinite(v)
    if not ok.any():
        return float("nan"), float("nan"), ""
    k = int(np.argmax(np.where(ok, v, -np.inf)))  # the first maximum in (i, j) order
    return float(v[ok].mean()), float(v[k]), f"{i[k]}-{j[k]}"


def average_linkage(dist: np.ndarray) -> list[tuple[int, int, float, int, int]]:
    """HC-SMoE's hierarchical clustering with average linkage, merge by merge down to one cluster, from the
    pairwise distances ``dist [n, n]`` of the points (every entry finite). A cluster is named by its lowest point;
    each step merges the two clusters with the smallest average distance (the mean of ``dist`` over the pairs of
    points one from each), ties to the lowest names in (i, j) order as HC-SMoE's ``compute_distance`` (``argmin``
    over the clusters in label order). Returns per merge ``(i, j, distance, size of the merged cluster, clusters
    left)``, ``i < j``, the merged cluster named ``i``. The cluster distances are updated by the Lance-Williams
    rule of average linkage, ``d(k, i ∪ j) = (|i| d(k, i) + |j| d(k, j)) / (|i| + |j|)``: the same mean of the
    pairwise distances, computed in O(n^2) per merge."""
    d = np.array(dist, dtype=np.float64)
    n = d.shape[0]
    size = {e: 1 for e in range(n)}
    merges = []
    while len(size) > 1:
        labels = np.array(sorted(size))
        sub = d[np.ix_(labels, labels)]
        iu, ju = np.triu_indices(len(labels), 1)
        k = int(np.argmin(sub[iu, ju]))  # the first minimum in row-major (i, j) order
        a, b = int(labels[iu[k]]), int(labels[ju[k]])
        na, nb = size[a], size.pop(b)
        d[a, :] = d[:, a] = (na * d[a, :] + nb * d[b, :]) / (na + nb)
        size[a] = na + nb
        merges.append((a, b, float(sub[iu[k], ju[k]]), na + nb, len(size)))
    return merges


def groups(merges: list[tuple[int, int, float, int, int]], n: int, n_groups: int) -> np.ndarray:
    """``[n]`` group of each point after the merges that leave ``n_groups`` clusters (groups numbered in the order
    of their lowest point, as HC-SMoE's ``hierarchical_clustering`` renumbers its labels)."""
    label = np.arange(n)
    for a, b, _, _, left in merges:
        if left < n_groups:
            break
        label[label == b] = a
    _, group = np.unique(label, return_inverse=True)
    return group


def dominant(mean: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``[n]`` bool: per group, the member whose mean output is closest (Euclidean) to the mean of its members'
    (HC-SMoE's ``center_indices``; ties: the lowest expert)."""
    out = np.zeros(len(group), dtype=bool)
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        x = mean[members]
        out[members[int(np.argmin(np.linalg.norm(x - x.mean(0), axis=-1)))]] = True
    return out


def tables(mats: dict[int, dict[str, Any]], n_experts: dict[int, int],
           cluster_to: int | None = None) -> dict[str, Any]:
    """``expert_similarity``, ``expert_similarity_pairs``, ``expert_similarity_merges`` (and, with ``cluster_to``,
    ``expert_similarity_groups``) DataFrames by file name, from :meth:`SimilaritySums.matrices`."""
    import pandas as pd

    layer_rows, pair_frames, merge_rows, group_frames = [], [], [], []
    for layer, m in mats.items():
        cols = {}
        for name in ("output_dist", "output_cos", "token_cos", "co_selection"):
            i, j, cols[name] = _upper(m[name])
        pair_frames.append(pd.DataFrame({"layer": layer, "i": i, "j": j, **cols}))
        oc, tc, cs = (_mean_max(i, j, cols[k]) for k in ("output_cos", "token_cos", "co_selection"))
        od = _mean_max(i, j, -cols["output_dist"])  # the smallest distance: the first maximum of its negative
        layer_rows.append({"layer": layer, "n_experts": n_experts[layer], "tokens": m["tokens"],
                           "mean_output_cos": oc[0], "max_output_cos": oc[1], "max_output_pair": oc[2],
                           "min_output_dist": -od[1], "min_dist_pair": od[2],
                           "mean_token_cos": tc[0], "max_token_cos": tc[1], "max_token_pair": tc[2],
                           "mean_co_selection": cs[0], "max_co_selection": cs[1]})
        merges = average_linkage(m["output_dist"])
        merge_rows += [{"layer": layer, "step": s, "i": a, "j": b, "distance": dist, "size": size, "clusters": left}
                       for s, (a, b, dist, size, left) in enumerate(merges, 1)]
        if cluster_to is not None:
            g = groups(merges, len(m["output_dist"]), cluster_to)
            group_frames.append(pd.DataFrame({"layer": layer, "expert": np.arange(len(g)), "group": g,
                                              "dominant": dominant(m["mean"], g)}))
    out = {"expert_similarity.csv": pd.DataFrame(layer_rows, columns=list(LAYER_COLUMNS)),
           "expert_similarity_pairs.csv": pd.concat(pair_frames, ignore_index=True)[list(PAIR_COLUMNS)],
           "expert_similarity_merges.csv": pd.DataFrame(merge_rows, columns=list(MERGE_COLUMNS))}
    if cluster_to is not None:
        out["expert_similarity_groups.csv"] = pd.concat(group_frames, ignore_index=True)[list(GROUP_COLUMNS)]
    return out


def expert_similarity(lm: Any, tokens: Any, options: ExpertSimilarityOptions | None = None, *, quiet: bool = False,
                      **overrides: Any) -> Result:
    """Per MoE layer, every pair of experts' output distance and cosine (of their mean outputs), per-token output
    cosine and co-selection (Jaccard of their routed tokens) under the model's own routing. Tables
    ``expert_similarity`` (per layer, the summary), ``expert_similarity_pairs``, ``expert_similarity_merges``
    (HC-SMoE's average-linkage merge order) and, with ``cluster_to``, ``expert_similarity_groups``; see
    :data:`DEFINITIONS`."""
    opts = resolve_options(ExpertSimilarityOptions, options, overrides)
    require_tokens(tokens)
    layers = select_layers(lm.layers, opts.layers)
    quant.require_readable(layers, "expert-similarity")
    indices = [L.index for L in layers]
    few = [L.index for L in layers if opts.cluster_to is not None and L.n_computed < opts.cluster_to]
    if few:  # before any forward: more groups than experts can only give nothing
        raise MoetoolError(f"--cluster-to {opts.cluster_to} asks for more groups than MoE layers {few} have "
                           f"computed experts ({min(L.n_computed for L in layers)}); use at most that many")
    sums = SimilaritySums(indices)
    forward(lm, distributed.shard(tokens, opts.batch_size), consumers=[sums], moe_layers=layers,
            batch_size=opts.batch_size, quiet=quiet, description="expert outputs")  # all-reduces the sums
    out = tables(sums.matrices(), {L.index: L.n_computed for L in layers}, opts.cluster_to)
    per_layer = out["expert_similarity.csv"]
    return Result("expert_similarity", out, opts,
                  meta=dict(definitions=DEFINITIONS, source=SOURCE, reference_code=CODE, data=tokens.describe(),
                            data_name=data_name(tokens.source), layers=indices,
                            **zero_computation_meta(layers, "zero_computation_experts_not_compared")),
                  summary=per_layer)


def summary_lines(name: str, res: Result) -> list[str]:
    """The most alike pair of experts by mean output, and the averages over the layers (co-selection a fraction, as
    expert_similarity.csv)."""
    df = res["expert_similarity"]
    top = df.loc[df["max_output_cos"].idxmax()] if df["max_output_cos"].notna().any() else None
    out = [f"expert-similarity {name}: mean over {len(df)} layer(s): output cos {df.mean_output_cos.mean():.3f}, "
           f"token cos {df.mean_token_cos.mean():.3f}, co-selection {fraction_text(df.mean_co_selection.mean())}"]
    if top is not None:
        out.append(f"  most alike by mean output: layer {top.layer} experts {top.max_output_pair} "
                   f"(output cos {top.max_output_cos:.3f})")
    out.append("  HC-SMoE's first merge (smallest distance of mean outputs) per layer: "
               + ", ".join(f"{r.layer}: {r.min_dist_pair}" for r in df.itertuples()))
    return out
