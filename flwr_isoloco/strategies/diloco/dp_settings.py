"""The differential-privacy settings of :class:`~flwr_isoloco.strategies.DiLoCo`
(``privacy=CentralDP(...) | LocalDP(...)``, ``CentralDP(adaptive=AdaptiveClipping(...))``):
frozen objects, each checked when built (``ValueError`` naming the field). The mechanisms they
configure: :mod:`~flwr_isoloco.strategies.diloco.privacy`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "DEFAULT_CLIP_LR",
    "DEFAULT_DP_DELTA",
    "AdaptiveClipping",
    "CentralDP",
    "DPSettings",
    "LocalDP",
    "finite_number",
    "off_or_positive",
]

DEFAULT_DP_DELTA = 1e-5
DEFAULT_CLIP_LR = 0.2  # Andrew et al.'s eta (and Flower's clip_norm_lr)


def finite_number(v: object) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def off_or_positive(where: str, v: Any) -> None:
    """``v`` is None or a finite number ``>= 0`` (0 / None: off); ``ValueError`` naming it."""
    if v is not None and not (finite_number(v) and v >= 0):
        raise ValueError(f"{where} must be a finite number >= 0 (or None for off), got {v!r}")


@dataclass(frozen=True)
class AdaptiveClipping:
    """Adaptive clipping (Andrew et al. 2021): ``C`` moves after each round towards the
    ``quantile`` quantile of the update norms, ``C <- C exp(-lr (b - quantile))``, ``b`` the
    unclipped fraction noised with std ``count_std`` (``> z / 2``: the count's share of the
    budget; the update sum then gets multiplier ``(z^-2 - (2 count_std)^-2)^-1/2``)."""

    quantile: float
    count_std: float
    lr: float = DEFAULT_CLIP_LR

    def __post_init__(self) -> None:
        q = self.quantile
        if not (finite_number(q) and 0 < q < 1):
            raise ValueError(f"AdaptiveClipping.quantile must be in (0, 1), got {q!r}")
        for name in ("count_std", "lr"):
            v = getattr(self, name)
            if not (finite_number(v) and v > 0):
                raise ValueError(f"AdaptiveClipping.{name} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class DPSettings:
    """What both DP modes share: ``clipping_norm`` (``C``, the L2 bound of one site's delta),
    ``noise_multiplier`` (``z``: noise ``N(0, (z C)^2)``; 0: clipping only, epsilon infinite),
    ``delta`` (epsilon is reported at it, the ``dp-epsilon`` metric), ``max_epsilon`` (a round
    that would pass it is not sent: ``PrivacyBudgetExhausted``), ``seed`` (the noise key; None:
    a secret from the OS, kept in the checkpoint; an int makes the noise reproducible, and
    removable by whoever knows it: tests only)."""

    mode: ClassVar[str] = ""
    clipping_norm: float
    noise_multiplier: float = 0.0
    delta: float = DEFAULT_DP_DELTA
    max_epsilon: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        where = type(self).__name__
        c = self.clipping_norm
        if not (finite_number(c) and c > 0):
            raise ValueError(f"{where}.clipping_norm must be a finite number > 0, got {c!r}")
        off_or_positive(f"{where}.noise_multiplier", self.noise_multiplier)
        off_or_positive(f"{where}.max_epsilon", self.max_epsilon)
        if not (isinstance(self.delta, float) and 0 < self.delta < 1):
            raise ValueError(f"{where}.delta must be a float in (0, 1), got {self.delta!r}")
        if self.max_epsilon and not self.noise_multiplier:
            raise ValueError(f"{where}.max_epsilon needs noise_multiplier > 0 (no noise: no bound)")
        s = self.seed
        if s is not None and (not isinstance(s, int) or isinstance(s, bool)):
            raise ValueError(f"{where}.seed must be an int or None, got {s!r}")


@dataclass(frozen=True, kw_only=True)
class LocalDP(DPSettings):
    """Client-side DP: each worker clips its delta to ``C`` and adds ``N(0, (z C)^2)`` before
    compression and error feedback; any merge rule and robust rule is then post-processing,
    replies without the echo are dropped, and ``dp-epsilon`` is each site's own (multiplier
    ``z / 2``: replace-one). Fields: :class:`DPSettings`."""

    mode: ClassVar[str] = "local"


@dataclass(frozen=True, kw_only=True)
class CentralDP(DPSettings):
    """Central DP: the server clips each pseudo-gradient to ``clipping_norm`` (``C``), weighs
    them uniformly, adds ``N(0, (z C)^2)`` to the sum before the outer step and divides by the
    number of nodes sampled. Mean-based merge rules only (mean, Iso-C), no robust rule, no
    ``max_norm_ratio``. ``adaptive``: :class:`AdaptiveClipping` (``clipping_norm`` is then the
    initial ``C``; needs ``noise_multiplier > 0``). Other fields: :class:`DPSettings`."""

    mode: ClassVar[str] = "central"
    adaptive: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.adaptive
        if a is None:
            return
        if not isinstance(a, AdaptiveClipping):
            raise ValueError(f"CentralDP.adaptive must be an AdaptiveClipping or None, got {a!r}")
        if not self.noise_multiplier:
            raise ValueError(
                "CentralDP.adaptive needs central DP with noise (noise_multiplier > 0): the "
                "server clips, counts and noises the count"
            )
        if not self.noise_multiplier < 2 * a.count_std:
            raise ValueError(
                f"AdaptiveClipping.count_std={a.count_std:g} is too small for noise_multiplier="
                f"{self.noise_multiplier:g}: the count alone would spend more than the budget "
                "(needs z < 2 count_std)"
            )
