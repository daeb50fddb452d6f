"""Tensors moetool makes without ``device=`` land off the model's device, proven without a GPU.

On a GPU the model's weights, activations and routing are on CUDA, while ``torch.zeros`` / ``arange`` / ``tensor``
/ ``full`` ... called without ``device=`` make a CPU tensor; an operation mixing the two raises (the first H100 run
failed 67 tests so). Here the model stays on the CPU and ``MetaDefault`` moves the *default* device instead: a
factory moetool's own code calls without ``device=`` (the innermost frame that is not torch's is moetool's) makes a
``meta`` tensor, so mixing it with the model's CPU tensors raises as CUDA would ("Tensor on device meta is not on
the expected device cpu"), and reading it (``tolist``, ``numpy``, ``.to(<device>)``) raises too. Torch itself lets
one mix pass: a CPU tensor indexed by a meta index returns uninitialised values without a word (CUDA moves a host
index, with a sync), so the mode stops any operation where a meta tensor meets a real one.

Left alone, as on a GPU: a factory transformers calls (plain ``torch.set_default_device("meta")`` breaks the model's
own forward: the host tensors it moves with ``.to()`` hold no data on meta); a 0-dim result (a CPU scalar tensor,
which CUDA accepts in an operation with its tensors); ``out=``; ``torch.tensor`` / ``as_tensor`` of a tensor (its
device). Host tensors moetool makes on purpose (tables, accumulators moved to the device at their first use, CPU
generators' draws, the packed rows' ids) say ``device="cpu"``: the tensor a GPU run makes, explicitly.

Complements ``tests/test_device_placement.py`` (a taint of the device side, every operation under a Python mode):
this mode intercepts every call too but looks only at factories and meta tensors, so it runs every routing policy on
every family, every experiment of the registry on both embedded models and some options' branches in ~45 s on two
cores, and what it finds raises torch's own error. ``torch.from_numpy`` is not a device factory (torch's overrides
ignore it): its host tensors are the taint's to see.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, build_tiny_model, padded_batch
import test_host_sync
from test_host_sync import FORWARD_EXPERIMENTS, POLICY_SPECS, attention_for, run_experiment
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import moetool
from moetool.adapters import find_moe_layers
from moetool.engine import Engine
from moetool.errors import MoetoolError
from moetool.policies import make_policy

pytestmark = pytest.mark.slow  # tiers: pytest -m 'not slow' (forwards under a Python-level mode, 1-4 s a test)
PKG = Path(moetool.__file__).parent
embedded = test_host_sync.embedded  # both embedded models and their tokens, once per module
TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
FACTORIES = _device_constructors()
#: factories whose result stays on a tensor argument's device when no device is given (a GPU's default is not used)
KEEPS_DEVICE = {torch.tensor, torch.as_tensor, torch.asarray}
#: moves between devices (a meta tensor cannot be copied out: they raise by themselves)
MOVES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.cuda}


def _tensors(x, out: list) -> list:
    for y in x:
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (list, tuple)):
            _tensors(y, out)
    return out


def _ours() -> str | None:
    """``file:line`` of the frame that called the factory when it is moetool's (torch's own Python frames are
    skipped: ``torch.functional.meshgrid`` called by moetool is moetool's call), else None."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(TORCH_DIR):
        f = f.f_back
    if f is None:
        return None
    path = Path(f.f_code.co_filename)
    return f"{path.relative_to(PKG.parent)}:{f.f_lineno}" if PKG in path.parents else None


