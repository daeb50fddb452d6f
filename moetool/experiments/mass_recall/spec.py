"""Mass recall of an IVF router: codebook -> expert shortlist -> exact scoring inside it (AIR-MoE).

Source: Kladny, Mordig, Schölkopf, Muehlebach (2026), "Adaptive Inverted-Index Routing for Granular
Mixtures-of-Experts" (AIR-MoE), arXiv 2605.04952.

Per MoE layer: a codebook of G unit codewords is fitted on the router inputs h by streaming adaptive spherical
k-means (EMA γ=0.95, dead codes below τ=1 re-initialised on a random token of the batch; k-means++ init; the
first pass plus --kmeans-iters extra passes), then a last pass evaluates on the same tokens. Token h goes to
c(h) = argmax_g cos(h, c_g); shortlist L(c) = the M experts ranked highest at the codeword.
MassRecall(h) = Σ_{e∈L(c(h))} π_e(h); top-K recall |TopK ∩ L|/K; exact-top-K rate (TopK ⊆ L);
ε = ||h − c(h)||; bound = exp(−2ε) ρ_M(c(h)), ρ_M(c) = Σ_{e∈L(c)} π_e(c) (Proposition 1; a theorem with
--centroids unit, so bound_holds_rate is 1 there). --centroids raw: the model's own router (bias, scoring,
its top-K); unit: router rows on the unit sphere, logits <w_e, h>, softmax. One codebook per (layer, G) for
every M. A shortlist size larger than a layer's n experts is refused before any forward (the default
sizes 2,4,8,16 stop at n).

Scale-aware bound: the proof holds for any point x and a fixed shortlist L: MassRecall(h) >= exp(−2||h − x||)
ρ_L(x). The paper's x = c(h) (unit) against raw states of norm ≈ sqrt(d) gives ≈ e^{-2 sqrt(d)} (true, empty);
x = s·c(h) keeps L for every s > 0, so bound_scaled = max_s exp(−2||h − s·c||) ρ_L(s·c). s = <h, c> minimises
the distance but is not optimal (d/ds log ρ_L = E_{π|L}[z] − E_π[z] > 0 there when M < n), so moetool takes the
best of s = 1, s = <h, c> and 64 grid points on [0, 2 max||h||] (any s gives a valid bound). Checked on every
token (bound_scaled_holds_rate; 1 in unit mode, a theorem). Derivation also in manifest.json (bound_derivation).

--bootstrap N (default 1000, 0 = off, seeded by --seed): 95% document-level bootstrap over packed rows (per-row
sums on the device, moetool.uncertainty) of mass_recall_mean, topk_recall and exact_topk_rate (*_lo/*_hi
columns, error bars in mass_recall_vs_shortlist; on the console value ± half-width where the interval is
symmetric to the digits shown, else value [lo, hi]). The codebook is held fixed (fitted once); the interval covers
the evaluation tokens' sampling only.

Writes mass_recall.csv (layer, codebook_size, shortlist_size, centroids, tokens, mass_recall_mean,
mass_recall_p05, topk_recall, exact_topk_rate (each mean with _lo/_hi), quant_error_mean, bound_mean, bound_holds_rate, dead_codes,
bound_scaled_mean, bound_scaled_holds_rate, best_scale_mean, expert_coverage, router_flops_frac = (G+M)/n;
every rate and recall a fraction in [0, 1], not %; dead_codes = the count of codewords no token went to (not
AIR-MoE's dead experts); expert_coverage = the fraction of experts in some used codeword's shortlist),
figures/mass_recall_vs_shortlist, figures/mass_recall_vs_router_flops (dashed: the full router's cost, 1),
figures/mass_recall_vs_bounds (measured vs both bounds; the y axis spans the measured values, bounds below it are
clipped and their maxima named in the title), manifest.json (definitions, bound_derivation).

Examples:
  moetool mass-recall --out runs/mr-tiny
  moetool mass-recall --model tiny-fine --codebook-size 16,64 --shortlist 4,8,16,32 --centroids unit
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import DEFAULT_BOOTSTRAP
from ...errors import MoetoolError
from ..experiment import Demo, experiment, option

MODES = ("raw", "unit")
#: each centroid mode in a few words, for the summary lines (a bare "tiny raw" / "tiny unit" said nothing)
MODE_WORDS = {"raw": "the model's router as is", "unit": "router rows on the unit sphere"}
#: shortlist sizes M when none are given (those up to each layer's n)
DEFAULT_SHORTLISTS = (2, 4, 8, 16)


@dataclass(frozen=True)
class MassRecallOptions:
    """Options of :func:`~moetool.experiments.mass_recall.compute.mass_recall`, each with the flag of
    ``moetool mass-recall`` that sets it."""

    codebook_sizes: tuple[int, ...] = option((8, 32, 128), "--codebook-size", "Codebook sizes G, comma-separated.",
                                             short="-G")  # G: codewords per layer
    # M: experts per shortlist (None: 2, 4, 8, 16 up to each layer's n)
    shortlists: tuple[int, ...] | None = option(None, "--shortlist", "Shortlist sizes M, comma-separated, each at most "
                                                "the layer's n experts (default: 2,4,8,16 up to n).", kind="ints",
                                                short="-M")
    centroids: tuple[str, ...] = option(("raw", "unit"), "--centroids", "Expert centroid modes, comma-separated: raw "
                                        "(the router as is) and/or unit (rows on the unit sphere).")  # expert centroid modes
    kmeans_iters: int = option(1, "--kmeans-iters", "Extra k-means passes over the data after the first.",
                               min=0)  # extra k-means passes over the data after the first
    seed: int = 0
    bootstrap: int = DEFAULT_BOOTSTRAP  # document-level bootstrap replicates over packed rows (0 = no intervals)
    batch_size: int = 8
    layers: tuple[int, ...] | None = None  # MoE layers analysed (None: every MoE layer)

    def __post_init__(self) -> None:
        from ...uncertainty import check_n_boot

        bad = [c for c in self.centroids if c not in MODES]
        if bad:
            raise MoetoolError(f"--centroids {bad[0]!r}: choose from {', '.join(MODES)}")
        if not self.codebook_sizes or min(self.codebook_sizes) < 1:
            raise MoetoolError("--codebook-size values must be >= 1")
        if self.shortlists is not None and (not self.shortlists or min(self.shortlists) < 1):
            raise MoetoolError("--shortlist values must be >= 1")
        if self.kmeans_iters < 0:
            raise MoetoolError("--kmeans-iters must be >= 0")
        check_n_boot(self.bootstrap)

    def shortlist_sizes(self, n: int) -> list[int]:
        """The shortlist sizes M run on a layer of ``n`` experts: the given ones (each at most n: checked before
        any forward by :func:`~moetool.experiments.mass_recall.compute.run_mass_recall`), or the defaults up to n."""
        return list(self.shortlists) if self.shortlists is not None else [m for m in DEFAULT_SHORTLISTS if m <= n]


#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "mass_recall_vs_shortlist": ("Per layer: mean mass recall against the shortlist size M, one line per codebook",
                                 ("mass_recall.csv",), ("mass_recall_mean", "codebook", "centroids")),
    "mass_recall_vs_router_flops": ("Per layer: mean mass recall against the router FLOPs spent (fraction of the "
                                    "full router's), one line per codebook", ("mass_recall.csv",),
                                    ("mass_recall_mean", "router_flops_frac")),
    "mass_recall_vs_bounds": ("Per layer, largest codebook: measured mass recall beside the paper's lower bound "
                              "and the scale-aware bound (log scale)", ("mass_recall.csv",),
                              ("mass_recall_mean", "bound_mean", "bound_scaled_mean")),
}

SPEC = experiment("mass-recall", "mass_recall", "MassRecallOptions", figures="moetool.experiments.mass_recall.figures:mass_recall_figures",
                  demo=Demo(max_tokens=4096, options={"codebook_sizes": (8, 32), "kmeans_iters": 1}),
                  order=50,
                  bootstrap=True, defaults={"max_tokens": 16384},
                  captions=CAPTIONS)
