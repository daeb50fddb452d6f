"""``python bench/bench.py --gpu``: every figure of the performance issue (#36) in one run, on any CUDA machine.

    python bench/bench.py --gpu                    # ~3-5 min on one H100: shapes, quantized probes, commands, CLI
    python bench/bench.py --gpu --quick            # fewer tokens and rounds (~1.5 min on an H100)
    python bench/bench.py --gpu --csv gpu.csv      # the figures as CSV (default bench.csv) + gpu.txt (the printout)

Sections (random weights built directly on the device, bf16 on CUDA, nothing downloaded):

1. **Real-width shapes**: Mixtral-8x7B (4 of its 32 layers), Qwen3-30B-A3B (8 of 48), OLMoE-1B-7B (all 16) at their
   published widths and vocabularies; ``--gpu-tokens`` tokens (default 16,384) in rows of ``--gpu-seq`` (2,048),
   ``--gpu-batch`` rows per forward. Variants interleaved as in ``--shapes`` (plain, capture, router_logits,
   hand_item_loop, norm:gate, all_expert_outputs): ratio to the plain forward (median of rounds), its FLOP-ideal,
   the plain forward's tokens/s and share of the bf16 peak, and for the probes the **achieved throughput of the
   probe's extra work**: the FLOPs the probe runs (norm:gate: every expert's gate, ``layers·n·2·I·d`` per token;
   all-expert outputs: ``layers·n·6·I·d``) over its extra time per token (variant time − plain time), as a share of
   the nominal dense bf16 peak (known cards), of a measured 8192³ bf16 matmul on the same card, and of the probe's
   own products run bare at its token chunk (``pct_shape_gemm``, :func:`shape_gemm_flops`: what the shape allows).
2. **Quantized probes**: ``bench.py --quant`` (one d=1024 layer, 8 experts of width 2048, 1,024 tokens per call and
   a batch's 16,384): FP8 (fp32 / UE8M0 scales) and FP4 probes as a ratio of the bf16 probe.
3. **Commands against one bare ``moetool.forward``** over the same tokens (Mixtral-8x7B width, 2 layers, one
   loaded model, the API with each command's defaults but ``batch_size``): ppl, stats, placement, margin (and
   ``margin_policies``: with ``--policies norm:gate,random``, its default before 2026-11-28), expert-similarity,
   approx, offload, topk; time ratio (each command between two bare forwards, ratio to their
   mean; every command once untimed first -- imports and other first-use costs are no forward's; then
   ``--gpu-command-rounds`` rounds, the median printed) and peak memory (CUDA: max allocated; CPU: peak RSS
   above the RSS before), next to the model's bytes and the bare forward's peak. ``--gpu-command-tokens`` (default
   65,536; ``--quick`` 32,768). ``--gpu-sections commands --gpu-commands offload topk``: only those.
4. **The CLI on a local checkpoint**: the commands' model saved as safetensors to a temporary folder (about 6 GB at
   Mixtral width in bf16; the shipped tokenizer beside it), each command in a fresh process as a user runs it:
   ``inspect --model DIR`` and ``plan --model DIR`` the first time (an empty moetool cache: the model built on the
   meta device) and again (answered from the cache), ``ppl --model DIR`` (``--max-tokens 32768``, rows of
   ``--gpu-seq``): its wall time against its forwards' (ppl.csv's ``seconds``); and the load speed in one
   process, best of 2: ``moetool.load`` and transformers' ``from_pretrained`` onto the device, GB/s of
   safetensors read (the files were just written: the page cache is warm, the figure is the load path's, not the
   disk's).

On a machine without CUDA the same command runs **scaled-down** shapes (widths / 16, 2 layers, small vocabulary,
fp32, about a thousand tokens) and says so in every table: those figures describe the code paths, not the hardware.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

import bench as B

#: the published widths (config.json of each checkpoint); ``layers`` = how many of them are built
GPU_SHAPES = {
    "Mixtral-8x7B (4 of 32 layers)": dict(family="mixtral", d=4096, inter=14336, n=8, k=2, heads=32, kv_heads=8,
                                          head_dim=128, layers=4, vocab=32000),
    "Qwen3-30B-A3B (8 of 48 layers)": dict(family="qwen3_moe", d=2048, inter=768, n=128, k=8, heads=32, kv_heads=4,
                                           head_dim=128, layers=8, vocab=151936),
    "OLMoE-1B-7B (all 16 layers)": dict(family="olmoe", d=2048, inter=1024, n=64, k=8, heads=16, kv_heads=16,
                                        head_dim=128, layers=16, vocab=50304),
}
COMMANDS_SHAPE = dict(family="mixtral", d=4096, inter=14336, n=8, k=2, heads=32, kv_heads=8, head_dim=128, layers=2,
                      vocab=32000)
COMMANDS = ("ppl", "stats", "placement", "margin", "margin_policies", "expert_similarity", "approx", "offload", "topk")
#: a row that is not a command's defaults: (the API function, its keywords); margin_policies is margin with the
#: policy comparison its default had until 2026-11-28 (norm:gate computes every expert's gate)
VARIANTS = {"margin_policies": ("margin", {"policies": ("norm:gate", "random")})}

#: nominal dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device-name fragment, first match wins
NOMINAL_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0),
                       ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0),
                       ("L4", 121.0))


def scaled(c: dict[str, Any]) -> dict[str, Any]:
    """The CPU stand-in of a shape: widths / 16 (heads / 4, head width 32), at most 2 layers, vocabulary 2,048."""
    return {**c, "d": max(64, c["d"] // 16), "inter": max(32, c["inter"] // 16), "heads": max(2, c["heads"] // 4),
            "kv_heads": max(1, min(c["kv_heads"], c["heads"] // 4)), "head_dim": 32, "layers": min(2, c["layers"]),
            "vocab": 2048}


def build(c: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random model of shape ``c``, its weights created on ``device`` (no host copy of a multi-GB model)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=c["vocab"], hidden_size=c["d"], intermediate_size=c["inter"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                  num_experts_per_tok=c["k"], max_position_embeddings=8192)
    if c["family"] == "mixtral":
        cfg = MixtralConfig(num_local_experts=c["n"], head_dim=c["head_dim"], **common)
    elif c["family"] == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=c["n"], moe_intermediate_size=c["inter"], head_dim=c["head_dim"],
                             decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
    else:
        cfg = OlmoeConfig(num_experts=c["n"], eos_token_id=min(50279, c["vocab"] - 1), **common)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.to(device).eval()


def environment(dev: torch.device) -> dict[str, str]:
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": "cpu (" + (platform.processor() or platform.machine()) + f", {torch.get_num_threads()} threads)"}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "?"
    return env


def nominal_peak(dev: torch.device) -> float | None:
    """The card's nominal dense bf16 FLOP/s, or None (CPU, an unknown card)."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((t * 1e12 for frag, t in NOMINAL_BF16_TFLOPS if frag in name), None)


