"""SuperLink pull calls per node per second while a round waits, and how soon a reply is seen
and its node sent new work: the pulls before (one message id per call, a sweep every 0.1 s, no
hold) against now (``strategies/core/pull.py``: every id in one call within 1 GiB, a sweep every
25 ms) in one process, on a grid whose replies come in real time.

The grid (:class:`TimedGrid`) answers node ``p``'s task ``0.5 + 0.05 p`` seconds after it was
pushed (``--task-s``); it counts pull calls. Synchronous: one round of ``M`` nodes through
:class:`~flwr_isoloco.strategies.core.stream.ReplyStream`. Asynchronous: DiLoCo with
``Rounds(asynchronous=True)`` for 6 outer steps, the turnaround of each reply (due -> the
node's next task pushed; a held node's includes its hold, so "after, hold 0" gives the bare
turnaround).

    python benchmarks/async/pull_rate.py            # M = 8 and 32, records pull_rate.json
    python benchmarks/async/pull_rate.py --quick    # M = 4, one round (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the fake grid
import common  # noqa: E402
import torch  # noqa: E402
from fakegrid import FakeGrid  # noqa: E402
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402

from flwr_isoloco.strategies import DiLoCo, ReplyChecks, Rounds  # noqa: E402
from flwr_isoloco.strategies.core.stream import ReplyStream  # noqa: E402

RECORDS = common.RESULTS / "pull_rate.json"
BEFORE = {"poll_s": 0.1, "max_bytes": 1, "hold": 0.0}
"""The pulls before: a sweep every 0.1 s, one id per call (a budget below one reply), no hold."""


def _train(msg: Message, ctx) -> Message:
    sd = msg.content["arrays"].to_torch_state_dict()
    new = {k: v + 0.01 for k, v in sd.items()}
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


class TimedGrid(FakeGrid):
    """Real time: node ``p``'s reply is in ``task_s + 0.05 p`` s after its task was pushed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.time_source = None  # real time: the round drivers' own clock, threaded pulls
        self.task_s, self.due, self.pushed, self.seen = 0.5, {}, [], []

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        now = time.monotonic()
        for mid in ids:
            p = self.partition_of[self._pending[mid].metadata.dst_node_id]
            self.due[mid] = (now + self.task_s + 0.05 * p, p)
            self.pushed.append((now, p))
        return ids

    def pull_messages(self, message_ids):
        now = time.monotonic()
        ready = [m for m in message_ids if m in self.due and self.due[m][0] <= now]
        out = list(super().pull_messages(ready))
        for m in ready:
            self.seen.append((self.due.pop(m), now))
        return out


def _model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 64)}


def sync_round(m: int, before: bool) -> dict[str, Any]:
    grid = TimedGrid({"train": _train}, num_nodes=m)
    stream = ReplyStream("t")
    if before:
        stream.poll_s, stream.puller.max_bytes = BEFORE["poll_s"], BEFORE["max_bytes"]
    rec = RecordDict({"arrays": ArrayRecord(_model())})
    msgs = [grid.create_message(rec, "train", nid, "1") for nid in grid.node_ids]
    wait = stream.run(grid, msgs, lambda r: None, server_round=1, timeout=60)
    lag = [now - due for (due, _), now in grid.seen]
    return {
        "calls_per_node_s": wait.pull_calls / (wait.wait_s * m),
        "seen_median_s": statistics.median(lag),
        "seen_max_s": max(lag),
        "wait_s": wait.wait_s,
    }


def async_run(m: int, before: bool, steps: int, hold: float = 0.1) -> dict[str, Any]:
    """``hold``: the hold after (0: every node sent work at once, the pure turnaround)."""
    grid = TimedGrid({"train": _train}, num_nodes=m)
    rounds = Rounds(asynchronous=True, hold=BEFORE["hold"] if before else hold)
    s = DiLoCo(
        fraction_evaluate=0.0,
        min_train_nodes=m,
        min_available_nodes=m,
        checks=ReplyChecks(max_weight_ratio=None),
        rounds=rounds,
    )
    if before:
        s.async_rounds.poll_s = BEFORE["poll_s"]
        s.async_rounds.puller.max_bytes = BEFORE["max_bytes"]
    t0 = time.monotonic()
    res = s.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=steps)
    wall = time.monotonic() - t0
    calls = sum(res.train_metrics_clientapp[r]["pull-calls"] for r in res.train_metrics_clientapp)
    waited = sum(res.train_metrics_clientapp[r]["wait-s"] for r in res.train_metrics_clientapp)
    pushes: dict[int, list[float]] = {}
    for t, p in grid.pushed:
        pushes.setdefault(p, []).append(t)
    turn = []
    for (due, p), _ in grid.seen:
        later = [t for t in pushes[p] if t >= due]
        if later:
            turn.append(min(later) - due)
    turn.sort()
    return {
        "calls_per_node_s": calls / (waited * m),
        "turnaround_median_s": statistics.median(turn),
        "turnaround_p95_s": turn[min(len(turn) - 1, int(0.95 * len(turn)))],
        "staleness_max": max(r["staleness-max"] for r in res.train_metrics_clientapp.values()),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="M = 4, one sync round, 2 async steps")
    a = p.parse_args(argv)
    sizes, steps = ((4,), 2) if a.quick else ((8, 32), 6)
    rec: dict[str, Any] = {"quick": a.quick, "machine": common.machine(), "cells": {}}
    for m in sizes:
        for label, before in (("before", True), ("after", False)):
            rec["cells"][f"sync-M{m}-{label}"] = sync_round(m, before)
            rec["cells"][f"async-M{m}-{label}"] = async_run(m, before, steps)
            print(m, label, rec["cells"][f"sync-M{m}-{label}"], rec["cells"][f"async-M{m}-{label}"])
        rec["cells"][f"async-M{m}-after-hold0"] = async_run(m, False, steps, hold=0.0)
        print(m, "after, hold 0", rec["cells"][f"async-M{m}-after-hold0"])
    if not a.quick:
        common.append_record(RECORDS, rec)
    return rec


if __name__ == "__main__":
    main()
