"""Per-token routing of every MoE layer: token ids, positions, top-K experts and weights.

Writes trace.csv.gz (one row per real token and MoE layer: row, pos, token_id, token, domain, layer,
expert_1..expert_K, weight_1..weight_K, and with --logits logit_0..logit_{n-1}) and manifest.json.
Read it with pandas.read_csv(path, keep_default_na=False) (else the tokens None, NaN, NA, null read as
missing); --format parquet writes trace.parquet (pandas.read_parquet).
--routing traces what a policy chose in --layers instead of the router.
--resume (with the --out of an interrupted run, same options): the rows of
the batches checkpointed before the interruption (at most once a minute) are
kept and the trace goes on from the next batch: the same file, row for row.

Examples:
  moetool trace --out runs/trace-tiny
  moetool trace --model tiny-fine --logits --max-tokens 2048
"""

from __future__ import annotations

from dataclasses import dataclass

from ..experiment import Flag, RoutingOptions, experiment, option


@dataclass(frozen=True)
class TraceOptions(RoutingOptions):
    """Options of :func:`~moetool.experiments.trace.compute.trace`: the routing traced (``router`` = the model's
    own: ``--routing`` and its options, the routing flag group) and the columns."""

    # also the full router logits (logit_0 .. logit_{n-1})
    logits: bool = option(False, "--logits", "Also write the full router logits.")
    batch_size: int = 8


SPEC = experiment("trace", "trace", "TraceOptions", lines=None,
                  order=180,
                  groups=("routing", "resume"),
                  flags=(Flag("--format", "str", "csv.gz", "csv.gz (pandas.read_csv) or parquet (pandas.read_parquet; "
                              "faster, smaller).", to_options=False),))
