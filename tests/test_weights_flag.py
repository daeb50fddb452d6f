"""--weights weights the experts a norm policy chose; given with a policy that takes no weights it is refused in one
line (it was ignored: `ppl --routing router --weights uniform` exited 0 with weights '-'), while not giving it
leaves every policy as it was (softmax for norm)."""

from __future__ import annotations

import sys

import pytest

from moetool.commands.generated import options_of
from moetool.errors import MoetoolError
from moetool.experiments.registry import EXPERIMENTS

ROUTING_COMMANDS = [s.name for s in EXPERIMENTS.values() if "routing" in s.groups]
LINE = "--weights applies to norm:<node> policies only (the weights of the experts they choose); --routing {} takes none"


def test_the_routing_commands_are_those_with_weights():
    assert set(ROUTING_COMMANDS) == {"ppl", "eval", "trace"}


@pytest.mark.parametrize("routing", ["router", "random", "similarity", "topk:1", "capacity:1"])
@pytest.mark.parametrize("command", ROUTING_COMMANDS)
def test_weights_with_a_policy_that_takes_none_is_one_line(command, routing, monkeypatch, capsys, tmp_path):
    import moetool.commands.app as app_module

    tasks = ["--tasks", "arc_easy"] if command == "eval" else []
    monkeypatch.setattr(sys, "argv", ["moetool", command, *tasks, "--routing", routing, "--weights", "uniform",
                                      "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as e:
        app_module.main()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and err == ["error: " + LINE.format(routing)]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("weights", ["softmax", "router", "uniform"])
def test_weights_reach_a_norm_policy(weights):
    spec = EXPERIMENTS["ppl"]
    opts = spec.options_class()(**options_of(spec, {"routing": "norm:gate", "weights": weights}))
    assert opts.policy().weights == weights


def test_not_given_means_each_policys_own():
    ppl = EXPERIMENTS["ppl"]
    router = ppl.options_class()(**options_of(ppl, {"routing": "router", "weights": None}))
    assert router.weights is None and router.policy().weights is None
    norm = ppl.options_class()(**options_of(ppl, {"routing": "norm:up", "weights": None}))
    assert norm.policy().weights == "softmax"
    ns = EXPERIMENTS["norm-select"]  # --weights alone (every policy of norm-select is a norm policy): softmax
    assert ns.options_class()(**options_of(ns, {"weights": None})).weights == "softmax"
    assert ns.options_class()(**options_of(ns, {"weights": "uniform"})).weights == "uniform"


def test_the_library_refuses_the_same_way():
    from moetool.experiments.ppl.spec import PplOptions

    with pytest.raises(MoetoolError) as e:
        PplOptions(routing="random", weights="router").policy()
    assert str(e.value) == LINE.format("random")


@pytest.mark.parametrize("flags,words", [(["--sim", "cosine"], "--sim cosine applies"),
                                         (["--no-causal"], "--no-causal applies"),
                                         (["--sim", "cosine", "--no-causal"], "--sim cosine, --no-causal apply")])
@pytest.mark.parametrize("routing", ["router", "norm:gate", "attention"])
def test_similarity_options_with_a_policy_that_reads_none_are_one_line(routing, flags, words, monkeypatch, capsys,
                                                                       tmp_path):
    """``--sim`` / ``--no-causal`` were accepted and ignored by every policy but similarity (``ppl --routing router
    --sim cosine`` exited 0 with the router's perplexity); now one line, as ``--weights``; with similarity they reach
    the policy."""
    import moetool.commands.app as app_module
    from moetool.experiments.ppl.spec import PplOptions

    monkeypatch.setattr(sys, "argv", ["moetool", "ppl", "--routing", routing, *flags, "--out", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as e:
        app_module.main()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and err == [f"error: {words} to the similarity policy only; --routing {routing} has none"]
    assert not (tmp_path / "r").exists()
    sim = PplOptions(routing="similarity", sim="cosine", causal=False).policy()
    assert sim.sim == "cosine" and sim.causal is False


def test_fluctuations_similarity_options_need_a_similarity_routing():
    from moetool.experiments.fluctuation.spec import FluctuationOptions

    with pytest.raises(MoetoolError, match=r"^--tau applies to the similarity policy only; --routing router,attention"):
        FluctuationOptions(routing=("router", "attention"), tau=0.5)
    assert FluctuationOptions(routing=("router", "similarity"), tau=0.5, sim="cosine").tau == 0.5
