"""IsoLoCo: DiLoCo whose merge rule is Iso-C (flattened spectrum of the weighted mean)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr_isoloco.strategies.diloco import DiLoCo
from flwr_isoloco.strategies.diloco_config import ISOLOCO_RUN_CONFIG

__all__ = ["IsoLoCo"]


class IsoLoCo(DiLoCo):
    """DiLoCo with Iso-C merging: ``g = iso_c(weighted mean)`` on 2-D tensors, mean elsewhere.

    Defaults from the IsoLoCo paper's tuned values: ``outer_lr=1.8``, ``outer_momentum=0.8``,
    Nesterov. ``fast=True`` uses the Newton-Schulz variant ``iso_c_ns`` instead of the SVD.
    """

    RUN_CONFIG_DEFAULTS = {**ISOLOCO_RUN_CONFIG, "fast": False}

    def __init__(
        self,
        *,
        merge: Any = None,
        fast: bool = False,
        outer_lr: float = 1.8,
        outer_momentum: float = 0.8,
        **kwargs: Any,
    ) -> None:
        if merge is None:
            merge = "iso_c_ns" if fast else "iso_c"
        elif fast:
            raise ValueError("give either merge= or fast=True, not both")
        self.fast = fast
        super().__init__(merge=merge, outer_lr=outer_lr, outer_momentum=outer_momentum, **kwargs)

    @classmethod
    def _extra_from_config(cls, c: Mapping[str, Any]) -> dict[str, Any]:
        if c.get("fast"):
            if c["merge"] not in ("iso_c", "iso_c_ns"):
                raise ValueError("strategy.fast=true needs strategy.merge 'iso_c' (the default)")
            return {"merge": None, "fast": True}
        return {}
