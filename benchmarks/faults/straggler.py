"""Straggler run: a real Ray simulation, one node answering 10x slower.

``N`` nodes train a small model (the update is a deterministic function of partition and round,
after a sleep: ``--base-s`` seconds, ``--slow-factor`` times longer for the last partition).
The same federation runs twice, with ``quorum = all`` (today's behaviour) and with
``quorum = N - 1`` and a grace window. Reported: each run's round wall times and ``wait-s``,
the late node named in the log, and whether the quorum run's model after round 1 equals,
bit for bit, an in-process merge of the ``N - 1`` fast replies (the same strategy on
``tests/fakegrid.FakeGrid`` with those partitions only).

    nice -n 10 python benchmarks/faults/straggler.py            # 8 nodes, 1 s / 10 s, grace 5 s
    nice -n 10 python benchmarks/faults/straggler.py --quick    # 3 nodes, 0.3 s / 3 s, grace 1 s, 3 rounds
    nice -n 10 python benchmarks/faults/straggler.py --asynchronous --all-threads --rounds 6

``--asynchronous`` adds the same federation in asynchronous rounds (``replies_per_step = N - 1``:
an outer step per ``N - 1`` replies, the slow node's reply merged when it comes, discounted by its
staleness); reported per step: wall time, ``wait-s``, the replies used and which steps took the
slow node's. ``--all-threads`` lets Flower's simulation engine run every node at once
(:func:`common.engine_threads`; without it a 2-core machine runs 6 of 8 at a time).

The client-side delay lives in this benchmark's own ClientApp, not in the library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

from flwr_isoloco.strategies import Rounds

HERE = Path(__file__).resolve().parent
SETTINGS: dict = {}
RESULT: dict = {}


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(64)}


def _update(theta: dict, pid: int, rnd: int) -> dict:
    g = torch.Generator().manual_seed(1000 * pid + rnd)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in theta.items()}


def train(msg, ctx):
    """Train handler: sleep (the slow partition longer), then a deterministic update."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    s = msg.content["config"]
    pid = int(ctx.node_config["partition-id"])
    slow = pid == int(s["slow-pid"])
    time.sleep(float(s["base-s"]) * (float(s["slow-factor"]) if slow else 1.0))
    theta = msg.content["arrays"].to_torch_state_dict()
    new = _update(theta, pid, int(s["server-round"]))
    metrics = MetricRecord({"num-examples": 10 + pid, "slow": int(slow)})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def _strategy(quorum, grace_s: float):
    from flwr_isoloco.strategies import DiLoCo

    n = SETTINGS["nodes"]
    if quorum == "async":
        rounds = Rounds(asynchronous=True, replies_per_step=n - 1)
    else:
        rounds = Rounds(quorum=quorum, grace_s=grace_s)
    return DiLoCo(min_available_nodes=n, min_train_nodes=n, fraction_evaluate=0.0, rounds=rounds)


def _apps():
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    client = ClientApp()
    client.train()(train)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        strategy = _strategy(SETTINGS["quorum"], SETTINGS["grace_s"])
        ends, models, slow_steps = [], {}, []

        def slow_in(contents, key):  # which steps merged the slow node's reply
            from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

            if any(int(rd["metrics"].get("slow", 0)) for rd in contents):
                slow_steps.append(len(ends) + 1)
            return aggregate_metricrecords(contents, key)

        strategy.train_metrics_aggr_fn = slow_in

        def on_round_end(rnd, arrays, train_metrics, _):
            ends.append(time.perf_counter())
            models[rnd] = arrays.to_torch_state_dict()

        t0 = time.perf_counter()
        res = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(_model()),
            num_rounds=SETTINGS["rounds"],
            train_config=ConfigRecord(
                {k: SETTINGS[k] for k in ("slow-pid", "base-s", "slow-factor")}
            ),
            timeout=600,
            on_round_end=on_round_end,
        )
        RESULT.update(
            round_wall_s=[b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)],
            metrics={r: dict(m) for r, m in res.train_metrics_clientapp.items()},
            model_round1=models.get(1),
            discarded=list(getattr(strategy._train_stream, "discarded", [])),
            slow_steps=slow_steps,
        )

    return server, client


