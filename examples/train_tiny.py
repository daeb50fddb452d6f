#!/usr/bin/env python3
"""Build moetool's embedded default models: tiny MoE causal LMs trained briefly
on CPU with transformers' own model classes.

Pipeline (all offline, deterministic given the CPython/torch/transformers versions):

1. ``examples/build_corpus.py`` -> train / validation JSONL (Python stdlib code and
   Python documentation prose, PSF-2.0).  The validation documents that fit in
   the training context (<= seq_len - 1 tokens) are the validation split and are
   written to ``moetool/embedded/data/heldout.jsonl``.
2. A byte-level BPE tokenizer (``tokenizers``; vocab 2048, ``<|endoftext|>`` as
   eos / bos / pad) trained on the train split, wrapped as
   ``transformers.PreTrainedTokenizerFast``.
3. Two models, each trained with AdamW + linear warmup + cosine decay on packed
   token chunks, with the router load-balancing aux loss:

   * ``tiny``      -- ``MixtralForCausalLM``: 4 layers, 8 experts, top-2.
   * ``tiny-fine`` -- ``Qwen3MoeForCausalLM``: 4 layers, 32 experts, top-4.

   An early checkpoint (``--early-frac`` of training) and the final one are
   saved as separate model directories (``<name>-early`` and ``<name>``) with the
   tokenizer, ``training_curve.csv`` and ``train_meta.json``.  Weights are
   stored as float16 to fit the package size budget; ``config.dtype`` stays
   float32 so ``from_pretrained`` loads (upcasts) them in float32.  Reported
   validation numbers are for the stored (float16-rounded) weights.
4. Validation loss and routing statistics (expert load entropy, per-token
   routing entropy, per-domain load) on the validation split, computed by
   moetool itself (``moetool.engine.forward`` and ``moetool.stats``), and a
   round-trip check in a fresh process with ``HF_HUB_OFFLINE=1``.
   ``moetool/embedded/README.md`` is written from the measured numbers.

Models are trained in parallel subprocesses (``--jobs``, default 2), each with
``--threads`` torch threads (default 1): on a shared 2-core machine, one
single-threaded process per core is far more robust than two-thread processes.

Rebuild everything:  python examples/train_tiny.py
Recompute and check the README's numbers from the shipped weights (no training):
    python examples/train_tiny.py --check-readme
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_OUT = REPO / "moetool" / "embedded"
EOS = "<|endoftext|>"
MODELS = ("tiny", "tiny-fine")


# ----------------------------------------------------------------------------- utils
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def set_seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_config(name: str, vocab_size: int, eos_id: int, max_pos: int):
    """The two architectures.  Sizes chosen for CPU training speed and the
    package size budget (~2.8M parameters each, ~5.7 MB in float16)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        output_router_logits=True,  # aux load-balancing loss during training
        router_aux_loss_coef=0.01,
        use_cache=True,
        attention_dropout=0.0,
    )
    if name == "tiny":
        return MixtralConfig(
            intermediate_size=192,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            **common,
        )
    if name == "tiny-fine":
        return Qwen3MoeConfig(
            head_dim=32,
            intermediate_size=256,  # dense-MLP size; unused (every layer is MoE)
            moe_intermediate_size=48,
            num_experts=32,
            num_experts_per_tok=4,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        )
    raise ValueError(name)


def model_class(name: str):
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    return {"tiny": MixtralForCausalLM, "tiny-fine": Qwen3MoeForCausalLM}[name]


