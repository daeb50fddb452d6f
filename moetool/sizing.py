"""Sizing a run from the config alone, before any weight loads: positions, parameters, the memory one batch needs
against the device's free memory (:func:`validate_run`), and the rows ``--batch-size auto`` takes."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .configs import text_config
from .context import dtype_choice, flag
from .errors import MoetoolError, MoetoolRuntimeError
from .loading import load_config, model_from_config, pick_device, pick_dtype, quiet_transformers

# ----- validate a run from the config, before any weight loads ----------------------------------------------------
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
GiB = 1024 ** 3


def _positions(config: Any) -> tuple[int | None, str]:
    """The first of :data:`_POSITION_KEYS` the config sets to a whole number, and its key; a number below 1 there
    (a corrupt or hand-edited config) is one line: no sequence fits it, and skipping it would let any length
    through unchecked."""
    for cfg in (text_config(config), config):
        for key in _POSITION_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                if value < 1:
                    mt = getattr(cfg, "model_type", None) or "the model"
                    raise MoetoolError(f"the config's {key} is {value} ({mt}): not a number of positions; fix "
                                       f"config.json")
                return int(value), key
    return None, ""


def max_positions(config: Any) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings`` or an equivalent key, read from
    the text config of a multimodal model); ``None`` if the config names none."""
    return _positions(config)[0]


def check_seq_len(config: Any, seq_len: int | None) -> int | None:
    """The model's positions (:func:`max_positions`); a ``seq_len`` longer than them is refused in one line (a
    usage error: the position encoding was never trained there and the statistics change)."""
    positions, key = _positions(config)
    if seq_len is not None and positions is not None and seq_len > positions:
        mt = getattr(text_config(config), "model_type", None) or getattr(config, "model_type", "the model")
        raise MoetoolError(f"{flag('seq_len', seq_len)} is longer than the model's {positions} positions "
                           f"({mt} {key}): use {flag('seq_len', positions)} or less")
    return positions


def _meta_model(config: Any) -> Any:
    """The model ``config`` describes, built on the meta device (no memory, no weights); ``None`` if it cannot be
    built from its config."""
    import torch

    try:
        with torch.device("meta"), quiet_transformers():
            return model_from_config(config)
    except Exception:  # noqa: BLE001 - an estimate only: the load itself reports real problems
        return None


def count_parameters(config: Any) -> int | None:
    """Parameters of the model ``config`` describes (:func:`_meta_model`; tied embeddings count once); ``None`` if it
    cannot be built from its config."""
    model = _meta_model(config)
    return None if model is None else sum(p.numel() for p in model.parameters())


# the styles of transformers' parallel plans that split a parameter over the ranks (the others keep it whole on every
# rank or only hook the module's forward): colwise*, rowwise*, packed_*, embedding_* (tp), grouped_gemm (ep)
_SPLITTING = ("colwise", "rowwise", "packed_", "embedding_", "grouped_gemm")


