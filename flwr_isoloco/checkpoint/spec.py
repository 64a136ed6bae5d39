"""Checks for what a checkpoint holds: the error type, a declarative meta-field spec, tensors.

:class:`Field` describes one required meta field (type, range, nested fields); :func:`check_fields`
checks a JSON meta against a dict of them and :func:`check_tensors` a group of tensors against a
reference (names, shapes, finiteness). Every failure is a :class:`CheckpointError` naming the
field (dotted path) or the tensor; :func:`restoring` adds the file's name. Used by
:func:`flwr_isoloco.checkpoint.load_checkpoint`, the apps' resume code and the strategies'
``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "Field",
    "check_fields",
    "check_tensors",
    "checkpoint_error",
    "restoring",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read (bad key, bad file, wrong format, bad field)."""


def checkpoint_error(path: str | os.PathLike, what: Any) -> CheckpointError:
    """``CheckpointError("checkpoint '<path>': <what>")`` (the one message prefix)."""
    return CheckpointError(f"checkpoint {str(path)!r}: {what}")


@contextlib.contextmanager
def restoring(path: str | os.PathLike, part: str = "") -> Iterator[None]:
    """Turn a ``ValueError``/``TypeError``/``KeyError`` raised while restoring state from the
    checkpoint at ``path`` into a :class:`CheckpointError` naming the file (and ``part``)."""
    try:
        yield
    except CheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise checkpoint_error(path, f"{part}{exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise checkpoint_error(path, f"{part}{msg}") from None


# ----------------------------------------------------------------------------- meta fields
@dataclass(frozen=True)
class Field:
    """One required meta field and what it must hold (a small declarative spec).

    ``kind`` is ``"int"`` (not bool), ``"float"`` (int or float, not bool, finite), ``"str"``,
    ``"bool"``, ``"dict"`` (JSON object), ``"list"`` or ``"any"``. ``min`` bounds numbers;
    ``choices`` lists the allowed values; ``optional`` lets the field be absent, ``nullable``
    lets it be ``null``. For a dict, ``fields`` are its required sub-fields, ``values`` the spec
    of every value and ``keys`` a regex every key must match; for a list, ``items`` is the spec
    of every item and ``length`` its exact length.
    """

    kind: str
    min: float | None = None
    choices: tuple = ()
    optional: bool = False
    nullable: bool = False
    fields: Mapping[str, Field] | None = None
    values: Field | None = None
    keys: str | None = None
    items: Field | None = None
    length: int | None = None


_KIND_NAMES = {
    "int": "an int",
    "float": "a finite number",
    "str": "a string",
    "bool": "a bool",
    "dict": "a JSON object",
    "list": "a list",
    "any": "any value",
}


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def _check_value(value: Any, spec: Field, name: str) -> None:
    if value is None and spec.nullable:
        return
    if not _has_kind(value, spec.kind):
        want = _KIND_NAMES[spec.kind]
        if spec.min is not None:
            want += f" >= {spec.min:g}"
        raise CheckpointError(f"field {name!r} must be {want}, got {value!r:.80}")
    if spec.min is not None and value < spec.min:
        raise CheckpointError(
            f"field {name!r} must be {_KIND_NAMES[spec.kind]} >= {spec.min:g}, got {value!r}"
        )
    if spec.choices and value not in spec.choices:
        raise CheckpointError(f"field {name!r} must be one of {list(spec.choices)}, got {value!r}")
    if spec.kind == "dict":
        if spec.keys is not None:
            bad = [k for k in value if not re.fullmatch(spec.keys, k)]
            if bad:
                raise CheckpointError(f"field {name!r} has a bad key {bad[0]!r:.80}")
        if spec.fields is not None:
            check_fields(value, spec.fields, name + ".")
        if spec.values is not None:
            for k, v in value.items():
                _check_value(v, spec.values, f"{name}.{k}")
    if spec.kind == "list":
        if spec.length is not None and len(value) != spec.length:
            raise CheckpointError(f"field {name!r} must have {spec.length} items, got {len(value)}")
        if spec.items is not None:
            for i, v in enumerate(value):
                _check_value(v, spec.items, f"{name}[{i}]")


def check_fields(meta: Any, spec: Mapping[str, Field], prefix: str = "") -> None:
    """Check ``meta`` against ``spec`` (name -> :class:`Field`); raise :class:`CheckpointError`
    naming the first missing or bad field (dotted path, e.g. ``'totals.bytes-p2p'``)."""
    if not isinstance(meta, dict):
        where = repr(prefix[:-1]) if prefix else "'meta'"
        raise CheckpointError(f"field {where} must be a JSON object, got {meta!r:.80}")
    for key, field in spec.items():
        name = prefix + key
        if key not in meta:
            if field.optional:
                continue
            raise CheckpointError(f"field {name!r} is missing")
        _check_value(meta[key], field, name)


def _shape_of(ref: Any) -> tuple[int, ...]:
    return tuple(ref.shape) if isinstance(ref, torch.Tensor) else tuple(ref)


def check_tensors(
    tensors: Any, reference: Mapping[str, Any] | None = None, name: str = "tensors"
) -> None:
    """``tensors`` must be a dict of tensors, floating ones finite; with ``reference`` (name ->
    tensor or shape), the same names with the same shapes. Raises :class:`CheckpointError`
    naming the tensor (``<name>/<key>``)."""
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"tensor group {name!r} is missing or not a group of tensors")
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor '{name}/{key!s:.80}' is not a tensor")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"tensor '{name}/{key}' has non-finite values (NaN or inf)")
    if reference is None:
        return
    missing = [k for k in reference if k not in tensors]
    extra = [k for k in tensors if k not in reference]
    if missing:
        raise CheckpointError(f"tensor '{name}/{missing[0]}' is missing ({len(missing)} missing)")
    if extra:
        raise CheckpointError(f"tensor '{name}/{extra[0]!s:.80}' is unexpected")
    for key, ref in reference.items():
        got, want = tuple(tensors[key].shape), _shape_of(ref)
        if got != want:
            raise CheckpointError(
                f"tensor '{name}/{key}' has shape {list(got)}, expected {list(want)}"
            )
