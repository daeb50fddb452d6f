"""Every experiment's command, generated from its spec.

The command's ``--help`` is the docstring of the experiment's ``spec.py`` (torch-free); its flags are the flag
groups of what it reads (the spec's ``inputs``: :func:`moetool.commands.flags.standard`), the groups its spec names
(``groups``: routing, lm-eval tasks, resume, trace input) and the spec's own :class:`Flag` s; its run is
:func:`moetool.run` on the model's name, exactly what ``moetool.run(name, model, data=..., ...)`` does from Python.

A command may add what is its own in ``moetool/commands/<name>.py`` (``-`` as ``_``), any of:

* ``PARAMS``: flags of the command alone (``(parameter, annotation, default)``), ``WITHOUT``: standard flags it does
  not take (with the reason in the module);
* ``model(p) -> str``: the model of the command's parameters ``p`` (default ``p.model``);
* ``check(p, opts) -> dict``: checks before anything loads (one line each), returning more keywords of
  :func:`moetool.run` (``inputs``: the compute function's own, e.g. a task plan; ``manifest``; ``call``);
* ``on_trace(p, opts)``: the analysis on recorded routing (``--trace``) instead of a forward;
* ``show(res, p)``: its console output (default: the summary table under the spec's ``title``), none under
  ``--quiet`` (:func:`moetool.commands.cli.finish`); ``written(res, p)``: the path the command names at its end
  (default: the run folder);
* ``main(p)``: the whole body, for an experiment that is not a run of a model (``plan`` reads a config).

``p`` is the command's parameters as attributes (:class:`types.SimpleNamespace`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Annotated, Any, Optional

import typer

from moetool.experiments.experiment import check_seed
from moetool.experiments.registry import EXPERIMENTS, Experiment, Flag

from .cli import finish, handle_errors, parse_layers, parse_list
from .flags import GROUPS, NAMED, standard

#: standard parameters that are fields of the experiment's options (when its dataclass has them)
TO_OPTIONS = ("layers", "batch_size", "bootstrap", "seed", "routing", "weights", "sim", "causal", "num_fewshot",
              "limit", "include_path", "fewshot_seed")
#: standard parameters :func:`moetool.run` takes
TO_RUN = ("data", "seq_len", "max_tokens", "dtype", "device", "device_map", "quantize", "out", "force", "resume",
          "quiet")
CASTS = {"int": int, "float": float, "str": str, "path": Path}


def help_text(spec: Experiment) -> str:
    """The docstring of the experiment's ``spec.py`` (torch-free; read from its source)."""
    module = f"moetool.experiments.{spec.name.replace('-', '_')}.spec"
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
        raise RuntimeError(f"registry: experiment '{spec.name}' has no {module}")
    doc = ast.get_docstring(ast.parse(Path(found.origin).read_text(encoding="utf-8")))
    if not doc:
        raise RuntimeError(f"registry: {module} has no docstring (it is `moetool {spec.name} --help`)")
    return doc


def own_module(spec: Experiment) -> ModuleType | None:
    """``moetool.commands.<name>``: what the command adds to its generated self, if it has such a module."""
    name = f"{__package__}.{spec.name.replace('-', '_')}"
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


def flag_parameter(flag: Flag) -> tuple[str, Any, Any]:
    """A :class:`Flag` as ``(name, annotation, default)`` of the command's signature."""
    names = [flag.flag, *([flag.short] if flag.short else [])]
    if flag.kind == "bool":  # on by default: --x/--no-x; off by default: the switch --x
        pair = f"{flag.flag}/--no-{flag.flag[2:]}" if flag.default else flag.flag
        return flag.name, Annotated[bool, typer.Option(pair, *names[1:], help=flag.help)], bool(flag.default)
    kind = str if flag.many else CASTS[flag.kind]
    bounds = {k: v for k, v in (("min", flag.min), ("max", flag.max), ("metavar", flag.metavar)) if v is not None}
    if flag.kind == "path":  # an empty path is refused, not read as the current folder
        from .options import parse_path

        bounds = {"parser": parse_path, "metavar": "<path>", **bounds}
    option = typer.Option(*names, help=flag.help, **bounds)
    default = ",".join(map(str, flag.default)) if flag.many and isinstance(flag.default, (tuple, list)) \
        else flag.default
    if flag.required:
        return flag.name, Annotated[kind, option], ...
    return flag.name, Annotated[Optional[kind], option], default


def parameters(spec: Experiment) -> list[tuple[str, Any, Any]]:
    """Every parameter of the generated command, in ``--help`` order: the standard groups of its inputs around its
    own flags and the groups it names; a standard default the spec sets (``defaults``) replaces the group's."""
    first, rest = standard(spec.inputs)
    own = own_module(spec)
    named: list[tuple[str, Any, Any]] = []
    for g in spec.groups:
        named += GROUPS[g] if g in GROUPS else [NAMED[g]]
    boot = GROUPS["bootstrap"] if spec.bootstrap and "bootstrap" not in spec.groups else []
    extra = getattr(own, "PARAMS", [])  # the command's own (one named as a standard flag replaces it)
    first = [g for g in first if g[0] not in {name for name, _, _ in extra}]
    params = [*first, *extra, *(flag_parameter(f) for f in spec.command_flags()), *named, *boot, *rest]
    without = set(getattr(own, "WITHOUT", ()))
    unknown = set(spec.defaults) - {name for name, _, _ in params}
    if unknown:
        raise RuntimeError(f"registry: '{spec.name}' sets defaults of flags it does not take: {sorted(unknown)}")
    return [(name, ann, spec.defaults.get(name, default)) for name, ann, default in params if name not in without]


