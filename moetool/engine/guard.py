"""NaN/inf guard for every MoE layer, without a host sync inside the forward (issue #14: a wrong number is worse
than a crash).

:class:`FiniteGuard` puts forward hooks on each MoE layer's router (its logits) and experts (their output) that OR
``~isfinite`` over the real tokens into one device bool per (layer, tensor). :func:`moetool.engine.forward` calls
:meth:`FiniteGuard.check` once after each batch: one host read for all flags, and a one-line
:class:`~moetool.errors.MoetoolRuntimeError` naming the first offender in forward order (a NaN spreads downstream,
so the first one is the cause), the model (:func:`moetool.engine.forward` passes its name: fluctuation and agreement
run several), the batch and its rows, and the dtype where it is fp16 or bf16 (an overflow: what to do).
:meth:`FiniteGuard.output` adds the model's next-token NLL of the batch's scored tokens to the same read: output
logits that overflow the model's dtype (fp16's largest number is 65504; the lm_head runs after the last MoE layer,
where no hook looks) stop the run in one line naming the batch and the dtype, instead of an infinite perplexity or a
bootstrap's "per-row sums contain NaN/inf". :func:`flag` adds a flag a consumer computes inside the forward
(``approx``'s all-expert probe: an expert the router did not choose, computed on every token, can overflow fp16 where
the model's own forward does not) to the same read.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..context import dtype_choice
from ..errors import MoetoolRuntimeError

TENSORS = ("router logits", "experts output", "all-expert probe outputs")
#: the guards of the forwards running (the innermost last): :func:`flag` reports to the last
_ACTIVE: list["FiniteGuard"] = []


def flag(layer: int, bad: torch.Tensor, dtype: torch.dtype, what: int = 2) -> None:
    """OR the device bool ``bad`` (real tokens only) into the running forward's guard as ``TENSORS[what]`` of MoE
    layer ``layer``, computed in ``dtype``: read at the guard's next check with the others, no host sync here.
    Outside a forward (no guard): nothing."""
    if _ACTIVE:
        g = _ACTIVE[-1]
        key = (layer, what)
        g.flags[key] = _or(g.flags.get(key), bad)
        g.dtypes[key] = dtype


class FiniteGuard:
    """``with FiniteGuard(lm.layers) as g: g.mask = mask; model(...); g.check(batch, rows)``.

    ``mask`` (``[B, S]`` on the device, 0 on padding) is set by the caller before each forward: padding is not
    checked (its activations mean nothing); ``None`` checks every position."""

    def __init__(self, layers: Iterable[Any], model: str | None = None):
        self.layers = list(layers)
        self.model = model  # the model's name, in the message (fluctuation runs several checkpoints: which one)
        self.seen: dict[tuple[int, int], torch.dtype] = {}  # each hooked tensor's dtype (the message names fp16/bf16)
        self._mask: torch.Tensor | None = None
        self.flags: dict[tuple[int, int], torch.Tensor] = {}
        self.dtypes: dict[tuple[int, int], torch.dtype] = {}  # of a flag's tensor, where the message names it
        self._output: tuple[torch.Tensor, torch.dtype] | None = None  # (device bool, the logits' dtype) of the batch
        self._handles: list[Any] = []

    @property
    def mask(self) -> torch.Tensor | None:
        return self._mask

    @mask.setter
    def mask(self, mask: torch.Tensor | None) -> None:  # set outside the forward: the bool cast is not in it
        self._mask = None if mask is None else mask.bool()

    def __enter__(self) -> "FiniteGuard":
        for L in self.layers:
            self._handles.append(L.router.register_forward_hook(self._hook((L.index, 0))))
            self._handles.append(L.experts.register_forward_hook(self._hook((L.index, 1))))
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.flags, self.dtypes, self.seen, self._output = {}, {}, {}, None

    def output(self, nll: torch.Tensor, dtype: torch.dtype) -> None:
        """Flag the batch's NLL sums ``nll`` (only scored tokens reach them) if one is not finite: a device bool, read
        by the next :meth:`check`; ``dtype`` the output logits' (named in the error)."""
        self._output = (_or(self._output[0] if self._output else None, ~torch.isfinite(nll).all()), dtype)

    def _hook(self, key: tuple[int, int]):
        def hook(module, args, out):
            x = out[0] if isinstance(out, (tuple, list)) and out else out
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
                return
            self.seen[key] = x.dtype
            bad = ~torch.isfinite(x)
            m = self.mask
            if m is not None and (x.shape[:1] == (m.numel(),) or x.shape[:2] == m.shape):
                m = m.reshape(-1, 1)
                bad = bad.reshape(m.shape[0], -1) & (m if m.device == x.device else m.to(x.device))
            bad = bad.any()  # a device bool: no sync
            self.flags[key] = _or(self.flags.get(key), bad)
        return hook

    def check(self, batch: int, rows: str = "") -> None:
        """Raise if a flag was set since the last check (one host read for every layer and the output), then reset."""
        output, self._output = self._output, None
        if not self.flags and output is None:
            return
        keys = sorted(self.flags)
        flags = [self.flags[k] for k in keys] + ([output[0]] if output is not None else [])
        dev = flags[0].device
        bad = torch.stack([f.to(dev) for f in flags]).tolist()
        dtypes, seen, self.flags, self.dtypes, self.seen = self.dtypes, self.seen, {}, {}, {}
        of = f" of {self.model}" if self.model else ""
        where = f" ({rows})" if rows else ""
        for (layer, what), b in zip(keys, bad):
            if b and (layer, what) in dtypes:  # a consumer's flag: what it computed beside the model, and its dtype
                raise MoetoolRuntimeError(f"non-finite {TENSORS[what]} in MoE layer {layer}{of} at batch {batch}"
                                          f"{where}: an expert computed on tokens the router did not send it is NaN or "
                                          f"inf in {_dtype_hint(dtypes[(layer, what)])}; results would be meaningless")
            if b:  # a MoE layer first: a NaN there spreads to the output, so it is the cause
                low = seen.get((layer, what))  # overflow of a half-precision dtype: say which, and what to do
                low = f", computed in {_dtype_hint(low)}" if low in (torch.float16, torch.bfloat16) else ""
                raise MoetoolRuntimeError(f"non-finite {TENSORS[what]} in MoE layer {layer}{of} at batch {batch}"
                                          f"{where}{low}: results would be meaningless")
        if output is not None and bad[-1]:
            dtype = _dtype_hint(output[1])
            raise MoetoolRuntimeError(f"non-finite next-token NLL{of} at batch {batch}{where}: the model's output "
                                      f"logits are NaN or inf in {dtype}; results would be meaningless")


def _or(old: torch.Tensor | None, bad: torch.Tensor) -> torch.Tensor:
    """``bad`` OR'd into the flag ``old`` (None: none yet), on ``old``'s device: no host sync."""
    return bad if old is None else old | bad.to(old.device)


def _dtype_hint(dtype: torch.dtype) -> str:
    """``dtype``'s name, with what to do where it is fp16 (whose largest number is 65504), in the flag of the run's
    command that chooses the dtype (:func:`moetool.context.dtype_choice`)."""
    name = str(dtype).removeprefix("torch.")
    return name + (f" (fp16's largest number is 65504: try {dtype_choice('bf16 or fp32')})"
                   if dtype == torch.float16 else "")
