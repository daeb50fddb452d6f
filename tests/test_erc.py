"""``erc``: M, the loss, alpha_min, dominance and the noise against hand computations from the raw weights."""

from __future__ import annotations

import copy
import re

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import kstest, uniform
from typer.testing import CliRunner

from conftest import build_tiny_model, reference_expert
from moetool.adapters import find_moe_layers
from moetool.commands.app import app
from moetool.experiments.erc.compute import (ErcOptions, derived_eps, erc_layer, erc_loss, noise_eps, proxy_tokens, run_erc)

runner = CliRunner()
COLUMNS = {
    "erc.csv": ["layer", "alpha", "erc_loss", "erc_loss_clean"],
    "erc_layers.csv": ["layer", "n_experts", "alpha_min", "alpha_min_paper", "row_dominance", "col_dominance", "eps_mean",
                       "router_abs_cos_mean"],
    "erc_matrix.csv": ["layer", "i", "j", "m"],
}


# ----- hand references: one expert, one proxy at a time -----------------------------------------
@torch.no_grad()
def hand_gate_M(layer, X: torch.Tensor) -> torch.Tensor:
    """``M[i, j] = ||W_g^j X_i||_2`` from the ``experts.gate_up_proj`` slices, a loop over experts."""
    W = layer.experts.gate_up_proj  # [n, 2I, d], gate rows first
    inter = W.shape[1] // 2
    n = W.shape[0]
    M = torch.zeros(X.shape[0], n, dtype=torch.float64)
    for j in range(n):
        Wg = W[j, :inter].double()  # [I, d]
        for i in range(X.shape[0]):
            M[i, j] = torch.linalg.norm(Wg @ X[i].double())
    return M


def hand_loss(M: torch.Tensor, alpha: float) -> float:
    n = M.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if j != i:
                total += max(M[i, j].item() - alpha * M[i, i].item(), 0.0)
                total += max(M[j, i].item() - alpha * M[i, i].item(), 0.0)
    return total / n ** 2


def hand_alpha_min(M: torch.Tensor) -> float:
    n = M.shape[0]
    return max(max(M[i, j].item(), M[j, i].item()) / M[i, i].item() for i in range(n) for j in range(n) if i != j)


def hand_eps(R: torch.Tensor) -> list[float]:
    R = R.double()
    out = []
    for i in range(R.shape[0]):
        nearest = min(torch.linalg.norm(R[i] - R[j]).item() for j in range(R.shape[0]) if j != i)
        out.append(nearest / (2 * torch.linalg.norm(R[i]).item()))
    return out


def hand_dominance(M: torch.Tensor) -> tuple[float, float]:
    """Strict: i counts only where M[i, i] is larger than every other entry of its row (column)."""
    n = M.shape[0]
    row = sum(all(M[i, i].item() > M[i, j].item() for j in range(n) if j != i) for i in range(n)) / n
    col = sum(all(M[j, j].item() > M[i, j].item() for i in range(n) if i != j) for j in range(n)) / n
    return row, col


# ----- tests ------------------------------------------------------------------------------------
def test_matrix_loss_alpha_min_dominance_match_hand_computation():
    model = build_tiny_model("mixtral")
    layers = find_moe_layers(model)[:2]
    alphas = (0.4, 0.8, 1.0, 1.3)
    res = run_erc(layers, ErcOptions(alphas=alphas, noise="none"), quiet=True)
    erc, per_layer, matrix = res.tables()
    assert list(erc.columns) == COLUMNS["erc.csv"] and list(per_layer.columns) == COLUMNS["erc_layers.csv"]
    assert list(matrix.columns) == COLUMNS["erc_matrix.csv"]
    for L in layers:
        R = L.router.weight.detach()
        M = hand_gate_M(L, R)
        got = matrix[matrix["layer"] == L.index].pivot(index="i", columns="j", values="m").to_numpy()
        np.testing.assert_allclose(got, M.numpy(), rtol=1e-5)
        rows = erc[erc["layer"] == L.index]
        np.testing.assert_allclose(rows["erc_loss_clean"], [hand_loss(M, a) for a in alphas], rtol=1e-5, atol=1e-9)
        info = per_layer[per_layer["layer"] == L.index].iloc[0]
        a_min = hand_alpha_min(M)
        assert info["alpha_min"] == pytest.approx(a_min, rel=1e-5)
        assert (info["row_dominance"], info["col_dominance"]) == hand_dominance(M)
        assert info["n_experts"] == 8
        # alpha_min is where the clean loss first vanishes
        at, below = erc_loss(M, [a_min, a_min * (1 - 1e-3)]).tolist()
        assert at == 0.0 and below > 0
        assert hand_loss(M, a_min * (1 - 1e-3)) > 0
        Rn = F.normalize(R.double(), dim=1)
        cos = (Rn @ Rn.T).abs()
        assert info["router_abs_cos_mean"] == pytest.approx(float((cos.sum() - cos.diagonal().sum()) / (8 * 7)),
                                                            rel=1e-5)


