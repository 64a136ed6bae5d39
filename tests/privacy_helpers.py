"""Shared pieces of the DP tests (test_privacy*.py): a federation of step clients on the fake
grid, a checkpoint round trip, and an epsilon from Flower's own accountant."""

from __future__ import annotations

import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)

from flwr_isoloco.checkpoint import load_checkpoint, save_checkpoint

QUIET = dict(min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0)


def step_client(step=lambda pid, rnd: 0.01 * (pid + 1) * (-1) ** rnd):
    """Node ``pid`` replies ``theta + step(pid, round)`` (weights = its pid + 1 examples)."""

    def train(msg: Message, ctx) -> Message:
        theta = msg.content["arrays"].to_torch_state_dict()
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        new = {k: v + step(pid, rnd) for k, v in theta.items()}
        metrics = MetricRecord({"num-examples": pid + 1})
        return Message(RecordDict({"arrays": ArrayRecord(new), "m": metrics}), reply_to=msg)

    return {"train": train}


def small_model(side: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(side, side, generator=g), "b": torch.zeros(side)}


def start_run(strategy, num_nodes: int, num_rounds: int):
    """``strategy`` run for ``num_rounds`` on ``num_nodes`` :func:`step_client` nodes from :func:`small_model`."""
    return strategy.start(
        grid=FakeGrid(step_client(), num_nodes=num_nodes),
        initial_arrays=ArrayRecord(small_model()),
        num_rounds=num_rounds,
    )


def through_checkpoint(strategy, tmp_path):
    """``strategy.state_dict()`` written to a checkpoint file and read back: ``(tensors, meta)``."""
    sd = strategy.state_dict()
    return load_checkpoint(save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], sd["meta"]))


def flower_epsilon(z: float, rounds: int, delta: float, population: int) -> float:
    """An accountant built here from Flower's public API, fed ``rounds`` Gaussian events."""
    config = PrivacyConfig(
        target_delta=delta,
        population_size=population,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION,
    )
    acc = RdpAccountant(config)
    for _ in range(rounds):
        acc.compose(GaussianPrivacyEvent(z, population, population))
    return acc.get_epsilon(delta)
