"""Describe a model's MoE structure from its config alone (built on the meta device)."""

from __future__ import annotations

from typing import Any


def describe_layers(model: Any, layers: list) -> dict[str, Any]:
    """Structure and parameter counts of an instantiated model (real or meta)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    rows = []
    for L in layers:
        ep = sum(p.numel() for p in L.experts.parameters())
        inactive += ep * (L.n_experts - L.top_k) // L.n_experts
        rows.append({**L.describe(), "expert_params": ep})
    moe = {L.index for L in layers}
    n_layers = int(getattr(model.config, "num_hidden_layers", len(rows)))
    return {"model_type": model.config.model_type, "num_layers": n_layers, "moe_layers": rows,
            "dense_layers": [i for i in range(n_layers) if i not in moe],
            "total_params": int(total), "active_params": int(total - inactive)}


def describe_model(name: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from .adapters import find_moe_layers, get_adapter
    from .loading import load_config

    config, source, kind = load_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    info = describe_layers(model, find_moe_layers(model))
    return {"name": name, "source": source, "kind": kind, "family": get_adapter(config).family, **info}
