"""The divergence guard: a round that makes the server's evaluation loss blow up is not silent.

After each round the lifecycle (:mod:`~flwr_isoloco.strategies.core.lifecycle`) hands the
``evaluate_fn`` result to :meth:`DivergenceGuard.check`. The loss is the value under ``key``
when one is given, else the first of :data:`LOSS_KEYS` the result holds (a quickstart's
``"loss"``, the LM app's ``"val-loss"``, ...); without such a number the guard is inactive
(said once). Round ``k`` *diverged* when its loss ``L_k`` is not finite, or when it jumped

    L_k > L_ref + (factor - 1) * |L_ref|      (= factor * L_ref for a positive loss)

with ``L_ref`` the loss of the model in force before the round (round ``k - 1``'s, or the
last kept round's after a skip; round 0 is the initial evaluation), or when it drifted away
from the best loss so far (a slow collapse, no single jump)

    L_k > L_best + (collapse_factor - 1) * |L_best|

with ``L_best`` the lowest loss of a kept model (round 0 included). ``factor = 0`` checks only
for non-finite losses (both rules off); ``collapse_factor = 0`` turns the second rule off.
The default ``collapse_factor`` 1.5 (:data:`DEFAULT_COLLAPSE_FACTOR`) catches the slow collapse seen
with the drop-in under strong label skew (test loss 0.39 -> 1.07 in steps below x1.5 each: flagged
at the first loss above 0.585) and the diverging runs in the repository's ``benchmarks/results``
(e.g. ``weight_bound.json`` attack-off DiLoCo, 7.50 -> 14.68 at <= x1.14 a round), and leaves every
healthy curve there alone: the largest ``L_k / L_best`` of a healthy run in those records is 1.15
(gossip on a ring, ``rwlora_summary.json``; 1.07 for the 54 LM runs of ``compression_loss.json``).
``on_divergence`` says what happens then:

- ``"warn"`` (default): a WARNING naming the round, both losses and the factor; the round's
  update is kept and its loss becomes the reference;
- ``"skip"``: the same WARNING, then the model and the outer optimiser state from before the
  round are restored (a snapshot taken before the round, O(model) memory; the round still
  counts) and the run goes on;
- ``"stop"``: the WARNING, then :class:`DivergenceError` once the round-end hook ran (so a
  checkpoint holds the round that stopped the run).

The round's server-side metrics carry ``diverged`` = 0 / 1 whenever the guard is active.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log

from flwr_isoloco.strategies.core.guard import NoProgressError

__all__ = [
    "DEFAULT_COLLAPSE_FACTOR",
    "DEFAULT_DIVERGENCE_FACTOR",
    "DIVERGENCE_MODES",
    "LOSS_KEYS",
    "DivergenceError",
    "DivergenceGuard",
]

DIVERGENCE_MODES = ("warn", "skip", "stop")
DEFAULT_DIVERGENCE_FACTOR = 1.5
"""A round whose evaluation loss is more than 1.5 x the previous one's diverged."""
DEFAULT_COLLAPSE_FACTOR = 1.5
"""A round whose evaluation loss is more than 1.5 x the best one so far diverged (module
docstring: why 1.5)."""
LOSS_KEYS = ("loss", "val-loss", "val_loss", "eval-loss", "eval_loss", "test-loss", "test_loss")
"""Keys tried in this order when no ``divergence_key`` is given."""


