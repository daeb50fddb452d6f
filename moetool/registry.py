"""Lazy registries: names map to ``"module:attr"`` strings loaded on first use.

Unknown names raise a one-line :class:`MoetoolError` with did-you-mean suggestions.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Iterable

from .errors import MoetoolError


#: how alike a name and a suggestion must be (difflib's ratio): 0.5 suggested 'olmoe' for 'nosuchmodel' and 'foo';
#: a typo ('mixtrl' -> 'mixtral-8x7b' 0.67, 'nrom' -> 'norm' 0.75, 'olmo' -> 'olmoe' 0.89) is above it
CLOSE = 0.65


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=CLOSE)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def refuse_repeats(items: Iterable[Any], flag: str) -> None:
    """One line naming ``flag`` and the first value of ``items`` given twice (equal once cast: ``0.5,.50``;
    values that differ stay distinct, ``0.5,0.5000001``): how every list flag and list option treats a repeat, on
    the command line and in the library alike (``Flag.check``, the ``moetool demo`` steps), so no table has a row
    computed twice and no run quietly does less than it was asked."""
    items = list(items)
    seen: list[Any] = []
    for x in items:
        if x in seen:
            raise MoetoolError(f"{flag}: {x!r} is given twice in {items} (each value once: no row is computed twice)")
        seen.append(x)


class LazyRegistry:
    """``name -> "package.module:attr"``; the module is imported on first :meth:`get`."""

    def __init__(self, kind: str, entries: dict[str, str] | None = None):
        self.kind = kind
        self._entries: dict[str, str] = dict(entries or {})
        self._loaded: dict[str, Any] = {}

    def register(self, name: str, target: str) -> None:
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise MoetoolError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._entries)}; "
                f"known: {', '.join(self.names())}"
            )
        if name not in self._loaded:
            module, _, attr = self._entries[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]
