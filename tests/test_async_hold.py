"""Asynchronous rounds hold a node whose reply is in for the step's model when that step is
about to close (``Rounds.hold``): sites of equal speed then take exactly the synchronous steps,
and a slow site still holds no one.

:class:`TimedGrid` gives every node a task time in virtual seconds (a reply is in ``d_p``
seconds after its task was pushed; the round driver's sleeps move the clock), so the runs are
deterministic and the expected models come from the synchronous strategy on the same grid.
"""

from __future__ import annotations

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from test_async_rounds import VirtualClock, init_model, target, train

from flwr_isoloco.strategies import DiLoCo, IsoLoCo, ReplyChecks, Rounds

torch.set_num_threads(1)


class TimedGrid(FakeGrid):
    """Node ``p``'s task takes ``durations[p]`` virtual seconds; ``pushed`` logs (time,
    partition) of every train message, ``ready`` (time, partition) of every reply pulled."""

    def __init__(self, durations: list[float]) -> None:
        super().__init__({"train": train, "evaluate": evaluate}, num_nodes=len(durations))
        self.durations, self.due = list(durations), {}
        self.time_source = VirtualClock()
        self.pushed: list[tuple[float, int]] = []
        self.ready: list[tuple[float, int]] = []
        self.tasks: list[tuple[float, int, str]] = []  # train messages: time, partition, id
        self.evaluated: list[tuple[float, int, bool]] = []  # time, partition, had a task

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        now = self.time_source.now
        for mid in ids:
            msg = self._pending[mid]
            p = self.partition_of[msg.metadata.dst_node_id]
            if msg.metadata.message_type == "evaluate":  # at once; never behind a train task
                busy = any(q == p and m in self.due for _, q, m in self.tasks)
                self.evaluated.append((now, p, busy))
                self.due[mid] = now
                continue
            self.due[mid] = now + self.durations[p]
            self.pushed.append((now, p))
            self.tasks.append((now, p, mid))
        return ids

    def pull_messages(self, message_ids):
        now = self.time_source.now
        due = sorted((self.due[m], m) for m in message_ids if m in self.due and self.due[m] <= now)
        out = []
        for t, mid in due:
            msg = self._pending[mid]
            p = self.partition_of[msg.metadata.dst_node_id]
            if msg.metadata.message_type != "evaluate":
                self.ready.append((t, p))
            del self.due[mid]
            out.extend(super().pull_messages([mid]))
        return out


def evaluate(msg: Message, ctx) -> Message:
    """The squared distance of the model sent to partition ``p``'s target, weighted p + 1."""
    pid = int(ctx.node_config["partition-id"])
    th, t = msg.content["arrays"].to_torch_state_dict(), target(pid)
    loss = sum(float((th[k].double() - t[k].double()).pow(2).sum()) for k in th)
    metrics = MetricRecord({"loss": loss, "num-examples": pid + 1})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def _kw(cls, **kw):
    base = dict(
        outer_lr=0.7,
        outer_momentum=0.9,
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(max_weight_ratio=None),
    )
    return {**base, **kw}


def _run(s, durations, steps):
    grid = TimedGrid(durations)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=steps)
    return res, grid


@pytest.mark.parametrize("cls", [DiLoCo, IsoLoCo])
def test_equal_speeds_take_bitwise_the_synchronous_steps(cls):
    """Three sites of equal speed (1 s tasks, 1 ms apart, so the arrival order is fixed):
    the asynchronous run holds every node for the new model and ends on the synchronous run's
    bits, every reply fresh. Without the hold (hold=0) every task after the first trains from a
    model one step old and the run ends elsewhere."""
    durations = [1.0, 1.001, 1.002]
    sync, _ = _run(cls(**_kw(cls)), durations, 6)
    a = cls(**_kw(cls, rounds=Rounds(asynchronous=True)))
    res, grid = _run(a, durations, 6)
    want, got = sync.arrays.to_torch_state_dict(), res.arrays.to_torch_state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for r in range(1, 7):
        m = res.train_metrics_clientapp[r]
        assert (m["staleness-max"], m["replies-used"], m["nodes-held"]) == (0, 3, 3)
    off = cls(**_kw(cls, rounds=Rounds(asynchronous=True, hold=0.0)))
    res0, _ = _run(off, durations, 6)
    assert res0.train_metrics_clientapp[2]["staleness-max"] == 1
    got0 = res0.arrays.to_torch_state_dict()
    assert not all(torch.equal(want[k], got0[k]) for k in want)


