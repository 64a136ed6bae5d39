"""RWLoRA strategy on an in-process fake grid: failing nodes, hostile and malformed replies, norm
bounds, required weights."""

import re

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid, corrupt_arrays
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from rwlora_helpers import HANDLERS, arm, assert_token, json_roundtrip, query, replay, run, train

from flwr_isoloco.strategies import ReplyChecks, Rounds, RWLoRA
from flwr_isoloco.strategies.core.guard import NoProgressError


@pytest.mark.parametrize("fault", ["raise", "timeout", "dead"])
def test_token_survives_a_failing_node_and_the_walk_reroutes(fault):
    grid = FakeGrid(HANDLERS, num_nodes=5)
    s = RWLoRA("complete", num_vertices=5, seed=1)
    run(s, grid, 1)  # vertices mapped while everyone is up
    grid.set_fault(2, fault)  # then partition 2 fails for ever
    res = run(s, grid, 40)  # rounds 2..40
    assert 2 not in s.trajectory[1:]
    assert len(s.trajectory) == 40  # every round re-routed to a live neighbour
    assert s.failures == s.failures_by_vertex[2] > 0
    assert sum(res.train_metrics_clientapp[r]["failures"] for r in range(2, 41)) == s.failures
    assert_token(res, replay(s.trajectory, 1))


@pytest.mark.filterwarnings("ignore::flwr_isoloco.graphs.PeriodicWalkWarning")  # path graphs
def test_no_other_neighbour_left_token_trains_again_then_run_stops_when_all_fail():
    grid = FakeGrid(HANDLERS, num_nodes=2)
    s = RWLoRA("0-1", seed=0, start_vertex=0)
    res = run(s, grid, 1)
    assert s.trajectory == [0]
    s2 = RWLoRA("0-1", seed=0, start_vertex=0, max_reroutes=3)
    arm(s2, grid, 1, "raise")
    s2.load_state_dict(json_roundtrip(s.state_dict()))
    res = run(s2, grid, 4)
    # rounds 2, 3: vertex 1 fails and vertex 0 has no other neighbour, so the token trains
    # again at 0 (2 attempts); round 3 is vertex 1's 2nd consecutive failure: dead; round 4
    # walks on the live graph {0} (1 attempt, no retry of the dead vertex)
    m = res.train_metrics_clientapp
    assert [m[r]["attempts"] for r in (2, 3, 4)] == [2, 2, 1]
    assert [m[r]["hop-ok"] for r in (2, 3, 4)] == [1, 1, 1]
    assert [m[r]["dead-vertices"] for r in (2, 3, 4)] == [0, 1, 1]
    assert s2.trajectory == [0, 0, 0, 0] and s2.failures_by_vertex == {1: 2}
    assert_token(res, replay([0, 0, 0, 0], 1))
    # now every node fails: no update, the token stays, and after max_empty_rounds (3)
    # consecutive empty rounds the run stops instead of reporting success
    grid.set_fault(0, "raise")
    with pytest.raises(NoProgressError, match=r"3 consecutive rounds \(up to round 7\)"):
        run(s2, grid, 20)
    assert s2.round == 7 and s2.trajectory == [0, 0, 0, 0]
    assert [(h["hop-ok"], h["walk-vertex"]) for h in s2.history[-3:]] == [(0, -1)] * 3
    assert_token_close_to(s2.current_arrays(), replay([0, 0, 0, 0], 1))
    off = RWLoRA("0-1", seed=0, start_vertex=0, rounds=Rounds(max_empty_rounds=0))
    grid = FakeGrid(HANDLERS, num_nodes=2)
    arm(off, grid, 0, "raise")
    grid.set_fault(1, "raise")
    run(off, grid, 5)  # guard off: the old behaviour, the run just ends
    assert off.round == 5 and off.trajectory == []


