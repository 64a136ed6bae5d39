"""The one-line FedAvg -> IsoLoCo example (examples/swap-fedavg) runs, with either strategy."""

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "swap-fedavg"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402

ISO_LINE = "    strategy = IsoLoCo(fraction_train=1.0, min_available_nodes=2)  # was: FedAvg(...)\n"
FEDAVG_LINE = "    strategy = FedAvg(fraction_train=1.0, min_available_nodes=2)\n"


def _server_module(source: str) -> types.ModuleType:
    mod = types.ModuleType("swap_fedavg.server_app_variant")
    mod.__package__ = "swap_fedavg"
    exec(compile(source, str(EXAMPLE / "swap_fedavg" / "server_app.py"), "exec"), mod.__dict__)
    return mod


def _run(server_mod, out: Path, rounds=3):
    client_app = importlib.import_module("swap_fedavg.client_app").app
    rc = {"num-server-rounds": rounds, "local-steps": 10, "lr": 0.1, "output-dir": str(out)}
    grid = FakeGrid(client_app, num_nodes=3, run_config=rc)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    server_mod.main(grid, ctx)
    return json.loads((out / "result.json").read_text())


def test_one_line_swap(tmp_path):
    source = (EXAMPLE / "swap_fedavg" / "server_app.py").read_text()
    lines = source.splitlines(keepends=True)
    assert lines.count(ISO_LINE) == 1
    fedavg_source = source.replace(ISO_LINE, FEDAVG_LINE)
    diff = [
        (a, b)
        for a, b in zip(lines, fedavg_source.splitlines(keepends=True), strict=True)
        if a != b
    ]
    assert len(diff) == 1

    iso = _run(_server_module(source), tmp_path / "iso")
    fed = _run(_server_module(fedavg_source), tmp_path / "fed")
    assert iso["strategy"] == "IsoLoCo" and fed["strategy"] == "FedAvg"
    assert iso["val-loss"]["0"] == fed["val-loss"]["0"]  # same start model
    for res in (iso, fed):
        losses = [res["val-loss"][str(r)] for r in range(4)]
        assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_example_through_flwr_run(tmp_path):
    """The example through scripts/run_app.sh (Ray). Its output dir is awkward on purpose, so
    the same real run checks run_app.sh's path handling (issue 8, B10; a run of the tiny FedAvg
    app of its own in tests/test_scripts.py before): Flower is handed the exact dir, the
    ServerApp writes into this very dir and nothing lands beside it."""
    out = tmp_path / 'it\'s "out" \\t'  # quotes, a space and a literal backslash-t
    env = {**os.environ, "NUM_SUPERNODES": "3", "CPUS_PER_CLIENT": "1"}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "scripts" / "run_app.sh"),
            str(EXAMPLE),
            str(out),
            "num-server-rounds=2",
        ],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "run_app.json").read_text())["status"] == "finished:completed"
    res = json.loads((out / "result.json").read_text())  # written by the ServerApp, here
    assert res["strategy"] == "IsoLoCo" and set(res["val-loss"]) == {"0", "1", "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
