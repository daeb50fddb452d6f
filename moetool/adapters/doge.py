"""Doge (``doge`` with ``is_moe``): CDMoE, product-key retrieval over single-neuron experts beside a dense MLP.

What ``DogeCDMoE.forward`` (each decoder layer's ``mlp``) does for ``h [B, S, d]`` (``T = B x S`` tokens,
``k = floor(sqrt(num_experts))`` keys per half, top-K = ``num_experts_per_tok``):

* ``r = router_gate(h).view(2, T, k)``: the two sub-key score sets ``x = r[0]``, ``y = r[1]``. The view is over the
  flattened ``[T, 2k]`` output, so token ``t``'s ``x`` is half ``t mod 2`` of token ``t // 2``'s projection and its
  ``y`` half ``(T + t) mod 2`` of token ``(T + t) // 2``'s: **the routing of a token depends on other tokens of the
  batch** (the model's own comment: kept for checkpoint compatibility; with one token, generation, it is the
  token's own two halves);
* expert ``i k + j`` scores ``x_i + y_j``; the model takes the top ``k`` of each half (all of them: the ranking of
  the ``k^2`` sums is complete) then the top-K of the ``k^2`` sums, weights = softmax over the K chosen scores
  (again divided by their sum if ``norm_topk_prob``);
* expert ``e`` is one neuron: ``act(down_embed[e] . h) x w_e x up_embed[e]``;
* the block adds a dense SwiGLU MLP on ``h`` (``gate_proj`` / ``up_proj`` / ``down_proj``).

moetool's view: the logits are the full ``[T, k^2]`` product scores ``x_i + y_j`` (expert ``i k + j``), the rule is
the catalogue's ``topk-softmax`` (top-K of the logits, softmax over the K chosen: the model's two-stage top-K is the
full top-K since its first stage keeps all ``k`` keys), identified at load on the router view, whose selection and
weights are the model's own code; at load the swapped block is also checked against ``DogeCDMoE.forward`` bit for
bit. The experts are ``n = k^2`` single-neuron experts (``I = 1``): ``gate = down_embed [n, 1, d]``, ``down =
up_embed [n, d, 1]``, no up projection (:meth:`DogeLayer.glu` is ``act(gate)``; ``up`` is the gate's view). The
dense MLP is the shared expert. Embedding rows past ``k^2`` (``num_experts`` not a square) are never chosen by the
model and are not experts here (``describe()['unreachable_rows']``).

Like jetmoe, the block's class is swapped (once, per instance; parameters and state dict unchanged: the views are
not registered) for one whose forward calls the router view and the experts view (the same operations on the same
tensors as the original forward), so the engine's hooks and policies see ``router(h) -> (logits, w, idx)`` and
``experts(h, idx, w)``.

Because the logits of a token depend on other tokens, :meth:`DogeLayer.logits` takes the whole flattened batch
(``RoutingEvent.h``, in the model's order) and every layer is :attr:`~moetool.adapters.base.MoELayer.carried_state`:
what recomputes routing from other inputs (perturbed or predicted points) refuses in one line. There is no router
matrix ``R [n, d]`` (:meth:`DogeLayer.router_weight` refuses in one line).

So the model's routing, and every number from it (perplexity included), depends on how tokens are batched and
padded (``--batch``): moetool runs the model as it is, with the batches it is given.

Precision: in fp32 ``route(logits)`` is the model's choice exactly (tests). In bf16 equal sums ``x_i + y_j`` tie
often and the model breaks ties in its two-stage order, which the ``[T, k^2]`` logits do not carry: re-routing from
captured logits (policies other than ``router``, ``topk:K``) then differs from the model's own set on ties (the
tiny model: 0.4-0.7% of tokens, tied experts' scores equal); the ``router`` policy and the captured events are the
model's own. The rule is identified on an fp32 copy of the router view for that reason.

Size: the full logits are ``[T, k^2]`` per layer (real Doge-MoE checkpoints: ``k^2`` of a few thousand to 16384
experts; fp32 ``T x n`` per captured event, e.g. 64 MiB for ``T = 1024``, ``n = 16384``), the cost of seeing the
whole routing distribution.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import text_config
from ..errors import MoetoolError
from . import rules
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer, _candidates, _is_meta, _materialized, decoder_layers
from .generic import restore_views as restore  # noqa: F401 - undo the class swap

_N_TOKENS = 256
MIXING = "the other tokens of the batch (Doge's product-key router mixes tokens: router_gate(h).view(2, T, -1))"


class ProductKeyRouterView(nn.Module):
    """``(logits [T, k^2], w, idx, router_logits)`` of a ``DogeCDMoE``'s router: the full product scores, then the
    model's own two-stage selection and weights; ``router_logits`` is the model's ``[2, T, k]`` (its second output)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.router_gate = block.router_gate
        self.num_keys, self.top_k, self.norm_topk_prob = int(block.num_keys), int(block.top_k), block.norm_topk_prob

    @property
    def weight(self) -> torch.Tensor:  # the sub-key projection [2k, d]
        return self.router_gate.weight

    def product_logits(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, k^2], router_logits [2, T, k])`` for the whole flattened batch ``[T, d]`` (model order)."""
        h = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.weight.dtype)
        T, k = h.shape[0], self.num_keys
        r = self.router_gate(h).view(2, T, -1)
        return (r[0].unsqueeze(-1) + r[1].unsqueeze(-2)).view(T, k * k), r

    def forward(self, hidden_states: torch.Tensor):
        logits, router_logits = self.product_logits(hidden_states)
        k = self.num_keys
        # the model's own selection (DogeCDMoE.forward)
        (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(k, dim=-1)
        all_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2))
        all_indices = indices_x.unsqueeze(-1) * k + indices_y.unsqueeze(-2)
        all_scores = all_scores.view(*all_scores.shape[:-2], -1)
        all_indices = all_indices.view(*all_indices.shape[:-2], -1)
        scores, position_indices = all_scores.topk(self.top_k, dim=-1)
        indices = all_indices.gather(-1, position_indices)
        routing_weights = F.softmax(scores, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        return logits, routing_weights, indices, router_logits


class SingleNeuronExpertsView(nn.Module):
    """``experts(h [T, d], idx, w)``: ``Σ_e w_e act(down_embed[e] . h) up_embed[e]``, the model's own operations."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.down_embed, self.up_embed, self.act_fn = block.down_embed, block.up_embed, block.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        T = hidden_states.shape[0]
        down_embed = self.down_embed(top_k_index)
        up_embed = self.up_embed(top_k_index)
        experts_weights = torch.matmul(down_embed, hidden_states.view(T, -1, 1)).view(T, -1)
        experts_weights = self.act_fn(experts_weights) * top_k_weights
        return torch.matmul(experts_weights.view(T, 1, -1), up_embed).view(T, -1)


