"""What a round did with each reply: applied once, only to its own round, late vs lost named.

Fast: the in-process ``FakeGrid`` (tests/fakegrid.py) and its virtual clock.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from flwr_isoloco.strategies import DiLoCo, Rounds
from flwr_isoloco.strategies.core.ledger import SentLedger
from flwr_isoloco.strategies.core.replies import ReplyValidator
from flwr_isoloco.strategies.core.stream import ReplyStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations" / "isoloco-lm"))
from isoloco_lm import client_app, server_app  # noqa: E402
from test_isoloco_lm_app import corpus, tiny  # noqa: E402,F401  (fixtures)


def _train(msg: Message, ctx) -> Message:
    theta = msg.content["arrays"].to_torch_state_dict()
    pid = int(ctx.node_config["partition-id"])
    new = {k: v + 0.01 * (pid + 1) for k, v in theta.items()}
    metrics = MetricRecord({"num-examples": pid + 1})
    return Message(RecordDict({"arrays": ArrayRecord(new), "m": metrics}), reply_to=msg)


def _metrics_only(msg: Message, ctx) -> Message:
    pid = int(ctx.node_config["partition-id"])
    return Message(RecordDict({"m": MetricRecord({"num-examples": pid + 1})}), reply_to=msg)


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16.0).reshape(4, 4), "b": torch.zeros(4)}


def _quiet(**kw):
    return dict(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1, **kw)


def _messages(grid: FakeGrid, rnd: int) -> list[Message]:
    rec = RecordDict({"arrays": ArrayRecord(_model())})
    return [grid.create_message(rec, "train", nid, str(rnd)) for nid in grid.node_ids]


class ReplayGrid(FakeGrid):
    """Every pull hands back each fresh reply twice and, again, the replies it handed out before
    (a replaying link)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: list[Message] = []

    def pull_messages(self, message_ids):
        fresh = list(super().pull_messages(message_ids))
        out = fresh + list(self.seen) + fresh
        self.seen.extend(fresh)
        return out


def test_replayed_reply_is_applied_once_and_named(caplog):
    grid = ReplayGrid({"train": _metrics_only}, num_nodes=3)
    stream = ReplyStream("t")
    got: list[str] = []
    with caplog.at_level(logging.WARNING):
        wait = stream.run(
            grid,
            _messages(grid, 1),
            lambda m: got.append(m.metadata.reply_to_message_id),
            server_round=1,
            timeout=60.0,
        )
    assert wait.arrived == 3 and len(got) == 3 and len(set(got)) == 3
    assert stream.duplicates and {n for n, _ in stream.duplicates} <= set(grid.node_ids)
    first = stream.duplicates[0][0]
    assert any(
        f"duplicate reply of node {first} for round 1 refused" in r.message for r in caplog.records
    )


def test_validate_applies_a_replayed_reply_once():
    grid = FakeGrid({"train": _train}, num_nodes=3)
    ledger = SentLedger()
    replies = list(grid.send_and_receive(ledger.remember(_messages(grid, 1))))
    v = ReplyValidator()
    kept, report = v.validate(replies + [replies[1]], expected=_model(), ledger=ledger)
    assert (report.used, report.rejected) == (3, 1)
    assert len({r.node_id for r in kept}) == 3
    assert "duplicate reply" in report.reasons[0].reason
    assert report.reasons[0].node_id == grid.node_ids[1]


def test_earlier_rounds_reply_is_never_folded_into_the_next(caplog):
    grid = FakeGrid({"train": _metrics_only}, num_nodes=3)
    grid.set_delay(2, pulls=1)  # node 2 answers round 1 only at the second pull
    stream = ReplyStream("t")
    by_round: dict[int, list[str]] = {1: [], 2: []}
    sent1 = _messages(grid, 1)
    stream.run(
        grid,
        sent1,
        lambda m: by_round[1].append(m.metadata.reply_to_message_id),
        server_round=1,
        timeout=60.0,
        quorum=2,
    )
    late_id = sent1[2].metadata.message_id
    assert late_id not in by_round[1] and len(by_round[1]) == 2
    sent2 = _messages(grid, 2)
    with caplog.at_level(logging.INFO):
        stream.run(
            grid,
            sent2,
            lambda m: by_round[2].append(m.metadata.reply_to_message_id),
            server_round=2,
            timeout=60.0,
        )
    assert set(by_round[2]) == {m.metadata.message_id for m in sent2}
    assert stream.discarded == [(grid.node_ids[2], 1)]
    assert any(
        f"late reply of node {grid.node_ids[2]} for round 1 discarded" in r.message
        for r in caplog.records
    )


