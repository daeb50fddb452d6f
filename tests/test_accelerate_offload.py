"""Offloaded layers (accelerate ``cpu_offload``, the same hooks as ``device_map`` with CPU/disk offload): the engine
gives the unhooked model's numbers, and a probe reuses the expert weights the layer's own forward brought in
instead of moving them a second time."""

from __future__ import annotations

import copy

import accelerate.hooks as acc_hooks
import pytest
import torch
from conftest import build_tiny_model

from moetool.adapters import find_moe_layers
from moetool.engine import Engine
from moetool.engine.hooks import offloaded
from moetool.policies import build_policy


def loads_of_experts(monkeypatch, layers) -> dict[int, int]:
    """Counts, per MoE layer, accelerate's moves of the experts module's parameters to the execution device."""
    counts: dict[int, int] = {}
    index = {id(L.experts): L.index for L in layers}
    real = acc_hooks.set_module_tensor_to_device

    def counting(module, name, device, *args, **kwargs):
        if id(module) in index and device is not None and torch.device(device).type != "meta":
            counts[index[id(module)]] = counts.get(index[id(module)], 0) + 1
        return real(module, name, device, *args, **kwargs)

    monkeypatch.setattr(acc_hooks, "set_module_tensor_to_device", counting)
    return counts


@pytest.mark.parametrize("fam", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("spec", ["norm:gate", "norm:output", "router"])
@pytest.mark.slow
def test_offloaded_probe_reuses_the_forward_weights(fam, spec, monkeypatch):
    from accelerate import cpu_offload

    model = copy.deepcopy(build_tiny_model(fam)).eval()  # the builder caches: never offload the shared one
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Engine(model, find_moe_layers(model), policy=build_policy(spec)):
        want = model(input_ids=ids).logits
    cpu_offload(model, execution_device="cpu")
    layers = find_moe_layers(model)
    assert all(offloaded(L.experts) for L in layers)
    assert all(p.device.type == "meta" for L in layers for p in L.experts.parameters(recurse=False))
    # what one forward of the layer costs by itself: the moves of the unhooked model
    counts = loads_of_experts(monkeypatch, layers)
    with torch.no_grad():
        model(input_ids=ids)
    per_forward = dict(counts)
    assert per_forward and set(per_forward) == {L.index for L in layers}
    counts.clear()
    with torch.no_grad(), Engine(model, layers, policy=build_policy(spec)):
        got = model(input_ids=ids).logits
    assert counts == per_forward  # the probe moved nothing more
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the hooks are gone after the block: accelerate's own pre_forward again, unhooked logits unchanged
    assert all("pre_forward" not in vars(L.experts._hf_hook) for L in layers)
