"""No host synchronisation inside the forward (issue #15), proven without a GPU.

``SyncDetector`` is a ``TorchDispatchMode`` (the same interception ``FakeTensorMode`` is built on) that records
every data-dependent operation — the ones that make a CUDA stream wait for the host: ``.item()`` / ``bool()`` /
``float()`` / ``int()`` of a tensor (``aten._local_scalar_dense``), ``nonzero``, boolean-mask indexing (``index``
with a bool index, ``masked_select``), ``bincount`` (its output size is the data's maximum), ``unique``,
``repeat_interleave`` by a tensor, copies to the CPU — plus ``Tensor.tolist`` / ``.numpy`` / ``.cpu`` which a CPU
tensor serves without dispatch. It records them only while the model's forward runs and only when the
innermost non-torch frame is moetool code (the model's own syncs are transformers'), with that file and line.

Unlike ``FakeTensorMode`` it runs the real computation, so the same run also checks the results are unchanged
and the detector is exercised on every policy, the capture path and every experiment's consumers. A positive
control proves each kind is caught. Offenders known today are ``xfail(strict=True)`` with the line at fault
(listed in /tmp/team/NOTES.md): fixing one turns its test into an XPASS failure, which says to drop the mark.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, build_tiny_model, padded_batch
from torch.utils._python_dispatch import TorchDispatchMode

import moetool
from moetool.adapters import find_moe_layers
from moetool.engine import Engine
from moetool.errors import MoetoolError
from moetool.policies import make_policy

PKG = Path(moetool.__file__).parent
A = torch.ops.aten
SYNC_OPS = {A._local_scalar_dense.default: "item/bool/float/int of a tensor", A.nonzero.default: "nonzero",
            A.masked_select.default: "masked_select", A.bincount.default: "bincount",
            A._unique2.default: "unique", A.unique_consecutive.default: "unique",
            A.repeat_interleave.Tensor: "repeat_interleave by a tensor"}
HOST_METHODS = {"tolist": ".tolist()", "numpy": ".numpy()", "cpu": ".cpu()"}


TORCH_PKG = Path(torch.__file__).parent
TESTS = Path(__file__).parent


def _site(stack: list | None = None) -> str | None:
    """``file:line`` of the innermost moetool frame, or None when the innermost frame that is neither torch's nor a
    test's is not ours (transformers & co: the model's own operation). torch and the tests are told by their own
    folders, not by a folder name in the path: a virtual environment under ``/opt/torch/.venv`` (as on a GPU machine
    found) has "torch" in every path, and would blame transformers' own syncs on the innermost moetool frame."""
    for fr in reversed(traceback.extract_stack()[:-3] if stack is None else stack):
        path = Path(fr.filename)
        if PKG in path.parents:
            return f"{path.relative_to(PKG.parent)}:{fr.lineno}"
        if TORCH_PKG not in path.parents and TESTS not in path.parents and "site-packages" in path.parts:
            return None
    return None


class SyncDetector(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits: set[tuple[str, str]] = set()
        self.armed = 0

    def record(self, what: str) -> None:
        if self.armed and (site := _site()):
            self.hits.add((what, site))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = SYNC_OPS.get(func)
        if func in (A.index.Tensor, A.index_put.default, A.index_put_.default) and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            what = "boolean-mask indexing"
        if func is A._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            what = "copy to the CPU"
        if what:
            self.record(what)
        return func(*args, **kwargs)


@contextlib.contextmanager
def detect(model):
    """Record the host syncs moetool code makes while ``model``'s forward runs."""
    det = SyncDetector()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}

    def wrap(name, f):
        def g(self, *a, **k):
            det.record(HOST_METHODS[name])
            return f(self, *a, **k)
        return g

    hooks = [model.register_forward_pre_hook(lambda m, a: setattr(det, "armed", det.armed + 1)),
             model.register_forward_hook(lambda m, a, o: setattr(det, "armed", det.armed - 1))]
    for name, f in saved.items():
        setattr(torch.Tensor, name, wrap(name, f))
    try:
        with det:
            yield det
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
        for h in hooks:
            h.remove()


