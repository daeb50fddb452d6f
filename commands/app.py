"""``moetool``: the Typer app. Every experiment's command is generated from its spec (:mod:`moetool.commands.generated`,
with what its own ``commands/<name>.py`` adds); ``demo``, ``inspect``, ``report`` and ``import-trace`` are modules of
their own (:func:`moetool.experiments.registry.command_modules`)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import typing
from pathlib import PurePath
from typing import Any

import typer
import typer.rich_utils
from typer.core import TyperOption

from moetool.experiments.registry import command_modules

app = typer.Typer(
    name="moetool",
    help="Mixture-of-Experts routing research: hook every MoE layer of a Hugging Face checkpoint, "
         "run routing experiments, write CSV tables and figures. Start with `moetool demo`.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode="rich",
)


def type_column(param: Any, ctx: Any) -> str | None:
    """The type column of a flag in ``--help`` (typer's, but for three cases): a switch (``--force``, ``--help``,
    ``--version``) takes no value and shows none (typer showed ``<bool>``); a number with bounds shows its kind,
    ``<int>``, the bounds following in brackets (typer's ``<int range>``); a flag given once per value
    (``--trace A --trace B``) shows one value, ``<path>`` (typer's ``<list[Path]>``)."""
    if param.metavar is not None:
        return param.metavar
    if param.is_flag:
        return None
    desc = param.type_descriptor
    if desc.is_list and not desc.is_choice:
        (item,) = typing.get_args(desc.annotation)
        return "<path>" if isinstance(item, type) and issubclass(item, PurePath) else f"<{param._bare_type(item)}>"
    if desc.is_ranged:
        return f"<{desc.ranged_type_name}>"
    return _TYPER_TYPE_COLUMN(param, ctx)


def range_text(param: Any) -> str | None:
    """The bounds after the type: ``x>=1``, ``0<=x<=1``, or the one value a flag takes, ``x=1`` (not ``1<=x<=1``)."""
    if param.min is not None and param.min == param.max:
        return f"x={param.min}"
    return _TYPER_RANGE_TEXT(param)


def help_text(*, text: str, style: str = "", markup_mode: Any) -> Any:
    """Every help text (a command's, a flag's, an epilog) as its source says it: typer reads help as rich markup,
    which ate bracketed text (``value [lo, hi]`` printed ``value``); moetool writes no markup in help, so the
    text is escaped (:func:`rich.markup.escape`) where typer turns it into rich text, the one place all pass."""
    from rich.markup import escape

    return _TYPER_RICH_TEXT(text=escape(text) if markup_mode == "rich" else text, style=style,
                            markup_mode=markup_mode)


_TYPER_TYPE_COLUMN, _TYPER_RANGE_TEXT = TyperOption.display_type_rich, TyperOption._get_number_range_help_str
TyperOption.display_type_rich, TyperOption._get_number_range_help_str = type_column, range_text
_TYPER_RICH_TEXT, typer.rich_utils._make_rich_text = typer.rich_utils._make_rich_text, help_text

for name in command_modules():  # every experiment of the registry (generated ones too), then demo, inspect, report
    importlib.import_module(name).register(app)

_TOPIC = re.compile(r"^[A-Z][\w\-/ ().,]{0,40}:(\s|$)")  # "Cache simulation: ...", "Writes:" start a line of their own


def reflow(text: str) -> str:
    """A command docstring, hard-wrapped in the source, as rich should wrap it: the lines of one sentence joined,
    so a narrow terminal (or a log at 80 columns) re-wraps whole paragraphs instead of breaking every source line
    twice. Kept on their own line: blank-line paragraph breaks, indented lines (examples, column lists; a line
    indented deeper than the one before continues it), lines opening a topic ("Intervals: ...")."""
    out: list[str] = []
    prev_indent = None
    for line in text.strip("\n").splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        joinable = out and out[-1].strip() and stripped and prev_indent is not None and (
            (indent == 0 and prev_indent == 0 and not _TOPIC.match(stripped)) or (indent > prev_indent > 0))
        if joinable:
            out[-1] = out[-1].rstrip() + " " + stripped
        else:
            out.append(line.rstrip())
            prev_indent = indent if stripped else None
    return "\n".join(out)


for _info in app.registered_commands:
    _info.help = reflow(_info.help or inspect.getdoc(_info.callback) or "")

#: environment defaults of the command line (never set by importing a moetool module; a user's value wins)
CLI_ENVIRONMENT = {
    # tokenizers' Rust thread pool and forked lm-eval/datasets workers: no "fork after parallelism" warnings
    "TOKENIZERS_PARALLELISM": "false",
}


#: moetool's own environment variables holding a number of seconds (checked when a command starts)
ENV_SECONDS = ("MOETOOL_HUB_TIMEOUT", "MOETOOL_DIST_TIMEOUT")


def configure_environment() -> None:
    """Process-wide defaults for a ``moetool`` command: :data:`CLI_ENVIRONMENT` (only where unset). Progress bars of
    transformers are switched off where the weights load (:func:`moetool.loading.quiet_transformers`). A bad
    :data:`ENV_SECONDS` value (``-1``, ``inf``, ``nan``) or ``MOETOOL_FIGURES`` value is one usage line before
    anything runs."""
    from moetool.errors import env_figures, env_seconds

    for key, value in CLI_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    for name in ENV_SECONDS:
        env_seconds(name)
    env_figures()


def _version(value: bool) -> None:
    if value:
        from moetool import __version__

        typer.echo(f"moetool {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print moetool's version and exit.")) -> None:
    # runs before every command (the group's help text is the Typer(help=...) above)
    from moetool.errors import MoetoolError

    try:
        configure_environment()
    except MoetoolError as e:  # a bad MOETOOL_*_TIMEOUT or MOETOOL_FIGURES: one line before the command runs
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(e.exit_code) from None


def main() -> None:
    """The ``moetool`` console script. Every error is one line on stderr: a bad flag value or unknown option
    (click's usage errors) exits 2, an error no command turned into one line exits 1 (``MOETOOL_DEBUG=1`` shows
    the traceback)."""
    from .cli import quiet_repeated_interrupts, said_interrupted

    try:
        with quiet_repeated_interrupts():  # more Ctrl-C while the run stops: no traceback from exit handlers
            code = app(prog_name="moetool", standalone_mode=False)
    except Exception as e:  # noqa: BLE001 - click's exceptions (Typer vendors its own click): by class name
        kinds = {c.__name__ for c in type(e).__mro__}
        if "ClickException" in kinds:
            if "UsageError" in kinds and "NoArgsIsHelpError" not in kinds:
                ctx = getattr(e, "ctx", None)
                where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                typer.secho(f"error: {e.format_message()}{where}", fg="red", err=True)
            else:  # `moetool` alone shows the help, as Typer shows it
                from typer import rich_utils

                rich_utils.rich_format_error(e)
            sys.exit(e.exit_code)
        if "Abort" in kinds:  # click's own: Ctrl-C outside a command's handler (startup), or EOF at a prompt
            cause = e.__cause__ or e.__context__
            if isinstance(cause, KeyboardInterrupt):
                said_interrupted()
                typer.secho("interrupted (Ctrl-C)", err=True)
                sys.exit(130)
            if isinstance(cause, EOFError):  # click turns any EOFError into Abort; moetool prompts for nothing, so
                _last_resort(cause)          # it is a command's (a truncated file's): its line, not a bare 'aborted'
            typer.secho("aborted", err=True)
            sys.exit(1)
        _last_resort(e)
    sys.exit(code if isinstance(code, int) else 0)


def _last_resort(e: Exception) -> None:
    """An error no command turned into one line: still one line, exit 1 (``MOETOOL_DEBUG=1`` re-raises). A
    moetool error raised before a command (a bad environment variable) keeps its exit code; a full disk is exit 1
    naming the file (:func:`moetool.errors.write_error`)."""
    from moetool.errors import MoetoolError, is_disk_full, write_error

    if os.environ.get("MOETOOL_DEBUG"):
        raise e
    known = write_error(e) if is_disk_full(e) else e
    if isinstance(known, MoetoolError):
        typer.secho(f"error: {known}", fg="red", err=True)
        sys.exit(known.exit_code)
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    typer.secho(f"error: {type(e).__name__}{': ' + text if text else ''} (MOETOOL_DEBUG=1 shows the traceback)",
                fg="red", err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
