"""LM study of asynchronous rounds: validation loss against wall time for sites of unequal speed.

Validation loss and each site's utilisation, with synchronous rounds, quorum + grace and
asynchronous rounds.

The LM app (``simulations/isoloco-lm``, :data:`common.SMALL_LM`) in a Ray simulation of 8
nodes, each node one Ray actor (a quarter of a CPU: all 8 run at once on 2 cores). Speeds are
emulated (``train.slowdown-spread`` 4: node ``p`` runs ``1 + 3 p / 7`` times slower; every inner
step padded to that factor x ``train.emulated-step-s``), so one machine's cores can hold the 8
sites and its load does not change their speeds while a step computes in less than its padded
time (the records count the steps that did not: ``pace_overruns``). Every mode gets the same
wall-clock budget ``T``: its round count is set so that its last round ends just before ``T``
(:data:`ROUNDS`, from a first measured run), so each run's inner-lr schedule ends at its budget;
the loss at ``T`` is the last validation before ``T``. Wall time runs from when the last node
started its first task (:func:`start_time`; a curve's first points can be before 0).

Utilisation of a node = seconds inside its tasks (the ClientApp's ``task-start-s`` ..
``task-end-s``; a task still running at the end counts from when it was sent) within ``[0, W]``,
over ``W``: ``W`` is ``T``, or the end of the run's last step if earlier. A node trains one task
at a time, as a site would (the benchmark's ClientApp holds a per-node lock: the simulation
would run a quorum round's next task on another actor while the late one still trains).
Discarded work (a quorum's late replies) counts as busy: the utilisation says how much a site
computes, the loss what the computation bought.

    python benchmarks/async/async_lm.py --queue --until 14:30   # the plan, resumable
    python benchmarks/async/async_lm.py --one isoloco async 0   # one run
    python benchmarks/async/async_lm.py --table                 # docs/strategies.md + plot

Records: ``benchmarks/results/async_lm.json`` (one per run; rerunning a recorded run is a no-op).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402
from tasklog import TaskLog, start_time, turnaround, utilisation  # noqa: E402

RECORDS = common.RESULTS / "async_lm.json"
DOC = common.REPO / "docs" / "strategies.md"
PLOT = common.REPO / "docs" / "img" / "async_lm.png"
NODES, SPREAD, STEP_S, H, BUDGET_S = 8, 4.0, 0.2, 10, 90.0
SEEDS = (0, 1, 2)
METHODS = ("diloco", "isoloco")

MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "quorum": {"strategy.quorum": 0.5, "strategy.grace-s": 0.5},
    "async": {"strategy.asynchronous": True, "strategy.async-replies-per-step": NODES},
    "async-dn": {
        "strategy.asynchronous": True,
        "strategy.async-replies-per-step": 2,
        "strategy.momentum-every": 4,
    },
    "async-tb": {
        "strategy.asynchronous": True,
        "strategy.async-replies-per-step": NODES,
        "train.time-budget-s": H * STEP_S,
    },
    "async-a0": {
        "strategy.asynchronous": True,
        "strategy.async-replies-per-step": NODES,
        "strategy.async-staleness": 0.0,
    },
    "async-a1": {
        "strategy.asynchronous": True,
        "strategy.async-replies-per-step": NODES,
        "strategy.async-staleness": 1.0,
    },
}
"""Synchronous rounds; a quorum of half the nodes + 0.5 s grace; asynchronous rounds with an
outer step per 8 replies (Nesterov per step); per 2 replies with the momentum moved every 4
steps (delayed Nesterov: once per 8 replies); per 8 replies with speed-scaled local steps (each
node's budget the fastest node's task time, so a 4x node runs 2 or 3 of the 10 steps); and the
staleness discount ``(1 + tau)^-a`` at ``a = 0`` and ``a = 1`` against the default 0.5 (seed 0)."""

LABELS = {
    "sync": "synchronous",
    "quorum": "quorum 4/8 + 0.5 s grace",
    "async": "async, K=8",
    "async-dn": "async, K=2, delayed Nesterov (every 4 steps)",
    "async-tb": "async, K=8, speed-scaled local steps",
    "async-a0": "async, K=8, no staleness discount (a = 0)",
    "async-a1": "async, K=8, discount 1/(1 + tau) (a = 1)",
}

ROUNDS: dict[str, int] = {"sync": 9, "quorum": 14, "async": 19, "async-dn": 73, "async-tb": 42}
ROUNDS |= {"async-a0": 19, "async-a1": 19}
STALENESS = ("async-a0", "async-a1")
"""Outer steps per mode so that the run ends just before ``BUDGET_S`` (set from the seed-0
DiLoCo runs' measured step times; the records keep each run's end)."""

EQUAL = {"sync": {}, "async": MODES["async"]}
"""The equal-speed check (spread 1): synchronous against asynchronous rounds at equal tokens
(the same number of outer steps of 8 replies each)."""
EQUAL_ROUNDS = 10


def key(method: str, mode: str, seed: int, spread: float = SPREAD) -> str:
    return f"{method}-{mode}-spread{spread:g}-s{seed}"


def run_config(method: str, mode: str, seed: int, spread: float, rounds: int, out: str):
    return {
        **common.SMALL_LM,
        "num-server-rounds": rounds,
        "seed": seed,
        "output-dir": out,
        "checkpoint": False,
        "torch-threads": 1,
        "strategy.name": method,
        "strategy.min-nodes": NODES,
        "train.local-steps": H,
        "train.slowdown-spread": spread,
        "train.emulated-step-s": STEP_S,
        **(MODES[mode] if spread != 1.0 else EQUAL[mode]),
    }


def loss_at(curve: list[tuple[float, float]], budget: float) -> float | None:
    """The last validation loss at or before ``budget`` seconds (None: none yet)."""
    seen = [loss for t, loss in curve if t <= budget]
    return seen[-1] if seen else None


ENV = "ASYNC_LM_RUN_CONFIG"


def _client_app():
    """The app's ClientApp, seeing this run's config (run_simulation passes none)."""
    from flwr.clientapp import ClientApp
    from isoloco_lm import client_app

    app = ClientApp()

    @app.train()
    def train(msg, context):
        # One task at a time per node, as at a real site: the simulation would run a node's
        # next task (a quorum round's, while the late one still trains) on another actor.
        import fcntl

        with open(Path(tempfile.gettempdir()) / f"async-lm-node-{context.node_id}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            rc = json.loads(os.environ[ENV])
            return client_app.train(msg, common.with_run_config(context, rc))

    return app


def all_nodes_at_once() -> None:
    """Flower 1.42's simulation engine runs its ``backend.num_workers`` worker loops in a
    ``ThreadPoolExecutor()``, whose default size is ``cpu_count + 4``: on 2 cores at most 6
    nodes train at once whatever the actor pool holds (8 here), and the last two wait for a
    thread each round. Give the engine's pool a thread per node (this process only)."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from flwr.server.superlink.fleet.vce import vce_api

    vce_api.ThreadPoolExecutor = functools.partial(ThreadPoolExecutor, max_workers=NODES + 2)


