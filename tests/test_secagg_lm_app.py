"""The LM app's ``strategy.secagg`` switch on the fake grid (the Ray run is in the app README).

Same tiny config, plain and under SecAgg+ (uniform weighting): the validation losses agree to
within what the quantisation step can move them, the SecAgg+ rows carry its columns, and the
refusals name the key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "simulations" / "isoloco_lm"
sys.path.insert(0, str(APP_DIR))
sys.path.insert(0, str(REPO / "tests"))

from fakegrid import FakeGrid  # noqa: E402
from isoloco_lm import client_app, server_app, task  # noqa: E402

from flwr_isoloco.runconfig import RunConfigError  # noqa: E402
from flwr_isoloco.secagg_mod import secagg_mod  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from flwr_isoloco.data.text import load_corpus

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(load_corpus("shakespeare")[:3]):
        (d / f"play{i}.txt").write_text(text[:40_000], encoding="utf-8")
    return {
        "num-server-rounds": 2,
        "model.hidden": 32,
        "model.heads": 2,
        "model.vocab-size": 400,
        "train.seq-len": 32,
        "train.batch-size": 4,
        "train.local-steps": 3,
        "train.warmup-steps": 2,
        "data.val-tokens": 1024,
        "data.corpus": str(d),
        "data.cache-dir": str(tmp_path_factory.mktemp("cache")),
        "strategy.min-nodes": 3,
        "strategy.weighting": "uniform",
        "checkpoint": False,
    }


def _run(rc, out):
    rc = {**rc, "output-dir": str(out)}
    handler = client_app.train
    grid = FakeGrid({"train": lambda m, c: secagg_mod(m, c, handler)}, num_nodes=3, run_config=rc)
    server_app.run_server(grid, rc, settle_s=0.0)
    return json.loads((out / "results.json").read_text())


def test_secagg_switch_matches_the_plain_run(tiny, tmp_path):
    rc = {**tiny, "strategy.name": "isoloco"}
    plain = _run(rc, tmp_path / "plain")
    sec = _run({**rc, "strategy.secagg": True}, tmp_path / "sec")
    for a, b in zip(plain["rounds"], sec["rounds"], strict=True):
        assert abs(a["val-loss"] - b["val-loss"]) < 1e-3, (a["round"], a["val-loss"], b["val-loss"])
        assert b["replies-used"] == 3 and b["secagg-clipped-entries"] == 0
        assert b["secagg-bound"] == pytest.approx(16 / 2**22)
        assert "secagg-bound" not in a
    assert sec["rounds"][-1]["val-loss"] < sec["initial"]["val-loss"]


@pytest.mark.parametrize(
    "override, pattern",
    [
        ({"strategy.weighting": "examples"}, "strategy.secagg.*max_weight_ratio"),
        ({"strategy.merge": "ties"}, "strategy.secagg.*every delta"),
        ({"strategy.secagg-num-shares": 2}, "strategy.secagg.*num_shares"),
    ],
)
def test_secagg_refusals_name_the_key(tiny, override, pattern):
    with pytest.raises(RunConfigError, match=pattern):
        task.load_config({**tiny, "strategy.secagg": True, **override})
