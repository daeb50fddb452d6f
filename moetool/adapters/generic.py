"""The generic adapter: MoE layers found by structure, routing rule identified by running the router.

Most transformers 5.x families share one shape: a decoder layer (of the text decoder's ``layers`` list, also
under ``model.model.language_model`` in multimodal checkpoints) holds a block -- a child such as ``mlp`` /
``feed_forward`` / ``block_sparse_moe``, or the decoder layer itself -- with an ``experts`` module called as
``experts(h, idx, w)`` and a ``gate`` / ``router`` module returning ``(logits, weights, idx)``; shared experts
beside them as ``shared_experts`` / ``shared_expert`` (+ sigmoid ``shared_expert_gate``) / ``shared_mlp``.
Decoder layers without such a block are dense.

At load each layer's own router is run on seeded random inputs (its device, the model's dtype) and
:func:`moetool.adapters.rules.identify` picks the catalogue rule (and variant: correction bias, groups, scale,
renormalisation) that reproduces its indices exactly and its weights at the dtype's tolerance. The logits are
checked too: ``logits(h)`` must equal the router's own bit for bit. Anything else is a one-line
:class:`MoetoolError` naming the model type and what did not match: never a guess.

The registry (``moetool/adapters/__init__.py``) falls back to :class:`GenericAdapter` for every model type whose
config looks MoE and that ``discovery.UNSUPPORTED`` does not list, so a future family with a known rule works
with no new code.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import text_config
from ..errors import MoetoolError
from . import quant, rules
from .base import Adapter, MoELayer

_ROUTER_ATTRS = ("gate", "router")
_SKIP = ("vision", "visual", "audio", "talker", "mtp", "image", "speech")
_BIAS_ATTRS = ("e_score_correction_bias", "expert_bias", "balancing_biases")
#: router parameters that multiply the weights (1 at init: Inkling's ``global_scale``): a meta-device router's copy
#: keeps them at 1, the only value a config gives (tiny models re-draw them around 1, so the weights keep their sign)
ONE_CENTRED = ("global_scale",)
_SCALE_ATTRS = ("routed_scaling_factor", "router_scaling_factor", "moe_routed_scaling_factor", "route_scale")
_GROUP_ATTRS = ("num_group", "n_group", "num_expert_group")
_LOGIT_MULT_ATTRS = ("output_multiplier",)  # a factor on the projection's output (muse_spark)
_N_TOKENS = 256
#: a norm the block applies to routed + shared output before returning it (A.X-K1)
_POST_STEP_ATTRS = ("post_mlp_layernorm",)
#: the decoder layer's norm of the stream before its feed-forward sublayer, under the names families give it
_PRE_FFN_NORMS = ("pre_feedforward_layernorm", "pre_mlp_layernorm", "pre_ff_layernorm", "ffn_norm")
#: a router reading the residual stream itself (:attr:`GenericLayer.pre_router_norm`)
IDENTITY = nn.Identity()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's layer list: the first ``layers`` ModuleList outside vision/audio towers."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and \
                not any(s in name for s in _SKIP):
            return list(mod)
    return []


def moe_parts(decoder_layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """``(block, router, experts)`` of a decoder layer, or None for a dense one."""
    for block in (*decoder_layer.children(), decoder_layer):
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module):
            router = next((getattr(block, a) for a in _ROUTER_ATTRS if isinstance(getattr(block, a, None), nn.Module)),
                          None)
            if router is not None:
                return block, router, experts
    return None


class FirstOutput(nn.Module):
    """The first output of a module returning a tuple (Qwen4-Exp's hyper-connection mixer: the mixed stream its MoE
    block reads, then what the block's output is injected with); shares the model's module."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)[0]


class GatedResidualNorm(nn.Module):
    """``norm(gate(x, 0))``: the stream a residual gate leaves when the sublayer before it adds nothing, through the
    norm the MoE block reads (Muse Spark: ``pre_feedforward_layernorm(post_attention_residual_gate(x, 0))``, the gate
    ``alpha * x + beta * attention`` per channel); shares the model's modules."""

    def __init__(self, gate: nn.Module, norm: nn.Module):
        super().__init__()
        self.gate, self.norm = gate, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.gate(x, torch.zeros_like(x)))


