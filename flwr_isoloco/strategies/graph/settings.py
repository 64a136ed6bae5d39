"""The graph strategies' settings: the objects DiLoCo and IsoLoCo take, one spelling per concept.

``checks=ReplyChecks(...)`` (``max_update_norm``, ``max_norm_ratio``, ``dtype_policy``,
``payload``) and ``rounds=Rounds(...)`` (``max_empty_rounds``; gossip: ``quorum``,
``grace_s``) are :mod:`flwr_isoloco.strategies.diloco.settings`'s classes. A field that means
nothing on a graph (:data:`GRAPH_REFUSED`, plus a strategy's own ``REFUSED_SETTINGS``) is
refused at a value other than its default with a ``ValueError`` saying why, and the plain
keywords these settings replaced (:data:`MOVED`) with a ``TypeError`` naming the new spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from flwr_isoloco.strategies.diloco.settings import ReplyChecks, Rounds

__all__ = ["GRAPH_REFUSED", "MOVED", "ReplyChecks", "Rounds", "check_settings", "moved_keyword"]

MOVED: dict[str, tuple[str, type]] = {
    "max_update_norm": ("checks", ReplyChecks),
    "max_norm_ratio": ("checks", ReplyChecks),
    "dtype_policy": ("checks", ReplyChecks),
    "payload": ("checks", ReplyChecks),
    "client_sends": ("checks", ReplyChecks),  # ReplyChecks' old name of payload
    "quorum": ("rounds", Rounds),
    "grace_s": ("rounds", Rounds),
    "max_empty_rounds": ("rounds", Rounds),
}
"""Plain keywords that are a field of a settings object: name -> (argument, class)."""
RENAMED = {"client_sends": "payload"}
"""Plain keywords whose field has another name."""

_UNWEIGHTED = (
    "a graph strategy weights no reply by its examples (RW-LoRA's token is the one reply of a "
    "hop; gossip mixes the adapters with the graph's Metropolis weights)"
)
GRAPH_REFUSED: dict[str, str] = {
    "ReplyChecks.weighting": _UNWEIGHTED,
    "ReplyChecks.max_weight_ratio": _UNWEIGHTED,
    "Rounds.asynchronous": (
        "a graph round is synchronous (RW-LoRA: one hop; gossip: one train message per live "
        "vertex, then one mixing step of all the adapters)"
    ),
}
"""Settings fields no graph strategy uses, with the reason (refused unless at the default)."""


def moved_keyword(cls: str, name: str, value: Any, refused: Mapping[str, str]) -> str | None:
    """The ``TypeError`` message for ``cls(name=value)`` when ``name`` is now a settings field
    (None if it is not), with the reason when the strategy refuses that field anyway."""
    if name not in MOVED:
        return None
    arg, klass = MOVED[name]
    field = RENAMED.get(name, name)
    text = (
        f"{cls}({name}={value!r}): {name} is a {klass.__name__} setting: use "
        f"{arg}={klass.__name__}({field}={value!r})"
    )
    why = refused.get(f"{klass.__name__}.{name}")
    return text if why is None else f"{text}; but {cls} refuses it: {why}"


def check_settings(
    strategy: Any, checks: ReplyChecks, rounds: Rounds
) -> tuple[ReplyChecks, Rounds]:
    """``(checks, rounds)`` once checked: the settings classes, with every field in the
    strategy's ``REFUSED_SETTINGS`` (``"Class.field"`` -> why) at its default; else a
    ``ValueError`` naming the field and saying why."""
    cls, refused = type(strategy).__name__, strategy.REFUSED_SETTINGS
    for arg, obj, klass in (("checks", checks, ReplyChecks), ("rounds", rounds, Rounds)):
        if not isinstance(obj, klass):
            raise ValueError(f"{cls}: {arg} must be a {klass.__name__}, got {obj!r}")
        for f in fields(obj):
            why = refused.get(f"{klass.__name__}.{f.name}")
            value = getattr(obj, f.name)
            if why is not None and value != f.default:
                raise ValueError(
                    f"{cls}: {klass.__name__}.{f.name}={value!r} does not apply here: {why}; "
                    f"leave it at its default ({f.default!r})"
                )
    return checks, rounds
