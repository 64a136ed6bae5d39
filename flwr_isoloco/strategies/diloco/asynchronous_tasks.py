"""The parts of asynchronous rounds (:mod:`.asynchronous`): a task in flight and their ledger,
a reply taken against the model its node was sent, the staleness discount, and the hold."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Message

from flwr_isoloco.strategies.core.ledger import SentLedger

__all__ = ["BasedReply", "Hold", "Task", "TaskLedger", "Wait", "asked_steps", "staleness_discount"]


def staleness_discount(tau: int, a: float) -> float:
    """``s(tau) = (1 + tau)^(-a)``: 1 for a fresh reply (``tau = 0``) and for ``a = 0``."""
    return 1.0 if tau == 0 or a == 0 else float((1.0 + tau) ** -a)


def asked_steps(config: Mapping[str, Any]) -> int | None:
    """The ``local-steps`` a train config asks for (an int >= 1), else None (not asked)."""
    h = config.get("local-steps")
    return h if isinstance(h, int) and not isinstance(h, bool) and h >= 1 else None


class BasedReply:
    """A checked reply whose delta is taken against the model its node was sent (``base``,
    version ``tau`` steps old), with its staleness discount; every other attribute is the
    :class:`~flwr_isoloco.strategies.core.replies.CheckedReply`'s. ``buffers``: the keys
    taken against the current model instead (:meth:`update`)."""

    def __init__(
        self,
        reply: Any,
        base: Mapping[str, torch.Tensor],
        tau: int,
        discount: float,
        buffers: frozenset[str] = frozenset(),
    ):
        self.__dict__.update(
            reply=reply, base=base, staleness=tau, discount=discount, buffers=buffers
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["reply"], name)

    def update(self, reference: Any = None) -> dict[str, torch.Tensor]:
        """``delta_i = theta_v - theta_i`` against the model sent, for the parameters; for a
        buffer ``b``, ``reference_b - theta_i,b = delta_i,b + (reference_b - theta_v,b)``
        against ``reference`` (the current model, which the round's fold passes): the merged
        buffer ``reference_b - mean_w(...)`` is then the weighted mean of the values the nodes
        reported, however old the model each trained from."""
        d = self.reply.update(self.base)
        if reference is None:
            return d
        for k in self.buffers & d.keys():
            d[k] = d[k] + (reference[k].float() - self.base[k].float())
        return d

    def strip(self) -> None:
        """The reply's arrays and the model it trained from are no longer needed."""
        self.reply.strip()
        self.__dict__["base"] = None


@dataclass
class Wait:
    """Counts of one step's wait."""

    t0: float
    calls0: int
    accepted: int = 0
    dropped_run: int = 0
    arrived: int = 0
    stale: int = 0
    taus: list[int] = field(default_factory=list)


@dataclass
class Task:
    """One node's work in flight: the node, the model version it got, when it was sent."""

    node: int
    version: int
    sent_at: float = 0.0


class TaskLedger(SentLedger):
    """The tasks in flight (message id -> :class:`Task`, in the order sent): attributes a reply
    to the node its task went to (a dead node's error comes from the SuperLink)."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: dict[str, Task] = {}
        # the reply being taken: message id -> the node of its task (set by AsyncRounds)
        self.answering: dict[str, int] = {}

    def sender(self, reply: Message) -> int:
        rid = reply.metadata.reply_to_message_id
        node = self.answering.get(rid)
        return reply.metadata.src_node_id if node is None else node

    def sent_any(self) -> bool:
        return True

    def unanswered(self, answered: set[str]) -> list[int]:
        return []  # a task in flight is not missing: it goes on into the next step

    def busy(self) -> set[int]:
        """Nodes with a task in flight."""
        return {t.node for t in self.tasks.values()}


class Hold:
    """Which nodes wait for the step's model (``Rounds.hold`` = ``fraction``;
    :mod:`.asynchronous`'s docstring): ``took_s`` the time each node's last task took (sent to
    reply; a node's first task is not counted: it includes starting the node's app),
    ``held`` node -> when its wait ends."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.took_s: dict[int, float] = {}
        self.held: dict[int, float] = {}
        self._started: set[int] = set()  # nodes whose first task has replied

    def finished(self, node: int, took: float) -> None:
        """``node``'s task took ``took`` seconds (its first task's time is not kept)."""
        if node in self._started:
            self.took_s[node] = took
        self._started.add(node)

    def window(self, took: float) -> float:
        """How long a node whose task took ``took`` s may wait for a step: ``hold x min(took,
        the median of the nodes' last task times)``, so a slow node waits no longer than a
        typical one."""
        times = sorted([*self.took_s.values(), took])
        return self.fraction * min(took, times[len(times) // 2])

    def decide(self, node: int, now: float, need: int, tasks: Iterable[Task], took: float) -> bool:
        """Hold ``node`` (True), whose task took ``took`` s, when the step, ``need`` accepted
        replies from closing, is predicted to close within its window: a task in flight replies
        at its send time plus the time its node's last task took (``took`` when not known
        yet), or now if overdue."""
        window = self.window(took)
        if window <= 0:
            return False
        eta = sorted(max(now, t.sent_at + self.took_s.get(t.node, took)) for t in tasks)
        if need <= 0 or (len(eta) >= need and eta[need - 1] <= now + window):
            self.held[node] = now + window
            return True
        return False

    def keep(self, node: int, now: float) -> None:
        """Hold ``node`` until the step closes: its reply closed it."""
        self.held[node] = now

    def expired(self, now: float) -> list[int]:
        """The nodes whose wait ran out (no longer held)."""
        done = sorted(n for n, until in self.held.items() if now >= until)
        for n in done:
            del self.held[n]
        return done

    def release(self) -> list[int]:
        """Every node held (the step closed), no longer held."""
        held, self.held = sorted(self.held), {}
        return held

    def sleep_s(self, now: float, poll_s: float) -> float:
        """Seconds to sleep before the next sweep: ``poll_s``, less when a wait ends sooner."""
        return max(0.0, min([poll_s, *(t - now for t in self.held.values())]))
