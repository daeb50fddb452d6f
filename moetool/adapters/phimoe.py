"""Phi-3.5-MoE (``phimoe``): every decoder layer's ``mlp`` is MoE, routed by SparseMixer.

Router ``mlp.router`` is an ``nn.Linear`` subclass (weight ``[E, H]``, no bias) returning
``(logits, multipliers, idx)``. In eval mode ``sparsemixer`` is deterministic and always picks
**two** experts (``num_experts_per_tok`` is ignored):

* round r picks ``j_r``, the best logit not picked before;
* its multiplier is ``softmax(masked)[j_r]`` where ``masked`` are the logits, minus earlier picks,
  with every expert ``e`` dropped (``-inf``) if ``(s[j_r] - s[e]) / max(|s[e]|, s[j_r]) > 2 ε``,
  ``ε = router_jitter_noise`` (so the threshold applies in eval too; multipliers do not sum to one).

That is rule ``sparsemixer`` of :mod:`moetool.adapters.rules` (``ε`` read off the router), identified at load by
the generic adapter; ``weights_for`` on any other set is :func:`moetool.adapters.rules.sparsemixer_weights`: the
set in descending logit order, each its masked softmax with the earlier chosen removed (what the model would
assign had it picked those experts; for the router's own set, sparsemixer bit for bit).

Training mode samples (Gumbel) instead and jitters the inputs in place: use ``model.eval()``. This file names the
family and its tiny test config.
"""

from __future__ import annotations

from .base import TINY_SHAPE
from .generic import GenericAdapter


class PhimoeAdapter(GenericAdapter):
    family = "phimoe"

    @staticmethod
    def tiny_config():
        """No input jitter; ``router_jitter_noise=0.1`` so the multipliers mix several experts."""
        from transformers import PhimoeConfig

        return PhimoeConfig(**TINY_SHAPE, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                            router_jitter_noise=0.1, input_jitter_noise=0.0)
