"""``moetool plan``: parameter counts against the published sizes of five flagship checkpoints, bytes and
throughput against hand-written closed forms, layouts against what is known to fit, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetool.errors import MoetoolError
from moetool.experiments.plan import compute as P
from moetool.loading import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"

#: (total, active) parameters as published by each model's authors (model cards / technical reports)
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "deepseek-v3": (671e9, 37e9),
    "kimi-k2": (1.04e12, 32e9),
    "gpt-oss-120b": (116.8e9, 5.13e9),  # OpenAI counts active parameters without the embedding table
}


def config(name: str):
    return load_config(str(CONFIGS / name))[0]


@pytest.fixture(scope="module")
def counts():
    return {name: P.parameter_groups(config(name)) for name in PUBLISHED}


@pytest.mark.parametrize("name", PUBLISHED)
@pytest.mark.slow
def test_parameters_match_published_sizes(counts, name):
    total, active = PUBLISHED[name]
    c = counts[name]
    assert c["total"] == pytest.approx(total, rel=0.015)
    own = c["active"] - (c["groups"]["embeddings"] if name == "gpt-oss-120b" else 0)
    assert own == pytest.approx(active, rel=0.03)
    assert sum(c["groups"].values()) == c["total"]


def test_groups_against_a_real_model():
    """On the embedded model (real weights): every parameter counted once, in the group its module says."""
    from moetool.loading import load

    lm = load("tiny", tokenizer=False)
    c = P.parameter_groups(lm.model.config)
    assert c["total"] == sum(p.numel() for p in lm.model.parameters())
    experts = sum(p.numel() for L in lm.layers for p in L.experts.parameters())
    routers = sum(p.numel() for L in lm.layers for p in L.router.parameters())
    assert c["groups"]["routed_experts"] == experts and c["groups"]["routers"] == routers
    n, k = lm.layers[0].n_experts, lm.layers[0].top_k
    assert c["active"] == c["total"] - experts * (n - k) // n


def test_bytes_per_format_closed_form():
    groups = {"embeddings": 10, "lm_head": 10, "routers": 4, "routed_experts": 16384 * 3, "shared_experts": 16384,
              "other_matrices": 16384 * 2, "vectors": 6}
    fp8 = P.group_bytes(groups, "fp8")
    assert fp8["routed_experts"] == 16384 * 3 + 3 * 4 and fp8["other_matrices"] == 16384 * 2 + 2 * 4
    assert fp8["embeddings"] == 20 and fp8["routers"] == 8 and fp8["vectors"] == 12
    mx = P.group_bytes(groups, "mxfp4")
    assert mx["routed_experts"] == 16384 * 3 * 0.5 + 16384 * 3 / 32 and mx["other_matrices"] == 16384 * 2 * 2
    assert sum(P.group_bytes(groups, "fp32").values()) == 4 * sum(groups.values())
    with pytest.raises(MoetoolError, match="unknown weight format"):
        P.group_bytes(groups, "int3")


def test_checkpoint_sizes(counts):
    """The released files: DeepSeek-V3 in FP8 is ~671 GB (without its MTP layer); gpt-oss-120b in MXFP4 60.8 GiB."""
    assert P.native_format(config("deepseek-v3")) == "fp8" and P.native_format(config("gpt-oss-120b")) == "mxfp4"
    assert P.native_format(config("mixtral-8x7b")) == "bf16"
    dsv3 = sum(P.group_bytes(counts["deepseek-v3"]["groups"], "fp8").values())
    assert 665e9 < dsv3 < 680e9
    oss = sum(P.group_bytes(counts["gpt-oss-120b"]["groups"], "mxfp4").values())
    assert oss / 2 ** 30 == pytest.approx(60.8, abs=0.5)


def test_mxfp4_keeps_the_experts_bias_rows_in_bf16(counts):
    """gpt-oss-120b's MXFP4 release packs the experts' matrices (4 bits + one E8M0 byte per 32); their bias rows
    ([128, 5760] and [128, 2880] per layer) stay bf16 like every vector. The plan packed them too: 58.5 MB short
    (gpt-oss-20b 9.7 MB); fp8 likewise stored them in 1 byte."""
    layers, n, hidden, inter = 36, 128, 2880, 2880
    matrices = layers * n * (hidden * 2 * inter + inter * hidden)
    biases = layers * n * (2 * inter + hidden)
    c = counts["gpt-oss-120b"]
    assert c["groups"]["routed_experts"] == matrices + biases and c["expert_vectors"] == biases
    rest = c["total"] - matrices - biases
    mx = P.group_bytes(c["groups"], "mxfp4", c["expert_vectors"])
    assert mx["routed_experts"] == matrices * (0.5 + 1 / 32) + 2 * biases
    assert sum(mx.values()) == matrices * (0.5 + 1 / 32) + 2 * biases + 2 * rest == 65_248_815_744
    fp8 = P.group_bytes(c["groups"], "fp8", c["expert_vectors"])
    assert fp8["routed_experts"] == matrices * (1 + 4 / 128 ** 2) + 2 * biases
    res = P.plan(config("gpt-oss-120b"), "1xH200", 1, seq_len=2048, rows=8)
    total = res["params"].set_index("group").loc["total"]
    assert total["bytes_mxfp4"] == 65_248_815_744


def layouts(name: str, gpus: str, nodes: int = 1):
    df = P.plan(config(name), gpus, nodes, seq_len=2048, rows=8)["layouts"]
    return {row.layout.split(" over")[0].split(",")[0] if "over" in row.layout else row.layout: row
            for row in df.itertuples()}


def test_layouts_fit_as_known():
    mix = layouts("mixtral-8x7b", "1xH100")
    assert not mix["1 GPU per replica, data parallel"].fits  # 93 GB in bf16 > one 80 GB H100
    assert mix["1 GPU per replica, --quantize fp8"].fits
    assert layouts("mixtral-8x7b", "2xH100")["--device-map auto"].fits
    one_node = layouts("deepseek-v3", "8xH100")  # 671 GB / 8 = 84 GB per GPU > 72 GB usable
    assert not any(r.fits for r in one_node.values())
    two = layouts("deepseek-v3", "8xH100", nodes=2)
    tpep = two["tensor+expert parallel"]  # 256 experts and 128 heads split over 16 GPUs
    assert tpep.fits and tpep.available == "yes" and tpep.command.endswith("--tp 16 --ep 16")
    assert "--nnodes 2 --nproc-per-node 8" in tpep.command
    assert not two["tensor+expert parallel within each node (8 GPUs), one replica per node"].fits
    assert layouts("deepseek-v3", "8xH200")["--device-map auto"].fits  # 84 GB per 141 GB GPU
    assert not layouts("kimi-k2", "8xH200")["--device-map auto"].fits  # 1.03 TB / 8 = 129 GB > 127 GB
    fits = layouts("kimi-k2", "8xH200", nodes=2)["tensor+expert parallel"]
    act = 8 * (2048 * 163840 * 2 + 2 * 2048 * 7168 * 2)  # 8 rows: bf16 logits and two hidden states
    assert fits.available == "yes" and fits.command.endswith("--tp 16 --ep 16")
    kimi = P.group_bytes(P.parameter_groups(config("kimi-k2"))["groups"], "fp8")
    rest = sum(kimi.values()) - kimi["routed_experts"]  # not split by --ep: counted whole on every GPU
    assert 1.0e12 < kimi["routed_experts"] < 1.03e12 and 1e10 < rest < 4e10
    assert fits.fits and fits.gib_per_gpu == pytest.approx((kimi["routed_experts"] / 16 + rest + act) / 2 ** 30,
                                                           abs=0.01)


def test_throughput_closed_form():
    """Mixtral-8x7B with --quantize fp8 on one H100, rows of 2048 x 8, written out by hand from its dimensions."""
    res = P.plan(config("mixtral-8x7b"), "1xH100", 1, seq_len=2048, rows=8)
    thr = res["throughput"].set_index("command")
    layer_expert = 8 * 3 * 4096 * 14336
    total = 32000 * 4096 * 2 + 32 * (4096 * 8 + layer_expert + 4096 * (4096 * 2 + 1024 * 2) + 2 * 4096) + 4096
    assert res.meta["plan"]["total_params"] == total
    vectors = 32 * 2 * 4096 + 4096
    active_matrices = total - 32000 * 4096 - vectors - 32 * layer_expert * 6 // 8
    flops = 2 * active_matrices + 4 * 32 * 1024 * 4096
    assert thr.loc["ppl", "compute_tokens_per_s"] == pytest.approx(1979e12 / flops, rel=1e-9)
    fp8_bytes = (2 * 2 * 32000 * 4096 + 2 * 32 * 4096 * 8 + 2 * vectors
                 + (32 * (layer_expert + 4096 * (4096 * 2 + 1024 * 2))) * (1 + 4 / 16384))
    assert thr.loc["ppl", "memory_tokens_per_s"] == pytest.approx(16384 * 3.35e12 / fp8_bytes, rel=1e-9)
    assert thr.loc["ppl", "bound"] == "compute"
    all_experts = flops + 2 * 32 * layer_expert * 6 // 8
    assert thr.loc["approx", "tokens_per_s"] == pytest.approx(1979e12 / all_experts, rel=1e-9)
    assert thr.loc["norm-select", "tokens_per_s"] == pytest.approx(1979e12 / (flops + 5 * all_experts), rel=1e-9)


def test_attention_flops_of_sliding_windows_and_mla(counts):
    """A sliding-window layer attends to at most its window (gpt-oss: 128 positions in every other layer), and MLA's
    values are narrower than its query-keys (DeepSeek-V3: 128 and 192 per head). The plan charged every layer half
    the sequence at 2 x 2 x the query width: gpt-oss-120b at 131,072 tokens 48.9 GFLOP per token for 29.6 (65%
    over, its compute ceiling 0.61x), DeepSeek-V3 at 2,048 1.3% over."""
    c = counts["gpt-oss-120b"]
    matrices = c["active"] - c["groups"]["embeddings"] - c["groups"]["vectors"]
    s, w, width = 131072, 128, 64 * 64
    attended = 18 * s / 2 + 18 * (w - w * w / (2 * s))  # 18 full layers, 18 sliding (mean of min(t, w) over t < s)
    want = 2 * matrices + 2 * attended * (width + width)
    assert P.flops_per_token(config("gpt-oss-120b"), c, s, all_experts=False) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(29.6e9, rel=0.01)
    d = counts["deepseek-v3"]
    matrices = d["active"] - d["groups"]["embeddings"] - d["groups"]["vectors"]
    want = 2 * matrices + 2 * 61 * 1024 * 128 * (192 + 128)
    assert P.flops_per_token(config("deepseek-v3"), d, 2048, all_experts=False) == pytest.approx(want, rel=1e-12)


def test_replicas_and_device_map_scale():
    one = P.plan(config("qwen3-30b-a3b"), "1xH100", 1)["throughput"].set_index(["layout", "command"])
    eight = P.plan(config("qwen3-30b-a3b"), "8xH100", 2)["throughput"].set_index(["layout", "command"])
    dp = "1 GPU per replica, data parallel"
    assert eight.loc[(dp, "ppl"), "tokens_per_s"] == pytest.approx(16 * one.loc[(dp, "ppl"), "tokens_per_s"])
    dm = eight.loc[("--device-map auto over 8 GPUs, one replica per node", "ppl")]
    # one GPU computes at a time and every byte is read in turn: two nodes, one replica each, = 2 x one GPU
    assert dm["tokens_per_s"] == pytest.approx(2 * one.loc[(dp, "ppl"), "tokens_per_s"])


def test_device_map_reads_the_whole_model_per_batch_closed_form():
    """--device-map over 2 H100s (Mixtral-8x7B in bf16, rows of 2048 x 8): one GPU computes at a time, and each
    batch streams every layer's weights through its GPU -- all 2 x total bytes, not the half one GPU holds, and the
    compute ceiling is one GPU's. Charging weights / shards read doubled the memory ceiling (pass 17, PL14)."""
    res = P.plan(config("mixtral-8x7b"), "2xH100", 1, seq_len=2048, rows=8)
    dm = res["throughput"].set_index(["layout", "command"]).loc[("--device-map auto over 2 GPUs, one replica per "
                                                                 "node", "ppl")]
    total = res.meta["plan"]["total_params"]
    assert dm["memory_tokens_per_s"] == pytest.approx(16384 * 3.35e12 / (2 * total), rel=1e-9)
    flops = dm["tflops_per_token"] * 1e12
    assert dm["compute_tokens_per_s"] == pytest.approx(989e12 / flops, rel=1e-9)  # one GPU at a time
    approx = res["throughput"].set_index(["layout", "command"]).loc[("--device-map auto over 2 GPUs, one replica "
                                                                     "per node", "approx")]
    assert approx["memory_tokens_per_s"] == pytest.approx(16384 * 3.35e12 / (2 * total), rel=1e-9)  # (0, 1): once



