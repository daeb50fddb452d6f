"""moetool.hub's offline decision reaching ``from_pretrained`` and moetool.context's run state (mutation testing,
part 7)."""

from __future__ import annotations

import pytest

from moetool.hub import hub_kwargs


@pytest.mark.parametrize("kind", ["hub", "alias"])
def test_offline_a_hub_id_or_an_alias_loads_from_the_local_cache_only(kind, monkeypatch):
    """HF_HUB_OFFLINE: both hub kinds get ``local_files_only`` (an uncached one fails at once, not after ~30 s
    of retries), with the reason; online they get no such argument."""
    import huggingface_hub.constants as hc

    import moetool.hub as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_kwargs(kind) == ({"local_files_only": True}, "HF_HUB_OFFLINE is set")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_probe", lambda url, timeout: None)  # the Hub answers
    assert hub_kwargs(kind) == ({}, None)


@pytest.mark.parametrize("kind", ["local", "embedded"])
def test_a_model_on_disk_never_asks_the_hub(kind, monkeypatch):
    import moetool.hub as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_offline", lambda: pytest.fail("probed the Hub for a model on disk"))
    assert hub_kwargs(kind) == ({}, None)


def test_a_backoff_halves_the_rows_rounding_down_and_the_manifest_says_so():
    from moetool.context import Backoff

    b = Backoff(enabled=True, choice={"reason": "fits memory"})
    assert b.manifest() is None  # never backed off
    assert b.backed_off(7) == 3 and b.backed_off(3) == 1  # 7 rows ran out of memory: 3 (not 4), then 1
    assert b.manifest() == {"reason": "fits memory", "rows": 1, "out_of_memory_at": [7, 3]}


@pytest.mark.parametrize("tp, ep", [(2, 0), (0, 1), (4, 2), (1, 2), (2, 4)])
def test_a_layout_that_cannot_exist_is_refused(tp, ep):
    from moetool.context import Parallel
    from moetool.errors import MoetoolError

    with pytest.raises(MoetoolError, match=f"--tp {tp}|--ep {ep}"):
        Parallel(tp, ep)


@pytest.mark.parametrize("tp, ep, group", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (4, 4, 4)])
def test_a_layout_group_is_its_ranks_holding_one_copy(tp, ep, group):
    from moetool.context import Parallel

    p = Parallel(tp, ep)
    assert p.group == group and p.active == (group > 1)


def test_a_runs_policy_is_built_once_per_key_and_nested_runs_restore_the_outer():
    from moetool import context

    outer, inner = context.RunState(), context.RunState()
    built = []
    assert outer.policy("a", lambda: built.append("a") or "A") == "A" == outer.policy("a", lambda: "other")
    assert outer.policy("b", lambda: built.append("b") or "B") == "B" and built == ["a", "b"]
    assert context.current() is None and context.state() is not context.state()  # no run: a fresh one each time
    with outer.active():
        assert context.state() is outer and context.state(inner) is inner
        with inner.active():
            assert context.current() is inner
        assert context.current() is outer  # the outer run again, not none
    assert context.current() is None


@pytest.mark.parametrize("env, want", [({"WORLD_SIZE": "4", "RANK": "1"}, 4), ({"RANK": "3"}, 1),
                                       ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 2),
                                       ({"WORLD_SIZE": "", "PMI_SIZE": "8", "PMI_RANK": "5"}, 8),
                                       ({"WORLD_SIZE": "four"}, 1), ({}, 1)])
def test_launcher_world_is_the_world_size_not_the_rank(env, want, monkeypatch):
    from moetool import context

    for names in (context._RANK, context._WORLD, context._LOCAL):
        for n in names:
            monkeypatch.delenv(n, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert context.launcher_world() == want


def test_compiled_kernels_are_wanted_on_their_devices_for_plain_tensors_only(monkeypatch):
    import torch

    from moetool import compiled

    class Sub(torch.Tensor):
        pass

    monkeypatch.delenv("MOETOOL_NO_COMPILE", raising=False)
    t = torch.zeros(4)
    assert compiled.DEVICES == ("cuda",) and not compiled.wanted(t)  # the CPU keeps the eager ops
    monkeypatch.setattr(compiled, "DEVICES", ("cpu",))
    assert compiled.wanted(t) and compiled.wanted(torch.nn.Parameter(t))
    assert not compiled.wanted(t.as_subclass(Sub))  # a DTensor shard or another subclass: eager
    for off, on in (("1", False), ("0", True), ("", True)):
        monkeypatch.setenv("MOETOOL_NO_COMPILE", off)
        assert compiled.wanted(t) == on


def test_a_kernel_that_fails_runs_eager_from_then_on_and_out_of_memory_goes_to_the_caller(monkeypatch):
    import warnings

    import torch

    from moetool import compiled

    calls = []

    def fake_compile(fn, backend=None, **options):
        def k(*args):
            calls.append(fn.__name__)
            if fn.__name__ == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory")
            raise RuntimeError("no triton here")
        return k

    def broken(x):
        return x

    def oom(x):
        return x

    monkeypatch.delenv("MOETOOL_NO_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "_KERNELS", {})
    monkeypatch.setattr(torch, "compile", fake_compile)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert compiled.run("broken", broken, 1) is None and compiled.run("broken", broken, 1) is None
    assert calls == ["broken"] and len([x for x in w if "broken kernel unavailable" in str(x.message)]) == 1
    for _ in range(2):  # the caller backs off (fewer rows); the kernel stays
        with pytest.raises(torch.OutOfMemoryError):
            compiled.run("oom", oom, 1)
    assert calls == ["broken", "oom", "oom"] and compiled._KERNELS["oom"] is not None
