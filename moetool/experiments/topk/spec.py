"""The compute-quality frontier of reduced and dynamic K: perplexity against experts per token.

For the router and each policy, the policy replaces routing in the MoE layers (--layers) and the model runs on
--data. topk:<k> is the model's own routing with k experts instead of K (its ranking, group limits and bias;
the weights its rule gives the chosen set, renormalised where it renormalises; topk:K reproduces the model).
topp:<p> keeps, per token, the smallest set of experts in decreasing routing probability π whose mass reaches p
(at least one, at most --kmax; dynamic routing, Huang et al. 2024, arXiv 2403.07652). The same policies work in
ppl, eval and trace: --routing topk:1, --routing topp:0.9.
Experts per token count computed experts: zero-computation experts (LongCat-Flash's identity experts, Zaya's skip
expert) may be chosen but cost nothing, so the router's row can be below K.
Intervals: 95% document-level bootstrap over packed rows (--bootstrap N, 0 = off); the ratio is paired with the
router on the same rows.

Writes topk.csv (policy, kind, value, tokens, scored_tokens, mean_experts, experts_frac, perplexity, ratio;
*_lo/*_hi), topk_layers.csv (policy, kind, value, layer, tokens, mean_experts, experts_frac, min_experts,
max_experts),
figures/topk_frontier (perplexity / the router's vs experts per token), figures/topk_layers (top-p: experts per token by
layer) and manifest.json (definitions).

Examples:
  moetool topk
  moetool topk --model tiny-fine --ks 1,4 --ps 0.5,0.9 --max-tokens 4096
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...context import flag
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

DEFAULT_PS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class TopkOptions:
    """Options of :func:`~moetool.experiments.topk.compute.topk`, each with the flag of ``moetool topk`` that
    sets it."""

    ks: tuple[int, ...] | None = option(None, "--ks", "Fixed experts per token, comma-separated (default 1 .. K-1).",
                                        kind="ints")  # fixed k per token (None: 1 .. K-1)
    ps: tuple[float, ...] = option(DEFAULT_PS, "--ps", "Top-p masses, comma-separated ('none': no "
                                   "top-p).")  # top-p masses
    # at most this many experts per token for topp (None: n)
    kmax: int | None = option(None, "--kmax", "At most this many experts per token under top-p (default: all n).",
                              kind="int")
    layers: tuple[int, ...] | None = None  # MoE layers whose routing is replaced (None: every MoE layer)
    batch_size: int = 8
    bootstrap: int = DEFAULT_BOOTSTRAP
    seed: int = 0

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        check_n_boot(self.bootstrap)
        if self.ks is not None and (not self.ks or min(self.ks) < 1):
            raise MoetoolError(f"{flag('ks')} must be positive integers, not {list(self.ks)}")
        if any(not 0.0 < p <= 1.0 for p in self.ps):
            raise MoetoolError(f"--ps must lie in (0, 1], not {list(self.ps)}")
        if self.kmax is not None and self.kmax < 1:
            raise MoetoolError(f"--kmax must be at least 1, not {self.kmax}")

    def specs(self, K: int) -> list[tuple[str, str, float]]:
        """``(policy spec, kind, value)`` in the sweep's order, the router first."""
        from ...policies.base import number_text

        ks = self.ks if self.ks is not None else tuple(range(1, K))
        tail = f":{self.kmax}" if self.kmax is not None else ""
        return ([("router", "router", float(K))] + [(f"topk:{k}", "topk", float(k)) for k in ks]
                + [(f"topp:{number_text(p)}{tail}", "topp", float(p)) for p in self.ps])  # p exactly, not :g


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "topk_frontier": ("Perplexity relative to the model's own routing on the same rows against the experts each "
                      "token uses (mean over the MoE layers the policy ran in, --layers), for fixed k below the "
                      "model's K and top-p routing; the star is the model's own routing; error bars: the paired "
                      "bootstrap interval", ("topk.csv",),
                      ("mean_experts", "ratio", "*_lo/*_hi")),
    "topk_layers": ("Top-p routing: experts per token (mean over real tokens) in each MoE layer, one line per p",
                    ("topk_layers.csv",), ("mean_experts",)),
}

SPEC = experiment("topk", "topk", "TopkOptions", figures="moetool.experiments.topk.figures:topk_figures",
                  demo=Demo(max_tokens=2048, options={"ps": (0.5, 0.8, 0.95)}), bootstrap=True,
                  title="experts per token and perplexity",
                  order=80, captions=CAPTIONS)
