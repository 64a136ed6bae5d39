"""The digits app's BatchNorm CNN (``model="cnn-bn"``) under ``IsoLoCo()``: its running
statistics are merged as FedAvg merges them (issue 34, item 3), so the server's running
variances stay the nodes' weighted mean (positive) and the model learns."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits"
sys.path.insert(0, str(EXAMPLE))

from fakegrid import FakeGrid  # noqa: E402

from flwr_isoloco.strategies import IsoLoCo  # noqa: E402


def test_cnn_bn_under_isoloco_keeps_running_statistics_out_of_the_outer_step():
    torch.set_num_threads(1)
    task = importlib.import_module("digits.task")
    server = importlib.import_module("digits.server_app")
    client = importlib.import_module("digits.client_app").app
    rc = {"num-server-rounds": 2, "model": "cnn-bn", "partitioner": "dirichlet"}
    strategy = IsoLoCo(fraction_evaluate=0.0)
    grid = FakeGrid(client, num_nodes=4, run_config=rc)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    acc = server.run_federation(grid, ctx, strategy)
    theta = strategy.theta
    assert {"bn1.running_var", "bn2.running_mean"} <= set(theta)
    assert all(theta[k].min() > 0 for k in ("bn1.running_var", "bn2.running_var"))
    assert not any("running_" in k for k in strategy.outer.momentum_buffer)
    assert "bn1.weight" in strategy.outer.momentum_buffer  # BatchNorm's gamma is a parameter
    assert acc[2] > 0.5  # chance is 0.1
    net = task.Net(model="cnn-bn")
    net.load_state_dict(strategy.current_arrays().to_torch_state_dict())


def test_docs_buffers_table_is_what_the_records_give(tmp_path):
    """docs/strategies.md's BUFFERS TABLE block is ``isoloco_dropin.py --table --bn --docs``
    of benchmarks/results/isoloco_dropin_bn.json (regenerated into a copy: no change)."""
    import importlib.util
    import json

    repo = EXAMPLE.parents[1]
    spec = importlib.util.spec_from_file_location(
        "isoloco_dropin", repo / "benchmarks" / "dropin" / "isoloco_dropin.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = tmp_path / "strategies.md"
    doc.write_text((repo / "docs" / "strategies.md").read_text())
    saved = json.loads((repo / "benchmarks" / "results" / "isoloco_dropin_bn.json").read_text())
    bench.bn_docs(saved, doc)
    assert doc.read_text() == (repo / "docs" / "strategies.md").read_text()
