"""The layers hold: every import of every module (function-local ones too) goes to the same layer or one below,
and no modules import each other in a cycle; so does every ``"module:attr"`` link an experiment's spec names (its
compute function, options, figures, command, demo options, checkpoint types), followed by the module that reads
it. ARCHITECTURE.md describes the layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: lowest first; a module may import its own layer and the layers before it (a group is moetool.<name>)
LAYERS: list[set[str]] = [
    {"errors", "registry", "configs", "demo_models", "progress", "ops", "compiled", "formats", "lmeval_compat", "files",
     "context", "defaults"},
    {"sketch", "uncertainty", "distributed", "data", "hub", "checkpoints"},
    {"adapters"},
    {"loading", "sizing", "engine"},
    {"policies"},
    {"experiments", "traces"},
    {"report", "inspect", "experiment figures"},
    {"demo", "api", "run"},
    {"commands", "moetool", "__main__"},
]
RANK = {group: i for i, groups in enumerate(LAYERS) for group in groups}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["moetool", "commands", *rel.parts[1:]] if rel.parts[0] == "commands" else list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("moetool").rglob("*.py"), *ROOT.joinpath("commands").rglob("*.py")]
    return {module_name(p): p for p in files if "embedded" not in p.parts}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The moetool modules ``name`` imports anywhere in its source (``from .x import y`` counts the submodule
    ``x.y`` when ``y`` is one, else ``x``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found = subs if len(subs) == len(node.names) else [target, *subs]
        elif isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        else:
            continue
        out |= {t for t in found if t in known and t != name}
    return out


def group(name: str) -> str:
    parts = name.split(".")
    if parts[1:2] == ["experiments"] and parts[3:] == ["figures"]:
        return "experiment figures"  # moetool/experiments/<name>/figures.py: drawn with the report's primitives
    return parts[1] if len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    assert {group(m) for m in modules()} <= set(RANK), set(map(group, modules())) - set(RANK)


def test_no_module_imports_a_higher_layer():
    bad = sorted(f"{a} -> {b}" for a, deps in graph().items() for b in deps if RANK[group(b)] > RANK[group(a)])
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_no_import_cycle():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_cycle_and_a_layer_break(tmp_path, monkeypatch):
    """The checks themselves: a planted upward import and a planted cycle are found."""
    g = graph()
    assert "moetool.engine.runner" in g["moetool.experiments.stats.compute"]  # imports are read (function-local too)
    assert "moetool.adapters.tiny" in g["moetool.inspect"]  # a function-local import counts
    g["moetool.ops"].add("moetool.report.console")
    assert any(RANK[group(b)] > RANK[group(a)] for a, deps in g.items() for b in deps)


def test_no_local_import_of_moetool_modules_where_torch_is_imported_anyway():
    """The import rule: a module that imports torch at its top gains nothing from importing moetool's own modules
    inside functions (they are light next to torch, and a cycle is caught above), so it imports them at its top.
    Function-local imports stay where they buy something: the command line and ``import moetool`` never import
    torch (commands/, api.py, modules without torch at the top) and heavy optional packages (pandas, matplotlib,
    transformers, lm_eval, accelerate, torch.distributed)."""
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.Import) and any(a.name == "torch" for a in n.names) for n in tree.body):
            continue
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def in_function(node: ast.AST) -> bool:  # anywhere in a function body, under a condition too
            while node in parents:
                node = parents[node]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return True
            return False

        found += [f"{name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("moetool"))
                  and in_function(n)]
    assert not found, "import these at the top of the module:\n" + "\n".join(found)


def test_architecture_md_names_what_exists():
    """ARCHITECTURE.md stays true: every file it names exists, and every dotted name it gives of moetool's code
    (``engine.hooks.refuse_recomputed``, ``loading.auto_model_class``, ``RoutingEvent.token_ids``,
    ``rules.Params.shared``) resolves: a module by its path or its unique file name, a class by where it is defined,
    then attributes (dataclass fields count)."""
    import importlib
    import re

    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    tokens = {re.sub(r"\(.*\)$", "", t) for t in re.findall(r"`([^`\n]+)`", text) if "<" not in t}
    files = modules()
    stems: dict[str, list[str]] = {}
    for name in files:
        stems.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    missing = [t for t in tokens if re.fullmatch(r"[\w/.]+(\.py|/)", t) and not (ROOT / t).exists()
               and not (ROOT / "moetool" / t).exists() and not ("/" not in t and t[:-3] in stems)]
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"
    classes = {node.name: name for name, path in files.items() for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.ClassDef)}

    def has(obj, attr):
        return hasattr(obj, attr) or attr in getattr(obj, "__dataclass_fields__", {})

    unresolved, checked = [], 0
    for token in sorted(t for t in tokens if re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", t)):
        parts = token.split(".")[1:] if token.startswith("moetool.") else token.split(".")
        if parts[-1] == "py":
            continue
        if parts[0] in classes:  # a class, where it is defined
            obj, rest = getattr(importlib.import_module(classes[parts[0]]), parts[0]), parts[1:]
        else:  # the longest module prefix (a path under moetool, or a unique file name)
            for cut in range(len(parts), 0, -1):
                dotted = ".".join(["moetool", *parts[:cut]])
                unique = stems.get(parts[0], []) if cut == 1 else []
                module = dotted if dotted in files else unique[0] if len(unique) == 1 else None
                if module:
                    obj, rest = importlib.import_module(module), parts[cut:]
                    break
            else:
                continue  # not moetool's (config.is_encoder_decoder)
        for attr in rest:
            if not has(obj, attr):
                unresolved.append(token)
                break
            obj = getattr(obj, attr, None)
        else:
            checked += 1
    assert not unresolved, f"ARCHITECTURE.md names what does not exist: {unresolved}"
    assert checked >= 10  # the check reads the document


def test_architecture_md_names_every_module_beside_the_layers_and_in_the_engine():
    """The other direction: every module of ``moetool/`` itself and of ``moetool/engine/`` is named in
    ARCHITECTURE.md (its path, its file name or its dotted name in backticks). configs.py, demo_models.py,
    lmeval_compat.py, progress.py, registry.py (only experiments/registry.py was), engine/guard.py and
    engine/stream.py were named nowhere (the document's module lists had fallen behind the tree)."""
    import re

    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`\n]+)`", text))
    words = {w for t in named for w in re.findall(r"[\w./]+", t)}
    files = [*ROOT.joinpath("moetool").glob("*.py"), *ROOT.joinpath("moetool", "engine").glob("*.py")]
    unnamed = []
    for path in files:
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT).as_posix()  # moetool/engine/guard.py
        dotted = rel[:-3].replace("/", ".")  # moetool.engine.guard
        forms = {rel, rel.removeprefix("moetool/"), dotted, dotted.removeprefix("moetool.")}
        if path.parent.name == "moetool":
            forms.add(path.name)  # a top-level module by its file name (engine's: named with engine/)
        prefixes = (dotted + ".", dotted.removeprefix("moetool.") + ".")  # engine.runner.forward names runner
        if not forms & words and not any(w.startswith(prefixes) for w in words):
            unnamed.append(rel)
    assert not unnamed, f"ARCHITECTURE.md names no module {unnamed}: say what each is for"


