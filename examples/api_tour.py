"""A tour of moetool's Python API on the embedded ``tiny`` model (offline, ~10 s on a laptop CPU).

    python examples/api_tour.py [OUT_DIR]

1. load a model and pack tokens; 2. routing statistics as DataFrames; 3. a custom probe: a consumer on the hook
engine computing a rate by hand (how often a token's top-1 expert repeats the previous token's; ``moetool
locality`` reports it too, as top1_repeat);
4. a plot of your own, saved next to the experiment's own figures and CSVs. The test suite runs this script.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import moetool  # noqa: E402


def main(out: Path) -> dict:
    # 1. a model and tokens (None = the held-out text shipped with moetool)
    lm = moetool.load("tiny")
    tokens = moetool.tokens(lm, None, seq_len=128, max_tokens=2048)
    print(f"{lm.name}: MoE layers {[L.index for L in lm.layers]}, {tokens.n_tokens} tokens")

    # 2. an experiment: a Result of named DataFrames with the CLI's columns, definitions included
    res = moetool.stats(lm, tokens, top_tokens=5, quiet=True)
    print(res)
    print(res.summary.to_string(index=False))
    print("load_fraction:", res.definitions["load_fraction"])

    # 3. a custom probe: each event carries the router input h, logits, the model's top-K (idx, weights: in the
    #    order the router returned them; ev.ranked: best first by selection score), the padding mask (valid) and
    #    what ran (chosen_idx); here: P(top-1 of token t == top-1 of token t-1), the top-1 being the routing
    #    decision, the first-ranked chosen expert (moetool.ops.top1), not idx[:, 0]
    same, pairs = {}, {}

    def repeat_rate(ev: moetool.RoutingEvent) -> None:
        B, S = ev.shape
        top1 = ev.ranked[0][:, 0].reshape(B, S)
        valid = ev.valid.reshape(B, S)
        both = valid[:, 1:] & valid[:, :-1]
        # tensors on the model's device: no host sync per event (int() once, after the forwards)
        same[ev.layer.index] = same.get(ev.layer.index, 0) + ((top1[:, 1:] == top1[:, :-1]) & both).sum()
        pairs[ev.layer.index] = pairs.get(ev.layer.index, 0) + both.sum()

    with torch.no_grad(), moetool.hook(lm, consumers=[repeat_rate]):
        for batch in tokens.batches(8):
            lm.model(input_ids=batch.input_ids.to(lm.device), attention_mask=batch.attention_mask.to(lm.device))
    pairs = {layer: int(n) for layer, n in pairs.items()}
    rates = {layer: int(same[layer]) / pairs[layer] for layer in sorted(same)}
    print("top-1 repeats the previous token's:", {k: round(v, 3) for k, v in rates.items()})

    # 4. write the experiment as the CLI would, and a figure of your own beside it
    run = moetool.write(res, out / "stats", force=True)
    load = res["load"]
    fig, ax = plt.subplots(figsize=(4.2, 3.0))
    for layer, g in load.groupby("layer"):
        ax.plot(g["expert"], g["load_fraction"], marker="o", label=f"layer {layer}")
    ax.axhline(1 / load["expert"].nunique(), color="k", linestyle="--", linewidth=0.8)
    ax.set(xlabel="expert", ylabel="load fraction", title="expert load (tiny)")
    ax.legend(fontsize=7, frameon=False)
    fig.savefig(out / "load_by_expert.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {run} and {out / 'load_by_expert.png'}")
    return {"stats": res, "repeat_rate": rates, "pairs": pairs, "run": run}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", metavar="OUT_DIR",
                    help="where the stats run and the figure go (default: a new temporary folder)")
    a = ap.parse_args()
    if a.out_dir is not None and not a.out_dir.strip():  # Path('') is the current folder
        ap.error("OUT_DIR is empty")
    main(Path(a.out_dir) if a.out_dir is not None else Path(tempfile.mkdtemp(prefix="moetool-tour-")))