def run_one(method: str, mode: str, seed: int, spread: float) -> dict[str, Any]:
    from flwr.serverapp import ServerApp

    common.on_path("simulations/isoloco-lm")
    from isoloco_lm import server_app

    from flwr_isoloco import apprunner

    rounds = ROUNDS[mode] if spread != 1.0 else EQUAL_ROUNDS
    ends: list[tuple[int, float]] = []
    original = apprunner.Recorder.on_round_end

    def on_round_end(self, server_round, *a, **k):
        ends.append((server_round, time.time()))
        return original(self, server_round, *a, **k)

    apprunner.Recorder.on_round_end = on_round_end
    all_nodes_at_once()
    logs: list[TaskLog] = []
    with tempfile.TemporaryDirectory() as out:
        rc = run_config(method, mode, seed, spread, rounds, out)
        os.environ[ENV] = json.dumps(rc)
        server = ServerApp()

        @server.main()
        def main(grid, context):
            logs.append(TaskLog(grid))
            server_app.run_server(logs[-1], rc, settle_s=2.0)

        t_wall = time.perf_counter()
        try:
            common.ray_simulation(server, _client_app(), NODES, cpus_per_node=2 / NODES)
        finally:
            apprunner.Recorder.on_round_end = original
        wall = time.perf_counter() - t_wall
        res = json.loads((Path(out) / "results.json").read_text())
    log = logs[-1]
    t0 = start_time(log.replies)
    end_of = dict(ends)
    curve = [(0.0, res["initial"]["val-loss"])] + [
        (end_of[r["round"]] - t0, r["val-loss"]) for r in res["rounds"] if r["round"] in end_of
    ]
    curve[0] = (min(0.0, curve[1][0]) if len(curve) > 1 else 0.0, curve[0][1])
    window = min(BUDGET_S, curve[-1][0])  # a run that ended early is not charged the rest
    util = utilisation(log.replies, log.sent, t0, window)
    answered = {(r["node"], r["sent"]) for r in log.replies}
    factor = {}
    for r in log.replies:
        if r.get("emulated-slowdown") is not None:
            factor[r["node"]] = r["emulated-slowdown"]
    rows = res["rounds"]
    return {
        "key": key(method, mode, seed, spread),
        "method": method,
        "mode": mode,
        "seed": seed,
        "spread": spread,
        "nodes": NODES,
        "local_steps": H,
        "emulated_step_s": STEP_S,
        "budget_s": BUDGET_S,
        "rounds": rounds,
        "settings": {k: v for k, v in rc.items() if k.startswith(("strategy.", "train."))},
        "curve": curve,
        "loss_at_budget": loss_at(curve, BUDGET_S),
        "final_loss": curve[-1][1],
        "end_s": curve[-1][0],
        "utilisation": {f"{factor.get(n, 0):.3f}": u for n, u in sorted(util.items())},
        "min_utilisation": min(util.values()) if util else None,
        "utilisation_window_s": window,
        "unanswered": [  # tasks sent and never answered: factor, sent (s from t0)
            [factor.get(n, 0.0), round(w - t0, 3)]
            for n, w in log.sent.values()
            if (n, w) not in answered
        ],
        "tasks": len(log.replies),
        "turnaround": turnaround(log),
        "pull_calls": log.calls,
        "task_log": [  # factor, then sent / started / ended / pulled (s from t0), steps
            [
                factor.get(r["node"], 0.0),
                *(
                    None if r.get(k) is None else round(r[k] - t0, 3)
                    for k in ("sent", "task-start-s", "task-end-s", "pulled")
                ),
                r.get("inner-steps"),
            ]
            for r in log.replies
        ],
        "inner_steps_total": sum(r.get("inner-steps") or 0 for r in log.replies),
        "pace_overruns": sum(r.get("pace-overruns") or 0 for r in log.replies),
        "replies_used": sum(r.get("replies-used", 0) for r in rows),
        "replies_late": sum(r.get("replies-late", 0) for r in rows),
        "replies_rejected": sum(r.get("replies-rejected", 0) for r in rows),
        "eval_time_s": sum(r.get("eval-time-s") or 0.0 for r in rows),
        "wall_s": wall,
        "machine": common.machine(),
        "started_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": common.git("rev-parse", "--short", "HEAD"),
    }


