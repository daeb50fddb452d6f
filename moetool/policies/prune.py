"""Expert pruning as a routing policy: ``prune:<criterion>:<fraction>[:<importance.csv>]`` and ``prune:file:<path>``.

A pruned layer routes as the checkpoint with the removed experts deleted does (REAP's ``prune.py`` deletes their
router rows): their logits are -inf, so their selection scores are -inf before the rule's top-K (and before
DeepSeek's group choice; the groups stay the model's), a softmax is over the kept experts only, and the chosen get
the weights the family's rule gives them (renormalised where it renormalises:
:meth:`moetool.adapters.base.MoELayer.route_masked`). Without renormalisation a softmax router's kept experts
therefore weigh more than in the full model (``softmax-topk``: p_e / sum of p over the kept); a sigmoid router's
weights do not change. Removing nothing reproduces the model exactly.

Which experts go, per MoE layer of n computed experts (zero-computation experts, LongCat-Flash's identity and
Zaya's skip, cost nothing and are never drawn nor measured): the ``⌊fraction · n⌋`` with the lowest importance
(ties: the lower expert index first), importance by routed ``frequency``, router-``weighted`` frequency or ``reap`` saliency as measured on data
by ``moetool prune`` (its ``prune_importance.csv``, passed as the spec's last argument), or ``random`` (seeded per
layer: the first of a permutation, so a smaller fraction's set is inside a larger one's). ``prune:file:<path>``
takes explicit sets: a JSON object ``{"<layer>": [experts...]}`` or a CSV with ``layer`` and ``expert`` columns
(``moetool prune``'s ``prune_removed.csv`` needs ``:<criterion>:<fraction>`` after the path to pick one set).
"""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .. import ops
from ..engine.hooks import RoutingEvent
from ..errors import MoetoolError, first_line
from ..files import table_problem
from .base import Policy, number_text

CRITERIA = ("frequency", "weighted", "reap", "random")


def n_removed(fraction: float, n: int) -> int:
    """Experts removed from a layer of ``n``: ``⌊fraction · n⌋`` (a float just below an integer counts as it)."""
    return int(math.floor(fraction * n + 1e-9))


def lowest(scores: Any, m: int) -> list[int]:
    """The ``m`` experts with the lowest score, ties broken by the lower index (sorted ascending)."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64)
    order = np.lexsort((np.arange(len(s)), s))  # by score, then by index
    return sorted(int(e) for e in order[:m])


def random_removed(seed: int, layer: int, n: int, m: int, exclude: Iterable[int] = ()) -> list[int]:
    """The first ``m`` of a permutation of ``n`` experts seeded by ``(seed, layer)``, skipping ``exclude`` (sorted
    ascending)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    skip = {int(e) for e in exclude}
    return sorted([int(e) for e in torch.randperm(n, generator=gen, device="cpu") if int(e) not in skip][:m])


def removed_from_importance(importance: Any, criterion: str, fraction: float) -> dict[int, list[int]]:
    """Per layer of ``importance`` (``prune_importance.csv``: layer, expert and the criterion's column), the
    experts a ``fraction`` removes."""
    need = {"layer", "expert", criterion}
    if not need <= set(importance.columns):
        raise MoetoolError(f"the importance table lacks column(s) {sorted(need - set(importance.columns))}")
    import numpy as np
    import pandas as pd

    values = pd.to_numeric(importance[criterion], errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)  # moetool prune writes finite values only (0 for an expert never routed)
    if bad.any():  # a NaN sorted last and was never removed; an edited or foreign table prunes by other numbers
        i = int(np.flatnonzero(bad)[0])
        at = {c: importance[c].iloc[i] for c in ("layer", "expert", criterion)}
        raise MoetoolError(f"the importance table's {criterion} is not a finite number at layer {at['layer']} expert "
                           f"{at['expert']} ('{at[criterion]}'; {int(bad.sum())} such row(s)): measure it with "
                           f"moetool prune")
    out = {}
    for layer, g in importance.assign(**{criterion: values}).groupby("layer", sort=True):
        g = g.sort_values("expert")
        if list(g["expert"]) != list(range(len(g))):
            raise MoetoolError(f"the importance table's layer {layer} does not list experts 0..{len(g) - 1} once")
        out[int(layer)] = lowest(g[criterion].to_numpy(), n_removed(fraction, len(g)))
    return out


def read_run_csv(path: str | Path) -> Any:
    """The CSV at ``path`` (pandas' read); one that ``moetool prune`` wrote and that is no longer what it wrote
    (rows, bytes or sha256 other than its run's manifest records, :func:`moetool.files.table_problem`: a truncated
    copy would prune by a partial importance table) is refused in one line."""
    import pandas as pd

    df = pd.read_csv(path)
    problem = table_problem(Path(path), len(df))
    if problem:
        raise MoetoolError(f"prune: {path} {problem}")
    return df


