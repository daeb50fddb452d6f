"""``moetool placement`` (generated from ``moetool/experiments/placement/spec.py``): the stale placement's
reference (``--reference-data`` / ``--reference-model``), ``--export`` to a serving engine's file, and the
placement of a recorded trace (``--trace``)."""

from __future__ import annotations

import dataclasses
from typing import Any


def check(p: Any, opts: Any) -> dict[str, Any]:
    """``--export`` (one placement, a known format) and the references, before anything loads; the references load
    beside the model and the export file is written with the tables."""
    from moetool.errors import MoetoolError
    from moetool.run import preflight

    if p.export is not None:
        from moetool.traces.export import EXPORTS

        if p.export not in EXPORTS or (p.gpus is None or len(set(opts.gpus or ())) != 1
                                       or len(set(opts.extra_slots)) != 1):
            raise MoetoolError(f"--export {p.export}: one of {', '.join(EXPORTS)}, with one --gpus G and one "
                               f"--extra-slots value (it writes one placement)")
        if p.export == "sglang" and opts.layers is not None:  # before anything loads (the config alone)
            from moetool.traces.export import check_sglang_layers
            from moetool.traces.shape import ModelShape

            check_sglang_layers(opts.layers, ModelShape.from_config(p.model))
    if p.reference_data is not None:
        from moetool.data import DocumentStream

        DocumentStream(p.reference_data)  # a missing file fails before the run folder exists
    if p.reference_model is not None:  # configs and vocabularies must agree, before any weight loads
        from moetool.experiments.fluctuation.compute import check_checkpoints

        preflight(p.reference_model)
        check_checkpoints([p.model, p.reference_model])

    def call(compute: Any, args: tuple[Any, ...], kwargs: dict[str, Any], folder: Any) -> Any:
        from moetool.data import load_tokens
        from moetool.loading import load

        lm, tokens, opts = args
        reference = (load_tokens(p.reference_data, lm.tokenizer, p.seq_len, p.max_tokens)
                     if p.reference_data is not None else None)
        ref_lm = (load(p.reference_model, dtype=p.dtype, device=p.device, device_map=p.device_map,
                       quantize=p.quantize, tokenizer=False) if p.reference_model is not None else None)
        res = compute(lm, tokens, opts, reference=reference, reference_model=ref_lm, **kwargs)
        if p.export is not None:
            from moetool.traces.shape import ModelShape

            from moetool.traces.export import placement_loads

            from .trace_input import write_export_file

            write_export_file(folder, p.export, placement_loads(res), opts, ModelShape.from_config(p.model))
        return res

    return {"call": call}


def on_trace(p: Any, opts: Any) -> None:
    from .trace_input import not_default, placement_on_trace, refuse

    refuse({"--data": p.data, "--reference-data": p.reference_data, "--reference-model": p.reference_model,
            **not_default("placement", p, "model", "max_tokens")})  # the trace's model and every token it holds
    placement_on_trace(p.trace, p.trace_config, dataclasses.replace(opts, bootstrap=0), p.out, p.force, p.export,
                       p.quiet)
