"""Capture and override routing in every MoE layer with plain PyTorch hooks.

Per MoE layer the engine installs
* a forward hook on the **router**: stores the logits (and the model's own top-K) the
  router just computed;
* a forward pre-hook on the **experts** module (``experts(h, idx, w)``): here ``h`` is
  exactly the router input. The engine builds a :class:`RoutingEvent`, lets the policy
  (if any) replace ``(idx, w)`` — the experts then run exactly as the model runs them —
  and hands the event to every consumer (streaming reductions, recorders);
* optionally a forward hook on the layer's **self-attention** for its attention
  probabilities (attention-aware routing; needs ``attn_implementation="eager"``);
* in a policy's layers, :class:`ChunkedExperts`: a policy handing the experts more columns than K runs them
  over chunks of tokens (the memory of the model's own forward).
A pre-hook on the whole model records the batch shape and padding mask of every
forward, whoever calls it (our runner, lm-eval, ``generate``).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import threading
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from .. import ops
from ..adapters import quant
from ..adapters.base import MoELayer
from ..context import flag, state
from ..errors import MoetoolError, shown, spans
from .probes import ON_DEVICE


@dataclass
class RoutingEvent:
    """What one MoE layer saw in one forward pass. ``T = B * S`` tokens, padding included."""

    layer: MoELayer
    h: torch.Tensor  # [T, d] router input
    logits: torch.Tensor  # [T, n] router logits as the model computed them ([T, n + s]: layer.captured_logits)
    idx: torch.Tensor  # [T, K] the model's own top-K
    weights: torch.Tensor  # [T, K] the model's own weights
    valid: torch.Tensor  # [T] bool, False on padding
    shape: tuple[int, int]  # (B, S)
    attn: torch.Tensor | None = None  # [B, heads, S, S] attention probabilities (if requested)
    chosen_idx: torch.Tensor | None = None  # [T, K] what ran (after the policy)
    chosen_weights: torch.Tensor | None = None  # [T, K]
    scores: torch.Tensor | None = None  # [T, n] the scores the policy chose from (similarity, attention), if any
    extra: dict[str, Any] = field(default_factory=dict)
    rows: list[int] | None = None  # the batch's B global packed-row ids (engine.forward sets them; else None)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the rule's inputs beyond h (MoELayer.router_inputs:
    # Zaya's carried router state), passed to layer.logits(h, **inputs)
    token_ids: torch.Tensor | None = None  # [T] the forward's input ids (None when it was given embeddings): the
    # input of a hash-routed layer's rule (experts by token id)

    @cached_property
    def probs(self) -> torch.Tensor:
        """π: the model's full routing distribution ``[T, n]`` (fp32)."""
        return self.layer.probs(self.logits)

    @cached_property
    def ranked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own ``(idx, weights)`` ``[T, K]`` in rank order: the largest selection score first
        (``layer.selection_scores``: the scores it ranks experts by, a correction bias included), as
        ``torch.topk(sorted=True)`` returns them. ``idx`` is the order the router returned, which for several
        families (``topk(sorted=False)``: DeepSeek-V3, GLM-4.5, LongCat, ...) is not the rank order, so ``idx[:, 0]``
        need not be the first-ranked expert. Computed once per event for every consumer that reads it."""
        return self.in_rank_order(self.idx), self.in_rank_order(self.weights)

    @cached_property
    def rank_positions(self) -> torch.Tensor | None:
        """Positions ``[T, K]`` that put the model's ``idx`` in rank order (:attr:`ranked`); None for K = 1."""
        if self.idx.shape[-1] == 1:
            return None
        return ops.rank_order(self.idx, self.layer.selection_scores(self.logits))

    def in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]``, column for column beside the model's ``idx`` (its weights, or a policy's weights for the
        model's own set, as ``capacity`` returns them), in :attr:`ranked`'s order."""
        order = self.rank_positions
        return x if order is None else x.gather(-1, order)


class Policy(Protocol):
    """A routing policy replaces the top-K choice: ``select(event) -> (idx [T, K], w [T, K])``."""

    name: str
    needs_attention: bool

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]: ...


Consumer = Callable[[RoutingEvent], None]


#: what a refusal says of a layer whose routing cannot be recomputed from its input alone (:func:`recompute_unable`)
RECOMPUTE_SAID = {
    "carried": "the router logits of MoE layers {layers} also depend on {detail}",
    "hash": "MoE layers {layers} are hash-routed (experts chosen by token id: no router logits to recompute their "
            "routing from)"}


def recompute_unable(layers: Iterable[MoELayer]) -> dict[int, tuple[str, str]]:
    """The layers of ``layers`` whose routing cannot be recomputed from their input alone (perturbed, predicted or
    codebook points), each with ``(kind, detail)``: a carried router state (``carried``: what else the logits
    depend on, :attr:`MoELayer.routing_context`) or a hash router (``hash``: experts chosen by token id). The checks
    every such refusal starts from (:func:`refuse_recomputed`; offload's and mass-recall's add their own)."""
    out: dict[int, tuple[str, str]] = {}
    for L in layers:
        if getattr(L, "carried_state", False):
            out[L.index] = ("carried", L.routing_context)
        elif getattr(L, "hash_routed", False):
            out[L.index] = ("hash", "")
    return out


def refuse_recomputed(layers: Iterable[MoELayer], what: str, model_layers: Iterable[MoELayer] | None = None) -> None:
    """One line when ``what`` recomputes routing from inputs other than the events' and some of ``layers`` (those
    asked for) cannot (:func:`recompute_unable`), naming them all (carried state and hash routing alike) and the
    layers that can (:func:`refuse_unable`; of ``model_layers`` where none asked for is left)."""
    layers = list(layers)
    refuse_unable(layers, layers if model_layers is None else list(model_layers),
                  lambda among, alt: recompute_unable(among), RECOMPUTE_SAID,
                  f"{what} needs the routing recomputed from the layer input alone, but ")


def refuse_hash_routed(layers: Iterable[MoELayer], what: str) -> None:
    """One line when any of ``layers`` is hash-routed (experts chosen by token id, :attr:`GenericLayer.hash_routed`):
    ``what`` needs the routing as a function of the router's logits, which such a layer does not have. The line
    names those layers and the others (``--layers``, :func:`refuse_unable`)."""
    layers = list(layers)
    refuse_unable(layers, layers, lambda among, alt: hash_routed(among), RECOMPUTE_SAID,
                  f"{what} needs the routing recomputed from the router logits, but ")


def hash_routed(layers: Iterable[MoELayer]) -> dict[int, tuple[str, str]]:
    """The hash-routed layers of ``layers`` (:func:`recompute_unable`'s ``hash`` kind)."""
    return {i: k for i, k in recompute_unable(layers).items() if k[0] == "hash"}


def refuse_unable(layers: Sequence[MoELayer], model_layers: Sequence[MoELayer],
                  check: Callable[[Sequence[MoELayer], bool], dict[int, tuple[str, str]]], said: dict[str, str],
                  lead: str, *, alt: tuple[str, str] | None = None, shared: Iterable[str] = (),
                  usable: Callable[[MoELayer], bool] | None = None) -> None:
    """One line, before any forward, naming every layer of ``layers`` (those asked for) that ``check(among,
    False)`` lists (``{index: (kind, detail)}``) and why, after ``lead``; and an invocation that runs, computed from
    the same check, so that it is never refused in turn: the others (``--layers``), the alternative ``alt`` (``(flag,
    what it does)``; ``check(among, True)`` lists what is left out with it) where that leaves more of them, or,
    where none of the layers asked for is left, the MoE layers of the model (``model_layers``) that are; where none
    is, it says so. ``said[kind]`` is formatted with ``layers`` and ``detail``; a kind in ``shared`` is said once
    for all its layers with the first one's detail (an adapter's reason). ``usable``: the layers a suggestion may
    name at all. offload's next-layer prediction and mass-recall's codebook points use it."""
    bad = check(layers, False)
    if not bad:
        return
    shared = set(shared)
    groups: dict[tuple[str, str], list[int]] = {}
    first: dict[str, str] = {}
    for i, (kind, detail) in bad.items():
        groups.setdefault((kind, "" if kind in shared else detail), []).append(i)
        first.setdefault(kind, detail)
    why = "; ".join(said[kind].format(layers=ls, detail=first[kind] if kind in shared else detail)
                    for (kind, detail), ls in groups.items())

    def left(among: list[MoELayer], alternative: bool) -> list[int]:
        out = check(among, alternative)
        return [L.index for L in among if L.index not in out and (usable is None or usable(L))]

    def hint(among: list[MoELayer], scope: str) -> list[str]:
        ok = left(among, False)
        tips = [f"{scope} --layers {','.join(map(str, ok))}"] if ok else []
        if alt is not None and len(more := left(among, True)) > len(ok):
            flag, what = alt
            tips.append(f"{what} ({flag})" if more == [L.index for L in among] else
                        f"{what} on --layers {','.join(map(str, more))} {flag}")
        return tips

    tips = hint(list(layers), "choose the others with") or hint(list(model_layers), "no layer asked for is left: choose")
    raise MoetoolError(lead + why + ": " + (", or ".join(tips) if tips else "no other layer is left"))


def refuse_above_max_k(what: str, k: int, layers: Iterable[MoELayer], *, groups: bool = True) -> None:
    """One line (before any forward) when ``k`` experts per token (``topk:<k>`` and ``topk --ks``; ``topp``'s
    ``kmax`` and ``topk --kmax``) is more than one of ``layers`` can route a token to (:attr:`MoELayer.max_k`; with
    ``groups=False``, for what ranks every expert regardless of group limits, ``n_experts``): never a silently
    smaller ``k`` recorded as ``k``."""
    def most(L: MoELayer) -> int:
        return L.max_k if groups else L.n_experts

    over = [L for L in layers if k > most(L)]
    if over:
        group = " (group-limited routing)" if any(most(L) < L.n_experts for L in over) else ""
        limits = sorted({most(L) for L in over}, reverse=True)  # each bound with its layers; the suggestion: the
        said = []  # smallest of them (of every layer given at once), so that no other layer refuses it in turn
        for m in limits:
            ls = [str(L.index) for L in over if most(L) == m]
            said.append(f"MoE layer{'s' if len(ls) > 1 else ''} {', '.join(ls)} {'can route a token to ' if not said else ''}"
                        f"at most {m}")
        raise MoetoolError(f"{what}: {k} experts per token, but {', '.join(said)}{group}; choose at most {limits[-1]}")


def check_policy(policy: Any, layers: Iterable[MoELayer], policy_layers: Iterable[int]) -> None:
    """A policy refuses what it cannot do before any forward, in this order: the layers it cannot run in, all in one
    line with the others to choose (:func:`refuse_unable` over one check, so that a layer it suggests is never
    refused by another check in turn): hash-routed ones where it re-ranks experts by the router's scores
    (``routes_by_scores``) and those its ``unable(layers, alternative)`` lists (said by ``unable_said``; its
    ``unable_alt``: refuse_unable's ``alt``); then ``check_moe_layers(its MoE layers)`` once (a bound over them all,
    e.g. topk's largest k), ``check(layer)`` per MoE layer of ``layers`` it runs in (``policy_layers``),
    ``check_layers(policy layers, MoE layers)`` once."""
    layers, policy_layers = list(layers), set(policy_layers)
    mine = [L for L in layers if L.index in policy_layers]
    by_scores, unable = getattr(policy, "routes_by_scores", False), getattr(policy, "unable", None)
    if unable is None and by_scores:
        refuse_hash_routed(mine, f"policy {policy.name}")
    elif unable is not None:
        def check(among: Sequence[MoELayer], alternative: bool) -> dict[int, tuple[str, str]]:
            out = hash_routed(among) if by_scores else {}
            return {**out, **{i: k for i, k in unable(among, alternative).items() if i not in out}}

        refuse_unable(mine, mine, check, {**RECOMPUTE_SAID, **policy.unable_said}, f"policy {policy.name}: ",
                      alt=getattr(policy, "unable_alt", None))
    check_all = getattr(policy, "check_moe_layers", None)
    if check_all is not None:
        check_all([L for L in layers if L.index in policy_layers])
    check = getattr(policy, "check", None)
    for L in layers:
        if check is not None and L.index in policy_layers:
            check(L)
    check_layers = getattr(policy, "check_layers", None)
    if check_layers is not None:
        check_layers(sorted(policy_layers), sorted(L.index for L in layers))


def select_layers(moe_layers: Iterable[MoELayer], wanted: Iterable[int] | None, *,
                  allow_empty: bool = False) -> list[MoELayer]:
    """The MoE layers whose decoder index is in ``wanted`` (``None`` = every MoE layer), in model order.

    The one meaning of ``--layers``: the MoE layers a command acts on. A non-MoE index or an empty selection is
    an error (:class:`MoetoolError`), never a silently smaller run.
    """
    moe_layers = list(moe_layers)
    if wanted is None:
        return moe_layers
    if isinstance(wanted, (str, bytes)) or not hasattr(wanted, "__iter__"):
        raise MoetoolError(f"{flag('layers')} must be decoder layer indices (a tuple such as (1, 2)), not {shown(wanted)}")
    wanted = list(wanted)
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in wanted):  # True is not layer 1
        raise MoetoolError(f"{flag('layers')} must be decoder layer indices (integers, a tuple such as (1, 2)), not "
                           f"{shown(wanted)}")
    wanted = {int(i) for i in wanted}
    known = {L.index for L in moe_layers}
    bad = sorted(wanted - known)
    if bad:
        named = flag("layers", spans(bad)) if state().cli else f"layers= names {spans(bad)}"  # not "layers=99"
        raise MoetoolError(f"{named}: not MoE layers (MoE layers: {spans(known)})")
    if not wanted and not allow_empty:
        raise MoetoolError(f"{flag('layers')} selects no layer (MoE layers: {sorted(known)})")
    return [L for L in moe_layers if L.index in wanted]


