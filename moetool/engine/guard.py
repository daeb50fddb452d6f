"""NaN/inf guard for every MoE layer, without a host sync inside the forward (issue #14: a wrong number is worse
than a crash).

:class:`FiniteGuard` puts forward hooks on each MoE layer's router (its logits) and experts (their output) that OR
``~isfinite`` over the real tokens into one device bool per (layer, tensor). :func:`moetool.engine.forward` calls
:meth:`FiniteGuard.check` once after each batch: one host read for all flags, and a one-line
:class:`~moetool.errors.MoetoolRuntimeError` naming the first offender in forward order (a NaN spreads downstream,
so the first one is the cause), the batch and its rows.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..errors import MoetoolRuntimeError

TENSORS = ("router logits", "experts output")


class FiniteGuard:
    """``with FiniteGuard(lm.layers) as g: g.mask = mask; model(...); g.check(batch, rows)``.

    ``mask`` (``[B, S]`` on the device, 0 on padding) is set by the caller before each forward: padding is not
    checked (its activations mean nothing); ``None`` checks every position."""

    def __init__(self, layers: Iterable[Any]):
        self.layers = list(layers)
        self._mask: torch.Tensor | None = None
        self.flags: dict[tuple[int, int], torch.Tensor] = {}
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
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.flags = {}

    def _hook(self, key: tuple[int, int]):
        def hook(module, args, out):
            x = out[0] if isinstance(out, (tuple, list)) and out else out
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
                return
            bad = ~torch.isfinite(x)
            m = self.mask
            if m is not None and (x.shape[:1] == (m.numel(),) or x.shape[:2] == m.shape):
                m = m.reshape(-1, 1)
                bad = bad.reshape(m.shape[0], -1) & (m if m.device == x.device else m.to(x.device))
            bad = bad.any()  # a device bool: no sync
            self.flags[key] = self.flags[key] | bad if key in self.flags else bad
        return hook

    def check(self, batch: int, rows: str = "") -> None:
        """Raise if a flag was set since the last check (one host read for every layer), then reset."""
        if not self.flags:
            return
        keys = sorted(self.flags)
        dev = self.flags[keys[0]].device
        bad = torch.stack([self.flags[k].to(dev) for k in keys]).tolist()
        self.flags = {}
        for (layer, what), b in zip(keys, bad):
            if b:
                where = f" ({rows})" if rows else ""
                raise MoetoolRuntimeError(f"non-finite {TENSORS[what]} in MoE layer {layer} at batch {batch}"
                                          f"{where}: results would be meaningless")
