"""Pulling replies from the SuperLink: many message ids per call, never held past a deadline.

``grid.pull_messages(ids)`` returns, inflated in memory, every reply among ``ids`` that has
arrived; the SuperLink then deletes it. One id per call keeps at most one reply in memory but
costs one SuperLink call per unanswered message per sweep (a SQLite-backed SuperLink under that
load answers "database is locked"). :class:`Puller` asks for up to ``batch`` ids per call,

    batch = max(1, floor(max_bytes / reply_bytes))

(``reply_bytes``: the caller's estimate of one reply, the model it sent; ``max_bytes`` 1 GiB by
default), so replies held at once stay under ``max_bytes`` or one reply, whatever the number of
nodes, and a sweep over ``n`` unanswered messages costs ``ceil(n / batch)`` calls: one at the
demo's sizes, ``n`` at 7B.

Flower's pull waits for a reply's objects (up to ~3 minutes of retries when a SuperNode died
mid-upload) and knows no deadline. Each call therefore runs in a daemon thread and the caller
waits for it at most ``patience_s`` seconds, and never past ``deadline``: a call still running
then is left to finish in the background, and the replies it brings are handed out by a later
:meth:`pull` (the caller treats those of a closed round as late). Its ids are not asked for again
while it is young (:meth:`Puller.running`); once it has run ``patience_s``, they are: the
SuperLink hands each reply out once, so the call holds only the replies it was given (the one
whose upload never completed, and any that were in with it), and the others, which came in
after it started, reach the caller through a new call instead of waiting minutes behind it. The
SuperLink answers an id it already handed out with a "message unavailable" error; that answer
is dropped while the call holding the id runs (the id is then not asked again until that call
returns) or once its reply was handed out, so a node's reply is never shadowed by it. A grid with a ``time_source`` (a test grid's
virtual clock) is pulled inline: its calls never block.

Replies come back in the order of the ids asked for, whatever order the grid returns them in,
so a fold over them is the same bits on every grid.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

__all__ = ["PATIENCE_S", "POLL_S", "PULL_BYTES", "Puller"]

PULL_BYTES = 1 << 30
"""Bytes of replies one pull call may bring at once (the estimate of :attr:`Puller.reply_bytes`)."""
PATIENCE_S = 1.0
"""Seconds a sweep waits for one pull call before it goes on without it."""
ANSWERED_KEPT = 1 << 16
"""Ids answered by a reply that a later "message unavailable" answer is checked against."""
POLL_S = 0.025
"""Seconds between two sweeps when none brought a reply: one call per sweep at the demo's sizes,
``1 / POLL_S`` = 40 SuperLink calls a second for the whole federation."""


class Puller:
    """Pull calls of one reply stream (module docstring). ``calls`` counts the calls made."""

    def __init__(self, max_bytes: int | None = None, patience_s: float = PATIENCE_S) -> None:
        self.max_bytes = int(PULL_BYTES if max_bytes is None else max_bytes)
        self.patience_s = float(patience_s)
        self.reply_bytes = 0
        self.calls = 0
        self.shadowed = 0  # "unavailable" answers dropped: the id's reply is in an older call
        self._answered: dict[str, None] = {}  # ids answered by a reply (the latest ANSWERED_KEPT)
        self._elsewhere: dict[str, None] = {}  # ids the SuperLink handed to a call still running
        self._running: dict[Future, tuple[list[str], float]] = {}  # call -> (ids, started)
        self._lock = threading.Lock()

    @property
    def batch(self) -> int:
        """Ids per call: ``max(1, max_bytes // reply_bytes)`` (all when the size is unknown)."""
        return max(1, self.max_bytes // self.reply_bytes) if self.reply_bytes > 0 else 1 << 20

    def running(self) -> set[str]:
        """Ids of the pull calls still running that started less than ``patience_s`` ago (not
        asked for again yet; module docstring)."""
        young = time.monotonic() - self.patience_s
        with self._lock:
            return {
                i
                for f, (ids, t0) in self._running.items()
                if not f.done() and t0 > young
                for i in ids
            }

    def pull(
        self, grid: Grid, ids: Sequence[str], deadline: float | None = None, clock: object = None
    ) -> Iterator[list[Message]]:
        """Yield the replies among ``ids`` that are in now, plus any a call left running
        earlier brought (which may answer ids not in ``ids``): one list per call (the next call
        is made only when the caller asks for the next list, so replies it dropped are freed
        first), each in the order of ``ids``. ``deadline``: a ``clock.monotonic()`` time no
        call is waited for past."""
        order = {mid: i for i, mid in enumerate(ids)}
        inline = getattr(grid, "time_source", None) is not None
        yield self._ordered(self._finished(), order)
        busy = self.running() | self._elsewhere.keys()
        todo = [i for i in ids if i not in busy]
        for k in range(0, len(todo), self.batch):
            chunk = todo[k : k + self.batch]
            self.calls += 1
            if inline:
                yield self._ordered(list(grid.pull_messages(chunk)), order)
                continue
            fut = self._start(grid, chunk)
            wait = self.patience_s
            if deadline is not None and clock is not None:
                wait = min(wait, max(0.0, deadline - clock.monotonic()))  # type: ignore[attr-defined]
            wait_for([fut], timeout=wait)
            yield self._ordered(self._finished(), order)

    @staticmethod
    def _ordered(replies: list[Message], order: dict[str, int]) -> list[Message]:
        last = len(order)
        replies.sort(key=lambda m: order.get(m.metadata.reply_to_message_id, last))
        return replies

    def _start(self, grid: Grid, chunk: list[str]) -> Future:
        fut: Future = Future()

        def call() -> None:
            try:
                fut.set_result(list(grid.pull_messages(chunk)))
            except BaseException as exc:  # handed to the caller by _finished
                fut.set_exception(exc)

        with self._lock:
            self._running[fut] = (chunk, time.monotonic())
        threading.Thread(target=call, name="flwr-isoloco-pull", daemon=True).start()
        return fut

    def _finished(self) -> list[Message]:
        """Replies of the calls that have returned (a call's exception is raised here), less
        the SuperLink's "message unavailable" answers to an id asked again while an older call
        that holds its reply still runs, or whose reply was already handed out."""
        with self._lock:
            done = [f for f in self._running if f.done()]
            for f in done:
                for i in self._running.pop(f)[0]:
                    self._elsewhere.pop(i, None)  # its call returned: whatever it held is out
            still = {i for ids, _ in self._running.values() for i in ids}
        out: list[Message] = []
        for f in done:
            out.extend(f.result())
        for m in out:
            if not _unavailable(m):
                self._answered[_rid(m)] = None
        for kept_ids in (self._answered, self._elsewhere):
            while len(kept_ids) > ANSWERED_KEPT:
                del kept_ids[next(iter(kept_ids))]
        kept = []
        for m in out:
            if _unavailable(m) and _rid(m) in still | self._answered.keys():
                self.shadowed += 1
                if _rid(m) in still:  # not asked again until the call holding it returns
                    self._elsewhere[_rid(m)] = None
                continue
            kept.append(m)
        return kept


def _rid(msg: Message) -> str:
    return msg.metadata.reply_to_message_id


def _unavailable(msg: Message) -> bool:
    """The SuperLink's answer for a message it no longer has (here: handed to another call)."""
    return msg.has_error() and msg.error.code == ErrorCode.MESSAGE_UNAVAILABLE
