"""The merge rules of the repository's ``docs/algorithms.md`` ("Algorithms") section 2, per tensor, as pure torch.

Conventions. ``deltas`` are M fp32 tensors of one parameter, ``weights`` are non-negative and sum
to 1, so every rule is on the scale of the weighted mean (for M identical deltas, ``mean`` returns
that delta). A rule only touches 2-D tensors whose name matches ``spectral_pattern`` (a regex,
``re.search``; default: every 2-D tensor); every other tensor takes the weighted mean.

- ``mean``: ``sum_i w_i d_i``.
- ``iso_c`` / ``iso_c_ns``: Iso-C of the weighted mean (exact: Gram eigendecomposition where
  its accuracy bound holds, else SVD / Newton-Schulz polar factor).
- ``iso_c_matched`` (the ``"dropin"`` preset's): Iso-C at the mean's Frobenius norm with no
  singular direction raised by more than ``max_gain`` (:mod:`.iso_range`).
- ``iso_cts``: common subspace (top k of the mean) + each worker's top ``s = (r-k)/M`` directions
  of ``w_i d_i`` outside it, with the authors' ``k = r - round((r - int(f r)) / M) * M``
  (:func:`iso_cts_sizes`); orthonormalised by polar factors; every singular value set to their
  mean.
- ``tsv_m``: top ``max(1, r // M)`` triplets of each ``w_i d_i``, stacked, U and V orthonormalised
  by polar factors, singular values kept.
- ``ties``: keep each worker's ``max(1, int((1 - p) n))`` largest entries
  (:func:`ties_kept_count`), elect the sign of the weighted sum, weighted mean of the kept
  entries that agree with it (in chunks: O(one tensor) extra memory; read in row blocks from
  a spill store, :func:`ties_rows`: O(one tensor) for all M workers together).
- ``dare``: drop entries with probability p, rescale survivors by 1/(1-p), weighted mean.
- ``sparseloco``: SparseLoCo's combine of sparse deltas (:mod:`.sparse`): each worker's tensor
  clipped to the workers' median norm, each entry the weighted mean over the workers that sent
  it (a non-zero entry).

Scale: with weights summing to 1, ``iso_c``, ``iso_cts`` and ``tsv_m`` are on the mean scale;
the TSV and Iso-C authors' code and the IsoLoCo code's TSV-M are on the sum scale (M times
larger for uniform weights), see the repository's ``docs/merging.md`` ("Merge rules and the outer optimiser").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .iso_range import MAX_GAIN, iso_c_matched
from .options import COMMON_OPTIONS as COMMON_OPTIONS  # re-exported: defined in .options
from .options import check_options, rule_applies
from .polar import NS_LOWER, NS_MAX_STEPS, NS_TOL, gram_polar, iso_c, thin_svd
from .sparse import sparseloco_combine

__all__ = [
    "MergeRule",
    "MERGE_RULES",
    "resolve_rule",
    "check_options",
    "rule_applies",
    "scaled_apply",
    "iso_cts_sizes",
    "ties_kept_count",
    "ties_rows",
]

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class MergeRule:
    """A merge rule.

    ``combine(deltas, weights, key=..., **options)`` merges one 2-D tensor from the M workers'
    tensors (fp32) and weights (summing to 1). Streaming rules also have
    ``transform(mean, **options)``, a function of the weighted mean only, so they can be folded
    reply by reply (:class:`StreamingMerger`). Rules that may also have
    ``rows(read, num, weights, key=..., **options)``: the same result as ``combine`` (bit for
    bit, after :func:`scaled_apply`), from row blocks ``read(i, r0, r1)`` of worker i's tensor
    fetched on demand (e.g. from a spill store), so only a block of each worker's tensor is in
    memory. ``options`` maps each option to its default.
    """

    name: str
    combine: Callable[..., torch.Tensor]
    transform: Callable[..., torch.Tensor] | None = None
    options: dict = field(default_factory=dict)
    description: str = ""
    rows: Callable[..., torch.Tensor] | None = None

    @property
    def streaming(self) -> bool:
        return self.transform is not None


def weighted_mean(deltas: Tensors, weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i d_i`` (weights already normalised)."""
    out = deltas[0] * weights[0]
    for d, w in zip(deltas[1:], weights[1:], strict=True):
        out.add_(d, alpha=w)
    return out


