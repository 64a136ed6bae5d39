"""GossipLoRA on the in-process fake grid: mixing against hand computation, faults, bytes, resume."""

import numpy as np
import pytest
import torch
from fakegrid import FakeGrid, corrupt_arrays
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Strategy
from rwlora_helpers import HANDLERS, NBYTES, SHAPES, arm, client_update, init_adapter

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.graphs import build_graph, metropolis_mixing_weights
from flwr_isoloco.strategies import GossipLoRA, ReplyChecks, Rounds
from flwr_isoloco.strategies.core.guard import NoProgressError
from flwr_isoloco.strategies.graph.gossip import mix

torch.set_num_threads(1)


def run(strategy, grid, rounds, **kw):
    return strategy.start(
        grid=grid, initial_arrays=ArrayRecord(init_adapter()), num_rounds=rounds, timeout=5, **kw
    )


def value(adapter) -> float:
    """Every entry of the fake client's adapters is equal; read one."""
    return float(adapter["lora_A.weight"][0, 0])


def reference(W, rounds, steps=1, fail=None):
    """Independent float64 simulation: x_v <- 0.5^K x_v + c; x <- W x (failed vertices skip)."""
    n = W.shape[0]
    x = np.zeros(n)
    for r in range(1, rounds + 1):
        t = x.copy()
        for v in range(n):
            if fail is None or not fail(r, v):
                for _ in range(steps):
                    t[v] = 0.5 * t[v] + (v + 1)
        x = W @ t
    return x


def test_one_round_on_a_star_against_hand_computation():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("star", num_vertices=4)
    res = run(s, grid, 1)
    # after K=1 step x_v = v + 1 everywhere; W (star, d = [3,1,1,1]): W_0j = 1/4, W_jj = 3/4
    # centre: (1+2+3+4)/4 = 2.5; leaf j: 1/4 * 1 + 3/4 * (j+1) -> 1.75, 2.5, 3.25
    got = [value(s.adapters[v]) for v in range(4)]
    assert got == pytest.approx([2.5, 1.75, 2.5, 3.25], abs=1e-6)
    assert value(res.arrays.to_torch_state_dict()) == pytest.approx(2.5, abs=1e-6)  # average
    m = res.train_metrics_clientapp[1]
    assert m["local-updates"] == 4 and m["trained"] == 4
    assert m["bytes-p2p"] == 2 * 3 * NBYTES  # 2|E| adapters, |E| = 3
    assert m["bytes-relayed"] == 2 * 4 * NBYTES  # 4 down + 4 up
    assert m["train-loss"] == pytest.approx(np.mean([1, 1 / 2, 1 / 3, 1 / 4]))


@pytest.mark.parametrize("spec, n", [("ring", 6), ("complete", 5), ("erdos_renyi:p=0.5", 6)])
def test_many_rounds_match_an_independent_simulation(spec, n):
    grid = FakeGrid(HANDLERS, num_nodes=n)
    s = GossipLoRA(spec, num_vertices=n, local_steps=2, graph_seed=1)
    res = run(s, grid, 7)
    W = metropolis_mixing_weights(build_graph(spec, n=n, seed=1))
    want = reference(W, 7, steps=2)
    got = [value(s.adapters[v]) for v in range(n)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert value(res.arrays.to_torch_state_dict()) == pytest.approx(want.mean(), rel=1e-6)
    assert s.local_updates == 7 * n * 2


def test_mix_is_exact_and_keeps_the_average():
    W = metropolis_mixing_weights(build_graph("erdos_renyi:p=0.5", n=5, seed=2))
    rng = np.random.default_rng(0)
    xs = [
        {k: torch.tensor(rng.normal(size=s), dtype=torch.float32) for k, s in SHAPES.items()}
        for _ in range(5)
    ]
    out = mix(W, xs)
    for k in SHAPES:
        stack = np.stack([x[k].double().numpy().ravel() for x in xs])
        want = W @ stack
        got = np.stack([o[k].double().numpy().ravel() for o in out])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got.mean(0), stack.mean(0), atol=1e-6)  # doubly stochastic
    with pytest.raises(ValueError, match="mixing matrix"):
        mix(W[:4, :4], xs)