class _KeyValues(list):
    """A JSON object's ``(key, value)`` pairs in file order (``json.loads``' ``object_pairs_hook``): a key written
    twice is still there to be refused."""


def read_removed(path: str, criterion: str | None = None, fraction: float | None = None) -> dict[int, list[int]]:
    """Removed experts per layer from a JSON object ``{"<layer>": [experts]}`` or a CSV with ``layer``, ``expert``
    (and, for ``prune_removed.csv``, ``criterion`` and ``fraction``: the set of one pair)."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise MoetoolError(f"prune: no file '{path}'")
    if p.suffix == ".json":
        try:
            raw = json.loads(p.read_text(), object_pairs_hook=_KeyValues)  # every key as written, repeats kept
            if not isinstance(raw, _KeyValues):
                raise TypeError(f"not an object but {json.dumps(raw)[:60]}")
            keys = [int(k) for k, _ in raw]
        except (ValueError, TypeError, AttributeError) as e:
            raise MoetoolError(f"prune: {path} is not a JSON object of layer -> list of experts ({e})") from None
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:  # json.loads keeps the last of "1" and "1" (or "01"): the other's experts would stay, unsaid
            raise MoetoolError(f"prune: {path} names layer {twice[0]} more than once: give each layer's experts "
                               f"in one list")
        out = dict(zip(keys, (dict(v) if isinstance(v, _KeyValues) else v for _, v in raw)))
        for k, v in out.items():  # as the CSV's whole numbers: 1.5, true or "12" (experts 1 and 2) were read as ids
            if not (isinstance(v, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in v)):
                raise MoetoolError(f"prune: {path}: layer {k} must map to a list of whole expert numbers, not "
                                   f"{json.dumps(v)}")
        return {k: sorted(set(v)) for k, v in out.items()}
    try:
        df = read_run_csv(p)
    except (ValueError, UnicodeDecodeError) as e:  # pandas' EmptyDataError and ParserError are ValueErrors
        raise MoetoolError(f"prune: {path} is not a readable CSV ({first_line(e)})") from None
    if not {"layer", "expert"} <= set(df.columns):
        raise MoetoolError(f"prune: {path} has no 'layer' and 'expert' columns")
    if len(df) and not all(pd.api.types.is_integer_dtype(df[c]) for c in ("layer", "expert")):
        raise MoetoolError(f"prune: {path}: layer and expert must be whole numbers in every line")
    if "criterion" in df.columns:
        pairs = sorted({(c, float(f)) for c, f in zip(df["criterion"], df["fraction"])})
        if criterion is None:
            raise MoetoolError(f"prune: {path} holds several sets: add :<criterion>:<fraction> (one of "
                               f"{', '.join(f'{c}:{number_text(f)}' for c, f in pairs)})")
        df = df[(df["criterion"] == criterion) & ((df["fraction"] - fraction).abs() < 1e-12)]
        if df.empty:
            raise MoetoolError(f"prune: {path} has no set {criterion}:{number_text(fraction)}")
    return {int(layer): sorted(int(e) for e in g["expert"]) for layer, g in df.groupby("layer")}


class PrunePolicy(Policy):
    """Route among the kept experts (module docstring). ``removed``: layer -> removed experts (layers absent keep
    all); ``fraction`` with ``removed=None``: a seeded random set per layer."""

    routes_by_scores = True
    name = "prune"

    def __init__(self, removed: Mapping[int, Iterable[int]] | None = None, *, criterion: str = "file",
                 fraction: float | None = None, seed: int = 0, name: str | None = None):
        if fraction is not None and not 0.0 <= fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1), not {fraction}")
        if removed is None and (criterion != "random" or fraction is None):
            raise ValueError("give the removed experts, or a fraction of random ones")
        self.removed = None if removed is None else {int(k): sorted({int(e) for e in v}) for k, v in removed.items()}
        self.criterion, self.fraction, self.seed = criterion, fraction, seed
        self.name = name or ("prune:" + criterion + (f":{number_text(fraction)}" if fraction is not None else ""))
        # layer (an MoELayer, weakly held) -> {device: [n] bool}: each model's layers checked and built on their own,
        # so a policy object reused on another model (another n, K) never routes by the first model's sets
        self._keep: weakref.WeakKeyDictionary[Any, dict[Any, torch.Tensor]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_spec(cls, args: list[str], seed: int = 0, **_: Any) -> "PrunePolicy":
        use = "use prune:<frequency|weighted|reap>:<fraction>:<prune_importance.csv>, prune:random:<fraction> or " \
              "prune:file:<removed.json|csv>"
        if not args:
            raise ValueError(use)
        criterion = args[0]
        if criterion == "file":
            if len(args) < 2:
                raise ValueError(use)
            path, pick = ":".join(args[1:]), None
            if len(args) >= 4 and args[-2] in CRITERIA:  # prune_removed.csv:<criterion>:<fraction>
                path, pick = ":".join(args[1:-2]), (args[-2], _fraction(args[-1]))
            removed = read_removed(path, *(pick or (None, None)))
            return cls(removed, criterion="file", name=f"prune:file:{Path(path).name}"
                       + (f":{pick[0]}:{number_text(pick[1])}" if pick else ""))
        if criterion not in CRITERIA:
            raise ValueError(f"unknown criterion '{criterion}' (choose from {', '.join(CRITERIA)}, file)")
        if len(args) < 2:
            raise ValueError(use)
        fraction = _fraction(args[1])
        if criterion == "random":
            if len(args) != 2:
                raise ValueError("use prune:random:<fraction> (the seed is --seed)")
            return cls(None, criterion="random", fraction=fraction, seed=seed)
        if len(args) < 3:
            raise ValueError(f"prune:{criterion}:<fraction> needs the importance measured on data: add "
                             f":<prune_importance.csv> from moetool prune")
        path = ":".join(args[2:])
        if not Path(path).is_file():
            raise ValueError(f"no file '{path}'")
        return cls(removed_from_importance(read_run_csv(path), criterion, fraction), criterion=criterion,
                   fraction=fraction)

    def check_layers(self, policy_layers: list[int], moe_layers: list[int]) -> None:
        """Before any forward (the engine calls it): a set measured on data covers every layer the policy runs in
        (else those would silently keep all), and explicit sets name only layers it runs in."""
        if self.removed is None:
            return
        if self.criterion == "file":
            outside = sorted(k for k, v in self.removed.items() if v and k not in policy_layers)
            if outside:
                where = "MoE layers" if set(outside) - set(moe_layers) else "layers the policy runs in (--layers)"
                raise MoetoolError(f"{self.name}: removes experts in layers {outside}, which are not "
                                   f"{where} (it runs in {policy_layers})")
        else:
            missing = sorted(set(policy_layers) - set(self.removed))
            if missing:
                raise MoetoolError(f"{self.name}: the importance table has no rows for MoE layers {missing} (a table "
                                   f"of another model?)")

    def removed_in(self, layer: Any) -> list[int]:
        """The experts removed from ``layer`` (an :class:`MoELayer`)."""
        if self.removed is None:
            return random_removed(self.seed, layer.index, layer.n_computed, n_removed(self.fraction, layer.n_computed))
        return self.removed.get(layer.index, [])

    def check(self, layer: Any) -> None:
        """One line before any forward where ``layer`` cannot route among the experts it keeps."""
        self.keep(layer, torch.device("cpu"))

    def keep(self, layer: Any, device: Any) -> torch.Tensor:
        """``[n]`` bool: the experts ``layer`` keeps (checked once per layer, cached per device)."""
        cpu = torch.device("cpu")
        per = self._keep.get(layer)
        if per is None:  # built and checked on the host (check(), before any forward)
            removed = self.removed_in(layer)
            n = layer.n_experts
            bad = [e for e in removed if not 0 <= e < n]
            if bad:
                raise MoetoolError(f"{self.name}: layer {layer.index} has experts 0..{n - 1}, not {bad}")
            keep = torch.ones(n, dtype=torch.bool, device="cpu")
            keep[removed] = False
            problem = layer.keep_problem(keep)
            if problem:
                raise MoetoolError(f"{self.name}: layer {layer.index} {problem}")
            per = self._keep[layer] = {cpu: keep}
        if device not in per:  # inside the forward: an asynchronous copy, no host sync
            per[device] = ops.to_device(per[cpu], device)
        return per[device]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "criterion": self.criterion, "fraction": self.fraction}
        if self.removed is not None:
            out["removed"] = {str(k): v for k, v in sorted(self.removed.items())}
        else:
            out["seed"] = self.seed
        return out

    def logits(self, ev: RoutingEvent) -> torch.Tensor:
        """The pruned router's logits of ``ev`` (the removed experts' -inf): what it routes and weighs by."""
        return ev.layer.masked_logits(ev.logits, self.keep(ev.layer, ev.logits.device))

    def select(self, ev: RoutingEvent) -> tuple[torch.Tensor, torch.Tensor]:
        """The pruned router's choice; its routing distribution (π over the kept experts, 0 on the removed) is left
        in ``ev.scores``, the distribution this policy chose from (fluctuation's entropy)."""
        keep = self.keep(ev.layer, ev.logits.device)
        ev.scores = ev.layer.probs(ev.layer.masked_logits(ev.logits, keep))
        return ev.layer.route_masked(ev.logits, keep)

    def ranking(self, ev: RoutingEvent) -> torch.Tensor:
        """The router's selection scores (correction bias included): the model's rule chose among the kept experts by
        them, so its top-1 is the router's first-ranked kept expert (``ev.scores`` holds the pruned π, which a biased
        router does not rank by)."""
        return ev.layer.selection_scores(ev.logits)


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise ValueError(f"fraction must be a number, not '{text}'") from None
    if not 0.0 <= f < 1.0:
        raise ValueError(f"fraction must be in [0, 1), not {f:g}")
    return f
