"""A round's reply stream: replies taken as they arrive, with a quorum and a grace window.

Flower's ``grid.send_and_receive`` returns every reply of a round in one list, so a server holds
``M`` replies at once and waits for the slowest node. :class:`ReplyStream` pushes the round's
messages (``grid.push_messages``), then pulls the replies that have arrived
(:class:`~flwr_isoloco.strategies.core.pull.Puller`: as many ids per call as keep the replies
held at once under 1 GiB or one reply, a call never waited for past the round's deadline) and
hands each to ``on_reply`` at once, so the caller can fold it and drop it. The round closes when

- every sampled node has replied; or
- the quorum is in (``quorum``: a fraction of the sent messages in (0, 1], rounded up, or a
  count >= 1) and ``grace_s`` seconds passed since it was reached; or
- ``timeout`` seconds passed since the push (Flower's overall cap). A pull that blocks (Flower's
  grid waits up to ~3 minutes for the objects of an upload a dead SuperNode never completed)
  holds neither the round nor the other replies: its ids go on without it and, if it has not
  returned when the round closes, its node is named late.

``on_reply`` may return a message to send in the reply's place, to the same node within the round
(a node that refused a compressed download and asks for the full model): the stream pushes it at
once and waits for its reply as for the original's; the reply it replaces does not count as
arrived.

Messages still unanswered when a round closes are remembered with their round: their ids are
pulled with the next rounds' and a reply that still comes is discarded and logged with its node
("late reply ... discarded"), never handed to a later round (a reply is recognised by the id of
the message it answers, ``reply_to_message_id``). A node left out is logged as late with why the
round closed (its quorum, or the timeout); a NODE_UNAVAILABLE error that comes after the close
(the SuperLink's answer for a dead node) is logged as a lost node (``lost``), not a late reply. A
second reply to a message already answered (a replayed delivery) is refused and named
(``duplicates``): no reply is handed on twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.strategies.core.ledger import node_gone
from flwr_isoloco.strategies.core.pull import POLL_S, Puller
from flwr_isoloco.strategies.core.reply import reply_nbytes

__all__ = [
    "ONE_IS_AMBIGUOUS",
    "ReplyStream",
    "RoundWait",
    "check_quorum",
    "quorum_arg",
    "quorum_count",
]

OnReply = Callable[[Message], "Message | None"]
"""Takes one reply; returns None, or a message to push in its place (module docstring)."""

STALE_ROUNDS = 3
"""Unanswered messages of a closed round are pulled (and their replies discarded) this long."""


ONE_IS_AMBIGUOUS = (
    "quorum=1 is ambiguous: the int count closes a round on one reply, while quorum = 1 in a "
    "run config (and the fraction 1.0) waits for every reply; write quorum=None (or 1.0) for "
    "every reply, or a count >= 2"
)


def check_quorum(quorum: object, grace_s: object) -> tuple[float | int | None, float]:
    """``(quorum, grace_s)`` checked: quorum None (all), a float in (0, 1] or an int count
    >= 2 (a whole float above 1 is that count; the int 1 is refused, :data:`ONE_IS_AMBIGUOUS`);
    ``grace_s`` a finite number >= 0. ``ValueError`` naming the bad one."""
    q = quorum
    bad = f"quorum must be a fraction in (0, 1] or a count >= 2, got {quorum!r}"
    if isinstance(q, bool) or not (q is None or isinstance(q, (int, float))):
        raise ValueError(bad)
    if type(q) is int and q == 1:
        raise ValueError(ONE_IS_AMBIGUOUS)
    if isinstance(q, float) and q > 1 and q == int(q):
        q = int(q)
    if (isinstance(q, float) and not (0 < q <= 1)) or (isinstance(q, int) and q < 2):
        raise ValueError(bad)
    g = grace_s
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 <= g < math.inf):
        raise ValueError(f"grace_s must be a finite number >= 0, got {grace_s!r}")
    return q, float(g)


def quorum_arg(value: float | int) -> float | int | None:
    """A run config's ``quorum`` key as the constructor's ``quorum=``: 1 or 1.0 (the default:
    every reply) is None, a whole number above 1 the int count, any other value as given
    (:func:`check_quorum` checks it). One value, one meaning, whichever way it is spelled."""
    if value == 1:
        return None
    if isinstance(value, float) and value > 1 and value.is_integer():
        return int(value)
    return value


def quorum_count(quorum: float | int | None, sent: int) -> int:
    """Replies that make the quorum of ``sent`` messages: all for None / 1.0,
    ``ceil(q * sent)`` for a fraction, ``min(q, sent)`` for a count."""
    if quorum is None:
        return sent
    if isinstance(quorum, float):
        return min(sent, math.ceil(quorum * sent - 1e-9))
    return min(int(quorum), sent)


@dataclass
class RoundWait:
    """How a round's wait went: the numbers behind ``replies-arrived``, ``replies-late``,
    ``wait-s``; ``late`` names the nodes whose reply was not in when the round closed."""

    sent: int = 0
    arrived: int = 0
    late: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    pull_calls: int = 0

    def as_metrics(self) -> dict[str, float | int]:
        """``replies-arrived``, ``replies-late``, ``wait-s``, ``pull-calls`` (SuperLink pull
        calls of the wait)."""
        return {
            "replies-arrived": self.arrived,
            "replies-late": len(self.late),
            "wait-s": self.wait_s,
            "pull-calls": self.pull_calls,
        }


class ReplyStream:
    """Push a round's messages and hand each reply to ``on_reply`` as it arrives (module doc).

    One per strategy (train and evaluate each have their own): it remembers the unanswered
    messages of closed rounds so that their late replies are discarded.
    """

    def __init__(self, what: str = "round", poll_s: float = POLL_S) -> None:
        self.what = what
        self.poll_s = poll_s
        self.puller = Puller()
        self._stale: dict[str, tuple[int, int]] = {}  # message id -> (node, round)
        self.discarded: list[tuple[int, int]] = []  # (node, round) of late replies dropped
        self.lost: list[tuple[int, int]] = []  # (node, round): NODE_UNAVAILABLE after close
        self.duplicates: list[tuple[int, int]] = []  # (node, round) of replayed replies refused
        self._taken: dict[str, tuple[int, int]] = {}  # message id -> (node, round) answered
        self._round, self._node_of = 0, {}

    def run(
        self,
        grid: Grid,
        messages: Iterable[Message],
        on_reply: OnReply,
        *,
        server_round: int,
        timeout: float | None,
        quorum: float | int | None = None,
        grace_s: float = 0.0,
    ) -> RoundWait:
        """Run one round's wait; ``on_reply(reply)`` for each reply of this round (a message
        it returns is pushed and its reply awaited in the reply's place).

        Time is ``time.monotonic`` / ``time.sleep``, or the grid's ``time_source`` (an object
        with ``monotonic()`` and ``sleep(s)``) when it has one: a test grid's virtual clock.
        """
        clock = getattr(grid, "time_source", None) or time
        for mid, (_, rnd) in list(self._stale.items()):
            if rnd < server_round - STALE_ROUNDS:
                del self._stale[mid]  # a node that never answers is not pulled for ever
        messages = list(messages)
        if messages:
            self.puller.reply_bytes = reply_nbytes(messages[0])
        calls0 = self.puller.calls
        node_of = {}
        ids = list(grid.push_messages(messages)) if messages else []
        for m, mid in zip(messages, ids, strict=False):
            if mid:
                node_of[mid] = m.metadata.dst_node_id
        del messages
        self._taken = {m: v for m, v in self._taken.items() if v[1] >= server_round - STALE_ROUNDS}
        self._round, self._node_of = server_round, node_of
        pending = list(node_of)
        wait = RoundWait(sent=len(pending))
        need = quorum_count(quorum, len(pending))
        t0 = clock.monotonic()
        quorum_at = None if pending else t0
        deadline = None if timeout is None else t0 + timeout
        while pending or self._stale:
            expired = deadline is not None and clock.monotonic() >= deadline
            took = self._sweep(grid, pending, on_reply, deadline, clock)
            wait.arrived += took
            now = clock.monotonic()
            if quorum_at is None and wait.arrived >= need:
                quorum_at = now
            if not pending or expired:
                break
            if quorum_at is not None and now - quorum_at >= grace_s:
                break
            if not took:
                clock.sleep(self.poll_s)
        wait.wait_s = clock.monotonic() - t0
        wait.pull_calls = self.puller.calls - calls0
        why = "the round closed on its quorum" if quorum_at is not None else "timeout"
        for mid in pending:
            node = node_of[mid]
            wait.late.append(node)
            self._stale[mid] = (node, server_round)
            log(
                WARNING,
                "%s (round %d): closed without the reply of node %d, late: %s (%d of %d arrived)",
                self.what,
                server_round,
                node,
                why,
                wait.arrived,
                wait.sent,
            )
        return wait

    def _sweep(
        self, grid: Grid, pending: list[str], on_reply: OnReply, deadline: float | None, clock
    ) -> int:
        """Pull every unanswered id (:class:`Puller`); returns this round's replies taken."""
        took = 0
        ids = list(self._stale) + list(pending)
        for replies in self.puller.pull(grid, ids, deadline, clock):
            while replies:
                took += self._route(grid, replies.pop(0), pending, on_reply)
        return took

    def _route(self, grid: Grid, msg: Message, pending: list[str], on_reply: OnReply) -> int:
        """Hand one pulled reply on (1 when it is one of this round's, taken)."""
        rid = msg.metadata.reply_to_message_id
        if rid in self._stale:
            self._discard(msg)
        elif rid in pending:
            pending.remove(rid)
            self._taken[rid] = (self._node_of.get(rid, -1), self._round)
            follow = on_reply(msg)
            if follow is None:
                return 1
            self._push_in_place(grid, follow, pending)
        elif rid in self._taken:
            self._duplicate(msg)
        else:
            log(WARNING, "%s: discarded a reply to an unknown message %r", self.what, rid)
        return 0

    def _push_in_place(self, grid: Grid, msg: Message, pending: list[str]) -> None:
        """Push ``msg`` (sent in a reply's place) and wait for its reply with the round's."""
        for mid in grid.push_messages([msg]):
            if mid:
                pending.append(mid)
                self._node_of[mid] = msg.metadata.dst_node_id

    def _duplicate(self, msg: Message) -> None:
        """Refuse a second reply to a message already answered (a replayed delivery)."""
        node, rnd = self._taken[msg.metadata.reply_to_message_id]
        self.duplicates.append((node, rnd))
        log(
            WARNING,
            "%s: duplicate reply of node %d for round %d refused (already taken once)",
            self.what,
            node,
            rnd,
        )

    def _discard(self, msg: Message) -> None:
        rid = msg.metadata.reply_to_message_id
        node, rnd = self._stale.pop(rid, (msg.metadata.src_node_id, -1))
        if node_gone(msg):
            self.lost.append((node, rnd))
            log(WARNING, "%s: lost node %d in round %d: %s", self.what, node, rnd, msg.error.reason)
            return
        self.discarded.append((node, rnd))
        log(
            INFO,
            "%s: late reply of node %d for round %d discarded (that round had closed)",
            self.what,
            node,
            rnd,
        )