def _bind_expert_args(experts: nn.Module):
    """Map the experts' call to ``(h, idx, w)`` whatever the argument names."""
    names = [p for p in inspect.signature(experts.forward).parameters if p != "self"][:3]

    def get(args, kwargs):
        vals = list(args[:3]) + [kwargs[n] for n in names[len(args):3]]
        return vals[0], vals[1], vals[2]

    def put(args, kwargs, idx, w, h=None):
        args, kwargs = list(args), dict(kwargs)
        for pos, value in ((1, idx), (2, w)) if h is None else ((0, h), (1, idx), (2, w)):
            if pos < len(args):
                args[pos] = value
            else:
                kwargs[names[pos]] = value
        return tuple(args), kwargs

    return get, put


def _restore(obj: Any, name: str, had: bool, orig: Any) -> None:
    """Undo an instance-level patch of ``obj.name``: the instance's own attribute back (``had``), else the class's."""
    if had:
        setattr(obj, name, orig)
    else:
        vars(obj).pop(name, None)


class ChunkedExperts:
    """While installed, a layer's experts module runs a call with more expert columns per token than the layer's K
    over consecutive chunks of tokens holding about ``tokens x K`` (token, expert) pairs each: a policy that hands it
    wider sets (``topp``: every expert, the unchosen at weight 0) then holds the activations of the model's own
    forward, not width / K times them. A static shape decides (no host sync); the engine's pre-hook has already
    seen the whole call; each token's output is computed from its own row alone, as in one call (smaller GEMMs may
    round the last fp32 bit differently: logits within ~3e-7 on the test families). A module whose output is not
    one ``[tokens, ...]`` tensor runs unchunked. ``remove()`` restores the module's forward."""

    def __init__(self, layer: MoELayer):
        self.module = layer.experts
        self.k = layer.top_k
        self.had = "forward" in vars(self.module)
        self.orig = orig = self.module.forward
        get, put = _bind_expert_args(self.module)

        def forward(*args, **kwargs):
            h, idx, w = get(args, kwargs)
            width = idx.shape[-1] if idx.dim() == 2 else 0
            T = h.shape[0]
            rows = max(1, T * self.k // width) if width > self.k and h.dim() == 2 else T
            if rows >= T:
                return orig(*args, **kwargs)
            outs = []
            for s in range(0, T, rows):
                a, kw = put(args, kwargs, idx[s:s + rows], w[s:s + rows], h[s:s + rows])
                out = orig(*a, **kw)
                if not (isinstance(out, torch.Tensor) and out.shape[:1] == h[s:s + rows].shape[:1]):
                    return orig(*args, **kwargs)  # not a per-token tensor (only the first chunk can tell)
                outs.append(out)
            return torch.cat(outs)

        self.module.forward = forward

    def remove(self) -> None:
        _restore(self.module, "forward", self.had, self.orig)


def offloaded(module: nn.Module) -> bool:
    """Parameters kept off the device by accelerate (``device_map`` with CPU/disk offload) until its pre-forward."""
    if not hasattr(module, "_hf_hook"):
        return False
    from accelerate.utils import has_offloaded_params

    return has_offloaded_params(module)


class AfterAccelerateLoads:
    """An engine pre-hook ``hook(module, args, kwargs)`` run inside accelerate's ``pre_forward`` of an offloaded
    experts module, right after it brought the weights (and the inputs) to the execution device: a probe in a
    policy or consumer reuses those weights instead of moving the whole layer's experts a second time. A torch
    forward pre-hook would run before accelerate's, with the weights still offloaded. ``remove()`` restores."""

    def __init__(self, module: nn.Module, hook: Callable[..., Any]):
        self.acc = module._hf_hook
        self.had = "pre_forward" in vars(self.acc)
        self.orig = orig = self.acc.pre_forward

        def pre_forward(mod, *args, **kwargs):
            args, kwargs = orig(mod, *args, **kwargs)
            if not args and not kwargs:  # accelerate's align_module_device, not a forward
                return args, kwargs
            setattr(mod, ON_DEVICE, True)
            try:
                new = hook(mod, args, kwargs)
            finally:
                setattr(mod, ON_DEVICE, False)
            return new if new is not None else (args, kwargs)

        self.acc.pre_forward = pre_forward

    def remove(self) -> None:
        _restore(self.acc, "pre_forward", self.had, self.orig)


#: model -> its holder ``[thread id, thread name, what, is a run, depth]``: one run (or open ``moetool.hook`` block)
#: at a time per loaded model (:func:`hold`)
_HOLDERS: "weakref.WeakKeyDictionary[nn.Module, list[Any]]" = weakref.WeakKeyDictionary()
_HOLDERS_LOCK = threading.Lock()


def take(model: nn.Module, what: str, *, run: bool) -> None:
    """Hold ``model`` for ``what`` (a run, its forward loop, or an engine's hooks) until :func:`give_back`.

    Hooks and policies are installed on the model itself, so every forward of it, in any thread, runs them: two
    runs on one loaded model at once would feed each other's consumers and route each other's tokens (numbers of
    neither). A model held by another thread, or by an engine left entered (a ``moetool.hook`` block, hooks
    still installed), is one line, never mixed numbers; a run (``run=True``) holding it lets its own thread nest
    (its forwards and their engines)."""
    me = threading.get_ident()
    with _HOLDERS_LOCK:
        held = _HOLDERS.get(model)
        if held is None:
            _HOLDERS[model] = [me, threading.current_thread().name, what, run, 1]
            return
        if held[0] == me and held[3]:
            held[4] += 1
            return
    _refuse(held)


def check_free(model: nn.Module) -> None:
    """:func:`take` would take ``model`` now (a run refused before its run folder is made); the take itself
    decides."""
    with _HOLDERS_LOCK:
        held = _HOLDERS.get(model)
        held = None if held is None else list(held)
    if held is not None and not (held[0] == threading.get_ident() and held[3]):
        _refuse(held)


def _refuse(held: list[Any]) -> None:
    mine = held[0] == threading.get_ident()
    hint = ("leave the moetool.hook block (its hooks are still installed) first" if not held[3] and mine
            else "one run at a time per loaded model: load the model again (moetool.load) for a concurrent run")
    raise MoetoolError(f"this model is in use by {held[2]} in " + ("this thread" if mine else f"thread '{held[1]}'")
                       + f": {hint}")


def give_back(model: nn.Module) -> None:
    """The end of one :func:`take` of ``model`` (the last one frees it)."""
    with _HOLDERS_LOCK:
        held = _HOLDERS.get(model)
        if held is not None:
            held[4] -= 1
            if held[4] <= 0:
                del _HOLDERS[model]


@contextlib.contextmanager
def hold(model: nn.Module, what: str) -> Any:
    """:func:`take` ``model`` for a run (``what``) for the duration of a ``with`` block."""
    take(model, what, run=True)
    try:
        yield model
    finally:
        give_back(model)


class Engine:
    """Hook every MoE layer of ``model`` for the duration of a ``with`` block.

    ``policy`` overrides routing in ``policy_layers`` (decoder layer indices; ``None`` = all
    MoE layers); ``consumers`` see every event (after the policy chose).
    """

    def __init__(self, model: nn.Module, layers: list[MoELayer], *, policy: Policy | None = None,
                 policy_layers: Iterable[int] | None = None, consumers: Iterable[Consumer] = (),
                 attention: bool = False):
        self.model = model
        self.layers = layers
        self.policy = policy
        self.policy_layers = {L.index for L in select_layers(layers, policy_layers, allow_empty=True)}
        self.consumers = list(consumers)
        self.attention = attention or bool(policy is not None and policy.needs_attention)
        self._handles: list[Any] = []
        self._slots: dict[int, dict[str, Any]] = {}
        self._batch: tuple[tuple[int, int], torch.Tensor | None, torch.Tensor | None] | None = None  # (B, S), valid, ids
        self.reported: dict[int, int] = {}
        self.forwards = 0
        self.rows: list[int] | None = None  # the next forward's global packed-row ids (engine.forward sets them)
        self.consumer_raised = False  # a consumer raised the last error out of a forward (the runner reads it)
        #: the next forward's real tokens ``[B, S]`` bool where it passes no attention mask (lm-eval's loglikelihood
        #: forwards: the eval bridge sets it from lm-eval's padding); used once, by a forward of that shape
        self.padding: torch.Tensor | None = None
        self._attn_was: str | None = None  # the attention implementation to give back on exit (eager switched on)
        self._held = False  # the model taken (:func:`take`) on entry, given back on exit

    # ----- installation ------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        self._check_policy()  # every layer the policy runs in at once (a hybrid's layers without attention too)
        attention = self._attention_modules()  # may refuse a layer: before any hook is installed
        take(self.model, "a moetool.hook block", run=False)  # one engine at a time per model (or its run's own)
        self._held = True
        try:
            self._install(attention)
        except BaseException:
            self.__exit__(None, None, None)  # nothing left installed, the model free again
            raise
        return self

    def _install(self, attention: dict[int, nn.Module]) -> None:
        self._attn_was = _eager_attention(self.model) if attention else None
        self._handles.append(self.model.register_forward_pre_hook(self._on_model, with_kwargs=True))
        for L in self.layers:
            self._slots[L.index] = {}
            through = quant.route_through_modules(L)  # MXFP4 gpt-oss: its kernel path bypasses both modules
            if through is not None:
                self._handles.append(through)
            self._handles.append(L.router.register_forward_hook(self._router_hook(L)))
            if (self.policy is not None and L.index in self.policy_layers and through is None
                    and not hasattr(L.experts, "_hf_hook")):  # accelerate's hooks wrap the forward: left alone
                self._handles.append(ChunkedExperts(L))
            if offloaded(L.experts):  # run inside accelerate's pre-forward, once the weights are on the device
                self._handles.append(AfterAccelerateLoads(L.experts, self._experts_hook(L)))
            else:
                self._handles.append(L.experts.register_forward_pre_hook(self._experts_hook(L), with_kwargs=True))
            if L.index in attention:
                self._handles.append(attention[L.index].register_forward_hook(self._attention_hook(L)))

    def _check_policy(self) -> None:
        """A policy refuses what it cannot do before any forward: ``check(layer)`` per layer it runs in (e.g. a
        top-k a sparsemixer router has no rounds for), ``check_layers(policy layers, MoE layers)`` once (e.g. a
        pruning set naming layers it does not run in)."""
        if self.policy is not None:
            check_policy(self.policy, self.layers, self.policy_layers)

    def _attention_modules(self) -> dict[int, nn.Module]:
        """The self-attention module to read per hooked layer (the policy's layers), if attention is wanted."""
        out = {}
        for L in self.layers if self.attention else ():
            if self.policy is None or L.index in self.policy_layers:
                pick = getattr(self.policy, "attention_module", None)  # the policy may refuse a layer (hybrids)
                out[L.index] = pick(L) if pick is not None else L.attention
                if out[L.index] is None:
                    raise MoetoolError(f"layer {L.index} has no self-attention module to read")
        return out

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._attn_was is not None:  # the attention implementation the model came with
            self.model.set_attn_implementation(self._attn_was)
            self._attn_was = None
        if self._held:
            self._held = False
            give_back(self.model)
        if exc[0] is None:
            self.check_all_reported()

    def check_all_reported(self) -> None:
        """Fail loudly if a forward ran and some MoE layer's hook never fired."""
        if self.forwards and len(self.reported) != len(self.layers):
            missing = sorted({L.index for L in self.layers} - set(self.reported))
            raise MoetoolError(f"MoE layers {missing} never reported: the hooks missed them "
                               f"(unsupported experts implementation or kernel replacement?)")

    # ----- hooks -------------------------------------------------------------------------
    def _on_model(self, module, args, kwargs):
        self._refuse_cached_step(kwargs.get("cache", kwargs.get("past_key_values")))  # transformers renamed it
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        B, S = int(ids.shape[0]), int(ids.shape[1])
        valid = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == (B, S):
            valid = mask.reshape(-1).bool()
        padding, self.padding = self.padding, None
        if valid is None and padding is not None and tuple(padding.shape) == (B, S):
            valid = padding.reshape(-1).to(ids.device)
        token_ids = ids.reshape(-1) if not ids.is_floating_point() else None
        self._batch = ((B, S), valid, token_ids)
        self.forwards += 1

    def _refuse_cached_step(self, cache: Any) -> None:
        """A policy that routes a token by the other tokens of its sequence (``Policy.reads_sequence``: similarity,
        attention) sees only the forward's tokens: a KV-cached decoding step (``model.generate`` with its cache, a
        forward given a filled ``cache`` / ``past_key_values``) holds the new token alone, which similarity routed by itself (the
        router's choice, silently) and attention refused mid-generation. One line instead, before the forward; the
        cache's length is a Python int (no device sync). ``eval`` generates without the cache for such a policy."""
        if cache is None or not getattr(self.policy, "reads_sequence", False):
            return
        try:
            cached = int(cache.get_seq_length())
        except Exception:  # not a transformers Cache (a legacy tuple, a model's own): nothing to read here
            return
        if cached > 0:
            raise MoetoolError(f"the {self.policy.name} policy routes a token by the earlier tokens of its sequence, "
                               f"but this forward continues a KV cache of {cached} tokens (it holds its new tokens "
                               f"alone): generate with use_cache=False")

    def _router_hook(self, L: MoELayer):
        slot = self._slots[L.index]

        def hook(module, args, out):
            slot["logits"] = L.captured_logits(args[0] if args else None, out[0])
            slot["inputs"] = L.router_inputs(args)
        return hook

    def _attention_hook(self, L: MoELayer):
        slot = self._slots[L.index]

        k = getattr(L, "attention_probs_index", 1)  # where the module's output tuple holds the probabilities

        def hook(module, args, out):
            attn = out[k] if isinstance(out, tuple) and len(out) > k else None
            if attn is None:
                raise MoetoolError("attention probabilities are not available: load the model with "
                                   "attn_implementation='eager' (moetool does this for attention routing)")
            slot["attn"] = attn
        return hook

    def _experts_hook(self, L: MoELayer):
        slot = self._slots[L.index]
        get, put = _bind_expert_args(L.experts)

        def hook(module, args, kwargs):
            h, idx, w = get(args, kwargs)
            if "logits" not in slot:
                raise MoetoolError(f"layer {L.index}: experts ran before the router reported")
            (B, S), valid, token_ids = self._batch if self._batch else ((1, h.shape[0]), None, None)
            if B * S != h.shape[0]:  # a caller that does not go through the model's forward
                (B, S), valid, token_ids = (1, h.shape[0]), None, None
            if valid is None:
                valid = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
            rows = self.rows if self.rows is not None and len(self.rows) == B else None
            ev = RoutingEvent(layer=L, h=h, logits=slot.pop("logits"), idx=idx, weights=w,
                              valid=valid.to(h.device), shape=(B, S), attn=slot.pop("attn", None), rows=rows,
                              token_ids=None if token_ids is None else token_ids.to(h.device),
                              inputs=slot.pop("inputs", {}))
            slot.clear()
            self.reported[L.index] = self.reported.get(L.index, 0) + 1
            new = None
            if self.policy is not None and L.index in self.policy_layers:
                with torch.no_grad():
                    nidx, nw = self.policy.select(ev)
                nidx = nidx.to(device=idx.device, dtype=idx.dtype)
                nw = nw.to(device=w.device, dtype=w.dtype)
                ev.chosen_idx, ev.chosen_weights = nidx, nw
                new = put(args, kwargs, *L.experts_args(nidx, nw))
            else:
                ev.chosen_idx, ev.chosen_weights = idx, w
            with torch.no_grad():
                try:
                    for c in self.consumers:
                        c(ev)
                except BaseException:
                    self.consumer_raised = True  # the analysis' error, not the model's (an out-of-memory: the runner)
                    raise
            return new
        return hook


def _eager_attention(model: nn.Module) -> str | None:
    """Switch ``model`` to eager attention (the only implementation that returns its probabilities: SDPA and flash
    kernels, CUDA's default, never materialise them) for an engine that reads them; the implementation it had, to
    restore on exit, or ``None`` when it already was eager or cannot be switched (the attention hook then says so)."""
    config = getattr(model, "config", None)
    was = getattr(config, "_attn_implementation", None)
    if was in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        return None
    try:
        model.set_attn_implementation("eager")
    except (ValueError, ImportError):
        return None
    return was if getattr(config, "_attn_implementation", None) == "eager" else None
