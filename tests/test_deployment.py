"""Loopback deployment tests: TLS SuperLink + authenticated SuperNodes on 127.0.0.1, `flwr run`.

Select alone with ``pytest -m deployment``. Each test stops every process it started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deploy_harness import format_run_config, loopback_deployment

pytestmark = pytest.mark.deployment

TESTS_DIR = Path(__file__).resolve().parent
TINY_APP = TESTS_DIR / "deploy_app"


def test_format_run_config_quotes_strings_and_rejects_quotes():
    text = format_run_config({"a": 1, "b": 0.5, "c": True, "output-dir": "/x/y"})
    assert text == "a=1 b=0.5 c=true output-dir='/x/y'"
    with pytest.raises(ValueError, match="'bad'"):
        format_run_config({"bad": "it's"})


def test_tiny_fedavg_app_over_tls_with_node_auth(tmp_path):
    """The harness end to end: 3 authenticated SuperNodes, 2 FedAvg rounds, results written."""
    out = tmp_path / "out"
    with loopback_deployment(tmp_path / "dep", num_supernodes=3) as dep:
        run = dep.run_app(TINY_APP, {"num-server-rounds": 2, "output-dir": str(out)}, 300)
        assert run.status == "finished:completed", run.output + run.logs + dep.diagnostics()
        procs = [dep.superlink] + [n.process for n in dep.supernodes]
    assert all(not p.alive() for p in procs)
    results = json.loads((out / "results.json").read_text())
    assert results["num-server-rounds"] == 2
    assert sorted(results["train_metrics"]) == ["1", "2"]
    # FedAvg of 3 equal-size partitions: every node trained, the loss fell from round 1 to 2.
    assert results["train_metrics"]["2"]["train_loss"] < results["train_metrics"]["1"]["train_loss"]
