"""No endless wait for nodes (issue 34, item 8): a round's wait for nodes is bounded by the
round timeout; then the run goes on with the connected nodes if they make the quorum, else it
stops with ``NodeWaitError`` and the app's results.json says ``failed`` with the reason.

The fake grid's virtual clock makes every timeout instant; each run is also given a real-time
limit (a thread), so a wait without a bound fails the test instead of hanging it."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord
from test_lifecycle import init_model, plain_app

from flwr_isoloco.strategies import DiLoCo, Rounds
from flwr_isoloco.strategies.core.nodes import NodeWaitError

torch.set_num_threads(1)
LIMIT_S = 30.0


def _within_limit(fn):
    """``fn()``'s result, or its exception, within :data:`LIMIT_S` seconds of real time."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"still waiting after {LIMIT_S:g} s: the wait has no bound"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _site_dies_after(grid: FakeGrid, partition: int, rnd: int):
    """Round-end hook: partition ``partition`` leaves the grid after round ``rnd``."""

    def hook(server_round, *_):
        if server_round == rnd:
            grid.offline.add(grid.node_ids[partition])

    return hook


def _run(strategy, grid, rounds, hook):
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(init_model()),
        num_rounds=rounds,
        timeout=30,
        on_round_end=hook,
    )


def test_a_dead_site_stops_the_run_with_the_reason_instead_of_waiting_for_ever():
    grid = FakeGrid(plain_app(), num_nodes=3)
    s = DiLoCo(min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0)
    with pytest.raises(NodeWaitError, match=r"only 2 of the 3 nodes .* after 30 s"):
        _within_limit(lambda: _run(s, grid, 5, _site_dies_after(grid, 2, 3)))
    assert s.completed_rounds == 3


@pytest.mark.parametrize("quorum", [2, 0.6])
def test_with_a_quorum_the_run_goes_on_with_the_connected_nodes(quorum):
    grid = FakeGrid(plain_app(), num_nodes=3)
    s = DiLoCo(
        min_train_nodes=3,
        min_available_nodes=3,
        fraction_evaluate=0.0,
        rounds=Rounds(quorum=quorum),
    )
    res = _within_limit(lambda: _run(s, grid, 5, _site_dies_after(grid, 2, 3)))
    assert s.completed_rounds == 5
    assert [res.train_metrics_clientapp[r]["replies-used"] for r in range(1, 6)] == [3, 3, 3, 2, 2]


def test_below_the_quorum_the_run_stops():
    grid = FakeGrid(plain_app(), num_nodes=3)
    s = DiLoCo(
        min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0, rounds=Rounds(quorum=3)
    )
    with pytest.raises(NodeWaitError, match="the quorum 3 needs 3"):
        _within_limit(lambda: _run(s, grid, 5, _site_dies_after(grid, 2, 1)))


def test_the_lm_app_ends_failed_with_the_reason(tmp_path):
    """The isoloco-lm app with min-nodes = sites (the user guide's advice) and one site dead
    after round 1: results.json says failed, names the wait, and keeps round 1."""
    from isoloco_lm import client_app, server_app
    from test_apprunner import _lm

    rc, _ = _lm(tmp_path)
    rc = {**rc, "num-server-rounds": 3, "output-dir": str(tmp_path / "out")}
    grid = FakeGrid({}, num_nodes=2, run_config=rc)

    def train(msg, ctx):
        reply = client_app.train(msg, ctx)
        if int(ctx.node_config["partition-id"]) == 1:  # this site dies after round 1
            grid.offline.add(grid.node_ids[1])
        return reply

    grid.app = {"train": train}
    with pytest.raises(NodeWaitError):
        _within_limit(lambda: server_app.run_server(grid, rc, settle_s=0.0))
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["status"] == "failed"
    assert "NodeWaitError" in res["error"] and "only 1 of the 2 nodes" in res["error"]
    assert [r["round"] for r in res["rounds"]] == [1]
