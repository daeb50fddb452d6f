r"""Expert–router coupling (ERC) from the weights only: no data, no tokenizer.

Source: Lv, Ma, Ma, Qiao (2025), "Coupling Experts and Routers in Mixture-of-Experts via an Auxiliary Loss",
arXiv 2512.23447.

Per MoE layer, router row R_i is a proxy token for expert i, perturbed
R~_i = R_i ⊙ δ_i with δ_i ~ U(1−eps_i, 1+eps_i)^d. M\[i,j] = ||W_g^j R~_i||
(--node gate) is how strongly expert j answers proxy i.
L_ERC(α) = (1/n²) Σ_i Σ_{j≠i} max(M\[i,j] − αM\[i,i], 0)
                          + max(M\[j,i] − αM\[i,i], 0).
alpha_min (clean M) is the smallest α with zero loss; row/col dominance is the
fraction of proxies/experts whose own counterpart is their row/column maximum,
strictly (a tie is no dominance). A layer with some M\[i,i] = 0 (an expert whose
node is zero on its own proxy, e.g. zero weights) is refused: alpha_min is
undefined. Routed experts of the MoE layers only, the computed ones: zero-computation
(identity) experts have no weights and are left out of M.

Writes erc.csv (layer, alpha, erc_loss = mean over --samples draws of each
draw's loss, erc_loss_clean), erc_layers.csv (layer, n_experts, alpha_min,
alpha_min_paper, row_dominance, col_dominance, eps_mean, router_abs_cos_mean;
alpha_min_paper = the ERC paper's vanilla-MoE value α≈5 in every layer,
approximate, printed beside the measured one), erc_matrix.csv
(layer, i, j, m = clean M), figures/erc_matrix (heatmaps), figures/erc_loss
(clean L_ERC(α) from 0 past every layer's alpha_min, which is marked; the noisy
loss at the --alpha values as points), manifest.json (every definition).

Examples:
  moetool erc --out runs/erc-tiny
  moetool erc --model tiny-fine --alpha 0.5,1,2,5 --samples 8
  moetool erc --noise none --node glu --norm l1 --layers 0,2
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

DEFAULT_ALPHAS = (0.4, 0.6, 0.8, 1.0)
NOISE_MODES = ("derived", "none")


@dataclass(frozen=True)
class ErcOptions:
    """Options of :func:`~moetool.experiments.erc.compute.erc`, each with the flag of ``moetool erc`` that sets
    it."""

    alphas: tuple[float, ...] = option(DEFAULT_ALPHAS, "--alpha",
                                       "Comma-separated α values of L_ERC(α).")  # the α values of erc.csv
    noise: str | float = option("derived", "--noise",  # derived | none | a fixed eps for every expert
                                "derived: eps_i from the nearest other router row (||R_i − R_j*|| / 2||R_i||); none: "
                                "no noise; a number: that eps for every expert.", shown="derived",
                                parse="moetool.experiments.erc.compute:parse_noise")
    samples: int = option(1, "--samples", "Noise draws (seeded); erc_loss is their mean.",
                          min=1)  # noise draws; the noisy loss is their mean
    node: str = option("gate", "--node",
                       "Probe node whose norm fills M: gate|up|act|glu|output.")  # probe node whose norm fills M
    norm: str = option("l2", "--norm", "Norm of the node: l2|l1|linf.")  # l2 | l1 | linf
    seed: int = 0
    layers: tuple[int, ...] | None = None  # MoE layers analysed (None: every MoE layer)

    def __post_init__(self) -> None:
        from ... import ops
        from ...engine import probes

        if not self.alphas:
            raise MoetoolError("--alpha needs at least one value")
        if any(a < 0 for a in self.alphas):
            raise MoetoolError(f"--alpha values must be >= 0, got {list(self.alphas)}")
        if self.samples < 1:
            raise MoetoolError(f"--samples must be >= 1, got {self.samples}")
        if self.node not in probes.NODES:
            raise MoetoolError(f"--node must be one of {', '.join(probes.NODES)}, not '{self.node}'")
        if self.norm not in ops.NORMS:
            raise MoetoolError(f"--norm must be one of {', '.join(ops.NORMS)}, not '{self.norm}'")
        if isinstance(self.noise, str) and self.noise not in NOISE_MODES:
            raise MoetoolError(f"--noise must be derived, none or a number, not '{self.noise}'")
        if not isinstance(self.noise, str) and not self.noise >= 0:
            raise MoetoolError(f"--noise eps must be >= 0, got {self.noise}")


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "erc_matrix": ("The clean ERC matrix M[i, j] per layer: the norm of expert j's output on proxy i; the title "
                   "gives the layer's α_min", ("erc_matrix.csv", "erc_layers.csv"), ("M", "proxy", "alpha_min")),
    "erc_loss": ("ERC loss against the margin α, one line per layer", ("erc.csv",), ("erc_loss",)),
}

SPEC = experiment("erc", "erc", "ErcOptions", inputs="weights", figures="moetool.experiments.erc.figures:erc_figures",
                  demo=Demo(seq_len=None, options={"samples": 4}),
                  order=30,
                  captions=CAPTIONS)
