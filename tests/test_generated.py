"""Commands generated from the experiment registry (``moetool.commands.generated``): every experiment's command gets
its ``--help`` from its ``spec.py``'s docstring and its flags from its spec and the flag groups, fills its options
dataclass from them, and runs :func:`moetool.run`; a ``commands/<name>.py`` holds only what is the command's own
(issue 32 item 2)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from moetool.commands.app import app
from moetool.commands.generated import TO_OPTIONS, TO_RUN, options_of, own_module, parameters
from moetool.experiments.experiment import option
from moetool.experiments.registry import EXPERIMENTS, Experiment, Flag

runner = CliRunner()
SPECS = list(EXPERIMENTS.values())
#: what a command's own module may define (commands/generated.py's docstring), beside private helpers
HOOKS = {"PARAMS", "WITHOUT", "model", "check", "on_trace", "show", "written", "main"}


def test_every_experiment_command_is_generated():
    """Each experiment's command is the generated one (its callback made by ``generated.make``), and no command
    module of an experiment declares a command of its own."""
    commands = {c.name: c for c in typer.main.get_command(app).commands.values()}
    for spec in SPECS:
        callback = commands[spec.name].callback
        assert getattr(callback, "command_name", None) == spec.name, spec.name
        assert callback.__wrapped__.__module__ == "moetool.commands.generated", spec.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_a_command_module_holds_only_the_command_own_parts(spec):
    """``commands/<name>.py`` defines only the hooks the generated command reads (and private helpers, constants in
    capitals): no ``register``, no flag re-declared by hand."""
    own = own_module(spec)
    if own is None:
        return
    public = {n for n, v in vars(own).items() if not n.startswith("_") and getattr(v, "__module__", own.__name__)
              == own.__name__ and (callable(v) or n.isupper()) and not isinstance(v, type(typer))}
    functions = {n for n in public if callable(vars(own)[n]) and not n.isupper()}
    assert functions <= HOOKS, functions - HOOKS
    assert "register" not in vars(own)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.options], ids=lambda s: s.name)
def test_every_parameter_is_an_option_field(spec):
    """What the command passes on (its own flags but those read by its hooks, and the standard ones its options
    have) are fields of the experiment's options dataclass: a flag that set nothing would be a silent no-op; every
    other parameter is the run's (:data:`TO_RUN`), the command's own module's, or --tp/--ep/--trust-remote-code (taken
    into the command's run by ``handle_errors``)."""
    fields = {f.name for f in dataclasses.fields(spec.options_class())}
    own_flags = {f.name for f in spec.command_flags() if f.to_options}
    assert own_flags <= fields, own_flags - fields
    names = {name for name, _, _ in parameters(spec)}
    hooks = {n for n, _, _ in getattr(own_module(spec), "PARAMS", [])} | {f.name for f in spec.command_flags() if not f.to_options}
    rest = names - own_flags - (set(TO_OPTIONS) & fields) - set(TO_RUN) - hooks - {
        "tp", "ep", "trust_remote_code", "checkpoints", "model", "trace", "trace_config"}
    assert not rest, f"{spec.name}: parameters nobody reads: {rest}"
    if spec.inputs in ("tokens", "checkpoints"):
        assert {"layers", "seed"} <= names & fields


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_help_is_the_module_docstring_and_lists_every_flag(spec):
    path = Path(importlib.util.find_spec(f"moetool.experiments.{spec.name.replace('-', '_')}.spec").origin)
    doc = ast.get_docstring(ast.parse(path.read_text()))
    r = runner.invoke(app, [spec.name, "--help"], env={"COLUMNS": "3000"}, terminal_width=3000)
    assert r.exit_code == 0, r.output
    assert doc.splitlines()[0] in r.output
    for flag in ["--out", *(f.flag for f in spec.command_flags())]:
        assert flag in r.output, flag
    assert ("--bootstrap" in r.output) == spec.bootstrap
    if spec.inputs != "config":
        assert "--layers" in r.output and "--seed" in r.output
    if spec.inputs == "tokens":
        assert "--data" in r.output and "--max-tokens" in r.output


@dataclasses.dataclass(frozen=True)
class _Options:
    """An options dataclass as a spec.py declares one: fields with their flags (``option``) and plain ones."""

    fractions: tuple[float, ...] = option((0.25, 0.5), "--fractions", "Fractions.")
    ks: tuple[int, ...] | None = option(None, "--ks", "Ks.", kind="ints")
    exact: bool = option(False, "--exact", "Exact.")
    pp: float = option(0.9, "--p", "A p.", min=0.0)
    names: tuple[str, ...] = ()
    layers: tuple[int, ...] | None = None
    batch_size: int = 8
    bootstrap: int = 1000
    seed: int = 0