def test_tensor_expert_parallel_throughput_closed_form():
    """DeepSeek-V3 (fp8) over 2 nodes of 8 H100s, tensor+expert parallel over the 16 GPUs (rows of 2048 x 8): all 16
    compute at once (16 x 1979 TFLOP/s), each reads its 1/16 of the weights per batch; lm-eval refuses --tp, so no
    eval row; norm-select's six passes (1 routed + 5 all-expert) read the weights six times. Pass 17: one GPU's
    compute (PL15), an eval row (PL18) and norm-select's memory ceiling of one pass (PL20) passed test_plan."""
    res = P.plan(config("deepseek-v3"), "8xH100", 2, seq_len=2048, rows=8)
    name = "tensor+expert parallel over 16 GPUs"
    thr = res["throughput"][res["throughput"].layout == name].set_index("command")
    assert len(thr) and "eval" not in thr.index and {"ppl", "norm-select", "approx"} <= set(thr.index)
    params = res["params"].set_index("group")
    weights = float(params.loc["total", "bytes_fp8"])
    for cmd, passes in (("ppl", 1), ("approx", 1), ("norm-select", 6), ("mass-recall", 3)):
        r = thr.loc[cmd]
        assert r["compute_tokens_per_s"] == pytest.approx(16 * 1979e12 / (r["tflops_per_token"] * 1e12), rel=1e-9)
        assert r["memory_tokens_per_s"] == pytest.approx(16384 * 3.35e12 / (weights / 16) / passes, rel=1e-6), cmd

