"""benchmarks/compression/comm_frontier.py --quick: bytes counted from the real messages, resume.

Two tiny in-process runs (FakeGrid, the sweep's real ClientApp with download_mod): fp32 and
sparseloco k = 64 both ways."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def frontier(tmp_path_factory):
    spec = importlib.util.spec_from_file_location(
        "comm_frontier", REPO / "benchmarks" / "compression" / "comm_frontier.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["comm_frontier"] = mod
    spec.loader.exec_module(mod)
    mod.QUICK_RECORDS = tmp_path_factory.mktemp("frontier") / "quick.json"
    mod.main(["--quick"])
    return mod


def test_quick_bytes_from_messages(frontier):
    from flwr.app import ArrayRecord

    recs = {r["config"]: r for r in frontier.common.load_records(frontier.QUICK_RECORDS)}
    fp32, sl = recs["diloco-fp32-nesterov"]["bytes"], recs["diloco-sl64-nesterov-both"]["bytes"]
    # fp32 both ways: the model's own ArrayRecord, counted independently
    size = frontier.run_size(True)
    full = ArrayRecord(frontier.L.build_model(size, 0).state_dict()).count_bytes()
    assert fp32["up_arrays_per_node_round"] == full
    assert fp32["down_arrays_per_node_round"] == full
    # sparseloco: round 1 goes down in full (nodes hold nothing), rounds 2+ compressed both ways
    assert sl["round1_down_per_node"] >= full
    assert sl["up_per_node_round"] < fp32["up_per_node_round"] / 10
    assert sl["down_per_node_round"] < fp32["down_per_node_round"] / 10
    assert sl["total_run"] == sum(
        r["down"] + r["up"] for r in recs["diloco-sl64-nesterov-both"]["bytes_rounds"]
    )


def test_resume_skips_recorded_run(frontier, capsys):
    before = frontier.common.load_records(frontier.QUICK_RECORDS)
    frontier.one("diloco-fp32-nesterov", 0.25, 0, "quick", True)
    assert "skip diloco-fp32-nesterov|lr=0.25|seed=0" in capsys.readouterr().out
    assert frontier.common.load_records(frontier.QUICK_RECORDS) == before


def test_tuning_extends_past_an_edge_optimum(frontier):
    name = "diloco-sl64-nesterov-both"
    done = {
        frontier.key(name, lr, 0): {"val_loss": v}
        for lr, v in zip(frontier.lr_grid(0.25), (3.0, 3.5, 4.0), strict=True)
    }
    todo, best = frontier.tuning(name, done)
    assert (todo, best) == ([0.125], None)  # 0.177 best, on the edge: one point below
    done[frontier.key(name, 0.125, 0)] = {"val_loss": 3.2}
    assert frontier.tuning(name, done) == ([], 0.177)