# ------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Name the class by its transformers-4.x compatible alias (5.x maps it to
    # TokenizersBackend), so the files also load with older transformers.
    tc = out_dir / "tokenizer_config.json"
    tcfg = json.loads(tc.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.write_text(json.dumps(tcfg, indent=2) + "\n")
    return fast


def encode_docs(tok, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False)["input_ids"]


def pack(docs_ids: list[list[int]], eos_id: int) -> list[int]:
    """Concatenate documents, each followed by EOS."""
    stream: list[int] = []
    for ids in docs_ids:
        stream.extend(ids)
        stream.append(eos_id)
    return stream


def val_chunks(docs_ids: list[list[int]], eos_id: int, seq_len: int) -> list[list[int]]:
    """Pack validation documents (in file order) into chunks of ``seq_len``
    tokens (the last one may be shorter).  Loss targets are chunk[1:]."""
    stream = pack(docs_ids, eos_id)
    return [stream[i : i + seq_len] for i in range(0, len(stream), seq_len) if len(stream[i : i + seq_len]) > 1]


def unigram_ppl(train_stream: list[int], val_by_domain: dict, vocab_size: int) -> dict:
    """Add-one smoothed unigram LM estimated on the train tokens, evaluated on
    exactly the validation target tokens the models are scored on."""
    import numpy as np

    counts = np.bincount(np.asarray(train_stream), minlength=vocab_size).astype(np.float64)
    logp = np.log((counts + 1.0) / (counts.sum() + vocab_size))
    out, tot_nll, tot_n = {}, 0.0, 0
    for dom, chunks in val_by_domain.items():
        tgt = np.concatenate([np.asarray(c[1:]) for c in chunks])
        nll = float(-logp[tgt].sum())
        out[dom] = {"loss": nll / len(tgt), "ppl": math.exp(nll / len(tgt)), "tokens": int(len(tgt))}
        tot_nll += nll
        tot_n += len(tgt)
    out["all"] = {"loss": tot_nll / tot_n, "ppl": math.exp(tot_nll / tot_n), "tokens": tot_n}
    return out


# ------------------------------------------------------------------------ evaluation
# Every number below comes from moetool itself: the loss from the one forward loop (moetool.engine.forward,
# nll=True: next-token NLL of real tokens), the routing statistics from the `stats` experiment (moetool.stats, whose
# entropies are moetool.ops.entropy: load fractions, load entropy, confidence entropy = per-token routing entropy,
# per-domain load). The README of the embedded models is computed by the same code as `moetool stats` / `moetool
# ppl`; `--check-readme` recomputes it from the shipped weights.
def as_lm(model):
    """A trained model as moetool's experiments take it (``.model``, ``.layers``, ``.tokenizer``)."""
    from moetool.adapters import find_moe_layers

    return SimpleNamespace(model=model, layers=find_moe_layers(model), tokenizer=None)


def token_set(val_by_domain: dict, pad_id: int, max_chunks: int | None = None):
    """The validation chunks as a moetool ``TokenSet``: one row per chunk (the shorter last chunk of a domain
    right-padded, padding masked out), the domain of each row."""
    import torch

    from moetool.data import TokenSet

    rows, doms = [], []
    for dom, chunks in val_by_domain.items():
        for c in (chunks if max_chunks is None else chunks[:max_chunks]):
            rows.append(c)
            doms.append(dom)
    S = max(len(c) for c in rows)
    ids = torch.tensor([c + [pad_id] * (S - len(c)) for c in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(c) + [0] * (S - len(c)) for c in rows], dtype=torch.long)
    return TokenSet(ids, mask, doms, "validation split")


def evaluate(model, val_by_domain: dict, batch_size: int = 16, max_chunks: int | None = None,
             routing: bool = False, pad_id: int = 0) -> dict:
    """Token-level cross entropy on packed validation chunks, per domain and overall (moetool.engine.forward
    with ``nll=True``). With ``routing=True`` also the routing statistics of :func:`routing_summary`."""
    from moetool.engine import forward

    model.eval()
    was = getattr(model.config, "output_router_logits", False)
    model.config.output_router_logits = False  # training-only output: no aux loss inside the forward
    try:
        lm = as_lm(model)
        stats: dict = {}
        for dom in val_by_domain:
            res = forward(lm, token_set({dom: val_by_domain[dom]}, pad_id, max_chunks), nll=True,
                          batch_size=batch_size, quiet=True)
            stats[dom] = {"loss": res.nll.mean, "ppl": res.nll.ppl, "tokens": res.nll.tokens, "_nll": res.nll.nll_sum}
        tot_nll = sum(v.pop("_nll") for v in stats.values())
        tot_n = sum(v["tokens"] for v in stats.values())
        stats["all"] = {"loss": tot_nll / tot_n, "ppl": math.exp(tot_nll / tot_n), "tokens": tot_n}
        if routing:
            stats["routing"] = routing_summary(lm, val_by_domain, pad_id, batch_size)
    finally:
        model.config.output_router_logits = was
    return stats


def routing_summary(lm, val_by_domain: dict, pad_id: int, batch_size: int = 16) -> list[dict]:
    """Per MoE layer, from ``moetool.stats`` on all validation chunks and on each domain's: load fractions
    (``load_fraction``: share of all top-K assignments), load entropy and mean per-token routing entropy
    (``confidence_entropy``), dead experts, and the code-vs-prose total-variation distance of the loads."""
    import moetool

    def run(chunks: dict):
        res = moetool.stats(lm, token_set(chunks, pad_id), quiet=True, top_tokens=0, batch_size=batch_size)
        return res.tables["layers.csv"].set_index("layer"), res.tables["load.csv"]

    layers, load = run(val_by_domain)
    per_dom = {dom: run({dom: chunks}) for dom, chunks in val_by_domain.items()}
    out = []
    for li, row in layers.iterrows():
        frac = load[load.layer == li].sort_values("expert")["load_fraction"].tolist()
        n = int(row["n_experts"])
        entry = {
            "layer": int(li),
            "num_experts": n,
            "log_n": math.log(n),
            "load_entropy": float(row["load_entropy"]),
            "mean_routing_entropy": float(row["confidence_entropy"]),
            "min_load_frac": min(frac),
            "max_load_frac": max(frac),
            "dead_experts": [e for e, f in enumerate(frac) if f == 0.0],
            "load_frac": [round(f, 5) for f in frac],
            "by_domain": {},
        }
        for dom, (dl, dload) in per_dom.items():
            f = dload[dload.layer == li].sort_values("expert")["load_fraction"].tolist()
            entry["by_domain"][dom] = {"load_frac": [round(x, 5) for x in f],
                                       "load_entropy": float(dl.loc[li, "load_entropy"]),
                                       "mean_routing_entropy": float(dl.loc[li, "confidence_entropy"])}
        if {"code", "prose"} <= set(entry["by_domain"]):
            fc = entry["by_domain"]["code"]["load_frac"]
            fp = entry["by_domain"]["prose"]["load_frac"]
            # total variation distance between the two domains' expert loads
            entry["code_vs_prose_tv"] = 0.5 * sum(abs(a - b) for a, b in zip(fc, fp))
            ratio = sorted(((e, (a + 1e-9) / (b + 1e-9)) for e, (a, b) in enumerate(zip(fc, fp))), key=lambda t: t[1])
            entry["most_prose_expert"] = {"expert": ratio[0][0], "code": fc[ratio[0][0]], "prose": fp[ratio[0][0]]}
            entry["most_code_expert"] = {"expert": ratio[-1][0], "code": fc[ratio[-1][0]], "prose": fp[ratio[-1][0]]}
        out.append(entry)
    return out


# -------------------------------------------------------------------------- training
def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def batches(train_docs: list[list[int]], eos_id: int, seq_len: int, batch_size: int, seed: int):
    """Infinite iterator of [B, seq_len] batches: each epoch shuffles the
    document order, packs (docs joined by EOS) into seq_len chunks and
    shuffles the chunks."""
    import torch

    epoch = 0
    while True:
        rng = random.Random(seed * 1000 + epoch)
        order = list(range(len(train_docs)))
        rng.shuffle(order)
        stream = pack([train_docs[i] for i in order], eos_id)
        n = len(stream) // seq_len
        chunks = [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]
        rng.shuffle(chunks)
        for i in range(0, n - batch_size + 1, batch_size):
            yield epoch, torch.tensor(chunks[i : i + batch_size], dtype=torch.long)
        epoch += 1


def save_checkpoint(model, tok_dir: Path, out_dir: Path, meta: dict, curve: list[dict], save_dtype: str) -> None:
    import shutil

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.iterdir():  # start from an empty directory
        if f.is_file():
            f.unlink()
    cfg = model.config
    cfg.output_router_logits = False
    cfg.use_cache = True
    dt = getattr(torch, save_dtype)
    state = {k: v.detach().to(dt) if v.is_floating_point() else v.detach() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    cfg.output_router_logits = True
    for f in sorted(tok_dir.iterdir()):  # the tokenizer exactly as trained and saved
        if f.is_file():
            shutil.copy2(f, out_dir / f.name)
    write_curve(out_dir / "training_curve.csv", curve)
    (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


CURVE_FIELDS = ["step", "tokens_seen", "epoch", "lr", "train_loss", "aux_loss", "val_loss_subset",
                "val_loss", "val_ppl", "elapsed_s"]


def write_curve(path: Path, curve: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
        w.writeheader()
        for row in curve:
            w.writerow({k: row.get(k, "") for k in CURVE_FIELDS})


def reload_and_eval(path: Path, val_by_domain: dict) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path)
    return evaluate(m, val_by_domain, routing=True)


def load_training_data(work: Path, corpus_dir: Path) -> SimpleNamespace:
    """What the parent process prepared in ``work`` for the training processes: the tokenizer, the encoded train
    documents and validation chunks, the unigram baseline, the validation-document counts and the corpus manifest."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    enc = json.loads((work / "encoded.json").read_text())
    return SimpleNamespace(
        tok=tok,
        train_docs=enc["train"],
        val_by_domain=enc["val"],
        unigram=json.loads((work / "unigram.json").read_text()),
        manifest=json.loads((corpus_dir / "manifest.json").read_text()),
        val_docs=json.loads((work / "val_docs.json").read_text()),
    )


def build_model(name: str, tok, args):
    """A freshly initialised model ``name`` (from the current torch seed) in training mode."""
    import torch

    cfg = model_config(name, len(tok), tok.eos_token_id, args.max_position_embeddings)
    cfg._experts_implementation = args.experts_implementation
    model = model_class(name)(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {type(model).__name__} {n_params / 1e6:.3f}M params, experts={args.experts_implementation}, "
        f"threads={torch.get_num_threads()}")
    return model


def make_optimizer(model, args):
    """AdamW with weight decay on the matrices (embeddings excluded), none on vectors."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def checkpoint_steps(args) -> dict[int, str]:
    """{step: checkpoint kind}: early, optionally mid, and final."""
    total = args.steps
    ckpts = {max(1, int(round(args.early_frac * total))): "early", total: "final"}
    if args.mid_frac:
        ckpts[max(1, int(round(args.mid_frac * total)))] = "mid"
    return ckpts


def train_step(model, opt, x, aux_loss: str, grad_clip: float):
    """One optimizer step on the batch ``x``; returns the (LM loss, aux loss) tensors."""
    import torch

    cfg = model.config
    if aux_loss == "hf":
        # transformers' own: one Switch-style loss over all layers' router
        # logits concatenated (balances the load summed over layers only)
        out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
        loss = out.loss
        aux_t = out.aux_loss
        lm_t = out.loss - cfg.router_aux_loss_coef * out.aux_loss
    else:
        # the same Switch-style loss (transformers' load_balancing_loss_func)
        # applied to each MoE layer separately and averaged over layers, so
        # that an expert cannot die in one layer while balanced in aggregate
        lb_loss = sys.modules[type(model).__module__].load_balancing_loss_func
        n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits
        lm_t = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        aux_t = torch.stack([lb_loss((rl,), n_experts, cfg.num_experts_per_tok) for rl in out.router_logits]).mean()
        loss = lm_t + cfg.router_aux_loss_coef * aux_t
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return lm_t, aux_t


def checkpoint_meta(name: str, kind: str, step: int, model, args, data: SimpleNamespace, train_wall_s: float) -> dict:
    """``train_meta.json`` of a checkpoint before its evaluation (which :func:`save_and_score` adds)."""
    import tokenizers
    import torch
    import transformers

    cfg = model.config
    tokens_seen = step * args.batch_size * args.seq_len
    manifest = data.manifest
    return {
        "name": checkpoint_dir(args, name, kind).name,
        "model": name,
        "checkpoint": kind,
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "step": step,
        "total_steps": args.steps,
        "tokens_seen": tokens_seen,
        "epochs_seen": tokens_seen / len(pack(data.train_docs, data.tok.eos_token_id)),
        "train_wall_s": round(train_wall_s, 1),
        "seed": args.seed,
        "command": args.command,
        "hyperparameters": {k: getattr(args, k) for k in (
            "steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_frac", "weight_decay",
            "grad_clip", "threads", "experts_implementation", "early_frac", "mid_frac", "aux_loss")}
        | {"optimizer": "AdamW(betas=(0.9,0.95), eps=1e-8)", "schedule": "linear warmup + cosine",
           "router_aux_loss_coef": cfg.router_aux_loss_coef},
        "weights_dtype": args.save_dtype,
        "unigram_baseline": data.unigram,
        "validation_docs": data.val_docs,
        "corpus": {"sources": manifest["sources"], "files": manifest["files"],
                   "python_version": manifest["python_version"], "stats": manifest["stats"]},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(data.tok), "eos_token": EOS},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }


def checkpoint_dir(args, name: str, kind: str) -> Path:
    return Path(args.out_dir) / (name if kind == "final" else f"{name}-{kind}")


def save_and_score(model, d: Path, meta: dict, curve: list[dict], data: SimpleNamespace, args, work: Path) -> dict:
    """Save the checkpoint once, then evaluate exactly what was stored (fp16-rounded weights): the full validation
    numbers go into the last curve row and ``meta``, both rewritten in ``d``."""
    save_checkpoint(model, work / "tokenizer", d, meta, curve, args.save_dtype)
    ev = reload_and_eval(d, data.val_by_domain)
    row = curve[-1]
    row["val_loss"] = f"{ev['all']['loss']:.5f}"
    row["val_ppl"] = f"{ev['all']['ppl']:.3f}"
    meta["val"] = {k: v for k, v in ev.items() if k != "routing"}
    meta["val_loss"] = ev["all"]["loss"]
    meta["val_ppl"] = ev["all"]["ppl"]
    meta["unigram_val_ppl"] = data.unigram["all"]["ppl"]
    meta["routing"] = ev["routing"]
    write_curve(d / "training_curve.csv", curve)
    (d / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    log(f"{meta['model']} saved {meta['checkpoint']} checkpoint -> {d}: val loss {ev['all']['loss']:.4f} "
        f"ppl {ev['all']['ppl']:.2f} (unigram ppl {data.unigram['all']['ppl']:.2f})")
    return {"dir": str(d), "val_loss": ev["all"]["loss"], "val_ppl": ev["all"]["ppl"]}


def train_one(name: str, args, work: Path) -> dict:
    """Train one model (runs in its own process): the training loop, with a curve row every ``--log-every`` steps,
    a validation-subset loss every ``--eval-every`` steps and a saved, scored checkpoint at each checkpoint step."""
    import torch

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    t_start = time.time()
    data = load_training_data(work, Path(args.corpus_dir))
    model = build_model(name, data.tok, args)
    opt = make_optimizer(model, args)
    total = args.steps
    warmup = max(1, int(args.warmup_frac * total))
    ckpts = checkpoint_steps(args)
    tokens_per_step = args.batch_size * args.seq_len
    it = batches(data.train_docs, data.tok.eos_token_id, args.seq_len, args.batch_size, args.seed)
    curve: list[dict] = []
    acc_loss = acc_aux = 0.0
    acc_n = 0
    results = {}
    t_train = time.time()
    for step in range(1, total + 1):
        lr = lr_at(step - 1, total, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        epoch, x = next(it)
        lm_t, aux_t = train_step(model, opt, x, args.aux_loss, args.grad_clip)
        acc_loss += lm_t.detach().item()
        acc_aux += aux_t.detach().item()
        acc_n += 1
        row = None
        if step % args.log_every == 0 or step in ckpts:
            row = {"step": step, "tokens_seen": step * tokens_per_step, "epoch": epoch, "lr": f"{lr:.6g}",
                   "train_loss": f"{acc_loss / acc_n:.5f}", "aux_loss": f"{acc_aux / acc_n:.5f}"}
            acc_loss = acc_aux = 0.0
            acc_n = 0
        if step % args.eval_every == 0 or step in ckpts:
            ev = evaluate(model, data.val_by_domain, max_chunks=args.eval_chunks)
            row["val_loss_subset"] = f"{ev['all']['loss']:.5f}"
            model.train()
        if row is not None:
            row["elapsed_s"] = f"{time.time() - t_train:.1f}"
            curve.append(row)
            el = time.time() - t_train
            log(f"{name} step {step}/{total} ep {epoch} lr {lr:.2e} loss {row['train_loss']} aux {row['aux_loss']}"
                + (f" val~ {row['val_loss_subset']}" if "val_loss_subset" in row else "")
                + f" | {step * tokens_per_step / el:.0f} tok/s, eta {el / step * (total - step) / 60:.1f} min")
        if step in ckpts:
            kind = ckpts[step]
            meta = checkpoint_meta(name, kind, step, model, args, data, time.time() - t_train)
            results[kind] = save_and_score(model, checkpoint_dir(args, name, kind), meta, curve, data, args, work)
            model.train()
    results["wall_s"] = time.time() - t_start
    return results


# ------------------------------------------------------------------------ verification
def verify_dirs(dirs: list[str], work: Path, threads: int, seq_len: int) -> dict:
    """Run in a fresh process with HF_HUB_OFFLINE=1: load each directory with
    the Auto classes, check the load report, re-tokenize the validation split
    with the loaded tokenizer and recompute the validation loss."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    records: list[str] = []

    class H(logging.Handler):
        def emit(self, rec):
            records.append(f"{rec.levelname}: {rec.getMessage()}")

    transformers.logging.set_verbosity_warning()
    transformers.logging.get_logger("transformers").addHandler(H())
    val_rows = read_jsonl(Path(json.loads((work / "paths.json").read_text())["validation"]))
    out = {}
    for d in dirs:
        records.clear()
        tok = AutoTokenizer.from_pretrained(d)
        model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        by_dom: dict[str, list[list[int]]] = {}
        for r in val_rows:
            by_dom.setdefault(r["domain"], []).append(r["text"])
        val = {dom: val_chunks(encode_docs(tok, texts), tok.eos_token_id, seq_len) for dom, texts in sorted(by_dom.items())}
        ev = evaluate(model, val)
        meta = json.loads((Path(d) / "train_meta.json").read_text())
        out[d] = {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "eos_token_id": tok.eos_token_id,
            "model_class": type(model).__name__,
            "dtype": str(model.dtype),
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "warnings": list(records),
            "val_loss": ev["all"]["loss"],
            "meta_val_loss": meta["val_loss"],
            "abs_diff": abs(ev["all"]["loss"] - meta["val_loss"]),
        }
    return out


# ------------------------------------------------------------------------------ README
def measured_lines(out_dir: Path, dirs: list[str], metas: dict | None = None) -> dict[str, list[str]]:
    """The README lines that carry measured numbers, by section, from each directory's ``train_meta.json`` (or
    ``metas[d]``): the models table, the validation-perplexity table, the routing bullets and the routing table."""
    metas = metas or {}
    out: dict[str, list[str]] = {"models": [], "val": [], "bullets": [], "routing": []}
    for d in dirs:
        m = metas.get(d) or json.loads((out_dir / d / "train_meta.json").read_text())
        cfg = json.loads((out_dir / d / "config.json").read_text())
        E = cfg.get("num_local_experts", cfg.get("num_experts"))
        k = cfg["num_experts_per_tok"]
        out["models"].append(
            f"| `{d}` | {m['architecture']} (`{m['model_type']}`) | {E} / {k} | "
            f"{m['num_parameters'] / 1e6:.2f}M | {m['checkpoint']} (step {m['step']}/{m['total_steps']}) | "
            f"{m['tokens_seen'] / 1e6:.2f}M | {m['val_loss']:.3f} | {m['val_ppl']:.2f} | {m['unigram_val_ppl']:.2f} |")
        v, u = m["val"], m["unigram_baseline"]
        out["val"].append(f"| `{d}` | {v['all']['ppl']:.2f} | {v['code']['ppl']:.2f} | {v['prose']['ppl']:.2f} | "
                          f"{u['all']['ppl']:.1f} / {u['code']['ppl']:.1f} / {u['prose']['ppl']:.1f} |")
        if m["checkpoint"] != "final":
            continue
        R = m["routing"]
        le = [r["load_entropy"] / r["log_n"] for r in R]
        re_ = [r["mean_routing_entropy"] / r["log_n"] for r in R]
        tv = [r["code_vs_prose_tv"] for r in R]
        out["bullets"].append(
            f"- `{d}`: aggregate load per layer close to uniform (load entropy {min(le):.3f}–{max(le):.3f} × log n; "
            f"min load fraction {min(r['min_load_frac'] for r in R):.3f}, no dead expert) — that is what the "
            f"load-balancing loss is for; per token the routing is clearly not uniform (routing entropy "
            f"{min(re_):.2f}–{max(re_):.2f} × log n; a router spreading its mass evenly over exactly k={k} experts "
            f"would give log k = {math.log(k):.3f}) and it differs by domain (code-vs-prose TV {min(tv):.2f}–{max(tv):.2f}).")
        for r in R:
            mc, mp = r["most_code_expert"], r["most_prose_expert"]
            out["routing"].append(
                f"| `{d}` | {r['layer']} | {r['log_n']:.3f} | {r['load_entropy']:.3f} | {r['mean_routing_entropy']:.3f} | "
                f"{r['min_load_frac']:.3f} / {r['max_load_frac']:.3f} | {len(r['dead_experts'])} | "
                f"{r['code_vs_prose_tv']:.3f} | #{mc['expert']} ({mc['code']:.3f}/{mc['prose']:.3f}) | "
                f"#{mp['expert']} ({mp['code']:.3f}/{mp['prose']:.3f}) |")
    return out


def readme_intro(numbers: dict, args) -> list[str]:
    """Title, the models table, the architecture and the files of a model directory."""
    lines = []
    a = lines.append
    a("# moetool embedded default models")
    a("")
    a("Tiny Mixture-of-Experts causal LMs trained briefly on CPU with transformers' own model classes, "
      "shipped so every moetool command works offline out of the box. They are research fixtures for "
      "routing analysis, **not** useful language models.")
    a("")
    a("| dir | class (model_type) | experts / top-k | params | checkpoint | tokens seen | val loss | val ppl | unigram ppl |")
    a("|---|---|---|---|---|---|---|---|---|")
    lines.extend(numbers["models"])
    a("")
    a("Common architecture: 4 layers, hidden size 128, 4 attention heads / 2 KV heads, RoPE, "
      f"max_position_embeddings {args.max_position_embeddings}, tied input/output embeddings, every layer MoE. "
      "`tiny`: Mixtral, expert intermediate size 192, softmax → top-2 → renormalize. "
      "`tiny-fine`: Qwen3-MoE, expert intermediate size 48, softmax → top-4 → renormalize (`norm_topk_prob=True`), "
      "`decoder_sparse_step=1`, `mlp_only_layers=[]`.")
    a("")
    a("Each directory is a complete `save_pretrained` model directory plus tokenizer files, so")
    a("")
    a("```python")
    a("from transformers import AutoModelForCausalLM, AutoTokenizer  # works with HF_HUB_OFFLINE=1")
    a("model = AutoModelForCausalLM.from_pretrained(d); tok = AutoTokenizer.from_pretrained(d)")
    a("```")
    a("")
    a("Weights are stored as **float16** (package size budget) while `config.json` keeps `dtype: float32`, "
      "so `from_pretrained` upcasts them to float32. All numbers here are for the stored weights evaluated in "
      "float32. `config.output_router_logits` is `false` (it was `true` during training).")
    a("")
    a("Files per directory: `config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`, "
      "`tokenizer_config.json`, `training_curve.csv` (step, tokens seen, lr, train LM loss and aux loss averaged "
      f"over {args.log_every} steps, validation loss on a {args.eval_chunks}-chunk-per-domain subset every "
      f"{args.eval_every} steps, full validation loss/ppl at checkpoints), `train_meta.json` (hyperparameters, "
      "command, seed, corpus sources and hashes, validation numbers per domain, unigram baseline, routing "
      "statistics).")
    a("")
    return lines


def readme_tokenizer(summary: dict) -> list[str]:
    return [
        "## Tokenizer",
        "",
        f"Byte-level BPE trained with `tokenizers` on the train split, vocabulary {summary['vocab_size']}, "
        f"`{EOS}` is eos, bos and pad token (documents are separated by it in training). "
        "Wrapped as `PreTrainedTokenizerFast`; no special tokens are added automatically.",
        "",
    ]


def readme_training(summary: dict, args) -> list[str]:
    """The training recipe, the rebuild command and the versions it was built with."""
    lines = []
    a = lines.append
    a("## Training")
    a("")
    a(f"AdamW (β=(0.9, 0.95), weight decay {args.weight_decay} on matrices), peak lr {args.lr}, "
      f"linear warmup {args.warmup_frac:.0%} then cosine decay to {args.min_lr_ratio:.0%} of peak, "
      f"grad-clip {args.grad_clip}, {args.steps} steps × batch {args.batch_size} × {args.seq_len} tokens "
      f"(packed chunks, documents joined by `{EOS}`, reshuffled every epoch), seed {args.seed}, "
      "router load-balancing aux loss with coefficient 0.01 (`output_router_logits=True` during training; "
      + ("transformers' `load_balancing_loss_func` applied to each layer's router logits separately and averaged "
         "over layers, instead of once over all layers concatenated as the model's built-in loss does, so that no "
         "expert can die in one layer while the load summed over layers looks balanced), "
         if args.aux_loss == "per-layer" else "the model's built-in loss), ")
      + f"`experts_implementation={args.experts_implementation}`, {args.threads} torch thread(s) per model, "
      f"models trained in parallel processes. Early checkpoint at {args.early_frac:.0%} of training.")
    a("")
    a("Rebuild (corpus + tokenizer + both models + checks + this README), offline, about "
      f"{summary['total_wall_s'] / 60:.0f} min on a 2-core CPU:")
    a("")
    a("```sh")
    a(summary["command"])
    a("```")
    a("")
    a("The build is deterministic for a given CPython / torch / transformers version (corpus hashes are recorded "
      "in `train_meta.json`); built here with "
      f"Python {platform.python_version()}, torch {summary['versions']['torch']}, transformers "
      f"{summary['versions']['transformers']}, tokenizers {summary['versions']['tokenizers']}.")
    a("")
    return lines


def readme_corpus(summary: dict, args) -> list[str]:
    """The corpus sources, its split and the held-out file."""
    lines = []
    a = lines.append
    a("## Corpus (`examples/build_corpus.py`)")
    a("")
    a("Built offline from text shipped with every CPython installation; all of it is under the "
      "**Python Software Foundation License (PSF-2.0)**:")
    a("")
    a("- `code`: standard-library `*.py` source files (`sysconfig.get_paths()['stdlib']`; tests, `encodings`, "
      "`lib2to3`, `turtledemo`, `pydoc_data` and data-table-like files excluded), chunked at blank lines.")
    a("- `prose`: `pydoc_data.topics.topics` (the Python documentation topics behind `help()`), docstrings of "
      "stdlib modules that are *not* used as code documents (doctest paragraphs removed), and "
      "`idlelib/help.html` (as text), `idlelib/README.txt`, `idlelib/extend.txt`, `email/architecture.rst`, "
      "`LICENSE.txt`.")
    a("")
    c = summary["corpus"]
    a(f"Documents are ≤ {c['options']['max_chars']} characters. Every source file / pydoc topic is assigned as a "
      "whole to train or validation (held-out documents, never chunks of a trained-on document). "
      f"Train: {c['files']['train.jsonl']['docs']} documents, {c['files']['train.jsonl']['bytes'] / 1e6:.2f} MB "
      f"(code {c['stats']['code']['train_chars'] / 1e6:.2f}M chars, prose {c['stats']['prose']['train_chars'] / 1e6:.2f}M chars), "
      f"{summary['train_tokens'] / 1e6:.2f}M tokens. "
      f"Validation: {summary['val_docs']['kept']} documents ("
      + ", ".join(f"{n} {d}" for d, n in sorted(summary['val_docs']['by_domain'].items()))
      + ") after dropping "
      f"{summary['val_docs']['dropped_too_long']} of the corpus' {c['files']['validation.jsonl']['docs']} held-out "
      f"documents that are longer than {args.seq_len - 1} tokens (so every held-out document plus one leading "
      f"`{EOS}` fits in the trained context of {args.seq_len}); {summary['val_tokens']:,} target tokens.")
    a("")
    a("`data/heldout.jsonl` (fields `text`, `domain`, `source`) is exactly the validation split: the default "
      "`--data` of moetool commands. The models never saw these documents.")
    a("")
    return lines


def readme_numbers(numbers: dict, summary: dict, args) -> list[str]:
    """The measured numbers: validation perplexities, routing bullets and table, the round trip."""
    lines = []
    a = lines.append
    a("## Measured numbers (validation split, stored weights)")
    a("")
    a("Perplexity is per token of the packed validation stream (chunks of "
      f"{args.seq_len} tokens); the unigram baseline is an add-one smoothed unigram model estimated on the "
      "train tokens and scored on the same target tokens.")
    a("")
    a("| dir | val ppl (all) | code | prose | unigram ppl (all / code / prose) |")
    a("|---|---|---|---|---|")
    lines.extend(numbers["val"])
    a("")
    a("Routing on the validation split (final checkpoints). Load entropy = entropy of the fraction of top-k "
      "assignments per expert; routing entropy = mean per-token entropy of the router softmax over all experts "
      "(both in nats, maximum log n). TV = total-variation distance between the code and prose expert-load "
      "distributions.")
    a("")
    lines.extend(numbers["bullets"])
    a("")
    a("| model | layer | log n | load entropy | routing entropy | min / max load frac | dead | code-vs-prose TV | most code-leaning expert (code/prose load) | most prose-leaning |")
    a("|---|---|---|---|---|---|---|---|---|---|")
    lines.extend(numbers["routing"])
    a("")
    a("Round trip: a fresh process with `HF_HUB_OFFLINE=1` loaded every directory with `AutoModelForCausalLM` / "
      "`AutoTokenizer` (no missing / unexpected / mismatched keys) and reproduced the validation loss "
      f"(max abs difference {summary['verify_max_abs_diff']:.2e}).")
    a("")
    return lines


def write_readme(out_dir: Path, summary: dict, args) -> None:
    """``README.md`` of the model directories: its number lines are :func:`measured_lines`, the rest describes the
    build from ``summary`` and the options."""
    numbers = measured_lines(out_dir, summary["dirs"])
    lines = (readme_intro(numbers, args) + readme_tokenizer(summary) + readme_training(summary, args)
             + readme_corpus(summary, args) + readme_numbers(numbers, summary, args))
    (out_dir / "README.md").write_text("\n".join(lines), encoding="utf-8")


def check_readme(out_dir: Path, models: list[str], write: bool = False, threads: int = 2) -> int:
    """Re-evaluate the shipped model directories with moetool (``moetool.load``, the validation split rebuilt from
    ``data/heldout.jsonl``, :func:`evaluate`) and compare every number the README prints. No training, weights
    untouched. ``write``: put the recomputed numbers into ``train_meta.json`` and the README's number lines."""
    import moetool
    import torch

    torch.set_num_threads(max(threads, 1))
    dirs = model_dirs(out_dir, models)
    rows = read_jsonl(out_dir / "data" / "heldout.jsonl")
    by_dom: dict[str, list[str]] = {}
    for r in rows:
        by_dom.setdefault(r["domain"], []).append(r["text"])
    stored, fresh, worst = {}, {}, 0.0
    for d in dirs:
        meta = json.loads((out_dir / d / "train_meta.json").read_text())
        lm = moetool.load(str(out_dir / d), device="cpu")
        tok = lm.tokenizer
        seq_len = meta["hyperparameters"]["seq_len"]
        val = {dom: val_chunks(encode_docs(tok, texts), tok.eos_token_id, seq_len) for dom, texts in sorted(by_dom.items())}
        ev = evaluate(lm.model, val, routing=meta["checkpoint"] == "final", pad_id=tok.eos_token_id)
        new = dict(meta, val={k: v for k, v in ev.items() if k != "routing"}, val_loss=ev["all"]["loss"],
                   val_ppl=ev["all"]["ppl"])
        diffs = [abs(ev[dom]["loss"] - meta["val"][dom]["loss"]) for dom in meta["val"]]
        if "routing" in ev:
            new["routing"] = ev["routing"]
            for a, b in zip(ev["routing"], meta["routing"]):
                diffs += [abs(a[k] - b[k]) for k in ("load_entropy", "mean_routing_entropy", "min_load_frac",
                                                     "max_load_frac", "code_vs_prose_tv")]
                diffs += [abs(x - y) for x, y in zip(a["load_frac"], b["load_frac"])]
        worst = max(worst, *diffs)
        log(f"{d}: val loss {ev['all']['loss']:.6f} (train_meta {meta['val_loss']:.6f}); largest difference of a "
            f"stored number {max(diffs):.2e}")
        stored[d], fresh[d] = meta, new
    old, now = measured_lines(out_dir, dirs, stored), measured_lines(out_dir, dirs, fresh)
    readme_path = out_dir / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    missing = [ln for sec in old.values() for ln in sec if ln not in readme]
    changed = [(a, b) for sec in old for a, b in zip(old[sec], now[sec]) if a != b]
    n_lines = sum(len(v) for v in now.values())
    if missing:
        log(f"README.md does not show {len(missing)} line(s) of the stored train_meta.json numbers, e.g. {missing[0]}")
    for a, b in changed:
        log(f"README line changes:\n  - {a}\n  + {b}")
    log(f"{n_lines} README number lines: {n_lines - len(changed)} identical when recomputed with moetool, "
        f"{len(changed)} changed; largest raw difference {worst:.2e}")
    if write and changed:
        for a, b in changed:
            readme = readme.replace(a, b)
        readme_path.write_text(readme, encoding="utf-8")
        for d in dirs:
            (out_dir / d / "train_meta.json").write_text(json.dumps(fresh[d], indent=2) + "\n", encoding="utf-8")
        log(f"wrote {readme_path} and train_meta.json of {', '.join(dirs)}")
        return 0
    return 0 if not changed and not missing else 1


def model_dirs(out_dir: Path, models: list[str]) -> list[str]:
    """The built directories of ``models`` in README order: early, mid, final checkpoint of each."""
    dirs = []
    for m in models:
        for kind in ("early", "mid", "final"):
            d = out_dir / (m if kind == "final" else f"{m}-{kind}")
            if (d / "train_meta.json").exists() and json.loads((d / "train_meta.json").read_text())["model"] == m:
                dirs.append(d.name)
    return dirs


# -------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT), help="where the model dirs go (moetool/embedded)")
    ap.add_argument("--work-dir", default=None, help="scratch dir (default: <tmp>/moetool-tiny-build)")
    ap.add_argument("--corpus-dir", default=None, help="corpus dir (default: <work-dir>/corpus)")
    ap.add_argument("--no-build-corpus", action="store_true", help="reuse an existing corpus in --corpus-dir")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--jobs", type=int, default=2, help="models trained in parallel processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256, help="training / validation chunk length")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--early-frac", type=float, default=0.25)
    ap.add_argument("--mid-frac", type=float, default=None, help="also keep a <name>-mid checkpoint")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-chunks", type=int, default=24, help="chunks per domain for periodic validation")
    ap.add_argument("--experts-implementation", default="grouped_mm", choices=["eager", "grouped_mm", "batched_mm"])
    ap.add_argument("--aux-loss", default="per-layer", choices=["per-layer", "hf"],
                    help="router load-balancing loss: per layer, averaged (default), or transformers' "
                         "built-in one computed over all layers' logits concatenated")
    ap.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--check-readme", action="store_true",
                    help="no training: re-evaluate the model directories in --out-dir with moetool and check "
                         "that every number of their README is reproduced (exit 1 if one is not)")
    ap.add_argument("--write-readme", action="store_true",
                    help="with --check-readme: write recomputed numbers into README.md and train_meta.json")
    ap.add_argument("--_train-one", dest="train_one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_verify", dest="verify", nargs="*", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.work_dir = Path(args.work_dir or Path(__import__("tempfile").gettempdir()) / "moetool-tiny-build")
    args.corpus_dir = args.corpus_dir or str(args.work_dir / "corpus")
    return args


def build_corpus_into(corpus: Path) -> None:
    """Run ``examples/build_corpus.py`` with its default options into ``corpus``."""
    sys.path.insert(0, str(HERE))
    import build_corpus

    log("building corpus")
    build_corpus.main(["--out-dir", str(corpus)])


def fresh_tokenizer(train_rows: list[dict], args, tok_dir: Path):
    """Train the tokenizer on the train split, save it in ``tok_dir`` and load it back as the model directories
    will (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    log(f"training tokenizer on {len(train_rows)} docs (vocab {args.vocab_size})")
    train_tokenizer([r["text"] for r in train_rows], args.vocab_size, tok_dir, args.max_position_embeddings)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.eos_token == EOS and tok.pad_token == EOS, (tok.eos_token, tok.pad_token)
    return tok


def write_heldout(tok, val_rows_all: list[dict], seq_len: int, work: Path, heldout: Path) -> list[dict]:
    """Validation / held-out documents must fit in the trained context together with one leading <|endoftext|>:
    drop the few longer ones (whole documents). Writes the kept ones to ``heldout`` and to the work dir; returns
    them."""
    val_lens = [len(ids) for ids in encode_docs(tok, [r["text"] for r in val_rows_all])]
    val_rows = [r for r, n in zip(val_rows_all, val_lens) if n + 1 <= seq_len]
    n_drop = len(val_rows_all) - len(val_rows)
    (work / "validation.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in val_rows),
                                           encoding="utf-8")
    heldout.parent.mkdir(parents=True, exist_ok=True)
    heldout.write_text("".join(json.dumps({"text": r["text"], "domain": r["domain"], "source": r["source"]},
                                          ensure_ascii=False) + "\n" for r in val_rows), encoding="utf-8")
    (work / "paths.json").write_text(json.dumps({"validation": str(work / "validation.jsonl")}))
    log(f"validation/held-out: kept {len(val_rows)} of {len(val_rows_all)} documents (dropped {n_drop} longer "
        f"than {seq_len - 1} tokens); wrote {heldout} ({heldout.stat().st_size:,} bytes)")
    return val_rows


def prepare_data(args, corpus: Path, work: Path, heldout: Path) -> SimpleNamespace:
    """Tokenizer, held-out split, encoded train documents and validation chunks, unigram baseline: written to
    ``work`` for the training processes (:func:`load_training_data`), returned for the summary."""
    train_rows = read_jsonl(corpus / "train.jsonl")
    val_rows_all = read_jsonl(corpus / "validation.jsonl")
    tok = fresh_tokenizer(train_rows, args, work / "tokenizer")
    eos_id = tok.eos_token_id
    train_ids = encode_docs(tok, [r["text"] for r in train_rows])
    val_rows = write_heldout(tok, val_rows_all, args.seq_len, work, heldout)
    by_dom: dict[str, list[str]] = {}
    for r in val_rows:
        by_dom.setdefault(r["domain"], []).append(r["text"])
    val = {dom: val_chunks(encode_docs(tok, texts), eos_id, args.seq_len) for dom, texts in sorted(by_dom.items())}
    (work / "val_docs.json").write_text(json.dumps({"kept": len(val_rows),
                                                    "dropped_too_long": len(val_rows_all) - len(val_rows),
                                                    "by_domain": {d: len(t) for d, t in by_dom.items()}}))
    train_stream = pack(train_ids, eos_id)
    unigram = unigram_ppl(train_stream, val, len(tok))
    n_chars = sum(len(r["text"]) for r in train_rows)
    log(f"train tokens {len(train_stream):,} ({n_chars / len(train_stream):.2f} chars/token); "
        f"val target tokens {unigram['all']['tokens']:,}; unigram val ppl {unigram['all']['ppl']:.2f} "
        f"(code {unigram['code']['ppl']:.2f}, prose {unigram['prose']['ppl']:.2f})")
    (work / "encoded.json").write_text(json.dumps({"train": train_ids, "val": val}))
    (work / "unigram.json").write_text(json.dumps(unigram))
    return SimpleNamespace(vocab_size=len(tok), train_tokens=len(train_stream), unigram=unigram)


def build_env(args) -> dict:
    """The environment of the child processes: offline, the build command, ``--threads`` threads."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MOETOOL_BUILD_COMMAND=args.command,
                OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))