@pytest.mark.parametrize("model_type,node,norm", [("qwen3_moe", "glu", "l1"), ("gpt_oss", "output", "linf")])
def test_other_nodes_and_families_match_the_per_expert_reference(model_type, node, norm):
    """Any probe node and norm; routed experts of MoE layers only (qwen3 tiny: layers 1, 3 are MoE)."""
    model = build_tiny_model(model_type)
    layers = find_moe_layers(model)
    res = run_erc(layers, ErcOptions(noise="none", node=node, norm=norm), quiet=True)
    assert [r.layer for r in res.layers] == [L.index for L in layers]
    order = {"l1": 1, "linf": float("inf")}[norm]
    for L, r in zip(layers, res.layers):
        R = L.router_weight().detach().float()
        n = R.shape[0]
        with torch.no_grad():
            M = torch.stack([torch.linalg.vector_norm(reference_expert(model_type, L, j, R)[node], ord=order, dim=-1)
                             for j in range(n)], dim=1)  # [proxy i, expert j]
        torch.testing.assert_close(r.M, M.detach(), rtol=1e-4, atol=1e-6)


def test_planted_coupling_is_strictly_diagonal_and_random_weights_are_not():
    random_res = run_erc(find_moe_layers(build_tiny_model("mixtral")), ErcOptions(noise="none"), quiet=True)
    for r in random_res.layers:  # seed 0 of the shared tiny model: no layer is coupled
        assert r.row_dominance < 1 and r.col_dominance < 1

    model = copy.deepcopy(build_tiny_model("mixtral"))
    layers = find_moe_layers(model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for L in layers:
            W = L.experts.gate_up_proj  # [n, 2I, d]
            n, inter, d = W.shape[0], W.shape[1] // 2, W.shape[2]
            V = torch.linalg.qr(torch.randn(d, n, generator=gen))[0]  # [d, n] orthonormal: distinct directions v_i
            for i in range(n):
                u = F.normalize(torch.randn(inter, generator=gen), dim=0)
                W[i, :inter] += 3.0 * torch.outer(u, V[:, i])  # a dominant rank-one component u_i v_iᵀ
                top = torch.linalg.svd(W[i, :inter])[2][0]  # top right-singular vector of W_g^i
                L.router.weight[i] = 0.5 * top
    res = run_erc(layers, ErcOptions(noise="none"), quiet=True)
    for L, r in zip(layers, res.layers):
        assert r.row_dominance == 1.0 and r.col_dominance == 1.0
        assert r.alpha_min < 0.5  # every off-diagonal entry far below its diagonal
        assert r.loss_clean[-1] == 0.0  # alpha = 1: no violation at all
        assert hand_dominance(hand_gate_M(L, L.router.weight.detach())) == (1.0, 1.0)


def test_noise_none_derived_eps_and_sample_average():
    model = build_tiny_model("mixtral")
    L = find_moe_layers(model)[1]
    R = L.router.weight.detach()
    # none: every draw is the clean M
    r = erc_layer(L, ErcOptions(noise="none", samples=3))
    assert r.loss == r.loss_clean and r.eps_mean == 0.0
    # derived eps: nearest other row, by hand
    np.testing.assert_allclose(derived_eps(R).numpy(), hand_eps(R), rtol=1e-5)
    # a fixed float: δ within [1 − eps, 1 + eps], different per draw, and every draw is seeded
    X = proxy_tokens(R, noise_eps(R, 0.3), 2, torch.Generator().manual_seed(0))  # [2, n, d]
    ratio = X / R
    assert ratio.min() >= 0.7 - 1e-6 and ratio.max() <= 1.3 + 1e-6 and not torch.equal(X[0], X[1])
    # ... and uniform over the whole of it, both sides of 1 (Kolmogorov-Smirnov against U(0.7, 1.3))
    assert kstest(ratio.double().flatten().numpy(), uniform(loc=0.7, scale=0.6).cdf).pvalue > 1e-3
    assert ratio.min() < 0.75 and ratio.max() > 1.25 and abs(float(ratio.double().mean()) - 1) < 0.02
    assert torch.equal(X, proxy_tokens(R, noise_eps(R, 0.3), 2, torch.Generator().manual_seed(0)))
    # derived noise, 3 draws: erc_loss is the mean of each draw's loss, recomputed by hand from the same draws
    opts = ErcOptions(noise="derived", samples=3, alphas=(0.6, 1.0), seed=5)
    r = erc_layer(L, opts)
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + L.index)
    draws = proxy_tokens(R, torch.tensor(hand_eps(R), dtype=torch.float32), 3, gen)
    for a, got in zip(opts.alphas, r.loss):
        want = np.mean([hand_loss(hand_gate_M(L, draws[s]), a) for s in range(3)])
        assert got == pytest.approx(want, rel=1e-4)
    assert r.loss != r.loss_clean
    assert r.eps_mean == pytest.approx(np.mean(hand_eps(R)), rel=1e-5)


