"""Exact sparse downloads: the server's outer step sent as the round's own upload messages.

When the server's step is a function of this round's compressed uploads alone (outer momentum
0; merge ``mean`` or ``sparseloco``), a node can take that step itself from the peers'
messages, as SparseLoCo's peers do after an all-gather, instead of receiving a re-compressed
``Q(theta - B)``. For each tensor, with peer ``i``'s decoded delta ``d_i``, coefficient
``a_i`` and weight ``w_i`` (fp32, written by the server)::

    g = SparseMean(per_entry)(d_1..d_M; a, w)      (merging.sparse: per-entry mean over the
                                                    senders, or the plain sum sum_i a_i d_i)
    d = scale * g,  scale = -lr                    (fp32)
    B <- B + d                                     (broadcast.apply_update)

The server computes its own new model with this very function on this very record, so the
nodes' copy and the server's model agree bit for bit on any IEEE-754 machine (every operation
is a separate, correctly rounded fp32 multiply, add or divide in a fixed order; the clip
factors, which need norms and a median, are computed once by the server and sent).

Record layout (one ArrayRecord):

- ``STEP_KEY`` (``"__step__"``): uint8 UTF-8 JSON ``{"format", "version", "peers": M,
  "scale", "per_entry": [names]}``;
- ``"p<i>:<key>"``: every array of peer ``i``'s compressed upload record, unchanged (its own
  header included: :class:`~flwr_isoloco.compression.record.RecordReader` checks it);
- ``"a:<name>"``: fp32 ``(M,)`` coefficients of tensor ``name``; ``"w"``: fp32 ``(M,)`` weights.

Bytes: about ``M`` times one upload; :class:`~flwr_isoloco.compression.broadcast.Broadcast`
sends the full model instead when that is smaller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from flwr_isoloco.compression.record import (
    RecordReader,
    json_array,
    json_header,
    nest,
    npy_1d,
    unnest,
)
from flwr_isoloco.merging.sparse import SparseMean, combine_coefs

__all__ = ["EXACT", "STEP_KEY", "build_step", "decode_step", "is_step", "step_terms"]

EXACT = "exact"
"""The download mode that sends the server's step itself (this module), not ``Q(theta - B)``."""
STEP_KEY = "__step__"
FORMAT, VERSION = "flwr-isoloco-step", 1
MAX_PEERS = 100_000


def is_step(record: ArrayRecord) -> bool:
    """Whether ``record`` is an exact step record (module doc)."""
    return STEP_KEY in record


def _f32(values: Sequence[float] | torch.Tensor) -> Array:
    return Array(np.ascontiguousarray(torch.as_tensor(values, dtype=torch.float32).numpy()))


def step_terms(
    uploads: Sequence[ArrayRecord],
    weights: Sequence[float],
    per_entry: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, torch.Tensor]:
    """The coefficients ``a`` of every tensor: ``a_i = w_i c_i`` (``c_i`` the clip to the
    median norm, :func:`~flwr_isoloco.merging.sparse.combine_coefs`) for the tensors in
    ``per_entry``, ``a_i = w_i`` for the others. One decoded tensor in memory at a time."""
    readers = [RecordReader(u, shapes=shapes) for u in uploads]
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32)
    out = {}
    for name in shapes:
        if name in per_entry:
            norms = torch.stack([torch.linalg.vector_norm(r.tensor(name).float()) for r in readers])
            out[name] = combine_coefs(norms, weights)[0]
        else:
            out[name] = w.clone()
    return out


def build_step(
    uploads: Sequence[ArrayRecord],
    weights: Sequence[float],
    per_entry: Sequence[str],
    scale: float,
    shapes: Mapping[str, tuple[int, ...]],
) -> ArrayRecord:
    """The step record of the module doc from the used replies' compressed ``uploads`` (in the
    merge's order), their normalised merge ``weights``, the tensors that take the per-entry
    mean and ``scale = -lr``."""
    if not uploads or len(uploads) != len(weights):
        raise ValueError("build_step needs one weight per upload, at least one upload")
    coefs = step_terms(uploads, weights, per_entry, shapes)
    head = {
        "format": FORMAT,
        "version": VERSION,
        "peers": len(uploads),
        "scale": float(np.float32(scale)),
        "per_entry": sorted(per_entry),
    }
    arrays: dict[str, Array] = {STEP_KEY: json_array(head), **nest(list(uploads), "p")}
    arrays.update({f"a:{k}": _f32(v) for k, v in coefs.items()})
    arrays["w"] = _f32([float(x) for x in weights])
    return ArrayRecord(arrays)


def _header(record: ArrayRecord) -> dict[str, Any]:
    head = json_header(record, STEP_KEY)
    if not isinstance(head, dict) or (head.get("format"), head.get("version")) != (
        FORMAT,
        VERSION,
    ):
        raise ValueError(f"{STEP_KEY!r}: not a {FORMAT} v{VERSION} header")
    peers, scale, per_entry = head.get("peers"), head.get("scale"), head.get("per_entry")
    if isinstance(peers, bool) or not isinstance(peers, int) or not 1 <= peers <= MAX_PEERS:
        raise ValueError(f"{STEP_KEY!r}: 'peers' must be an int in [1, {MAX_PEERS}]")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"{STEP_KEY!r}: 'scale' must be a finite number")
    if not isinstance(per_entry, list) or not all(isinstance(n, str) for n in per_entry):
        raise ValueError(f"{STEP_KEY!r}: 'per_entry' must be a list of tensor names")
    return head


def _vector(record: ArrayRecord, key: str, m: int) -> torch.Tensor:
    arr = record.get(key)
    if arr is None or str(arr.dtype) != "float32" or tuple(arr.shape) != (m,):
        raise ValueError(f"step record: {key!r} must be a float32 vector of {m} entries")
    v = npy_1d(arr.data, "float32", m)
    if isinstance(v, str) or not bool(np.isfinite(v).all()):
        raise ValueError(f"step record: {key!r} {v if isinstance(v, str) else 'is not finite'}")
    return torch.from_numpy(v)


def decode_step(
    record: ArrayRecord, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The step ``d`` (fp32, one tensor per name of ``shapes``) of a step record, checked as
    hostile input: header, every peer's upload record (names and shapes = ``shapes``),
    coefficient vectors finite and of length M, no other arrays; ValueError naming the part."""
    head = _header(record)
    m, names = head["peers"], list(shapes)
    if not set(head["per_entry"]) <= set(names):
        raise ValueError("step record: 'per_entry' names tensors the model does not have")
    expected = {STEP_KEY, "w", *(f"a:{n}" for n in names)}
    subs = unnest(record, "p", m, expected)
    readers = [RecordReader(sub, shapes=shapes) for sub in subs]
    w = _vector(record, "w", m)
    scale = torch.tensor(head["scale"], dtype=torch.float32)
    out = {}
    for name in names:
        a = _vector(record, f"a:{name}", m)
        acc: SparseMean | None = None
        for i, r in enumerate(readers):
            d = r.tensor(name).float()
            acc = acc or SparseMean(d, per_entry=name in head["per_entry"])
            acc.add(d, a[i], w[i])
        assert acc is not None
        out[name] = acc.result() * scale
    return out
