"""Streaming merge for rules that only need the weighted mean (mean, iso_c, iso_c_ns).

A server folds each worker's delta into one running weighted mean (fp32, fp64 for fp64 input) as
its reply arrives, so the extra memory is one model copy (plus one tensor's temporaries when
finishing), whatever the number of workers M: ``result = transform(sum_i w_i d_i / sum_i w_i)``
per tensor.

Overflow. Raw weights (e.g. ``num-examples``) can be huge, and deltas can hold finite values near
the fp32 maximum. The accumulator is therefore the running *mean*, a convex combination that is
never larger than the largest delta entry, and the weights are kept relative to the largest weight
seen so far: with ``u_i = w_i / w_max`` and ``U_j = sum_{i<=j} u_i``, adding worker j does
``mean <- mean * (U_{j-1} / U_j) + d_j * (u_j / U_j)``; a new largest weight first rescales
``U <- U * w_max_old / w_max_new``. Both factors are in ``[0, 1]``, ``U <= M``, and nothing
overflows for any finite weights.

Arrival order. :class:`OrderFreeMean` is the accumulator of a server round that folds replies
as they arrive: its result does not depend on the order of the ``add`` calls (module-level
note at the class).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping

import torch

from .device import resolve_device
from .rules import MergeRule, check_options, resolve_rule, rule_applies, scaled_apply
from .validation import check_delta, check_weight

__all__ = ["OrderFreeMean", "StreamingMerger"]

_SPLIT = 134217729.0  # 2**27 + 1: Dekker's split of a float64 into two 26-bit halves


class StreamingMerger:
    """``add(delta, weight)`` one worker at a time, then ``result()``.

    A bad delta or weight raises ``ValueError`` (naming the worker index, i.e. the number of
    earlier ``add`` calls, and the key) and leaves the running mean untouched, so the caller can
    drop that reply and go on. The result equals :func:`~flwr_isoloco.merging.merge` of the same
    deltas and weights (up to fp32 round-off).
    """

    def __init__(self, rule: str | MergeRule, **options) -> None:
        self.rule = resolve_rule(rule)
        if not self.rule.streaming:
            raise ValueError(
                f"merge rule {self.rule.name!r} needs every worker's delta at once; use merge()"
            )
        self._options, self._pattern = check_options(self.rule, options)
        self._mean: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, torch.Size] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.num_added = 0
        self._max_weight = 0.0  # largest weight added so far
        self._rel_total = 0.0  # sum of the weights added so far, divided by _max_weight

    @property
    def total_weight(self) -> float:
        """Sum of the weights added (``inf`` if that sum exceeds the float64 range)."""
        return self._rel_total * self._max_weight

    def add(self, delta: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """Fold ``delta`` with ``weight`` into the running weighted mean (after checking it)."""
        worker = self.num_added
        w = check_weight(weight, worker)
        check_delta(delta, worker, self._shapes)
        if self._shapes is None:
            self._shapes = {k: t.shape for k, t in delta.items()}
            self._dtypes = {k: t.dtype for k, t in delta.items()}
            self._mean = {
                k: torch.zeros_like(
                    t, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32
                )
                for k, t in delta.items()
            }
        self.num_added += 1
        if w == 0:
            return
        if w > self._max_weight:
            self._rel_total *= self._max_weight / w
            self._max_weight = w
        u = w / self._max_weight
        new_total = self._rel_total + u
        keep, take = self._rel_total / new_total, u / new_total
        for k, acc in self._mean.items():
            d = delta[k].detach().to(device=acc.device, dtype=acc.dtype)
            if keep == 0:
                acc.copy_(d)
            else:
                acc.mul_(keep).add_(d, alpha=take)
        self._rel_total = new_total

    def result(self) -> dict[str, torch.Tensor]:
        """The merged delta, each tensor in the dtype of the first delta's tensor."""
        if self.num_added == 0:
            raise ValueError("no deltas added: nothing to merge")
        if not self._rel_total > 0:
            raise ValueError("weights are all zero")
        out: dict[str, torch.Tensor] = {}
        for k, mean in self._mean.items():
            if self.rule.name != "mean" and rule_applies(k, mean, self._pattern):
                merged = scaled_apply(lambda x: self.rule.transform(x[0], **self._options), [mean])
            else:
                merged = mean.clone()
            out[k] = merged.to(self._dtypes[k])
        return out


#: Entries per pass of :class:`OrderFreeMean`: the fp64 scratch (4 x 256 KiB) and the matching
#: slices of ``hi`` and ``lo`` stay in cache through the ~10 elementwise steps of a fold. Not above
#: torch's intra-op grain (32768 entries), so each step runs in the calling thread: with more
#: torch threads, a parallel region per step and chunk cost more than it gained (measured).
CHUNK = 1 << 15


