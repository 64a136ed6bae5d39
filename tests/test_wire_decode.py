"""The one decoder of client-sent arrays (strategies.core.wire.decode_array, nonfinite_reason)."""

import numpy as np
import pytest
import torch
from flwr.app import Array

from flwr_isoloco.strategies.core.wire import decode_array, nonfinite_reason, record_tensors


def test_good_array_decodes_to_an_equal_writable_copy():
    nd = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = decode_array("w", Array(nd), (2, 3))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    assert torch.equal(t, torch.from_numpy(nd))
    t += 1  # a copy of the bytes, not a view of them
    assert torch.equal(decode_array("w", Array(nd)), torch.from_numpy(nd))


@pytest.mark.parametrize(
    ("arr", "shape", "why"),
    [
        (
            Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=b"junk"),
            None,
            "array 'w' could not be read (ValueError: This file contains pickled",
        ),
        (Array(np.ones(2, ">f4")), None, "array 'w' could not be read (ValueError: given numpy"),
        (Array(np.ones((2, 3), np.float32)), (3, 2), "array 'w' has shape (2, 3), expected (3, 2)"),
        (Array(np.ones(2, bool)), None, "array 'w' has unsupported dtype bool"),
        (Array(np.ones(2, np.complex64)), None, "array 'w' has unsupported dtype complex64"),
        (np.array(["a"]), None, "array 'w' has unsupported dtype <U1"),
    ],
)
def test_bad_arrays_give_a_reason_and_never_raise(arr, shape, why):
    got = decode_array("w", arr, shape)
    assert isinstance(got, str) and got.startswith(why), got


def test_nonfinite_reason():
    assert nonfinite_reason("w", torch.ones(3)) is None
    assert nonfinite_reason("w", torch.empty(0)) is None
    assert nonfinite_reason("w", torch.tensor([2**40])) is None  # ints are always finite
    nan = torch.tensor([1.0, float("nan"), float("inf")])
    assert nonfinite_reason("w", nan) == "array 'w' has 2 non-finite values (NaN/inf)"
    huge = torch.full((4,), 3e38)  # finite, but the fp32 sum overflows
    assert nonfinite_reason("w", huge) == "array 'w' has values so large that their sum overflows"


def test_record_tensors_of_none_is_empty():
    assert record_tensors(None) == {}
