"""``merge(rule, deltas, weights=None, **options)``: one call, all tensors, any rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .device import resolve_device
from .rules import (
    MergeRule,
    check_options,
    resolve_rule,
    rule_applies,
    scaled_apply,
    weighted_mean,
)
from .validation import check_deltas, normalised_weights

__all__ = ["merge"]


def merge(
    rule: str | MergeRule,
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    *,
    device: str | torch.device | None = "auto",
    **options,
) -> dict[str, torch.Tensor]:
    """Merge M workers' pseudo-gradients (dicts name -> tensor, same keys and shapes).

    ``weights``: finite, non-negative, not all zero, default uniform; normalised in float64
    without overflow (:func:`~flwr_isoloco.merging.validation.normalised_weights`). Non-2-D
    tensors, and 2-D tensors whose name does not match ``spectral_pattern``, take the weighted
    mean. Spectral rules run on a power-of-two rescaled copy where entries are huge or tiny
    (:func:`~flwr_isoloco.merging.rules.scaled_apply`; for streaming rules on the mean, as in
    :class:`~flwr_isoloco.merging.StreamingMerger`). Computes in fp32 (fp64 for fp64 input) on
    ``device`` (:func:`~flwr_isoloco.merging.device.resolve_device`: ``"auto"`` is CUDA where
    available, else the CPU), one tensor's M slices at a time, and returns CPU tensors in worker
    0's dtype. Raises ``ValueError`` naming the worker and key on bad input, and naming the
    option on a bad option or device.
    """
    dev = resolve_device(device)
    rule = resolve_rule(rule)
    opts, pattern = check_options(rule, options)
    check_deltas(deltas)
    norm = normalised_weights(weights, len(deltas))
    # Streaming rules: transform(weighted mean), the mean computed here with the normalised
    # weights (a convex combination: no overflow for finite deltas), one tensor at a time, the
    # power-of-two rescaling decided on the mean, as StreamingMerger does. Zero-weight workers
    # take no part (their arbitrary singular vectors must not enter TSV-M / Iso-CTS, nor count
    # in M).
    used = [i for i, w in enumerate(norm) if w > 0]
    deltas, norm = [deltas[i] for i in used], [norm[i] for i in used]
    out: dict[str, torch.Tensor] = {}
    for key, t0 in deltas[0].items():
        cdt = torch.float64 if t0.dtype == torch.float64 else torch.float32
        xs = [d[key].detach().to(device=dev, dtype=cdt) for d in deltas]
        if not rule_applies(key, t0, pattern) or rule.name == "mean":
            merged = weighted_mean(xs, norm)
        elif rule.streaming:
            mean = weighted_mean(xs, norm)
            merged = scaled_apply(lambda x: rule.transform(x[0], **opts), [mean])
        else:
            merged = scaled_apply(rule.combine, xs, norm, key=key, **opts)
        out[key] = merged.to(device="cpu", dtype=t0.dtype)
    return out
