"""RWLoRA on the fake grid: re-routes among the other neighbours, dead vertices (back-off,
live-graph walk, relays), exact resume with dead-vertex state, and hostile train metrics."""

import math

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from rwlora_helpers import (
    HANDLERS,
    NBYTES,
    arm,
    assert_token,
    json_roundtrip,
    replay,
    run,
    train,
)

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.graphs import build_graph
from flwr_isoloco.strategies import GossipLoRA, Rounds, RWLoRA
from flwr_isoloco.strategies.core.wire import check_train_metrics

torch.set_num_threads(1)

IRREG = "0-1,0-2,0-3,0-4,1-2,3-4,4-5,5-6"  # hub 0 (cut vertex), pendant 6 on vertex 5


def rows(res, key, rounds):
    return [res.train_metrics_clientapp[r][key] for r in rounds]


def test_default_transition_is_metropolis():
    s = RWLoRA(IRREG)
    assert s.transition == "metropolis"
    grid = FakeGrid(HANDLERS, num_nodes=7)
    run(s, grid, 1)
    np.testing.assert_allclose(s.pi, np.full(7, 1 / 7), atol=1e-12)


def test_reroute_draws_among_the_other_neighbours_never_the_self_loop():
    """Lazy walk (self-loop 1/2): before the fix a re-route after vertex 1 failed kept the token
    on the vertex that just trained about half of the time."""
    grid = FakeGrid(HANDLERS, num_nodes=5)
    s = RWLoRA("complete", num_vertices=5, lazy=True, seed=3, dead_after=0)  # 1 never "dead"
    arm(s, grid, 1, "raise")
    res = run(s, grid, 200)
    rerouted = [r for r in range(2, 201) if res.train_metrics_clientapp[r]["attempts"] >= 2]
    assert len(rerouted) > 20
    traj = s.trajectory
    assert all(traj[r - 1] != traj[r - 2] for r in rerouted)  # trajectory[r-1] = round r
    stays = sum(traj[i] == traj[i - 1] for i in range(1, 200))
    assert stays > 50  # first attempts still take the lazy self-loop: the test can fail
    assert_token(res, replay(traj, 1))


def test_dead_hub_for_good_both_sides_still_visited_with_relays():
    grid = FakeGrid(HANDLERS, num_nodes=7)
    s = RWLoRA(IRREG, seed=5, start_vertex=6)
    arm(s, grid, 0, "dead")  # hub 0 down for the whole run
    res = run(s, grid, 300)
    late = s.trajectory[50:]
    assert {1, 2} & set(late) and {3, 4, 5, 6} & set(late)  # both sides of the cut
    assert set(s.trajectory) == {1, 2, 3, 4, 5, 6}
    assert len(s.trajectory) == 300  # every round trained somewhere
    assert res.train_metrics_clientapp[300]["relays-total"] == s.relays > 30
    assert sum(rows(res, "relays", range(1, 301))) == s.relays
    # back-off 8, 16, 32, 64, 128: the dead hub is retried a handful of times, not every draw
    assert 2 <= s.failures_by_vertex[0] <= 8
    assert max(rows(res, "dead-vertices", range(1, 301))) == 1
    # a relay is one hop in the peer-to-peer accounting: one adapter per move
    moves = sum(a != b for a, b in zip(s.trajectory, s.trajectory[1:], strict=False))
    assert s.bytes_p2p == (1 + moves + s.failures) * NBYTES
    assert_token(res, replay(s.trajectory, 1))


def test_pendant_whose_neighbour_is_dead_still_moves():
    grid = FakeGrid(HANDLERS, num_nodes=7)
    s = RWLoRA(IRREG, seed=0, start_vertex=6)
    arm(s, grid, 5, "raise")
    res = run(s, grid, 40)
    assert all(rows(res, "hop-ok", range(1, 41)))  # never a round without an update
    assert s.trajectory[0] == 6 and set(s.trajectory) - {6, 5} and 5 not in s.trajectory
    first_away = next(i for i, v in enumerate(s.trajectory) if v != 6)
    assert s.trajectory[first_away] == 4 and s.relays >= 1  # relayed 6 -> 4 across dead 5
    assert_token(res, replay(s.trajectory, 1))


def test_dead_vertex_comes_back_after_its_back_off():
    grid = FakeGrid(HANDLERS, num_nodes=5)
    # no federated evaluation: its messages to node 2 would take the injected faults
    s = RWLoRA("complete", num_vertices=5, seed=2, dead_backoff=6, fraction_evaluate=0.0)
    s.setup(grid, timeout=5)
    grid.set_fault(2, "raise", times=2)  # two failed hops, then vertex 2 is healthy again
    res = run(s, grid, 80)
    fails = [r for r, v, _ in s.failure_log if v == 2]
    assert len(fails) == 2
    died = fails[1]
    sent_to_2 = [r for r in range(1, 81) if res.train_metrics_clientapp[r]["walk-vertex"] == 2]
    assert not [r for r in sent_to_2 if died <= r <= died + 6]  # skipped during the back-off
    assert rows(res, "dead-vertices", range(died, died + 7)) == [1] * 7
    assert res.train_metrics_clientapp[died + 7]["dead-vertices"] == 0
    assert [r for r in sent_to_2 if r > died + 6]  # and visited again afterwards
    assert s.health.strikes == {} and s.health.dead_until == {}  # the success forgave it


