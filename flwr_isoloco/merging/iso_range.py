"""Iso-C on the numerical range of the mean, at the mean's norm: the drop-in preset's merge.

The measurements behind both changes to ``iso_c``: the repository's ``docs/algorithms.md``
("Algorithms"), 3.1.

``iso_c`` sets every singular value of ``g = U diag(s) V^T`` to ``mean(s)``. Where ``g`` is rank
deficient (a layer with dead units, a classifier whose gradient lives in few directions) some
``s_i`` are (numerically) zero: their singular vectors are any orthonormal basis of the null
space, so ``iso_c`` moves the model by ``mean(s)`` along directions the data does not determine
(whatever LAPACK returns). ``iso_c_range`` keeps only the numerical range::

    k = #{i : s_i > rtol * s_1},   rtol = max(m, n) * eps   (numpy's matrix_rank convention)
    iso_c_range(g) = mean(s_1..s_k) * U_k V_k^T

For full-rank ``g`` it is ``iso_c`` (the same computation: at clear full rank, every
``s_i > 2 rtol s_1``, both take the Gram route of ``polar.gram_polar`` where it is accepted,
else the thin SVD); ``g = 0`` gives 0. Like ``iso_c``
it is positively homogeneous and ``||iso_c_range(g)||_F = mean(s_1..s_k) sqrt(k) <= ||g||_F``.
(The Newton-Schulz variant ``iso_c_ns`` already maps zero singular values to zero.)

That shrinkage is why the paper needs ``outer_lr = 1.8``: Iso-C's step on a matrix is shorter
than the mean's, but the same lr also drives the tensors that take the plain mean (biases,
norms, conv kernels), where 1.8 is beyond the outer step's stability limit once local
training converges within a round. ``iso_c_matched`` keeps Iso-C's direction at the mean's own
Frobenius norm, so one lr means the same step size on every tensor::

    iso_c_matched(g) = ||g||_F / sqrt(k) * U_k V_k^T

(``||.||_F = ||g||_F``, spectral norm ``||g||_F / sqrt(k) <= s_1 = ||g||_2``).

That raises a direction of ``g`` by ``||g||_F / (sqrt(k) s_i)``, without bound: measured on
label-skewed shards (the repository's ``benchmarks/dropin/label_skew.py``; the repository's
``docs/algorithms.md``, 3.2) the smallest singular directions of the mean were raised
100-2000 x (a classifier's numerically rank-2 but truly rank-1 pseudo-gradient: 62,000 x,
half the step into round-off), and the drop-in collapsed to the majority class. The
``"dropin"`` merge is therefore Iso-C with a bounded gain ``kappa = max_gain``
(default :data:`MAX_GAIN`)::

    g = U diag(s) V^T,   s'_i = min(t, kappa s_i),   t > 0 such that sum s'_i^2 = sum s_i^2
    iso_c_matched(g) = U diag(s') V^T

(:func:`capped_spectrum`): the top of the spectrum is flattened to the level ``t``, no
direction is raised by more than ``kappa`` (``s'_i / s_i <= kappa``, so a (near-)null direction
stays (near-)null and no rank threshold is needed), and ``||.||_F = ||g||_F``. ``kappa = 1`` is
the mean itself; ``kappa -> inf`` is the uncapped form above (``max_gain=None``, kept as it was).
"""

from __future__ import annotations

import math

import torch

from .polar import gram_polar, sym_product, thin_svd

__all__ = ["MAX_GAIN", "capped_level", "capped_spectrum", "iso_c_matched", "iso_c_range"]
__all__ += ["numerical_rank"]

#: The ``"dropin"`` merge's bound on the gain of any singular direction (docs/algorithms.md 3.2).
MAX_GAIN = 2.0


def numerical_rank(s: torch.Tensor, shape: tuple[int, ...], rtol: float | None = None) -> int:
    """How many of the (descending) singular values ``s`` exceed ``rtol * s[0]``."""
    if s.numel() == 0 or not float(s[0]) > 0:
        return 0
    tol = max(shape) * torch.finfo(s.dtype).eps if rtol is None else rtol
    return int((s > tol * s[0]).sum())


def _range_svd(g: torch.Tensor, rtol: float | None, what: str):
    if g.ndim != 2:
        raise ValueError(f"{what} needs a 2-D tensor, got shape {tuple(g.shape)}")
    x = g.detach().to(torch.float64 if g.dtype == torch.float64 else torch.float32)
    u, s, vh = thin_svd(x)
    return u, s, vh, numerical_rank(s, tuple(x.shape), rtol)


def _full_rank_gram(g: torch.Tensor, rtol: float | None, scale: str) -> torch.Tensor | None:
    """``c U V^T`` by :func:`~.polar.gram_polar` where it is accepted *and* every singular value
    is above twice the rank threshold (so ``k = r`` beyond doubt: the fp32 SVD's singular values
    are accurate to about ``eps * s_1``, far inside that margin); None otherwise (the SVD)."""
    if g.ndim != 2 or not g.is_floating_point():
        return None
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    tol = max(g.shape) * torch.finfo(dtype).eps if rtol is None else rtol
    out = gram_polar(g, scale=scale, min_rel_sv=2 * tol)
    return None if out is None else out.to(g.dtype)