def matmul_flops(dev: torch.device, dtype: torch.dtype) -> float:
    """Measured FLOP/s of one square matmul (8192³ bf16 on CUDA, 1024³ in ``dtype`` on CPU): the attainable peak."""
    m = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(m, m, device=dev, dtype=dtype)
    b = torch.randn(m, m, device=dev, dtype=dtype)
    reps = 20 if dev.type == "cuda" else 3
    a @ b
    B.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    B.sync()
    return 2 * m ** 3 * reps / (time.perf_counter() - t0)


def probe_flops(g: dict[str, int]) -> dict[str, float]:
    """FLOPs per token the probe itself runs (every expert, whatever the forward computes)."""
    per = g["layers"] * g["n"] * g["inter"] * g["d"]
    return {"norm:gate": 2.0 * per, "all_expert_outputs": 6.0 * per}


def shape_gemm_flops(g: dict[str, int], dev: torch.device, dtype: torch.dtype, per_call: int) -> dict[str, float]:
    """Measured FLOP/s of each probe's own products, run as bare torch calls on random tensors of the probe's
    shapes at the token chunk the probe uses (the device's budget, :func:`moetool.engine.probes._chunk_size`, at
    most the ``per_call`` tokens of one forward):
    norm:gate = every expert's gate, ``[T, d] x [n, d, I]`` (gate is half of the fused ``gate_up_proj``: a
    batched product over its strided rows); all-expert outputs = gate and up of every expert in one
    ``[T, d] x [d, n·2I]`` GEMM (CUDA; one batched matmul on the CPU, as the probe runs them), then the down
    projection ``[n, T, I] x [n, I, d]``. What the shape itself allows on this device, whatever moetool adds:
    ``pct_shape_gemm`` = the probe's achieved FLOP/s over this."""
    from moetool.engine.probes import auto_budget

    d, inter, n = g["d"], g["inter"], g["n"]
    T = max(1, auto_budget(dev) // (3 * n * inter))
    T = min(T, per_call)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, d, device=dev, dtype=dtype, generator=gen)
    gate_up = torch.randn(n, 2 * inter, d, device=dev, dtype=dtype, generator=gen) / d ** 0.5
    down = torch.randn(n, d, inter, device=dev, dtype=dtype, generator=gen) / inter ** 0.5
    gate = gate_up[:, :inter]  # a strided view, as the probe reads it

    def norm_gate():
        return torch.matmul(x.unsqueeze(0), gate.transpose(-1, -2))

    def outputs():
        if dev.type == "cuda":
            y = (x @ gate_up.reshape(n * 2 * inter, d).T).view(T, n, 2 * inter).transpose(0, 1)
        else:
            y = torch.matmul(x.unsqueeze(0), gate_up.transpose(-1, -2))
        glu = torch.nn.functional.silu(y[..., :inter]) * y[..., inter:]
        return torch.matmul(glu, down.transpose(-1, -2))

    out = {}
    for name, fn, flops in (("norm:gate", norm_gate, 2.0 * n * inter * d * T),
                            ("all_expert_outputs", outputs, 6.0 * n * inter * d * T)):
        fn()
        B.sync()
        reps, t0 = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < 0.5:
            fn()
            B.sync()
            reps += 1
        out[name] = flops * reps / (time.perf_counter() - t0)
    return out


