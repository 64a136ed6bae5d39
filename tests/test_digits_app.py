"""The digits app (examples/digits): partitions, an in-process run, and on Ray (slow) IsoLoCo()
swapped in for FedAvg by the README's change does not collapse and is at least as good.

The swap is made on the ServerApp's source, one changed line (the import is already there)."""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

pytest.importorskip("sklearn")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"
sys.path.insert(0, str(EXAMPLE))

from fakegrid import FakeGrid  # noqa: E402
from ray_mains import run_mains  # noqa: E402

FEDAVG_LINE = "    strategy = FedAvg()\n"
TOLERANCE = 0.01  # issue 17: IsoLoCo() >= FedAvg - 0.01
COLLAPSED = 0.5  # chance is 0.1; the paper preset ends at ~0.10 on this app (results json)


def _variant(line: str) -> types.ModuleType:
    """The example's ServerApp module with its ``strategy =`` line replaced by ``line``."""
    source = (EXAMPLE / "digits" / "server_app.py").read_text()
    assert source.splitlines(keepends=True).count(FEDAVG_LINE) == 1
    changed = source.replace(FEDAVG_LINE, line)
    mod = types.ModuleType("digits.server_app_variant")
    mod.__package__ = "digits"
    exec(compile(changed, mod.__name__, "exec"), mod.__dict__)
    return mod


def test_partitions_are_disjoint_cover_the_training_set_and_are_seeded():
    task = importlib.import_module("digits.task")
    for kind in ("iid", "dirichlet"):
        parts = task.partition_indices(4, kind, 0.5, 0)
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == 1437, kind
        assert task.partition_indices(4, kind, 0.5, 0) == parts
    skewed = task.partition_indices(4, "dirichlet", 0.5, 0)
    assert skewed != task.partition_indices(4, "dirichlet", 0.5, 1)  # the seed matters
    assert len(task.load_test()[1]) == 360


def test_app_runs_in_process_with_isoloco():
    client = importlib.import_module("digits.client_app").app
    mod = _variant("    strategy = IsoLoCo()\n")
    rc = {"num-server-rounds": 2}
    grid = FakeGrid(client, num_nodes=4, run_config=rc)
    mod.main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc))
    res = mod.LAST["result"]
    assert mod.LAST["strategy"] == "IsoLoCo"
    assert sorted(res.evaluate_metrics_serverapp) == [0, 1, 2]
    assert sorted(res.evaluate_metrics_clientapp) == [1, 2]


@pytest.mark.slow
def test_isoloco_default_matches_fedavg_on_ray():
    """FedAvg and IsoLoCo() on Flower's Ray engine (4 SuperNodes, 10 rounds, IID, seed 0);
    run_simulation passes no run config, so the app runs at its code defaults. One simulation,
    one Ray start: its ServerApp runs the two variants' ``main`` one after the other on the
    simulation's grid (the ClientApp keeps no state between messages)."""

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXAMPLE), str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    client = importlib.import_module("digits.client_app").app
    mods = {name: _variant(FEDAVG_LINE.replace("FedAvg", name)) for name in ("FedAvg", "IsoLoCo")}
    run_mains((mod.main for mod in mods.values()), client, 4)
    final = {}
    for name, mod in mods.items():
        assert mod.LAST.get("strategy") == name, f"{name}: the ServerApp did not finish"
        acc = {
            r: float(m["accuracy"])
            for r, m in mod.LAST["result"].evaluate_metrics_serverapp.items()
        }
        assert sorted(acc) == list(range(11)), acc
        final[name] = acc[10]
    print("digits on Ray, final test accuracy:", final)
    assert final["IsoLoCo"] > COLLAPSED, final
    assert final["IsoLoCo"] >= final["FedAvg"] - TOLERANCE, final
