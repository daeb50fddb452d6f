"""The spec of ``moetool erc`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "erc_matrix": ("The clean ERC matrix M[i, j] per layer: the norm of expert j's output on proxy i; the title "
                   "gives the layer's α_min", ("erc_matrix.csv", "erc_layers.csv"), ("M", "proxy", "alpha_min")),
    "erc_loss": ("ERC loss against the margin α, one line per layer", ("erc.csv",), ("erc_loss",)),
}

SPEC = experiment("erc", "erc", "ErcOptions", inputs="weights", figures="moetool.experiments.erc.figures:erc_figures",
                  demo=Demo(seq_len=None, options={"samples": 4}),
                  order=30, captions=CAPTIONS)
