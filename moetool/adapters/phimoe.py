"""Phi-3.5-MoE (``phimoe``): every decoder layer's ``mlp`` is MoE, routed by SparseMixer.

Router ``mlp.router`` is an ``nn.Linear`` subclass (weight ``[E, H]``, no bias) returning
``(logits, multipliers, idx)``. In eval mode ``sparsemixer`` is deterministic and always picks
**two** experts (``num_experts_per_tok`` is ignored):

* round r picks ``j_r``, the best logit not picked before;
* its multiplier is ``softmax(masked)[j_r]`` where ``masked`` are the logits, minus earlier picks,
  with every expert ``e`` dropped (``-inf``) if ``(s[j_r] - s[e]) / max(|s[e]|, s[j_r]) > 2 ε``,
  ``ε = router_jitter_noise`` (so the threshold applies in eval too; multipliers do not sum to one).

Training mode samples (Gumbel) instead and jitters the inputs in place: use ``model.eval()``.

``weights_for`` on an arbitrary set uses the same rule with the set taken in descending logit
order: the multiplier of the r-th chosen expert is its masked softmax with the earlier chosen
removed and the threshold at its own logit. For the router's set this *is* sparsemixer (bitwise),
and for any other set it is what the model would assign had it picked those experts; unpicked
higher-logit experts stay in the softmax and shrink the weight. (The alternative, renormalised
softmax probabilities, would not reproduce the model's multipliers on its own choice.)
"""

from __future__ import annotations

import torch

from .base import TINY_SHAPE, Adapter, MoELayer


class PhimoeLayer(MoELayer):
    scoring = "sparsemixer (eval): top-2 by logits; weight = softmax over the logits within 2*jitter of it"

    @property
    def top_k(self) -> int:
        return 2  # sparsemixer hard-codes two rounds

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        eps = self.router.router_jitter_noise
        chosen = logits.gather(-1, idx)
        order = chosen.argsort(dim=-1, descending=True)
        w = torch.empty_like(chosen)
        remaining = logits
        for r in range(idx.shape[-1]):
            k = order[:, r:r + 1]
            j = idx.gather(-1, k)
            top = logits.gather(-1, j)
            far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
            w.scatter_(-1, k, torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1).gather(-1, j))
            remaining = remaining.scatter(-1, j, float("-inf"))
        return w

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = logits.max(dim=-1, keepdim=True)[1]
        second = logits.scatter(-1, first, float("-inf")).max(dim=-1, keepdim=True)[1]
        idx = torch.cat((first, second), dim=-1)
        return idx, self.weights_for(logits, idx)


class PhimoeAdapter(Adapter):
    family = "phimoe"
    model_types = ("phimoe",)
    layer_cls = PhimoeLayer
    router_attr = "router"

    @staticmethod
    def tiny_config():
        """No input jitter; ``router_jitter_noise=0.1`` so the multipliers mix several experts."""
        from transformers import PhimoeConfig

        return PhimoeConfig(**TINY_SHAPE, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                            router_jitter_noise=0.1, input_jitter_noise=0.0)
