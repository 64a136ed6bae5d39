"""The settings of :class:`~flwr_isoloco.strategies.DiLoCo` and
:class:`~flwr_isoloco.strategies.IsoLoCo` beyond FedAvg's arguments, the merge rule and the
outer optimiser: small frozen objects, each checked when built (``ValueError`` naming the field).

- ``checks=ReplyChecks(...)``: what a reply must be and how much it may weigh.
- ``rounds=Rounds(...)``: when a round closes (quorum, grace) and when a run that trains nothing
  stops.
- ``upload=Codec(...)`` (or a codec name): how workers compress their delta.
- ``merge_settings=MergeSettings(...)``, ``records=Records(...)``: the merge rule's options,
  device and buffers; Flower's record keys and metric aggregation
  (:mod:`~flwr_isoloco.strategies.diloco.settings_groups`).
- ``divergence=Divergence(...)``: what a round that makes the evaluation loss blow up does.
- ``robust=Median() | TrimmedMean() | Krum() | MultiKrum() | NormClip() | DistanceFilter()`` (or
  a rule name): robust aggregation in place of the mean.
- ``privacy=CentralDP(...) | LocalDP(...)``: differential privacy, with
  ``CentralDP(adaptive=AdaptiveClipping(...))`` for adaptive clipping.

A quorum's type says what it is: a float a fraction, an int a count (so the int 1, which the
run config's ``strategy.quorum = 1`` reads as all, and ``3.0`` are refused with the fix).
A new policy is one new class here. Checks that involve the strategy (DP refuses a robust rule or
a merge rule whose output is not a function of the sum; ``median`` needs a mean-based rule) stay
at the strategy's construction. The run-config keys map onto these objects in one place,
:func:`~flwr_isoloco.strategies.diloco.sections.section_kwargs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

from flwr_isoloco.compression import EXACT, normalize_options
from flwr_isoloco.merging import MERGE_RULES
from flwr_isoloco.merging.robust import ROBUST_RULES, resolve_robust
from flwr_isoloco.settings_tools import renamed_fields, short_repr
from flwr_isoloco.strategies.core.divergence import (
    DEFAULT_COLLAPSE_FACTOR,
    DEFAULT_DIVERGENCE_FACTOR,
    DivergenceGuard,
)
from flwr_isoloco.strategies.core.guard import EmptyRoundGuard
from flwr_isoloco.strategies.core.replies import PAYLOADS
from flwr_isoloco.strategies.core.stream import check_quorum
from flwr_isoloco.strategies.diloco.dp_settings import (
    AdaptiveClipping,
    CentralDP,
    DPSettings,
    LocalDP,
    finite_number,
    off_or_positive,
)
from flwr_isoloco.strategies.diloco.settings_groups import MergeSettings, Records

__all__ = [
    "AdaptiveClipping",
    "CentralDP",
    "Codec",
    "DistanceFilter",
    "DPSettings",
    "Divergence",
    "Krum",
    "LocalDP",
    "Median",
    "MergeSettings",
    "MultiKrum",
    "NormClip",
    "Records",
    "ReplyChecks",
    "Robust",
    "Rounds",
    "TrimmedMean",
    "as_codec",
    "as_robust",
]

WEIGHTINGS = ("examples", "uniform")
DTYPE_POLICIES = ("cast", "reject")
DEFAULT_MAX_WEIGHT_RATIO = 5.0
"""No reply's weight counts for more than 5 x the round's median weight (docs/strategies.md)."""


def _renamed(where: str, exc: ValueError) -> ValueError:
    return ValueError(f"{where}: {exc}")


# ----------------------------------------------------------------------------- replies, rounds
@renamed_fields(client_sends="payload")
@short_repr
@dataclass(frozen=True)
class ReplyChecks:
    """What a train reply must be, and how much it may weigh.

    ``weighting``: ``w_i = num-examples_i`` (``"examples"``) or ``1`` (``"uniform"``).
    ``payload``: what a reply holds unless its ConfigRecord ``payload`` says otherwise,
    ``"weights"`` (the trained model, as FedAvg) or ``"delta"`` (``theta - theta_i``). ``max_update_norm`` / ``max_norm_ratio``: drop a
    reply whose ``||delta_i||_2`` is above this (absolute; x the median of the others; None or
    0: off). ``max_weight_ratio``: each weight clipped to ``r x`` the round's median weight, so
    no one site owns the merge (None or 0: off; ``"auto"``: 5, off under ``"uniform"``, where a
    number is refused: every weight is 1). ``dtype_policy``: a reply array of another floating
    dtype is cast (``"cast"``) or the reply dropped (``"reject"``).
    """

    weighting: str = "examples"
    payload: str = "weights"
    max_update_norm: float | None = None
    max_norm_ratio: float | None = None
    max_weight_ratio: float | str | None = "auto"
    dtype_policy: str = "cast"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("weighting", WEIGHTINGS),
            ("payload", PAYLOADS),
            ("dtype_policy", DTYPE_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"ReplyChecks.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        off_or_positive("ReplyChecks.max_update_norm", self.max_update_norm)
        off_or_positive("ReplyChecks.max_norm_ratio", self.max_norm_ratio)
        r = self.max_weight_ratio
        if r is not None and r != "auto" and not (finite_number(r) and (r == 0 or r >= 1)):
            raise ValueError(
                f"ReplyChecks.max_weight_ratio must be >= 1, 0/None for off or 'auto', got {r!r}"
            )
        if self.weighting == "uniform" and r not in ("auto", None, 0):
            raise ValueError(
                f"ReplyChecks.max_weight_ratio={r!r} clips weights, but weighting='uniform' "
                "gives every reply weight 1, so it would clip nothing: leave max_weight_ratio "
                "out (or 0) with uniform weights, or use weighting='examples'"
            )

    @property
    def weight_ratio(self) -> float:
        """The bound ``r`` in force, ``"auto"`` resolved (0.0: off, always under uniform)."""
        r = self.max_weight_ratio
        if self.weighting == "uniform" or not r:
            return 0.0
        return DEFAULT_MAX_WEIGHT_RATIO if r == "auto" else float(r)


@renamed_fields(buffer="replies_per_step")
@short_repr
@dataclass(frozen=True)
class Rounds:
    """When a round closes and when a run stops; synchronous or asynchronous rounds.

    ``quorum``: the round closes once this many of the sampled nodes replied: a float in (0, 1]
    (a fraction, rounded up; 1.0: all) or an int >= 2 (a count); None: all. ``grace_s``: then
    wait at most this many seconds more for the rest (needs a quorum below all).
    ``max_empty_rounds``: stop with :class:`~flwr_isoloco.strategies.core.guard.NoProgressError`
    after this many consecutive rounds that used no reply (0: never).

    ``asynchronous=True`` (:mod:`~flwr_isoloco.strategies.diloco.asynchronous`): a node gets new
    work from the newest model as soon as its reply is in, and a round is one outer step, taken
    once ``replies_per_step`` replies (K, FedBuff's buffer size; None: the number of nodes
    training) are accepted. A reply that trained from a model ``tau`` outer steps old weighs
    ``(1 + tau) ** -staleness`` (``s(tau)``, 0: no discount, 0.5: FedBuff's ``1/sqrt(1+tau)``);
    beyond ``max_staleness`` steps it is dropped.
    ``momentum_every``: the outer momentum moves once every N outer steps (delayed Nesterov,
    :class:`~flwr_isoloco.merging.outer.OuterSGD` ``delay``; 1: every step).
    ``hold``: a node whose reply was accepted waits for the step's new model when that step is
    predicted to close within ``hold`` x its task time (its last task's, at most the
    nodes' median); else, or once that time ran out, it gets the current model: sites of equal
    speed then take the synchronous steps; 0: never wait.
    ``quorum`` and ``grace_s`` are for synchronous rounds only.
    """

    quorum: float | int | None = None
    grace_s: float = 0.0
    max_empty_rounds: int = 3
    asynchronous: bool = False
    replies_per_step: int | None = None
    max_staleness: int = 16
    staleness: float = 0.5
    momentum_every: int = 1
    hold: float = 0.25

    def __post_init__(self) -> None:
        check_quorum_type(self.quorum)
        try:
            check_quorum(self.quorum, self.grace_s)
            EmptyRoundGuard(self.max_empty_rounds)
        except ValueError as exc:
            raise _renamed("Rounds", exc) from None
        if not isinstance(self.asynchronous, bool):
            raise ValueError(f"Rounds.asynchronous must be a bool, got {self.asynchronous!r}")
        for name, low in (("replies_per_step", 1), ("max_staleness", 0), ("momentum_every", 1)):
            v = getattr(self, name)
            if (v is None and name == "replies_per_step") or (
                isinstance(v, int) and not isinstance(v, bool) and v >= low
            ):
                continue
            raise ValueError(f"Rounds.{name} must be an int >= {low}, got {v!r}")
        for name, what in (("staleness", "the exponent a of s(tau) = (1 + tau)^-a"),
                           ("hold", "a fraction of a node's task time")):  # fmt: skip
            if not (finite_number(v := getattr(self, name)) and v >= 0):
                raise ValueError(f"Rounds.{name} must be a finite number >= 0 ({what}), got {v!r}")
        if self.asynchronous:
            if self.quorum is not None or self.grace_s:
                raise ValueError(
                    "Rounds.quorum / grace_s close a synchronous round; asynchronous rounds "
                    "never wait for a cohort (an outer step takes the first `replies_per_step` "
                    "replies): leave them unset with asynchronous=True"
                )
            return
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in ASYNC_FIELDS and getattr(self, f.name) != f.default
        ]
        if changed:
            raise ValueError(
                f"Rounds: {', '.join(changed)} apply to asynchronous rounds only; "
                "set asynchronous=True or leave them at their defaults"
            )
        if self.grace_s and self.closing_quorum is None:
            raise ValueError(
                f"Rounds.grace_s={self.grace_s:g} is a wait for the rest once a quorum is in, "
                f"but quorum={self.quorum!r} waits for every reply: set quorum to a fraction "
                "below 1.0 or a count, or leave grace_s at 0"
            )

    @property
    def closing_quorum(self) -> float | int | None:
        """The quorum that closes a round before every reply is in (None: all, 1.0 too)."""
        return None if self.quorum is None or self.quorum == 1.0 else self.quorum


ASYNC_FIELDS = ("replies_per_step", "max_staleness", "staleness", "momentum_every", "hold")
"""The fields of :class:`Rounds` that only asynchronous rounds read."""


def check_quorum_type(quorum: object) -> None:
    """``ValueError`` with the fix for a whole float above 1 (a count is an int)."""
    if isinstance(quorum, float) and quorum > 1 and quorum.is_integer():
        raise ValueError(f"Rounds.quorum={quorum!r}: a count is an int: write {int(quorum)}")


@short_repr
@dataclass(frozen=True)
class Divergence:
    """The divergence guard (:mod:`~flwr_isoloco.strategies.core.divergence`): a round whose
    ``evaluate_fn`` loss is not finite, above ``factor x`` the previous round's (0: non-finite
    only) or above ``collapse_factor x`` the best so far (a slow collapse; 0: off) diverged;
    then ``on_divergence``: ``"warn"``, ``"skip"`` (restore the round before) or ``"stop"``.
    ``key``: the loss's metric name (None: the first of ``loss``, ``val-loss``, ... present).
    """

    on_divergence: str = "warn"
    factor: float = DEFAULT_DIVERGENCE_FACTOR
    collapse_factor: float = DEFAULT_COLLAPSE_FACTOR
    key: str | None = None

    def __post_init__(self) -> None:
        try:
            DivergenceGuard(self.on_divergence, self.factor, self.key, self.collapse_factor)
        except ValueError as exc:
            raise _renamed("Divergence", exc) from None


# ----------------------------------------------------------------------------- compression
@dataclass(frozen=True, init=False)
class Codec:
    """A delta codec and its options (:mod:`flwr_isoloco.compression`), e.g.
    ``Codec("int8", block_size=64)``, ``Codec("topk", fraction=0.01, values="int8")``.
    ``name``: the codec (``int8``, ``fp8``, ``int4``, ``topk``, ``sparseloco``; ``exact`` for
    downloads). ``options``: the codec's own options as keywords; those not given take the
    codec's defaults. ``error_feedback``: the worker keeps what the
    codec dropped and adds it to its next delta. One class for any direction a codec applies to.
    ``nodes_hold_initial`` (downloads only): every node builds the initial model itself (same
    seed or checkpoint; ``clients.make_download_mod(initial=...)``), so round 1 sends no arrays.
    ``Codec("exact")`` (downloads only): the nodes take the server's step from the round's
    sparse uploads, exactly (``compression/step.py``).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    nodes_hold_initial: bool = False

    def __init__(
        self,
        name: str,
        *,
        error_feedback: bool = True,
        nodes_hold_initial: bool = False,
        **options: Any,
    ) -> None:
        try:  # unknown codec or option, bad value ("exact": a download mode, no options)
            normalize_options(name, options) if name != EXACT or options else None
        except ValueError as exc:
            raise _renamed("Codec", exc) from None
        for arg, v in (
            ("error_feedback", error_feedback),
            ("nodes_hold_initial", nodes_hold_initial),
        ):
            if not isinstance(v, bool):
                raise ValueError(f"Codec.{arg} must be a bool, got {v!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "options", MappingProxyType(dict(options)))
        object.__setattr__(self, "error_feedback", error_feedback)
        object.__setattr__(self, "nodes_hold_initial", nodes_hold_initial)

    def __hash__(self) -> int:
        opts = tuple(sorted(self.options.items()))
        return hash((self.name, opts, self.error_feedback, self.nodes_hold_initial))

    def __repr__(self) -> str:
        args = [repr(self.name), *(f"{k}={v!r}" for k, v in self.options.items())]
        if not self.error_feedback:
            args.append("error_feedback=False")
        if self.nodes_hold_initial:
            args.append("nodes_hold_initial=True")
        return f"Codec({', '.join(args)})"


def as_codec(codec: Codec | str | None) -> Codec | None:
    """``None`` / ``"none"``: no codec; a name: that codec with its defaults."""
    if codec is None or codec == "none":
        return None
    return codec if isinstance(codec, Codec) else Codec(codec)


# ----------------------------------------------------------------------------- robust rules
@dataclass(frozen=True)
class Robust:
    """A robust aggregation of the pseudo-gradients in place of the mean
    (:mod:`flwr_isoloco.merging.robust`); a subclass per rule, its fields the rule's options
    (None: the rule's default for the round's ``M``)."""

    name: ClassVar[str] = "none"

    def __post_init__(self) -> None:
        try:  # the option checks; the rule's own check (a mean-based rule) is the strategy's
            resolve_robust(self.name, self.options(), MERGE_RULES["mean"])
        except ValueError as exc:
            raise _renamed(type(self).__name__, exc) from None

    def options(self) -> dict[str, Any]:
        """The options given (fields not None)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class Median(Robust):
    """Coordinate-wise median."""

    name: ClassVar[str] = "median"


@dataclass(frozen=True)
class TrimmedMean(Robust):
    """Coordinate-wise mean without the ``trim`` fraction at each end (``[0, 0.5)``)."""

    name: ClassVar[str] = "trimmed-mean"
    trim: float = 0.25


@dataclass(frozen=True)
class Krum(Robust):
    """The one update closest to its ``M - f - 2`` nearest others (``f``: tolerated attackers,
    None: ``(M - 3) // 2``)."""

    name: ClassVar[str] = "krum"
    f: int | None = None


@dataclass(frozen=True)
class MultiKrum(Robust):
    """The mean of the ``select`` best Krum scores (None: ``M - f``)."""

    name: ClassVar[str] = "multikrum"
    f: int | None = None
    select: int | None = None


@dataclass(frozen=True)
class NormClip(Robust):
    """Each update clipped to the round's median norm."""

    name: ClassVar[str] = "norm-clip"


@dataclass(frozen=True)
class DistanceFilter(Robust):
    """Leave out the updates farther from the coordinate-wise median than ``factor x`` the
    median such distance (a finite number ``>= 1``)."""

    name: ClassVar[str] = "distance-filter"
    factor: float = 2.0


ROBUST_CLASSES: dict[str, type[Robust]] = {
    c.name: c for c in (Median, TrimmedMean, Krum, MultiKrum, NormClip, DistanceFilter)
}
assert set(ROBUST_CLASSES) | {"none"} == set(ROBUST_RULES)


def as_robust(
    robust: Robust | str | None, options: Mapping[str, Any] | None = None
) -> Robust | None:
    """``None`` / ``"none"``: no robust rule; a rule name (with ``options``): its class."""
    if robust is None or robust == "none":
        return None
    if isinstance(robust, Robust):
        return robust
    if robust not in ROBUST_CLASSES:
        raise ValueError(f"robust must be one of {ROBUST_RULES} or a Robust, got {robust!r}")
    return ROBUST_CLASSES[robust](**dict(options or {}))
