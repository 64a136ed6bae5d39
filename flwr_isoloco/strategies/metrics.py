"""Metric helpers shared by the strategies: weighted means of the replies' metrics, the one
update norm (:func:`tensor_norm`, fp64) and a MetricRecord without non-finite values."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from flwr.app import MetricRecord

__all__ = ["metric_record", "tensor_norm", "weighted_mean_metrics"]


class WeightedMetrics(Protocol):
    """What :func:`weighted_mean_metrics` reads of a reply (a :class:`~.replies.CheckedReply`)."""

    weight: float
    metrics: Mapping[str, float]


def weighted_mean_metrics(
    replies: Iterable[WeightedMetrics], exclude: Iterable[str] = ()
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
