"""SecAgg+'s settings for DiLoCo/IsoLoCo (:func:`~flwr_isoloco.strategies.diloco.secagg.use_secagg`):
Flower's ``SecAggPlusWorkflow`` parameters, the weight cap, and the error bound of the
quantised weighted mean."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from flwr.server.workflow import SecAggPlusWorkflow

__all__ = ["SecAggSettings"]


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters (``SecAggPlusWorkflow``'s, same meaning).

    ``num_shares``: a float is the share of the sampled nodes (1.0: every node, 3 nodes give 3
    shares), an int a count (> 2). ``reconstruction_threshold``: shares needed to unmask a
    dropped node (a float: of ``num_shares``, at least 2). ``max_weight``: the largest weight
    one reply may have (None: 1 with uniform weighting, Flower's 1000 with examples).
    """

    num_shares: float | int = 1.0
    reconstruction_threshold: float | int = 0.67
    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    modulus_range: int = 1 << 32
    max_weight: float | None = None

    def weight_cap(self, weighting: str) -> float:
        """``max_weight`` in force for ``weighting``."""
        if self.max_weight is not None:
            return float(self.max_weight)
        return 1.0 if weighting == "uniform" else 1000.0

    def step(self) -> float:
        """One quantisation step on a client's weighted entry: ``2 c / Q``."""
        return 2.0 * self.clipping_range / self.quantization_range

    def bound(self, weights: Iterable[float], weighting: str) -> float:
        """Largest per-entry error of SecAgg+'s weighted mean: ``step M / sum_i (w_i / W)``."""
        ws = list(weights)
        cap = self.weight_cap(weighting)
        return self.step() * len(ws) / sum(w / cap for w in ws) if ws else math.inf

    def check(self) -> None:
        """``ValueError`` naming a bad value (Flower's workflow checks the rest)."""
        c, q, mod = self.clipping_range, self.quantization_range, self.modulus_range
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0 < c < math.inf):
            raise ValueError(f"secagg clipping_range must be a finite number > 0, got {c!r}")
        if isinstance(q, bool) or not isinstance(q, int) or q < 2:
            raise ValueError(f"secagg quantization_range must be an int >= 2, got {q!r}")
        if isinstance(mod, bool) or not isinstance(mod, int) or mod <= q or mod > 1 << 32:
            raise ValueError(
                f"secagg modulus_range must be an int in (quantization_range, 2^32], got {mod!r}"
            )
        w = self.max_weight
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0):
            raise ValueError(f"secagg max_weight must be a number > 0 or None, got {w!r}")

    def workflow(self, weighting: str, timeout: float | None) -> SecAggPlusWorkflow:
        """Flower's workflow with these parameters (it checks shares / threshold itself)."""
        return SecAggPlusWorkflow(
            self.num_shares,
            self.reconstruction_threshold,
            max_weight=self.weight_cap(weighting),
            clipping_range=float(self.clipping_range),
            quantization_range=self.quantization_range,
            modulus_range=self.modulus_range,
            timeout=timeout,
        )

    def describe(self) -> str:
        return (
            f"SecAgg+ (shares {self.num_shares}, threshold {self.reconstruction_threshold}, "
            f"clipping +-{self.clipping_range:g}, {self.quantization_range} levels, "
            f"step {self.step():.3g})"
        )
