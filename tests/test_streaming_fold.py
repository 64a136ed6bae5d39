"""The chunked, in-place fold of :class:`OrderFreeMean` against a whole-tensor reference.

``_Reference`` below is the straightforward implementation of the same formulas (Dekker split
of the scaled weight, fp64 products, Knuth TwoSum into ``hi + lo`` on whole tensors with fresh
temporaries, ``fl((hi + lo) / W)``). The package's ``add`` must give the same ``hi`` and ``lo``
bit for bit (compared as int64 bit patterns, so ``-0`` and ``+0`` differ) for any chunk size.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from flwr_isoloco.merging import streaming
from flwr_isoloco.merging.streaming import OrderFreeMean

torch.set_num_threads(1)


class _Reference:
    """Whole-tensor double-double accumulation (the formulas of OrderFreeMean, no checks)."""

    def __init__(self) -> None:
        self.hi: dict[str, torch.Tensor] = {}
        self.lo: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.weights: list[float] = []
        self.exp: int | None = None

    @staticmethod
    def _two_sum(hi: torch.Tensor, lo: torch.Tensor, t: torch.Tensor) -> None:
        s = hi + t
        bp = s - hi
        err = (hi - (s - bp)).add_(t - bp)
        hi.copy_(s)
        lo.add_(err)

    def add(self, delta: dict[str, torch.Tensor], w: float) -> None:
        if not self.hi:
            for k, t in delta.items():
                self.hi[k] = torch.zeros(t.shape, dtype=torch.float64)
                self.lo[k] = torch.zeros(t.shape, dtype=torch.float64)
                self.dtypes[k] = t.dtype
        if w == 0:
            return
        e = math.frexp(w)[1]
        if self.exp is None:
            self.exp = e
        elif e > self.exp:
            f = math.ldexp(1.0, self.exp - e)
            for k in self.hi:
                self.hi[k].mul_(f)
                self.lo[k].mul_(f)
            self.weights = [math.ldexp(x, self.exp - e) for x in self.weights]
            self.exp = e
        ws = math.ldexp(w, -self.exp)
        self.weights.append(ws)
        c = 134217729.0 * ws
        w_hi = c - (c - ws)
        w_lo = ws - w_hi
        for k, hi in self.hi.items():
            d = delta[k].detach().to(dtype=torch.float64)
            self._two_sum(hi, self.lo[k], d * w_hi)
            if w_lo:
                self._two_sum(hi, self.lo[k], d * w_lo)

    def mean(self, key: str) -> torch.Tensor:
        out = (self.hi[key] + self.lo[key]).div_(math.fsum(self.weights))
        return out if self.dtypes[key] == torch.float64 else out.float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return t.contiguous().view(ints[t.dtype])


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), what


def _deltas(m: int, dtype: torch.dtype, seed: int) -> list[dict[str, torch.Tensor]]:
    """Shapes that are no multiple of any chunk tried, 0-d and empty tensors, a transposed
    (non-contiguous) one, magnitudes over many decades, and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        scale = torch.logspace(-6, 6, 7, dtype=torch.float64)[i % 7].item()
        big = torch.randn(37, 41, generator=g, dtype=torch.float64) * scale
        big[0, :5] = -0.0  # -0 in every delta: TwoSum into +0 must give +0
        big[1, :5] = 0.0 if i % 2 else -0.0
        d = {
            "w": big.to(dtype),
            "wt": (torch.randn(19, 23, generator=g, dtype=torch.float64) * scale).to(dtype).T,
            "v": (torch.randn(1001, generator=g, dtype=torch.float64) * 3.0**i).to(dtype),
            "scalar": torch.tensor(-0.0 if i == 0 else 1.0 / (i + 3), dtype=dtype),
            "empty": torch.zeros(0, dtype=dtype),
            "empty2": torch.zeros(3, 0, dtype=dtype),
        }
        out.append(d)
    return out


WEIGHTS = {
    "ones": [1.0] * 6,  # w_lo == 0, scaled weight a power of two
    "integers": [1024, 3, 77, 1, 512, 9],  # w_lo == 0
    "mixed": [0.1, 1 / 3, 2.5, 1e6 + 0.1, 7.3, 0.7],  # w_lo != 0, a larger exponent later
    "zero-first": [0.0, math.pi, 0.0, math.e, 1e-3, 2.0**60 / 3],  # zeros, a rescale
}


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, streaming.CHUNK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_chunked_fold_is_bitwise_the_whole_tensor_formulas(monkeypatch, chunk, dtype, weights):
    monkeypatch.setattr(streaming, "CHUNK", chunk)
    ws = WEIGHTS[weights]
    deltas = _deltas(len(ws), dtype, seed=chunk)
    order = list(range(len(ws)))
    random.Random(chunk).shuffle(order)
    acc, ref = OrderFreeMean(), _Reference()
    for i in order:
        acc.add(deltas[i], ws[i])
        ref.add(deltas[i], ws[i])
        for k in ref.hi:  # after every add, not only at the end
            _assert_bitwise(acc._hi[k], ref.hi[k], f"hi {k} after worker {i}")
            _assert_bitwise(acc._lo[k], ref.lo[k], f"lo {k} after worker {i}")
    got = acc.result("mean", device="cpu")
    for k in ref.hi:
        _assert_bitwise(acc.mean(k), ref.mean(k), f"mean {k}")
        _assert_bitwise(got[k], ref.mean(k).to(dtype), f"result {k}")
    assert len(acc._buf) == 4 and all(b.numel() <= chunk for b in acc._buf)


@pytest.mark.parametrize("chunk", [5, streaming.CHUNK])
def test_chunked_fold_is_order_free(monkeypatch, chunk):
    monkeypatch.setattr(streaming, "CHUNK", chunk)
    ws = WEIGHTS["mixed"]
    deltas = _deltas(len(ws), torch.float32, seed=3)
    for d in deltas:  # iso_c of a 3 x 0 matrix fails in rules.scaled_apply (aminmax of nothing)
        del d["empty2"]
    results = []
    for seed in range(4):
        order = list(range(len(ws)))
        random.Random(seed).shuffle(order)
        acc = OrderFreeMean()
        for i in order:
            acc.add(deltas[i], ws[i])
        results.append(acc.result("iso_c", device="cpu"))
    for r in results[1:]:
        for k in r:
            _assert_bitwise(r[k], results[0][k], k)


def test_fold_of_a_large_tensor_equals_the_reference_with_one_fp64_scratch_set():
    """Several default-size chunks plus a tail; the scratch is made once per accumulator."""
    g = torch.Generator().manual_seed(7)
    n = 3 * streaming.CHUNK + 12345
    deltas = [{"x": torch.randn(n, generator=g) * 10.0**i} for i in range(-2, 3)]
    ws = [0.3, 1.0, 1e3 / 7, 2.0, 5.0]
    acc, ref = OrderFreeMean(), _Reference()
    bufs = None
    for d, w in zip(deltas, ws, strict=True):
        acc.add(d, w)
        ref.add(d, w)
        bufs = bufs or [b.data_ptr() for b in acc._buf]
        assert [b.data_ptr() for b in acc._buf] == bufs
    _assert_bitwise(acc._hi["x"], ref.hi["x"], "hi")
    _assert_bitwise(acc._lo["x"], ref.lo["x"], "lo")
    _assert_bitwise(acc.mean("x"), ref.mean("x"), "mean")
