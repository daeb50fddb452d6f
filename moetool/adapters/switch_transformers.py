"""Switch Transformers (``switch_transformers``): an encoder-decoder (T5) with top-1 MoE layers in both stacks.

What the model does (``SwitchTransformersSparseMLP``, the ``mlp`` of the last sublayer of every sparse block of
``encoder.block`` and ``decoder.block``):

* ``SwitchTransformersTop1Router`` (``classifier``, an ``nn.Linear [E, H]``, run in ``router_dtype`` = fp32)
  returns ``(dispatch [B, S, E] one-hot, p_max [B, S, 1], logits)``: ``p = softmax(logits)``, the expert is the
  argmax, its weight the top probability (no renormalisation; the catalogue's ``softmax-topk`` at K = 1).
  Router jitter (``router_jitter_noise``) applies in training only: none in eval.
* **Expert capacity**: within each sequence (row) an expert takes at most ``expert_capacity`` tokens, in
  position order; later tokens routed to a full expert are dropped (the experts add nothing for them: the
  residual carries them). The dispatch mask is the one-hot choice with those tokens zeroed.
* ``SwitchTransformersExperts`` (a ModuleDict ``expert_{e}`` of ``wo(act(wi x))``, **not gated**, no biases,
  ``act = dense_act_fn``, ReLU by default) is called as ``experts(h [T, H], dispatch [T, 1, E], p_max [T, 1])``.

The engine needs ``router -> (logits, w, idx)`` and ``experts(h, idx, w)``, so the adapter swaps the class of each
sparse MLP (once, per instance; parameters and state dict unchanged: :func:`restore` undoes it) for one whose
forward calls

* a router view: the model's own router runs inside it on the ``[B, S, H]`` input; it returns the logits
  ``[T, E]``, ``idx [T, 1]`` (the argmax of the router's own probabilities, *before* capacity) and ``w = p_max``;
* an experts view ``experts(h, idx, w)`` that applies the model's capacity rule to whatever ``(idx, w)`` it is
  given (per row, in position order, an expert keeps its first ``expert_capacity`` (token, choice) pairs with a
  nonzero weight; at K = 1 this is the model's own cumsum) and runs the model's experts module on that dispatch.

So routing events carry the router's choice (what every analysis and policy sees); capacity is a dispatch step
after it, applied to the model's routing and to any policy's alike. With the model's own ``(idx, w)`` the dispatch
mask is the router's own, element for element: the logits are bit for bit the original model's.

Layers of both stacks are one list: the encoder's sparse blocks keep their block index ``i``, the decoder's get
``n_encoder_blocks + j`` (``describe()`` gives ``stack`` and ``stack_layer``), so ``--layers`` and every table's
``layer`` column name one MoE layer of either stack.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import MoetoolError
from .base import ExpertWeights
from .generic import GenericAdapter, GenericLayer, identify_layer
from .generic import restore_views as restore  # noqa: F401 - undo the class swap


class SwitchRouterView(nn.Module):
    """``(logits [T, E], w [T, 1], idx [T, 1])`` of the model's ``SwitchTransformersTop1Router``."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.__dict__["router"] = router  # not registered: children() is the classifier alone (its projection)
        self.classifier = router.classifier

    def forward(self, hidden_states: torch.Tensor):
        router = self.__dict__["router"]
        h = hidden_states if hidden_states.dim() == 3 else hidden_states.unsqueeze(0)  # rows: capacity per row
        _, p_max, logits = router(h)  # the model's own module (transformers' recorders see it)
        logits = logits.reshape(-1, logits.shape[-1])
        probs = F.softmax(logits, dim=-1, dtype=router.dtype).to(hidden_states.dtype)  # as the router ranks
        idx = probs.argmax(dim=-1, keepdim=True)
        return logits, p_max.reshape(-1, 1), idx


def capacity_dispatch(idx: torch.Tensor, w: torch.Tensor, n_experts: int, capacity: int,
                      rows: tuple[int, int]) -> torch.Tensor:
    """``[T, K, E]`` one-hot dispatch of ``idx [T, K]``: per row of ``rows = (B, S)`` tokens, an expert keeps its
    first ``capacity`` (token, choice) pairs in (position, choice) order among those with a nonzero weight."""
    B, S = rows
    T, K = idx.shape
    onehot = F.one_hot(idx, n_experts) * (w != 0).unsqueeze(-1)  # [T, K, E]
    position = onehot.reshape(B, S * K, n_experts).cumsum(dim=1).reshape(T, K, n_experts)
    return onehot * (position <= capacity)


class SwitchExpertsView(nn.Module):
    """``experts(h, idx, w)``: the model's capacity rule, then its experts module on the dispatch mask."""

    def __init__(self, experts: nn.Module, capacity: int):
        super().__init__()
        self.experts = experts
        self.capacity = capacity
        self.rows: tuple[int, int] | None = None  # (B, S) of the block's input, set by the block for its call

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        rows = self.rows if self.rows is not None and self.rows[0] * self.rows[1] == hidden_states.shape[0] \
            else (1, hidden_states.shape[0])
        dispatch = capacity_dispatch(top_k_index, top_k_weights, self.experts.num_experts, self.capacity, rows)
        return self.experts(hidden_states, dispatch, top_k_weights)


