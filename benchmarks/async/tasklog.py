"""The study's task log: when each train task was sent and what its reply said, and what
follows from it (each node's utilisation, when every node had started, the turnaround)."""

from __future__ import annotations

import math
import time
from typing import Any


class TaskLog:
    """A ``Grid`` wrapper recording when each train task was sent and what its reply said."""

    def __init__(self, grid: Any) -> None:
        self.grid, self.sent, self.replies = grid, {}, []
        self.calls = 0  # pull calls: SuperLink calls while waiting

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def push_messages(self, messages: Any) -> Any:
        messages = list(messages)
        now = time.time()
        ids = list(self.grid.push_messages(messages))
        for mid, msg in zip(ids, messages, strict=False):
            if msg.metadata.message_type.startswith("train"):
                self.sent[mid] = (int(msg.metadata.dst_node_id), now)
        return ids

    def pull_messages(self, ids: Any) -> Any:
        self.calls += 1
        replies = list(self.grid.pull_messages(ids))
        now = time.time()
        for r in replies:
            mid = r.metadata.reply_to_message_id
            if mid not in self.sent:
                continue
            row = {"node": self.sent[mid][0], "sent": self.sent[mid][1], "pulled": now}
            if not r.has_error():
                m = r.content.metric_records.get("metrics", {})
                for k in ("task-start-s", "task-end-s", "emulated-slowdown", "pace-overruns"):
                    row[k] = m.get(k)
                row["inner-steps"] = m.get("inner-steps")
            self.replies.append(row)
        return replies


def utilisation(tasks: list[dict], sent: dict[str, tuple], t0: float, budget: float) -> dict:
    """Per node: busy seconds within ``[t0, t0 + budget]`` over ``budget`` (module docstring).
    ``tasks`` are replies with ``task-start-s`` / ``task-end-s``; ``sent`` maps each task sent
    to ``(node, time)``: a task without a reply counts as busy from when it was sent."""
    end = t0 + budget
    spans: dict[int, list[tuple[float, float]]] = {}
    answered = set()
    for t in tasks:
        answered.add((t["node"], t["sent"]))
        if t.get("task-start-s") is not None:
            spans.setdefault(t["node"], []).append((t["task-start-s"], t["task-end-s"]))
    for node, when in sent.values():
        spans.setdefault(node, [])
        if (node, when) not in answered:
            spans[node].append((when, end))
    return {node: busy_fraction(s, t0, end) for node, s in spans.items()}


def busy_fraction(spans: list[tuple[float, float]], t0: float, end: float) -> float:
    """The length of the union of ``spans`` clipped to ``[t0, end]``, over ``end - t0``."""
    busy, reach = 0.0, t0
    for a, b in sorted((max(a, t0), min(b, end)) for a, b in spans):
        if b > reach and b > a:
            busy += b - max(a, reach)
            reach = b
    return busy / (end - t0)


def start_time(tasks: list[dict]) -> float:
    """``t = 0``: when the last node started its first task. Ray's actors load the app for
    ~25 s before their first task (a deployment's running sites would not); work done before
    every node is up is a few seconds of the fastest nodes."""
    first: dict[int, float] = {}
    for t in tasks:
        if t.get("task-start-s") is not None:
            first[t["node"]] = min(first.get(t["node"], math.inf), t["task-start-s"])
    return max(first.values())


def _q(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def turnaround(log: TaskLog) -> dict[str, Any]:
    """Seconds from a task's end on its node (``task-end-s``) to the next task sent to that
    node (``next``: the node's idle time between tasks, holds included) and to the server
    pulling its reply (``seen``): median and p95 over the run."""
    sends: dict[int, list[float]] = {}
    for node, when in log.sent.values():
        sends.setdefault(node, []).append(when)
    nxt, seen = [], []
    for r in log.replies:
        end = r.get("task-end-s")
        if end is None:
            continue
        seen.append(r["pulled"] - end)
        later = [w for w in sends.get(r["node"], []) if w >= end]
        if later:
            nxt.append(min(later) - end)
    return {
        "next_median_s": _q(nxt, 0.5),
        "next_p95_s": _q(nxt, 0.95),
        "seen_median_s": _q(seen, 0.5),
        "seen_p95_s": _q(seen, 0.95),
        "count": len(nxt),
    }