def train_models(models: list[str], args, raw_argv: list[str], env: dict) -> list[str]:
    """Train ``models`` in child processes (this script with ``--_train-one``), at most ``--jobs`` at a time;
    returns the names of those that failed."""
    pending = list(models)
    running: dict[str, subprocess.Popen] = {}
    failed = []
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            m = pending.pop(0)
            cmd = [sys.executable, str(Path(__file__).resolve())] + raw_argv + ["--no-build-corpus", "--_train-one", m]
            log(f"starting {m}: {shlex.join(cmd)}")
            running[m] = subprocess.Popen(cmd, env=env)
        time.sleep(2)
        for m, p in list(running.items()):
            if p.poll() is not None:
                del running[m]
                log(f"{m} finished with exit code {p.returncode}")
                if p.returncode != 0:
                    failed.append(m)
    return failed


def round_trip(dirs: list[Path], args, env: dict) -> dict | None:
    """:func:`verify_dirs` in a fresh process (``--_verify``); its result, or None if the process failed."""
    log("round-trip check in a fresh process (HF_HUB_OFFLINE=1)")
    cp = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_verify", *map(str, dirs),
                         "--work-dir", str(args.work_dir), "--threads", str(max(args.threads, 2)),
                         "--seq-len", str(args.seq_len)],
                        env=env, capture_output=True, text=True)
    line = [l for l in cp.stdout.splitlines() if l.startswith("VERIFY_JSON ")]
    if cp.returncode != 0 or not line:
        print(cp.stdout, cp.stderr)
        log("verification process failed")
        return None
    return json.loads(line[0][len("VERIFY_JSON "):])


