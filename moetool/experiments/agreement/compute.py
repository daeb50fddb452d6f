"""``agreement``: routing agreement across precisions (issue #23 item 4).

The same tokens go through the model once per precision (one model in memory at a time besides a caller's own:
loaded or converted, run, freed). The reference is the most precise run of the list (fp32 > bf16/fp16 > fp8 >
fp4/mxfp4; the first listed on a tie). Per MoE layer and precision, against the reference, token by token:

* ``top1_flip``: the top-1 (the chosen expert with the largest selection score, :func:`moetool.ops.top1`; a tie,
  frequent in bf16, goes to the lowest expert id) differs; ``topk_flip``: the chosen top-K set differs
  (:func:`moetool.ops.same_set`);
* the flip rates per bin of the reference run's routing margin (the K-th minus the (K+1)-th selection score,
  :func:`moetool.experiments.margin.compute.token_margins`), and that margin's mean and median per layer;
* ``delta_nll``: the mean next-token NLL change (this precision's minus the reference's on the same tokens).

Precisions: ``fp32`` / ``bf16`` / ``fp16`` load the model in that dtype (transformers' own loading: modules the
family keeps in fp32, e.g. DeepSeek-V3's router, stay fp32). ``fp8`` / ``fp4`` / ``mxfp4`` are SIMULATED: the model
is loaded in bf16, the weights a real release stores in that format are quantized then dequantized with the
format's own rules (:func:`moetool.formats.fake_quantize`) and the forward runs in bf16 -- what transformers'
dequantizing CPU path computes; a GPU's FP8 kernels (FP8 activations, FP8 matmuls) are not simulated. Which
weights (:data:`QUANTIZED_WEIGHTS`): fp8, every ``nn.Linear`` weight and every expert matrix outside the embeddings,
the LM head and the routers (the DeepSeek-V3/Qwen3/GLM FP8 releases: routers, norms, embeddings, biases kept);
fp4 / mxfp4, the routed experts' matrices only (gpt-oss MXFP4, DeepSeek-V4-style FP4 experts), the rest bf16.

Intervals: document-level bootstrap over packed rows (:class:`~moetool.uncertainty.RowTable`, one set of row
weights per run: the ΔNLL interval is paired).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ... import distributed, formats, ops
from ...data import check_tokenizer, require_tokens
from ...engine.hooks import RoutingEvent, select_layers
from ...engine.runner import forward, free_memory
from ...errors import MoetoolError
from ...loading import load, load_tokenizer
from ...sketch import QuantileSketch
from ...uncertainty import RowTable, bootstrap_meta, format_ci, ratio_intervals
from ..margin.compute import token_margins
from ..routing import data_name
from ..result import Result, resolve_options
from .spec import DEFAULT_THRESHOLDS, RANK, AgreementOptions, reference_of  # noqa: F401 - its options (declared with their flags in spec.py)

#: precision -> (dtype the forward computes in, simulated weight format or None)
PRECISIONS: dict[str, tuple[torch.dtype, str | None]] = {
    "fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
    "fp8": (torch.bfloat16, "fp8"), "fp4": (torch.bfloat16, "fp4"), "mxfp4": (torch.bfloat16, "mxfp4")}
#: load dtype names of moetool.loading.load
LOAD_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: which weights a simulated format replaces
QUANTIZED_WEIGHTS = {
    "fp8": "every nn.Linear weight and every routed/shared expert matrix except the embeddings, the LM head and "
           "the routers (as the DeepSeek-V3/R1, Kimi-K2, Qwen3 and GLM-4.5 FP8 releases: 128x128 blocks, fp32 "
           "scale_inv); norms, biases, routers (and their correction bias), embeddings, LM head stay bf16/as loaded",
    "fp4": "the routed experts' matrices only (DeepSeek-V4-style FP4 experts: 1x32 groups along the input dim, fp32 "
           "scales); everything else bf16",
    "mxfp4": "the routed experts' matrices only (as gpt-oss ships MXFP4: 32 input values per E8M0 scale); "
             "everything else bf16",
}

DEFINITIONS = {
    "precision": "how the model computes: fp32/bf16/fp16 = loaded in that dtype (transformers' loading; modules a "
                 "family keeps in fp32 stay fp32); fp8/fp4/mxfp4 = SIMULATED: loaded in bf16, the weights of "
                 "QUANTIZED_WEIGHTS (manifest 'precisions') quantized then dequantized with the format's rules "
                 "(moetool.formats.fake_quantize, from the bf16 weights) and the forward in bf16 (no FP8 "
                 "activations or kernels)",
    "reference": "the most precise precision of the list (fp32 > bf16/fp16 > fp8 > fp4/mxfp4; the first listed on "
                 "a tie): every other run is compared with it on the same tokens",
    "layer": "decoder layer index of the MoE layer",
    "tokens": "real (non-padding) tokens routed by the layer in both runs",
    "top1_flip": "share of real tokens whose top-1 expert (the chosen expert with the largest selection score of its "
                 "own run; a tie, frequent in bf16/fp16, goes to the lowest expert id) differs from the reference "
                 "run's",
    "topk_flip": "share of real tokens whose chosen top-K set differs from the reference run's",
    "margin_mean": "mean over real tokens of the reference run's routing margin s_(K) - s_(K+1): the K-th minus the "
                   "(K+1)-th largest selection score (layer.selection_scores of the router logits, bias included)",
    "margin_p50": "median of that margin (QuantileSketch: within sketch_rel_error of np.quantile)",
    "margin_lo": "lower edge of the reference-margin bin [margin_lo, margin_hi) of agreement_bins.csv (edges 0, the "
                 "thresholds, inf); not an interval bound",
    "margin_hi": "upper edge (excluded) of the reference-margin bin; not an interval bound",
    "agreement_bins.tokens": "real tokens of the layer whose reference margin falls in the bin",
    "agreement_bins.top1_flip": "top1_flip among the tokens of the bin (NaN for an empty bin); no interval",
    "agreement_bins.topk_flip": "topk_flip among the tokens of the bin (NaN for an empty bin); no interval",
    "agreement_summary.top1_flip": "top-1 flips summed over the MoE layers / (tokens x layers)",
    "agreement_summary.topk_flip": "top-K set flips summed over the MoE layers / (tokens x layers)",
    "layers": "MoE layers compared",
    "simulated": "True when the precision's weights were fake-quantized (fp8/fp4/mxfp4), not a real dtype",
    "nll_ref": "mean next-token NLL (nats) of the reference run over the real scored tokens",
    "nll": "mean next-token NLL (nats) of this precision's run over the same tokens",
    "delta_nll": "nll - nll_ref (paired: the same tokens, per-row differences bootstrapped)",
    "*_lo/*_hi": "95% document-level bootstrap percentile interval over packed rows; NaN with bootstrap=0",
}


# ----- precisions --------------------------------------------------------------------------------
def quantized_views(lm: Any, fmt: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, weight [..., out, in])`` of every matrix ``fmt`` replaces (:data:`QUANTIZED_WEIGHTS`), as views of
    the model's parameters in the ``[out, in]`` layout (the input dim last: FP4/MXFP4 groups run along it).

    Routed experts: the adapter's canonical views (``gate``/``up`` ``[n, I, d]``, ``down`` ``[n, d, I]``), which must
    share the experts' parameter storage, or else the experts module's own per-expert ``nn.Linear`` weights (a
    layout the adapter copies, with neither, is refused in one line); fp8 also takes every
    other ``nn.Linear`` weight except the routers', the embeddings' and the LM head's."""
    model = lm.model
    out: list[tuple[str, torch.Tensor]] = []
    skip: set[int] = set()
    for L in lm.layers:
        ew = L.expert_weights()
        mats = {"gate": ew.gate, "up": ew.up, "down": ew.down}
        own = {p.untyped_storage().data_ptr() for p in L.experts.parameters()}
        linears = [(n, m.weight) for n, m in L.experts.named_modules() if isinstance(m, nn.Linear)]
        if all(w.untyped_storage().data_ptr() in own for w in mats.values()):
            out += [(f"layer {L.index} experts.{k}", w) for k, w in mats.items()]
        elif linears:  # per-expert linears (Switch, un-fused checkpoints): each expert matrix is its own weight
            out += [(f"layer {L.index} experts.{n}", w) for n, w in linears]
        else:
            raise MoetoolError(f"{fmt}: layer {L.index}'s expert weights are not views of its parameters "
                               f"({type(L.experts).__name__}): cannot simulate {fmt} on this family")
        skip |= {id(m) for m in L.experts.modules()}
        skip |= {id(m) for m in L.router.modules()}
    if fmt == "fp8":
        for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
            if emb is not None:
                skip |= {id(m) for m in emb.modules()}
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and id(m) not in skip:
                out.append((name, m.weight))
    return out


