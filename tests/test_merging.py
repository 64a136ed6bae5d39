"""Merge rules against independent computations and hand-worked examples; input checks."""

import math

import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, iso_c, merge, polar
from flwr_isoloco.merging.polar import _newton_schulz, ns_coefficients, thin_svd
from flwr_isoloco.merging.rules import prune_smallest
from flwr_isoloco.merging.validation import all_finite
from flwr_isoloco.testing.synthetic import adam_pseudo_gradient, low_rank_plus_noise

torch.set_num_threads(1)
F64 = torch.float64


def _deltas(num=3, seed=0, dtype=F64, shape=(6, 4)):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "layer.w": torch.randn(*shape, generator=g, dtype=dtype),
            "layer.b": torch.randn(shape[1], generator=g, dtype=dtype),
        }
        for _ in range(num)
    ]


def _random_orthogonal(n, seed):
    q, r = torch.linalg.qr(
        torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    )
    return q * torch.sign(torch.diagonal(r))


def _polar_by_eigh(g):
    """Independent polar factor: g (g^T g)^(-1/2) from an eigendecomposition."""
    evals, evecs = torch.linalg.eigh(g.T @ g)
    return g @ (evecs * evals.rsqrt()) @ evecs.T


# ---- mean --------------------------------------------------------------------------------


def test_weighted_mean_equals_weighted_average():
    ds = _deltas()
    w = [1.0, 2.0, 5.0]
    out = merge("mean", ds, w)
    for k in ds[0]:
        expected = sum(wi * d[k] for wi, d in zip(w, ds, strict=True)) / sum(w)
        torch.testing.assert_close(out[k], expected, rtol=0, atol=1e-14)


def test_default_weights_are_uniform_and_zero_weight_ignored():
    ds = _deltas()
    out = merge("mean", ds)
    out0 = merge("mean", ds, [1, 1, 0])
    for k in ds[0]:
        torch.testing.assert_close(out[k], sum(d[k] for d in ds) / 3, rtol=0, atol=1e-14)
        torch.testing.assert_close(out0[k], (ds[0][k] + ds[1][k]) / 2, rtol=0, atol=1e-14)


# ---- identical deltas ---------------------------------------------------------------------


def test_identical_deltas():
    d = _deltas(1)[0]
    ds = [d, {k: v.clone() for k, v in d.items()}, {k: v.clone() for k, v in d.items()}]
    out_mean = merge("mean", ds, [0.2, 0.3, 0.5])
    out_ties = merge("ties", ds, prune_fraction=0.0)
    out_iso = merge("iso_c", ds)
    for k in d:
        torch.testing.assert_close(out_mean[k], d[k], rtol=0, atol=1e-14)
        torch.testing.assert_close(out_ties[k], d[k], rtol=0, atol=1e-14)
    torch.testing.assert_close(out_iso["layer.w"], iso_c(d["layer.w"]), rtol=0, atol=1e-13)
    torch.testing.assert_close(out_iso["layer.b"], d["layer.b"], rtol=0, atol=1e-14)
    # with pruning, ties of identical deltas is the pruned delta
    pruned = merge("ties", ds, prune_fraction=0.5)["layer.w"]
    w = d["layer.w"]
    keep = w.abs() >= w.abs().flatten().sort().values[12]
    torch.testing.assert_close(pruned, torch.where(keep, w, 0.0), rtol=0, atol=1e-14)