def round_trip_ok(ver: dict) -> bool:
    """Log each directory's round trip; True if every one loaded cleanly and reproduced its validation loss."""
    ok = True
    for d, v in ver.items():
        bad_keys = any(v["loading_info"].get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        good = (not bad_keys) and v["abs_diff"] < 1e-4 and v["eos_token"] == EOS and not v["warnings"]
        ok &= good
        log(f"verify {Path(d).name}: {v['model_class']} {v['dtype']} tok={v['tokenizer_class']} eos={v['eos_token']!r} "
            f"val_loss {v['val_loss']:.5f} (meta {v['meta_val_loss']:.5f}, diff {v['abs_diff']:.1e}) "
            f"load_info={v['loading_info']} warnings={v['warnings']} -> {'OK' if good else 'FAIL'}")
    return ok


def checks_ok(dirs: list[Path], out_dir: Path, unigram: dict) -> bool:
    """Each checkpoint beats the unigram baseline, each early checkpoint is worse than its final one, no final
    checkpoint has a dead expert (the routing of the final ones is logged)."""
    ok = True
    for d in dirs:
        m = json.loads((d / "train_meta.json").read_text())
        if not m["val_ppl"] < unigram["all"]["ppl"]:
            log(f"WARNING: {d.name} val ppl {m['val_ppl']:.2f} not below unigram {unigram['all']['ppl']:.2f}")
            ok = False
        if m["checkpoint"] == "final":
            early = out_dir / f"{m['model']}-early"
            if early.exists():
                me = json.loads((early / "train_meta.json").read_text())
                if not me["val_loss"] > m["val_loss"]:
                    log(f"WARNING: {early.name} not worse than {d.name}")
                    ok = False
            for r in m["routing"]:
                log(f"{d.name} layer {r['layer']}: load entropy {r['load_entropy']:.3f} / log n {r['log_n']:.3f}, "
                    f"routing entropy {r['mean_routing_entropy']:.3f}, load min {r['min_load_frac']:.4f} "
                    f"max {r['max_load_frac']:.4f}, dead {r['dead_experts']}, code-vs-prose TV {r['code_vs_prose_tv']:.3f}")
                if r["dead_experts"]:
                    ok = False
    return ok


def build_summary(dirs: list[Path], args, data: SimpleNamespace, corpus: Path, ver: dict, t0: float) -> dict:
    """What :func:`write_readme` reports besides the directories' ``train_meta.json``."""
    import tokenizers
    import torch
    import transformers

    return {
        "dirs": [d.name for d in dirs],
        "command": args.command,
        "vocab_size": data.vocab_size,
        "unigram": data.unigram,
        "train_tokens": data.train_tokens,
        "val_tokens": data.unigram["all"]["tokens"],
        "val_docs": json.loads((args.work_dir / "val_docs.json").read_text()),
        "corpus": json.loads((corpus / "manifest.json").read_text()),
        "verify_max_abs_diff": max(v["abs_diff"] for v in ver.values()),
        "total_wall_s": time.time() - t0,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }


def build(args, raw_argv: list[str]) -> int:
    """The whole build: corpus, tokenizer and data, the models (child processes), the fresh-process round trip,
    the checks and the README."""
    import numpy as np  # noqa: F401
    import torch

    t0 = time.time()
    work, out_dir, corpus = args.work_dir, Path(args.out_dir), Path(args.corpus_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not args.no_build_corpus:
        build_corpus_into(corpus)
    torch.set_num_threads(max(args.threads, 1))
    set_seed(args.seed)
    data = prepare_data(args, corpus, work, out_dir / "data" / "heldout.jsonl")
    models = [m for m in args.models.split(",") if m]
    env = build_env(args)
    failed = train_models(models, args, raw_argv, env)
    if failed:
        log(f"FAILED: {failed}")
        return 1
    dirs = [out_dir / d for d in model_dirs(out_dir, models)]
    ver = round_trip(dirs, args, env)
    if ver is None:
        return 1
    ok = round_trip_ok(ver)
    (work / "verify.json").write_text(json.dumps(ver, indent=2))
    ok &= checks_ok(dirs, out_dir, data.unigram)
    summary = build_summary(dirs, args, data, corpus, ver, t0)
    write_readme(out_dir, summary, args)
    total = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    log(f"done in {summary['total_wall_s'] / 60:.1f} min; {out_dir} holds {total / 1e6:.2f} MB; "
        f"checks {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    args.command = os.environ.get("MOETOOL_BUILD_COMMAND") or (
        "python examples/train_tiny.py" + ("" if not raw_argv else " " + shlex.join(raw_argv)))
    if args.train_one:  # child process: train one model
        res = train_one(args.train_one, args, args.work_dir)
        (args.work_dir / f"result-{args.train_one}.json").write_text(json.dumps(res, indent=2))
        return 0
    if args.check_readme:  # no training: recompute the README's numbers from the shipped weights
        return check_readme(Path(args.out_dir), [m for m in args.models.split(",") if m], args.write_readme,
                            max(args.threads, 2))
    if args.verify is not None:  # child process: fresh-process round trip
        print("VERIFY_JSON " + json.dumps(verify_dirs(args.verify, args.work_dir, args.threads, args.seq_len)),
              flush=True)
        return 0
    return build(args, raw_argv)


if __name__ == "__main__":
    sys.exit(main())