# ----------------------------------------------------------------------------- the plan
def plan() -> list[tuple[str, str, int, float]]:
    """Seed 0 of every cell first (so a cut-short queue has every mode), then seeds 1 and 2,
    then the equal-speed check (seeds 0 and 1), the staleness exponents (seed 0), and the
    equal-speed check's seed 2."""
    main = [m for m in MODES if m not in STALENESS]
    out = [(method, mode, seed, SPREAD) for seed in SEEDS for method in METHODS for mode in main]
    eq = [(method, mode, seed, 1.0) for seed in SEEDS for method in METHODS for mode in EQUAL]
    staleness = [(m, a, 0, SPREAD) for m in METHODS for a in STALENESS]
    return out + eq[:8] + staleness + eq[8:]


def recorded(records: Path = RECORDS) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in common.load_records(records)}


def one(method: str, mode: str, seed: int, spread: float, records: Path = RECORDS) -> None:
    """One run into ``records`` (a no-op when it is there)."""
    k = key(method, mode, seed, spread)
    if k in recorded(records):
        print(f"skip {k}: recorded")
        return
    rec = run_one(method, mode, seed, spread)
    common.append_record(records, rec)
    t = rec["turnaround"]
    print(
        f"done {k}: loss@{BUDGET_S:g}s {rec['loss_at_budget']:.4f} final {rec['final_loss']:.4f} "
        f"end {rec['end_s']:.1f}s min util {rec['min_utilisation']:.3f} "
        f"next median {t['next_median_s']} p95 {t['next_p95_s']} pulls {rec['pull_calls']} "
        f"overruns {rec['pace_overruns']} wall {rec['wall_s']:.0f}s",
        flush=True,
    )


def queue(until: str | None, runs: Any = None, records: Path = RECORDS, script: str = __file__):
    """Each run of ``runs`` (:func:`plan`) not in ``records``, one subprocess of ``script`` at a
    time, until ``until`` (UTC ``HH:MM`` today) has passed."""
    runs = plan() if runs is None else runs
    stop = None
    if until:
        h, m = map(int, until.split(":"))
        stop = dt.datetime.now(dt.timezone.utc).replace(hour=h, minute=m, second=0)
    for method, mode, seed, spread in runs:
        if key(method, mode, seed, spread) in recorded(records):
            continue
        if stop and dt.datetime.now(dt.timezone.utc) >= stop:
            print(f"queue: {until} UTC passed", flush=True)
            return
        print(f"queue: {dt.datetime.now(dt.timezone.utc):%H:%M:%S} start {method} {mode} {seed}")
        cmd = [sys.executable, script, "--one", method, mode, str(seed), "--spread", str(spread)]
        if subprocess.run(cmd, check=False).returncode:
            print(f"queue: {method} {mode} {seed} failed; going on", flush=True)