def assert_token_close_to(arrays, expected):
    got = arrays.to_torch_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "name, corrupt, reason",
    [
        ("nan", lambda a: {k: v * np.nan for k, v in a.items()}, "non-finite"),
        ("inf", lambda a: {k: v + np.inf for k, v in a.items()}, "non-finite"),
        ("shape", lambda a: {k: v[:1] for k, v in a.items()}, "shape"),
        ("extra", lambda a: {**a, "evil": np.zeros(2, np.float32)}, "extra"),
        ("missing", lambda a: dict(list(a.items())[:1]), "missing"),
        ("int", lambda a: {k: v.astype(np.int64) for k, v in a.items()}, "dtype"),
        ("bool", lambda a: {k: v > 0 for k, v in a.items()}, "dtype"),
    ],
)
def test_hostile_replies_are_rejected_and_token_kept(name, corrupt, reason):
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=2)
    arm(s, grid, 1, corrupt_arrays(corrupt))
    res = run(s, grid, 25)
    assert 1 not in s.trajectory and s.failures_by_vertex.get(1, 0) > 0
    assert len(s.trajectory) == 25
    assert_token(res, replay(s.trajectory, 1))
    assert s.failure_log and all(v == 1 and reason in why for _, v, why in s.failure_log)


def test_fp16_reply_is_cast_and_accepted():
    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=0)
    arm(s, grid, 0, corrupt_arrays(lambda a: {k: v.astype(np.float16) for k, v in a.items()}))
    res = run(s, grid, 12)
    assert s.failures == 0 and 0 in s.trajectory
    assert all(v.dtype == torch.float32 for v in res.arrays.to_torch_state_dict().values())


def test_fp16_reply_is_refused_with_dtype_policy_reject():
    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=0, checks=ReplyChecks(dtype_policy="reject"))
    arm(s, grid, 0, corrupt_arrays(lambda a: {k: v.astype(np.float16) for k, v in a.items()}))
    res = run(s, grid, 12)
    assert 0 not in s.trajectory and s.failures > 0
    assert all("dtype" in why for _, _, why in s.failure_log)
    assert_token(res, replay(s.trajectory, 1))


def test_delta_payload_reply():
    """A client may send ``old - new`` with ConfigRecord payload='delta'."""

    def as_delta(reply):
        new = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = ArrayRecord({k: SENT[0][k] - v for k, v in new.items()})
        reply.content["flags"] = ConfigRecord({"payload": "delta"})
        return reply

    SENT: list = []

    def train_recording(msg, context):
        SENT[:] = [msg.content["arrays"].to_torch_state_dict()]
        return train(msg, context)

    grid = FakeGrid({"train": train_recording, "query": query}, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=1)
    s.setup(grid, timeout=5)
    for node in range(3):
        grid.set_fault(node, as_delta)
    res = run(s, grid, 6)
    assert s.failures == 0
    assert_token_close(res, replay(s.trajectory, 1))


def assert_token_close(result, expected):
    got = result.arrays.to_torch_state_dict()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-5)


def test_norm_bounds_reject_a_huge_update():
    def blow_up(a):
        return {k: v * 1e6 for k, v in a.items()}

    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=4, checks=ReplyChecks(max_update_norm=1e3))
    arm(s, grid, 3, corrupt_arrays(blow_up))
    res = run(s, grid, 20)
    assert 3 not in s.trajectory and s.failures > 0
    assert_token(res, replay(s.trajectory, 1))
    grid = FakeGrid(HANDLERS, num_nodes=4)
    # the early blown-up hops poison the token, after which every update is refused: with
    # the empty-round guard off the run goes on (with it, it would stop; see the 0-1 test)
    s = RWLoRA(
        "complete",
        num_vertices=4,
        seed=4,
        checks=ReplyChecks(max_norm_ratio=100.0),
        rounds=Rounds(max_empty_rounds=0),
    )
    arm(s, grid, 3, corrupt_arrays(blow_up))
    run(s, grid, 20)
    # until 3 updates are accepted the ratio has no baseline; afterwards vertex 3 is refused
    late = s.trajectory[3:]
    assert 3 not in late and s.failures > 0
    ratio = [why for _, v, why in s.failure_log if "max_norm_ratio 100 x median" in why]
    assert ratio and all(re.search(r" of the last [3-8] accepted updates \S+$", w) for w in ratio)


def test_error_and_missing_weight_replies_with_require_weight():
    def no_weight(reply):
        reply.content["metrics"] = MetricRecord({"train-loss": 0.5})
        return reply

    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=0, require_weight=True)
    arm(s, grid, 2, no_weight)
    run(s, grid, 10)
    assert 2 not in s.trajectory and s.failures > 0
    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=0)  # weight not needed: nothing is averaged
    arm(s, grid, 2, no_weight)
    run(s, grid, 10)
    assert 2 in s.trajectory and s.failures == 0