def test_validate_refuses_a_reply_to_an_earlier_rounds_message():
    grid = FakeGrid({"train": _train}, num_nodes=3)
    ledger = SentLedger()
    old = list(grid.send_and_receive(ledger.remember(_messages(grid, 1))))
    new = list(grid.send_and_receive(ledger.remember(_messages(grid, 2))))
    kept, report = ReplyValidator().validate(new + old[:1], expected=_model(), ledger=ledger)
    assert (report.used, report.rejected) == (3, 1)
    assert "not sent this round" in report.reasons[0].reason


def test_node_unavailable_is_lost_not_late(caplog):
    grid = FakeGrid({"train": _train}, num_nodes=4)
    grid.set_fault(1, "dead", times=1)
    strat = DiLoCo(**_quiet())
    with caplog.at_level(logging.WARNING):
        res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-lost"], m["replies-late"]) == (3, 1, 0)
    dead = grid.node_ids[1]
    assert any(f"lost node {dead}" in r.message and "code 5" in r.message for r in caplog.records)


def test_node_unavailable_after_the_close_is_lost_not_a_late_reply(caplog):
    grid = FakeGrid({"train": _metrics_only}, num_nodes=3)
    grid.set_delay(2, pulls=1)
    grid.set_fault(2, "dead", times=1)  # its answer, when it comes, is the SuperLink's error
    stream = ReplyStream("t")
    stream.run(grid, _messages(grid, 1), lambda m: None, server_round=1, timeout=60.0, quorum=2)
    with caplog.at_level(logging.WARNING):
        stream.run(grid, _messages(grid, 2), lambda m: None, server_round=2, timeout=60.0)
    dead = grid.node_ids[2]
    assert stream.lost == [(dead, 1)] and stream.discarded == []
    assert any(f"lost node {dead} in round 1" in r.message for r in caplog.records)


def test_quorum_closed_round_logs_the_node_as_late_not_timeout(caplog):
    grid = FakeGrid({"train": _train}, num_nodes=4)
    grid.set_delay(3, pulls=1)
    strat = DiLoCo(**_quiet(rounds=Rounds(quorum=3, grace_s=0.0)))
    with caplog.at_level(logging.WARNING):
        res = strat.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    m = res.train_metrics_clientapp[1]
    assert (m["replies-used"], m["replies-late"], m["replies-lost"]) == (3, 1, 0)
    late = grid.node_ids[3]
    msgs = [r.message for r in caplog.records]
    assert any(f"node {late}, late: the round closed on its quorum" in s for s in msgs), msgs
    assert not any("(timeout)" in s for s in msgs), msgs


def test_lm_results_rows_carry_late_and_lost(tiny, tmp_path):  # noqa: F811
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "num-server-rounds": 2}
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=rc)
    grid.set_fault(1, "dead", times=1)  # round 1: node 1 gone; round 2: back
    server_app.run_server(grid, rc, settle_s=0.0)
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["rounds"]
    got = [
        (r["replies-used"], r["replies-rejected"], r["replies-lost"], r["replies-late"])
        for r in rows
    ]
    assert got == [(2, 1, 1, 0), (3, 0, 0, 0)]


class StallGrid(FakeGrid):
    """The first pull blocks for 200 s of the virtual clock (Flower's grid waiting for the
    objects of an upload that failed), past the round's 120 s timeout."""

    def pull_messages(self, message_ids):
        if self.pull_calls == 0:
            self.time_source.now += 200.0
        return super().pull_messages(message_ids)


def test_a_reply_in_before_a_blocked_pull_returns_is_taken_not_late():
    grid = StallGrid({"train": _metrics_only}, num_nodes=3)
    grid.set_delay(1, pulls=1)  # not there at its first pull, there by its second
    stream = ReplyStream("t")
    taken = []
    wait = stream.run(grid, _messages(grid, 1), taken.append, server_round=1, timeout=120.0)
    assert len(taken) == 3 and wait.late == []
    assert wait.wait_s >= 200.0  # the round did pass its deadline; one more sweep took node 1