def forward(model, policy=None, consumers=()):
    with torch.no_grad(), Engine(model, find_moe_layers(model), policy=policy, consumers=consumers):
        return model(**padded_batch()).logits


def test_a_sync_in_transformers_is_not_blamed_on_moetool_under_any_venv_path():
    """The frame walk tells torch's and the tests' frames by their folders: transformers under a virtual environment
    whose path names "torch" (``/opt/torch/.venv``) is the model's own code, so nothing is blamed on moetool."""
    ours = traceback.FrameSummary(str(PKG / "engine" / "runner.py"), 267, "__call__")
    for venv in ("/opt/torch/.venv", "/usr/local", "/home/u/tests/.venv"):
        theirs = traceback.FrameSummary(f"{venv}/lib/python3.12/site-packages/transformers/modeling_x.py", 9, "f")
        torch_frame = traceback.FrameSummary(str(TORCH_PKG / "nn" / "modules" / "module.py"), 1, "_call_impl")
        assert _site([ours, torch_frame, theirs, torch_frame]) is None, venv
        assert _site([theirs, torch_frame, ours, torch_frame]) == "moetool/engine/runner.py:267", venv


def test_detector_catches_every_kind_of_sync():
    model = build_tiny_model("mixtral")
    seen = []

    def offender(ev):  # every pattern the issue names, in a consumer
        seen.append(ev.h[ev.valid].shape)
        bool(ev.valid.any())
        ev.idx.tolist()
        ev.valid.nonzero()
        ev.logits.cpu()
        torch.bincount(ev.idx.reshape(-1), minlength=8)

    with detect(model) as det:
        forward(model, consumers=[offender])
    kinds = {k for k, _ in det.hits}
    assert kinds == {"boolean-mask indexing", "item/bool/float/int of a tensor", ".tolist()", "nonzero", ".cpu()",
                     "bincount"}, det.hits
    assert seen and all(site.startswith("moetool/engine/hooks.py:") for _, site in det.hits)  # the caller
    with detect(model) as det:  # the model's own forward, unhooked: nothing is ours
        want = model(**padded_batch()).logits
    assert not det.hits and want.isfinite().all()


POLICY_SPECS = ["router", "random", "similarity", "similarity:0.5", "attention",
                *(f"norm:{n}" for n in ("gate", "up", "act", "glu", "output")), "norm:gate:l1", "norm:gate:linf",
                "topk:1", "topp:0.5", "capacity:1.0", "capacity:1.25:score", "prune:random:0.25"]
KNOWN: dict[str, str] = {}  # spec -> the line that syncs today (strict xfail)


@contextlib.contextmanager
def attention_for(spec: str, model):
    """``model`` as policy ``spec`` needs it: eager attention for ``attention`` (it reads the attention weights),
    restored after."""
    impl = model.config._attn_implementation
    if spec == "attention":
        model.config._attn_implementation = "eager"
    try:
        yield model
    finally:
        model.config._attn_implementation = impl


@pytest.mark.parametrize("spec", POLICY_SPECS + ["capture"])
def test_policies_and_capture_stay_on_the_device(spec, request):
    if spec in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"syncs today: {KNOWN[spec]}"))
    hits, ran = set(), 0
    for family in FAMILIES:
        model = build_tiny_model(family)
        try:
            with attention_for(spec, model):
                policy = None if spec == "capture" else make_policy(spec)
                consumers = [lambda ev: (ev.probs, ev.chosen_idx)] if policy is None else []
                with detect(model) as det:
                    out = forward(model, policy, consumers)
            assert out.isfinite().all()
            hits |= {(family, *h) for h in det.hits}
            ran += 1
        except MoetoolError:  # a policy the family's routing cannot run (topk:1 on sparsemixer, prune of a group)
            pass
    assert ran >= len(FAMILIES) - 3 and not hits, sorted(hits)


