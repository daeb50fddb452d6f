"""No host tensor meets a device tensor in moetool's code, proven without a GPU (the device audit of 2026-11-30).

On a GPU the model's weights, activations and routing live on CUDA; a tensor moetool makes without ``device=``
(``torch.zeros``, ``arange``, ``tensor``, ``from_numpy``...) is on the CPU, and an operation combining the two --
or ``.numpy()`` of a CUDA tensor -- is a RuntimeError there, never seen on a CPU-only machine where both are on the
CPU. ``DeviceTaint`` (a ``TorchFunctionMode``) stands in for the device: every tensor derived from the model's
parameters and buffers, from a tensor moved with ``.to(<device>)``, or made with an explicit ``device=``, is tagged
as on the device; any other tensor is the host's. An operation moetool's code makes (the innermost non-torch frame
is moetool's, as ``test_host_sync._site`` tells it) that mixes a device tensor with a host tensor of one element or
more (a 0-dim CPU tensor is a scalar CUDA accepts), or reads a device tensor with ``.numpy()``, is recorded with
its file, function and line. It runs the real computation, over every routing policy on every family in bf16 and
over every experiment's forwards, so the runs also show each path works in bf16 (numpy has no bf16).

What a CPU cannot tell: a branch chosen by ``t.device.type == "cpu"`` (or ``a.device != b.device``) takes its CPU
side here, which CUDA never takes; those functions are listed in ``CPU_BRANCHES`` with the line that keeps CUDA
off them.
"""

from __future__ import annotations

import copy
import functools
import traceback
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, build_tiny_model, padded_batch
from test_host_sync import PKG, POLICY_SPECS, TESTS, TORCH_PKG
from torch.overrides import TorchFunctionMode

from moetool.adapters import find_moe_layers
from moetool.engine import Engine

pytestmark = pytest.mark.slow  # tiers: pytest -m 'not slow' (each test runs forwards under a Python-level mode)
T = torch.Tensor
#: (file, function) -> why its host tensors never meet a device tensor on a GPU (the branch a CPU takes instead)
CPU_BRANCHES = {
    ("moetool/formats.py", "decode_bytes"): "the numpy byte table only for _bytes_on_host(codes) (CPU codes)",
    ("moetool/formats.py", "dequantize_fp8"): "decode_bytes' fp32 values only for _bytes_on_host(codes)",
    ("moetool/sketch.py", "add"): "QuantileSketch.add moves its counters when self.counts.device != x.device",
    ("moetool/experiments/approx/compute.py", "subset_matrix"): "built on the host (device=idx.device of a host "
                                                                 "idx), then moved by ops.to_device",
}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.eye, torch.rand,
              torch.randn, torch.randint, torch.linspace, torch.logspace, torch.as_tensor, torch.randperm}
_NEUTRAL = {"tolist", "item", "pin_memory", "__bool__", "__float__", "__int__", "__index__", "__len__", "__repr__",
            "__format__", "size", "dim", "numel", "is_floating_point", "element_size", "stride", "is_contiguous",
            "data_ptr", "__hash__", "copy_", "__setitem__"}


def _tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and (isinstance(t, torch.nn.Parameter) or getattr(t, "_on_device", False))


def put_on_device(x) -> None:
    for t in _tensors(x, []):
        try:
            t._on_device = True
        except (AttributeError, RuntimeError):  # some C++-made tensors take no attribute: left the host's
            pass


