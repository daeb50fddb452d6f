"""Expert-parallel placement what-if: per-GPU load imbalance under the model's measured expert loads.

The model's own top-K routing is counted per (layer, expert) on --data in one forward. For each G in --gpus, the
n experts (plus R redundant replicas) are spread over G GPUs, (n + R) / G slots each; a GPU's load is the sum of
its replicas' loads (an expert with c replicas gives each load / c), and the imbalance is max / mean GPU load
(1 = balanced; every MoE layer waits for its busiest GPU). Placements: contiguous (expert e on GPU e*G//n, the
static layout), round_robin (e on GPU e % G), and eplb: DeepSeek's expert-parallel load balancer (DeepSeek-AI,
EPLB, 2025, github.com/deepseek-ai/EPLB, MIT; ported in moetool.experiments.placement) with R = extra_slots x G
redundant replicas for the heaviest experts, hierarchical over --nodes when the expert groups (--groups, default
the model's routing groups) divide into them. With --reference-data and/or --reference-model, eplb_stale: EPLB
fitted on the loads of the reference model (default --model) on the reference data (default --data), evaluated
on --data's under --model (a placement computed once; the traffic or the weights changed). A reference model must
have the model's architecture and tokenizer; both models are held in memory.

Writes placement.csv (layer, gpus, nodes, replicas, slots_per_gpu, method, imbalance, max_gpu_load,
mean_gpu_load, min_gpu_load, max_replicas), placement_overall.csv (gpus, nodes, replicas, slots_per_gpu, method,
imbalance = sum of the layers' max / sum of their mean, max_layer_imbalance, layers),
placement_loads.csv (data_set, layer, expert, tokens, load, load_fraction), figures/placement_imbalance (imbalance
vs G per method), figures/placement_layers (per-layer imbalance at the largest G below n) and manifest.json (definitions).
Intervals (--bootstrap): the documents are resampled; contiguous, round_robin and eplb_stale of other
reference data are held fixed (BCa interval); eplb (and eplb_stale of --data's rows) is fitted on the data, so its
imbalance is in-sample (optimistic): EPLB is refitted on every resample and serves another, independent resample,
and the percentile interval (widened to include the estimate) describes the imbalance on traffic it was not fitted
on, the estimate at or near its low end.

--trace PATH (a moetool trace or import-trace run) takes the loads from recorded routing instead of a forward
(no bootstrap, no eplb_stale; --groups defaults to 1). --export sglang writes sglang_expert_location.json
(physical_to_logical_map for SGLang's --init-expert-location; every decoder layer a row, dense ones SGLang's
trivial map), --export eplb writes eplb_placement.json (EPLB's phy2log, log2phy, logcnt): the EPLB placement at
the one --gpus G and --extra-slots given.

Examples:
  moetool placement
  moetool placement --trace runs/vllm-trace --gpus 8 --extra-slots 1 --export sglang
  moetool placement --model tiny-fine --gpus 2,4,8 --extra-slots 0,1,2 --reference-data other.jsonl
  moetool placement --model tiny --reference-model tiny-early
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, Flag, experiment, option


@dataclass(frozen=True)
class PlacementOptions:
    """Options of :func:`~moetool.experiments.placement.compute.placement`, each with the flag of
    ``moetool placement`` that sets it (``--reference-data``, ``--reference-model`` and ``--export`` are the
    command's own)."""

    # G values (None: powers of two from 2 dividing n, at most n)
    gpus: tuple[int, ...] | None = option(None, "--gpus", "GPU counts G, comma-separated; each must divide the "
                                          "number of experts (default: powers of two up to n).", kind="ints")
    # redundant replica slots per GPU for EPLB: R = extra_slots * G
    extra_slots: tuple[int, ...] = option((0, 1), "--extra-slots", "Redundant replica slots per GPU for EPLB, "
                                          "comma-separated (R = slots x G).")
    # nodes for EPLB's hierarchical packing (must divide every G)
    nodes: int = option(1, "--nodes", "Nodes for EPLB's hierarchical packing (divides G).")
    # expert groups for EPLB (None: the model's routing groups, n_group, else 1)
    groups: int | None = option(None, "--groups", "Expert groups for EPLB (default: the model's routing groups, "
                                "else 1).", kind="int")
    layers: tuple[int, ...] | None = None  # MoE layers (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP  # replicates of the document-level bootstrap of the imbalances (0 = none)
    seed: int = 0

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if self.gpus is not None and (not self.gpus or min(self.gpus) < 1):
            raise MoetoolError(f"--gpus must be positive integers, not {list(self.gpus)}")
        if not self.extra_slots or min(self.extra_slots) < 0:
            raise MoetoolError(f"--extra-slots must be integers >= 0, not {list(self.extra_slots)}")
        if self.nodes < 1:
            raise MoetoolError(f"--nodes must be at least 1, not {self.nodes}")
        if self.groups is not None and self.groups < 1:
            raise MoetoolError(f"--groups must be at least 1, not {self.groups}")

    def gpu_counts(self, n: int) -> list[int]:
        """The G values for n experts: each must divide n (equal slots per GPU without replicas) and be a multiple
        of the nodes; the default keeps the powers of two from 2 to n that do."""
        if self.gpus is None:
            gs = [g for g in (2 ** i for i in range(1, n.bit_length())) if n % g == 0 and g % self.nodes == 0]
            if not gs:
                raise MoetoolError(f"no default --gpus for {n} experts on {self.nodes} node(s): give --gpus")
            return gs
        bad = [g for g in self.gpus if n % g or g % self.nodes]
        if bad:
            raise MoetoolError(f"--gpus {bad}: each G must divide the {n} experts and be a multiple of --nodes "
                               f"{self.nodes}")
        return sorted(set(self.gpus))


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "placement_imbalance": ("Per-GPU load imbalance (max / mean GPU load; summed over MoE layers, each waiting for "
                            "its busiest GPU) against the number of GPUs, one line per expert placement the legend "
                            "names: contiguous, round-robin, DeepSeek's EPLB with R = slots × G redundant replicas "
                            "(+r/GPU), and eplb_stale (EPLB fitted on a --reference, when one was given); dotted: "
                            "perfect balance; error bars: the bootstrap interval", ("placement_overall.csv",),
                            ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
    "placement_layers": ("Per MoE layer: per-GPU load imbalance at the largest number of GPUs below the number of "
                         "experts, one line per placement; dotted: perfect balance; error bars: the bootstrap "
                         "interval", ("placement.csv",), ("imbalance", "method", "replicas", "imbalance_lo/imbalance_hi")),
}

SPEC = experiment("placement", "placement", "PlacementOptions", figures="moetool.experiments.placement.figures:placement_figures",
                  demo=Demo(max_tokens=4096),
                  order=140,
                  groups=("trace",), bootstrap=True, title="per-GPU load imbalance (max/mean)",
                  summary_csv="placement_overall.csv",
                  flags=(Flag("--reference-data", "path", None, "Text/JSONL whose loads the stale EPLB placement is "
                              "computed from.", to_options=False),
                         Flag("--reference-model", "str", None, "Checkpoint (same architecture and tokenizer) whose loads "
                              "the stale EPLB placement is computed from.", to_options=False),
                         Flag("--export", "str", None, "Also write the EPLB placement at the one --gpus G and "
                              "--extra-slots given, as the engine loads it: sglang (--init-expert-location file) or "
                              "eplb (phy2log, log2phy, logcnt).", to_options=False)), captions=CAPTIONS)