def rank_parameters(config: Any, tp: int = 1, ep: int = 1) -> tuple[int | None, bool]:
    """``(parameters, split)``: the parameters ONE rank of a ``--tp`` / ``--ep`` model group holds, from the plans
    transformers' ``DistributedConfig`` loads the model with (its resolved tensor- and expert-parallel plans, on the
    meta model): a parameter a splitting style names holds ``ceil(numel / tp)`` (tensor plan) or ``ceil(numel /
    ep)`` (expert plan) on each rank, every other one (norms, routers) its whole ``numel``. ``split`` is False when
    nothing splits (alone, or transformers' plans cannot be read): then it is the whole model's
    :func:`count_parameters`, as one process holds it."""
    model = _meta_model(config)
    if model is None:
        return None, False
    params = dict(model.named_parameters())  # tied embeddings once
    whole = sum(p.numel() for p in params.values())
    if max(tp, ep) == 1:
        return whole, False
    try:
        from transformers.distributed import DistributedConfig

        with quiet_transformers():
            tp_plan, ep_plan, *_ = model._resolve_parallel_plans(
                DistributedConfig(tp_size=tp, ep_size=ep if ep > 1 else None))
    except Exception:  # noqa: BLE001 - no readable plan: the whole model on each rank (never fewer bytes than held)
        return whole, False
    held = 0
    for name, p in params.items():
        size = next((n for plan, n in ((ep_plan, ep), (tp_plan, tp))
                     if str(plan.get(name, "")).startswith(_SPLITTING)), 1)
        held += -(-p.numel() // size)
    return held, held < whole


def _meminfo_available() -> int | None:
    """Bytes of RAM available to this process: ``MemAvailable`` of /proc/meminfo (psutil if installed), capped
    by a cgroup v2/v1 memory limit (containers, cluster jobs)."""
    avail = None
    try:
        import psutil  # type: ignore[import-not-found]

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except OSError:
            pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            room = max(int(limit) - used, 0)
            avail = room if avail is None else min(avail, room)
        break
    return avail


def available_memory(device: Any) -> int | None:
    """Free bytes on ``device`` (a ``torch.device``): ``torch.cuda.mem_get_info`` on CUDA, available RAM on CPU
    (:func:`_meminfo_available`); ``None`` when unknown (then nothing is refused)."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return _meminfo_available()
    return None


@dataclass
class RunEstimate:
    """What :func:`validate_run` checked: a *lower bound* of the memory one forward batch needs."""

    device: str
    dtype: str
    max_positions: int | None
    rows_per_batch: int  # min(--batch-size, rows --max-tokens can fill)
    params: int | None
    weights_bytes: int
    activation_bytes: int
    available_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def estimate_memory(config: Any, *, seq_len: int, rows: int, dtype: Any, params: int | None,
                    attn_implementation: str | None = None, quantize: str | None = None) -> tuple[int, int]:
    """``(weights, activations)`` in bytes: a lower bound of what one forward of ``rows x seq_len`` tokens holds.

    weights = parameters x element size (0 for a quantized checkpoint or ``--quantize``: its size depends on the
    kernel);
    activations = the logits ``rows x seq_len x vocab`` (transformers computes them for every position) +
    two hidden-state tensors ``rows x seq_len x hidden`` + the attention probabilities
    ``rows x heads x seq_len^2`` only with ``attn_implementation="eager"`` (SDPA kernels need not materialise them).
    Everything else (KV projections, expert intermediates, the fp32 chunks of the logits an NLL makes --
    ``moetool.engine.runner.NLL_CHUNK_ELEMENTS`` at a time --, allocator slack) is left out, so a run refused by this bound cannot fit; one that passes may still run out.
    """
    import torch

    tc = text_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    quantized = quantize or getattr(config, "quantization_config", None) or getattr(tc, "quantization_config", None)
    weights = 0 if quantized or params is None else params * size
    vocab = int(getattr(tc, "vocab_size", 0) or 0)
    hidden = int(getattr(tc, "hidden_size", 0) or 0)
    tokens = rows * seq_len
    act = tokens * vocab * size + 2 * tokens * hidden * size
    if attn_implementation == "eager":
        heads = int(getattr(tc, "num_attention_heads", 0) or 0)
        act += rows * heads * seq_len * seq_len * size
    return weights, act


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 1024 ** 2:.0f} MiB"


def check_sizes(*, seq_len: Any = None, max_tokens: Any = None, batch_size: Any = None) -> None:
    """``seq_len`` and ``max_tokens`` integers of at least 2 (one next-token prediction), ``batch_size`` of at least 1
    (``None``: not given): one line (exit 2) naming the flag otherwise."""
    for name, value, least in (("seq_len", seq_len, 2), ("max_tokens", max_tokens, 2), ("batch_size", batch_size, 1)):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least):
            raise MoetoolError(f"{flag(name)} must be an integer of at least {least}, not {value!r}")


def validate_run(config: Any, *, seq_len: int | None = None, batch_size: int | None = None,
                 max_tokens: int | None = None, device: Any = "auto", dtype: Any = "auto",
                 device_map: str | None = None, attn_implementation: str | None = None,
                 check_memory: bool = True, quantize: str | None = None,
                 weights_loaded: bool = False) -> RunEstimate:
    """Refuse, with one line and before any weight loads or any run folder exists, inputs a run cannot use.

    * ``seq_len``, ``max_tokens``, ``batch_size`` must be positive (``seq_len`` at least 2: one next-token
      prediction) -- usage errors (exit 2);
    * ``seq_len`` must not exceed the model's positions (:func:`max_positions`; ``text_config`` of a multimodal
      config) -- a usage error: the position encoding was never trained there and the statistics change;
    * ``device`` / ``dtype`` are resolved as :func:`moetool.loading.load` resolves them (``--device cuda`` without
      CUDA: exit 1);
    * memory: the weights plus one batch's activations (:func:`estimate_memory`, a lower bound) must fit in the
      device's free memory (CUDA: free memory of the device; CPU: available RAM, within a cgroup limit) -- a
      runtime error (exit 1). The batch is the one the options ask for, ``min(batch_size, ceil(max_tokens /
      seq_len))`` rows: the data are not read yet, so a ``--data`` with fewer than ``max_tokens`` tokens (smaller
      batches) can be refused although it would fit -- the message says which option to lower. Skipped with
      ``device_map="auto"`` (accelerate spreads and offloads) or when the free memory is unknown;
      ``weights_loaded`` (a model already in memory: ``moetool.run``): the weights count 0, the free memory is
      what they left.

    Returns the :class:`RunEstimate` (its ``as_dict()`` fits a manifest).
    """
    check_sizes(seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size)
    positions = check_seq_len(config, seq_len)
    dev = pick_device(device) if not hasattr(device, "type") else device
    torch_dtype = pick_dtype(dtype, config, dev) if isinstance(dtype, str) else dtype
    rows = batch_size or 1
    if max_tokens is not None and seq_len:
        rows = min(rows, -(-max_tokens // seq_len))
    est = RunEstimate(device=str(dev), dtype=str(torch_dtype).replace("torch.", ""), max_positions=positions,
                      rows_per_batch=rows, params=None, weights_bytes=0, activation_bytes=0, available_bytes=None)
    if not check_memory or device_map or seq_len is None:
        return est
    est.available_bytes = available_memory(dev)
    if est.available_bytes is None:
        return est
    est.params = None if weights_loaded else count_parameters(config)
    est.weights_bytes, est.activation_bytes = estimate_memory(
        config, seq_len=seq_len, rows=rows, dtype=torch_dtype, params=est.params,
        attn_implementation=attn_implementation, quantize=quantize)
    avail = est.available_bytes
    if est.weights_bytes > avail:
        raise MoetoolRuntimeError(
            f"the weights alone need {_gib(est.weights_bytes)} ({est.params:,} parameters in {est.dtype}) but "
            f"{dev} has {_gib(avail)} free: use {dtype_choice()}, --device-map auto or a larger machine")
    if est.weights_bytes + est.activation_bytes > avail:
        raise MoetoolRuntimeError(
            f"a batch of {rows} rows x --seq-len {seq_len} needs at least {_gib(est.activation_bytes)} of "
            f"activations (logits over {int(getattr(text_config(config), 'vocab_size', 0)):,} tokens in "
            f"{est.dtype}) besides {_gib(est.weights_bytes)} of weights, but {dev} has {_gib(avail)} free: "
            f"lower --batch-size or --seq-len")
    return est


# ----- --batch-size auto ---------------------------------------------------------------------------------------
AUTO_SLACK = 3  # activations counted per row: 3x estimate_memory's lower bound (fp32 logits copy and
#                log-softmax of the NLL, expert intermediates, allocator slack)
AUTO_SHARE = 0.8  # of the free memory left after the weights
AUTO_MAX_ROWS = 1024


def policy_needs(policies: Any) -> tuple[bool, bool]:
    """``(attention, probe)``: whether any of ``policies`` (policy objects or classes) declares ``needs_attention``
    (eager attention probabilities) or ``needs_probe`` (every expert computed on every token)."""
    ps = [p for p in (policies if isinstance(policies, (list, tuple, set)) else [policies]) if p is not None]
    return (any(getattr(p, "needs_attention", False) for p in ps), any(getattr(p, "needs_probe", False) for p in ps))


def auto_batch_size(model: str, *, seq_len: int | None, max_tokens: int | None = None, device: str = "auto",
                    dtype: str = "auto", device_map: str | None = None, policies: Any = (),
                    processes: int = 1, world: int = 1, quantize: str | None = None, tp: int = 1,
                    ep: int = 1) -> tuple[int, dict[str, Any]]:
    """``--batch-size auto`` for a model by name, before it loads: :func:`auto_rows` on its config, the weights
    counted unless ``--device-map auto`` places them -- under ``--tp`` / ``--ep`` the share one rank of the model
    group holds (:func:`rank_parameters`), whose free memory is what the rows get. ``world``: the data-parallel
    groups the data are split over (the model groups under ``--tp`` / ``--ep``, whose ranks all run the same rows).
    Returns ``(rows per model group, facts for the manifest)``."""
    config, _, _ = load_config(model)
    dev = pick_device(device)
    params, split = (None, False) if device_map else rank_parameters(config, tp, ep)
    rows, facts = auto_rows(config, device=dev, dtype=pick_dtype(dtype, config, dev), seq_len=seq_len,
                            max_tokens=max_tokens, params=params, policies=policies, processes=processes,
                            world=world, quantize=quantize)
    if max(tp, ep) > 1:
        facts.update(model_group=max(tp, ep), data_parallel=world,
                     weights="this rank's share" if split else "the whole model (no split plan read)")
    return rows, facts


def auto_rows(config: Any, *, device: Any, dtype: Any, seq_len: int | None, max_tokens: int | None = None,
              params: int | None = None, policies: Any = (), processes: int = 1, world: int = 1,
              quantize: str | None = None) -> tuple[int, dict[str, Any]]:
    """``--batch-size auto``: the largest number of rows whose activations fit the device's free memory.

    rows = ``AUTO_SHARE x (free - weights - probes) / (AUTO_SLACK x activations of one row)`` with ``free`` from
    ``torch.cuda.mem_get_info`` on CUDA or the available RAM on CPU (shared by ``processes`` ranks on this node),
    weights (``params`` of them; ``None``: already loaded or placed by accelerate, 0) and one row's activations
    from :func:`estimate_memory`, sized for what the ``policies`` declare (:func:`policy_needs`: eager attention
    probabilities; a probe of every expert adds its token-chunk intermediates, ``probes.DEFAULT_BUDGET`` fp32
    elements, and the ``[seq_len, n]`` fp32 scores per row); at most the rows ``max_tokens`` fills on each of
    ``world`` data-parallel ranks (model groups under ``--tp`` / ``--ep``) and
    :data:`AUTO_MAX_ROWS`. Free memory unknown: 8. Returns ``(rows, facts for the manifest)``."""
    from .adapters import config_experts

    if not seq_len:  # eval: lm-eval packs its own requests; the model's context (at most 2048) is the bound
        positions = getattr(text_config(config), "max_position_embeddings", None) or 2048
        seq_len = min(int(positions), 2048)
    dev = device
    free = available_memory(dev)
    fill = -(-max_tokens // seq_len) if max_tokens else AUTO_MAX_ROWS
    fill = max(1, -(-fill // world))  # rows each rank gets
    facts: dict[str, Any] = {"device": str(dev), "seq_len": seq_len, "free_bytes": free, "processes_per_node":
                             processes, "slack": AUTO_SLACK, "share": AUTO_SHARE}
    if free is None:
        return min(8, fill), {**facts, "rows": min(8, fill), "reason": "free memory unknown: default 8"}
    attention, probe = policy_needs(policies)
    weights, act = estimate_memory(config, seq_len=seq_len, rows=1, dtype=dtype, params=params,
                                   attn_implementation="eager" if attention else None, quantize=quantize)
    fixed = weights
    if probe:
        from .engine.probes import DEFAULT_BUDGET

        fixed += 4 * DEFAULT_BUDGET
        act += seq_len * (config_experts(config) or 0) * 4
        facts["probe_bytes"] = 4 * DEFAULT_BUDGET
    budget = AUTO_SHARE * (free / (processes if dev.type == "cpu" else 1) - fixed)
    rows = int(budget // (AUTO_SLACK * max(act, 1)))
    if rows < 1:
        raise MoetoolRuntimeError(f"--batch-size auto: not even one row of --seq-len {seq_len} fits: "
                                  f"{weights / 2**30:.1f} GiB of weights, {act * AUTO_SLACK / 2**30:.2f} GiB per "
                                  f"row, {free / 2**30:.1f} GiB free on {dev}; lower --seq-len or use --device-map")
    chosen = min(rows, fill, AUTO_MAX_ROWS)
    why = "fits memory" if chosen == rows else ("rows the data fill" if chosen == fill else "cap")
    return chosen, {**facts, "weights_bytes": weights, "row_bytes": act * AUTO_SLACK, "memory_rows": rows,
                    "data_rows": fill, "rows": chosen, "reason": why}