def scaled_apply(
    fn: Callable[..., torch.Tensor], xs: Sequence[torch.Tensor], *args, **kwargs
) -> torch.Tensor:
    """``fn(xs, *args, **kwargs)`` for a positively homogeneous ``fn`` (``fn(c xs) = c fn(xs)``
    for c > 0; every rule is), computed on ``xs * 2**-e`` and scaled back by ``2**e`` when the
    largest entry (about ``2**e``) is far from 1.

    Why: a delta whose entries are finite but large (e.g. +-3e38 in fp32) has singular values and
    a Frobenius norm beyond the dtype's range, so SVD and Newton-Schulz give nan/inf (or, for
    entries below ~1e-19, Newton-Schulz's norm underflows to 0). Scaling by a power of two is
    exact, so the result is the same as unscaled wherever both are finite; it is only done when
    the largest entry is above ``2**(maxexp/4)`` or below ``2**-(maxexp/4)`` (fp32: 2**+-32),
    which keeps ordinary inputs bit-identical. The result can still be non-finite where its true
    value is beyond the dtype's range (e.g. DARE's ``d / (1 - p)``).
    """
    top = 0.0
    for x in xs:
        top = max(top, _largest(x))
    factors = _scale_factors(top, xs[0].dtype)
    if factors is None:
        return fn(list(xs), *args, **kwargs)
    down, up = factors
    out = fn([x * down[0] * down[1] for x in xs], *args, **kwargs)
    return out * up[0] * up[1]


