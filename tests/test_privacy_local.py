"""Local (client-side) DP in the DiLoCo worker (issue 20): clip then noise before compression,
every merge rule allowed, replies without the echo dropped, the LM app's precheck."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from privacy_helpers import QUIET, flower_epsilon, start_run

from flwr_isoloco.strategies import DiLoCo, LocalDP


def _tiny_worker(payload="weights", **train):
    from flwr_isoloco.clients import TrainSettings, make_diloco_train_handler
    from flwr_isoloco.models.llama import build_llama, llama_config

    cfg = llama_config(vocab_size=32, hidden=16, layers=1, heads=2, max_seq_len=16)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(4)]
    train = TrainSettings(**{"lr": 1e-2, "local_steps": 2, "num_server_rounds": 2, **train})
    model_fn = lambda _ctx=None: build_llama(cfg, seed=0)  # noqa: E731
    worker = make_diloco_train_handler(model_fn, lambda _c: batches, train=train, payload=payload)
    return worker, model_fn


def test_privatize_clips_then_adds_noise_of_std_z_c():
    from flwr_isoloco.merging.dp import privatize

    gen = torch.Generator().manual_seed(0)
    out = privatize({"w": torch.zeros(200, 200)}, 0.5, 2.0, gen)
    assert abs(out["w"].double().std().item() / 1.0 - 1) < 0.03  # z C = 1
    big = privatize({"a": torch.full((10,), 100.0)}, 1.0, 0.0)  # no noise: clipping only
    assert big["a"].norm().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("codec", [None, "int8"])
def test_worker_applies_local_dp_before_compression(codec):
    """lr = 0: the trained delta is exactly zero, so the reply is the noise: std z C, and the
    compressed upload carries it (noise first, then compression with error feedback)."""
    from flwr.app import ConfigRecord, Context

    from flwr_isoloco.compression import decompress

    FakeGrid({}, num_nodes=1)  # Flower's task identity, so Messages can be built
    train, model_fn = _tiny_worker(lr=0.0, warmup_steps=0, payload="delta")
    theta = model_fn().state_dict()
    config = {"server-round": 1, "dp-clipping-norm": 0.05, "dp-noise-multiplier": 3.0}
    if codec:
        config.update({"upload-codec": codec, "error-feedback": True})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(theta), "config": ConfigRecord(config)}), 77, "train"
    )
    ctx = Context(1, 77, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
    reply = train(msg, ctx)
    echo = reply.content["config"]
    assert (echo["dp-clipping-norm"], echo["dp-noise-multiplier"]) == (0.05, 3.0)
    arrays = reply.content["arrays"]
    d = decompress(arrays) if codec else arrays.to_torch_state_dict()
    flat = torch.cat([v.double().flatten() for v in d.values() if v.is_floating_point()])
    assert abs(flat.std().item() / 0.15 - 1) < 0.05


def test_local_dp_allows_every_rule_and_drops_replies_without_the_echo():
    z, c = 2.0, 0.05
    train, model_fn = _tiny_worker()
    s = DiLoCo(**QUIET, merge="ties", privacy=LocalDP(noise_multiplier=z, clipping_norm=c))
    res = s.start(
        grid=FakeGrid({"train": train}, num_nodes=2),
        initial_arrays=ArrayRecord(model_fn().state_dict()),
        num_rounds=2,
        train_config=ConfigRecord({"num-server-rounds": 2}),
    )
    for r in (1, 2):
        m = res.train_metrics_clientapp[r]
        assert m["replies-used"] == 2 and m["dp-noise-std"] == pytest.approx(z * c)
        # each site's own release: multiplier z / 2 (replace-one sensitivity 2 C)
        assert m["dp-epsilon"] == pytest.approx(flower_epsilon(z / 2, r, 1e-5, 1), rel=1e-12)
    plain = DiLoCo(**QUIET, privacy=LocalDP(noise_multiplier=z, clipping_norm=c))
    res = start_run(plain, 2, 1)
    assert res.train_metrics_clientapp[1]["replies-rejected"] == 2  # no echo: not private


def test_lm_app_precheck_names_the_dp_key():
    from flwr_isoloco.runconfig import precheck_app_config

    app = Path(__file__).resolve().parents[1] / "simulations" / "isoloco-lm"
    (msg,) = precheck_app_config(app, {"strategy.dp-noise-multiplier": 1.0})
    assert "'strategy.dp-noise-multiplier'" in msg and "needs strategy.dp-clipping-norm" in msg
    ties = {"strategy.dp-noise-multiplier": 1.0, "strategy.dp-clipping-norm": 0.5}
    ties["strategy.merge"] = "ties"
    (msg,) = precheck_app_config(app, ties)
    assert "'strategy.dp-clipping-norm'" in msg and "LocalDP" in msg
    assert precheck_app_config(app, {**ties, "strategy.dp-mode": "local"}) == []
    (msg,) = precheck_app_config(app, {"strategy.dp-delta": 2.0})
    assert "'strategy.dp-delta'" in msg
