"""Emulated unequal sites (issue 38 item 3's slowdown knob): :class:`inner_loop.Pace` pads each
inner step with a sleep so a node runs ``f`` times slower, the time budget sees the padded
steps, and the LM app gives node ``p`` of ``N`` the factor ``1 + (s - 1) p / (N - 1)``.

Worker tests use the fake clock of test_time_budget (``inner_loop.time`` replaced: each loss
call advances it ``dt``, each pad sleep advances it by the pad), so the counts are exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_diloco_worker import new_context, reference_continuous_adamw, schedule, send
from test_time_budget import BATCHES, TODAY_KEYS, H, StepClock, handler, theta0

from flwr_isoloco.clients import Pace, inner_loop


class SleepingClock(StepClock):
    def sleep(self, seconds: float) -> None:
        self.now += seconds


def use(monkeypatch, clock: SleepingClock) -> None:
    monkeypatch.setattr(inner_loop, "time", SimpleNamespace(perf_counter=clock, sleep=clock.sleep))


@pytest.mark.parametrize(
    "f,p,t,pad,overrun",
    [
        (3.0, 0.0, 0.1, 0.2, 0),  # (f - 1) t
        (1.0, 0.0, 0.1, 0.0, 0),
        (3.0, 0.1, 0.02, 0.28, 0),  # f p - t
        (1.0, 0.1, 0.25, 0.0, 1),  # computed past f p: not padded, an overrun
        (2.0, 0.1, 0.2, 0.0, 0),  # exactly f p
    ],
)
def test_pad_formula(f, p, t, pad, overrun):
    pace = Pace(f, p)
    assert pace.pad(t) == pytest.approx(pad, abs=1e-12)
    assert pace.overruns == overrun


@pytest.mark.parametrize("f,p", [(0.5, 0.0), (float("nan"), 0.0), (2.0, -1.0), (True, 0.0)])
def test_bad_settings_refused(f, p):
    with pytest.raises(ValueError, match="slowdown|step_s"):
        Pace(f, p)


@pytest.mark.parametrize(
    "pace,steps,overruns",
    [
        (Pace(3.0), 3, 0),  # 0.1 s computed -> 0.3 s a step: 0.9 + 0.3 > 1
        (Pace(2.0, 0.2), 2, 0),  # 0.4 s: 0.8 + 0.4 > 1
        (Pace(step_s=0.05), H, H),  # 1x at 0.05 s: every 0.1 s step overruns it
        (None, H, None),  # off: 5 steps of 0.1 s fit the budget
    ],
)
def test_the_time_budget_sees_the_emulated_speed(monkeypatch, pace, steps, overruns):
    """Budget 1 s, 0.1 s of compute a step: a slowed node runs the steps a node whose every step
    took the padded time runs (test_time_budget's counts), and the reply says what the
    emulation did."""
    clock = SleepingClock(0.1)
    use(monkeypatch, clock)
    train = handler(clock, pace, time_budget_s=1.0)
    for _ in range(2):  # each message counts its own overruns
        m = send(train, theta0(), 1, new_context()).content["metrics"]
        assert m["inner-steps"] == steps
        assert m.get("pace-overruns") == overruns
        assert ("emulated-slowdown" in m) is (pace is not None)


@pytest.mark.parametrize("pace", [None, Pace(1.0, 0.0)])
def test_off_by_default_is_the_plain_worker(monkeypatch, pace):
    """No pace (the default) or ``Pace(1.0, 0.0)``: nothing sleeps, and
    the reply is the plain worker's, pinned to a plain fp32 ``torch.optim.AdamW`` loop
    (test_diloco_worker's) of H = 5 steps on the handler's batches at the cosine lr
    (1e-2, no warm-up, 2 rounds x 5 steps); its metrics are the usual four, with the loop's
    mean loss, 5 x 2 x 8 predicted tokens and the last step's lr, and no pace key."""

    def no_sleep(s):
        raise AssertionError(f"slept {s} s with the emulation off")

    clock = StepClock(0.1)  # each step computes 0.1 s: a slowdown would pad it
    monkeypatch.setattr(inner_loop, "time", SimpleNamespace(perf_counter=clock, sleep=no_sleep))
    reply = send(handler(clock, pace), theta0(), 1, new_context())
    got = reply.content["arrays"].to_torch_state_dict()

    def lr_at(s):
        return schedule(s, total=2 * H, lr=1e-2, warm=0)

    losses = []
    want = reference_continuous_adamw(H, BATCHES, lr_at, losses)
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], rtol=0, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}"
        )
    m = dict(reply.content["metrics"])
    assert set(m) == TODAY_KEYS and m["num-examples"] == H * 2 * 8 and m["inner-steps"] == H
    assert m["train-loss"] == pytest.approx(sum(losses) / H, rel=1e-6)
    assert m["lr"] == pytest.approx(lr_at(H - 1), rel=1e-12)


