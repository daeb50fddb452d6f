"""The experiment registry: one :class:`Experiment` spec per experiment, from which everything else is derived.

* the command line: ``moetool <name>`` is ``<command>.register(app)`` for every spec (``moetool.commands.app``);
* ``import moetool``: ``moetool.<api>`` is the compute function and ``moetool.<Options>`` its options dataclass
  (``moetool.api.EXPORTS``);
* ``moetool demo``: a spec with a :class:`Demo` is a demo step, run by :func:`moetool.demo.run_step`;
* figures: :func:`moetool.report.plots.figures` draws the spec's ``figures`` function for a result;
* the parametrised tests (every command with zero tokens, under torchrun, per routing rule) read :data:`EXPERIMENTS`.

Everything here is a string (``"module:attr"``), so the command line's ``--help`` imports no torch, pandas or
matplotlib. How to add an experiment: ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import MoetoolError
from ..registry import did_you_mean

from ..demo_models import DEMO_MODELS as BASE  # the embedded base models every demo step runs on

PAIRS = (("tiny-early", "tiny"), ("tiny-fine-early", "tiny-fine"))


@dataclass(frozen=True)
class Demo:
    """How ``moetool demo`` runs an experiment: on ``models`` (``PAIRS`` for checkpoint pairs), ``max_tokens`` of
    the shipped held-out text in rows of ``seq_len`` (``None``: weights only), with ``options`` overriding the
    options dataclass's defaults (``options_from``: ``"module:attr"`` returning more overrides when the step runs,
    e.g. the shipped lm-eval tasks), and ``tokens`` passed to :func:`moetool.data.load_tokens`."""

    models: tuple[Any, ...] = BASE
    seq_len: int | None = 128
    max_tokens: int = 2048
    options: dict[str, Any] = field(default_factory=dict)
    options_from: str | None = None
    tokens: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Flag:
    """One option of a command generated from the registry (an :class:`Experiment` with no ``command`` module):
    ``--<flag>`` sets the options dataclass's field ``field`` (default: the flag's name with ``_`` for ``-``).
    ``kind`` is ``int``, ``float``, ``str`` or ``bool`` (``--x/--no-x``), or ``ints``, ``floats``, ``strs``: a
    comma-separated list, a tuple in the options (``none``: the empty tuple). ``default`` is shown by ``--help``
    (a list as its text, ``"0.5,1"``); ``None`` leaves the options dataclass's own default."""

    flag: str
    kind: str = "str"
    default: Any = None
    help: str = ""
    field: str | None = None

    KINDS = ("int", "float", "str", "bool", "ints", "floats", "strs")

    def __post_init__(self) -> None:
        if not self.flag.startswith("--") or self.kind not in self.KINDS:
            raise ValueError(f"bad Flag({self.flag!r}, {self.kind!r}): '--name' and one of {self.KINDS}")

    @property
    def name(self) -> str:
        """The option's field (and the generated command's parameter)."""
        return self.field or self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class Experiment:
    """One experiment. ``module`` holds ``function`` (``(lm, tokens, options=None, *, quiet, **overrides) ->
    Result``; ``inputs`` says what it takes instead of ``(lm, tokens)``: ``"weights"`` = ``(lm, options)``,
    ``"checkpoints"`` = ``(names or models, tokens, options)``), ``options`` (its dataclass) and ``lines``
    (``(name, Result) -> list[str]``: what the demo prints). ``api`` is its name in ``import moetool``;
    ``command`` the module of its CLI command; ``figures`` the ``"module:attr"`` drawing its figures."""

    name: str
    module: str
    function: str
    options: str | None = None
    api: str = ""
    inputs: str = "tokens"
    command: str | None = ""
    figures: str | None = None
    lines: str | None = "summary_lines"
    demo: Demo | None = None
    flags: tuple[Flag, ...] = ()
    bootstrap: bool = False
    title: str = ""
    summary_csv: str | None = None
    sample: tuple[str, ...] = ()

    @property
    def result(self) -> str:
        """The :class:`Result` name its function returns (``norm_select`` for ``norm-select``)."""
        return self.function

    def load(self, attr: str | None = None) -> Any:
        """The compute function (or another attribute of the experiment's module)."""
        return getattr(importlib.import_module(self.module), attr or self.function)

    def options_class(self) -> Any:
        return self.load(self.options) if self.options else None