def test_resume_is_exact_while_a_vertex_is_dead(tmp_path):
    def make():
        return RWLoRA(IRREG, seed=4, start_vertex=1, dead_backoff=20)

    def grid(seed):
        g = FakeGrid(HANDLERS, num_nodes=7, seed=seed)
        return g

    full = make()
    g = grid(0)
    arm(full, g, 0, "raise")
    res_full = run(full, g, 60)
    first = make()
    g = grid(1)
    arm(first, g, 0, "raise")
    split = 16
    run(first, g, split)
    assert first.health.dead(split) == {0} and first.relays > 0  # the split is inside a death
    sd = first.state_dict()
    save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], {"strategy": sd["meta"]})
    tensors, meta = load_checkpoint(tmp_path / "ck.safetensors")
    second = make()
    g = grid(2)
    arm(second, g, 0, "raise")
    second.load_state_dict({"tensors": tensors, "meta": meta["strategy"]})
    res_second = run(second, g, 60)
    assert second.trajectory == full.trajectory and second.relays == full.relays
    assert second.failures_by_vertex == full.failures_by_vertex
    for r in range(split + 1, 61):
        assert dict(res_second.train_metrics_clientapp[r]) == dict(
            res_full.train_metrics_clientapp[r]
        ), r
    assert_token(res_second, res_full.arrays.to_torch_state_dict())
    # without the dead-vertex state the walk would retry vertex 0 at once: it differs
    bare = make()
    g = grid(3)
    arm(bare, g, 0, "raise")
    state = json_roundtrip(first.state_dict())
    del state["meta"]["health"]
    bare.load_state_dict(state)
    run(bare, g, 60)
    assert bare.failures_by_vertex != full.failures_by_vertex


# ----------------------------------------------------------------------------- B3


def set_metric(key, value):
    def corrupt(reply: Message) -> Message:
        rec = reply.content.metric_records.get("metrics") if reply.has_content() else None
        if rec is not None:
            rec[key] = value
        return reply

    return corrupt


BAD_METRICS = [
    ("local-steps", math.nan, "not an integer"),
    ("local-steps", math.inf, "not an integer"),
    ("local-steps", [1, 2], "not an integer"),
    ("local-steps", 2.5, "not an integer"),
    ("local-steps", -1, "negative"),
    ("local-steps", 99, "more than the 1 asked"),
    ("data-cursor", math.nan, "not an integer"),
    ("data-cursor", -math.inf, "not an integer"),
    ("data-cursor", [3], "not an integer"),
    ("data-cursor", -4, "negative"),
    ("data-cursor", 10**30, "not an integer"),
    ("partition-id", math.nan, "not an integer"),
    ("partition-id", math.inf, "not an integer"),
    ("partition-id", [1], "not an integer"),
    ("partition-id", 3, "reply was for vertex 1"),
]


@pytest.mark.parametrize("key, value, reason", BAD_METRICS)
def test_hostile_train_metrics_drop_the_hop(key, value, reason):
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=2)
    arm(s, grid, 1, set_metric(key, value))
    res = run(s, grid, 25)
    assert 1 not in s.trajectory and s.failures_by_vertex[1] > 0
    assert len(s.trajectory) == 25
    assert s.local_updates == 25  # a hostile local-steps never enters the count
    assert all(v == 1 and key in why and reason in why for _, v, why in s.failure_log)
    assert_token(res, replay(s.trajectory, 1))


@pytest.mark.parametrize("key, value, reason", BAD_METRICS)
def test_hostile_train_metrics_keep_the_gossip_adapter(key, value, reason):
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("complete", num_vertices=4)
    arm(s, grid, 1, set_metric(key, value))
    res = run(s, grid, 3)
    assert s.failures_by_vertex == {1: 3}
    assert all(key in why and reason in why for _, _, why in s.failure_log)
    assert res.train_metrics_clientapp[3]["local-updates"] == 9  # 3 honest nodes x 3 rounds


def test_sound_metrics_pass_the_checker():
    ok = RecordDict(
        {"metrics": MetricRecord({"local-steps": 5, "data-cursor": 40, "partition-id": 2})}
    )
    assert check_train_metrics(ok, asked_steps=5, vertex=2) is None
    assert check_train_metrics(ok, asked_steps=5, vertex="site-a") is None  # cannot compare
    floats = RecordDict({"metrics": MetricRecord({"local-steps": 5.0, "partition-id": 2.0})})
    assert check_train_metrics(floats, asked_steps=5, vertex=2) is None
    assert check_train_metrics(RecordDict({"config": ConfigRecord({"x": 1})})) is None


def test_query_answer_inf_or_nan_is_ignored_not_a_crash():
    """A vertex-query answer of inf made int() raise OverflowError inside the server."""

    def query_bad(msg, context):
        pid = context.node_config["partition-id"]
        value = {0: math.inf, 1: math.nan}.get(pid, pid)
        content = RecordDict({"metrics": MetricRecord({"partition-id": value})})
        return Message(content, reply_to=msg)

    grid = FakeGrid({"train": train, "query": query_bad}, num_nodes=4)
    s = RWLoRA(build_graph("complete", n=4), node_wait_s=0, query_attempts=1)
    run(s, grid, 2)
    assert s.missing_vertices == [0, 1] and set(s.trajectory) <= {2, 3}


def test_bad_dead_vertex_and_guard_arguments():
    with pytest.raises(ValueError, match="dead_backoff_max|backoff_max"):
        RWLoRA("complete", num_vertices=3, dead_backoff=8, dead_backoff_max=4)
    with pytest.raises(ValueError, match="max_empty_rounds"):
        RWLoRA("complete", num_vertices=3, rounds=Rounds(max_empty_rounds=-1))
    with pytest.raises(TypeError, match=r"use rounds=Rounds\(max_empty_rounds=0\)"):
        RWLoRA("complete", num_vertices=3, max_empty_rounds=0)
    with pytest.raises(ValueError, match="seed"):
        RWLoRA("complete", num_vertices=3, seed=-1)
