"""Write a safetensors file tensor by tensor, without building it in memory.

The bytes are those ``safetensors.torch.save(tensors, metadata)`` returns (format: 8-byte
little-endian header length ``n``; ``n`` bytes of JSON, padded with spaces to a multiple of 8;
the tensors' raw little-endian bytes back to back):

    {"__metadata__": {key: value, ...}, name: {"dtype": D, "shape": [...],
     "data_offsets": [begin, end]}, ...}

compact JSON (no spaces, non-ASCII characters as UTF-8, ``"``, ``\\`` and control characters
escaped), tensors ordered as the library orders them: by dtype, in the reverse of
:data:`DTYPES`' order, then by name (Python's ``str`` order = the library's byte order of
UTF-8), offsets relative to the end of the header. One difference: the library keeps
``__metadata__`` in a hash map, so its key order there changes from one process to the next;
here it is ``metadata``'s own order (readers do not care: it is a JSON object).

Only the header and one tensor at a time are in memory: a tensor on another device or not
contiguous is copied to a contiguous CPU tensor while it is written, others are written from
their own memory.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from typing import BinaryIO

import torch

__all__ = ["DTYPES", "ordered", "header_bytes", "write_safetensors"]

# The library's dtype order (its Rust ``Dtype`` enum); a file lists larger ones first.
DTYPES: dict[torch.dtype, str] = {
    dt: name
    for name, dt in (
        ("BOOL", torch.bool),
        ("U8", torch.uint8),
        ("I8", torch.int8),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("I16", torch.int16),
        ("U16", getattr(torch, "uint16", None)),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("I32", torch.int32),
        ("U32", getattr(torch, "uint32", None)),
        ("F32", torch.float32),
        ("C64", torch.complex64),
        ("F64", torch.float64),
        ("I64", torch.int64),
        ("U64", getattr(torch, "uint64", None)),
    )
    if dt is not None
}
_RANK = {dt: i for i, dt in enumerate(DTYPES)}


def _dtype_name(key: str, t: torch.Tensor) -> str:
    name = DTYPES.get(t.dtype)
    if name is None:
        raise ValueError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
    return name


def ordered(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` in file order: dtype rank descending, then name ascending."""
    for key, t in tensors.items():
        _dtype_name(key, t)
    return sorted(tensors.items(), key=lambda kv: (-_RANK[kv[1].dtype], kv[0]))


def _json(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def header_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    """The first ``8 + n`` bytes of the file: length, JSON header, space padding."""
    parts = []
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise ValueError(f"safetensors metadata must map str to str; {bad[0]!r} does not")
        parts.append(f"{_json('__metadata__')}:{_json(dict(metadata))}")
    offset = 0
    for key, t in ordered(tensors):
        end = offset + t.numel() * t.element_size()
        info = {"dtype": _dtype_name(key, t), "shape": list(t.shape), "data_offsets": [offset, end]}
        parts.append(f"{_json(key)}:{_json(info)}")
        offset = end
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    fh: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> int:
    """Write the file to the binary stream ``fh``; returns the number of bytes written."""
    if sys.byteorder != "little":  # raw bytes are written as they lie in memory
        raise RuntimeError("write_safetensors needs a little-endian machine")
    head = header_bytes(tensors, metadata)
    fh.write(head)
    total = len(head)
    for _, t in ordered(tensors):
        t = t.detach().to("cpu").contiguous()  # no copy for a contiguous CPU tensor
        if t.numel():
            total += fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
    return total
