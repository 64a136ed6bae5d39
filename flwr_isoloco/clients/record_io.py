"""Tensors in and out of Flower ``ArrayRecord`` with at most one copy.

A Flower ``Array`` holds its values as the bytes of a ``.npy`` file (``np.save``: a header,
then the raw values in C order). Flower's own conversions copy twice each way
(``np.save`` into a ``BytesIO`` and ``getvalue()``; ``np.load`` from a ``BytesIO``), which at
SmolLM2-135M's 0.5 GB of weights is most of a CPU message's overhead. Here:

- :func:`unpack_record`: each ``.npy`` header is parsed and the values are returned as a
  read-only tensor *viewing the Array's bytes* (no copy). The caller must not write into them
  (they are the message's memory); loading them into a model copies them once, as it must.
  A header that does not describe exactly the bytes that follow (hostile or damaged input), a
  Fortran-order or object array falls back to Flower's ``Array.numpy()``, which raises on what
  it cannot read.
- :func:`pack_record`: each tensor becomes an ``Array`` whose bytes are the ``.npy`` header
  followed by the tensor's values, joined in one copy; the bytes are identical to what
  ``ArrayRecord(state_dict)`` writes (the repository's ``tests/test_record_io.py`` checks it
  for every dtype and shape the worker sends). bf16 travels as fp32, as everywhere in flwr-isoloco.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy

__all__ = ["pack_record", "unpack_record"]

_NUMPY_STYPE = "numpy.ndarray"
_MAX_HEADER = 10_000  # numpy's own limit when it reads a header


def _npy_view(arr: Array) -> np.ndarray | None:
    """The values of ``arr`` as a read-only array over its bytes, or None when its header is
    not a plain C-order one that describes exactly the bytes after it."""
    data = arr.data
    if arr.stype != _NUMPY_STYPE or not isinstance(data, bytes) or data[:6] != b"\x93NUMPY":
        return None
    head = io.BytesIO(data[: 12 + _MAX_HEADER])
    try:
        major, _minor = npy.read_magic(head)
        reader = npy.read_array_header_1_0 if major == 1 else npy.read_array_header_2_0
        shape, fortran, dtype = reader(head, max_header_size=_MAX_HEADER)
    except (ValueError, SyntaxError, TypeError):
        return None
    if fortran or dtype.hasobject or str(dtype) != arr.dtype or tuple(shape) != tuple(arr.shape):
        return None
    count, offset = math.prod(shape), head.tell()
    if len(data) - offset != count * dtype.itemsize:
        return None
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def unpack_record(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``rec`` on the CPU; tensors view the record's bytes (read-only: do
    not write into them). Equal, value for value, to ``rec.to_torch_state_dict()``."""
    out = {}
    for name, arr in rec.items():
        view = _npy_view(arr)
        if view is None:
            out[name] = torch.from_numpy(arr.numpy())
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out[name] = torch.from_numpy(view)
    return out


def _npy_bytes(values: np.ndarray) -> bytes:
    """``np.save``'s bytes of a C-contiguous ``values``, made with one copy of the values."""
    head = io.BytesIO()
    npy.write_array_header_1_0(head, npy.header_data_from_array_1_0(values))
    if values.size == 0:
        return head.getvalue()
    return b"".join((head.getvalue(), memoryview(values).cast("B")))


def _array(t: torch.Tensor) -> Array:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    values = t.cpu().numpy()
    if not values.flags.c_contiguous:  # np.save's own layout choice (Fortran order or a copy)
        return Array.from_numpy_ndarray(values)
    data = _npy_bytes(values)
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype=_NUMPY_STYPE, data=data)


def pack_record(sd: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> ArrayRecord:
    """``ArrayRecord`` of ``sd`` (bf16 as fp32), each Array's bytes made in one copy. ``sd``
    may be an iterable of ``(name, tensor)`` made lazily: then only one tensor at a time is
    alive beside the record (the worker's pseudo-gradient, 0.5 GB less at 135M)."""
    rec = ArrayRecord()
    for name, t in sd.items() if isinstance(sd, Mapping) else sd:
        rec[name] = _array(t)
        del t
    return rec
