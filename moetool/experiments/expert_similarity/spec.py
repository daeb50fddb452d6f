"""The spec of ``moetool expert-similarity`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

SPEC = experiment("expert-similarity", "expert_similarity", "ExpertSimilarityOptions", cmd=None, title="expert similarity",
                  demo=Demo(max_tokens=2048), sample=("--cluster-to", "2"),
                  flags=(Flag("--cluster-to", "int", None, "HC-SMoE's groups: cluster each layer's experts into this many "
                              "(average linkage on the distance of mean outputs); default: the merge order only."),),
                  order=150)
