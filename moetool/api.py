"""The Python API: the experiments as functions of a loaded model and tokens, returning named DataFrames.

    import moetool
    lm = moetool.load("tiny")                                   # embedded name, alias, local dir or hub id
    tokens = moetool.tokens(lm, "text.jsonl", seq_len=256, max_tokens=8192)   # None: the shipped held-out text
    res = moetool.stats(lm, tokens)                             # a Result: res["load"], res.summary, res.definitions
    moetool.write(res, "runs/stats")                            # the CLI's CSVs, figures and manifest
    res = moetool.run("stats", lm, tokens, out="runs/stats", batch_size="auto", resume=True)  # the CLI's run

Every experiment takes its options dataclass (``moetool.StatsOptions(...)``) or the same options as keywords, and
returns a :class:`~moetool.experiments.result.Result` holding DataFrames with exactly the CLI's CSV columns (the
command is a thin wrapper over the same function). ``moetool.hook`` is the hook engine itself, for custom probes.
Nothing here imports torch until a function is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable


def _timed(model: Any, run: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)`` -> its Result, which records the model (a loaded model's manifest entry, or the
    checkpoint names) and when the computation started and how long it took (for :func:`write`). Each loaded model
    (``model``, or a list of them) is held for the run (:func:`moetool.engine.hooks.hold`): a run on a model another
    thread's run holds, or an open ``moetool.hook`` block, is one line, not mixed numbers."""
    import time

    started, t0 = time.time(), time.perf_counter()
    with _held(model, run):
        res = run(*args, **kwargs)
    res.started, res.wall_seconds = started, round(time.perf_counter() - t0, 3)
    if res.model is None:
        if hasattr(model, "manifest"):
            res.model = model.manifest()
        elif isinstance(model, (str, list)) or model is None:
            res.model = model
        else:  # a transformers config (plan)
            res.model = getattr(model, "_name_or_path", None) or type(model).__name__
    return res


def _held(models: Any, run: Any) -> Any:
    """A context holding each loaded model of ``models`` (one, or a list) for the run ``run`` (a callable, named in
    the refusal) until it ends (:func:`moetool.engine.hooks.hold`); names and configs hold nothing."""
    import contextlib

    stack = contextlib.ExitStack()
    loaded = [m for m in (models if isinstance(models, (list, tuple)) else [models])
              if hasattr(m, "model") and hasattr(m, "layers")]
    if loaded:
        from .engine.hooks import hold

        what = f"a moetool run ({getattr(run, '__name__', type(run).__name__)})"
        try:
            for m in loaded:
                stack.enter_context(hold(m.model, what))
        except BaseException:
            stack.close()  # the models held before the refusal are free again
            raise
    return stack


def load(name: str = "tiny", *, dtype: Any = "auto", device: str = "auto", device_map: str | None = None,
         attn_implementation: str | None = None, tokenizer: bool = True, trust_remote_code: bool = False) -> Any:
    """Load a MoE model (eval mode) with its tokenizer and wrapped MoE layers (``lm.model``, ``lm.layers``,
    ``lm.tokenizer``): ``name`` as ``--model`` takes it, ``dtype`` / ``device`` / ``device_map`` as the flags
    (``dtype`` also as torch names it: ``"bfloat16"``, ``torch.bfloat16``; :func:`moetool.loading.dtype_name`).
    ``attn_implementation``: transformers' (``None``: the model's default); ``routing="attention"`` needs no
    ``"eager"`` here, the engine switches the model to eager attention for its forwards and back.
    ``tokenizer=False``: no tokenizer (``lm.tokenizer`` is ``None``). ``trust_remote_code`` as
    ``--trust-remote-code``: the checkpoint's own code may run -- its tokenizer's, and its config's and model's only
    where transformers has no native class (a config naming a native architecture, as Kimi-K2's
    ``DeepseekV3ForCausalLM``, is read natively without it: :func:`moetool.loading.read_config`)."""
    from .loading import load as _load

    return _load(name, dtype=dtype, device=device, device_map=device_map, attn_implementation=attn_implementation,
                 tokenizer=tokenizer, trust_remote_code=trust_remote_code)


