"""Hook-engine overhead, measured in one run: ratios, not absolute times.

* capture / plain: an Engine with a no-op consumer vs the unhooked forward;
* router-policy / plain: the override path returning the router's own choice;
* all-experts probe / plain: computing every expert's output (``expert_outputs``) for every
  MoE layer's tokens inside the forward;
* peak memory of the all-experts probe with token chunking vs without (CPU: tracemalloc is
  blind to torch, so we report the analytic bytes of the largest intermediate instead).

Usage: python bench/bench_engine.py [--model tiny] [--tokens 4096] [--repeat 3] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()

    import pandas as pd

    from moetool.data import load_tokens
    from moetool.engine import Engine, expert_outputs, run_batches
    from moetool.engine.probes import DEFAULT_BUDGET, _chunk_size
    from moetool.loading import load
    from moetool.policies import make_policy

    lm = load(a.model)
    ts = load_tokens(None, lm.tokenizer, a.seq_len, a.tokens)

    def plain():
        run_batches(lm.model, ts.batches(a.batch_size), quiet=True)

    def with_engine(**kw):
        def f():
            with Engine(lm.model, lm.layers, **kw):
                run_batches(lm.model, ts.batches(a.batch_size), quiet=True)
        return f

    def probe_all(ev):
        expert_outputs(ev.layer, ev.h)

    t_plain = timed(plain, a.repeat)
    rows = [
        ("capture (no-op consumer)", timed(with_engine(consumers=[lambda ev: None]), a.repeat)),
        ("router policy (override path)", timed(with_engine(policy=make_policy("router")), a.repeat)),
        ("all-experts outputs probe", timed(with_engine(consumers=[probe_all]), a.repeat)),
    ]
    L = lm.layers[0]
    W = L.expert_weights()
    n, inter = W.gate.shape[0], W.gate.shape[1]
    T = a.batch_size * a.seq_len
    chunk = min(T, _chunk_size(L, W, DEFAULT_BUDGET))
    out = pd.DataFrame([{"what": w, "seconds": s, "ratio_to_plain": s / t_plain} for w, s in rows])
    print(f"model {a.model} ({lm.config.model_type}), {ts.n_tokens} tokens, device {lm.device}, plain {t_plain:.3f}s")
    print(out.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"largest probe intermediate per batch: unchunked {n * T * inter * 4 / 2**20:.1f} MiB, "
          f"chunked ({chunk} tokens) {n * chunk * inter * 4 / 2**20:.1f} MiB")
    if a.csv:
        out.to_csv(a.csv, index=False)


if __name__ == "__main__":
    main()
