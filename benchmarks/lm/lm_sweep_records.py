"""The result records of ``benchmarks/lm/lm_sweep.py``: a JSON list per file, a cell's key, and
the lookups that make the sweep resumable (a cell already in the file, or the identical
computation recorded under another method name, is not run again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lm_sweep_lib as lib
from common import append_record, load_records  # noqa: F401  (re-exported: lm_sweep, tests)

KEY_FIELDS = (
    "method",
    "protocol",
    "workers",
    "seed",
    "outer_lr",
    "outer_momentum",
    "inner_steps",
    "rounds",
    "quick",
    "inner_lr",
    "corpora",
)


def _key_value(rec: dict[str, Any], field: str) -> Any:
    """``rec[field]``; ``inner_lr`` from ``rec["size"]`` and ``corpora`` as a tuple for records
    written before those fields were part of the key (the ``main`` protocol's first records)."""
    if field == "inner_lr":
        return rec.get("inner_lr", (rec.get("size") or {}).get("inner_lr"))
    if field == "corpora":
        return tuple(rec["corpora"]) if rec.get("corpora") else None
    return rec.get(field)


def cell_key(rec: dict[str, Any]) -> tuple:
    return tuple(_key_value(rec, k) for k in KEY_FIELDS)


def find_cell(records: list[dict[str, Any]], key: tuple) -> dict[str, Any] | None:
    return next((r for r in records if cell_key(r) == key), None)


def same_run_methods(method: str, outer_momentum: float | None) -> list[str]:
    """Methods that run the identical computation as ``method`` at this momentum: with
    ``mu = 0`` the Nesterov switch is off, so only the merge rule matters (FedAvg is DiLoCo at
    lr 1, mu 0; Iso-C SGD is IsoLoCo at mu 0)."""
    if method == "dp-adamw" or outer_momentum != 0.0:
        return [method]
    rule = lib.METHODS[method][0]
    return [m for m, (r, _, _) in lib.METHODS.items() if r == rule]


def find_twin(key: tuple, paths: list[Path]) -> dict[str, Any] | None:
    """A finished record of the same computation under another method name (or file)."""
    fields = dict(zip(KEY_FIELDS, key, strict=False))
    for path in paths:
        for m in same_run_methods(fields["method"], fields["outer_momentum"]):
            rec = find_cell(load_records(path), (m, *key[1:]))
            if rec is not None:
                return rec
    return None
