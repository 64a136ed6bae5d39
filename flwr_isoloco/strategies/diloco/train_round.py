"""One DiLoCo/IsoLoCo train round, fed reply by reply: check, weigh, fold, then the outer step.

:class:`TrainRound` is the one path of a train reply in DiLoCo and IsoLoCo, whether the replies
come one at a time from :class:`~flwr_isoloco.strategies.core.stream.ReplyStream` or as Flower's list
(``aggregate_train``)::

    take(reply):  ReplyValidator.check -> merge weight -> RoundFold.add -> strip the arrays
    finish():     norm-ratio filter -> weights -> RoundFold.finish -> outer step -> metrics

Nothing is kept of a reply but its metrics once its delta is folded (a streaming rule) or
spilled to the round's private directory (any other rule, or a round that needs every weight
or norm first), so server memory does not grow with the number of replies.

Weight bound (``max_weight_ratio = r``, the repository's ``docs/strategies.md`` ("DiLoCo / IsoLoCo strategies") "Weight bound"). A reply's merge
weight is ``min(w_i, r * m)`` where ``m`` is the *reference weight*: the median raw weight of the
replies used in the last round that used any (kept in the checkpoint). A round without a
reference (the first, or one after a resume from an older checkpoint) uses its own median, as a
two-pass merge would: its deltas are spilled and merged when the round closes.

Asynchronous rounds (:mod:`~flwr_isoloco.strategies.diloco.asynchronous`) pass ``per_reply``:
each reply is then checked against the model its node was sent (``per_reply.base(msg)``), and
the reply :meth:`per_reply.adopt <flwr_isoloco.strategies.diloco.asynchronous.AsyncRounds.adopt>`
returns carries its ``discount`` ``s(tau)``: its merge weight is the bounded weight times
``s(tau)``, and ``g`` is scaled by ``rho = sum_i w_i s_i / sum_i w_i`` (``w_i`` the bounded
weights), so that a step of stale replies moves the model less; buffer keys (BatchNorm
statistics, :mod:`~flwr_isoloco.merging.buffers`) are taken against the current model and
not scaled, so they become the weighted mean of the values the nodes reported. Without
``per_reply`` none of this runs (synchronous rounds, bit for bit as before).
"""

from __future__ import annotations

import statistics
import time
from logging import WARNING
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from flwr_isoloco.merging.device import is_out_of_memory
from flwr_isoloco.merging.fold import RoundFold
from flwr_isoloco.merging.weights import bounded_weights
from flwr_isoloco.strategies.core.metrics import metric_record, train_client_metrics
from flwr_isoloco.strategies.core.replies import CheckedReply, Rejection, ReplyReport
from flwr_isoloco.strategies.diloco import downloads
from flwr_isoloco.strategies.diloco.round_close import RoundClose, RoundHost
from flwr_isoloco.strategies.diloco.setup import buffer_keys, effective_weighting

if TYPE_CHECKING:
    from flwr_isoloco.strategies.core.stream import RoundWait

__all__ = ["RoundStrategy", "TrainRound"]


class RoundStrategy(RoundHost, Protocol):
    """What a train round reads and calls of its strategy (DiLoCo, IsoLoCo): public members
    only. A protocol, not an import of ``diloco``: that module builds the round, so the round
    must not import it."""

    theta: dict[str, Any] | None
    train_validator: Any
    merger: Any
    dp: Any
    robust: Any
    weighting: str
    weighted_by_key: str
    max_weight_ratio: float
    weight_reference: float | None
    train_metrics_aggr_fn: Any


def merge_weight(s: RoundStrategy, reply: CheckedReply) -> float:
    """A reply's weight in the merge: its own (bounded) weight, or 1 under uniform weighting."""
    return 1.0 if effective_weighting(s) == "uniform" else reply.weight


