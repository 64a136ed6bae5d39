"""Huge weights and huge (finite) delta entries: no overflow, no crash, same result as scaled.

Issue 8, B1: ``merge("ties", [{"w": torch.ones(3, 2)}] * 2, weights=[1e308, 1e308])`` raised
IndexError (the float64 sum of the weights was inf, every normalised weight 0); raw weights such
as ``num-examples`` = 3.5e38 overflowed the fp32 running sum of ``StreamingMerger``.
"""

import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, merge

torch.set_num_threads(1)
F32, F64 = torch.float32, torch.float64
STREAMING = [name for name, rule in MERGE_RULES.items() if rule.streaming]

# raw weights -> the same weights normalised by hand
HUGE_WEIGHTS = [
    ([1e308, 1e308], [0.5, 0.5]),
    ([1e300, 1.0], [1.0, 1e-300]),
    ([1.0, 1e300], [1e-300, 1.0]),  # the larger weight second: the accumulator is rescaled
    ([3.5e38, 1.0], [1.0, 1 / 3.5e38]),
    ([1.0, 3.5e38], [1 / 3.5e38, 1.0]),
    ([1e38, 2e38], [1 / 3, 2 / 3]),
]


def _deltas(num=2, seed=0, shape=(6, 4), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "layer.w": torch.randn(*shape, generator=g) * scale,
            "layer.b": torch.randn(shape[1], generator=g) * scale,
        }
        for _ in range(num)
    ]


def _close(a, b, tol=1e-6):
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol)


def test_b1_reproducer_every_rule():
    for rule in MERGE_RULES:
        out = merge(rule, [{"w": torch.ones(3, 2)}] * 2, weights=[1e308, 1e308])["w"]
        ref = merge(rule, [{"w": torch.ones(3, 2)}] * 2, weights=[1.0, 1.0])["w"]
        assert torch.equal(out, ref), rule


@pytest.mark.parametrize("raw,norm", HUGE_WEIGHTS)
@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
def test_merge_huge_weights_equal_normalised(rule, raw, norm):
    ds = _deltas()
    _close(merge(rule, ds, raw), merge(rule, ds, norm))


@pytest.mark.parametrize("raw,norm", HUGE_WEIGHTS)
@pytest.mark.parametrize("rule", STREAMING)
def test_streaming_huge_raw_weights_equal_merge(rule, raw, norm):
    ds = _deltas()
    sm = StreamingMerger(rule)
    for d, w in zip(ds, raw, strict=True):
        sm.add(d, w)
    tol = 1e-4 if rule == "iso_c_ns" else 1e-6
    _close(sm.result(), merge(rule, ds, norm), tol)


def test_streaming_zero_weight_first_then_positive():
    ds = _deltas(3)
    sm = StreamingMerger("mean")
    sm.add(ds[0], 0.0)
    sm.add(ds[1], 5e37)
    sm.add(ds[2], 0.0)
    out = sm.result()
    for k in ds[1]:
        assert torch.equal(out[k], ds[1][k])
    assert sm.total_weight == 5e37 and sm.num_added == 3


@pytest.mark.parametrize(
    "bad,match",
    [
        ([1.0, -2.0], "worker 1: weight -2.0 is negative"),
        ([float("nan"), 1.0], "worker 0: weight nan is not finite"),
        ([1.0, float("inf")], "worker 1: weight inf is not finite"),
        ([0.0, 0.0], "weights are all zero"),
    ],
)
@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
def test_only_non_finite_negative_or_all_zero_weights_are_errors(rule, bad, match):
    with pytest.raises(ValueError, match=match):
        merge(rule, _deltas(), bad)


# ---- entries near the fp32 maximum --------------------------------------------------------


def _near_max(num, seed=0):
    """num workers, 4 x 3 and 3, entries +-3.4e38 (fp32 max is 3.4028e38), random signs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        sign = torch.randint(0, 2, (4, 3), generator=g) * 2.0 - 1
        out.append({"w": sign * 3.4e38, "b": torch.full((3,), -3.4e38)})
    return out


def test_weighted_mean_of_near_max_values_never_overflows():
    ds = _near_max(4)
    raw = [1e30, 3e38, 1.0, 7.0]
    total = sum(raw)
    expected = {
        k: sum(w / total * d[k].double() for w, d in zip(raw, ds, strict=True)) for k in ds[0]
    }
    sm = StreamingMerger("mean")
    for d, w in zip(ds, raw, strict=True):
        sm.add(d, w)
    for out in (sm.result(), merge("mean", ds, raw)):
        for k in ds[0]:
            assert bool(torch.isfinite(out[k]).all()), k
            torch.testing.assert_close(out[k].double(), expected[k], rtol=1e-6, atol=1e32)
    # every rule's fallback for non-2-D tensors (the mean) is finite too
    for rule in MERGE_RULES:
        torch.testing.assert_close(merge(rule, ds, raw)["b"], torch.full((3,), -3.4e38))


@pytest.mark.parametrize("rule", ["iso_c", "iso_c_ns", "iso_cts", "tsv_m", "ties", "dare"])
@pytest.mark.parametrize("scale", [5e37, 1e30, 1e-30])
def test_every_rule_exact_on_huge_or_tiny_entries(rule, scale):
    # Frobenius norm of each 8 x 6 delta ~ 7 * scale: beyond fp32 at 5e37; Newton-Schulz's
    # sum of squares over/underflows at 1e30 / 1e-30. fp32 result vs the fp64 computation.
    ds = [{"w": d["layer.w"]} for d in _deltas(2, seed=3, shape=(8, 6), scale=scale)]
    out = merge(rule, ds)["w"]
    ref = merge(rule, [{"w": d["w"].double()} for d in ds])["w"]
    assert bool(torch.isfinite(out).all())
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < (1e-4 if rule == "iso_c_ns" else 1e-5), err


def test_iso_c_whose_true_value_exceeds_fp32_is_inf():
    # ||d||_F = 7.3e38 > fp32 max; singular values 6e38, 4.24e38 (fp64). Iso-C raises the
    # smaller one to the mean 5.12e38, entries up to 3.62e38: not representable in fp32 -> inf
    # (before: nan from the overflowing SVD). tsv_m of one worker gives d back, finite.
    d = torch.tensor([[3e38, -3e38], [3e38, 3e38], [-3e38, 3e38]])
    ref = merge("iso_c", [{"w": d.double()}])["w"]
    assert float(ref.abs().max()) == pytest.approx(3.6213e38, rel=1e-4)
    for rule in ("iso_c", "iso_c_ns"):
        out = merge(rule, [{"w": d}])["w"]
        assert bool(torch.isinf(out).any()) and not bool(torch.isnan(out).any()), rule
    torch.testing.assert_close(merge("tsv_m", [{"w": d}])["w"], d)
