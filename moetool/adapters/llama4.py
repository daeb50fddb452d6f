"""Llama 4 (``llama4`` and its text decoder ``llama4_text``): sigmoid over the top-K logits, experts on
score-scaled inputs, a shared expert beside them.

What the model does (``Llama4TextMoe``, the ``feed_forward`` of the layers in ``config.moe_layers``):

* ``Llama4Router`` (an ``nn.Linear [E, H]``) returns ``(scores [T, E], logits [T, E])``: top-K of the logits,
  ``scores = sigmoid(top-K logits)`` at the chosen experts and exactly 0 elsewhere (sigmoid(-inf)).
* Every token goes through every expert, its **input** scaled by the score: ``experts(h.repeat(E) * scores)``
  (``Llama4TextExperts``: ``gate_up_proj [E, H, 2I]`` as (in, out), gate first half; ``down_proj [E, I, H]``);
  an expert whose score is 0 sees 0 and returns 0 (no biases). The routed output is the sum over experts, the
  shared expert is added.

So the routing weight multiplies the expert's input, not its output: ``y = Σ_k E_k(w_k h)``. There is no
``experts(h, idx, w)`` call and the router returns no indices, so this adapter swaps the class of each MoE block
(once, per instance; parameters and state dict unchanged) for :class:`Llama4MoeBlock`, whose forward calls

* a router view returning ``(logits, w, idx)`` (the model's own router module runs inside it; ``w`` =
  sigmoid of the top-K logits, as the model computes it) and
* an experts view ``experts(h, idx, w)`` that scatters ``w`` into the dense ``[T, E]`` scores (0 elsewhere) and
  runs the model's own computation on them.

With the model's own ``(idx, w)`` the scores tensor is the one ``Llama4Router`` builds, element for element, so
the logits are bit for bit the original model's (tests/test_families_hand.py checks it against an unswapped
copy). The routing rule (``topk-sigmoid``) is identified by the generic adapter on the router view.
``describe()["weights_scale_input"]`` says that ``w`` scales the experts' input (``inspect`` shows it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..configs import text_config
from . import rules
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer, decoder_layers
from .generic import restore_views as restore  # noqa: F401 - undo the class swap


class Llama4RouterView(nn.Module):
    """``(logits, w, idx)`` of the model's ``Llama4Router`` (registered here as ``router``)."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.top_k = router.top_k

    def forward(self, hidden_states: torch.Tensor):
        _, logits = self.router(hidden_states)  # the model's own module (transformers' recorders see it)
        top, idx = torch.topk(logits, self.top_k, dim=1)
        w = torch.sigmoid(top.float()).to(logits.dtype)
        return logits, w, idx


class Llama4ExpertsView(nn.Module):
    """``experts(h, idx, w)``: the model's score-scaled dense computation for the chosen ``(idx, w)``."""

    def __init__(self, experts: nn.Module, n_experts: int):
        super().__init__()
        self.experts = experts
        self.n_experts = n_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        T, H = hidden_states.shape
        scores = torch.zeros(T, self.n_experts, dtype=top_k_weights.dtype, device=hidden_states.device)
        scores = scores.scatter(1, top_k_index, top_k_weights)
        routed_in = hidden_states.repeat(self.n_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
        routed_out = self.experts(routed_in)
        return routed_out.reshape(self.n_experts, -1, routed_out.shape[-1]).sum(dim=0)


def _views(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The block's router and experts views, created once per block (not registered: the state dict is unchanged)."""
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (Llama4RouterView(block.router),
                                            Llama4ExpertsView(block.experts, block.num_experts))
        original = type(block)
        block.__class__ = type("Llama4MoeBlock", (original,), {"forward": _block_forward,
                                                               "_moetool_original": original})
    return block.__dict__["_moetool_views"]


def _block_forward(self, hidden_states: torch.Tensor):
    """``Llama4TextMoe.forward`` through the views (same tensors, same order of operations)."""
    router, experts = self.__dict__["_moetool_views"]
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits, w, idx = router(hidden_states)
    routed = experts(hidden_states, idx, w)
    out = self.shared_expert(hidden_states)
    out.add_(routed)
    return out, router_logits


class Llama4Layer(GenericLayer):
    """The routing weight scales the experts' input: y = Σ_k E_k(w_k h), not Σ_k w_k E_k(h)."""

    def __init__(self, index, decoder_layer, block, router, experts, config):
        router_view, experts_view = _views(block)
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)
        if self.rule.name == "sigmoid-topk":  # at K = 1 the two orders agree; Llama4Router's code ranks logits
            self.rule = rules.TOPK_SIGMOID
            self.scoring = self.rule.scoring(self.params)

    @property
    def shared_experts(self) -> nn.Module | None:
        return self.block.shared_expert

    def expert_weights(self) -> ExpertWeights:
        ex = self.experts.experts
        gate_up = ex.gate_up_proj.transpose(1, 2)  # [n, 2I, d], views
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=ex.down_proj.transpose(1, 2))

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.experts.experts.act_fn(gate)

    def describe(self):
        return {**super().describe(), "weights_scale_input": True}


def _is_llama4_moe(block: nn.Module) -> bool:
    return all(hasattr(block, a) for a in ("router", "experts", "shared_expert", "hidden_dim"))


class Llama4Adapter(GenericAdapter):
    family = "llama4-sigmoid-input-scaled"
    layer_cls = Llama4Layer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        out = []
        for i, dl in enumerate(decoder_layers(model)):
            block = getattr(dl, "feed_forward", None)
            if block is not None and _is_llama4_moe(block):
                out.append(self.layer_cls(i, dl, block, block.router, block.experts, config))
        return out