def tokens(lm: Any, data: str | Path | None = None, *, seq_len: int = 256, max_tokens: int = 32768,
           add_special_tokens: bool | None = False) -> Any:
    """Pack ``data`` (text file, JSONL with ``text`` and optional ``domain``, or a folder; ``None`` = the shipped
    held-out text) into rows of ``seq_len`` tokens, at most ``max_tokens`` real tokens (a ``TokenSet``).
    ``add_special_tokens``: ``False`` (the default, every command but ``stats``) adds none, ``None`` the tokenizer's
    own default (a BOS where it adds one: ``moetool stats``), ``True`` its special tokens.

    The defaults are ``moetool stats``' and ``moetool ppl``'s; the other commands read fewer tokens unless told
    (the commands' ``--max-tokens`` defaults: stats and ppl 32768; approx 4096; mass-recall 16384; the others 8192),
    so pass ``max_tokens`` to get a command's numbers, or call ``moetool.run(command, "model name")``, which packs
    the text with the command's own defaults."""
    from .data import load_tokens
    from .errors import MoetoolError, shown
    from .sizing import check_seq_len, check_sizes

    if not hasattr(lm, "tokenizer"):
        raise MoetoolError(f"tokens(lm, ...) takes a loaded model (moetool.load(...)), not {shown(lm)}")
    if lm.tokenizer is None:
        raise MoetoolError("this model was loaded without a tokenizer (load(..., tokenizer=True))")
    check_sizes(seq_len=seq_len, max_tokens=max_tokens)
    check_seq_len(lm.model.config, seq_len)  # rows longer than the model's positions: refused before reading
    return load_tokens(data, lm.tokenizer, seq_len, max_tokens, add_special_tokens=add_special_tokens)


def hook(lm: Any, *, policy: Any = None, layers: Iterable[int] | None = None, consumers: Iterable[Any] = (),
         attention: bool = False, **policy_options: Any) -> Any:
    """The hook engine as a context manager: every forward of ``lm.model`` inside the block hands a
    :class:`~moetool.engine.RoutingEvent` (``h``, ``logits``, ``idx``, ``weights``, ``valid``, ``probs``,
    ``chosen_idx``, ...) to each consumer; ``policy`` (a spec like ``"norm:gate"`` or a policy object; keywords:
    its options, as ``weights="uniform"``) replaces routing in ``layers``. ``attention=True`` hands each event the
    layer's attention probabilities (``attn``; the model runs eager attention inside the block, as it does for a
    policy that reads them). The block leaves autograd as it is: the model's weights require gradients, so a
    forward outside ``torch.no_grad()`` builds the autograd graph, which events kept (``events.append``) hold on to;
    moetool's own forwards run without it.

        with torch.no_grad(), moetool.hook(lm, consumers=[events.append]):
            lm.model(input_ids=ids)
    """
    from .engine.hooks import Engine, select_layers
    from .engine.runner import _consumer_list
    from .errors import MoetoolError, shown

    policy = _policy(policy, policy_options)
    if not (hasattr(lm, "model") and hasattr(lm, "layers")):
        raise MoetoolError(f"moetool.hook takes a loaded model (lm = moetool.load(...)), not {shown(lm)}")
    _refuse_layers_without_policy("moetool.hook", layers, policy, "every MoE layer is hooked: keep the events of "
                                                                  "some by ev.layer.index")
    if layers is not None:
        layers = [L.index for L in select_layers(lm.layers, layers)]
    return Engine(lm.model, lm.layers, policy=policy, policy_layers=layers, consumers=_consumer_list(consumers),
                  attention=attention)