def test_kv_cache_per_row():
    mix = P.per_row(config("mixtral-8x7b"), 1000)
    assert mix["kv_cache_bytes"] == 32 * 2 * 8 * 128 * 1000 * 2
    oss = P.per_row(config("gpt-oss-120b"), 1000)  # 18 sliding layers keep 128 positions
    assert oss["kv_cache_bytes"] == (18 * 1000 + 18 * 128) * 2 * 8 * 64 * 2
    dsv3 = P.per_row(config("deepseek-v3"), 10)  # transformers caches MLA's latent: 512 values + the 64-wide rope key
    assert dsv3["kv_cache_bytes"] == 61 * 10 * (512 + 64) * 2


def test_a_window_without_layer_types_slides_in_every_layer():
    """A config that sets sliding_window but names no per-layer types (Mixtral, PhiMoE): transformers' cache keeps
    the window in every layer (DynamicSlidingWindowLayer), the plan counted the whole sequence -- Mixtral-8x7B with a
    4096 window at 32,768 tokens: 4.3 GB per row for the 0.54 GB its cache holds (8x)."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    import copy

    mix = copy.deepcopy(config("mixtral-8x7b"))
    assert mix.sliding_window is None  # the published config: no window
    mix.sliding_window = 4096
    assert P.per_row(mix, 32768)["kv_cache_bytes"] == 32 * 4096 * 2 * 8 * 128 * 2 == 536_870_912
    assert P.per_row(mix, 2048)["kv_cache_bytes"] == 32 * 2048 * 2 * 8 * 128 * 2
    tiny = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = AutoModelForCausalLM.from_config(tiny).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 64, (1, 10)), use_cache=True).past_key_values
    assert all(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    assert P.per_row(tiny, 10)["kv_cache_bytes"] == 2 * 4 * 2 * 2 * 8 * 2  # 2 layers x 4 positions x k, v of 2 x 8


def test_mla_kv_cache_is_what_transformers_caches():
    """MLA (DeepSeek-V2/V3 and alike) caches its compressed latent, kv_lora_rank + qk_rope_head_dim values per token
    and layer, not the keys and values of every head: the plan counted heads x (qk + v) -- DeepSeek-V3 40,960
    values per token and layer for 576 (71x, 10.2 GB per row of 2048 for 144 MB), DeepSeek-V2-Lite 5,120 (8.9x).
    Checked by hand at the published dimensions and against the cache a tiny model's own forward fills."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, MixtralConfig

    v2_lite = DeepseekV2Config(vocab_size=102400, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                               num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840)
    assert P.per_row(v2_lite, 2048)["kv_cache_bytes"] == 27 * 2048 * (512 + 64) * 2 == 63_700_992
    assert P.per_row(config("deepseek-v3"), 2048)["kv_cache_bytes"] == 61 * 2048 * (512 + 64) * 2 == 143_917_056
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    tiny = {"deepseek_v3": DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                                           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                           first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12),
            "deepseek_v2": DeepseekV2Config(**common, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                           kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
                                           qk_nope_head_dim=16, v_head_dim=12),
            "mixtral": MixtralConfig(**{**common, "num_key_value_heads": 2}, intermediate_size=32)}
    for name, cfg in tiny.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            cache = model(torch.randint(0, 64, (1, 10)), use_cache=True).past_key_values
        held = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values)) * 2  # bf16 bytes
        assert P.per_row(cfg, 10)["kv_cache_bytes"] == held, name