# ----------------------------------------------------------------------------- the table
def _mean_sd(xs: list[float]) -> str:
    if not xs:
        return "—"
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{m:.4f} ± {sd:.4f}" if len(xs) > 1 else f"{m:.4f}"


def table(records: list[dict[str, Any]]) -> str:
    """The markdown block of docs/strategies.md: one row per method and mode, every seed."""
    head = (
        f"| method | mode | val loss at {BUDGET_S:g} s, every seed | mean ± sd | outer steps "
        "| last step ends (s) | utilisation, min over nodes (every seed) | mean utilisation | replies used / late "
        "| step overruns |"
    )
    lines = [head, common.rule(10)]
    for method in METHODS:
        for mode in MODES:
            rs = sorted(
                (r for r in records if r["method"] == method and r["mode"] == mode
                 and r["spread"] == SPREAD),
                key=lambda r: r["seed"],
            )  # fmt: skip
            if not rs:
                continue
            losses = [r["loss_at_budget"] for r in rs]
            mins = ", ".join(f"{r['min_utilisation']:.3f}" for r in rs)
            means = [sum(r["utilisation"].values()) / len(r["utilisation"]) for r in rs]
            lines.append(
                f"| {method} | {LABELS[mode]} | {', '.join(f'{x:.4f}' for x in losses)} "
                f"| {_mean_sd(losses)} | {rs[0]['rounds']} "
                f"| {sum(r['end_s'] for r in rs) / len(rs):.0f} | {mins} "
                f"| {sum(means) / len(means):.2f} "
                f"| {sum(r['replies_used'] for r in rs) / len(rs):.0f} / "
                f"{sum(r['replies_late'] for r in rs) / len(rs):.0f} "
                f"| {sum(r['pace_overruns'] for r in rs)} |"
            )
    eq = [r for r in records if r["spread"] == 1.0]
    if eq:
        lines += ["", "| method | equal speeds: sync, every seed | async K=8 | paired Δ |"]
        lines.append(common.rule(4))
        for method in METHODS:
            s, a = ({r["seed"]: r["final_loss"] for r in eq if (r["method"], r["mode"]) == (method, m)}
                    for m in ("sync", "async"))  # fmt: skip
            both = sorted(set(s) & set(a))
            lines.append(
                f"| {method} | {', '.join(f'{s[k]:.4f}' for k in sorted(s))} "
                f"| {', '.join(f'{a[k]:.4f}' for k in sorted(a))} "
                f"| {', '.join(f'{a[k] - s[k]:+.4f}' for k in both)} |"
            )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = dict(zip(MODES, ("C0", "C1", "C2", "C3", "C4", "C5", "C6"), strict=True))
    for ax, method in zip(axes, METHODS, strict=True):
        for r in records:
            if r["method"] != method or r["spread"] != SPREAD or r["mode"] in STALENESS:
                continue  # the staleness exponents (seed 0) are in the table only
            t, y = zip(*r["curve"], strict=True)
            label = LABELS[r["mode"]] if r["seed"] == 0 else None
            ax.plot(t, y, color=colours[r["mode"]], alpha=0.8, lw=1.2, label=label)
        ax.axvline(BUDGET_S, color="grey", ls=":", lw=1)
        ax.set_title(f"{method}: 8 nodes, speeds 1x-4x (every seed)")
        ax.set_xlabel("wall time from when every node has started (s)")
        low = min((y for r in records if r["method"] == method for _, y in r["curve"]), default=0)
        ax.set_ylim(low - 0.05, low + 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss")  # each panel its own scale
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def cli(argv: list[str] | None, doc: str, runs: Any, records: Path, script: str, table: Any):
    """The command line of a study: ``--one`` run, ``--queue`` of ``runs`` into ``records``
    (each run a subprocess of ``script``), ``--table`` calls ``table()``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--queue", action="store_true", help="run the plan, resumable")
    p.add_argument("--until", help="queue: start no run after HH:MM UTC")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "MODE", "SEED"))
    p.add_argument("--spread", type=float, default=SPREAD)
    p.add_argument("--table", action="store_true", help="the docs/strategies.md block")
    a = p.parse_args(argv)
    common.offline_env()
    common.export_path("simulations/isoloco-lm")  # Ray's workers import the LM app
    if a.one:
        one(a.one[0], a.one[1], int(a.one[2]), a.spread, records)
    elif a.queue:
        queue(a.until, runs, records, script)
    if a.table:
        table()


def write_table() -> None:
    """docs/strategies.md's block and the plot."""
    records = common.load_records(RECORDS)
    common.write_block(DOC, "<!-- async-lm:begin -->", "<!-- async-lm:end -->", table(records))
    plot(records)
    print(table(records))


def main(argv: list[str] | None = None) -> None:
    cli(argv, __doc__, plan(), RECORDS, __file__, write_table)


if __name__ == "__main__":
    main()