def _policy(policy: Any, policy_options: dict[str, Any]) -> Any:
    """``policy`` as the engine takes it: a spec (``"norm:gate"``) built with its ``policy_options``
    (``weights="uniform"``), a policy object or ``None`` as given; options beside no spec, or unknown ones, are one
    line."""
    from .errors import MoetoolError

    if isinstance(policy, str):
        from .policies import build_policy, option_names

        bad = sorted(set(policy_options) - option_names())
        if bad:
            raise MoetoolError(f"unknown policy option(s) {bad} (known: {', '.join(sorted(option_names()))})")
        return build_policy(policy, **policy_options)
    if policy_options:
        raise MoetoolError(f"policy options {sorted(policy_options)} go with a policy spec (policy='norm:gate'), "
                           f"not with {policy!r}")
    return policy


def inspect_model(name: str) -> dict[str, Any]:
    """What ``moetool inspect --model NAME`` prints, as a dict: family, layers, which are MoE, n, K, routing,
    shared experts, parameters (no weights loaded)."""
    from .inspect import describe_model

    return describe_model(name)


def families(*, refresh: bool = False) -> Any:
    """``moetool inspect --families`` as a DataFrame: one row per MoE model type of the installed transformers,
    supported or not (and why), routing rule, shared experts, dense layers, experts implementation (cached per
    installation; ``refresh=True``: rebuilt, as ``--refresh``)."""
    import pandas as pd

    from .inspect import families as rows

    return pd.DataFrame(rows(cache=not refresh))


def aliases() -> Any:
    """``moetool inspect --aliases`` as a DataFrame: every model alias and embedded model (``name``, ``resolves
    to``); any of them is a name :func:`load` takes."""
    import pandas as pd

    from .inspect import aliases as rows

    return pd.DataFrame(rows())


def write_report(run_dirs: Iterable[str | Path], out: str | Path | None = None, *, force: bool = False,
           title: str = "moetool report") -> Path:
    """``moetool report``: gather run folders (one or more) into one HTML/Markdown page (+ LaTeX/CSV tables, PNG/PDF
    figures) in ``out`` (default ``runs/report-<time>``, as ``--out``); returns the path of ``report.html``."""
    from .report.page import write_report as run

    return run(run_dirs if isinstance(run_dirs, (str, Path)) else _paths(run_dirs, "run_dirs", "a list"), out,
               force=force, title=title)


def run_demo(out: str | Path | None = None, steps: Iterable[str] | None = None, *, force: bool = False,
         quiet: bool = False) -> Path:
    """``moetool demo``: every experiment on the embedded models into ``out`` and a report page; returns the
    folder. ``steps``: a subset of the steps (``--steps``)."""
    from .demo import demo as run

    return run(out, list(steps) if steps else None, force=force, quiet=quiet)[0]


def _refuse_layers_without_policy(call: str, layers: Any, policy: Any, instead: str) -> None:
    """``layers=`` says where a policy routes: without a policy it would be ignored (every MoE layer hooked, every
    event handed over), so it is one line saying what to do ``instead``."""
    from .errors import MoetoolError

    if layers is not None and policy is None:
        raise MoetoolError(f"{call}: layers= picks the layers a policy= routes in, and no policy was given; {instead}")


def _paths(given: Any, what: str, forms: str = "one, or a list") -> list[Any]:
    """One path or an iterable of them as a list (a lone name is one path, never its letters); an empty name or
    anything else is one line: ``Path("")`` is the current folder."""
    from .errors import MoetoolError, shown

    # a table or an array iterates over its column names or rows: never paths
    iterable = hasattr(given, "__iter__") and not isinstance(given, (bytes, dict)) and not hasattr(given, "shape")
    paths = [given] if isinstance(given, (str, Path)) else list(given) if iterable else None
    if paths is None or not all(isinstance(p, (str, Path)) and str(p).strip() for p in paths):
        raise MoetoolError(f"{what} are file or folder names ({forms}), not {shown(given)}")
    return paths


