"""Routing fluctuation: the same token ids through two or more checkpoints of one architecture.

Source: Nguyen, Tran, Nguyen, Baraniuk (2025), "Improving Routing in Sparse Mixture of Experts with Graph of
Tokens", arXiv 2505.00792 (routing fluctuation, Fig. 3; Similarity-/Attention-Aware routing).

Token ids come from the first checkpoint's tokenizer; checkpoints of a different architecture (model_type,
layers, experts, K) or tokenizer vocabulary are refused. Checkpoints load one at a time, the last given first
(--reference last: the first given first), so a checkpoint runs before its reference (--isolate feeds the
reference's MoE inputs to its routers); the progress bars name each (tiny-early tiny: 'tiny: router' runs
first). Per MoE layer, pair
(reference, checkpoint) and routing: top1_change (fraction of real tokens whose top-1 expert differs: the
paper's fluctuation rate; top-1 = the routing decision: the chosen expert ranked first by the scores the routing
selected on -- the router's selection scores, a correction bias included, before any per-expert scale; a policy's
own scores; random's and norm's own order --, not the largest weight), topk_change (chosen set differs;
a set is the experts with a nonzero weight: top-p's unchosen and capacity's dropped columns are none of it),
topk_overlap (mean |A∩B|/|A|, /K for a fixed top-K), jaccard (mean |A∩B|/|A∪B|), entropy_ref / entropy_ckpt
(mean entropy in nats) and entropy_ratio (ckpt/ref).

--routing router: the model's own top-K, entropy of π. similarity / attention: that training-free policy
applied in every MoE layer of each checkpoint (Similarity-Aware S = softmax(h_i·h_j/τ), causal;
Attention-Aware: the same layer's lowest-entropy attention head), the chosen sets compared, entropy of the
policy's normalised scores s_i = Σ_j S[i,j] π(h_j). Any other --routing spec runs as everywhere; its entropy is
of π (prune: the pruned router's π over the kept experts). --isolate adds rows <routing>-isolated: the
reference's own MoE inputs (and attention) fed to the checkpoint's routers — router drift alone.

--layers 0,2,5-7: the MoE layers measured (the rows, and the summary's mean over layers) and the only layers
where similarity / attention replace the routing; every other MoE layer runs the model's own router, unmeasured.

Memory: routing stays on the device during the forward, one host copy per batch is spilled to a temporary
file and read back batch by batch for the comparison, so RSS stays flat in the number of tokens.

--bootstrap N (default 1000, 0 = off, seeded by --seed): 95% document-level bootstrap over packed rows of
every rate (per-row sums, moetool.uncertainty), *_lo/*_hi columns, error bars in fluctuation_by_layer, value ±
half-width on the console (value [lo, hi] where the interval is not symmetric).

--resume (with the --out of an interrupted run, same options): checkpoints
whose routing was captured before the interruption are read back, not run
again; the same tables as an uninterrupted run.

Writes fluctuation.csv (layer, routing, reference, checkpoint, tokens, top1_change, topk_change, topk_overlap,
jaccard, each with _lo/_hi, entropy_ref, entropy_ckpt, entropy_ratio), fluctuation_summary.csv (the headline,
one row per routing, reference and checkpoint: routing, reference, checkpoint, tokens, layers, top1_change =
the top-1 change averaged over layers, reduction_vs_router = the router's top1_change minus this routing's
(paired bootstrap; for a <routing>-isolated row router-isolated's minus its), each with _lo/_hi),
figures/fluctuation_by_layer, figures/entropy_ratio_by_layer, figures/entropy_vs_router_by_layer (each
routing's entropy / the router's, the paper's ratio), manifest.json.

--trace RUN (twice or more, instead of checkpoints): the recorded routings of the same tokens (moetool trace
or import-trace runs, e.g. one model at two training steps), their first --max-tokens tokens: fluctuation.csv
with topk_change, topk_overlap, jaccard (and top1_change when every trace has gate weights, as moetool trace
writes them: the top-1 is then the first chosen column, moetool trace's columns being ranked by selection score); no entropies (they need the router's probabilities), no --isolate; one figure,
figures/fluctuation_by_layer (where top1_change is there; no entropy figures).

Examples:
  moetool fluctuation tiny-early tiny --out runs/fluct-tiny
  moetool fluctuation --trace runs/step-1000 --trace runs/step-2000 --bootstrap 0
  moetool fluctuation tiny-fine-early tiny-fine --routing router,similarity --sim cosine --tau 0.1 --isolate
  moetool fluctuation ckpt-1000 ckpt-2000 ckpt-3000 --reference last
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, PAIRS, experiment, option

ROUTINGS = ("router", "similarity", "attention")  # the default comparison; any policy spec is accepted
REFERENCES = ("previous", "first", "last")


@dataclass(frozen=True)
class FluctuationOptions:
    """Options of :func:`~moetool.experiments.fluctuation.compute.fluctuation`, each with the flag of
    ``moetool fluctuation`` that sets it (``--sim``, ``--causal``, ``--layers``, the loading flags and
    ``--bootstrap``: the standard flag groups)."""

    routing: tuple[str, ...] = option(  # policy specs compared (router = the model's own routing)
        ROUTINGS, "--routing", "Routing policies compared, comma-separated (router = the model's own routing; "
        "similarity, attention, or any --routing spec).")
    tau: float | None = option(None, "--tau", "Similarity temperature τ (default sqrt(d)).",
                               kind="float")  # similarity temperature (None: sqrt(d))
    sim: str = "dot"  # similarity: dot | cosine
    causal: bool = True  # similarity: j <= i only
    reference: str = option("previous", "--reference", "Pairs: previous (i-1 vs i), first (0 vs i) or last (last "
                            "vs i).")
    isolate: bool = option(False, "--isolate", "Also feed the reference's MoE inputs to the other checkpoint's "
                           "routers (rows <routing>-isolated).")
    layers: tuple[int, ...] | None = None  # MoE layers measured and where a policy routes (None: every MoE layer)
    batch_size: int = 8
    dtype: str = "auto"  # how checkpoints given by name are loaded
    device: str = "auto"
    device_map: str | None = None  # --device-map of checkpoints given by name
    quantize: str | None = None  # --quantize of checkpoints given by name
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap over packed rows (0 = none)
    seed: int = 0  # bootstrap seed

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if not self.routing:
            raise MoetoolError(f"--routing is empty: give policy specs, e.g. {','.join(ROUTINGS)}")
        from ...policies import refuse_unread_similarity_options

        # an unknown spec or a bad --sim / --tau fails here, before any model loads (each policy built once)
        policies = [self.policy(r) for r in self.routing]
        for r, policy in zip(self.routing, policies):
            # --isolate keeps only the other checkpoint's routers (router_copy: no experts), so a policy choosing by
            # expert activations (norm:<node>) has nothing to run there: one line, not an AttributeError mid-run
            if policy.needs_probe and self.isolate:
                raise MoetoolError(f"--isolate with --routing {r}: that policy chooses by every expert's activations "
                                   "and --isolate keeps only the other checkpoint's routers, not its experts; "
                                   "drop --isolate or that policy")
        refuse_unread_similarity_options(policies, ",".join(self.routing), self.sim, self.causal, self.tau)
        if self.reference not in REFERENCES:
            raise MoetoolError(f"--reference {self.reference!r}: choose from {', '.join(REFERENCES)}")

    @property
    def needs_attention(self) -> bool:
        return any(self.policy(r).needs_attention for r in self.routing)

    def policy(self, routing: str) -> Any:
        """The policy applied for ``routing`` (``router``: the model's own routing, through the override path)."""
        from ...policies import build_policy

        return build_policy(routing, tau=self.tau, sim=self.sim, causal=self.causal)


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "fluctuation_by_layer": ("Per layer: the share of tokens whose top-1 expert changes between the two "
                             "checkpoints, one panel per checkpoint pair, one line per routing",
                             ("fluctuation.csv",), ("top1_change", "routing")),
    "entropy_ratio_by_layer": ("Per layer: routing entropy at the checkpoint over the reference's, one panel per "
                               "checkpoint pair, one line per routing", ("fluctuation.csv",),
                               ("entropy_ratio", "routing")),
    "entropy_vs_router_by_layer": ("Per layer: each routing's entropy over the router's at the same checkpoint",
                                   ("fluctuation.csv",), ("entropy_ref/entropy_ckpt", "routing")),
}

SPEC = experiment("fluctuation", "fluctuation", "FluctuationOptions", inputs="checkpoints",
                  figures="moetool.experiments.fluctuation.figures:fluctuation_figures", demo=Demo(models=PAIRS, options={"isolate": True}),
                  order=70,
                  groups=("sim", "causal", "resume", "traces"), bootstrap=True,
                  captions=CAPTIONS)
