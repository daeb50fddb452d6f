"""Expert–router coupling (ERC; Lv, Ma, Ma, Qiao 2025, arXiv 2512.23447): the n×n matrix M of proxy-token activations, from weights only.

Per MoE layer, router row ``R_i`` is expert i's proxy token. ``M[i, j] = || node_j(R~_i) ||``: how strongly
expert j answers proxy i (node ``gate`` = ``W_g^j R~_i`` by default). A coupled layer has a dominant
diagonal; ``alpha_min`` is the smallest α for which the ERC loss ``L_ERC(α)`` vanishes on the clean M.

All ``n`` proxies (times the ``--samples`` draws of a chunk, :data:`DRAW_CHUNK_ELEMENTS`) go through all ``n``
experts as one batch of "tokens" of the batched probes (:func:`moetool.engine.probes.node_scores`): one batched
product per token chunk, on the model's device. Everything here is vectorised over i, j; no Python loop over experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from ... import distributed, ops
from ...adapters import quant
from ...adapters.base import MoELayer
from ...engine import probes
from ...engine.hooks import select_layers
from ...errors import MoetoolError, MoetoolRuntimeError
from ...progress import progress
from ..published import erc_alpha_min
from ..result import Result, resolve_options
from .spec import DEFAULT_ALPHAS, NOISE_MODES, ErcOptions  # noqa: F401 - its options (declared with their flags in spec.py)


DEFINITIONS = {
    "eps": "eps_i = ||R_i - R_j*|| / (2 ||R_i||), j* the nearest other router row (Euclidean), computed in fp32",
    "proxy": "R~_i = R_i * delta_i, delta_i ~ U(1 - eps_i, 1 + eps_i)^d elementwise; --noise derived uses eps_i "
             "above, none uses delta = 1, a float uses that eps for every i",
    "M": "M[i, j] = || node_j(R~_i) || (norm --norm, node --node; gate = W_g^j R~_i), fp32; row i = proxy i, "
         "column j = expert j; erc_matrix.csv holds the clean M (no noise). The node is computed as the batched "
         "probes compute it, i.e. including expert biases where the family has them (gpt-oss)",
    "erc_loss": "L_ERC(alpha) = (1/n^2) sum_i sum_{j != i} [max(M[i,j] - alpha M[i,i], 0) + "
                "max(M[j,i] - alpha M[i,i], 0)]; erc_loss = the mean over --samples draws of the loss of each "
                "draw's noisy M (not the loss of the mean M); erc_loss_clean = the loss of the clean M",
    "layer": "decoder layer index of the MoE layer",
    "erc_loss_clean": "L_ERC(alpha) of the clean M (no noise); see erc_loss",
    "alpha": "the alpha of L_ERC(alpha) (--alpha)",
    "m": "the clean M[i, j] (erc_matrix.csv; see M): proxy token i through expert j",
    "i/j": "i: the proxy token (router row R_i), j: the expert (erc_matrix.csv)",
    "n_experts": "the computed routed experts of the layer: M is n_experts x n_experts",
    "alpha_min": "max over i != j of max(M[i,j], M[j,i]) / M[i,i] on the clean M: the smallest alpha with "
                 "erc_loss_clean = 0",
    "alpha_min_paper": "the ERC paper's alpha_min where it gives one: a vanilla MoE needs alpha ~ 5 in every layer "
                       "(approximate, read from the paper's text; no per-layer table): moetool.experiments.published",
    "row_dominance": "fraction of proxies i with argmax_j M[i,j] = i (clean M), strictly: M[i,i] > M[i,j] for "
                     "every j != i (a tie for the row's maximum is no dominance)",
    "col_dominance": "fraction of experts j with argmax_i M[i,j] = j (clean M), strictly: M[j,j] > M[i,j] for "
                     "every i != j (a tie for the column's maximum is no dominance)",
    "zero_diagonal": "a layer where some M[i,i] = 0 on the clean M (an expert whose node is zero on its own proxy "
                     "token, e.g. zero weights) is refused in one line: alpha_min divides by M[i,i]",
    "router_abs_cos_mean": "mean |cos(R_i, R_j)| over ordered pairs i != j",
    "seeding": "each layer draws its noise from its own generator seeded with seed * 1_000_003 + layer index, so a "
               "layer's numbers do not depend on which other layers are analysed",
    "experts": "routed experts of the MoE layers only (shared experts and dense layers are not part of M); of them "
               "the computed ones: zero-computation experts (LongCat-Flash's identity experts) have no weights, "
               "their node on any proxy is the proxy itself, so they are left out of M, eps and the router rows "
               "(n_experts counts the computed experts)",
}


def parse_noise(text: str) -> str | float:
    """``derived`` | ``none`` | a float eps."""
    if text in NOISE_MODES:
        return text
    try:
        return float(text)
    except ValueError:
        raise MoetoolError(f"--noise must be derived, none or a number, not '{text}'") from None


def router_rows(layer: MoELayer) -> torch.Tensor:
    """The router rows ``R [m, d]`` of the ``n_computed`` computed experts as fp32, materialised if accelerate
    offloaded the router (``device_map``). A zero-computation expert (LongCat-Flash's identity) has no weights: its
    node on any proxy is the proxy itself, no coupling of an expert to its router row, so it is left out of M."""
    m = layer.n_computed
    if not hasattr(layer.router, "_hf_hook"):
        return layer.router_weight().detach().float()[:m]
    from accelerate.utils import align_module_device

    with align_module_device(layer.router):
        return layer.router_weight().detach().float()[:m].clone()


# ----- the math --------------------------------------------------------------------------------
def derived_eps(R: torch.Tensor) -> torch.Tensor:
    """``eps_i = ||R_i - R_j*|| / (2 ||R_i||)`` with ``j*`` the nearest other row: ``[n, d] -> [n]`` fp32."""
    R = R.float()
    dist = torch.cdist(R, R)  # [n, n]
    dist.fill_diagonal_(float("inf"))
    return dist.min(dim=1).values / (2 * ops.vector_norm(R).clamp_min(torch.finfo(torch.float32).tiny))


def noise_eps(R: torch.Tensor, noise: str | float) -> torch.Tensor:
    """Per-expert noise level ``[n]`` for ``--noise`` (``derived`` | ``none`` | float)."""
    if noise == "derived":
        return derived_eps(R)
    eps = 0.0 if noise == "none" else float(noise)
    if eps > torch.finfo(torch.float32).max:  # the proxies' fp32 cannot hold it (torch.full raised a RuntimeError)
        raise NoiseOverflow(f"--noise {noise}: past float32's largest number "
                            f"({torch.finfo(torch.float32).max:.3g}), the proxies' dtype")
    return torch.full((R.shape[0],), eps, dtype=torch.float32, device=R.device)


def proxy_tokens(R: torch.Tensor, eps: torch.Tensor, samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """``R~ = R ⊙ δ``, ``δ_i ~ U(1 - eps_i, 1 + eps_i)^d``: ``[n, d], [n] -> [samples, n, d]`` fp32."""
    n, d = R.shape
    u = torch.rand(samples, n, d, generator=generator, device=R.device)  # [S, n, d] in [0, 1)
    delta = 1 + eps.view(1, n, 1) * (2 * u - 1)  # [S, n, d]
    return R.float().unsqueeze(0) * delta


def coupling_matrix(layer: MoELayer, X: torch.Tensor, node: str = "gate", norm: str = "l2") -> torch.Tensor:
    """``M[..., i, j] = || node_j(X[..., i]) ||`` for proxies ``X [..., m, d]`` -> ``[..., m, m]`` fp32, j over the
    ``n_computed`` computed experts (zero-computation experts' columns left out).

    All proxies are one batch of tokens for the batched probes (chunked to bound memory).
    """
    lead, d = X.shape[:-1], X.shape[-1]
    scores = probes.node_scores(layer, X.reshape(-1, d), node, norm)[:, :layer.n_computed]  # [prod(lead), m]
    return scores.reshape(*lead, scores.shape[-1])


def erc_loss(M: torch.Tensor, alphas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """``L_ERC(α)`` for every α: ``M [..., n, n]`` -> ``[..., A]`` (fp64)."""
    M = M.double()
    n = M.shape[-1]
    a = torch.as_tensor(alphas, dtype=torch.float64, device=M.device).view(-1, 1, 1)  # [A, 1, 1]
    thr = a * M.diagonal(dim1=-2, dim2=-1).unsqueeze(-2).unsqueeze(-1)  # [..., A, n, 1]: α M[i, i] on row i
    over_row = (M.unsqueeze(-3) - thr).clamp_min(0)  # [..., A, n, n]: M[i, j] - α M[i, i]
    over_col = (M.transpose(-1, -2).unsqueeze(-3) - thr).clamp_min(0)  # [..., A, n, n]: M[j, i] - α M[i, i]
    off = ~torch.eye(n, dtype=torch.bool, device=M.device)  # [n, n]
    return ((over_row + over_col) * off).sum((-2, -1)) / n ** 2


def alpha_min(M: torch.Tensor) -> float:
    """``max_{i≠j} max(M[i,j], M[j,i]) / M[i,i]``: the smallest α with ``L_ERC(α) = 0``."""
    M = M.double()
    n = M.shape[-1]
    ratio = torch.maximum(M, M.T) / M.diagonal().unsqueeze(1)  # [n, n], row i divided by M[i, i]
    off = ~torch.eye(n, dtype=torch.bool, device=M.device)
    return float(ratio[off].max())


def alpha_sweep(alpha_mins: Sequence[float], alphas: Sequence[float] = (), points: int = 61) -> list[float]:
    """The α grid of the ERC loss figure: ``points`` steps from 0 to 1.15 × the largest α_min (or --alpha), plus
    every α_min and --alpha value exactly (the clean loss reaches 0 at α_min, and erc.csv's α lie on it)."""
    top = 1.15 * max([*alpha_mins, *alphas, 1e-3])
    grid = {round(top * k / (points - 1), 12) for k in range(points)}
    return sorted(grid | {float(a) for a in (*alpha_mins, *alphas)})


def loss_curves(matrix: Any, alphas: Sequence[float] = (), points: int = 61) -> Any:
    """Clean ``L_ERC(α)`` of every layer of an ``erc_matrix`` table (layer, i, j, m) on :func:`alpha_sweep`'s grid,
    past every layer's α_min: DataFrame (layer, alpha, erc_loss_clean, alpha_min). erc.csv keeps the --alpha values."""
    import pandas as pd

    Ms = {int(layer): torch.tensor(g.pivot(index="i", columns="j", values="m").to_numpy(), dtype=torch.float64)
          for layer, g in matrix.groupby("layer", sort=True)}  # layer -> [n, n]
    mins = {layer: alpha_min(M) for layer, M in Ms.items()}
    grid = alpha_sweep(list(mins.values()), alphas, points)
    return pd.DataFrame([{"layer": layer, "alpha": a, "erc_loss_clean": float(v), "alpha_min": mins[layer]}
                         for layer, M in Ms.items() for a, v in zip(grid, erc_loss(M, grid).tolist())])


def dominance(M: torch.Tensor) -> tuple[float, float]:
    """``(row, col)``: fraction of i with ``M[i,i] > M[i,j]`` for every ``j != i`` (``argmax_j M[i,j] = i``), of j
    with ``M[j,j] > M[i,j]`` for every ``i != j``. Strict: a tie for the maximum is no dominance (``argmax`` would
    credit the tie to the lower index, so relabelling the experts changed the fraction)."""
    others = M.masked_fill(torch.eye(M.shape[-1], dtype=torch.bool, device=M.device), float("-inf"))
    own = M.diagonal()
    return float((own > others.amax(dim=1)).double().mean()), float((own > others.amax(dim=0)).double().mean())


# ----- per layer, per run ------------------------------------------------------------------------
@dataclass
class LayerErc:
    layer: int
    M: torch.Tensor  # [n, n] clean M (host)
    loss: list[float]  # per α, mean over noise draws
    loss_clean: list[float]  # per α
    alpha_min: float
    row_dominance: float
    col_dominance: float
    eps_mean: float
    router_abs_cos_mean: float


#: proxy elements (draws x n x d) per chunk of --samples draws: 2^24 fp32 values, 64 MiB
DRAW_CHUNK_ELEMENTS = 1 << 24


class NoiseOverflow(MoetoolError):
    """The noisy proxies of a layer whose clean M is finite give a non-finite M: the noise level overflowed
    (:func:`run_erc` adds the largest noise that passes to the line)."""


def _finite_M(layer: MoELayer, X: torch.Tensor, opts: ErcOptions, noisy: bool = False) -> torch.Tensor:
    """:func:`coupling_matrix` of proxies ``X [s, n, d]``, or one line where it is not finite (``noisy``: the
    proxies are noise draws of rows whose clean M was finite, so the noise level is what overflowed:
    :class:`NoiseOverflow`)."""
    M = coupling_matrix(layer, X, opts.node, opts.norm)  # [s, n, n]
    if not bool(torch.isfinite(M).all()):  # weights only, no forward: the engine's FiniteGuard never ran
        if noisy:
            raise NoiseOverflow(f"--noise {opts.noise}: the noisy proxies of MoE layer {layer.index} give a "
                                f"non-finite M (node {opts.node}; the clean M is finite)")
        raise MoetoolRuntimeError(f"non-finite M in MoE layer {layer.index} (node {opts.node} of the experts' "
                                  "weights on the router rows; NaN/inf weights?): results would be meaningless")
    return M


@torch.no_grad()
def erc_layer(layer: MoELayer, opts: ErcOptions) -> LayerErc:
    """Everything ERC reports for one layer (on the layer's device; results moved to the host)."""
    R = router_rows(layer)  # [n, d]
    zero = (R == 0).all(dim=1).nonzero().flatten().tolist()
    if zero:  # its proxy token is the zero vector: M's row, eps_i (a division by ||R_i|| = 0) and alpha_min undefined
        raise MoetoolError(f"MoE layer {layer.index}: the router row of expert(s) {zero} is all zero, so its "
                           "proxy token is the zero vector and M, eps and alpha_min are undefined; leave the layer "
                           "out (--layers)")
    gen = torch.Generator(device=R.device).manual_seed(opts.seed * 1_000_003 + layer.index)
    eps = noise_eps(R, opts.noise)  # [n]
    clean = _finite_M(layer, R.float().unsqueeze(0), opts)[0]  # [n, n]: the clean proxies (no noise)
    dead = (clean.diagonal() == 0).nonzero().flatten().tolist()
    if dead:  # alpha_min divides by M[i, i]: inf (NaN for two such experts), and a zero column ties every argmax
        raise MoetoolError(f"MoE layer {layer.index}: node {opts.node} of expert(s) {dead} is zero on its own proxy "
                           f"token (M[i,i] = 0: zero expert weights?), so alpha_min (max M[i,j] / M[i,i]) and "
                           f"dominance are undefined; leave the layer out (--layers)")
    # the draws in chunks of at most DRAW_CHUNK_ELEMENTS proxy elements, their losses summed in fp64: memory is
    # one chunk's (--samples 10^8 on tiny asked for 400 GB at once); on the CPU the draws are those of one call
    loss_sum = torch.zeros(len(opts.alphas), dtype=torch.float64, device=R.device)
    per_chunk = max(1, DRAW_CHUNK_ELEMENTS // R.numel())
    for start in range(0, opts.samples, per_chunk):
        X = proxy_tokens(R, eps, min(per_chunk, opts.samples - start), gen)  # [s, n, d]
        loss_sum += erc_loss(_finite_M(layer, X, opts, noisy=True), opts.alphas).sum(0)  # [A]
    row, col = dominance(clean)
    return LayerErc(layer=layer.index, M=clean.cpu(), loss=(loss_sum / opts.samples).tolist(),
                    loss_clean=erc_loss(clean, opts.alphas).tolist(), alpha_min=alpha_min(clean), row_dominance=row,
                    col_dominance=col, eps_mean=float(eps.mean()), router_abs_cos_mean=float(ops.abs_cos_mean(R)))


@dataclass
class ErcResult:
    opts: ErcOptions
    layers: list[LayerErc] = field(default_factory=list)

    def tables(self) -> tuple[Any, Any, Any]:
        """``(erc, erc_layers, erc_matrix)`` DataFrames with exactly the columns of DEFINITIONS."""
        import pandas as pd

        erc = pd.DataFrame([{"layer": r.layer, "alpha": a, "erc_loss": lo, "erc_loss_clean": lc}
                            for r in self.layers for a, lo, lc in zip(self.opts.alphas, r.loss, r.loss_clean)])

        per_layer = pd.DataFrame([{"layer": r.layer, "n_experts": r.M.shape[0], "alpha_min": r.alpha_min,
                                   "row_dominance": r.row_dominance, "col_dominance": r.col_dominance,
                                   "eps_mean": r.eps_mean, "router_abs_cos_mean": r.router_abs_cos_mean}
                                  for r in self.layers])
        if len(per_layer):  # the paper's value beside the measured one, where it gives one
            per_layer.insert(3, "alpha_min_paper", erc_alpha_min(per_layer)["alpha_min paper"].to_numpy())
        frames = []
        for r in self.layers:
            n = r.M.shape[0]
            ii, jj = torch.meshgrid(torch.arange(n, device="cpu"), torch.arange(n, device="cpu"), indexing="ij")
            frames.append(pd.DataFrame({"layer": r.layer, "i": ii.reshape(-1).numpy(), "j": jj.reshape(-1).numpy(),
                                        "m": r.M.reshape(-1).numpy()}))
        return erc, per_layer, pd.concat(frames, ignore_index=True)


def run_erc(layers: Sequence[MoELayer], opts: ErcOptions, quiet: bool = False) -> ErcResult:
    """Every layer's :func:`erc_layer` (seeded per layer). Data parallel: rank r takes layers r, r + world, ... and
    the ranks exchange their results, so no layer is computed twice and every rank holds all of them."""
    world, rank = distributed.world_size(), distributed.rank()
    mine = list(layers)[rank::world]
    res = ErcResult(opts)
    for L in progress(mine, total=len(mine), description="erc", quiet=quiet):
        try:
            res.layers.append(erc_layer(L, opts))
        except NoiseOverflow as e:
            raise MoetoolError(f"{e}: {smaller_noise(mine, opts)}") from None
    if world > 1:
        got = {r.layer: r for part in distributed.gather_object(res.layers) for r in part}
        res.layers = [got[L.index] for L in layers]
    return res


def smaller_noise(layers: Sequence[MoELayer], opts: ErcOptions) -> str:
    """What to use instead of ``opts.noise``, whose noisy M overflowed: the largest ``eps / 10^k`` (``eps`` the
    fixed noise, or the largest derived eps_i of ``layers``) whose noisy M is finite in every layer of ``layers``
    on the same seeded draws (checked: doubling k, then halving the interval; a noise of 0 is the clean M, finite),
    as ``--noise <value>``; ``--noise none`` where none above 1e-30 passes."""
    if isinstance(opts.noise, str):  # derived: its largest eps_i over the layers
        base = max(float(noise_eps(router_rows(L), opts.noise).max()) for L in layers)
    else:
        base = float(opts.noise)

    def level(k: int) -> float:  # base / 10^k to 2 digits (10.0 ** -k: no OverflowError of 10 ** k past 1e308)
        return float(f"{base * 10.0 ** -k:.2g}")

    def passes(k: int) -> bool:
        try:
            for L in layers:
                erc_layer(L, replace(opts, noise=level(k)))
        except NoiseOverflow:
            return False
        return True

    lowest = math.floor(math.log10(base) + 30)  # the largest k whose level is at least 1e-30
    fail, k = 0, 1
    while not passes(k):
        if k >= lowest:
            return "--noise none (no noise) is the only level that keeps M finite"
        fail, k = k, min(2 * k, lowest)  # never past 1e-30 without checking the levels between
    while k - fail > 1:  # passes(k), not passes(fail): the smallest k that passes, between them
        mid = (fail + k) // 2
        fail, k = (fail, mid) if passes(mid) else (mid, k)
    return f"--noise {level(k):g} keeps M finite in every layer (checked on the same seeded draws)"


def erc(lm: Any, options: ErcOptions | None = None, *, quiet: bool = False, **overrides: Any) -> Result:
    """Expert–router coupling of every (or ``layers``') MoE layer, from the weights only (no data).

    Tables ``erc`` (layer, alpha, erc_loss, erc_loss_clean), ``erc_layers`` (layer, n_experts, alpha_min,
    alpha_min_paper, row_dominance, col_dominance, eps_mean, router_abs_cos_mean) and ``erc_matrix`` (layer, i, j, m = clean M);
    see :data:`DEFINITIONS`.
    """
    opts = resolve_options(ErcOptions, options, overrides)
    layers = select_layers(lm.layers, opts.layers)
    quant.require_readable(layers, "erc")
    res = run_erc(layers, opts, quiet=quiet)
    erc_df, per_layer, matrix = res.tables()
    o = res.opts
    return Result("erc", {"erc.csv": erc_df, "erc_layers.csv": per_layer, "erc_matrix.csv": matrix}, opts,
                  meta=dict(definitions=DEFINITIONS,
                            erc={"alphas": list(o.alphas), "noise": o.noise, "samples": o.samples, "node": o.node,
                                 "norm": o.norm, "layers": [r.layer for r in res.layers]}),
                  summary=per_layer)


def summary_lines(name: str, res: Any) -> list[str]:
    per_layer, erc = res["erc_layers"], res["erc"]
    top = erc[erc["alpha"] == erc["alpha"].max()]
    return [f"erc {name}: alpha_min {per_layer['alpha_min'].min():.2f}-{per_layer['alpha_min'].max():.2f} over "
            f"{len(per_layer)} layers; row/col dominance {per_layer['row_dominance'].mean():.2f}/"
            f"{per_layer['col_dominance'].mean():.2f} (mean over layers); L_ERC(α={top['alpha'].iloc[0]:g}) mean "
            f"{top['erc_loss'].mean():.4g} (clean {top['erc_loss_clean'].mean():.4g})"]
