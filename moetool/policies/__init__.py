"""Routing policies, by name: ``router``, ``norm:<node>[:<norm>]``, ``random``, ... (SPEC §Routing policies).

``make_policy("norm:gate:l2", weights="softmax")`` parses a policy string; options a
policy does not use are ignored, so one set of CLI flags serves every policy.
"""

from __future__ import annotations

from typing import Any

from ..errors import MoetoolError
from ..registry import LazyRegistry

POLICIES = LazyRegistry("routing policy", {
    "router": "moetool.policies.basic:RouterPolicy",
    "norm": "moetool.policies.norm:NormPolicy",
    "random": "moetool.policies.basic:RandomPolicy",
    "similarity": "moetool.policies.similarity:SimilarityPolicy",
    "attention": "moetool.policies.attention:AttentionPolicy",
})


def make_policy(spec: str, **options: Any):
    """Build a policy from ``name[:arg[:arg]]`` and keyword options (weights, seed, sim, tau, causal...)."""
    spec = spec.strip()
    if not spec:
        raise MoetoolError("empty routing policy")
    name, *args = spec.split(":")
    cls = POLICIES.get(name)
    try:
        return cls.from_spec(args, **options)
    except (ValueError, TypeError) as e:
        raise MoetoolError(f"bad routing policy '{spec}': {e}") from None


def policy_names() -> list[str]:
    return POLICIES.names()
