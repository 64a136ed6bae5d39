"""Metric helpers shared by the strategies: weighted means of the replies' metrics, the train
round's client metrics (:func:`train_client_metrics`, the one epilogue of the plain and the
SecAgg+ round), the one update norm (:func:`tensor_norm`, fp64) and a MetricRecord without
non-finite values."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from flwr.app import MetricRecord, RecordDict

__all__ = ["metric_record", "tensor_norm", "train_client_metrics", "weighted_mean_metrics"]


class WeightedMetrics(Protocol):
    """What :func:`weighted_mean_metrics` reads of a reply (a :class:`~.replies.CheckedReply`)."""

    weight: float
    metrics: Mapping[str, float]


def weighted_mean_metrics(
    replies: Iterable[WeightedMetrics],
    exclude: Iterable[str] = (),
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """``m_k = sum_i w_i m_ik / sum_i w_i`` for each scalar client metric ``k``, over the replies
    that report it; ``w_i = weights[i]`` when given (the merge weights), else ``reply.weight``."""
    replies = list(replies)
    ws = [r.weight for r in replies] if weights is None else list(weights)
    if len(ws) != len(replies):
        raise ValueError(f"{len(ws)} weights for {len(replies)} replies")
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}
    skip = set(exclude)
    for r, w in zip(replies, ws, strict=True):
        for k, v in r.metrics.items():
            if k in skip:
                continue
            sums[k] = sums.get(k, 0.0) + w * v
            totals[k] = totals.get(k, 0.0) + w
    return {k: sums[k] / totals[k] for k in sums if totals[k] > 0}


class ContentReply(WeightedMetrics, Protocol):
    """A used train reply: its weight, metrics and the RecordDict an app's aggr_fn reads."""

    content: RecordDict


def train_client_metrics(
    replies: Sequence[ContentReply],
    weights: Sequence[float],
    weighted_by_key: str,
    aggr_fn: Callable[[list[RecordDict], str], Any] | None,
    exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """The client metrics of a train round, over the replies that entered the model.

    With the app's ``aggr_fn`` (FedAvg's ``train_metrics_aggr_fn``): ``aggr_fn([reply
    contents], weighted_by_key)``, as Flower calls it. Otherwise the mean of every scalar
    metric weighted by each reply's *merge* weight ``weights[i]`` (after the weight bound, or
    1 when weighting is uniform), not its self-reported ``weighted_by_key``: one site that
    claims a huge ``num-examples`` then owns a round's ``train-loss`` no more than its model.
    ``weighted_by_key`` and ``exclude`` are left out of the default mean."""
    if aggr_fn is not None and replies:
        return dict(aggr_fn([r.content for r in replies], weighted_by_key))
    return weighted_mean_metrics(replies, exclude=[weighted_by_key, *exclude], weights=weights)


def tensor_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """Global L2 norm of a dict of tensors, accumulated in fp64 (finite for any finite fp32 input)."""
    return math.sqrt(
        sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in tensors.values())
    )


def metric_record(values: Mapping[str, float | int]) -> MetricRecord:
    """A MetricRecord from plain numbers (drops non-finite values, which Flower would print)."""
    return MetricRecord({k: v for k, v in values.items() if math.isfinite(float(v))})
