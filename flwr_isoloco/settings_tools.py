"""What the package's settings objects share: frozen dataclasses checked when built, shown by
the fields not at their default (:func:`short_repr`), and keywords that moved into one of them
refused with the new spelling (:func:`renamed_fields`).

Used by the strategies' settings (:mod:`flwr_isoloco.strategies.diloco.settings`) and the DiLoCo
worker's (:mod:`flwr_isoloco.clients.worker_settings`); it imports neither side.
"""

from __future__ import annotations

import functools
import re
from dataclasses import MISSING, fields
from types import MappingProxyType
from typing import Any

__all__ = ["renamed_fields", "renamed_message", "short_repr"]

_MOVED = re.compile(r"(\w+)=(\w+)\.(\w+)")


def renamed_message(name: str, old: str, value: Any, new: str) -> str:
    """The message refusing ``name(old=value)``: ``new`` is the new field name, ``arg=Class.field``
    (the field of a settings object: ``rounds=Rounds.asynchronous``) or a spelling to use
    instead (``merge='iso_c_ns'``)."""
    if m := _MOVED.fullmatch(new):
        what, use = f"{m[2]}.{m[3]}", f"{m[1]}={m[2]}({m[3]}={value!r})"
    else:
        what, use = new, new if "=" in new else f"{new}={value!r}"
    return f"{name}({old}={value!r}): {old} is now {what}: use {name}({use})"


def renamed_fields(**renamed: str):
    """A class or function whose old keywords (``old=new``, :func:`renamed_message`) are refused
    with a ``TypeError`` naming the new spelling, not taken for an unknown argument. A class
    keeps its identity (its ``__init__`` is wrapped); a function is wrapped (its signature is
    the function's, ``inspect.signature`` follows ``__wrapped__``)."""

    def refuse(name: str, kw: dict[str, Any]) -> None:
        for old, new in renamed.items():
            if old in kw:
                raise TypeError(renamed_message(name, old, kw[old], new))

    def wrap(obj):
        if not isinstance(obj, type):

            @functools.wraps(obj)
            def call(*args: Any, **kw: Any):
                refuse(obj.__name__, kw)
                return obj(*args, **kw)

            return call
        init = obj.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kw: Any) -> None:
            refuse(type(self).__name__, kw)
            init(self, *args, **kw)

        obj.__init__ = __init__
        return obj

    return wrap


def short_repr(cls):
    """A dataclass whose repr names only the fields not at their default (``Rounds()``,
    ``Rounds(quorum=0.5)``): a signature that shows it as a default stays one short line."""

    def __repr__(self) -> str:
        args = []
        for f in fields(self):
            v = getattr(self, f.name)
            v = dict(v) if isinstance(v, MappingProxyType) else v
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if default is MISSING or type(v) is not type(default) or v != default:
                args.append(f"{f.name}={v!r}")
        return f"{type(self).__name__}({', '.join(args)})"

    cls.__repr__ = __repr__
    return cls