def test_draws_go_in_chunks_of_bounded_size_and_give_the_loss_of_one_batch(monkeypatch):
    """--samples draws went through the experts as one [1 + S, n, d] batch (--samples 10^8 on tiny asked for
    400 GB at once). They go in chunks of at most DRAW_CHUNK_ELEMENTS proxy elements: 5 draws in chunks of 2
    give the same draws (the CPU generator's stream) and the same mean loss as one chunk, by hand per draw."""
    import moetool.experiments.erc.compute as C

    model = build_tiny_model("mixtral")
    L = find_moe_layers(model)[1]
    R = L.router.weight.detach()
    opts = ErcOptions(noise="derived", samples=5, alphas=(0.6, 1.0), seed=2)
    whole = erc_layer(L, opts)
    shapes = []
    real = C.coupling_matrix
    monkeypatch.setattr(C, "coupling_matrix", lambda layer, X, *a: shapes.append(tuple(X.shape)) or real(layer, X, *a))
    monkeypatch.setattr(C, "DRAW_CHUNK_ELEMENTS", 2 * R.numel() + 1)
    chunked = erc_layer(L, opts)
    n, d = R.shape
    assert shapes == [(1, n, d), (2, n, d), (2, n, d), (1, n, d)]  # the clean proxies, then 2 + 2 + 1 draws
    assert chunked.loss == pytest.approx(whole.loss, rel=1e-12) and chunked.loss_clean == whole.loss_clean
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + L.index)
    draws = proxy_tokens(R, torch.tensor(hand_eps(R), dtype=torch.float32), 5, gen)
    for a, got in zip(opts.alphas, chunked.loss):
        assert got == pytest.approx(np.mean([hand_loss(hand_gate_M(L, draws[s]), a) for s in range(5)]), rel=1e-4)


def test_nonfinite_expert_weights_and_zero_router_rows_are_refused_not_tabulated():
    """ERC reads weights only (no forward, so no FiniteGuard): a NaN in an expert's gate weights made M's column
    NaN, alpha_min NaN (blank in the CSV, left out of the summary's range) and dominance an argmax over NaN
    (0.125); an all-zero router row (a zero proxy token) gave eps_mean ~1e36 and alpha_min inf, an all-zero router
    alpha_min NaN, erc_loss 0 and dominance 0.125 from argmax ties. Each is one line naming the layer; the other
    layers still run."""
    from moetool.errors import MoetoolError, MoetoolRuntimeError

    model = copy.deepcopy(build_tiny_model("mixtral"))
    layers = find_moe_layers(model)
    with torch.no_grad():
        layers[1].experts.gate_up_proj[3, 0, 0] = float("nan")
    with pytest.raises(MoetoolRuntimeError, match=r"^non-finite M in MoE layer 1 \(node gate"):
        erc_layer(layers[1], ErcOptions())
    with pytest.raises(MoetoolRuntimeError, match="non-finite M in MoE layer 1"):
        run_erc(layers, ErcOptions(noise="none"), quiet=True)
    assert np.isfinite(erc_layer(layers[0], ErcOptions()).alpha_min)
    for rows in ([2], list(range(8))):
        model = copy.deepcopy(build_tiny_model("mixtral"))
        L = find_moe_layers(model)[2]
        with torch.no_grad():
            L.router.weight[rows] = 0
        for noise in ("derived", "none", 0.1):
            with pytest.raises(MoetoolError, match=rf"^MoE layer 2: the router row of expert\(s\) "
                                                   rf"{re.escape(str(rows))} is all zero"):
                erc_layer(L, ErcOptions(noise=noise))