# ----- the links by name: an experiment's spec (issue 32 item 5) -----------------------------------------------
#: who follows each kind of link of a spec (an import the source does not show): the reader's layer bounds the
#: target's
READERS = {"module": "moetool.experiments.experiment", "options": "moetool.experiments.experiment",
           "lines": "moetool.demo", "figures": "moetool.report.plots", "parse": "moetool.commands.generated",
           "options_from": "moetool.demo", "checkpoint_types": None}  # None: the spec module itself names them


def spec_links() -> list[tuple[str, str, str, str]]:
    """``(experiment, kind, reader module, "module:attr")`` for every link of every discovered spec."""
    from moetool.experiments.registry import EXPERIMENTS

    out = []
    for spec in EXPERIMENTS.values():
        own = f"moetool.experiments.{spec.name.replace('-', '_')}.spec"
        links = {"module": [f"{spec.module}:{spec.function}"],
                 "options": [f"{spec.module}:{spec.options}"] if spec.options else [],
                 "lines": [f"{spec.module}:{spec.lines}"] if spec.lines else [],
                 "figures": [spec.figures] if spec.figures else [],
                 "parse": [f.parse for f in spec.command_flags() if f.parse],
                 "options_from": [spec.demo.options_from] if spec.demo and spec.demo.options_from else [],
                 "checkpoint_types": [":".join(t.rsplit(".", 1)) for t in spec.checkpoint_types]}
        out += [(spec.name, kind, READERS[kind] or own, target) for kind, targets in links.items() for target in targets]
    return out


