"""The quickstart swap: in a plain Flower app (examples/quickstart-swap, ClientApp with only
@app.train / @app.evaluate), each of DiLoCo, IsoLoCo, RWLoRA and GossipLoRA replaces FedAvg by
one changed line and the run completes (in-process, and on Ray: slow)."""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "quickstart-swap"
sys.path.insert(0, str(EXAMPLE))

from fakegrid import FakeGrid  # noqa: E402
from ray_mains import run_mains  # noqa: E402

FEDAVG_LINE = "    strategy = FedAvg(fraction_evaluate=0.5)\n"
SWAPS = ["DiLoCo", "IsoLoCo", "RWLoRA", "GossipLoRA"]
ROUNDS = 3


def _variant(name: str) -> types.ModuleType:
    """The example's ServerApp module with the FedAvg line changed to ``name`` (one line)."""
    source = (EXAMPLE / "quickstart_swap" / "server_app.py").read_text()
    assert source.splitlines(keepends=True).count(FEDAVG_LINE) == 1
    changed = source.replace(FEDAVG_LINE, FEDAVG_LINE.replace("FedAvg", name))
    diff = [
        (a, b) for a, b in zip(source.splitlines(), changed.splitlines(), strict=True) if a != b
    ]
    assert len(diff) == (0 if name == "FedAvg" else 1)
    mod = types.ModuleType(f"quickstart_swap.server_app_{name}")
    mod.__package__ = "quickstart_swap"
    exec(compile(source if name == "FedAvg" else changed, mod.__name__, "exec"), mod.__dict__)
    return mod


RUN_CONFIG = {"num-server-rounds": ROUNDS, "local-epochs": 2, "lr": 0.5, "output-dir": ""}


def _check(mod, name):
    res = mod.LAST["result"]
    assert mod.LAST["strategy"] == name
    acc = {r: float(m["accuracy"]) for r, m in res.evaluate_metrics_serverapp.items()}
    assert sorted(acc) == list(range(ROUNDS + 1)), acc
    assert sorted(res.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert sorted(res.evaluate_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert acc[ROUNDS] > acc[0] + 0.2, acc  # it learned
    return acc


@pytest.mark.parametrize("name", ["FedAvg", *SWAPS])
def test_quickstart_swap_in_process(name):
    client = importlib.import_module("quickstart_swap.client_app").app
    mod = _variant(name)
    grid = FakeGrid(client, num_nodes=3, run_config=RUN_CONFIG)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=RUN_CONFIG)
    mod.main(grid, ctx)
    _check(mod, name)


@pytest.mark.slow
def test_quickstart_swap_on_ray():
    """All four swaps through Flower's Ray simulation engine (3 SuperNodes, 3 rounds each). One
    simulation, one Ray start: its ServerApp runs the four changed ServerApps' ``main`` one
    after the other on the simulation's grid (the ClientApp keeps no state between messages,
    so each swap sees the nodes as a run of its own would)."""

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXAMPLE), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    client = importlib.import_module("quickstart_swap.client_app").app
    mods = {name: _variant(name) for name in SWAPS}
    for mod in mods.values():
        mod.LAST.clear()
    # run_simulation() takes no run config: the apps use pyproject.toml's defaults
    run_mains((mod.main for mod in mods.values()), client, 3)
    accuracies = {}
    for name, mod in mods.items():
        assert mod.LAST, f"{name}: the ServerApp did not finish"
        accuracies[name] = _check(mod, name)
    print("quickstart swap on Ray, test accuracy per round:", accuracies)
