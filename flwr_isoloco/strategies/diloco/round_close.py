"""The close of a DiLoCo/IsoLoCo train round: one path for every way a round collects replies.

A round is a pipeline; the collectors differ only in its first stages::

    collect        synchronous / quorum (ReplyStream), asynchronous (AsyncRounds: K replies,
                   each against the model its node was sent), SecAgg+ (Flower's workflow: one
                   masked sum)
    check, fold    TrainRound.take (ReplyValidator, merge weight, RoundFold), or SecAgg+'s
                   aggregate checks
    merge          RoundFold.finish / the rule applied to the one aggregate  -> g, used
    ---------------------------------------------- RoundClose, the same for every collector
    step           outer step (params), the nodes' mean (buffers); a failure keeps the model
    release        the model record; central DP: the noised sum was formed (its norm published)
    account        DP accountant and journal (StrategyDP.account)
    report         reply counts and reasons, client metrics, DP metrics, the empty-round guard

So a guarantee of the close (DP charging, the empty-round guard, the counts logged and returned
agreeing) is written once, here, and a new collector inherits it by ending its round with
:meth:`RoundClose.step` and :meth:`RoundClose.close`. The strategy's per-round bookkeeping that
collectors share lives in a :class:`RoundBook`, a public object, not in the strategy's private
attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Protocol

from flwr.app import ArrayRecord
from flwr.common.logger import log

from flwr_isoloco.merging.device import is_out_of_memory
from flwr_isoloco.strategies.core.guard import EmptyRoundGuard
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.metrics import tensor_norm
from flwr_isoloco.strategies.core.replies import ReplyReport

__all__ = ["RoundBook", "RoundClose", "RoundHost"]


@dataclass
class RoundBook:
    """What a strategy remembers about its current round, shared by the collectors: which node
    each instruction went to (train and evaluate), the empty-round guard and the array bytes
    the last train messages carried."""

    guard: EmptyRoundGuard
    train_ledger: SentLedger = field(default_factory=SentLedger)
    eval_ledger: SentLedger = field(default_factory=SentLedger)
    bytes_down: int = 0


class RoundHost(Protocol):
    """What the close reads and calls of its strategy (public members only)."""

    book: RoundBook
    train_validator: Any
    dp: Any

    def outer_step(self, g: Mapping[str, Any]) -> None: ...
    def current_arrays(self) -> ArrayRecord: ...


class RoundClose:
    """The last stages of train round ``server_round`` of ``host`` (module docstring).

    ``report`` is the round's :class:`~flwr_isoloco.strategies.core.replies.ReplyReport`, which
    the collector filled while checking the replies."""

    def __init__(self, host: RoundHost, server_round: int, report: ReplyReport) -> None:
        self.host, self.server_round, self.report = host, server_round, report
        self.merged = False  # a g was formed: under central DP, a release

    def step(
        self, g: Mapping[str, Any] | None, used: list[Any], failure: str = "outer step failed"
    ) -> tuple[ArrayRecord | None, list[Any], dict[str, float]]:
        """``(new model, used, extra metrics)``: the outer step on ``g`` (None: nothing merged,
        model kept). A step that fails keeps the model and drops every used reply, named,
        unless the server ran out of memory (not the replies' fault: it raises)."""
        if g is None:
            return None, used, {}
        self.merged = True
        extra = {"pseudo-grad-norm": tensor_norm(g)}
        try:
            self.host.outer_step(g)
            return self.host.current_arrays(), used, extra
        except (ValueError, RuntimeError) as exc:
            if is_out_of_memory(exc):
                raise
            self.drop(used, f"{failure}, model kept: {exc}")
            return None, [], extra

    def drop(self, replies: Iterable[Any], why: str) -> None:
        """Count ``replies`` rejected for ``why`` (each logged with its node)."""
        for r in replies:
            self.host.train_validator.reject(self.report, r.node_id, why)

    def close(
        self,
        used: list[Any],
        metrics: Mapping[str, Any],
        empty_reasons: list[str] | None = None,
    ) -> dict[str, Any]:
        """Account, log and report the round; ``metrics`` (the collector's: client metrics,
        timings, bytes) come first, then the counts, then the DP figures. Raises
        :class:`~flwr_isoloco.strategies.core.guard.NoProgressError` after too many empty
        rounds (``empty_reasons``: why this one used nothing, default the rejections)."""
        host, report = self.host, self.report
        sent = host.book.train_ledger.sent_any()
        # central DP: a formed g is a release whether or not the step took (its norm is out)
        host.dp.account(released=self.merged, sent=sent)
        report.used = len(used)
        host.train_validator.log_summary(report, self.server_round)
        if not used:
            log(
                WARNING,
                "aggregate_train: no usable reply in round %d, model kept",
                self.server_round,
            )
        out = {**metrics, **report.as_metrics(), **host.dp.metrics()}
        if sent:
            reasons = [why for _, why in report.reasons] if empty_reasons is None else empty_reasons
            host.book.guard.record(self.server_round, report.used, reasons)
        return out