def check_formats(lm: Any, precisions: Sequence[str]) -> None:
    """One line before any run when a simulated format cannot quantize this model's matrices (FP4/MXFP4 groups of 32
    input values) or the adapter's expert views are not the parameters (:func:`quantized_views`)."""
    for p in precisions:
        fmt = PRECISIONS[p][1]
        if fmt is None:
            continue
        for name, w in quantized_views(lm, fmt):
            if fmt in ("fp4", "mxfp4") and w.shape[-1] % formats.FP4_GROUP:
                raise MoetoolError(f"--precisions {p}: {name} has an input dim of {w.shape[-1]}, not a multiple of "
                                   f"the format's {formats.FP4_GROUP}-value groups")


@torch.no_grad()
def simulate_format(lm: Any, fmt: str) -> dict[str, Any]:
    """Replace, in place, the weights ``fmt`` quantizes by their quantize-dequantize (:func:`formats.fake_quantize`,
    one expert at a time); returns what was replaced (the manifest's record)."""
    views = quantized_views(lm, fmt)
    values = 0
    for _, w in views:
        for e in range(w.shape[0]) if w.dim() == 3 else [None]:  # one expert matrix at a time: bounded memory
            part = w if e is None else w[e]
            part.copy_(formats.fake_quantize(part, fmt))
        values += w.numel()
    return {"format": fmt, "rule": formats.DESCRIPTIONS[fmt], "weights": QUANTIZED_WEIGHTS[fmt],
            "matrices": len(views), "values": values}