def _largest(x: torch.Tensor) -> float:
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def _scale_factors(top: float, dtype: torch.dtype):
    """``(down, up)``, two power-of-two factors each, for :func:`scaled_apply`; None: no scaling."""
    limit = 2.0 ** (math.frexp(torch.finfo(dtype).max)[1] // 4)
    if top == 0 or (1 / limit <= top <= limit):
        return None
    exp = math.frexp(top)[1]  # top = m * 2**exp, m in [0.5, 1)
    half = exp // 2  # two factors, each a normal number of the dtype
    return (2.0**-half, 2.0 ** -(exp - half)), (2.0**half, 2.0 ** (exp - half))


def _streaming(transform: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def combine(deltas: Tensors, weights: Sequence[float], key: str = "", **options):
        return transform(weighted_mean(deltas, weights), **options)

    return combine


# ---- streaming rules: functions of the weighted mean ---------------------------------------


def _mean(g: torch.Tensor) -> torch.Tensor:
    return g


def _iso_c(g: torch.Tensor) -> torch.Tensor:
    return iso_c(g, method="gram")


def _iso_c_ns(
    g: torch.Tensor,
    ns_steps: int | None = None,
    ns_tol: float = NS_TOL,
    ns_lower: float = NS_LOWER,
    ns_max_steps: int = NS_MAX_STEPS,
) -> torch.Tensor:
    return iso_c(
        g,
        method="newton_schulz",
        steps=ns_steps,
        tol=ns_tol,
        lower=ns_lower,
        max_steps=ns_max_steps,
    )


# ---- rules that need every worker's tensor ------------------------------------------------


def _exact_polar(x: torch.Tensor) -> torch.Tensor:
    """``U V^T``: from the small Gram matrix where its accuracy bound holds (:func:`gram_polar`),
    else the thin SVD (stacked, nearly duplicate singular vectors are ill-conditioned)."""
    out = gram_polar(x)
    if out is not None:
        return out
    u, _, vh = thin_svd(x)
    return u @ vh


def iso_cts_sizes(r: int, num: int, common_fraction: float) -> tuple[int, int]:
    """``(k, s)``: common directions and task-specific directions per worker for Iso-CTS.

    The authors' rule (iso-merging ``src/utils/iso.py``; the IsoLoCo code's ``isoctsloco.py``):
    ``k = r - round((r - int(f r)) / M) * M`` and ``s = (r - k) / M``, with Python's ``round``
    on a float (round half to even: ``round(2.5) = 2``). E.g. r = 64, f = 0.8: k = 49 at M = 5,
    48 at M = 8; r = 1024, M = 128: k = 768. One guard the references lack: where
    ``round(...) * M`` exceeds r (small ``f r``, e.g. r = 3, f = 0.2, M = 2 gives k = -1 there)
    it is lowered to the largest multiple of M not above r, so ``0 <= k <= r``.
    """
    specific = round((r - int(common_fraction * r)) / num) * num
    specific = min(specific, (r // num) * num)
    return r - specific, specific // num


def _iso_cts(
    deltas: Tensors, weights: Sequence[float], key: str = "", common_fraction: float = 0.8
) -> torch.Tensor:
    """Iso-CTS: k common + (r-k)/M per-worker directions (:func:`iso_cts_sizes`), flat spectrum."""
    m, n = deltas[0].shape
    k, per_worker = iso_cts_sizes(min(m, n), len(deltas), common_fraction)
    scaled = [d * w for d, w in zip(deltas, weights, strict=True)]
    total = weighted_mean(deltas, weights)
    u, s, vh = thin_svd(total)
    us, ss, vs = [u[:, :k]], [s[:k]], [vh[:k]]
    if per_worker > 0:
        common = u[:, :k]
        for d in scaled:
            outside = d - common @ (common.T @ d)
            ui, si, vhi = thin_svd(outside)
            us.append(ui[:, :per_worker])
            ss.append(si[:per_worker])
            vs.append(vhi[:per_worker])
    u_all, s_all, v_all = torch.cat(us, 1), torch.cat(ss), torch.cat(vs, 0)
    return s_all.mean() * (_exact_polar(u_all) @ _exact_polar(v_all))


def _tsv_m(deltas: Tensors, weights: Sequence[float], key: str = "") -> torch.Tensor:
    """TSV-M: each worker's top ``max(1, r // M)`` triplets, U and V orthonormalised."""
    r, num = min(deltas[0].shape), len(deltas)
    top = max(1, r // num)
    us, ss, vs = [], [], []
    for d, w in zip(deltas, weights, strict=True):
        u, s, vh = thin_svd(d * w)
        us.append(u[:, :top])
        ss.append(s[:top])
        vs.append(vh[:top])
    u_all, s_all, v_all = torch.cat(us, 1), torch.cat(ss), torch.cat(vs, 0)
    return (_exact_polar(u_all) * s_all) @ _exact_polar(v_all)


def ties_kept_count(numel: int, prune_fraction: float) -> int:
    """Entries TIES keeps per worker and tensor: ``max(1, int((1 - p) * n))``.

    As the IsoLoCo code (``mergeloco.py``); mergekit's ``sparsify.magnitude`` keeps
    ``int(density * n)`` with ``density = 1 - p`` (and refuses 0). E.g. n = 6, p = 0.25: 4 kept
    (``int(4.5)``), where zeroing ``floor(p n) = 1`` entry would keep 5.
    """
    return max(1, int((1 - prune_fraction) * numel))


#: Entries per worker that :func:`_ties` stacks at a time (4 MiB each in fp32).
TIES_CHUNK = 1 << 20


def _prune_rule(d: torch.Tensor, fraction: float) -> tuple[torch.Tensor, int] | None:
    """``(t, c)``: :func:`prune_smallest` keeps flat entry j of ``d`` iff ``|d_j| > t``, or
    ``|d_j| == t`` and ``j >= c`` (equal magnitudes: the lower index is zeroed first). None: keep
    every entry. Memory: a few copies of ``d``'s magnitudes, one at a time."""
    count = d.numel() - ties_kept_count(d.numel(), fraction)
    if count <= 0:
        return None
    mag = d.detach().abs().flatten()
    threshold = torch.kthvalue(mag, count).values  # O(n) selection, no full sort
    extra = count - int((mag < threshold).sum())  # ties at the threshold to zero, >= 1
    seen = 0
    for start in range(0, mag.numel(), TIES_CHUNK):
        eq = mag[start : start + TIES_CHUNK] == threshold
        here = int(eq.sum())
        if seen + here >= extra:
            return threshold, start + int(torch.nonzero(eq).flatten()[extra - seen - 1]) + 1
        seen += here
    raise AssertionError("kthvalue's value has fewer ties than its rank implies")  # unreachable


def _pruned_slice(flat: torch.Tensor, rule: tuple[torch.Tensor, int] | None, start: int):
    """Entries ``start:start + len`` of the pruned tensor, from the flat slice ``flat``."""
    if rule is None:
        return flat
    threshold, cut = rule
    mag = flat.abs()
    prune = mag < threshold
    head = min(max(cut - start, 0), flat.numel())
    if head:
        prune[:head] |= mag[:head] == threshold
    return torch.where(prune, 0.0, flat)


def prune_smallest(d: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep the :func:`ties_kept_count` largest-magnitude entries, zero the rest (equal
    magnitudes: the lower index is zeroed first)."""
    rule = _prune_rule(d, fraction)
    return d if rule is None else _pruned_slice(d.flatten(), rule, 0).view_as(d)


def _ties(
    deltas: Tensors, weights: Sequence[float], key: str = "", prune_fraction: float = 0.1
) -> torch.Tensor:
    """TIES: trim, elect sign of the weighted sum of kept entries, disjoint weighted mean.

    Per flat chunk of ``TIES_CHUNK`` entries (each worker's pruning threshold found first, over
    its whole tensor), so the extra memory is O(one tensor + M x chunk), not O(M x tensor). The
    sums over workers run in worker order, entry by entry, so the result does not depend on the
    chunk size (the dense version's ``sum(0)`` agrees to fp32 round-off).
    """
    rules = [_prune_rule(d, prune_fraction) for d in deltas]
    flats = [d.reshape(-1) for d in deltas]
    out = torch.empty_like(flats[0])
    for start in range(0, out.numel(), TIES_CHUNK):
        stop = start + TIES_CHUNK
        kept = [_pruned_slice(f[start:stop], r, start) for f, r in zip(flats, rules, strict=True)]
        out[start:stop] = _ties_disjoint_mean(kept, weights)
    return out.view_as(deltas[0])


def _ties_disjoint_mean(kept: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Entry by entry, in worker order: elected sign ``s = sign(sum_i w_i k_i)``, then
    ``sum_{i: sign k_i = s} w_i k_i / sum_{i: sign k_i = s} w_i`` (0 where s = 0)."""
    total = kept[0] * weights[0]
    for k, w in zip(kept[1:], weights[1:], strict=True):
        total.add_(k, alpha=w)
    elected = torch.sign(total)
    voted = elected != 0
    num, den = torch.zeros_like(total), torch.zeros_like(total)
    for k, w in zip(kept, weights, strict=True):
        agree = (torch.sign(k) == elected) & voted
        num.add_(torch.where(agree, k, 0.0), alpha=w)
        den.add_(agree.to(den.dtype), alpha=w)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0)


#: Entries of all workers together that :func:`ties_rows` reads at a time (16 MiB in fp32).
TIES_BLOCK_BUDGET = 1 << 22


def ties_rows(
    read: Callable[[int, int, int | None], torch.Tensor],
    num: int,
    weights: Sequence[float],
    key: str = "",
    prune_fraction: float = 0.1,
) -> torch.Tensor:
    """TIES of ``num`` workers' 2-D tensors read on demand: ``read(i, r0, r1)`` is rows
    ``r0:r1`` of worker i's tensor (``read(i, 0, None)``: all of it). Equal, bit for bit, to
    ``scaled_apply(_ties, tensors, weights)``: each worker's pruning rule and largest entry come
    from one pass over its whole tensor (one tensor in memory at a time), then blocks of
    ``max(1, TIES_BLOCK_BUDGET // (num * cols))`` rows of every worker are merged entry by
    entry as :func:`_ties` does. Memory: O(one tensor + TIES_BLOCK_BUDGET), whatever ``num``.
    """
    top, rules = 0.0, []
    for i in range(num):
        x = read(i, 0, None)
        rows, cols = x.shape
        top, dtype, device = max(top, _largest(x)), x.dtype, x.device
        rules.append(_prune_rule(x, prune_fraction))
        del x
    factors = _scale_factors(top, dtype)
    down, up = factors if factors is not None else ((1.0, 1.0), (1.0, 1.0))

    def block(i: int, r0: int, r1: int | None) -> torch.Tensor:
        x = read(i, r0, r1)
        return x if factors is None else x * down[0] * down[1]

    if factors is not None:  # entries beyond 2**+-32 (fp32): prune the scaled tensors
        rules = [_prune_rule(block(i, 0, None), prune_fraction) for i in range(num)]
    out = torch.empty(rows * cols, dtype=dtype, device=device)
    step = max(1, TIES_BLOCK_BUDGET // (num * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        start = r0 * cols
        kept = [_pruned_slice(block(i, r0, r1).reshape(-1), rules[i], start) for i in range(num)]
        out[start : r1 * cols] = _ties_disjoint_mean(kept, weights)
        del kept
    out = out.view(rows, cols)
    return out if factors is None else out * up[0] * up[1]


def dare_seed(seed: int, key: str) -> int:
    """Per-tensor seed: independent of dict order, reproducible across processes."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


def _dare(
    deltas: Tensors,
    weights: Sequence[float],
    key: str = "",
    drop_rate: float = 0.1,
    seed: int = 0,
) -> torch.Tensor:
    """DARE: keep each entry with prob 1-p (one seeded generator per tensor), rescale, mean."""
    gen = torch.Generator().manual_seed(dare_seed(seed, key))
    out = torch.zeros_like(deltas[0])
    for d, w in zip(deltas, weights, strict=True):
        keep = torch.rand(d.shape, generator=gen) >= drop_rate
        out.add_(d * keep.to(d.device), alpha=w / (1.0 - drop_rate))
    return out


MERGE_RULES: dict[str, MergeRule] = {
    "mean": MergeRule("mean", _streaming(_mean), _mean, {}, "weighted mean (DiLoCo)"),
    "iso_c": MergeRule(
        "iso_c", _streaming(_iso_c), _iso_c, {}, "Iso-C of the mean, exact (Gram eigh / SVD)"
    ),
    "iso_c_matched": MergeRule(
        "iso_c_matched",
        _streaming(iso_c_matched),
        iso_c_matched,
        {"max_gain": MAX_GAIN},
        "Iso-C at the mean's norm, no direction raised by more than max_gain (None: unbounded)",
    ),
    "iso_c_ns": MergeRule(
        "iso_c_ns",
        _streaming(_iso_c_ns),
        _iso_c_ns,
        {"ns_steps": None, "ns_tol": NS_TOL, "ns_lower": NS_LOWER, "ns_max_steps": NS_MAX_STEPS},
        "Iso-C of the mean, Newton-Schulz polar factor",
    ),
    "iso_cts": MergeRule(
        "iso_cts",
        _iso_cts,
        None,
        {"common_fraction": 0.8},
        "Iso-CTS: common + per-worker subspaces, flat spectrum",
    ),
    "tsv_m": MergeRule("tsv_m", _tsv_m, None, {}, "task singular vectors merge"),
    "ties": MergeRule(
        "ties",
        _ties,
        None,
        {"prune_fraction": 0.1},
        "TIES: trim, elect sign, disjoint mean",
        rows=ties_rows,
    ),
    "dare": MergeRule(
        "dare",
        _dare,
        None,
        {"drop_rate": 0.1, "seed": 0},
        "DARE: random drop and rescale, then mean",
    ),
    "sparseloco": MergeRule(
        "sparseloco",
        sparseloco_combine,
        None,
        {},
        "SparseLoCo: each peer clipped to the median norm, each entry the mean over its senders",
    ),
}


def resolve_rule(rule: str | MergeRule) -> MergeRule:
    if isinstance(rule, MergeRule):
        return rule
    if isinstance(rule, str) and rule in MERGE_RULES:
        return MERGE_RULES[rule]
    raise ValueError(f"unknown merge rule {rule!r}; known: {', '.join(MERGE_RULES)}")
