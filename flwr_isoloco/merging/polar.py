"""Polar factor and Iso-C of one 2-D tensor: exact (SVD, or the small Gram matrix's
eigendecomposition where that is provably as accurate: :func:`gram_polar`) and fast
(Newton-Schulz).

For ``g = U diag(s) V^T`` (thin SVD, ``r = min(m, n)``):

- ``polar(g) = U V^T``;
- ``iso_c(g) = mean(s) * U V^T`` (Marczak et al. 2025): all singular values equal, nuclear norm
  kept, ``||iso_c(g)||_F = ||g||_* / sqrt(r)``.

Fast mode. With ``O ~= U V^T`` from Newton-Schulz, ``mean(s) = <U V^T, g>_F / r``, so
``iso_c(g) ~= (<O, g>_F / r) * O``. Each Newton-Schulz step maps ``X <- p(X)`` for an odd
quintic ``p(x) = a x + b x^3 + c x^5`` applied to the singular values, computed on the small
side as ``X <- (a I + b A + c A^2) X`` with ``A = X X^T``. Unlike Muon's fixed coefficients
(singular values end in about [0.7, 1.2]), the coefficients here follow the "Polar Express"
recipe (Amsel et al. 2025): step k uses the minimax quintic for the interval ``[l_k, u_k]``
that the previous steps left the singular values in, so the schedule starts aggressive and ends
in the classic ``(15, -10, 3) / 8`` iteration, which converges to exactly 1. See
the repository's ``docs/merging.md`` ("Merge rules and the outer optimiser") for the measured accuracy and speed.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "iso_c",
    "polar",
    "thin_svd",
    "gram_polar",
    "sym_product",
    "GRAM_COND_FP32",
    "GRAM_COND_FP64",
    "GRAM_COND_FP64_INPUT",
    "GRAM_MIN_ASPECT",
    "newton_schulz_polar",
    "ns_coefficients",
    "NS_LOWER",
    "NS_LOWER_SQUARE",
    "NS_LOWER_RECT",
    "NS_TOL",
    "NS_MAX_STEPS",
]

#: Smallest singular value (relative to the bound on the largest) that the first pass of the
#: schedule is designed for, by shape: square-ish matrices (long side < 2 x short side) have
#: singular values down to ~0 (quarter-circle law), clearly rectangular ones are far better
#: conditioned (Marchenko-Pastur). ``lower=None`` picks by shape; later passes use
#: ``NS_LOWER_RECT``.
NS_LOWER_SQUARE = 1e-4
NS_LOWER_RECT = 1e-2
NS_LOWER = None
#: Early stop once the RMS deviation of the singular values from 1 is below this.
NS_TOL = 1e-3
#: Hard cap on Newton-Schulz steps when ``steps`` is not given.
NS_MAX_STEPS = 20
#: Coefficients are designed for inputs up to ``_SAFETY * u`` so fp32 round-off cannot push a
#: singular value past the interval where the quintic is bounded (Polar Express uses 1.01).
_SAFETY = 1.01


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def thin_svd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.svd(x, full_matrices=False)`` that does not give up.

    LAPACK's divide-and-conquer can fail to converge on matrices with many repeated singular
    values (e.g. stacked, nearly duplicate singular vectors in TSV-M / Iso-CTS); a merge must not
    crash a run for that. Fallbacks: the SVD in fp64, then the eigendecomposition of the small
    Gram matrix (``s = sqrt(eig)``, ``U = X V / s`` where ``s > 0``). Returned in ``x``'s dtype.
    """
    try:
        return torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError:
        pass
    x64 = x.double()
    try:
        u, s, vh = torch.linalg.svd(x64, full_matrices=False)
    except torch.linalg.LinAlgError:
        wide = x64.shape[0] < x64.shape[1]
        y = x64.T if wide else x64  # tall: Gram on the small (column) side
        evals, v = torch.linalg.eigh(y.T @ y)
        evals, v = evals.flip(0), v.flip(1)
        s = evals.clamp_min(0).sqrt()
        inv = torch.where(s > s[0] * 1e-12, 1 / s, torch.zeros_like(s))
        u = (y @ v) * inv
        u, vh = (v, u.T) if wide else (u, v.T)
    return u.to(x.dtype), s.to(x.dtype), vh.to(x.dtype)


