"""Streaming merge for rules that only need the weighted mean (mean, iso_c, iso_c_ns).

A server folds each worker's delta into one running weighted mean (fp32, fp64 for fp64 input) as
its reply arrives, so the extra memory is one model copy (plus one tensor's temporaries when
finishing), whatever the number of workers M: ``result = transform(sum_i w_i d_i / sum_i w_i)``
per tensor.

Overflow. Raw weights (e.g. ``num-examples``) can be huge, and deltas can hold finite values near
the fp32 maximum. The accumulator is therefore the running *mean*, a convex combination that is
never larger than the largest delta entry, and the weights are kept relative to the largest weight
seen so far: with ``u_i = w_i / w_max`` and ``U_j = sum_{i<=j} u_i``, adding worker j does
``mean <- mean * (U_{j-1} / U_j) + d_j * (u_j / U_j)``; a new largest weight first rescales
``U <- U * w_max_old / w_max_new``. Both factors are in ``[0, 1]``, ``U <= M``, and nothing
overflows for any finite weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .rules import MergeRule, check_options, resolve_rule, rule_applies, scaled_apply
from .validation import check_delta, check_weight

__all__ = ["StreamingMerger"]


class StreamingMerger:
    """``add(delta, weight)`` one worker at a time, then ``result()``.

    A bad delta or weight raises ``ValueError`` (naming the worker index, i.e. the number of
    earlier ``add`` calls, and the key) and leaves the running mean untouched, so the caller can
    drop that reply and go on. The result equals :func:`~flwr_isoloco.merging.merge` of the same
    deltas and weights (up to fp32 round-off).
    """

    def __init__(self, rule: str | MergeRule, **options) -> None:
        self.rule = resolve_rule(rule)
        if not self.rule.streaming:
            raise ValueError(
                f"merge rule {self.rule.name!r} needs every worker's delta at once; use merge()"
            )
        self._options, self._pattern = check_options(self.rule, options)
        self._mean: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, torch.Size] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.num_added = 0
        self._max_weight = 0.0  # largest weight added so far
        self._rel_total = 0.0  # sum of the weights added so far, divided by _max_weight

    @property
    def total_weight(self) -> float:
        """Sum of the weights added (``inf`` if that sum exceeds the float64 range)."""
        return self._rel_total * self._max_weight

    def add(self, delta: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """Fold ``delta`` with ``weight`` into the running weighted mean (after checking it)."""
        worker = self.num_added
        w = check_weight(weight, worker)
        check_delta(delta, worker, self._shapes)
        if self._shapes is None:
            self._shapes = {k: t.shape for k, t in delta.items()}
            self._dtypes = {k: t.dtype for k, t in delta.items()}
            self._mean = {
                k: torch.zeros_like(
                    t, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32
                )
                for k, t in delta.items()
            }
        self.num_added += 1
        if w == 0:
            return
        if w > self._max_weight:
            self._rel_total *= self._max_weight / w
            self._max_weight = w
        u = w / self._max_weight
        new_total = self._rel_total + u
        keep, take = self._rel_total / new_total, u / new_total
        for k, acc in self._mean.items():
            d = delta[k].detach().to(device=acc.device, dtype=acc.dtype)
            if keep == 0:
                acc.copy_(d)
            else:
                acc.mul_(keep).add_(d, alpha=take)
        self._rel_total = new_total

    def result(self) -> dict[str, torch.Tensor]:
        """The merged delta, each tensor in the dtype of the first delta's tensor."""
        if self.num_added == 0:
            raise ValueError("no deltas added: nothing to merge")
        if not self._rel_total > 0:
            raise ValueError("weights are all zero")
        out: dict[str, torch.Tensor] = {}
        for k, mean in self._mean.items():
            if self.rule.name != "mean" and rule_applies(k, mean, self._pattern):
                merged = scaled_apply(lambda x: self.rule.transform(x[0], **self._options), [mean])
            else:
                merged = mean.clone()
            out[k] = merged.to(self._dtypes[k])
        return out