def import_trace(sources: Iterable[str | Path], config: str, out: str | Path | None = None, *,
                 format: str | None = None, force: bool = False) -> Path:
    """``moetool import-trace``: an engine's routing dump (``format`` vllm, sglang-routed, sglang-dump or megatron;
    sniffed when ``None``) checked against the model ``config`` and written as moetool's trace (``trace.parquet``)
    or loads (``loads.parquet``) with a manifest (``routing_source``) into the folder ``out``; returns the file. A
    bad dump raises :class:`~moetool.errors.MoetoolError` before anything is written."""
    import shutil
    import tempfile

    from .errors import MoetoolError
    from .report import RunDir
    from .traces import readers, store
    from .traces.shape import ModelShape

    sources = [str(s) for s in _paths(sources, "sources")]
    if not sources:
        raise MoetoolError("import_trace takes the dump files or folders to read (a list), not []")
    shape = ModelShape.from_config(config)
    if not shape.moe:
        raise MoetoolError(f"--config {config}: no MoE layer")
    run = RunDir.create("import-trace", out, force)  # --out validated first; the folder is made after a clean read
    dump = readers.read(sources, shape, format)
    with tempfile.TemporaryDirectory(prefix="moetool-import-") as tmp:  # nothing written if the dump is bad
        if dump.counts is not None:
            name, kind = store.LOADS, "loads"
            written = store.write_loads(dump.counts, Path(tmp) / name, shape)
        else:
            name, kind = store.TRACE, "trace"
            written = store.write_trace(dump.chunks, shape, Path(tmp) / name)
        with run.atomic(name, rows=store.parquet_rows(Path(tmp) / name)) as dst:  # its rows in the manifest
            shutil.move(str(Path(tmp) / name), dst)
    run.add(routing_source={"format": dump.format, "kind": kind, "files": dump.sources, "ids": dump.ids,
                            "order": dump.order, "weights": "none (the engine records expert ids only)",
                            "read_as": readers.SOURCES[dump.format],
                            "engine_version": dump.describe_version(), "notes": dump.notes,
                            "shape": shape.to_manifest(), **written}, definitions=store.DEFINITIONS)
    run.finish(options={"sources": sources, "format": format, "config": config})
    return run.path / name


def from_trace(experiment: str, traces: str | Path | Iterable[str | Path], config: str | None = None,
               options: Any = None, *, max_tokens: int | None = None, **overrides: Any) -> Any:
    """``moetool stats|placement|offload|fluctuation --trace PATH``: the ``experiment``'s tables from recorded routing
    (a ``moetool trace`` or :func:`import_trace` run folder or file; two or more for fluctuation) instead of a
    forward; ``config`` names the model when the trace does not (``--config``). ``options`` / keywords are the
    experiment's (``moetool.StatsOptions``, ...); those that need a forward (stats: ``layers``; fluctuation:
    ``routing``, ``isolate``, ``layers``) are refused, and stats and placement compute no intervals (one recorded
    routing), as on the command line. ``max_tokens`` caps the tokens read (offload, fluctuation). Returns the
    :class:`Result` (``moetool.write(res, out)`` writes the command's files; :func:`export_placement` its
    ``--export``)."""
    from .errors import MoetoolError
    from .experiments.registry import get
    from .experiments.result import resolve_options
    from .experiments.trace_analyses import TRACE_EXPERIMENTS, analyse
    from .sizing import check_sizes

    spec = get(experiment)
    if spec.name not in TRACE_EXPERIMENTS:
        raise MoetoolError(f"'{spec.name}' has no analysis of recorded routing: {', '.join(TRACE_EXPERIMENTS)}")
    paths = _paths(traces, "traces")
    many = spec.name == "fluctuation"
    if (len(paths) < 2) if many else (len(paths) != 1):
        raise MoetoolError(f"{spec.name} from recorded routing takes " + ("two or more traces (a list)" if many
                                                                          else "one trace") + f", not {paths!r}")
    if max_tokens is not None and spec.name in ("stats", "placement"):
        raise MoetoolError(f"{spec.name} from a trace reads every token it holds: max_tokens does not apply")
    check_sizes(max_tokens=max_tokens)  # as --max-tokens: 0 read every token (no cap), a negative one no row
    opts = resolve_options(spec.options_class(), options, overrides)
    default = spec.options_class()()
    forward = [f for f in TRACE_EXPERIMENTS[spec.name] if getattr(opts, f) != getattr(default, f)]
    if forward:
        raise MoetoolError(f"{', '.join(forward)} need{'s' if len(forward) == 1 else ''} a forward of the model: "
                           "not from a trace")
    names = [str(p) for p in paths]
    return _timed(names if many else names[0], lambda: analyse(spec.name, paths, config, opts, max_tokens)[0])


