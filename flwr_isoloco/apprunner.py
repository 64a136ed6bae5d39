"""One ServerApp runner for every flwr-isoloco app: config, resume, rounds, results, export.

An app is an :class:`AppSpec` (its name, run-config schema and a ``build`` function) whose
``build`` returns an :class:`AppRun`: the strategy, the initial arrays, a server-side
evaluator, the app's columns of a results row, and optional plot and export functions.
:func:`run_app` does the rest, the same way for every app:

1. validate the run config once (the app's schema; a bad key logs and raises
   ``RunConfigError``), create the output folder;
2. with ``resume-from``: verify the checkpoint (kind, fields of :data:`CHECKPOINT_SPEC`,
   digests, an unchanged config, history rounds ``1..round``) before anything runs;
3. wait for the nodes, build the app, restore the strategy, the app state and the RNGs;
4. ``strategy.start`` over the global rounds ``done + 1 .. num-server-rounds`` (at most
   ``rounds-this-run`` of them), with the evaluator as ``evaluate_fn`` and the round-end hook
   writing the results row, ``results.json``, the plots and the checkpoint;
5. a run that trains nothing (:class:`~flwr_isoloco.strategies.core.guard.NoProgressError`), or
   that raises anything else once the output folder exists (a strategy refusing its
   arguments, a crash mid-run), ends ``status: failed`` with its ``error`` and the exception
   is raised again, so Flower marks the run ``finished:failed``; otherwise ``completed`` (``partial`` when ``rounds-this-run`` stopped
   it early), the export is written and one closing line is logged.

Client state (optimiser moments, data cursors) is resumed by the clients themselves from the
node-state files whose folder the runner names in the train config
(:mod:`flwr_isoloco.clients.node_state`). The results schema is in the user guide,
the repository's ``docs/user-guide.md`` ("flwr-isoloco user guide").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from omegaconf import OmegaConf

from flwr_isoloco.checkpoint import (
    RNG_FIELD,
    CheckpointError,
    Field,
    check_fields,
    checkpoint_error,
    load_checkpoint,
    restoring,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json_atomic,
)
from flwr_isoloco.clients.node_state import RESUME_DIR_KEY, RESUME_ROUND_KEY, STATE_DIR_KEY
from flwr_isoloco.runconfig import RunConfigError, check_resumable, prepare_output_dir
from flwr_isoloco.strategies.core.guard import NoProgressError
from flwr_isoloco.strategies.core.nodes import wait_for_nodes
from flwr_isoloco.strategies.diloco.dp_journal import attach_dp_journal

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_SPEC",
    "AppRun",
    "AppSpec",
    "node_state_config",
    "output_dir",
    "run_app",
]

CHECKPOINT = "checkpoint.safetensors"
NODE_STATE_DIR = "node-state"
# Keys that may differ between a run and the run that resumes it (apps add their own): where
# and how long it runs, not what it computes (the merge device moves the same arithmetic).
RESUMABLE_DIFFERENCES = frozenset(
    {
        "output-dir",
        "resume-from",
        "round-timeout",
        "torch-threads",
        "checkpoint",
        "rounds-this-run",
        "strategy.merge-device",
    }
)
# What ``resume-from`` must hold (checked before anything is restored; see load_checkpoint).
CHECKPOINT_SPEC = {
    "round": Field("int", min=0),
    "config": Field("dict"),
    "strategy": Field("dict"),
    "history": Field("list", items=Field("dict", fields={"round": Field("int", min=1)})),
    "initial": Field("dict", nullable=True),
    "app-state": Field("dict"),
    "rng": RNG_FIELD,
}


@dataclass
class AppRun:
    """What an app's ``build`` returns for one run.

    Attributes
    ----------
    strategy
        A :class:`~flwr_isoloco.strategies.core.lifecycle.ResumableStrategy` with ``state_dict``,
        ``load_state_dict(sd, **restore_kwargs)`` and ``completed_rounds``.
    initial_arrays
        The model (or adapter) before training; None once handed to the strategy
        (:meth:`take_initial_arrays`).
    evaluate
        ``evaluate(server_round, arrays) -> metrics | None``: the server-side evaluation
        (None: not this round).
    row
        ``row(server_round, train_metrics, evaluate_metrics) -> dict``: the app's columns of
        the round's results row.
    summary
        ``summary(row) -> str``: the round's one log line (after ``round k/N``).
    info
        Extra fields of the ``results.json`` envelope (model size, data sizes, ...).
    plot
        ``plot(results, out)``: redraw the app's plots (failures are logged, never fatal).
    export
        ``export(arrays, out) -> path``: write the trained model for users; returns the folder.
    app_state, load_app_state, app_state_spec
        App-side state kept in the checkpoint (JSON; e.g. per-vertex counts for plots) and
        the :class:`~flwr_isoloco.checkpoint.Field` spec it is checked against on resume.
    """

    strategy: Any
    initial_arrays: ArrayRecord | None
    evaluate: Callable[[int, ArrayRecord], Mapping[str, Any] | None]
    row: Callable[[int, dict[str, Any], dict[str, Any]], dict[str, Any]]
    summary: Callable[[dict[str, Any]], str]
    train_config: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    restore_kwargs: dict[str, Any] = field(default_factory=dict)
    plot: Callable[[dict[str, Any], Path], None] | None = None
    export: Callable[[ArrayRecord, Path], Path | None] | None = None
    app_state: Callable[[], dict[str, Any]] = dict
    load_app_state: Callable[[dict[str, Any]], None] = lambda state: None
    app_state_spec: Mapping[str, Field] = field(default_factory=dict)

    def take_initial_arrays(self) -> ArrayRecord:
        """``initial_arrays``, handed over once: the strategy builds its own state from it, so
        the run does not keep this copy of the model (or adapter) until it ends."""
        if self.initial_arrays is None:
            raise RuntimeError("initial_arrays were already handed to the strategy")
        arrays, self.initial_arrays = self.initial_arrays, None
        return arrays


@dataclass
class AppSpec:
    """An app as the runner sees it.

    ``name`` is the checkpoint kind and the results' ``app``; ``label`` prefixes the log
    lines; ``load_config(run_config)`` validates (raises ``RunConfigError``) and returns the
    config (an OmegaConf DictConfig) with ``num-server-rounds``, ``resume-from``,
    ``checkpoint``, ``round-timeout``, ``torch-threads`` and ``output-dir``; ``nodes(cfg) -> (min_nodes, exact, timeout_s)`` says how
    long to wait for the nodes (``exact``: that many are expected, no settling);
    ``build(cfg, node_ids)`` returns the :class:`AppRun`; ``build_needs_nodes``: the app's
    strategy depends on the connected nodes (e.g. one graph vertex per node), so the runner
    waits for them even when a resumed checkpoint leaves no round to run.
    """

    name: str
    label: str
    load_config: Callable[[Mapping[str, Any]], Any]
    nodes: Callable[[Any], tuple[int, bool, float]]
    build: Callable[[Any, list[int]], AppRun]
    resumable_differences: frozenset[str] = frozenset()
    build_needs_nodes: bool = False


def output_dir(cfg, app: str, run_id: int) -> Path:
    """``output-dir``, or ``~/flwr_isoloco_runs/<app>/<UTC time>-run<run id>`` when empty."""
    if cfg["output-dir"]:
        return Path(os.path.expanduser(cfg["output-dir"]))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path.home() / "flwr_isoloco_runs" / app / f"{stamp}-run{run_id}"


def node_state_config(out: Path, resume: Path | None, done: int) -> dict[str, Any]:
    """Train-config keys for the clients' state files: save under ``<out>/node-state``; after
    a resume, read ``<checkpoint folder>/node-state`` up to round ``done``."""
    conf: dict[str, Any] = {STATE_DIR_KEY: str(out / NODE_STATE_DIR)}
    if resume is not None:
        conf.update({RESUME_DIR_KEY: str(resume.parent / NODE_STATE_DIR), RESUME_ROUND_KEY: done})
    return conf


def read_checkpoint(spec: AppSpec, path: Path, conf: dict[str, Any]) -> tuple[dict, dict]:
    """Verify ``path``: kind, :data:`CHECKPOINT_SPEC`, digests, unchanged config, history
    rounds ``1..round``. Raises CheckpointError naming the file and field, or RunConfigError."""
    tensors, meta = load_checkpoint(path, kind=spec.name, spec=CHECKPOINT_SPEC)
    differences = RESUMABLE_DIFFERENCES | spec.resumable_differences
    check_resumable(meta["config"], conf, differences, source=str(path))
    done = meta["round"]
    if [r["round"] for r in meta["history"]] != list(range(1, done + 1)):
        raise checkpoint_error(
            path, f"field 'history' does not hold rounds 1..{done} (field 'round' = {done})"
        )
    return tensors, meta


def restore(run: AppRun, path: Path, tensors: dict, meta: dict) -> None:
    """Load the strategy, the app state and the RNGs from a verified checkpoint."""
    done = meta["round"]
    with restoring(path, "strategy state: "):
        run.strategy.load_state_dict(
            {"tensors": tensors.get("strategy", {}), "meta": meta["strategy"]},
            **run.restore_kwargs,
        )
        if run.strategy.completed_rounds != done:
            raise CheckpointError(
                f"the strategy holds {run.strategy.completed_rounds} rounds, field 'round' = {done}"
            )
    with restoring(path):
        check_fields(meta["app-state"], run.app_state_spec, prefix="app-state.")
        run.load_app_state(meta["app-state"])
    with restoring(path):
        set_rng_state(meta["rng"])


class Recorder:
    """The server-side evaluation and the round-end hook of one run: rows, ``results.json``,
    plots and the checkpoint."""

    def __init__(self, spec: AppSpec, cfg, run: AppRun, out: Path, results: dict) -> None:
        self.spec, self.cfg, self.run, self.out, self.results = spec, cfg, run, out, results
        self.path = out / "results.json"
        self.total = cfg["num-server-rounds"]
        now = time.perf_counter()
        self.clock = {"start": now, "last": now, "eval": None}

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        t0 = time.perf_counter()
        metrics = self.run.evaluate(server_round, arrays)
        self.clock["eval"] = None if metrics is None else time.perf_counter() - t0
        if metrics is None:
            return None
        if server_round == 0:
            row = {"round": 0, **metrics, "eval-time-s": self.clock["eval"]}
            self.results["initial"] = row
            log(INFO, "%s: round 0/%d %s", self.spec.label, self.total, self.run.summary(row))
            write_json_atomic(self.path, self.results)
            self.clock["last"] = time.perf_counter()
        return MetricRecord(dict(metrics))

    def on_round_end(self, server_round: int, arrays, train_metrics, eval_metrics) -> None:
        tm = dict(train_metrics) if train_metrics is not None else {}
        em = dict(eval_metrics) if eval_metrics is not None else {}
        now = time.perf_counter()
        row = {"round": server_round, **self.run.row(server_round, tm, em)}
        if self.clock["eval"] is not None:
            row["eval-time-s"] = self.clock["eval"]
        row["round-wall-s"] = now - self.clock["last"]  # since the previous round ended
        row["elapsed-s"] = now - self.clock["start"]
        self.clock.update(last=now, eval=None)
        self.results["rounds"].append(row)
        log(
            INFO,
            "%s: round %d/%d %s",
            self.spec.label,
            server_round,
            self.total,
            self.run.summary(row),
        )
        if row.get("replies-used") == 0:
            log(
                WARNING,
                "%s: round %d had no usable reply; model kept",
                self.spec.label,
                server_round,
            )
        write_json_atomic(self.path, self.results)
        self.plot()
        if self.cfg["checkpoint"]:
            self.checkpoint(server_round)

    def checkpoint(self, server_round: int) -> None:
        sd = self.run.strategy.state_dict()
        meta = {
            "app": self.spec.name,
            "round": server_round,
            "config": self.results["config"],
            "strategy": sd["meta"],
            "history": self.results["rounds"],
            "initial": self.results["initial"],
            "app-state": self.run.app_state(),
            "rng": rng_state(),
        }
        save_checkpoint(self.out / CHECKPOINT, {"strategy": sd["tensors"]}, meta)

    def plot(self) -> None:
        if self.run.plot is None:
            return
        try:
            self.run.plot(self.results, self.out)
        except Exception as exc:  # plots must never stop a run
            log(WARNING, "%s: plotting failed: %s", self.spec.label, exc)

    def write(self, status: str, **extra: Any) -> None:
        self.results.update(status=status, **extra)
        self.results["wall-time-s"] = time.perf_counter() - self.clock["start"]
        write_json_atomic(self.path, self.results)


def _fail(spec: AppSpec, what: str, exc: Exception) -> None:
    log(ERROR, "%s: %s: %s", spec.label, what, exc)


def _setup(spec: AppSpec, run_config: Mapping[str, Any], run_id: int):
    """Validated config, output folder, config dict and the verified checkpoint (or None)."""
    try:
        cfg = spec.load_config(run_config)
    except RunConfigError as exc:
        _fail(spec, "bad run config", exc)
        raise
    if cfg["torch-threads"]:
        import torch

        torch.set_num_threads(cfg["torch-threads"])
    out = prepare_output_dir(output_dir(cfg, spec.name, run_id))
    log(INFO, "%s: results will be written to %s", spec.label, out)
    conf = OmegaConf.to_container(cfg, resolve=True)  # what a resumed run must match
    resume = Path(cfg["resume-from"]) if cfg["resume-from"] else None
    tensors, meta = {}, None
    if resume is not None:
        try:
            tensors, meta = read_checkpoint(spec, resume, conf)
        except (CheckpointError, RunConfigError) as exc:
            _fail(spec, "cannot resume", exc)
            raise
    return cfg, out, conf, resume, (tensors, meta)


def _nodes(spec: AppSpec, cfg, grid: Grid, settle_s: float, run_anything: bool) -> list[int]:
    """The connected nodes; simulated nodes register after the ServerApp starts, so unless
    nothing is to run (and the app's build does not depend on them), wait until enough are
    there (and, unless exact, their count settles)."""
    if not run_anything and not spec.build_needs_nodes:
        return sorted(grid.get_node_ids())
    wanted, exact, timeout_s = spec.nodes(cfg)
    return wait_for_nodes(
        grid,
        max(wanted, 1),
        settle_s=0.0 if exact else settle_s,
        timeout_s=timeout_s,
        what=spec.label,
    )


def run_app(
    spec: AppSpec,
    grid: Grid,
    run_config: Mapping[str, Any],
    run_id: int = 0,
    *,
    settle_s: float = 2.0,
) -> Path:
    """The whole server side of ``spec`` (module docstring); returns the output folder.

    Any exception after the output folder exists (a strategy refusing its arguments, a node
    that never came, a run that trained nothing) is logged as one ERROR line, recorded as
    ``status: failed`` with its ``error`` in ``results.json`` (rounds done so far kept) and
    raised again, so Flower ends the run ``finished:failed`` (``flwr ls``)."""
    cfg, out, conf, resume, (tensors, meta) = _setup(spec, run_config, run_id)
    holder: dict[str, Recorder] = {}
    try:
        _run(spec, grid, cfg, out, conf, resume, (tensors, meta), settle_s, holder)
    except Exception as exc:
        _record_failure(spec, out, conf, holder.get("rec"), exc)
        raise
    return out


def _record_failure(spec: AppSpec, out: Path, conf: dict, rec: Recorder | None, exc: Exception):
    """``results.json`` says ``failed`` with the error; one ERROR line unless already said."""
    if not isinstance(exc, (NoProgressError, CheckpointError, RunConfigError)):
        _fail(spec, "failed", exc)  # those three were logged where they were raised
    error = f"{type(exc).__name__}: {exc}"
    if rec is None:
        results = {"app": spec.name, "output-dir": str(out), "config": conf, "rounds": []}
        write_json_atomic(out / "results.json", {**results, "status": "failed", "error": error})
    elif rec.results.get("status") != "failed":
        rec.write("failed", error=error)


def _run(spec, grid, cfg, out, conf, resume, checkpoint, settle_s, holder) -> None:
    """:func:`run_app` once the config is valid and the output folder exists."""
    tensors, meta = checkpoint
    done = meta["round"] if meta is not None else 0
    stop_at = cfg["num-server-rounds"]
    if cfg.get("rounds-this-run"):
        stop_at = min(stop_at, done + cfg["rounds-this-run"])
    run = spec.build(cfg, _nodes(spec, cfg, grid, settle_s, stop_at > done))
    attach_dp_journal(run.strategy, out, resume)  # DP releases, before restore charges them
    if meta is not None:
        try:
            restore(run, resume, tensors, meta)
        except CheckpointError as exc:
            _fail(spec, "cannot resume", exc)
            raise
        log(INFO, "%s: resumed from %s at round %d", spec.label, resume, done)
    results = {
        "app": spec.name,
        "status": "running",
        "output-dir": str(out),
        "config": conf,
        **run.info,
        "resumed-from": str(resume) if resume else None,
        "initial": None if meta is None else meta["initial"],
        "rounds": [] if meta is None else list(meta["history"]),
    }
    rec = holder["rec"] = Recorder(spec, cfg, run, out, results)
    train_config = dict(run.train_config)
    if cfg["checkpoint"]:
        train_config.update(node_state_config(out, resume, done))
    result = None
    if stop_at <= done:
        log(INFO, "%s: checkpoint already holds round %d; nothing to run", spec.label, done)
    else:
        try:
            result = run.strategy.start(
                grid=grid,
                initial_arrays=run.take_initial_arrays(),  # not held by the runner
                num_rounds=stop_at,  # global: the strategy runs rounds done + 1 .. stop_at
                timeout=cfg["round-timeout"],
                train_config=ConfigRecord(train_config),
                evaluate_fn=rec.evaluate_fn,
                on_round_end=rec.on_round_end,
            )
        except NoProgressError as exc:  # the run trained nothing: say so, never "completed"
            _fail(spec, "stopped", exc)
            rec.plot()
            rec.write("failed", error=str(exc))
            raise
    _finish(spec, rec, result, done)


def _finish(spec: AppSpec, rec: Recorder, result, done: int) -> None:
    """Status, plots, the export and the closing line (``done``: rounds restored)."""
    rounds, total = rec.results["rounds"], rec.total
    arrays = result.arrays if result is not None and len(result.arrays) else None
    if arrays is None:
        arrays = rec.run.strategy.current_arrays()
    exported = None
    if rec.run.export is not None and arrays is not None and len(arrays):
        exported = rec.run.export(arrays, rec.out)
    rec.plot()
    rec.write("completed" if len(rounds) == total else "partial")
    last = rounds[-1] if rounds else rec.results["initial"]
    log(
        INFO,
        "%s: done, %d rounds in this run, %d of %d in total; %s. Results: %s%s",
        spec.label,
        len(rounds) - done,
        len(rounds),
        total,
        "no round evaluated" if last is None else rec.run.summary(last),
        rec.path,
        "" if exported is None else f", export: {exported}",
    )