def test_dominance_ties_count_for_no_expert_whatever_the_labels():
    """A tie for a row's (column's) maximum went to the lower index (``argmax``): M = [[1, 2], [2, 2]] gave row
    dominance 0.0 and the same experts relabelled (swap 0 and 1: [[2, 2], [2, 1]]) 0.5. Strict now: 0.0 for both,
    as the hand count, and any relabelling of a matrix with ties leaves both fractions unchanged."""
    from moetool.experiments.erc.compute import dominance

    M = torch.tensor([[1.0, 2.0], [2.0, 2.0]])
    swap = torch.tensor([1, 0])
    assert dominance(M) == hand_dominance(M) == (0.0, 0.0)
    assert dominance(M[swap][:, swap]) == hand_dominance(M[swap][:, swap]) == (0.0, 0.0)
    gen = torch.Generator().manual_seed(0)
    M = torch.randint(0, 3, (8, 8), generator=gen).float()  # many ties
    M.diagonal().copy_(torch.tensor([2.0, 2, 2, 2, 1, 0, 2, 2]))
    for _ in range(5):
        perm = torch.randperm(8, generator=gen)
        assert dominance(M[perm][:, perm]) == hand_dominance(M) == dominance(M)


def test_an_expert_zero_on_its_own_proxy_is_refused_not_tabulated():
    """An expert with zero gate weights (a dead or zeroed expert) makes M's column 0 and M[i, i] = 0: alpha_min
    (a division by M[i, i]) was inf in erc_layers.csv (NaN with two such experts) and col_dominance counted the zero
    column for expert 0 (argmax of a column of zeros is 0): 1.000 on the embedded tiny model's layer 0 with expert 0
    zeroed, 0.875 with expert 3 zeroed instead. One line naming the layer and the experts now; the other layers run."""
    from moetool.errors import MoetoolError

    for zero in ([0], [3], [0, 1]):
        model = copy.deepcopy(build_tiny_model("mixtral"))
        layers = find_moe_layers(model)
        with torch.no_grad():
            layers[1].experts.gate_up_proj[zero] = 0
        for noise in ("derived", "none"):
            with pytest.raises(MoetoolError, match=rf"^MoE layer 1: node gate of expert\(s\) {re.escape(str(zero))} "
                                                   rf"is zero on its own proxy"):
                erc_layer(layers[1], ErcOptions(noise=noise))
        with pytest.raises(MoetoolError, match="MoE layer 1: node gate"):
            run_erc(layers, ErcOptions(noise="none"), quiet=True)
        ok = erc_layer(layers[0], ErcOptions(noise="none"))
        assert np.isfinite(ok.alpha_min) and ok.alpha_min == pytest.approx(hand_alpha_min(ok.M.double()), rel=1e-6)


@pytest.mark.slow
def test_cli_on_a_saved_tiny_model(tmp_path):
    model = build_tiny_model("mixtral")
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    r = runner.invoke(app, ["erc", "--model", str(tmp_path / "model"), "--out", str(out), "--noise", "none",
                            "--samples", "2", "--layers", "0,3", "--alpha", "0.5,1", "-q"])
    assert r.exit_code == 0, r.output
    tables = {name: pd.read_csv(out / name) for name in COLUMNS}
    for name, cols in COLUMNS.items():
        assert list(tables[name].columns) == cols
    erc = tables["erc.csv"]
    assert sorted(erc["layer"].unique()) == [0, 3] and list(erc["alpha"][:2]) == [0.5, 1.0]
    np.testing.assert_allclose(erc["erc_loss"], erc["erc_loss_clean"], rtol=1e-12)
    L3 = find_moe_layers(model)[3]
    m = tables["erc_matrix.csv"].query("layer == 3").pivot(index="i", columns="j", values="m").to_numpy()
    np.testing.assert_allclose(m, hand_gate_M(L3, L3.router.weight.detach()).numpy(), rtol=1e-5)
    assert (out / "figures" / "erc_matrix.png").is_file() and (out / "manifest.json").is_file()
    for bad, msg in ((["--noise", "lots"], "--noise"), (["--layers", "9"], "not MoE layers"),
                     (["--alpha", "0.5,x"], "--alpha: bad value 'x'")):
        r = runner.invoke(app, ["erc", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "bad"),
                                "--force", "-q", *bad])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]  # (the loader may print progress)
        assert r.exit_code == 2 and len(errors) == 1 and msg in errors[0], r.output