def load_precision(model: Any, precision: str, device: str,
                   device_map: str | None = None) -> tuple[Any, dict[str, Any], bool]:
    """``(loaded model, its manifest record, whether this call loaded it)`` for one precision. ``model``: a name or
    path (loaded in the precision's dtype, with ``device_map``), or a loaded model (used as it is when it already
    computes in that plain dtype, else its ``name`` is loaded again, with ``device_map``)."""
    dtype, fmt = PRECISIONS[precision]
    if not isinstance(model, (str, Path)):
        if fmt is None and model.dtype == dtype:
            return model, {"dtype": str(dtype).replace("torch.", ""), "simulated": False}, False
        device = model.device.type  # "cuda" / "cpu": the load puts it on the current device of that kind
        model = model.name
    lm = load(str(model), dtype=LOAD_DTYPE[dtype], device=device, device_map=device_map, tokenizer=False)
    record: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "simulated": fmt is not None}
    if fmt is not None:
        record.update(simulate_format(lm, fmt))
    return lm, record, True


# ----- collection --------------------------------------------------------------------------------
class _Run:
    """What every run records: its packed rows (per-row NLL sums, :class:`RowTable`) and the local row positions of
    each batch (the reference routing is stored by row, so any sub-batching lines up)."""

    def __init__(self, tokens: Any, layers: Sequence[Any]):
        # the MoE layer indices only: a layer object holds its experts' weights, which must go with their precision's
        # model before the next precision loads (a run outlives its model)
        self.layers = dict.fromkeys(L.index for L in layers)
        self.rows = RowTable(tokens)
        self._start, self._slice = 0, slice(0, 0)

    def before_batch(self, batch: Any) -> None:
        self.rows.next_batch(batch)
        B = batch.input_ids.shape[0]
        self._slice = slice(self._start, self._start + B)
        self._start += B

    def nll(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        self.rows.add("nll", torch.stack([sums.double(), counts.double()], -1))

    @staticmethod
    def routing(ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(top-K idx [T, K], top-1 [T], logits [T, n], valid [T])`` of the model's own routing in an event."""
        logits = ev.logits.reshape(-1, ev.logits.shape[-1])
        idx = ev.idx.reshape(-1, ev.idx.shape[-1]).sort(-1).values  # ascending ids: a tie goes to the lowest
        return idx, ops.top1(idx, ev.layer.selection_scores(logits)), logits, ev.valid.reshape(-1)


class ReferenceRun(_Run):
    """The reference run: each layer's routing (top-K set, top-1, margin) stored per local row ``[rows, S, ...]`` on
    the device, and the margin's sketch."""

    def __init__(self, tokens: Any, layers: Sequence[Any]):
        super().__init__(tokens, layers)
        self.n_rows = tokens.input_ids.shape[0]
        self.idx: dict[int, torch.Tensor] = {}
        self.top1: dict[int, torch.Tensor] = {}
        self.margin: dict[int, torch.Tensor] = {}
        self.sketch = {i: QuantileSketch() for i in self.layers}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        idx, top1, logits, valid = self.routing(ev)
        B, S = ev.shape
        m = token_margins(L, logits).to(idx.device)
        if L.index not in self.idx:
            self.idx[L.index] = torch.zeros(self.n_rows, S, idx.shape[-1], dtype=torch.int32, device=idx.device)
            self.top1[L.index] = torch.zeros(self.n_rows, S, dtype=torch.int32, device=idx.device)
            self.margin[L.index] = torch.zeros(self.n_rows, S, dtype=torch.float32, device=idx.device)
        self.idx[L.index][self._slice] = idx.view(B, S, -1).int()
        self.top1[L.index][self._slice] = top1.view(B, S).int()
        self.margin[L.index][self._slice] = m.view(B, S)
        self.sketch[L.index].add(m, valid.to(m.device))

    def reduce_across_ranks(self) -> None:
        if distributed.world_size() <= 1:
            return
        for i in sorted(self.layers):
            distributed.all_reduce_state(self.sketch[i])
        self.rows.reduce_across_ranks()


class CompareRun(_Run):
    """A run compared token by token with the stored reference: per-row flip sums (bootstrap) and flips per
    reference-margin bin, per MoE layer; device tensors only."""

    def __init__(self, tokens: Any, layers: Sequence[Any], ref: ReferenceRun, thresholds: Sequence[float]):
        super().__init__(tokens, layers)
        self.ref = ref
        self.edges = torch.tensor(thresholds, dtype=torch.float32, device="cpu")
        self.bins = {i: torch.zeros(len(thresholds) + 1, 3, dtype=torch.float64, device="cpu") for i in self.layers}

    def __call__(self, ev: RoutingEvent) -> None:
        L = ev.layer
        if L.index not in self.layers:
            return
        if L.index not in self.ref.idx:
            raise MoetoolError(f"layer {L.index}: no reference routing for this batch (the runs saw different layers)")
        idx, top1, _, valid = self.routing(ev)
        B, S = ev.shape
        dev = idx.device
        r_idx = ops.to_device(self.ref.idx[L.index][self._slice], dev)
        if r_idx.shape[:2] != (B, S) or r_idx.shape[-1] != idx.shape[-1]:
            raise MoetoolError(f"layer {L.index}: the runs saw different batches ({tuple(r_idx.shape)} vs "
                               f"{(B, S, idx.shape[-1])})")
        r_top1 = ops.to_device(self.ref.top1[L.index][self._slice], dev).reshape(-1)
        m = ops.to_device(self.ref.margin[L.index][self._slice], dev).reshape(-1)
        w = ops.to_device(valid, dev).double()
        topk = (~ops.same_set(r_idx.reshape(-1, idx.shape[-1]).long(), idx.long())).double() * w
        one = (r_top1.long() != top1.long()).double() * w
        fl = torch.stack([w, topk, one], -1)  # [T, 3]
        self.rows.add(f"{L.index}/flips", fl)
        b = torch.bucketize(m, ops.to_device(self.edges, dev), right=True)
        acc = self.bins[L.index] = ops.to_device(self.bins[L.index], dev)
        acc.index_add_(0, b, fl)

    def reduce_across_ranks(self) -> None:
        if distributed.world_size() <= 1:
            return
        for i in sorted(self.layers):
            self.bins[i] = distributed.all_reduce(self.bins[i])
        self.rows.reduce_across_ranks()


# ----- the experiment ----------------------------------------------------------------------------
def run_precision(lm: Any, tokens: Any, collector: Any, layers: Sequence[Any], opts: AgreementOptions,
                  description: str, quiet: bool) -> None:
    forward(lm, tokens, consumers=[collector], moe_layers=layers, batch_size=opts.batch_size,
            before_batch=collector.before_batch, per_row_nll=collector.nll, quiet=quiet, description=description)


def tables(ref_name: str, ref: ReferenceRun, runs: dict[str, CompareRun], records: dict[str, dict[str, Any]],
           opts: AgreementOptions) -> tuple[Any, Any, Any]:
    """``agreement`` (per precision and layer), ``agreement_summary`` (per precision, pooled over layers, with the
    NLL change) and ``agreement_bins`` (per precision, layer and reference-margin bin)."""
    import pandas as pd

    nan = float("nan")
    per_layer, summary, bins = [], [], []
    ref_nll = ref.rows.table("nll").reshape(-1, 2)
    edges = [0.0, *opts.thresholds, float("inf")]
    layers = sorted(ref.layers)
    for p, run in runs.items():
        fl = {i: run.rows.table(f"{i}/flips").reshape(-1, 3) for i in layers}
        for i in layers:
            tok = fl[i][:, 0]
            n = float(tok.sum())
            if n == 0:
                raise MoetoolError(f"layer {i}: no real tokens (empty data or all padding)")
            top1, topk = ratio_intervals(fl[i][:, [2, 1]], tok, n_boot=opts.bootstrap, seed=opts.seed)
            sk = ref.sketch[i]
            per_layer.append({"precision": p, "reference": ref_name, "layer": i, "tokens": int(n),
                              **top1.columns("top1_flip"), **topk.columns("topk_flip"),
                              "margin_mean": sk.mean, "margin_p50": sk.quantile(0.5)})
            acc = run.bins[i].cpu().numpy()
            for b in range(len(edges) - 1):
                t = acc[b, 0]
                bins.append({"precision": p, "layer": i, "margin_lo": edges[b], "margin_hi": edges[b + 1],
                             "tokens": int(t), "top1_flip": acc[b, 2] / t if t else nan,
                             "topk_flip": acc[b, 1] / t if t else nan})
        pooled = np.sum([fl[i] for i in layers], axis=0)  # [rows, 3]: tokens x layers, flips summed over layers
        top1, topk = ratio_intervals(pooled[:, [2, 1]], pooled[:, 0], n_boot=opts.bootstrap, seed=opts.seed)
        mine = run.rows.table("nll").reshape(-1, 2)
        if not np.array_equal(mine[:, 1], ref_nll[:, 1]):
            raise MoetoolError(f"{p}: the runs scored different tokens ({int(mine[:, 1].sum())} vs "
                               f"{int(ref_nll[:, 1].sum())})")
        nll_ref, nll, delta = ratio_intervals(np.stack([ref_nll[:, 0], mine[:, 0], mine[:, 0] - ref_nll[:, 0]], 1),
                                              ref_nll[:, 1], n_boot=opts.bootstrap, seed=opts.seed)
        summary.append({"precision": p, "reference": ref_name, "simulated": records[p]["simulated"],
                        "tokens": int(fl[layers[0]][:, 0].sum()), "layers": len(layers),
                        **top1.columns("top1_flip"), **topk.columns("topk_flip"), **nll_ref.columns("nll_ref"),
                        **nll.columns("nll"), **delta.columns("delta_nll")})
    return pd.DataFrame(per_layer), pd.DataFrame(summary), pd.DataFrame(bins)


def agreement(model: Any, tokens: Any, options: AgreementOptions | None = None, *, quiet: bool = False,
              **overrides: Any) -> Result:
    """Routing agreement across precisions on the same ``tokens``. ``model``: a name or path (loaded once per
    precision, one at a time) or a loaded model (used for the precision it computes in; the others are loaded again
    from its name). Tables ``agreement`` (per precision and MoE layer: top-1 and top-K flip rates against the
    reference with intervals, the reference margin), ``agreement_summary`` (per precision: flips pooled over layers,
    NLL and ΔNLL with intervals) and ``agreement_bins`` (flip rates per reference-margin bin); see
    :data:`DEFINITIONS`."""
    opts = resolve_options(AgreementOptions, options, overrides)
    require_tokens(tokens)
    if isinstance(model, (str, Path)) and getattr(tokens, "tokenizer", None) is not None:  # loaded without one
        check_tokenizer(tokens, load_tokenizer(str(model)))  # tokens of another vocabulary: before any weight loads
    ref_name = opts.reference
    order = [ref_name] + [p for p in opts.precisions if p != ref_name]
    shard = distributed.shard(tokens, opts.batch_size)
    records: dict[str, dict[str, Any]] = {}
    runs: dict[str, CompareRun] = {}
    ref: ReferenceRun | None = None
    manifest = None
    for p in order:
        lm, records[p], owned = load_precision(model, p, opts.device, opts.device_map)
        layers = select_layers(lm.layers, opts.layers)
        full = [(L.index, L.n_experts) for L in layers if L.top_k >= L.n_experts]  # (no loop variable to keep a
        if full:  # layer, and its weights, alive past this precision)
            raise MoetoolError(f"layer {full[0][0]}: routes all {full[0][1]} experts (K = n): every precision "
                               "chooses the same set, no (K+1)-th score, no margin")
        if ref is None:
            check_formats(lm, order)  # on the first model loaded: before any forward
            manifest = lm.manifest()
            ref = col = ReferenceRun(shard, layers)
        else:
            if sorted(L.index for L in layers) != sorted(ref.layers):
                raise MoetoolError(f"{p}: other MoE layers than the reference run's")
            col = runs[p] = CompareRun(shard, layers, ref, opts.thresholds)
        run_precision(lm, shard, col, layers, opts, f"agreement {p}", quiet)
        del lm, layers  # every reference to this precision's model (the runs keep layer indices only) ...
        if owned:
            free_memory()  # ... so its memory is free before the next precision loads
    per_layer, summary, bins = tables(ref_name, ref, runs, records, opts)
    meta = dict(definitions=DEFINITIONS, data=tokens.describe(), data_name=data_name(tokens.source),
                layers=sorted(ref.layers), reference=ref_name, precisions=records,
                simulated=[p for p in order if records[p]["simulated"]],
                sketch_rel_error=next(iter(ref.sketch.values())).rel_error,
                bootstrap=bootstrap_meta(opts.bootstrap, opts.seed, int(ref.rows.row_ids.shape[0])))
    show = summary[["precision", "reference", "top1_flip", "top1_flip_lo", "top1_flip_hi", "topk_flip",
                    "topk_flip_lo", "topk_flip_hi", "delta_nll", "delta_nll_lo", "delta_nll_hi"]]
    return Result("agreement", {"agreement.csv": per_layer, "agreement_summary.csv": summary,
                                "agreement_bins.csv": bins}, opts, meta=meta, summary=show,
                  model=manifest if isinstance(model, (str, Path)) else None)


def summary_lines(name: str, res: Result) -> list[str]:
    """One line: per precision, the top-1 and top-K flip rates (pooled over layers) and ΔNLL against the reference."""
    s = res["agreement_summary"]
    parts = [f"{r.precision} top-1 {format_ci(r.top1_flip, r.top1_flip_lo, r.top1_flip_hi)}, top-K "
             f"{format_ci(r.topk_flip, r.topk_flip_lo, r.topk_flip_hi)}, ΔNLL "
             f"{format_ci(r.delta_nll, r.delta_nll_lo, r.delta_nll_hi)}" for r in s.itertuples()]
    return [f"agreement {name} (vs {s.reference.iloc[0]}): " + "; ".join(parts)]