def export_placement(result: Any, format: str, path: str | Path, *, config: str | None = None,
                     force: bool = False) -> Path:
    """``moetool placement --export sglang|eplb``: EPLB's placement of a ``placement`` result's loads (of the data,
    at its one ``gpus`` G and ``extra_slots``: R = slots x G) written at ``path`` in the file the engine loads
    (:mod:`moetool.traces.export`); returns ``path``. ``sglang`` needs every decoder layer of the model: ``config``
    (a model's name or folder), else the result's model or trace. An existing ``path`` needs ``force``."""
    from .errors import MoetoolError
    from .traces.export import EXPORTS, export_layout, export_placement as export, placement_loads
    from .traces.shape import ModelShape

    if format not in EXPORTS:
        raise MoetoolError(f"format must be one of {', '.join(EXPORTS)}, not '{format}'")
    loads = placement_loads(result)
    export_layout(format, loads["n"], result.options)
    path = Path(path)
    if path.is_dir() or (path.exists() and not force):
        raise MoetoolError(f"{path}: " + ("a folder: give the file's path" if path.is_dir() else
                                          "exists (force=True to replace it)"))
    if not path.parent.is_dir():
        raise MoetoolError(f"{path.parent}: no such folder")
    shape = None
    if format == "sglang":
        trace = result.meta.get("trace")  # a --trace analysis: the shape its trace records (it names its model too)
        model = result.model.get("name") if isinstance(result.model, dict) else None
        if config is None and isinstance(trace, dict) and "shape" in trace:
            shape = ModelShape.from_manifest(trace["shape"])
        elif config is not None or model is not None:
            shape = ModelShape.from_config(str(config if config is not None else model))
    export(format, path, loads, result.options, shape)
    return path


def forward(lm: Any, tokens: Any, **kwargs: Any) -> Any:
    """The one forward loop (:func:`moetool.engine.forward`, whose docstring lists every keyword): ``tokens`` in
    batches of ``batch_size`` rows (default 8) under ``torch.no_grad``, ``policy`` (a spec such as ``"norm:gate"``,
    keywords its options, as ``weights="uniform"``; or a policy object) routing in ``layers`` (default: every MoE
    layer), each routing event handed to ``consumers``; ``quiet=True`` hides the progress bar. Returns a
    ``ForwardResult``: ``seconds``, ``batches``, and with ``nll=True`` the next-token NLL of the real tokens
    (``nll.mean`` in nats per token, ``nll.tokens`` scored, ``perplexity``; NaN without ``nll=True``, the default).
    ``layers`` (where ``policy`` routes) without a policy is refused: the hooked layers are ``moe_layers``."""
    from .engine.runner import forward as run
    from .errors import MoetoolError, shown

    if not (hasattr(lm, "model") and hasattr(lm, "layers")):
        raise MoetoolError(f"moetool.forward takes a loaded model (lm = moetool.load(...)), not {shown(lm)}")
    if not (hasattr(tokens, "input_ids") and hasattr(tokens, "attention_mask")):
        raise MoetoolError(f"moetool.forward takes packed tokens (moetool.tokens(lm, data, ...)), not "
                           f"{shown(tokens, typed=True)}")
    import inspect

    from .policies import option_names

    loop = inspect.signature(run).parameters  # the rest are the spec's options (weights="uniform"), or unknown
    options = {k: kwargs.pop(k) for k in list(kwargs)
               if k in option_names() or (k not in loop and isinstance(kwargs.get("policy"), str))}
    kwargs["policy"] = _policy(kwargs.get("policy"), options)
    _refuse_layers_without_policy("moetool.forward", kwargs.get("layers"), kwargs["policy"],
                                  "to hook only some MoE layers pass moe_layers=[lm.layers[i] ...]")
    return run(lm, tokens, **kwargs)


