"""moetool's speed and memory, in one run: ratios to the plain forward, every variant interleaved.

    python bench/bench.py                 # engine ratios on two Mixtral-shaped random models (~2-4 min on 2 cores)
    python bench/bench.py --real          # + one decoder layer at Mixtral-8x7B / Qwen3-30B-A3B width, bf16
    python bench/bench.py --rss           # + peak RSS of every command at 20k and 200k tokens
    python bench/bench.py --lazy-data     # + load_tokens --max-tokens 20k/200k on a 200 MB corpus
    python bench/bench.py --shapes --quant  # only: quantized-expert probes against the plain probe
    python bench/bench.py --shapes --cache-sim  # only: offload's cache simulation, one layer (host CPU)
    python bench/bench.py --shapes --cache-sim --cache-sim-base REV  # ... against git revision REV's, interleaved
    python bench/bench.py --shapes --load   # only: moetool.load vs from_pretrained of a local checkpoint, GB/s
    python bench/bench.py --shapes --host-work  # only: each command's host work over the bare forward (CPU, ~2 min)
    python bench/bench.py --shapes --wide-work  # only: each command's own work at d=4096, one layer (CPU, ~1 min)
    python bench/bench.py --csv out.csv   # where the figures go (default bench.csv)
    python bench/bench.py --gpu           # issue #36's figures on any CUDA machine (~3-4 min on an H100; --quick:
                                          # half); on CPU scaled-down shapes, said so (bench/bench_gpu.py)

**Engine ratios** (``--shapes``): two random Mixtral-shaped models, 8 layers, d=512 — ``8x1024k2`` (8 experts,
I=1024, top-2) and ``64x128k8`` (64 experts, I=128, top-8) — over ``--tokens`` random tokens in batches of
``--batch-size`` × ``--seq-len``. Variants, all timed in every round in turn (round-robin, ``--repeat`` rounds
after a warm-up), each round's time divided by that round's plain forward, the median of those ratios printed:

* ``plain``            the unhooked forward (vocabulary 32000, Mixtral's) (the reference, 1.00);
* ``capture``          an Engine with a no-op consumer (routing events built in every MoE layer);
* ``router_logits``    transformers' own ``output_router_logits=True`` (no moetool);
* ``hand_item_loop``   what a researcher writes by hand: a forward hook on every router that counts each
                       expert's tokens with ``(top == e).sum().item()`` — one host sync per expert and layer;
* ``norm:gate``        the AoE policy: all experts' gate projection, top-K by its L2 norm;
* ``all_expert_outputs`` every expert's output for every token of every MoE layer (batched probe).

Each is printed next to its **FLOP-ideal** ratio: FLOPs of the variant / FLOPs of the plain forward, per token,
multiply-add = 2, per MoE layer with d hidden, I expert width, n experts, top-K, H query / G key-value heads of
width h, causal context (mean attended S' = (S+1)/2), vocabulary V:

    attention = 2·d·H·h + 2·2·d·G·h + 2·H·h·d + 2·2·H·h·S'     router = 2·n·d     experts = K·3·2·I·d
    plain     = layers·(attention + router + experts) + 2·d·V
    norm:gate = plain + layers·(n − K)·2·I·d      (gate of all n; the chosen K's gate reused, not recomputed)
    norm:gate (recompute) = plain + layers·n·2·I·d   (what a policy that does not reuse its probe costs)
    all_expert_outputs = plain + layers·n·3·2·I·d

capture, router_logits and hand_item_loop have an ideal of 1.00 (no extra arithmetic).

**Real widths** (``--real``): one decoder layer (attention + MoE block, vocabulary 256) at the true shapes of
Mixtral-8x7B (d=4096, 8 experts, I=14336, top-2, 32/8 heads) and Qwen3-30B-A3B (d=2048, 128 experts, I=768,
top-8, 32/4 heads), bf16, random weights; time per 1,000 tokens and peak extra memory (CUDA: max allocated;
CPU: peak RSS sampled every 2 ms above the RSS before the call) of plain, capture, norm:gate and all-expert
outputs (token chunks sized by ``engine.probes.auto_budget``: a share of a CUDA device's free memory,
``DEFAULT_BUDGET`` on the CPU).

**RSS per command** (``--rss``): ``moetool <command>`` on the embedded models in a subprocess at 20k and 200k
tokens of a corpus made by repeating the held-out text; its peak RSS (``wait4``). Flat memory = the 200k figure
close to the 20k one.

**Quantized probes** (``--quant``): one Mixtral-shaped MoE layer (d=``--quant-d``, 8 experts of width
``--quant-inter``, top-2; bf16 on CUDA, fp32 on CPU) and copies of it whose experts are transformers' ``FP8Experts``
holding the same weights quantized (FP8 128x128 with fp32 scales, FP8 with UE8M0 scales, FP4 packed 1x32): the probe
``node_scores(gate)`` and ``expert_outputs`` over the same ``--quant-tokens`` tokens per call (one or more counts:
the dequantization is per call, so its share falls as a call's tokens grow), quantized time / plain time
(median of ``--repeat`` interleaved rounds; each timed unit calls the probe as often as the plain probe needs to
last 20 ms, ``calls_per_round``). The extra is the dequantization of every expert, a slice at a time (on CUDA one
compiled kernel per slice, :mod:`moetool.compiled`).

**Host work** (``--host-work``): what a command computes on the host around its forwards, the share of a GPU run
that the device's speed does not shrink, measured on the CPU at the GPU command benchmark's layout (``--gpu``
section 3: Mixtral's 8 experts top-2, 2 layers, vocabulary 32,000, rows of 2,048) at a width where the forward
costs little (d=64, I=128, 2 heads), with two stand-ins for what a GPU does in one kernel and a CPU in seconds:
the LM head returns logits of the same shape without its GEMM (a broadcast view), and the vocabulary
specialisation's argmax over them is a cheap function of the logits with as many distinct ids (``ppl``'s
log-softmax over the vocabulary is device arithmetic of the same kind: not a host-work figure). ``--host-tokens`` tokens (65,536) in forwards
of ``--host-rows`` rows (2), one thread; each command (``--host-commands``, default stats and placement; the API
with its defaults but ``batch_size``) between two bare ``moetool.forward`` calls, its extra = its time - their mean:
the median over ``--repeat`` rounds (min-max), in ms and µs per token.

**Work at d=4096** (``--wide-work``): the same measurement as ``--host-work`` (each of ``--wide-commands``, default
margin, stats and ppl, between two bare forwards) on one MoE layer at Mixtral-8x7B's width d=4096 with narrow
experts (I=32), 2 heads and a vocabulary of 512, ``--wide-tokens`` tokens (4,096) in forwards of 4 rows,
``--wide-dtype`` (bf16), one thread: the forward costs little, so what a command does per token over
``[tokens, d]`` (margin's noisy router inputs) shows as the memory traffic it is on a GPU.

**Cache simulation** (``--cache-sim``): ``offload``'s cache simulation alone (``simulate_all``: every default
capacity x lru / lfu / belady) on one layer's skewed random routing trace (each token's top-K of uniform noise plus
a fixed Dirichlet popularity per expert) at 8 experts top-2 (64k tokens), 128 top-8 (8k and 64k) and 64 top-8
(16k); seconds (best of ``--repeat``) and microseconds per token, on the host CPU whatever the device: the part
of ``offload`` no GPU runs. ``--cache-sim-base REV``: also git revision REV's simulation on the same traces,
interleaved, its hits asserted identical (``base_seconds``, ``speedup``).

**Load speed** (``--load``): a random Mixtral-shaped checkpoint of about ``--load-mb`` MB (fp32 safetensors,
written once to a temporary folder, so read from a warm page cache) loaded by ``moetool.load`` (no tokenizer) and by
transformers' own ``AutoModelForCausalLM.from_pretrained`` (same dtype; on CUDA both straight onto the GPU),
interleaved, best of ``--repeat``: seconds and GB/s (safetensors bytes / seconds).

Speed targets are ratios printed here, never timed tests. Not a test.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

SHAPES = {  # name: (experts, expert width, top-K)
    "8x1024k2": (8, 1024, 2),
    "64x128k8": (64, 128, 8),
}
REAL = {  # name: config of one decoder layer at the true width
    "mixtral-8x7b-block": dict(family="mixtral", d=4096, inter=14336, n=8, k=2, heads=32, kv_heads=8),
    "qwen3-30b-a3b-block": dict(family="qwen3_moe", d=2048, inter=768, n=128, k=8, heads=32, kv_heads=4),
}


# ----- models -----------------------------------------------------------------------------------------------
def mixtral_model(n: int, inter: int, k: int, *, d: int = 512, layers: int = 8, heads: int = 8, kv_heads: int = 8,
                  vocab: int = 32000, dtype=torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=n,
                        num_experts_per_tok=k, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def qwen3_model(n: int, inter: int, k: int, *, d: int, heads: int, kv_heads: int, vocab: int = 256,
                dtype=torch.bfloat16, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter, moe_intermediate_size=inter,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                         num_experts=n, num_experts_per_tok=k, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def geometry(model) -> dict[str, int]:
    from moetool.adapters import find_moe_layers

    cfg = model.config
    layers = find_moe_layers(model)
    heads = cfg.num_attention_heads
    W = layers[0].expert_weights()
    return dict(d=cfg.hidden_size, inter=int(W.gate.shape[1]), n=layers[0].n_experts, k=layers[0].top_k,
                heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, vocab=cfg.vocab_size,
                layers=len(layers))


def plain_flops(g: dict[str, int], seq: int) -> float:
    """FLOPs per token of the plain forward (the module docstring's ``plain``)."""
    d, inter, n, k, H, G, h = g["d"], g["inter"], g["n"], g["k"], g["heads"], g["kv_heads"], g["head_dim"]
    s_mean = (seq + 1) / 2
    attention = 2 * d * H * h + 2 * 2 * d * G * h + 2 * H * h * d + 2 * 2 * H * h * s_mean
    return g["layers"] * (attention + 2 * n * d + k * 3 * 2 * inter * d) + 2 * d * g["vocab"]


def flop_ideals(g: dict[str, int], seq: int) -> dict[str, float]:
    """FLOP-ideal ratio of every variant (formulas in the module docstring)."""
    d, inter, n, k = g["d"], g["inter"], g["n"], g["k"]
    plain = plain_flops(g, seq)
    extra = {"norm:gate": (n - k) * 2 * inter * d, "norm:gate (recompute)": n * 2 * inter * d,
             "all_expert_outputs": n * 3 * 2 * inter * d}
    out = {v: 1.0 for v in ("plain", "capture", "router_logits", "hand_item_loop")}
    out.update({v: (plain + g["layers"] * e) / plain for v, e in extra.items()})
    return out


# ----- variants -------------------------------------------------------------------------------------------
def variants(model, batches: list[tuple[torch.Tensor, torch.Tensor]], which: list[str]) -> dict[str, Callable]:
    from moetool.adapters import find_moe_layers
    from moetool.engine import Engine, expert_outputs
    from moetool.policies import make_policy

    layers = find_moe_layers(model)

    def forward(**kw):
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False, **kw)

    def engine(**kw):
        def run():
            with Engine(model, layers, **kw):
                forward()
        return run

    def hand_item_loop():
        counts = {L.index: [0] * L.n_experts for L in layers}

        def hook_for(L):
            def hook(module, args, out):
                logits = out[0] if isinstance(out, tuple) else out
                top = logits.topk(L.top_k, dim=-1).indices
                for e in range(L.n_experts):
                    counts[L.index][e] += (top == e).sum().item()
            return hook

        handles = [L.router.register_forward_hook(hook_for(L)) for L in layers]
        try:
            forward()
        finally:
            for h in handles:
                h.remove()

    table = {
        "plain": forward,
        "capture": engine(consumers=[lambda ev: None]),
        "router_logits": lambda: forward(output_router_logits=True),
        "hand_item_loop": hand_item_loop,
        "norm:gate": engine(policy=make_policy("norm:gate")),
        "all_expert_outputs": engine(consumers=[lambda ev: expert_outputs(ev.layer, ev.h)]),
    }
    return {k: table[k] for k in which}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable], repeat: int) -> dict[str, dict[str, float]]:
    """Round-robin: every variant once per round (after one warm-up round); per round, time / plain time.
    Returns per variant the median ratio, its spread (min, max over rounds) and the median seconds."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate the order too
        for k in order:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k in names:
        ratios = [t / p for t, p in zip(times[k], times["plain"])]
        out[k] = {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                  "seconds": statistics.median(times[k])}
    return out


def random_batches(vocab: int, tokens: int, batch: int, seq: int, device: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = max(1, tokens // seq)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    return [(ids[s:s + batch].to(device), torch.ones_like(ids[s:s + batch]).to(device)) for s in range(0, rows, batch)]


def bench_shapes(a) -> list[dict[str, Any]]:
    rows = []
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = ["plain", "capture", "router_logits", "hand_item_loop", "norm:gate", "all_expert_outputs"]
    for shape in a.shapes:
        n, inter, k = SHAPES[shape]
        model = mixtral_model(n, inter, k).to(dev)
        batches = random_batches(model.config.vocab_size, a.tokens, a.batch_size, a.seq_len, dev)
        t0 = time.perf_counter()
        res = interleaved(variants(model, batches, names), a.repeat)
        ideal = flop_ideals(geometry(model), a.seq_len)
        tokens = sum(int(m.sum()) for _, m in batches)
        for v in names:
            rows.append({"section": "engine", "model": f"mixtral-d512-L8-{shape}", "variant": v, "device": str(dev),
                         "tokens": tokens, "ratio": res[v]["ratio"], "ratio_min": res[v]["ratio_min"],
                         "ratio_max": res[v]["ratio_max"], "flop_ideal": ideal[v],
                         "flop_ideal_recompute": ideal["norm:gate (recompute)"] if v == "norm:gate" else None,
                         "seconds": res[v]["seconds"]})
        print(f"  {shape}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        del model
    return rows


# ----- real widths ----------------------------------------------------------------------------------------
def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def exact_rss_mode() -> None:
    """glibc: a fixed mmap threshold (128 KiB) so every tensor buffer is mmapped and returned to the OS when
    freed; with ``malloc_trim`` before each call, the RSS peak above the RSS before is that call's own memory."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


def trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_extra(fn: Callable) -> tuple[float, int]:
    """(seconds, peak extra bytes) of one call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    trim()
    base, peak, stop = rss_bytes(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    return dt, max(peak[0], rss_bytes()) - base


def bench_real(a) -> list[dict[str, Any]]:
    rows = []
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = ["plain", "capture", "norm:gate", "all_expert_outputs"]
    for name, c in REAL.items():
        t0 = time.perf_counter()
        if c["family"] == "mixtral":
            model = mixtral_model(c["n"], c["inter"], c["k"], d=c["d"], layers=1, heads=c["heads"],
                                  kv_heads=c["kv_heads"], vocab=256, dtype=torch.bfloat16)
        else:
            model = qwen3_model(c["n"], c["inter"], c["k"], d=c["d"], heads=c["heads"], kv_heads=c["kv_heads"])
        model = model.to(dev)
        batches = random_batches(256, a.real_tokens, 1, a.real_tokens, dev)
        fns = variants(model, batches, names)
        fns["plain"]()  # warm-up
        ideal = flop_ideals(geometry(model), a.real_tokens)
        measured = {}
        for _ in range(a.real_repeat):  # interleaved rounds; keep the fastest time, the largest peak
            for v in names:
                dt, mem = peak_extra(fns[v])
                best = measured.setdefault(v, [float("inf"), 0])
                best[0], best[1] = min(best[0], dt), max(best[1], mem)
        for v in names:
            rows.append({"section": "real", "model": name, "variant": v, "device": str(dev),
                         "tokens": a.real_tokens, "ratio": measured[v][0] / measured["plain"][0],
                         "flop_ideal": ideal[v],
                         "flop_ideal_recompute": ideal["norm:gate (recompute)"] if v == "norm:gate" else None,
                         "seconds_per_1k_tokens": measured[v][0] * 1000 / a.real_tokens,
                         "peak_extra_mib": measured[v][1] / 2**20, "seconds": measured[v][0]})
        print(f"  {name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        del model, fns
    return rows


# ----- quantized probes ----------------------------------------------------------------------------------
def fp8_experts_copy(model, expert_dtype: str, scale_fmt: str):
    """A copy of ``model`` whose experts are transformers' FP8Experts holding its weights quantized by
    moetool.formats (128x128 FP8 blocks, or FP4 packed in 1x32 groups)."""
    import copy

    from torch import nn
    from transformers.integrations import finegrained_fp8 as tf_fp8
    from transformers.integrations.moe import use_experts_implementation

    from moetool import formats
    from moetool.adapters import find_moe_layers

    qm = copy.deepcopy(model)
    cls = use_experts_implementation(experts_class=tf_fp8.FP8Experts, experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    for L in find_moe_layers(qm):
        new = cls(config=qm.config, block_size=(128, 128), scale_fmt=scale_fmt, expert_dtype=expert_dtype)
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(L.experts, name).detach()
            q, sc = formats.quantize_fp8(w, scale_fmt=scale_fmt) if expert_dtype == "fp8" else \
                formats.quantize_fp4(w, scale_fmt)
            setattr(new, name, nn.Parameter(q, requires_grad=False))
            setattr(new, f"{name}_scale_inv", nn.Parameter(sc, requires_grad=False))
        L.block.experts = new.to(w.device)
    return qm


def bench_quant(a, device: Any = None) -> list[dict[str, Any]]:
    from moetool.adapters import find_moe_layers
    from moetool.engine import probes

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = mixtral_model(8, a.quant_inter, 2, d=a.quant_d, layers=1, vocab=256, dtype=dtype).to(dev)
    formats_ = {"plain": model, "fp8 (fp32 scales)": fp8_experts_copy(model, "fp8", "float"),
                "fp8 (UE8M0 scales)": fp8_experts_copy(model, "fp8", "ue8m0"),
                "fp4 (packed, 1x32)": fp8_experts_copy(model, "fp4", "float")}
    layer = {k: find_moe_layers(m)[0] for k, m in formats_.items()}
    rows = []
    for tokens in a.quant_tokens:  # the dequantization is per call: its share falls as a call's tokens grow
        h = torch.randn(tokens, a.quant_d, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
        for probe, fn in (("node_scores(gate)", lambda L: probes.node_scores(L, h, "gate")),
                          ("expert_outputs", lambda L: probes.expert_outputs(L, h))):
            calls = repeats_for(lambda: fn(layer["plain"]), QUANT_UNIT_S)  # one call can be well under a millisecond
            res = interleaved({k: (lambda L=L: [fn(L) for _ in range(calls)]) for k, L in layer.items()}, a.repeat)
            for k in layer:
                rows.append({"section": "quant", "model": f"mixtral-d{a.quant_d}-8x{a.quant_inter}", "variant": k,
                             "probe": probe, "device": str(dev), "tokens": tokens, "ratio": res[k]["ratio"],
                             "ratio_min": res[k]["ratio_min"], "ratio_max": res[k]["ratio_max"],
                             "seconds": res[k]["seconds"] / calls, "calls_per_round": calls})
    return rows


#: the least time one timed unit of ``--quant`` lasts (calls repeated): single sub-millisecond calls on a GPU
#: spread 0.7-2.5x round to round
QUANT_UNIT_S = 0.02


def repeats_for(fn: Callable, unit_s: float) -> int:
    """How many calls of ``fn`` (warmed up first) make one timed unit of at least ``unit_s`` seconds."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return max(1, math.ceil(unit_s / max(time.perf_counter() - t0, 1e-6)))


