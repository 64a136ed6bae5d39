"""The reply ledger under duplicated and replayed replies (issue 39): a reply is applied once,
to the round whose instruction it answers, and a copy or a replay of an old round's reply is
refused and named (node, round) in ``ReplyStream.duplicates`` and the log. A scripted grid
returns exactly the replies each test chooses, so every arrival order is the test's."""

from __future__ import annotations

import logging
from uuid import uuid4

from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from flwr_isoloco.strategies.core.stream import ReplyStream


class ScriptedGrid:
    """``push_messages`` ids the instructions; ``pull_messages([mid])`` returns what the test
    queued under ``mid`` (a genuine reply, a duplicate, a replay of another round's reply)."""

    def __init__(self) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, SUPERLINK_NODE_ID, 1
        self.sent: dict[str, Message] = {}
        self.queue: dict[str, list[Message]] = {}

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent[msg.metadata.message_id] = msg
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            out.extend(self.queue.pop(mid, []))
        return out

    def answer(self, mid: str, *extra: Message) -> Message:
        reply = Message(RecordDict(), reply_to=self.sent[mid])
        self.queue.setdefault(mid, []).extend([reply, *extra])
        return reply


def _round(grid: ScriptedGrid, nodes, n_round: int) -> list[Message]:
    return [Message(RecordDict(), n, "train", group_id=str(n_round)) for n in nodes]


def test_each_reply_applied_once_and_only_to_its_round(caplog):
    grid, stream = ScriptedGrid(), ReplyStream(poll_s=0.0)
    applied: list[tuple[str, int]] = []  # (instruction id answered, round it was applied to)
    nodes = [11, 12, 13]

    def on_reply_for(rnd):
        return lambda reply: applied.append((reply.metadata.reply_to_message_id, rnd))

    # round 1: node 11 answers twice (a duplicated message), node 12 once, node 13 is late
    msgs1 = _round(grid, nodes, 1)
    orig_push = grid.push_messages
    ids1 = orig_push(msgs1)
    grid.push_messages = lambda messages: ids1  # already pushed: hand the ids to the stream
    dup = Message(RecordDict(), reply_to=grid.sent[ids1[0]])
    grid.answer(ids1[0], dup)
    grid.answer(ids1[1])
    with caplog.at_level(logging.INFO):
        w1 = stream.run(grid, msgs1, on_reply_for(1), server_round=1, timeout=None, quorum=2)
    assert (w1.arrived, w1.late) == (2, [13])
    assert applied == [(ids1[0], 1), (ids1[1], 1)]  # the duplicate was not applied

    # round 2: node 13's round-1 reply arrives now, and a replay of node 11's round-1 reply
    # rides along with node 11's genuine round-2 reply
    grid.push_messages = orig_push
    msgs2 = _round(grid, nodes, 2)
    ids2 = grid.push_messages(msgs2)
    grid.push_messages = lambda messages: ids2
    replay = Message(RecordDict(), reply_to=grid.sent[ids1[0]])
    grid.answer(ids2[0], replay)
    grid.answer(ids2[1])
    grid.answer(ids2[2])
    grid.answer(ids1[2])  # the late one
    with caplog.at_level(logging.INFO):
        w2 = stream.run(grid, msgs2, on_reply_for(2), server_round=2, timeout=None)
    assert (w2.arrived, w2.late) == (3, [])
    assert applied[2:] == [(ids2[0], 2), (ids2[1], 2), (ids2[2], 2)]
    # every instruction answered at most once, each reply applied to its own round only
    answered = [mid for mid, _ in applied]
    assert len(answered) == len(set(answered)) == 5
    assert all((mid in ids1) == (rnd == 1) for mid, rnd in applied)
    assert stream.discarded == [(13, 1)]  # the late reply: named by node and round
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "late reply of node 13 for round 1 discarded" in text
    # the duplicate (round 1) and the replay (seen in round 2) are both refused and named as
    # node 11's reply for round 1
    assert stream.duplicates == [(11, 1), (11, 1)]
    assert text.count("duplicate reply of node 11 for round 1 refused") == 2
