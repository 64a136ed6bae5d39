"""The streaming checkpoint writer and the copies the server no longer makes (135M, issue 18).

``write_safetensors`` must write the bytes ``safetensors.torch.save`` returns (old readers and
the digests keep working); the library keeps ``__metadata__`` in a hash map whose key order
changes per process, so the comparison puts our metadata in the order the library chose.
``DiLoCo.state_dict`` hands out its own tensors (no clone) and stays a snapshot after later
steps; ``start`` drops the initial ArrayRecord once the strategy has built its state.
"""

from __future__ import annotations

import gc
import io
import json
import os
import struct
import weakref

import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from safetensors import safe_open
from safetensors.torch import save as st_save

from flwr_isoloco.apprunner import AppRun
from flwr_isoloco.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flwr_isoloco.checkpoint.safetensors_stream import DTYPES, header_bytes, write_safetensors
from flwr_isoloco.strategies import DiLoCo


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype of the table, 0-d, empty and 3-d shapes, non-ASCII names, a transposed view."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dt in enumerate(DTYPES):
        x = 50 * torch.randn(3, 2, generator=g)
        out[f"t{i:02d}"] = x > 0 if dt is torch.bool else x.to(dt)
    out.update(
        {
            "scalar": torch.tensor(3.25),
            "scalar_i64": torch.tensor(-7, dtype=torch.int64),
            "empty": torch.zeros(0, 4, dtype=torch.float16),
            "empty_f32": torch.zeros(2, 0),
            "cube": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
            "é☃ name": torch.ones(5, dtype=torch.bfloat16),
            "B": torch.ones(2),
            "a": torch.ones(1),
            "view": torch.randn(4, 3, generator=g).t(),  # not contiguous
        }
    )
    return out


def _library_bytes(tensors, metadata):
    """``safetensors.torch.save`` of contiguous copies, and the order of its metadata keys."""
    blob = st_save({k: v.clone().contiguous() for k, v in tensors.items()}, metadata=metadata)
    (n,) = struct.unpack("<Q", blob[:8])
    order = list(json.loads(blob[8 : 8 + n]).get("__metadata__", {}))
    return blob, order


def _ours(tensors, metadata) -> bytes:
    buf = io.BytesIO()
    assert write_safetensors(buf, tensors, metadata) == len(buf.getvalue())
    return buf.getvalue()


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        {"only": 'a "quoted" \\ line\nwith\ttabs, \x01 \x1f \x7f, é and ☃'},
        {"format": "f", "meta": '{"round": 3}', "empty": "[]", "digest": "d" * 70},
    ],
)
def test_stream_writes_the_library_bytes(metadata):
    tensors = _tensors()
    lib, order = _library_bytes(tensors, metadata)
    in_lib_order = None if metadata is None else {k: metadata[k] for k in order}
    assert _ours(tensors, in_lib_order) == lib
    (n,) = struct.unpack("<Q", lib[:8])
    assert n % 8 == 0 and header_bytes(tensors, metadata)[:8] == lib[:8]


def test_stream_with_no_tensors_and_refused_dtypes():
    assert _ours({}, {"x": "y"}) == st_save({}, metadata={"x": "y"})
    assert _ours({}, None) == st_save({})
    with pytest.raises(ValueError, match="'z'.*complex128"):
        header_bytes({"z": torch.zeros(1, dtype=torch.complex128)}, None)
    with pytest.raises(ValueError, match="str to str"):
        header_bytes({}, {"k": 1})


