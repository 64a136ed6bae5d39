"""Median-ratio bounds on what one worker sends: its merge weight and its update norm.

Client-reported weights (``num-examples``) are untrusted: one worker reporting ``1e12`` would
otherwise own the weighted mean. :func:`bounded_weights` clips every weight to
``max_ratio`` times the median weight of the round::

    w_i' = min(w_i, r * median_j w_j)

so no worker counts for more than ``r`` median workers; its share of the merge is at most
``r / (r + M - 1)`` when the others sit at the median. In float64 ``r * median`` may round
to ``inf`` only when the median is near ``1.8e308``, and then no finite weight exceeds it.
Weights that are not clipped are returned unchanged, so turning the bound on changes nothing
bitwise unless a weight is clipped. The merge normalises the result
(:func:`flwr_isoloco.merging.merge`).

:func:`norm_outlier` is the one median-ratio outlier test of an update norm, used by every
strategy (against the other replies of the round, or against the last accepted updates)::

    reject  iff  ||u_i||_2 > r * median(reference norms)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = ["bounded_weights", "norm_outlier"]


def bounded_weights(
    weights: Sequence[float], max_ratio: float | None
) -> tuple[list[float], list[int]]:
    """Clip ``weights`` to ``max_ratio * median(weights)``; return them and the clipped indices.

    Parameters
    ----------
    weights :
        Finite, non-negative numbers (already validated).
    max_ratio :
        ``r >= 1``; ``None`` or ``0`` turns the bound off.
    """
    ws = [float(w) for w in weights]
    if not max_ratio or not ws:
        return ws, []
    if not (max_ratio >= 1 and math.isfinite(max_ratio)):
        raise ValueError(f"max_ratio must be >= 1 (or 0/None for off), got {max_ratio!r}")
    cap = max_ratio * statistics.median(ws)
    clipped = [i for i, w in enumerate(ws) if w > cap]
    return [min(w, cap) for w in ws], clipped


def norm_outlier(
    norm: float,
    reference_norms: Iterable[float],
    max_ratio: float | None,
    *,
    min_reference: int = 2,
    reference: str = "the others",
) -> str | None:
    """Why ``norm`` is an outlier (``norm > max_ratio * median(reference_norms)``), else None.

    Parameters
    ----------
    norm :
        The update norm ``||u_i||_2`` under test (finite, already validated).
    reference_norms :
        The norms it is compared with (the round's other replies, or recent accepted ones).
    max_ratio :
        ``r > 0`` (the strategies' ``max_norm_ratio``); ``None`` or ``0`` turns the test off.
    min_reference :
        Fewer reference norms than this: no test (a median of one or two is no reference).
    reference :
        What the reference norms are, for the reason (``"the others"``, ...).

    Returns
    -------
    str or None
        ``"update norm N > max_norm_ratio r x median of <reference> M"`` or None.
    """
    refs = [float(n) for n in reference_norms]
    if not max_ratio or len(refs) < min_reference:
        return None
    med = statistics.median(refs)
    if norm > max_ratio * med:
        return (
            f"update norm {norm:.4g} > max_norm_ratio {max_ratio:g} x median of {reference} "
            f"{med:.4g}"
        )
    return None
