"""The LM app's ``strategy.secagg`` switch on the fake grid (the Ray run is in the app README).

Same tiny config, plain and under SecAgg+ (uniform weighting): the validation losses agree to
within what the quantisation step can move them, the SecAgg+ rows carry its columns, and the
refusals name the key."""

from __future__ import annotations

import json

import pytest
import torch
from fakegrid import FakeGrid
from isoloco_lm import client_app, server_app, task
from lm_app import tiny_config, write_corpus

from flwr_isoloco.clients import secagg_mod
from flwr_isoloco.runconfig import RunConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    rc = tiny_config(corpus, tmp_path_factory.mktemp("cache"), num_server_rounds=2)
    return {**rc, "strategy.weighting": "uniform", "checkpoint": False}


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