def test_checkpoint_file_is_the_library_file(tmp_path):
    tensors = _tensors()  # float8 included: read back and checked for NaN / inf in fp32
    tied = tensors["cube"]
    tree = {"model": {**tensors, "tied": tied}, "strategy": {"momentum": {"w": tied[0]}}}
    path = save_checkpoint(tmp_path / "ck.safetensors", tree, {"round": 2, "x": "é"})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + n])["__metadata__"]  # in the file's key order
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == metadata
        flat = {k: fh.get_tensor(k) for k in fh.keys()}
    assert set(flat) == {f"model/{k}" for k in [*tensors, "tied"]} | {"strategy/momentum/w"}
    lib, order = _library_bytes(flat, metadata)
    assert data == _ours(flat, metadata)  # the file is our writer's output
    assert data[:8] == lib[:8] and data[8 + n :] == lib[8 + n :]  # same header size, same data
    assert _ours(flat, {k: metadata[k] for k in order}) == lib
    back, meta = load_checkpoint(path)
    assert meta == {"round": 2, "x": "é"}
    for k, t in tensors.items():
        assert back["model"][k].dtype == t.dtype and torch.equal(back["model"][k], t), k
    assert torch.equal(back["strategy"]["momentum"]["w"], tied[0])


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_non_finite_float8_is_a_checkpoint_error(tmp_path, name):
    """``torch.isfinite`` is not implemented for e4m3fn: the reader must still refuse NaN."""
    dt = getattr(torch, name)
    p = save_checkpoint(tmp_path / "ck.safetensors", {"w": torch.tensor([1.0, 2.0]).to(dt)}, {})
    assert load_checkpoint(p)[0]["w"].dtype == dt
    p = save_checkpoint(p, {"w": torch.tensor([1.0, float("nan")]).to(dt)}, {})
    with pytest.raises(CheckpointError, match="'w' has non-finite"):
        load_checkpoint(p)


def test_unwritable_dtype_leaves_the_old_checkpoint(tmp_path):
    p = tmp_path / "ck.safetensors"
    save_checkpoint(p, {"x": torch.zeros(2)}, {"round": 1})
    with pytest.raises(CheckpointError, match="'y'.*complex128"):
        save_checkpoint(p, {"x": torch.ones(2), "y": torch.zeros(1, dtype=torch.complex128)}, {})
    assert os.listdir(tmp_path) == ["ck.safetensors"]
    assert load_checkpoint(p)[1] == {"round": 1}


def _stepped() -> DiLoCo:
    s = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    g = torch.Generator().manual_seed(3)
    s._adopt(ArrayRecord({"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}))
    s.theta = s.outer.step(s.theta, {k: torch.randn_like(v) for k, v in s.theta.items()})
    return s


def test_state_dict_shares_the_tensors_and_stays_a_snapshot(tmp_path):
    s = _stepped()
    sd = s.state_dict()
    theta, buffers = sd["tensors"]["theta"], sd["tensors"]["outer"]["momentum_buffer"]
    assert all(theta[k] is s.theta[k] for k in s.theta)  # no copy of the model
    own = s.outer.momentum_buffer
    assert set(buffers) == {"w", "b"}
    assert all(buffers[k].data_ptr() == own[k].data_ptr() for k in own)  # nor of the momentum
    before = {k: v.clone() for k, v in theta.items()}, {k: v.clone() for k, v in buffers.items()}
    save_checkpoint(tmp_path / "ck.safetensors", sd["tensors"], sd["meta"])
    s.theta = s.outer.step(s.theta, {k: torch.ones_like(v) for k, v in s.theta.items()})
    assert not torch.equal(s.theta["w"], before[0]["w"])  # the step moved the model ...
    for old, now in zip(before, (theta, buffers), strict=True):  # ... not the snapshot
        assert all(torch.equal(old[k], now[k]) for k in old)
    tensors, meta = load_checkpoint(tmp_path / "ck.safetensors")
    resumed = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    resumed.load_state_dict({"tensors": tensors, "meta": meta})
    assert all(torch.equal(resumed.theta[k], before[0][k]) for k in before[0])
    assert all(resumed.theta[k] is not theta[k] for k in theta)  # restored state is a copy


def _train(msg: Message, ctx) -> Message:
    sd = msg.content["arrays"].to_torch_state_dict()
    new = {k: v - 0.01 for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 10})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def test_start_drops_the_initial_arrays_and_apprun_hands_them_over_once():
    run = AppRun(strategy=DiLoCo(fraction_evaluate=0.0, min_evaluate_nodes=0),
                 initial_arrays=ArrayRecord({"w": torch.ones(4, 3)}),
                 evaluate=lambda r, a: None, row=lambda r, t, e: {}, summary=str)  # fmt: skip
    ref = weakref.ref(run.initial_arrays)
    alive: list[bool] = []

    def hook(rnd, arrays, tm, em):
        gc.collect()
        alive.append(ref() is not None)

    run.strategy.start(grid=FakeGrid({"train": _train}, num_nodes=2),
                       initial_arrays=run.take_initial_arrays(), num_rounds=2,
                       on_round_end=hook)  # fmt: skip
    assert alive == [False, False] and run.initial_arrays is None
    assert run.strategy.completed_rounds == 2
    with pytest.raises(RuntimeError, match="already handed"):
        run.take_initial_arrays()
