"""Streaming merge for rules that only need the weighted sum (mean, iso_c, iso_c_ns).

A server folds each worker's delta into one fp32 running sum as its reply arrives, so the extra
memory is one model copy (plus one tensor's temporaries when finishing), whatever the number of
workers M: ``result = transform(sum_i w_i d_i / sum_i w_i)`` per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .rules import MergeRule, check_options, resolve_rule, rule_applies
from .validation import check_delta, check_weight

__all__ = ["StreamingMerger"]


class StreamingMerger:
    """``add(delta, weight)`` one worker at a time, then ``result()``.

    A bad delta or weight raises ``ValueError`` (naming the worker index, i.e. the number of
    earlier ``add`` calls, and the key) and leaves the running sum untouched, so the caller can
    drop that reply and go on.
    """

    def __init__(self, rule: str | MergeRule, **options) -> None:
        self.rule = resolve_rule(rule)
        if not self.rule.streaming:
            raise ValueError(
                f"merge rule {self.rule.name!r} needs every worker's delta at once; use merge()"
            )
        self._options, self._pattern = check_options(self.rule, options)
        self._sum: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, torch.Size] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.num_added = 0
        self.total_weight = 0.0

    def add(self, delta: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """Fold ``weight * delta`` into the running sum (after checking all of it)."""
        worker = self.num_added
        w = check_weight(weight, worker)
        check_delta(delta, worker, self._shapes)
        if self._shapes is None:
            self._shapes = {k: t.shape for k, t in delta.items()}
            self._dtypes = {k: t.dtype for k, t in delta.items()}
            cdt = {
                k: torch.float64 if t.dtype == torch.float64 else torch.float32
                for k, t in delta.items()
            }
            self._sum = {k: t.detach().to(cdt[k]) * w for k, t in delta.items()}
        elif w > 0:
            for k, acc in self._sum.items():
                acc.add_(delta[k].detach().to(device=acc.device, dtype=acc.dtype), alpha=w)
        self.num_added += 1
        self.total_weight += w

    def result(self) -> dict[str, torch.Tensor]:
        """The merged delta, each tensor in the dtype of the first delta's tensor."""
        if self.num_added == 0:
            raise ValueError("no deltas added: nothing to merge")
        if not self.total_weight > 0:
            raise ValueError("weights are all zero")
        out: dict[str, torch.Tensor] = {}
        for k, acc in self._sum.items():
            mean = acc / self.total_weight
            if self.rule.name != "mean" and rule_applies(k, mean, self._pattern):
                mean = self.rule.transform(mean, **self._options)
            out[k] = mean.to(self._dtypes[k])
        return out
