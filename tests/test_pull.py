"""Pulls (strategies/core/pull.py): many ids per call within a byte budget, replies in the order
asked, and a pull that blocks (an upload a dead SuperNode never completed: Flower's grid
retries ~3 minutes) holds neither round driver past its deadline."""

from __future__ import annotations

import logging
import threading
import time

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import Error
from flwr.common.constant import ErrorCode
from test_async_rounds import init_model, train

from flwr_isoloco.strategies import DiLoCo, ReplyChecks, Rounds
from flwr_isoloco.strategies.core.pull import Puller
from flwr_isoloco.strategies.core.stream import ReplyStream


def _metrics_only(msg: Message, ctx) -> Message:
    return Message(RecordDict({"m": MetricRecord({"num-examples": 1})}), reply_to=msg)


def _messages(grid: FakeGrid) -> list[Message]:
    rec = RecordDict({"arrays": ArrayRecord({"w": torch.zeros(256)})})  # 1 KiB
    return [grid.create_message(rec, "train", nid, "1") for nid in grid.node_ids]


def test_one_call_per_sweep_within_the_budget_and_one_per_reply_beyond_it():
    grid = FakeGrid({"train": _metrics_only}, num_nodes=8)
    wait = ReplyStream("t").run(grid, _messages(grid), lambda m: None, server_round=1, timeout=9)
    assert (wait.arrived, wait.pull_calls, grid.pull_calls) == (8, 1, 1)
    grid = FakeGrid({"train": _metrics_only}, num_nodes=8)
    stream = ReplyStream("t")
    stream.puller.max_bytes = 2048  # two 1 KiB replies a call
    wait = stream.run(grid, _messages(grid), lambda m: None, server_round=1, timeout=9)
    assert (wait.arrived, wait.pull_calls) == (8, 4)


def test_replies_come_in_the_order_asked_whatever_the_grid_returns():
    grid = FakeGrid({"train": _metrics_only}, num_nodes=5)
    ids = list(grid.push_messages(_messages(grid)))
    real = grid.pull_messages
    grid.pull_messages = lambda chunk: list(reversed(list(real(chunk))))
    got = [m.metadata.reply_to_message_id for b in Puller().pull(grid, ids) for m in b]
    assert got == ids


