"""Expert similarity: how alike the experts of each MoE layer are (expert redundancy, the input of merging).

One pass of the model's own routing over --data applies every expert of each MoE layer (--layers) to every real
token's expert input (batched probes in memory-bounded token chunks; streaming sums, nothing kept per token) and
measures, per pair of experts i < j: output_cos, the cosine of their mean outputs over the tokens (the expert-output
similarity HC-SMoE clusters experts by: Chen et al. 2024, "Retraining-Free Merging of Sparse MoE via Hierarchical
Clustering", arXiv 2410.08589); token_cos, the mean over tokens of the cosine of their two outputs on the same token
(do they act alike token by token, not only on average); co_selection, the Jaccard overlap of the tokens the model
routes to each (tokens where both are in the top-K / tokens where either is). Experts are compared before any
routing weight; zero-computation experts are compared with their output (the input itself, or 0: a cosine with 0
is undefined, left empty).

Writes expert_similarity.csv (layer, n_experts, tokens, mean_output_cos, max_output_cos, max_output_pair,
mean_token_cos, max_token_cos, max_token_pair, mean_co_selection, max_co_selection),
expert_similarity_pairs.csv (layer, i, j, output_cos, token_cos, co_selection; every pair i < j) and manifest.json
(definitions).

Examples:
  moetool expert-similarity
  moetool expert-similarity --model tiny-fine --layers 0,1 --max-tokens 4096
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import distributed, ops
from ..adapters import quant
from ..engine.hooks import RoutingEvent, select_layers
from ..engine.probes import DEFAULT_BUDGET, expert_outputs
from ..engine.runner import forward
from ..errors import MoetoolError, MoetoolRuntimeError
from .ppl import data_name
from .result import Result, resolve_options

SOURCE = "Chen et al. 2024, HC-SMoE, arXiv 2410.08589"

LAYER_COLUMNS = ("layer", "n_experts", "tokens", "mean_output_cos", "max_output_cos", "max_output_pair",
                 "mean_token_cos", "max_token_cos", "max_token_pair", "mean_co_selection", "max_co_selection")
PAIR_COLUMNS = ("layer", "i", "j", "output_cos", "token_cos", "co_selection")

DEFINITIONS = {
    "layer": "decoder layer index of the MoE layer",
    "n_experts": "experts of the layer (zero-computation experts included)",
    "tokens": "real (unpadded) tokens of the data, every expert applied to each",
    "i/j": "the pair's experts, i < j (every pair of the layer)",
    "expert output": "E_e(x): expert e's output on the layer's expert input x, before any routing weight; every "
                     "expert on every real token (not only the tokens routed to it). Zero-computation experts: "
                     "x itself (identity experts) or 0 (skip experts)",
    "output_cos": f"cosine of the mean outputs of experts i and j over the real tokens, mean_t E_i(x_t) against "
                  f"mean_t E_j(x_t) (the expert-output similarity of {SOURCE}); empty if a mean output is 0",
    "token_cos": "mean over real tokens of cos(E_i(x_t), E_j(x_t)), the two experts' outputs on the same token "
                 "(tokens where either output is 0 left out; empty if none is left)",
    "co_selection": "Jaccard overlap of the real tokens the model's own routing sends to i and to j: tokens whose "
                    "top-K holds both / tokens whose top-K holds either; empty if neither is ever chosen",
    "mean_output_cos/mean_token_cos/mean_co_selection": "mean over the layer's pairs i < j (empty ones left out; "
                                                        "empty with no pair)",
    "max_output_cos/max_token_cos/max_co_selection": "largest value over the layer's pairs i < j",
    "max_output_pair/max_token_pair": "the pair with the largest output_cos / token_cos, as i-j (ties: the "
                                      "lowest i, then j)",
}


@dataclass(frozen=True)
class ExpertSimilarityOptions:
    """Options of :func:`expert_similarity`."""

    layers: tuple[int, ...] | None = None  # MoE layers measured (None: every MoE layer)
    batch_size: int = 8
    seed: int = 0  # nothing here is random; recorded for the manifest like every experiment's seed

    def __post_init__(self) -> None:
        if not _integer(self.batch_size) or self.batch_size < 1:
            raise MoetoolError(f"--batch-size must be an integer >= 1, not {self.batch_size!r}")
        if self.layers is not None and (isinstance(self.layers, (str, bytes)) or
                                        not all(_integer(i) and i >= 0 for i in self.layers)):
            raise MoetoolError(f"--layers must be decoder layer indices >= 0, not {self.layers!r}")
        if not _integer(self.seed):
            raise MoetoolError(f"--seed must be an integer, not {self.seed!r}")


def _integer(x: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


class SimilaritySums:
    """Forward consumer: per chosen MoE layer, streaming sums over the real tokens (device tensors, no host sync;
    summed over data-parallel ranks):

    * ``out``  ``[n, d]``: ``Σ_t E_e(x_t)`` (the mean output up to the token count);
    * ``cos``  ``[n, n]``: ``Σ_t cos(E_i(x_t), E_j(x_t))`` (0 where either output is 0);
    * ``both`` ``[n, n]``: tokens where both outputs are non-zero (the count ``cos`` is a sum over);
    * ``co``   ``[n, n]``: tokens whose top-K holds both i and j (the diagonal: tokens routed to i);
    * ``tokens``: real tokens.

    Every expert's output comes from :func:`moetool.engine.probes.expert_outputs` over token chunks of at most
    ``budget / 4`` output elements ``[n, T_c, d]`` (the outputs, their unit vectors and the probe's own buffers live
    at once; the probe bounds its intermediates by ``budget`` itself)."""

    def __init__(self, layers: list[int], budget: int | None = None) -> None:
        self.layers = set(layers)
        self.budget = budget or DEFAULT_BUDGET
        self.acc: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        n, dev = L.n_experts, ev.h.device
        valid = ev.valid.to(dev)
        a = self.acc.get(L.index)
        h = ev.h
        step = max(1, self.budget // (4 * n * h.shape[-1]))
        out = cos = both = None
        for s in range(0, h.shape[0], step):  # token chunks: [n, T_c, d] at a time
            v = valid[s:s + step]  # [T_c]
            y = expert_outputs(L, h[s:s + step], self.budget).float()  # [n, T_c, d]
            y = torch.where(v[None, :, None], y, torch.zeros((), dtype=y.dtype, device=y.device))  # padding: 0
            u = ops.unit(y)  # [n, T_c, d]; a zero output stays 0
            nz = (ops.vector_norm(y) > 0).float()  # [n, T_c]
            parts = (y.sum(1).double(), (u.flatten(1) @ u.flatten(1).T).double(), (nz @ nz.T).double())
            out, cos, both = parts if out is None else (out + parts[0], cos + parts[1], both + parts[2])
        m = ops.multi_hot(ev.idx, n) * valid.to(ev.idx.device).unsqueeze(-1).float()  # [T, n] own top-K, real tokens
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
            token_cos = torch.where(a["both"] > 0, a["cos"] / a["both"].clamp_min(1), nan)
            c = a["co"]
            union = c.diagonal()[:, None] + c.diagonal()[None, :] - c  # |A ∪ B| = |A| + |B| - |A ∩ B|
            co_selection = torch.where(union > 0, c / union.clamp_min(1), nan)
            res[layer] = {"output_cos": output_cos.numpy(), "token_cos": token_cos.numpy(),
                          "co_selection": co_selection.numpy(), "tokens": int(round(tokens))}
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


def tables(mats: dict[int, dict[str, Any]], n_experts: dict[int, int]) -> tuple[Any, Any]:
    """``(expert_similarity, expert_similarity_pairs)`` DataFrames from :meth:`SimilaritySums.matrices`."""
    import pandas as pd

    layer_rows, pair_frames = [], []
    for layer, m in mats.items():
        cols = {}
        for name in ("output_cos", "token_cos", "co_selection"):
            i, j, cols[name] = _upper(m[name])
        pair_frames.append(pd.DataFrame({"layer": layer, "i": i, "j": j, **cols}))
        oc, tc, cs = (_mean_max(i, j, cols[k]) for k in ("output_cos", "token_cos", "co_selection"))
        layer_rows.append({"layer": layer, "n_experts": n_experts[layer], "tokens": m["tokens"],
                           "mean_output_cos": oc[0], "max_output_cos": oc[1], "max_output_pair": oc[2],
                           "mean_token_cos": tc[0], "max_token_cos": tc[1], "max_token_pair": tc[2],
                           "mean_co_selection": cs[0], "max_co_selection": cs[1]})
    pairs = pd.concat(pair_frames, ignore_index=True)[list(PAIR_COLUMNS)]
    return pd.DataFrame(layer_rows, columns=list(LAYER_COLUMNS)), pairs


def expert_similarity(lm: Any, tokens: Any, options: ExpertSimilarityOptions | None = None, *, quiet: bool = False,
                      **overrides: Any) -> Result:
    """Per MoE layer, every pair of experts' output cosine (of their mean outputs), per-token output cosine and
    co-selection (Jaccard of their routed tokens) under the model's own routing. Tables ``expert_similarity``
    (per layer, the summary) and ``expert_similarity_pairs``; see :data:`DEFINITIONS`."""
    opts = resolve_options(ExpertSimilarityOptions, options, overrides)
    tokens.require_tokens()
    layers = select_layers(lm.layers, opts.layers)
    quant.require_readable(layers, "expert-similarity")
    indices = [L.index for L in layers]
    sums = SimilaritySums(indices)
    forward(lm, distributed.shard(tokens, opts.batch_size), consumers=[sums], moe_layers=layers,
            batch_size=opts.batch_size, quiet=quiet, description="expert outputs")  # all-reduces the sums
    per_layer, pairs = tables(sums.matrices(), {L.index: L.n_experts for L in layers})
    return Result("expert_similarity", {"expert_similarity.csv": per_layer, "expert_similarity_pairs.csv": pairs},
                  opts, meta=dict(definitions=DEFINITIONS, source=SOURCE, data=tokens.describe(),
                                  data_name=data_name(tokens.source), layers=indices),
                  summary=per_layer)


def summary_lines(name: str, res: Result) -> list[str]:
    """The most alike pair of experts by mean output, and the averages over the layers."""
    df = res["expert_similarity"]
    top = df.loc[df["max_output_cos"].idxmax()] if df["max_output_cos"].notna().any() else None
    out = [f"expert-similarity {name}: mean over {len(df)} layer(s): output cos {df.mean_output_cos.mean():.3f}, "
           f"token cos {df.mean_token_cos.mean():.3f}, co-selection {df.mean_co_selection.mean():.3f}"]
    if top is not None:
        out.append(f"  most alike by mean output: layer {top.layer} experts {top.max_output_pair} "
                   f"(output cos {top.max_output_cos:.3f})")
    return out
