"""Tensor and expert parallel (``--tp`` / ``--ep``, transformers' own ``DistributedConfig``) under torchrun with gloo
on CPU: every experiment command of the registry gives the tables of one process.

Two launches, each running every command in ONE process per rank (tests/cli_sequence.py):

* 2 ranks, ``--tp 2``: one model split over both (attention heads and every expert's intermediate features);
* 4 ranks, ``--tp 2 --ep 2``: two model groups of 2 ranks (data parallel over the groups, world = dp 2 × tp 2),
  whole experts split over the ranks of a group.

Tables equal one process to relative 1e-5 (absolute 2e-6 for float32 values near zero: routing margins, which TP's
all-reduced attention sums in another order); traces row for row (the same rows, token ids and experts exactly; their
per-token float32 weights and logits to relative 5e-5). Refusals (bad layouts) are one line before any run folder exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from test_distributed_cli import CASES, NOT_DISTRIBUTED, SEQUENCE, accelerate_launch, run_cli

from moetool.context import RunState

# one xdist worker runs this module (--dist loadgroup): its launches are one module fixture, which each worker given
# some of the tests would otherwise run again (about 4.5 min of 2 cores)
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("tensor_parallel")]

# 7 packed rows: a full global batch of 4, then a partial one of 3 (tp2ep2dp2: 2 rows in group 0, 1 in group 1).
# (It was 900 tokens, 15 rows = 3 full batches + 3: the same shapes; the forwards are about half these launches' CPU.)
DATA = ["--max-tokens", "420", "--seq-len", "64"]
LAYOUTS = {  # name: (processes, flags, rows per forward of one model group)
    "tp2": (2, ["--tp", "2"], 4),
    "tp2ep2dp2": (4, ["--tp", "2", "--ep", "2"], 2),
}
REFUSED = {"eval": "lm-eval", "agreement": "one whole model per precision"}  # refusing --tp/--ep in one line


def _cases():
    out = []
    for command, extra in CASES:
        if command in REFUSED:
            continue
        extra = list(extra)
        if "--max-tokens" in extra:
            i = extra.index("--max-tokens")
            extra[i:i + 4] = DATA
        out.append((command, extra))
    return out


def _sequence(root: Path, side: str, flags: list[str], rows: int) -> Path:
    seq = [[command, "--quiet", *extra, *flags] + ["--batch-size", str(rows)] * ("--max-tokens" in extra
                                                                                  and "--batch-size" not in extra)
           + ["--out", str(root / side / f"{command}{i}")] for i, (command, extra) in enumerate(_cases())]
    path = root / f"{side}.json"
    path.write_text(json.dumps(seq))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    run_cli([str(_sequence(root, "one", [], 4))], root, target=SEQUENCE, timeout=600)
    for name, (world, flags, rows) in LAYOUTS.items():
        run_cli([str(_sequence(root, name, flags, rows))], root, world=world, target=SEQUENCE, timeout=900)
    return root


def _read(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)


def test_every_command_is_covered():
    from moetool.experiments.registry import EXPERIMENTS

    assert {c for c, _ in CASES} | set(NOT_DISTRIBUTED) == set(EXPERIMENTS)
    assert set(NOT_DISTRIBUTED) - {"plan"} <= set(REFUSED)  # plan loads no model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tables_equal_one_process(runs, layout):
    worst = {}
    for i, (command, _) in enumerate(_cases()):
        one, par = runs / "one" / f"{command}{i}", runs / layout / f"{command}{i}"
        names = sorted(f.name for p in ("*.csv", "*.csv.gz", "*.parquet") for f in one.glob(p))
        assert names and names == sorted(f.name for p in ("*.csv", "*.csv.gz", "*.parquet") for f in par.glob(p))
        for name in names:
            a, b = _read(one / name), _read(par / name)
            a, b = (x.drop(columns=[c for c in ("seconds",) if c in x]) for x in (a, b))
            # a trace keeps every token's float32 weights and logits: tp's re-ordered sums move the last bits, which
            # a softmax over expert norms (norm:gate weights) can lift to ~1e-5; its routing is checked exactly below
            # (pandas takes max(rtol * |x|, atol), not their sum: a logit near 0 in a layer whose logits reach ~6 gets
            # only atol, while its rounding is that of the layer's scale -- measured 2.1e-6 on a 0.028 logit; 1e-5 = 2e-6
            # of the largest logit, the scale of one float32 reordering)
            rtol, atol = (5e-5, 1e-5) if name.startswith("trace.") else (1e-5, 2e-6)
            # mass-recall's best_scale_mean is the mean of an argmax over a grid of scales: a token whose best two
            # bounds tie within float32 rounding may take the neighbouring scale under tp's re-ordered sums (one of
            # 900 tokens on an AVX-512 CPU: 6e-5 of the mean; one of the 420 tokens now: ~1.3e-4); the bound itself
            # (bound_scaled_mean, a max of continuous bounds) is compared at full tolerance with the rest
            if "best_scale_mean" in a:
                pd.testing.assert_series_equal(a.pop("best_scale_mean"), b.pop("best_scale_mean"), check_exact=False,
                                               rtol=1e-3, obj=f"{command}{i}/{name} best_scale_mean")
            pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=rtol, atol=atol, obj=f"{command}{i}/{name}")
            num = a.select_dtypes("number").columns
            if len(num):
                rel = ((a[num] - b[num]).abs() / a[num].abs().clip(lower=1e-3)).max().max()
                worst[f"{command}{i}"] = max(worst.get(f"{command}{i}", 0.0), float(rel))
        m = json.loads((par / "manifest.json").read_text())
        world, flags, _ = LAYOUTS[layout]
        tp, ep = int(flags[1]), int(flags[3]) if len(flags) > 2 else 1
        assert m["status"] == "complete"
        if isinstance(m.get("model"), dict):  # fluctuation compares checkpoints: no one model block
            assert m["model"]["parallel"] == {"tp": tp, "ep": ep, "dp": world // 2, "group": 2, "world": world,
                                              "engine": "transformers DistributedConfig"}
        d = m.get("distributed", {})
        assert d.get("tp", tp) == tp and d.get("processes", world) == world
    print(layout, {k: f"{v:.1e}" for k, v in worst.items()})


def test_accelerate_launch_tp(runs):
    """``accelerate launch`` (its own launcher, the same rank variables) with --tp 2: stats equals one process."""
    i, (command, extra) = next((i, c) for i, c in enumerate(_cases()) if c[0] == "stats")
    out = runs / "accelerate" / f"{command}{i}"
    run_cli([command, "--quiet", *extra, "--batch-size", "4", "--tp", "2", "--out", str(out)], runs, world=2,
            launcher=accelerate_launch)
    for f in (runs / "one" / f"{command}{i}").glob("*.csv"):
        pd.testing.assert_frame_equal(_read(f), _read(out / f.name), check_exact=False, rtol=1e-5, atol=2e-6,
                                      obj=f.name)
    assert json.loads((out / "manifest.json").read_text())["model"]["parallel"]["tp"] == 2


def test_traces_row_for_row(runs):
    for i, (command, _) in enumerate(_cases()):
        if command != "trace":
            continue
        for layout in LAYOUTS:
            for f in (runs / "one" / f"trace{i}").glob("trace.*"):
                a, b = _read(f), _read(runs / layout / f"trace{i}" / f.name)
                keys = [c for c in a.columns if c in ("row", "pos", "token_id", "layer") or c.startswith("expert")]
                pd.testing.assert_frame_equal(a[keys], b[keys], check_exact=True)  # the same routing, row for row


def test_bad_layouts_are_one_line_before_loading(tmp_path):
    """On the command line: not under a launcher, and eval (lm-eval's own loop): one line, no run folder."""
    import subprocess
    import sys

    from test_distributed_cli import _env

    for args, says in ((["stats", "--tp", "2"], "launch with torchrun --nproc-per-node 2"),
                       (["eval", "--tasks", "arc_easy", "--tp", "2"], "lm-eval"),
                       (["agreement", "--tp", "2"], "one whole model per precision")):
        p = subprocess.run([sys.executable, "-m", "moetool", *args, "--out", str(tmp_path / "out")], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=300)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr[-2000:]
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world, tp, ep, device_map, tweak, says", [
    (4, 4, 1, None, {}, "2 key/value heads do not split over 4 ranks"),
    (2, 2, 2, None, {"num_local_experts": 5}, "5 experts do not split over 2 ranks"),
    (2, 2, 1, None, {"intermediate_size": 191}, "191 expert intermediate features do not split over 2 ranks"),
    (6, 4, 1, None, {}, "world size 6 is not a multiple of the 4 ranks"),
    (2, 2, 1, "auto", {}, "--device-map with --tp 2"),
    (2, 2, 2, "auto", {}, "--device-map with --tp 2"),
])
def test_check_parallel_refuses(monkeypatch, world, tp, ep, device_map, tweak, says):
    """The layout checks on the config alone, as a launcher's environment presents the processes."""
    from moetool import distributed
    from moetool.errors import MoetoolError
    from moetool.loading import load_config

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    config = load_config("tiny")[0]
    for k, v in tweak.items():
        setattr(config, k, v)
    with RunState(layout=distributed.Parallel(tp, ep)).active():  # the run's --tp/--ep
        with pytest.raises(MoetoolError, match=re.escape(says)):
            distributed.check_parallel(config, device_map)
    assert distributed.parallel() == distributed.Parallel(1, 1)  # no run: nothing split