# tables and console only (no_figures): erc's figures are test_cli_on_a_saved_tiny_model's and test_help_files.py's
@pytest.mark.slow
def test_cli_on_embedded_tiny(tmp_path, no_figures):
    r = runner.invoke(app, ["erc", "--model", "tiny", "--out", str(tmp_path), "--samples", "2", "-q"])
    assert r.exit_code == 0, r.output
    per_layer = pd.read_csv(tmp_path / "erc_layers.csv")
    assert list(per_layer.columns) == COLUMNS["erc_layers.csv"]
    assert per_layer["alpha_min"].gt(0).all() and per_layer["row_dominance"].between(0, 1).all()
    # the paper's value beside the measured one: the published vanilla-MoE alpha_min, every layer
    from moetool.experiments.published import published
    paper = published("vanilla-moe", "alpha_min").value.item()
    assert (per_layer["alpha_min_paper"] == paper).all() and paper == 5.0
    loud = runner.invoke(app, ["erc", "--model", "tiny", "--out", str(tmp_path / "loud")])
    assert loud.exit_code == 0 and "alpha_min_paper: ERC alpha_min per layer" in " ".join(loud.output.split())
    erc = pd.read_csv(tmp_path / "erc.csv")
    # the loss is non-increasing in alpha in every layer
    assert (erc.sort_values(["layer", "alpha"]).groupby("layer")["erc_loss_clean"].diff().dropna() <= 1e-12).all()


def test_identity_experts_are_left_out_of_M():
    """LongCat-Flash (tiny: 8 computed + 2 identity experts): an identity expert has no weights, its "gate" on any
    proxy is the proxy itself, so it is no expert of M. M is the computed experts' by hand from ``gate_up_proj``
    (proxies: their own router rows), alpha_min, dominance, eps and |cos| over those 8. Before, M was 10 x 10 with
    the identity columns ``||R_i||`` (~1.2 against ~0.12 for the real experts): alpha_min 12.4 instead of 1.66 in
    layer 0 and row dominance 0 in every layer."""
    from moetool.adapters.tiny import build_tiny

    model = build_tiny("longcat_flash")
    layers = find_moe_layers(model)
    res = run_erc(layers, ErcOptions(noise="derived", samples=2, alphas=(0.5, 1.0)), quiet=True)
    _, per_layer, matrix = res.tables()
    for L in layers:
        m = L.n_experts - L.n_zero_compute
        assert L.n_zero_compute == 2 and m == 8
        R = L.router_weight().detach()[:m]  # the computed experts' router rows
        M = hand_gate_M(L, R)[:, :m]  # gate_up_proj holds 10 slices; the identity experts' are never used
        got = matrix[matrix["layer"] == L.index].pivot(index="i", columns="j", values="m").to_numpy()
        np.testing.assert_allclose(got, M.numpy(), rtol=1e-5)
        info = per_layer[per_layer["layer"] == L.index].iloc[0]
        assert info["n_experts"] == m
        assert info["alpha_min"] == pytest.approx(hand_alpha_min(M), rel=1e-5)
        assert (info["row_dominance"], info["col_dominance"]) == hand_dominance(M)
        assert info["eps_mean"] == pytest.approx(np.mean(hand_eps(R)), rel=1e-5)
        Rn = F.normalize(R.double(), dim=1)
        cos = (Rn @ Rn.T).abs()
        assert info["router_abs_cos_mean"] == pytest.approx(float((cos.sum() - m) / (m * (m - 1))), rel=1e-5)


