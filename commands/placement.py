"""``moetool placement``: expert-parallel placement what-if -- per-GPU load imbalance, static layouts vs EPLB."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .trace_input import Trace, TraceConfig
from .options import (BatchSize, Bootstrap, Data, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Device, DeviceMap, Dtype, Ep, Force,
                      Layers, MaxTokens, Model, Out, Quantize, Quiet, Seed, SeqLen, Tp, finish_command, handle_errors,
                      parse_layers, parse_list, preflight, start_run)
from moetool.experiments.placement import spec as _spec

HELP = _spec.__doc__  # the experiment's description lives in moetool/experiments/placement/spec.py


@handle_errors
def placement(model: Model = DEFAULT_MODEL, data: Data = None, out: Out = None, force: Force = False,
              gpus: str = typer.Option(None, "--gpus", help="GPU counts G, comma-separated; each must divide the "
                                                            "number of experts (default: powers of two up to n)."),
              extra_slots: str = typer.Option("0,1", "--extra-slots", help="Redundant replica slots per GPU for "
                                                                             "EPLB, comma-separated (R = slots x G)."),
              nodes: int = typer.Option(1, "--nodes", help="Nodes for EPLB's hierarchical packing (divides G)."),
              groups: int = typer.Option(None, "--groups", help="Expert groups for EPLB (default: the model's "
                                                                "routing groups, else 1)."),
              reference_data: Optional[Path] = typer.Option(None, "--reference-data", help="Text/JSONL whose loads "
                                                            "the stale EPLB placement is computed from."),
              reference_model: str = typer.Option(None, "--reference-model", help="Checkpoint (same architecture "
                                                  "and tokenizer) whose loads the stale EPLB placement is "
                                                  "computed from."),
              layers: Layers = None, seq_len: SeqLen = 256, max_tokens: MaxTokens = 8192, batch_size: BatchSize = 8,
              dtype: Dtype = "auto", device: Device = "auto", device_map: DeviceMap = None, quantize: Quantize = None,
              tp: Tp = 1, ep: Ep = 1,
              seed: Seed = 0, bootstrap: Bootstrap = DEFAULT_BOOTSTRAP, quiet: Quiet = False,
              trace: Optional[Path] = Trace, trace_config: Optional[str] = TraceConfig,
              export: str = typer.Option(None, "--export", help="Also write the EPLB placement at the one --gpus G "
                                                                "and --extra-slots given, as the engine loads it: "
                                                                "sglang (--init-expert-location file) or eplb "
                                                                "(phy2log, log2phy, logcnt).")) -> None:
    if trace is not None:  # recorded routing instead of a forward (commands/trace_input.py)
        from moetool.experiments.placement.compute import PlacementOptions

        from .trace_input import placement_on_trace, refuse

        refuse({"--data": data, "--reference-data": reference_data, "--reference-model": reference_model})
        return placement_on_trace(trace, trace_config, PlacementOptions(
            gpus=tuple(parse_list(gpus, int, "G")) if gpus else None,
            extra_slots=tuple(parse_list(extra_slots, int, "slots")), nodes=nodes, groups=groups,
            layers=parse_layers(layers), batch_size=batch_size, bootstrap=0, seed=seed), out, force, export)
    preflight(model)  # before the experiment's imports: a bad --model fails at once
    from moetool.data import DocumentStream, load_tokens
    from moetool.loading import load
    from moetool.experiments.placement.compute import PlacementOptions, placement as compute

    opts = PlacementOptions(gpus=tuple(parse_list(gpus, int, "G")) if gpus else None,
                            extra_slots=tuple(parse_list(extra_slots, int, "slots")), nodes=nodes, groups=groups,
                            layers=parse_layers(layers), batch_size=batch_size, bootstrap=bootstrap, seed=seed)
    if export is not None:  # checked before the forward: one placement, a known format
        from moetool.errors import MoetoolError
        from moetool.traces.export import EXPORTS

        if export not in EXPORTS or (gpus is None or len(set(parse_list(gpus, int, "G"))) != 1
                                     or len(set(opts.extra_slots)) != 1):
            raise MoetoolError(f"--export {export}: one of {', '.join(EXPORTS)}, with one --gpus G and one "
                               f"--extra-slots value (it writes one placement)")
    if reference_data is not None:
        DocumentStream(reference_data)  # a missing file fails before the run folder exists
    if reference_model is not None:  # configs and vocabularies must agree, before any weight loads
        from moetool.experiments.fluctuation.compute import check_checkpoints

        preflight(reference_model)
        check_checkpoints([model, reference_model])
    started = start_run("placement", out, force, model, data=data, seq_len=seq_len, max_tokens=max_tokens,
                        batch_size=batch_size, dtype=dtype, device=device, device_map=device_map, quantize=quantize)
    _, lm, tokens = started
    reference = (load_tokens(reference_data, lm.tokenizer, seq_len, max_tokens) if reference_data is not None
                 else None)
    ref_lm = (load(reference_model, dtype=dtype, device=device, device_map=device_map, quantize=quantize,
    tokenizer=False)
              if reference_model is not None else None)
    res = compute(lm, tokens, opts, reference=reference, reference_model=ref_lm, quiet=quiet)
    if export is not None:
        from moetool.traces.shape import ModelShape

        from .trace_input import loads_of_result, write_export_file

        write_export_file(started.run, export, loads_of_result(res), opts, ModelShape.from_config(model))
    finish_command(started, res, f"per-GPU load imbalance (max/mean): {model} ({tokens.n_tokens:,} tokens)",
                   "placement_overall.csv")


def register(app: typer.Typer) -> None:
    app.command(help=HELP)(placement)