def test_hybrid_layers_without_attention_hold_no_kv_cache():
    """Jamba (32 layers: attention every 8th, the rest Mamba) and Qwen3-Next (48: full attention every 4th, the rest
    linear attention) keep keys and values in 4 and 12 layers, and only those attend over the sequence: the plan
    counted every layer (8x and 4x the KV cache)."""
    from transformers import JambaConfig, Qwen3NextConfig

    jamba, qnext = JambaConfig(), Qwen3NextConfig()
    assert jamba.layers_block_type.count("attention") == 4 and qnext.layer_types.count("full_attention") == 12
    assert P.per_row(jamba, 1000)["kv_cache_bytes"] == 4 * 1000 * 2 * 8 * 128 * 2  # 8 kv heads of 4096 / 32
    assert P.per_row(qnext, 1000)["kv_cache_bytes"] == 12 * 1000 * 2 * 2 * 256 * 2  # 2 kv heads of 256
    no_params = {"active": 0, "inactive_experts": 0, "groups": {"embeddings": 0, "vectors": 0}}
    assert P.flops_per_token(jamba, no_params, 1000, all_experts=False) == 4 * 4 * 500 * 32 * 128
    assert P.flops_per_token(qnext, no_params, 1000, all_experts=False) == 4 * 12 * 500 * 16 * 256


