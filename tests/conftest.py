"""Shared fixtures: tiny random models of every supported family, a padded batch, and an
independent per-expert reference computed straight from each family's raw parameters."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

if os.environ.get("MOETOOL_TEST_DEVICE", "").lower() == "cpu":  # a CUDA machine told to test the CPU path: hide
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the GPU before torch starts, so --device auto in the CLI agrees

import pytest
import torch
import torch.nn.functional as F

from moetool.adapters import ADAPTERS, find_moe_layers
from moetool.engine import Engine

# tiny models gain nothing from intra-op threads, and on a shared 2-core machine they spin and wait
torch.set_num_threads(1)

# ----- the device the suite runs on ------------------------------------------------------------------------------
#: where the tests' models, inputs and references go: where ``--device auto`` (the CLI's and ``moetool.load``'s
#: default) puts a model -- CUDA when present, else the CPU (CI). ``MOETOOL_TEST_DEVICE=cpu`` tests the CPU path on a
#: CUDA machine (the GPU is hidden above, so the CLI agrees); any other value must be where ``auto`` lands.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if os.environ.get("MOETOOL_TEST_DEVICE", "").lower() not in ("", "cpu", DEVICE.type):
    raise RuntimeError(f"MOETOOL_TEST_DEVICE={os.environ['MOETOOL_TEST_DEVICE']} but --device auto picks {DEVICE}")
ON_CUDA = DEVICE.type == "cuda"
# references in exact fp32: TF32 off (torch's default for matmuls; cuDNN's is on)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
#: fp32 results of one computation through two code paths on the suite's device: CPU kernels give bit-identical or
#: 1e-6-close values here; CUDA's GEMM kernels differ with the operands' shapes and layouts (a batch of 8 rows vs
#: one of 1, a fused bias, a transposed weight), so their fp32 sums legitimately differ in the last bits -- a few
#: ulps of the largest partial sum. The one place where a test's fp32 tolerance depends on the device.
FP32_RTOL, FP32_ATOL = (2e-5, 2e-6) if ON_CUDA else (1e-6, 1e-7)


def feed(model, ids: torch.Tensor, mask: torch.Tensor | None = None, **kwargs):
    """``model(input_ids=ids, attention_mask=mask, **kwargs)`` with the inputs on the model's device (a test builds
    them on the CPU; ``--device auto`` may have put the model on CUDA)."""
    dev = next(model.parameters()).device
    if mask is not None:
        kwargs["attention_mask"] = mask.to(dev)
    return model(input_ids=ids.to(dev), **kwargs)

#: every registered model type that is a family of its own (aliases such as minimax excluded)
FAMILIES = [mt for mt in ADAPTERS.names() if ADAPTERS.get(mt).family == mt]

SEED = 0
ROUTER_STD = 0.1  # logits ~ N(0, ~1.1) on unit-RMS router inputs of width 128: no ties, varied top-k
BIAS_STD = 0.05  # e_score_correction_bias: moves some choices off the plain sigmoid top-k
EXPERT_BIAS_STD = 0.1


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test its own moetool cache (``inspect --families``' table): no test reads another's or the user's."""
    monkeypatch.setenv("MOETOOL_CACHE_DIR", str(tmp_path_factory.mktemp("moetool-cache")))


@pytest.fixture
def no_figures(monkeypatch):
    """The runs of a test that compares tables draw no figure (``MOETOOL_FIGURES=none``): drawing and saving them
    is most of a small run's time, and the figures are the commands' own tests' to check."""
    monkeypatch.setenv("MOETOOL_FIGURES", "none")


@pytest.fixture
def cli(monkeypatch, capfd):
    """``cli(*args)`` -> ``moetool ARGS`` as ``python -m moetool`` runs it (the console script's ``main``: its exit
    code, one-line errors, stdout and stderr), in this process: for tests of what a command answers, not of a start of
    python (a fresh one importing torch and transformers cost 1-9 s of CPU a call). Output is captured at the file
    descriptors (a library's log handler bound to the original stderr is caught too), and each Python warning the
    call raised is on its stderr as python would print it (pytest records warnings instead)."""
    import sys
    import types
    import warnings

    import moetool.commands.app as app_module

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", ["moetool", *args])
        capfd.readouterr()
        with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as e:
            warnings.filterwarnings("ignore", category=PendingDeprecationWarning)  # as python's default filters
            app_module.main()
        out = capfd.readouterr()
        err = out.err + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
        return types.SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=err)

    return run