def test_a_layout_refuses_ep_other_than_tp():
    from moetool import distributed
    from moetool.errors import MoetoolError

    for tp, ep in ((2, 4), (1, 2)):  # no --ep without the same --tp: transformers' expert groups are its tp groups
        with pytest.raises(MoetoolError, match="--ep must equal --tp"):
            distributed.Parallel(tp, ep)
    assert distributed.parallel() == distributed.Parallel(1, 1)


def test_check_parallel_accepts(monkeypatch):
    from moetool import distributed
    from moetool.loading import load_config

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    config = load_config("tiny")[0]
    for tp, ep in ((2, 1), (2, 2), (1, 1)):  # world 4: two model groups of 2
        want = distributed.Parallel(tp, ep)
        with RunState(layout=want).active():
            assert distributed.check_parallel(config) == want


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-process gloo group and a 1-rank device mesh: DTensor expert weights without a launcher."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from test_distributed import free_port, port_retry

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")

    def start():
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)

    port_retry(start)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_split_of_reads_the_placements(one_rank_group):
    """Shard(0) of the fused expert weights = whole experts per rank (ep); a split of another dim = every expert's
    features (tp), read only for the layout moetool verified (the base fused gate_up/down view); a family with its
    own expert layout (gpt-oss: interleaved gate/up and biases) is refused in one line, never read wrongly."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.engine.probes import split_of
    from moetool.errors import MoetoolError

    def put(layer, placement):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(layer.experts, name)
            layer.experts._parameters[name] = torch.nn.Parameter(
                distribute_tensor(p.detach(), one_rank_group, [placement]), requires_grad=False)

    mix = find_moe_layers(build_tiny("mixtral"))[0]
    assert split_of(mix) is None
    put(mix, Shard(0))
    assert split_of(mix).kind == "experts" and split_of(mix).size == 1
    mix = find_moe_layers(build_tiny("mixtral"))[0]
    put(mix, Shard(1))
    assert split_of(mix).kind == "features"
    oss = find_moe_layers(build_tiny("gpt_oss"))[0]
    put(oss, Shard(0))
    assert split_of(oss).kind == "experts"
    oss = find_moe_layers(build_tiny("gpt_oss"))[0]
    put(oss, Shard(1))
    with pytest.raises(MoetoolError, match="split by --tp alone is not supported; use --tp N --ep N"):
        split_of(oss)


@pytest.mark.parametrize("placement_dim", [0, 1])
def test_probes_read_dtensor_weights(one_rank_group, placement_dim):
    """Probes on DTensor expert weights (the rank's local shard, gathered / summed over the group) equal the same
    probes on the plain weights (a 1-rank group: the collectives are the identity; tests above use 2 and 4 ranks)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from moetool.adapters import find_moe_layers
    from moetool.adapters.tiny import build_tiny
    from moetool.engine.probes import expert_nodes, node_scores, routed_absmax

    layer = find_moe_layers(build_tiny("mixtral"))[0]
    h = torch.randn(37, layer.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))
    routed = torch.rand(37, layer.experts.gate_up_proj.shape[0], generator=torch.Generator().manual_seed(1)) < 0.3
    want = {n: node_scores(layer, h, n) for n in ("gate", "glu", "output")}
    nodes = expert_nodes(layer, h, ("act", "output"))
    peak = routed_absmax(layer, h, routed)
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(layer.experts, name)
        layer.experts._parameters[name] = torch.nn.Parameter(
            distribute_tensor(p.detach(), one_rank_group, [Shard(placement_dim)]), requires_grad=False)
    for n, ref in want.items():
        torch.testing.assert_close(node_scores(layer, h, n), ref, rtol=0, atol=0)
    got = expert_nodes(layer, h, ("act", "output"))
    for n in nodes:
        torch.testing.assert_close(got[n], nodes[n], rtol=0, atol=0)
    torch.testing.assert_close(routed_absmax(layer, h, routed), peak, rtol=0, atol=0)
