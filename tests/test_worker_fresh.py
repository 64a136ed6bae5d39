"""benchmarks/gpu/worker_fresh.py at the tiny size: every message in a fresh process, the
node's state carried by its temp folder and its Context through protobuf, the message as
Flower's deflated objects. The chain's replies equal the handler's in one process, bitwise."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _load(name):
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fresh_processes_time_every_stage_and_reply_as_one_process(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    wf = _load("worker_fresh")
    res = wf.measure("tiny", "fp32", messages=1, keep=tmp_path / "last.pkl")
    assert res["messages"] == 1 and len(res["bare_msg_s"]) == 1
    stages = res["stages_median_s"]
    for stage in ("model_build", "state_read", "unpack", "load_model", "inner_steps", "reply"):
        assert stage in stages, stage
    assert stages["inner_steps"] > 0 and res["child_s"] <= res["child_wall_s"]
    assert res["overhead_s"] == pytest.approx(res["child_wall_s"] - stages["inner_steps"])
    # the last fresh process's reply is the in-process handler's after the same 2 messages
    wt = wf.wt
    size = wt.sizes("cpu", quick=True)["tiny"]
    handler = wt.Handler(size, size.build(0), torch.device("cpu"), "fp32", 2, size.h, False)
    handler.message()
    handler.message()
    got = wf.read_reply(tmp_path / "last.pkl")
    want = handler.arrays.to_torch_state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
