"""Commands generated from the experiment registry (``moetool.commands.generated``): an experiment with no command
module gets its ``--help`` from its ``spec.py``'s docstring and its flags from its spec, and fills its options
dataclass from them."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.commands.generated import TO_OPTIONS, options_of, parameters
from moetool.experiments.registry import EXPERIMENTS, Experiment, Flag, generated

runner = CliRunner()


def test_some_experiment_is_generated():
    assert generated(), "no experiment of the registry uses a generated command"
    assert {spec.name for spec in generated()} <= set(EXPERIMENTS)


@pytest.mark.parametrize("spec", generated(), ids=lambda s: s.name)
def test_every_parameter_is_an_option_field(spec):
    """What the command passes on (its flags, and --layers / --batch-size / --bootstrap / --seed) are fields of the
    experiment's options dataclass: a flag that set nothing would be a silent no-op."""
    fields = {f.name for f in dataclasses.fields(spec.options_class())}
    passed = {name for name, _, _ in parameters(spec)} & {*TO_OPTIONS, *(f.name for f in spec.flags)}
    assert passed <= fields, passed - fields
    assert {f.name for f in spec.flags} <= passed and "layers" in passed and "seed" in passed


@pytest.mark.parametrize("spec", generated(), ids=lambda s: s.name)
def test_help_is_the_module_docstring_and_lists_every_flag(spec):
    path = Path(importlib.util.find_spec(f"moetool.experiments.{spec.name.replace('-', '_')}.spec").origin)
    doc = ast.get_docstring(ast.parse(path.read_text()))
    r = runner.invoke(app, [spec.name, "--help"], env={"COLUMNS": "3000"}, terminal_width=3000)
    assert r.exit_code == 0, r.output
    assert doc.splitlines()[0] in r.output
    for flag in ["--model", "--out", "--layers", "--seed", *(f.flag for f in spec.flags)]:
        assert flag in r.output, flag
    assert ("--bootstrap" in r.output) == spec.bootstrap
    if spec.inputs == "tokens":
        assert "--data" in r.output and "--max-tokens" in r.output


def test_flags_fill_the_options():
    """Each flag kind parses to the options' type: lists to tuples (``none``: the empty one), an unset flag without
    default to nothing (the dataclass keeps its own default), --layers to a tuple of indices."""
    spec = Experiment(name="x", module="moetool.experiments.super_experts.compute", function="super_experts",
                      options="SuperExpertsOptions", command=None, bootstrap=True,
                      flags=(Flag("--fractions", "floats", (0.25, 0.5)), Flag("--ks", "ints"),
                             Flag("--names", "strs"), Flag("--exact", "bool"), Flag("--p", "float", 0.9, field="pp")))
    params = {name: default for name, _, default in parameters(spec)}
    assert params["fractions"] == "0.25,0.5" and params["ks"] is None and params["exact"] is False
    params.update(ks="1, 3", names="a,b", layers="0,2-3", exact=True)
    kw = options_of(spec, params)
    assert kw == {"fractions": (0.25, 0.5), "ks": (1, 3), "names": ("a", "b"), "exact": True, "pp": 0.9,
                  "layers": (0, 2, 3), "batch_size": 8, "bootstrap": 1000, "seed": 0}
    assert options_of(spec, {**params, "fractions": "None"})["fractions"] == ()  # a list flag's none: empty
    with pytest.raises(Exception, match="ks"):
        options_of(spec, {**params, "ks": "1,x"})
    with pytest.raises(ValueError, match="bad Flag"):
        Flag("ks", "ints")
    with pytest.raises(ValueError, match="bad Flag"):
        Flag("--ks", "list")


def test_a_bad_value_is_one_line_before_any_work(tmp_path):
    spec = generated()[0]
    r = runner.invoke(app, [spec.name, "--layers", "3-1", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == ["error: empty --layers range '3-1' (use low-high, "
                                                                  "e.g. 1-3)"], r.output
    assert not (tmp_path / "run").exists()