# ----- RSS per command ------------------------------------------------------------------------------------
COMMANDS = {  # command -> its arguments (data and tokens appended)
    "stats": ["stats", "--model", "tiny"],
    "ppl": ["ppl", "--model", "tiny", "--routing", "norm:gate"],
    "norm-select": ["norm-select", "--model", "tiny"],
    "approx": ["approx", "--model", "tiny"],
    "mass-recall": ["mass-recall", "--model", "tiny"],
    "fluctuation": ["fluctuation", "tiny-early", "tiny"],
    "trace": ["trace", "--model", "tiny"],
}


#: ``python -S -c RUNNER CMD...``: runs CMD (stdout to /dev/null) in a child of a fresh, small process and prints its
#: peak RSS (KiB) and exit code. A command started straight from this process (subprocess: vfork, then exec) keeps
#: this process's peak RSS as its own ``ru_maxrss`` (Linux carries the old memory's high-water mark over exec), so
#: the figure read max(this process's peak, the command's): after ``--real``'s 3 GB every command "peaked" at 4178 MiB
_PEAK_RSS_RUNNER = """import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as e:
        print(e, file=sys.stderr)
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def child_peak_rss(cmd: list[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(peak RSS bytes, seconds, exit code) of a subprocess (its own peak: see ``_PEAK_RSS_RUNNER``)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-S", "-c", _PEAK_RSS_RUNNER, *cmd], capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    maxrss_kib, code = map(int, p.stdout.split())
    err = p.stderr.strip().splitlines()
    if code:
        print(f"  {' '.join(cmd[2:4])}: exit {code}: {err[-1] if err else ''}", file=sys.stderr)
    return maxrss_kib * 1024, dt, code


def bench_rss(a) -> list[dict[str, Any]]:
    from moetool.data import default_data_path

    rows = []
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="moetool-bench-") as tmp:
        held = default_data_path().read_text(encoding="utf-8")
        corpus = Path(tmp) / "corpus.jsonl"
        copies = max(5, -(-max(a.rss_tokens, default=0) * 5 // 300_000))  # 5 copies: ~330k tokens
        corpus.write_text(held * copies, encoding="utf-8")
        for name, args in COMMANDS.items():
            if a.commands and name not in a.commands:
                continue
            for tokens in a.rss_tokens:
                out = Path(tmp) / f"{name}-{tokens}"
                cmd = [sys.executable, "-m", "moetool", *args, "--data", str(corpus), "--max-tokens", str(tokens),
                       "--out", str(out)]
                rss, dt, code = child_peak_rss(cmd, env)
                rows.append({"section": "rss", "model": "tiny", "variant": name, "device": "cpu", "tokens": tokens,
                             "peak_rss_mib": rss / 2**20 if code == 0 else None, "seconds": dt, "exit": code})
                print(f"  {name} {tokens}: {rss / 2**20:.0f} MiB, {dt:.1f}s", file=sys.stderr)
    return rows


# ----- lazy --data ------------------------------------------------------------------------------------------
def bench_lazy_data(a) -> list[dict[str, Any]]:
    """``load_tokens`` with ``--max-tokens`` on a large generated corpus: seconds and bytes read, next to the
    time merely reading the whole file takes (the eager path also tokenized all of it)."""
    from moetool import data as D
    from moetool.loading import load

    tok = load("tiny").tokenizer
    held = D.default_data_path().read_bytes()
    rows = []
    with tempfile.TemporaryDirectory(prefix="moetool-bench-") as tmp:
        p = Path(tmp) / "big.jsonl"
        with open(p, "wb") as f:
            for _ in range(max(1, a.lazy_mb * 2**20 // len(held))):
                f.write(held)
        size = p.stat().st_size
        t0 = time.perf_counter()
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
        t_read = time.perf_counter() - t0
        one = Path(tmp) / "one.jsonl"  # eager path (read all, tokenize all) on one copy, scaled to the file
        one.write_bytes(held)
        t0 = time.perf_counter()
        D.pack(D.read_documents(one), tok, 256, None)
        eager = (time.perf_counter() - t0) * size / len(held)
        for cap in (20000, 200000):
            stream = D.DocumentStream(p)
            t0 = time.perf_counter()
            ts = D.pack(stream, tok, 256, cap, source=str(p))
            dt = time.perf_counter() - t0
            rows.append({"section": "lazy_data", "model": "tiny", "variant": f"load_tokens {size / 2**20:.0f} MB",
                         "device": "cpu", "tokens": ts.n_tokens, "seconds": dt,
                         "mib_read": stream.bytes_read / 2**20, "read_whole_file_seconds": t_read,
                         "eager_seconds_estimate": eager})
            print(f"  lazy data {cap}: {dt:.2f}s, {stream.bytes_read / 2**20:.0f} of {size / 2**20:.0f} MiB read "
                  f"(reading the whole file: {t_read:.2f}s; tokenizing all of it: ~{eager:.0f}s)", file=sys.stderr)
    return rows


#: (experts, top-K, tokens) of --cache-sim: Mixtral's routing width at 64k tokens, Qwen3-30B-A3B's and OLMoE's
CACHE_SIM_SHAPES = ((8, 2, 65536), (128, 8, 8192), (128, 8, 65536), (64, 8, 16384))


def routing_trace(n: int, k: int, tokens: int, seed: int = 0):
    """A skewed random routing trace ``[tokens, k]``: each token's top-k of uniform noise plus a fixed per-expert
    popularity (Dirichlet), so some experts are hot, as in real routing."""
    import numpy as np

    rng = np.random.default_rng(seed)
    s = rng.random((tokens, n)) + 0.3 * np.log(rng.dirichlet(np.ones(n)) + 1e-9)[None]
    return np.ascontiguousarray(np.argsort(-s, axis=1)[:, :k])  # contiguous, as a recorded trace is


def offload_compute_at(rev: str) -> Any:
    """``moetool.experiments.offload.compute`` as of git revision ``rev``: a module beside the installed one."""
    import importlib.util

    src = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "show",
                          f"{rev}:moetool/experiments/offload/compute.py"], check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp()) / "compute_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("moetool.experiments.offload._compute_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_cache_sim(a) -> list[dict[str, Any]]:
    """``offload``'s cache simulation alone, one MoE layer: every default capacity x lru, lfu, belady
    (``simulate_all``) on a skewed random trace; seconds (best of ``--repeat``) and microseconds per token. With
    ``--cache-sim-base REV`` also revision REV's simulation, interleaved (its hits asserted identical)."""
    import numpy as np

    from moetool.experiments.offload.compute import POLICIES, default_capacities, simulate_all

    base = offload_compute_at(a.cache_sim_base) if a.cache_sim_base else None
    rows = []
    for n, k, T in CACHE_SIM_SHAPES:
        trace = routing_trace(n, k, T)
        caps = default_capacities(n, k)
        times, base_times = [], []
        for _ in range(max(1, a.repeat)):
            if base is not None:
                t0 = time.perf_counter()
                want = base.simulate_all(trace, caps, POLICIES)
                base_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = simulate_all(trace, caps, POLICIES)
            times.append(time.perf_counter() - t0)
            if base is not None and not all(np.array_equal(got[c], want[c]) for c in want):
                raise SystemExit(f"cache sim {n}x top-{k}: hits differ from {a.cache_sim_base}'s")
        dt = min(times)
        rows.append({"section": "cache_sim", "model": f"{n} experts top-{k}", "variant": "simulate_all",
                     "device": "cpu", "tokens": T, "seconds": dt, "us_per_token": dt / T * 1e6,
                     "capacities": " ".join(map(str, caps)),
                     **({"base_seconds": min(base_times), "speedup": min(base_times) / dt} if base else {})})
        print(f"  cache sim {n}x top-{k}, {T} tokens: {dt:.3f}s"
              + (f" ({a.cache_sim_base}: {min(base_times):.3f}s)" if base else ""), file=sys.stderr)
    return rows


