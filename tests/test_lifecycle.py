"""One lifecycle for every strategy: resume with global round numbers, the round-end hook,
RW-LoRA / gossip as drop-ins for FedAvg (no query handler, FedAvg's keyword arguments), and
the one node-waiting helper."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint
from flwr_isoloco.clients import partition_id_query
from flwr_isoloco.strategies import (
    DiLoCo,
    GossipLoRA,
    IsoLoCo,
    NodeWaitError,
    RWLoRA,
    wait_for_nodes,
)

torch.set_num_threads(1)
N = 3


def init_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def plain_app(with_query: bool = False) -> ClientApp:
    """A quickstart-style ClientApp: @app.train / @app.evaluate only (FedAvg replies)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        theta = msg.content["arrays"].to_torch_state_dict()
        new = {k: 0.5 * v + (pid + 1) * 0.25 for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": 10 + pid, "train-loss": float(pid)})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        loss = float(sum(v.abs().sum() for v in theta.values()))
        metrics = MetricRecord({"num-examples": 1, "eval-loss": loss})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    if with_query:
        app.query()(partition_id_query)
    return app


MAKERS = {
    "DiLoCo": lambda: DiLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0),
    "IsoLoCo": lambda: IsoLoCo(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0),
    "RWLoRA": lambda: RWLoRA(),
    "GossipLoRA": lambda: GossipLoRA(),
}


def _start(strategy, grid, rounds, seen, ended):
    def evaluate_fn(rnd, arrays):
        seen.append(rnd)
        return MetricRecord(
            {"norm": float(sum(float(t.norm()) for t in arrays.to_torch_state_dict().values()))}
        )

    def on_round_end(rnd, arrays, train_metrics, eval_metrics):
        ended.append((rnd, train_metrics is not None, eval_metrics["norm"]))

    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(init_model()),
        num_rounds=rounds,
        timeout=5,
        evaluate_fn=evaluate_fn,
        on_round_end=on_round_end,
    )


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_resume_in_a_user_app_numbers_rounds_globally(name, tmp_path, caplog):
    full = _start(MAKERS[name](), FakeGrid(plain_app(), num_nodes=N), 4, [], [])

    grid = FakeGrid(plain_app(), num_nodes=N)
    first = MAKERS[name]()
    seen1, ended1 = [], []
    res1 = _start(first, grid, 2, seen1, ended1)
    sd = first.state_dict()
    save_checkpoint(tmp_path / "ckpt.safetensors", sd["tensors"], sd["meta"])
    tensors, meta = load_checkpoint(tmp_path / "ckpt.safetensors")

    second = MAKERS[name]()
    second.load_state_dict({"tensors": tensors, "meta": meta})
    assert second.completed_rounds == 2
    seen2, ended2 = [], []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        res2 = _start(second, grid, 4, seen2, ended2)

    assert seen1 == [0, 1, 2] and seen2 == [3, 4]  # not 0, 1, 2 again
    assert sorted(res1.train_metrics_clientapp) == [1, 2]
    assert sorted(res2.train_metrics_clientapp) == [3, 4]
    assert sorted(res2.evaluate_metrics_serverapp) == [3, 4]
    assert [r for r, _, _ in ended1 + ended2] == [1, 2, 3, 4]
    assert all(has_train for _, has_train, _ in ended1 + ended2)
    text = caplog.text
    assert "[ROUND 3/4]" in text and "[ROUND 4/4]" in text and "[ROUND 1/" not in text
    # the resumed run ends where an uninterrupted one does (bitwise)
    a, b = full.arrays.to_torch_state_dict(), res2.arrays.to_torch_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a strategy with every round done runs nothing and returns its model
    seen3: list[int] = []
    res3 = _start(second, grid, 4, seen3, [])
    assert seen3 == [] and not res3.train_metrics_clientapp


@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_no_query_handler_vertices_are_nodes_in_id_order(cls, caplog):
    grid = FakeGrid(plain_app(), num_nodes=4, seed=7)
    s = cls()  # no arguments: graph "complete" on the connected nodes
    with caplog.at_level(logging.INFO, logger="flwr"):
        res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=3, timeout=5)
    assert s.vmap.by_node_order
    assert s.vmap.node_of == dict(enumerate(sorted(grid.node_ids)))
    assert s.graph.number_of_nodes() == 4
    explained = [r for r in caplog.records if "no @app.query() handler" in r.getMessage()]
    assert len(explained) == 1, [r.getMessage() for r in explained]
    assert "partition_id_query" in explained[0].getMessage()
    assert not [r for r in caplog.records if "query to node" in r.getMessage()]  # no tracebacks
    used = "hop-ok" if cls is RWLoRA else "trained"
    expected = 1 if cls is RWLoRA else 4
    assert [res.train_metrics_clientapp[r][used] for r in (1, 2, 3)] == [expected] * 3


def test_partition_id_query_maps_vertex_to_partition():
    grid = FakeGrid(plain_app(with_query=True), num_nodes=4, seed=7)
    s = RWLoRA("ring", num_vertices=4, lazy=True)
    s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    assert not s.vmap.by_node_order
    assert s.vmap.node_of == {pid: grid.node_ids[pid] for pid in range(4)}
    assert sorted(grid.node_ids) != grid.node_ids  # so node-id order would have differed


@pytest.mark.parametrize(
    "cls, kwargs, pattern",
    [
        (RWLoRA, {"fraction_train": 0.5}, "trains exactly one node per round"),
        (RWLoRA, {"min_train_nodes": 2}, "trains exactly one node per round"),
        (GossipLoRA, {"fraction_train": 0.5}, "trains every live vertex"),
        (GossipLoRA, {"train_metrics_aggr_fn": sum}, "mixing and byte accounting"),
        (RWLoRA, {"fraction_evalute": 0.5}, "unexpected keyword argument 'fraction_evalute'"),
    ],
)
def test_fedavg_arguments_without_meaning_are_refused_with_a_reason(cls, kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_fedavg_evaluation_arguments_work(cls):
    grid = FakeGrid(plain_app(), num_nodes=4)
    s = cls(fraction_evaluate=0.5, min_evaluate_nodes=1, min_available_nodes=4)
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    evaluated = [r for r in grid.log if r.message_type == "evaluate"]
    assert len(evaluated) == 2 * 2  # floor(0.5 * 4) nodes per round
    m = res.evaluate_metrics_clientapp[2]
    assert m["replies-used"] == 2 and m["eval-loss"] > 0


class _GrowingGrid:
    """get_node_ids() lists one more node per call, up to ``n``."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def get_node_ids(self):
        self.calls += 1
        return list(range(10, 10 + min(self.calls, self.n)))


def test_wait_for_nodes_waits_for_enough_and_stable(monkeypatch):
    monkeypatch.setattr("flwr_isoloco.strategies.core.nodes.POLL_S", 0.001)
    assert wait_for_nodes(_GrowingGrid(3), 3) == [10, 11, 12]
    assert wait_for_nodes(_GrowingGrid(2), 1, settle_s=0.05) == [10, 11]  # waits out growth
    with pytest.raises(NodeWaitError, match="only 2 of 5 nodes connected"):
        wait_for_nodes(_GrowingGrid(2), 5, timeout_s=0.05, what="app")
    assert wait_for_nodes(_GrowingGrid(2), 5, timeout_s=0.05, strict=False) == [10, 11]
