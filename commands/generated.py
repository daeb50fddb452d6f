"""Commands generated from the experiment registry: an experiment whose spec has no ``command`` module.

The command's ``--help`` is the docstring of the experiment's ``spec.py`` (torch-free); its flags are the flag
groups of what it takes (:mod:`moetool.commands.flags`; ``inputs``: tokens or weights) and the spec's own
:class:`~moetool.experiments.registry.Flag` s; the run is every command's: :func:`preflight`, :func:`start_run`,
the compute function, :func:`finish_command` (the ``summary`` table printed, the run folder named).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from moetool.experiments.registry import Experiment, Flag, generated

from .flags import STANDARD
from .options import (Bootstrap, DEFAULT_BOOTSTRAP, finish_command, handle_errors, parse_layers, parse_list, preflight,
                      start_run)

#: standard parameters that are options of the experiment (its dataclass must have these fields)
TO_OPTIONS = ("layers", "batch_size", "bootstrap", "seed")
CASTS = {"int": int, "float": float, "str": str}


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


def flag_parameter(flag: Flag) -> tuple[str, Any, Any]:
    """A :class:`Flag` as ``(name, annotation, default)`` of the command's signature."""
    if flag.kind == "bool":
        option = typer.Option(f"{flag.flag}/--no-{flag.flag[2:]}", help=flag.help)
        return flag.name, Annotated[bool, option], bool(flag.default)
    many = flag.kind.endswith("s") and flag.kind != "str"
    kind = str if many else CASTS[flag.kind]
    default = ",".join(map(str, flag.default)) if many and isinstance(flag.default, (tuple, list)) else flag.default
    return flag.name, Annotated[Optional[kind], typer.Option(flag.flag, help=flag.help)], default


def parameters(spec: Experiment) -> list[tuple[str, Any, Any]]:
    """Every parameter of the generated command, in ``--help`` order."""
    if spec.inputs not in STANDARD:
        raise RuntimeError(f"registry: a generated command takes tokens or weights, not {spec.inputs!r} "
                           f"('{spec.name}' needs a command module)")
    first, rest = STANDARD[spec.inputs]
    own = [flag_parameter(f) for f in spec.flags]
    boot = [("bootstrap", Bootstrap, DEFAULT_BOOTSTRAP)] if spec.bootstrap else []
    return [*first, *own, *boot, *rest]


def options_of(spec: Experiment, params: dict[str, Any]) -> dict[str, Any]:
    """The options dataclass's keywords from the command's parameters (a list flag parsed, ``none`` the empty
    tuple; an unset flag with no default leaves the dataclass's own)."""
    kw: dict[str, Any] = {}
    for flag in spec.flags:
        value = params.get(flag.name)
        if value is None:
            continue
        if flag.kind in ("ints", "floats", "strs"):
            value = () if value.strip().lower() == "none" else tuple(parse_list(value, CASTS[flag.kind[:-1]],
                                                                                flag.flag[2:]))
        kw[flag.name] = value
    for name in TO_OPTIONS:
        if name in params:
            kw[name] = parse_layers(params[name]) if name == "layers" else params[name]
    return kw


def run(spec: Experiment, params: dict[str, Any]) -> None:
    """The generated command's body."""
    model = params["model"]
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    compute = spec.load()
    opts = spec.options_class()(**options_of(spec, params))
    tokens_in = spec.inputs == "tokens"
    sizes = {k: params[k] for k in ("data", "seq_len", "max_tokens", "batch_size")} if tokens_in else {}
    started = start_run(spec.name, params["out"], params["force"], model, dtype=params["dtype"],
                        device=params["device"], device_map=params["device_map"], quantize=params["quantize"],
                        tokenizer=tokens_in, **sizes)
    _, lm, tokens = started
    quiet = params["quiet"]
    res = compute(lm, tokens, opts, quiet=quiet) if tokens_in else compute(lm, opts, quiet=quiet)
    title = f"{spec.title or spec.name}: {model}" + (f" ({tokens.n_tokens:,} tokens)" if tokens_in else "")
    csv = spec.summary_csv or next((name for name, df in res.tables.items() if df is res.summary),
                                   next(iter(res.tables)))
    finish_command(started, res, title, csv)


def make(spec: Experiment) -> Any:
    """The Typer callback of ``moetool <spec.name>``: a function with the generated signature."""
    params = parameters(spec)

    def command(**kwargs: Any) -> None:
        run(spec, kwargs)

    command.__name__ = command.__qualname__ = spec.function
    command.__doc__ = help_text(spec)
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
         for name, annotation, default in params])
    command.__annotations__ = {name: annotation for name, annotation, _ in params}
    return handle_errors(command)


def register(app: typer.Typer) -> None:
    for spec in generated():
        command = make(spec)
        app.command(name=spec.name, help=command.__doc__)(command)