def write(result: Any, out: str | Path, *, force: bool = False, model: Any = None) -> Path:
    """Write a :class:`Result` as the CLI does (CSVs, figures, manifest.json) into the folder ``out``. The manifest's
    model (unless ``model`` is given), ``started`` and ``wall_seconds`` are the result's: from the start of the
    computation to the end of the write."""
    from .report import RunDir
    from .report.writers import write as _write

    _require_result("moetool.write", result)
    with RunDir.create(result.name.replace("_", "-"), out, force) as run:  # an error marks the run failed
        _write(result, run, model=model)
    return run.path


def figures(result: Any) -> dict[str, Any]:
    """The experiment's figures as ``{name: matplotlib Figure}`` (the ones ``write`` saves; ``{}`` for a result
    drawn as tables only)."""
    from .report.plots import figures as _figures

    _require_result("moetool.figures", result)
    return _figures(result)


def _require_result(call: str, result: Any) -> None:
    """``result`` is a :class:`Result` (a name and tables): one line naming what was passed otherwise (a command's
    name, a DataFrame), not an AttributeError from the writer or the plots."""
    from .errors import MoetoolError, shown

    if not (hasattr(result, "name") and hasattr(result, "tables")):
        raise MoetoolError(f"{call} takes a Result (what moetool.stats(...) and the others return), not "
                           f"{shown(result)}")


def check_inputs(spec: Any, lm: Any, tokens: Any, call: str | None = None) -> None:
    """An experiment of a loaded model (``spec.inputs`` ``"tokens"`` or ``"weights"``) is given one, and a
    ``"tokens"`` one packed tokens: one line naming what to pass otherwise (a model's name, a path, a tensor), not
    an AttributeError from inside the experiment. ``None`` is left to the experiment, which checks its options
    first. An experiment that loads its model itself (``loads_model=False``: agreement, once per precision) takes
    its name too. ``call``: how the user called it (default ``moetool.<api>``)."""
    from .errors import MoetoolError, shown

    if spec.inputs not in ("tokens", "weights", "checkpoints"):
        return
    call = call or f"moetool.{spec.api}"
    if spec.inputs == "checkpoints":  # a list of names or of loaded models (a lone name would be read by letter)
        if lm is not None and (isinstance(lm, (str, Path, bytes)) or not isinstance(lm, (list, tuple))):
            raise MoetoolError(f"{call} takes a list of two or more checkpoints (names or paths, or models from "
                               f"moetool.load), not {shown(str(lm) if isinstance(lm, Path) else lm)}")
        kinds = [isinstance(c, (str, Path)) or (hasattr(c, "model") and hasattr(c, "layers")) for c in lm or ()]
        named = {isinstance(c, (str, Path)) for c in lm or ()}
        if not all(kinds) or len(named) > 1:
            raise MoetoolError(f"{call} takes checkpoints all named or all loaded (moetool.load(...)), not "
                               f"{', '.join(type(c).__name__ for c in lm)}"[:300])
    else:
        named = isinstance(lm, (str, Path)) and not spec.loads_model  # it loads the model itself (agreement)
        if lm is not None and not named and not (hasattr(lm, "model") and hasattr(lm, "layers")):
            raise MoetoolError(f"{call} takes a loaded model (lm = moetool.load(...)), not {shown(lm)}")
    for model in (lm if isinstance(lm, (list, tuple)) else [lm]):
        if hasattr(model, "model") and hasattr(model, "layers"):
            from .engine.hooks import check_free
            from .engine.runner import check_weights

            check_weights(model.model)  # weights on the meta device: one line before the experiment
            check_free(model.model)  # another thread's run or an open moetool.hook block: before any run folder
    if spec.inputs == "weights" and hasattr(tokens, "input_ids") and hasattr(tokens, "attention_mask"):
        raise MoetoolError(f"{call} reads the weights alone: it takes no tokens (the model, then its options, or "
                           f"these as keywords)")
    if spec.inputs != "weights" and tokens is not None and not (hasattr(tokens, "input_ids")
                                                                and hasattr(tokens, "attention_mask")):
        raise MoetoolError(f"{call} takes packed tokens (moetool.tokens(lm, data, ...)), not "
                           f"{shown(tokens, typed=True)}")
    if spec.inputs != "weights" and tokens is not None:
        from .data import check_packed, check_tokenizer

        check_packed(tokens)  # ids, mask and domains of the same rows, before the experiment reads any
        for model in (lm if isinstance(lm, (list, tuple)) else [lm]):
            if hasattr(model, "model") and hasattr(model, "layers"):
                check_tokenizer(tokens, getattr(model, "tokenizer", None))  # another model's vocabulary: one line