#: every test this session collected, before ``-m``/``-k``/``--deselect`` leave some out (tests/test_readme.py counts
#: the suite's tiers from it instead of collecting the whole suite again)
COLLECTED = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """A module naming ``XDIST_GROUP_BY = "<param>"`` (a module-scoped fixture parametrized by it) has the tests of
    each value run in one xdist worker: the fixture's value (e.g. a rule's model, built, saved and run by plain
    transformers) is then made once, not once per worker that runs some of its tests. Also keeps the collected
    items (:data:`COLLECTED`; tryfirst: before any deselection)."""
    config.stash[COLLECTED] = list(items)
    for item in items:
        by, spec = getattr(getattr(item, "module", None), "XDIST_GROUP_BY", None), getattr(item, "callspec", None)
        if by and spec is not None and by in spec.params:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{spec.params[by]}"))


#: ``len(sys.modules)`` when the session's objects were last frozen (:func:`freeze_what_lives_on`)
_FROZEN_AT = [0]


def freeze_what_lives_on() -> None:
    """Take what the session holds now out of the cyclic collector's view (``gc.collect()`` first, then
    ``gc.freeze()``: only objects alive now, the garbage freed). Torch, transformers, the families' modeling modules
    and pytest's own objects (~300k after collection, as many again from the modules the first tests import) live
    to the session's end; scanned at every full collection -- Python's own, and each ``gc.collect()`` a run makes
    between loads (agreement's three per run) -- they cost 0.25 s a scan on this machine."""
    import gc
    import sys

    gc.collect()
    gc.freeze()
    _FROZEN_AT[0] = len(sys.modules)


def pytest_collection_finish(session):
    freeze_what_lives_on()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Again after a test that imported 100 modules or more (the first runs of each kind of model or command):
    modules stay, so what they hold is frozen as well (once per such test, not per test)."""
    import sys

    if len(sys.modules) - _FROZEN_AT[0] >= 100:
        freeze_what_lives_on()


def pytest_generate_tests(metafunc):
    """Any test taking a ``family`` argument runs once per family."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", FAMILIES)


def longcat_unsorted_router_model(rows: int, gen: torch.Generator) -> tuple[torch.nn.Module, list, torch.Tensor]:
    """A tiny LongCat-Flash (12 routed + 4 identity experts, top-4) whose routers return their top-K unsorted
    (``topk(sorted=False)``; on CPU at K = 4 the largest is often not first), with random router weights and
    correction biases from ``gen``: ``(model, routers, ids [rows, 20])``. A fresh model per call (not cached)."""
    from moetool.adapters.discovery import model_class, tiny_config

    cfg = tiny_config("longcat_flash")
    cfg.n_routed_experts, cfg.zero_expert_num, cfg.moe_topk = 12, 4, 4
    torch.manual_seed(0)
    model = model_class("longcat_flash").from_config(cfg).float().eval()
    routers = [layer.mlp.router for layer in model.model.layers]
    with torch.no_grad():
        for r in routers:
            r.classifier.weight.copy_(torch.randn(r.classifier.weight.shape, generator=gen) * 0.15)
            r.e_score_correction_bias.copy_(torch.randn(r.e_score_correction_bias.shape, generator=gen) * 0.05)
    return model, routers, torch.randint(3, 30, (rows, 20), generator=gen)


def router_outputs(model: torch.nn.Module, routers: list, ids: torch.Tensor, mask: torch.Tensor) -> dict[int, Any]:
    """One plain forward of ``ids`` (``mask``) with a forward hook on each of ``routers``: ``{position: its output}``
    (transformers' own router outputs, no moetool hook)."""
    seen: dict[int, Any] = {}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return seen