class DivergenceError(NoProgressError):
    """A run stopped because a round's evaluation loss diverged (``on_divergence="stop"``).

    A :class:`~flwr_isoloco.strategies.core.guard.NoProgressError`, so an app that ends a run
    which stopped making progress as failed (the shared app runner) does so here too.
    """


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class DivergenceGuard:
    """Checks each round's evaluation loss against the previous and the best one (module
    docstring)."""

    def __init__(
        self,
        on_divergence: str = "warn",
        factor: float = DEFAULT_DIVERGENCE_FACTOR,
        key: str | None = None,
        collapse_factor: float = DEFAULT_COLLAPSE_FACTOR,
    ) -> None:
        if on_divergence not in DIVERGENCE_MODES:
            raise ValueError(
                f"on_divergence must be one of {DIVERGENCE_MODES}, got {on_divergence!r}"
            )
        if not (_number(factor) and math.isfinite(factor) and (factor == 0 or factor >= 1)):
            raise ValueError(f"divergence_factor must be >= 1, or 0 for off, got {factor!r}")
        cf = collapse_factor
        if not (_number(cf) and math.isfinite(cf) and (cf == 0 or cf >= 1)):
            raise ValueError(f"collapse_factor must be >= 1, or 0 for off, got {cf!r}")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"divergence_key must be a metric name or None, got {key!r}")
        self.mode = on_divergence
        self.factor = float(factor)
        self.key = key
        self.collapse_factor = float(cf)
        self.reference: float | None = None  # loss of the model in force
        self.best: float | None = None  # lowest loss of a kept model
        self._said_inactive = False

    def loss(self, metrics: Mapping[str, Any] | None) -> tuple[str, float] | None:
        """``(key, value)`` of the loss in ``metrics``, or None (then the guard is inactive)."""
        if metrics is None:
            return None
        for k in (self.key,) if self.key is not None else LOSS_KEYS:
            v = metrics.get(k)
            if _number(v):
                return k, float(v)
        if not self._said_inactive:
            self._said_inactive = True
            wanted = repr(self.key) if self.key else "any of " + ", ".join(LOSS_KEYS)
            log(
                INFO,
                "divergence guard: the evaluation result has no %s; guard inactive "
                "(set divergence_key)",
                wanted,
            )
        return None

    def observe(self, metrics: Mapping[str, Any] | None) -> None:
        """Take ``metrics``' loss as the reference (the initial evaluation)."""
        found = self.loss(metrics)
        if found is not None:
            self._keep(found[1])

    def _keep(self, loss: float) -> None:
        """``loss`` is the kept model's: the new ``reference``, and ``best`` if lower."""
        self.reference = loss
        if math.isfinite(loss) and (self.best is None or loss < self.best):
            self.best = loss

    @staticmethod
    def _above(new: float, ref: float | None, factor: float) -> bool:
        """``new > ref + (factor - 1) |ref|`` (False without a finite ``ref`` or at factor 0)."""
        if ref is None or not math.isfinite(ref) or factor == 0:
            return False
        return new > ref + (factor - 1.0) * abs(ref)

    def why(self, new: float) -> str | None:
        """Why ``new`` diverged (non-finite, a jump, a slow collapse), or None."""
        if not math.isfinite(new):
            return "not finite"
        if self.factor == 0:
            return None
        if self._above(new, self.reference, self.factor):
            return "rose by more than the factor"
        if self._above(new, self.best, self.collapse_factor):
            return (
                f"above {self.collapse_factor:g} x the best loss so far {self.best:.6g}: "
                "a slow collapse"
            )
        return None

    def diverged(self, new: float) -> bool:
        """Whether ``new`` is non-finite, above ``reference`` by more than the factor, or
        above ``best`` by more than the collapse factor."""
        return self.why(new) is not None

    def check(self, server_round: int, metrics: Mapping[str, Any] | None) -> bool | None:
        """Whether round ``server_round`` diverged (logged); None when inactive.

        A kept round's loss becomes the reference; a skipped one leaves it unchanged.
        """
        found = self.loss(metrics)
        if found is None:
            return None
        key, new = found
        why = self.why(new)
        bad = why is not None
        if bad:
            action = {
                "warn": "update kept (on-divergence 'warn')",
                "skip": "update discarded, model and optimiser restored (on-divergence 'skip')",
                "stop": "stopping after this round (on-divergence 'stop')",
            }[self.mode]
            log(
                WARNING,
                "divergence guard: round %d: %s %s -> %s (%s, factor %g): %s",
                server_round,
                key,
                "n/a" if self.reference is None else f"{self.reference:.6g}",
                f"{new:.6g}",
                why,
                self.factor,
                action,
            )
        if not (bad and self.mode == "skip"):
            self._keep(new)
        return bad

    def error(self, server_round: int) -> DivergenceError:
        """The error ``"stop"`` raises after round ``server_round``."""
        return DivergenceError(
            f"round {server_round}: the evaluation loss diverged (on-divergence 'stop', "
            f"factor {self.factor:g}); the round's model is kept in the results; lower the "
            "outer lr/momentum or use on-divergence 'skip'"
        )

    # ----------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, float]:
        """``{"reference": L, "best": L_best}``, each when finite (JSON-able)."""
        out = {"reference": self.reference, "best": self.best}
        return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state`; a missing or non-finite value is None (older checkpoints
        hold no ``best``: it restarts at the reference)."""
        ref, best = state.get("reference"), state.get("best", state.get("reference"))
        self.reference = float(ref) if _number(ref) and math.isfinite(ref) else None
        self.best = float(best) if _number(best) and math.isfinite(best) else None