#: Largest ``lambda_max / lambda_min`` (= ``kappa^2`` of the matrix) of the Gram matrix for which
#: :func:`gram_polar` trusts an fp32 eigendecomposition: its relative (Frobenius) error is about
#: ``5e-8 kappa^2`` (measured, the repository's ``docs/merging.md`` ("Merge rules and the outer optimiser")), so <= ~5e-6 here.
GRAM_COND_FP32 = 1e2
#: The same bound for the fp64 eigendecomposition of an fp32 input: error about
#: ``1e-16 kappa^2``, so <= ~1e-7 here; beyond it, the SVD.
GRAM_COND_FP64 = 1e9
#: The bound for an fp64 input (fp64 arithmetic only): error <= ~1e-12, near the fp64 SVD's.
GRAM_COND_FP64_INPUT = 1e4
#: The Gram path is used where the long side is at least this many times the short one. Near-square
#: matrices are rarely well conditioned (smallest singular values near 0), so the fp32 attempt
#: would mostly be wasted, and at 576 x 576 the fp64 eigendecomposition is no faster than the fp32
#: SVD (measured, the repository's ``docs/merging.md`` ("Merge rules and the outer optimiser")): they take the SVD at once.
GRAM_MIN_ASPECT = 2.0


def sym_product(b: torch.Tensor) -> torch.Tensor:
    """``b @ b.T`` from its block upper triangle, the lower blocks mirrored.

    With the rows of ``b`` in ``k`` blocks, only the ``k (k + 1) / 2`` products ``b_i b_j^T``
    (``j >= i``) are formed: ``(k + 1) / (2 k)`` of the flops of one product (62% at k = 4).
    ``k = min(4, rows // 128)``: one product below 256 rows, where smaller products lose more
    to overhead than they save.
    """
    m = b.shape[0]
    k = min(4, m // 128)
    if k <= 1:
        return b @ b.T
    size = -(-m // k)
    out = torch.empty(m, m, dtype=b.dtype, device=b.device)
    for i in range(0, m, size):
        blk = b[i : i + size] @ b[i:].T  # block row i, from the diagonal block on
        out[i : i + size, i:] = blk
        out[i + size :, i : i + size] = blk[:, size:].T
    return out


#: Scales of :func:`gram_polar`: ``c`` as a function of the singular values ``s`` (r of them).
_GRAM_SCALES = {
    "none": lambda s: 1.0,
    "mean": lambda s: s.mean(),  # Iso-C
    "rms": lambda s: s.square().mean().sqrt(),  # ||g||_F / sqrt(r): iso_c_matched at full rank
}


def gram_polar(
    x: torch.Tensor, scale: str = "none", min_rel_sv: float = 0.0
) -> torch.Tensor | None:
    """``c * U V^T`` of a 2-D tensor from the eigendecomposition of its small Gram matrix, or None.

    With ``y`` the wide orientation of ``x`` (``m <= n``), ``G = y y^T = Q diag(lam) Q^T`` and
    ``s = sqrt(lam)``: ``c U V^T = c G^(-1/2) y = (B B^T) y`` with ``B = Q diag(sqrt(c / s))``,
    one ``m x m`` eigh and three products (``y y^T`` and ``B B^T`` by :func:`sym_product`) instead
    of a thin SVD. ``scale``: ``"none"`` the polar factor (``c = 1``), ``"mean"`` Iso-C
    (``c = mean(s)``), ``"rms"`` ``c = sqrt(mean(s^2)) = ||x||_F / sqrt(r)``. Squaring the
    condition number costs accuracy, so the result is only returned for ``n >= GRAM_MIN_ASPECT * m``
    and where ``lam_max / lam_min`` (all ``lam > 0``) is at most ``GRAM_COND_FP32`` with fp32
    arithmetic (fp32 input), else at most ``GRAM_COND_FP64`` with fp64 arithmetic
    (``GRAM_COND_FP64_INPUT`` for fp64 input), and where ``s_min > min_rel_sv * s_max`` (a
    caller that needs full numerical rank says so here); otherwise (near-square, rank-deficient,
    too ill-conditioned, non-finite) None: the caller uses the SVD. Returned in the compute dtype
    of ``x``, contiguous, in ``x``'s orientation.
    """
    _check_matrix(x)
    if scale not in _GRAM_SCALES:
        raise ValueError(f"scale must be one of {sorted(_GRAM_SCALES)}, got {scale!r}")
    dtype = _compute_dtype(x.dtype)
    x = x.detach().to(dtype)
    m, n = sorted(x.shape)
    if m == 0 or n < GRAM_MIN_ASPECT * m:
        return None
    tries = [(torch.float64, GRAM_COND_FP64 if dtype == torch.float32 else GRAM_COND_FP64_INPUT)]
    if dtype == torch.float32:
        tries.insert(0, (torch.float32, GRAM_COND_FP32))
    for work, bound in tries:
        out = _gram_apply(x, work, bound, scale, min_rel_sv)
        if out is not None:
            return out.to(dtype)
    return None


def _gram_apply(
    x: torch.Tensor, work: torch.dtype, bound: float, scale: str, min_rel_sv: float = 0.0
) -> torch.Tensor | None:
    """:func:`gram_polar` in one working dtype; None where ``G`` fails the bound.

    Wide ``x`` (m x n): ``W x`` with ``W = B B^T = c G^(-1/2)``; tall ``x``: ``x W`` with
    ``G = x^T x`` (``W`` is symmetric), so the result comes out contiguous in ``x``'s
    orientation."""
    xw = x.to(work)
    tall = xw.shape[0] > xw.shape[1]
    try:
        lam, q = torch.linalg.eigh(sym_product(xw.T if tall else xw))
    except torch.linalg.LinAlgError:  # non-finite Gram matrix
        return None
    lo, hi = float(lam[0]), float(lam[-1])
    if not (math.isfinite(hi) and lo > 0 and hi <= bound * lo and lo > min_rel_sv**2 * hi):
        return None
    s = lam.sqrt()
    w = sym_product(q * (_GRAM_SCALES[scale](s) / s).sqrt())
    return xw @ w if tall else w @ xw


def _check_matrix(g: torch.Tensor) -> None:
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(g).__name__}")
    if g.ndim != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(g.shape)}")
    if not g.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got dtype {g.dtype}")