def test_consensus_distance_formula():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("ring", num_vertices=4)
    res = run(s, grid, 3)
    vals = np.array([value(s.adapters[v]) for v in range(4)])
    entries = sum(int(np.prod(sh)) for sh in SHAPES.values())  # every entry has the same value
    want = np.sqrt(np.mean((vals - vals.mean()) ** 2) * entries)
    assert res.train_metrics_clientapp[3]["consensus-distance"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("fault", ["raise", "timeout", "dead"])
def test_failed_node_keeps_its_adapter_and_is_still_mixed(fault):
    grid = FakeGrid(HANDLERS, num_nodes=5)
    s = GossipLoRA("ring", num_vertices=5)
    arm(s, grid, 2, fault)  # vertex 2 fails every round
    res = run(s, grid, 4)
    W = metropolis_mixing_weights(build_graph("ring", n=5))
    want = reference(W, 4, fail=lambda r, v: v == 2)
    np.testing.assert_allclose([value(s.adapters[v]) for v in range(5)], want, rtol=1e-6)
    assert s.failures == 4 and s.failures_by_vertex == {2: 4}
    m = res.train_metrics_clientapp[4]
    assert m["trained"] == 4 and m["local-updates"] == 16
    assert m["bytes-relayed"] == (5 + 4) * NBYTES  # 5 down, 4 up (error replies carry none)
    assert m["bytes-p2p"] == 2 * 5 * NBYTES


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda a: {k: v * np.nan for k, v in a.items()}, "non-finite"),
        (lambda a: {k: v[:1] for k, v in a.items()}, "shape"),
        (lambda a: {**a, "evil": np.zeros(3, np.float32)}, "extra"),
        (lambda a: {k: v.astype(np.int32) for k, v in a.items()}, "dtype"),
    ],
)
def test_hostile_replies_keep_the_previous_adapter(corrupt, reason):
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("complete", num_vertices=4)
    arm(s, grid, 1, corrupt_arrays(corrupt))
    run(s, grid, 3)
    W = metropolis_mixing_weights(build_graph("complete", n=4))
    want = reference(W, 3, fail=lambda r, v: v == 1)
    np.testing.assert_allclose([value(s.adapters[v]) for v in range(4)], want, rtol=1e-6)
    assert len(s.failure_log) == 3 and all(reason in why for _, _, why in s.failure_log)


def test_norm_ratio_rejects_an_outlier():
    grid = FakeGrid(HANDLERS, num_nodes=5)
    s = GossipLoRA("complete", num_vertices=5, checks=ReplyChecks(max_norm_ratio=10.0))
    arm(s, grid, 4, corrupt_arrays(lambda a: {k: v * 1e4 for k, v in a.items()}))
    run(s, grid, 2)
    W = metropolis_mixing_weights(build_graph("complete", n=5))
    want = reference(W, 2, fail=lambda r, v: v == 4)
    np.testing.assert_allclose([value(s.adapters[v]) for v in range(5)], want, rtol=1e-6)
    assert s.failures_by_vertex == {4: 2}
    assert all(
        v == 4 and why.startswith("update norm ") and " x median of the others " in why
        for _, v, why in s.failure_log
    )


def test_resume_is_exact_through_a_checkpoint(tmp_path):
    def grid(strategy, seed):
        g = FakeGrid(HANDLERS, num_nodes=6, seed=seed)
        arm(strategy, g, 3, "raise")
        return g

    full = GossipLoRA("erdos_renyi:p=0.5", num_vertices=6, graph_seed=4, local_steps=2)
    res_full = run(full, grid(full, 0), 8)
    first = GossipLoRA("erdos_renyi:p=0.5", num_vertices=6, graph_seed=4, local_steps=2)
    run(first, grid(first, 1), 4)
    sd = first.state_dict()
    save_checkpoint(tmp_path / "g.safetensors", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "g.safetensors")
    second = GossipLoRA("erdos_renyi:p=0.5", num_vertices=6, graph_seed=4, local_steps=2)
    second.load_state_dict({"tensors": tensors, "meta": meta})  # before setup: applied at start
    res_second = run(second, grid(second, 2), 8)
    for v in range(6):
        for k in SHAPES:
            assert torch.equal(second.adapters[v][k], full.adapters[v][k])
    for r in range(5, 9):
        assert dict(res_second.train_metrics_clientapp[r]) == dict(
            res_full.train_metrics_clientapp[r]
        )
    assert second.history == full.history[4:]


