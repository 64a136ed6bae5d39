"""The fast exact paths of the merge: Gram-eigh Iso-C / polar, chunked TIES, the device option.

Each is checked against an independent computation: the fp64 (and fp32) SVD for the Gram path,
the dense TIES of the previous implementation (written out below) for the chunked one, and the
default device for ``device="cpu"``.
"""

import importlib
import math

import pytest
import torch

from flwr_isoloco.merging import MERGE_RULES, StreamingMerger, iso_c, merge, polar, resolve_device
from flwr_isoloco.merging import rules as rules_mod
from flwr_isoloco.merging.polar import GRAM_COND_FP32, GRAM_COND_FP64, gram_polar
from flwr_isoloco.merging.rules import prune_smallest, ties_kept_count
from flwr_isoloco.testing.synthetic import adam_pseudo_gradient, llama_delta

polar_mod = importlib.import_module("flwr_isoloco.merging.polar")  # the module, not polar()
torch.set_num_threads(1)
F64 = torch.float64


def _rel(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


def _with_kappa(m, n, kappa, seed, cluster=False):
    """fp32 ``U diag(s) V^T`` with ``s_max / s_min = kappa`` (log-spaced, or 10% at 1/kappa)."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=F64))
    if cluster:
        s = torch.ones(r, dtype=F64)
        s[-max(1, r // 10) :] = 1 / kappa
    else:
        s = torch.logspace(0, -math.log10(kappa), r, dtype=F64)
    return ((u * s) @ v.T * 1e-3).float()


def _svd_iso_c(x):
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return (u * s.mean()) @ vh


@pytest.fixture
def route(monkeypatch):
    """Records (working dtype, accepted) for each Gram attempt."""
    calls = []
    real = polar_mod._gram_apply

    def spy(x, work, *args):
        out = real(x, work, *args)
        calls.append((work, out is not None))
        return out

    monkeypatch.setattr(polar_mod, "_gram_apply", spy)
    return calls


# ---- Gram-eigh Iso-C and polar ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 128), (128, 48)])
@pytest.mark.parametrize(
    ("kappa", "expected"),
    [
        (3.0, [(torch.float32, True)]),  # kappa^2 = 9 <= GRAM_COND_FP32
        (100.0, [(torch.float32, False), (torch.float64, True)]),  # 1e4: fp64
        (1e6, [(torch.float32, False), (torch.float64, False)]),  # 1e12: SVD
    ],
)
@pytest.mark.parametrize("cluster", [False, True])
def test_gram_iso_c_branches_and_accuracy(route, shape, kappa, expected, cluster):
    assert GRAM_COND_FP32 < 3.0**2 * 100 and 100.0**2 < GRAM_COND_FP64 < 1e12
    x = _with_kappa(*shape, kappa, seed=int(kappa), cluster=cluster)
    out = iso_c(x, method="gram")
    assert route == expected
    assert out.dtype == torch.float32 and out.shape == x.shape
    exact = _svd_iso_c(x.double())
    svd32 = iso_c(x, method="svd")
    if expected[-1][1]:  # a Gram branch was taken
        assert _rel(out, exact) <= 1e-5
        assert _rel(out, svd32) <= max(1e-5, 2 * _rel(svd32, exact))
        o = polar(x, method="gram")
        assert (
            _rel(
                o,
                torch.linalg.svd(x.double(), full_matrices=False)[0]
                @ torch.linalg.svd(x.double(), full_matrices=False)[2],
            )
            <= 1e-5
        )
    else:  # the SVD itself, bit for bit
        assert torch.equal(out, svd32)


def test_gram_square_rank_deficient_and_zero_go_to_the_svd(route):
    gen = torch.Generator().manual_seed(0)
    square = torch.randn(40, 40, generator=gen)
    assert gram_polar(square) is None and route == []  # near-square: no attempt
    assert torch.equal(iso_c(square, method="gram"), iso_c(square, method="svd"))
    low = torch.randn(20, 3, generator=gen) @ torch.randn(3, 64, generator=gen)  # rank 3
    assert gram_polar(low, scale="mean") is None
    assert torch.equal(iso_c(low, method="gram"), iso_c(low, method="svd"))
    zero = torch.zeros(8, 32)
    assert gram_polar(zero) is None
    assert torch.equal(iso_c(zero, method="gram"), torch.zeros(8, 32))


def test_gram_realistic_pseudo_gradients_within_1e5_of_the_svd():
    """The benchmark's inputs (mean of correlated Gaussian deltas) and Adam pseudo-gradients."""
    shapes = {"mlp": (96, 256), "kv": (32, 96), "emb": (2048, 96), "down": (96, 256)}
    deltas = [llama_delta(shapes, i) for i in range(8)]
    mean = merge("mean", deltas)
    cases = [*mean.values(), adam_pseudo_gradient(64, 200, seed=3), adam_pseudo_gradient(300, 90)]
    for g in cases:
        exact, svd32 = _svd_iso_c(g.double()), iso_c(g, method="svd")
        fast = iso_c(g, method="gram")
        assert _rel(fast, exact) <= 1e-5
        assert _rel(fast, svd32) <= 1e-5
        assert _rel(polar(g, method="gram"), polar(g.double())) <= 1e-5
    # the rule: the Gram path, within 1e-5 of the SVD rule on every matrix
    merged = merge("iso_c", deltas)
    for k, g in mean.items():
        assert _rel(merged[k], iso_c(g, method="svd")) <= 1e-5


def test_gram_fp64_input_stays_near_fp64_exact(route):
    x = _with_kappa(30, 90, 20.0, seed=1).double()
    out = iso_c(x, method="gram")
    assert route == [(torch.float64, True)] and out.dtype == F64
    assert _rel(out, _svd_iso_c(x)) <= 1e-12
    route.clear()
    iso_c(_with_kappa(30, 90, 1e3, seed=1).double(), method="gram")  # kappa^2 = 1e6 > 1e4
    assert route == [(torch.float64, False)]


def test_gram_rejects_bad_scale_and_non_finite():
    with pytest.raises(ValueError, match="scale must be"):
        gram_polar(torch.ones(2, 8), scale="max")
    x = torch.randn(4, 16)
    x[0, 0] = float("inf")
    assert gram_polar(x) is None


# ---- chunked TIES against the dense implementation ---------------------------------------


def _dense_prune(d, fraction):
    """The dense pruning the chunked one replaced (same tie rule: lower index zeroed first)."""
    count = d.numel() - ties_kept_count(d.numel(), fraction)
    if count <= 0:
        return d
    mag = d.abs().flatten()
    threshold = torch.kthvalue(mag, count).values
    prune = mag < threshold
    ties = torch.nonzero(mag == threshold).flatten()
    prune[ties[: count - int(prune.sum())]] = True
    return torch.where(prune.view_as(d), 0.0, d)


def _dense_ties(deltas, weights, fraction):
    kept = torch.stack([_dense_prune(d, fraction) for d in deltas])
    w = torch.tensor(weights, dtype=kept.dtype).view(-1, *[1] * (kept.ndim - 1))
    elected = torch.sign((w * kept).sum(0))
    agree = (torch.sign(kept) == elected) & (elected != 0)
    num = (w * kept * agree).sum(0)
    den = (w * agree).sum(0)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
@pytest.mark.parametrize("num", [1, 3, 8])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("kind", ["gaussian", "ties"])
def test_chunked_ties_equals_dense(monkeypatch, chunk, num, fraction, kind):
    monkeypatch.setattr(rules_mod, "TIES_CHUNK", chunk)
    gen = torch.Generator().manual_seed(num * 100 + int(10 * fraction))
    shape = (13, 29)
    if kind == "ties":  # small integers: many equal magnitudes and zeros, across chunk borders
        ds = [torch.randint(-3, 4, shape, generator=gen).float() for _ in range(num)]
    else:
        ds = [torch.randn(shape, generator=gen) for _ in range(num)]
    w = (torch.rand(num, generator=gen, dtype=F64) + 0.1).tolist()
    total = sum(w)
    w = [x / total for x in w]
    for d in ds:
        assert torch.equal(prune_smallest(d, fraction), _dense_prune(d, fraction))
    got = rules_mod._ties(ds, w, prune_fraction=fraction)
    torch.testing.assert_close(got, _dense_ties(ds, w, fraction), rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(rules_mod, "TIES_CHUNK", 1 << 20)
    assert torch.equal(got, rules_mod._ties(ds, w, prune_fraction=fraction))  # chunk-independent
    via_merge = merge("ties", [{"w": d} for d in ds], w, prune_fraction=fraction)["w"]
    torch.testing.assert_close(via_merge, got, rtol=1e-6, atol=1e-7)  # weights renormalised


def test_chunked_ties_never_holds_more_than_a_chunk_per_worker(monkeypatch):
    monkeypatch.setattr(rules_mod, "TIES_CHUNK", 100)
    sizes = []
    real = rules_mod._pruned_slice

    def spy(flat, rule, start):
        sizes.append(flat.numel())
        return real(flat, rule, start)

    monkeypatch.setattr(rules_mod, "_pruned_slice", spy)
    ds = [torch.randn(50, 40) for _ in range(6)]
    rules_mod._ties(ds, [1 / 6] * 6, prune_fraction=0.2)
    assert len(sizes) == 6 * 20 and max(sizes) == 100


# ---- device option -----------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only resolution")
def test_resolve_device_on_a_cpu_only_machine():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" AUTO ") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match="torch.cuda.is_available"):
            resolve_device(bad)
    for bad in ("tpu", "gpu", "", 3, "meta"):
        with pytest.raises(ValueError, match="merge device"):
            resolve_device(bad)


