"""What travels between the graph strategies and their nodes: record helpers and the checks
of the scalar metrics a TRAIN reply carries.

Every client-sent metric the server reads is untrusted. :func:`check_train_metrics` is the one
checker of the metrics the graph strategies and the rwlora_sentiment app read (``local-steps``,
``data-cursor``, ``partition-id``): type, finiteness and range. A bad one drops the reply with
the returned reason (in a strategy: a failed hop, so the walk re-routes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

__all__ = [
    "check_train_metrics",
    "decode_array",
    "nonfinite_reason",
    "record_nbytes",
    "record_tensors",
]

CHECKED_METRICS = ("local-steps", "data-cursor", "partition-id")
_INT64_MAX = 2**63 - 1  # what a Flower MetricRecord int can carry


def record_nbytes(*records: ArrayRecord | None) -> int:
    """Serialised payload bytes of ArrayRecords (what goes on the wire, headers aside)."""
    return sum(len(a.data) for r in records if r is not None for a in r.values())


def record_tensors(rec: ArrayRecord | None) -> dict[str, torch.Tensor]:
    """A trusted ArrayRecord (our own token, a checked reply) as ``{key: tensor}`` copies.

    Client-sent arrays go through :func:`decode_array` first (it names what is wrong)."""
    if rec is None:
        return {}
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in rec.items()}


def decode_array(
    key: str, arr: Array | np.ndarray, shape: tuple[int, ...] | None = None
) -> torch.Tensor | str:
    """A client-sent array as a torch tensor, or why it is unusable. Never raises.

    Refused: bytes that do not decode as a pickle-free ``.npy`` (or a byte order torch cannot
    take), a shape other than ``shape`` (when given), a dtype that is not a number (bool,
    complex, strings). Values are not checked here: see :func:`nonfinite_reason`.
    """
    try:
        nd = arr if isinstance(arr, np.ndarray) else arr.numpy()
        if not isinstance(nd, np.ndarray):
            return f"array {key!r} did not decode to an ndarray"
        if shape is not None and tuple(nd.shape) != tuple(shape):
            return f"array {key!r} has shape {tuple(nd.shape)}, expected {tuple(shape)}"
        if nd.dtype.kind not in "fiu":
            return f"array {key!r} has unsupported dtype {nd.dtype}"
        return torch.from_numpy(np.ascontiguousarray(nd))
    except Exception as exc:  # noqa: BLE001 - hostile bytes: any failure is a reason
        return f"array {key!r} could not be read ({type(exc).__name__}: {str(exc)[:200]})"


def nonfinite_reason(key: str, t: torch.Tensor) -> str | None:
    """Why the floating tensor ``t`` is unusable (NaN/inf, or a sum that overflows), or None.

    One pass without allocation in the common case: NaN/inf anywhere make ``sum`` non-finite,
    and so does an overflow of huge finite values (refused too: no merge could hold them)."""
    if not (t.is_floating_point() and t.numel()) or math.isfinite(float(t.sum())):
        return None
    if bool(torch.isfinite(t).all()):
        return f"array {key!r} has values so large that their sum overflows"
    n_bad = int((~torch.isfinite(t)).sum())
    return f"array {key!r} has {n_bad} non-finite values (NaN/inf)"


def _record_of(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def _config_to_json(cfg: ConfigRecord | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    out = {}
    for k, v in cfg.items():
        if isinstance(v, bytes):
            out[k] = {"__bytes__": v.hex()}
        else:
            out[k] = v
    return out


def _config_from_json(d: Mapping[str, Any]) -> ConfigRecord:
    out = {}
    for k, v in d.items():
        out[k] = bytes.fromhex(v["__bytes__"]) if isinstance(v, Mapping) else v
    return ConfigRecord(out)


def _count(value: Any) -> int | None:
    """``value`` as an int if it is an int or an integral finite float (5.0) within int64, else
    ``None`` (bools, lists, strings, NaN, inf, 2.5 and 10**30 are not counts)."""
    if isinstance(value, bool):
        return None
    n = None
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and value == int(value):
        n = int(value)
    return n if n is not None and abs(n) <= _INT64_MAX else None


def check_train_metrics(
    content: RecordDict,
    *,
    asked_steps: int | None = None,
    vertex: Any = None,
    vertex_key: str = "partition-id",
) -> str | None:
    """Reason to drop a TRAIN reply for its scalar metrics, or ``None`` when they are sound.

    Looked up in every MetricRecord of ``content`` (each occurrence is checked):

    - ``local-steps``: a count in ``[0, asked_steps]`` (the K the instruction asked for; no
      upper bound when ``asked_steps`` is None);
    - ``data-cursor``: a count ``>= 0``;
    - ``partition-id``: a count ``>= 0``, equal to ``vertex`` when the vertex the reply was sent
      to is an int and ``vertex_key`` is ``partition-id`` (a node may not speak for another
      partition).

    A count is an int or an integral finite float within int64; bool, list, str, NaN, inf
    are refused.
    Absent keys are fine (the strategy then assumes K steps).
    """
    for rec in content.metric_records.values():
        for key in CHECKED_METRICS:
            if key not in rec:
                continue
            raw = rec[key]
            n = _count(raw)
            if n is None:
                return f"metric {key!r} = {raw!r} is not an integer count"
            if n < 0:
                return f"metric {key!r} = {n} is negative"
            if key == "local-steps" and asked_steps is not None and n > asked_steps:
                return f"metric 'local-steps' = {n} is more than the {asked_steps} asked for"
            if (
                key == "partition-id"
                and vertex_key == "partition-id"
                and isinstance(vertex, (int, np.integer))
                and not isinstance(vertex, bool)
                and n != int(vertex)
            ):
                return f"metric 'partition-id' = {n} but the reply was for vertex {vertex!r}"
    return None
