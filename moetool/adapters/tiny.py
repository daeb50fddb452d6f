"""Tiny random models of any MoE family of the installed transformers (tests, ``inspect --families``)."""

from __future__ import annotations

from typing import Any

from . import find_moe_layers
from .discovery import MAX_TINY_PARAMS, model_class, tiny_config
from .generic import ONE_CENTRED, hash_table, random_table

#: routers are re-drawn at this scale so top-K has no ties (logits ~ N(0, ~1) on unit-RMS inputs of width 64)
ROUTER_STD, BIAS_STD, EXPERT_BIAS_STD = 0.15, 0.05, 0.1


def build_tiny(model_type: str, seed: int = 0, redraw: bool = True) -> Any:
    """A random fp32 eval model of ``tiny_config(model_type)``.

    ``redraw``: every floating parameter and buffer of each MoE layer's router (correction biases at a smaller
    scale) and the experts' biases are re-drawn, seeded: random init leaves some at zero or near-uniform, which
    makes top-K a matter of ties. Needs an adapter for the family (``find_moe_layers``).
    """
    import torch

    config, cls = tiny_config(model_type), model_class(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls.from_config(config).parameters())
    if n > MAX_TINY_PARAMS:
        raise ValueError(f"{model_type}: the shrunk config still has {n:,} parameters (> {MAX_TINY_PARAMS:,})")
    torch.manual_seed(seed)
    model = cls.from_config(config).float().eval()
    if redraw:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for L in find_moe_layers(model):
                for name, t in [*L.router.named_parameters(), *L.router.named_buffers()]:
                    if t.is_floating_point():
                        std = BIAS_STD if "correction" in name else ROUTER_STD
                        t.copy_(torch.randn(t.shape, generator=gen) * std + (name in ONE_CENTRED))
                table = hash_table(L.router)
                if table is not None:  # a hash router's token -> experts table (zeros at init: every token alike)
                    table.copy_(random_table(tuple(table.shape), L.n_experts, gen))
                post = L.post_step()  # a bias the block adds after the experts (jetmoe) too
                for name, t in [*L.experts.named_parameters(), *(post.named_parameters() if post else [])]:
                    if name.endswith("bias"):
                        t.copy_(torch.randn(t.shape, generator=gen) * EXPERT_BIAS_STD)
    return model