# ----- every experiment's consumers (they run inside the forward) -----------------------------------------
def _entry(module: str, *names: str):
    import importlib

    mod = importlib.import_module(f"moetool.experiments.{module}.compute")
    for n in names:
        if hasattr(mod, n):
            return mod, getattr(mod, n)
    pytest.skip(f"moetool.experiments.{module}.compute has none of {names} (renamed by the refactor? update this test)")


def run_experiment(name, lm, ts):
    if name == "approx":
        return _entry("approx", "run_approx")[1](lm, ts, quiet=True)
    if name == "stats":
        return _entry("stats", "collect")[1](lm, ts, quiet=True, row_sums=True)  # bootstrap's per-row sums too
    if name == "mass_recall":
        mod, f = _entry("mass_recall", "run_mass_recall")
        return f(lm, ts, mod.MassRecallOptions(codebook_sizes=(4,), shortlists=(2,)), quiet=True)
    if name == "norm_select":
        return _entry("norm_select", "run_norm_select")[1](lm, ts, [make_policy("router"), make_policy("norm:gate")],
                                                             quiet=True, bootstrap=200)  # per-row sums too
    if name == "ppl":
        return _entry("ppl", "perplexity")[1](lm, ts, policy=make_policy("norm:gate"), quiet=True)
    if name == "fluctuation":
        mod, f = _entry("fluctuation", "capture")
        others = {"iso": {L.index: mod.router_copy(L) for L in lm.layers}}
        return f(lm, ts, make_policy("similarity"), others=others, quiet=True)
    if name == "margin":  # noise, re-routing, sketch, rows; and its policy branch (no policy runs by default)
        from moetool.experiments.margin.spec import DEMO_POLICIES

        return _entry("margin", "margin")[1](lm, ts, quiet=True, bootstrap=0, policies=DEMO_POLICIES)
    from moetool.experiments.registry import EXPERIMENTS

    return EXPERIMENTS[name.replace("_", "-")].load()(lm, ts, quiet=True)  # every other: its defaults


#: every experiment of the registry that runs forwards over tokens (eval: lm-eval's harness drives the model)
FORWARD_EXPERIMENTS = sorted({x.name.replace("-", "_") for x in __import__(
    "moetool.experiments.registry", fromlist=["EXPERIMENTS"]).EXPERIMENTS.values()
    if x.inputs == "tokens" and x.name != "eval"} | {"fluctuation"})


EXPERIMENT_SYNCS = {  # experiment -> lines that sync inside the forward today (device-side fixes in NOTES.md)
}


@pytest.fixture(scope="module")
def embedded():
    from moetool.data import load_tokens
    from moetool.loading import load

    out = {}
    for name in ("tiny", "tiny-fine"):
        lm = load(name)
        out[name] = (lm, load_tokens(None, lm.tokenizer, 32, 96))
    return out


@pytest.mark.parametrize("experiment", FORWARD_EXPERIMENTS)
def test_experiment_consumers_stay_on_the_device(experiment, embedded, request):
    if experiment in EXPERIMENT_SYNCS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"syncs today: {EXPERIMENT_SYNCS[experiment]}"))
    hits = set()
    for name, (lm, ts) in embedded.items():
        with detect(lm.model) as det:
            run_experiment(experiment, lm, ts)
        hits |= {(name, *h) for h in det.hits}
    assert not hits, sorted(hits)


@contextlib.contextmanager
def cuda_sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class ErrorOnSync:
    """A policy run with CUDA's sync debug mode at "error" (only moetool's code, not the model's own)."""

    def __init__(self, policy):
        self.policy, self.name, self.needs_attention = policy, policy.name, policy.needs_attention

    def select(self, ev):
        with cuda_sync_errors():
            return self.policy.select(ev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [s for s in POLICY_SPECS if s not in KNOWN] + ["capture"])
