"""The rarely changed arguments of :class:`~flwr_isoloco.strategies.DiLoCo` and
:class:`~flwr_isoloco.strategies.IsoLoCo`, one settings object per concern, so the constructor
takes one argument for each group:

- ``merge_settings=MergeSettings(...)``: how the merge rule runs (its options, whether it acts
  on the merged gradient or the outer update, on which device, which tensors are buffers).
- ``records=Records(...)``: where the strategy reads and writes in Flower's records, and how it
  aggregates the nodes' metrics (the FedAvg arguments of the same names).

Like the classes of :mod:`~flwr_isoloco.strategies.diloco.settings`, each is frozen and checks
its fields when built (``ValueError`` naming the field) and its repr shows the fields not at
their default (:func:`~flwr_isoloco.settings_tools.short_repr`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from flwr_isoloco.merging.buffers import check_buffers_spec
from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.settings_tools import short_repr

__all__ = ["ORTHOGONALIZE", "MergeSettings", "Records"]

ORTHOGONALIZE = ("gradient", "update")
"""Where the merge rule acts (:attr:`MergeSettings.orthogonalize`)."""

MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


@short_repr
@dataclass(frozen=True)
class MergeSettings:
    """How the merge rule runs.

    ``options``: the rule's options (None: none; ``prune_fraction``, ``drop_rate``, ``ns_steps``...; DARE's
    seed is the strategy's ``seed``), checked against the rule by the strategy.
    ``orthogonalize``: ``"gradient"``, the rule merges ``g``; or ``"update"``, ``g`` is the
    weighted mean and the rule (``iso_c``, ``iso_c_ns``) applies to the outer update ``u``
    after momentum. ``device``: where the merge computes (``"auto"``: CUDA if available, else
    the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``); results stay on the CPU.
    ``buffers``: the float tensors not trained by gradients (BatchNorm statistics), merged as
    FedAvg does (weighted mean; no rule, no outer step): ``"auto"`` (``running_*`` and the
    like), ``"none"``, a regex, names, a callable ``(name, tensor) -> bool`` or an nn.Module.
    """

    options: Mapping[str, Any] | None = None
    orthogonalize: str = "gradient"
    device: str | torch.device = "auto"
    buffers: str | Sequence[str] | Callable[[str, torch.Tensor], bool] | torch.nn.Module = "auto"

    def __post_init__(self) -> None:
        if self.options is not None:
            if not isinstance(self.options, Mapping):
                raise ValueError(f"MergeSettings.options must be a mapping, got {self.options!r}")
            object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if self.orthogonalize not in ORTHOGONALIZE:
            raise ValueError(
                f"MergeSettings.orthogonalize must be one of {ORTHOGONALIZE}, "
                f"got {self.orthogonalize!r}"
            )
        parse_device(self.device, "MergeSettings.device")  # spelling; the strategy resolves it
        object.__setattr__(self, "buffers", check_buffers_spec(self.buffers))

    def __hash__(self) -> int:
        options = tuple(sorted((self.options or {}).items()))
        return hash((options, self.orthogonalize, str(self.device)))


@short_repr
@dataclass(frozen=True)
class Records:
    """Flower's record keys and metric aggregation, as in ``flwr.serverapp.strategy.FedAvg``.

    ``weighted_by_key``: the MetricRecord entry that weighs a reply (``num-examples``).
    ``arrayrecord_key`` / ``configrecord_key``: the keys of the model and the config in the
    messages. ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``: ``fn(contents,
    weighted_by_key) -> MetricRecord`` for the replies' metrics (None: the weighted mean).
    """

    weighted_by_key: str = "num-examples"
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    train_metrics_aggr_fn: MetricsAggrFn | None = None
    evaluate_metrics_aggr_fn: MetricsAggrFn | None = None
