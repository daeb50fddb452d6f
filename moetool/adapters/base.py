"""The adapter contract: one uniform view of an MoE layer, whatever the family.

An :class:`Adapter` (one per model family, one file each) finds the MoE layers of a
loaded model and wraps each in an :class:`MoELayer` subclass that knows

* where to hook: the ``router`` module (returns ``(logits, weights, idx)``) and the
  ``experts`` module (called as ``experts(h [T, d], idx [T, K], w [T, K])``);
* the weights: router ``R [n, d]`` (+ bias), experts as stacked views
  ``gate/up [n, I, d]``, ``down [n, d, I]`` (+ biases), the activation;
* the routing math exactly as the model does it: :meth:`MoELayer.route` from logits,
  :meth:`MoELayer.probs` (the full routing distribution π, summing to one) and
  :meth:`MoELayer.weights_for` (the model's weights for any chosen set).

The base class implements the common transformers 5.x layout (fused
``experts.gate_up_proj [E, 2I, H]`` with gate first, ``experts.down_proj [E, H, I]``,
softmax -> top-K -> optional renormalisation); families override what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops

#: the shape every adapter's ``tiny_config()`` shares (with its family's expert sizes: ~1-2M parameters)
TINY_SHAPE: dict[str, int] = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256)


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked expert weights in one canonical layout (views of the model's parameters)."""

    gate: torch.Tensor  # [n, I, d]  W_g
    up: torch.Tensor  # [n, I, d]  W_p
    down: torch.Tensor  # [n, d, I]  W_o
    gate_bias: torch.Tensor | None = None  # [n, I]
    up_bias: torch.Tensor | None = None  # [n, I]
    down_bias: torch.Tensor | None = None  # [n, d]


class MoELayer:
    """One MoE layer. Subclass per family; the defaults are the common 5.x layout."""

    #: the weights returned by the router are fp32 (mixtral, deepseek) rather than cast back to the logits' dtype
    weights_fp32: ClassVar[bool] = False
    #: human-readable scoring, for ``inspect``
    scoring: ClassVar[str] = "softmax -> top-k"

    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        self.index = index  # decoder layer index
        self.decoder_layer = decoder_layer
        self.block = block
        self.router = router
        self.experts = experts
        self.config = config

    # ----- shape -------------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        return int(self.router.weight.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)

    @property
    def renormalize(self) -> bool:
        """Whether the chosen experts' probabilities are renormalised to sum to one."""
        return bool(getattr(self.router, "norm_topk_prob", False))

    @property
    def weight_scale(self) -> float:
        """Factor the model multiplies its routing weights by (DeepSeek's ``routed_scaling_factor``).

        Policies whose weights sum to one (norm ``softmax``/``uniform``, ``random``) multiply by it,
        so the routed output keeps the model's own scale.
        """
        return 1.0

    @property
    def attention(self) -> nn.Module | None:
        """The same decoder layer's self-attention (for attention-aware routing)."""
        return getattr(self.decoder_layer, "self_attn", None)

    @property
    def shared_experts(self) -> nn.Module | None:
        return None

    # ----- weights -----------------------------------------------------------------------
    def router_weight(self) -> torch.Tensor:
        return self.router.weight  # [n, d]

    def router_bias(self) -> torch.Tensor | None:
        return getattr(self.router, "bias", None)

    def expert_weights(self) -> ExpertWeights:
        gate_up = self.experts.gate_up_proj  # [n, 2I, d]
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=self.experts.down_proj)

    def expert_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the experts compute on, for router inputs ``h``: ``h`` itself, except where the model feeds the
        experts a transformed copy (gemma4: a separate RMS norm)."""
        return h

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        """``act(W_g h)``."""
        return self.experts.act_fn(gate)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(W_g h) ⊙ W_p h``: what the down projection sees."""
        return self.act(gate) * up

    # ----- routing, exactly as the model does it ----------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Router logits for router inputs ``h [T, d]`` -> ``[T, n]``."""
        w = self.router_weight()
        b = self.router_bias()
        return F.linear(h.to(w.dtype), w, b)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The full routing distribution π over all n experts (fp32, rows sum to one)."""
        return torch.softmax(logits.float(), dim=-1)

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores the model ranks experts by (π for softmax families)."""
        return self.probs(logits)

    def _weights_dtype(self, logits: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.weights_fp32 else logits.dtype

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The model's routing weights for a chosen set ``idx [T, K]`` (renormalised as the model does)."""
        w = self.probs(logits).gather(-1, idx)
        if self.renormalize:
            w = ops.normalize(w)
        return w.to(self._weights_dtype(logits))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx [T, K], weights [T, K])`` exactly as the model's router computes them."""
        idx = ops.topk(self.selection_scores(logits), self.top_k)
        return idx, self.weights_for(logits, idx)

    def rule_name(self) -> str:
        """The catalogue rule (moetool/adapters/rules.py) the router reproduces, identified on first use."""
        name = self.__dict__.get("_rule_name")
        if name is None:
            from .generic import identify_layer

            name = self.__dict__["_rule_name"] = identify_layer(self)[0].name
        return name

    def describe(self) -> dict[str, Any]:
        return {
            "layer": self.index,
            "rule": self.rule_name(),
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "scoring": self.scoring,
            "renormalize": self.renormalize,
            "shared_experts": self.shared_experts is not None,
            "router_bias": self.router_bias() is not None,
        }


class Adapter:
    """A model family: which decoder layers are MoE and how to wrap them."""

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    layer_cls: ClassVar[type[MoELayer]] = MoELayer
    block_attr: ClassVar[str] = "mlp"
    router_attr: ClassVar[str] = "gate"

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        base = getattr(model, "model", model)
        return list(base.layers)

    def is_moe_block(self, index: int, block: nn.Module, config: Any) -> bool:
        return hasattr(block, "experts") and hasattr(block, self.router_attr)

    def layers(self, model: nn.Module) -> list[MoELayer]:
        out = []
        for i, dl in enumerate(self.decoder_layers(model)):
            block = getattr(dl, self.block_attr, None)
            if block is not None and self.is_moe_block(i, block, model.config):
                out.append(self.layer_cls(i, dl, block, getattr(block, self.router_attr), block.experts, model.config))
        return out

    @staticmethod
    def tiny_config() -> Any:
        """A tiny random-weight config of this family (tests; no download)."""
        raise NotImplementedError