class _LogitsStandIn(torch.nn.Module):
    """An LM head's stand-in for ``--host-work``: logits of the right shape, a different value per token in column 0
    (what the argmax stand-in reads), without the ``[tokens, d] x [d, vocab]`` GEMM or its memory (a broadcast
    view)."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.vocab = vocab
        self.weight = torch.nn.Parameter(torch.zeros(vocab, d))  # what get_output_embeddings() reports

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :1].expand(*x.shape[:-1], self.vocab)


def _extra_over_bare(lm: Any, tokens: Any, rows: int, commands: list[str], repeat: int,
                     section: str, label: str) -> list[dict[str, Any]]:
    """Each of ``commands`` (the API with its defaults but ``batch_size``) between two bare ``moetool.forward``
    calls, interleaved over ``repeat`` rounds after one untimed call each: its extra = its time - their mean."""
    import moetool

    bare = lambda: moetool.forward(lm, tokens, batch_size=rows, quiet=True)  # noqa: E731
    calls = {name: (lambda f=getattr(moetool, name): f(lm, tokens, batch_size=rows, quiet=True)) for name in commands}
    bare()
    for fn in calls.values():  # first-use costs (imports, caches) are no forward's
        fn()
    extra: dict[str, list[float]] = {name: [] for name in calls}
    bares: list[float] = []
    for _ in range(max(1, repeat)):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            bare()
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            bare()
            t3 = time.perf_counter()
            extra[name].append((t2 - t1) - ((t1 - t0) + (t3 - t2)) / 2)
            bares += [t1 - t0, t3 - t2]
    out = []
    for name, xs in extra.items():
        m = statistics.median(xs)
        out.append({"section": section, "model": label, "variant": name, "device": str(lm.device),
                    "tokens": tokens.n_tokens, "bare_seconds": statistics.median(bares), "extra_ms": m * 1e3,
                    "extra_min_ms": min(xs) * 1e3, "extra_max_ms": max(xs) * 1e3,
                    "us_per_token": m / tokens.n_tokens * 1e6})
        print(f"  {section} {name}: {m * 1e3:.0f} ms over the bare forward", file=sys.stderr)
    return out


def bench_host_work(a) -> list[dict[str, Any]]:
    """``--host-work``: each command's extra over the bare forward, host work only (see the module's docstring)."""
    from moetool import ops
    from moetool.adapters import find_moe_layers
    from moetool.loading import LoadedModel

    from bench_gpu import COMMANDS_SHAPE, build, random_tokenset

    torch.set_num_threads(1)
    c = {**COMMANDS_SHAPE, "d": 64, "inter": 128, "heads": 2, "kv_heads": 1, "head_dim": 32}
    model = build(c, torch.device("cpu"), torch.float32)
    model.lm_head = _LogitsStandIn(c["vocab"], c["d"])
    lm = LoadedModel("host-work", "random weights", "random", model, None, find_moe_layers(model),
                     torch.device("cpu"), torch.float32)
    tokens = random_tokenset(c["vocab"], a.host_tokens, 2048)
    label = (f"mixtral layout d{c['d']} I{c['inter']} {c['layers']} layers, vocabulary {c['vocab']}, LM head and "
             "argmax stood in, 1 thread")
    argmax = ops.argmax
    ops.argmax = lambda x: (x[..., 0].abs() * 1e6).long() % x.shape[-1]  # the specialisation's predicted view
    try:
        return _extra_over_bare(lm, tokens, a.host_rows, a.host_commands, a.repeat, "host_work", label)
    finally:
        ops.argmax = argmax


def bench_wide_work(a) -> list[dict[str, Any]]:
    """``--wide-work``: each command's extra over the bare forward on one MoE layer of Mixtral-8x7B's width d=4096
    with narrow experts (I=32), 2 heads, vocabulary 512: the forward costs little, and a command's own work over
    ``[tokens, d]`` (margin's noisy router inputs) weighs as the memory traffic it is on a GPU (see the docstring)."""
    from moetool.adapters import find_moe_layers
    from moetool.loading import LoadedModel

    from bench_gpu import COMMANDS_SHAPE, build, random_tokenset

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.wide_dtype == "bf16" else torch.float32
    c = {**COMMANDS_SHAPE, "d": 4096, "inter": 32, "heads": 2, "kv_heads": 1, "head_dim": 32, "layers": 1,
         "vocab": 512}
    model = build(c, torch.device("cpu"), dtype)
    lm = LoadedModel("wide-work", "random weights", "random", model, None, find_moe_layers(model),
                     torch.device("cpu"), dtype)
    tokens = random_tokenset(c["vocab"], a.wide_tokens, 1024)
    label = f"one MoE layer d{c['d']} I{c['inter']}, vocabulary {c['vocab']}, {a.wide_dtype}, 1 thread"
    return _extra_over_bare(lm, tokens, 4, a.wide_commands, a.repeat, "wide_work", label)


def bench_load(a) -> list[dict[str, Any]]:
    """Load speed of a local safetensors checkpoint (a random Mixtral-shaped model of about ``--load-mb`` MB, fp32,
    saved once to a temporary folder): ``moetool.load`` against transformers' own ``from_pretrained`` of the same
    folder (same dtype, device), interleaved, best of ``--repeat``; GB/s = the safetensors bytes / seconds."""
    import gc

    import moetool
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moetool.loading import auto_model_class  # noqa: F401 - imported before timing

    layers = max(1, int(a.load_mb * 2**20 / 4 / (8 * 3 * 512 * 1536 + 4 * 512 * 512)))
    cfg = MixtralConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory(prefix="moetool-bench-load-") as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        nbytes = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        calls = {"transformers from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(
                     tmp, dtype=torch.float32, **({"device_map": {"": dev}} if dev == "cuda" else {})),
                 "moetool.load": lambda: moetool.load(tmp, dtype="fp32", device=dev, tokenizer=False)}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(max(1, a.repeat)):
            for name, fn in calls.items():
                gc.collect()
                sync()
                t0 = time.perf_counter()
                m = fn()
                sync()
                times[name].append(time.perf_counter() - t0)
                del m
        for name, ts in times.items():
            dt = min(ts)
            rows.append({"section": "load", "model": f"mixtral-shaped {layers} layers, {nbytes / 1e9:.2f} GB fp32",
                         "variant": name, "device": dev, "seconds": dt, "gb_per_s": nbytes / 1e9 / dt,
                         "bytes": nbytes})
            print(f"  load {name}: {dt:.2f}s, {nbytes / 1e9 / dt:.2f} GB/s", file=sys.stderr)
    return rows