class DenseMLPView(nn.Module):
    """The block's dense SwiGLU MLP (its shared expert) as one callable."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (block.gate_proj, block.up_proj, block.down_proj,
                                                                     block.act_fn)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))


def _forward(self, hidden_states: torch.Tensor, **kwargs):
    """``DogeCDMoE.forward`` through the views (same tensors, same order of operations)."""
    router, experts, dense = self.__dict__["_moetool_views"]
    bsz, seq_len, d = hidden_states.shape
    h = hidden_states.view(bsz * seq_len, d)
    _, w, idx, router_logits = router(h)
    experts_states = experts(h, idx, w).view(bsz, seq_len, -1)
    return dense(hidden_states) + experts_states, router_logits


@functools.lru_cache(maxsize=None)
def _swapped(original: type) -> type:
    return type(f"{original.__name__}WithViews", (original,), {"forward": _forward, "_moetool_original": original})


def _views(block: nn.Module) -> tuple[ProductKeyRouterView, SingleNeuronExpertsView, DenseMLPView]:
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (ProductKeyRouterView(block), SingleNeuronExpertsView(block),
                                            DenseMLPView(block))
        block.__class__ = _swapped(type(block))
    return block.__dict__["_moetool_views"]


class DogeLayer(GenericLayer):
    """``topk-softmax`` over ``k^2`` product-key logits; single-neuron experts; the dense MLP as shared expert."""

    routing_context = MIXING

    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        router_view, experts_view, self._dense = _views(block)
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)

    @property
    def n_experts(self) -> int:
        return self.router.num_keys ** 2

    @property
    def carried_state(self) -> bool:
        return True  # the logits depend on the rest of the batch, not on h alone (routing_context)

    @property
    def shared_experts(self) -> nn.Module | None:
        return self._dense

    def router_weight(self) -> torch.Tensor:
        raise MoetoolError(f"layer {self.index}: Doge's router is product-key retrieval (two sub-key score sets over "
                           f"{MIXING.removeprefix('the other tokens of the batch (').rstrip(')')}), not a matrix "
                           f"R [n, d] over the layer input")

    def router_bias(self) -> torch.Tensor | None:
        return None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The ``[T, k^2]`` product scores for the **whole flattened batch** ``h [T, d]`` in the model's order (the
        router mixes tokens: a subset of rows gives other logits than the model's)."""
        return self.router.product_logits(h)[0]

    def expert_weights(self) -> ExpertWeights:
        n = self.n_experts
        gate = self.experts.down_embed.weight[:n].unsqueeze(1)  # [n, 1, d]
        return ExpertWeights(gate=gate, up=gate, down=self.experts.up_embed.weight[:n].unsqueeze(-1))  # [n, d, 1]

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self.experts.act_fn(gate)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(down_embed[e] . h)``: one neuron, no up projection (``up`` is ignored)."""
        return self.act(gate)

    def describe(self) -> dict[str, Any]:
        rows = int(self.experts.down_embed.weight.shape[0])
        d = {**super().describe(), "router": f"product keys: {self.router.num_keys} x {self.router.num_keys} sub-keys",
             "expert_width": 1, "note": "single-neuron experts (embedding rows); the dense MLP as shared expert; "
                                        "routing depends on the other tokens of the batch"}
        if rows > self.n_experts:
            d["unreachable_rows"] = rows - self.n_experts
        return d

    def _identify(self):
        """The rule on the router view's output (the model's own selection code) on seeded random inputs; then the
        swapped block against ``DogeCDMoE.forward`` itself, bit for bit."""
        mt = getattr(self.config, "model_type", "?")
        router = self.router
        if _is_meta(router.weight):
            router = _materialized(router)
        elif router.weight.dtype != torch.float32:  # low precision: equal sums x_i + y_j tie often, and the model's
            router = copy.deepcopy(router).float()  # two-stage order among ties is not a rule's; the rule is in the code
        w = router.weight
        h = torch.randn(_N_TOKENS, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w)
        with torch.no_grad():
            logits, weights, idx, _ = router(h)
            try:
                rule, params = rules.identify(logits, idx, weights, _candidates(router, int(idx.shape[-1]), None))
            except rules.NoRuleMatches as e:
                raise MoetoolError(f"{mt}: router output matches no known routing rule ({e}) (layer {self.index}, "
                                   f"DogeCDMoE)") from None
            if not _is_meta(*self.block.parameters()):
                x = h.unsqueeze(0).to(self.block.router_gate.weight)
                want = self.block._moetool_original.forward(self.block, x)
                got = self.block(x)
                if not all(torch.equal(a, b) for a, b in zip(want, got)):
                    raise MoetoolError(f"{mt}: the router/experts views do not reproduce DogeCDMoE.forward bit for "
                                       f"bit (layer {self.index})")
        return rule, params, "native", 0.0


class DogeAdapter(GenericAdapter):
    family = "product-key"
    layer_cls = DogeLayer

    def layers(self, model: nn.Module) -> list:
        config = text_config(model.config)
        out = []
        for i, dl in enumerate(decoder_layers(model)):
            mlp = getattr(dl, "mlp", None)
            if isinstance(getattr(mlp, "router_gate", None), nn.Module):
                out.append(self.layer_cls(i, dl, mlp, mlp.router_gate, mlp, config))
        return out
