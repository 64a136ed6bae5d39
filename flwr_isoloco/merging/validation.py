"""Input checks shared by :func:`merge` and :class:`StreamingMerger`.

Every error is a ``ValueError`` naming the worker index and the key, e.g.
``worker 3, key 'layers.0.w': shape (4, 5) != (4, 4)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = ["all_finite", "check_delta", "check_weight", "check_deltas", "normalised_weights"]


def all_finite(t: torch.Tensor) -> bool:
    """No nan/inf. Fast path: one reduction (nan/inf propagate into the sum); only a non-finite
    sum (which finite values could also give by overflow) triggers the exact element check."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def check_delta(
    delta: object,
    worker: int,
    reference: Mapping[str, torch.Size] | None = None,
) -> None:
    """Check one worker's ``name -> tensor`` dict (against ``reference``: key -> shape)."""
    if not isinstance(delta, Mapping):
        raise ValueError(
            f"worker {worker}: delta must be a dict name -> tensor, got {type(delta).__name__}"
        )
    if not delta:
        raise ValueError(f"worker {worker}: delta is empty")
    if reference is not None:
        for key in reference:
            if key not in delta:
                raise ValueError(f"worker {worker}, key {key!r}: missing")
        for key in delta:
            if key not in reference:
                raise ValueError(f"worker {worker}, key {key!r}: unexpected (not in worker 0)")
    for key, t in delta.items():
        if not isinstance(key, str):
            raise ValueError(f"worker {worker}, key {key!r}: keys must be strings")
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"worker {worker}, key {key!r}: expected a torch.Tensor, got {type(t).__name__}"
            )
        if not t.is_floating_point():
            raise ValueError(f"worker {worker}, key {key!r}: dtype {t.dtype} is not floating point")
        if reference is not None and t.shape != reference[key]:
            raise ValueError(
                f"worker {worker}, key {key!r}: shape {tuple(t.shape)} != {tuple(reference[key])}"
            )
        if not all_finite(t):
            raise ValueError(f"worker {worker}, key {key!r}: non-finite values (nan or inf)")


def check_weight(weight: object, worker: int) -> float:
    """A finite, non-negative float."""
    if isinstance(weight, torch.Tensor) and weight.numel() == 1:
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"worker {worker}: weight must be a number, got {weight!r}")
    w = float(weight)
    if not math.isfinite(w):
        raise ValueError(f"worker {worker}: weight {weight!r} is not finite")
    if w < 0:
        raise ValueError(f"worker {worker}: weight {weight!r} is negative")
    return w


def normalised_weights(weights: Sequence[float] | None, num: int) -> list[float]:
    """Weights divided by their sum (uniform when ``None``), in float64 without overflow.

    ``w_i / sum_j w_j`` is computed as ``u_i / sum_j u_j`` with ``u_i = w_i / max_j w_j`` in
    ``[0, 1]``, so the sum is at most ``num`` and finite for any finite weights (``[1e308,
    1e308]`` gives ``[0.5, 0.5]``; a plain sum would be ``inf`` and every weight 0). A weight
    below ``max * 2**-1074`` becomes 0 and that worker takes no part.
    """
    if weights is None:
        return [1.0 / num] * num
    if isinstance(weights, torch.Tensor):
        weights = weights.tolist()
    if not isinstance(weights, Sequence) or isinstance(weights, (str, bytes)):
        raise ValueError(f"weights must be a sequence of numbers, got {type(weights).__name__}")
    if len(weights) != num:
        raise ValueError(f"got {len(weights)} weights for {num} workers")
    ws = [check_weight(w, i) for i, w in enumerate(weights)]
    top = max(ws)
    if not top > 0:
        raise ValueError("weights are all zero")
    rel = [w / top for w in ws]
    total = math.fsum(rel)
    return [u / total for u in rel]


def check_deltas(deltas: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Non-empty sequence of dicts with worker 0's keys and shapes, finite float tensors."""
    if isinstance(deltas, Mapping) or not isinstance(deltas, Sequence):
        raise ValueError("deltas must be a sequence (list) of dicts name -> tensor, one per worker")
    if len(deltas) == 0:
        raise ValueError("deltas is empty: nothing to merge")
    check_delta(deltas[0], 0)
    shapes = {key: t.shape for key, t in deltas[0].items()}
    for i in range(1, len(deltas)):
        check_delta(deltas[i], i, shapes)
