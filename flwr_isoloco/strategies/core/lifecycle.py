"""The one server lifecycle of every flwr-isoloco strategy (DiLoCo, IsoLoCo, RW-LoRA, gossip).

:meth:`ResumableStrategy.start` has Flower's ``Strategy.start`` signature and runs rounds
``completed_rounds + 1 .. num_rounds``: all of them for a fresh strategy, the rest for one
restored with ``load_state_dict``. Round numbers are *global* everywhere: in ``evaluate_fn``,
in the ``Result`` keys, in the ``[ROUND k/N]`` log lines and in the ``server-round`` the
clients receive. ``evaluate_fn(0, arrays)`` runs only for a fresh strategy (a resumed run was
evaluated at round 0 before its checkpoint).

Each round is :meth:`ResumableStrategy.run_round` (overridable: DiLoCo's is Flower's
train + evaluate round, RW-LoRA's re-routes a failed hop), then the server-side
``evaluate_fn``, then the round-end hook::

    on_round_end(server_round, arrays, train_metrics, evaluate_metrics)

given to :meth:`~ResumableStrategy.start` or set as ``strategy.on_round_end``. ``arrays`` is
the global model (RW-LoRA: the token; gossip: the vertex average), ``train_metrics`` the
round's aggregated train MetricRecord (or None), ``evaluate_metrics`` the client-side
evaluation merged with ``evaluate_fn``'s result (server-side keys win; None when neither ran).
Apps write results rows and checkpoints there; ``strategy.state_dict()`` then holds the round.

Between ``evaluate_fn`` and the hook the divergence guard
(:mod:`~flwr_isoloco.strategies.core.divergence`, :func:`set_divergence_guard`)
compares the round's evaluation loss with the previous one and with the best one so far (a
slow collapse): ``"warn"`` logs, ``"skip"``
restores the round snapshot (taken before :meth:`~ResumableStrategy.run_round`) and
evaluates the restored model again, ``"stop"`` raises after the hook.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import ERROR, INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from flwr_isoloco.strategies.core.divergence import (
    DEFAULT_COLLAPSE_FACTOR,
    DEFAULT_DIVERGENCE_FACTOR,
    DivergenceGuard,
)

__all__ = [
    "ResumableStrategy",
    "RoundEndFn",
    "RoundOutcome",
    "divergence_guard",
    "set_divergence_guard",
]

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
RoundEndFn = Callable[[int, ArrayRecord, MetricRecord | None, MetricRecord | None], None]
"""``fn(server_round, arrays, train_metrics, evaluate_metrics)``, called after every round."""


@dataclass
class RoundOutcome:
    """What one round produced (:meth:`ResumableStrategy.run_round`).

    ``arrays``: the new global model, or None when the round kept the old one (then, as in
    Flower, ``Result.arrays`` is not updated). ``stop``: an exception to raise once the round's evaluation and round-end hook ran (e.g.
    :class:`~flwr_isoloco.strategies.core.guard.NoProgressError`, so the last checkpoint holds the
    round that stopped the run).
    """

    arrays: ArrayRecord | None = None
    train_metrics: MetricRecord | None = None
    evaluate_metrics: MetricRecord | None = None
    stop: Exception | None = None


def set_divergence_guard(
    strategy: ResumableStrategy,
    on_divergence: str = "warn",
    divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR,
    divergence_key: str | None = None,
    collapse_factor: float = DEFAULT_COLLAPSE_FACTOR,
) -> None:
    """Set ``strategy``'s divergence guard (:mod:`~flwr_isoloco.strategies.core.divergence`).

    ``on_divergence``: ``"warn"`` | ``"skip"`` | ``"stop"``; ``divergence_factor``: a round
    whose ``evaluate_fn`` loss is above ``factor x`` the previous one's (or not finite)
    diverged (``>= 1``; 0 = only non-finite); ``divergence_key``: the loss's metric name
    (None: the first of ``LOSS_KEYS`` present); ``collapse_factor``: a round whose loss is
    above ``collapse_factor x`` the best one so far diverged too (default 1.5; 0 = off).
    ``"skip"`` needs a strategy that restores a round (DiLoCo, IsoLoCo).
    """
    guard = DivergenceGuard(
        on_divergence, divergence_factor, divergence_key, collapse_factor=collapse_factor
    )
    hook = type(strategy)._round_snapshot
    if on_divergence == "skip" and hook is ResumableStrategy._round_snapshot:
        raise ValueError(
            f"on_divergence='skip' needs {type(strategy).__name__} to restore a round "
            "(a round snapshot); use 'warn' or 'stop'"
        )
    strategy._divergence = guard


def divergence_guard(strategy: ResumableStrategy) -> DivergenceGuard:
    """``strategy``'s guard in force (default: ``"warn"``, factor 1.5, loss key found by name)."""
    if strategy._divergence is None:
        strategy._divergence = DivergenceGuard()
    return strategy._divergence


