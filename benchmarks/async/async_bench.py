"""Asynchronous rounds in a real Ray simulation: nodes of unequal speed never wait.

``N`` nodes train a small model; node ``p`` sleeps ``base_s * (1 + (spread - 1) p / (N - 1))``
seconds per task (the slowdown knob: node 0 at 1x, the last at ``spread`` x), then returns a
deterministic update of the model it got. The same federation runs with asynchronous rounds
(``Rounds(asynchronous=True, replies_per_step=K)``) and, with ``--compare``, with synchronous
rounds. Each reply reports when its task started and ended (wall clock); reported per node: tasks
done, time computing, utilisation (time computing / the run's wall time from the first task
to the last step), and the largest idle gap between the end of one task and the start of the
next, which is the wait for other nodes in synchronous rounds and only the server's latency in
asynchronous ones.

    nice -n 10 python benchmarks/async/async_bench.py --quick            # 3 nodes, 0.2 s / 2 s
    nice -n 10 python benchmarks/async/async_bench.py --nodes 8 --spread 4 --compare

The same question on the LM app (loss against wall time, DiLoCo and IsoLoCo) is
``benchmarks/async/async_lm.py``. The client-side sleep lives in this benchmark's own
ClientApp, not in the library.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

from flwr_isoloco.strategies import Rounds  # noqa: E402

SETTINGS: dict = {}
RESULT: dict = {}


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64)}


def task_seconds(pid: int, nodes: int, base_s: float, spread: float) -> float:
    """Seconds node ``pid`` sleeps per task: ``base_s`` (node 0) to ``spread * base_s``."""
    return base_s * (1.0 + (spread - 1.0) * pid / max(nodes - 1, 1))


def train(msg, ctx):
    """Train handler: sleep for this node's speed, then a deterministic step towards its target."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    c = msg.content["config"]
    pid = int(ctx.node_config["partition-id"])
    start = time.time()
    time.sleep(task_seconds(pid, int(c["nodes"]), float(c["base-s"]), float(c["spread"])))
    theta = msg.content["arrays"].to_torch_state_dict()
    g = torch.Generator().manual_seed(pid)
    new = {k: v + 0.5 * (torch.randn(v.shape, generator=g) - v) for k, v in theta.items()}
    metrics = MetricRecord(
        {"num-examples": 10, "partition": pid, "t-start": start, "t-end": time.time()}
    )
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def _strategy():
    from flwr_isoloco.strategies import DiLoCo

    n = SETTINGS["nodes"]
    rounds = (
        Rounds(asynchronous=True, replies_per_step=SETTINGS["buffer"])
        if SETTINGS["async"]
        else Rounds()
    )
    return DiLoCo(min_available_nodes=n, min_train_nodes=n, fraction_evaluate=0.0, rounds=rounds)


def _apps():
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    client = ClientApp()
    client.train()(train)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        strategy = _strategy()
        tasks: list[dict] = []

        def keep(contents, key):  # every used reply's timing (train_metrics_aggr_fn)
            for rd in contents:
                tasks.append(dict(next(iter(rd.metric_records.values()))))
            return MetricRecord({})

        strategy.train_metrics_aggr_fn = keep
        ends: list[float] = []
        t0 = time.time()
        res = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(_model()),
            num_rounds=SETTINGS["steps"],
            train_config=ConfigRecord({k: SETTINGS[k] for k in ("nodes", "base-s", "spread")}),
            timeout=600,
            on_round_end=lambda *a: ends.append(time.time()),
        )
        RESULT.update(
            t0=t0,
            ends=ends,
            tasks=tasks,
            metrics={r: dict(m) for r, m in res.train_metrics_clientapp.items()},
        )

    return server, client


def utilisation(tasks: list[dict], t0: float, t1: float, nodes: int) -> dict[int, dict]:
    """Per node: tasks, busy seconds, busy / (t1 - t0), the largest gap between tasks."""
    out = {}
    for p in range(nodes):
        mine = sorted((t["t-start"], t["t-end"]) for t in tasks if int(t["partition"]) == p)
        busy = sum(b - a for a, b in mine)
        gaps = [s2 - e1 for (_, e1), (s2, _) in zip(mine, mine[1:], strict=False)]
        out[p] = {
            "tasks": len(mine),
            "busy_s": busy,
            "utilisation": busy / (t1 - t0) if t1 > t0 else 0.0,
            "max_gap_s": max(gaps, default=0.0),
            "max_gap_after_first_s": max(gaps[1:], default=0.0),  # the first step is held
        }
    return out


def run_once(asynchronous: bool) -> dict:
    """One Ray simulation; returns the per-node table and the step metrics."""
    SETTINGS["async"] = asynchronous
    RESULT.clear()
    server, client = _apps()
    nodes = SETTINGS["nodes"]
    common.ray_simulation(server, client, nodes, cpus_per_node=2 / max(4, nodes))
    t1 = RESULT["ends"][-1] if RESULT.get("ends") else RESULT.get("t0", 0.0)
    first = min((t["t-start"] for t in RESULT.get("tasks", [])), default=t1)
    return {
        "wall_s": t1 - first,
        "nodes": utilisation(RESULT.get("tasks", []), first, t1, nodes),
        "metrics": RESULT.get("metrics", {}),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 nodes, 0.2 s to 2 s, K=2, 10 steps")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--base-s", type=float, default=0.5)
    p.add_argument("--spread", type=float, default=4.0, help="slowest node's slowdown (x)")
    p.add_argument("--buffer", type=int, default=None, help="K (default: the number of nodes)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--compare", action="store_true", help="also run synchronous rounds")
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.nodes, a.base_s, a.spread, a.buffer, a.steps = 3, 0.2, 10.0, 2, 10
    common.export_path("benchmarks/async")  # Ray's workers import this file
    SETTINGS.update(
        nodes=a.nodes, steps=a.steps, buffer=a.buffer, **{"base-s": a.base_s, "spread": a.spread}
    )
    summary = {
        "nodes": a.nodes,
        "base_s": a.base_s,
        "spread": a.spread,
        "buffer": a.buffer,
        "steps": a.steps,
        "asynchronous": run_once(True),
    }
    if a.compare:
        summary["synchronous"] = run_once(False)
    print(json.dumps(summary, indent=2, default=str))
    if a.out is not None:
        a.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


if __name__ == "__main__":
    main()
