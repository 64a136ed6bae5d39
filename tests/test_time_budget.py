"""Speed-scaled local steps (issue 38 item 1): a DiLoCo worker with a time budget runs inner
steps until the budget is spent (at least 1, at most H), reports the steps it ran and the tokens
of those steps; the server drops a reply claiming more steps than it asked for, named.

The worker's clock is a fake one (``inner_loop.time`` replaced) that advances a fixed time per
inner step, so the step counts below are exact."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from test_async_rounds import ScriptedGrid, init_model, strategy
from test_diloco_worker import model_fn, new_context, send

from flwr_isoloco.clients import Pace, TrainSettings, inner_loop, make_diloco_train_handler
from flwr_isoloco.clients.diloco_worker import WORKER_STATE_KEY, next_token_loss
from flwr_isoloco.clients.inner_loop import another_step_fits
from flwr_isoloco.strategies.core.replies import ReplyReport, ReplyValidator, steps_problem
from flwr_isoloco.strategies.diloco.asynchronous_tasks import asked_steps

torch.set_num_threads(1)

H = 5
TODAY_KEYS = {"num-examples", "train-loss", "lr", "inner-steps"}


class StepClock:
    """``perf_counter`` of a node whose every inner step (one loss call) takes ``dt`` s."""

    def __init__(self, dt: float) -> None:
        self.dt, self.now, self.calls = dt, 100.0, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now

    def loss(self, model, batch):
        self.now += self.dt
        return next_token_loss(model, batch)


def batches(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(n)]


BATCHES = batches()


def handler(clock: StepClock | None = None, pace: Pace | None = None, **train):
    """The worker timed by ``clock``; ``train``: the fields of its TrainSettings that differ
    from this test's."""
    train = {"lr": 1e-2, "local_steps": H, "num_server_rounds": 2, "warmup_steps": 0, **train}
    loss = clock.loss if clock is not None else next_token_loss
    return make_diloco_train_handler(
        model_fn,
        lambda ctx: lambda i: BATCHES[i % 8],
        loss_fn=loss,
        train=TrainSettings(**train),
        pace=pace,
    )


def theta0():
    return {k: v.detach() for k, v in model_fn().state_dict().items()}


def use_clock(monkeypatch, clock) -> None:
    monkeypatch.setattr(inner_loop, "time", SimpleNamespace(perf_counter=clock))


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "done,elapsed,budget,want",
    [
        (0, 0.0, 1.0, True),  # the first step always runs
        (0, 5.0, 1.0, True),
        (1, 0.3, 1.0, True),  # 0.3 + 0.3 <= 1
        (2, 0.6, 1.0, True),  # 0.6 + 0.3 <= 1
        (3, 0.9, 1.0, False),  # 0.9 + 0.3 > 1
        (1, 2.0, 1.0, False),  # one step already past the budget
        (4, 0.0, 1.0, True),
        (5, 0.0, 1.0, False),  # never more than H
        (4, 99.0, 0.0, True),  # budget 0: off, all H steps
        (5, 0.0, 0.0, False),
    ],
)
def test_another_step_fits_the_documented_rule(done, elapsed, budget, want):
    assert another_step_fits(done, elapsed, H, budget) is want


@pytest.mark.parametrize("dt,steps", [(0.3, 3), (2.0, 1), (0.01, H), (0.25, 4)])
def test_step_count_under_a_fake_clock(monkeypatch, dt, steps):
    """Budget 1 s: a node of 0.3 s per step runs 3 (0.9 + 0.3 > 1), one slower than the budget
    runs 1, a fast one all H; 0.25 s: 4 (0.75 + 0.25 <= 1, then 1.0 + 0.25 > 1)."""
    clock = StepClock(dt)
    use_clock(monkeypatch, clock)
    ctx = new_context()
    reply = send(handler(clock, time_budget_s=1.0), theta0(), 1, ctx)
    m = reply.content["metrics"]
    assert m["inner-steps"] == steps
    assert m["inner-steps-asked"] == H and m["time-budget-s"] == 1.0
    assert m["num-examples"] == steps * 2 * 8  # tokens of the steps run: weighted by work
    assert m["step-time-s"] >= 0
    assert ctx.state[WORKER_STATE_KEY]["data-cursor"] == steps  # the next round goes on from it


def test_the_message_config_overrides_the_handler_budget(monkeypatch):
    clock = StepClock(0.3)
    use_clock(monkeypatch, clock)
    reply = send(handler(clock), theta0(), 1, new_context(), **{"time-budget-s": 0.65})
    assert reply.content["metrics"]["inner-steps"] == 2


