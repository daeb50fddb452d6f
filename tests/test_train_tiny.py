"""examples/train_tiny.py reports the embedded models' numbers through moetool itself (engine.forward, stats)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from moetool.loading import EMBEDDED_DIR

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(model, val, n_experts):
    """The script's former private evaluation, kept here as the independent reference: unpadded batches grouped by
    length, a hook on each router for its logits and top-K, bincount loads, -sum p log p entropies."""
    import torch
    import torch.nn.functional as F

    from moetool.adapters import find_moe_layers

    rec, hooks = {}, []
    for L in find_moe_layers(model):
        hooks.append(L.router.register_forward_hook(
            lambda m, i, o, li=L.index: rec.__setitem__(li, (o[0].detach().float(), o[2].detach()))))
    out, route = {}, {}
    with torch.no_grad():
        for dom, chunks in val.items():
            nll, n = 0.0, 0
            for c in chunks:  # one chunk per forward: no padding at all
                x = torch.tensor([c])
                logits = model(input_ids=x, use_cache=False).logits
                nll += float(F.cross_entropy(logits[0, :-1].double(), x[0, 1:], reduction="sum"))
                n += len(c) - 1
                for li, (lg, idx) in rec.items():
                    r = route.setdefault(li, {}).setdefault(dom, {"counts": torch.zeros(n_experts, dtype=torch.float64),
                                                                  "ent": 0.0, "tokens": 0})
                    r["counts"] += torch.bincount(idx.reshape(-1), minlength=n_experts).double()
                    p = torch.softmax(lg.double(), -1)
                    r["ent"] += float(-(p * torch.log(p.clamp_min(1e-300))).sum())
                    r["tokens"] += lg.shape[0]
            out[dom] = nll / n
    for h in hooks:
        h.remove()
    return out, route


@pytest.mark.parametrize("name", ["tiny", "tiny-fine"])
@pytest.mark.slow
def test_evaluate_through_moetool_equals_the_hand_reference(name):
    import moetool

    tt = _script()
    lm = moetool.load(name, device="cpu")
    tok = lm.tokenizer
    rows = tt.read_jsonl(EMBEDDED_DIR / "data" / "heldout.jsonl")
    by_dom = {}
    for r in rows:
        by_dom.setdefault(r["domain"], []).append(r["text"])
    # a few documents per domain, chunked at 64 so the last chunk of each domain is short (padding in a batch)
    val = {d: tt.val_chunks(tt.encode_docs(tok, t[:2]), tok.eos_token_id, 64) for d, t in sorted(by_dom.items())}
    assert any(len(c[-1]) < 64 for c in val.values())
    ev = tt.evaluate(lm.model, val, batch_size=4, routing=True, pad_id=tok.eos_token_id)
    n = lm.layers[0].n_experts
    loss, route = _reference(lm.model, val, n)
    for dom in val:
        assert ev[dom]["loss"] == pytest.approx(loss[dom], rel=1e-5)
        assert ev[dom]["tokens"] == sum(len(c) - 1 for c in val[dom])
    for entry in ev["routing"]:
        doms = route[entry["layer"]]
        counts = sum(d["counts"] for d in doms.values())
        frac = (counts / counts.sum()).tolist()
        assert entry["load_frac"] == [round(f, 5) for f in frac]
        assert entry["load_entropy"] == pytest.approx(-sum(f * math.log(f) for f in frac if f > 0), abs=1e-5)
        toks = sum(d["tokens"] for d in doms.values())
        assert entry["mean_routing_entropy"] == pytest.approx(sum(d["ent"] for d in doms.values()) / toks, abs=1e-5)
        fc, fp = ([round(x, 5) for x in (doms[k]["counts"] / doms[k]["counts"].sum()).tolist()] for k in ("code", "prose"))
        assert entry["code_vs_prose_tv"] == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(fc, fp)), abs=1e-9)
        for dom, d in doms.items():
            assert entry["by_domain"][dom]["mean_routing_entropy"] == pytest.approx(d["ent"] / d["tokens"], abs=1e-5)


def test_the_readme_shows_exactly_the_stored_numbers():
    """Every number line of moetool/embedded/README.md is the rendering of the directories' train_meta.json
    (which `python examples/train_tiny.py --check-readme` recomputes with moetool: identical to 1.6e-7)."""
    tt = _script()
    dirs = tt.model_dirs(EMBEDDED_DIR, list(tt.MODELS))
    assert dirs == ["tiny-early", "tiny", "tiny-fine-early", "tiny-fine"]
    readme = (EMBEDDED_DIR / "README.md").read_text(encoding="utf-8")
    lines = tt.measured_lines(EMBEDDED_DIR, dirs)
    assert [len(v) for v in lines.values()] == [4, 4, 2, 8]
    for section in lines.values():
        for line in section:
            assert line in readme, line
    meta = json.loads((EMBEDDED_DIR / "tiny" / "train_meta.json").read_text())
    assert f"| {meta['val_ppl']:.2f} |" in lines["models"][1]