@pytest.mark.parametrize("spec, want", [("8xH100", (8, "H100")), ("h200", (1, "H200")), ("2 x a100", (2, "A100-80")),
                                        ("4*rtx4090", (4, "RTX4090"))])
def test_parse_gpus(spec, want):
    n, gpu = P.parse_gpus(spec)
    assert (n, gpu.name) == want


@pytest.mark.parametrize("spec", ["8xZ100", "0xH100", "x", ""])
def test_parse_gpus_refuses(spec):
    with pytest.raises(MoetoolError):
        P.parse_gpus(spec)


@pytest.mark.slow
def test_cli(tmp_path, cli):
    # 4 rows: with 8, 60.8 GiB of MXFP4 weights + 6.3 GiB of activations is 67.08 GiB, over the 67.06 usable
    r = cli("plan", "--model", str(CONFIGS / "gpt-oss-120b"), "--gpus", "1xH100", "--batch-size", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    import moetool

    assert moetool.plan(str(CONFIGS / "gpt-oss-120b"), "1xH100", rows=4)["layouts"].to_dict(orient="records") == \
        out["layouts"]
    assert out["plan"]["native_format"] == "mxfp4" and out["layouts"][0]["fits"]
    assert out["layouts"][0]["command"].startswith("moetool ppl --model")
    r = cli("plan", "--gpus", "8xZ100", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown GPU 'Z100'" in r.stderr
    assert not (tmp_path / "x").exists()
    r = cli("plan", "--nodes", "0")
    assert r.returncode == 2
    r = cli("plan", "--gpus", "1xRTX4090", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"params.csv", "layouts.csv", "throughput.csv",
                                                               "manifest.json"}


def test_nothing_fits_is_an_answer():
    """gpt-oss-120b on one RTX 4090: no layout fits. The tables say why (the GiB each layout needs per GPU against
    the 90% of 24 GB usable); there is no throughput ceiling to give and no empty column."""
    res = P.plan(config("gpt-oss-120b"), "1xRTX4090")
    assert "throughput" not in res and res.names == ["params", "layouts"]
    lay = res["layouts"]
    usable = P.USABLE * 24e9 / 2 ** 30
    assert not lay["fits"].any() and "command" not in lay.columns
    for r in lay.itertuples():
        assert r.gib_per_gpu > usable
        # one unit, the column's value; 90% of the card's GiB (22.4 GiB = 24 GB) is the usable 20.12 GiB. It said
        # "(90% of the RTX4090's 24 GB = 22.4 GiB)", read as 90% of 24 GB being 22.4 GiB beside "20.12 GiB usable"
        assert r.why == (f"needs {r.gib_per_gpu:g} GiB per GPU, more than the {usable:.2f} GiB usable: "
                         f"90% of the RTX4090's {24e9 / 2 ** 30:.1f} GiB (24 GB)")
        assert f"{usable:.2f}" == "20.12" and f"{0.9 * 24e9 / 2 ** 30:.2f}" == "20.12"
    assert "why" in res.meta["definitions"]
    fits = P.plan(config("gpt-oss-120b"), "1xH100", rows=4)["layouts"]  # the same column where something fits
    assert fits.loc[0, "why"] == "fits: 63.92 of 67.06 usable GiB per GPU"
    close = P.plan(config("gpt-oss-120b"), "1xH100")["layouts"]  # 8 rows: 0.02 GiB over, said in the same precision
    assert close.loc[0, "why"].startswith("needs 67.08 GiB per GPU, more than the 67.06 GiB usable")
    assert fits.loc[0, "why"].startswith("fits: ") and fits.loc[0, "command"].startswith("moetool ppl")


@pytest.mark.slow
def test_cli_nothing_fits_exits_0(tmp_path, cli):
    for gpus in ("1xRTX4090", "1xA100-40"):
        out = tmp_path / gpus
        r = cli("plan", "--model", str(CONFIGS / "gpt-oss-120b"), "--gpus", gpus, "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "no layout fits" in r.stdout
        assert {p.name for p in out.iterdir()} == {"params.csv", "layouts.csv", "manifest.json"}
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] != "failed"


def test_plan_reads_at_80_columns_and_respects_the_models_positions(tmp_path):
    """Issue 35 item 9: at 80 columns every suggested command is one whole line (not a 5-wide column of a split
    table), a small model's parameters print in M (counted here from the loaded model), and the default --seq-len
    is the model's positions when it has fewer than 2048 (the suggested command passes the commands' own check);
    a longer explicit --seq-len is refused in one line, as ppl would refuse it."""
    from typer.testing import CliRunner

    import moetool
    from moetool.commands.app import app
    from moetool.sizing import check_seq_len, max_positions

    lm = moetool.load("tiny")
    total = sum(p.numel() for p in lm.model.parameters())
    positions = max_positions(lm.model.config)
    assert positions == 1024
    runner = CliRunner(env={"COLUMNS": "80"})
    r = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "8xH100", "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert f"{total / 1e6:.3g}M parameters" in r.output.replace("\n", " ") and "0.0B" not in r.output, first
    lines = r.output.splitlines()
    cmd = f"moetool ppl --model tiny --seq-len {positions} --batch-size 8 --device-map auto"
    assert any(ln.strip() == cmd for ln in lines), r.output
    assert sum("--nproc-per-node 8 -m moetool ppl --model tiny" in ln for ln in lines) == 2
    assert "(1/" not in r.output.split("ceiling")[0]  # the layouts are not split into slices
    check_seq_len(lm.model.config, positions)  # what the suggested commands run is accepted
    layouts = P.plan("tiny", "8xH100")["layouts"]
    assert all(f"--seq-len {positions} " in c for c in layouts["command"] if c)
    with pytest.raises(MoetoolError, match="longer than the model's 1024 positions"):
        P.plan("tiny", "8xH100", seq_len=2048)
    r = runner.invoke(app, ["plan", "--model", "tiny", "--seq-len", "2048", "--out", str(tmp_path / "q")])
    assert r.exit_code == 2 and "use --seq-len 1024 or less" in r.output


def test_moetool_run_plan_is_the_command(tmp_path, cli):
    """``moetool.run("plan", name, gpus=..., nodes=..., seq_len=..., batch_size=..., out=...)`` writes the command's
    tables (it raised a raw TypeError after loading the model's weights: plan() got an unexpected keyword 'quiet');
    a bad value of a flag is one MoetoolError, as on the command line, and nothing is written."""
    import pandas as pd

    import moetool

    r = cli("plan", "--model", "tiny", "--gpus", "2xH100", "--nodes", "2", "--seq-len", "128", "--batch-size", "4",
            "--out", str(tmp_path / "cli"), "--quiet")
    assert r.returncode == 0, r.stderr
    res = moetool.run("plan", "tiny", gpus="2xH100", nodes=2, seq_len=128, batch_size=4, out=tmp_path / "api")
    assert res.path == tmp_path / "api"
    names = sorted(p.name for p in (tmp_path / "cli").glob("*.csv"))
    assert names == sorted(p.name for p in (tmp_path / "api").glob("*.csv")) and "layouts.csv" in names
    for name in names:
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "cli" / name), pd.read_csv(tmp_path / "api" / name))
    default = moetool.run("plan", "tiny", out=tmp_path / "default")  # the command's defaults: 8xH100, 1 node, 8 rows
    assert default.meta["plan"]["rows"] == 8 and default["layouts"].equals(moetool.plan("tiny")["layouts"])
    for kw, msg in ((dict(nodes=0), "--nodes must be >= 1"), (dict(gpus="8xZ100"), "unknown GPU"),
                    (dict(batch_size="auto"), "runs no batches"), (dict(max_tokens=64), "do not apply"),
                    (dict(top_k=1), "do not apply")):
        with pytest.raises(MoetoolError, match=msg):
            moetool.run("plan", "tiny", out=tmp_path / "bad", **kw)
        assert not (tmp_path / "bad").exists()


