"""Iso-C on the numerical range of the mean: the drop-in preset's merge (docs/algorithms.md 3.1).

``iso_c`` sets every singular value of ``g = U diag(s) V^T`` to ``mean(s)``. Where ``g`` is rank
deficient (a layer with dead units, a classifier whose gradient lives in few directions) some
``s_i`` are (numerically) zero: their singular vectors are any orthonormal basis of the null
space, so ``iso_c`` moves the model by ``mean(s)`` along directions the data does not determine
(whatever LAPACK returns). ``iso_c_range`` keeps only the numerical range::

    k = #{i : s_i > rtol * s_1},   rtol = max(m, n) * eps   (numpy's matrix_rank convention)
    iso_c_range(g) = mean(s_1..s_k) * U_k V_k^T

For full-rank ``g`` it is ``iso_c`` (the same computation); ``g = 0`` gives 0. Like ``iso_c``
it is positively homogeneous and ``||iso_c_range(g)||_F <= ||g||_F``. (The Newton-Schulz variant
``iso_c_ns`` already maps zero singular values to zero.)
"""

from __future__ import annotations

import torch

from .polar import thin_svd

__all__ = ["iso_c_range", "numerical_rank"]


def numerical_rank(s: torch.Tensor, shape: tuple[int, ...], rtol: float | None = None) -> int:
    """How many of the (descending) singular values ``s`` exceed ``rtol * s[0]``."""
    if s.numel() == 0 or not float(s[0]) > 0:
        return 0
    tol = max(shape) * torch.finfo(s.dtype).eps if rtol is None else rtol
    return int((s > tol * s[0]).sum())


def iso_c_range(g: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """``mean(s_1..s_k) U_k V_k^T`` of a 2-D tensor, ``k`` its numerical rank (fp32 inside)."""
    if g.ndim != 2:
        raise ValueError(f"iso_c_range needs a 2-D tensor, got shape {tuple(g.shape)}")
    x = g.detach().to(torch.float64 if g.dtype == torch.float64 else torch.float32)
    u, s, vh = thin_svd(x)
    k = numerical_rank(s, tuple(x.shape), rtol)
    if k == 0:
        return torch.zeros_like(g)
    if k == s.numel():
        out = (u * s.mean()) @ vh
    else:
        out = (u[:, :k] * s[:k].mean()) @ vh[:k]
    return out.to(g.dtype)
