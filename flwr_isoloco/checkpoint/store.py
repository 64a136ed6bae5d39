"""Atomic, tamper-evident checkpoints: tensors in safetensors, everything else as JSON.

One checkpoint is one ``.safetensors`` file; nothing is unpickled. Nested tensor dicts
(``{"model": {...}, "strategy": {"momentum": {...}}}``) are flattened to
``"model/layer.weight"`` keys (``/`` joins levels, so keys themselves may not contain ``/``);
the JSON-able ``meta`` (app, round, config, RNG state, strategy scalars) goes into the
safetensors header metadata.

Integrity (format ``/2``): the header carries a ``digest`` entry, JSON
``{"algorithm": "sha256", "meta": h_m, "tensors": {key: h_k}}`` with

    h_m = sha256(format || 0x00 || meta_json || 0x00 || empty_json)
    h_k = sha256(dtype || ":" || shape || 0x00 || raw bytes of tensor k)

:func:`load_checkpoint` recomputes every hash, so one flipped bit in a tensor, in the meta or
in a tensor's dtype/shape is a :class:`CheckpointError` naming the file (and the tensor). The
digest detects corruption and careless edits; it is not a signature (whoever can write the file
can recompute it), so the loader also refuses non-finite tensors and, given a ``kind`` and a
``spec`` (:class:`Field`), meta fields that are missing or of the wrong type or range.
Files of format ``/1`` (no digest) are refused.

Writing streams the file to a temporary file ``.<name>.<random>.tmp`` in the same directory
(:mod:`~flwr_isoloco.checkpoint.safetensors_stream`: the header, then each tensor's bytes from its own
memory, so a save holds no copy of the model; the bytes are those ``safetensors.torch.save``
would return), fsyncs it, then ``os.replace``s it over the target, so a crash leaves either the
old or the new checkpoint, never a torn one; the next write to the same target removes such
leftovers of earlier, interrupted writes (only names of exactly that pattern).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import safe_open

from .safetensors_stream import ordered, write_safetensors
from .spec import (
    CheckpointError,
    Field,
    check_fields,
    check_tensors,
    checkpoint_error,
    restoring,
)

__all__ = [
    "CheckpointError",
    "Field",
    "check_fields",
    "check_tensors",
    "checkpoint_error",
    "restoring",
    "save_checkpoint",
    "write_atomic",
    "write_bytes_atomic",
    "write_json_atomic",
    "load_checkpoint",
    "flatten_tensors",
    "unflatten_tensors",
    "rng_state",
    "set_rng_state",
    "RNG_FIELD",
    "RECORDS_FIELD",
    "KINDS",
    "recorddict_to_tree",
    "tree_to_recorddict",
]

SEP = "/"
_FORMAT = "flwr-isoloco-checkpoint/2"
_OLD_FORMATS = ("flwr-isoloco-checkpoint/1",)
_HEADER_FIELDS = ("meta", "empty", "digest")
# What each ``meta["app"]`` value is, for the message when a file of another kind is given.
KINDS = {
    "isoloco_lm": "an isoloco_lm server checkpoint",
    "rwlora_sentiment": "a rwlora_sentiment server checkpoint",
    "node-state": "one node's state file (node-state/node-p<id>-r<round>.safetensors)",
}


# ----------------------------------------------------------------------------- tensor trees
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
    """Inverse of :func:`flatten_tensors`; a key that is both a tensor and a group (``a`` and
    ``a/b``) or has an empty level (``a//b``) is a :class:`CheckpointError` naming it."""
    tree: dict[str, Any] = {}
    for path in list(empty) + list(flat):
        parts = path.split(SEP)
        if not all(parts):
            raise CheckpointError(f"tensor key {path!r:.80} has an empty level")
        node = tree
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                clash = SEP.join(parts[: i + 1])
                raise CheckpointError(
                    f"tensor key {path!r} clashes with tensor {clash!r} (a key cannot be both "
                    "a tensor and a group)"
                )
        leaf = parts[-1]
        if path in flat:
            if leaf in node:
                raise CheckpointError(
                    f"tensor key {path!r} clashes with the group {path!r} (a key cannot be both "
                    "a tensor and a group)"
                )
            node[leaf] = flat[path]
        elif not isinstance(node.setdefault(leaf, {}), dict):
            raise CheckpointError(f"empty group {path!r} clashes with tensor {path!r}")
    return tree


def _tensor_digest(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes (so a bit flip anywhere in them shows)."""
    h = hashlib.sha256(f"{t.dtype}:{list(t.shape)}".encode() + b"\x00")
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _meta_digest(fmt: str, meta_json: str, empty_json: str) -> str:
    return hashlib.sha256("\x00".join((fmt, meta_json, empty_json)).encode("utf-8")).hexdigest()


def _header(ready: Mapping[str, torch.Tensor], meta_json: str, empty_json: str) -> dict[str, str]:
    digest = {
        "algorithm": "sha256",
        "meta": _meta_digest(_FORMAT, meta_json, empty_json),
        "tensors": {k: _tensor_digest(t) for k, t in ready.items()},
    }
    return {"format": _FORMAT, "meta": meta_json, "empty": empty_json, "digest": json.dumps(digest)}


# ----------------------------------------------------------------------------- writing
def save_checkpoint(
    path: str | os.PathLike, tensors: Mapping[str, Any], meta: Mapping[str, Any]
) -> Path:
    """Atomically write ``tensors`` (nested dict of tensors) and ``meta`` (JSON-able) to ``path``,
    with the sha256 digest of every tensor and of the meta in the header.

    The tensors are read twice (digests, then the bytes written) and not copied, so they must
    not change during the call; tied weights are written once per key, as if cloned."""
    path = Path(path)
    flat, empty = flatten_tensors(tensors)
    try:
        meta_json = json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {exc}") from None
    try:
        header = _header(flat, meta_json, json.dumps(empty))
        ordered(flat)  # every dtype storable: refuse before the temporary file exists
    except ValueError as exc:
        raise CheckpointError(f"checkpoint cannot be written: {exc}") from None
    write_atomic(path, lambda fh: write_safetensors(fh, flat, header))
    return path


def _remove_leftovers(path: Path) -> None:
    """Delete ``.<name>.<random>.tmp`` files that interrupted writes to ``path`` left behind.

    Only plain files whose whole name is that pattern (``mkstemp``'s 8-character random part
    of ``[a-z0-9_]``) are removed; anything else in the folder is left alone. Assumes one
    writer per target at a time (as in the apps: one server, one file per node and round);
    two concurrent writers of the same file could remove each other's temporary file.
    """
    pattern = re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}" + re.escape(".tmp"))
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so a reader sees the old or the new file, never a torn one
    (:func:`write_atomic`)."""
    write_atomic(path, lambda fh: fh.write(data), mode)


def write_atomic(
    path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int | None = None
) -> None:
    """Call ``write(fh)`` on a temporary file that then replaces ``path`` atomically.

    Removes earlier interrupted writes' temporary files for this target (see
    :func:`_remove_leftovers`), then: temporary file in the same folder, ``write``, fsync,
    ``os.replace``, fsync the folder. The file mode is ``mkstemp``'s 0600 (checkpoints: owner
    only) unless ``mode`` is given (results: ``0o644``). If ``write`` raises, the temporary
    file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
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


def write_json_atomic(path: str | os.PathLike, obj: Any, mode: int = 0o644) -> None:
    """``json.dump(obj)`` (indented) to ``path`` atomically (see :func:`write_bytes_atomic`);
    mode 0644 by default: results are for reading, by other users too."""
    write_bytes_atomic(path, json.dumps(obj, indent=2).encode("utf-8"), mode=mode)


# ----------------------------------------------------------------------------- reading
def _read_header(path: Path, header: Mapping[str, str]) -> tuple[str, str, dict[str, Any]]:
    """Check the format and header fields; return ``(meta_json, empty_json, digest)``."""
    fmt = header.get("format")
    if fmt in _OLD_FORMATS:
        raise checkpoint_error(
            path,
            f"format {fmt!r} predates checksums; this version reads only {_FORMAT!r} "
            "(old checkpoints are not supported: start the run again)",
        )
    if fmt != _FORMAT:
        raise checkpoint_error(path, f"has format {fmt!r}, expected {_FORMAT!r}")
    for name in _HEADER_FIELDS:
        if not isinstance(header.get(name), str):
            raise checkpoint_error(path, f"header field {name!r} is missing")
    try:
        digest = json.loads(header["digest"])
    except ValueError:
        raise checkpoint_error(path, "header field 'digest' is not valid JSON") from None
    try:
        check_fields(
            digest,
            {
                "algorithm": Field("str", choices=("sha256",)),
                "meta": Field("str"),
                "tensors": Field("dict", values=Field("str")),
            },
            "digest.",
        )
    except CheckpointError as exc:
        raise checkpoint_error(path, exc) from None
    meta_json, empty_json = header["meta"], header["empty"]
    if _meta_digest(fmt, meta_json, empty_json) != digest["meta"]:
        raise checkpoint_error(
            path, "header field 'meta' does not match its sha256 digest (file changed or corrupt)"
        )
    return meta_json, empty_json, digest


def _parse_json(path: Path, name: str, text: str, kind: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise checkpoint_error(path, f"header field {name!r} is not valid JSON ({exc})") from None
    if kind == "dict" and not isinstance(value, dict):
        raise checkpoint_error(path, f"header field {name!r} must be a JSON object")
    if kind == "list" and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        raise checkpoint_error(path, f"header field {name!r} must be a list of strings")
    return value


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``; 1-byte floats (float8: ``isfinite`` is not implemented for
    e4m3fn) are checked in fp32, which holds each of their values exactly."""
    return bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())


def load_checkpoint(
    path: str | os.PathLike,
    kind: str | None = None,
    spec: Mapping[str, Field] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read and verify a checkpoint written by :func:`save_checkpoint`: ``(tensors, meta)``.

    Verifies the format, the sha256 digests of the meta and of every tensor, that floating
    tensors are finite and that tensor keys form a tree; with ``kind``, that ``meta["app"]``
    is ``kind``; with ``spec``, that meta has the fields of ``spec`` (:func:`check_fields`).
    Every failure is a :class:`CheckpointError` naming the file and the field or tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            meta_json, empty_json, digest = _read_header(path, header)
            names = list(fh.keys())
            missing = sorted(set(digest["tensors"]) - set(names))
            if missing:
                raise checkpoint_error(path, f"tensor {missing[0]!r} is missing")
            flat = {}
            for key in names:
                if key not in digest["tensors"]:
                    raise checkpoint_error(path, f"tensor {key!r} has no digest")
                t = fh.get_tensor(key)
                if _tensor_digest(t) != digest["tensors"][key]:
                    raise checkpoint_error(
                        path,
                        f"tensor {key!r} does not match its sha256 digest (file changed or corrupt)",
                    )
                flat[key] = t
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types on bad files
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a readable safetensors file: {exc}"
        ) from None
    meta = _parse_json(path, "meta", meta_json, "dict")
    empty = _parse_json(path, "empty", empty_json, "list")
    with restoring(path):
        tensors = unflatten_tensors(flat, empty)
        for key, t in flat.items():
            if t.is_floating_point() and not _all_finite(t):
                raise CheckpointError(f"tensor {key!r} has non-finite values (NaN or inf)")
        if kind is not None:
            app = meta.get("app")
            if app != kind:
                what = KINDS.get(app, "not a known kind") if isinstance(app, str) else "no kind"
                raise CheckpointError(
                    f"field 'app' is {app!r} ({what}), expected {kind!r} "
                    f"({KINDS.get(kind, kind)}): wrong file?"
                )
        if spec is not None:
            check_fields(meta, spec)
    return tensors, meta


# ----------------------------------------------------------------------------- RNG state
RNG_FIELD = Field(
    "dict",
    fields={
        "python": Field("list", length=3),
        "numpy": Field("list", length=5),
        "torch": Field("list", items=Field("int", min=0)),
    },
)
"""Spec of :func:`rng_state`'s output (for a checkpoint's ``rng`` field)."""


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
    """Restore what :func:`rng_state` captured; a malformed state is a :class:`CheckpointError`
    naming the generator (nothing is restored then)."""
    check_fields({"rng": state}, {"rng": RNG_FIELD})
    try:
        version, internal, gauss = state["python"]
        py = (version, tuple(internal), gauss)
        random.Random().setstate(py)  # validate on a scratch generator first
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"field 'rng.python' is not a valid state ({exc})") from None
    try:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np_state = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
        np.random.RandomState().set_state(np_state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"field 'rng.numpy' is not a valid state ({exc})") from None
    try:
        t_state = torch.tensor(state["torch"], dtype=torch.uint8)
        torch.Generator().set_state(t_state)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"field 'rng.torch' is not a valid state ({exc})") from None
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(t_state)


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


RECORDS_FIELD = Field(
    "dict",
    values=Field(
        "dict",
        fields={"kind": Field("str", choices=("config", "metric")), "values": Field("dict")},
    ),
)
"""Spec of :func:`recorddict_to_tree`'s meta (for a node-state file's ``records`` field)."""


def tree_to_recorddict(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Any:
    """Inverse of :func:`recorddict_to_tree`; a malformed entry is a :class:`CheckpointError`
    naming the record."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    check_fields({"records": meta}, {"records": RECORDS_FIELD})
    out = RecordDict()
    for key, sd in tensors.items():
        if key in meta:
            raise CheckpointError(f"record {key!r} is both tensors and a config/metric record")
        check_tensors(sd, None, key)
        try:
            out[key] = ArrayRecord({k: v for k, v in sd.items()})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"record {key!r} is not a valid ArrayRecord ({exc})") from None
    for key, entry in meta.items():
        cls = ConfigRecord if entry["kind"] == "config" else MetricRecord
        try:
            out[key] = cls(dict(entry["values"]))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"field 'records.{key}.values' is not a valid {cls.__name__} ({exc})"
            ) from None
    return out
