"""``norm-select``: the Autonomy-of-Experts pilot (paper 000, Table 1; SPEC §norm-select).

For the router baseline and one ``norm:<node>:<norm>`` policy per probe node, the policy replaces
the top-K choice in the chosen layers and the model runs on ``--data`` (perplexity, with the
agreement meter attached) and, optionally, on lm-eval tasks (accuracy).

Agreement with the router is measured on the hidden states the policy itself saw: ``ev.idx`` is
the model's own router choice for the MoE input reached under the policy (not a separate
unhooked run). A policy's top-1 is the first expert it returns (policies return their choice
best first); the router's top-1 is the member of its top-K with the largest model score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .. import ops
from ..engine.hooks import RoutingEvent
from ..engine.probes import NODES
from ..errors import MoetoolError
from ..registry import did_you_mean
from .result import Result, resolve_options

AGREEMENT_COLUMNS = ("layer", "policy", "topk_overlap", "top1_agree", "tokens")
QUALITY_COLUMNS = ("policy", "task", "metric", "value", "router_value", "ratio", "seconds")

DEFINITIONS = {
    "topk_overlap": "mean over real tokens of |TopK_policy ∩ TopK_router| / K, TopK_router = the model's own "
                    "router choice for the MoE input reached under the policy",
    "top1_agree": "fraction of real tokens whose policy top-1 (first expert the policy returns) is the router's "
                  "top-1 (its top-K member with the largest model score)",
    "value": "perplexity on --data (metric 'perplexity', task = the data name) or the lm-eval metric",
    "ratio": "value / router_value: perplexity ratio (lower is better) or accuracy retention (higher is better)",
    "seconds": "wall time of the pass that produced the row: the perplexity forwards (policy and agreement "
               "bookkeeping included), or the whole lm-eval run of all tasks under the policy; measured after "
               "one untimed warm-up forward (and a 1-item lm-eval run)",
    "agreement_layers": "only the layers the policy replaced (--layers) appear in agreement.csv",
}


def parse_nodes(text: str | None) -> list[str]:
    """``all`` or a comma list of probe nodes (gate, up, act, glu, output)."""
    if text is None or not text.strip() or not [s for s in text.split(",") if s.strip()]:
        raise MoetoolError(f"--nodes is empty; give 'all' or some of {', '.join(NODES)}")
    if text.strip() == "all":
        return list(NODES)
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        if item not in NODES:
            raise MoetoolError(f"unknown node '{item}'{did_you_mean(item, NODES)}; choose from "
                               f"{', '.join(NODES)} or 'all'")
        if item not in out:
            out.append(item)
    return out


def parse_norms(text: str) -> list[str]:
    """A norm or comma list of norms (l2, l1, linf)."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise MoetoolError(f"--norm is empty; choose from {', '.join(ops.NORMS)}")
    for n in out:
        if n not in ops.NORMS:
            raise MoetoolError(f"unknown norm '{n}'{did_you_mean(n, ops.NORMS)}; choose from {', '.join(ops.NORMS)}")
    return list(dict.fromkeys(out))


def sweep_specs(nodes: Iterable[str], norms: Iterable[str] = ("l2",)) -> list[str]:
    """``router`` plus ``norm:<node>:<norm>`` for every node and norm."""
    return ["router"] + [f"norm:{node}:{norm}" for norm in norms for node in nodes]


class AgreementMeter:
    """Consumer: per layer, on-device sums of |chosen ∩ router|/K, top-1 agreement and real tokens."""

    def __init__(self, layers: Iterable[int] | None = None):
        self.layers = None if layers is None else set(layers)
        self.sums: dict[int, torch.Tensor] = {}  # layer -> [3] float64: overlap/K, top1, tokens

    def __call__(self, ev: RoutingEvent) -> None:
        if self.layers is not None and ev.layer.index not in self.layers:
            return
        ref_top1 = ops.best_of(ev.idx, ev.layer.selection_scores(ev.logits))  # [T]
        pol_top1 = ref_top1 if ev.chosen_idx is ev.idx else ev.chosen_idx[:, 0]  # [T]
        v = ev.valid  # [T]
        K = ev.idx.shape[-1]
        # padding weighted out, not indexed out: no host sync inside the forward
        s = torch.stack([(ops.overlap_count(ev.chosen_idx, ev.idx) * v).sum().double() / K,
                         ((pol_top1 == ref_top1) & v).sum().double(), v.sum().double()])  # [3]
        key = ev.layer.index
        self.sums[key] = self.sums[key] + s if key in self.sums else s

    def frame(self, policy: str) -> Any:
        import pandas as pd

        rows = []
        for layer in sorted(self.sums):
            ov, t1, n = self.sums[layer].tolist()
            rows.append({"layer": layer, "policy": policy, "topk_overlap": ov / n if n else float("nan"),
                         "top1_agree": t1 / n if n else float("nan"), "tokens": int(n)})
        return pd.DataFrame(rows, columns=list(AGREEMENT_COLUMNS))


