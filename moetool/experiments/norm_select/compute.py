"""``norm-select``: the Autonomy-of-Experts pilot (Lv et al., ICML 2025, arXiv 2501.13074, Table 1).

For the router baseline and one ``norm:<node>:<norm>`` policy per probe node, the policy replaces
the top-K choice in the chosen layers and the model runs on ``--data`` (perplexity, with the
agreement meter attached) and, optionally, on lm-eval tasks (accuracy).

Agreement with the router is measured on the hidden states the policy itself saw: ``ev.idx`` is
the model's own router choice for the MoE input reached under the policy (not a separate
unhooked run). A policy's top-1 is the first expert it returns (policies return their choice
best first); the router's top-1 is the member of its top-K with the largest model score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ... import distributed, ops
from ...data import TokenSet, require_tokens
from ...defaults import FEWSHOT_SEED
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.probes import NODES
from ...errors import MoetoolError
from ...policies import build_once
from ...registry import did_you_mean
from ...uncertainty import Interval, RowTable, bootstrap_meta, format_ci, mover_ratio, ratio_intervals
from ..eval import compute as lmeval  # as a module: its functions are looked up when called (tests stand in for lm-eval)
from ..routing import data_name, perplexity, ppl_intervals
from ..published import aoe_table1
from ..result import Result, resolve_options
from .spec import NormSelectOptions  # noqa: F401 - its options (declared with their flags in spec.py)
from .spec import sweep_specs  # noqa: F401 - re-exported: its home is spec.py (NormSelectOptions.specs)

AGREEMENT_COLUMNS = ("layer", "policy", "topk_overlap", "topk_overlap_lo", "topk_overlap_hi", "top1_agree",
                     "top1_agree_lo", "top1_agree_hi", "tokens")
QUALITY_COLUMNS = ("policy", "task", "metric", "value", "stderr", "value_lo", "value_hi", "router_value", "ratio",
                   "ratio_lo", "ratio_hi", "seconds")

#: how a retention (accuracy / router accuracy) interval is made: quality.csv's ratio_lo/hi, prune_eval.csv's
#: retention_lo/hi (:func:`moetool.uncertainty.mover_ratio`)
RETENTION_INTERVAL = ("MOVER-R (Newcombe 2016: Fieller's interval with each variance recovered from its value's "
                      "interval, an accuracy's Wilson interval; moetool.uncertainty.mover_ratio): honest at an "
                      "accuracy of 0 or 1, where the delta method on lm-eval's stderrs (0 there) said 1 ± 0 for 5 "
                      "of 5 items right in both runs (now [0.57, 1.77]), and the delta method's interval away from "
                      "them; the two accuracies taken as independent (conservative: the same items are scored under "
                      "both); NaN when the router's interval reaches 0 (no upper bound)")

DEFINITIONS = {
    "policy": "the routing of the row: router (the model's own top-K; the baseline) or norm:<node>:<norm> (the K "
              "experts with the largest output norm at that probe node)",
    "agreement.tokens": "real (unpadded) tokens the layer routed under the policy: the means' denominator",
    "task": "perplexity rows: the --data name (heldout: the embedded default); lm-eval rows: the lm-eval task",
    "metric": "perplexity, or the lm-eval metric (acc, acc_norm, ...)",
    "router_value": "value of the router row of the same task and metric: the ratio's denominator",
    "topk_overlap": "mean over real tokens of |TopK_policy ∩ TopK_router| / K, TopK_router = the model's own "
                    "router choice for the MoE input reached under the policy",
    "top1_agree": "fraction of real tokens whose policy top-1 (first expert the policy returns) is the router's "
                  "top-1 (its top-K member with the largest model score)",
    "value": "perplexity on --data (metric 'perplexity', task = the data name) or the lm-eval metric",
    "ratio": "value / router_value: perplexity ratio (lower is better) or accuracy retention (higher is better)",
    "seconds": "wall time of the pass that produced the row: the perplexity forwards (policy and agreement "
               "bookkeeping included), or the whole lm-eval run of all tasks under the policy; measured after "
               "one untimed warm-up forward (and a 1-item lm-eval run)",
    "stderr": "lm-eval's standard error of an lm-eval metric (as in eval.csv); empty for perplexity, whose "
              "interval is the bootstrap's (value_lo/value_hi)",
    "agreement_layers": "only the layers the policy replaced (--layers) appear in agreement.csv",
    "pruned": "with --prune: every row is on the pruned model — 'router' is the model's router among the kept "
              "experts (removed experts' scores -inf before its top-K, weights as its rule gives them), each norm "
              "policy takes the K largest norms among the kept experts, and agreement is with the pruned router",
    "*_lo/*_hi": "95% intervals. Agreement and perplexity: document-level bootstrap over packed rows "
                 "(percentile, --bootstrap replicates, seeded; a perplexity ratio is paired: one row weight applies "
                 "to the policy and the router run). lm-eval metrics: " + lmeval.INTERVAL_DEFINITION + "; retention: "
                 + RETENTION_INTERVAL + ". The router's own ratio is exactly 1 ([1, 1]). NaN: off (--bootstrap 0), "
                 "no stderr or item count from lm-eval, or a router accuracy of 0",
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
        out.append(item)
    return out  # a repeat is the flag's check's to refuse (Flag.check)


def parse_norms(text: str) -> list[str]:
    """A norm or comma list of norms (l2, l1, linf)."""
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise MoetoolError(f"--norm is empty; choose from {', '.join(ops.NORMS)}")
    for n in out:
        if n not in ops.NORMS:
            raise MoetoolError(f"unknown norm '{n}'{did_you_mean(n, ops.NORMS)}; choose from {', '.join(ops.NORMS)}")
    return out  # a repeat is the flag's check's to refuse (Flag.check)


class AgreementMeter:
    """Consumer: per layer, on-device sums of |chosen ∩ router|/K, top-1 agreement and real tokens."""

    def __init__(self, layers: Iterable[int] | None = None, rows: Any = None, reference: Any = None,
                 same: bool = False):
        self.layers = None if layers is None else set(layers)
        self.sums: dict[int, torch.Tensor] = {}  # layer -> [3] float64: overlap/K, top1, tokens
        self.rows = rows  # uncertainty.RowTable: the same three sums per packed row ("agree<layer>") for intervals
        # the router's choice: the model's own (ev.idx), or ``reference.select(ev)`` (the pruned router); ``same``:
        # the measured policy is that reference
        self.reference, self.same = reference, same

    def __call__(self, ev: RoutingEvent) -> None:
        if self.layers is not None and ev.layer.index not in self.layers:
            return
        ref = ev.idx if self.reference is None else self.reference.select(ev)[0]  # [T, K]
        ref_top1 = ops.top1(ref, ev.layer.selection_scores(ev.logits))  # [T]
        same = self.same or (self.reference is None and ev.chosen_idx is ev.idx)
        pol_top1 = ref_top1 if same else ev.chosen_idx[:, 0]  # [T]
        v = ev.valid  # [T]
        K = ref.shape[-1]
        # padding weighted out, not indexed out: no host sync inside the forward
        per_token = torch.stack([ops.overlap_count(ev.chosen_idx, ref).double() / K * v,
                                 ((pol_top1 == ref_top1) & v).double(), v.double()], -1)  # [T, 3]
        s = per_token.sum(0)  # [3]
        key = ev.layer.index
        self.sums[key] = self.sums[key] + s if key in self.sums else s
        if self.rows is not None:
            self.rows.add(f"agree{key}", per_token)

    def reduce_across_ranks(self) -> None:
        """Data parallel (called by ``engine.forward``): the per-layer sums all-reduced; alone a no-op. The row
        table is reduced by its owner (``perplexity``)."""
        if distributed.world_size() > 1:
            self.sums = distributed.all_reduce_keyed(self.sums)

    def frame(self, policy: str, *, n_boot: int = 0, seed: int = 0) -> Any:
        """Per layer: the three means, with bootstrap intervals from ``rows`` (``n_boot`` replicates) if kept."""
        import pandas as pd

        rows = []
        for layer in sorted(self.sums):
            ov, t1, n = self.sums[layer].tolist()
            row = {"layer": layer, "policy": policy, "topk_overlap": ov / n if n else float("nan"),
                   "top1_agree": t1 / n if n else float("nan"), "tokens": int(n)}
            if self.rows is not None and n:
                t = self.rows.table(f"agree{layer}")  # [rows, 3]
                a, b = ratio_intervals(t[:, :2], t[:, 2], n_boot=n_boot, seed=seed)
                row.update({**a.columns("topk_overlap"), **b.columns("top1_agree")})
            rows.append(row)
        return pd.DataFrame(rows, columns=list(AGREEMENT_COLUMNS))


    def overall(self, policy: str, *, n_boot: int = 0, seed: int = 0) -> dict[str, Any]:
        """Agreement pooled over the meter's layers (token-weighted, as Table 1) with bootstrap intervals from
        ``rows``: ``{policy, topk_overlap[_lo/_hi], top1_agree[_lo/_hi]}`` (NaN bounds without rows)."""
        tot = sum(self.sums.values()).tolist() if self.sums else [0.0, 0.0, 0.0]
        nan = float("nan")
        if self.rows is not None and tot[2]:
            t = sum(self.rows.table(f"agree{layer}") for layer in self.sums)  # [rows, 3]
            a, b = ratio_intervals(t[:, :2], t[:, 2], n_boot=n_boot, seed=seed)
        else:
            a, b = (Interval(x / tot[2] if tot[2] else nan) for x in tot[:2])
        return {"policy": policy, **a.columns("topk_overlap"), **b.columns("top1_agree")}


@dataclass
class NormSelectResult:
    agreement: Any  # DataFrame, AGREEMENT_COLUMNS
    quality: Any  # DataFrame, QUALITY_COLUMNS
    evals: dict[str, Any] = field(default_factory=dict)  # policy -> EvalResult
    overall: Any = None  # DataFrame: agreement pooled over layers with intervals (AgreementMeter.overall)


def quality_frame(ppl: dict[str, Any], evals: dict[str, Any], data: str, *, n_boot: int = 0, seed: int = 0) -> Any:
    """Rows per policy: perplexity on ``data`` and every lm-eval metric, with the router's value and the ratio,
    and their 95% intervals (bootstrap from the runs' per-row sums when kept; lm-eval: Wilson / MOVER-R)."""
    import pandas as pd

    nan = float("nan")
    rows = []
    base_run = ppl["router"]
    base_ppl = base_run.perplexity
    for name, pr in ppl.items():
        row = {"policy": name, "task": data, "metric": "perplexity", "value": pr.perplexity, "stderr": nan, "value_lo": nan,
               "value_hi": nan, "router_value": base_ppl, "ratio": pr.perplexity / base_ppl, "ratio_lo": nan,
               "ratio_hi": nan, "seconds": round(pr.seconds, 3)}
        if pr.rows is not None:
            ci = ppl_intervals(pr, base_run, n_boot=n_boot, seed=seed)
            row.update(value_lo=ci["perplexity_lo"], value_hi=ci["perplexity_hi"])
            row.update({k: ci[k] for k in ("ratio_lo", "ratio_hi") if k in ci})
        rows.append(row)
        if name in evals:
            rows += eval_rows(name, evals[name], evals["router"])
    return pd.DataFrame(rows, columns=list(QUALITY_COLUMNS))


def eval_rows(name: str, res: Any, base: Any) -> list[dict[str, Any]]:
    """quality rows of one policy's lm-eval result: the value with lmeval.results_frame's interval (Wilson for a
    proportion), retention with the MOVER-R interval from the two values' intervals (:func:`mover_ratio`: honest at
    an accuracy of 0 or 1, where the delta method on lm-eval's stderrs said ``1 ± 0``)."""
    nan = float("nan")
    ref = base.frame.set_index(["task", "metric"])
    out = []
    for r in res.frame.itertuples(index=False):
        key = (r.task, r.metric)
        b, b_lo, b_hi = (float(ref[c].get(key, nan)) for c in ("value", "value_lo", "value_hi"))
        # NaN bounds unless both values and both intervals are known and the base is above 0 (a / 0: NaN)
        ratio = mover_ratio(float(r.value), float(r.value_lo), float(r.value_hi), b, b_lo, b_hi)
        if name == "router" and not math.isnan(ratio.lo):  # the router's own: [1, 1], as ppl_intervals gives the
            ratio = Interval(ratio.value, 1.0, 1.0)  # base (its run is the base: r.value = b)
        out.append({"policy": name, "task": r.task, "metric": r.metric, "value": r.value, "stderr": float(r.stderr),
                    "value_lo": r.value_lo, "value_hi": r.value_hi,  # lmeval.results_frame's interval
                    "router_value": b, **ratio.columns("ratio"), "seconds": round(res.seconds, 3)})
    return out


def run_norm_select(lm: Any, tokens: Any, policies: list[Any], *, data: str = "heldout",
                    policy_layers: Iterable[int] | None = None, batch_size: int = 8, plan: Any = None,
                    num_fewshot: int | None = None, limit: int | None = None, seed: int = 0,
                    fewshot_seed: int = FEWSHOT_SEED, quiet: bool = False, bootstrap: int = 0, units: Any = None,
                    pruned: Any = None) -> NormSelectResult:
    """Run every policy (the first must be ``router``, the baseline of the ratios). ``bootstrap``: replicates for
    the intervals of agreement and perplexity (per-row sums are kept whenever > 0). ``units``
    (:class:`moetool.checkpoints.Units`): each finished policy is saved there, and one saved before an
    interruption is taken from there instead of being run again (``--resume``). ``pruned`` (a
    :class:`moetool.policies.prune.PrunePolicy`): the model is pruned — the ``router`` baseline is the pruned router
    (``policies[0]`` is that policy) and agreement is measured against its choice."""
    import pandas as pd

    if not policies or (policies[0].name != "router" and policies[0] is not pruned):
        raise MoetoolError("the sweep must start with the 'router' baseline")
    layers = None if policy_layers is None else sorted(policy_layers)
    hflm = lmeval.make_hflm(lm, batch_size) if plan is not None else None
    # untimed warm-up (kernels, allocator, lm-eval's dataset build and cache), so that the first policy's
    # seconds are comparable; on a shared CPU they stay noisy (bench/bench.py interleaves runs: its norm:gate variant)
    rows = 3 * batch_size
    head = TokenSet(tokens.input_ids[:rows], tokens.attention_mask[:rows], tokens.domains[:rows], tokens.source)
    for p in (policies[0], policies[-1]):
        perplexity(lm, head, policy=p, policy_layers=layers, batch_size=batch_size, quiet=True)
    if plan is not None:
        lmeval.evaluate(lm, plan, limit=1, batch_size=batch_size, seed=seed, fewshot_seed=fewshot_seed, hflm=hflm,
                        quiet=True)
    ppl, evals, agree, overall = {}, {}, [], []
    shard = distributed.shard(tokens, batch_size)  # alone: the same rows, numbered (RowTable's global row ids)
    for p in policies:
        name = "router" if p is pruned else p.name  # the pruned model's router is its router
        done = units.load(name) if units is not None else None
        if done is None:
            rows = RowTable(shard) if bootstrap else None
            meter = AgreementMeter(layers, rows=rows, reference=pruned, same=p is pruned)
            run = perplexity(lm, shard, policy=p, policy_layers=layers, consumers=[meter], batch_size=batch_size,
                             quiet=quiet, description=f"ppl {name}", rows=rows)
            done = {"ppl": run, "agree": meter.frame(name, n_boot=bootstrap, seed=seed),
                    "overall": meter.overall(name, n_boot=bootstrap, seed=seed)}
            if plan is not None:
                done["eval"] = lmeval.evaluate(lm, plan, policy=p, policy_layers=layers, num_fewshot=num_fewshot,
                                               limit=limit, batch_size=batch_size, seed=seed,
                                               fewshot_seed=fewshot_seed, hflm=hflm, quiet=quiet)
            if units is not None:
                units.save(name, done)
        ppl[name] = done["ppl"]
        agree.append(done["agree"])
        overall.append(done["overall"])
        if "eval" in done:
            evals[name] = done["eval"]
    return NormSelectResult(pd.concat(agree, ignore_index=True),
                            quality_frame(ppl, evals, data, n_boot=bootstrap, seed=seed), evals,
                            pd.DataFrame(overall))


def data_rows(quality: Any) -> Any:
    """The rows of ``quality`` (:func:`quality_frame`) that hold the perplexity on ``--data``: metric ``perplexity``
    of the data's task (the table's first row's), never an lm-eval task's own ``perplexity`` metric (lambada's, any
    ``loglikelihood`` task's), which is that task's number, not the data's."""
    if not len(quality):
        return quality
    return quality[(quality.metric == "perplexity") & (quality.task == quality.task.iloc[0])]


def asked_rows(quality: Any, metric: str, tasks: Iterable[str] | None) -> Any:
    """Rows of ``metric``, only for the asked task names (a group's subtasks stay in quality.csv)."""
    rows = quality[quality.metric == metric]
    return rows if tasks is None else rows[rows.task.isin(list(tasks))]


def table1(agreement: Any, quality: Any, metric: str = "acc", tasks: Iterable[str] | None = None,
           overall: Any = None) -> Any:
    """The paper's Table 1 shape: one row per policy (node and norm; ``router`` first), quality, agreement
    and time side by side. Agreement is the token-weighted mean over the replaced layers. Every value column
    ``c`` with an interval has ``c_lo``/``c_hi`` beside it (``overall``: the all-layer agreement intervals per
    policy from :meth:`AgreementMeter.overall`; quality intervals from ``quality``'s columns)."""
    import pandas as pd

    nan = float("nan")
    over = {} if overall is None else overall.set_index("policy").to_dict("index")
    rows = []
    for name, q in quality.groupby("policy", sort=False):
        a = agreement[agreement.policy == name]
        n = a.tokens.sum()
        on_data = data_rows(q)
        p = on_data.iloc[0]
        kind, _, rest = name.partition(":")
        node, _, norm = rest.partition(":")
        o = over.get(name, {})
        row = {"node": node or kind, "norm": norm or "-", "ppl": p.value, "ppl_lo": p.value_lo, "ppl_hi": p.value_hi,
               "ppl ratio": p.ratio, "ppl ratio_lo": p.ratio_lo, "ppl ratio_hi": p.ratio_hi,
               "top-K overlap": float((a.topk_overlap * a.tokens).sum() / n) if n else nan,
               "top-K overlap_lo": o.get("topk_overlap_lo", nan), "top-K overlap_hi": o.get("topk_overlap_hi", nan),
               "top-1 agree": float((a.top1_agree * a.tokens).sum() / n) if n else nan,
               "top-1 agree_lo": o.get("top1_agree_lo", nan), "top-1 agree_hi": o.get("top1_agree_hi", nan)}
        for r in asked_rows(q, metric, tasks).itertuples(index=False):
            row.update({f"{r.task} {metric}": r.value, f"{r.task} {metric}_lo": r.value_lo,
                        f"{r.task} {metric}_hi": r.value_hi, f"{r.task} retention": r.ratio,
                        f"{r.task} retention_lo": r.ratio_lo, f"{r.task} retention_hi": r.ratio_hi})
        lmeval_rows = q.drop(index=on_data.index)
        row["seconds"] = float(p.seconds) + float(lmeval_rows.seconds.max() if len(lmeval_rows) else 0.0)
        rows.append(row)
    return pd.DataFrame(rows)


def norm_select(lm: Any, tokens: Any, options: NormSelectOptions | None = None, *, plan: Any = None,
                quiet: bool = False, units: Any = None, **overrides: Any) -> Result:
    """The AoE pilot: the router baseline and ``norm:<node>:<norm>`` for every node and norm.

    Tables ``agreement`` (layer, policy, topk_overlap, top1_agree, tokens) and ``quality`` (policy, task, metric,
    value, router_value, ratio, seconds), each value with ``_lo``/``_hi`` (95%; ``bootstrap=0``: NaN), see
    :data:`DEFINITIONS`; ``summary`` is the paper's Table 1 shape; with lm-eval tasks measured by ``acc`` also
    ``aoe_table1`` (:func:`moetool.experiments.published.aoe_table1`: AoE's published Mixtral numbers beside the
    measured ones; measured only for other models).
    ``plan`` (from :func:`moetool.experiments.eval.compute.plan_tasks`) may be passed when the tasks are resolved.
    ``units``: per-policy checkpoints for ``--resume`` (:class:`moetool.checkpoints.Units`).
    """
    opts = resolve_options(NormSelectOptions, options, overrides)
    require_tokens(tokens)
    specs = opts.specs()
    policies = [build_once(s, opts.weights, opts.seed) for s in specs]  # the command's check built them (one run)
    pruned = None
    if opts.prune is not None:  # the router baseline is the pruned router; the norm policies choose among the kept
        pruned = build_once(opts.prune, opts.weights, opts.seed)
        if pruned.name.partition(":")[0] != "prune":
            raise MoetoolError(f"--prune takes a prune policy (prune:<criterion>:<fraction>[:<csv>]), not "
                               f"'{opts.prune}'")
        policies = [pruned] + policies[1:]
        for p in policies[1:]:
            p.among = pruned
    if plan is None and opts.tasks is not None:
        plan = lmeval.plan_tasks(opts.tasks, opts.include_path)
    layers = None if opts.layers is None else [L.index for L in select_layers(lm.layers, opts.layers)]
    res = run_norm_select(lm, tokens, policies, data=data_name(tokens.source), policy_layers=layers,
                          batch_size=opts.batch_size, plan=plan, num_fewshot=opts.num_fewshot, limit=opts.limit,
                          seed=opts.seed, fewshot_seed=opts.fewshot_seed, quiet=quiet, bootstrap=opts.bootstrap,
                          units=units, pruned=pruned)
    asked = plan.names if plan else None
    summary = table1(res.agreement, res.quality, tasks=asked, overall=res.overall)
    tables = {"agreement.csv": res.agreement, "quality.csv": res.quality}
    laid = [t for t in (asked or ()) if f"{t} acc" in summary.columns]
    if laid:  # AoE Table 1 layout: the paper's numbers beside the measured ones (Mixtral), else measured only
        tables["aoe_table1.csv"] = aoe_table1(summary, lm.name, tasks=laid)
    return Result("norm_select", tables, opts,
                  meta=dict(definitions=DEFINITIONS, data=tokens.describe(), policies=specs, weights=opts.weights,
                            pruned=None if pruned is None else pruned.describe(),
                            eval=plan.describe() if plan else None,
                            n_samples={k: v.n_samples for k, v in res.evals.items()},
                            bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, tokens.input_ids.shape[0])),
                  summary=summary)


def summary_lines(name: str, res: Any) -> list[str]:
    """One line per policy of the Table-1-shaped summary (``res.summary``), each naming the model ``name``."""
    pruned = res.meta.get("pruned")
    lines = [f"{name}: on the model pruned by {pruned['name']}"] if pruned else []
    for r in res.summary.to_dict("records"):
        policy = r["node"] if r["norm"] == "-" else f"norm:{r['node']}:{r['norm']}"
        def ci(c: str) -> str:  # the value with its 95% interval (format_ci; the value alone where there is none)
            return format_ci(r[c], r.get(f"{c}_lo"), r.get(f"{c}_hi"))

        accs = "".join(f", {k[:-4]} acc {ci(k)} (x{ci(k[:-4] + ' retention')})" for k in r if k.endswith(" acc"))
        lines.append(f"{name}, {policy}: ppl {ci('ppl')} (x{ci('ppl ratio')}), top-K overlap "
                     f"{ci('top-K overlap')}, top-1 agree {ci('top-1 agree')}{accs}")
    return lines


def demo_options() -> dict[str, Any]:
    """What ``moetool demo`` adds to its options: the shipped offline lm-eval tasks (none if not installed)."""
    return {"tasks": tuple(lmeval.shipped_tasks()) or None}
