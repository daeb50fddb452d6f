"""A placement in the files the engines load, and those files read back as the engines read them.

* ``eplb``: DeepSeek EPLB's ``rebalance_experts`` outputs ``phy2log [L, P]``, ``log2phy [L, n, X]``, ``logcnt
  [L, n]`` (JSON, with the MoE layers they describe and EPLB's arguments). ``log2phy`` is built as eplb.py builds it
  (deepseek-ai/EPLB eplb.py @d52c72d5b2f2fb4c41afbf8eb21366820239913d, ``rebalance_experts``)::

      maxlogcnt = logcnt.max().item()
      log2phy = torch.full((num_layers, num_logical_experts, maxlogcnt), -1, dtype=torch.int64, ...)
      log2phy.view(num_layers, -1).scatter_(-1, phy2log * maxlogcnt + phyrank,
              torch.arange(num_replicas, dtype=torch.int64, ...).expand(num_layers, -1))

* ``sglang``: the ``--init-expert-location`` file, a JSON ``{"physical_to_logical_map": [num_hidden_layers, P]}``
  (SGLang reads ``.pt`` with ``torch.load(data, weights_only=True)`` or ``.json`` with ``json.loads``, then
  ``ExpertLocationMetadata.init_by_mapping``; sgl-project/sglang python/sglang/srt/eplb/expert_location.py
  @6270b01498692d05d29267efe96d0eb7d9824545). Every decoder layer has a row: a dense layer gets SGLang's own
  trivial map (``torch.arange(0, num_physical_experts).repeat(num_layers, 1) % num_logical_experts``, its
  ``init_trivial``). Start the server with ``--ep-size G --ep-num-redundant-experts R``: P = n + R slots, P / G
  per GPU (slot s on GPU ``s // (P / G)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import MoetoolError, spans
from ..experiments.placement.compute import rebalance_experts
from .readers import load_pt
from .shape import ModelShape

EXPORTS = ("sglang", "eplb")
FILES = {"sglang": "sglang_expert_location.json", "eplb": "eplb_placement.json"}


def placement_loads(res: Any) -> dict[str, Any]:
    """The data's loads of a ``placement`` result as :func:`export_placement` takes them: ``{"load" [layers, n]
    float64, "layers", "n", "groups"}`` (``placement_loads.csv``'s ``data`` rows)."""
    if getattr(res, "name", None) != "placement" or "placement_loads" not in res:
        raise MoetoolError(f"an export takes a placement result (moetool.placement / moetool.run('placement', ...) / "
                           f"moetool.from_trace('placement', ...)), not {getattr(res, 'name', type(res).__name__)!r}")
    df = res["placement_loads"]
    df = df[df["data_set"] == "data"]
    layers = sorted(int(x) for x in df["layer"].unique())
    load = torch.stack([torch.tensor(df[df["layer"] == li].sort_values("expert")["load"].to_numpy(),
                                     dtype=torch.float64) for li in layers])
    return {"load": load, "layers": layers, "n": int(res.meta["n_experts"]), "groups": int(res.meta["groups"])}


def export_layout(kind: str, n: int, opts: Any) -> tuple[int, int]:
    """``(G, R)`` of the one placement an export of ``kind`` writes for ``n`` experts (one ``--gpus`` G and one
    ``--extra-slots`` value of ``opts``); anything else is one line, before any file is made."""
    if kind not in EXPORTS:
        raise MoetoolError(f"--export must be one of {', '.join(EXPORTS)}, not '{kind}'")
    gpus = opts.gpu_counts(n)
    if len(gpus) != 1 or len(set(opts.extra_slots)) != 1:
        raise MoetoolError("--export writes one placement: give one --gpus G and one --extra-slots value")
    return gpus[0], opts.extra_slots[0] * gpus[0]


def export_placement(kind: str, path: Path, loads: dict[str, Any], opts: Any, shape: ModelShape | None
                     ) -> dict[str, Any]:
    """``--export sglang|eplb``: EPLB's placement of ``loads`` (:func:`placement_loads`) at the one ``--gpus`` G and
    ``--extra-slots`` of ``opts`` (R = slots x G), written at ``path`` in the file the engine loads; returns its
    manifest entry (``export``)."""
    G, R = export_layout(kind, loads["n"], opts)
    placed = eplb_placement(loads["load"], G, R, loads["groups"], opts.nodes)
    write_export(kind, path, placed, loads["layers"], shape,
                 {"num_replicas": loads["n"] + R, "num_groups": loads["groups"], "num_nodes": opts.nodes,
                  "num_gpus": G})
    return {"format": kind, "file": FILES[kind], "gpus": G, "replicas": R,
            "engine": ("sglang: --init-expert-location " + FILES[kind] + f" --ep-size {G} "
                       f"--ep-num-redundant-experts {R}") if kind == "sglang" else
            "DeepSeek EPLB rebalance_experts outputs (phy2log, log2phy, logcnt)"}


def log2phy_map(phy2log: torch.Tensor, phyrank: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """EPLB's ``log2phy [L, n, max replicas]`` (-1 padded) from ``phy2log``, the replica ranks and counts."""
    L, n = logcnt.shape
    P = phy2log.shape[1]
    maxlogcnt = int(logcnt.max().item())
    log2phy = torch.full((L, n, maxlogcnt), -1, dtype=torch.int64)
    log2phy.view(L, -1).scatter_(-1, phy2log * maxlogcnt + phyrank, torch.arange(P, dtype=torch.int64).expand(L, -1))
    return log2phy


def eplb_placement(load: torch.Tensor, gpus: int, replicas: int, groups: int, nodes: int) -> dict[str, torch.Tensor]:
    """EPLB (moetool's port, :func:`moetool.experiments.placement.compute.rebalance_experts`) on ``load [L, n]`` with
    ``n + replicas`` slots over ``gpus``: ``phy2log``, ``phyrank``, ``logcnt``, ``log2phy``."""
    n = load.shape[1]
    phy2log, phyrank, logcnt = rebalance_experts(load, n + replicas, groups, nodes, gpus)
    return {"phy2log": phy2log, "phyrank": phyrank, "logcnt": logcnt, "log2phy": log2phy_map(phy2log, phyrank, logcnt)}


def check_sglang_layers(layers: Any, shape: ModelShape) -> None:
    """``--export sglang`` writes a row for every decoder layer: a MoE layer of ``shape`` left out of ``layers``
    (``--layers``, a trace without it) would get SGLang's trivial map in the file, read by the server as the
    placement of that layer -- one line instead. ``layers`` ``None``: every MoE layer."""
    missing = [] if layers is None else sorted(set(shape.moe) - {int(i) for i in layers})
    if missing:
        raise MoetoolError(f"--export sglang: the file places every MoE layer, but the placement covers only layers "
                           f"{spans(sorted(set(shape.moe) - set(missing)))}; MoE layers {spans(missing)} would get "
                           f"SGLang's trivial map as if placed: measure every MoE layer (drop --layers), or "
                           f"--export eplb, which lists the layers it places")


def write_export(kind: str, path: Path, placed: dict[str, torch.Tensor], layers: list[int], shape: ModelShape | None,
                 args: dict[str, int]) -> None:
    """Write ``placed`` (:func:`eplb_placement` of ``layers``) as ``kind`` at ``path``."""
    if kind == "eplb":
        obj = {"layers": layers, **args, "phy2log": placed["phy2log"].tolist(), "log2phy": placed["log2phy"].tolist(),
               "logcnt": placed["logcnt"].tolist()}
    elif kind == "sglang":
        if shape is None:
            raise MoetoolError("--export sglang needs the model's decoder layers (every layer has a row)")
        check_sglang_layers(layers, shape)
        P = placed["phy2log"].shape[1]
        n = placed["logcnt"].shape[1]
        full = (torch.arange(0, P).repeat(shape.num_layers, 1) % n)  # SGLang's init_trivial for the others
        for j, li in enumerate(layers):
            full[li] = placed["phy2log"][j]
        obj = {"physical_to_logical_map": full.tolist()}
    else:
        raise MoetoolError(f"--export must be one of {', '.join(EXPORTS)}, not '{kind}'")
    path.write_text(json.dumps(obj))


def read_sglang_location(path: Path, num_logical_experts: int) -> dict[str, torch.Tensor]:
    """An ``--init-expert-location`` file as SGLang reads it (``.pt`` with ``weights_only=True``, ``.json``):
    ``physical_to_logical_map [L, P]`` and ``logical_to_all_physical_map [L, n, X]`` (-1 padded), computed as its
    ``_compute_logical_to_all_physical_map`` does; a map naming an expert outside n is one line."""
    data = load_pt(path) if path.suffix == ".pt" else json.loads(path.read_text())
    if "physical_to_logical_map" not in data:
        raise MoetoolError(f"{path}: no physical_to_logical_map")
    p2l = torch.as_tensor(data["physical_to_logical_map"], dtype=torch.int64)
    if p2l.ndim != 2 or p2l.min() < 0 or p2l.max() >= num_logical_experts:
        raise MoetoolError(f"{path}: physical_to_logical_map must be [layers, slots] ids in "
                           f"0..{num_logical_experts - 1}")
    L, P = p2l.shape
    l2p: list[list[list[int]]] = [[[] for _ in range(num_logical_experts)] for _ in range(L)]
    for layer_id in range(L):
        for physical_expert_id in range(P):
            l2p[layer_id][int(p2l[layer_id, physical_expert_id])].append(physical_expert_id)
    width = max(len(x) for row in l2p for x in row)
    if min(len(x) for row in l2p for x in row) == 0:
        raise MoetoolError(f"{path}: a logical expert has no physical slot: its tokens would have nowhere to go")
    pad = [[x + [-1] * (width - len(x)) for x in row] for row in l2p]
    return {"physical_to_logical_map": p2l, "logical_to_all_physical_map": torch.tensor(pad, dtype=torch.int64)}


def read_eplb(path: Path) -> dict[str, Any]:
    """An ``eplb`` export: its tensors and arguments; ``log2phy`` and ``logcnt`` must agree with ``phy2log``."""
    d = json.loads(path.read_text())
    out = {k: torch.tensor(d[k], dtype=torch.int64) for k in ("phy2log", "log2phy", "logcnt")}
    out.update({k: v for k, v in d.items() if k not in out})
    L, n = out["logcnt"].shape
    for j in range(L):
        counts = torch.bincount(out["phy2log"][j], minlength=n)
        if not torch.equal(counts, out["logcnt"][j]):
            raise MoetoolError(f"{path}: logcnt of layer {out['layers'][j]} disagrees with phy2log")
        for e in range(n):
            slots = out["log2phy"][j, e]
            slots = slots[slots >= 0]
            if len(slots) != counts[e] or not bool((out["phy2log"][j, slots] == e).all()):
                raise MoetoolError(f"{path}: log2phy of layer {out['layers'][j]} expert {e} disagrees with phy2log")
    return out
