"""One house style for every figure (matplotlib, no screen needed)."""

from __future__ import annotations

from typing import Any


def new_figure(nrows: int = 1, ncols: int = 1, width: float = 4.2, height: float = 3.2) -> tuple[Any, Any]:
    """``(fig, axes)`` with the house style; ``axes`` is always a flat list."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 100, "savefig.dpi": 150})
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, list(axes.ravel())


def grid_shape(n: int, max_cols: int = 4) -> tuple[int, int]:
    cols = min(max_cols, max(1, n))
    return -(-n // cols), cols


def heatmap(ax: Any, matrix: Any, title: str = "", xlabel: str = "", ylabel: str = "", cmap: str = "viridis",
            colorbar: bool = True) -> Any:
    im = ax.imshow(matrix, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(False)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return im


def line_by(ax: Any, df: Any, x: str, y: str, by: str, title: str = "", marker: str = "o") -> None:
    """One line per value of column ``by``."""
    for key, g in df.groupby(by, sort=False):
        g = g.sort_values(x)
        ax.plot(g[x], g[y], marker=marker, label=str(key), linewidth=1.2, markersize=3)
    if df[x].dtype.kind in "iu":  # layers, shortlist sizes: integer ticks only
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.legend(fontsize=7, frameon=False)