def test_a_noise_that_overflows_the_proxies_names_the_noise_not_the_weights():
    """``--noise 1e30``: δ up to 1e30 puts the proxies' gate products past fp32 (inf), while the clean M of the same
    finite weights is fine; the line names --noise and its value (it blamed 'NaN/inf weights?')."""
    from moetool.errors import MoetoolError

    L = find_moe_layers(build_tiny_model("mixtral"))[0]
    assert np.isfinite(erc_layer(L, ErcOptions(noise="none")).alpha_min)  # the weights are finite
    with pytest.raises(MoetoolError, match=r"^--noise 1e\+30: the noisy proxies of MoE layer 0 give a non-finite M"):
        erc_layer(L, ErcOptions(noise=1e30))


def test_an_overflowing_noise_is_told_the_largest_noise_that_passes_every_layer():
    """The refusal said "choose a smaller noise" with no value. It now names one: the largest 1e37 / 10^k whose
    noisy M is finite in every layer on the same seeded draws. Checked here: every layer runs at that noise, and
    at 10 times it a layer is refused again (so it is the largest power of ten that passes)."""
    from moetool.errors import MoetoolError

    layers = find_moe_layers(build_tiny_model("mixtral"))
    with pytest.raises(MoetoolError) as e:
        run_erc(layers, ErcOptions(noise=1e37), quiet=True)
    m = re.fullmatch(r"--noise 1e\+37: the noisy proxies of MoE layer \d+ give a non-finite M \(node gate; the clean "
                     r"M is finite\): --noise (\S+) keeps M finite in every layer \(checked on the same seeded "
                     r"draws\)", str(e.value))
    assert m, str(e.value)
    noise = float(m.group(1))
    assert noise < 1e37 and np.log10(noise) == round(np.log10(noise))  # 1e37 / 10^k
    res = run_erc(layers, ErcOptions(noise=noise), quiet=True)
    assert all(np.isfinite(r.loss).all() for r in res.layers)
    with pytest.raises(MoetoolError, match="give a non-finite M"):
        for L in layers:
            erc_layer(L, ErcOptions(noise=10 * noise))


@pytest.mark.parametrize("noise", [1e37, 1e200, 1e300])
def test_an_overflowing_noise_past_float32_or_in_a_later_layer_is_told_the_largest_that_passes(noise):
    """A --noise past float32's largest number (the proxies' dtype) was a RuntimeError of torch.full (a traceback);
    it is now refused as an overflowing noise, with the level that passes. That level (searched by doubling k in
    noise / 10^k, then bisecting) must be checked between the last failure and 1e-30: from 1e200 the doubling
    jumped past every level that passes and said only --noise none would do, from 1e300 10 ** 512 was an
    OverflowError. Here the last layer's router is 1e6 times larger (its proxies too), so it overflows at a noise
    1e6 times smaller than the first layer that is refused: the level is the largest 10^j that passes in every
    layer, checked by hand (every layer runs at it, one refuses at 10 times it)."""
    from moetool.errors import MoetoolError

    layers = find_moe_layers(copy.deepcopy(build_tiny_model("mixtral")))  # the cached model stays as it is
    with torch.no_grad():
        layers[-1].router.weight.mul_(1e6)
    with pytest.raises(MoetoolError) as e:
        run_erc(layers, ErcOptions(noise=noise), quiet=True)
    m = re.fullmatch(re.escape(f"--noise {noise!r}: ") + r"(.*): --noise (\S+) keeps M finite in every layer "
                     r"\(checked on the same seeded draws\)", str(e.value))
    assert m, str(e.value)
    assert ("past float32's largest number (3.4e+38)" in m.group(1)) == (noise > 3.4e38)
    got = float(m.group(2))
    assert np.log10(got) == round(np.log10(got))  # noise / 10^k, noise a power of ten
    for L in layers:
        erc_layer(L, ErcOptions(noise=got))  # no refusal in any layer
    with pytest.raises(MoetoolError, match="give a non-finite M"):
        erc_layer(layers[-1], ErcOptions(noise=10 * got))  # the last layer is the one that binds
    erc_layer(layers[0], ErcOptions(noise=1e4 * got))  # the first layer alone would pass far larger noise


