"""``moetool inspect``: what the MoE layers of a model look like (no weights are loaded)."""

from __future__ import annotations

import json

import typer

from .cli import handle_errors
from .options import DEFAULT_MODEL, Model, TrustRemoteCode

HELP = """Family, layers, which are MoE, n, K, scoring, shared experts, total and active parameters.

Active parameters count everything a token uses, the embedding table and the output head included (as
Mistral, Qwen, OLMoE and Phi publish them); DeepSeek and OpenAI publish them without the embedding
table, also printed (embedding_params in --json).

The model is built on the meta device from its config, so even a 671B checkpoint is inspected
in seconds without downloading weights (the config must be readable).

Examples:
  moetool inspect                      # the embedded default model
  moetool inspect --model tiny-fine --json
  moetool inspect --aliases            # short names of well-known checkpoints
  moetool inspect --families           # every MoE model type of the installed transformers
  moetool inspect --families --json    # the same rows as JSON

--families builds a tiny model of each family once per installation (15 s
to minutes on a CPU) and keeps the table in ~/.cache/moetool
(MOETOOL_CACHE_DIR, XDG_CACHE_HOME), keyed by the transformers, torch and
moetool versions and moetool's adapter code; later calls answer from it
(--refresh rebuilds it).
"""


@handle_errors
def inspect(model: Model = DEFAULT_MODEL,
            as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
            aliases: bool = typer.Option(False, "--aliases", help="List model aliases and embedded models."),
            families: bool = typer.Option(False, "--families", help="One row per MoE model type of the installed "
                                          "transformers: supported or why not, routing rule, shared experts, "
                                          "dense layers, experts implementation (checked on a tiny model of each, "
                                          "cached per installation)."),
            refresh: bool = typer.Option(False, "--refresh", help="--families: rebuild the cached table."),
            trust_remote_code: TrustRemoteCode = False) -> None:
    from moetool.errors import MoetoolError, spans
    from moetool.report.console import console

    listing = "--families lists every MoE family" if families else "--aliases lists every alias" if aliases else None
    if listing and model != DEFAULT_MODEL:
        raise MoetoolError(f"{listing}, not one model: drop --model {model}")
    if refresh and not families:
        raise MoetoolError("--refresh rebuilds the --families table: give --families")
    if families:
        import pandas as pd

        from moetool.inspect import families as family_rows
        from moetool.report.console import print_table

        rows = family_rows(cache=not refresh, notice=None if as_json else lambda line: typer.echo(line, err=True))
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        n_ok = sum(r["supported"] == "yes" for r in rows)
        print_table(pd.DataFrame(rows), title=f"MoE model types: {n_ok} supported of {len(rows)}", max_rows=len(rows),
                    whole_when_piped=True)  # piped into a file or grep: one line a model type
        return
    if aliases:
        from moetool.inspect import aliases as alias_rows

        rows = alias_rows()
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        import pandas as pd

        from moetool.report.console import print_table

        print_table(pd.DataFrame(rows), title="model aliases", max_rows=len(rows), whole_when_piped=True)  # every alias
        return
    from moetool.inspect import describe_model

    info = describe_model(model)
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    import pandas as pd

    from moetool.report.console import fraction_text, print_table

    c = console()
    c.print(f"{info['name']} -> {info['source']}  family {info['family']} "
            f"({info['model_type']}), {info['num_layers']} decoder layers, {len(info['moe_layers'])} MoE")
    embed = info.get("embedding_params")
    c.print(f"parameters: total {info['total_params']:,}, active per token {info['active_params']:,} "
            f"({fraction_text(info['active_params'] / info['total_params'])} of the total; embedding table and output "
            "head included"
            + (f", {info['active_params'] - embed:,} without the {embed:,} of the embedding table" if embed else "")
            + ")")
    cols = ("n_experts", "top_k", "scoring", "renormalize", "shared_experts", "router_bias", "expert_params")
    if any("stack" in L for L in info["moe_layers"]):  # an encoder-decoder: which stack, and the block in it
        cols = ("stack", "stack_layer", *cols)
    cell = lambda v: f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)  # noqa: E731
    groups: dict[tuple[str, ...], list[int]] = {}  # layers described alike: one row (DeepSeek-V3: 58 layers, 1 row)
    first: dict[tuple[str, ...], dict] = {}  # each group's values as described (numbers stay numbers)
    for L in info["moe_layers"]:
        key = tuple(cell(L[k]) for k in cols if k != "stack_layer")
        groups.setdefault(key, []).append(L["layer"])
        first.setdefault(key, L)
    shown = [k for k in cols if k != "stack_layer"]
    scoring = {g[shown.index("scoring")] for g in groups}
    if len(scoring) == 1:  # one rule for every layer: a line of its own, not a column wrapped over many lines
        c.print(f"scoring (every MoE layer): {scoring.pop()}")
        shown = [k for k in shown if k != "scoring"]
    # the console's table: numbers never cut (a wide table is paged with its key column), text wrapped
    print_table(pd.DataFrame([{"layers": spans(layers), **{k: first[key][k] for k in shown}}
                              for key, layers in groups.items()]), title="MoE layers", max_rows=len(groups), keys=1,
                intfmt="{:,}")  # expert_params 589,824 as the parameters line above
    if info["dense_layers"]:
        c.print(f"dense (non-MoE) decoder layers: {spans(info['dense_layers'])}")
    fmt = info["experts_format"]
    c.print(f"experts: {fmt['format']}; on a GPU {fmt['gpu']}; on CPU {fmt['cpu']}")
    c.print(f"  routing: {fmt['routing']}")
    c.print(f"  weight-reading commands (approx, erc, norm-select, prune, super-experts, norm:<node>): "
            f"{fmt['weights']}")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(inspect)
