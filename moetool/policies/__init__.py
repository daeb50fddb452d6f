"""Routing policies, by name: ``router``, ``norm:<node>[:<norm>]``, ``random``, ...

"Routing" means one thing everywhere: a policy spec string. ``router`` is the model's own routing (through the
override path). ``build_policy("norm:gate:l2", weights="softmax")`` parses a spec; options a policy does not
use are ignored here, so one set of CLI flags serves every policy (a command refuses ``--weights``, ``--sim`` or
``--no-causal`` given to a policy that reads none, in one line: ``RoutingOptions.policy``,
:func:`refuse_unread_similarity_options`). Every policy derives from :class:`moetool.policies.base.Policy`.
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
    "topk": "moetool.policies.topk:TopKPolicy",
    "topp": "moetool.policies.topk:TopPPolicy",
    "capacity": "moetool.policies.capacity:CapacityPolicy",
    "prune": "moetool.policies.prune:PrunePolicy",
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


def build_policy(routing: str, weights: str = "softmax", seed: int = 0, **options: Any):
    """``--routing`` + ``--weights`` (checked even when the policy ignores it) + options -> a policy object."""
    from .norm import WEIGHTS

    if weights not in WEIGHTS:
        raise MoetoolError(f"unknown --weights '{weights}' (choose from {', '.join(WEIGHTS)})")
    return make_policy(routing, weights=weights, seed=seed, **options)


def build_once(routing: str, weights: str = "softmax", seed: int = 0, **options: Any):
    """:func:`build_policy`, once per run: the run in progress (:func:`moetool.context.current`) keeps the policy
    built for these arguments, so the command that checks ``--routing`` before loading and the experiment that
    routes with it share one build (``Policy.from_spec`` is called once per run). Outside a run: a new policy
    each call."""
    from ..context import current

    run = current()
    build = lambda: build_policy(routing, weights, seed, **options)  # noqa: E731
    if run is None:
        return build()
    return run.policy(("policy", routing, weights, seed, tuple(sorted(options.items()))), build)


def refuse_unread_similarity_options(policies: list[Any], routing: str, sim: str, causal: bool,
                                      tau: float | None = None) -> None:
    """``--sim``, ``--no-causal`` (and fluctuation's ``--tau``) given where no ``--routing`` policy reads them (the
    similarity policy alone does): one line, never silently ignored (as ``--weights`` off norm policies)."""
    from .similarity import SimilarityPolicy

    if any(isinstance(p, SimilarityPolicy) for p in policies):
        return
    given = [flag for flag, on in ((f"--sim {sim}", sim != "dot"), ("--no-causal", not causal),
                                   ("--tau", tau is not None)) if on]
    if given:
        raise MoetoolError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the similarity policy "
                           f"only; --routing {routing} has none")


def option_names() -> set[str]:
    """The keyword options some registered policy reads (``weights``, ``seed`` and the named parameters of every
    policy's ``from_spec``): a keyword outside them is a typo, which :func:`build_policy` would ignore."""
    import inspect

    names = {"weights", "seed"}
    for name in POLICIES.names():
        params = inspect.signature(POLICIES.get(name).from_spec).parameters.values()
        names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD
                                                                        and p.name != "args")}
    return names


def policy_names() -> list[str]:
    return POLICIES.names()