def bench_gpu_shapes(a, dev: torch.device, full: bool, peak: float | None, mm: float) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if full else torch.float32
    names = ["plain", "capture", "router_logits", "hand_item_loop", "norm:gate", "all_expert_outputs"]
    rows = []
    for label, c0 in GPU_SHAPES.items():
        c = c0 if full else scaled(c0)
        t0 = time.perf_counter()
        model = build(c, dev, dtype)
        t_build = time.perf_counter() - t0
        batches = B.random_batches(c["vocab"], a.gpu_tokens, a.gpu_batch, a.gpu_seq, dev)
        tokens = sum(int(m.sum()) for _, m in batches)
        res = B.interleaved(B.variants(model, batches, names), a.gpu_repeat)
        g = B.geometry(model)
        g["head_dim"] = c["head_dim"]
        ideal = B.flop_ideals(g, a.gpu_seq)
        fp = B.plain_flops(g, a.gpu_seq)
        pf = probe_flops(g)
        own = shape_gemm_flops(g, dev, dtype, a.gpu_batch * a.gpu_seq)
        plain_s = res["plain"]["seconds"]
        model_name = label if full else f"{label} scaled down"
        for v in names:
            row = {"section": "gpu_shapes", "model": model_name, "variant": v, "device": str(dev), "tokens": tokens,
                   "ratio": res[v]["ratio"], "ratio_min": res[v]["ratio_min"], "ratio_max": res[v]["ratio_max"],
                   "flop_ideal": ideal[v], "seconds": res[v]["seconds"], "tokens_per_s": tokens / res[v]["seconds"],
                   "ratio_to_ideal": res[v]["ratio"] / ideal[v]}
            if v == "plain":
                row["tflops"] = fp * tokens / plain_s / 1e12
            if v in pf:
                extra = (res[v]["ratio"] - 1.0) * plain_s  # the probe's extra time (median ratio x plain time)
                row["tflops"] = pf[v] * tokens / extra / 1e12 if extra > 0 else float("nan")
            if "tflops" in row:
                row["pct_nominal_peak"] = 100 * row["tflops"] * 1e12 / peak if peak else float("nan")
                row["pct_measured_matmul"] = 100 * row["tflops"] * 1e12 / mm
            if v in own:
                row["pct_shape_gemm"] = 100 * row["tflops"] * 1e12 / own[v]
            rows.append(row)
        print(f"  {model_name}: built in {t_build:.0f}s, measured in {time.perf_counter() - t0 - t_build:.0f}s",
              file=sys.stderr)
        del model, batches
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def random_tokenset(vocab: int, tokens: int, seq: int):
    from moetool.data import TokenSet

    rows = max(1, tokens // seq)
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    return TokenSet(ids, torch.ones_like(ids), [""] * rows, source="random token ids")


def command_calls(lm: Any, tokens: Any, batch: int) -> dict[str, Callable[[], Any]]:
    import moetool

    def call(name: str) -> Callable[[], Any]:
        fn, extra = VARIANTS.get(name, (name, {}))
        return lambda: getattr(moetool, fn)(lm, tokens, batch_size=batch, quiet=True, **extra)

    return {"bare forward": lambda: moetool.forward(lm, tokens, batch_size=batch, quiet=True),
            **{name: call(name) for name in COMMANDS}}


def bench_gpu_commands(a, dev: torch.device, full: bool) -> list[dict[str, Any]]:
    from moetool.adapters import find_moe_layers
    from moetool.loading import LoadedModel

    dtype = torch.bfloat16 if full else torch.float32
    c = COMMANDS_SHAPE if full else scaled(COMMANDS_SHAPE)
    model = build(c, dev, dtype)
    lm = LoadedModel("random", "random weights", "random", model, None, find_moe_layers(model), dev, dtype)
    seq = a.gpu_seq if full else min(a.gpu_seq, 256)
    tokens = random_tokenset(c["vocab"], a.gpu_command_tokens, seq)
    batch = max(1, a.gpu_command_batch_tokens // seq)
    calls = command_calls(lm, tokens, batch)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    label = f"mixtral-width d{c['d']} I{c['inter']} {c['layers']} layers" + ("" if full else " (scaled down)")
    wanted = [n for n in COMMANDS if not a.gpu_commands or n in a.gpu_commands]
    bare = calls["bare forward"]
    bare()  # warm-up
    bares: list[tuple[float, int]] = [B.peak_extra(bare)]
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in wanted}  # (seconds, ratio, peak)
    errors: dict[str, str | None] = {name: None for name in wanted}
    for name in wanted:  # once untimed: first-use costs (imports, lazy modules, caches) are no forward's
        try:
            calls[name]()
        except Exception as e:  # noqa: BLE001 - a failing command is reported, not a number
            errors[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in range(a.gpu_command_rounds):  # every command once per round, each between two bare forwards
        for name in wanted:
            if errors[name] is not None:
                continue
            t0 = time.perf_counter()
            try:
                dt, mem = B.peak_extra(calls[name])
            except Exception as e:  # noqa: BLE001 - a failing command is reported, not a number
                errors[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                dt, mem = float("nan"), 0
            if dev.type == "cuda":
                torch.cuda.empty_cache()  # each command starts from the same allocator state
            bares.append(B.peak_extra(bare))
            runs[name].append((dt, dt / ((bares[-2][0] + bares[-1][0]) / 2), mem))
            print(f"  {name} (round {r + 1}): {time.perf_counter() - t0:.1f}s"
                  + (f" ({errors[name]})" if errors[name] else ""), file=sys.stderr)
    rows = []
    for name in wanted:
        error, done = errors[name], runs[name]
        rows.append({"section": "gpu_commands", "model": label, "variant": name, "device": str(dev),
                     "tokens": tokens.n_tokens, "rounds": len(done),
                     "seconds": statistics.median(d for d, _, _ in done) if error is None else float("nan"),
                     "ratio": statistics.median(q for _, q, _ in done) if error is None else float("nan"),
                     "ratio_min": min(q for _, q, _ in done) if error is None else float("nan"),
                     "ratio_max": max(q for _, q, _ in done) if error is None else float("nan"),
                     "peak_extra_gib": max(m for _, _, m in done) / 2**30 if error is None else float("nan"),
                     "model_gib": model_bytes / 2**30, "error": error})
    bare_s = statistics.median(t for t, _ in bares)
    bare_mem = max(m for _, m in bares)
    for r in rows:
        r["bare_seconds"] = bare_s
        r["bare_peak_extra_gib"] = bare_mem / 2**30
        # peak of the command / peak of the bare forward, both above what the model holds
        r["peak_ratio"] = r["peak_extra_gib"] / (bare_mem / 2**30) if bare_mem else float("nan")
    rows.insert(0, {"section": "gpu_commands", "model": label, "variant": "bare forward", "device": str(dev),
                    "tokens": tokens.n_tokens, "rounds": len(bares), "seconds": bare_s, "ratio": 1.0,
                    "bare_seconds": bare_s,
                    "peak_extra_gib": bare_mem / 2**30, "model_gib": model_bytes / 2**30,
                    "bare_peak_extra_gib": bare_mem / 2**30, "peak_ratio": 1.0, "error": None})
    del lm, model
    return rows


def _cli(args: list[str], env: dict[str, str]) -> float:
    """Wall seconds of ``python -m moetool ARGS`` in a fresh process (as the ``moetool`` script runs it); a failing
    command stops the benchmark with its last lines."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "moetool", *args], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"moetool {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return dt


def bench_gpu_cli(a, dev: torch.device, full: bool) -> list[dict[str, Any]]:
    """Section 4 (see the module's docstring): the CLI on a local checkpoint, and its load speed."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    import moetool
    from moetool.loading import EMBEDDED_DIR

    c = COMMANDS_SHAPE if full else scaled(COMMANDS_SHAPE)
    dtype = torch.bfloat16 if full else torch.float32
    label = f"mixtral-width d{c['d']} I{c['inter']} {c['layers']} layers" + ("" if full else " (scaled down)")
    rows: list[dict[str, Any]] = []

    def row(variant: str, seconds: float, **extra: Any) -> None:
        rows.append({"section": "cli", "model": label, "variant": variant, "device": str(dev), "seconds": seconds,
                     **extra})
        print(f"  cli {variant}: {seconds:.2f}s", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="moetool-bench-cli-") as tmp:
        ckpt = Path(tmp) / "checkpoint"
        model = build(c, dev, dtype)
        model.save_pretrained(ckpt)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        for f in ("tokenizer.json", "tokenizer_config.json"):  # the shipped tokenizer (its ids < the vocabulary)
            shutil.copy(EMBEDDED_DIR / "tiny" / f, ckpt / f)
        nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        label += f", {nbytes / 1e9:.2f} GB of safetensors"  # before the first row()
        base = {**os.environ, "HF_HUB_OFFLINE": "1"}
        for cmd in ("inspect", "plan"):
            env = {**base, "MOETOOL_CACHE_DIR": str(Path(tmp) / f"cache-{cmd}")}  # empty: the model is built
            first = _cli([cmd, "--model", str(ckpt), "--json"], env)
            again = _cli([cmd, "--model", str(ckpt), "--json"], env)
            row(f"{cmd} --model DIR (first)", first)
            row(f"{cmd} --model DIR (cached)", again)
        out = Path(tmp) / "ppl-run"
        seq = a.gpu_seq if full else min(a.gpu_seq, 256)
        wall = _cli(["ppl", "--model", str(ckpt), "--device", dev.type, "--max-tokens", "32768" if full else "2048",
                     "--seq-len", str(seq), "--out", str(out), "--quiet"],
                    {**base, "MOETOOL_CACHE_DIR": str(Path(tmp) / "cache-ppl")})
        table = pd.read_csv(out / "ppl.csv")
        row("ppl --model DIR", wall, forward_seconds=float(table.seconds.iloc[0]),
            tokens=int(table.scored_tokens.iloc[0]))
        loads = {"moetool.load": lambda: moetool.load(str(ckpt), dtype="auto", device=dev.type, tokenizer=False),
                 "transformers from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(
                     ckpt, dtype=dtype, device_map={"": str(dev)})}
        best = {name: float("inf") for name in loads}
        for _ in range(2):
            for name, fn in loads.items():
                B.sync()
                t0 = time.perf_counter()
                m = fn()
                B.sync()
                best[name] = min(best[name], time.perf_counter() - t0)
                del m
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        for name, dt in best.items():
            row(f"load: {name}", dt, gb_per_s=nbytes / 1e9 / dt, bytes=nbytes)
    return rows


def run(a) -> list[dict[str, Any]]:
    """Every section of ``--gpu``; the rows of each (saved by the caller)."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.gpu_cpu else "cpu")
    full = dev.type == "cuda"
    if a.quick:
        a.gpu_tokens, a.gpu_command_tokens, a.gpu_repeat = min(a.gpu_tokens, 8192), min(a.gpu_command_tokens, 32768), 3
    if not full:  # scaled down: the same code paths on a CPU, about a thousand tokens
        a.gpu_tokens, a.gpu_seq, a.gpu_batch = min(a.gpu_tokens, 512 if a.quick else 1024), min(a.gpu_seq, 256), \
            min(a.gpu_batch, 4)
        a.gpu_command_tokens = min(a.gpu_command_tokens, 1024 if a.quick else 2048)
        a.gpu_command_batch_tokens = min(a.gpu_command_batch_tokens, 1024)
        a.quant_d, a.quant_inter, a.quant_tokens = 256, 512, [256, 2048]
        a.gpu_repeat = min(a.gpu_repeat, 2)
    elif a.quant_tokens == [1024]:  # the default: also a batch's tokens (the dequantization amortised over them)
        a.quant_tokens = [1024, 16384]
    env = environment(dev)
    dtype = torch.bfloat16 if full else torch.float32
    peak = nominal_peak(dev)
    mm = matmul_flops(dev, dtype)
    env["nominal peak"] = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "unknown"
    env["measured matmul"] = f"{mm / 1e12:.3g} TFLOP/s ({'8192^3 bf16' if full else '1024^3 fp32'})"
    if not full:
        env["scale"] = ("SCALED DOWN (no CUDA device): widths / 16, 2 layers, vocabulary 2,048, fp32, few tokens; "
                        "these figures describe code paths, not the hardware")
    rows: list[dict[str, Any]] = [{"section": "env", "variant": k, "value": v} for k, v in env.items()]
    for k, v in env.items():
        print(f"{k}: {v}", file=sys.stderr)
    a.gpu_env = env
    yield rows
    if "shapes" in a.gpu_sections:
        yield bench_gpu_shapes(a, dev, full, peak, mm)
    if "quant" in a.gpu_sections:
        yield B.bench_quant(a, device=dev)
    if "commands" in a.gpu_sections:
        yield bench_gpu_commands(a, dev, full)
    if "cli" in a.gpu_sections:
        yield bench_gpu_cli(a, dev, full)


def fmt_table(df, cols: list[str]) -> str:
    cols = [c for c in cols if c in df.columns]
    t = df[cols].copy()
    for c in set(cols) & set(B.COUNT_COLUMNS):  # as integers, '-' where a row has none (the CLI's ppl tokens)
        t[c] = [f"{int(x)}" if ok else "-" for x, ok in zip(t[c], t[c].notna())]
    return t.to_string(index=False, float_format=lambda x: f"{x:.2f}", na_rep="-")


def report(df, a) -> str:
    """The printout of ``--gpu`` (also written next to the CSV as ``<csv stem>.txt``)."""
    out = ["moetool bench --gpu (issue #36)"]
    env = df[df.section == "env"]
    out += [f"  {r.variant}: {r.value}" for r in env.itertuples()]
    shapes = df[df.section == "gpu_shapes"]
    if len(shapes):
        out.append(f"\nReal-width shapes: ratio to the plain forward (median of {a.gpu_repeat} interleaved rounds), "
                   f"{int(shapes.tokens.iloc[0])} tokens in rows of {a.gpu_seq}, {a.gpu_batch} rows per forward. "
                   "tflops: plain = its FLOPs / its time; probes = the probe's FLOPs / its extra time over plain")
        for model, part in shapes.groupby("model", sort=False):
            t = part.assign(spread=part.ratio_min.map("{:.2f}".format) + "-" + part.ratio_max.map("{:.2f}".format))
            out.append(f"{model}: plain {part.tokens_per_s.iloc[0] / 1e3:.1f}k tokens/s")
            out.append(fmt_table(t, ["variant", "ratio", "spread", "flop_ideal", "ratio_to_ideal", "tflops",
                                     "pct_nominal_peak", "pct_measured_matmul", "pct_shape_gemm"]))
    quant = df[df.section == "quant"]
    if len(quant):
        out.append(f"\nQuantized probes: time / the plain ({'bf16' if 'cuda' in quant.device.iloc[0] else 'fp32'}) "
                   f"probe on the same tokens per call ({', '.join(str(int(t)) for t in quant.tokens.unique())}), "
                   f"{quant.model.iloc[0]}")
        out.append(fmt_table(quant, ["tokens", "probe", "variant", "ratio", "ratio_min", "ratio_max", "seconds"]))
    cmds = df[df.section == "gpu_commands"]
    if len(cmds):
        out.append(f"\nCommands against one bare moetool.forward over the same {int(cmds.tokens.iloc[0])} tokens, "
                   f"{cmds.model.iloc[0]} (model {cmds.model_gib.iloc[0]:.2f} GiB; peak_extra = memory above the "
                   "model's at the command's peak; peak_ratio = that / the bare forward's)")
        out.append(f"(each command run once untimed first; time ratio: median over {a.gpu_command_rounds} round(s) of "
                   "the command's time / the mean of the bare forwards run just before and after it; min-max in "
                   "ratio_min, ratio_max)")
        out.append(fmt_table(cmds, ["variant", "ratio", "ratio_min", "ratio_max", "seconds", "peak_extra_gib",
                                    "peak_ratio", "error"]))
    cli = df[df.section == "cli"]
    if len(cli):
        out.append(f"\nThe CLI on a local checkpoint ({cli.model.iloc[0]}), each command in a fresh process: wall "
                   "seconds; ppl's forward_seconds = its forwards (ppl.csv); load = one process, best of 2, GB/s of "
                   "safetensors (page cache warm)")
        out.append(fmt_table(cli, ["variant", "seconds", "forward_seconds", "tokens", "gb_per_s"]))
    return "\n".join(out)
