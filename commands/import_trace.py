"""``moetool import-trace``: an engine's routing dump (vLLM, SGLang, Megatron-Core) as moetool's own trace."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from .cli import finish, handle_errors
from .options import Force, Out, Quiet, parse_path

HELP = """Read a serving or training engine's routing dump into moetool's own trace.

Formats (--format, sniffed from the files when left out; mixed formats in one call are refused):
  vllm: per-request routed experts (vLLM --enable-return-routed-experts): .npy files
    of each RequestOutput output's routed_experts, or JSONL of API responses (one a line,
    each choice's routed_experts = base64 of a .npy file); logical ids, num_tokens - 1 rows,
    dense layers zero rows
  sglang-routed: per-request routed experts (SGLang --enable-return-routed-experts,
    return_routed_experts): JSONL of /generate responses (meta_info.routed_experts) or
    OpenAI responses (sglext.routed_experts), base64 int32 reshaped from --config
  sglang-dump: the expert distribution recorder's .pt files (stat, per_pass: counts;
    per_token: per-token physical ids mapped to logical with the dump's map) or the legacy
    layer_id,expert_id,count CSV; several files (ranks) are summed
  megatron: Megatron-Core's router_trace_rank*.jsonl (--moe-routing-trace-path); ids come
    sorted by expert id (the top-K order is lost), MTP records are skipped
A folder stands for its .jsonl/.npy/.pt/.csv files. --config (a model name or folder with a
config.json; read on the meta device, no weights) says which layers are MoE, n and K: the
dump must agree (layer count, top-K, ids below n, dense layers empty, token ids below its
vocabulary), else one line, exit 2, nothing written. .pt files are read with
torch.load(weights_only=True).

Writes trace.parquet (per-token formats; the schema of moetool trace: row, pos, token_id,
domain, layer, expert_1..expert_K, weight_1..weight_K -- weights NaN, the engines record ids
only; token_id -1 where the dump has none) or loads.parquet (counts-only dumps: layer,
expert, count) and manifest.json (routing_source: format, files, ids' kind, order, notes,
the model's shape). Analyse it with moetool stats / placement / offload / fluctuation --trace.

Examples:
  moetool import-trace responses.jsonl --config Qwen/Qwen3-30B-A3B --out runs/vllm-trace
  moetool import-trace /tmp/sglang_dump --format sglang-dump --config deepseek-ai/DeepSeek-V3
  moetool import-trace traces/ --format megatron --config my-checkpoint --out runs/mcore
"""


@handle_errors
def import_trace(sources: List[Path] = typer.Argument(..., parser=parse_path, help="Dump files or folders (one format)."),
                 fmt: str = typer.Option(None, "--format", help="vllm, sglang-routed, sglang-dump or megatron "
                                                                "(default: sniffed from the files)."),
                 config: str = typer.Option(..., "--config", help="The model whose routing was recorded: a name or "
                                                                  "a folder with its config.json (no weights read)."),
                 out: Out = None, force: Force = False, quiet: Quiet = False) -> None:
    import json

    from moetool.api import import_trace as run_import

    path = run_import(sources, config, out, format=fmt, force=force)
    rs = json.loads((path.parent / "manifest.json").read_text())["routing_source"]
    for note in rs["notes"]:  # the dump's caveats: notes, printed under --quiet too
        typer.echo(f"note: {note}")
    counted = {k: rs[k] for k in ("tokens", "rows", "requests", "assignments") if k in rs}
    finish(None, path, quiet, lambda: typer.echo(f"{rs['format']}: " + ", ".join(
        f"{v:,} {k if v != 1 else k[:-1]}" for k, v in counted.items())))


def register(app: typer.Typer) -> None:
    app.command("import-trace", help=HELP)(import_trace)