def _minimax_quintic(lo: float, hi: float) -> tuple[float, float, float, float]:
    """Odd quintic ``p`` minimising ``max |1 - p(x)|`` on ``[lo, hi]`` (Remez exchange).

    Returns ``(a, b, c, E)``: ``p(x) = a x + b x^3 + c x^5`` equioscillates between ``1 - E`` and
    ``1 + E`` at ``lo``, two interior extrema and ``hi``.
    """
    x1, x2 = lo + 0.25 * (hi - lo), lo + 0.75 * (hi - lo)
    a = b = c = err = 0.0
    for _ in range(200):
        pts = (lo, x1, x2, hi)
        mat = torch.tensor(
            [[x, x**3, x**5, (-1.0) ** j] for j, x in enumerate(pts)], dtype=torch.float64
        )
        a, b, c, err = torch.linalg.solve(mat, torch.ones(4, dtype=torch.float64)).tolist()
        disc = 9 * b * b - 20 * a * c
        if c <= 0 or disc <= 0:  # degenerate: fall back to the classic converging quintic
            return 15 / 8, -10 / 8, 3 / 8, 0.0
        y1 = (-3 * b - math.sqrt(disc)) / (10 * c)
        y2 = (-3 * b + math.sqrt(disc)) / (10 * c)
        n1, n2 = math.sqrt(max(y1, 0.0)), math.sqrt(max(y2, 0.0))
        if not (lo < n1 < n2 < hi):
            return 15 / 8, -10 / 8, 3 / 8, 0.0
        done = abs(n1 - x1) <= 1e-14 * hi and abs(n2 - x2) <= 1e-14 * hi
        x1, x2 = n1, n2
        if done:
            break
    return a, b, c, abs(err)