def _gaps(grid: TimedGrid, p: int) -> list[float]:
    """Seconds node ``p`` waited between each reply and its next task."""
    pushes = [t for t, q in grid.pushed if q == p]
    replies = [t for t, q in grid.ready if q == p]
    return [nxt - done for done, nxt in zip(replies, pushes[1:], strict=False)]


def test_one_slow_node_holds_no_one():
    """Tasks of 1 s, 1 s and 4 s, K = 3: the fast nodes wait at most twice, each time for at
    most 0.25 x their task time, while the slow node's time is still unknown (a node's first
    task is not counted: it includes starting its app); after that the step is predicted to
    close with the slow reply, far off, and they are sent work at once."""
    s = DiLoCo(**_kw(DiLoCo, rounds=Rounds(asynchronous=True)))
    res, grid = _run(s, [1.0, 1.0, 4.0], 10)
    end = grid.time_source.now
    poll = 0.025 + 1e-9  # a reply is seen at the next sweep
    for p in (0, 1):
        gaps = _gaps(grid, p)
        holds = [g for g in gaps if g > poll]
        assert len(holds) <= 2 and all(g <= 0.25 + poll for g in holds), gaps
        assert all(g <= poll for g in gaps[6:]), gaps  # none once the slow node's time is known
        assert sum(1 for _, q in grid.ready if q == p) >= int(end) - 1
    assert sorted(res.train_metrics_clientapp) == list(range(1, 11))


def test_a_hold_never_outlasts_its_window():
    """A node predicted to see the step close soon, whose step then does not close (the last
    node is much slower than its first guess), gets the current model when 0.25 x its task time
    ran out."""
    s = DiLoCo(**_kw(DiLoCo, rounds=Rounds(asynchronous=True)))
    _, grid = _run(s, [1.0, 1.0, 30.0], 1)
    first = [t for t, q in grid.pushed if q == 0]
    assert first[1] == pytest.approx(1.25, abs=0.03)  # held from 1.0 until its window ended


def test_hold_is_checked_and_is_a_run_config_key():
    with pytest.raises(ValueError, match="Rounds.hold"):
        Rounds(asynchronous=True, hold=-1.0)
    with pytest.raises(ValueError, match="asynchronous rounds only"):
        Rounds(hold=0.5)
    from flwr_isoloco.strategies.diloco.sections import section_rounds

    r = section_rounds(
        {
            "asynchronous": True,
            "async-hold": 0.3,
            "quorum": 1.0,
            "grace-s": 0.0,
            "max-empty-rounds": 3,
            "async-replies-per-step": 0,
            "max-staleness": 16,
            "async-staleness": 0.5,
            "momentum-every": 1,
        }
    )
    assert r.hold == 0.3


def check_evaluation_async() -> None:
    """Federated evaluation with asynchronous rounds: at equal speeds every node evaluates the
    step's model, bitwise the synchronous run's evaluation; with a slow node, only nodes with
    no training task in flight get an evaluate message (the held ones), never a busy one."""
    durations = [1.0, 1.001, 1.002]
    sync, _ = _run(DiLoCo(**_kw(DiLoCo, fraction_evaluate=1.0)), durations, 4)
    a = DiLoCo(**_kw(DiLoCo, fraction_evaluate=1.0, rounds=Rounds(asynchronous=True)))
    res, grid = _run(a, durations, 4)
    for r in range(1, 5):
        want, got = sync.evaluate_metrics_clientapp[r], res.evaluate_metrics_clientapp[r]
        assert got["loss"] == want["loss"] and got["replies-arrived"] == 3
    assert len(grid.evaluated) == 12 and not any(busy for *_, busy in grid.evaluated)
    s = DiLoCo(**_kw(DiLoCo, fraction_evaluate=1.0, rounds=Rounds(asynchronous=True)))
    res, grid = _run(s, [1.0, 1.0, 4.0], 6)
    assert grid.evaluated and not any(busy for *_, busy in grid.evaluated)
    for r, m in res.evaluate_metrics_clientapp.items():
        assert m["replies-arrived"] <= res.train_metrics_clientapp[r]["nodes-held"]


def test_federated_evaluation_runs_on_idle_nodes_only():
    check_evaluation_async()


def test_the_one_flag_switch_works_at_every_default():
    """IsoLoCo(rounds=Rounds(asynchronous=True)) at FedAvg's fraction_evaluate=1.0 is
    accepted."""
    s = IsoLoCo(rounds=Rounds(asynchronous=True))
    assert s.fraction_evaluate == 1.0 and s.async_rounds is not None
