"""Describe a model's MoE structure from its config alone (built on the meta device)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def describe_layers(model: Any, layers: list) -> dict[str, Any]:
    """Structure and parameter counts of an instantiated model (real or meta)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    rows = []
    for L in layers:
        ep = sum(p.numel() for p in L.experts.parameters())
        inactive += ep * (L.n_experts - L.top_k) // L.n_experts
        rows.append({**L.describe(), "expert_params": ep})
    moe = {L.index for L in layers}
    n_layers = len(_decoder_layer_count(model, layers)) if getattr(model.config, "is_encoder_decoder", False) else \
        int(getattr(model.config, "num_hidden_layers", len(rows)))
    return {"model_type": model.config.model_type, "num_layers": n_layers, "moe_layers": rows,
            "dense_layers": [i for i in range(n_layers) if i not in moe],
            "total_params": int(total), "active_params": int(total - inactive)}


def describe_model(name: str, *, cache: bool = True) -> dict[str, Any]:
    """The MoE structure of ``name`` from its config (a model built on the meta device: no weight is read).

    A model on disk (a local directory, an embedded model) is answered from :func:`cache_dir` when the same
    config (and code files beside it) was described before by this installation (:func:`families_cache_key`):
    building it imports torch and transformers' modeling code, seconds that the answer does not depend on."""
    from .loading import resolve

    path, key = None, None
    if cache:
        path, key = _describe_cache(*resolve(name))  # a bad name fails here, before torch is imported
        stored = _read_cache(path, key) if path is not None else None
        if stored is not None:
            source, kind = resolve(name)
            return {"name": name, "source": source, "kind": kind, **stored}
    from .loading import auto_model_class, load_config

    config, source, kind = load_config(name)
    import torch

    from .adapters import find_moe_layers, get_adapter, quant

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    info = {"family": get_adapter(config).family, **describe_layers(model, find_moe_layers(model)),
            "experts_format": quant.checkpoint_format(config)}
    if path is not None:
        _write_cache(path, key, info)
    return {"name": name, "source": source, "kind": kind, **info}