@functools.lru_cache(maxsize=64)
def ns_coefficients(
    lower: float = NS_LOWER_SQUARE, tol: float = 1e-7
) -> tuple[tuple[float, ...], ...]:
    """Per-step quintic coefficients ``(a, b, c)`` taking ``[lower, 1]`` to within ``tol`` of 1.

    Step k is the minimax quintic on the interval ``[l_k, u_k]`` the previous steps produce
    (``l_0 = lower, u_0 = 1``), evaluated at ``x / 1.01`` for round-off safety; the next
    interval is ``[p(l_k), 1 + E_k]``. Once the interval is within 1e-3 of 1, the classic
    ``(15, -10, 3) / 8`` step (``p(1) = 1``, ``p'(1) = p''(1) = 0``) finishes.
    """
    if not 0 < lower < 1:
        raise ValueError(f"lower must be in (0, 1), got {lower!r}")
    steps: list[tuple[float, float, float]] = []
    lo, hi = lower, 1.0
    while len(steps) < 50:
        if hi - lo <= 2e-3:
            a, b, c = 15 / 8, -10 / 8, 3 / 8
            steps.append((a, b, c))
            p_lo, p_hi = (a * x + b * x**3 + c * x**5 for x in (lo, hi))
            lo, hi = min(p_lo, p_hi, 1.0), max(p_lo, p_hi, 1.0)
        else:
            a, b, c, err = _minimax_quintic(lo, hi)
            s = _SAFETY
            a, b, c = a / s, b / s**3, c / s**5
            steps.append((a, b, c))
            lo, hi = a * lo + b * lo**3 + c * lo**5, 1.0 + err
        if max(1.0 - lo, hi - 1.0) <= tol:
            break
    return tuple(steps)


def newton_schulz_polar(
    g: torch.Tensor,
    steps: int | None = None,
    *,
    lower: float | None = NS_LOWER,
    tol: float = NS_TOL,
    max_steps: int = NS_MAX_STEPS,
) -> torch.Tensor:
    """``U V^T`` of a 2-D tensor by Newton-Schulz, in fp32 (fp64 for fp64 input).

    ``steps=None``: run the schedule of :func:`ns_coefficients` for ``lower`` (``None``: by
    shape, see ``NS_LOWER_SQUARE``/``NS_LOWER_RECT``), then, if singular values below ``lower``
    are still unconverged, passes of the ``NS_LOWER_RECT`` schedule (values left below
    ``lower`` are >= 1e-2 after one pass if they started >= 1e-2 * lower), until the RMS of ``s_i - 1`` over the
    singular values is at most ``tol`` (checked for free from the Gram matrix each step), at
    most ``max_steps`` steps (whole passes only). ``steps=k``: exactly k steps, no early stop:
    the schedule, then classic ``(15, -10, 3) / 8`` steps if k is longer.
    The input is scaled by ``||(X X^T)^2||_F^(1/4) >= s_max`` (of ``X = g / ||g||_F``), a
    bound much tighter than the Frobenius norm, which saves one or two steps.
    """
    return _newton_schulz(g, steps, lower=lower, tol=tol, max_steps=max_steps)[0]