@functools.lru_cache(maxsize=None)
def build_tiny_model(model_type: str, **config: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config())``, seeded, fp32, eval, routing made non-degenerate;
    ``config``: attributes of the tiny config set first (``n_routed_experts=16``).

    Random init leaves some routers (and gpt-oss expert biases, DeepSeek's correction bias) at zero
    or near-uniform, which makes top-k a matter of ties; re-draw them, seeded.
    """
    from transformers import AutoModelForCausalLM

    cfg = ADAPTERS.get(model_type).tiny_config()
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for layer in find_moe_layers(model):
            for name, t in [*layer.router.named_parameters(), *layer.router.named_buffers()]:
                std = BIAS_STD if name == "e_score_correction_bias" else ROUTER_STD
                t.copy_(torch.randn(t.shape, generator=gen) * std)
            for name, t in layer.experts.named_parameters():
                if name.endswith("bias"):
                    t.copy_(torch.randn(t.shape, generator=gen) * EXPERT_BIAS_STD)
    return model


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(model_type)`` -> the session's cached tiny model of that family."""
    return build_tiny_model


def padded_batch(batch: int = 2, seq: int = 10, pad: int = 3) -> dict[str, torch.Tensor]:
    """Random ids; the second row is left-padded with ``pad`` masked positions."""
    gen = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(3, 1024, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="session")
def batch() -> dict[str, torch.Tensor]:
    return padded_batch()


def run(model, layers, inputs, policy=None, policy_layers=None, experts_out: dict | None = None):
    """One forward under an :class:`Engine`; returns ``(logits, {layer index: event}, engine)``.

    ``experts_out``, if given, receives each layer's actual experts-module output (a forward hook).
    """
    events, handles = {}, []
    if experts_out is not None:
        for L in layers:
            handles.append(L.experts.register_forward_hook(
                lambda m, a, out, i=L.index: experts_out.__setitem__(i, out)))
    try:
        with torch.no_grad(), Engine(model, layers, policy=policy, policy_layers=policy_layers,
                                     consumers=[lambda ev: events.__setitem__(ev.layer.index, ev)]) as eng:
            logits = model(**inputs).logits
    finally:
        for h in handles:
            h.remove()
    return logits, events, eng


@functools.lru_cache(maxsize=None)
def captured(model_type: str):
    """Layers and routing events of the padded batch through the tiny model (plain capture)."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    _, events, _ = run(model, layers, padded_batch())
    return model, layers, events


def hand_ppl(model, tokens, batch_size: int = 8):
    """Plain forwards (no hooks) and my own next-token cross-entropy over real token pairs."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, tokens.input_ids.shape[0], batch_size):
            ids, mask = tokens.input_ids[s:s + batch_size], tokens.attention_mask[s:s + batch_size]
            logp = F.log_softmax(feed(model, ids, mask).logits.float(), dim=-1).cpu()
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1] - 1):
                    if mask[b, t] and mask[b, t + 1]:
                        total -= float(logp[b, t, ids[b, t + 1]])
                        count += 1
    return math.exp(total / count), count


