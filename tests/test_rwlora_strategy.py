"""RWLoRA strategy on an in-process fake grid: walk, vertices, bytes, resume, Flower's loop, Ray.
Faults and hostile replies: test_rwlora_faults.py."""

import math

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid, corrupt_arrays
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from rwlora_helpers import (
    HANDLERS,
    NBYTES,
    arm,
    assert_token,
    init_adapter,
    npy_bytes,
    query,
    replay,
    run,
    train,
    train_log,
)

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.graphs import build_graph
from flwr_isoloco.strategies import RWLoRA

# ----------------------------------------------------------------------------- walk


def test_token_follows_the_walk_one_node_per_round():
    grid = FakeGrid(HANDLERS, num_nodes=8)
    G = build_graph("ring", n=8)
    s = RWLoRA("ring", num_vertices=8, lazy=True, seed=3, local_steps=2)
    res = run(s, grid, 30)
    traj = s.trajectory
    assert len(traj) == 30
    assert all(a == b or G.has_edge(a, b) for a, b in zip(traj, traj[1:], strict=False))
    assert any(a == b for a, b in zip(traj, traj[1:], strict=False))  # lazy: some self-loops
    sent = train_log(grid)
    assert len(sent) == 30  # exactly one node per round
    assert [grid.partition_of[r.node_id] for r in sent] == traj
    assert [int(res.train_metrics_clientapp[r]["walk-vertex"]) for r in range(1, 31)] == traj
    assert_token(res, replay(traj, 2))
    assert s.local_updates == 60
    counts = s.visit_counts()
    assert sum(counts.values()) == 30
    assert res.train_metrics_clientapp[30]["tv-distance"] == pytest.approx(
        0.5 * sum(abs(counts[v] / 30 - 1 / 8) for v in range(8))
    )


def test_walk_is_reproducible_from_seed():
    def traj(seed):
        s = RWLoRA("erdos_renyi:p=0.4", num_vertices=6, seed=seed, graph_seed=1)
        run(s, FakeGrid(HANDLERS, num_nodes=6, seed=seed + 10), 25)  # node ids differ by run
        return s.trajectory

    assert traj(5) == traj(5)
    assert traj(5) != traj(6)


@pytest.mark.filterwarnings("ignore::flwr_isoloco.graphs.PeriodicWalkWarning")  # path graphs
def test_start_vertex_and_string_vertices():
    grid = FakeGrid(
        {"train": train, "query": query},
        num_nodes=3,
        node_config_fn=lambda i: {"site": ["a", "b", "c"][i]},
    )
    s = RWLoRA("a-b,b-c", vertex_key="site", start_vertex="c", seed=0)
    res = run(s, grid, 6)
    assert s.trajectory[0] == "c"
    assert set(s.trajectory) <= {"a", "b", "c"}
    assert all(0 <= res.train_metrics_clientapp[r]["walk-vertex"] <= 2 for r in range(1, 7))


# ----------------------------------------------------------------------------- vertices


def test_vertices_without_node_are_excluded_and_reported():
    grid = FakeGrid(HANDLERS, num_nodes=5)
    s = RWLoRA("ring", num_vertices=6, lazy=True, seed=0, node_wait_s=0)
    run(s, grid, 20)
    assert s.missing_vertices == [5]
    assert s.vertices == [0, 1, 2, 3, 4] and 5 not in s.trajectory
    star = RWLoRA("star", num_vertices=4, lazy=True, node_wait_s=0)
    grid = FakeGrid(HANDLERS, num_nodes=4)
    grid.offline.add(grid.node_ids[0])  # the centre is missing: leaves are cut apart
    with pytest.raises(ValueError, match="disconnected"):
        run(star, grid, 1)


def test_bad_query_answers_are_ignored():
    def query_bad(msg, context):
        pid = context.node_config["partition-id"]
        if pid == 0:
            raise RuntimeError("boom")
        value = {1: 99, 2: "x", 3: 3, 4: 3}[pid]  # unknown, nonsense, duplicate 3
        return Message(RecordDict({"config": ConfigRecord({"partition-id": value})}), reply_to=msg)

    grid = FakeGrid({"train": train, "query": query_bad}, num_nodes=5)
    s = RWLoRA("complete", num_vertices=5, node_wait_s=0)
    run(s, grid, 5)
    assert s.vertices == [3]
    assert s.vmap.node_of[3] == min(grid.node_ids[3], grid.node_ids[4])
    assert s.missing_vertices == [0, 1, 2, 4]


