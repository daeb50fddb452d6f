"""``moetool``: the Typer app. Each subcommand lives in its own small module."""

from __future__ import annotations

import typer

from . import inspect as inspect_cmd
from . import trace as trace_cmd

app = typer.Typer(
    name="moetool",
    help="Mixture-of-Experts routing research: hook every MoE layer of a Hugging Face checkpoint, "
         "run routing experiments, write CSV tables and figures. Start with `moetool demo`.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode="rich",
)

for module in (inspect_cmd, trace_cmd):
    module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
