"""The empty-round guard: a run that trains nothing stops with an error, never "completed"."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["EmptyRoundGuard", "NoProgressError"]


class NoProgressError(RuntimeError):
    """A run stopped because too many consecutive rounds used no reply (nothing was trained)."""


class EmptyRoundGuard:
    """Stop a run that trains nothing: ``limit`` consecutive rounds that used no reply raise.

    A round "uses" a reply when at least one client's update entered the model (DiLoCo: a
    merged reply; RW-LoRA: an accepted hop; gossip: a vertex that trained). Without this a run
    whose every reply is dropped (bad seed, all nodes failing) would end and report success.
    ``limit=0`` turns the guard off.
    """

    def __init__(self, limit: int = 3, what: str = "strategy") -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"max_empty_rounds must be an int >= 0, got {limit!r}")
        self.limit = limit
        self.what = what
        self.streak = 0

    def record(self, server_round: int, used: int, reasons: Iterable[str] = ()) -> None:
        """Count round ``server_round`` (``used`` replies); raise :class:`NoProgressError`."""
        self.streak = 0 if used > 0 else self.streak + 1
        if self.limit and self.streak >= self.limit:
            why = "; ".join(list(reasons)[:3]) or "no reply arrived or every reply was dropped"
            raise NoProgressError(
                f"{self.what}: {self.streak} consecutive rounds (up to round {server_round}) "
                f"used no reply, so nothing was trained; stopping (max-empty-rounds="
                f"{self.limit}). Last reasons: {why}"
            )