class _Late(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "closed without the reply" in msg or "late reply of node" in msg:
            self.lines.append(msg)


def run_once(quorum, grace_s: float) -> dict:
    """One Ray simulation with this quorum; returns RESULT plus the late-reply log lines."""
    from flwr.common.logger import FLOWER_LOGGER

    SETTINGS.update(quorum=quorum, grace_s=grace_s)
    RESULT.clear()
    handler = _Late()
    FLOWER_LOGGER.addHandler(handler)
    server, client = _apps()
    try:
        nodes = SETTINGS["nodes"]
        common.ray_simulation(server, client, nodes, cpus_per_node=2 / max(4, nodes))
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    return {**RESULT, "log": handler.lines}


def in_process_merge(fast_nodes: int) -> dict[str, torch.Tensor]:
    """Round 1 of the same strategy on a FakeGrid holding only the fast partitions."""
    common.on_path("tests")
    from fakegrid import FakeGrid
    from flwr.app import ArrayRecord, ConfigRecord

    def fast_train(msg, ctx):
        return train(msg, ctx)

    n = SETTINGS["nodes"]
    SETTINGS["nodes"] = fast_nodes
    try:
        strategy = _strategy(None, 0.0)
    finally:
        SETTINGS["nodes"] = n
    grid = FakeGrid({"train": fast_train}, num_nodes=fast_nodes)
    cfg = {k: SETTINGS[k] for k in ("slow-pid", "base-s", "slow-factor")}
    res = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(_model()),
        num_rounds=1,
        train_config=ConfigRecord({**cfg, "base-s": 0.0}),
    )
    return res.arrays.to_torch_state_dict()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 nodes, 0.3 s / 3 s, grace 1 s, 3 rounds")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--base-s", type=float, default=1.0)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--grace-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--asynchronous", action="store_true", help="also asynchronous rounds")
    p.add_argument("--all-threads", action="store_true", help="every node at once (see above)")
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.nodes, a.base_s, a.slow_factor, a.grace_s, a.rounds = 3, 0.3, 10.0, 1.0, 3
    if a.all_threads:
        common.engine_threads(a.nodes)
    common.export_path("benchmarks/faults")  # Ray's workers import this file
    SETTINGS.update(
        {
            "nodes": a.nodes,
            "rounds": a.rounds,
            "slow-pid": a.nodes - 1,
            "base-s": a.base_s,
            "slow-factor": a.slow_factor,
        }
    )
    today = run_once(None, 0.0)
    quorum = run_once(a.nodes - 1, a.grace_s)
    want = in_process_merge(a.nodes - 1)
    got = quorum["model_round1"]
    equal = got is not None and all(torch.equal(got[k], want[k]) for k in want)
    summary = {
        "nodes": a.nodes,
        "base_s": a.base_s,
        "slow_factor": a.slow_factor,
        "grace_s": a.grace_s,
        "quorum_all": {
            "round_wall_s": today["round_wall_s"],
            "wait_s": [today["metrics"][r]["wait-s"] for r in sorted(today["metrics"])],
        },
        "quorum_n_minus_1": {
            "round_wall_s": quorum["round_wall_s"],
            "wait_s": [quorum["metrics"][r]["wait-s"] for r in sorted(quorum["metrics"])],
            "replies_late": [
                quorum["metrics"][r]["replies-late"] for r in sorted(quorum["metrics"])
            ],
            "replies_used": [
                quorum["metrics"][r]["replies-used"] for r in sorted(quorum["metrics"])
            ],
            "log": quorum["log"],
            "discarded": quorum["discarded"],
        },
        "round1_model_equals_in_process_merge_of_fast_replies": equal,
        "all_threads": a.all_threads,
    }
    if a.asynchronous:
        run = run_once("async", 0.0)
        ms = [run["metrics"][r] for r in sorted(run["metrics"])]
        summary["asynchronous"] = {
            "buffer": a.nodes - 1,
            "step_wall_s": run["round_wall_s"],
            "wait_s": [m["wait-s"] for m in ms],
            "replies_used": [m["replies-used"] for m in ms],
            "replies_stale": [m.get("replies-stale", 0) for m in ms],
            "steps_with_the_slow_node": run["slow_steps"],
        }
    print(json.dumps(summary, indent=2))
    if a.out is not None:
        a.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
