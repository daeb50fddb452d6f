"""Per-experiment figures: ``figures(result) -> {name: matplotlib Figure}`` (saved by :mod:`moetool.report.writers`).

Each experiment draws its own (``moetool/experiments/<name>/figures.py``, named by its spec's ``figures``) with the
house-style primitives of :mod:`moetool.report.figures`; the functions take the experiment's tables, so a notebook
can draw them from a :class:`~moetool.experiments.result.Result` (``moetool.figures(result)``) without writing
anything. Their captions are in the specs too (:data:`FIGURE_CAPTIONS`, discovered).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..experiments.registry import captions, of_result

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots): the
#: report page's captions (:mod:`moetool.report.page`), each from its experiment's ``spec.py``
FIGURE_CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = captions()


def figures(result: Any) -> dict[str, Any]:
    """Every figure of ``result``: the ``figures`` function its experiment's spec names
    (:mod:`moetool.experiments.registry`; none for an experiment without figures or a result of no experiment).
    A ``--trace`` analysis (``stats_trace``, ``offload_trace``, ``fluctuation_trace``) draws its experiment's
    figures of the tables a trace gives."""
    spec = of_result(result.name)
    target = spec.figures if spec is not None else None
    if target is None:
        return {}
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(result)