def parse_flag(flag: Flag, value: Any) -> Any:
    """A flag's text as its options field's value: a list flag a tuple (``none``: empty), ``parse`` applied."""
    if flag.parse is not None:
        module, _, attr = flag.parse.partition(":")
        parsed = getattr(importlib.import_module(module), attr)(value)
        return tuple(parsed) if isinstance(parsed, list) else parsed
    if flag.many:
        if value.strip().lower() == "none":
            return ()
        return tuple(parse_list(value, CASTS[flag.kind[:-1]], flag.flag))
    return str(value) if flag.kind == "path" else value


def options_of(spec: Experiment, params: dict[str, Any]) -> dict[str, Any]:
    """The options dataclass's keywords from the command's parameters (a list flag parsed, ``none`` the empty
    tuple; an unset flag with no default leaves the dataclass's own); standard parameters the dataclass has as
    fields (:data:`TO_OPTIONS`, the loading flags of an experiment that loads its models itself) go there too."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(spec.options_class())}
    kw: dict[str, Any] = {}
    for flag in spec.command_flags():
        value = params.get(flag.name)
        if value is None or not flag.to_options:
            continue
        kw[flag.name] = parse_flag(flag, value)
        flag.check(kw[flag.name])  # NaN, inf (unless the flag allows it), out of range: one line naming the flag
    for name in (*TO_OPTIONS, "dtype", "device", "device_map", "quantize"):
        if name in params and name in fields and name not in kw and params[name] is not None:  # None: not given
            value = params[name]
            kw[name] = parse_layers(value) if name == "layers" else str(value) if name == "include_path" and \
                value is not None else value
    return kw


def run(spec: Experiment, params: dict[str, Any]) -> None:
    """The generated command's body: :func:`moetool.run` with the command's own checks and console output."""
    own = own_module(spec)
    p = SimpleNamespace(**params)
    for name in ("seed", "fewshot_seed"):  # before anything else: the library refuses the same seeds (check_options)
        if name in params:
            check_seed(params[name], "--" + name.replace("_", "-"))
    if hasattr(own, "main"):
        return own.main(p)
    from moetool.errors import MoetoolError
    from moetool.run import preflight

    if getattr(p, "trace", None):  # recorded routing instead of a forward (commands/trace_input.py)
        return own.on_trace(p, spec.options_class()(**options_of(spec, params)))
    if spec.inputs == "checkpoints":
        if not p.checkpoints:
            raise MoetoolError("give two or more checkpoints (or --trace runs)")
        model: Any = list(p.checkpoints)
    else:
        model = own.model(p) if hasattr(own, "model") else p.model
    preflight(*(model if isinstance(model, list) else [model]))  # before the experiment's imports: fails at once
    import moetool

    opts = spec.options_class()(**options_of(spec, params))
    policy = getattr(opts, "policy", None)
    if policy is not None and not any(q.default is q.empty for q in inspect.signature(policy).parameters.values()):
        policy()  # a bad --routing fails before anything loads (built once: the run uses this one)
    more = (own.check(p, opts) if hasattr(own, "check") else None) or {}
    if "lmeval" in spec.groups and opts.tasks is not None:  # unknown lm-eval tasks fail before anything loads
        from moetool.experiments.eval.compute import plan_tasks

        more["inputs"] = {**more.get("inputs", {}), "plan": plan_tasks(opts.tasks, opts.include_path)}
    res = moetool.run(spec.name, model, options=opts, **{k: params[k] for k in TO_RUN if k in params}, **more)
    finish(res, own.written(res, p) if hasattr(own, "written") else res.path, getattr(p, "quiet", False),
           lambda: own.show(res, p) if hasattr(own, "show") else show(spec, res, model))


def show(spec: Experiment, res: Any, model: Any) -> None:
    """The default console output: the summary table under the spec's title (long tables point to its CSV); none
    for a run without one (trace: its file is the output)."""
    from moetool.report.console import print_table

    if res.summary is None:
        return
    tokens = f" ({res.tokens.n_tokens:,} tokens)" if res.tokens is not None else ""
    title = f"{spec.title or spec.name}: {model}{tokens}"
    csv = spec.summary_csv or next((name for name, df in res.tables.items() if df is res.summary),
                                   next(iter(res.tables)))
    print_table(res.summary, title, csv=csv)


def make(spec: Experiment) -> Any:
    """The Typer callback of ``moetool <spec.name>``: a function with the generated signature."""
    params = parameters(spec)

    def command(**kwargs: Any) -> None:
        run(spec, kwargs)

    command.__name__ = command.__qualname__ = spec.function
    command.command_name = spec.name  # type: ignore[attr-defined]
    command.__doc__ = help_text(spec)
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
         for name, annotation, default in params])
    command.__annotations__ = {name: annotation for name, annotation, _ in params}
    return handle_errors(command)


def register(app: typer.Typer) -> None:
    for spec in EXPERIMENTS.values():
        command = make(spec)
        app.command(name=spec.name, help=command.__doc__)(command)