class MetaDefault(TorchFunctionMode):
    """The default device of moetool's factories is ``meta`` (see the module); ``made`` lists where each was made."""

    def __init__(self):
        super().__init__()
        self.made: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and kwargs.get("out") is None and not (
                func in KEEPS_DEVICE and args and isinstance(args[0], torch.Tensor)) and (site := _ours()):
            out = func(*args, **{**kwargs, "device": "meta"})
            if out.dim() > 0:
                self.made.add(site)
                return out
        elif func not in MOVES:
            ts = _tensors(args, _tensors(kwargs.values(), []))
            if any(t.is_meta for t in ts) and not all(t.is_meta for t in ts):
                # torch indexes a CPU tensor with a meta index without a word (uninitialised values): CUDA moves a
                # host index, with a sync; here any meta tensor meeting a real one stops
                raise RuntimeError(f"{getattr(func, '__name__', func)}: a tensor on device meta meets one on "
                                   f"{next(t.device for t in ts if not t.is_meta)}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_default():
    mode = MetaDefault()
    try:
        with mode:
            yield mode
    except (RuntimeError, NotImplementedError, TypeError) as e:  # where it failed, where its meta tensors came from
        ours = [f"{Path(fr.filename).relative_to(PKG.parent)}:{fr.lineno}"
                for fr in traceback.extract_tb(e.__traceback__) if PKG in Path(fr.filename).parents]
        raise AssertionError(f"{type(e).__name__}: {e}\nat {ours[-1] if ours else '?'}; moetool's factories "
                             f"without device= used: {sorted(mode.made)}") from e


def _as_ours(body: str):
    """``bad(ev)`` compiled as if written in moetool's own code (engine/hooks.py): the frame walk blames it."""
    scope = {"torch": torch}
    exec(compile(f"def bad(ev):\n    h = ev.h.reshape(-1, ev.h.shape[-1])\n    {body}\n",
                 str(PKG / "engine" / "hooks.py"), "exec"), scope)
    return scope["bad"]


@pytest.mark.parametrize("body", ["h + torch.zeros(h.shape[-1])",  # a bias made on the host
                                  "torch.cat([ev.idx, torch.zeros(ev.idx.shape, dtype=ev.idx.dtype)])",
                                  "h[torch.arange(2)]"])  # a host index: torch would index with meta silently
def test_the_stand_in_catches_a_host_tensor_meeting_the_model(body):
    """Positive control: a consumer of moetool's mixing a tensor made without ``device=`` with the router's input or
    choice stops, blamed on its line; one made with ``device=h.device``, a 0-dim scalar, and the model's own forward
    (transformers' factories) do not."""
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)
    seen = []

    def good(ev):
        h = ev.h.reshape(-1, ev.h.shape[-1])
        seen.append(h[torch.arange(2, device=h.device)] + torch.zeros(h.shape[-1], device=h.device)
                    + torch.tensor(1.0))

    with meta_default(), torch.no_grad(), Engine(model, layers, consumers=[good]):
        assert model(**padded_batch()).logits.isfinite().all() and seen
    with pytest.raises(AssertionError, match="(?s)device meta.*at moetool/engine/hooks.py:3.*used: "
                                             r"\['moetool/engine/hooks.py:3'\]"), \
            meta_default(), torch.no_grad(), Engine(model, layers, consumers=[_as_ours(body)]):
        model(**padded_batch())


@pytest.mark.parametrize("spec", POLICY_SPECS + ["capture"])
def test_policies_make_their_tensors_on_the_device(spec):
    """Every policy (and the capture's routing event) on every family: finite logits under the meta default, equal
    to the run without it; a policy a family's routing cannot run is its one-line refusal."""
    ran = 0
    for family in FAMILIES:
        outs, model = [], build_tiny_model(family)
        try:
            for stand_in in (contextlib.nullcontext, meta_default):
                policy = None if spec == "capture" else make_policy(spec)
                consumer = (lambda ev: (ev.probs.sum(), ev.chosen_idx, ev.ranked)) if policy is None else None
                with attention_for(spec, model), stand_in(), torch.no_grad(), Engine(
                        model, find_moe_layers(model), policy=policy, consumers=[consumer] if consumer else []):
                    outs.append(model(**padded_batch()).logits)
        except MoetoolError:  # e.g. topk:1 on sparsemixer, prune of too many experts of a group
            continue
        assert outs[1].isfinite().all() and torch.equal(outs[0], outs[1]), family
        ran += 1
    assert ran >= len(FAMILIES) - 3


@pytest.mark.parametrize("experiment", FORWARD_EXPERIMENTS)
def test_experiments_make_their_tensors_on_the_device(experiment, embedded, monkeypatch):
    """Every experiment of the registry that runs forwards (test_host_sync's runs of them), on both embedded models,
    forwards and tables: it runs under the meta default. Module caches of tensors made for a device (approx's
    ``subset_matrix``) start empty, so they are made under the stand-in."""
    from moetool.experiments.approx import compute as approx

    monkeypatch.setattr(approx, "_SUBSETS", {})
    for name, (lm, ts) in embedded.items():
        with meta_default():
            run_experiment(experiment, lm, ts)


#: options that take branches the runs above do not (each a table or a loop of its own)
VARIANTS = {
    "erc": {},  # weights only: no tokens
    "stats": {"coactivation": "adjacent", "all_tokens": True, "top_k": 1, "bootstrap": 200},
    "placement": {"gpus": (2,), "extra_slots": (0, 1), "nodes": 2, "groups": 2, "bootstrap": 200},
}


@pytest.mark.parametrize("experiment", sorted(VARIANTS))
def test_experiment_options_make_their_tensors_on_the_device(experiment, embedded):
    """ERC (weights only), and options whose tables or loops the runs above leave out, on the tiny model."""
    from moetool.experiments.registry import EXPERIMENTS

    lm, ts = embedded["tiny"]
    run = EXPERIMENTS[experiment].load()
    with meta_default():
        run(lm, quiet=True, **VARIANTS[experiment]) if experiment == "erc" else \
            run(lm, ts, quiet=True, **VARIANTS[experiment])
