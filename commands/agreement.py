"""``moetool agreement`` (generated from ``moetool/experiments/agreement/spec.py``): the model as an argument or
``--model``, no ``--dtype`` / ``--quantize`` (it loads the model once per ``--precisions`` entry: fp32/bf16/fp16,
fp8/fp4/mxfp4 simulated; a dtype or quantization would contradict them), its console table."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from moetool.run import DEFAULT_MODEL

PARAMS = [("model_arg", Annotated[Optional[str], typer.Argument(metavar="MODEL", help="The model (as --model).")],
           None),
          ("model", Annotated[Optional[str], typer.Option("--model", "-m", help="Embedded name (tiny, tiny-fine, ...), "
                                                          "alias (moetool inspect --aliases), local directory or hub "
                                                          f"id (default {DEFAULT_MODEL}).")], None)]
WITHOUT = ("dtype", "quantize")


def model(p: Any) -> str:
    if p.model_arg and p.model and p.model_arg != p.model:
        raise typer.BadParameter(f"the model is given twice ({p.model_arg} and --model {p.model})")
    p.model = p.model_arg or p.model or DEFAULT_MODEL
    return p.model


def check(p: Any, opts: Any) -> dict[str, Any]:
    """The memory check sizes the reference precision's load; the manifest records the device."""
    from moetool.experiments.agreement.compute import LOAD_DTYPE, PRECISIONS

    return {"dtype": LOAD_DTYPE[PRECISIONS[opts.reference][0]], "manifest": {"device": p.device}}


def show(res: Any, p: Any) -> None:
    from moetool.report.console import print_table, with_ci

    print_table(with_ci(res.summary), f"routing agreement across precisions: {p.model} "
                                      f"({res.tokens.n_tokens:,} tokens)", csv="agreement.csv")
