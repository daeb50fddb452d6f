"""``moetool``: the Typer app. Each subcommand lives in its own small module."""

from __future__ import annotations

import typer

from . import approx as approx_cmd
from . import demo as demo_cmd
from . import erc as erc_cmd
from . import eval as eval_cmd
from . import fluctuation as fluctuation_cmd
from . import inspect as inspect_cmd
from . import mass_recall as mass_recall_cmd
from . import norm_select as norm_select_cmd
from . import ppl as ppl_cmd
from . import report as report_cmd
from . import stats as stats_cmd
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

for module in (approx_cmd, demo_cmd, erc_cmd, eval_cmd, fluctuation_cmd, inspect_cmd, mass_recall_cmd,
               norm_select_cmd, ppl_cmd, report_cmd, stats_cmd, trace_cmd):
    module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
