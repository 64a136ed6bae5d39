"""Real Flower simulations (Ray backend): int8 uploads (the bytes-up metric is real); int8
downloads with a node that restarts (the full model pushed within the round).

Slow (Ray start ~10 s): select with ``pytest -m slow tests/test_compression_ray.py``.
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

    return build_llama(llama_config(vocab_size=64, hidden=32, layers=1, heads=2, max_seq_len=16), 0)


def _data(ctx):
    g = torch.Generator().manual_seed(int(ctx.node_config["partition-id"]))
    return [torch.randint(0, 64, (2, 9), generator=g) for _ in range(4)]


def _apps():
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from flwr_isoloco.clients import TrainSettings, make_diloco_train_handler
    from flwr_isoloco.strategies import IsoLoCo

    client = ClientApp()
    train = TrainSettings(lr=1e-2, local_steps=H)
    client.train()(make_diloco_train_handler(_model, _data, train=train))
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        strategy = IsoLoCo(
            min_available_nodes=2, min_train_nodes=2, fraction_evaluate=0.0, upload="int8"
        )
        initial = {k: v.detach().clone() for k, v in _model().state_dict().items()}
        RESULT["initial"] = initial
        RESULT["result"] = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"num-server-rounds": ROUNDS}),
            timeout=120,
        )

    return server, client


def simulate(server, client) -> None:
    """``server`` and ``client`` in a 2-node Ray simulation, 1 CPU a node (this folder on the
    actors' PYTHONPATH, for the apps' functions)."""
    from flwr.simulation import run_simulation

    here = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=2,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )


def test_int8_uploads_through_ray_cut_bytes_up():
    from flwr.app import ArrayRecord

    from flwr_isoloco.compression import payload_nbytes

    server, client = _apps()
    simulate(server, client)
    res = RESULT["result"]
    fp32 = payload_nbytes(ArrayRecord(RESULT["initial"]))
    for rnd in range(1, ROUNDS + 1):
        m = res.train_metrics_clientapp[rnd]
        assert m["replies-used"] == 2 and m["replies-rejected"] == 0
        assert m["bytes-down"] == 2 * fp32
        assert 0.2 * 2 * fp32 < m["bytes-up"] < 0.35 * 2 * fp32  # int8: ~1/4 plus scales, vectors
    final = res.arrays.to_torch_state_dict()
    assert max(float((final[k] - RESULT["initial"][k]).abs().max()) for k in final) > 1e-4


def _forget(msg, context, call_next):
    """A restart of partition 0 before round 3's training: its copy of B is gone."""
    from flwr_isoloco.clients.download import STATE_ARRAYS, STATE_CONFIG

    cfg = msg.content.config_records.get("config", {})
    if int(context.node_config["partition-id"]) == 0 and cfg.get("server-round") == 3:
        for key in (STATE_ARRAYS, STATE_CONFIG):
            if key in context.state:
                del context.state[key]
    return call_next(msg, context)


def test_a_restarted_node_gets_the_full_model_within_the_round_through_ray():
    """int8 downloads in a real simulation: partition 0 loses its copy of B before round 3; its
    refusal brings the full model within round 3 (pushed mid-round through Flower's grid), so
    both replies are used; bytes down: two int8 updates plus the fp32 model."""
    from flwr.app import ArrayRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from test_download import theta0, train_fn

    from flwr_isoloco.clients import download_mod
    from flwr_isoloco.compression import compress, payload_nbytes
    from flwr_isoloco.strategies import DiLoCo

    client = ClientApp(mods=[_forget, download_mod])
    client.train()(train_fn)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        s = DiLoCo(min_available_nodes=2, fraction_evaluate=0.0, download="int8")
        RESULT["restart"] = s.start(
            grid=grid, initial_arrays=ArrayRecord(theta0()), num_rounds=3, timeout=120
        )

    simulate(server, client)
    m = RESULT["restart"].train_metrics_clientapp
    update = payload_nbytes(compress({k: torch.zeros_like(v) for k, v in theta0().items()}, "int8"))
    assert [m[r]["replies-used"] for r in (1, 2, 3)] == [2, 2, 2]
    assert m[3]["bytes-down"] == 2 * update + 4 * (32 * 64 + 64)
