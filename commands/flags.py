"""Flag groups: the standard options of a command, declared once, as ``(parameter, annotation, default)`` in
``--help`` order. Every experiment's command is generated from its spec (:mod:`moetool.commands.generated`): it
takes the groups of what it reads (the spec's ``inputs``: :func:`standard`), the groups and single flags its spec
names (``groups``: ``routing``, ``lmeval``, ``bootstrap``, ``resume``, ``trace``, ``traces``, or a flag of them by
name) and its own :class:`~moetool.experiments.experiment.Flag` s. ``tests/test_flag_groups.py`` checks that every
command that loads a model has every flag of :data:`LOADING` (``--tp`` / ``--ep`` and ``--trust-remote-code`` are
taken into the command's run by :func:`moetool.commands.cli.handle_errors`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from moetool.defaults import FEWSHOT_SEED, MAX_TOKENS, SEQ_LEN

from .options import (BatchSize, Bootstrap, Causal, DEFAULT_BOOTSTRAP, DEFAULT_MODEL, Data, Device, DeviceMap, Dtype,
                      Ep, FewshotSeed, Force, IncludePath, Layers, Limit, MaxTokens, Model, NumFewshot, Out, Quantize,
                      Quiet, Resume, Routing, Seed, SeqLen, Sim, Tp, Trace, TraceConfig, TrustRemoteCode, Weights)

Group = list[tuple[str, Any, Any]]

Checkpoints = Annotated[Optional[List[str]], typer.Argument(help="Two or more checkpoints (embedded names, local "
                                                            "directories, aliases or hub ids), in order.")]
Traces = Annotated[Optional[List[Path]], typer.Option("--trace", help="Two or more recorded routings of the same "
                                                      "tokens (moetool trace / import-trace runs), in order, "
                                                      "instead of checkpoints.")]

#: the model and where the run goes
DATA: Group = [("model", Model, DEFAULT_MODEL), ("data", Data, None), ("out", Out, None), ("force", Force, False)]
#: which layers and how much text, in what batches
SIZES: Group = [("layers", Layers, None), ("seq_len", SeqLen, SEQ_LEN), ("max_tokens", MaxTokens, MAX_TOKENS),
                ("batch_size", BatchSize, 8)]
#: how the model is loaded, and split over processes (--tp / --ep)
LOADING: Group = [("dtype", Dtype, "auto"), ("device", Device, "auto"), ("device_map", DeviceMap, None),
                  ("quantize", Quantize, None), ("trust_remote_code", TrustRemoteCode, False), ("tp", Tp, 1),
                  ("ep", Ep, 1)]
#: every run
RUN: Group = [("seed", Seed, 0), ("quiet", Quiet, False)]

#: the groups a spec may name (``groups=``), beside those of its inputs
GROUPS: dict[str, Group] = {
    "routing": [("routing", Routing, "router"), ("weights", Weights, None), ("sim", Sim, "dot"),
                ("causal", Causal, True)],
    "lmeval": [("num_fewshot", NumFewshot, None), ("limit", Limit, None), ("include_path", IncludePath, None),
               ("fewshot_seed", FewshotSeed, FEWSHOT_SEED)],
    "bootstrap": [("bootstrap", Bootstrap, DEFAULT_BOOTSTRAP)],
    "resume": [("resume", Resume, False)],
    "trace": [("trace", Trace, None), ("trace_config", TraceConfig, None)],
    "traces": [("trace", Traces, None), ("trace_config", TraceConfig, None)],
}
#: every flag of a group by its parameter name (a spec may name one alone: ``groups=("sim", "causal")``)
NAMED: dict[str, tuple[str, Any, Any]] = {p[0]: p for g in (*GROUPS.values(), DATA, SIZES, LOADING, RUN) for p in g
                                          if p[0] != "trace"}

#: the flags of :data:`LOADING` on the command line
LOADING_FLAGS = ("--dtype", "--device", "--device-map", "--quantize", "--trust-remote-code", "--tp", "--ep")


def standard(inputs: str) -> tuple[Group, Group]:
    """The standard groups of a command whose experiment reads ``inputs``: (before the spec's own flags, after
    them). ``tokens``: a model and text; ``weights``: a model's weights alone; ``model``: a loaded model and no text
    (lm-eval brings its own); ``checkpoints``: two or more models as arguments and text; ``config``: a model's
    config alone (nothing loads)."""
    no_data = [g for g in DATA if g[0] != "data"]
    if inputs == "tokens":
        return DATA, SIZES + LOADING + RUN
    if inputs == "weights":
        return no_data, SIZES[:1] + LOADING + RUN
    if inputs == "model":
        return no_data, [SIZES[0], SIZES[3]] + LOADING + RUN
    if inputs == "checkpoints":
        return [("checkpoints", Checkpoints, None), *DATA[1:]], SIZES + LOADING + RUN
    if inputs == "config":  # a config of remote code is read only with --trust-remote-code
        return no_data, [NAMED["trust_remote_code"]] + RUN[1:]
    raise RuntimeError(f"registry: no flag groups for inputs {inputs!r}")