class ExperimentFunction:
    """``moetool.<experiment>``: the experiment's compute function (:mod:`moetool.experiments.registry`), imported
    on the first call, so ``import moetool`` and resolving the name stay free of torch. ``__doc__`` and
    ``__signature__`` are the function's own (reading them imports it)."""

    def __init__(self, spec: Any):
        self._spec = spec
        self.__name__ = self.__qualname__ = spec.api
        self.__module__ = "moetool"

    @property
    def function(self) -> Any:
        return self._spec.load()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The experiment, its Result recording the model and the computation's start and wall time; called
        outside a run (not by :func:`moetool.run` or a command), in a run of its own whose suggestions name the
        experiment's dtype keyword (agreement's ``precisions=``: :func:`moetool.context.dtype_choice`)."""
        from .context import RunState, current

        if current() is None:
            with RunState(dtype_flag=self._spec.dtype_flag).active():
                return self._call(*args, **kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("lm", kwargs.get("checkpoints", kwargs.get("model")))
        if args or "lm" in kwargs or "checkpoints" in kwargs:
            check_inputs(self._spec, first, args[1] if len(args) > 1 else kwargs.get("tokens"))
        if self._spec.inputs == "checkpoints" and first is not None:
            with _held(first, self.function):  # loaded checkpoints: each held for the run, recorded by name
                return _timed([getattr(c, "name", c) for c in first], self.function, *args, **kwargs)
        return _timed(first, self.function, *args, **kwargs)

    @property  # type: ignore[override]
    def __doc__(self) -> str | None:  # noqa: D105
        return self.function.__doc__

    @property
    def __signature__(self) -> Any:
        import inspect

        return inspect.signature(self.function)

    def __repr__(self) -> str:
        return f"<moetool.{self._spec.api}: {self._spec.module}.{self._spec.function}>"


def _exports() -> dict[str, str]:
    from .experiments.registry import EXPERIMENTS

    out: dict[str, str] = {}
    for spec in EXPERIMENTS.values():  # every experiment's function and options dataclass
        globals()[spec.api] = ExperimentFunction(spec)
        out[spec.api] = f"moetool.api:{spec.api}"
        if spec.options:
            out[spec.options] = f"{spec.module}:{spec.options}"
    return {
        **out,
        **{name: f"moetool.api:{name}" for name in (
            "load", "tokens", "inspect_model", "families", "aliases", "write_report", "run_demo", "hook", "forward",
            "write", "figures", "import_trace", "from_trace", "export_placement")},
        "run": "moetool.run",  # the module itself: callable (moetool.run._CallableModule), whichever import came first
        "Run": "moetool.run:Run",
        "Result": "moetool.experiments.result:Result",
        "RoutingEvent": "moetool.engine.hooks:RoutingEvent",
        "MoetoolError": "moetool.errors:MoetoolError",
    }


#: name in ``import moetool`` -> "module:attr" or "module" (resolved on first use by ``moetool.__getattr__``)
EXPORTS = _exports()