def _two_sum_into(hi: torch.Tensor, lo: torch.Tensor, p: torch.Tensor, s, b) -> None:
    """``hi + lo <- hi + lo + p`` by Knuth's error-free TwoSum, in place on fp64 chunks:
    ``s = fl(hi + p)``, ``b = s - hi``, ``err = (hi - (s - b)) + (p - b)`` (exactly
    ``hi + p - s``), ``lo <- fl(lo + err)``, ``hi <- s``. ``s`` and ``b`` are scratch of the same
    length; ``p`` is overwritten."""
    torch.add(hi, p, out=s)
    torch.sub(s, hi, out=b)
    p.sub_(b)  # p - b
    torch.sub(s, b, out=b)  # s - b
    hi.sub_(b).add_(p)  # err = (hi - (s - b)) + (p - b)
    lo.add_(hi)
    hi.copy_(s)


class OrderFreeMean:
    """Weighted mean ``sum_i w_i d_i / sum_i w_i`` whose result is independent of arrival order.

    Each tensor keeps a double-double accumulator ``hi + lo`` (two fp64 tensors). A weight is
    split exactly as ``w = w_hi + w_lo`` (Dekker, 26 bits each), so ``w_hi * d`` and ``w_lo * d``
    are exact in fp64 for an fp32 ``d`` (26 + 24 bits); each exact term enters ``hi + lo`` by
    TwoSum, which loses nothing but the rounding of ``lo`` (about ``M * 2**-106`` of the sum).
    ``hi + lo`` is therefore the exact sum to ~106 bits in any order, and the fp32 result
    (``(hi + lo) / W``, ``W = fsum(w_i)``, rounded to fp32) is the same bits for every order
    unless the exact sum lies within ~``2**-100`` of a rounding boundary. The weights are scaled
    by a power of two so that the largest seen so far is in [0.5, 1) (the accumulators are
    rescaled when a larger one comes): a weight near the float64 maximum cannot overflow the
    products, and scaling by a power of two is exact, so it changes no bit (unless weights
    more than ~2**900 apart push the smaller terms into fp64's subnormal range).

    Speed: every step is elementwise, so ``add`` runs over each tensor in slices of
    :data:`CHUNK` entries with four preallocated fp64 scratch buffers, all in place: the same
    operations on the same values as whole-tensor arithmetic (bit for bit), with the working set
    in cache and no tensor-sized temporaries. The first positive weight only writes
    ``hi = 0 + w_hi d`` (TwoSum into zeros leaves ``lo = +0``).

    ``add(delta, weight)`` checks like :class:`StreamingMerger` (``ValueError`` naming the
    worker and key, accumulator untouched). ``result(rule, options)`` applies a streaming rule's
    transform to the mean (``mean``: none). Memory: 4 x the fp32 size of one delta, plus
    ``4 x CHUNK`` fp64 entries.
    """

    def __init__(self) -> None:
        self._hi: dict[str, torch.Tensor] = {}
        self._lo: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, torch.Size] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._weights: list[float] = []  # scaled by 2**-_exp
        self._exp: int | None = None
        self._buf: list[torch.Tensor] = []  # fp64 scratch, CHUNK entries at most
        self.num_added = 0

    @property
    def total_weight(self) -> float:
        """``sum_i w_i`` (correctly rounded, order-free)."""
        return math.ldexp(math.fsum(self._weights), self._exp or 0)

    def add(self, delta: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """Fold ``delta`` with ``weight`` (checked first; a bad one raises ``ValueError``)."""
        worker = self.num_added
        w = check_weight(weight, worker)
        check_delta(delta, worker, self._shapes)
        if self._shapes is None:
            self._shapes = {k: t.shape for k, t in delta.items()}
            self._dtypes = {k: t.dtype for k, t in delta.items()}
            for k, t in delta.items():
                self._hi[k] = torch.zeros(t.shape, dtype=torch.float64)
                self._lo[k] = torch.zeros(t.shape, dtype=torch.float64)
        self.num_added += 1
        if w == 0:
            return
        e = math.frexp(w)[1]
        if self._exp is None:
            self._exp = e
        elif e > self._exp:  # keep every scaled weight <= 1: the products cannot overflow
            shift = self._exp - e
            for k in self._hi:
                self._hi[k].mul_(math.ldexp(1.0, shift))
                self._lo[k].mul_(math.ldexp(1.0, shift))
            self._weights = [math.ldexp(x, shift) for x in self._weights]
            self._exp = e
        ws = math.ldexp(w, -self._exp)
        first = not self._weights  # hi and lo hold +0 everywhere until the first positive weight
        self._weights.append(ws)
        c = _SPLIT * ws
        w_hi = c - (c - ws)
        w_lo = ws - w_hi
        for k, hi in self._hi.items():
            x = delta[k].detach().to(device="cpu").reshape(-1)
            self._fold(x, hi.view(-1), self._lo[k].view(-1), w_hi, w_lo, first)

    def _scratch(self) -> list[torch.Tensor]:
        if not self._buf:
            size = min(CHUNK, max(t.numel() for t in self._hi.values()))
            self._buf = [torch.empty(size, dtype=torch.float64) for _ in range(4)]
        return self._buf

    def _fold(self, x, hi, lo, w_hi: float, w_lo: float, first: bool) -> None:
        """``hi + lo <- hi + lo + w_hi x + w_lo x`` (flat tensors), one chunk at a time."""
        d_buf, p_buf, s_buf, b_buf = self._scratch()
        for a in range(0, x.numel(), CHUNK):
            m = min(CHUNK, x.numel() - a)
            h, lo_c, p, s, b = hi[a : a + m], lo[a : a + m], p_buf[:m], s_buf[:m], b_buf[:m]
            xc = x[a : a + m]
            d = xc if xc.dtype == torch.float64 else d_buf[:m].copy_(xc)  # exact cast
            if first:  # TwoSum into +0: hi = fl(0 + p) (-0 becomes +0), err = lo = +0
                torch.mul(d, w_hi, out=h).add_(0.0)
            else:
                _two_sum_into(h, lo_c, torch.mul(d, w_hi, out=p), s, b)
            if w_lo:
                _two_sum_into(h, lo_c, torch.mul(d, w_lo, out=p), s, b)

    def mean(self, key: str) -> torch.Tensor:
        """The weighted mean of one tensor, in fp32 (fp64 for fp64 input): ``fl((hi + lo) / W)``
        in fp64, then rounded to the output dtype, chunk by chunk (no fp64 temporary)."""
        total = math.fsum(self._weights)
        hi, lo = self._hi[key].view(-1), self._lo[key].view(-1)
        out_dtype = torch.float64 if self._dtypes[key] == torch.float64 else torch.float32
        out = torch.empty(self._hi[key].shape, dtype=out_dtype)
        flat, s_buf = out.view(-1), self._scratch()[2]
        for a in range(0, hi.numel(), CHUNK):
            m = min(CHUNK, hi.numel() - a)
            dst = flat[a : a + m]
            s = dst if out_dtype == torch.float64 else s_buf[:m]
            torch.add(hi[a : a + m], lo[a : a + m], out=s).div_(total)
            if s is not dst:
                dst.copy_(s)
        return out

    def result(
        self,
        rule: str | MergeRule = "mean",
        device: str | torch.device | None = "auto",
        perturb: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        plain: Container[str] = (),
        **options,
    ) -> dict[str, torch.Tensor]:
        """``transform(mean)`` per tensor (2-D tensors the rule applies to), else the mean.

        ``perturb(key, mean)``, when given, replaces each mean before the transform (the DP
        release, :class:`~flwr_isoloco.merging.dp.GaussianSum`). Keys in ``plain`` (buffers,
        :mod:`.buffers`) are the mean (perturbed as the rest), never transformed.

        The transform runs on ``device`` (:func:`~flwr_isoloco.merging.device.resolve_device`:
        ``"auto"`` is CUDA where available), one tensor at a time; results are CPU tensors."""
        dev = resolve_device(device)
        if self.num_added == 0:
            raise ValueError("no deltas added: nothing to merge")
        if not self._weights:
            raise ValueError("weights are all zero")
        rule = resolve_rule(rule)
        if not rule.streaming:
            raise ValueError(f"merge rule {rule.name!r} is not a function of the mean")
        opts, pattern = check_options(rule, options)
        out: dict[str, torch.Tensor] = {}
        for k in list(self._hi):
            mean = self.mean(k)
            if perturb is not None:
                mean = perturb(k, mean)
            if rule.name != "mean" and k not in plain and rule_applies(k, mean, pattern):
                mean = scaled_apply(lambda x: rule.transform(x[0], **opts), [mean.to(dev)])
            out[k] = mean.to(device="cpu", dtype=self._dtypes[k])
        return out

    def release(self) -> None:
        """Free the accumulators."""
        self._hi, self._lo, self._buf = {}, {}, []