def test_a_config_without_a_dtype_prints_no_transformers_deprecation(tmp_path):
    """A config.json that records no dtype (``save_pretrained`` of a config built by hand) made ``plan`` and
    ``inspect`` print "[transformers] `torch_dtype` is deprecated! Use `dtype` instead!": moetool read the
    deprecated property as a fallback. ``configs.stored_dtype`` reads ``dtype`` and a ``torch_dtype`` the config
    itself holds; the formats are as before (bf16 when none is recorded, fp32 from a recorded float32)."""
    from transformers import Qwen3MoeConfig

    from moetool.configs import stored_dtype

    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    none = tmp_path / "none"
    Qwen3MoeConfig(**tiny).save_pretrained(none)
    assert "dtype" not in json.loads((none / "config.json").read_text())
    r = subprocess.run([sys.executable, "-m", "moetool", "plan", "--model", str(none), "--gpus", "1xH100", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "deprecated" not in r.stderr and json.loads(r.stdout)["plan"]["native_format"] == "bf16"
    c = Qwen3MoeConfig(**tiny)
    c.__dict__["torch_dtype"] = "float32"  # a config object holding the old key itself
    c.dtype = None
    assert stored_dtype(c) == "float32" and P.native_format(c) == "fp32"


def test_plan_says_when_its_commands_name_a_config_without_weights(tmp_path):
    """A newcomer's ``moetool plan --model examples/configs/deepseek-v3 --gpus 8xH100 --nodes 2`` (the README's
    example) printed ``torchrun ... -m moetool ppl --model examples/configs/deepseek-v3 ... --tp 16 --ep 16`` to copy;
    run, it loads for a minute and fails ('holds a config and no weight files'). The plan now says under its
    commands that the folder has no weights; a model with weights (tiny) gets no such line."""
    from typer.testing import CliRunner

    from moetool.commands.app import app

    cfg = Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3"
    assert not [f for f in cfg.rglob("*") if f.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(app, ["plan", "--model", str(cfg), "--gpus", "8xH100", "--nodes", "2", "--out",
                            str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    said = [ln for ln in r.output.splitlines() if "a config without weights" in ln]
    assert said == [f"  (the commands name {cfg}, a config without weights: put the checkpoint's folder or hub id "
                    "in --model)"], r.output
    assert f"--model {cfg} --seq-len 2048 --batch-size 8 --tp 16 --ep 16" in r.output  # the command it is about
    r = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "8xH100", "--out", str(tmp_path / "q")])
    assert r.exit_code == 0 and "without weights" not in r.output, r.output


def test_a_quantization_config_naming_fp8_by_its_fmt_is_sized_as_fp8():
    """``native_format`` reads FP8 from ``quant_method`` or from ``fmt`` (a config whose method field is blank or
    another name but whose ``fmt`` says ``FP8_E4M3``): sized as FP8 (1 + 4/128 bytes per expert weight), not refused
    as an unknown quantization nor sized as bf16 (mutation pass 16: the ``fmt`` half of the rule dropped); another
    method is one line."""
    from types import SimpleNamespace

    def cfg(q):
        return SimpleNamespace(quantization_config=q)

    assert P.native_format(cfg({"quant_method": "", "fmt": "FP8_E4M3"})) == "fp8"
    assert P.native_format(cfg({"quant_method": "fp8", "fmt": "e4m3"})) == "fp8"
    assert P.native_format(cfg({"quant_method": "MXFP4"})) == "mxfp4"
    with pytest.raises(MoetoolError, match=r"^quantization 'awq' of this checkpoint is not one moetool can size"):
        P.native_format(cfg({"quant_method": "awq", "fmt": "int4"}))


def _console_rows(output: str, title: str) -> dict[str, list[str]]:
    """The rows of the console table under ``title``: first cell -> the other cells, as printed."""
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if title in ln)
    rows = {}
    for ln in lines[start + 4:]:
        if not ln.startswith("│"):
            break
        cells = [c.strip() for c in ln.strip("│").split("│")]
        rows[cells[0]] = cells[1:]
    return rows


def test_plan_console_tables_write_big_numbers_readably_and_the_csvs_exactly(tmp_path):
    """A newcomer's ``moetool plan --model examples/configs/deepseek-v3 --gpus 8xH100 --nodes 2`` printed parameter
    bytes as raw integers (``1342052808704``) and the tokens/s ceilings as ``2.354e+04`` beside ``4653``. The console
    now writes integers with thousands separators and tokens/s as whole numbers (``23,537``); params.csv and
    throughput.csv keep the exact values, which the printed ones are checked against."""
    import pandas as pd
    from typer.testing import CliRunner

    from moetool.commands.app import app

    cfg = Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3"
    out = tmp_path / "p"
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "--model", str(cfg), "--gpus", "8xH100", "--nodes",
                                                       "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    params = pd.read_csv(out / "params.csv")
    assert params.bytes_bf16.iloc[-1] == 2 * params.params.iloc[-1] > 10 ** 12  # exact integers in the CSV
    shown = _console_rows(r.output, "parameter bytes by group and format")
    assert list(shown) == list(params.group)
    for row in params.itertuples(index=False):
        assert shown[row.group] == [f"{v:,}" for v in row[1:]], (row, shown[row.group])
    assert "1,342,052,808,704" in r.output and "1342052808704" not in r.output
    tput = pd.read_csv(out / "throughput.csv")
    shown = _console_rows(r.output, "ceiling, tokens/s")
    assert sorted(shown) == sorted(tput.command) and "e+" not in " ".join(c for v in shown.values() for c in v)
    for row in tput.itertuples(index=False):  # one layout fits: one value column
        assert shown[row.command] == [f"{round(row.tokens_per_s):,}"], (row, shown[row.command])
    assert tput.tokens_per_s.min() < 10 ** 4 < tput.tokens_per_s.max()  # both magnitudes the issue mixed