def test_silent_node_is_queried_again_then_left_out():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    grid.set_fault(2, "timeout", times=1)  # slow first answer (e.g. a cold Ray actor)
    s = RWLoRA("complete", num_vertices=4, seed=0)
    run(s, grid, 3)
    assert s.vertices == [0, 1, 2, 3] and s.missing_vertices == []
    grid = FakeGrid(HANDLERS, num_nodes=4)
    grid.set_fault(2, "timeout")  # never answers
    s = RWLoRA("complete", num_vertices=4, seed=0, query_attempts=3)
    run(s, grid, 5)
    assert s.missing_vertices == [2] and 2 not in s.trajectory
    queries = [
        r for r in grid.log if r.message_type.startswith("query") and r.node_id == grid.node_ids[2]
    ]
    assert len(queries) == 3  # not re-queried every round


def test_dead_start_vertex_falls_back_to_the_stationary_law():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=0, start_vertex=1)
    arm(s, grid, 1, "raise")
    run(s, grid, 5)
    assert len(s.trajectory) == 5 and 1 not in s.trajectory


@pytest.mark.filterwarnings("ignore::flwr_isoloco.graphs.PeriodicWalkWarning")  # path graphs
def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="unknown graph spec"):
        RWLoRA("hypercube", num_vertices=4)
    with pytest.raises(ValueError, match="transition kind"):
        RWLoRA("ring", num_vertices=4, transition="fast")
    with pytest.raises(ValueError, match="local_steps"):
        RWLoRA("ring", num_vertices=4, local_steps=0)
    with pytest.raises(ValueError, match="start_vertex 9"):
        RWLoRA("ring", num_vertices=4, start_vertex=9)
    with pytest.raises(ValueError, match="weight 0"):
        RWLoRA("ring", num_vertices=4, transition="metropolis", target=[1, 0, 1, 1])


# ----------------------------------------------------------------------------- accounting


def test_bytes_accounting():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, lazy=True, seed=7)
    arm(s, grid, 2, corrupt_arrays(lambda a: {k: v * np.nan for k, v in a.items()}))
    grid.set_fault(3, "timeout")
    res = run(s, grid, 30)
    assert len(train_log(grid)) == sum(
        res.train_metrics_clientapp[r]["attempts"] for r in range(1, 31)
    )
    pos = None
    for r in range(1, 31):
        m = res.train_metrics_clientapp[r]
        v = int(m["walk-vertex"])
        failed = [u for rnd, u, _ in s.failure_log if rnd == r]
        assert m["hop-ok"] == 1 and m["attempts"] == len(failed) + 1
        # relayed: the hop's token down + up; each failed attempt's token down, plus the
        # (NaN) reply up for vertex 2; a timeout (vertex 3) sends nothing back
        want_relay = 2 * NBYTES + len(failed) * NBYTES + failed.count(2) * NBYTES
        # P2P: one token per move to another vertex (lazy self-loop: 0), failures included
        # (vertices 2 and 3 never hold the token, so their failures are never self-loops)
        want_p2p = (NBYTES if v != pos else 0) + len(failed) * NBYTES
        assert m["bytes-relayed"] == want_relay, r
        assert m["bytes-p2p"] == want_p2p, r
        pos = v
    assert s.failures > 0 and {2, 3} >= set(s.failures_by_vertex)
    assert s.bytes_relayed == sum(
        res.train_metrics_clientapp[r]["bytes-relayed"] for r in range(1, 31)
    )
    assert s.bytes_p2p == res.train_metrics_clientapp[30]["bytes-p2p-total"]
    stays = sum(a == b for a, b in zip(s.trajectory, s.trajectory[1:], strict=False))
    assert stays > 0  # the lazy walk did stay somewhere, so the 0-byte case was exercised


def test_optimizer_state_travels_with_the_token():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=0, carry_optimizer_state=True)
    res = run(s, grid, 9)
    assert s.optimizer_state.to_torch_state_dict()["visits"].item() == 9
    assert s.optimizer_config["step"] == 9
    # bytes: the optimiser state (one fp32 .npy) travels both ways with the adapter
    assert res.train_metrics_clientapp[5]["bytes-relayed"] == 2 * (NBYTES + npy_bytes((1,)))

    def nan_opt(reply):
        reply.content["optimizer"] = ArrayRecord({"visits": torch.tensor([float("nan")])})
        return reply

    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=0, carry_optimizer_state=True)
    arm(s, grid, 1, nan_opt)
    run(s, grid, 12)
    assert 1 not in s.trajectory and s.failures > 0
    assert s.optimizer_state.to_torch_state_dict()["visits"].item() == 12