def test_the_noise_told_instead_of_derived_starts_from_the_largest_derived_eps_of_the_layers():
    """smaller_noise with --noise derived: the level searched from is the largest derived eps_i over the layers
    (eps_i = ||R_i - R_j*|| / (2 ||R_i||), j* the nearest other router row), by hand here with the rows of one layer
    scaled apart so the layers' largest eps differ; a tenth of it passes on the tiny model (mutation pass 22: the
    smallest layer's eps as the start survived)."""
    from moetool.experiments.erc.compute import smaller_noise

    layers = find_moe_layers(copy.deepcopy(build_tiny_model("mixtral")))  # the cached model stays as it is
    with torch.no_grad():
        layers[0].router.weight[0].mul_(0.1)  # row 0 nearer the origin: its eps_0 grows

    def largest_eps(L):
        R = L.router.weight.detach().double()
        far = [min(float((R[i] - R[j]).norm()) for j in range(len(R)) if j != i) / (2 * float(R[i].norm()))
               for i in range(len(R))]
        return max(far)

    per_layer = [largest_eps(L) for L in layers]
    assert max(per_layer) > 1.5 * min(per_layer)  # the case: the start depends on which layer's eps
    want = float(f"{max(per_layer) / 10:.2g}")
    assert smaller_noise(layers, ErcOptions(noise="derived")) == (
        f"--noise {want:g} keeps M finite in every layer (checked on the same seeded draws)")


def test_loss_curves_cover_every_layer_past_its_alpha_min_with_alpha_min_on_the_grid():
    """The figure's curves (loss_curves) from an erc_matrix table: every layer (layer 0 included), its alpha_min by
    hand, a grid from 0 to 1.15 x the largest alpha_min holding every alpha_min and --alpha exactly, and each point
    the hand loss; at alpha_min the clean loss is exactly 0, and just below it is not."""
    from moetool.experiments.erc.compute import loss_curves

    Ms = {0: torch.tensor([[2.0, 1.0], [3.0, 4.0]], dtype=torch.float64),  # alpha_min = 3/2
          3: torch.tensor([[1.0, 0.5, 0.2], [0.1, 2.0, 0.4], [0.3, 0.6, 1.0]], dtype=torch.float64)}  # 0.6
    matrix = pd.DataFrame([{"layer": layer, "i": i, "j": j, "m": float(M[i, j])}
                           for layer, M in Ms.items() for i in range(len(M)) for j in range(len(M))])
    curves = loss_curves(matrix, alphas=(0.7,), points=61)
    assert sorted(curves["layer"].unique()) == [0, 3]
    mins = {0: 1.5, 3: 0.6}
    for layer, M in Ms.items():
        c = curves[curves["layer"] == layer].sort_values("alpha")
        assert c["alpha_min"].tolist() == pytest.approx([mins[layer]] * len(c))
        grid = c["alpha"].to_numpy()
        assert grid[0] == 0.0 and grid[-1] == pytest.approx(1.15 * 1.5)
        assert len(grid) == 61 + 3  # none of 1.5, 0.6, 0.7 is a grid step (1.725 k / 60)
        for a in (1.5, 0.6, 0.7):
            assert a in set(grid.tolist())
        np.testing.assert_allclose(c["erc_loss_clean"], [hand_loss(M, a) for a in grid], rtol=1e-12, atol=1e-15)
        at = c[c["alpha"] == mins[layer]]["erc_loss_clean"].item()
        below = c[c["alpha"] < mins[layer]]["erc_loss_clean"].iloc[-1]
        assert at == 0.0 and below > 0
    assert curves[curves["layer"] == 0]["erc_loss_clean"].iloc[0] == pytest.approx(2 * (1 + 3) / 4)  # alpha 0


def test_a_router_row_with_some_zero_entries_is_not_taken_for_a_zero_row():
    """Only an ALL-zero router row is a zero proxy token; a row with zeros in some coordinates is an ordinary proxy:
    the layer runs and its M is the hand M of its rows."""
    model = copy.deepcopy(build_tiny_model("mixtral"))
    L = find_moe_layers(model)[0]
    with torch.no_grad():
        L.router.weight[2, :3] = 0
        L.router.weight[5, 1] = 0
    got = erc_layer(L, ErcOptions(noise="none", alphas=(1.0,)))
    M = hand_gate_M(L, L.router.weight.detach())
    np.testing.assert_allclose(got.M.numpy(), M.numpy(), rtol=1e-5)
    assert got.alpha_min == pytest.approx(hand_alpha_min(M), rel=1e-5)
