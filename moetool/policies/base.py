"""The policy contract: every routing policy derives from :class:`Policy`.

A policy replaces the top-K choice of a MoE layer: ``select(event) -> (idx [T, K], w [T, K])``, best expert
first. ``from_spec(args, **options)`` builds it from the ``:``-separated arguments of its spec string
(``norm:gate:l2`` -> ``["gate", "l2"]``) and the shared keyword options (weights, seed, tau, sim, causal...):
options a policy does not use are ignored, so one set of CLI flags serves every policy (the commands refuse
``--weights``, ``--sim`` or ``--no-causal`` given to a policy that reads none: ``RoutingOptions.policy``).
``describe()`` is what the manifest records. A policy that computes scores of every expert leaves them in
``ev.scores``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.hooks import RoutingEvent


def spec_number(text: str, cast: Any, what: str) -> Any:
    """A number of a policy spec (``topk:<k>``, ``similarity:<tau>``) cast by ``cast``; a word is a ValueError naming
    the parameter (``make_policy`` turns it into one line)."""
    try:
        return cast(text)
    except ValueError:
        raise ValueError(f"{what} must be {'a whole number' if cast is int else 'a number'}, not '{text}'") from None


def number_text(x: float) -> str:
    """The shortest text of ``x`` that reads back as the same float (``1``, ``1.25``, ``0.9999999``, ``inf``): a
    policy's name carries its number exactly (``:g`` wrote 0.9999999 as 1 and 0.5000001 as 0.5)."""
    short = format(x, "g")
    return short if float(short) == x else repr(float(x))


class Policy:
    """Base class: ``name``, what it needs (``needs_attention``, ``needs_probe``), ``weights`` (``None`` if the
    policy has no weight option). The needs are declarations of the class, read before any policy is built:
    ``--batch-size auto`` sizes the run for them (``moetool.sizing.policy_needs``) and the run loads the model with
    eager attention for ``needs_attention``."""

    name: str = ""
    #: reads the attention probabilities of the layer's attention (``attn_implementation="eager"``)
    needs_attention: bool = False
    #: computes every expert on every token (``moetool.engine.probes``: memory beside the batch)
    needs_probe: bool = False
    weights: str | None = None
    #: re-ranks experts by the router's scores (``route_k`` / ``route_masked``, or the distribution π: similarity,
    #: attention): refused on hash-routed layers
    routes_by_scores: bool = False
    #: routes a token by the other tokens of its sequence (similarity, attention): a forward must hold the whole
    #: sequence, so a KV-cached decoding step (one new token) would route by that token alone; the eval command's
    #: lm-eval generation runs without the cache for such a policy
    reads_sequence: bool = False

    @classmethod
    def from_spec(cls, args: list[str], **options: Any) -> "Policy":
        """Default: a policy that takes no ``:arg`` in its spec."""
        if args:
            raise ValueError(f"'{cls.name}' takes no arguments")
        return cls()

    def describe(self) -> dict[str, Any]:
        """The manifest's record of the policy: its name and the options it uses."""
        return {"name": self.name, **({"weights": self.weights} if self.weights is not None else {})}

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def ranking(self, ev: RoutingEvent) -> torch.Tensor | None:
        """The scores ``[T, n]`` this policy's chosen set (after :meth:`select`) was selected on, whose first-ranked
        chosen expert is its top-1 (:func:`moetool.ops.top1`): the scores it chose from (``ev.scores``: similarity,
        attention); the router's selection scores for a policy that keeps the model's set (router, capacity) or runs
        the model's rule on it (topk, prune); None: its own column order, best first (random, norm)."""
        if ev.scores is not None:
            return ev.scores
        if self.routes_by_scores or ev.chosen_idx is ev.idx:
            return ev.layer.selection_scores(ev.logits)
        return None