JUNK_NPY = Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"junk")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (JUNK_NPY, "optimizer array 'visits' could not be read (ValueError: "),
        (Array(np.ones(1, dtype=">f4")), "optimizer array 'visits' could not be read ("),
        (Array(np.ones(2, np.float32)), "optimizer array 'visits' has shape (2,), expected (1,)"),
        (Array(np.ones(1, bool)), "optimizer array 'visits' has unsupported dtype bool"),
        (Array(np.ones(1, np.uint8)), "optimizer array 'visits' has dtype torch.uint8"),
        (Array(np.full(1, np.inf, np.float32)), "optimizer array 'visits' has 1 non-finite"),
    ],
)
def test_undecodable_optimizer_state_fails_the_hop_not_the_server(bad, why):
    """Hostile optimizer arrays (bytes that need pickle, big-endian, wrong shape or dtype, inf)
    fail that hop with a reason; the walk goes on and the carried state is the honest one."""

    def junk_opt(reply):
        reply.content["optimizer"] = ArrayRecord({"visits": bad})
        return reply

    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=0, carry_optimizer_state=True)
    arm(s, grid, 1, junk_opt)
    run(s, grid, 12)
    assert 1 not in s.trajectory and s.failures > 0
    failed = [reason for _, v, reason in s.failure_log if v == 1]
    assert failed and all(r.startswith(why) for r in failed), failed
    assert s.optimizer_state.to_torch_state_dict()["visits"].item() == 12


# ----------------------------------------------------------------------------- resume


def test_resume_is_exact_through_a_checkpoint(tmp_path):
    def make():
        return RWLoRA(
            "erdos_renyi:p=0.5",
            num_vertices=6,
            graph_seed=3,
            transition="metropolis",
            target=[1, 2, 3, 4, 5, 6],
            lazy=True,
            seed=9,
            carry_optimizer_state=True,
        )

    def grid(strategy):
        g = FakeGrid(HANDLERS, num_nodes=6, seed=len(ckpts))  # new node ids every run
        arm(strategy, g, 4, "raise")  # failures and re-routing consume RNG draws too
        return g

    ckpts = []
    full = make()
    res_full = run(full, grid(full), 16)

    first = make()
    run(first, grid(first), 8)
    sd = first.state_dict()
    save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], {"strategy": sd["meta"]})
    tensors, meta = load_checkpoint(tmp_path / "ck.safetensors")
    second = make()
    ckpts.append(0)
    second.round_end_fn = lambda r, s: ckpts.append(r)
    g2 = grid(second)  # fresh node ids: re-queried, same vertices
    second.load_state_dict({"tensors": tensors, "meta": meta["strategy"]})
    res_second = run(second, g2, 16)
    assert ckpts == [0, *range(9, 17)]
    assert second.trajectory == full.trajectory
    assert second.failures == full.failures
    assert second.bytes_relayed == full.bytes_relayed and second.bytes_p2p == full.bytes_p2p
    assert_token(res_second, res_full.arrays.to_torch_state_dict())
    assert torch.equal(
        second.optimizer_state.to_torch_state_dict()["visits"],
        full.optimizer_state.to_torch_state_dict()["visits"],
    )
    for r in range(9, 17):
        a, b = (
            dict(res_full.train_metrics_clientapp[r]),
            dict(res_second.train_metrics_clientapp[r]),
        )
        assert a == b, r
    assert second.history == full.history[8:]  # per-round rows live in Result / the app


def test_load_state_rejects_wrong_state():
    s = RWLoRA("ring", num_vertices=4, lazy=True)
    with pytest.raises(ValueError, match="'tensors' and 'meta'"):
        s.load_state_dict({"token": {}})
    with pytest.raises(ValueError, match="not 'rwlora'"):
        s.load_state_dict({"tensors": {}, "meta": {"kind": "gossip"}})
    done = RWLoRA("ring", num_vertices=4, lazy=True)
    run(done, FakeGrid(HANDLERS, num_nodes=4), 2)
    bigger = RWLoRA("ring", num_vertices=5, lazy=True)
    bigger.load_state_dict(done.state_dict())
    with pytest.raises(ValueError, match="cannot resume the same walk"):
        run(bigger, FakeGrid(HANDLERS, num_nodes=5), 4)


# ----------------------------------------------------------------------------- Flower glue


