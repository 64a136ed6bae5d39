"""Iso-C on the numerical range of the mean, at the mean's norm: the drop-in preset's merge.

https://github.com/flwr-isoloco/flwr-isoloco/blob/main/docs/algorithms.md 3.1 gives the measurements behind both changes to ``iso_c``.

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
"""

from __future__ import annotations

import math

import torch

from .polar import gram_polar, thin_svd

__all__ = ["iso_c_matched", "iso_c_range", "numerical_rank"]


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


def iso_c_matched(g: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """``||g||_F / sqrt(k) * U_k V_k^T`` of a 2-D tensor (module docstring; fp32 inside).

    At clear full rank (and where :func:`~.polar.gram_polar` is accepted): ``sqrt(mean(s^2))
    G^(-1/2) g`` by the Gram eigendecomposition; otherwise the thin SVD."""
    out = _full_rank_gram(g, rtol, "rms")
    if out is not None:
        return out
    u, s, vh, k = _range_svd(g, rtol, "iso_c_matched")
    if k == 0:
        return torch.zeros_like(g)
    scale = torch.linalg.vector_norm(s) / math.sqrt(k)
    return ((u[:, :k] * scale) @ vh[:k]).to(g.dtype)