@dataclass
class NormSelectResult:
    agreement: Any  # DataFrame, AGREEMENT_COLUMNS
    quality: Any  # DataFrame, QUALITY_COLUMNS
    evals: dict[str, Any] = field(default_factory=dict)  # policy -> EvalResult


def quality_frame(ppl: dict[str, Any], evals: dict[str, Any], data: str) -> Any:
    """Rows per policy: perplexity on ``data`` and every lm-eval metric, with the router's value and the ratio."""
    import pandas as pd

    rows = []
    base_ppl = ppl["router"].perplexity
    for name, pr in ppl.items():
        rows.append({"policy": name, "task": data, "metric": "perplexity", "value": pr.perplexity,
                     "router_value": base_ppl, "ratio": pr.perplexity / base_ppl, "seconds": round(pr.seconds, 3)})
        if name in evals:
            base = evals["router"].frame.set_index(["task", "metric"]).value
            for r in evals[name].frame.itertuples(index=False):
                ref = float(base.get((r.task, r.metric), float("nan")))
                rows.append({"policy": name, "task": r.task, "metric": r.metric, "value": r.value,
                             "router_value": ref, "ratio": r.value / ref if ref else float("nan"),
                             "seconds": round(evals[name].seconds, 3)})
    return pd.DataFrame(rows, columns=list(QUALITY_COLUMNS))


def run_norm_select(lm: Any, tokens: Any, policies: list[Any], *, data: str = "heldout",
                    policy_layers: Iterable[int] | None = None, batch_size: int = 8, plan: Any = None,
                    num_fewshot: int | None = None, limit: int | None = None, seed: int = 0,
                    quiet: bool = False) -> NormSelectResult:
    """Run every policy (the first must be ``router``, the baseline of the ratios)."""
    import pandas as pd

    from ..data import TokenSet
    from .lmeval import evaluate, make_hflm
    from .ppl import perplexity

    if not policies or policies[0].name != "router":
        raise MoetoolError("the sweep must start with the 'router' baseline")
    layers = None if policy_layers is None else sorted(policy_layers)
    hflm = make_hflm(lm, batch_size) if plan is not None else None
    # untimed warm-up (kernels, allocator, lm-eval's dataset build and cache), so that the first policy's
    # seconds are comparable; on a shared CPU they stay noisy (bench/bench_norm_select.py interleaves runs)
    rows = 3 * batch_size
    head = TokenSet(tokens.input_ids[:rows], tokens.attention_mask[:rows], tokens.domains[:rows], tokens.source)
    for p in (policies[0], policies[-1]):
        perplexity(lm, head, policy=p, policy_layers=layers, batch_size=batch_size, quiet=True)
    if plan is not None:
        evaluate(lm, plan, limit=1, batch_size=batch_size, seed=seed, hflm=hflm, quiet=True)
    ppl, evals, agree = {}, {}, []
    for p in policies:
        meter = AgreementMeter(layers)
        ppl[p.name] = perplexity(lm, tokens, policy=p, policy_layers=layers, consumers=[meter],
                                 batch_size=batch_size, quiet=quiet, description=f"ppl {p.name}")
        agree.append(meter.frame(p.name))
        if plan is not None:
            evals[p.name] = evaluate(lm, plan, policy=p, policy_layers=layers, num_fewshot=num_fewshot,
                                     limit=limit, batch_size=batch_size, seed=seed, hflm=hflm, quiet=quiet)
    return NormSelectResult(pd.concat(agree, ignore_index=True), quality_frame(ppl, evals, data), evals)


def asked_rows(quality: Any, metric: str, tasks: Iterable[str] | None) -> Any:
    """Rows of ``metric``, only for the asked task names (a group's subtasks stay in quality.csv)."""
    rows = quality[quality.metric == metric]
    return rows if tasks is None else rows[rows.task.isin(list(tasks))]