def _site(stack=None):
    """``(file, function, line)`` of the innermost moetool frame, or None when the innermost frame that is neither
    torch's nor a test's is not ours (as ``test_host_sync._site``) or a moetool frame of the stack is one of
    :data:`CPU_BRANCHES`."""
    stack = traceback.extract_stack()[:-3] if stack is None else stack
    ours = [(str(Path(fr.filename).relative_to(PKG.parent)), fr.name) for fr in stack
            if PKG in Path(fr.filename).parents]
    if any(f in CPU_BRANCHES for f in ours):
        return None
    for fr in reversed(stack):
        path = Path(fr.filename)
        if PKG in path.parents:
            return str(path.relative_to(PKG.parent)), fr.name, fr.lineno
        if TORCH_PKG not in path.parents and TESTS not in path.parents and "site-packages" in path.parts:
            # the model's own code (transformers): a device tensor of ours it combines with its own is right on a
            # GPU; a host tensor moetool handed it (a policy's choice, a hook's output) is not
            return f"model code: {path.name}", fr.name, fr.lineno
    return None


class DeviceTaint(TorchFunctionMode):
    """Record every operation of moetool's code that mixes a device tensor with a host one (see the module)."""

    def __init__(self):
        super().__init__()
        self.hits: set[tuple[str, str, int, str]] = set()  # (file, function, line, what)

    def hit(self, what: str) -> None:
        site = _site()
        if site:
            self.hits.add((*site, what))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        ts = _tensors(list(args), []) + _tensors(list(kwargs.values()), [])
        if name in ("numpy", "__array__"):
            if ts and on_device(ts[0]):
                self.hit(f".{name}() of a device tensor {tuple(ts[0].shape)}")
            return out
        if name == "cpu" or (name == "to" and kwargs.get("device", args[1] if len(args) > 1 else None) == "cpu"):
            # on the CPU .cpu() is the tensor itself: the host's copy is a fresh alias, the original stays tagged
            return out.detach().view_as(out) if isinstance(out, torch.Tensor) and out is args[0] else out
        if name in ("to", "cuda"):
            dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            like = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if isinstance(dev, torch.device) or (dev is not None and dev != "cpu") or on_device(like) \
                    or (dev is None and like is None and on_device(args[0])) or name == "cuda":
                if out is args[0] and not on_device(out):  # on the CPU a move is the tensor itself: the copy a
                    out = out.view_as(out)  # GPU makes is an alias here, the host's tensor stays the host's
                put_on_device(out)
            return out
        if name in _NEUTRAL:
            return out
        if func in _FACTORIES or name.endswith("_like") or name.startswith("new_"):
            dev = kwargs.get("device")
            if (dev is not None and dev != "cpu") or (func not in _FACTORIES and ts and on_device(ts[0])) \
                    or (func in _FACTORIES and any(on_device(t) for t in ts)):
                put_on_device(out)
            return out
        dev = [t for t in ts if on_device(t)]
        if dev:
            host = [t for t in ts if not on_device(t) and t.dim() > 0]
            if host:
                self.hit(f"{name}: device {tuple(dev[0].shape)} with host {tuple(host[0].shape)}")
            put_on_device(out)
        return out


def forward(model, policy=None, consumers=()):
    """``test_host_sync.forward`` with the batch on the stand-in device (as the runner moves it)."""
    batch = padded_batch()
    put_on_device(list(batch.values()))
    with torch.no_grad(), Engine(model, find_moe_layers(model), policy=policy, consumers=consumers):
        return model(**batch).logits


def run_on_device(model, fn):
    """``fn()`` with ``model``'s parameters and buffers on the stand-in device: ``(result, hits)``."""
    put_on_device(list(model.buffers()))
    mode = DeviceTaint()
    with mode:
        out = fn()
    return out, mode.hits


