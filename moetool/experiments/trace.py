"""Per-token routing dump: one row per (real token, MoE layer), streamed to ``trace.csv.gz``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine.hooks import Engine, RoutingEvent
from ..progress import progress


def events_frame(ev: RoutingEvent, ids: Any, rows: Any, pos: Any, domains: list[str], tokens: list[str] | None,
                 logits: bool) -> Any:
    """Valid tokens of one event as a DataFrame (host)."""
    import pandas as pd

    keep = ev.valid.cpu()
    K = ev.chosen_idx.shape[-1]
    cols: dict[str, Any] = {"row": rows[keep].numpy(), "pos": pos[keep].numpy(), "token_id": ids[keep].numpy()}
    if tokens is not None:
        cols["token"] = [t for t, k in zip(tokens, keep.tolist()) if k]
    cols["domain"] = [domains[r] for r in rows[keep].tolist()]
    cols["layer"] = ev.layer.index
    idx = ev.chosen_idx[ev.valid].cpu().numpy()
    w = ev.chosen_weights[ev.valid].float().cpu().numpy()
    for k in range(K):
        cols[f"expert_{k + 1}"] = idx[:, k]
    for k in range(K):
        cols[f"weight_{k + 1}"] = w[:, k]
    if logits:
        lg = ev.logits[ev.valid].float().cpu().numpy()
        for e in range(lg.shape[1]):
            cols[f"logit_{e}"] = lg[:, e]
    return pd.DataFrame(cols)


def run_trace(lm: Any, tokens: Any, run: Any, *, policy: Any = None, policy_layers: Any = None,
              logits: bool = False, batch_size: int = 8, quiet: bool = False) -> Path:
    import torch

    path = run.file("trace.csv.gz")
    events: list[RoutingEvent] = []
    first, row0 = True, 0
    with torch.no_grad(), Engine(lm.model, lm.layers, policy=policy, policy_layers=policy_layers,
                                 consumers=[events.append]):
        for b in progress(tokens.batches(batch_size), total=tokens.n_batches(batch_size),
                          description="trace", quiet=quiet):
            events.clear()
            lm.model(input_ids=b.input_ids.to(lm.device), attention_mask=b.attention_mask.to(lm.device),
                     use_cache=False)
            B, S = b.input_ids.shape
            ids = b.input_ids.reshape(-1)
            rows = (torch.arange(B).repeat_interleave(S) + row0)
            pos = torch.arange(S).repeat(B)
            doms = {row0 + i: d for i, d in enumerate(b.domains)}
            toks = lm.tokenizer.convert_ids_to_tokens(ids.tolist()) if lm.tokenizer is not None else None
            for ev in events:
                df = events_frame(ev, ids, rows, pos, doms, toks, logits)
                df.to_csv(path, mode="w" if first else "a", header=first, index=False, compression="gzip")
                first = False
            row0 += B
    run.add(format={"trace.csv.gz": "one row per real (unpadded) token and MoE layer: row (packed row index), "
                                     "pos (position in row), token_id, token, domain, layer (decoder layer index), "
                                     "expert_k / weight_k (k-th chosen expert, largest first as the router "
                                     "returned them, and its weight), logit_e (router logit of expert e, --logits)"},
            data=tokens.describe(), routing=getattr(policy, "name", "router"))
    return path
