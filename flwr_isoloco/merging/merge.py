"""``merge(rule, deltas, weights=None, **options)``: one call, all tensors, any rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .rules import MergeRule, check_options, resolve_rule, rule_applies, weighted_mean
from .streaming import StreamingMerger
from .validation import check_deltas, normalised_weights

__all__ = ["merge"]


def merge(
    rule: str | MergeRule,
    deltas: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    **options,
) -> dict[str, torch.Tensor]:
    """Merge M workers' pseudo-gradients (dicts name -> tensor, same keys and shapes).

    ``weights``: non-negative, not all zero, default uniform. Non-2-D tensors, and 2-D tensors
    whose name does not match ``spectral_pattern``, take the weighted mean. Computes in fp32 (fp64
    for fp64 input) and returns each tensor in worker 0's dtype. Raises ``ValueError`` naming
    the worker and key on bad input, and naming the option on a bad option.
    """
    rule = resolve_rule(rule)
    opts, pattern = check_options(rule, options)
    check_deltas(deltas)
    norm = normalised_weights(weights, len(deltas))
    if rule.streaming:
        merger = StreamingMerger(rule, **options)
        for d, w in zip(deltas, norm, strict=True):
            merger.add(d, w)
        return merger.result()
    # zero-weight workers take no part (their arbitrary singular vectors must not enter
    # TSV-M / Iso-CTS, nor count in M)
    used = [i for i, w in enumerate(norm) if w > 0]
    deltas, norm = [deltas[i] for i in used], [norm[i] for i in used]
    out: dict[str, torch.Tensor] = {}
    for key, t0 in deltas[0].items():
        cdt = torch.float64 if t0.dtype == torch.float64 else torch.float32
        xs = [d[key].detach().to(device=t0.device, dtype=cdt) for d in deltas]
        if rule_applies(key, t0, pattern):
            merged = rule.combine(xs, norm, key=key, **opts)
        else:
            merged = weighted_mean(xs, norm)
        out[key] = merged.to(t0.dtype)
    return out