def test_flags_fill_the_options():
    """Each flag kind parses to the options' type: lists to tuples (``none``: the empty one), an unset flag without
    default to nothing (the dataclass keeps its own default), --layers to a tuple of indices; a field declared with
    ``option`` is a flag with the field's default (its kind from the default, a tuple shown as its text), beside the
    spec's own ``Flag`` s."""
    spec = Experiment(name="x", module="test_generated", function="f", options="_Options", bootstrap=True,
                      flags=(Flag("--names", "strs"), Flag("--own", "str", "a", to_options=False)))
    assert [(f.flag, f.kind, f.default, f.name) for f in spec.command_flags()] == [
        ("--fractions", "floats", "0.25,0.5", "fractions"), ("--ks", "ints", None, "ks"), ("--exact", "bool", False,
        "exact"), ("--p", "float", 0.9, "pp"), ("--names", "strs", None, "names"), ("--own", "str", "a", "own")]
    params = {name: default for name, _, default in parameters(spec)}
    assert params["fractions"] == "0.25,0.5" and params["ks"] is None and params["exact"] is False
    params.update(ks="1, 3", names="a,b", layers="0,2-3", exact=True)
    kw = options_of(spec, params)
    assert kw == {"fractions": (0.25, 0.5), "ks": (1, 3), "names": ("a", "b"), "exact": True, "pp": 0.9,
                  "layers": (0, 2, 3), "batch_size": 8, "bootstrap": 1000, "seed": 0}
    assert _Options(**kw).fractions == (0.25, 0.5)
    assert options_of(spec, {**params, "fractions": "None"})["fractions"] == ()  # a list flag's none: empty
    with pytest.raises(Exception, match="ks"):
        options_of(spec, {**params, "ks": "1,x"})
    with pytest.raises(ValueError, match="bad Flag"):
        Flag("ks", "ints")
    with pytest.raises(ValueError, match="bad Flag"):
        Flag("--ks", "list")
    with pytest.raises(ValueError, match="give kind"):
        option(None, "--x", "no kind")


def test_a_bad_value_is_one_line_before_any_work(tmp_path):
    spec = EXPERIMENTS["topk"]
    r = runner.invoke(app, [spec.name, "--layers", "3-1", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == ["error: empty --layers range '3-1' (use low-high, "
                                                                  "e.g. 1-3)"], r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("spec", [s for s in SPECS if s.options], ids=lambda s: s.name)
def test_a_flag_default_is_the_options_default(spec):
    """A spec's Flag and the options dataclass describe one default: the flag's text, parsed as the command parses
    it, is the field's default (so ``moetool <name>`` and ``moetool.<function>(lm, tokens)`` run the same thing
    unless told otherwise); a flag without a default leaves the dataclass's."""
    from moetool.commands.generated import parse_flag

    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(spec.options_class())}
    for flag in spec.command_flags():
        if not flag.to_options or flag.default is None:
            continue
        assert parse_flag(flag, flag.default) == defaults[flag.name], (spec.name, flag.flag)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.options], ids=lambda s: s.name)
def test_the_options_dataclass_is_the_spec_one(spec):
    """An experiment's options dataclass is declared in its ``spec.py`` (issue 32 item 1: each field with its flag
    and help), and the compute module's name for it (what ``moetool.<Options>`` exports) is that same class."""
    import importlib

    cls = spec.options_class()
    assert cls.__module__ == spec.spec_module and dataclasses.is_dataclass(cls)
    assert getattr(importlib.import_module(spec.module), spec.options) is cls


def test_defaults_spelled_out_in_a_spec_match_their_home():
    """Two option defaults are spelled out in a torch-free spec.py because their home imports torch: they must stay
    equal to it (prune's --criteria = every prune criterion, norm-select's nodes = every probe node)."""
    from moetool.engine.probes import NODES
    from moetool.experiments.norm_select.spec import NormSelectOptions
    from moetool.experiments.prune.spec import PruneOptions
    from moetool.policies.prune import CRITERIA

    assert tuple(PruneOptions().criteria) == tuple(CRITERIA)
    assert tuple(NormSelectOptions().nodes) == tuple(NODES)