class ScaledNormedResidual(nn.Module):
    """``post(alpha * pre(x))``: MiniMax's residual after an attention that adds nothing (its decoder layer norms the
    input, keeps ``attn_alpha_factor`` of it as the residual and norms the sum with ``post_attention_layernorm``
    before the MoE block); shares the model's modules."""

    def __init__(self, pre: nn.Module, alpha: float, post: nn.Module):
        super().__init__()
        self.pre, self.alpha, self.post = pre, alpha, post

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.pre(x) * self.alpha)


class GatedSharedExpert(nn.Module):
    """``sigmoid(gate(h)) * expert(h)``: Qwen's gated shared expert as one callable (shares the model's modules)."""

    def __init__(self, expert: nn.Module, gate: nn.Module):
        super().__init__()
        self.expert, self.gate = expert, gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(h)) * self.expert(h)


def shared_experts(block: nn.Module) -> nn.Module | None:
    """The block's shared experts as one callable (Qwen's sigmoid-gated one wrapped), or None."""
    if isinstance(getattr(block, "shared_expert_gate", None), nn.Module):
        return GatedSharedExpert(block.shared_expert, block.shared_expert_gate)
    for attr in ("shared_experts", "shared_expert", "shared_mlp"):
        if isinstance(getattr(block, attr, None), nn.Module):
            return getattr(block, attr)
    return None


