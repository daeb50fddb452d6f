"""Flag groups: the standard options of a command, declared once, as ``(parameter, annotation, default)`` in
``--help`` order. A command generated from its spec (:mod:`moetool.commands.generated`) takes the groups of what
it reads (``inputs``); a hand-written command names the same annotations (:mod:`moetool.commands.options`), and
``tests/test_flag_groups.py`` checks that every command that loads a model has every flag of :data:`LOADING` (``--tp``
/ ``--ep`` are declared with the loading flags: :func:`moetool.commands.options.handle_errors` takes them into the
command's run).
"""

from __future__ import annotations

from typing import Any

from .options import (BatchSize, DEFAULT_MODEL, Data, Device, DeviceMap, Dtype, Ep, Force, Layers, MaxTokens, Model,
                      Out, Quantize, Quiet, Seed, SeqLen, Tp)

Group = list[tuple[str, Any, Any]]

#: the model and where the run goes
DATA: Group = [("model", Model, DEFAULT_MODEL), ("data", Data, None), ("out", Out, None), ("force", Force, False)]
#: which layers and how much text, in what batches
SIZES: Group = [("layers", Layers, None), ("seq_len", SeqLen, 256), ("max_tokens", MaxTokens, 8192),
                ("batch_size", BatchSize, 8)]
#: how the model is loaded, and split over processes (--tp / --ep)
LOADING: Group = [("dtype", Dtype, "auto"), ("device", Device, "auto"), ("device_map", DeviceMap, None),
                  ("quantize", Quantize, None), ("tp", Tp, 1), ("ep", Ep, 1)]
#: every run
RUN: Group = [("seed", Seed, 0), ("quiet", Quiet, False)]

#: the flags of :data:`LOADING` on the command line
LOADING_FLAGS = ("--dtype", "--device", "--device-map", "--quantize", "--tp", "--ep")

#: inputs -> the groups of a generated command: (before the spec's own flags, after them)
STANDARD: dict[str, tuple[Group, Group]] = {
    "tokens": (DATA, SIZES + LOADING + RUN),
    "weights": ([g for g in DATA if g[0] != "data"], SIZES[:1] + LOADING + RUN),
}