@pytest.mark.parametrize("rule", sorted(MERGE_RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, F64])
def test_device_cpu_equals_default_bitwise_and_returns_cpu_input_dtype(rule, dtype):
    gen = torch.Generator().manual_seed(7)
    ds = [
        {"a.w": torch.randn(12, 30, generator=gen).to(dtype), "a.b": torch.randn(5).to(dtype)}
        for _ in range(3)
    ]
    w = [1.0, 2.0, 0.5]
    default = merge(rule, ds, w)
    for option in ("cpu", "auto", None, torch.device("cpu")):
        got = merge(rule, ds, w, device=option)
        for k, t in got.items():
            assert t.device.type == "cpu" and t.dtype == dtype
            assert torch.equal(t, default[k])


def test_merge_rejects_a_bad_device_before_any_work():
    with pytest.raises(ValueError, match="merge device 'tpu'"):
        merge("mean", [{"w": torch.ones(2)}], device="tpu")


def test_streaming_rules_in_merge_equal_the_streaming_merger():
    """merge() takes the streaming rules' transform on the mean, as StreamingMerger does."""
    shapes = {"w": (24, 80), "b": (24,)}
    ds = [llama_delta(shapes, i) for i in range(4)]
    for rule in ("iso_c", "iso_c_ns"):
        sm = StreamingMerger(rule)
        for d in ds:
            sm.add(d)
        torch.testing.assert_close(sm.result()["w"], merge(rule, ds)["w"], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("rule", ["tsv_m", "iso_cts"])
def test_tsv_m_and_iso_cts_polar_factors_by_gram_equal_the_svd_ones(monkeypatch, rule):
    shapes = {"up": (256, 64), "down": (64, 256), "sq": (48, 48)}
    ds = [llama_delta(shapes, i) for i in range(4)]
    fast = merge(rule, ds)
    monkeypatch.setattr(rules_mod, "gram_polar", lambda x, scale="none": None)  # SVD only
    svd = merge(rule, ds)
    for k in shapes:
        assert _rel(fast[k], svd[k]) <= 1e-5
    assert torch.equal(fast["sq"], svd["sq"])  # near-square: the SVD in both


@pytest.mark.parametrize(("m", "n"), [(100, 40), (300, 70), (577, 30)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sym_product_is_b_bt(m, n, dtype):
    gen = torch.Generator().manual_seed(m)
    b = torch.randn(m, n, generator=gen, dtype=F64)
    out = polar_mod.sym_product(b.to(dtype))
    assert out.dtype == dtype and out.shape == (m, m)
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    assert _rel(out, b @ b.T) <= tol
    assert _rel(polar_mod.sym_product(b.T.to(dtype)), b.T @ b) <= tol  # transposed view input


def test_gram_tall_and_wide_results_are_contiguous_and_transposes():
    x = _with_kappa(40, 130, 3.0, seed=5)
    wide, tall = gram_polar(x, scale="mean"), gram_polar(x.T.contiguous(), scale="mean")
    assert wide.is_contiguous() and tall.is_contiguous()
    assert _rel(tall.T, wide) <= 1e-6
    rms = gram_polar(x, scale="rms")
    s = torch.linalg.svdvals(x.double())
    assert _rel(rms, wide * float(s.square().mean().sqrt() / s.mean())) <= 1e-6
