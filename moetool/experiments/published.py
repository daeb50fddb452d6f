"""Published numbers of the papers moetool reproduces, with their source, and layouts that put a measured run
beside them (a user with a GPU sees at a glance whether the run reproduces the paper).

Only numbers the papers state are here (``source`` says paper and table); nothing is interpolated. Values the
sources do not give (e.g. the per-node rows of AoE Table 1 other than the best node, or ERC's α_min per layer)
are absent, and the layouts show NaN for them rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import MoetoolError


@dataclass(frozen=True)
class Published:
    paper: str  # short name
    table: str  # where in the paper
    model: str  # moetool model name / hub id family
    task: str  # lm-eval task name ("" for weight-only numbers)
    metric: str
    policy: str  # "router" or "best node" (norm-select), "vanilla" (erc)
    value: float
    note: str = ""

    @property
    def source(self) -> str:
        return f"{self.paper}, {self.table}"


#: the works moetool's experiments come from, as the README's "Citing" section gives them
REFERENCES = {
    "aoe": "Lv et al. (2025). Autonomy-of-Experts Models. ICML 2025. arXiv:2501.13074",
    "su": "Su, Jianlin (2025). MoE环游记：1、从几何意义出发 (MoE Travelogue 1: Starting from Geometric Meaning). "
          "Scientific Spaces blog, 8 February 2025. https://kexue.fm/archives/10699",
    "erc": "Lv, Ma, Ma, Qiao (2025). Coupling Experts and Routers in Mixture-of-Experts via an Auxiliary Loss. "
           "arXiv:2512.23447",
    "air-moe": "Kladny, Mordig, Schölkopf, Muehlebach (2026). Adaptive Inverted-Index Routing for Granular "
               "Mixtures-of-Experts (AIR-MoE). arXiv:2605.04952",
    "graph-of-tokens": "Nguyen, Tran, Nguyen, Baraniuk (2025). Improving Routing in Sparse Mixture of Experts with "
                       "Graph of Tokens. arXiv:2505.00792",
}
AOE = "Autonomy-of-Experts (AoE), Lv et al., ICML 2025, arXiv 2501.13074"
ERC = "Expert-router coupling loss (ERC), Lv, Ma, Ma, Qiao 2025, arXiv 2512.23447"

#: AoE Table 1 (pilot on Mixtral 8x7B, routers removed, experts chosen by an activation norm; no training)
PUBLISHED: tuple[Published, ...] = (
    Published(AOE, "Table 1", "mixtral-8x7b", "mmlu", "acc", "router", 70.35, "5-shot"),
    Published(AOE, "Table 1", "mixtral-8x7b", "mmlu", "acc", "best node", 66.66, "5-shot"),
    Published(AOE, "Table 1", "mixtral-8x7b", "mmlu", "retention", "best node", 94.8, "66.66 / 70.35, percent"),
    Published(AOE, "Table 1", "mixtral-8x7b", "arc_challenge", "acc", "router", 62.12, ""),
    Published(AOE, "Table 1", "mixtral-8x7b", "arc_challenge", "acc", "best node", 58.79, ""),
    Published(AOE, "Table 1", "mixtral-8x7b", "arc_challenge", "retention", "best node", 94.6,
              "58.79 / 62.12, percent"),
    Published(ERC, "text (no table number)", "vanilla-moe", "", "alpha_min", "vanilla", 5.0,
              "approximate: the paper reads that a vanilla MoE needs α≈5 in every layer; no per-layer values given"),
)

#: model names accepted for the Mixtral rows
MIXTRAL_NAMES = ("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1")


def published(paper_model: str | None = None, metric: str | None = None) -> Any:
    """All published numbers (or those of one model / metric) as a DataFrame with a ``source`` column."""
    import pandas as pd

    rows = [dict(paper=p.paper, table=p.table, model=p.model, task=p.task, metric=p.metric, policy=p.policy,
                 value=p.value, note=p.note, source=p.source) for p in PUBLISHED
            if (paper_model is None or p.model == paper_model) and (metric is None or p.metric == metric)]
    return pd.DataFrame(rows)


def paper_model(model: str) -> str | None:
    """The published model key a moetool model name maps to (None: the papers give no number for it)."""
    m = model.lower()
    if m in (n.lower() for n in MIXTRAL_NAMES) or ("mixtral" in m and "8x7b" in m):
        return "mixtral-8x7b"
    return None


def _get(model: str, task: str, metric: str, policy: str) -> float:
    for p in PUBLISHED:
        if (p.model, p.task, p.metric, p.policy) == (model, task, metric, policy):
            return p.value
    return float("nan")


def aoe_table1(table: Any, model: str, tasks: Any = ("mmlu", "arc_challenge"), metric: str = "acc") -> Any:
    """AoE Table 1 layout: the measured norm-select table (:func:`moetool.experiments.norm_select.compute.table1`:
    one row per policy, ``<task> <metric>`` and ``<task> retention`` columns, retention as a ratio) beside the
    paper's numbers, all as fractions (0.7035, as quality.csv: the paper's percentages divided by 100).

    Rows: ``router`` and the measured best node per task (highest retention over the norm policies), each with
    ``paper`` and ``measured`` columns per task and a ``Δ`` (measured − paper, a fraction). A model the papers give
    no number for gets the measured columns only (no paper or Δ column: an empty column is not written).
    """
    import pandas as pd

    key = paper_model(model)
    tasks = list(tasks)
    if table is None or len(table) == 0:
        raise MoetoolError("no measured norm-select rows to lay out")
    if "node" not in table.columns:
        raise MoetoolError("aoe_table1 needs the norm-select Table-1 frame (a 'node' column)")
    router = table[table.node == "router"]
    norms = table[table.node != "router"]
    if router.empty or norms.empty:
        raise MoetoolError("aoe_table1 needs the router row and at least one norm policy row")
    out = []
    for label in ("router", "best node"):
        row: dict[str, Any] = {"row": label}
        for task in tasks:
            acc, ret = f"{task} {metric}", f"{task} retention"
            if acc not in table.columns:
                raise MoetoolError(f"task {task!r} was not measured (columns: {', '.join(table.columns)})")
            src = router.iloc[0] if label == "router" else norms.loc[norms[ret].astype(float).idxmax()]
            node = "router" if label == "router" else f"{src['node']}:{src['norm']}"
            m_acc, m_ret = float(src[acc]), 1.0 if label == "router" else float(src[ret])
            row[f"{task} node"] = node
            if key:  # the paper's percentages as fractions
                row[f"{task} {metric} paper"] = _get(key, task, metric, label) / 100
            row[f"{task} {metric} measured"] = m_acc
            row.update(_bounds(src, acc, f"{task} {metric} measured"))
            p_ret = (1.0 if label == "router" else _get(key, task, "retention", label) / 100) if key else None
            if key:
                row[f"{task} retention paper"] = p_ret
            row[f"{task} retention measured"] = m_ret
            row.update(_bounds(src, ret, f"{task} retention measured"))  # the router's too: [1, 1], as quality.csv
            if key:
                row[f"{task} retention Δ"] = m_ret - p_ret
        out.append(row)
    df = pd.DataFrame(out)
    df.attrs["published"] = key is not None
    df.attrs["source"] = (f"{AOE}, Table 1: paper beside measured (accuracy and retention as fractions)" if key
                          else f"AoE Table 1 layout; the paper gives numbers for Mixtral 8x7B only, not {model}: "
                          f"measured only (accuracy and retention as fractions)")
    return df


def _bounds(src: Any, col: str, name: str) -> dict[str, float]:
    """``name_lo``/``name_hi`` from the measured row's ``col_lo``/``col_hi`` (when it has them)."""
    if f"{col}_lo" not in src.index:
        return {}
    return {f"{name}_lo": float(src[f"{col}_lo"]), f"{name}_hi": float(src[f"{col}_hi"])}


