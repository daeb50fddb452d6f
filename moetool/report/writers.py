"""The one writer: a :class:`~moetool.experiments.result.Result` into a run folder.

Every table -> CSV (``run.write_csv``; a large one Parquet), its rows, bytes and sha256 in the manifest's ``tables``
(:meth:`~moetool.report.RunDir.atomic`), then the experiment's figures (:mod:`moetool.report.plots`; PNG and PDF, or
what ``MOETOOL_FIGURES`` asks for, recorded as the manifest's ``figure_formats``; ``none`` draws none): a figure that
fails is listed under ``figures_failed`` in the manifest (the tables stay written) and the run fails with one line
(:class:`~moetool.errors.MoetoolRuntimeError`, exit 1). Then the manifest:
options = the run-level options the caller passes (model, data, dtype, ...) + the experiment's options dataclass,
sections = ``result.meta`` (a ``bootstrap`` section's ``note``, intervals from too few rows, also on stderr as one
``note:`` line when the run did not fail), and ``headline``: the experiment's summary lines (:func:`headline_lines`,
the report page's summary table). Commands and ``moetool demo`` both call :func:`write`.
"""

from __future__ import annotations

from typing import Any


def write(result: Any, run: Any, *, model: Any = None, options: dict[str, Any] | None = None,
          seed: int | None = None, finish: bool = True) -> Any:
    """Write ``result`` into ``run`` (a :class:`~moetool.report.RunDir`); returns the manifest path (or ``None``
    with ``finish=False``, when the caller adds more before finishing). ``seed`` defaults to the options' seed."""
    from ..errors import FIGURE_FORMATS, MoetoolRuntimeError, env_figures
    from .figures import describe_run, trace_marker
    from .plots import figures
    from .rundir import one_line

    if getattr(run, "discard", False):  # a data-parallel rank other than 0: rank 0 writes the one run folder
        return None
    formats = env_figures()  # a bad MOETOOL_FIGURES: one line before any file is written
    if model is None:
        model = result.model
    if result.started is not None and result.started < run.started:  # the run began with the computation, not
        run.started = result.started  # with the folder made to write it (the manifest's started / wall_seconds)
    if not run.caption:  # the model and data under every figure (report pages and papers show them apart)
        data = result.meta.get("data") or {}
        who = ((model.get("name") if isinstance(model, dict) else getattr(model, "name", None))
               or (options or {}).get("model")
               or " vs ".join(map(str, result.meta.get("checkpoints", []))))
        run.caption = describe_run(f"{who}{trace_marker(result.meta)}" if who else who, data.get("source"),
                                   data.get("tokens"))
    for name, df in result.tables.items():
        if name.endswith(".parquet"):  # large tables (stats --all-tokens): Parquet, one row group per layer
            _write_parquet(run, name, df)
        else:
            run.write_csv(name, df)
    failed: dict[str, str] = {}  # a figure that cannot be drawn or saved never loses the tables written above
    if formats != FIGURE_FORMATS:  # MOETOOL_FIGURES chose other files (or none): the manifest says so
        run.add(figure_formats=list(formats))
    try:
        built = figures(result) if formats else {}  # none: no figure is drawn
    except Exception as e:  # noqa: BLE001 - any drawing error: recorded, then one line and exit 1 below
        built, failed[f"{result.name} figures"] = {}, one_line(e)
    for name, fig in built.items():
        try:
            run.save_figure(fig, name)
        except Exception as e:  # noqa: BLE001
            failed[name] = one_line(e)
    run.add(**result.meta)
    if result.tables:  # the shared columns' definitions (layer, expert, ...) beside the experiment's own
        run.add(definitions=result.definitions)
    headline = headline_lines(result, model, options)
    if headline:
        run.add(headline=headline)
    if failed:
        run.add(figures_failed=failed)
        first = next(iter(failed.items()))
        raise MoetoolRuntimeError(f"{len(failed)} figure(s) failed ({first[0]}: {first[1]}); every table is written "
                                  f"in {run.path}, manifest.json lists figures_failed")
    note = (result.meta.get("bootstrap") or {}).get("note")  # too few rows for a 95% interval (FEW_ROWS):
    if note:  # one line on a run that worked (a failed one says its error alone; the manifest keeps the note)
        from ..progress import say

        say(f"note: {note}")
    if not finish:
        return None
    opts = {**(options or {}), **result.manifest_options()}
    if seed is None:
        seed = getattr(result.options, "seed", None)
    return run.finish(options=opts, model=model, seed=seed)


def headline_lines(result: Any, model: Any = None, options: dict[str, Any] | None = None) -> list[str]:
    """The experiment's headline numbers of ``result`` (its spec's ``summary_lines``, the lines ``moetool demo``
    prints, intervals where the experiment gives them), for the manifest's ``headline`` and the report page's
    summary table; ``[]`` for an experiment without them or a result of no experiment. A ``--trace`` analysis
    (``stats_trace``, ...) gets its experiment's lines of the tables it has."""
    from ..experiments.registry import of_result
    from .figures import trace_marker

    spec = of_result(result.name)
    if spec is None or not spec.lines:
        return []
    trace = result.meta.get("trace")  # a --trace analysis: no model loaded, the routing of the trace's model
    traced = (trace["shape"].get("source") if isinstance(trace, dict) and isinstance(trace.get("shape"), dict)
              else None)
    who = ((model.get("name") if isinstance(model, dict) else getattr(model, "name", None))
           or (options or {}).get("model") or " -> ".join(map(str, result.meta.get("checkpoints", []))) or traced
           or (None if trace_marker(result.meta) else spec.name))
    who = f"{who or 'a model'}{trace_marker(result.meta)}"
    try:
        return [str(line) for line in spec.load(spec.lines)(str(who), result)]
    except Exception:  # noqa: BLE001 - a headline that cannot be said is left out: the tables are the record
        return []


def _write_parquet(run: Any, name: str, df: Any) -> None:
    from ..engine.stream import TableStream

    with run.atomic(name, rows=len(df)) as tmp, TableStream(tmp) as out:
        for _, part in (df.groupby("layer", sort=False) if "layer" in df else [(None, df)]):
            out.write({c: part[c].to_numpy() for c in part.columns})
