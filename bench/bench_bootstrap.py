"""What ``--bootstrap`` costs: interval time / run time for stats, ppl, norm-select, mass-recall and fluctuation on
the embedded models (``intervals`` only where the replicates can be timed apart from the run).

    python bench/bench_bootstrap.py                       # tiny and tiny-fine, 32768 tokens, 1000 replicates
    python bench/bench_bootstrap.py --tokens 8192 --models tiny --replicates 1000 --repeat 3

Per command and model, every round runs the experiment twice in turn — ``bootstrap=0`` (no per-row sums, no
intervals) and ``bootstrap=N`` — and prints the median over rounds of

* ``overhead``  = (time with N − time with 0) / time with 0: the whole cost of the intervals (per-row sums kept in
  the forward + the replicates), end to end, as a user sees it;
* ``intervals`` = time of the replicates alone (the bootstrap on the per-row sums, after the forward) / time with 0.

The issue's rule: the default of 1000 replicates holds where it costs under 10% of the run.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,tiny-fine")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--replicates", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from moetool import distributed
    from moetool.engine.probes import NODES
    from moetool.data import load_tokens
    from moetool.experiments.norm_select import compute as ns
    from moetool.experiments.ppl.compute import ppl
    from moetool.experiments.routing import perplexity, ppl_intervals
    from moetool.experiments.stats.compute import collect, stats
    from moetool.experiments.fluctuation.compute import fluctuation
    from moetool.experiments.mass_recall.compute import mass_recall
    from moetool.loading import embedded_models, load
    from moetool.policies import build_policy
    from moetool.uncertainty import RowTable

    N = args.replicates
    print(f"{'command':<12} {'model':<10} {'tokens':>7} {'rows':>5} {'run (s)':>8} {'overhead':>9} {'intervals':>9}")
    for name in args.models.split(","):
        lm = load(name)
        tokens = load_tokens(None, lm.tokenizer, args.seq_len, args.tokens)
        rows = tokens.input_ids.shape[0]
        shard = distributed.shard(tokens, 8)
        c = collect(lm, tokens, quiet=True, row_sums=True, specialization=False)  # warm-up + sums for the timing
        meters, runs_ns = {}, {}
        for spec in ns.sweep_specs(NODES):
            rt = RowTable(shard)
            meters[spec] = ns.AgreementMeter(rows=rt)
            runs_ns[spec] = perplexity(lm, shard, policy=build_policy(spec), consumers=[meters[spec]], rows=rt,
                                       quiet=True)

        def ns_intervals() -> None:
            for spec, m in meters.items():
                m.frame(spec, n_boot=N)
                m.overall(spec, n_boot=N)
            ns.quality_frame(runs_ns, {}, "heldout", n_boot=N)
        runs = {
            "stats": (lambda b: stats(lm, tokens, quiet=True, bootstrap=b),
                      lambda: c.routing.intervals(N)),
            "ppl": (lambda b: ppl(lm, tokens, quiet=True, bootstrap=b),
                    (lambda r=perplexity(lm, shard, rows=RowTable(shard), quiet=True): ppl_intervals(r, n_boot=N))),
            "norm-select": (lambda b: ns.norm_select(lm, tokens, quiet=True, bootstrap=b), ns_intervals),
            "mass-recall": (lambda b: mass_recall(lm, tokens, quiet=True, bootstrap=b), None),
        }
        if f"{name}-early" in embedded_models():  # the pair the README shows: <name>-early -> <name>
            early = load(f"{name}-early", tokenizer=False)
            runs["fluctuation"] = (lambda b: fluctuation([early, lm], tokens, routing=("router", "similarity"),
                                                         quiet=True, bootstrap=b), None)
        for cmd, (run, only) in runs.items():
            base, over, part = [], [], []
            for i in range(args.repeat):  # alternate which goes first: a warm cache favours the second
                if i % 2:
                    t1, t0 = _time(lambda: run(N)), _time(lambda: run(0))
                else:
                    t0, t1 = _time(lambda: run(0)), _time(lambda: run(N))
                base.append(t0)
                over.append((t1 - t0) / t0)
                if only is not None:
                    part.append(_time(only) / t0)
            med = statistics.median
            print(f"{cmd:<12} {name:<10} {tokens.n_tokens:>7} {rows:>5} {med(base):>8.2f} {med(over):>8.1%} "
                  f"{med(part) if part else float('nan'):>8.1%}")


if __name__ == "__main__":
    main()
