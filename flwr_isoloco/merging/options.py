"""A merge rule's options: the names it accepts, the checks on their values, and where a rule
applies (2-D tensors whose name matches ``spectral_pattern``). The rules: :mod:`.rules`."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Protocol

import torch

__all__ = ["COMMON_OPTIONS", "RuleOptions", "check_options", "rule_applies"]


class RuleOptions(Protocol):
    """What :func:`check_options` reads of a rule: its name and its options with their
    defaults (a :class:`.rules.MergeRule` is one; this module does not import :mod:`.rules`,
    which imports it)."""

    name: str
    options: Mapping[str, object]


#: Options every rule accepts.
COMMON_OPTIONS = {"spectral_pattern": None}


def _fraction(name: str, value: object, low_open: bool, high_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {name}={value!r} must be a number")
    ok_low = value > 0 if low_open else value >= 0
    ok_high = value < 1 if high_open else value <= 1
    if not (ok_low and ok_high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"option {name}={value!r} must be in {lo}0, 1{hi}")
    return float(value)


def check_options(rule: RuleOptions, options: dict) -> tuple[dict, re.Pattern | None]:
    """Validate option names and values; return the rule's options and the compiled pattern."""
    allowed = {**COMMON_OPTIONS, **rule.options}
    for name in options:
        if name not in allowed:
            raise ValueError(
                f"unknown option {name!r} for merge rule {rule.name!r}; "
                f"accepted: {', '.join(sorted(allowed)) or 'none'}"
            )
    opts = {k: options.get(k, v) for k, v in rule.options.items()}
    for name, value in opts.items():
        if name in ("prune_fraction", "drop_rate"):
            opts[name] = _fraction(name, value, low_open=False, high_open=True)
        elif name in ("common_fraction",):
            opts[name] = _fraction(name, value, low_open=True, high_open=False)
        elif name == "ns_lower":
            if value is None:
                continue
            opts[name] = _fraction(name, value, low_open=True, high_open=True)
        elif name == "max_gain":
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"option max_gain={value!r} must be a number >= 1 or None")
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"option max_gain={value!r} must be a finite number >= 1 or None")
            opts[name] = float(value)
        elif name in ("ns_tol",):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"option ns_tol={value!r} must be a number > 0")
        elif name in ("seed", "ns_max_steps", "ns_steps"):
            if value is None and name == "ns_steps":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (0 if name == "seed" else 1)
            ):
                raise ValueError(
                    f"option {name}={value!r} must be an int >= {0 if name == 'seed' else 1}"
                )
    pattern = options.get("spectral_pattern")
    compiled = None
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError(f"option spectral_pattern={pattern!r} must be a regex string")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"option spectral_pattern={pattern!r} is not a valid regex: {exc}"
            ) from None
    return opts, compiled


def rule_applies(key: str, tensor: torch.Tensor, pattern: re.Pattern | None) -> bool:
    """True for non-empty 2-D tensors whose name matches ``pattern`` (all 2-D when None).

    An empty matrix (e.g. 3 x 0) has no singular values: it takes the mean (itself empty)."""
    return (
        tensor.ndim == 2
        and tensor.numel() > 0
        and (pattern is None or pattern.search(key) is not None)
    )