def _newton_schulz(
    g: torch.Tensor, steps: int | None, *, lower: float | None, tol: float, max_steps: int
) -> tuple[torch.Tensor, int]:
    """:func:`newton_schulz_polar` plus the number of steps taken."""
    _check_matrix(g)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"ns_steps must be a positive int or None, got {steps!r}")
    dtype = _compute_dtype(g.dtype)
    x = g.detach().to(dtype)
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # keep the Gram matrix X X^T on the small side
        x = x.T
    r = x.shape[0]
    fro = torch.linalg.matrix_norm(x)
    if not bool(fro > 0):
        out = torch.zeros_like(x)
        return (out.T if transposed else out), 0
    x = x / fro
    gram = x @ x.T
    gram2 = gram @ gram
    nu = torch.linalg.matrix_norm(gram2).pow(0.25).clamp_min(torch.finfo(dtype).tiny)
    x = x / nu
    gram = gram / nu**2
    gram2 = gram2 / nu**4
    if lower is None:
        lower = NS_LOWER_SQUARE if x.shape[1] < 2 * r else NS_LOWER_RECT
    first = ns_coefficients(float(lower))
    again = ns_coefficients(NS_LOWER_RECT)
    eye = torch.eye(r, dtype=dtype, device=x.device)
    taken, start = 0, 0
    if steps is None and x.shape[1] >= 2 * r:
        x, taken = _gram_side_pass(x, gram, gram2, first[:max_steps], eye, tol)
        start = len(first)  # go on (if needed) with explicit steps of the `again` schedule
    limit = steps if steps is not None else start + max_steps - taken
    pass_dev: float | None = None
    probes = None
    if steps is None:  # fixed Gaussian probes for the cheap convergence test
        gen = torch.Generator().manual_seed(0)
        probes = torch.randn(r, _PROBES, generator=gen, dtype=dtype).to(x.device)
    for k in range(start, limit):
        if k > 0:
            if probes is not None and _sketched_deviation(x, probes) <= tol:
                break  # converged: skip the r x r x N Gram product the next step would need
            gram = x @ x.T
            if steps is None:
                # ||A - I||_F / sqrt(r) = RMS(s^2 - 1) ~= 2 RMS(s - 1) near convergence
                dev = torch.linalg.matrix_norm(gram - eye) / math.sqrt(r)
                if float(dev) <= 2 * tol:
                    break
                if k >= len(first) and (k - len(first)) % len(again) == 0:
                    if k + len(again) > limit:
                        break  # a pass cut short leaves values anywhere in [1 - E_k, 1 + E_k]
                    # end of a pass: stop if it did not halve the deviation (e.g. exactly
                    # rank-deficient g, whose zero singular values never move)
                    if pass_dev is not None and float(dev) > 0.5 * pass_dev:
                        break
                    pass_dev = float(dev)
            gram2 = gram @ gram
        if k < len(first):
            a, b, c = first[k]
        elif steps is not None:  # beyond the schedule: classic steps keep converged values at 1
            a, b, c = _CLASSIC
        else:
            a, b, c = again[(k - len(first)) % len(again)]
        poly = gram2 * c  # a I + b A + c A^2
        poly.add_(gram, alpha=b)
        poly.diagonal().add_(a)
        x = poly @ x
        taken += 1
    return (x.T if transposed else x), taken


#: The classic quintic ``(15, -10, 3) / 8``: ``p(1) = 1``, ``p'(1) = p''(1) = 0``.
_CLASSIC = (15 / 8, -10 / 8, 3 / 8)

#: Gaussian probes of the sketched convergence test (relative std of the estimate ~ 1/4).
_PROBES = 32


def _sketched_deviation(x: torch.Tensor, probes: torch.Tensor) -> float:
    """Estimate of ``||X X^T - I||_F / sqrt(r)`` from ``k`` Gaussian probes W:
    ``E ||(X X^T - I) W||_F^2 = k ||X X^T - I||_F^2``; costs ``4 r N k`` flops instead of the
    ``2 r^2 N`` of the Gram matrix. Compared with ``tol`` (half the exact test's ``2 tol``), a
    false "converged" needs the estimate to be 4x too small: chi-square(32) odds below 1e-6."""
    residual = x @ (x.T @ probes) - probes
    k, r = probes.shape[1], probes.shape[0]
    return float(torch.linalg.matrix_norm(residual)) / math.sqrt(k * r)