# ----------------------------------------------------------------------------- the LM app
def _ctx(pid, parts, **node):
    return SimpleNamespace(node_config={"partition-id": pid, "num-partitions": parts, **node})


def test_lm_app_node_factor():
    from isoloco_lm import task
    from isoloco_lm.client_app import node_slowdown
    from isoloco_lm.task import RunConfigError

    cfg = task.load_config({"train.slowdown-spread": 4.0})
    got = [node_slowdown(cfg, _ctx(p, 8)) for p in range(8)]
    assert got == pytest.approx([1 + 3 * p / 7 for p in range(8)])
    assert node_slowdown(cfg, _ctx(0, 1)) == 1.0
    assert node_slowdown(task.load_config({}), _ctx(5, 8)) == 1.0  # default spread 1: off
    assert node_slowdown(cfg, _ctx(0, 8, slowdown=10)) == 10.0  # a site's own factor
    for bad in (0.5, True, "2"):
        with pytest.raises(ValueError, match="node_config slowdown"):
            node_slowdown(cfg, _ctx(0, 8, slowdown=bad))
    for key, bad in (("train.slowdown-spread", 0.9), ("train.emulated-step-s", -1.0)):
        with pytest.raises(RunConfigError, match=key):
            task.load_config({key: bad})


def test_lm_app_emulated_sites_in_process(tmp_path):
    """The LM app in-process (FakeGrid, 3 nodes, 1 round), spread 3 (factors 1, 2, 3), steps
    padded to factor x 0.05 s, a time budget of 0.25 s: the nodes run 3, 2 and 1 of their 3
    inner steps (2 x 0.1 <= 0.25 < 2 x 0.15 ...), report their factor, and their tasks'
    wall-clock spans (task-start-s .. task-end-s) last at least their padded steps."""
    from fakegrid import FakeGrid
    from isoloco_lm import client_app, server_app
    from lm_app import tiny_config, write_corpus

    (tmp_path / "corpus").mkdir()
    rc = {
        **tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "cache", 1),
        "output-dir": str(tmp_path / "out"),
        "train.slowdown-spread": 3.0,
        "train.emulated-step-s": 0.05,
        "train.time-budget-s": 0.25,
    }
    seen: dict[int, dict] = {}

    def train(msg, ctx):
        reply = client_app.train(msg, ctx)
        seen[int(ctx.node_config["partition-id"])] = dict(reply.content["metrics"])
        return reply

    server_app.run_server(FakeGrid({"train": train}, num_nodes=3, run_config=rc), rc, settle_s=0)
    assert [seen[p]["emulated-slowdown"] for p in range(3)] == [1.0, 2.0, 3.0]
    assert [seen[p]["inner-steps"] for p in range(3)] == [3, 2, 1], seen
    for p in range(3):
        span = seen[p]["task-end-s"] - seen[p]["task-start-s"]
        assert span >= (p + 1) * 0.05 * seen[p]["inner-steps"] - 1e-3
