"""Streaming adaptive spherical k-means (AIR-MoE Algorithm 2), on the tokens' device.

Per batch of token states ``H [N, d]``: project onto the unit sphere, assign each token to the
codeword of largest cosine, then EMA-update the running counts and sums
``n_g <- γ n_g + (1-γ) n_g^batch``, ``m_g <- γ m_g + (1-γ) m_g^batch``; a codeword whose running count
falls below the dead-code threshold ``τ`` is re-initialised on a random token of the current batch
(``m_g <- h'_u``, ``n_g <- 1``); finally ``c_g = m_g / ||m_g||``. AIR-MoE's hyper-parameters: γ = 0.95,
τ = 1.

Choices where the paper is silent: the codebook is initialised on the first batch by spherical
k-means++ (D² sampling on ``1 - cos``), with ``n_g = 1`` and ``m_g = c_g`` — the state a re-initialised
codeword gets, so a codeword only dies after it has drawn on average fewer than ``τ`` tokens per
batch; if the first batch has fewer tokens than codewords, tokens are reused (the duplicates
die and are re-initialised later). Dead codewords of one batch are re-initialised on distinct
random tokens when the batch has enough.
"""

from __future__ import annotations

import torch

from .. import ops

GAMMA = 0.95
DEAD_TAU = 1.0


def assign(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``c(h) = argmax_g cos(h, c_g)`` for tokens ``x [N, d]`` and unit codewords ``[G, d]`` -> ``[N]`` long."""
    return (ops.unit(x.float()) @ codebook.float().T).argmax(-1)  # [N]


class SphericalKMeans:
    """``G`` unit codewords in ``R^d``, fitted by :meth:`update` one batch of tokens at a time."""

    def __init__(self, size: int, gamma: float = GAMMA, tau: float = DEAD_TAU, seed: int = 0):
        if size < 1:
            raise ValueError("codebook size must be at least 1")
        self.size, self.gamma, self.tau, self.seed = size, gamma, tau, seed
        self.codebook: torch.Tensor | None = None  # [G, d] unit rows
        self.counts: torch.Tensor | None = None  # [G] EMA counts n_g
        self.sums: torch.Tensor | None = None  # [G, d] EMA sums m_g
        self.reinits = 0  # dead-code re-initialisations so far
        self._gen: torch.Generator | None = None

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen

    def _init(self, x: torch.Tensor) -> None:
        """Spherical k-means++ on the first batch ``x [N, d]`` (unit rows)."""
        gen = self._generator(x.device)
        N, G = x.shape[0], self.size
        picks = [int(torch.randint(N, (1,), generator=gen, device=x.device))]
        dist = (1 - x @ x[picks[0]]).clamp_min(0)  # [N] 1 - cos to the nearest pick so far
        for _ in range(1, G):
            if float(dist.sum()) > 0:
                j = int(torch.multinomial(dist, 1, generator=gen))
            else:  # every token already coincides with a pick: reuse one
                j = int(torch.randint(N, (1,), generator=gen, device=x.device))
            picks.append(j)
            dist = torch.minimum(dist, (1 - x @ x[j]).clamp_min(0))
        self.codebook = x[picks].clone()  # [G, d]
        self.sums = self.codebook.clone()
        self.counts = torch.ones(G, device=x.device)

    @torch.no_grad()
    def update(self, h: torch.Tensor) -> torch.Tensor:
        """One EMA step on the batch ``h [N, d]`` (real tokens only); returns the assignments ``[N]``."""
        x = ops.unit(h.float())  # [N, d] h'
        if x.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=x.device)
        if self.codebook is None:
            self._init(x)
        g = (x @ self.codebook.T).argmax(-1)  # [N]
        n_batch = torch.zeros(self.size, device=x.device).index_add_(0, g, torch.ones(g.shape, device=x.device))
        m_batch = torch.zeros_like(self.sums).index_add_(0, g, x)  # [G, d]
        self.counts.mul_(self.gamma).add_((1 - self.gamma) * n_batch)
        self.sums.mul_(self.gamma).add_((1 - self.gamma) * m_batch)
        dead = (self.counts < self.tau).nonzero().flatten()  # [D]
        if dead.numel():
            gen = self._generator(x.device)
            if x.shape[0] >= dead.numel():
                u = torch.randperm(x.shape[0], generator=gen, device=x.device)[: dead.numel()]
            else:
                u = torch.randint(x.shape[0], (dead.numel(),), generator=gen, device=x.device)
            self.sums[dead] = x[u]
            self.counts[dead] = 1.0
            self.reinits += int(dead.numel())
        self.codebook = ops.unit(self.sums)
        return g

    def assign(self, h: torch.Tensor) -> torch.Tensor:
        """Nearest codeword by cosine for ``h [N, d]`` -> ``[N]``."""
        if self.codebook is None:
            raise ValueError("the codebook is not fitted yet")
        return assign(h, self.codebook)
