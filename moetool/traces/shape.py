"""What ``--config`` says about a model whose routing was recorded elsewhere: its decoder layers, which of them are
MoE, and the number of experts n and the top-K of each (read from the config alone: the model is built on the meta
device, as ``moetool inspect`` does; no weight is read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import MoetoolError


@dataclass(frozen=True)
class ModelShape:
    """``num_layers`` decoder layers; ``moe`` maps each MoE layer's index to ``(n_experts, top_k)``; ``zero`` the
    MoE layers with zero-computation experts (LongCat-Flash's identity experts, Zaya's skip class: the last ids of
    the n) to their number (``MoELayer.n_zero_compute``; layers without any are left out); ``vocab_size`` the ids of
    its vocabulary (``None``: not recorded, as in an import-trace manifest written before it was)."""

    num_layers: int
    moe: dict[int, tuple[int, int]] = field(default_factory=dict)
    source: str = ""
    zero: dict[int, int] = field(default_factory=dict)
    vocab_size: int | None = None

    @classmethod
    def from_config(cls, name: str) -> "ModelShape":
        """The shape of ``name`` (a model name, an embedded model, a folder with a ``config.json``)."""
        import torch

        from ..adapters import find_moe_layers
        from ..configs import text_config
        from ..loading import load_config, model_from_config

        config, _, _ = load_config(name)  # a bad name fails before torch builds anything
        with torch.device("meta"):
            model = model_from_config(config)
        layers = find_moe_layers(model)
        n_layers = getattr(text_config(config), "num_hidden_layers", None)
        if n_layers is None or getattr(config, "is_encoder_decoder", False):
            raise MoetoolError(f"--config {name}: a decoder-only model with num_hidden_layers is needed (an engine's "
                               f"dump numbers its decoder layers)")
        vocab = getattr(text_config(config), "vocab_size", None) or getattr(config, "vocab_size", None)
        return cls(int(n_layers), {L.index: (int(L.n_experts), int(L.top_k)) for L in layers}, name,
                   {L.index: int(L.n_zero_compute) for L in layers if L.n_zero_compute},
                   int(vocab) if vocab else None)

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> "ModelShape":
        return cls(int(d["num_layers"]), {int(k): (int(v[0]), int(v[1])) for k, v in d["moe"].items()},
                   d.get("source", ""), {int(k): int(v) for k, v in (d.get("zero_compute") or {}).items()},
                   int(d["vocab_size"]) if d.get("vocab_size") else None)

    def to_manifest(self) -> dict[str, Any]:
        return {"source": self.source, "num_layers": self.num_layers,
                "moe": {str(k): list(v) for k, v in sorted(self.moe.items())},
                **({"zero_compute": {str(k): v for k, v in sorted(self.zero.items())}} if self.zero else {}),
                **({"vocab_size": self.vocab_size} if self.vocab_size else {})}

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.moe)

    def top_k(self) -> int:
        """The one top-K of the MoE layers (a dump has one K per token); layers of different K are refused."""
        ks = {k for _, k in self.moe.values()}
        if len(ks) != 1:
            raise MoetoolError(f"{self.source}: MoE layers of different top-K {sorted(ks)}: not supported in a dump")
        return ks.pop()

    def n_experts(self, layer: int) -> int:
        return self.moe[layer][0]

    def check_token_ids(self, ids: Any, what: str) -> None:
        """One line where a token id (``-1``: none recorded) is beyond the model's vocabulary: the routing of another
        model's tokens (a dump of a model of the same layers and experts but another tokenizer)."""
        import numpy as np

        ids = np.asarray(ids)
        if self.vocab_size and ids.size and int(ids.max()) >= self.vocab_size:
            raise MoetoolError(f"{what}: token id {int(ids.max())} is outside the {self.vocab_size:,} ids of the "
                               f"vocabulary of {self.source}: the routing of another model's tokens")

    def n_zero_compute(self, layer: int) -> int:
        """Zero-computation experts of MoE layer ``layer`` (the last ids), 0 without."""
        return self.zero.get(layer, 0)
