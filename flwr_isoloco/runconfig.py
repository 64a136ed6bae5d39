"""Read Flower's flat run config (``context.run_config``) into a validated OmegaConf structure.

Flower flattens ``[tool.flwr.app.config]`` and ``--run-config`` overrides into one dict with
dotted keys (``strategy.outer-lr = 0.7``). :func:`read_run_config` checks it against a nested
*defaults* mapping (the schema: every allowed key with its default value, whose type fixes the
key's type) and optional per-key validators, and returns a read-only nested ``DictConfig``::

    cfg = read_run_config(context.run_config, DEFAULTS, {"strategy.name": choices("a", "b")})
    cfg.strategy["outer-lr"]        # keys keep their dashes; use item access for them

Every problem raises :class:`RunConfigError` naming the key and the value (unknown keys also
list close matches), so a run stops up front with a message the user can act on.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = [
    "RunConfigError",
    "prepare_output_dir",
    "SEED_MAX",
    "THREADS_MAX",
    "read_run_config",
    "flatten",
    "unflatten",
    "check_resumable",
    "choices",
    "positive",
    "non_negative",
    "in_range",
    "absolute_path",
    "existing_path",
    "precheck_app_config",
]

SEED_MAX = 2**32 - 1
"""Largest ``seed`` an app accepts: numpy, torch and PCG64 all take it (and derived seeds stay
within ``manual_seed``'s range); larger values used to overflow per-node generators."""
THREADS_MAX = 256
"""Largest ``torch-threads`` an app accepts (``torch.set_num_threads(100000)`` segfaults)."""

Validator = Callable[[Any], None]
"""A validator takes the (type-checked) value and raises ``ValueError(reason)`` if it is bad."""


class RunConfigError(ValueError):
    """A run-config key is unknown, has the wrong type, or has a bad value."""


# ----------------------------------------------------------------------------- flatten helpers
def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` (the shape of Flower's ``context.run_config``)."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if not isinstance(key, str) or not key or "." in key:
            raise RunConfigError(
                f"schema key {prefix + str(key)!r} must be a non-empty str without '.'"
            )
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, full + "."))
        else:
            flat[full] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1} -> {"a": {"b": 1}}``; raises if a key is both a leaf and a section."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RunConfigError(f"run-config key {key!r} clashes with the value key {part!r}")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise RunConfigError(f"run-config key {key!r} is a section, not a value")
        node[parts[-1]] = value
    return nested


# ----------------------------------------------------------------------------- validators
def check_resumable(
    saved: Any, now: Mapping[str, Any], may_differ: Iterable[str] = (), source: str = ""
) -> None:
    """Refuse to resume when a setting differs from the checkpoint's (except ``may_differ`` keys).

    Both configs are nested; the error lists every differing dotted key with both values (and
    ``source``, the checkpoint file, when given), so one failed resume shows all there is to
    fix. ``saved`` comes from a file, so a value that is not a config (not a dict, or keys that
    are not setting names) is refused too.
    """
    where = f" ({source})" if source else ""
    if not isinstance(saved, Mapping):
        raise RunConfigError(f"the checkpoint's config{where} is not a dict: {saved!r:.80}")
    try:
        a = flatten(saved)
    except RunConfigError as exc:
        raise RunConfigError(f"the checkpoint's config{where} is malformed: {exc}") from None
    b = flatten(now)
    allowed = set(may_differ)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in allowed:
            continue
        if key not in a:
            diffs.append(f"run-config key {key!r} = {b[key]!r} is not in the checkpoint's config")
        elif key not in b:
            diffs.append(
                f"the checkpoint has key {key!r} = {a[key]!r}, which this run does not know"
            )
        elif a[key] != b[key] or isinstance(a[key], bool) != isinstance(b[key], bool):
            diffs.append(
                f"run-config key {key!r} = {b[key]!r} differs from the checkpoint's {a[key]!r}"
            )
    if len(diffs) == 1:
        raise RunConfigError(f"{diffs[0]}{where}; a resumed run must use the same settings")
    if diffs:
        raise RunConfigError(
            f"{len(diffs)} settings differ from the checkpoint's config{where}; a resumed run "
            "must use the same settings: " + "; ".join(diffs)
        )


def choices(*allowed: Any) -> Validator:
    """Value must be one of ``allowed``."""

    def check(value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"must be one of {sorted(map(str, allowed))}")

    return check


def positive(value: Any) -> None:
    """Value must be > 0."""
    if not value > 0:
        raise ValueError("must be > 0")


def non_negative(value: Any) -> None:
    """Value must be >= 0."""
    if not value >= 0:
        raise ValueError("must be >= 0")


def in_range(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Validator:
    """Value must lie in [lo, hi] (ends excluded when ``*_open``)."""

    def check(value: Any) -> None:
        ok_lo = value > lo if lo_open else value >= lo
        ok_hi = value < hi if hi_open else value <= hi
        if not (ok_lo and ok_hi):
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise ValueError(f"must be in {left}{lo}, {hi}{right}")

    return check


def absolute_path(*, allow_empty: bool = False) -> Validator:
    """Value must be an absolute path (the ServerApp's cwd is the SuperLink's, so relative
    paths would land somewhere surprising). ``allow_empty`` lets ``""`` mean "use the default"."""

    def check(value: Any) -> None:
        if value == "" and allow_empty:
            return
        if not os.path.isabs(os.path.expanduser(str(value))):
            raise ValueError("must be an absolute path")

    return check


def existing_path(*, allow_empty: bool = False) -> Validator:
    """Value must name an existing file or directory (``""`` allowed if ``allow_empty``)."""

    def check(value: Any) -> None:
        if value == "" and allow_empty:
            return
        if not os.path.exists(os.path.expanduser(str(value))):
            raise ValueError("no such file or directory")

    return check


def prepare_output_dir(path: str | os.PathLike, key: str = "output-dir") -> Path:
    """Create ``path`` (and parents) and prove it writable, before any work starts.

    A path that is a file, lies below a file, or cannot be written raises
    :class:`RunConfigError` naming ``key``, instead of an ``OSError`` rounds later.
    """
    out = Path(path)
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{str(out)!r} is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise RunConfigError(
            f"run-config key {key!r} = {str(path)!r}: cannot write results there ({why})"
        ) from None
    return out


# ----------------------------------------------------------------------------- reader
def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of ``default``; ints are accepted for float keys."""
    bad = RunConfigError(
        f"run-config key {key!r} has value {value!r} of type {type(value).__name__}; "
        f"expected {type(default).__name__} (default {default!r})"
    )
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
        if not math.isfinite(value):
            raise RunConfigError(f"run-config key {key!r} has non-finite value {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise bad
        return value
    raise RunConfigError(
        f"schema default for {key!r} has unsupported type {type(default).__name__}"
    )


def read_run_config(
    run_config: Mapping[str, Any],
    defaults: Mapping[str, Any],
    validators: Mapping[str, Validator | Iterable[Validator]] | None = None,
    *,
    readonly: bool = True,
) -> DictConfig:
    """Validate Flower's flat ``run_config`` against nested ``defaults``; return a ``DictConfig``.

    - keys missing from ``run_config`` take their default;
    - a key not in ``defaults`` -> :class:`RunConfigError` naming it, with close matches;
    - a value whose type differs from the default's (int accepted for float) -> error;
    - each validator of a key (dotted name) runs on the final value, defaults included.
    Nested input (``{"strategy": {"outer-lr": 1}}``) is accepted too and flattened first.
    """
    schema = flatten(defaults)
    flat_input = (
        flatten(run_config)
        if any(isinstance(v, Mapping) for v in run_config.values())
        else dict(run_config)
    )
    validators = dict(validators or {})
    for key in validators:
        if key not in schema:
            raise RunConfigError(f"validator given for {key!r}, which is not a schema key")

    merged = dict(schema)
    for key, value in flat_input.items():
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RunConfigError(
                f"unknown run-config key {key!r}{hint} (valid keys: {', '.join(sorted(schema))})"
            )
        merged[key] = _coerce(key, value, schema[key])

    for key, checks in validators.items():
        for check in [checks] if callable(checks) else list(checks):
            try:
                check(merged[key])
            except ValueError as exc:
                raise RunConfigError(
                    f"run-config key {key!r} has bad value {merged[key]!r}: {exc}"
                ) from None

    cfg = OmegaConf.create(unflatten(merged))
    OmegaConf.set_struct(cfg, True)
    if readonly:
        OmegaConf.set_readonly(cfg, True)
    return cfg


# ----------------------------------------------------------------------------- pre-flight
def _declared(app_dir: Path) -> tuple[dict[str, Any], str]:
    """The app's declared run config (flat) and its ServerApp component (``module:attr``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10; tomli is a Flower dependency
        import tomli as tomllib

    with open(app_dir / "pyproject.toml", "rb") as fh:
        app = tomllib.load(fh)["tool"]["flwr"]["app"]
    return flatten(app.get("config", {})), app.get("components", {}).get("serverapp", "")


def _app_spec(app_dir: Path, component: str) -> Any:
    """The :class:`~flwr_isoloco.apprunner.AppSpec` ``SPEC`` of the ServerApp module, if it
    has one. The module is imported only when its source builds an ``AppSpec`` (so a user's
    app, which may load data at import, is never imported here)."""
    import importlib
    import sys

    module = component.split(":")[0]
    source = app_dir.joinpath(*module.split(".")).with_suffix(".py")
    if not module or not source.is_file() or "AppSpec(" not in source.read_text("utf-8"):
        return None
    sys.path.insert(0, str(app_dir))
    try:
        return getattr(importlib.import_module(module), "SPEC", None)
    finally:
        sys.path.remove(str(app_dir))


def precheck_app_config(app_dir: str | os.PathLike, overrides: Mapping[str, Any]) -> list[str]:
    """Problems with run-config ``overrides`` (flat, as Flower parses them) for the Flower app
    in ``app_dir``, found before anything starts (the repository's ``scripts/run_app.sh`` calls it).

    Each override must have the type of the value the app declares in ``pyproject.toml``
    (int accepted for a float key, as Flower's TOML would write ``1`` for ``1.0``); unknown
    keys are the caller's. For an app built on :mod:`flwr_isoloco.apprunner` (its ServerApp
    module defines ``SPEC``), the app's own ``load_config`` then checks the whole config:
    values, ranges, paths and the keys that depend on each other, as the run would at start.
    """
    app_dir = Path(app_dir)
    declared, component = _declared(app_dir)
    problems = []
    for key, value in overrides.items():
        if key in declared:
            try:
                _coerce(key, value, declared[key])
            except RunConfigError as exc:
                problems.append(str(exc).replace("(default", "(declared"))
    if problems:
        return problems
    spec = _app_spec(app_dir, component)
    if spec is None:
        return []
    try:
        spec.load_config({**declared, **overrides})
    except RunConfigError as exc:
        return [str(exc)]
    return []