def test_every_spec_link_resolves_and_obeys_the_layers():
    """Every ``"module:attr"`` a spec names is an attribute of a moetool module (a class for checkpoint types), and
    the import it stands for (reader -> target) goes to the same layer or one below and closes no cycle; the
    experiments' figures and commands are reached only through these links."""
    import importlib
    import inspect

    known = modules()
    g = graph()
    links = spec_links()
    assert len({e for e, *_ in links}) >= 19 and {k for _, k, _, _ in links} == set(READERS)
    bad = []
    for exp, kind, reader, target in links:
        module, _, attr = target.partition(":")
        if module not in known:
            bad.append(f"{exp} {kind}: {target}: no such moetool module")
            continue
        obj = getattr(importlib.import_module(module), attr, None)
        if obj is None or (kind == "checkpoint_types" and not inspect.isclass(obj)) or \
                (kind != "checkpoint_types" and kind != "options" and not callable(obj)):
            bad.append(f"{exp} {kind}: {target} does not resolve")
        if RANK[group(module)] > RANK[group(reader)]:
            bad.append(f"{exp} {kind}: {reader} -> {module} goes to a higher layer")
        g[reader].add(module)
    assert not bad, "\n".join(bad)
    higher = sorted(f"{a} -> {b}" for a, deps in g.items() for b in deps if RANK[group(b)] > RANK[group(a)])
    assert not higher, higher


def test_the_link_check_sees_a_bad_link(monkeypatch):
    """The check itself: a figures link to a missing function, and one to a command module, fail it."""
    import dataclasses

    import pytest

    from moetool.experiments import registry

    spec = registry.EXPERIMENTS["stats"]
    for figures in ("moetool.experiments.stats.figures:no_such_figures", "moetool.commands.stats:show"):
        monkeypatch.setitem(registry.EXPERIMENTS, "stats", dataclasses.replace(spec, figures=figures))
        with pytest.raises(AssertionError):
            test_every_spec_link_resolves_and_obeys_the_layers()


def test_nothing_below_the_experiments_names_one():
    """No module below the experiments' layer names an experiment's module or folder (in code, strings or
    docstrings): what an experiment needs from below (its checkpoint types, its figures' captions) is in its spec."""
    import re

    from moetool.experiments.registry import EXPERIMENTS

    names = "|".join(sorted((s.name.replace("-", "_") for s in EXPERIMENTS.values()), key=len, reverse=True))
    pattern = re.compile(rf"experiments[./]({names})\b")
    found = [f"{name}: {m.group(0)}" for name, path in modules().items()
             if RANK[group(name)] < RANK["experiments"] for m in pattern.finditer(path.read_text())]
    assert not found, found
    assert pattern.search("from moetool.experiments.stats.compute import stats")  # the pattern reads a link


