"""Report-page captions (issue 35 items 15 and 18): every figure's caption comes from its own experiment (the
definitions it cites are ones that experiment writes), no caption is given twice for one figure name, and a
caption describes only what is drawn."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from moetool.experiments.registry import EXPERIMENTS
from moetool.report import plots

STEM = re.compile(r'out\["(\w+)"\] = |[{,]\s*"(\w+)": (?:plot_\w+\(|fig\b|ratio_curve\()'
                  r'|for name, \w+ in \(\("(\w+)", "\w+"\),|\),\s+\("(\w+)", "\w+"\)\):')


def stems_of(func, mod, seen=None) -> set[str]:
    """The figure names ``func`` draws, following the module's own functions it calls."""
    seen = set() if seen is None else seen
    if func in seen:
        return set()
    seen.add(func)
    src = inspect.getsource(func)
    out = {g for m in STEM.findall(src) for g in m if g}
    for name in set(re.findall(r"\b(\w+)\(", src)):
        f = getattr(mod, name, None)
        if inspect.isfunction(f) and f.__module__ == mod.__name__:
            out |= stems_of(f, mod, seen)
    return out


def figures_by_experiment() -> dict[str, set[str]]:
    out = {}
    for spec in EXPERIMENTS.values():
        if spec.figures:
            module, _, attr = spec.figures.partition(":")
            mod = importlib.import_module(module)
            out[spec.name] = stems_of(getattr(mod, attr), mod)
    return out


def test_no_figure_name_is_captioned_twice():
    """A dict literal keeps the last of two equal keys: the agreement figure once carried norm-select's caption
    because both were "agreement_by_layer"."""
    tree = ast.parse(Path(plots.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "FIGURE_CAPTIONS":
            keys = [k.value for k in node.value.keys]
            assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
            break
    else:
        raise AssertionError("FIGURE_CAPTIONS not found")
    owners: dict[str, list[str]] = {}
    for exp, stems in figures_by_experiment().items():
        for s in stems:
            owners.setdefault(s, []).append(exp)
    assert {s: e for s, e in owners.items() if len(e) > 1} == {}  # one experiment per figure name
    assert len(owners) >= 30


def test_every_caption_cites_its_own_experiments_definitions():
    """The quantities a caption names (the definitions it cites) are columns the figure's own experiment
    defines, and the caption's tables are tables that experiment writes (its docstring says which)."""
    for exp, stems in figures_by_experiment().items():
        spec = EXPERIMENTS[exp]
        mod = importlib.import_module(spec.module)
        defs = {k for n in dir(mod) if n.endswith("DEFINITIONS") and isinstance(getattr(mod, n), dict)
                for k in getattr(mod, n)}
        writes = inspect.getsource(mod) + (inspect.getsource(importlib.import_module(f"moetool.commands.{exp.replace('-', '_')}"))
                                           if importlib.util.find_spec(f"moetool.commands.{exp.replace('-', '_')}") else "")
        for stem in stems:
            shows, tables, keys = plots.FIGURE_CAPTIONS[stem]
            assert set(keys) <= defs, (exp, stem, set(keys) - defs)
            assert keys, (exp, stem)
            for t in tables:
                assert t in writes, (exp, stem, t)