# ---- Iso-C -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7, 7), (9, 4), (4, 9)])
def test_iso_c_properties(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    r = min(shape)
    s = torch.linalg.svdvals(g)
    out = iso_c(g)
    s_out = torch.linalg.svdvals(out)
    torch.testing.assert_close(s_out, torch.full((r,), s.mean().item(), dtype=F64))
    torch.testing.assert_close(s_out.sum(), s.sum())  # nuclear norm kept
    torch.testing.assert_close(torch.linalg.matrix_norm(out), s.sum() / math.sqrt(r))
    torch.testing.assert_close(iso_c(3.5 * g), 3.5 * out)  # positive homogeneity
    q, rr = _random_orthogonal(shape[0], 2), _random_orthogonal(shape[1], 3)
    torch.testing.assert_close(iso_c(q @ g @ rr), q @ out @ rr)  # orthogonal equivariance
    # independent route: polar by eigh, mean singular value by <O, g> / r
    o = _polar_by_eigh(g) if shape[0] >= shape[1] else _polar_by_eigh(g.T).T
    torch.testing.assert_close(out, (s.sum() / r) * o)
    torch.testing.assert_close(polar(g), o)


def test_iso_c_zero_and_dtypes():
    assert torch.equal(iso_c(torch.zeros(3, 5)), torch.zeros(3, 5))
    assert torch.equal(iso_c(torch.zeros(3, 5), method="newton_schulz"), torch.zeros(3, 5))
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    ref = iso_c(g.double())
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for method in ("svd", "newton_schulz"):
            out = iso_c(g.to(dt), method=method)
            assert out.dtype == dt
            err = (out.double() - ref).norm() / ref.norm()
            assert err < (2e-2 if dt != torch.float32 else 2e-3), (dt, method, err)


# ---- Newton-Schulz fast mode --------------------------------------------------------------


@pytest.mark.parametrize(
    "make,shape",
    [
        (adam_pseudo_gradient, (96, 96)),
        (adam_pseudo_gradient, (160, 48)),
        (low_rank_plus_noise, (96, 96)),
        (low_rank_plus_noise, (48, 160)),
    ],
)
def test_iso_c_ns_within_one_percent_of_svd(make, shape):
    g = make(*shape)
    exact = iso_c(g)
    fast = iso_c(g, method="newton_schulz")
    err = (torch.linalg.matrix_norm(fast - exact) / torch.linalg.matrix_norm(exact)).item()
    assert err <= 1e-2, err
    # the tuned schedule: one pass (8-9 steps square, 5 rectangular) suffices on these inputs
    _, taken = _newton_schulz(g, None, lower=None, tol=1e-3, max_steps=20)
    assert taken <= (10 if shape[0] == shape[1] else 6), taken
    # and through merge(): the mean of two halves is the same matrix
    out = merge("iso_c_ns", [{"w": 2 * g}, {"w": 0 * g}])["w"]
    assert (torch.linalg.matrix_norm(out - exact) / torch.linalg.matrix_norm(exact)) <= 1e-2


@pytest.mark.parametrize("shape", [(200, 50), (50, 200)])
def test_ns_ill_conditioned_rectangular_continues_after_gram_side_pass(shape):
    # singular values 1 .. 1e-5: below the rectangular first pass's design range (1e-2), and
    # far below what the Gram-side pass resolves in fp32; the explicit passes must finish it.
    g = torch.Generator().manual_seed(2)
    m, n = shape
    u, _ = torch.linalg.qr(torch.randn(m, 50, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, 50, generator=g))
    x = (u * torch.logspace(0, -5, 50)) @ v.T
    exact = iso_c(x.double())
    fast, taken = _newton_schulz(x, None, lower=None, tol=1e-3, max_steps=20)
    fast = fast.double() * (torch.sum(fast.double() * x.double()) / 50)
    assert (fast - exact).norm() / exact.norm() <= 1e-2
    assert taken > 6  # the first pass alone was not enough


def test_thin_svd_falls_back_when_lapack_fails(monkeypatch):
    g = torch.randn(7, 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    real_svd = torch.linalg.svd
    calls = []

    def failing_svd(x, full_matrices=True):
        calls.append(x.dtype)
        raise torch.linalg.LinAlgError("simulated non-convergence")

    monkeypatch.setattr(torch.linalg, "svd", failing_svd)
    for shape in ((7, 4), (4, 7)):
        x = g if shape == (7, 4) else g.T
        u, s, vh = thin_svd(x)
        torch.testing.assert_close((u * s) @ vh, x)  # eigh fallback reconstructs x
        torch.testing.assert_close(s, torch.linalg.svdvals(x))
    assert len(calls) == 4  # fp32/fp64 attempt, then fp64, for each shape
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    out = merge("tsv_m", [{"w": g}, {"w": g}])  # and merge still works with the real one
    assert bool(torch.isfinite(out["w"]).all())


def test_muon_like_few_steps_are_not_enough_but_schedule_is():
    g = low_rank_plus_noise(64, 64, seed=3)
    exact = polar(g.double())
    few = polar(g, method="newton_schulz", steps=2).double()
    many = polar(g, method="newton_schulz").double()
    assert (few - exact).norm() / exact.norm() > 0.1
    assert (many - exact).norm() / exact.norm() < 1e-2


def test_ns_fixed_steps_and_transpose_symmetry():
    g = adam_pseudo_gradient(40, 24, seed=5)
    o, taken = _newton_schulz(g, 4, lower=1e-3, tol=1e-3, max_steps=20)
    assert taken == 4
    o_t, taken_t = _newton_schulz(g.T, 4, lower=1e-3, tol=1e-3, max_steps=20)
    assert taken_t == 4
    torch.testing.assert_close(o_t, o.T)


def test_ns_rank_deficient_is_finite_and_capped():
    g = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    g = g @ torch.randn(8, 30, generator=torch.Generator().manual_seed(1))  # rank 8 of 30
    o, taken = _newton_schulz(g, None, lower=None, tol=1e-3, max_steps=20)
    assert taken <= 20 and bool(torch.isfinite(o).all())
    # on the row space of g, O is still the polar factor (null-space directions are arbitrary)
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    u8, v8 = u[:, :8], vh[:8]
    torch.testing.assert_close(u8.T @ o.double() @ v8.T, torch.eye(8, dtype=F64), atol=1e-2, rtol=0)


def test_ns_schedule_maps_design_interval_to_one():
    """Compose the scalar quintics: every x in [lower, 1] must end within 1e-6 of 1."""
    lower = 1e-3
    x = torch.cat(
        [torch.logspace(-3, 0, 2000, dtype=F64), torch.linspace(lower, 1, 2000, dtype=F64)]
    )
    for a, b, c in ns_coefficients(lower):
        assert float(x.max()) <= 2.5  # stays where the quintic is bounded
        x = a * x + b * x**3 + c * x**5
    assert float((x - 1).abs().max()) <= 1e-6
    # below the design interval the schedule is monotone: nothing flips sign
    y = torch.logspace(-8, -3, 50, dtype=F64)
    for a, b, c in ns_coefficients(lower):
        y = a * y + b * y**3 + c * y**5
    assert bool((y > 0).all()) and bool((y[1:] >= y[:-1]).all())


# ---- TIES, DARE, TSV-M, Iso-CTS -----------------------------------------------------------


def test_ties_hand_worked():
    # prune_fraction 1/3 of 6 entries: each worker drops its 2 smallest |entries|.
    d1 = torch.tensor([[3.0, -1.0, 0.5], [2.0, 0.1, -4.0]])
    d2 = torch.tensor([[-2.0, -3.0, 1.0], [0.2, 0.3, 5.0]])
    d3 = torch.tensor([[1.0, 2.0, -0.4], [-1.0, 0.05, -2.0]])
    # kept:   d1 -> [[3, -1, 0], [2, 0, -4]]; d2 -> [[-2, -3, 1], [0, 0, 5]];
    #         d3 -> [[1, 2, 0], [-1, 0, -2]]
    # sums:   [[2, -2, 1], [1, 0, -1]] -> elected signs [[+, -, +], [+, 0, -]]
    # agree:  (0,0): 3, 1 -> 2 ; (0,1): -1, -3 -> -2 ; (0,2): 1 -> 1 ;
    #         (1,0): 2 -> 2 ; (1,1): none -> 0 ; (1,2): -4, -2 -> -3
    expected = torch.tensor([[2.0, -2.0, 1.0], [2.0, 0.0, -3.0]])
    out = merge("ties", [{"w": d1}, {"w": d2}, {"w": d3}], prune_fraction=1 / 3)
    torch.testing.assert_close(out["w"], expected)
    # weighted: weights (1, 1, 2) -> (0,0): (3*1 + 1*2) / 3
    out_w = merge("ties", [{"w": d1}, {"w": d2}, {"w": d3}], [1, 1, 2], prune_fraction=1 / 3)
    assert out_w["w"][0, 0].item() == pytest.approx(5 / 3)


def test_prune_ties_lower_index_first_and_all_finite_overflow():
    d = torch.tensor([1.0, -1.0, 1.0, 2.0])
    assert torch.equal(prune_smallest(d, 0.5), torch.tensor([0.0, 0.0, 1.0, 2.0]))
    assert torch.equal(prune_smallest(d, 0.0), d)
    big = torch.full((4,), 3e38)  # finite, but the sum overflows: must still count as finite
    assert all_finite(big) and not all_finite(torch.tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([1.0, float("-inf")], dtype=torch.float16))


def test_dare_seeded_and_unbiased():
    ds = _deltas(4, dtype=torch.float32, shape=(64, 32))
    a = merge("dare", ds, drop_rate=0.3, seed=7)
    b = merge("dare", ds, drop_rate=0.3, seed=7)
    c = merge("dare", ds, drop_rate=0.3, seed=8)
    reordered = merge("dare", [dict(reversed(list(d.items()))) for d in ds], drop_rate=0.3, seed=7)
    assert torch.equal(a["layer.w"], b["layer.w"]) and torch.equal(
        a["layer.w"], reordered["layer.w"]
    )
    assert not torch.equal(a["layer.w"], c["layer.w"])
    mean = merge("mean", ds)
    assert torch.equal(a["layer.b"], mean["layer.b"])  # 1-D tensors take the mean
    torch.testing.assert_close(merge("dare", ds, drop_rate=0.0)["layer.w"], mean["layer.w"])
    # one worker of ones: survivors are 1/(1-p), the kept fraction is 1-p (4 sigma, n=4096)
    ones = {"w": torch.ones(64, 64)}
    out = merge("dare", [ones], drop_rate=0.3, seed=1)["w"]
    survivors = out[out != 0]
    torch.testing.assert_close(survivors, torch.full_like(survivors, 1 / 0.7))
    kept = (out != 0).float().mean().item()
    assert abs(kept - 0.7) < 4 * math.sqrt(0.7 * 0.3 / 4096)


def test_tsv_m_hand_worked():
    # two rank-1 deltas whose directions are not orthogonal; polar of the stack is hand-computable
    a, b = 0.3, 0.5
    u1, u2 = torch.tensor([math.cos(a), math.sin(a)]), torch.tensor([math.cos(a), -math.sin(a)])
    v1, v2 = torch.tensor([math.cos(b), math.sin(b)]), torch.tensor([math.cos(b), -math.sin(b)])
    d1, d2 = 4.0 * torch.outer(u1, v1), 2.0 * torch.outer(u2, v2)
    h = torch.tensor([[1.0, 1.0], [1.0, -1.0]]) / math.sqrt(2)  # polar([x1, x2]) for this pattern
    # weights 1/2 each: singular values 2 and 1, kept; U and V replaced by their polar factors
    expected = h @ torch.diag(torch.tensor([2.0, 1.0])) @ h.T
    out = merge("tsv_m", [{"w": d1}, {"w": d2}])["w"]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_iso_cts_hand_worked_and_reduces_to_iso_c():
    n = 8
    e = torch.eye(n, dtype=F64)
    f = _random_orthogonal(n, 9)
    common = sum(c * torch.outer(e[i], f[i]) for i, c in enumerate([8.0, 7.0, 6.0, 5.0]))
    d1 = common + 0.8 * torch.outer(e[4], f[4]) + 0.6 * torch.outer(e[5], f[5])
    d2 = common + 0.4 * torch.outer(e[6], f[6]) + 0.2 * torch.outer(e[7], f[7])
    # common_fraction 0.5: k = 4 common (mean: 8, 7, 6, 5); per worker s = (8 - 4) / 2 = 2
    # directions of w_i d_i outside the common space: (0.4, 0.3) and (0.2, 0.1)
    out = merge("iso_cts", [{"w": d1}, {"w": d2}], common_fraction=0.5)["w"]
    sigma = (8 + 7 + 6 + 5 + 0.4 + 0.3 + 0.2 + 0.1) / 8
    torch.testing.assert_close(out, sigma * e @ f[:n], rtol=1e-10, atol=1e-10)
    ds = _deltas(2)
    full = merge("iso_cts", ds, common_fraction=1.0)["layer.w"]
    torch.testing.assert_close(full, iso_c(merge("mean", ds)["layer.w"]))


@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
def test_zero_weight_worker_takes_no_part(rule):
    ds = _deltas(3)
    out = merge(rule, ds, [1.0, 0.0, 2.0])
    ref = merge(rule, [ds[0], ds[2]], [1.0, 2.0])
    for k in ref:
        torch.testing.assert_close(out[k], ref[k])


@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
def test_every_rule_keeps_shapes_dtypes_and_means_non_2d(rule):
    ds = _deltas(3, dtype=torch.bfloat16, shape=(12, 8))
    out = merge(rule, ds, [1, 2, 3])
    mean = merge("mean", ds, [1, 2, 3])
    for k in ds[0]:
        assert out[k].dtype == torch.bfloat16 and out[k].shape == ds[0][k].shape
        assert bool(torch.isfinite(out[k]).all())
    assert torch.equal(out["layer.b"], mean["layer.b"])


@pytest.mark.parametrize("rule", ["iso_c", "ties", "tsv_m"])
def test_spectral_pattern_selects_tensors(rule):
    ds = [{**d, "embed.w": d["layer.w"].clone()} for d in _deltas(3)]
    out = merge(rule, ds, spectral_pattern=r"^layer\.")
    full = merge(rule, ds)
    mean = merge("mean", ds)
    assert torch.equal(out["layer.w"], full["layer.w"])
    assert torch.equal(out["embed.w"], mean["embed.w"])
    assert not torch.allclose(out["layer.w"], mean["layer.w"])


# ---- streaming ----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["mean", "iso_c", "iso_c_ns"])
def test_streaming_equals_merge(rule):
    ds = _deltas(5, dtype=torch.float32)
    w = [1.0, 0.5, 2.0, 0.0, 3.0]
    sm = StreamingMerger(rule)
    for d, wi in zip(ds, w, strict=True):
        sm.add(d, wi)
    out, ref = sm.result(), merge(rule, ds, w)
    for k in ref:
        # same arithmetic up to where the weights are normalised (fp32 round-off)
        tol = 1e-4 if rule == "iso_c_ns" else 1e-6
        torch.testing.assert_close(out[k], ref[k], rtol=tol, atol=tol)
    assert sm.num_added == 5 and sm.total_weight == pytest.approx(6.5)


def test_streaming_holds_one_model_copy_and_survives_bad_adds():
    ds = _deltas(4, dtype=torch.float32)
    sm = StreamingMerger("mean")
    sm.add(ds[0])
    with pytest.raises(ValueError, match=r"worker 1, key 'layer.w': shape \(3, 4\) != \(6, 4\)"):
        sm.add({"layer.w": torch.zeros(3, 4), "layer.b": torch.zeros(4)})
    with pytest.raises(ValueError, match="worker 1, key 'layer.b': non-finite"):
        sm.add({"layer.w": torch.zeros(6, 4), "layer.b": torch.tensor([0.0, float("inf"), 0, 0])})
    with pytest.raises(ValueError, match="worker 1: weight -1"):
        sm.add(ds[1], -1.0)
    for d in ds[1:]:
        sm.add(d)
    model_bytes = sum(t.numel() * 4 for t in ds[0].values())
    assert sum(t.numel() * t.element_size() for t in sm._mean.values()) == model_bytes
    ref = merge("mean", ds)
    for k in ref:
        torch.testing.assert_close(sm.result()[k], ref[k])


def test_streaming_rejects_non_streaming_rules_and_empty():
    for rule in ("ties", "dare", "tsv_m", "iso_cts"):
        assert not MERGE_RULES[rule].streaming
        with pytest.raises(ValueError, match="needs every worker"):
            StreamingMerger(rule)
    with pytest.raises(ValueError, match="no deltas"):
        StreamingMerger("mean").result()
    sm = StreamingMerger("iso_c")
    sm.add(_deltas(1)[0], 0.0)
    with pytest.raises(ValueError, match="all zero"):
        sm.result()


# ---- bad input ----------------------------------------------------------------------------


def _bad_cases():
    good = _deltas(3, dtype=torch.float32)
    w = good[0]["layer.w"]
    return [
        ([], None, "empty"),
        ([good[0], {"layer.w": w}], None, "worker 1, key 'layer.b': missing"),
        ([good[0], good[1], {**good[2], "x": w}], None, "worker 2, key 'x': unexpected"),
        (
            [good[0], {**good[1], "layer.w": torch.zeros(4, 5)}],
            None,
            r"worker 1, key 'layer.w': shape \(4, 5\) != \(6, 4\)",
        ),
        (
            [good[0], {**good[1], "layer.w": w.clone().fill_(float("nan"))}],
            None,
            "worker 1, key 'layer.w': non-finite",
        ),
        (
            [good[0], {**good[1], "layer.b": [1.0, 2.0]}],
            None,
            "worker 1, key 'layer.b': expected a torch.Tensor",
        ),
        (
            [good[0], {**good[1], "layer.b": torch.ones(4, dtype=torch.int64)}],
            None,
            "worker 1, key 'layer.b': dtype",
        ),
        (good, [1.0, -2.0, 1.0], "worker 1: weight -2.0 is negative"),
        (good, [0.0, 0.0, 0.0], "all zero"),
        (good, [1.0, float("inf"), 1.0], "worker 1: weight inf is not finite"),
        (good, [1.0, 1.0], "2 weights for 3 workers"),
        (good[0], None, "sequence"),
        ([good[0], "nope"], None, "worker 1: delta must be a dict"),
    ]


@pytest.mark.parametrize("rule", ["mean", "iso_c", "ties"])
@pytest.mark.parametrize("case", range(13))
def test_bad_input_raises_naming_worker_and_key(rule, case):
    deltas, weights, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=match):
        merge(rule, deltas, weights)


@pytest.mark.parametrize(
    "rule,options,match",
    [
        ("nope", {}, "unknown merge rule 'nope'"),
        ("mean", {"prune_fraction": 0.1}, "unknown option 'prune_fraction' for merge rule 'mean'"),
        ("ties", {"prune_fraction": 1.5}, r"prune_fraction=1.5 must be in \[0, 1\)"),
        ("dare", {"drop_rate": 1.0}, "drop_rate=1.0"),
        ("dare", {"seed": -1}, "seed=-1"),
        ("iso_cts", {"common_fraction": 0.0}, "common_fraction=0.0"),
        ("iso_c_ns", {"ns_steps": 0}, "ns_steps=0"),
        ("iso_c", {"spectral_pattern": "("}, "spectral_pattern"),
    ],
)
def test_bad_rule_or_options(rule, options, match):
    with pytest.raises(ValueError, match=match):
        merge(rule, _deltas(2), **options)


def test_polar_and_iso_c_reject_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        iso_c(torch.ones(3))
    with pytest.raises(ValueError, match="method"):
        polar(torch.ones(3, 3), method="qr")
    with pytest.raises(ValueError, match="newton_schulz"):
        iso_c(torch.ones(3, 3), steps=3)


def test_ns_steps_beyond_the_schedule_keep_converging():
    # ns_steps longer than the schedule continues with classic (15, -10, 3)/8 steps: converged
    # singular values stay at 1 and the error never grows (a restarted aggressive schedule
    # would throw them to ~1.7 and the result off by O(1)).
    from flwr_isoloco.merging.polar import NS_LOWER_SQUARE

    g = torch.randn(48, 48, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    exact = iso_c(g)
    n = len(ns_coefficients(NS_LOWER_SQUARE))
    errs = [
        float((merge("iso_c_ns", [{"w": g}], ns_steps=k)["w"] - exact).norm() / exact.norm())
        for k in range(n, n + 5)
    ]
    assert all(b <= a * 1.01 + 1e-12 for a, b in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] < 1e-2, errs


@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
def test_an_empty_matrix_takes_the_mean_under_every_rule(rule):
    """A 3 x 0 tensor has no spectrum: every rule returns it (empty) instead of failing."""
    deltas = [{"e": torch.zeros(3, 0), "v": torch.full((2,), float(i))} for i in range(3)]
    out = merge(rule, deltas)
    assert out["e"].shape == (3, 0) and out["e"].dtype == torch.float32
    assert torch.isfinite(out["v"]).all()