def test_evaluate_fn_gets_the_vertex_average_and_flower_loop_works():
    seen = []

    def evaluate_fn(rnd, arrays):
        seen.append(value(arrays.to_torch_state_dict()))
        return MetricRecord({"v": seen[-1]})

    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = GossipLoRA("complete", num_vertices=3)
    run(s, grid, 2, evaluate_fn=evaluate_fn)
    W = metropolis_mixing_weights(build_graph("complete", n=3))
    assert seen == pytest.approx([0.0, reference(W, 1).mean(), reference(W, 2).mean()], rel=1e-6)
    g2 = FakeGrid(HANDLERS, num_nodes=3)
    s2 = GossipLoRA("complete", num_vertices=3)
    res = Strategy.start(s2, g2, ArrayRecord(init_adapter()), num_rounds=2, timeout=5)
    assert value(res.arrays.to_torch_state_dict()) == pytest.approx(
        reference(W, 2).mean(), rel=1e-6
    )


def test_client_update_is_the_reference_step():
    # keeps the fake client and the float64 reference in this file in sync
    x = client_update(init_adapter(), 2, 3)
    assert value(x) == pytest.approx(((0 * 0.5 + 3) * 0.5 + 3) * 0.5 + 3)


def test_offline_node_keeps_its_adapter():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("ring", num_vertices=4)
    s.setup(grid, timeout=5)
    grid.offline.add(grid.node_ids[3])
    res = run(s, grid, 3)
    W = metropolis_mixing_weights(build_graph("ring", n=4))
    want = reference(W, 3, fail=lambda r, v: v == 3)
    np.testing.assert_allclose([value(s.adapters[v]) for v in range(4)], want, rtol=1e-6)
    m = res.train_metrics_clientapp[3]
    assert m["bytes-relayed"] == 2 * 3 * NBYTES and m["trained"] == 3
    assert all("offline" in why for _, _, why in s.failure_log)


def test_run_where_no_vertex_trains_stops_with_no_progress_error():
    grid = FakeGrid(HANDLERS, num_nodes=3)
    s = GossipLoRA("complete", num_vertices=3)
    s.setup(grid, timeout=5)
    for node in range(3):
        grid.set_fault(node, "raise")
    with pytest.raises(NoProgressError, match=r"3 consecutive rounds \(up to round 3\)"):
        run(s, grid, 10)
    assert s.round == 3 and s.failures == 9
    assert "ClientApp raised" in str(s.failure_log[-1])
    off = GossipLoRA("complete", num_vertices=3, rounds=Rounds(max_empty_rounds=0))
    grid.clear_faults()
    off.setup(grid, timeout=5)
    for node in range(3):
        grid.set_fault(node, "timeout")
    run(off, grid, 5)
    assert off.round == 5 and off.failures == 15


def test_vertex_adapters_are_each_vertex_own_and_average_is_their_mean():
    grid = FakeGrid(HANDLERS, num_nodes=4)
    s = GossipLoRA("ring", num_vertices=4)
    res = run(s, grid, 2)
    own = {v: a.to_torch_state_dict() for v, a in s.vertex_adapters().items()}
    assert sorted(own) == [0, 1, 2, 3]
    assert len({value(a) for a in own.values()}) > 1  # the ring has not reached consensus
    avg = res.arrays.to_torch_state_dict()
    for k in avg:
        torch.testing.assert_close(avg[k], torch.stack([own[v][k] for v in own]).mean(0))
