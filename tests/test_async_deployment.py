"""Asynchronous DiLoCo in a loopback deployment (issue 38 item 4): TLS SuperLink, 3
authenticated SuperNodes, one slowed and one SIGKILLed mid-task.

The app (``tests/deploy-async-app``) makes every update known: node ``p`` replies
``theta + 0.125 (p + 1)``, with equal weights, no staleness discount, outer lr 1 and no
momentum, so outer step ``s`` moves the model by ``0.125 (1 + m_s)``, ``m_s`` the mean
``partition-id`` of the replies it merged (the step's client metric). Partition 1 sleeps 2 s per
task; partition 2 writes a marker, then sleeps 300 s: the test kills its SuperNode as soon as
the marker is there. Select with ``pytest -m deployment``; the deployment harness stops every
process it started, by PID.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from deploy_harness import loopback_deployment

pytestmark = pytest.mark.deployment

APP = Path(__file__).resolve().parent / "deploy-async-app"
STEPS = 7
# Steps last >= 4 s (the app's step-min-s), tasks are given up after 20 s: the killed node's
# first task is given up at the latest at step 7's start (>= 24 s after it was sent).


def _wait_for(path: Path, run, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run.process.alive(), f"run ended before {path.name}:\n{run.process.log_tail()}"
        assert time.monotonic() < deadline, f"no {path} after {timeout}s"
        time.sleep(0.2)


def test_async_rounds_go_on_past_a_slow_and_a_killed_supernode(tmp_path):
    """The run completes its 7 outer steps on the fast and the slow node (2 replies each, or 1
    where a step timed out on a loaded machine);
    the killed node's task is given up (or lost, if the SuperLink reports the node gone first)
    and named by its node id in the server's log; it never enters the model, which is exactly
    the sum of the other nodes' merged updates; the slow node's updates are among them."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    with loopback_deployment(tmp_path / "dep", num_supernodes=3) as dep:
        doomed = dep.supernodes[2].node_id
        run = dep.start_app(APP, {"output-dir": str(out), "num-server-rounds": STEPS}, 240)
        _wait_for(out / "doomed-started", run, 120)
        dep.kill_supernode(2)  # mid-task: its ClientApp is sleeping in its first task
        assert not dep.supernodes[2].process.alive()
        outcome = run.wait()
        assert outcome.status == "finished:completed", (
            outcome.output + outcome.logs + dep.diagnostics()
        )
        logs = outcome.logs
    wall = time.monotonic() - t0
    results = json.loads((out / "results.json").read_text())
    steps = results["train_metrics"]
    assert sorted(steps, key=int) == [str(s) for s in range(1, STEPS + 1)]
    assert all(m["replies-used"] in (1, 2) for m in steps.values()), steps
    means = [steps[str(s)]["partition-id"] for s in range(1, STEPS + 1)]
    assert all(0.0 <= m <= 1.0 for m in means), means  # partition 2 never merged
    assert any(m > 0 for m in means), means  # the slow node's updates were applied
    want = sum(0.125 * (1 + m) for m in means)
    assert results["final_params"] == pytest.approx([want, want], abs=1e-5)
    not_used = sum(m["replies-missing"] + m["replies-lost"] for m in steps.values())
    assert not_used >= 1, steps
    named = re.findall(
        rf"(?:no reply from node {doomed} when the round closed|lost node {doomed} )", logs
    )
    assert named, logs[-4000:]
    print(
        f"\nasync deployment: {STEPS} steps, m_s {means}, doomed task named {len(named)}x, "
        f"wall {wall:.1f} s (run {outcome.wall_s:.1f} s)"
    )
