"""``moetool.sizing`` against hand counts: what ``validate_run`` refuses and with which line, and the rows
``--batch-size auto`` takes (``auto_rows``) -- the README's formula with its own numbers (three times the activations
per row, 80 % of the free memory), not the module's constants."""

from __future__ import annotations

import pytest
import torch

from moetool import sizing
from moetool.errors import MoetoolRuntimeError

V, H, HEADS, E = 64, 32, 2, 4  # the config below: vocabulary, hidden size, attention heads, experts
SLACK, SHARE, PROBE_ELEMENTS = 3, 0.8, 2 ** 26  # README "three times"; the docstring's share; probes.DEFAULT_BUDGET


def _mixtral(**kw):
    from transformers import MixtralConfig

    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=1,
                intermediate_size=48, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=128)
    return MixtralConfig(**{**base, **kw})


def _params(config) -> int:
    """Parameters by transformers itself (a real model built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _row(seq: int, probe: bool = False) -> int:
    """One row's activations in fp32: logits, two hidden states, with a probe the [seq, E] expert scores."""
    return seq * (V + 2 * H + probe * E) * 4


# ----- validate_run ------------------------------------------------------------------------------------------------
def test_a_loaded_model_counts_no_weights_against_the_memory_it_left(monkeypatch):
    """``weights_loaded`` (moetool.run on a loaded model): the free memory is what the weights left, so they count 0;
    counting them again refused a batch that fits."""
    act = 3 * _row(100)  # 3 rows of 100 tokens: 153,600 bytes
    monkeypatch.setattr(sizing, "available_memory", lambda dev: act)
    est = sizing.validate_run(_mixtral(), seq_len=100, batch_size=3, device="cpu", dtype="fp32", weights_loaded=True)
    assert (est.params, est.weights_bytes, est.activation_bytes, est.rows_per_batch) == (None, 0, act, 3)
    with pytest.raises(MoetoolRuntimeError):  # the same batch with the weights still to load does not fit
        sizing.validate_run(_mixtral(), seq_len=100, batch_size=3, device="cpu", dtype="fp32")


def test_weights_that_exactly_fill_the_memory_are_refused_for_the_batch_not_the_weights(monkeypatch):
    """Weights equal to the free memory fit; it is the batch beside them that does not, and the line says so."""
    cfg = _mixtral()
    weights = _params(cfg) * 4
    monkeypatch.setattr(sizing, "available_memory", lambda dev: weights)
    with pytest.raises(MoetoolRuntimeError, match="^a batch of 2 rows x --seq-len 50 needs at least"):
        sizing.validate_run(cfg, seq_len=50, batch_size=2, device="cpu", dtype="fp32")
    monkeypatch.setattr(sizing, "available_memory", lambda dev: weights + 2 * _row(50))
    est = sizing.validate_run(cfg, seq_len=50, batch_size=2, device="cpu", dtype="fp32")
    assert (est.weights_bytes, est.activation_bytes) == (weights, 2 * _row(50))


def test_no_batch_size_is_sized_as_one_row(monkeypatch):
    """Without ``batch_size`` the bound is one row (a lower bound: more rows could refuse a run that fits), even when
    ``max_tokens`` fills 10 of them."""
    monkeypatch.setattr(sizing, "available_memory", lambda dev: 10 ** 12)
    est = sizing.validate_run(_mixtral(), seq_len=100, max_tokens=1000, device="cpu", dtype="fp32")
    assert (est.rows_per_batch, est.activation_bytes) == (1, _row(100))


def test_bf16_and_fp16_are_the_dtypes_they_name():
    """``--dtype bf16`` is bfloat16, not float16 (both 2 bytes: the memory numbers cannot tell them apart)."""
    from moetool.loading import pick_dtype

    cpu = torch.device("cpu")
    assert [pick_dtype(d, _mixtral(), cpu) for d in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16,
                                                                                  torch.float32]
    est = sizing.validate_run(_mixtral(), seq_len=16, device="cpu", dtype="bf16", check_memory=False)
    assert est.dtype == "bfloat16"


# ----- --batch-size auto -----------------------------------------------------------------------------------------
def _auto(monkeypatch, free, **kw):
    monkeypatch.setattr(sizing, "available_memory", lambda dev: free)
    args = dict(device=torch.device("cpu"), dtype=torch.float32, seq_len=64, max_tokens=10 ** 6)
    return sizing.auto_rows(_mixtral(**kw.pop("config", {})), **{**args, **kw})


