"""Robust aggregation of the round's pseudo-gradients, before the rule and the outer step.

With ``robust`` set, the merge of a round is ``g = rule(A(delta_1..delta_M))`` where ``A``
replaces the (weighted) mean that the rule (``mean``, Iso-C, ...) then transforms:

- ``"median"``: coordinate-wise median, ``A_j = median_i delta_ij`` (the mean of the two middle
  values when ``M`` is even); unweighted. Then ``g = rule.transform(A)``.
- ``"trimmed-mean"``: per coordinate, drop the ``k = floor(trim * M)`` largest and ``k``
  smallest values and average the rest (Flower's ``fedtrimmedavg.trim_mean``); unweighted.
- ``"krum"`` / ``"multikrum"``: score ``s_i = sum of the n_c smallest ||delta_i - delta_j||^2``
  over ``j != i``, ``n_c = max(1, M - f - 2)`` (Flower's ``select_multikrum``); keep the one
  (krum) or the ``m`` (multikrum, default ``M - f``) lowest scores, then ``g = rule(kept; w)``.
  ``f`` defaults to ``floor((M - 3) / 2)``, the most Krum tolerates (``M > 2f + 2``).
- ``"norm-clip"``: ``delta_i <- delta_i * min(1, median_j ||delta_j|| / ||delta_i||)`` (the
  round's own median), then ``g = rule(clipped; w)``.
- ``"distance-filter"``: ``r_i = ||delta_i - m||`` with ``m`` the coordinate-wise median; keep
  every ``i`` with ``r_i <= factor * median_j r_j`` (``factor >= 1``, default 2), then
  ``g = rule(kept; w)``. An honest round whose updates are spread alike keeps every update (so
  ``g`` is the plain merge); an update far from the median is left out.

``median`` and ``trimmed-mean`` need a streaming rule (a function of the mean); ``krum``,
``multikrum``, ``norm-clip`` and ``distance-filter`` only choose or scale the inputs and work
with any rule.

Memory: in a strategy round (a :class:`~.spill.SpillStore`) the per-coordinate statistics
(median, trimmed mean, the filter's median and distances, Krum's distances) read the ``M``
copies of one block of rows at a time (:attr:`RobustMerge.block_bytes`, 64 MiB in fp32), and a
rule of the mean adds the chosen updates one at a time, so the round costs
``O(largest tensor + block)``, not ``O(M x largest tensor)``; called with ``get`` alone (updates
in memory) it reads whole tensors. The choice (Krum's ``M x M`` distances, norm-clip's norms,
the filter's distances) is a first pass over the store; the merge is a second pass.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

from .device import resolve_device
from .merge import merge
from .validation import normalised_weights

__all__ = [
    "ROBUST_RULES",
    "RobustMerge",
    "clip_factors",
    "coordinate_median",
    "distance_keep",
    "krum_select",
    "pairwise_sq_distances",
    "resolve_robust",
    "trimmed_mean",
]

ROBUST_RULES = (
    "none",
    "median",
    "trimmed-mean",
    "krum",
    "multikrum",
    "norm-clip",
    "distance-filter",
)
ROBUST_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "median": {},
    "trimmed-mean": {"trim": 0.25},
    "krum": {"f": None},
    "multikrum": {"f": None, "select": None},
    "norm-clip": {},
    "distance-filter": {"factor": 2.0},
}
"""Each rule's options and defaults (``None``: computed from the round's ``M``)."""
_NEED_MEAN = ("median", "trimmed-mean")

Tensors = dict[str, torch.Tensor]
Getter = Callable[[int, str], torch.Tensor]
RowGetter = Callable[[int, str, int, int], torch.Tensor]  # (i, key, start, stop): rows of a tensor


# ---------------------------------------------------------------------------- pure maths
def coordinate_median(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median of ``xs`` (mean of the two middle values for an even count)."""
    s = torch.stack([x.float() if x.dtype != torch.float64 else x for x in xs]).sort(dim=0).values
    m = s.shape[0]
    if m % 2:
        return s[m // 2]
    return (s[m // 2 - 1] + s[m // 2]) / 2


def trimmed_mean(xs: Sequence[torch.Tensor], trim: float) -> torch.Tensor:
    """Coordinate-wise mean after dropping the ``floor(trim * M)`` largest and smallest values
    (Flower's ``trim_mean``; ``0 <= trim < 0.5``)."""
    dt = torch.float64 if xs[0].dtype == torch.float64 else torch.float32
    arr = np.stack([x.detach().to(dtype=dt).cpu().numpy() for x in xs])
    return torch.from_numpy(np.asarray(trim_mean(arr, trim), dtype=arr.dtype))


def pairwise_sq_distances(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``D_ij = ||x_i - x_j||^2`` (float64, ``M x M``) of one tensor's ``M`` copies; summed over
    tensors this is the distance of the whole updates."""
    x = torch.stack([t.detach().reshape(-1).double() for t in xs])
    sq = (x * x).sum(dim=1)
    d = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    d.fill_diagonal_(0.0)
    return d.clamp_(min=0.0)


def krum_select(dist: torch.Tensor | np.ndarray, f: int, select: int) -> list[int]:
    """Indices of the ``select`` lowest Krum scores (``s_i``: sum of the ``max(1, M - f - 2)``
    smallest distances to the others), best first; ties go to the lower index."""
    d = np.asarray(dist, dtype=np.float64)
    m = d.shape[0]
    if m == 1:
        return [0]
    n_c = max(1, m - f - 2)
    scores = []
    for i in range(m):
        others = np.delete(d[i], i)
        scores.append(float(np.sort(others)[: min(n_c, m - 1)].sum()))
    order = np.argsort(np.asarray(scores), kind="stable")
    return [int(i) for i in order[: max(1, min(select, m))]]


def clip_factors(norms: Sequence[float]) -> list[float]:
    """``min(1, median(norms) / n_i)`` for each norm (1 for a zero norm)."""
    med = statistics.median(norms)
    return [1.0 if n <= med or n == 0 else med / n for n in norms]


def distance_keep(dist: Sequence[float], factor: float) -> list[int]:
    """Indices ``i`` with ``dist[i] <= factor * median(dist)`` (``factor >= 1``: at least half)."""
    bar = factor * statistics.median(dist)
    return [i for i, d in enumerate(dist) if d <= bar]


# ---------------------------------------------------------------------------- configuration
def resolve_robust(
    robust: str | None, options: Mapping[str, Any] | None, rule: Any
) -> tuple[str, dict[str, Any]]:
    """The checked ``(name, options)``; ``ValueError`` naming a bad name, option or value, or a
    rule that ``median`` / ``trimmed-mean`` cannot feed (one that is not a function of the mean).
    """
    name = "none" if robust is None else robust
    if name not in ROBUST_RULES:
        raise ValueError(f"robust must be one of {ROBUST_RULES}, got {robust!r}")
    opts = dict(ROBUST_OPTIONS[name])
    for k, v in dict(options or {}).items():
        if k not in opts:
            raise ValueError(
                f"robust_options: unknown option {k!r} for robust={name!r} "
                f"(allowed: {sorted(opts) or 'none'})"
            )
        opts[k] = v
    if name == "trimmed-mean":
        t = opts["trim"]
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 0.5):
            raise ValueError(f"robust_options trim must be in [0, 0.5), got {t!r}")
    if name == "distance-filter":
        v = opts["factor"]
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 1 <= v < math.inf):
            raise ValueError(f"robust_options factor must be a finite number >= 1, got {v!r}")
    for k, lo in (("f", 0), ("select", 1)):
        v = opts.get(k)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
            raise ValueError(f"robust_options {k} must be an int >= {lo} (or None), got {v!r}")
    if name in _NEED_MEAN and not getattr(rule, "streaming", False):
        raise ValueError(
            f"robust={name!r} replaces the mean, so it needs a rule that is a function of the "
            f"mean (mean, iso_c, iso_c_ns, iso_c_matched), got {getattr(rule, 'name', rule)!r}"
        )
    return name, opts


def _rule_of(rule: Any, key: str, agg: torch.Tensor, opts: Mapping[str, Any]) -> torch.Tensor:
    return merge(rule, [{key: agg}], None, **opts)[key]


class RobustMerge:
    """``A`` of the module docstring for one strategy: ``merge(rule, opts, keys, get, ws)``."""

    block_bytes = 64 * 2**20
    """The most one row block's ``M`` copies take in fp32 (:meth:`blocks`); sorting and the
    fp64 distances need a few times that."""

    def __init__(self, name: str, options: Mapping[str, Any]) -> None:
        self.name, self.options = name, dict(options)
        self.last_kept: list[int] | None = None  # krum, multikrum, filter: indices kept last round
        self.last_factors: list[float] | None = None  # norm-clip: the clip factors last round

    def krum_params(self, m: int) -> tuple[int, int]:
        """``(f, select)`` for a round of ``m`` updates."""
        f = self.options.get("f")
        f = max(0, (m - 3) // 2) if f is None else int(f)
        if self.name == "krum":
            return f, 1
        sel = self.options.get("select")
        return f, max(1, m - f) if sel is None else int(sel)

    def merge(
        self,
        rule: Any,
        opts: Mapping[str, Any],
        keys: Sequence[str],
        get: Getter,
        weights: Sequence[float],
        rows: RowGetter | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> Tensors:
        """``g`` over the ``len(weights)`` updates ``get(i, key)``, one tensor at a time; with
        ``rows(i, key, start, stop)`` and ``shapes``, the per-coordinate statistics read blocks
        of rows (:meth:`blocks`) and a rule of the mean adds the kept updates one at a time."""
        n = len(weights)
        if n == 0:
            raise ValueError("robust merge of no update")
        if self.name in _NEED_MEAN:
            out = {}
            for key in keys:
                parts = [self._statistic(xs) for xs in self.blocks(key, n, get, rows, shapes)]
                agg = parts[0] if len(parts) == 1 else torch.cat(parts)
                out[key] = _rule_of(rule, key, agg, opts)
            return out
        scale = [1.0] * n
        kept = list(range(n))
        if self.name in ("krum", "multikrum"):
            dist = torch.zeros(n, n, dtype=torch.float64)
            for key in keys:
                for xs in self.blocks(key, n, get, rows, shapes):
                    dist += pairwise_sq_distances(xs)
            f, sel = self.krum_params(n)
            kept = sorted(krum_select(dist, f, sel))
            self.last_kept = kept
        elif self.name == "norm-clip":
            sq = [0.0] * n
            for key in keys:
                for i in range(n):
                    sq[i] += float(get(i, key).double().pow(2).sum())
            scale = clip_factors([math.sqrt(s) for s in sq])
            self.last_factors = scale
        elif self.name == "distance-filter":
            sq = [0.0] * n
            for key in keys:
                for xs in self.blocks(key, n, get, rows, shapes):
                    med = coordinate_median(xs).double()
                    for i, x in enumerate(xs):
                        sq[i] += float((x.double() - med).pow(2).sum())
            kept = distance_keep([math.sqrt(s) for s in sq], float(self.options["factor"]))
            self.last_kept = kept
        ws = [weights[i] for i in kept]
        out = {}
        for key in keys:
            if rows is not None and getattr(rule, "streaming", False):
                out[key] = _kept_mean(rule, key, opts, get, kept, ws, scale)
                continue
            xs = [{key: get(i, key) * scale[i] if scale[i] != 1.0 else get(i, key)} for i in kept]
            out[key] = merge(rule, xs, ws, **opts)[key]
        return out

    def _statistic(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """median / trimmed mean of one block's copies, in their dtype."""
        if self.name == "median":
            return coordinate_median(xs).to(xs[0].dtype)
        return trimmed_mean(xs, float(self.options["trim"])).to(xs[0].dtype)

    def blocks(
        self,
        key: str,
        n: int,
        get: Getter,
        rows: RowGetter | None,
        shapes: Mapping[str, Sequence[int]] | None,
    ) -> Iterator[list[torch.Tensor]]:
        """The ``n`` copies of successive row blocks of tensor ``key``, each block's stack at
        most :attr:`block_bytes` in fp32 (one row at least); the whole tensor without ``rows``.
        Every statistic here is per coordinate (or, for distances, a sum over coordinates), so
        the blocks give the whole tensor's values."""
        shape = None if shapes is None else tuple(shapes[key])
        if rows is None or not shape:
            yield [get(i, key) for i in range(n)]
            return
        step = max(1, self.block_bytes // (4 * n * max(1, math.prod(shape[1:]))))
        if step >= shape[0]:
            yield [get(i, key) for i in range(n)]
            return
        for a in range(0, shape[0], step):
            yield [rows(i, key, a, min(a + step, shape[0])) for i in range(n)]


def _kept_mean(
    rule: Any,
    key: str,
    opts: Mapping[str, Any],
    get: Getter,
    kept: Sequence[int],
    ws: Sequence[float],
    scale: Sequence[float],
) -> torch.Tensor:
    """``merge(rule, kept updates, ws)[key]`` for a rule of the mean, bit for bit, reading one
    update at a time: ``merge`` forms ``sum_i w_i d_i`` left to right in the compute dtype (an
    elementwise fold), then transforms it; here the fold reads each ``d_i`` when it is added."""
    norm = normalised_weights(ws, len(ws))
    dev = resolve_device(opts.get("device", "auto"))
    acc, dtype = None, None
    for i, w in zip(kept, norm, strict=True):
        if w <= 0:
            continue  # as in merge(): zero-weight updates take no part
        x = get(i, key)
        x = x * scale[i] if scale[i] != 1.0 else x
        if acc is None:
            dtype = x.dtype
            cdt = torch.float64 if dtype == torch.float64 else torch.float32
            acc = x.detach().to(device=dev, dtype=cdt) * w
        else:
            acc.add_(x.detach().to(device=dev, dtype=acc.dtype), alpha=w)
        del x
    assert acc is not None and dtype is not None  # normalised weights are not all zero
    return _rule_of(rule, key, acc, opts).to(dtype)
