"""IsoLoCo's presets: its update by name, a merge rule and the outer optimiser's values
(the repository's ``docs/algorithms.md`` ("Algorithms"), 3.1)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ISOLOCO_PRESETS", "IsoLoCoPreset", "resolve_preset"]


@dataclass(frozen=True)
class IsoLoCoPreset:
    """IsoLoCo's update by name: merge rule and outer optimiser (the repository's ``docs/algorithms.md`` ("Algorithms"), 3.1)."""

    name: str
    merge: str
    outer_lr: float
    outer_momentum: float
    nesterov: bool = True


ISOLOCO_PRESETS: dict[str, IsoLoCoPreset] = {
    "dropin": IsoLoCoPreset("dropin", "iso_c_matched", 0.5, 0.9),
    "isoloco-paper": IsoLoCoPreset("isoloco-paper", "iso_c", 1.8, 0.8),
}


def resolve_preset(name: object) -> IsoLoCoPreset:
    """The preset called ``name`` (``ValueError`` listing the known ones)."""
    if not isinstance(name, str) or name not in ISOLOCO_PRESETS:
        raise ValueError(
            f"unknown IsoLoCo preset {name!r}; expected one of {sorted(ISOLOCO_PRESETS)}"
        )
    return ISOLOCO_PRESETS[name]
