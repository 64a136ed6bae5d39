"""Asynchronous rounds of DiLoCo / IsoLoCo: no node waits for another (``Rounds(asynchronous=True)``).

Each node always has one task: the newest model to train from. As soon as its reply is in, it
is checked (the strategy's one reply path, :class:`~.train_round.TrainRound`: reply checks,
weight bound, dtype policy, norm bounds) and kept for the step, and the node is sent new work
from the newest model, or held for the model of the step about to close (the hold, below). A
*round* is one outer step, taken once ``K`` replies (``Rounds.replies_per_step``, FedBuff's
buffer size; None: the number of nodes training) are accepted; ``num_rounds`` counts outer
steps, so with the default ``K`` a run of ``num_rounds`` steps uses as many replies as
``num_rounds`` synchronous rounds of every node.

Staleness. Model *version* ``v`` is the model after ``v`` outer steps. A reply to a task sent
version ``v`` that arrives while the server has taken ``d`` steps has staleness
``tau = d - v``. Its pseudo-gradient is taken against the model it was sent,
``delta_i = theta_v - theta_i`` (not the newest model), and it is merged with weight

    w_i = bound(n_i) * s(tau_i),   s(tau) = (1 + tau)^(-a)   (a = Rounds.staleness, 0.5)

(``n_i`` its ``num-examples``, ``bound`` the weight bound of ``ReplyChecks.max_weight_ratio``,
1 with uniform weighting; ``a = 0.5`` is FedBuff's ``1/sqrt(1+tau)``, ``a = 0`` no discount).
The step's merge ``m = merge(delta_1..delta_K; w)`` is the strategy's rule (mean, Iso-C,
... and a robust rule per step) and the outer step takes

    g = rho * m,   rho = sum_i bound(n_i) s(tau_i) / sum_i bound(n_i)

so that, for the mean, ``g = sum_i bound(n_i) s(tau_i) delta_i / sum_i bound(n_i)`` (FedBuff's
discounted sum): a step of stale replies moves the model less, a fresh one (``tau = 0``) as
a synchronous round would. A reply with ``tau > Rounds.max_staleness`` is dropped before any
check, logged with its node and the reason, and counted (``replies-stale``).

The hold (``Rounds.hold`` = ``h``, :class:`~.asynchronous_tasks.Hold`). A node whose reply
was accepted waits for the step's model when the step is predicted to close within its
window ``h x min(its last task time, the nodes' median)``: a task in flight is predicted to reply
at its send time plus its node's last task time, and the step closes at the arrival that makes
``K``. Sites of equal speed reply together, so every node waits a moment and the run takes the
synchronous steps, bit for bit; a slow site is predicted far off and no one waits for it. A
node whose window runs out first gets the current model; the node whose reply closed the step,
and every node held, get the step's model. A node's first task time is not kept (it includes
starting the node's app), so the first step, with no time known, holds every node: a
synchronous round. Replies pulled in one call with the one that closed
a step are taken at the next step (:attr:`AsyncRounds.carried`). Pulls:
:class:`~flwr_isoloco.strategies.core.pull.Puller` (every id in one call within a byte budget,
never waited for past the step's deadline).

Buffers (float tensors not trained by gradients, BatchNorm's running statistics:
:mod:`flwr_isoloco.merging.buffers`) are not pseudo-gradients: a stale delta of a statistic
applied to a newer model, then scaled by ``rho``, is no value any node reported (every node
reporting ``running_var = 1`` drove it below zero). Node ``i``'s buffer delta is taken against
the current model ``theta``, ``theta_b - theta_i,b`` (:meth:`BasedReply.update`), and is not
scaled by ``rho``, so the step sets

    theta_b <- sum_i w_i theta_i,b / sum_i w_i       (w_i = bound(n_i) s(tau_i))

the weighted mean of the values reported, with the merge weights (a statistic measured on an
older model counts less, as its update does), whatever the staleness of each.

Speed-scaled local steps: a DiLoCo worker with a time budget (``time_budget_s``, the LM app's
``train.time-budget-s``) runs as many of the ``local-steps`` as fit its budget and reports them
(``inner-steps``); its ``num-examples`` are the tokens of those steps, so the weight above
already counts its work. A reply claiming more ``inner-steps`` than the train config's
``local-steps`` is dropped and named (:func:`~flwr_isoloco.strategies.core.replies.steps_problem`).

Outer momentum: ``Rounds.momentum_every = N`` moves the momentum once every ``N`` outer steps
on the mean of their ``g`` and takes plain steps ``g / N`` in between (delayed Nesterov, Liu et
al. arXiv 2401.09135; the formula is :mod:`flwr_isoloco.merging.outer`'s module docstring). ``K = 1``
with ``N`` = the number of nodes is that paper's setting; the default ``K`` = nodes, ``N = 1``
moves the momentum once per ``K`` accepted pseudo-gradients.

Memory. The server keeps the models it sent that a task in flight still trains from and that
are at most ``max_staleness`` steps old: ``min(max_staleness + 1, nodes + 1)`` fp32 model copies
at most, the current one included (a model is shared, not copied, while it is current). A
step's replies are held as a synchronous round's are (folded or spilled deltas,
:mod:`~flwr_isoloco.merging.fold`).

An outer step also closes without ``K`` replies when ``max(K, nodes)`` replies in a row failed
their checks (stale ones aside; it then merges those it has, possibly none: an empty round,
counted by ``Rounds.max_empty_rounds``), when no task is in flight, or after ``timeout``
seconds (Flower's round timeout). Tasks older than that, and at each step's start those of
nodes no longer connected, are given up; their nodes can get new work. A node whose reply is
an error (a ClientApp that raised, a dead SuperNode) gets new work at the next step if still
connected.

Checkpoint (:meth:`AsyncRounds.save`): the settings, the tasks in flight (node, version) in
the order they were sent and the versions they train from. A resumed run sends every node of
the checkpoint that is connected the model of the task it held (so a run resumed with the same
arrival order is the uninterrupted run, bit for bit), the newest model if that version is gone
or the node is new, and tops up to the number of nodes training.

What does not compose is refused (:func:`~.asynchronous_setup.check_composition` at
construction, :func:`refuse_secagg` when the run starts): SecAgg+ (a fixed cohort sums its
masked updates), central and local DP (the accountant counts rounds of a
sampled cohort; a step is the first ``K`` replies of whichever nodes are fastest, possibly
one node twice, so neither the sampling nor the per-node count of releases that
Flower's ``RdpAccountant`` composes holds), compressed downloads (the broadcast model is one
version for every node). Federated evaluation samples the nodes held when a step closes (idle:
an evaluate message never waits behind a training task), before they are sent work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_isoloco.compression import payload_nbytes
from flwr_isoloco.strategies.core.lifecycle import RoundOutcome, divergence_guard
from flwr_isoloco.strategies.core.pull import POLL_S, Puller
from flwr_isoloco.strategies.core.replies import reply_nbytes
from flwr_isoloco.strategies.diloco.asynchronous_tasks import (
    BasedReply,
    Hold,
    Task,
    TaskLedger,
    Wait,
    asked_steps,
    staleness_discount,
)
from flwr_isoloco.strategies.diloco.settings import Rounds
from flwr_isoloco.strategies.diloco.setup import codec_request
from flwr_isoloco.strategies.diloco.train_round import TrainRound

__all__ = ["AsyncRounds", "refuse_secagg"]

VERSION_KEY = "model-version"
"""ConfigRecord key of a task: the version (outer steps) of the model sent."""


def refuse_secagg(s: Any) -> None:
    """SecAgg+ sums the masked updates of a fixed cohort: refused with asynchronous rounds."""
    if getattr(s, "secagg", None) is not None:
        raise ValueError(
            "asynchronous rounds: SecAgg+ needs a fixed cohort that masks and sums its updates "
            "together; asynchronous replies arrive one by one from different model versions. "
            "Use synchronous rounds with use_secagg"
        )


@dataclass(frozen=True)
class StrategyOps:
    """What asynchronous rounds ask of the strategy that runs them, handed over by it (so this
    module does not import the strategy's): ``sample_nodes(s, grid, fraction, min_nodes)``,
    ``draw(s, nodes, k)``, ``federated_evaluation(s, grid, round, config, timeout)`` and
    ``record_of(s, model)``."""

    sample_nodes: Callable[..., list[int]]
    draw: Callable[..., list[int]]
    federated_evaluation: Callable[..., Any]
    record_of: Callable[..., Any]


class AsyncRounds:
    """The asynchronous round driver of one strategy (module docstring)."""

    def __init__(self, rounds: Rounds, ops: StrategyOps, poll_s: float = POLL_S) -> None:
        self.settings, self.ops, self.poll_s = rounds, ops, poll_s
        self.replies_per_step: int | None = rounds.replies_per_step  # K; None: set at step 1
        self.nodes = 0  # nodes kept training (the first sample's size)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # version -> model sent
        self.ledger = TaskLedger()
        self.plan: list[tuple[int, int]] = []  # (node, version) to re-send after a resume
        self.started = False
        self.current = 0  # the version theta is (outer steps taken)
        self.stale_total = 0
        self.puller = Puller()
        self.hold = Hold(rounds.hold)
        self.idle: list[int] = []  # nodes held when a step closed, while they evaluate
        self._carry: list[Message] = []  # replies pulled with the one that closed a step
        self._taking: tuple[Task, int] | None = None
        self._down = 0

    @property
    def carried(self) -> int:
        """Replies pulled with the one that closed the last step, taken at the next; a
        checkpoint counts their tasks as in flight (a resumed run sends them again)."""
        return len(self._carry)

    # ------------------------------------------------------------------ TrainRound hooks
    def base(self, msg: Message) -> Mapping[str, torch.Tensor]:
        """The model the reply being taken trained from."""
        assert self._taking is not None
        return self.versions[self._taking[0].version]

    def adopt(self, reply: Any, msg: Message, buffers: frozenset[str] = frozenset()) -> BasedReply:
        """The checked reply with its base and discount ``s(tau)``; ``buffers`` (the model's
        buffer keys) are taken against the current model (:meth:`BasedReply.update`)."""
        assert self._taking is not None
        task, tau = self._taking
        discount = staleness_discount(tau, self.settings.staleness)
        return BasedReply(reply, self.versions[task.version], tau, discount, buffers)

    # ------------------------------------------------------------------ one outer step
    def run_round(
        self,
        s: Any,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        timeout: float,
        evaluate_config: ConfigRecord | None = None,
    ) -> RoundOutcome:
        """Wait for ``K`` accepted replies (sending each node new work as its reply comes in,
        or holding it), take the outer step, evaluate the new model on the nodes held
        (:attr:`idle`; ``fraction_evaluate`` of them), then send them work: the new model
        (None if kept), the step's metrics and the evaluation's (None when none ran)."""
        refuse_secagg(s)
        clock = getattr(grid, "time_source", None) or time
        done = self.current = s.server_round  # theta is version `done` until the step
        self.versions[done] = s.theta
        self._down = 0
        self._config = ConfigRecord(dict(train_config))
        for k, v in codec_request(s.upload).items():
            self._config[k] = v
        s.train_validator.asked_steps = asked_steps(self._config)  # inner-steps <= it
        s.book.train_ledger = self.ledger  # replies are attributed to the node of their task
        s.server_round = done + 1
        train = TrainRound(s, done + 1, per_reply=self)
        try:
            self._give_up(train, clock, timeout, set(grid.get_node_ids()))
            self._start_or_top_up(s, grid, clock)
            wait = self._wait(s, grid, train, done, clock, timeout)
            s.book.bytes_down = self._down
            s.codec_use.close(done + 1)  # a ClientApp that does not run upload_mod is said
            new_arrays, metrics = train.finish()
        finally:
            train.close()
        self.current = s.server_round
        held = self.hold.release()
        evaluated = self._evaluate(s, grid, server_round, held, evaluate_config, timeout)
        if divergence_guard(s).mode != "skip":
            self._send(s, grid, held, clock)  # from the model this step made
        # with on_divergence="skip" the step's model may be put back after evaluate_fn: the
        # nodes are then sent work at the next step's top-up, from the model that stands
        self._prune(s.server_round)
        values = {
            **dict(metrics),
            **wait,
            "nodes-held": len(held),
            "replies-per-step": self.replies_per_step,
            "tasks-in-flight": len(self.ledger.tasks),
            "versions-kept": len(self.versions),
        }
        return RoundOutcome(new_arrays, type(metrics)(values), evaluated)

    def evaluation_nodes(self, s: Any) -> list[int]:
        """A ``fraction_evaluate`` share of the nodes idle when the step closed (at least
        ``min_evaluate_nodes`` of them where there are so many), drawn with ``s``'s generator."""
        idle, f = self.idle, s.fraction_evaluate
        return self.ops.draw(s, idle, max(int(len(idle) * f), min(s.min_evaluate_nodes, len(idle))))

    def _evaluate(
        self, s: Any, grid: Grid, server_round: int, held: list[int], config: Any, timeout: float
    ) -> Any:
        """Federated evaluation of the step's model on the nodes held (idle: no evaluate
        message waits behind a training task); None when it sends nothing."""
        if s.fraction_evaluate == 0 or not held:
            return None
        self.idle = held
        try:
            config = ConfigRecord(dict(config or {}))
            return self.ops.federated_evaluation(s, grid, server_round, config, timeout)
        finally:
            self.idle = []

    def _wait(
        self, s: Any, grid: Grid, train: TrainRound, done: int, clock: Any, timeout: float
    ) -> dict[str, float]:
        """Pull replies until the step closes (module docstring); a node whose reply was
        accepted is held for the step's model when :meth:`Hold.decide` says so, else sent work at
        once. Replies pulled with the one that closed the step are carried to the next step.
        Returns the wait's metrics."""
        w = Wait(t0=clock.monotonic(), calls0=self.puller.calls)
        deadline = w.t0 + timeout
        while True:
            took = 0
            batches = self.puller.pull(grid, list(self.ledger.tasks), deadline, clock)
            for replies in chain([self._carry], batches):
                while replies:
                    took += 1
                    if self._one(s, grid, train, replies.pop(0), done, clock, w):
                        self._carry = replies
                        batches.close()
                        return self._wait_metrics(w, clock)
            self._carry = []
            self._release(s, grid, clock)
            if w.dropped_run >= max(self.replies_per_step, self.nodes) or not self.ledger.tasks:
                break
            if clock.monotonic() >= deadline:
                self._give_up(train, clock, timeout)
                break
            if not took:
                clock.sleep(self.hold.sleep_s(clock.monotonic(), self.poll_s))
        return self._wait_metrics(w, clock)

    def _one(
        self, s: Any, grid: Grid, train: TrainRound, reply: Message, done: int, clock: Any, w: Wait
    ) -> bool:
        """Take one reply; True when it closed the step (its node held for the new model)."""
        task = self.ledger.tasks.pop(reply.metadata.reply_to_message_id, None)
        if task is None:
            log(WARNING, "asynchronous round: discarded a reply to no task in flight")
            return False
        w.arrived, now = w.arrived + 1, clock.monotonic()
        took = now - task.sent_at
        self.hold.finished(task.node, took)
        tau = done - task.version
        ok = self._take(train, reply, task, tau)
        if ok:
            w.accepted, w.dropped_run = w.accepted + 1, 0
            w.taus.append(tau)
            if w.accepted >= self.replies_per_step:
                self.hold.keep(task.node, now)
                return True
        elif tau > self.settings.max_staleness:
            w.stale += 1  # its node gets the newest model: not a failing node
        else:
            w.dropped_run += 1
        if reply.has_error():
            return False
        need = self.replies_per_step - w.accepted
        tasks = self.ledger.tasks.values()
        if not (ok and self.hold.decide(task.node, now, need, tasks, took)):
            self._send(s, grid, [task.node], clock)
        return False

    def _release(self, s: Any, grid: Grid, clock: Any) -> None:
        """Nodes whose hold ran out before the step closed get work from the current model."""
        self._send(s, grid, self.hold.expired(clock.monotonic()), clock)

    def _wait_metrics(self, w: Wait, clock: Any) -> dict[str, float]:
        self.stale_total += w.stale
        return {
            "pull-calls": self.puller.calls - w.calls0,
            "replies-arrived": w.arrived,
            "replies-stale": w.stale,
            "staleness-mean": sum(w.taus) / len(w.taus) if w.taus else 0.0,
            "staleness-max": max(w.taus, default=0),
            "wait-s": clock.monotonic() - w.t0,
        }

    def _take(self, train: TrainRound, reply: Message, task: Task, tau: int) -> bool:
        """Drop a reply beyond ``max_staleness`` (named), else the round's one reply path;
        True when it was accepted."""
        rid = reply.metadata.reply_to_message_id
        if tau > self.settings.max_staleness:
            train.report.bytes_up += reply_nbytes(reply)
            train.reject(
                task.node,
                f"stale: trained from the model of step {task.version}, {tau} outer steps old "
                f"(max_staleness {self.settings.max_staleness})",
            )
            return False
        self._taking = (task, tau)
        self.ledger.answering[rid] = task.node
        train.s.codec_use.see(task.node, reply)
        before = len(train.taken)
        try:
            train.take(reply)
        finally:
            self.ledger.answering.pop(rid, None)
            self._taking = None
        return len(train.taken) > before

    def _give_up(
        self, train: TrainRound, clock: Any, timeout: float, connected: set[int] | None = None
    ) -> None:
        """Tasks in flight for ``timeout`` seconds, or whose node is no longer connected, are
        given up (counted missing, logged): their node can be sent work again."""
        now = clock.monotonic()
        for mid, task in list(self.ledger.tasks.items()):
            gone = connected is not None and task.node not in connected
            if gone or now - task.sent_at >= timeout:
                del self.ledger.tasks[mid]
                train.v.count_missing([task.node], train.report)

    # ------------------------------------------------------------------ sending work
    def _start_or_top_up(self, s: Any, grid: Grid, clock: Any) -> None:
        """First step: sample the nodes (a resumed run re-sends its checkpoint's tasks first);
        later: connected nodes without a task get one, up to the number training."""
        d = self.ops
        if not self.started:
            self.started = True
            if self.plan:
                connected = set(grid.get_node_ids())
                for node, version in self.plan:
                    if node in connected and node not in self.ledger.busy():
                        self._send(s, grid, [node], clock, version)
                self.plan = []
            else:
                nodes = d.sample_nodes(s, grid, s.fraction_train, s.min_train_nodes)
                self.nodes = len(nodes)
                self._send(s, grid, nodes, clock)
            if self.replies_per_step is None:
                self.replies_per_step = max(self.nodes, 1)
            k = self.replies_per_step
            log(INFO, "asynchronous rounds: %d nodes, %d replies per step (K)", self.nodes, k)
        busy = self.ledger.busy()
        idle = sorted(n for n in grid.get_node_ids() if n not in busy)
        room = self.nodes - len(busy)
        if room > 0 and idle:
            self._send(s, grid, d.draw(s, idle, room), clock)
        if not self.ledger.tasks:  # nobody to work: wait for nodes as a round does
            self._send(s, grid, d.sample_nodes(s, grid, s.fraction_train, s.min_train_nodes), clock)

    def _send(
        self, s: Any, grid: Grid, nodes: Iterable[int], clock: Any, version: int | None = None
    ) -> None:
        """Push a task to each node: the newest model (or ``version``, when still kept)."""
        nodes = list(nodes)
        if not nodes:
            return
        current = self.current
        v = current if version is None or version not in self.versions else version
        if v == current:
            self.versions[current] = s.theta
            record = s.current_arrays()
        else:
            record = self.ops.record_of(s, self.versions[v])
        config = ConfigRecord(dict(self._config))
        config["server-round"] = current + 1
        config[VERSION_KEY] = v
        content = RecordDict({s.arrayrecord_key: record, s.configrecord_key: config})
        for node in nodes:
            msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            ids = [i for i in grid.push_messages([msg]) if i]
            if not ids:
                log(WARNING, "asynchronous round: the grid refused a task for node %d", node)
                continue
            self.ledger.tasks[ids[0]] = Task(node, v, clock.monotonic())
            self._down += payload_nbytes(record)
        self.puller.reply_bytes = payload_nbytes(record)

    def _prune(self, current: int) -> None:
        """Keep the current model and the versions a task in flight trains from that are at
        most ``max_staleness`` steps old."""
        low = current - self.settings.max_staleness
        used = {t.version for t in self.ledger.tasks.values() if t.version >= low}
        self.versions = {v: m for v, m in self.versions.items() if v == current or v in used}

    # ------------------------------------------------------------------ checkpoint
    def settings_meta(self) -> dict[str, Any]:
        """The settings a resumed run must share, as the checkpoint's ``async`` fields name them
        (``buffer``: K, ``replies_per_step`` as resolved; the field keeps its name so that every
        checkpoint written loads)."""
        r = self.settings
        return {
            "buffer": self.replies_per_step,
            "max_staleness": r.max_staleness,
            "staleness": r.staleness,
            "momentum_every": r.momentum_every,
        }

    def save(self, sd: dict[str, Any], current: int) -> None:
        """Into a strategy's ``state_dict`` ``sd``: ``tensors["versions"]``, the versions other
        than the current one (the strategy's own tensors, not copies), and ``meta["async"]``,
        the settings and the tasks in flight in the order sent."""
        tensors = {str(v): dict(m) for v, m in self.versions.items() if v != current}
        tasks = [[t.node, t.version] for t in self.ledger.tasks.values()]
        if not self.started:  # restored, not run yet: the plan is still the state
            tasks = [[n, v] for n, v in self.plan]
        sd["tensors"]["versions"] = tensors
        sd["meta"]["async"] = {**self.settings_meta(), "nodes": self.nodes, "tasks": tasks}

    def restore(
        self,
        versions: dict[int, dict[str, torch.Tensor]],
        plan: list[tuple[int, int]],
        nodes: int,
        replies_per_step: int | None,
    ) -> None:
        """Set what :func:`~.asynchronous_setup.parse_checkpoint` returned: the next step
        re-sends the plan's tasks."""
        self.versions, self.plan, self.nodes = versions, plan, nodes
        self.replies_per_step = replies_per_step
        self.ledger = TaskLedger()
        self.started = False
