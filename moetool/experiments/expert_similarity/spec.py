"""Expert similarity: how alike the experts of each MoE layer are (expert redundancy, the input of merging).

One pass of the model's own routing over --data applies every expert of each MoE layer (--layers) to every real
token's expert input (batched probes in memory-bounded token chunks; streaming sums, nothing kept per token) and
measures, per pair of experts i < j: output_dist, the Euclidean distance between their mean outputs over the tokens
(what HC-SMoE clusters experts by: Chen et al. 2024, "Retraining-Free Merging of Sparse MoE via Hierarchical
Clustering", arXiv 2410.08589; its code, wazenmai/HC-SMoE --similarity_base expert-output, clusters the mean expert
outputs by Euclidean distance with average linkage); output_cos, the cosine of the same mean outputs (a
scale-free view of the same vectors; HC-SMoE's code uses (cos+1)/2 only to pick its frequency-dominant experts,
not to group); token_cos, the mean over tokens of the cosine of their two outputs on the same token (do they act
alike token by token, not only on average); co_selection, the Jaccard overlap of the tokens the model routes to
each (tokens where both are in the top-K / tokens where either is). Then HC-SMoE's grouping: average-linkage
hierarchical clustering of the mean outputs by output_dist, merge by merge down to one cluster (ties: the pair of
clusters with the lowest labels, a cluster labelled by its lowest expert, as HC-SMoE's code), and with
--cluster-to N the N groups it stops at. Experts are compared before any routing weight; zero-computation experts
(LongCat-Flash's identity experts, Zaya's skip expert) have no weights to compare or merge and are left out.

Writes expert_similarity.csv (layer, n_experts, tokens, mean_output_cos, max_output_cos, max_output_pair,
min_output_dist, min_dist_pair, mean_token_cos, max_token_cos, max_token_pair, mean_co_selection,
max_co_selection), expert_similarity_pairs.csv (layer, i, j, output_dist, output_cos, token_cos, co_selection;
every pair i < j), expert_similarity_merges.csv (layer, step, i, j, distance, size, clusters: HC-SMoE's
average-linkage merge order), with --cluster-to N expert_similarity_groups.csv (layer, expert, group, dominant:
HC-SMoE's N groups) and manifest.json (definitions).

Examples:
  moetool expert-similarity
  moetool expert-similarity --model tiny-fine --layers 0,1 --max-tokens 4096
  moetool expert-similarity --cluster-to 4
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ...context import flag
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option


@dataclass(frozen=True)
class ExpertSimilarityOptions:
    """Options of :func:`~moetool.experiments.expert_similarity.compute.expert_similarity`, each with the flag of
    ``moetool expert-similarity`` that sets it."""

    layers: tuple[int, ...] | None = None  # MoE layers measured (None: every MoE layer)
    cluster_to: int | None = option(  # HC-SMoE's groups: this many per layer (None: the merge order only)
        None, "--cluster-to", "HC-SMoE's groups: cluster each layer's experts into this many (average linkage on the "
        "distance of mean outputs); default: the merge order only.", kind="int")
    batch_size: int = 8
    seed: int = 0  # nothing here is random; recorded for the manifest like every experiment's seed

    def __post_init__(self) -> None:
        if self.cluster_to is not None and (not _integer(self.cluster_to) or self.cluster_to < 1):
            raise MoetoolError(f"--cluster-to must be an integer >= 1, not {self.cluster_to!r}")
        if not _integer(self.batch_size) or self.batch_size < 1:
            raise MoetoolError(f"{flag('batch_size')} must be an integer >= 1, not {self.batch_size!r}")
        if self.layers is not None and (isinstance(self.layers, (str, bytes)) or
                                        not all(_integer(i) and i >= 0 for i in self.layers)):
            raise MoetoolError(f"{flag('layers')} must be decoder layer indices >= 0, not {self.layers!r}")
        if not _integer(self.seed):
            raise MoetoolError(f"--seed must be an integer, not {self.seed!r}")


def _integer(x: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    import numpy as np

    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


SPEC = experiment("expert-similarity", "expert_similarity", "ExpertSimilarityOptions", title="expert similarity",
                  demo=Demo(max_tokens=2048), sample=("--cluster-to", "2"),
                  order=150)
