"""Describe a model's MoE structure from its config alone (built on the meta device)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from .files import cache_dir, cached, installation_key, read_cached, write_cached  # noqa: F401 (cache_dir: re-export)


def describe_layers(model: Any, layers: list) -> dict[str, Any]:
    """Structure and parameter counts of an instantiated model (real or meta). ``active_params`` counts everything but
    the routed experts a token is not sent to, the embedding table and the output head included (as Mistral, Qwen,
    OLMoE and Phi publish active counts); DeepSeek and OpenAI publish it without the embedding table
    (``embedding_params``): gpt-oss-120b 5.71B here, 5.13B theirs."""
    total = sum(p.numel() for p in model.parameters())
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    inactive = 0
    rows = []
    for L in layers:
        ep = sum(p.numel() for p in L.experts.parameters())
        inactive += L.inactive_expert_params(ep)
        rows.append({**L.describe(), "expert_params": ep})
    moe = {L.index for L in layers}
    # the model's own decoder layers: a vision-language config keeps num_hidden_layers in its text config, and
    # LongCat's counts two sublayers per layer
    n_layers = len(_decoder_layer_count(model, layers))
    return {"model_type": model.config.model_type, "num_layers": n_layers, "moe_layers": rows,
            "dense_layers": [i for i in range(n_layers) if i not in moe],
            "total_params": int(total), "active_params": int(total - inactive),
            "embedding_params": int(sum(p.numel() for p in embed.parameters())) if embed is not None else None}


def describe_model(name: str, *, cache: bool = True) -> dict[str, Any]:
    """The MoE structure of ``name`` from its config (a model built on the meta device: no weight is read).

    A model on disk (a local directory, an embedded model) is answered from :func:`cache_dir` when the same
    config (and code files beside it) was described before by this installation (:func:`families_cache_key`):
    building it imports torch and transformers' modeling code, seconds that the answer does not depend on."""
    from .loading import config_fingerprint, resolve

    source, kind = resolve(name)  # a bad name fails here, before torch is imported
    fingerprint = config_fingerprint(name) if cache else None
    if fingerprint is not None:
        info = cached("describe", {**families_cache_key(), "model_files": fingerprint}, lambda: _describe(name))
    else:
        info = _describe(name)
    return {"name": name, "source": source, "kind": kind, **info}


def _describe(name: str) -> dict[str, Any]:
    from .loading import load_config, model_from_config

    config, _, _ = load_config(name)
    import torch

    from .adapters import find_moe_layers, get_adapter, quant

    with torch.device("meta"):
        model = model_from_config(config)
    return {"family": get_adapter(config).family, **describe_layers(model, find_moe_layers(model)),
            "experts_format": quant.checkpoint_format(config)}


# ----- every MoE family of the installed transformers (``moetool inspect --families``) ------------------
FAMILY_COLUMNS = ("model_type", "head", "supported", "routing", "shared_experts", "dense_layers", "experts")
README_START, README_END = "<!-- families:start -->", "<!-- families:end -->"
#: what a row is of: the type's default config, which a checkpoint's own config may override (checked in
#: tests/test_families.py on the shipped Qwen3-30B-A3B config)
FAMILIES_CAVEAT = ("Each row is a tiny model of transformers' default config for the type, so `routing`, "
                   "`shared_experts` and `dense_layers` are the default's: a checkpoint's own config can differ "
                   "(Qwen3-30B-A3B sets `norm_topk_prob`: `softmax-topk-renorm`, where the `qwen3_moe` row says "
                   "`softmax-topk`); `moetool inspect --model` reads a checkpoint's own.")


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
    from .errors import MoetoolError, first_line

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
        return {**row, "supported": f"unchecked: no tiny model ({type(e).__name__}: {first_line(e)})",
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


def aliases() -> list[dict[str, str]]:
    """``moetool inspect --aliases``: every model alias and embedded model, and what it resolves to."""
    from .loading import ALIASES, embedded_models

    rows = [{"name": k, "resolves to": v} for k, v in ALIASES.items()]
    return rows + [{"name": k, "resolves to": f"embedded: {p}"} for k, p in embedded_models().items()]


def families(model_types: list[str] | None = None, *, cache: bool = True,
             notice: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The families table: one row per MoE model type of the installed transformers (or of ``model_types``).

    Building a tiny model of each family takes 15 s to minutes on a CPU, so the whole table (``model_types``
    None) is kept in :func:`cache_dir` under :func:`families_cache_key` (the installed transformers, torch and
    moetool versions and a hash of moetool's adapter code): it is built once per installation and rebuilt as
    soon as any of them changes. ``cache=False`` builds it anew (and refreshes the cached copy). ``notice`` is told
    one line before a build of the whole table, and a progress bar counts the model types on stderr while it builds
    (the command prints both: minutes of silence look like a hang; 334 s at load average 10)."""
    whole = model_types is None
    path = None
    if whole:
        key = families_cache_key()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = cache_dir() / f"families-{digest}.json"
        if cache:
            stored = read_cached(path, key, "rows", list)
            if stored is not None:
                return stored
    from .adapters import discovery

    types = model_types or discovery.moe_model_types()
    if whole and notice is not None:
        notice(f"building the families table once for this installation: a tiny model of each of {len(types)} MoE "
               f"model types (15 s to minutes on a CPU); later calls answer from {path}")
    from .progress import progress

    rows = [family_row(mt) for mt in progress(types, len(types), "families", quiet=not (whole and notice is not None))]
    if path is not None:
        write_cached(path, key, rows, "rows")
    return rows


def families_cache_key() -> dict[str, Any]:
    """What the families table (and a model's description) depends on, read without importing torch or
    transformers: :func:`moetool.files.installation_key` over moetool's adapter and inspection code and
    ``loading.py``, which reads the config and builds the model they describe (an edited adapter or loader in a source
    checkout, or a reinstall of another commit under the same version, changes it too)."""
    here = Path(__file__).resolve().parent
    return installation_key([here / "inspect.py", here / "loading.py", *(here / "adapters").glob("*.py")])


def families_markdown(rows: list[dict[str, Any]]) -> str:
    """The README block (between the families markers) for ``rows``."""
    import transformers

    ok = [r for r in rows if r["supported"] == "yes"]
    lines = [README_START,
             f"MoE model types of the installed transformers {transformers.__version__}: {len(ok)} supported "
             f"of {len(rows)} (`moetool inspect --families`; generated by `python -m moetool.inspect --readme`). "
             f"{FAMILIES_CAVEAT}",
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
