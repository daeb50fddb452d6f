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
are compared with their output (the input itself, or 0: a cosine with 0 is undefined, left empty).

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

from ..experiment import Demo, Flag, experiment

SPEC = experiment("expert-similarity", "expert_similarity", "ExpertSimilarityOptions", title="expert similarity",
                  demo=Demo(max_tokens=2048), sample=("--cluster-to", "2"),
                  flags=(Flag("--cluster-to", "int", None, "HC-SMoE's groups: cluster each layer's experts into this many "
                              "(average linkage on the distance of mean outputs); default: the merge order only."),),
                  order=150)