def router_linear(router: nn.Module) -> nn.Module:
    """The router's projection: the router itself, or its one ``nn.Linear`` child (``gate``, ``wg``, ...)."""
    if isinstance(getattr(router, "weight", None), torch.Tensor):
        return router
    linears = [m for m in router.children() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        raise MoetoolError(f"cannot tell the router projection of {type(router).__name__}")
    return linears[0]


def _attr(owners: tuple, names: tuple[str, ...]) -> Any:
    for owner in owners:
        for a in names:
            v = getattr(owner, a, None)
            if v is not None and not isinstance(v, bool):
                return v
    return None


def correction_bias(router: nn.Module, block: nn.Module) -> torch.Tensor | None:
    """The selection-only bias (``e_score_correction_bias`` / ``expert_bias``) of the router or its block."""
    for name, t in [*router.named_buffers(), *router.named_parameters()]:
        if name.split(".")[-1] in _BIAS_ATTRS:
            return t
    v = _attr((block,), _BIAS_ATTRS)
    return v if isinstance(v, torch.Tensor) else None


def hash_table(router: nn.Module) -> torch.Tensor | None:
    """The token-id -> experts table ``[vocab, K]`` of a hash router (one whose forward takes ``input_ids``:
    DeepSeek-V4's ``DeepseekV4HashRouter.tid2eid``), or None for a router that chooses by its scores."""
    if "input_ids" not in inspect.signature(router.forward).parameters:
        return None
    tables = [t for _, t in router.named_buffers() if not t.is_floating_point() and t.dim() == 2]
    if len(tables) != 1:
        raise MoetoolError(f"cannot tell the token-id table of the hash router {type(router).__name__}")
    return tables[0]


def _is_meta(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.device.type == "meta" for t in tensors)


class GenericLayer(MoELayer):
    """An MoE layer whose routing is a catalogue rule, identified on the router itself (module docstring)."""

    def __init__(self, index: int, decoder_layer: nn.Module, block: nn.Module, router: nn.Module,
                 experts: nn.Module, config: Any):
        super().__init__(index, decoder_layer, block, router, experts, config)
        self.linear = router_linear(router)
        self._hash_routed = hash_table(router) is not None  # read once: route() runs per batch
        self.logit_mult = logit_multiplier(router)
        self.rule, self.params, self.logits_mode, self.softcap = self._identify()
        self.scoring = self.rule.scoring(self.params)

    # ----- shape and parts ---------------------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        return int(self.linear.weight.shape[0])

    @property
    def top_k(self) -> int:
        return self.params.top_k

    @property
    def renormalize(self) -> bool:
        return self.rule.renorm

    @property
    def weight_scale(self) -> float:
        return self.params.scale

    @property
    def shared_experts(self) -> nn.Module | None:
        return shared_experts(self.block)

    @property
    def n_zero_compute(self) -> int:
        """Zero-computation experts: the experts module's ``zero_expert_num`` (LongCat-Flash), else 0."""
        return int(getattr(self.experts, "zero_expert_num", 0) or 0)

    @property
    def pre_router_norm(self) -> nn.Module:
        """What the MoE block's router reads of the residual stream entering the layer's MoE sublayer (the stream
        after the attention sublayer; offload predicts the next layer's routing through it), read off the decoder
        layer in this order:

        * several residual streams per token (``hc_mult`` hyper-connections: DeepSeek-V4, GLM-5-Next, HY-V4): the
          block reads a learned mix of them, not one stream -- a one-line :class:`MoetoolError`;
        * a hyper-connection mixer before the block (``mlp_hyper_connection``, Qwen4-Exp: the stream is its
          ``hc_count`` streams side by side): its mixed output;
        * a residual transformed on its way to the block (Muse Spark's per-channel residual gate,
          :class:`GatedResidualNorm`; MiniMax's normed and scaled residual, :class:`ScaledNormedResidual`): the
          stream that transform leaves when attention adds nothing, through the block's norm;
        * a norm named as the feed-forward's input (:data:`_PRE_FFN_NORMS`: sandwich norms, Muse Spark, Beam,
          Gemma 4's dense MLP; AFMoE, Jamba, LFM2-MoE): it -- ``post_attention_layernorm`` there norms the
          attention's output;
        * ``post_feedforward_layernorm`` without one (Olmo2-style post-norms, FlexOlmo): every norm is on a
          sublayer's output, the router reads the stream itself (the identity);
        * ``post_attention_layernorm`` (LongCat's two sublayers have one each: its shortcut MoE reads the first's);
        * the decoder layer's only norm (a parallel attention + MoE block reading the norm attention reads,
          Cohere2-MoE; one mixer per decoder layer, Nemotron-H).

        Otherwise a one-line :class:`MoetoolError`: never a guess."""
        d = self.decoder_layer
        hc = self.residual_streams
        if hc > 1:
            raise MoetoolError(f"layer {self.index} carries hc_mult={hc} residual streams per token (hyper-"
                               f"connections) and its MoE block reads a learned mix of them: its router input is no "
                               f"norm of one residual stream")
        if isinstance(getattr(d, "mlp_hyper_connection", None), nn.Module):
            return FirstOutput(d.mlp_hyper_connection)
        if isinstance(getattr(d, "post_attention_residual_gate", None), nn.Module):  # Muse Spark
            return GatedResidualNorm(d.post_attention_residual_gate, d.pre_feedforward_layernorm)
        if getattr(d, "attn_alpha_factor", None) is not None:  # MiniMax: a normed, scaled residual
            return ScaledNormedResidual(d.input_layernorm, float(d.attn_alpha_factor), d.post_attention_layernorm)
        norm = next((getattr(d, a) for a in _PRE_FFN_NORMS if isinstance(getattr(d, a, None), nn.Module)), None)
        if norm is None and isinstance(getattr(d, "post_feedforward_layernorm", None), nn.Module):
            return IDENTITY
        if norm is None:
            norm = getattr(d, "post_attention_layernorm", None)
        if norm is None:
            norms = [m for name, m in d.named_children() if "norm" in name.lower()]
            norm = norms[0] if len(norms) == 1 else None
        if norm is None:
            raise MoetoolError(f"layer {self.index}: cannot tell which norm of {type(d).__name__} its MoE block "
                               f"reads")
        return norm[0] if isinstance(norm, nn.ModuleList) else norm

    def experts_args(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """LongCat's experts module squeezes the K axis of its one-hot mask, so K = 1 fails there: the one expert is
        given twice, the second time with weight 0 (the same sum)."""
        if hasattr(self.experts, "identity_expert") and idx.shape[-1] == 1:
            return idx.expand(-1, 2), torch.cat((w, torch.zeros_like(w)), dim=-1)
        return idx, w

    @property
    def hash_routed(self) -> bool:
        """Experts chosen by token id (a fixed table), not by the router's scores: the weights are the rule's
        for that set (:meth:`weights_for`), but no re-routing from logits (:meth:`route`, ``route_k``,
        ``route_masked``) is defined; policies and experiments that need one refuse the layer in one line."""
        return self._hash_routed

    def _hash_refused(self, what: str) -> MoetoolError:
        return MoetoolError(f"layer {self.index} is hash-routed (experts chosen by token id through "
                            f"{type(self.router).__name__}'s table, not by its logits): {what} is not defined there")

    @property
    def output_scale(self) -> float:
        """The block's ``routed_scaling_factor`` where the router does not apply one itself (Beam, Laguna,
        Step-3.7: ``experts(h, idx, w) x factor``); 1 otherwise (the factor is in the weights, ``weight_scale``)."""
        factor = _attr((self.block,), _SCALE_ATTRS)
        if factor is None or _attr((self.router,), _SCALE_ATTRS) is not None:
            return 1.0
        return float(factor)

    def post_step(self) -> nn.Module | None:
        return next((getattr(self.block, a) for a in _POST_STEP_ATTRS
                     if isinstance(getattr(self.block, a, None), nn.Module)), None)

    def router_weight(self) -> torch.Tensor:
        return self.linear.weight

    def router_bias(self) -> torch.Tensor | None:
        return getattr(self.linear, "bias", None)

    # ----- routing: the identified rule --------------------------------------------------------------------
    def _p(self) -> rules.Params:
        """The identified parameters with the live correction bias (a buffer may move with the model)."""
        if self.params.bias is None:
            return self.params
        return replace(self.params, bias=correction_bias(self.router, self.block))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear_logits(h, self.router_weight(), self.router_bias(), self.logits_mode, self.softcap,
                             self.logit_mult)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.rule.probs(logits, self.params)

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores the model ranks experts by; on a hash-routed layer the scores its chosen experts are weighted
        by (it ranks none: the best of a chosen set by them is its heaviest expert)."""
        return self.rule.scores(logits, self._p())

    def weights_for(self, logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.rule.weights(logits, idx, self.params, mask)

    def route(self, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's routing; a hash-routed layer's needs the tokens' ids (``token_ids [T]``: its table's rows,
        weighted by the rule) and refuses without them."""
        if self.hash_routed:
            if token_ids is None:
                raise self._hash_refused("routing from the router logits alone")
            idx = hash_table(self.router)[token_ids.to(logits.device)].long()
            return idx, self.weights_for(logits, idx)
        idx = self.rule.select(logits, self._p())
        return idx, self.weights_for(logits, idx)

    def route_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hash_routed:
            raise self._hash_refused(f"a top-{k} of the router's scores")
        if self.rule.weight == "sparsemixer" and k != self.top_k:
            raise MoetoolError(f"layer {self.index}: sparsemixer routing has exactly {self.top_k} rounds; "
                               f"no top-{k} of it is defined")
        idx = self.rule.select(logits, replace(self._p(), top_k=k))
        return idx, self.weights_for(logits, idx)

    def route_masked(self, logits: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hash_routed:
            raise self._hash_refused("routing among a subset of the experts")
        keep = keep.to(logits.device)
        # the removed experts leave the router as a pruned checkpoint's rows leave it (REAP's prune.py deletes
        # them): a softmax (or sparsemixer's rounds) is over the kept experts' logits, a sigmoid is per expert
        logits = self.masked_logits(logits, keep)
        idx = self.rule.select(logits, self._p(), keep)
        return idx, self.weights_for(logits, idx)

    def keep_problem(self, keep: torch.Tensor) -> str | None:
        problem = super().keep_problem(keep)
        p = self.params
        if problem is None and p.n_group > 1:  # the topk_group groups chosen must hold K kept experts whichever
            counts = keep.reshape(p.n_group, -1).sum(-1).sort().values  # groups win: the fewest-kept ones count
            if int(counts[:p.topk_group].sum()) < self.top_k:
                problem = (f"keeps fewer than {self.top_k} experts within some {p.topk_group} of its {p.n_group} "
                           f"groups (group-limited routing)")
        return problem

    @property
    def max_k(self) -> int:
        p = self.params  # group-limited: only the experts of the topk_group groups chosen can be routed to
        return p.topk_group * (self.n_experts // p.n_group) if p.n_group > 1 else self.n_experts

    def rule_name(self) -> str:
        """The catalogue rule; ``hash:<rule>`` on a hash-routed layer (experts by token id, weighted by the rule)."""
        return ("hash:" if self.hash_routed else "") + self.rule.name

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rule": self.rule_name(), **self.params.describe()}

    def _identify(self):
        return identify_layer(self)


LOGITS_MODES = ("native", "native->fp32", "fp32", "mm->fp32")


def logit_multiplier(router: nn.Module) -> float:
    """The factor a router multiplies its projection's output by (``output_multiplier``; 1 if none)."""
    v = _attr((router,), _LOGIT_MULT_ATTRS)
    return 1.0 if v is None else float(v)


def mm_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h @ w.T`` as fp32 from a GEMM in the operands' dtype with fp32 output, the way some routers compute on CUDA
    (Kolibri1: ``torch.mm(h, w.t(), out_dtype=torch.float32)`` when ``h.is_cuda`` and the dtypes match, torch >= 2.8;
    its CPU path is ``F.linear`` in fp32). Where that kernel does not exist (the CPU, older torch, mixed dtypes) the
    same products are summed in fp32 by ``F.linear`` on fp32 copies: the identical value up to summation order."""
    if h.is_cuda and h.dtype == w.dtype:
        try:
            return torch.mm(h.reshape(-1, h.shape[-1]), w.t(), out_dtype=torch.float32).reshape(*h.shape[:-1], -1)
        except TypeError:  # torch < 2.8: no out_dtype
            pass
    return F.linear(h.float(), w.float())


def nearest_logits_mode(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float, mult: float,
                        logits: torch.Tensor) -> str | None:
    """The logits mode closest to the router's ``logits`` when none reproduces them bit for bit, if it is within the
    rounding of a sum of ``d`` products (else ``None``: not a linear map of the input).

    Why a tolerance: a GEMM kernel's summation order depends on the device, the shapes and the library (cuBLAS splits
    a long ``d`` across threads; CPU kernels block it differently), so the same ``h @ W.T`` computed by the router and
    by :func:`linear_logits` may differ in the last bits on a GPU while agreeing on the CPU. The bound: each of two
    fp32-accumulated sums of ``d`` terms is within ``d·u·(|h|·|W|ᵀ + |b|)`` of the exact value (u = 2⁻²⁴; the
    standard forward-error bound of recursive summation, Higham 2002, §3.1), plus one rounding of each output to its
    dtype (``u_out·|logit|``); times ``|mult|`` (softcapping's tanh is 1-Lipschitz). A different function (a
    non-linear router, another weight, a missing bias) is off by the logits' own scale, orders of magnitude above."""
    hd, wd = h.detach().double(), w.detach().double()
    mag = hd.abs() @ wd.abs().T + (0.0 if b is None else b.detach().double().abs())
    d = h.shape[-1]
    tol = abs(mult) * 2 * d * torch.finfo(torch.float32).eps * mag + \
        2 * torch.finfo(logits.dtype).eps * logits.detach().double().abs()
    best, best_err = None, None
    for m in LOGITS_MODES:
        got = linear_logits(h, w, b, m, softcap, mult)
        if got.dtype != logits.dtype or got.shape != logits.shape:
            continue
        err = (got.double() - logits.double()).abs()
        if bool((err <= tol).all()) and (best_err is None or float(err.max()) < best_err):
            best, best_err = m, float(err.max())
    return best


def linear_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mode: str, softcap: float = 0.0,
                  mult: float = 1.0):
    """Router logits as the router computes them: ``native`` (in the weight's dtype), ``native->fp32`` (then
    cast to fp32), ``fp32`` (input and weight cast first) or ``mm->fp32`` (fp32 logits from one GEMM in the input's
    dtype, :func:`mm_fp32`); times ``mult`` if not 1; ``tanh`` soft-capped if ``softcap``."""
    if mode == "fp32":
        out = F.linear(h.float(), w.float(), None if b is None else b.float())
    elif mode == "mm->fp32":
        out = mm_fp32(h, w)
        if b is not None:
            out = out + b.float()
    else:
        out = F.linear(h.to(w.dtype), w, b)
        if mode == "native->fp32":
            out = out.float()
    if mult != 1.0:
        out = out * mult
    return torch.tanh(out / softcap) * softcap if softcap else out


def identify_layer(L: MoELayer) -> tuple[rules.Rule, rules.Params, str, float]:
    """``(rule, params, logits mode, softcap)`` reproducing ``L.router`` on seeded random inputs (its device, the
    experts' dtype). Any MoE layer whose router returns ``(logits, weights, idx)`` from one linear projection:
    the generic layer routes by it, hand-written layers report it (``describe()['rule']``)."""
    mt = getattr(L.config, "model_type", "?")

    def fail(what: str) -> MoetoolError:
        return MoetoolError(f"{mt}: {what} (layer {L.index}, {type(L.router).__name__})")

    with _loaded(L.router, L.block):  # accelerate-offloaded weights brought in for the check, then put back
        return _identify_loaded(L, fail)


#: identifications of meta-device routers (random weights stand in for the missing ones, so every layer of one
#: router class, shape and config identifies alike): a 61-layer DeepSeek-V3 is checked once, not 58 times
_META_IDENTIFIED: dict[tuple, tuple[rules.Rule, rules.Params, str, float]] = {}


def _identify_loaded(L: MoELayer, fail: Callable[[str], MoetoolError]) -> tuple[rules.Rule, rules.Params, str, float]:
    router, block = L.router, L.block
    bias = correction_bias(router, block)
    if _is_meta(*router.parameters(), *router.buffers(), bias):  # a model built on the meta device
        w = router_linear(router).weight
        config = getattr(L.config, "to_json_string", None)
        key = (type(router), tuple(w.shape), w.dtype, bias is None, config() if callable(config) else id(L.config))
        if key not in _META_IDENTIFIED:
            if len(_META_IDENTIFIED) > 64:
                _META_IDENTIFIED.clear()
            _META_IDENTIFIED[key] = _identify_meta(L, fail)
        rule, params, mode, cap = _META_IDENTIFIED[key]
        if params.bias is not None:
            params = replace(params, bias=correction_bias(L.router, L.block))
        return rule, params, mode, cap
    return _identify_real(L, router, bias, fail)


def _identify_meta(L: MoELayer, fail: Callable[[str], MoetoolError]) -> tuple[rules.Rule, rules.Params, str, float]:
    router = _materialized(L.router)
    return _identify_real(L, router, _stand_in_bias(correction_bias(router, L.block)), fail)


def _stand_in_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A correction bias on the meta device (the block's, not the router's: :func:`_materialized` does not copy it)
    as seeded random values on the CPU; any other as it is."""
    if _is_meta(bias):
        return torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)) * 0.05
    return bias


def _identify_real(L: MoELayer, router: nn.Module, bias: torch.Tensor | None,
                   fail: Callable[[str], MoetoolError]) -> tuple[rules.Rule, rules.Params, str, float]:
    lin = router_linear(router)
    w, b = lin.weight, getattr(lin, "bias", None)
    dtype = next((p.dtype for p in L.experts.parameters() if p.is_floating_point()), w.dtype)
    if _is_meta(w) or _is_meta(next(L.experts.parameters(), None)) or quant.expert_format(L).kind != "plain":
        dtype = w.dtype  # quantized experts (codes, fp32 scales or biases): the hidden states are the router's dtype
    h = torch.randn(_N_TOKENS, w.shape[1], generator=torch.Generator().manual_seed(0), device="cpu").to(
        device=w.device, dtype=dtype)
    table = hash_table(router)
    with torch.no_grad():
        if table is not None:  # a hash router: its experts are its table's for the token ids; the weights a rule's
            return _identify_hash(L, router, h, table, bias, fail)
        out = _call_router(router, h, bias)
        if not (isinstance(out, tuple) and len(out) >= 3 and isinstance(out[2], torch.Tensor)
                and not out[2].is_floating_point()):
            raise fail("the router does not return (logits, weights, top-K indices)")
        logits, want_w, want_idx = (t.reshape(-1, t.shape[-1]) for t in out[:3])
        cap = float(getattr(router, "router_logit_softcapping", 0.0) or 0.0)
        mult = logit_multiplier(router)
        mode = next((m for m in LOGITS_MODES if torch.equal(got := linear_logits(h, w, b, m, cap, mult), logits)
                     and got.dtype == logits.dtype), None) or nearest_logits_mode(h, w, b, cap, mult, logits)
        if mode is None:
            raise fail("the router's logits are not a linear map of its input (logits(h) differs from the "
                       "router's first output)")
        cands = _candidates(router, int(want_idx.shape[-1]), None if bias is None else bias.detach())
        if want_w.dtype != torch.float32 and want_w.is_floating_point():  # ranked in the output's own precision
            cands += [replace(c, rank_dtype=want_w.dtype) for c in cands if c.jitter_eps is None]
        try:
            rule, params = rules.identify(logits, want_idx, want_w, cands)
        except rules.NoRuleMatches as e:
            if h.dtype == torch.float32:
                raise fail(f"router output matches no known routing rule ({e})") from None
            rule, params = _identify_fp32(router, h, bias, cands, fail, e)
            params = replace(params, weights_dtype=want_w.dtype)  # the model's weights stay in its dtype
    if params.bias is not None:  # the live buffer, not the copy identification ran with
        params = replace(params, bias=correction_bias(L.router, L.block))
    return rule, params, mode, cap


def _identify_fp32(router: nn.Module, h: torch.Tensor, bias: torch.Tensor | None, cands: list[rules.Params],
                   fail: Callable[[str], MoetoolError], low: Exception) -> tuple[rules.Rule, rules.Params]:
    """The rule of a router that ranks in bf16/fp16 with its own order of near-ties (DBRX's block, DeepSeek-V4's
    sqrtsoftplus): identified on the same router with its parameters in fp32 for the call (bf16/fp16 -> fp32 -> back
    is exact, so the model is unchanged after). The logits mode was found in the model's own dtype before. At run
    time the rule re-ranks the model's logits in fp32: the events keep the model's own choice; a policy that
    re-routes may order a near-tie (equal in bf16) differently."""
    tensors = [t for t in (*router.parameters(), *router.buffers(), bias) if t is not None and t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    try:
        for t in tensors:
            t.data = t.data.float()
        out = _call_router(router, h.float(), None if bias is None else bias)
        logits, want_w, want_idx = (t.reshape(-1, t.shape[-1]) for t in out[:3])
        fp32 = [replace(c, bias=None if c.bias is None else c.bias.float(), rank_dtype=None) for c in cands
                if c.rank_dtype is None]
        return rules.identify(logits, want_idx, want_w, fp32)
    except rules.NoRuleMatches:
        raise fail(f"router output matches no known routing rule ({low}; also in fp32)") from None
    finally:
        for t, d in zip(tensors, dtypes):
            t.data = t.data.to(d)


def _identify_hash(L: MoELayer, router: nn.Module, h: torch.Tensor, table: torch.Tensor, bias: torch.Tensor | None,
                   fail: Callable[[str], MoetoolError]) -> tuple[rules.Rule, rules.Params, str, float]:
    """A hash router on seeded random token ids: its indices must be its table's rows for them exactly; its weights
    must be a catalogue rule's weights for that set (the rule's own selection is not used)."""
    lin = router_linear(router)
    ids = torch.randint(0, table.shape[0], (h.shape[0],), generator=torch.Generator().manual_seed(0),
                        device="cpu").to(table.device)
    out = router(h, ids)
    logits, want_w, want_idx = (t.reshape(-1, t.shape[-1]) for t in out[:3])
    if not torch.equal(want_idx.long(), table[ids].long()):
        raise fail("the hash router's experts are not its token-id table's rows")
    mode = next((m for m in LOGITS_MODES if torch.equal(got := linear_logits(h, lin.weight, getattr(lin, "bias", None),
                                                                             m), logits)
                 and got.dtype == logits.dtype), None) or nearest_logits_mode(
        h, lin.weight, getattr(lin, "bias", None), 0.0, 1.0, logits)
    if mode is None:
        raise fail("the router's logits are not a linear map of its input")
    cands = _candidates(router, int(want_idx.shape[-1]), None if bias is None else bias.detach())
    try:
        rule, params = rules.identify(logits, want_idx, want_w, cands, fixed_selection=True)
    except rules.NoRuleMatches as e:
        raise fail(f"the hash router's weights match no known routing rule ({e})") from None
    return rule, params, mode, 0.0


@contextlib.contextmanager
def _loaded(*modules: nn.Module) -> Iterator[None]:
    """Every accelerate-offloaded tensor of ``modules`` (``device_map`` / ``cpu_offload``: kept on the meta device
    until the module's pre-forward) on its execution device for the duration."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for m in {id(s): s for mod in modules for s in mod.modules()}.values():
            if has_offloaded_params(m):
                stack.enter_context(align_module_device(m))
        yield


def _call_router(router: nn.Module, h: torch.Tensor, bias: torch.Tensor | None):
    names = [n for n, p in inspect.signature(router.forward).parameters.items()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = (bias,) if len(names) > 1 and (names[1] in _BIAS_ATTRS or
                                           inspect.signature(router.forward).parameters[names[1]].default
                                           is inspect.Parameter.empty) else ()
    try:
        return router(h, *extra)
    except (ValueError, RuntimeError):  # a router that unpacks [B, S, H]
        return router(h.unsqueeze(0), *extra)


def _materialized(router: nn.Module) -> nn.Module:
    """A CPU copy of a meta-device router with seeded random weights (the rule is in its code, not its values), in
    eval mode (a model built from its config trains: phimoe's SparseMixer then samples, and matched no rule)."""
    r = copy.deepcopy(router).to_empty(device="cpu").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*r.named_parameters(), *r.named_buffers()]:
            if name.split(".")[-1] in ONE_CENTRED:
                t.fill_(1.0)
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * (0.05 if name.split(".")[-1] in _BIAS_ATTRS else 0.15))
        table = hash_table(r)
        if table is not None:  # a random token -> K distinct experts table
            table.copy_(random_table(table.shape, router_linear(r).weight.shape[0], gen))
    return r


def random_table(shape: tuple[int, int], n: int, gen: torch.Generator) -> torch.Tensor:
    """``[vocab, K]``: K distinct experts of ``n`` per token id, drawn uniformly (a hash router's table)."""
    return torch.rand(shape[0], n, generator=gen).argsort(dim=-1)[:, :shape[1]]


def _candidates(router: nn.Module, top_k: int, bias: torch.Tensor | None) -> list[rules.Params]:
    """Every parameter variant the router's attributes allow, most specific first."""
    scale = _attr((router,), _SCALE_ATTRS)
    scales = [float(scale), 1.0] if scale is not None and float(scale) != 1.0 else [1.0]
    n_group = int(_attr((router,), _GROUP_ATTRS) or 1)
    topk_group = int(getattr(router, "topk_group", None) or 1)
    groups = [(1, 1, "top2sum")]
    if n_group > 1:
        groups = [(n_group, topk_group, "top2sum"), (n_group, topk_group, "max"), *groups]
    norm_min = float(getattr(router, "norm_min", 0.0) or 0.0)
    norms = ([(0.0, norm_min)] if norm_min else []) + [(0.0, 0.0), (1e-6, 0.0)]
    jitter = getattr(router, "router_jitter_noise", None)
    jitters = [None] + ([float(jitter)] if isinstance(jitter, (int, float)) else [])
    return [rules.Params(top_k=top_k, bias=b, n_group=g, topk_group=tg, group_score=gs, scale=s, renorm_eps=eps,
                         norm_min=nm, jitter_eps=j)
            for b in ([bias, None] if bias is not None else [None]) for g, tg, gs in groups for s in scales
            for eps, nm in norms for j in jitters]


def restore_views(model: nn.Module) -> None:
    """Undo a hand adapter's per-instance class swap (llama4, gemma4) on every module of ``model``: the class
    named by its ``_moetool_original`` comes back and the unregistered ``_moetool_views`` go."""
    for m in model.modules():
        original = type(m).__dict__.get("_moetool_original")
        if original is not None:
            m.__class__ = original
            m.__dict__.pop("_moetool_views", None)


class GenericAdapter(Adapter):
    """Any family of the common shape (module docstring)."""

    family = "generic"

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return decoder_layers(model)

    def layers(self, model: nn.Module) -> list[MoELayer]:
        out = []
        config = text_config(model.config)
        for i, dl in enumerate(decoder_layers(model)):
            parts = moe_parts(dl)
            if parts is not None:
                block, router, experts = parts
                out.append(self.layer_cls(i, dl, block, router, experts, config))
        return out

    layer_cls = GenericLayer
