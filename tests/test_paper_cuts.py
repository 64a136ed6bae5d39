"""Issue 17's paper cuts, each pinned by a check that failed before its fix (in-process, on
the fake grid): the QUERY probe, the graph strategies' evaluation default, failing runs, the
resume config diff, the run-config pre-check, and the log nits."""

from __future__ import annotations

import logging

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_isoloco.strategies import GossipLoRA, RWLoRA


def plain_app() -> ClientApp:
    """A quickstart-style ClientApp: @app.train / @app.evaluate only, no @app.query()."""
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

    return app


def init_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(3, 2), "b": torch.zeros(2)}


# ---------------------------------------------------------------- 1. one quiet QUERY probe
@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_no_query_handler_is_probed_once(cls, caplog):
    """Before: every node got the QUERY (4 failed ClientApp calls, one Flower traceback each
    on Ray). After: one node is probed and the warning names it, in one line."""
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = cls()
    with caplog.at_level(logging.INFO, logger="flwr"):
        s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    queries = [r for r in grid.log if r.message_type == "query"]
    assert [(r.node_id, r.outcome) for r in queries] == [(min(grid.node_ids), "raised")]
    assert s.vmap.by_node_order and s.vmap.node_of == dict(enumerate(sorted(grid.node_ids)))
    said = [r.getMessage() for r in caplog.records if "@app.query()" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"probe of node {min(grid.node_ids)}" in said[0]


# ---------------------------------------------------------------- 2. evaluation as FedAvg's
@pytest.mark.parametrize("cls", [RWLoRA, GossipLoRA])
def test_graph_strategies_evaluate_by_default_as_fedavg(cls):
    """Before: fraction_evaluate defaulted to 0, so a swapped FedAvg app lost its federated
    evaluation (no evaluate message, evaluate_metrics_clientapp empty)."""
    grid = FakeGrid(plain_app(), num_nodes=4, seed=3)
    s = cls()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(init_model()), num_rounds=2, timeout=5)
    assert s.fraction_evaluate == 1.0
    assert sorted(res.evaluate_metrics_clientapp) == [1, 2]
    evaluated = [r.node_id for r in grid.log if r.message_type == "evaluate"]
    assert sorted(evaluated) == sorted(grid.node_ids * 2)  # every node, every round
    # the metric is the weighted mean over the nodes of the model sent (independent sum)
    final = s.current_arrays().to_torch_state_dict()
    expected = float(sum(v.abs().sum() for v in final.values()))
    assert res.evaluate_metrics_clientapp[2]["eval-loss"] == pytest.approx(expected, rel=1e-6)


def test_rwlora_sentiment_keeps_server_side_evaluation_only():
    """The app evaluates server-side; its graph strategies pin the old fraction_evaluate=0."""
    import sys
    from pathlib import Path

    sys.path.insert(
        0, str(Path(__file__).resolve().parents[1] / "simulations" / "rwlora_sentiment")
    )
    from rwlora_sentiment.task import build_strategy, load_config

    for name in ("rwlora", "gossip"):
        cfg = load_config({"strategy.name": name})
        assert build_strategy(cfg, 4).fraction_evaluate == 0.0