def _views(block: nn.Module) -> tuple[SwitchRouterView, SwitchExpertsView]:
    """The sparse MLP's router and experts views, created once (not registered: the state dict is unchanged)."""
    if "_moetool_views" not in block.__dict__:
        block.__dict__["_moetool_views"] = (SwitchRouterView(block.router),
                                            SwitchExpertsView(block.experts, int(block.router.expert_capacity)))
        original = type(block)
        block.__class__ = type("SwitchSparseMLP", (original,), {"forward": _block_forward,
                                                                "_moetool_original": original})
    return block.__dict__["_moetool_views"]


def _block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``SwitchTransformersSparseMLP.forward`` through the views (same tensors, same dispatch)."""
    router, experts = self.__dict__["_moetool_views"]
    B, S, H = hidden_states.shape
    _, w, idx = router(hidden_states)
    experts.rows = (B, S)
    try:
        out = experts(hidden_states.reshape(-1, H), idx, w)
    finally:
        experts.rows = None
    return out.reshape(B, S, H)


class SwitchLayer(GenericLayer):
    """A sparse MLP of either stack; non-gated experts ``wo(act(wi x))``."""

    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any, *, stack: str = "encoder", stack_layer: int = 0):
        router_view, experts_view = _views(block)
        self.stack, self.stack_layer = stack, stack_layer
        super().__init__(index, decoder_layer, block, router_view, experts_view, config)

    #: ``SwitchTransformersAttention`` returns ``(output, position_bias, attention probabilities)``
    attention_probs_index = 2

    @property
    def attention(self) -> nn.Module | None:
        """The block's self-attention (bidirectional in the encoder, causal in the decoder; eager for probabilities)."""
        return self.decoder_layer.layer[0].SelfAttention

    @property
    def softmax_attention(self) -> nn.Module:
        return self.attention

    @property
    def shared_experts(self) -> nn.Module | None:
        return None

    @property
    def pre_router_norm(self) -> nn.Module:
        """The norm between the block's input stream and the router (the feed-forward sublayer's layer norm)."""
        return self.decoder_layer.layer[-1].layer_norm

    @property
    def capacity(self) -> int:
        return self.experts.capacity

    def _experts(self) -> list[nn.Module]:
        ex = self.experts.experts
        return [ex[f"expert_{e}"] for e in range(ex.num_experts)]

    def expert_weights(self) -> ExpertWeights:
        experts = self._experts()
        up = torch.stack([m.wi.weight for m in experts])  # [n, I, d]
        return ExpertWeights(gate=up, up=up, down=torch.stack([m.wo.weight for m in experts]))  # down [n, d, I]

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return self._experts()[0].act(gate)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(up)

    def _identify(self):
        """The generic identification, then how the router breaks ties in a half-precision model: it ranks its fp32
        probabilities cast back to the input dtype (``argmax``: the lowest index among equal ones). Checked on the
        router's own output for near-uniform probabilities, where rounding makes ties: the rank dtype (or fp32
        ranking) that reproduces its choice there is kept; neither is one error line."""
        router = self.router.__dict__["router"]
        was = router.training
        router.eval()  # the router's jitter is for training only (a model built by from_config is in train mode)
        try:
            return self._identify_eval()
        finally:
            router.train(was)

    def _identify_eval(self):
        rule, params, mode, cap = identify_layer(self)
        if params.weights_dtype not in (torch.bfloat16, torch.float16):
            return rule, params, mode, cap
        w = self.linear.weight
        if w.device.type == "meta":  # no weights to run (inspect of a hub model): the modeling code's ranking
            return rule, replace(params, rank_dtype=params.weights_dtype), mode, cap
        h = torch.randn(256, w.shape[1], generator=torch.Generator().manual_seed(0)) * 1e-3
        with torch.no_grad():
            logits, _, idx = self.router(h.to(device=w.device, dtype=params.weights_dtype))
        for p in (replace(params, rank_dtype=params.weights_dtype), replace(params, rank_dtype=None)):
            if torch.equal(rule.select(logits, p), idx):
                return rule, p, mode, cap
        raise MoetoolError(f"switch_transformers: the router's choice among near-equal probabilities matches no "
                           f"ranking (layer {self.index})")

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "stack": self.stack, "stack_layer": self.stack_layer,
                "expert_capacity": self.capacity}


def _sparse_mlp(block: nn.Module) -> nn.Module | None:
    ff = block.layer[-1]
    return ff.mlp if getattr(ff, "is_sparse", False) else None


class SwitchAdapter(GenericAdapter):
    family = "switch-top1-encoder-decoder"
    layer_cls = SwitchLayer

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return [*model.encoder.block, *model.decoder.block]

    def layers(self, model: nn.Module) -> list:
        out = []
        n_enc = len(model.encoder.block)
        for stack, blocks, offset in (("encoder", model.encoder.block, 0), ("decoder", model.decoder.block, n_enc)):
            for j, blk in enumerate(blocks):
                mlp = _sparse_mlp(blk)
                if mlp is not None:
                    out.append(SwitchLayer(offset + j, blk, mlp, mlp.router, mlp.experts, model.config, stack=stack,
                                           stack_layer=j))
        return out