def test_the_stand_in_catches_host_tensors_meeting_device_ones():
    """Positive control: a consumer adding a host tensor to the router input, reading the routing with numpy and
    concatenating a host index table to it is caught at each kind; the model's own forward, moetool's capture, and a
    host tensor moved with ``.to(h.device)`` first are not."""
    model = build_tiny_model("mixtral")

    def offender(ev):
        h = ev.h.reshape(-1, ev.h.shape[-1])
        h + torch.zeros(h.shape[-1])  # a bias made on the host
        ev.probs.numpy()
        torch.cat([ev.idx, torch.zeros(ev.idx.shape, dtype=ev.idx.dtype)])
        h + torch.zeros(h.shape[-1]).to(h.device)  # moved first: fine
        h + torch.zeros(h.shape[-1], device=h.device)  # made there: fine
        h * torch.tensor(2.0)  # a 0-dim host tensor: a scalar CUDA accepts

    _, hits = run_on_device(model, lambda: forward(model, consumers=[offender]))
    assert sorted(w for *_, w in hits) == [".numpy() of a device tensor (20, 8)", "add: device (20, 128) with host "
                                           "(128,)", "cat: device (20, 2) with host (20, 2)"], hits
    assert all(f == "moetool/engine/hooks.py" for f, *_ in hits)  # blamed on the caller of the consumer
    out, hits = run_on_device(model, lambda: forward(model, consumers=[lambda ev: (ev.probs, ev.ranked)]))
    assert not hits and out.isfinite().all()


SPECS = POLICY_SPECS + ["capture"]


@functools.lru_cache(maxsize=None)
def bf16_model(family: str) -> torch.nn.Module:
    """A bf16 copy of the family's cached tiny model, made once per process for every policy (``Module.to`` converts
    in place: converting the cached model itself left it bf16 for every later test of the process)."""
    return copy.deepcopy(build_tiny_model(family)).to(torch.bfloat16)


@pytest.mark.parametrize("spec", SPECS)
def test_policies_keep_host_tensors_off_the_device_in_bf16(spec):
    """Every policy (and the capture) on every family's tiny model in bf16: finite logits, no host tensor meeting
    a device one; a policy a family's routing cannot run is its one-line refusal."""
    from moetool.errors import MoetoolError
    from moetool.policies import make_policy

    hits, ran = set(), 0
    for family in FAMILIES:
        model = bf16_model(family)
        impl = model.config._attn_implementation
        if spec == "attention":
            model.config._attn_implementation = "eager"
        try:
            policy = None if spec == "capture" else make_policy(spec)
            consumers = [lambda ev: (ev.probs, ev.chosen_idx, ev.ranked)] if policy is None else []
            out, h = run_on_device(model, lambda: forward(model, policy, consumers))
            assert out.isfinite().all(), family
            hits |= {(family, *k) for k in h}
            ran += 1
        except MoetoolError:  # e.g. topk:1 on sparsemixer, prune of too many experts of a group
            pass
        finally:
            model.config._attn_implementation = impl
    assert ran >= len(FAMILIES) - 3 and not hits, sorted(hits)


@pytest.fixture(scope="module")
def embedded_bf16():
    from moetool.data import load_tokens
    from moetool.loading import load

    out = {}
    for name in ("tiny", "tiny-fine"):
        lm = load(name, dtype="bf16")
        out[name] = (lm, load_tokens(None, lm.tokenizer, 32, 96))
    return out


def _forward_experiments():
    from test_host_sync import FORWARD_EXPERIMENTS

    return FORWARD_EXPERIMENTS


@pytest.mark.parametrize("experiment", _forward_experiments())
def test_experiments_keep_host_tensors_off_the_device_in_bf16(experiment, embedded_bf16, monkeypatch):
    """Every experiment of the registry that runs forwards (test_host_sync's runs of them), on both embedded models
    in bf16: no host tensor meets a device one, in the forward or in the tables built after it. Module caches of
    tensors made for a device (approx's ``subset_matrix`` per ``(n, k, device)``) start empty, so the stand-in sees
    them made and moved there: one an earlier test of the worker filled outside the stand-in reads as the host's."""
    from test_host_sync import run_experiment

    from moetool.experiments.approx import compute as approx

    monkeypatch.setattr(approx, "_SUBSETS", {})
    hits = set()
    for name, (lm, ts) in embedded_bf16.items():
        _, h = run_on_device(lm.model, lambda: run_experiment(experiment, lm, ts))
        hits |= {(name, *k) for k in h}
    assert not hits, sorted(hits)
