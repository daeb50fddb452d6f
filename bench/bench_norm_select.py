"""Cost of AoE's norm selection: the ``norm:gate`` forward vs the plain forward, measured and analytic.

Wall: best of ``--repeat`` rounds over the same packed rows, unhooked vs an Engine applying
``norm:gate`` in every MoE layer, alternating within each round (after one warm-up pass each), on
the embedded model and, with ``--large``, on a random Mixtral-shaped model with wider layers.

FLOPs per token (multiply-add = 2), per MoE decoder layer, d hidden, I expert width, n experts,
top-K, H query heads and G key/value heads of width h, causal context S (mean attended S' = (S+1)/2):

    attention = 2·d·H·h (q) + 2·2·d·G·h (k, v) + 2·H·h·d (o) + 2·2·H·h·S' (scores, weighted sum)
    router    = 2·n·d
    experts   = K · 3 · I · d · 2          (gate, up, down of the K chosen experts)
    plain     = attention + router + experts                         per layer, plus 2·d·V (lm head) per token
    norm:gate = plain + n · I · d · 2       (the gate of all n experts, to rank them; the chosen K then run
                                             as usual and recompute their gate -- moetool keeps no cache)

``flop_ratio`` = norm:gate / plain for the whole model (MoE layers + lm head); ``flop_ratio_layer`` for one
decoder layer. Mixtral-8x7B's analytic ratio is printed too (no wall time). Not a test.

Usage: python bench/bench_norm_select.py [--model tiny] [--tokens 2048] [--large] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


def clock(fn) -> float:
    """Wall seconds of one call (device work finished)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def timed(fns: list, repeat: int) -> list[float]:
    """Best wall time of each function; the functions alternate within every round (shared-machine noise)."""
    for fn in fns:  # warm-up
        fn()
    rounds = [[clock(fn) for fn in fns] for _ in range(repeat)]
    return [min(r[i] for r in rounds) for i in range(len(fns))]


def flops(d: int, inter: int, n: int, k: int, heads: int, kv_heads: int, head_dim: int, seq: int,
          vocab: int, moe_layers: int) -> dict[str, float]:
    """Per-token FLOPs of the plain and ``norm:gate`` forwards (formula in the module docstring)."""
    s_mean = (seq + 1) / 2
    attention = 2 * d * heads * head_dim + 2 * 2 * d * kv_heads * head_dim + 2 * heads * head_dim * d \
        + 2 * 2 * heads * head_dim * s_mean
    router = 2 * n * d
    experts = k * 3 * inter * d * 2
    extra = n * inter * d * 2
    layer = attention + router + experts
    plain = moe_layers * layer + 2 * d * vocab
    return {"flops_plain": plain, "flops_norm_gate": plain + moe_layers * extra,
            "flop_ratio": (plain + moe_layers * extra) / plain, "flop_ratio_layer": (layer + extra) / layer}


def shape_of(config: Any, layers: list) -> dict[str, int]:
    L = layers[0]
    W = L.expert_weights()
    heads = config.num_attention_heads
    return dict(d=config.hidden_size, inter=int(W.gate.shape[1]), n=L.n_experts, k=L.top_k, heads=heads,
                kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                vocab=config.vocab_size, moe_layers=len(layers))


def measure(name: str, model: Any, layers: list, batches: list, repeat: int, seq: int) -> dict[str, Any]:
    from moetool.engine import Engine
    from moetool.policies import make_policy

    def plain():
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False)

    def norm_gate():
        with Engine(model, layers, policy=make_policy("norm:gate")):
            plain()

    t_plain, t_norm = timed([plain, norm_gate], repeat)
    tokens = int(sum(int(m.sum()) for _, m in batches))
    shape = shape_of(model.config, layers)
    return {"model": name, "tokens": tokens, "seq_len": seq, **shape, "plain_seconds": t_plain,
            "norm_gate_seconds": t_norm, "wall_ratio": t_norm / t_plain, **flops(**shape, seq=seq)}


def large_model(seed: int = 0):
    """A random Mixtral-shaped model: d=512, I=1792 (Mixtral's I/d = 3.5), 8 experts top-2, 2 layers."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from moetool.adapters import find_moe_layers

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=2048, hidden_size=512, intermediate_size=1792, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    return model, find_moe_layers(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default=None, help="text for the embedded model (default: the shipped held-out text)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--large", action="store_true", help="also a random Mixtral-shaped model (d=512, I=1792)")
    ap.add_argument("--csv", default="bench_norm_select.csv")
    a = ap.parse_args()

    import pandas as pd

    from moetool.data import load_tokens
    from moetool.loading import load

    lm = load(a.model)
    ts = load_tokens(a.data, lm.tokenizer, a.seq_len, a.tokens)
    batches = [(b.input_ids.to(lm.device), b.attention_mask.to(lm.device)) for b in ts.batches(a.batch_size)]
    rows = [measure(a.model, lm.model, lm.layers, batches, a.repeat, a.seq_len)]
    if a.large:
        model, layers = large_model()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 2048, (ts.input_ids.shape[0], a.seq_len), generator=gen)
        big = [(ids[s:s + a.batch_size], torch.ones_like(ids[s:s + a.batch_size]))
               for s in range(0, ids.shape[0], a.batch_size)]
        rows.append(measure("random-mixtral-d512", model, layers, big, a.repeat, a.seq_len))
    mixtral = dict(d=4096, inter=14336, n=8, k=2, heads=32, kv_heads=8, head_dim=128, vocab=32000, moe_layers=32)
    rows.append({"model": "mixtral-8x7b (analytic)", "seq_len": 4096, **mixtral, **flops(**mixtral, seq=4096)})
    df = pd.DataFrame(rows)
    cols = ["model", "tokens", "plain_seconds", "norm_gate_seconds", "wall_ratio", "flop_ratio", "flop_ratio_layer"]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print("flop_ratio = (plain + moe_layers·n·I·d·2) / plain, plain = moe_layers·(attention + 2nd + K·6Id) + 2dV")
    df.to_csv(a.csv, index=False)
    print(f"wrote {a.csv}")


if __name__ == "__main__":
    main()
