"""Policies whose weights sum to one keep the model's routed-output scale (DeepSeek's routed_scaling_factor)."""

import pytest
import torch

from conftest import captured
from moetool.policies import make_policy


@pytest.mark.parametrize("spec,opts", [("norm:gate", {"weights": "softmax"}), ("norm:up", {"weights": "uniform"}),
                                       ("random", {}), ("similarity", {})])
@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "deepseek_v2"])
def test_policy_weights_sum_like_the_models_own(model_type, spec, opts):
    model, layers, events = captured(model_type)
    ev = next(iter(events.values()))
    idx, w = make_policy(spec, **opts).select(ev)
    cfg = model.config
    # what the model's own weights sum to for a renormalised set: the routed scaling factor (DeepSeek) or 1
    expected = getattr(cfg, "routed_scaling_factor", 1.0) if model_type.startswith("deepseek") else 1.0
    assert torch.allclose(w.sum(-1).float(), torch.full((w.shape[0],), float(expected)), atol=1e-5)
    if model_type == "deepseek_v3":  # the model's own weights (norm_topk_prob) sum to the same
        assert torch.allclose(ev.weights.sum(-1).float(), torch.full((w.shape[0],), float(expected)), atol=1e-5)
