"""One real Flower simulation (Ray backend): IsoLoCo + the DiLoCo worker, tiny LLaMA, 2 nodes.

Slow (Ray start ~10 s): select with ``pytest -m slow tests/test_ray_diloco.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

RESULT: dict = {}
ROUNDS, H = 2, 2


def _model(_ctx=None):
    from flwr_isoloco.models.llama import build_llama, llama_config

    return build_llama(llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16), 0)


def _data(ctx):
    pid = int(ctx.node_config["partition-id"])
    g = torch.Generator().manual_seed(pid)
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]


def _apps():
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from flwr_isoloco.clients import (
        TrainSettings,
        make_diloco_train_handler,
        make_lm_evaluate_handler,
    )
    from flwr_isoloco.strategies import IsoLoCo

    client = ClientApp()
    train = TrainSettings(lr=1e-2, local_steps=H)
    client.train()(make_diloco_train_handler(_model, _data, train=train))
    client.evaluate()(make_lm_evaluate_handler(_model, _data))

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        strategy = IsoLoCo(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2)
        initial = {k: v.detach().clone() for k, v in _model().state_dict().items()}
        RESULT["initial"] = initial
        RESULT["result"] = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"num-server-rounds": ROUNDS}),
            timeout=120,
        )
        RESULT["rounds"] = strategy.server_round

    return server, client


def test_isoloco_ray_simulation_completes_and_changes_the_model():
    from flwr.simulation import run_simulation

    # Ray workers import this module by name: make tests/ importable for them.
    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    server, client = _apps()
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=2,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    assert RESULT.get("rounds") == ROUNDS, "the ServerApp did not finish its rounds"
    res = RESULT["result"]
    for rnd in range(1, ROUNDS + 1):
        assert res.train_metrics_clientapp[rnd]["replies-used"] == 2
        assert res.train_metrics_clientapp[rnd]["replies-rejected"] == 0
    final = res.arrays.to_torch_state_dict()
    assert set(final) == set(RESULT["initial"])
    change = max(float((final[k] - RESULT["initial"][k]).abs().max()) for k in final)
    assert change > 1e-4
    assert all(torch.isfinite(v).all() for v in final.values())
    assert res.evaluate_metrics_clientapp[ROUNDS]["eval-loss"] > 0
