"""Devices and precision in the apps (issue 37): ``train.device`` / ``train.precision`` /
``train.compile`` checked and passed to the workers, and a server-only setting
(``strategy.merge-device``) that never breaks a node."""

from __future__ import annotations

import json

import pytest
import torch
from fakegrid import FakeGrid
from isoloco_lm import client_app, server_app, task
from lm_app import tiny_config, write_corpus

from flwr_isoloco.runconfig import RunConfigError

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), plays=2, chars=20_000)
    return tiny_config(corpus, tmp_path_factory.mktemp("cache"), num_server_rounds=1)


# ----------------------------------------------------------------------------- merge device
@no_gpu
def test_server_merge_device_cuda_does_not_break_gpu_less_nodes(tiny, tmp_path):
    """Every node sees ``strategy.merge-device='cuda'`` in its run config on this GPU-less
    machine and trains (it checks the spelling only); the server, here on the CPU, uses all
    three replies."""
    grid = FakeGrid(
        {"train": client_app.train},
        num_nodes=3,
        run_config={**tiny, "strategy.merge-device": "cuda"},
    )
    node_cfg = task.load_config({**tiny, "strategy.merge-device": "cuda"}, node=True)
    assert node_cfg.strategy["merge-device"] == "cuda"
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "strategy.merge-device": "cpu"}
    out = server_app.run_server(grid, rc, settle_s=0.0)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    (row,) = res["rounds"]
    assert row["replies-used"] == 3 and row["replies-rejected"] == 0
    assert row["val-loss"] < res["initial"]["val-loss"]


@no_gpu
@pytest.mark.parametrize("option", ["cuda", "cuda:1"])
def test_server_refuses_cuda_merge_device_naming_the_key(tiny, tmp_path, option):
    """On the server the key is resolved: a CUDA device that is not visible is refused before
    anything is sent, naming strategy.merge-device and the fix."""
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "strategy.merge-device": option}
    with pytest.raises(RunConfigError, match=r"strategy\.merge-device.*no CUDA device") as err:
        task.load_config(rc)
    assert "'auto'" in str(err.value) and "'cpu'" in str(err.value)
    assert "'strategy.merge'" not in str(err.value)
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=rc)
    with pytest.raises(RunConfigError, match=r"strategy\.merge-device"):
        server_app.run_server(grid, rc, settle_s=0.0)
    assert grid.log == []  # nothing was sent to any node


def test_merge_device_spelling_is_checked_on_nodes_too(tiny):
    with pytest.raises(RunConfigError, match=r"'strategy\.merge-device' has bad value 'gpu'"):
        task.load_config({**tiny, "strategy.merge-device": "gpu"}, node=True)
