"""Perplexity, mean next-token NLL and token count of --data with a routing policy applied.

--routing takes any policy: router (unchanged; reproduces the unhooked model exactly),
norm:<node>[:<norm>] (AoE: the K experts with the largest node norm; node gate|up|act|glu|output,
norm l2|l1|linf), random, and the others listed by the error for an unknown name. Writes ppl.csv
(model, data, routing, weights, layers, tokens, nll_mean, perplexity, router_perplexity, ratio,
seconds; *_lo/*_hi = 95% interval) and manifest.json. A policy other than router is compared with
the model's own routing on the same rows (ratio = perplexity / router_perplexity; --no-baseline
skips that second pass). Intervals: document-level bootstrap over packed rows (--bootstrap N,
paired for the ratio; 0 = off).

Examples:
  moetool ppl                                   # the router on the shipped held-out text
  moetool ppl --routing norm:gate --weights softmax
  moetool ppl --routing norm:output:l1 --layers 0-1 --max-tokens 4096
"""

from __future__ import annotations

from ..experiment import Flag, experiment

SPEC = experiment("ppl", "ppl", "PplOptions", lines=None,
                  order=160,
                  groups=("routing",), bootstrap=True, defaults={"max_tokens": 32768},
                  flags=(Flag("--baseline", "bool", True, "Also run the router on the same rows for the perplexity ratio "
                              "(policies other than router)."),))
