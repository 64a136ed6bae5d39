"""The FedAvg-LoRA baseline: Flower's own FedAvg, run by flwr-isoloco's lifecycle.

:class:`FedAvgBaseline` is ``flwr.serverapp.strategy.FedAvg`` (same sampling with Python's
global ``random``, same aggregation) under
:class:`~flwr_isoloco.strategies.core.lifecycle.ResumableStrategy`: it resumes with global round
numbers and calls the app's ``on_round_end`` hook like RW-LoRA and gossip. It also keeps the
ledger the app reports: array bytes each way, local steps, and each reply's metrics
(``partition-id``, ``data-cursor``, ``train_loss``); :meth:`~FedAvgBaseline.state_dict` holds
the arrays and the ledger's totals for the app's checkpoint. Client metrics are untrusted: a reply
whose metrics fail :func:`~flwr_isoloco.strategies.core.wire.check_train_metrics` is logged with its
node and not recorded (FedAvg itself still aggregates it, as Flower does).
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flwr_isoloco.checkpoint import CheckpointError, check_tensors
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.lifecycle import ResumableStrategy, RoundOutcome
from flwr_isoloco.strategies.core.replies import reply_metrics
from flwr_isoloco.strategies.core.wire import check_train_metrics

__all__ = ["FedAvgBaseline", "array_bytes"]


def array_bytes(msg: Message) -> int:
    """Bytes of every array a message carries (as serialised by Flower)."""
    if not msg.has_content():
        return 0
    return sum(len(a.data) for rec in msg.content.array_records.values() for a in rec.values())


class FedAvgBaseline(ResumableStrategy, FedAvg):
    """Flower's FedAvg with a resumable ``start`` and the app's ledger (module docstring)."""

    def __init__(self, *, local_steps: int, **fedavg_kwargs: Any) -> None:
        FedAvg.__init__(self, **fedavg_kwargs)
        self.local_steps = local_steps
        self.arrays: ArrayRecord | None = None
        self.round = 0
        self.bytes_relayed = 0
        self.local_updates = 0
        self.round_replies: list[tuple[int, dict[str, float]]] = []
        self.round_failures = 0
        self._ledger = SentLedger()

    @property
    def completed_rounds(self) -> int:
        return self.round

    @property
    def bytes_p2p(self) -> int:
        """Peer-to-peer bytes: a star deployment sends exactly what the server relays."""
        return self.bytes_relayed

    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"arrays": ...}, "meta": {"round", "bytes-relayed", "local-updates"}}``."""
        arrays = self.current_arrays().to_torch_state_dict()
        meta = {
            "round": self.round,
            "bytes-relayed": self.bytes_relayed,
            "local-updates": self.local_updates,
        }
        return {"tensors": {"arrays": arrays}, "meta": meta}

    def load_state_dict(self, sd: dict[str, Any], *, reference: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the arrays must match ``reference`` (names, shapes,
        dtypes) and the counters be ints >= 0, else CheckpointError / ValueError."""
        check_tensors(sd["tensors"].get("arrays"), reference, "arrays")
        meta = sd["meta"]
        for key in ("round", "bytes-relayed", "local-updates"):
            v = meta.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CheckpointError(f"field {key!r} must be an int >= 0, got {v!r}")
        self.arrays = ArrayRecord(sd["tensors"]["arrays"])
        self.round, self.bytes_relayed = meta["round"], meta["bytes-relayed"]
        self.local_updates = meta["local-updates"]

    def current_arrays(self) -> ArrayRecord:
        return self.arrays if self.arrays is not None else ArrayRecord()

    def prepare(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        if self.arrays is None:
            self.arrays = initial_arrays

    def run_round(
        self,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        timeout: float,
    ) -> RoundOutcome:
        self.round_replies, self.round_failures = [], 0
        out = super().run_round(grid, server_round, train_config, evaluate_config, timeout)
        if out.arrays is not None:
            self.arrays = out.arrays
        self.round = server_round
        return out

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        msgs = self._ledger.remember(
            FedAvg.configure_train(self, server_round, arrays, config, grid)
        )
        self.bytes_relayed += sum(array_bytes(m) for m in msgs)
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        for r in replies:
            self.bytes_relayed += array_bytes(r)
            if r.has_error():
                self.round_failures += 1
                continue
            node = self._ledger.sender(r)
            why = check_train_metrics(r.content, asked_steps=self.local_steps)
            if why is not None:
                log(WARNING, "fedavg: node %d: %s; reply metrics not recorded", node, why)
                continue
            metrics = reply_metrics(r.content)
            self.local_updates += int(metrics.get("local-steps", 0))
            self.round_replies.append((node, metrics))
        return FedAvg.aggregate_train(self, server_round, replies)
