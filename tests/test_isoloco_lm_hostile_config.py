"""isoloco_lm: run-config values that used to crash late or let a run "complete" untrained (B5, B11)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flwr_isoloco.runconfig import RunConfigError
from flwr_isoloco.strategies.core.guard import NoProgressError

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "simulations" / "isoloco-lm"
sys.path.insert(0, str(APP_DIR))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402
from isoloco_lm import client_app, server_app, task  # noqa: E402
from test_isoloco_lm_app import corpus, tiny  # noqa: E402,F401  (fixtures)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ({"seed": 2**32}, r"'seed' has bad value 4294967296: must be in \[0, 4294967295\]"),
        ({"seed": -1}, r"'seed' has bad value -1"),
        ({"torch-threads": 100000}, r"'torch-threads' has bad value 100000: must be in \[1, 256\]"),
        ({"torch-threads": 0}, r"'torch-threads' has bad value 0"),
        ({"strategy.max-weight-ratio": 0.5}, r"'strategy\.max-weight-ratio'.*>= 1, or 0"),
        ({"strategy.max-empty-rounds": -1}, r"'strategy\.max-empty-rounds'"),
        (
            {"num-server-rounds": 2, "train.local-steps": 5, "train.warmup-steps": 11},
            r"'train\.warmup-steps' = 11 is longer than the run \(2 rounds x 5 local steps = 10\)",
        ),
    ],
)
def test_out_of_range_values_are_refused(override, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        task.load_config(override)


@pytest.mark.parametrize("seed", [18_000_000, 2**32 - 1])
def test_large_seeds_give_usable_batches(seed):
    """Seeds >= 1.8e7 used to overflow every node's batch generator (no reply was ever used)."""
    g = task.batch_generator(seed, 7, 123)
    assert torch.randint(0, 10, (3,), generator=g).shape == (3,)
    # small seeds draw exactly what they drew before the mod-2**64 reduction
    old = torch.Generator().manual_seed((5 * 1_000_003 + 7) * 1_000_033 + 123)
    assert torch.equal(
        torch.rand(4, generator=task.batch_generator(5, 7, 123)), torch.rand(4, generator=old)
    )


def test_strategy_gets_the_weight_bound_and_empty_round_limit():
    s = task.build_strategy(
        task.load_config({"strategy.max-weight-ratio": 0.0, "strategy.max-empty-rounds": 7})
    )
    assert s.max_weight_ratio == 0.0 and s.book.guard.limit == 7
    assert task.build_strategy(task.load_config({})).max_weight_ratio == 5.0


def _file_dir(tmp):
    f = tmp / "a-file"
    f.write_text("x")
    return f


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda tmp: _file_dir(tmp), "is a file"),
        (lambda tmp: _file_dir(tmp) / "below", "Not a directory"),
        (lambda tmp: Path("/proc/flwr-isoloco-out"), "cannot write results there"),
    ],
)
def test_bad_output_dir_is_a_config_error_before_any_work(tiny, tmp_path, make, why):  # noqa: F811
    out = make(tmp_path)
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=tiny)
    rc = {**tiny, "output-dir": str(out)}
    with pytest.raises(RunConfigError, match=r"run-config key 'output-dir'.*" + why):
        server_app.run_server(grid, rc, settle_s=0.0)
    assert grid.log == []  # nothing was sent to any node


def test_run_that_trains_nothing_fails_instead_of_completing(tiny, tmp_path):  # noqa: F811
    rc = {**tiny, "output-dir": str(tmp_path / "o"), "num-server-rounds": 5}
    grid = FakeGrid({"train": client_app.train}, num_nodes=3, run_config=rc)
    for n in grid.node_ids:
        grid.set_fault(n, "raise")
    with pytest.raises(NoProgressError, match="3 consecutive rounds"):
        server_app.run_server(grid, rc, settle_s=0.0)
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["status"] == "failed" and "used no reply" in res["error"]
    assert [r["replies-used"] for r in res["rounds"]] == [0, 0]  # round 3 raised before its row
