"""Data parallelism under ``torchrun`` / ``accelerate launch``: ranks, sharding, all-reduce, rank-0 writing.

Both launchers set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and ``MASTER_ADDR`` / ``MASTER_PORT``) in every
process; :func:`init` reads them, starts the process group (``nccl`` with CUDA, ``gloo`` on CPU) and returns the
rank's device (``cuda:LOCAL_RANK`` when CUDA is present). Without them everything here is a no-op on one process,
so a command written with these helpers runs unchanged alone.

What a forward loop needs (one process or many):

1. ``tokens = shard(tokens, batch_size)`` — each global batch (``batch_size × world`` packed rows) is split by rank
   (rank r takes rows ``r·batch_size … (r+1)·batch_size − 1`` of it); ``tokens.row_ids`` keeps the global row
   numbers (traces write them), and every rank runs ``n_steps(...)`` batches (possibly empty ones at the end),
   so a per-batch collective (k-means EMA sums) lines up across ranks.
2. accumulate on the device as usual; at the end ``all_reduce_dict(acc)`` / ``all_reduce_state(sketch)``
   (sums, counts, per-layer matrices, mins and maxes). A sequential step (a k-means EMA update) reduces its
   per-batch sums with ``all_reduce_dict`` before applying them: the result equals one process over the same
   global batches.
3. only ``is_main()`` creates the run directory and writes; ``gather_object`` brings per-rank facts (token counts)
   to the manifest.

Tensor and expert parallel (``--tp N`` / ``--ep N``: the run's :class:`~moetool.context.Parallel`, :func:`parallel`): transformers' own engine
(``DistributedConfig``) splits ONE model over a group of ``max(tp, ep)`` consecutive ranks, which all see the same
tokens; data parallel runs across groups (world = dp × group). Then :func:`rank` / :func:`world_size` are the
data-parallel rank and size (the group's number and the number of groups), every reduction above runs over the ranks
of this rank's position in its group (one per group: each group counted once) and :func:`is_main` is global rank 0.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from . import context
from .context import Parallel  # noqa: F401  (moetool.distributed.Parallel: the layout's type)
from .errors import MoetoolError, env_seconds


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


_GROUPS: dict[str, Any] = {}  # tp/ep runs only: "dp" this rank's data-parallel group, "model" its model group


def parallel() -> Parallel:
    """``--tp`` / ``--ep`` of the run in progress (:attr:`moetool.context.RunState.layout`; no run: nothing split)."""
    run = context.current()
    return run.layout if run is not None else Parallel()


def check_parallel(config: Any, device_map: str | None = None) -> Parallel:
    """One line before anything loads for a layout that cannot work: not under a launcher, a world not divisible
    by the group, ``--device-map`` with it, heads, key/value heads, experts or expert features not divisible."""
    par = parallel()
    if not par.active:
        return par
    flag = f"--tp {par.tp}" if par.tp > 1 else f"--ep {par.ep}"
    world = env().world_size
    if world == 1:
        raise MoetoolError(f"{flag} splits the model over {par.group} processes: launch with torchrun "
                           f"--nproc-per-node {par.group} (or accelerate launch); this is one process")
    if world % par.group:
        raise MoetoolError(f"{flag}: the world size {world} is not a multiple of the {par.group} ranks holding one "
                           f"model (world = data parallel × {par.group})")
    if device_map:
        raise MoetoolError(f"--device-map with {flag}: tensor/expert parallel already places the model on the ranks' "
                           "devices; use one or the other")
    text = getattr(config, "get_text_config", lambda: config)()
    checks = []
    if par.tp > 1:
        checks += [("attention heads", getattr(text, "num_attention_heads", None), par.tp),
                   ("key/value heads", getattr(text, "num_key_value_heads", None), par.tp)]
    n_experts = next((getattr(text, k) for k in ("n_routed_experts", "num_local_experts", "num_experts",
                                                  "moe_num_experts") if isinstance(getattr(text, k, None), int)), None)
    if par.ep > 1:
        checks.append(("experts", n_experts, par.ep))
    elif par.tp > 1:
        inter = next((getattr(text, k) for k in ("moe_intermediate_size", "intermediate_size")
                      if isinstance(getattr(text, k, None), int)), None)
        checks.append(("expert intermediate features", inter, par.tp))  # tp alone splits each expert's features
    for what, n, size in checks:
        if isinstance(n, int) and n % size:
            raise MoetoolError(f"{flag}: the model's {n} {what} do not split over {size} ranks (choose a divisor "
                               f"of {n})")
    return par


# the launchers' variables (torchrun, accelerate, mpirun): moetool.context, which the CLI reads without torch
from .context import _LOCAL, _RANK, _WORLD, _first  # noqa: E402


def env() -> DistEnv:
    """The launcher's view of this process (torchrun and accelerate set the same variables; MPI's as a fallback)."""
    try:
        world = int(_first(_WORLD, "1"))
        rank = int(_first(_RANK, "0"))
        local = int(_first(_LOCAL, str(rank)))
    except ValueError:
        raise MoetoolError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise MoetoolError(f"bad launcher environment: RANK={rank} WORLD_SIZE={world}")
    return DistEnv(rank, world, local)


def _dist():
    import torch.distributed as dist

    return dist


def initialized() -> bool:
    d = _dist()
    return d.is_available() and d.is_initialized()


def init(device: str | None = None) -> torch.device:
    """Join the process group if a launcher started us; returns this rank's device.

    ``device``: ``None``/``"auto"`` = ``cuda:LOCAL_RANK`` when CUDA is present, else CPU; ``"cpu"`` forces gloo.
    """
    e = env()
    use_cuda = torch.cuda.is_available() and device not in ("cpu",)
    dev = torch.device(f"cuda:{e.local_rank}") if use_cuda and e.distributed else \
        torch.device(device if device not in (None, "auto") else ("cuda" if use_cuda else "cpu"))
    if e.distributed and not initialized():
        if use_cuda:
            torch.cuda.set_device(dev)
        _dist().init_process_group(backend="nccl" if use_cuda else "gloo", rank=e.rank, world_size=e.world_size,
                                   timeout=_timeout())
        atexit.register(shutdown)  # leave the group cleanly when the command ends
    _dp_group()
    return dev


def _dp_group() -> Any:
    """Under tp/ep: the process group of the ranks at this rank's position in every model group (one per group),
    made once by every rank in the same order; ``None`` (the whole world) otherwise. The model groups' own process
    groups (:func:`model_group_all`) are made with them."""
    g = parallel().group
    if g == 1 or not initialized():
        return None
    world = _dist().get_world_size()
    if _GROUPS.get("dp_key") != (g, world):
        me = _dist().get_rank()
        for pos in range(g):
            group = _dist().new_group(list(range(pos, world, g)))
            if pos == me % g:
                _GROUPS["dp"] = group
        for first in range(0, world, g):  # its own communicator: never paired with the model's collectives
            group = _dist().new_group(list(range(first, first + g)))
            if first == me - me % g:
                _GROUPS["model"] = group
        _GROUPS["dp_key"] = (g, world)
    return _GROUPS["dp"]


def model_group_all(ok: bool) -> bool:
    """``ok`` on every rank of this rank's model group (``--tp``/``--ep``: one all-reduce, min, over the group's
    ranks), so all of them take the same branch after a step they ran together; alone or without a model group
    ``ok``. It waits for every rank of the group: one still inside a forward never pairs with it (its own process
    group), it waits until that rank comes (``MOETOOL_DIST_TIMEOUT``)."""
    if parallel().group == 1 or not initialized():
        return ok
    _dp_group()
    d = _dist()
    flag = torch.tensor([int(bool(ok))], device=_backend_device())
    d.all_reduce(flag, op=d.ReduceOp.MIN, group=_GROUPS["model"])
    return bool(flag.item())


def _timeout() -> Any:
    """``MOETOOL_DIST_TIMEOUT`` seconds for every collective (tests: a minute, so a mismatch fails instead of
    hanging for torch's default 10-30 minutes); ``None`` = torch's default."""
    from datetime import timedelta

    seconds = env_seconds("MOETOOL_DIST_TIMEOUT")
    return None if seconds is None else timedelta(seconds=seconds)


def shutdown() -> None:
    if initialized():
        _dist().destroy_process_group()
    _GROUPS.clear()


def global_rank() -> int:
    return _dist().get_rank() if initialized() else env().rank


def rank() -> int:
    """The data-parallel rank (the model group's number under tp/ep; the process's rank otherwise)."""
    return global_rank() // parallel().group


def world_size() -> int:
    """The data-parallel size: processes, or model groups under tp/ep (1 alone)."""
    return _dist().get_world_size() // parallel().group if initialized() else 1


def _reduces() -> bool:
    """True when there is more than one data-parallel part to combine."""
    return initialized() and world_size() > 1


def backend() -> str | None:
    """``gloo`` / ``nccl`` in a process group, ``None`` alone."""
    return str(_dist().get_backend()) if initialized() else None


def is_main() -> bool:
    """True on rank 0 (or alone): the one process that writes the run directory."""
    return global_rank() == 0


def barrier() -> None:
    if initialized():
        _dist().barrier()


# ----- sharding -------------------------------------------------------------------------------------------
def shard_indices(n_rows: int, batch_size: int, rank_: int, world: int) -> torch.Tensor:
    """Global row numbers of rank ``rank_``: its ``batch_size`` slice of every global batch of ``batch_size·world``."""
    if batch_size < 1:
        raise MoetoolError("--batch-size must be at least 1")
    rows = torch.arange(n_rows)
    within = rows % (batch_size * world)
    return rows[(within // batch_size) == rank_]


def n_steps(n_rows: int, batch_size: int, world: int) -> int:
    """Batches every rank runs (the same on all ranks, so per-batch collectives line up)."""
    return -(-n_rows // (batch_size * world))


def shard(tokens: Any, batch_size: int, rank_: int | None = None, world: int | None = None) -> Any:
    """This rank's rows of a :class:`~moetool.data.TokenSet` (``row_ids``: their global numbers). Alone: unchanged."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    base = tokens.row_ids if tokens.row_ids is not None else torch.arange(tokens.input_ids.shape[0], device="cpu")
    if w == 1:
        return replace(tokens, row_ids=base)
    keep = shard_indices(tokens.input_ids.shape[0], batch_size, r, w)
    return replace(tokens, input_ids=tokens.input_ids[keep], attention_mask=tokens.attention_mask[keep],
                   domains=[tokens.domains[i] for i in keep.tolist()], row_ids=base[keep])


# ----- reductions -----------------------------------------------------------------------------------------
_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


def _backend_device() -> torch.device:
    return torch.device("cpu") if _dist().get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced over the data-parallel ranks (a new tensor on ``t``'s device; ``t`` itself alone)."""
    if not _reduces():
        return t
    d = _dist()
    buf = t.detach().to(_backend_device()).clone()
    d.all_reduce(buf, op=getattr(d.ReduceOp, _OPS[op]), group=_dp_group())
    return buf.to(t.device)


def all_reduce_dict(acc: Mapping[str, Any], op: str = "sum") -> dict[str, Any]:
    """Every tensor of a (nested) dict of accumulators reduced over ranks; other values kept."""
    out: dict[str, Any] = {}
    for k, v in acc.items():
        if isinstance(v, torch.Tensor):
            out[k] = all_reduce(v, op)
        elif isinstance(v, Mapping):
            out[k] = all_reduce_dict(v, op)
        else:
            out[k] = v
    return out


def all_reduce_keyed(acc: Mapping[Any, Any], op: str = "sum") -> dict[Any, Any]:
    """Like :func:`all_reduce_dict` for accumulators keyed by what a rank happened to see (MoE layers, codebook
    sizes): the ranks first agree on the union of keys (one ``all_gather_object``), a rank that lacks a key
    joins with zeros of the shape another rank reported, and every rank then reduces the same tensors in the
    same order -- so a rank with fewer (or no) rows never leaves a collective unmatched. Its zeros sit on the
    kind of device the reporting rank keeps the tensor on (a GPU accumulator on this rank's GPU, a host one on the
    host), as the ranks that saw the key hold theirs. Values: tensors or dicts of tensors (other entries copied
    from whichever rank has them)."""
    if not _reduces():
        return dict(acc)

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype, v.device.type)
        if isinstance(v, Mapping):
            return {k: spec(x) for k, x in v.items()}
        return ("value", v)

    here = _backend_device()

    def zeros(sp: Any) -> Any:  # on the kind of device the reporting rank keeps it (this rank's GPU, or the host)
        if isinstance(sp, dict):
            return {k: zeros(x) for k, x in sp.items()}
        return torch.zeros(sp[1], dtype=sp[2], device=here if sp[3] == here.type else "cpu") \
            if sp[0] == "tensor" else sp[1]

    specs: dict[Any, Any] = {}
    for part in gather_object({k: spec(v) for k, v in acc.items()}):
        for k, sp in part.items():
            specs.setdefault(k, sp)
    out: dict[Any, Any] = {}
    try:
        order = sorted(specs)  # the same order on every rank (layer numbers, (layer, size) pairs)
    except TypeError:
        order = sorted(specs, key=repr)
    for k in order:
        v = acc[k] if k in acc else zeros(specs[k])
        out[k] = all_reduce(v, op) if isinstance(v, torch.Tensor) else \
            {n: all_reduce(x, op) if isinstance(x, torch.Tensor) else x for n, x in v.items()} \
            if isinstance(v, Mapping) else v
    return out


def rank_counts(n: int, device: Any = None) -> torch.Tensor:
    """``[world]`` long: every rank's ``n`` (one all-reduce of a one-hot vector; ``[n]`` alone)."""
    out = torch.zeros(world_size(), dtype=torch.long, device=device)
    out[rank()] = n
    return all_reduce(out)


def all_gather_rows(t: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``t`` (rows may differ in number, even 0) concatenated along dim 0 in rank order, on every
    rank (``t`` alone). ``counts``: the ranks' row counts if known (:func:`rank_counts`), else one more
    collective finds them."""
    if not _reduces():
        return t
    counts = rank_counts(t.shape[0]) if counts is None else counts
    size = int(counts.max())
    buf = torch.zeros((size, *t.shape[1:]), dtype=t.dtype, device=_backend_device())
    buf[: t.shape[0]] = t.detach().to(buf.device)
    parts = [torch.empty_like(buf) for _ in range(world_size())]
    _dist().all_gather(parts, buf, group=_dp_group())
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts.tolist())]).to(t.device)


def all_reduce_state(obj: Any) -> Any:
    """Reduce an object exposing ``state()``, ``load_state()`` and ``REDUCE`` (the :mod:`moetool.sketch` summaries)
    in place; returns it."""
    if _reduces():
        obj.load_state({k: all_reduce(v, obj.REDUCE[k]) for k, v in obj.state().items()})
    return obj


def gather_to_main(value: Any) -> list[Any] | None:
    """``value`` of every rank in rank order on rank 0 (``None`` on the others; ``[value]`` alone): rows only the
    writer needs (trace rows) travel once, not to every rank."""
    if not _reduces():
        return [value]
    dst = global_rank() % parallel().group  # this data-parallel group's first rank (global rank 0 for the writer's)
    out: list[Any] | None = [None] * world_size() if global_rank() == dst else None
    _dist().gather_object(value, out, dst=dst, group=_dp_group())
    return out if is_main() else None


def gather_object(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` alone)."""
    if not _reduces():
        return [value]
    out: list[Any] = [None] * world_size()
    _dist().all_gather_object(out, value, group=_dp_group())
    return out


def all_reduce_world(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced over EVERY process (not only the data-parallel ranks): a choice all ranks of a model group
    must share (``--batch-size auto``)."""
    if not initialized():
        return t
    d = _dist()
    buf = t.detach().to(_backend_device()).clone()
    d.all_reduce(buf, op=getattr(d.ReduceOp, _OPS[op]))
    return buf.to(t.device)
