"""Atomic checkpoints: tensors in safetensors, everything else as JSON; nothing is unpickled.

One checkpoint is one ``.safetensors`` file. Nested tensor dicts (``{"model": {...},
"strategy": {"momentum": {...}}}``) are flattened to ``"model/layer.weight"`` keys (``/`` joins
levels, so keys themselves may not contain ``/``); the JSON-able ``meta`` (round, config, RNG
state, strategy scalars) goes into the safetensors header metadata. Writing goes to a temporary
file in the same directory, is fsynced, then ``os.replace``d over the target, so a crash leaves
either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "write_bytes_atomic",
    "write_json_atomic",
    "load_checkpoint",
    "flatten_tensors",
    "unflatten_tensors",
    "rng_state",
    "set_rng_state",
    "recorddict_to_tree",
    "tree_to_recorddict",
]

SEP = "/"
_FORMAT = "flwr-isoloco-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read (bad key, bad file, wrong format)."""


def flatten_tensors(
    tree: Mapping[str, Any], prefix: str = ""
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Flatten nested dicts of tensors to ``"a/b/name"`` keys; also return the paths of empty dicts."""
    flat: dict[str, torch.Tensor] = {}
    empty: list[str] = []
    for key, value in tree.items():
        if not isinstance(key, str) or not key or SEP in key:
            raise CheckpointError(
                f"checkpoint key {prefix + str(key)!r} must be a non-empty str without {SEP!r}"
            )
        full = prefix + key
        if isinstance(value, Mapping):
            if not value:
                empty.append(full)
            sub, sub_empty = flatten_tensors(value, full + SEP)
            flat.update(sub)
            empty.extend(sub_empty)
        elif isinstance(value, torch.Tensor):
            flat[full] = value
        else:
            raise CheckpointError(
                f"checkpoint entry {full!r} is a {type(value).__name__}, not a tensor or dict "
                "(put non-tensor state in meta)"
            )
    return flat, empty


def unflatten_tensors(
    flat: Mapping[str, torch.Tensor], empty: list[str] | tuple = ()
) -> dict[str, Any]:
    """Inverse of :func:`flatten_tensors`."""
    tree: dict[str, Any] = {}
    for path in list(empty) + list(flat):
        parts = path.split(SEP)
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if path in flat:
            node[parts[-1]] = flat[path]
        else:
            node.setdefault(parts[-1], {})
    return tree


def save_checkpoint(
    path: str | os.PathLike, tensors: Mapping[str, Any], meta: Mapping[str, Any]
) -> Path:
    """Atomically write ``tensors`` (nested dict of tensors) and ``meta`` (JSON-able) to ``path``."""
    path = Path(path)
    flat, empty = flatten_tensors(tensors)
    try:
        meta_json = json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {exc}") from None
    # safetensors refuses shared storage (tied weights) and non-contiguous views: copy those.
    seen: set[tuple[int, int]] = set()
    ready: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        t = t.detach().to("cpu")
        ident = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if ident in seen or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone().contiguous()
        seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        ready[key] = t
    header = {"format": _FORMAT, "meta": meta_json, "empty": json.dumps(empty)}
    blob = st_save(ready, metadata=header)

    write_bytes_atomic(path, blob)
    return path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old or the new file, never a torn one.

    Temporary file in the same folder, fsync, ``os.replace``, then fsync the folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """``json.dump(obj)`` (indented) to ``path`` atomically (see :func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, json.dumps(obj, indent=2).encode("utf-8"))


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a checkpoint written by :func:`save_checkpoint`: ``(nested tensors, meta)``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            flat = {key: fh.get_tensor(key) for key in fh.keys()}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types on bad files
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a readable safetensors file: {exc}"
        ) from None
    if header.get("format") != _FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format {header.get('format')!r}, expected {_FORMAT!r}"
        )
    meta = json.loads(header["meta"])
    return unflatten_tensors(flat, json.loads(header.get("empty", "[]"))), meta


# ----------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """JSON-able state of Python's, NumPy's and torch's (CPU) global generators."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


# ----------------------------------------------------------------------------- Flower records
def recorddict_to_tree(records: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Flower ``RecordDict`` (e.g. a node's ``context.state``) into ``(tensors, meta)``
    for :func:`save_checkpoint`: ArrayRecords become tensor dicts, Config/MetricRecords JSON."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, rec in records.items():
        if isinstance(rec, ArrayRecord):
            tensors[key] = rec.to_torch_state_dict()
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            kind = "config" if isinstance(rec, ConfigRecord) else "metric"
            values = dict(rec)
            if any(
                isinstance(v, bytes) or (isinstance(v, list) and v and isinstance(v[0], bytes))
                for v in values.values()
            ):
                raise CheckpointError(
                    f"record {key!r} holds bytes, which a checkpoint's JSON cannot"
                )
            meta[key] = {"kind": kind, "values": values}
        else:
            raise CheckpointError(f"record {key!r} has unsupported type {type(rec).__name__}")
    return tensors, meta


def tree_to_recorddict(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Any:
    """Inverse of :func:`recorddict_to_tree`."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    out = RecordDict()
    for key, sd in tensors.items():
        out[key] = ArrayRecord({k: v for k, v in sd.items()})
    for key, entry in meta.items():
        cls = ConfigRecord if entry["kind"] == "config" else MetricRecord
        out[key] = cls(dict(entry["values"]))
    return out
