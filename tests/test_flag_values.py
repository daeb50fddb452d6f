"""Numbers no experiment can mean are refused in one line before any model loads: NaN and infinity in every float
flag of every generated command (``--cf`` alone takes ``inf``: no capacity limit), and a ``--seed`` outside the
range numpy's and torch's generators share, on the command line and from Python alike."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
import typer

import moetool
from moetool.commands.app import app
from moetool.commands.generated import options_of
from moetool.errors import MoetoolError
from moetool.experiments.experiment import SEED_MAX, Flag, check_seed
from moetool.experiments.registry import EXPERIMENTS


def console(argv, monkeypatch, capsys, tmp_path):
    """``moetool <argv>`` as the console script runs it: (exit code, the non-empty stderr lines, run folder made)."""
    import moetool.commands.app as app_module

    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["moetool", *argv, "--out", str(out)])
    monkeypatch.delenv("MOETOOL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        app_module.main()
    return e.value.code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()], out.exists()


def positional(spec):
    """The arguments a command needs beside the flag under test: two checkpoints for a checkpoint experiment, a
    value of each required flag (eval's --tasks: never read, the refusal comes first)."""
    required = [x for f in spec.command_flags() if f.required for x in (f.flag, "arc_easy")]
    return (["tiny-early", "tiny"] if spec.inputs == "checkpoints" else []) + required


def numeric_flags():
    """(command, flag) for every flag whose value is or may parse to a float: float kinds, float lists and flags
    with a parser of their own (``--noise``: derived, none or a number)."""
    return [(spec, f) for spec in EXPERIMENTS.values() for f in spec.command_flags()
            if f.to_options and (f.kind in ("float", "floats") or f.parse is not None)]


def test_the_sweep_sees_the_float_flags_and_only_cf_takes_infinity():
    names = {(s.name, f.flag) for s, f in numeric_flags()}
    assert {("erc", "--alpha"), ("erc", "--noise"), ("capacity", "--cf"), ("fluctuation", "--tau"),
            ("super-experts", "--percentile"), ("margin", "--eps")} <= names
    assert {(s.name, f.flag) for s, f in numeric_flags() if f.inf} == {("capacity", "--cf")}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("spec, flag", numeric_flags(), ids=lambda x: getattr(x, "name", None) or x.flag)
def test_nan_and_infinity_are_refused_in_every_float_flag(spec, flag, value, monkeypatch, capsys, tmp_path):
    if flag.inf and value == "inf":  # --cf inf: no capacity limit (the model's own routing), a real setting
        opts = options_of(spec, {flag.name: value})
        assert opts[flag.name] == (math.inf,)
        return
    code, err, made = console([spec.name, *positional(spec), flag.flag, value], monkeypatch, capsys, tmp_path)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert not made
    if flag.kind in ("float", "floats") or flag.name == "noise":  # a number of the flag: the line names the flag
        assert flag.flag in err[0] and value.lstrip("-") in err[0], err


def test_the_library_refuses_the_same_numbers_before_loading(tmp_path):
    """moetool.run and the compute functions resolve their options with the same checks (and the same line)."""
    with pytest.raises(MoetoolError, match=r"^--alpha values must be finite numbers, not nan$"):
        moetool.run("erc", "tiny", alphas=(1.0, float("nan")), out=tmp_path / "a")
    with pytest.raises(MoetoolError, match=r"^--noise must be a finite number, not inf$"):
        moetool.run("erc", "tiny", noise=math.inf, out=tmp_path / "b")
    with pytest.raises(MoetoolError, match=r"^--cf .*nan"):  # (its options' own check says it first)
        moetool.run("capacity", "tiny", cfs=(float("nan"),), out=tmp_path / "c")
    assert not any(tmp_path.iterdir())
    from moetool.experiments.capacity.spec import CapacityOptions
    from moetool.experiments.result import resolve_options

    assert resolve_options(CapacityOptions, None, {"cfs": (1.0, math.inf)}).cfs == (1.0, math.inf)


@pytest.mark.parametrize("spec", ["similarity:nan", "similarity:inf", "topp:nan", "topp:inf", "capacity:nan",
                                  "prune:random:nan", "prune:random:inf", "topk:inf"])
def test_numbers_in_a_routing_spec_are_refused_the_same_way(spec):
    """--routing name:number: NaN and infinity refused (capacity:inf alone is a setting: no capacity limit)."""
    from moetool.policies import build_policy

    with pytest.raises(MoetoolError, match=f"^bad routing policy '{spec}': "):
        build_policy(spec)
    assert build_policy("capacity:inf").cf == math.inf


def test_a_word_for_a_number_in_a_routing_spec_is_named():
    """similarity:x says which number it wanted, as topk: does (it read "could not convert string to float: 'x'")."""
    from moetool.policies import build_policy

    with pytest.raises(MoetoolError) as e:
        build_policy("similarity:x")
    assert str(e.value) == "bad routing policy 'similarity:x': tau must be a number, not 'x'"
    for spec, message in [("topk:1.5", "k must be a whole number, not '1.5'"),
                          ("topp:0.5:2.5", "kmax must be a whole number, not '2.5'")]:
        with pytest.raises(MoetoolError) as e:  # an integer's parameter said so (it read "k must be a number")
            build_policy(spec)
        assert str(e.value) == f"bad routing policy '{spec}': {message}"


def test_flag_check_bounds_and_kinds():
    f = Flag("--x", "float", min=0.0, max=1.0)
    f.check(0.5), f.check(None), f.check("derived")  # not a number: the flag's own parser judged it
    for bad, line in ((float("nan"), "--x must be a finite number, not nan"), (1.5, "--x must be from 0 to 1, not 1.5"),
                      (-0.1, "--x must be from 0 to 1, not -0.1")):
        with pytest.raises(MoetoolError) as e:
            f.check(bad)
        assert str(e.value) == line
    with pytest.raises(MoetoolError, match=r"^--n values must be >= 1, not 0$"):
        Flag("--n", "ints", min=1).check((3, 0))
    Flag("--cf", "floats", inf=True).check((1.0, math.inf))
    with pytest.raises(MoetoolError, match=r"^--x must be a finite number, not nan$"):
        f.check(np.float32("nan"))  # numpy's floats too (the library takes them)


# ----- --seed -----------------------------------------------------------------------------------------------------
def test_the_seed_range_is_what_every_generator_takes():
    """0 .. 2**32 - 1: numpy's legacy seeding (lm-eval's numpy_random_seed) stops there; torch's generators and
    numpy's default_rng take it, also as the derived per-layer seeds (seed * 1_000_003 + layer)."""
    np.random.seed(SEED_MAX), np.random.default_rng(SEED_MAX)
    torch.Generator().manual_seed(SEED_MAX * 1_000_003 + 1000)
    with pytest.raises(ValueError):
        np.random.seed(SEED_MAX + 1)
    with pytest.raises(ValueError):
        np.random.default_rng(-1)
    from moetool.policies.basic import uniform_rows  # the random policy's per-row seed, the largest derived one

    a = uniform_rows(SEED_MAX, 3, [0, 7], 2, 4, "cpu")
    assert a.shape == (4, 4) and torch.equal(a, uniform_rows(SEED_MAX, 3, [0, 7], 2, 4, "cpu"))
    check_seed(0), check_seed(SEED_MAX), check_seed(np.int64(7))  # a numpy integer is an integer
    for bad in (-1, SEED_MAX + 1, 10**20, 1.5, True):
        with pytest.raises(MoetoolError, match=r"^--seed must be an integer from 0 to 4294967295"):
            check_seed(bad)


def seed_commands():
    commands = typer.main.get_command(app).commands
    return sorted(name for name, c in commands.items() if any("--seed" in p.opts for p in c.params))


def test_every_model_command_takes_a_seed():
    assert set(seed_commands()) == {s.name for s in EXPERIMENTS.values() if s.inputs != "config"}


@pytest.mark.parametrize("seed", ["-1", str(SEED_MAX + 1), "99999999999999999999"])
@pytest.mark.parametrize("command", seed_commands())
def test_a_seed_out_of_range_is_one_line_in_every_command(command, seed, monkeypatch, capsys, tmp_path):
    spec = EXPERIMENTS[command]
    code, err, made = console([command, *positional(spec), "--seed", seed], monkeypatch, capsys, tmp_path)
    assert code == 2 and not made
    assert err == [f"error: --seed must be an integer from 0 to 4294967295 (2**32 - 1), not {seed}"]


def test_the_library_refuses_the_same_seeds(tmp_path):
    for seed in (-1, SEED_MAX + 1):
        with pytest.raises(MoetoolError) as e:
            moetool.run("ppl", "tiny", seed=seed, max_tokens=64, out=tmp_path / "x")
        assert str(e.value) == f"--seed must be an integer from 0 to 4294967295 (2**32 - 1), not {seed}"
    assert not (tmp_path / "x").exists()