def test_cuda_sync_debug_mode(spec):
    """On a GPU, the CUDA runtime itself refuses a synchronising call in a policy or consumer."""
    import copy

    model = copy.deepcopy(build_tiny_model("mixtral")).cuda()
    batch = {k: v.cuda() for k, v in padded_batch().items()}
    policy = None if spec == "capture" else ErrorOnSync(make_policy(spec))

    def consumer(ev):
        with cuda_sync_errors():
            ev.probs.sum()
            ev.chosen_idx.float().mean()

    with torch.no_grad(), Engine(model, find_moe_layers(model), policy=policy, consumers=[consumer]):
        model(**batch)
    torch.cuda.synchronize()


class ErrorOnSyncConsumer:
    """A consumer run with CUDA's sync debug mode at "error" (its own code only, not the model's)."""

    def __init__(self, consumer):
        self.consumer = consumer

    def __call__(self, ev):
        with cuda_sync_errors():
            return self.consumer(ev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experiment", FORWARD_EXPERIMENTS)
def test_every_experiment_consumer_under_cuda_sync_debug_mode(experiment, embedded, monkeypatch):
    """On a GPU, the CUDA runtime itself refuses a synchronising call (``.item()``, a copy to or from pageable host
    memory, ``nonzero``...) in every consumer of every experiment of the registry (issue 37.2)."""
    enter = Engine.__enter__

    def wrapped(self):
        self.consumers = [ErrorOnSyncConsumer(c) for c in self.consumers]
        return enter(self)

    monkeypatch.setattr(Engine, "__enter__", wrapped)
    for name, (lm, ts) in embedded.items():
        run_experiment(experiment, lm, ts)


def test_sparse_counts_merge_outside_the_forward(embedded, monkeypatch):
    """``stats``' (token, expert) counters: the embedded model's ids x experts are few enough for dense tables
    (``sketch.DENSE_KEYS``: ``index_add_``, nothing to merge); a larger space is sparse and merges with
    ``torch.unique`` (a sync). At the default threshold the small data above never merges, so here the sparse
    counters get every add past it (``merge_min=1``) -- the merges must still wait for the forward to end
    (``SparseCounter(defer=True)`` settled by ``begin_batch``); the counts of all three runs are the same."""
    from moetool import sketch
    from moetool.experiments.stats.compute import collect

    lm, ts = embedded["tiny"]
    with detect(lm.model) as det:
        dense = collect(lm, ts, quiet=True, merge_min=1, batch_size=4)
    assert not det.hits, sorted(det.hits)
    monkeypatch.setattr(sketch, "DENSE_KEYS", 0)  # every counter sparse from here on
    with detect(lm.model) as det:
        every = collect(lm, ts, quiet=True, merge_min=1, batch_size=4)
    assert not det.hits, sorted(det.hits)
    once = collect(lm, ts, quiet=True, merge_min=1 << 40, batch_size=4)  # never merged before the end
    runs = (dense, every, once)
    assert all(r.routing.acc.keys() == once.routing.acc.keys() and r.vocab.counters.keys() == once.vocab.counters.keys()
               for r in runs)

    def counters(r):
        return [r.routing.token_totals] + [a.pairs for _, a in sorted(r.routing.acc.items())] + \
            [c for _, views in sorted(r.vocab.counters.items()) for _, c in sorted(views.items())]

    assert all(c.dense is not None for c in counters(dense)) and all(c.dense is None for c in counters(every))
    for a, b, c in zip(*map(counters, runs)):
        (ka, ca), (kb, cb), (kc, cc) = a.result(), b.result(), c.result()
        assert torch.equal(ka, kb) and torch.equal(ca, cb) and torch.equal(ka, kc) and torch.equal(ca, cc)
    assert sum(int(c.result()[1].sum()) for c in counters(every)) > 0