def test_every_package_folder_is_a_package_of_the_distribution():
    """pyproject.toml lists its packages by name (``commands/`` is installed as ``moetool.commands``): a wheel
    without a folder would quietly lack what is in it (``pip install .`` once shipped no ``moetool.traces``, and every
    trace command failed after the README's install while the editable install of the tests hid it), so every
    folder of ``moetool/`` and ``commands/`` with an ``__init__.py`` is listed, and nothing listed is missing."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = {name: ROOT / d for name, d in setup["package-dir"].items()}
    found = {"moetool.commands"} | {
        ".".join(("moetool", *p.parent.relative_to(ROOT / "moetool").parts)).rstrip(".")
        for p in (ROOT / "moetool").rglob("__init__.py") if "__pycache__" not in p.parts}
    experiments = {f"moetool.experiments.{p.parent.name}" for p in ROOT.joinpath("moetool", "experiments").glob("*/spec.py")}
    assert len(experiments) >= 20 and experiments <= found
    assert "moetool.traces" in found and not found - listed, sorted(found - listed)
    for name in listed:  # every listed package exists where package-dir puts it
        base = next((k for k in sorted(dirs, key=len, reverse=True) if name == k or name.startswith(k + ".")), None)
        folder = dirs[base].joinpath(*name[len(base) + 1:].split(".")) if base and name != base else dirs.get(name)
        assert folder is not None and folder.is_dir(), name


def test_what_architecture_md_says_every_layer_uses_is_below_the_adapters():
    """ARCHITECTURE.md listed `moetool/loading.py` and `moetool/sizing.py` among the modules "used by every layer",
    but both import the adapters (sizing the engine too), so no adapter can use them. Every module of that paragraph
    that imports a layer (adapters and above) is named in its clause saying it sits at the engine's layer."""
    import re

    text = " ".join((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").split())
    start = text.index("Beside them, used by every layer:")
    para = text[start:text.index("`moetool/errors.py`", start)]
    named = re.findall(r"`moetool/(\w+)\.py`", para)
    assert {"ops", "loading", "sizing", "data"} <= set(named)
    g = graph()
    above = {m for m in named if any(RANK[group(d)] >= RANK["adapters"] for d in g[f"moetool.{m}"])}
    clause = ""
    if "sit at the engine's layer" in para:
        end = para.index("sit at the engine's layer")
        clause = para[para.rindex("`moetool/", 0, end):end]
    assert above and all(f"{m}.py`" in clause for m in above), (sorted(above), clause)
    assert RANK["loading"] == RANK["sizing"] == RANK["engine"]


def test_architecture_md_says_which_commands_take_seed():
    """ARCHITECTURE.md said every command takes --seed; `plan` (a config, no model) does not. The commands of
    experiments without --seed are the ones it names as exceptions."""
    import re

    import typer

    from moetool.commands.app import app
    from moetool.experiments.registry import EXPERIMENTS

    group = typer.main.get_command(app)
    without = {n for n in EXPERIMENTS if "--seed" not in {o for p in group.commands[n].params for o in p.opts}}
    assert all(EXPERIMENTS[n].inputs == "config" for n in without)
    text = " ".join((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").split())
    claim = re.search(r"`seed` \(always: ([^)]*)\)", text).group(1)
    assert "every command takes" not in claim and set(re.findall(r"`([a-z][a-z-]*)`", claim)) == without, claim


def test_architecture_md_recipe_calls_what_its_example_calls():
    """ARCHITECTURE.md's step 1 of adding an experiment said `tokens.require_tokens()`; every experiment, locality (its
    "small complete example") too, calls `require_tokens(tokens)` from moetool.data, which also refuses no tokens.
    Each call the step names is a call in locality's compute function."""
    import re

    text = " ".join((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").split())
    step = text[text.index("1. `moetool/experiments/<name>/compute.py`."):text.index("2. `moetool/experiments/<name>/spec.py`.")]
    modules = {"moetool", "data", "distributed", "engine", "hooks", "runner", "probes", "ops", "uncertainty"}
    calls = re.findall(r"`((?:[a-z_]+\.)*)([a-z_]+)\(([^`]*)\)`", step)
    source = " ".join((ROOT / "moetool/experiments/locality/compute.py").read_text().split())
    named = [c for c in calls if c[1] not in ("reduce_across_ranks", "summary_lines")]
    assert {fn for _, fn, _ in named} >= {"require_tokens", "shard"}, calls
    for dotted, fn, args in named:
        receiver = ".".join(p for p in dotted.split(".") if p and p not in modules)  # a variable's method
        first = args.split(",")[0].strip()
        called = rf"\b{re.escape(receiver + '.' if receiver else '')}{fn}\({re.escape(first)}"
        assert re.search(called, source), (dotted + fn, args)
