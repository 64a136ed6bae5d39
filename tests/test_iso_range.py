"""iso_c_range / iso_c_matched (the drop-in preset's merge): Iso-C on the numerical range of
the mean, and that at the mean's Frobenius norm.

Checked against an independent float64 numpy computation, against iso_c on full-rank input,
and on the property that motivates it: a direction with no signal (a dead unit's zero row)
gets no update, where iso_c moves it by mean(s)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, iso_c, merge
from flwr_isoloco.merging.iso_range import iso_c_matched as _capped
from flwr_isoloco.merging.iso_range import iso_c_range, numerical_rank


def iso_c_matched(x, **kw):
    """The uncapped form (``max_gain=None``), which these tests check; the capped default:
    tests/test_label_skew.py."""
    return _capped(x, max_gain=None, **kw)


def _rank_deficient(m=10, n=64, rank=4, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, rank, generator=g, dtype=torch.float64) @ torch.randn(
        rank, n, generator=g, dtype=torch.float64
    )


def _numpy_reference(x: np.ndarray) -> np.ndarray:
    u, s, vh = np.linalg.svd(x, full_matrices=False)
    k = np.linalg.matrix_rank(x)  # numpy's tolerance: s_max * max(m, n) * eps
    return s[:k].mean() * (u[:, :k] @ vh[:k])


@pytest.mark.parametrize("rank", [1, 4, 10])
def test_matches_an_independent_numpy_computation(rank):
    x = _rank_deficient(rank=rank)
    out = iso_c_range(x)
    assert numerical_rank(torch.linalg.svdvals(x), tuple(x.shape)) == rank
    np.testing.assert_allclose(out.numpy(), _numpy_reference(x.numpy()), rtol=1e-9, atol=1e-12)


def test_full_rank_is_exactly_iso_c():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 7, generator=g)
    assert torch.equal(iso_c_range(x), iso_c(x))


def test_dead_unit_gets_no_update_where_iso_c_moves_it():
    x = _rank_deficient(m=8, n=16, rank=8).float()
    x[3] = 0.0  # a dead unit: its row of the pseudo-gradient is zero
    assert float(iso_c(x)[3].norm()) > 0.1 * float(iso_c(x).norm()) / 8**0.5
    assert float(iso_c_range(x)[3].abs().max()) < 1e-6 * float(x.abs().max())


def test_zero_scale_and_norm_bound():
    assert torch.equal(iso_c_range(torch.zeros(4, 5)), torch.zeros(4, 5))
    x = _rank_deficient(rank=3)
    assert torch.allclose(iso_c_range(2.5 * x), 2.5 * iso_c_range(x), rtol=1e-10, atol=1e-12)
    assert float(iso_c_range(x).norm()) <= float(x.norm()) * (1 + 1e-12)
    with pytest.raises(ValueError, match="2-D"):
        iso_c_range(torch.ones(3))


@pytest.mark.parametrize("rank", [2, 10])
def test_matched_is_the_range_direction_at_the_means_frobenius_norm(rank):
    x = _rank_deficient(rank=rank)
    out = iso_c_matched(x)
    ref = _numpy_reference(x.numpy())
    ref *= np.linalg.norm(x.numpy()) / np.linalg.norm(ref)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-9, atol=1e-12)
    assert float(out.norm()) == pytest.approx(float(x.norm()), rel=1e-12)
    assert float(torch.linalg.matrix_norm(out, 2)) <= float(torch.linalg.matrix_norm(x, 2))
    assert torch.equal(iso_c_matched(torch.zeros(3, 4)), torch.zeros(3, 4))


def test_registered_rule_streams_and_leaves_1d_tensors_to_the_mean():
    rule = MERGE_RULES["iso_c_matched"]
    assert rule.streaming
    g = torch.Generator().manual_seed(1)
    deltas = [
        {"w": _rank_deficient(rank=2, seed=i).float(), "b": torch.randn(5, generator=g)}
        for i in range(3)
    ]
    out = merge("iso_c_matched", deltas, max_gain=None)
    mean_w = sum(d["w"] for d in deltas) / 3
    assert torch.allclose(out["w"], iso_c_matched(mean_w), atol=1e-5)
    assert torch.allclose(out["b"], sum(d["b"] for d in deltas) / 3, atol=1e-6)
    sm = StreamingMerger("iso_c_matched", max_gain=None)
    for d in deltas:
        sm.add(d, 1.0)
    assert torch.allclose(sm.result()["w"], out["w"], atol=1e-5)


# ---- the Gram route (full rank, accepted by gram_polar) against an independent SVD ----------


def _np_matched(x: np.ndarray) -> np.ndarray:
    ref = _numpy_reference(x)
    return ref * (np.linalg.norm(x) / np.linalg.norm(ref))


def _spectrum(m, n, smin, seed, dtype=torch.float32):
    """``U diag(s) V^T`` with log-spaced ``s`` from 1 down to ``smin`` (fp64 factors)."""
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    s = torch.logspace(0, np.log10(smin), r, dtype=torch.float64)
    return ((u * s) @ v.T).to(dtype)


@pytest.fixture
def gram_calls(monkeypatch):
    """Records whether each gram_polar call gave a result (True) or sent the caller to the SVD."""
    import importlib

    mod = importlib.import_module("flwr_isoloco.merging.iso_range")
    real, calls = mod.gram_polar, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(mod, "gram_polar", spy)
    return calls


@pytest.mark.parametrize("shape", [(64, 200), (300, 90)])
@pytest.mark.parametrize("smin", [0.3, 1e-2])  # kappa^2 = 11 (fp32 rung), 1e4 (fp64 rung)
@pytest.mark.parametrize("fn", [iso_c_matched, iso_c_range])
def test_gram_route_matches_an_independent_fp64_svd(gram_calls, shape, smin, fn):
    x = _spectrum(*shape, smin, seed=7)
    out = fn(x)
    assert gram_calls == [True] and out.dtype == torch.float32 and out.is_contiguous()
    ref = (
        _np_matched(x.double().numpy())
        if fn is iso_c_matched
        else _numpy_reference(x.double().numpy())
    )
    rel = np.linalg.norm(out.double().numpy() - ref) / np.linalg.norm(ref)
    assert rel <= 1e-5
    u, s, vh = torch.linalg.svd(x, full_matrices=False)  # the fp32 SVD route, as before
    svd32 = (u * (s.norm() / len(s) ** 0.5 if fn is iso_c_matched else s.mean())) @ vh
    assert _rel(out, svd32) <= 1e-5


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_near_the_rank_threshold_and_rank_deficient_go_to_the_svd(gram_calls):
    # s_min = 1.5 x the fp32 rank threshold (200 * eps): below the 2x margin, so the SVD decides k
    tol = 200 * torch.finfo(torch.float32).eps
    x = _spectrum(64, 200, 1.5 * tol, seed=2, dtype=torch.float64).float()
    out = iso_c_matched(x)
    assert gram_calls == [False]
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    k = numerical_rank(s, tuple(x.shape))
    assert torch.equal(out, (u[:, :k] * (s.norm() / k**0.5)) @ vh[:k])  # the SVD route, bitwise
    low = _rank_deficient(m=16, n=64, rank=5).float()  # exactly rank 5: no Gram result
    gram_calls.clear()
    ref = torch.from_numpy(_np_matched(low.numpy()).astype(np.float64))  # fp32 rank rule
    assert _rel(iso_c_matched(low), ref) <= 1e-5
    assert gram_calls == [False]
    gram_calls.clear()
    sq = _spectrum(96, 96, 0.5, seed=1)  # near-square: always the SVD
    iso_c_range(sq)
    assert gram_calls == [False]


def test_fp64_input_by_the_gram_route_stays_fp64_exact(gram_calls):
    x = _spectrum(40, 120, 0.2, seed=4, dtype=torch.float64)
    out = iso_c_matched(x)
    assert gram_calls == [True] and out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), _np_matched(x.numpy()), rtol=0, atol=1e-12)
