"""Defaults shared by the library and the command line, importable without numpy or torch (``moetool --help``
reads them from the experiments' specs)."""

from __future__ import annotations

from typing import Any

#: replicates of the document-level bootstrap behind every 95% interval (``--bootstrap``)
DEFAULT_BOOTSTRAP = 1000
#: the most replicates ``--bootstrap`` takes: their ``[replicates x rows]`` resample weights are held in memory
#: (float64), and beyond it an interval's ends no longer move at a table's precision
MAX_BOOTSTRAP = 100_000
#: the seed of lm-eval's few-shot sampler (``--fewshot-seed``): lm-eval's own default ``fewshot_random_seed``, so a
#: task's few-shot examples are those ``lm_eval`` picks for the same model and task
FEWSHOT_SEED = 1234
#: tokens per packed row (``--seq-len``)
SEQ_LEN = 256
#: cap on the real tokens read from ``--data`` (``--max-tokens``), where an experiment's spec sets no other
#: (``defaults={"max_tokens": 32768}``)
MAX_TOKENS = 8192


def text_sizes(spec_defaults: dict[str, Any]) -> dict[str, Any]:
    """What a run of an experiment that reads text reads by default: ``data`` (``None``: the held-out text shipped
    with moetool), ``seq_len``, ``max_tokens`` -- the standard flags' defaults with the spec's own ``defaults``
    over them. The command's flags (:mod:`moetool.commands.flags`) and ``moetool.run`` by name both take them from
    here."""
    return {k: spec_defaults.get(k, v) for k, v in (("data", None), ("seq_len", SEQ_LEN), ("max_tokens", MAX_TOKENS))}