def reference_expert(model_type: str, layer, e: int, h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every probe node of expert ``e`` for tokens ``h [T, d]``, from the raw parameters (no adapter)."""
    ex = layer.experts
    if model_type == "gpt_oss":  # x @ W, gate/up interleaved, biases, clamped SwiGLU
        gate_up = h @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        g = gate.clamp(max=ex.limit)
        act = g * torch.sigmoid(g * ex.alpha)
        glu = act * (up.clamp(-ex.limit, ex.limit) + 1)
        out = glu @ ex.down_proj[e] + ex.down_proj_bias[e]
    else:  # the common layout: gate_up_proj [E, 2I, H], gate first; down_proj [E, H, I]; silu
        assert layer.config.hidden_act == "silu"
        gate, up = F.linear(h, ex.gate_up_proj[e]).chunk(2, dim=-1)
        act = F.silu(gate)
        glu = act * up
        out = F.linear(glu, ex.down_proj[e])
    return {"gate": gate, "up": up, "act": act, "glu": glu, "output": out}


def reference_moe(model_type: str, layer, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_k E_{idx_k}(h)`` per token, one expert at a time (the test's own loop)."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(idx.shape[1]):
            out[t] += w[t, k] * reference_expert(model_type, layer, int(idx[t, k]), h[t:t + 1])["output"][0]
    return out


def ctrl_c_default() -> None:
    """``preexec_fn`` of a child the test sends SIGINT: Ctrl-C handled as in a terminal even when the suite itself
    was started with SIGINT ignored (a background job, nohup), which children would inherit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wilson_by_hand(p, n, z=1.959964):
    """The Wilson bounds as the roots in π of (p - π)² = z² π (1 - π) / n (the score test's acceptance region)."""
    import numpy as np

    a = 1 + z * z / n
    return sorted(np.roots([a, -(2 * p + z * z / n), p * p]).real.tolist())


def mover_by_hand(a, a_lo, a_hi, b, b_lo, b_hi):
    """The MOVER-R bounds of ``a / b`` as roots in r of Fieller's equations with the variances recovered from the two
    intervals (Newcombe 2016): the largest root below a / b of (a - r b)² = (a - a_lo)² + r² (b_hi - b)² and the
    smallest root above it of (a - r b)² = (a_hi - a)² + r² (b - b_lo)²."""
    import numpy as np

    r = a / b
    lo = np.roots([b * b - (b_hi - b) ** 2, -2 * a * b, a * a - (a - a_lo) ** 2]).real
    hi = np.roots([b * b - (b - b_lo) ** 2, -2 * a * b, a * a - (a_hi - a) ** 2]).real
    return max(x for x in lo if x <= r + 1e-12), min(x for x in hi if x >= r - 1e-12)


def recorded_tables(folder) -> dict[str, int]:
    """``{table: rows}`` of the run in ``folder``, after checking its manifest's ``tables`` against the files read
    back by hand: every table it lists (CSV, gzipped CSV, Parquet) has its record, rows as pandas reads them, bytes
    and sha256 as on disk."""
    import hashlib
    import json
    from pathlib import Path

    import pandas as pd

    folder = Path(folder)
    m = json.loads((folder / "manifest.json").read_text())
    tables = [f for f in m["files"] if f.endswith((".csv", ".csv.gz", ".parquet"))]
    assert sorted(m["tables"]) == sorted(tables), (folder, m["tables"].keys(), tables)
    for f in tables:
        p = folder / f
        rows = len(pd.read_parquet(p) if f.endswith(".parquet") else pd.read_csv(p, keep_default_na=False))
        assert m["tables"][f] == {"rows": rows, "bytes": p.stat().st_size,
                                  "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}, (folder, f)
    return {f: m["tables"][f]["rows"] for f in tables}


def zero_compute_lm(model_type: str, rows: int, seq: int, seed: int, padded: dict[int, int], grab,
                    batch_size: int = 2):
    """A tiny model with zero-computation experts (``build_tiny(model_type, seed=0)``, not redrawn here) as a
    ``LoadedModel``, ``rows`` random rows of ``seq`` ids (``padded``: row -> left-padded positions) as a
    ``TokenSet``, and ``grab(ev)`` called on every routing event of the unhooked model over batches of
    ``batch_size`` rows (what the experiments' runs see): ``(lm, tokens)``."""
    import moetool
    from moetool.adapters import tiny
    from moetool.data import TokenSet
    from moetool.loading import LoadedModel

    model = tiny.build_tiny(model_type, seed=0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1024, (rows, seq), generator=gen)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for r, n in padded.items():
        mask[r, :n] = 0
    lm = LoadedModel(model_type, "x", "local", model, None, find_moe_layers(model), torch.device("cpu"),
                     torch.float32)
    with moetool.hook(lm, consumers=[grab]), torch.no_grad():
        for s in range(0, rows, batch_size):
            model(input_ids=ids[s:s + batch_size], attention_mask=mask[s:s + batch_size])
    return lm, TokenSet(ids, mask, [""] * rows, "test")