#: counts: a section's rows beside another's that lack the column hold NaN there, which makes the column float
#: (512 tokens read "512.0", 20000 "20000.00")
COUNT_COLUMNS = ("tokens", "rounds", "calls_per_round")


def int_counts(df):
    """``df`` with its count columns as nullable integers (printed and written as integers)."""
    return df.astype({c: "Int64" for c in COUNT_COLUMNS if c in df.columns})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per timed pass (engine ratios)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds after the warm-up")
    ap.add_argument("--real", action="store_true", help="one decoder layer at Mixtral-8x7B / Qwen3-30B-A3B width")
    ap.add_argument("--real-tokens", type=int, default=512)
    ap.add_argument("--real-repeat", type=int, default=2)
    ap.add_argument("--rss", action="store_true", help="peak RSS of every command at --rss-tokens")
    ap.add_argument("--rss-tokens", type=int, nargs="*", default=[20000, 200000])
    ap.add_argument("--commands", nargs="*", default=None, help="restrict --rss to these commands")
    ap.add_argument("--lazy-data", action="store_true", help="load_tokens on a large generated corpus")
    ap.add_argument("--lazy-mb", type=int, default=200)
    ap.add_argument("--quant", action="store_true", help="quantized-expert probes against the plain probe")
    ap.add_argument("--quant-d", type=int, default=1024)
    ap.add_argument("--quant-inter", type=int, default=2048)
    ap.add_argument("--quant-tokens", type=int, nargs="+", default=[1024],
                    help="tokens per probe call, one or more counts (--gpu on CUDA: 1024 and a batch's 16384)")
    ap.add_argument("--host-work", action="store_true", help="each command's host work over the bare forward (CPU)")
    ap.add_argument("--host-tokens", type=int, default=65536)
    ap.add_argument("--host-rows", type=int, default=2, help="--host-work: rows of 2,048 tokens per forward")
    ap.add_argument("--host-commands", nargs="*", default=["stats", "placement"])
    ap.add_argument("--wide-work", action="store_true",
                    help="each command's own work over [tokens, d] at d=4096 (one layer, narrow experts; CPU)")
    ap.add_argument("--wide-tokens", type=int, default=4096)
    ap.add_argument("--wide-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--wide-commands", nargs="*", default=["margin", "stats", "ppl"])
    ap.add_argument("--cache-sim", action="store_true", help="offload's cache simulation alone, one layer")
    ap.add_argument("--cache-sim-base", default=None, metavar="REV",
                    help="--cache-sim: also git revision REV's simulation, interleaved (same hits asserted)")
    ap.add_argument("--load", action="store_true", help="moetool.load vs from_pretrained of a local checkpoint")
    ap.add_argument("--load-mb", type=int, default=512, help="--load: checkpoint size (MB, fp32)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--gpu", action="store_true", help="issue #36's figures: real-width shapes, quantized probes, "
                    "command ratios, the CLI on a local checkpoint (bench/bench_gpu.py); scaled down without CUDA")
    ap.add_argument("--quick", action="store_true", help="--gpu with fewer tokens and rounds")
    ap.add_argument("--gpu-cpu", action="store_true", help="--gpu's scaled-down run even where CUDA is available")
    ap.add_argument("--gpu-sections", nargs="*", default=["shapes", "quant", "commands", "cli"],
                    choices=["shapes", "quant", "commands", "cli"])
    ap.add_argument("--gpu-tokens", type=int, default=16384, help="--gpu shapes: tokens per timed pass")
    ap.add_argument("--gpu-seq", type=int, default=2048, help="--gpu: tokens per row")
    ap.add_argument("--gpu-batch", type=int, default=4, help="--gpu shapes: rows per forward")
    ap.add_argument("--gpu-repeat", type=int, default=5, help="--gpu shapes: interleaved rounds")
    ap.add_argument("--gpu-command-tokens", type=int, default=65536, help="--gpu commands: tokens")
    ap.add_argument("--gpu-command-batch-tokens", type=int, default=16384, help="--gpu commands: tokens per forward")
    ap.add_argument("--gpu-commands", nargs="*", default=None, help="--gpu: restrict to these commands")
    ap.add_argument("--gpu-command-rounds", type=int, default=1, help="--gpu commands: rounds (median ratio printed)")
    ap.add_argument("--csv", default="bench.csv")
    a = ap.parse_args()
    if a.gpu:
        return main_gpu(a)

    import pandas as pd

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.real:
        exact_rss_mode()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {dev}, torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    sections = [(bool(a.shapes), bench_shapes), (a.real, bench_real), (a.rss, bench_rss),
                (a.lazy_data, bench_lazy_data), (a.quant, bench_quant), (a.cache_sim, bench_cache_sim),
                (a.load, bench_load), (a.host_work, bench_host_work), (a.wide_work, bench_wide_work)]
    for wanted, section in sections:
        if wanted:
            rows += section(a)
            pd.DataFrame(rows).to_csv(a.csv, index=False)  # saved after every section: a late failure loses nothing
    df = int_counts(pd.DataFrame(rows))
    fmt = {"float_format": lambda x: f"{x:.2f}", "index": False}
    eng = df[df.section == "engine"] if len(df) else df
    if len(eng):
        print(f"\nEngine: ratio to the plain forward (median of {a.repeat} interleaved rounds; min-max), "
              f"device {dev}")
        for model, part in eng.groupby("model", sort=False):
            t = part.assign(spread=part.ratio_min.map("{:.2f}".format) + "-" + part.ratio_max.map("{:.2f}".format))
            print(f"{model} ({part.tokens.iloc[0]} tokens per pass, plain {part.seconds.iloc[0]:.2f}s)")
            print(t[["variant", "ratio", "spread", "flop_ideal"]].to_string(**fmt))
        print("norm:gate FLOP-ideal if the chosen experts' gate were recomputed: " + ", ".join(
            f"{r.model} {r.flop_ideal_recompute:.2f}" for r in eng[eng.variant == "norm:gate"].itertuples()))
    real = df[df.section == "real"] if len(df) else df
    if len(real):
        print(f"\nReal widths, one decoder layer, bf16, {a.real_tokens} tokens, device {dev}")
        print(real[["model", "variant", "ratio", "flop_ideal", "seconds_per_1k_tokens", "peak_extra_mib"]]
              .to_string(**fmt))
    rss = df[df.section == "rss"] if len(df) else df
    if len(rss):
        print("\nPeak RSS per command (MiB), embedded model tiny")
        print(rss.pivot(index="variant", columns="tokens", values="peak_rss_mib").to_string(float_format=lambda x: f"{x:.0f}"))
    lazy = df[df.section == "lazy_data"] if len(df) else df
    if len(lazy):
        print("\nLazy --data (tokens asked of a large corpus)")
        print(lazy[["variant", "tokens", "seconds", "mib_read", "read_whole_file_seconds", "eager_seconds_estimate"]]
              .to_string(**fmt))
    quant = df[df.section == "quant"] if len(df) else df
    if len(quant):
        print(f"\nQuantized expert probes: time / plain probe time on the same tokens per call (median of {a.repeat} "
              f"rounds; min-max), {quant.model.iloc[0]}, device {dev}")
        t = quant.assign(spread=quant.ratio_min.map("{:.2f}".format) + "-" + quant.ratio_max.map("{:.2f}".format))
        print(t[["tokens", "probe", "variant", "ratio", "spread", "seconds"]].to_string(**fmt))
    load = df[df.section == "load"] if len(df) else df
    if len(load):
        print(f"\nLoading a local safetensors checkpoint (best of {a.repeat}; page cache warm), device {dev}")
        print(load[["model", "variant", "seconds", "gb_per_s"]].to_string(**fmt))
    for section, what in (("host_work", "Host work"), ("wide_work", "Work at d=4096")):
        host = df[df.section == section] if len(df) else df
        if len(host):
            print(f"\n{what} over the bare forward ({host.model.iloc[0]}; {int(host.tokens.iloc[0])} tokens, bare "
                  f"forward {host.bare_seconds.iloc[0]:.2f}s; median of {a.repeat} rounds, min-max)")
            print(host[["variant", "extra_ms", "extra_min_ms", "extra_max_ms", "us_per_token"]].to_string(**fmt))
    sim = df[df.section == "cache_sim"] if len(df) else df
    if len(sim):
        print(f"\noffload's cache simulation, one layer, every default capacity x lru/lfu/belady (best of "
              f"{a.repeat}; host CPU)")
        print(sim[["model", "tokens", "capacities", "seconds", "us_per_token"]
                  + (["base_seconds", "speedup"] if "speedup" in sim else [])].to_string(**fmt))
    df.to_csv(a.csv, index=False)
    print(f"\nwrote {a.csv}")


def main_gpu(a) -> None:
    """``--gpu``: the sections of bench_gpu.run, the CSV saved after each, the printout also in <csv>.txt."""
    import pandas as pd

    import bench_gpu

    if a.threads:
        torch.set_num_threads(a.threads)
    if not torch.cuda.is_available() or a.gpu_cpu:
        exact_rss_mode()  # CPU peaks are RSS peaks
    Path(a.csv).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for part in bench_gpu.run(a):
        rows += part
        pd.DataFrame(rows).to_csv(a.csv, index=False)
    df = pd.DataFrame(rows)
    text = bench_gpu.report(df, a) + f"\n\ntotal {time.perf_counter() - t0:.0f}s; wrote {a.csv}"
    print(text)
    Path(a.csv).with_suffix(".txt").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