class TrainRound:
    """The train round ``server_round`` of strategy ``s`` (module docstring)."""

    def __init__(self, s: RoundStrategy, server_round: int, per_reply: Any = None) -> None:
        assert s.theta is not None
        self.s, self.server_round = s, server_round
        self.per_reply = per_reply  # asynchronous rounds: each reply's own base and discount
        self.busy_s = 0.0  # server time spent on this round's replies (not waiting for them)
        self.report = ReplyReport()
        self.v = s.train_validator
        self.ratio = s.max_weight_ratio if s.weighting == "examples" else 0.0
        ref = s.weight_reference
        self.collect = bool(self.ratio) and ref is None  # weights bounded when the round closes
        self.cap = self.ratio * ref if self.ratio and ref is not None else None
        spill = self.collect or bool(self.v.max_norm_ratio)
        floats = [k for k, t in s.theta.items() if t.is_floating_point()]
        dp = s.dp.mechanism(server_round, s.book.train_ledger.count(), floats)  # None: DP off
        self.buffers = buffers = buffer_keys(s)  # merged as FedAvg does, outside the step
        # deltas against the model the workers trained from: B with compressed downloads
        self.base = downloads.train_base(getattr(s, "broadcast", None), s.theta)
        self.fold = RoundFold(
            s.merger, self.base, server_round, spill=spill, dp=dp, buffers=buffers
        )
        b = getattr(s, "broadcast", None)
        self.uploads: dict[int, Any] | None = {} if b is not None and b.exact else None
        self.taken: list[CheckedReply] = []
        self.answered: set[str] = set()
        self._w: dict[int, float] = {}  # id(reply) -> merge weight
        self._bounded: dict[int, float] = {}  # id(reply) -> weight before s(tau) (per_reply)

    # ------------------------------------------------------------------ per reply
    def take(self, msg: Message) -> None:
        """Check ``msg``, fold (or spill) its delta and keep only its metrics. Never raises."""
        t0 = time.perf_counter()
        try:
            self._take(msg)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _take(self, msg: Message) -> None:
        self.answered.add(msg.metadata.reply_to_message_id)
        s, v = self.s, self.v
        if getattr(s, "broadcast", None) is not None:  # compressed downloads: the node's copy
            s.broadcast.note(s.book.train_ledger.sender(msg), msg)
        base = self.base if self.per_reply is None else self.per_reply.base(msg)
        r = v.check(msg, base, s.book.train_ledger, self.report)
        if isinstance(r, Rejection):
            return
        if self.per_reply is not None:
            r = self.per_reply.adopt(r, msg, self.buffers)
        why = s.dp.reply_problem(r.content)  # local DP: the reply must say it applied it
        if why is not None:
            r.release()
            v.reject(self.report, r.node_id, why)
            return
        w = self._discounted(r, self._capped(r))
        try:
            self.fold.add(r, w)
        except (ValueError, RuntimeError) as exc:
            r.release()
            if is_out_of_memory(exc):  # the server's memory, not this reply's data
                raise
            v.reject(self.report, r.node_id, f"merge refused this delta: {exc}")
            return
        if self.uploads is not None:  # exact downloads send the used replies' own records
            self.uploads[id(r)] = r.content.array_records.get(r.arrayrecord_key)
        r.strip()
        self._w[id(r)] = w
        self.taken.append(r)

    def _discounted(self, r: CheckedReply, w: float) -> float:
        """``w s(tau)`` for a reply with a staleness discount (asynchronous rounds), else ``w``."""
        if self.per_reply is None:
            return w
        self._bounded[id(r)] = w
        return w * r.discount

    def reject(self, node: int, why: str) -> None:
        """Drop a reply before it is checked (an asynchronous round's stale reply), named."""
        self.v.reject(self.report, node, why)

    def _capped(self, r: CheckedReply) -> float:
        w = merge_weight(self.s, r)
        if self.cap is not None and w > self.cap:
            log(
                WARNING,
                "aggregate_train: node %d: weight %s=%.4g clipped to %.4g "
                "(max-weight-ratio %g x the previous round's median %.4g)",
                r.node_id,
                self.s.weighted_by_key,
                w,
                self.cap,
                self.ratio,
                self.s.weight_reference,
            )
            return self.cap
        return w

    # ------------------------------------------------------------------ end of round
    def _bound_now(self, keep: list[CheckedReply]) -> None:
        """The round's own median bound (a round without a reference weight)."""
        raw = [merge_weight(self.s, r) for r in keep]
        bounded, clipped = bounded_weights(raw, self.ratio)
        for i in clipped:
            log(
                WARNING,
                "aggregate_train: node %d: weight %s=%.4g clipped to %.4g "
                "(max-weight-ratio %g x the round's median)",
                keep[i].node_id,
                self.s.weighted_by_key,
                raw[i],
                bounded[i],
                self.ratio,
            )
        self._w.update({id(r): self._discounted(r, w) for r, w in zip(keep, bounded, strict=True)})

    def finish(self, wait: RoundWait | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
        """Merge, outer step, metrics (the counts logged and returned agree).

        ``aggregation-time-s`` is the server's own time on the round: checking and folding each
        reply as it arrived plus this merge and outer step (the wait is ``wait-s``)."""
        t0 = time.perf_counter()
        s, v, report = self.s, self.v, self.report
        v.count_missing(s.book.train_ledger.unanswered(self.answered), report)
        keep = sorted(self.taken, key=lambda r: (r.digest, r.node_id))
        if v.max_norm_ratio:
            keep = v.norm_filter(keep, report)
        if self.collect:
            self._bound_now(keep)
        g, checked = self.fold.finish(
            keep,
            lambda r: self._w[id(r)],
            reject=lambda r, why: v.reject(report, r.node_id, why),
            on_failure=lambda exc: log(
                WARNING, "aggregate_train: merge failed (%s); checking replies one by one", exc
            ),
        )
        close, extra = RoundClose(s, self.server_round, report), {}
        self._log_left_out(g is not None)
        if g is not None and self.per_reply is not None:
            g, extra["staleness-scale"] = self._stale_scaled(g, checked)
        kept = getattr(self.fold.robust, "last_kept", None)  # the choosing rules set it
        if g is not None and kept is not None:
            extra["robust-kept"] = len(kept)
        if g is not None and self.uploads is not None:
            w = [self._w[id(r)] for r in checked]
            downloads.exact_record(s, checked, w, self.uploads, self.buffers)
        new_arrays, checked, stepped = close.step(g, checked)
        del g
        if checked and self.ratio:
            s.weight_reference = statistics.median(merge_weight(s, r) for r in checked)
        metrics = close.close(
            checked,
            {
                **self._client_metrics(checked),
                **extra,
                **stepped,
                **(wait.as_metrics() if wait is not None else {}),
                "spill-bytes": self.fold.spill_bytes,
                "bytes-down": s.book.bytes_down,
                "aggregation-time-s": self.busy_s + time.perf_counter() - t0,
            },
        )
        return new_arrays, metric_record(metrics)

    def _stale_scaled(self, g: dict[str, Any], used: list[Any]) -> tuple[dict[str, Any], float]:
        """``(rho g, rho)``, ``rho = sum_i w_i s_i / sum_i w_i`` over the used replies (``w_i``
        the bounded weights): the mean discount of the replies (module docstring). Buffer keys
        stay unscaled: their ``g`` is ``theta - mean``, the weighted mean of the reported
        values, and ``rho`` times it would leave that mean."""
        total = sum(self._bounded[id(r)] for r in used)
        rho = sum(self._w[id(r)] for r in used) / total if total > 0 else 1.0
        if rho == 1.0:
            return g, 1.0
        return {k: v if k in self.buffers else v * rho for k, v in g.items()}, rho

    def _log_left_out(self, merged: bool) -> None:
        """Name the nodes whose update the robust rule did not choose (they stay 'used': they
        passed every check; the rule decided, as a median decides, what counts)."""
        if merged and self.fold.left_out:
            log(
                WARNING,
                "aggregate_train: round %d: robust=%s left out node(s) %s",
                self.server_round,
                self.s.robust,
                ", ".join(str(r.node_id) for r in self.fold.left_out),
            )

    def _client_metrics(self, checked: list[CheckedReply]) -> dict[str, Any]:
        """:func:`~.metrics.train_client_metrics`, weighted by the bounded merge weights."""
        s = self.s
        weights = [self._w[id(r)] for r in checked]
        return train_client_metrics(checked, weights, s.weighted_by_key, s.train_metrics_aggr_fn)

    def close(self) -> None:
        """Remove the spill directory (also when the round failed)."""
        self.fold.close()
