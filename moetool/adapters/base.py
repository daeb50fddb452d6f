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

This module is the contract only. The one implementation of the routing is
:class:`moetool.adapters.generic.GenericLayer` (the rule identified on the router itself,
:mod:`moetool.adapters.rules`); hand adapters subclass it where a family's structure differs.
The expert-weight views here are the common transformers 5.x layout (fused
``experts.gate_up_proj [E, 2I, H]`` with gate first, ``experts.down_proj [E, H, I]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import MoetoolRuntimeError


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
    """One MoE layer: where to hook, its weights and its routing (the contract every adapter fulfils)."""

    #: human-readable scoring, for ``inspect``
    scoring: str = ""

    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        self.index = index  # decoder layer index
        self.decoder_layer = decoder_layer
        self.block = block
        self.router = router
        self.experts = experts
        self.config = config
        self.check_finite_router()

    def check_finite_router(self) -> None:
        """NaN/inf in the router's parameters or buffers (a corrupt or overflowed checkpoint): one line naming the
        layer and the tensor (exit 1), before any routing rule is identified on them. Tensors not in memory (meta,
        accelerate-offloaded) are not read here."""
        for name, t in [*self.router.named_parameters(), *self.router.named_buffers()]:
            if not t.is_floating_point() or t.is_meta or t.numel() == 0:
                continue
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                own = [*self.decoder_layer.named_parameters(), *self.decoder_layer.named_buffers()]
                name = next((n for n, p in own if p is t), name)  # its path in the decoder layer (views too)
                nan = int(torch.isnan(t.detach()).sum())
                raise MoetoolRuntimeError(
                    f"non-finite router weight in MoE layer {self.index}: {name} has {nan} NaN and "
                    f"{int(bad.sum()) - nan} inf of its {t.numel()} values (a corrupt checkpoint?)")

    # ----- shape -------------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        raise NotImplementedError

    @property
    def max_k(self) -> int:
        """The most experts this layer's routing can give one token (``n_experts``; fewer under group limits): a
        ``topk:<k>`` / ``topk --ks`` above it is refused (:func:`moetool.engine.hooks.refuse_above_max_k`)."""
        return self.n_experts

    @property
    def n_zero_compute(self) -> int:
        """Zero-computation experts among the ``n_experts`` the router ranks: the last ``n_zero_compute`` indices
        (LongCat-Flash's ``zero_expert_num`` identity experts, Zaya's skip class). They have no weights:
        :meth:`expert_weights` stacks the ``n_experts - n_zero_compute`` computed experts only; what they output is
        :attr:`zero_compute_output`."""
        return 0

    @property
    def n_computed(self) -> int:
        """The experts that compute something (the first ``n_experts - n_zero_compute``): what has weights, what a
        probe can measure, what is placed, measured or removed where zero-computation experts are left out."""
        return self.n_experts - self.n_zero_compute

    #: what a zero-computation expert outputs: ``"input"`` (identity, LongCat: ``E_e(h) = h``, its "activations"
    #: are ``h`` itself, every node's norm ``||h||``) or ``"zero"`` (a skip, Zaya: ``E_e(h) = 0``, every norm 0)
    zero_compute_output: str = "input"

    def router_inputs(self, args: tuple) -> dict[str, torch.Tensor]:
        """Inputs of the routing rule beyond the router's ``h``, read off the router module's call ``args`` (the
        engine puts them in ``RoutingEvent.inputs`` and :meth:`logits` takes them as keywords): none by default;
        Zaya's carried router state."""
        return {}

    #: what else the router logits depend on where :attr:`carried_state` (named in refusals)
    routing_context: str = "the previous layer's router state (carried state)"

    @property
    def carried_state(self) -> bool:
        """The router logits depend on state carried from the previous layer (Zaya's EDA), not on ``h`` alone:
        :meth:`logits` needs that state (``RoutingEvent.inputs``); experiments that recompute routing from other
        inputs refuse the layer in one line."""
        return False

    @property
    def residual_streams(self) -> int:
        """Residual streams a token carries between decoder layers: 1, or ``hc_mult`` where the config has
        hyper-connections (DeepSeek-V4, GLM-5-Next, HY-V4: the MoE block reads a learned mix of them, so no one
        hidden state entering the decoder layer is what its router reads; offload cannot predict its routing)."""
        hc = getattr(self.config, "hc_mult", None)
        return hc if isinstance(hc, int) and hc > 1 else 1

    @property
    def renormalize(self) -> bool:
        """Whether the chosen experts' probabilities are renormalised to sum to one."""
        raise NotImplementedError

    @property
    def weight_scale(self) -> float:
        """Factor the model multiplies its routing weights by (DeepSeek's ``routed_scaling_factor``).

        Policies whose weights sum to one (norm ``softmax``/``uniform``, ``random``) multiply by it,
        so the routed output keeps the model's own scale.
        """
        raise NotImplementedError

    @property
    def output_scale(self) -> float:
        """What the block multiplies the experts' output by, after the experts (Beam, MiniMax-M3: the
        ``routed_scaling_factor`` sits on the block, not in the routing weights); 1 where the weights carry it."""
        return 1.0

    def post_step(self) -> nn.Module | None:
        """A step the block applies to routed + shared output before returning it (A.X-K1: ``post_mlp_layernorm``);
        ``None``: the block returns the sum itself."""
        return None

    def block_output(self, routed: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The block's output from the experts' output ``routed [T, d]`` for router inputs ``h [T, d]``:
        ``post_step(routed x output_scale + shared_experts(h))`` (each part where the layer has it)."""
        out = routed * self.output_scale if self.output_scale != 1.0 else routed
        shared = self.shared_experts
        if shared is not None:
            out = out + shared(h)
        post = self.post_step()
        return out if post is None else post(out)

    @property
    def attention(self) -> nn.Module | None:
        """The same decoder layer's self-attention (for attention-aware routing)."""
        return getattr(self.decoder_layer, "self_attn", None)

    @property
    def shared_experts(self) -> nn.Module | None:
        raise NotImplementedError

    # ----- weights -----------------------------------------------------------------------
    def router_weight(self) -> torch.Tensor:
        """``R [n, d]``."""
        raise NotImplementedError

    def router_bias(self) -> torch.Tensor | None:
        raise NotImplementedError

    def expert_weights(self) -> ExpertWeights:
        """The computed experts' weights (identity experts have none: see :attr:`n_zero_compute`)."""
        m = self.n_computed
        gate_up = self.experts.gate_up_proj[:m]  # [m, 2I, d] (LongCat stores rows for its identity experts too)
        inter = gate_up.shape[1] // 2
        return ExpertWeights(gate=gate_up[:, :inter], up=gate_up[:, inter:], down=self.experts.down_proj[:m])

    def expert_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the experts compute on, for router inputs ``h``: ``h`` itself, except where the model feeds the
        experts a transformed copy (gemma4: a separate RMS norm)."""
        return h

    def experts_args(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, w)`` as handed to the model's experts module for a policy's choice (the same, except where the
        module cannot take that shape: LongCat's cannot take one expert per token)."""
        return idx, w

    def expert_output(self, y: torch.Tensor) -> torch.Tensor:
        """What the block makes of one expert's output ``y = W_o glu [..., d_e]`` before weighting it: ``y`` itself,
        except where the experts work in a projected width (muse_spark: a per-expert norm, then the projection
        back to the model width; linear in the weights, so ``block = Σ w expert_output(y)``)."""
        return y

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        """``act(W_g h)``."""
        return self.experts.act_fn(gate)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(W_g h) ⊙ W_p h``: what the down projection sees."""
        return self.act(gate) * up

    # ----- routing, exactly as the model does it ----------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Router logits for router inputs ``h [T, d]`` -> ``[T, n]`` (``[T, n + s]`` where the rule needs the
        shared experts' logits too: :meth:`captured_logits`)."""
        raise NotImplementedError

    def captured_logits(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The logits the routing methods take, from the router's input ``h`` and first output ``out`` (the engine
        calls this in its router hook): ``out`` itself, except where the rule needs more of the router's
        projection than it returns (Inkling: the shared experts' logits appended, ``[T, n + s]``)."""
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The full routing distribution π over all n experts (fp32, rows sum to one)."""
        raise NotImplementedError

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores the model ranks experts by (π for softmax families)."""
        raise NotImplementedError

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's routing weights for a chosen set ``idx [T, K]`` (renormalised as the model does); ``mask``
        [T, K] bool: per token only the columns where it is True are chosen (the others get weight 0)."""
        raise NotImplementedError

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx [T, K], weights [T, K])`` exactly as the model's router computes them."""
        raise NotImplementedError

    def route_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's routing with ``k`` experts per token instead of K (``route_k(logits, K) == route(logits)``)."""
        raise NotImplementedError

    def route_masked(self, logits: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's routing among the experts where ``keep [n]`` (bool) is True, as the checkpoint with the
        removed experts' router rows deleted routes (their logits -inf: selection scores -inf before the top-K, a
        softmax over the kept experts only; the chosen get the weights the rule gives them, renormalised where it
        renormalises); ``route_masked(logits, all True) == route(logits)``."""
        raise NotImplementedError

    def masked_logits(self, logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``logits`` as the checkpoint with the experts where ``keep [n]`` is False deleted computes them: those
        experts' logits -inf (the shared experts' logits after the routed ones, ``captured_logits``, kept). What
        :meth:`route_masked` routes by; :meth:`probs` / :meth:`weights_for` of it are the pruned router's."""
        keep = keep.to(logits.device)
        extra = logits.shape[-1] - keep.shape[0]
        full = torch.cat([keep, keep.new_ones(extra)]) if extra else keep
        return logits.masked_fill(~full, float("-inf"))

    def keep_problem(self, keep: torch.Tensor) -> str | None:
        """Why the routing cannot choose K experts among ``keep [n]`` (``None``: it can)."""
        kept = int(keep.sum())
        if kept < self.top_k:
            return f"keeps {kept} of {self.n_experts} experts, fewer than its top-{self.top_k}"
        return None

    def rule_name(self) -> str:
        """The catalogue rule (moetool/adapters/rules.py) the router reproduces."""
        raise NotImplementedError

    def inactive_expert_params(self, expert_params: int) -> int:
        """Of this layer's ``expert_params`` (its routed experts' parameters), those a token does not use on
        average: the ``n - K`` experts of ``n`` it is not routed to (total minus this is the active count
        ``inspect`` and ``plan`` report)."""
        return expert_params * (self.n_experts - self.top_k) // self.n_experts

    def describe(self) -> dict[str, Any]:
        return {
            "layer": self.index,
            "rule": self.rule_name(),
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "scoring": self.scoring,
            "renormalize": self.renormalize,
            "shared_experts": self.shared_experts is not None,
            **({"identity_experts": self.n_zero_compute} if self.n_zero_compute else {}),
            "router_bias": self.router_bias() is not None,
            **({"output_scale": self.output_scale} if self.output_scale != 1.0 else {}),
            **({"post_step": type(self.post_step()).__name__} if self.post_step() is not None else {}),
        }


class Adapter:
    """A model family: which decoder layers are MoE and how to wrap them."""

    family: ClassVar[str] = ""
    layer_cls: ClassVar[type[MoELayer]] = MoELayer

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def layers(self, model: nn.Module) -> list[MoELayer]:
        """Every MoE layer of ``model``, wrapped in :attr:`layer_cls`."""
        raise NotImplementedError

    @staticmethod
    def tiny_config() -> Any:
        """A tiny random-weight config of this family (tests; no download)."""
        raise NotImplementedError