def _describe_cache(source: str, kind: str) -> tuple[Path | None, dict[str, Any] | None]:
    """Where the description of a model on disk is cached, and its key: the installation
    (:func:`families_cache_key`) and a hash of the config and the code files in the model's directory.
    ``(None, None)`` for a hub model (its config is not read here)."""
    if kind not in ("local", "embedded"):
        return None, None
    d = Path(source)
    h = hashlib.sha256()
    for f in sorted([d / "config.json", *d.glob("*.py")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    key = {**families_cache_key(), "model_files": h.hexdigest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"describe-{digest}.json", key


def cached(name: str, key: dict[str, Any], compute: Any, kind: type = dict) -> Any:
    """``compute()``, or what it returned before in this installation (:func:`families_cache_key`) for the same
    ``key`` (kept in :func:`cache_dir` as ``<name>-<digest>.json``; only JSON-exact values are kept)."""
    key = {**families_cache_key(), **key}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.json"
    value = _read_cache(path, key, "value", kind)
    if value is None:
        value = compute()
        _write_cache(path, key, value, "value")
    return value


def _read_cache(path: Path, key: dict[str, Any], field: str = "info", kind: type = dict) -> Any:
    """The ``field`` stored at ``path`` under exactly ``key`` (None: absent, stale or unreadable)."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get(field), kind):
        return None
    return stored[field]


def _write_cache(path: Path, key: dict[str, Any], value: Any, field: str = "info") -> None:
    """Atomically, and only what JSON gives back unchanged (else the next answer would differ in type)."""
    from .files import atomic_path

    try:
        text = json.dumps({"key": key, field: value})
        if json.loads(text)[field] != value:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except (OSError, TypeError, ValueError):  # an unwritable cache only costs the next call the time again
        pass


# ----- every MoE family of the installed transformers (``moetool inspect --families``) ------------------
FAMILY_COLUMNS = ("model_type", "head", "supported", "routing", "shared_experts", "dense_layers", "experts")
README_START, README_END = "<!-- families:start -->", "<!-- families:end -->"


def _experts_impl(experts: Any) -> str:
    """The experts class and how transformers may run it (``@use_experts_implementation`` or its own forward)."""
    name = type(experts).__name__
    if hasattr(experts, "is_concatenated"):  # set by transformers' @use_experts_implementation
        return f"{name} (eager / batched_mm / grouped_mm)"
    return f"{name} (own forward)"


def family_row(model_type: str, model: Any = None, layers: list | None = None) -> dict[str, Any]:
    """One row of the families table; the tiny model (:func:`moetool.adapters.tiny.build_tiny`) is built unless
    given."""
    from .adapters import discovery, find_moe_layers
    from .errors import MoetoolError

    row: dict[str, Any] = {"model_type": model_type, "head": discovery.head_kind(model_type)}
    if model_type in discovery.UNSUPPORTED:
        return {**row, "supported": "no: " + discovery.UNSUPPORTED[model_type], "routing": "", "shared_experts": "",
                "dense_layers": "", "experts": ""}
    empty = {"routing": "", "shared_experts": "", "dense_layers": "", "experts": ""}
    try:
        if model is None:
            from .adapters.tiny import build_tiny

            model = build_tiny(model_type)
    except Exception as e:  # noqa: BLE001 - any failure of the family's own code on the shrunk config
        return {**row, "supported": f"unchecked: no tiny model ({type(e).__name__}: {str(e).splitlines()[0]})",
                **empty}
    try:
        layers = find_moe_layers(model) if layers is None else layers
    except MoetoolError as e:
        return {**row, "supported": f"no: {e}", **empty}
    L = layers[0]
    d = L.describe()
    n_layers = len(_decoder_layer_count(model, layers))
    dense = [i for i in range(n_layers) if i not in {x.index for x in layers}]
    rules = dict.fromkeys(str(x.describe().get("rule") or x.scoring) for x in layers)  # in layer order (hash, top-K)
    note = f" ({d['note']})" if d.get("note") else ""  # what a layer routes beyond its rule (issue 26 adapters)
    return {**row, "supported": "yes", "routing": (" + ".join(rules) if len(rules) > 1 else str(d.get("rule") or
                                                                                                 d.get("scoring")))
            + note,
            "shared_experts": "yes" if any(x.shared_experts is not None for x in layers) else "no",
            "dense_layers": (f"{len(dense)} of {n_layers} in the tiny model ({', '.join(map(str, dense))})"
                             if dense else "none"),
            "experts": _experts_impl(L.experts)}


def _decoder_layer_count(model: Any, layers: list) -> range:
    from .adapters import get_adapter

    decoder = get_adapter(model.config).decoder_layers(model)  # LongCat's config counts its 2 sublayers per layer
    if decoder:
        return range(len(decoder))
    cfg = layers[0].config if layers else model.config
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None) or getattr(cfg, "n_layers", None)
    return range(int(n) if n else max(x.index for x in layers) + 1)


def families(model_types: list[str] | None = None, *, cache: bool = True) -> list[dict[str, Any]]:
    """The families table: one row per MoE model type of the installed transformers (or of ``model_types``).

    Building a tiny model of each family takes 15 s to minutes on a CPU, so the whole table (``model_types``
    None) is kept in :func:`cache_dir` under :func:`families_cache_key` (the installed transformers, torch and
    moetool versions and a hash of moetool's adapter code): it is built once per installation and rebuilt as
    soon as any of them changes. ``cache=False`` builds it anew (and refreshes the cached copy)."""
    whole = model_types is None
    path = None
    if whole:
        key = families_cache_key()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = cache_dir() / f"families-{digest}.json"
        if cache:
            stored = _read_cache(path, key, "rows", list)
            if stored is not None:
                return stored
    from .adapters import discovery

    rows = [family_row(mt) for mt in (model_types or discovery.moe_model_types())]
    if path is not None:
        _write_cache(path, key, rows, "rows")
    return rows


def cache_dir() -> Path:
    """Where moetool keeps what it computes once per installation: ``MOETOOL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/moetool``, else ``~/.cache/moetool``."""
    if os.environ.get("MOETOOL_CACHE_DIR"):
        return Path(os.environ["MOETOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetool"


def families_cache_key() -> dict[str, Any]:
    """What the families table depends on, read without importing torch or transformers: the installed
    transformers, torch, moetool and Python versions and a hash of moetool's adapter and inspection code (an
    edited adapter in a source checkout changes it too)."""
    import importlib.metadata as md
    import platform

    key: dict[str, Any] = {"python": platform.python_version()}
    for pkg in ("transformers", "torch", "moetool"):
        try:
            key[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            key[pkg] = None
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted([here / "inspect.py", *(here / "adapters").glob("*.py")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    key["code"] = h.hexdigest()[:16]
    return key


def families_markdown(rows: list[dict[str, Any]]) -> str:
    """The README block (between the families markers) for ``rows``."""
    import transformers

    ok = [r for r in rows if r["supported"] == "yes"]
    lines = [README_START,
             f"MoE model types of the installed transformers {transformers.__version__}: {len(ok)} supported "
             f"of {len(rows)} (`moetool inspect --families`; generated by `python -m moetool.inspect --readme`).",
             "",
             "| " + " | ".join(FAMILY_COLUMNS) + " |",
             "|" + "---|" * len(FAMILY_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]).replace("|", "/").replace("\n", " ") for c in FAMILY_COLUMNS) + " |")
    lines.append(README_END)
    return "\n".join(lines)


def readme_block(text: str) -> str | None:
    """The families block of a README text (markers included), or None."""
    i, j = text.find(README_START), text.find(README_END)
    return text[i:j + len(README_END)] if i >= 0 and j > i else None


def write_readme(path: str, rows: list[dict[str, Any]]) -> None:
    """Replace the families block of ``path`` (it must hold the markers) with the table of ``rows``."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    old = readme_block(text)
    if old is None:
        raise SystemExit(f"{path}: no {README_START} ... {README_END} block")
    p.write_text(text.replace(old, families_markdown(rows)), encoding="utf-8")


if __name__ == "__main__":  # python -m moetool.inspect --readme [README.md]
    import sys

    if len(sys.argv) >= 2 and sys.argv[1] == "--readme":
        write_readme(sys.argv[2] if len(sys.argv) > 2 else "README.md", families(cache=False))
    else:
        raise SystemExit("usage: python -m moetool.inspect --readme [README.md]")