def table1(agreement: Any, quality: Any, metric: str = "acc", tasks: Iterable[str] | None = None) -> Any:
    """The paper's Table 1 shape: one row per policy (node and norm; ``router`` first), quality, agreement
    and time side by side. Agreement is the token-weighted mean over the replaced layers."""
    import pandas as pd

    rows = []
    for name, q in quality.groupby("policy", sort=False):
        a = agreement[agreement.policy == name]
        n = a.tokens.sum()
        p = q[q.metric == "perplexity"].iloc[0]
        kind, _, rest = name.partition(":")
        node, _, norm = rest.partition(":")
        row = {"node": node or kind, "norm": norm or "-", "ppl": p.value, "ppl ratio": p.ratio,
               "top-K overlap": float((a.topk_overlap * a.tokens).sum() / n) if n else float("nan"),
               "top-1 agree": float((a.top1_agree * a.tokens).sum() / n) if n else float("nan")}
        for r in asked_rows(q, metric, tasks).itertuples(index=False):
            row[f"{r.task} {metric}"] = r.value
            row[f"{r.task} retention"] = r.ratio
        row["seconds"] = float(p.seconds) + float(q[q.metric != "perplexity"].seconds.max()
                                                  if (q.metric != "perplexity").any() else 0.0)
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class NormSelectOptions:
    """Options of :func:`norm_select`."""

    nodes: tuple[str, ...] = NODES  # probe nodes swept (norm:<node>:<norm> for each)
    norms: tuple[str, ...] = ("l2",)  # norms swept
    weights: str = "softmax"  # weights of the chosen experts: softmax | router | uniform
    layers: tuple[int, ...] | None = None  # MoE layers whose routing is replaced (None: every MoE layer)
    tasks: tuple[str, ...] | None = None  # lm-eval tasks (None: perplexity only)
    num_fewshot: int | None = None
    limit: int | None = None
    include_path: str | None = None
    batch_size: int = 8
    seed: int = 0

    def specs(self) -> list[str]:
        return sweep_specs(self.nodes, self.norms)


def norm_select(lm: Any, tokens: Any, options: NormSelectOptions | None = None, *, plan: Any = None,
                quiet: bool = False, **overrides: Any) -> Result:
    """The AoE pilot: the router baseline and ``norm:<node>:<norm>`` for every node and norm.

    Tables ``agreement`` (layer, policy, topk_overlap, top1_agree, tokens) and ``quality`` (policy, task, metric,
    value, router_value, ratio, seconds), see :data:`DEFINITIONS`; ``summary`` is the paper's Table 1 shape.
    ``plan`` (from :func:`moetool.experiments.lmeval.plan_tasks`) may be passed when the tasks are resolved.
    """
    from ..engine.hooks import select_layers
    from ..policies import build_policy
    from .lmeval import plan_tasks
    from .ppl import data_name

    opts = resolve_options(NormSelectOptions, options, overrides)
    specs = opts.specs()
    policies = [build_policy(s, opts.weights, opts.seed) for s in specs]
    if plan is None and opts.tasks is not None:
        plan = plan_tasks(opts.tasks, opts.include_path)
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    res = run_norm_select(lm, tokens, policies, data=data_name(tokens.source), policy_layers=layers,
                          batch_size=opts.batch_size, plan=plan, num_fewshot=opts.num_fewshot, limit=opts.limit,
                          seed=opts.seed, quiet=quiet)
    asked = plan.names if plan else None
    return Result("norm_select", {"agreement.csv": res.agreement, "quality.csv": res.quality}, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(), policies=specs, weights=opts.weights,
                            eval=plan.describe() if plan else None,
                            n_samples={k: v.n_samples for k, v in res.evals.items()}),
                  summary=table1(res.agreement, res.quality, tasks=asked))


def summary_lines(table: Any) -> list[str]:
    """One line per policy of the Table-1-shaped summary."""
    lines = []
    for r in table.to_dict("records"):
        name = r["node"] if r["norm"] == "-" else f"norm:{r['node']}:{r['norm']}"
        accs = "".join(f", {k[:-4]} acc {v:.2f} (x{r[k[:-4] + ' retention']:.2f})"
                       for k, v in r.items() if k.endswith(" acc"))
        lines.append(f"{name}: ppl {r['ppl']:.1f} (x{r['ppl ratio']:.2f}), top-K overlap {r['top-K overlap']:.2f}, "
                     f"top-1 agree {r['top-1 agree']:.2f}{accs}")
    return lines


def demo(parent: Any, quiet: bool) -> list[str]:
    """The sweep on the embedded ``tiny`` model: 5 nodes, 2048 tokens, the shipped offline tasks (20 items each)."""
    from ..data import load_tokens
    from ..loading import load
    from ..report.writers import write
    from .lmeval import shipped_tasks

    lm = load("tiny")
    tokens = load_tokens(None, lm.tokenizer, seq_len=256, max_tokens=2048)
    shipped = tuple(shipped_tasks())
    res = norm_select(lm, tokens, NormSelectOptions(tasks=shipped or None, limit=20, batch_size=16), quiet=quiet)
    write(res, parent.sub("norm-select"), model=lm, options=dict(model="tiny", seq_len=256, max_tokens=2048))
    return summary_lines(res.summary)