class BlockingGrid(FakeGrid):
    """Real time; the pull of a call holding node 0's reply blocks until ``release`` is set
    (at most 60 s), as Flower's does for an upload that never completed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.time_source = None
        self.release = threading.Event()

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        mine = [m for m in ids if self._pending.get(m) is not None]
        if any(self._pending[m].metadata.dst_node_id == self.node_ids[0] for m in mine):
            self.release.wait(60)
        return super().pull_messages(ids)


def test_a_blocked_pull_holds_no_synchronous_round_past_its_timeout(caplog):
    grid = BlockingGrid({"train": _metrics_only}, num_nodes=3)
    stream = ReplyStream("t")
    stream.puller.max_bytes = 1024  # one id a call: node 0's call blocks, the others return
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING):
            wait = stream.run(grid, _messages(grid), lambda m: None, server_round=1, timeout=2.0)
        took = time.monotonic() - t0
    finally:
        grid.release.set()
    assert took < 30.0, took  # bounded by the 2 s timeout, not the 60 s block (it blocked before)
    assert wait.arrived == 2 and wait.late == [grid.node_ids[0]]
    assert any(f"node {grid.node_ids[0]}, late: timeout" in r.message for r in caplog.records)


def test_a_blocked_pull_holds_no_asynchronous_step_past_its_timeout():
    grid = BlockingGrid({"train": train}, num_nodes=3)
    s = DiLoCo(
        outer_lr=1.0,
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        checks=ReplyChecks(max_weight_ratio=None),
        rounds=Rounds(asynchronous=True, hold=0.0),
    )
    t0 = time.monotonic()
    try:
        res = s.start(
            grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=1, timeout=2.0
        )
        took = time.monotonic() - t0
    finally:
        grid.release.set()
    assert took < 30.0, took  # not the 60 s block
    m = res.train_metrics_clientapp[1]
    assert m["replies-missing"] >= 1  # node 0's task given up at the deadline


class LinkGrid(FakeGrid):
    """Real time, with the SuperLink's hand-out-once semantics: a reply is handed to the first
    call that asks for it once it is in (``due_s[p]`` seconds after the push); a later call
    asking for an id already handed out gets a MESSAGE_UNAVAILABLE error. The call that was
    handed node 0's reply then takes ``slow_s`` seconds more (its objects), or until
    ``release`` when ``slow_s`` is None (an upload that never completed)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.time_source = None
        self.release = threading.Event()
        self.due_s, self.slow_s = [0.0, 0.5, 0.5], None
        self.pushed_at: dict[str, float] = {}
        self.handed: set[str] = set()
        self.sent: dict[str, Message] = {}
        self.lock = threading.Lock()

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for mid in ids:
            self.pushed_at[mid] = time.monotonic()
        return ids

    def pull_messages(self, message_ids):
        out, slow = [], False
        with self.lock:
            for mid in message_ids:
                if mid in self.handed:
                    out.append(_unavailable(self.sent[mid]))
                    continue
                msg = self._pending.get(mid)
                if msg is None:
                    continue
                p = self.partition_of[msg.metadata.dst_node_id]
                if time.monotonic() - self.pushed_at[mid] < self.due_s[p]:
                    continue
                self.handed.add(mid)
                self.sent[mid] = msg
                slow = slow or p == 0
                out.extend(super().pull_messages([mid]))
        if slow:
            self.release.wait(60 if self.slow_s is None else self.slow_s)
        return out


def _unavailable(msg: Message) -> Message:
    """The SuperLink's answer for a message it no longer has."""
    return Message(Error(ErrorCode.MESSAGE_UNAVAILABLE, "not found in the database"), reply_to=msg)


def _link_run(grid, quorum, timeout, caplog):
    stream = ReplyStream("t")
    got: list[Message] = []
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        wait = stream.run(grid, _messages(grid), got.append, server_round=1, timeout=timeout,
                          quorum=quorum)  # fmt: skip
    return stream, got, wait, time.monotonic() - t0


def test_a_pull_held_by_a_dead_upload_does_not_hold_replies_that_came_later(caplog):
    """Node 0's reply is handed out at once and its objects never come; nodes 1 and 2 reply
    0.5 s later. Their ids were in the blocked call too: after PATIENCE_S they are asked again
    and the round closes on its quorum with them, node 0 named late (it waited out the
    20 s timeout with 0 replies before)."""
    grid = LinkGrid({"train": _metrics_only}, num_nodes=3)
    try:
        stream, got, wait, took = _link_run(grid, 2, 20.0, caplog)
    finally:
        grid.release.set()
    assert took < 15.0, took  # the quorum, not the 20 s timeout
    assert sorted(grid.partition_of[m.metadata.src_node_id] for m in got) == [1, 2]
    assert not any(m.has_error() for m in got) and stream.duplicates == []
    assert wait.late == [grid.node_ids[0]]


def test_an_unavailable_answer_to_an_id_asked_again_never_shadows_its_reply(caplog):
    """Node 0's reply takes 3 s to pull: its id is asked again after PATIENCE_S and the
    SuperLink answers "message unavailable" (it handed the reply out); that answer is dropped,
    the real reply is taken once, nothing is refused as a duplicate."""
    grid = LinkGrid({"train": _metrics_only}, num_nodes=3)
    grid.slow_s = 3.0
    stream, got, wait, _ = _link_run(grid, None, 30.0, caplog)
    assert wait.arrived == 3 and not any(m.has_error() for m in got)
    assert stream.duplicates == [] and stream.puller.shadowed >= 1
    assert not any("duplicate" in r.message for r in caplog.records)
