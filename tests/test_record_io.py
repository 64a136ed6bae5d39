"""``flwr_isoloco.clients.record_io``: ArrayRecords packed with one copy are byte for byte what
Flower writes, unpacked without a copy they equal Flower's reading, and a record whose header
lies about its bytes is not viewed (Flower's reader decides)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flwr_isoloco.clients.record_io import pack_record, unpack_record

TENSORS = {
    "fp32": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "int64": torch.arange(5),
    "bf16": torch.randn(2, 3).to(torch.bfloat16),
    "empty": torch.zeros(0, 3),
    "scalar": torch.tensor(3.5),
    "transposed": torch.arange(20.0).reshape(4, 5).t(),
    "uint8": torch.tensor([1, 2, 250], dtype=torch.uint8),
    "bool": torch.tensor([True, False]),
    "fp16": torch.tensor([1.5, -2.0], dtype=torch.float16),
}


def _flower(sd):
    return ArrayRecord({k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in sd.items()})


def test_packed_bytes_are_flowers():
    got, want = pack_record(TENSORS), _flower(TENSORS)
    assert list(got) == list(want)
    for k in want:
        assert (got[k].dtype, got[k].shape, got[k].stype) == (
            want[k].dtype,
            want[k].shape,
            want[k].stype,
        )
        assert got[k].data == want[k].data, k


def test_unpacked_views_equal_flowers_reading_and_share_the_bytes():
    rec = _flower(TENSORS)
    got, want = unpack_record(rec), rec.to_torch_state_dict()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    big = rec["fp32"]
    view = got["fp32"]
    start = np.frombuffer(big.data, dtype=np.uint8).ctypes.data
    assert start <= view.data_ptr() < start + len(big.data)  # no copy: inside the bytes


def _lying(data: bytes, dtype="float32", shape=(3, 4)) -> ArrayRecord:
    rec = ArrayRecord()
    rec["x"] = Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)
    return rec


def test_a_header_that_does_not_fit_its_bytes_is_not_viewed():
    good = pack_record({"x": TENSORS["fp32"]})["x"].data
    # values cut short: Flower's reader refuses, so does unpacking
    with pytest.raises(ValueError):
        unpack_record(_lying(good[:-8]))
    # extra bytes after the values: not viewed, Flower's reader decides (it ignores the tail)
    got = unpack_record(_lying(good + b"\0" * 8))["x"]
    assert torch.equal(got, TENSORS["fp32"])
    # metadata that disagrees with the header: not viewed either
    got = unpack_record(_lying(good, shape=(4, 3)))["x"]
    assert got.shape == (3, 4)
    # not an npy at all
    with pytest.raises(ValueError):
        unpack_record(_lying(b"garbage" * 10))
