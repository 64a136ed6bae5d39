"""Gossip rounds close on a quorum (+ grace window): the straggler's vertex keeps its adapter
exactly as on a timeout, its late reply is discarded and named; RW-LoRA, one node per hop,
refuses ``Rounds(quorum=...)`` with the reason; the plain keywords name ``rounds=Rounds(...)``."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord
from test_lifecycle import init_model, plain_app

from flwr_isoloco.strategies import GossipLoRA, Rounds, RWLoRA

torch.set_num_threads(1)
N, SLOW = 4, 1  # SLOW: partition id of the straggler


def _run(setup, **kw):
    grid = FakeGrid(plain_app(with_query=True), num_nodes=N)
    s = GossipLoRA(fraction_evaluate=0.0, **kw)
    s.setup(grid, timeout=60)  # vertex discovery first: the fault is for round 1's train message
    setup(grid)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=60)
    return s, res, grid


def test_quorum_round_equals_the_round_without_the_straggler(caplog):
    slow_node = None

    def straggler(grid):  # its round-1 reply comes only at the second pull that asks for it
        nonlocal slow_node
        slow_node = grid.node_ids[SLOW]
        grid.set_delay(SLOW, pulls=1, times=1)

    with caplog.at_level(logging.INFO):
        s, res, _ = _run(straggler, rounds=Rounds(quorum=N - 1, grace_s=0.0))
    ref, ref_res, _ = _run(lambda g: g.set_fault(SLOW, "timeout", times=1))  # all, by timeout

    m1, r1 = res.train_metrics_clientapp[1], ref_res.train_metrics_clientapp[1]
    assert (m1["replies-arrived"], m1["replies-late"], m1["trained"]) == (N - 1, 1, N - 1)
    assert (r1["replies-arrived"], r1["replies-late"], r1["trained"]) == (N - 1, 1, N - 1)
    assert m1["wait-s"] < 1.0 <= r1["wait-s"]  # the quorum did not wait for the straggler
    assert res.train_metrics_clientapp[2]["trained"] == N
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"closed without the reply of node {slow_node}" in ln for ln in lines)
    assert any(f"late reply of node {slow_node} for round 1 discarded" in ln for ln in lines)
    assert s.vertices == ref.vertices
    for v in s.vertices:  # same adapters, bit for bit: the late reply entered no round
        for k, t in s.adapters[v].items():
            assert torch.equal(t, ref.adapters[v][k]), (v, k)


@pytest.mark.parametrize("kw", [{"quorum": 0}, {"quorum": 1.5}, {"quorum": 2, "grace_s": -1.0}])
def test_gossip_checks_quorum_and_grace(kw):
    with pytest.raises(ValueError, match="quorum|grace_s"):
        GossipLoRA(rounds=Rounds(**kw))


@pytest.mark.parametrize("cls", [GossipLoRA, RWLoRA])
@pytest.mark.parametrize("name", ["quorum", "grace_s"])
def test_the_plain_keywords_name_the_new_spelling(cls, name):
    want = f"{cls.__name__}({name}=3): {name} is a Rounds setting: use rounds=Rounds({name}=3)"
    with pytest.raises(TypeError) as err:
        cls(**{name: 3})
    assert str(err.value).startswith(want)
    if cls is RWLoRA:  # and why RW-LoRA would refuse it anyway
        assert str(err.value).endswith(
            "but RWLoRA refuses it: each hop goes to one node and "
            "waits for its reply (timeout), then re-routes"
        )


def test_rwlora_refuses_a_quorum_with_the_reason():
    with pytest.raises(ValueError, match=r"RWLoRA: Rounds.quorum=3 does not apply here: each hop"):
        RWLoRA(rounds=Rounds(quorum=3, grace_s=1.0))
    assert RWLoRA(rounds=Rounds(max_empty_rounds=5)).guard.limit == 5
