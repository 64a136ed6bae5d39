"""Metric helpers shared by the strategies: reply bytes and metrics, weighted means, the one
update norm (:func:`tensor_norm`, fp64) and a MetricRecord without non-finite values."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from flwr.app import Message, MetricRecord, RecordDict

from flwr_isoloco.compression import payload_nbytes

if TYPE_CHECKING:
    from .common import CheckedReply

__all__ = ["metric_record", "reply_metrics", "reply_nbytes", "tensor_norm", "weighted_mean_metrics"]


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def reply_nbytes(msg: Message) -> int:
    """Array bytes a reply carried (:func:`~flwr_isoloco.compression.payload_nbytes`), 0 if none."""
    if msg.has_error() or not msg.has_content():
        return 0
    return sum(payload_nbytes(r) for r in msg.content.array_records.values())


def reply_metrics(content: RecordDict) -> dict[str, float]:
    """Scalar numeric metrics of every MetricRecord in a reply (lists skipped)."""
    out: dict[str, float] = {}
    for rec in content.metric_records.values():
        for k, v in rec.items():
            if _is_number(v) and math.isfinite(float(v)):
                out[k] = float(v)
    return out


def weighted_mean_metrics(
    replies: Iterable[CheckedReply], exclude: Iterable[str] = ()
) -> dict[str, float]:
    """Weighted mean of each scalar client metric, over the replies that report it."""
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}
    skip = set(exclude)
    for r in replies:
        for k, v in r.metrics.items():
            if k in skip:
                continue
            sums[k] = sums.get(k, 0.0) + r.weight * v
            totals[k] = totals.get(k, 0.0) + r.weight
    return {k: sums[k] / totals[k] for k in sums if totals[k] > 0}


def tensor_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """Global L2 norm of a dict of tensors, accumulated in fp64 (finite for any finite fp32 input)."""
    return math.sqrt(
        sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values())
    )


def metric_record(values: Mapping[str, float | int]) -> MetricRecord:
    """A MetricRecord from plain numbers (drops non-finite values, which Flower would print)."""
    return MetricRecord({k: v for k, v in values.items() if math.isfinite(float(v))})
