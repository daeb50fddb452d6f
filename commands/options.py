"""The flags of the command line, declared once as annotated types (grouped in :mod:`moetool.commands.flags`);
the error path and the list flags' parsers are :mod:`moetool.commands.cli`'s (a path's and ``--batch-size``'s are
here), the run :mod:`moetool.run`'s.

Nothing here imports torch: ``moetool --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from moetool.defaults import DEFAULT_BOOTSTRAP, MAX_BOOTSTRAP  # noqa: F401 - numpy-free (the library's one default)
from moetool.run import DEFAULT_MODEL  # noqa: F401 - torch-free


def parse_path(value: Any) -> Path:
    """A path flag's text as a ``Path``; an empty one (``--data ""``, an unset shell variable) is refused: ``Path("")``
    is the current folder, so ``--data ""`` read every text file under it and ``--out ""`` wrote there."""
    if isinstance(value, Path):
        return value
    if not str(value).strip():
        raise typer.BadParameter("an empty path (the current folder is '.')")
    return Path(value)


Model = Annotated[str, typer.Option("--model", "-m", help="Embedded name (tiny, tiny-fine, ...), alias "
                                    "(moetool inspect --aliases), local directory or hub id.")]
Data = Annotated[Optional[Path], typer.Option("--data", "-d", parser=parse_path, metavar="<path>", help="Text file, JSONL (text, optional domain: a "
                                              "string or null; a number, boolean, list or object is refused) or a "
                                              "folder of them. Default: the held-out text shipped with moetool.")]
SeqLen = Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per packed row.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=2, help="Cap on real (unpadded) tokens read from --data.")]
AUTO_BATCH = 0  # what --batch-size auto parses to; handle_errors replaces it by the chosen number of rows


def parse_batch_size(value: Any) -> int:
    """``--batch-size N`` (N >= 1) or ``auto`` (:data:`AUTO_BATCH`, resolved by :func:`moetool.run.resolve_batch_size`)."""
    if isinstance(value, int):
        return value
    if str(value).strip().lower() == "auto":
        return AUTO_BATCH
    try:
        n = int(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is neither a number of rows nor 'auto'") from None
    if n < 1:
        raise typer.BadParameter(f"{n} is not a number of rows (at least 1) nor 'auto'")
    return n


BatchSize = Annotated[int, typer.Option("--batch-size", "-b", parser=parse_batch_size, metavar="N|auto",
                                        help="Rows per forward pass (per process under torchrun). 'auto': the "
                                             "largest batch the device's free memory holds (see README, Scale).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto|bf16|fp16|fp32 (auto: the checkpoint's; fp32 on CPU).")]
Device = Annotated[str, typer.Option("--device", help="auto|cuda|cpu.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="'auto': let accelerate spread a model "
                                                  "larger than one GPU over GPUs and CPU.")]
Quantize = Annotated[Optional[str], typer.Option("--quantize", metavar="fp8", help="fp8: load a bf16 checkpoint with "
                                                 "transformers' block-scaled FP8 quantization (CUDA only; "
                                                 "Mixtral-8x7B then fits one 80 GB GPU).")]
TrustRemoteCode = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Let the checkpoint run its own code (transformers' trust_remote_code): a tokenizer "
    "that is remote code (Kimi-K2's); a config and model only where transformers has no native class for it (a "
    "config naming a native architecture, Kimi-K2's DeepseekV3ForCausalLM, is read natively without this flag). "
    "moetool's adapters then decide: a model they do not recognise is one line, not a supported MoE family.")]
TP_HELP = ("Tensor parallel: split attention heads and every expert's features over N processes with transformers' "
           "own engine (under torchrun; world = data parallel x N). See README, Several GPUs and nodes.")
EP_HELP = ("Expert parallel: whole experts split over the N processes of the --tp group instead of each "
           "expert's features (N must equal --tp). Under torchrun.")
Tp = Annotated[int, typer.Option("--tp", min=1, help=TP_HELP)]
Ep = Annotated[int, typer.Option("--ep", min=1, help=EP_HELP)]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", parser=parse_path, metavar="<path>", help="Run directory (default runs/<command>-<time>).")]
Force = Annotated[bool, typer.Option("--force", help="Write into a non-empty --out.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the interrupted run in --out from its last "
                                      "finished unit (same options; same result as an uninterrupted run).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of every random choice.")]
Layers = Annotated[Optional[str], typer.Option("--layers", help="MoE layers the command acts on (decoder "
                                               "indices): where the policy replaces routing, or the layers an "
                                               "analysis covers; e.g. '0,2,5-7' (default: every MoE layer).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars and no console tables (every table "
                                     "is in the run folder): only notes and warnings, what the run left out, and "
                                     "the line naming what it wrote.")]
Bootstrap = Annotated[int, typer.Option("--bootstrap", min=0, max=MAX_BOOTSTRAP, help="Replicates of the document-level bootstrap "
                                        "over packed rows (seeded by --seed) for 95% intervals: *_lo/*_hi CSV "
                                        "columns, error bars, 'value ± half-width' in tables ('value [lo, hi]' where the "
                                        "interval is not symmetric). 0 = off; else 100 to 100,000.")]

# routing: a policy spec everywhere ("router" = the model's own routing) and the options policies read
Routing = Annotated[str, typer.Option("--routing", "-r", help="Routing policy: router, norm:<node>[:<norm>], random, "
                                      "topk:<k>, topp:<p>[:<kmax>], capacity:<cf>[:order|score], "
                                      "prune:<criterion>:<fraction>[:<csv>], prune:file:<path>, similarity[:tau], "
                                      "attention (README, Commands).")]
Weights = Annotated[Optional[str], typer.Option("--weights", help="Weights of the experts a norm policy chose: "
                                                "softmax (over their norms, AoE Algorithm 1; the default), router (the "
                                                "model's probabilities, renormalised as the model does) or uniform "
                                                "(1/K). Only with norm policies: refused with any other --routing.")]
Sim = Annotated[str, typer.Option("--sim", help="similarity policy: dot (raw h_i·h_j, the paper) or cosine.")]
Causal = Annotated[bool, typer.Option("--causal/--no-causal", help="similarity policy: only tokens j <= i "
                                      "(default).")]

# lm-eval
NumFewshot = Annotated[Optional[int], typer.Option("--num-fewshot", min=0, help="Few-shot examples per item "
                                                   "(default: the task's own).")]
Limit = Annotated[Optional[int], typer.Option("--limit", min=1, help="At most this many items per task (default: "
                                              "all).")]
FewshotSeed = Annotated[int, typer.Option("--fewshot-seed", help="Seed of lm-eval's few-shot sampler "
                                          "(default: lm-eval's own, 1234: the examples lm_eval picks).")]
IncludePath = Annotated[Optional[Path], typer.Option("--include-path", parser=parse_path, metavar="<path>",
                                                     help="Folder of extra lm-eval task YAMLs.")]

# recorded routing instead of a forward (commands/trace_input.py)
Trace = Annotated[Optional[Path], typer.Option("--trace", parser=parse_path, metavar="<path>", help="Analyse the routing in this trace (a moetool trace / "
                                               "import-trace run folder, or its trace or loads Parquet file) "
                                               "instead of running --model on --data.")]
TraceConfig = Annotated[Optional[str], typer.Option("--trace-config", help="With --trace: the model whose routing "
                                                    "it is, when the trace's manifest does not say (a name or "
                                                    "config folder).")]