def _x(name: str, function: str, options: str | None, **kw: Any) -> Experiment:
    module = f"moetool.experiments.{name.replace('-', '_')}.compute"
    cmd = kw.pop("cmd", function)  # None: a command generated from the spec
    return Experiment(name=name, module=module, function=function, options=options, api=kw.pop("api", function),
                      command=cmd and f"moetool.commands.{cmd}", **kw)


#: every experiment, in the demo's order
EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    _x("stats", "stats", "StatsOptions", figures="moetool.report.plots:stats_figures",
       demo=Demo(seq_len=256, max_tokens=8192, tokens={"add_special_tokens": None})),
    _x("norm-select", "norm_select", "NormSelectOptions", figures="moetool.report.plots:norm_select_figures",
       demo=Demo(models=("tiny",), seq_len=256, max_tokens=2048, options={"limit": 20, "batch_size": 16},
                 options_from="moetool.experiments.norm_select.compute:demo_options")),
    _x("erc", "erc", "ErcOptions", inputs="weights", figures="moetool.report.plots:erc_figures",
       demo=Demo(seq_len=None, options={"samples": 4})),
    _x("approx", "approx", "ApproxOptions", figures="moetool.report.plots:approx_figures",
       demo=Demo(max_tokens=1024, options={"batch_size": 8})),
    _x("mass-recall", "mass_recall", "MassRecallOptions", figures="moetool.report.plots:mass_recall_figures",
       demo=Demo(max_tokens=4096, options={"codebook_sizes": (8, 32), "kmeans_iters": 1})),
    _x("offload", "offload", "OffloadOptions", figures="moetool.report.plots_offload:offload_figures",
       demo=Demo(max_tokens=2048)),
    _x("fluctuation", "fluctuation", "FluctuationOptions", inputs="checkpoints",
       figures="moetool.report.plots:fluctuation_figures", demo=Demo(models=PAIRS, options={"isolate": True})),
    _x("topk", "topk", "TopkOptions", figures="moetool.report.plots:topk_figures",
       demo=Demo(max_tokens=2048, options={"ps": (0.5, 0.8, 0.95)}), cmd=None, bootstrap=True,
       title="experts per token and perplexity",
       flags=(Flag("--ks", "ints", None, "Fixed experts per token, comma-separated (default 1 .. K-1)."),
              Flag("--ps", "floats", "0.5,0.7,0.8,0.9,0.95,0.99", "Top-p masses, comma-separated ('none': no top-p)."),
              Flag("--kmax", "int", None, "At most this many experts per token under top-p (default: all n)."))),
    _x("margin", "margin", "MarginOptions", figures="moetool.report.plots:margin_figures",
       demo=Demo(max_tokens=2048, options={"bootstrap": 200}), cmd=None, bootstrap=True,
       title="routing margin and flips under noise", summary_csv="margin_flips.csv",
       flags=(Flag("--eps", "floats", "0.001,0.01,0.05,0.1", "Relative noise sizes on the router input, "
                   "comma-separated."),
              Flag("--thresholds", "floats", "0.001,0.01,0.1", "Margin thresholds (increasing), comma-separated."),
              Flag("--policies", "strs", "norm:gate,random", "Routing policies compared with the router (soft and "
                   "plain top-N Jaccard), comma-separated; none = off."))),
    _x("agreement", "agreement", "AgreementOptions", figures="moetool.report.plots:agreement_figures",
       demo=Demo(max_tokens=2048, options={"precisions": ("fp32", "bf16", "fp8"), "bootstrap": 200})),
    _x("capacity", "capacity", "CapacityOptions", figures="moetool.report.plots:capacity_figures",
       demo=Demo(max_tokens=2048, options={"cfs": (0.5, 1.0, 2.0), "orders": ("order", "score")}), cmd=None,
       bootstrap=True, title="capacity factor, dropped assignments and perplexity",
       flags=(Flag("--cf", "floats", "0.5,1,1.25,1.5,2", "Capacity factors, comma-separated (inf allowed).",
                   field="cfs"),
              Flag("--order", "strs", "order", "Which assignments an expert keeps: order (the first in token "
                   "order), score (the highest routing weight), or both: order,score.", field="orders"))),
    _x("prune", "prune", "PruneOptions", figures="moetool.report.plots:prune_figures",
       demo=Demo(models=("tiny",), max_tokens=2048, options={"fractions": (0.25, 0.5), "ablate": 4})),
    _x("super-experts", "super_experts", "SuperExpertsOptions", figures="moetool.report.plots:super_experts_figures",
       demo=Demo(models=("tiny",), max_tokens=2048), cmd=None, bootstrap=True,
       title="super experts and perplexity without them", sample=("--bootstrap", "100"),
       flags=(Flag("--percentile", "float", 99.5, "A super expert's maximum exceeds this percentile of every "
                   "(layer, expert) maximum."),
              Flag("--fraction-of-max", "float", 0.1, "... and above the largest // (1 / this) (--max-rule "
                   "floordiv) or at least this x the largest (--max-rule fraction)."),
              Flag("--max-rule", "str", "floordiv", "floordiv: > largest // (1 / --fraction-of-max), the paper's "
                   "code (largest // 10); fraction: >= --fraction-of-max x the largest."),
              Flag("--include-layers", "float", 0.75, "Only the MoE layers of the first round(this x L) decoder "
                   "layers, as the paper's code; 1: every layer."),
              Flag("--reading", "str", "routed", "routed: every routed token; first-row: per row, the first token "
                   "routed to the expert (what the paper's code's hook reads)."))),
    _x("placement", "placement", "PlacementOptions", figures="moetool.report.plots:placement_figures",
       demo=Demo(max_tokens=4096)),
    _x("expert-similarity", "expert_similarity", "ExpertSimilarityOptions", cmd=None, title="expert similarity",
       demo=Demo(max_tokens=2048), sample=("--cluster-to", "2"),
       flags=(Flag("--cluster-to", "int", None, "HC-SMoE's groups: cluster each layer's experts into this many "
                   "(average linkage on the distance of mean outputs); default: the merge order only."),)),
    _x("ppl", "ppl", "PplOptions", lines=None),
    _x("eval", "eval_tasks", "EvalOptions", api="evaluate", cmd="eval", inputs="model", lines=None),
    _x("trace", "trace", "TraceOptions", lines=None),
    _x("plan", "plan", None, inputs="config", lines=None),
)}

#: commands that are not experiments (their modules under moetool.commands)
OTHER_COMMANDS = ("demo", "inspect", "report", "import_trace")


def get(name: str) -> Experiment:
    """The spec of a command name (``norm-select``) or result name (``norm_select``); one line if unknown."""
    if name in EXPERIMENTS:
        return EXPERIMENTS[name]
    for spec in EXPERIMENTS.values():
        if spec.result == name:
            return spec
    raise MoetoolError(f"unknown experiment '{name}'{did_you_mean(name, EXPERIMENTS)}; known: "
                       f"{', '.join(EXPERIMENTS)}")


def command_modules() -> list[str]:
    """Every CLI command's module, experiments first (the order of ``moetool --help`` is alphabetical anyway);
    ``moetool.commands.generated`` registers the experiments with ``command=None`` (:func:`generated`)."""
    hand = [spec.command for spec in EXPERIMENTS.values() if spec.command]
    return hand + ["moetool.commands.generated"] + [f"moetool.commands.{c}" for c in OTHER_COMMANDS]


def generated() -> list[Experiment]:
    """The experiments whose command is generated from their spec (``moetool.commands.generated``)."""
    return [spec for spec in EXPERIMENTS.values() if not spec.command]