def test_evaluate_fn_sees_the_token_every_round():
    seen = []

    def evaluate_fn(rnd, arrays):
        seen.append((rnd, arrays.to_torch_state_dict()["lora_A.weight"][0, 0].item()))
        return MetricRecord({"acc": float(rnd)})

    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = RWLoRA("complete", num_vertices=3, seed=0)
    res = run(s, grid, 4, evaluate_fn=evaluate_fn)
    assert [r for r, _ in seen] == [0, 1, 2, 3, 4]
    assert seen[0][1] == 0.0
    want = replay(s.trajectory, 1)["lora_A.weight"][0, 0].item()
    assert seen[-1][1] == want
    assert res.evaluate_metrics_serverapp[4]["acc"] == 4.0


def test_works_with_floweres_own_round_loop():
    """configure_train / aggregate_train alone (Flower's Strategy.start) also walk the token;
    a failed hop keeps it and the next round re-routes."""
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=1)
    arm(s, grid, 0, "raise")
    res = Strategy.start(s, grid, ArrayRecord(init_adapter()), num_rounds=15, timeout=5)
    assert 0 not in s.trajectory
    assert 0 < len(s.trajectory) <= 15
    assert_token(res, replay(s.trajectory, 1))
    assert all(math.isfinite(v) for m in res.train_metrics_clientapp.values() for v in m.values())


def test_offline_node_is_skipped_without_a_failed_attempt():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=5)
    run(s, grid, 2)
    grid.offline.add(grid.node_ids[1])  # node gone from the grid's listing (e.g. deregistered)
    res = run(s, grid, 20)
    assert 1 not in s.trajectory[2:]
    assert s.failures == 0 and len(s.trajectory) == 20
    assert res.train_metrics_clientapp[20]["offline-vertices"] == 1
    grid.offline.clear()  # back: the walk uses it again
    run(s, grid, 60)
    assert 1 in s.trajectory[20:]


def test_restarted_node_with_a_new_id_is_remapped():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = RWLoRA("complete", num_vertices=4, seed=6)
    run(s, grid, 2)
    old = grid.node_ids[2]
    new = old ^ 0xFFFF  # the SuperNode restarts under a new random id
    grid.contexts[new] = grid.contexts.pop(old)
    grid.node_ids[2] = new
    grid.partition_of[new] = 2
    run(s, grid, 30)
    assert s.vmap.node_of[2] == new
    assert 2 in s.trajectory[2:] and s.failures == 0


# ----------------------------------------------------------------------------- real Flower


RAY_RESULT: dict = {}


def _ray_apps():
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from flwr_isoloco.strategies import GossipLoRA

    client = ClientApp()

    @client.train()
    def _train(msg, context):
        if int(context.node_config["partition-id"]) == 2:
            raise RuntimeError("vertex 2 is broken")
        return train(msg, context)

    client.query()(query)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        rw = RWLoRA("ring", num_vertices=4, lazy=True, seed=0, local_steps=2)
        RAY_RESULT["rw"] = rw
        RAY_RESULT["rw_result"] = rw.start(
            grid=grid, initial_arrays=ArrayRecord(init_adapter()), num_rounds=6, timeout=180
        )
        gossip = GossipLoRA("ring", num_vertices=4)
        RAY_RESULT["gossip"] = gossip
        RAY_RESULT["gossip_result"] = gossip.start(
            grid=grid, initial_arrays=ArrayRecord(init_adapter()), num_rounds=2, timeout=180
        )

    return server, client


@pytest.mark.slow
def test_rwlora_and_gossip_in_a_real_ray_simulation():
    """Real Flower (Ray backend, 4 SuperNodes): QUERY mapping, one node per hop, a ClientApp
    that raises on vertex 2 (re-routed around), gossip mixing; ~15 s."""
    import os
    from pathlib import Path

    from flwr.simulation import run_simulation

    here = str(Path(__file__).parent)  # Ray workers import this module by name
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    server, client = _ray_apps()
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=4,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    rw = RAY_RESULT["rw"]
    assert rw.round == 6 and rw.vertices == [0, 1, 2, 3]
    assert len(rw.trajectory) == 6 and 2 not in rw.trajectory
    assert_token(RAY_RESULT["rw_result"], replay(rw.trajectory, 2))
    assert rw.failures == rw.failures_by_vertex.get(2, 0)
    gossip = RAY_RESULT["gossip"]
    assert gossip.round == 2 and gossip.failures_by_vertex == {2: 2}
    assert RAY_RESULT["gossip_result"].train_metrics_clientapp[2]["trained"] == 3