class ResumableStrategy(Strategy):
    """A Flower ``Strategy`` whose :meth:`start` resumes and numbers rounds globally.

    Subclasses provide :attr:`completed_rounds`, :meth:`current_arrays`, :meth:`prepare`
    and (unless Flower's configure/aggregate round fits) :meth:`run_round`.
    """

    _divergence: DivergenceGuard | None = None

    def _round_snapshot(self) -> Any:
        """What ``on_divergence="skip"`` restores: the model and optimiser state before a round
        (strategies that support "skip" override this and :meth:`_restore_round_snapshot`)."""
        raise NotImplementedError

    def _restore_round_snapshot(self, snapshot: Any) -> None:
        """Put back :meth:`_round_snapshot`'s state; the round still counts as run."""
        raise NotImplementedError

    # ----------------------------------------------------------------- subclass interface
    @property
    def completed_rounds(self) -> int:
        """Rounds already run (0 for a fresh strategy; the checkpoint's round once restored)."""
        raise NotImplementedError

    def current_arrays(self) -> ArrayRecord:
        """The global model as it is now."""
        raise NotImplementedError

    def prepare(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """Adopt ``initial_arrays`` (unless restored) and set up before the first round."""

    def run_round(
        self,
        grid: Grid,
        server_round: int,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        timeout: float,
    ) -> RoundOutcome:
        """One round as Flower runs it: configure/send/aggregate train, then evaluate."""
        arrays = self.current_arrays()
        replies = grid.send_and_receive(
            messages=self.configure_train(server_round, arrays, train_config, grid),
            timeout=timeout,
        )
        new_arrays, train_metrics = self.aggregate_train(server_round, replies)
        replies = grid.send_and_receive(
            messages=self.configure_evaluate(
                server_round, self.current_arrays(), evaluate_config, grid
            ),
            timeout=timeout,
        )
        evaluate_metrics = self.aggregate_evaluate(server_round, replies)
        return RoundOutcome(new_arrays, train_metrics, evaluate_metrics)

    # ----------------------------------------------------------------- the loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        on_round_end: RoundEndFn | None = None,
    ) -> Result:
        """Run rounds ``completed_rounds + 1 .. num_rounds``, ``on_round_end`` after each one."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        log(INFO, "")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        hook = on_round_end if on_round_end is not None else getattr(self, "on_round_end", None)
        result = Result()
        t0 = time.time()
        self.prepare(grid, initial_arrays, timeout)
        del initial_arrays  # the strategy holds its own state now: not a model copy per run
        done = self.completed_rounds
        if done >= num_rounds:
            log(INFO, "%s: all %d rounds already done", self.__class__.__name__, num_rounds)
            result.arrays = self.current_arrays()
        elif done:
            log(
                INFO,
                "%s: resuming at round %d of %d",
                self.__class__.__name__,
                done + 1,
                num_rounds,
            )
        if evaluate_fn is not None and done == 0:
            res = evaluate_fn(0, self.current_arrays())
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
            divergence_guard(self).observe(res)
        skip = evaluate_fn is not None and divergence_guard(self).mode == "skip"
        for server_round in range(done + 1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            snapshot = self._round_snapshot() if skip else None
            out = self.run_round(
                grid,
                server_round,
                ConfigRecord(dict(train_config)),
                ConfigRecord(dict(evaluate_config)),
                timeout,
            )
            self._finish_round(server_round, out, result, evaluate_fn, hook, snapshot)
        self._log_result(result, t0)
        return result

    def _finish_round(
        self,
        server_round: int,
        out: RoundOutcome,
        result: Result,
        evaluate_fn: EvaluateFn | None,
        hook: RoundEndFn | None,
        snapshot: Any = None,
    ) -> None:
        """Record the round in ``result``, run ``evaluate_fn``, the divergence guard and the
        hook, then raise ``out.stop`` or the guard's stop."""
        if out.arrays is not None:
            result.arrays = out.arrays
        if out.train_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", out.train_metrics)
            result.train_metrics_clientapp[server_round] = out.train_metrics
        if out.evaluate_metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", out.evaluate_metrics)
            result.evaluate_metrics_clientapp[server_round] = out.evaluate_metrics
        arrays = self.current_arrays()
        res, diverged = None, None
        if evaluate_fn is not None:
            res, diverged = self._evaluate_round(server_round, arrays, evaluate_fn, snapshot)
            if diverged and snapshot is not None:  # skipped: the restored model
                arrays = result.arrays = self.current_arrays()
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        if hook is not None:
            merged: dict[str, Any] = {**(out.evaluate_metrics or {}), **(res or {})}
            hook(server_round, arrays, out.train_metrics, MetricRecord(merged) if merged else None)
        self._after_round(server_round)
        if out.stop is not None:
            log(ERROR, "%s", out.stop)
            raise out.stop
        if diverged and divergence_guard(self).mode == "stop":
            exc = divergence_guard(self).error(server_round)
            log(ERROR, "%s", exc)
            raise exc

    def _evaluate_round(
        self, server_round: int, arrays: ArrayRecord, evaluate_fn: EvaluateFn, snapshot: Any
    ) -> tuple[MetricRecord | None, bool | None]:
        """``evaluate_fn`` on the round's model, checked by the divergence guard; a skipped
        round's model is restored from ``snapshot`` and evaluated again. Returns the metrics
        (with ``diverged`` 0/1 when the guard is active) and the verdict (None: inactive)."""
        log(INFO, "Global evaluation")
        res = evaluate_fn(server_round, arrays)
        log(INFO, "\t└──> MetricRecord: %s", res)
        guard = divergence_guard(self)
        diverged = guard.check(server_round, res)
        if diverged and snapshot is not None:
            self._restore_round_snapshot(snapshot)
            log(INFO, "Global evaluation of the restored model")
            res = evaluate_fn(server_round, self.current_arrays())
            log(INFO, "\t└──> MetricRecord: %s", res)
        if diverged is not None and res is not None:
            res = MetricRecord({**res, "diverged": int(diverged)})
        return res, diverged

    def _after_round(self, server_round: int) -> None:
        """Subclass hook after the round-end hook (the graph strategies' ``round_end_fn``)."""

    @staticmethod
    def _log_result(result: Result, t0: float) -> None:
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t0)
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
