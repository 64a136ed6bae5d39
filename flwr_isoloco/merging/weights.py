"""A bound on any one worker's share of the merge weight.

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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["bounded_weights"]


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