def iso_c_range(g: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """``mean(s_1..s_k) U_k V_k^T`` of a 2-D tensor, ``k`` its numerical rank (fp32 inside).

    At clear full rank (and where :func:`~.polar.gram_polar` is accepted) this is Iso-C by the
    Gram eigendecomposition, ``iso_c(g, method="gram")``; otherwise the thin SVD."""
    out = _full_rank_gram(g, rtol, "mean")
    if out is not None:
        return out
    u, s, vh, k = _range_svd(g, rtol, "iso_c_range")
    if k == 0:
        return torch.zeros_like(g)
    if k == s.numel():
        out = (u * s.mean()) @ vh
    else:
        out = (u[:, :k] * s[:k].mean()) @ vh[:k]
    return out.to(g.dtype)


def capped_level(s: torch.Tensor, max_gain: float) -> torch.Tensor:
    """The level ``t`` with ``sum_i min(t, kappa s_i)^2 = sum_i s_i^2`` (``s >= 0``, any order,
    not all 0; ``kappa = max_gain >= 1``).

    With ``a = kappa s`` sorted descending, ``t`` lies in ``[a_{j+1}, a_j]`` for the smallest
    ``j`` whose ``t_j = sqrt((sum s^2 - sum_{i>j} a_i^2) / j)`` is at least ``a_{j+1}``
    (``a_{r+1} = 0``; ``j = r`` always qualifies as ``kappa >= 1``)."""
    a = (max_gain * s.double()).sort(descending=True).values
    total = s.double().square().sum()
    tail = a.square().flip(0).cumsum(0).flip(0)  # tail[i] = sum_{l >= i} a_l^2
    after = torch.cat([tail[1:], tail.new_zeros(1)])  # sum_{l > j} a_l^2, j = 1..r
    level = ((total - after).clamp_min(0) / torch.arange(1, len(a) + 1, dtype=a.dtype)).sqrt()
    nxt = torch.cat([a[1:], a.new_zeros(1)])
    j = int(torch.nonzero(level >= nxt * (1 - 1e-12))[0])
    return level[j]


def capped_spectrum(g: torch.Tensor, max_gain: float = MAX_GAIN) -> torch.Tensor:
    """``U diag(min(t, kappa s)) V^T`` of a 2-D tensor, ``t`` from :func:`capped_level`.

    Computed as ``W y`` with ``y`` the wide orientation of ``g``, ``y y^T = Q diag(s^2) Q^T``
    (fp64 eigendecomposition) and ``W = Q diag(min(t / s, kappa)) Q^T``: every factor is at most
    ``kappa``, so no small singular value is inverted and any rank is fine. Returned in ``g``'s
    dtype (fp32 or fp64 inside)."""
    if g.ndim != 2:
        raise ValueError(f"iso_c_matched needs a 2-D tensor, got shape {tuple(g.shape)}")
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.detach().to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    if y.numel() == 0 or not bool(y.abs().amax() > 0):
        return torch.zeros_like(g)
    lam, q = torch.linalg.eigh(sym_product(y))
    s = lam.clamp_min(0).sqrt()
    t = capped_level(s, max_gain)
    gain = torch.where(s > 0, t / s.clamp_min(torch.finfo(s.dtype).tiny), max_gain)
    w = sym_product(q * gain.clamp(max=max_gain).sqrt())
    out = y.T @ w if tall else w @ y
    return out.to(dtype).to(g.dtype).contiguous()


def iso_c_matched(
    g: torch.Tensor, rtol: float | None = None, max_gain: float | None = MAX_GAIN
) -> torch.Tensor:
    """The ``"dropin"`` merge of a 2-D tensor (module docstring; fp32 or fp64 inside).

    ``max_gain`` a number ``kappa >= 1`` (default :data:`MAX_GAIN`): :func:`capped_spectrum`,
    no singular direction raised by more than ``kappa``, at the mean's Frobenius norm (``rtol``
    is not used). ``max_gain=None``: the uncapped form ``||g||_F / sqrt(k) * U_k V_k^T`` on the
    numerical range (at clear full rank, and where :func:`~.polar.gram_polar` is accepted,
    ``sqrt(mean(s^2)) G^(-1/2) g`` by the Gram eigendecomposition; otherwise the thin SVD)."""
    if max_gain is not None:
        return capped_spectrum(g, max_gain)
    out = _full_rank_gram(g, rtol, "rms")
    if out is not None:
        return out
    u, s, vh, k = _range_svd(g, rtol, "iso_c_matched")
    if k == 0:
        return torch.zeros_like(g)
    scale = torch.linalg.vector_norm(s) / math.sqrt(k)
    return ((u[:, :k] * scale) @ vh[:k]).to(g.dtype)