def test_given_the_step_count_the_round_is_deterministic(monkeypatch):
    """3 steps under a budget (H=5, constant lr) are bitwise the round of a worker told H=3;
    and two budgeted runs with the same clock reply the same bytes."""
    flat = {"min_lr_ratio": 1.0}  # constant lr: the schedule's length does not matter
    replies = []
    for _ in range(2):
        clock = StepClock(0.3)
        use_clock(monkeypatch, clock)
        replies.append(send(handler(clock, time_budget_s=1.0, **flat), theta0(), 1, new_context()))
    monkeypatch.undo()
    plain = send(handler(local_steps=3, **flat), theta0(), 1, new_context())
    a, b = (r.content["arrays"].to_torch_state_dict() for r in replies)
    p = plain.content["arrays"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], p[k]) for k in a)
    assert replies[0].content["metrics"]["train-loss"] == plain.content["metrics"]["train-loss"]


def test_off_by_default_replies_exactly_as_today(monkeypatch):
    """No budget (default), ``time_budget_s=0`` and ``time-budget-s = 0`` in the message: the
    same bytes and today's metrics (H steps), and the clock is never read."""

    def no_clock():
        raise AssertionError("the clock is read with the budget off")

    use_clock(monkeypatch, no_clock)
    runs = [
        send(handler(), theta0(), 1, new_context()),
        send(handler(time_budget_s=0.0), theta0(), 1, new_context()),
        send(handler(), theta0(), 1, new_context(), **{"time-budget-s": 0.0}),
    ]
    arrays = [r.content["arrays"].to_torch_state_dict() for r in runs]
    metrics = [dict(r.content["metrics"]) for r in runs]
    assert all(torch.equal(arrays[0][k], x[k]) for x in arrays[1:] for k in arrays[0])
    assert set(metrics[0]) == TODAY_KEYS and metrics[0]["inner-steps"] == H
    assert metrics[1:] == [metrics[0], metrics[0]]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="TrainSettings.time_budget_s"):
        TrainSettings(time_budget_s=bad)


def test_a_negative_budget_in_the_message_is_refused_before_training():
    """The handler raises (Flower sends the server an error reply, dropped and named)."""
    ctx = new_context()
    with pytest.raises(ValueError, match="time-budget-s must be >= 0"):
        send(handler(), theta0(), 1, ctx, **{"time-budget-s": -2.0})
    assert WORKER_STATE_KEY not in ctx.state