def _gram_side_pass(
    x: torch.Tensor,
    gram: torch.Tensor,
    gram2: torch.Tensor,
    schedule: tuple[tuple[float, ...], ...],
    eye: torch.Tensor,
    tol: float,
) -> tuple[torch.Tensor, int]:
    """One pass of ``schedule`` on the small side, for rectangular ``x`` (r x N, N >= 2r).

    The steps are polynomials in ``A_0 = X_0 X_0^T``: ``X_k = Q_k X_0`` and ``A_{k+1} = P_k A_k
    P_k`` with ``P_k = a I + b A_k + c A_k^2``, so a step costs four r x r products instead of
    ``2 N / r + 1`` and X is formed once at the end. Squaring the condition number in fp32 is
    harmless for the first pass of a rectangular matrix (designed for ``s >= 1e-2 s_max``,
    i.e. eigenvalues of A >= 1e-4); the explicit Gram check that follows in
    :func:`_newton_schulz` catches anything left unconverged.
    """
    q: torch.Tensor | None = None
    r, taken = gram.shape[0], 0
    for k, (a, b, c) in enumerate(schedule):
        if k > 0:
            if float(torch.linalg.matrix_norm(gram - eye)) / math.sqrt(r) <= 2 * tol:
                break
            gram2 = gram @ gram
        poly = gram2 * c  # a I + b A + c A^2
        poly.add_(gram, alpha=b)
        poly.diagonal().add_(a)
        q = poly if q is None else poly @ q
        taken += 1
        if k < len(schedule) - 1:
            gram = poly @ (gram @ poly)
    return (x if q is None else q @ x), taken


def polar(
    g: torch.Tensor,
    method: str = "svd",
    steps: int | None = None,
    **ns_options,
) -> torch.Tensor:
    """Orthogonal polar factor ``U V^T`` of a 2-D tensor, returned in the input dtype.

    ``method="svd"`` is exact; ``method="gram"`` is :func:`gram_polar` where its accuracy bound
    holds, the SVD elsewhere (same result to ~1e-6 relative in fp32, several times faster on
    rectangular matrices); ``method="newton_schulz"`` is the fast approximation of
    :func:`newton_schulz_polar` (``steps`` and ``lower``/``tol``/``max_steps`` apply to it).
    """
    _check_matrix(g)
    if method in ("svd", "gram"):
        if steps is not None or ns_options:
            raise ValueError("steps/ns options only apply to method='newton_schulz'")
        x = g.detach().to(_compute_dtype(g.dtype))
        out = gram_polar(x) if method == "gram" else None
        if out is None:
            u, _, vh = thin_svd(x)
            out = u @ vh
    elif method == "newton_schulz":
        out = newton_schulz_polar(g, steps, **ns_options)
    else:
        raise ValueError(f"polar method must be 'svd', 'gram' or 'newton_schulz', got {method!r}")
    return out.to(g.dtype)


def iso_c(
    g: torch.Tensor,
    method: str = "svd",
    steps: int | None = None,
    **ns_options,
) -> torch.Tensor:
    """``mean(s) * U V^T`` of a 2-D tensor (fp32 inside, input dtype out).

    ``method="svd"``: exact, from the thin SVD. ``method="gram"``: exact too (to ~1e-6 relative
    in fp32), ``mean(sqrt(lam)) G^(-1/2) g`` from the small Gram matrix (:func:`gram_polar`)
    where its accuracy bound holds, the SVD elsewhere. ``method="newton_schulz"``:
    ``(<O, g>/r) O`` with ``O`` the Newton-Schulz polar factor.
    """
    _check_matrix(g)
    x = g.detach().to(_compute_dtype(g.dtype))
    r = min(x.shape)
    if method in ("svd", "gram"):
        if steps is not None or ns_options:
            raise ValueError("steps/ns options only apply to method='newton_schulz'")
        out = gram_polar(x, scale="mean") if method == "gram" else None
        if out is None:
            u, s, vh = thin_svd(x)
            out = (u * s.mean()) @ vh
    elif method == "newton_schulz":
        o = newton_schulz_polar(x, steps, **ns_options)
        out = o * (torch.sum(o * x) / r)
    else:
        raise ValueError(f"iso_c method must be 'svd', 'gram' or 'newton_schulz', got {method!r}")
    return out.to(g.dtype)
