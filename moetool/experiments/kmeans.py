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

Data parallel (:class:`GlobalBatch`): each rank holds its slice of the global batch; the batch counts and sums
``n_g^batch``, ``m_g^batch`` are all-reduced before the EMA step, k-means++ draws from the gathered ``1 - cos``
distances, and a drawn token (a k-means++ pick, a dead-code seed) is fetched from the rank that holds it. The
generator's draws are the same on every rank, so every rank keeps the codebook one process would fit on the
same global batches; a rank with no token in a batch still joins every collective.
"""

from __future__ import annotations

import torch

from .. import distributed, ops

GAMMA = 0.95
DEAD_TAU = 1.0


def assign(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``c(h) = argmax_g cos(h, c_g)`` for tokens ``x [N, d]`` and unit codewords ``[G, d]`` -> ``[N]`` long."""
    return (ops.unit(x.float()) @ codebook.float().T).argmax(-1)  # [N]


class GlobalBatch:
    """One global k-means batch split over data-parallel ranks: this rank holds global rows
    ``offset … offset + n − 1``. Every rank builds one per batch (also with ``n = 0``) and makes the same calls."""

    def __init__(self, n: int, device: torch.device):
        counts = distributed.rank_counts(n, device)
        self.counts, self.n = counts, n
        self.total = int(counts.sum())
        self.offset = int(counts[: distributed.rank()].sum())

    @staticmethod
    def sum(t: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(t)

    def cat(self, v: torch.Tensor) -> torch.Tensor:
        """Per-row ``v [n]`` of every rank, in global row order ``[total]``."""
        return distributed.all_gather_rows(v, self.counts)

    def rows(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (global numbers) of the global batch, from whichever rank holds each."""
        local = idx.to(x.device) - self.offset
        mine = (local >= 0) & (local < self.n)
        out = torch.zeros(idx.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        out[mine] = x[local[mine]]
        return self.sum(out)


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

    def _init(self, x: torch.Tensor, gb: GlobalBatch | None = None) -> None:
        """Spherical k-means++ on the first batch ``x [N, d]`` (unit rows; a rank's slice of it under ``gb``)."""
        gen = self._generator(x.device)
        N, G = (x.shape[0] if gb is None else gb.total), self.size

        def row(j: int) -> torch.Tensor:
            return x[j] if gb is None else gb.rows(torch.tensor([j], device=x.device), x)[0]

        j = int(torch.randint(N, (1,), generator=gen, device=x.device))
        picks = [row(j)]
        dist = (1 - x @ picks[0]).clamp_min(0)  # [N] 1 - cos to the nearest pick so far
        for _ in range(1, G):
            if float(dist.sum() if gb is None else gb.sum(dist.sum())) > 0:
                j = int(torch.multinomial(dist if gb is None else gb.cat(dist), 1, generator=gen))
            else:  # every token already coincides with a pick: reuse one
                j = int(torch.randint(N, (1,), generator=gen, device=x.device))
            picks.append(row(j))
            dist = torch.minimum(dist, (1 - x @ picks[-1]).clamp_min(0))
        self.codebook = torch.stack(picks)  # [G, d]
        self.sums = self.codebook.clone()
        self.counts = torch.ones(G, device=x.device)

    @torch.no_grad()
    def update(self, h: torch.Tensor, gb: GlobalBatch | None = None) -> torch.Tensor:
        """One EMA step on the batch ``h [N, d]`` (real tokens only; under data parallel this rank's slice of the
        global batch ``gb``); returns the assignments ``[N]``."""
        x = ops.unit(h.float())  # [N, d] h'
        N = x.shape[0] if gb is None else gb.total
        if N == 0:
            return torch.zeros(0, dtype=torch.long, device=x.device)
        if self.codebook is None:
            self._init(x, gb)
        g = (x @ self.codebook.T).argmax(-1)  # [N]
        n_batch = torch.zeros(self.size, device=x.device).index_add_(0, g, torch.ones(g.shape, device=x.device))
        m_batch = torch.zeros_like(self.sums).index_add_(0, g, x)  # [G, d]
        if gb is not None:
            n_batch, m_batch = gb.sum(n_batch), gb.sum(m_batch)
        self.counts.mul_(self.gamma).add_((1 - self.gamma) * n_batch)
        self.sums.mul_(self.gamma).add_((1 - self.gamma) * m_batch)
        dead = (self.counts < self.tau).nonzero().flatten()  # [D]
        if dead.numel():
            gen = self._generator(x.device)
            if N >= dead.numel():
                u = torch.randperm(N, generator=gen, device=x.device)[: dead.numel()]
            else:
                u = torch.randint(N, (dead.numel(),), generator=gen, device=x.device)
            self.sums[dead] = x[u] if gb is None else gb.rows(u, x)
            self.counts[dead] = 1.0
            self.reinits += int(dead.numel())
        self.codebook = ops.unit(self.sums)
        return g

    def assign(self, h: torch.Tensor) -> torch.Tensor:
        """Nearest codeword by cosine for ``h [N, d]`` -> ``[N]``."""
        if self.codebook is None:
            raise ValueError("the codebook is not fitted yet")
        return assign(h, self.codebook)