def test_a_budget_is_refused_in_a_ddp_group(monkeypatch):
    """Each rank of the distributed worker would time its own steps: refused before training."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    ctx = new_context()
    with pytest.raises(ValueError, match="distributed worker"):
        send(handler(time_budget_s=1.0), theta0(), 1, ctx)
    assert WORKER_STATE_KEY not in ctx.state
    reply = send(handler(), theta0(), 1, new_context())  # no budget: unchanged
    assert reply.content["metrics"]["inner-steps"] == H


# ----------------------------------------------------------------------------- the server
def _content(steps) -> RecordDict:
    arrays = ArrayRecord({"w": torch.zeros(2)})
    return RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": 4, "inner-steps": steps})}
    )


@pytest.mark.parametrize(
    "steps,asked,why",
    [
        (5, 5, None),
        (1, 5, None),
        (3, None, None),
        (6, 5, "is more than the 5 local-steps asked"),
        (10**9, 5, "is more than the 5"),
        (0, 5, "not a count >= 1"),
        (-3, None, "not a count >= 1"),
        (2.5, 5, "not a count >= 1"),
        (float("nan"), 5, "not a count >= 1"),
        (float("inf"), None, "not a count >= 1"),
    ],
)
def test_steps_problem(steps, asked, why):
    got = steps_problem(_content(steps), asked)
    assert got is None if why is None else why in got


def test_asked_steps_reads_only_a_count():
    assert asked_steps(ConfigRecord({"local-steps": 20})) == 20
    for cfg in ({}, {"local-steps": 0}, {"local-steps": True}, {"local-steps": 2.0}):
        assert asked_steps(ConfigRecord(cfg)) is None


def test_the_validator_rejects_more_steps_than_asked_and_names_the_node():
    from fakegrid import FakeGrid
    from flwr.app import Message

    FakeGrid({}, num_nodes=1)
    v = ReplyValidator(asked_steps=5)
    base = {"w": torch.zeros(2)}
    for steps, ok in ((5, True), (6, False)):
        msg = Message(_content(steps), 33, "train")
        report = ReplyReport()
        got = v.check(msg, base, None, report)
        assert (report.rejected == 0) is ok
        if not ok:
            assert got.node_id == msg.metadata.src_node_id
            assert "'inner-steps' = 6 is more than the 5" in got.reason


def claims(n):
    """A fault: the reply says it ran ``n`` inner steps."""

    def fault(reply):
        reply.content["metrics"]["inner-steps"] = n
        return reply

    return fault


def run_with_a_claim(s, caplog, faults):
    """Two rounds (or outer steps) of ``s`` on 3 scripted nodes asked for 5 local steps, with
    ``faults`` ({partition: (fault, times)}); the train metrics, the warnings naming
    inner-steps, the grid."""
    grid = ScriptedGrid([0, 1, 2, 0, 1, 2])
    for pid, (fault, times) in faults.items():
        grid.set_fault(pid, fault, times=times)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res = s.start(
            grid=grid,
            initial_arrays=ArrayRecord(init_model()),
            num_rounds=2,
            train_config=ConfigRecord({"local-steps": 5}),
        )
    named = [r.getMessage() for r in caplog.records if "inner-steps" in r.getMessage()]
    return res.train_metrics_clientapp, named, grid


def test_asynchronous_rounds_drop_a_reply_claiming_more_steps_than_asked(caplog):
    """Node 1 claims 6 inner steps where the train config asked for 5: dropped and named; node
    0 reporting its 5 (or fewer) steps is used."""
    m, named, grid = run_with_a_claim(
        strategy(replies_per_step=2), caplog, {0: (claims(3), None), 1: (claims(6), 1)}
    )
    assert sum(x["replies-rejected"] for x in m.values()) == 1
    assert sum(x["replies-used"] for x in m.values()) == 4
    assert len(named) == 1 and f"node {grid.node_ids[1]}" in named[0]
    assert "more than the 5 local-steps asked" in named[0]


def test_synchronous_rounds_drop_a_reply_claiming_more_steps_than_asked(caplog):
    """The same check in synchronous rounds: node 1 claims 6 of the 5 steps asked in round 1,
    dropped and named; the other 5 replies of the two rounds are used."""
    from flwr_isoloco.strategies.diloco.settings import Rounds

    m, named, grid = run_with_a_claim(strategy(rounds=Rounds()), caplog, {1: (claims(6), 1)})
    assert [(m[r]["replies-used"], m[r]["replies-rejected"]) for r in (1, 2)] == [(2, 1), (3, 0)]
    assert len(named) == 1 and f"node {grid.node_ids[1]}" in named[0]


# ----------------------------------------------------------------------------- the LM app
def test_lm_app_key_default_off_and_checked():
    from isoloco_lm import task
    from isoloco_lm.task import RunConfigError

    assert task.load_config({}).train["time-budget-s"] == 0.0
    assert task.load_config({"train.time-budget-s": 2.5}).train["time-budget-s"] == 2.5
    with pytest.raises(RunConfigError, match="train.time-budget-s"):
        task.load_config({"train.time-budget-s": -1.0})


def test_lm_app_runs_with_a_budget_and_off_unchanged(tmp_path):
    """The LM app in-process (FakeGrid, 3 nodes, 2 rounds): with a budget of 1 ns every node
    runs exactly 1 of its 3 inner steps (the first always runs; then 2 x elapsed > budget) and
    replies 1 step's tokens; the run completes. Without the key the replies say 3 steps."""
    from fakegrid import FakeGrid
    from isoloco_lm import client_app, server_app
    from lm_app import tiny_config, write_corpus

    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    base = tiny_config(corpus, tmp_path / "cache", num_server_rounds=2)
    for budget, steps in ((1e-9, 1), (None, 3)):
        seen: list[dict] = []

        def train(msg, ctx, seen=seen):
            reply = client_app.train(msg, ctx)
            seen.append(dict(reply.content["metrics"]))
            return reply

        rc = {**base, "output-dir": str(tmp_path / f"out-{steps}")}
        if budget is not None:
            rc["train.time-budget-s"] = budget
        grid = FakeGrid({"train": train}, num_nodes=3, run_config=rc)
        out = server_app.run_server(grid, rc, settle_s=0.0)
        rounds = json.loads((out / "results.json").read_text())["rounds"]
        assert [r["replies-used"] for r in rounds] == [3, 3]
        assert len(seen) == 6 and all(m["inner-steps"] == steps for m in seen), seen
        assert all(m["num-examples"] == steps * 4 * 32 for m in seen)
        assert all(("time-budget-s" in m) is (budget is not None) for m in seen)
