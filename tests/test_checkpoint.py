"""Atomic safetensors+JSON checkpoints: exact round trip, no pickle, clear errors."""

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from flwr_isoloco.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def _tree():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    return {
        "model": {"embed.weight": w, "lm_head.weight": w, "norm.weight": torch.ones(3)},
        "strategy": {"momentum": {"embed.weight": torch.randn(4, 3, generator=g)}, "empty": {}},
        "misc": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "view": torch.randn(4, 4, generator=g).t(),
    }


def test_roundtrip_exact(tmp_path):
    tree = _tree()
    meta = {"round": 3, "config": {"a": 1.5, "b": "x"}, "history": [0.1, float("inf")]}
    path = save_checkpoint(tmp_path / "ck.safetensors", tree, meta)
    tensors, meta2 = load_checkpoint(path)
    assert meta2 == meta
    assert set(tensors) == {"model", "strategy", "misc", "half", "view"}
    assert tensors["strategy"]["empty"] == {}
    for a, b in [
        (tree["model"]["embed.weight"], tensors["model"]["embed.weight"]),
        (tree["model"]["lm_head.weight"], tensors["model"]["lm_head.weight"]),
        (
            tree["strategy"]["momentum"]["embed.weight"],
            tensors["strategy"]["momentum"]["embed.weight"],
        ),
        (tree["misc"], tensors["misc"]),
        (tree["half"], tensors["half"]),
        (tree["view"], tensors["view"]),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_file_is_plain_safetensors_with_json_meta(tmp_path):
    path = save_checkpoint(tmp_path / "ck.safetensors", {"x": torch.zeros(2)}, {"round": 1})
    with safe_open(str(path), framework="pt") as fh:
        assert json.loads(fh.metadata()["meta"]) == {"round": 1}
        assert list(fh.keys()) == ["x"]


def test_atomic_overwrite_leaves_no_temp(tmp_path):
    p = tmp_path / "ck.safetensors"
    save_checkpoint(p, {"x": torch.zeros(2)}, {"round": 1})
    save_checkpoint(p, {"x": torch.ones(2)}, {"round": 2})
    assert os.listdir(tmp_path) == ["ck.safetensors"]
    t, m = load_checkpoint(p)
    assert m["round"] == 2 and torch.equal(t["x"], torch.ones(2))


def test_failed_write_keeps_old_checkpoint(tmp_path):
    p = tmp_path / "ck.safetensors"
    save_checkpoint(p, {"x": torch.zeros(2)}, {"round": 1})
    with pytest.raises(CheckpointError, match="not JSON"):
        save_checkpoint(p, {"x": torch.ones(2)}, {"bad": object()})
    with pytest.raises(CheckpointError, match="'a/b'"):
        save_checkpoint(p, {"a/b": torch.ones(2)}, {})
    with pytest.raises(CheckpointError, match="'m.k'.*int"):
        save_checkpoint(p, {"m": {"k": 3}}, {})
    t, m = load_checkpoint(p)
    assert m["round"] == 1 and torch.equal(t["x"], torch.zeros(2))
    assert os.listdir(tmp_path) == ["ck.safetensors"]


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_checkpoint(bad)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    with pytest.raises(CheckpointError, match="format None"):
        load_checkpoint(foreign)


def test_rng_state_roundtrip_through_json(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_recorddict_roundtrip(tmp_path):
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from flwr_isoloco.checkpoint import recorddict_to_tree, tree_to_recorddict

    rd = RecordDict(
        {
            "opt": ArrayRecord({"w.exp_avg": torch.randn(3, 2), "w.step": torch.ones(1)}),
            "cfg": ConfigRecord({"cursor": 7, "name": "x", "flag": True}),
            "m": MetricRecord({"loss": 1.5}),
        }
    )
    tensors, meta = recorddict_to_tree(rd)
    save_checkpoint(tmp_path / "s.safetensors", tensors, meta)
    back = tree_to_recorddict(*load_checkpoint(tmp_path / "s.safetensors"))
    assert set(back) == {"opt", "cfg", "m"}
    sd, sd2 = rd["opt"].to_torch_state_dict(), back["opt"].to_torch_state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd) and set(sd) == set(sd2)
    assert dict(back["cfg"]) == {"cursor": 7, "name": "x", "flag": True}
    assert dict(back["m"]) == {"loss": 1.5}
    with pytest.raises(CheckpointError, match="'b' holds bytes"):
        recorddict_to_tree(RecordDict({"b": ConfigRecord({"k": b"\x00"})}))
