"""The spec of ``moetool topk`` (torch-free: the command line, ``import moetool``, the demo, the report page
and ``--resume`` read it; :mod:`moetool.experiments.registry` discovers it)."""

from __future__ import annotations

from ..experiment import Demo, Flag, experiment

#: figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` of what it plots):
#: the report page's captions (:mod:`moetool.report.page`)
CAPTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "topk_frontier": ("Perplexity relative to the model's own routing on the same rows against the experts each "
                      "token uses (mean over MoE layers), for fixed k below the model's K and top-p routing; the "
                      "star is the model's own routing; error bars: the paired bootstrap interval", ("topk.csv",),
                      ("mean_experts", "ratio", "*_lo/*_hi")),
    "topk_layers": ("Top-p routing: experts per token (mean over real tokens) in each MoE layer, one line per p",
                    ("topk_layers.csv",), ("mean_experts",)),
}

SPEC = experiment("topk", "topk", "TopkOptions", figures="moetool.experiments.topk.figures:topk_figures",
                  demo=Demo(max_tokens=2048, options={"ps": (0.5, 0.8, 0.95)}), cmd=None, bootstrap=True,
                  title="experts per token and perplexity",
                  flags=(Flag("--ks", "ints", None, "Fixed experts per token, comma-separated (default 1 .. K-1)."),
                         Flag("--ps", "floats", "0.5,0.7,0.8,0.9,0.95,0.99", "Top-p masses, comma-separated ('none': no top-p)."),
                         Flag("--kmax", "int", None, "At most this many experts per token under top-p (default: all n).")),
                  order=80, captions=CAPTIONS)