def test_auto_rows_is_the_readme_formula(monkeypatch):
    """rows = floor(0.8 x (free - weights) / (3 x one row)); the row bytes and the rows in the facts."""
    weights = 10 ** 6
    for k in (1, 4, 9):
        free = weights + (k + 0.5) * SLACK * _row(64) / SHARE
        rows, facts = _auto(monkeypatch, int(free), params=weights // 4)
        assert (rows, facts["memory_rows"], facts["row_bytes"], facts["weights_bytes"]) == (k, k, SLACK * _row(64),
                                                                                            weights)


def test_auto_rows_of_a_probing_policy_count_its_scores_per_row(monkeypatch):
    """A policy that probes every expert: per row the [seq, E] fp32 scores (1,024 bytes at seq 64, E 4) on top of the
    forward, and 2^26 fp32 chunk elements once."""
    from moetool.policies import POLICIES

    norm = POLICIES.get("norm")
    assert norm.needs_probe
    free = 4 * PROBE_ELEMENTS + 7.5 * SLACK * _row(64, probe=True) / SHARE
    rows, facts = _auto(monkeypatch, int(free), policies=[norm])
    assert facts["row_bytes"] == SLACK * (_row(64) + 64 * E * 4) and facts["probe_bytes"] == 4 * PROBE_ELEMENTS
    assert rows == 7


def test_auto_rows_share_the_ram_of_a_node_but_not_a_gpu(monkeypatch):
    """``processes`` ranks on a node share its RAM (each gets 1/processes); each rank's GPU is its own."""
    free = int(8.5 * SLACK * _row(64) / SHARE)
    assert _auto(monkeypatch, free)[0] == 8
    assert _auto(monkeypatch, free, processes=2)[0] == 4  # floor(0.8 x free / 2 / row) = floor(4.25)
    assert _auto(monkeypatch, free, device=torch.device("cuda"), processes=2)[0] == 8


def test_auto_rows_with_unknown_free_memory_take_8_at_most_what_the_data_fill(monkeypatch):
    """Free memory unknown: 8 rows, or fewer when --max-tokens fills fewer (128 tokens of 64: 2 rows; 1 per rank on
    2 ranks)."""
    assert _auto(monkeypatch, None, max_tokens=10 ** 6)[0] == 8
    rows, facts = _auto(monkeypatch, None, max_tokens=128)
    assert rows == facts["rows"] == 2 and facts["reason"] == "free memory unknown: default 8"
    assert _auto(monkeypatch, None, max_tokens=128, world=2)[0] == 1


def test_auto_rows_without_a_seq_len_size_rows_of_the_context_at_most_2048(monkeypatch):
    """lm-eval (no --seq-len): rows of the model's positions, capped at 2048."""
    free = int(2.5 * SLACK * _row(2048) / SHARE)
    rows, facts = _auto(monkeypatch, free, seq_len=None, max_tokens=None, config=dict(max_position_embeddings=4096))
    assert (rows, facts["seq_len"], facts["row_bytes"]) == (2, 2048, SLACK * _row(2048))
    rows, facts = _auto(monkeypatch, free, seq_len=None, max_tokens=None, config=dict(max_position_embeddings=1024))
    assert (rows, facts["seq_len"]) == (5, 1024)


def test_auto_batch_size_with_a_device_map_counts_no_weights(monkeypatch):
    """``--device-map auto``: accelerate places (and offloads) the weights, so the free memory is all the batch's;
    without it the tiny model's weights (its parameters x 4 bytes) come off first."""
    from moetool.loading import load_config

    config = load_config("tiny")[0]
    row = 64 * (config.vocab_size + 2 * config.hidden_size) * 4
    weights = _params(config) * 4
    free = int(weights + 3.5 * SLACK * row / SHARE)  # 3.5 rows beside the weights
    monkeypatch.setattr(sizing, "available_memory", lambda dev: free)
    assert sizing.auto_batch_size("tiny", seq_len=64, max_tokens=10 ** 6, device="cpu")[0] == 3
    want = int(SHARE * free // (SLACK * row))
    assert want > 3
    assert sizing.auto_batch_size("tiny", seq_len=64, max_tokens=10 ** 6, device="cpu", device_map="auto")[0] == want


def test_memory_in_the_messages_is_mib_below_a_tenth_of_a_gib():
    assert [sizing._gib(n) for n in (50 * 2 ** 20, 2 ** 30 // 10 - 1, -(-2 ** 30 // 10), 3 * 2 ** 29)] == [
        "50 MiB", "102 MiB", "0.1 GiB", "1.5 GiB"]


def test_available_ram_is_capped_by_the_cgroup_limit_less_its_usage(monkeypatch):
    """RAM available 8 GiB; a cgroup v2 limit of 4 GiB with 3 GiB used leaves 1 GiB; used past the limit, 0; no
    limit ("max"), the 8 GiB."""
    import sys
    import types

    GiB = 2 ** 30
    files: dict[str, str] = {}

    class FakePath:
        def __init__(self, name):
            self.name = str(name)

        def read_text(self):
            if self.name not in files:
                raise OSError(self.name)
            return files[self.name]

    monkeypatch.setitem(sys.modules, "psutil", types.SimpleNamespace(
        virtual_memory=lambda: types.SimpleNamespace(available=8 * GiB)))
    monkeypatch.setattr(sizing, "Path", FakePath)
    for limit, used, want in ((4 * GiB, 3 * GiB, GiB), (4 * GiB, 5 * GiB, 0), ("max", GiB, 8 * GiB),
                              (16 * GiB, GiB, 8 * GiB)):
        files.update({"/sys/fs/cgroup/memory.max": f"{limit}\n", "/sys/fs/cgroup/memory.current": f"{used}\n"})
        assert sizing._meminfo_available() == want, (limit, used)


def test_eager_attention_adds_the_attention_probabilities_of_every_head(monkeypatch):
    """``attn_implementation="eager"`` materialises ``rows x heads x S x S`` probabilities: validate_run counts them
    (3 rows x 2 heads x 100^2 x 4 bytes = 240,000 on top of the logits and hidden states), and ``--batch-size auto``
    for a policy that reads attention sizes each row with its 2 x 64^2 fp32 probabilities (mutation pass 13: the
    term as ``heads x S`` passed every test)."""
    from types import SimpleNamespace

    S, rows = 100, 3
    plain = rows * S * (V + 2 * H) * 4
    monkeypatch.setattr(sizing, "available_memory", lambda dev: 10 ** 12)
    for attn, act in ((None, plain), ("sdpa", plain), ("eager", plain + rows * HEADS * S * S * 4)):
        est = sizing.validate_run(_mixtral(), seq_len=S, batch_size=rows, device="cpu", dtype="fp32",
                                  attn_implementation=attn, weights_loaded=True)
        assert est.activation_bytes == act
    reader = SimpleNamespace(needs_attention=True, needs_probe=False)
    row = _row(64) + HEADS * 64 * 64 * 4
    free = int(5.5 * SLACK * row / SHARE)
    rows_got, facts = _auto(monkeypatch, free, policies=[reader])
    assert (rows_got, facts["row_bytes"]) == (5, SLACK * row)


def test_auto_rows_are_capped_at_1024_when_memory_and_data_allow_more(monkeypatch):
    """Memory for 5,000 rows and data for 15,625 (10^6 tokens of 64) take the cap, 1,024 rows (mutation pass 13:
    without the cap, 5,000), with memory_rows and data_rows beside it."""
    rows, facts = _auto(monkeypatch, int(5000.5 * SLACK * _row(64) / SHARE))
    assert (rows, facts["memory_rows"], facts["data_rows"], facts["reason"]) == (1024, 5000, 15625, "cap")


def test_a_quantized_model_counts_no_weight_bytes():
    """A quantized checkpoint (a config's quantization_config) or --quantize: the weights' size depends on the kernel,
    so they count 0 bytes, the activations as unquantized (mutation pass 13: without the check, 1,000 parameters
    counted 4,000 fp32 bytes)."""
    S, rows = 16, 2
    act = rows * S * (V + 2 * H) * 4
    kw = dict(seq_len=S, rows=rows, dtype=torch.float32, params=1000)
    assert sizing.estimate_memory(_mixtral(), **kw) == (4000, act)
    assert sizing.estimate_memory(_mixtral(), quantize="int8", **kw) == (0, act)
    quantized = _mixtral()
    quantized.quantization_config = {"quant_method": "fp8"}
    assert sizing.estimate_memory(quantized, **kw) == (0, act)