def console_layout(table: Any) -> tuple[str, Any]:
    """``(title, frame)`` to print a published layout (:func:`aoe_table1`, :func:`erc_alpha_min`): measured
    values as ``value ± half-width``; without published numbers for the model, the paper and Δ columns are
    dropped and the title says so. Only the first column (``row``, ``layer``) labels the rows: a split table
    repeats it alone (``attrs["keys"]``), not the text column after it (AoE's ``<task> node`` is a value of the
    first task: each task's best node differs)."""
    from ..uncertainty import with_ci

    source = table.attrs.get("source", "")
    df = table
    if not table.attrs.get("published", True):
        df = df[[c for c in df.columns if " paper" not in c and "Δ" not in c and c != "source"]]
    shown = with_ci(df)
    shown.attrs["keys"] = 1
    return source, shown


def erc_alpha_min(layers: Any, model: str | None = None) -> Any:
    """ERC layout: measured ``alpha_min`` per layer (``erc_layers.csv``) beside the paper's value where it gives
    one (a vanilla MoE: α≈5 in every layer, approximate), with ``source``."""
    if layers is None or "alpha_min" not in getattr(layers, "columns", ()):
        raise MoetoolError("erc_alpha_min needs erc_layers with an alpha_min column")
    df = layers[["layer", "alpha_min"]].rename(columns={"alpha_min": "alpha_min measured"}).copy()
    ref = _get("vanilla-moe", "", "alpha_min", "vanilla")
    df["alpha_min paper"] = ref
    src = next(p for p in PUBLISHED if p.metric == "alpha_min")
    df["source"] = f"{src.source} ({src.note})"
    df.attrs["published"] = True
    df.attrs["source"] = (f"ERC alpha_min per layer: measured{' on ' + model if model else ''} beside the paper's "
                          f"vanilla-MoE value (α≈{ref:g} in every layer, approximate; {src.paper})")
    return df
