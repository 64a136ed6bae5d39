"""Federated (client-side) evaluation, shared by the strategies.

Each evaluation round sends the current model to ``k = max(floor(fraction * N), min_nodes)``
of the ``N`` candidate nodes (capped at ``N``; drawn with the strategy's seeded generator from
the candidates in the caller's order: the graph strategies give them in vertex order, so a
resumed run, whose nodes have new ids, samples the same vertices; the generator's state is
in the checkpoint, :meth:`FederatedEvaluation.rng_state`) and aggregates the replies' scalar metrics as

    m = sum_i w_i m_i / sum_i w_i,   w_i = num-examples_i

over the replies that pass :class:`~flwr_isoloco.strategies.core.replies.ReplyValidator` (error
replies, missing or invalid weights are dropped and named), or with the app's
``evaluate_metrics_aggr_fn(list[RecordDict], weighted_by_key)`` as in FedAvg.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.metrics import metric_record, weighted_mean_metrics
from flwr_isoloco.strategies.core.replies import ReplyValidator

if TYPE_CHECKING:
    from flwr_isoloco.strategies.core.stream import ReplyStream

__all__ = [
    "FederatedEvaluation",
    "check_fraction",
    "check_count",
    "evaluation_round",
    "rng_from_json",
    "rng_to_json",
]

AggrFn = Callable[[list[RecordDict], str], MetricRecord]


def check_fraction(name: str, value: object) -> float:
    """``value`` as a float in [0, 1], or ``ValueError`` naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``, or ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def rng_to_json(rng: random.Random) -> list:
    """``rng``'s state as JSON: ``[version, [625 ints], gauss]`` (``random.getstate``)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_json(value: object) -> random.Random:
    """A generator in the state :func:`rng_to_json` wrote; ``ValueError`` for anything else
    (a checkpoint is hostile input: ``random.setstate`` checks the length and the types)."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"not a generator state [version, state, gauss]: {str(value)[:60]}")
    version, internal, gauss = value
    if not isinstance(internal, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in internal
    ):
        raise ValueError("generator state: the internal state must be a list of ints")
    rng = random.Random()
    try:
        rng.setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"not a valid generator state ({exc})") from None
    return rng


class FederatedEvaluation:
    """Sample nodes, send the model, aggregate the metrics (module docstring)."""

    def __init__(
        self,
        fraction: float,
        min_nodes: int,
        *,
        seed: int = 0,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        weighted_by_key: str = "num-examples",
        aggr_fn: AggrFn | None = None,
        what: str = "aggregate_evaluate",
    ) -> None:
        self.fraction = check_fraction("fraction_evaluate", fraction)
        self.min_nodes = 0 if self.fraction == 0 else check_count("min_evaluate_nodes", min_nodes)
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.weighted_by_key = weighted_by_key
        self.aggr_fn = aggr_fn
        self.validator = ReplyValidator(
            arrayrecord_key=arrayrecord_key,
            weighted_by_key=weighted_by_key,
            require_arrays=False,
            what=what,
        )
        self.ledger = SentLedger()
        self._rng = random.Random(seed)

    def sample_size(self, available: int) -> int:
        """``min(max(floor(fraction * available), min_nodes), available)``."""
        return min(max(int(available * self.fraction), self.min_nodes), available)

    def configure(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int]
    ) -> list[Message]:
        """EVALUATE messages with ``arrays`` for a seeded sample of ``nodes``, drawn in the
        order given (a deterministic one: the graph strategies' vertex order)."""
        if self.fraction == 0.0 or not nodes:
            return []
        chosen = self._rng.sample(list(nodes), self.sample_size(len(nodes)))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        msgs = [
            Message(content=record, message_type=MessageType.EVALUATE, dst_node_id=n)
            for n in chosen
        ]
        return self.ledger.remember(msgs)

    def rng_state(self) -> list:
        """The sampling generator's state, JSON-able (:func:`rng_to_json`), for checkpoints."""
        return rng_to_json(self._rng)

    def load_rng_state(self, value: object) -> None:
        """Restore :meth:`rng_state` (``ValueError`` on anything else; nothing set then)."""
        self._rng = rng_from_json(value)

    def aggregate(self, replies: Iterable[Message]) -> MetricRecord | None:
        """Weighted mean of the valid replies' metrics (never raises on a bad reply)."""
        return aggregate_metrics(self.validator, replies, self.ledger, self.aggr_fn)


def aggregate_metrics(
    validator: ReplyValidator,
    replies: Iterable[Message],
    ledger: SentLedger,
    aggr_fn: AggrFn | None,
) -> MetricRecord | None:
    """Evaluation metrics of the valid replies, plus ``replies-used`` / ``replies-rejected``."""
    checked, report = validator.validate(replies, None, ledger)
    if not checked:
        return None
    key = validator.weighted_by_key
    if aggr_fn is not None:
        metrics = dict(aggr_fn([r.content for r in checked], key))
    else:
        metrics = weighted_mean_metrics(checked, exclude=[key])
    metrics.update({"replies-used": report.used, "replies-rejected": report.rejected})
    return metric_record(metrics)


def evaluation_round(
    stream: ReplyStream,
    grid: Grid,
    messages: Iterable[Message],
    aggregate: Callable[[int, list[Message]], MetricRecord | None],
    *,
    server_round: int,
    timeout: float | None,
    quorum: float | int | None = None,
    grace_s: float = 0.0,
) -> MetricRecord | None:
    """One federated evaluation round: push ``messages``, take the replies as they arrive
    (``stream``, with ``quorum`` / ``grace_s``), ``aggregate(server_round, replies)`` and add
    the wait's ``replies-arrived`` / ``replies-late`` / ``wait-s``.

    A round that sends no message (``fraction_evaluate=0``, no node sampled or listed) is no
    round: nothing is pushed, pulled, waited for or logged, and the result is None."""
    messages = list(messages)
    if not messages:
        return None
    replies: list[Message] = []
    wait = stream.run(
        grid,
        messages,
        replies.append,
        server_round=server_round,
        timeout=timeout,
        quorum=quorum,
        grace_s=grace_s,
    )
    del messages
    metrics = aggregate(server_round, replies)
    return None if metrics is None else MetricRecord({**metrics, **wait.as_metrics()})
