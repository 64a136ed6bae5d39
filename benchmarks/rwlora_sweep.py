"""RW-LoRA vs gossip LoRA vs FedAvg-LoRA with seeds (issue 11, RW-LoRA part): a resumable sweep.

Each cell (method, graph, clients, partition, rank, seed) is one run of the rwlora_sentiment
app's own server (``run_server``) and LoRA client under Flower's simulation engine (Ray
backend; ``--engine fake`` runs the same server and client code on the in-process test grid).
Run config and app launch are those of ``benchmarks/rwlora_experiments.py`` (imported). The
protocol (sizes, evaluation schedule, budget) is in docs/results-rwlora.md, "Sweep protocol":

- every method runs the same number of local updates ``U = --updates`` (optimiser steps summed
  over clients: RW-LoRA ``K`` per hop, gossip / FedAvg ``n K`` per round), so ``final_acc`` is
  the test accuracy of the evaluation at ``U`` updates (the last round, always evaluated);
- ``updates_to_target[t]`` is the local-update count of the first evaluation (round 0
  included) whose test accuracy is ``>= t`` (``None``: not reached within ``U``); the MB
  dicts are the bytes relayed / sent peer-to-peer up to that evaluation, in 1e6 bytes;
- gossip is scored on the A/B-averaged adapter (``final_acc``, ``updates_to_target``) and on
  the mean of the vertices' own accuracies (the ``*_vertex_mean`` fields);
- FedAvg does not use the graph: it runs once per (clients, partition, rank, seed), graph ``none``.

Every finished run is appended at once to the JSON list ``--out``; a cell already there with
the same run config is skipped, so an interrupted sweep continues where it stopped.

    python benchmarks/rwlora_sweep.py --methods rwlora gossip fedavg --graphs complete ring \\
        regular-3 --clients 8 --partitions iid dirichlet-0.5 --ranks 8 --seeds 0 1 2
    python benchmarks/rwlora_sweep.py --suite all          # the whole planned suite
    python benchmarks/rwlora_sweep.py --quick ...          # tiny, in-process (the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rwlora_experiments as E  # noqa: E402  (sets sys.path and the offline env)
from lm_sweep import append_record, load_records  # noqa: E402

ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results" / "rwlora_sweep.json"
SWEEP_VERSION = 1
METHODS = ("rwlora", "gossip", "fedavg")
GRAPHS = {"complete": "complete", "ring": "ring", "regular-3": "random_regular:d=3"}
TARGETS = (0.65, 0.70, 0.75, 0.80)
KEY_FIELDS = (
    "method",
    "graph",
    "clients",
    "partition",
    "rank",
    "seed",
    "quick",
    "variant",
    "eval_split",
)
# fields added after the first records: the value an older record (without them) stands for
KEY_DEFAULTS = {"variant": "paper", "eval_split": "test"}
# RW-LoRA variants (docs/results-rwlora.md, "Label skew"): sizing overrides (``local_steps``)
# and run-config keys of the app (flwr_isoloco/strategies/rwlora_variants.py). ``paper`` is
# the paper's walk: no key added, so its run config is that of the first records.
VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {},
    "k1": {"local_steps": 1},
    "k2": {"local_steps": 2},
    "lrdecay8": {"strategy.lr-decay-hops": 8.0},
    "avg0.9": {"strategy.average-decay": 0.9},
    "avg0.95": {"strategy.average-decay": 0.95},
    "mom0.5": {"strategy.hop-momentum": 0.5},
    "tail1": {"strategy.tail-average-from": 1},
    # the AdamW state travels with the token (an option of the paper's code, not a new one)
    "carry": {"strategy.carry-optimizer-state": True},
    "carry-tail1": {"strategy.carry-optimizer-state": True, "strategy.tail-average-from": 1},
    "k2-tail1": {"local_steps": 2, "strategy.tail-average-from": 1},
    "k1-avg0.9": {"local_steps": 1, "strategy.average-decay": 0.9},
    "k2-avg0.9": {"local_steps": 2, "strategy.average-decay": 0.9},
    "lrdecay8-avg0.9": {"strategy.lr-decay-hops": 8.0, "strategy.average-decay": 0.9},
}
EVAL_SPLITS = ("test", "val")
# run-config keys that do not change the computation (excluded when matching a done cell)
NEUTRAL_KEYS = ("output-dir", "torch-threads")

# Sizing (docs/results-rwlora.md, "Sweep protocol").
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "updates": 320,
        "local_steps": 5,
        "batch_size": 8,
        "max_length": 48,
        "lr": 2e-3,
        "eval_examples": 1000,
        "max_examples": 0,
        "eval_every": 40,
        "gossip_eval_every": 160,
        "eval_split": "test",
        "per_class": False,
    },
    "quick": {
        "updates": 16,
        "local_steps": 2,
        "batch_size": 4,
        "max_length": 32,
        "lr": 2e-3,
        "eval_examples": 24,
        "max_examples": 48,
        "eval_every": 8,
        "gossip_eval_every": 8,
        "eval_split": "test",
        "per_class": False,
    },
}
QUICK_CLIENTS = 4
# Cost model of the plan (docs/results-rwlora.md), from the measured cell rwlora / ring / iid /
# seed 0 / 8 clients (Ray, load average 4.6 to 7.3 on the 2 shared cores): 299 s wall, of which
# 130 s for 9 evaluations of 1,000 sentences and 152 s for 64 hops of 5 updates.
COST = {"startup_s": 17.0, "eval_s_per_1000": 14.5, "update_s": 0.475}
# The planned suite: (methods, graphs, clients, partitions, ranks, seeds).
SUITES: dict[str, list[tuple]] = {
    "main": [(METHODS, tuple(GRAPHS), (8,), ("iid", "dirichlet-0.5"), (8,), (0, 1, 2))],
    "ranks": [(("rwlora", "gossip"), ("ring",), (8,), ("iid",), (2, 4, 8, 16), (0,))],
    "clients16": [(METHODS, ("ring",), (16,), ("iid",), (8,), (0,))],
}
SUITES["all"] = SUITES["main"] + SUITES["ranks"] + SUITES["clients16"]


def partition_keys(partition: str) -> dict[str, Any]:
    """``iid`` or ``dirichlet-<alpha>`` -> the app's ``data.partitioner`` / ``data.dirichlet-alpha``."""
    if partition == "iid":
        return {"data.partitioner": "iid"}
    name, _, alpha = partition.partition("-")
    if name == "dirichlet":
        try:
            a = float(alpha)
        except ValueError:
            a = -1.0
        if a > 0:
            return {"data.partitioner": "dirichlet", "data.dirichlet-alpha": a}
    raise ValueError(f"partition {partition!r}: expected 'iid' or 'dirichlet-<alpha>' (alpha > 0)")


def sizing(args) -> dict[str, Any]:
    """:data:`SIZES` (``quick`` or ``full``) with the CLI's budget / evaluation overrides."""
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in (
        "updates",
        "eval_every",
        "gossip_eval_every",
        "lr",
        "eval_split",
        "per_class",
        "eval_examples",
    ):
        if getattr(args, key, None) is not None:
            size[key] = getattr(args, key)
    return size


def cells(
    methods, graphs, clients, partitions, ranks, seeds, variants=("paper",)
) -> list[dict[str, Any]]:
    """Cells in run order: seed-major (a full comparison at seed 0 comes first); FedAvg once
    per (clients, partition, rank, seed) with graph ``none``; the variants are RW-LoRA's
    (gossip and FedAvg run as ``paper``)."""
    out: list[dict[str, Any]] = []
    for seed in seeds:
        for n in clients:
            for part in partitions:
                for rank in ranks:
                    for method in methods:
                        for graph in graphs if method != "fedavg" else ["none"]:
                            for variant in variants if method == "rwlora" else ["paper"]:
                                cell = dict(
                                    method=method,
                                    graph=graph,
                                    clients=n,
                                    partition=part,
                                    rank=rank,
                                    seed=seed,
                                    variant=variant,
                                )
                                if cell not in out:
                                    out.append(cell)
    return out


def variant_sizing(cell: dict[str, Any], size: dict[str, Any]) -> dict[str, Any]:
    """``size`` with the cell's variant's sizing overrides (``local_steps``)."""
    extra = VARIANTS[cell.get("variant", "paper")]
    return {**size, **{k: v for k, v in extra.items() if "." not in k}}


def run_config(cell: dict[str, Any], size: dict[str, Any], threads: int) -> dict[str, Any]:
    """The app's run config for one cell (via ``rwlora_experiments.run_config``): ``U`` updates
    for every method, evaluation every ``eval_every`` updates (``gossip_eval_every`` for gossip,
    whose evaluation scores every vertex's adapter too); the variant's keys; ``size``'s
    ``eval_split`` / ``per_class`` add ``data.eval-split`` / ``eval-per-class`` when not the
    defaults (so the first records' run configs still match)."""
    size = variant_sizing(cell, size)
    method, n, k = cell["method"], cell["clients"], size["local_steps"]
    per_round = k if method == "rwlora" else n * k
    every = size["gossip_eval_every"] if method == "gossip" else size["eval_every"]
    every = max(every, per_round)  # at most once per round
    for what, x in (("updates", size["updates"]), ("eval spacing", every)):
        if x % per_round:
            raise ValueError(
                f"{method}, {n} clients: {what} {x} is not a multiple of the "
                f"{per_round} local updates of one round"
            )
    ns = types.SimpleNamespace(
        clients=n,
        local_steps=k,
        rw_updates=size["updates"],
        gossip_updates=size["updates"],
        fedavg_updates=size["updates"],
        eval_every_updates=every,
        seed=cell["seed"],
        threads=threads,
        transition="metropolis",
        rank=cell["rank"],
        max_length=size["max_length"],
        lr=size["lr"],
        batch_size=size["batch_size"],
        eval_examples=size["eval_examples"],
        max_examples=size["max_examples"],
    )
    graph = GRAPHS["complete" if cell["graph"] == "none" else cell["graph"]]  # unused by fedavg
    rc = E.run_config(ns, method, graph, Path("/unused"))
    rc.update(
        {"strategy.num-clients": n, "strategy.lazy": False, **partition_keys(cell["partition"])}
    )
    rc.update({k: v for k, v in VARIANTS[cell.get("variant", "paper")].items() if "." in k})
    if size.get("eval_split", "test") != "test":
        rc["data.eval-split"] = size["eval_split"]
    if size.get("per_class"):
        rc["eval-per-class"] = True
    return rc


def estimate_s(cell: dict[str, Any], size: dict[str, Any], ray_cpus: int = 2) -> float:
    """Planned wall seconds of one cell: start-up + evaluations + training, with :data:`COST`.
    Evaluations: rounds 0, every ``eval-every``-th and the last, each scoring 1 adapter
    (gossip: the average and the ``n`` vertices' own). Training: ``U`` updates one client at
    a time (RW-LoRA), or ``ceil(n / ray_cpus) K`` update times per round (clients in parallel)."""
    rc = run_config(cell, size, 1)
    size = variant_sizing(cell, size)
    rounds, every, n = rc["num-server-rounds"], rc["eval-every"], cell["clients"]
    points = 1 + rounds // every + (1 if rounds % every else 0)
    per_point = n + 1 if cell["method"] == "gossip" else 1
    evals = points * per_point * COST["eval_s_per_1000"] * size["eval_examples"] / 1000
    if cell["method"] == "rwlora":
        train = size["updates"] * COST["update_s"]
    else:
        train = rounds * -(-n // ray_cpus) * size["local_steps"] * COST["update_s"]
    return COST["startup_s"] + evals + train


def eval_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Evaluated rows from round 0: ``initial`` (no totals: 0 updates / bytes) + ``rounds``."""
    start = dict.fromkeys(("local-updates", "bytes-relayed", "bytes-p2p"), 0)
    rows = [{**start, "round": 0, **res["initial"]}, *res["rounds"]]
    return [r for r in rows if "test-accuracy" in r]


def to_target(rows: list[dict[str, Any]], targets=TARGETS, key: str = "test-accuracy") -> dict:
    """Per target ``t`` (keys ``f"{t:.2f}"``): local updates, MB relayed and MB P2P at the first
    row with ``rows[key] >= t`` (``rwlora_experiments.reach`` on that accuracy), else ``None``;
    ``before``: the updates of the evaluation just before it (the crossing lies in
    ``(before, updates]``; ``None`` if the first row or none reached it)."""
    scored = [{**r, "test-accuracy": r[key]} for r in rows if key in r]
    out: dict[str, dict] = {"updates": {}, "before": {}, "mb_relayed": {}, "mb_p2p": {}}
    for t in targets:
        hit = E.reach(scored, t)
        name = f"{t:.2f}"
        out["updates"][name] = hit.get("local-updates")
        i = next((j for j, r in enumerate(scored) if r["test-accuracy"] >= t), 0)
        out["before"][name] = scored[i - 1]["local-updates"] if hit and i > 0 else None
        out["mb_relayed"][name] = None if not hit else hit["bytes-relayed"] / 1e6
        out["mb_p2p"][name] = None if not hit else hit["bytes-p2p"] / 1e6
    return out


def summarise(res: dict[str, Any], budget: int, targets=TARGETS) -> dict[str, Any]:
    """Record fields from one results.json: targets, the accuracy at ``budget`` updates (the
    last evaluation at or below it; ``final_updates`` says where), the curve."""
    rows = eval_rows(res)
    done = [r for r in rows if r["local-updates"] <= budget]
    last = done[-1]
    hit = to_target(rows, targets)
    rec: dict[str, Any] = {
        "updates_to_target": hit["updates"],
        "updates_before_target": hit["before"],
        "mb_relayed_to_target": hit["mb_relayed"],
        "mb_p2p_to_target": hit["mb_p2p"],
        "final_acc": last["test-accuracy"],
        "final_loss": last.get("test-loss"),
        "final_updates": last["local-updates"],
        "best_acc": max(r["test-accuracy"] for r in rows),
        "curve": [
            {
                "round": r["round"],
                "updates": r["local-updates"],
                "mb_relayed": r["bytes-relayed"] / 1e6,
                "mb_p2p": r["bytes-p2p"] / 1e6,
                "acc": r["test-accuracy"],
                "acc_vertex_mean": r.get("test-accuracy-vertex-mean"),
                **{
                    f"acc_class_{k.rsplit('-', 1)[1]}": x
                    for k, x in r.items()
                    if k.startswith("test-accuracy-class-")
                },
            }
            for r in rows
        ],
    }
    if any("test-accuracy-vertex-mean" in r for r in rows):
        own = to_target(rows, targets, key="test-accuracy-vertex-mean")
        rec.update(
            final_acc_vertex_mean=last.get("test-accuracy-vertex-mean"),
            updates_to_target_vertex_mean=own["updates"],
            updates_before_target_vertex_mean=own["before"],
            mb_relayed_to_target_vertex_mean=own["mb_relayed"],
            mb_p2p_to_target_vertex_mean=own["mb_p2p"],
        )
    return rec


def same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    drop = set(NEUTRAL_KEYS)
    return {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }


def find_done(records: list[dict], cell: dict, rc: dict) -> dict | None:
    return next(
        (
            r
            for r in records
            if all(
                r.get(k, KEY_DEFAULTS.get(k)) == cell.get(k, KEY_DEFAULTS.get(k))
                for k in KEY_FIELDS
            )
            and same_config(r.get("run_config", {}), rc)
        ),
        None,
    )


def run_cell(cell: dict[str, Any], args) -> dict[str, Any]:
    """Run one cell and return its record (not yet written)."""
    size = sizing(args)
    rc = run_config(cell, size, args.threads)
    if args.work is None:  # made on the first run (not by --dry-run)
        args.work = tempfile.mkdtemp(prefix="rwlora_sweep_")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{cell['method']}_{cell['seed']}_", dir=args.work))
    rc["output-dir"] = str(work)
    load0, t0 = os.getloadavg()[0], time.time()
    engine = types.SimpleNamespace(
        engine=args.engine,
        clients=cell["clients"],
        ray_address=args.ray_address,
        ray_cpus=args.ray_cpus,
    )
    res = E.run_one(engine, rc)
    wall = time.time() - t0
    return {
        **cell,
        "quick": bool(args.quick),
        "eval_split": size["eval_split"],
        **summarise(res, size["updates"]),
        "budget_updates": size["updates"],
        "lr": size["lr"],
        "targets": list(TARGETS),
        "test_examples": res.get("test-examples", size["eval_examples"]),
        "visit_counts": res.get("visit-counts"),
        "wall_s": wall,
        "engine": args.engine,
        "ray_address": args.ray_address,
        "run_config": {k: v for k, v in rc.items() if k != "output-dir"},
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "sweep_version": SWEEP_VERSION,
    }


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive lock on the folder of ``path`` (shards of one sweep append to the same file;
    no lock file is left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure_cell(cell: dict[str, Any], args) -> tuple[dict[str, Any], bool]:
    """The cell's record: the one in ``args.out`` if done (``False``), else run and append it
    at once (``True``)."""
    size = sizing(args)
    rc = run_config(cell, size, args.threads)
    rc.pop("output-dir", None)
    key = {**cell, "quick": bool(args.quick), "eval_split": size["eval_split"]}
    done = find_done(load_records(args.out), key, rc)
    if done is not None:
        print(f"[rwlora_sweep] skip (done): {cell}", flush=True)
        return done, False
    print(f"[rwlora_sweep] run: {cell}", flush=True)
    rec = run_cell(cell, args)
    with locked(args.out):
        append_record(args.out, rec)
    ups = rec["updates_to_target"]
    print(
        f"[rwlora_sweep] done {cell}: final acc {rec['final_acc']:.3f} at "
        f"{rec['final_updates']} updates, to target {ups} ({rec['wall_s']:.0f} s)",
        flush=True,
    )
    return rec, True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=list(GRAPHS))
    ap.add_argument("--clients", nargs="+", type=int, default=None, help="default: 8 (quick: 4)")
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet-0.5"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument(
        "--suite",
        choices=list(SUITES),
        default=None,
        help="a planned part of the suite (overrides the six lists above)",
    )
    ap.add_argument(
        "--updates",
        type=int,
        default=None,
        help="common budget U of local updates (default: the sizing's)",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="local updates between evaluations, rwlora / fedavg (default: the sizing's)",
    )
    ap.add_argument(
        "--gossip-eval-every",
        type=int,
        default=None,
        help="local updates between gossip evaluations (default: the sizing's)",
    )
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"inner AdamW lr of every method (default: {SIZES['full']['lr']:g})",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["paper"],
        choices=list(VARIANTS),
        help="RW-LoRA variants (default: the paper's walk)",
    )
    ap.add_argument(
        "--eval-split",
        choices=EVAL_SPLITS,
        default="test",
        help="score the test set, or the clients' joined validation tails (tuning)",
    )
    ap.add_argument(
        "--eval-examples",
        type=int,
        default=None,
        help="sentences scored per evaluation (default: the sizing's; 0 = all)",
    )
    ap.add_argument(
        "--per-class", action="store_true", help="also record each label's accuracy (recall)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="tiny sizing, in-process (tests)")
    ap.add_argument(
        "--engine", choices=("ray", "fake"), default=None, help="default: ray (fake with --quick)"
    )
    ap.add_argument(
        "--ray-address", default=None, help="existing Ray cluster (e.g. auto, host:6379)"
    )
    ap.add_argument("--ray-cpus", type=int, default=2, help="local Ray CPUs (no --ray-address)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--work", default=None, help="scratch folder for the runs' outputs")
    ap.add_argument(
        "--shard",
        default="0/1",
        help="I/N: run every N-th planned cell from the I-th (N processes in parallel share --out)",
    )
    ap.add_argument("--dry-run", action="store_true", help="list the cells still to run")
    args = ap.parse_args(argv)
    try:
        i, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        ap.error(f"--shard {args.shard!r}: expected I/N with 0 <= I < N")
    args.shard_index, args.shard_count = i, n
    if args.lr is not None and not 0 < args.lr < float("inf"):
        ap.error(f"--lr {args.lr}: expected a finite learning rate > 0")
    args.engine = args.engine or ("fake" if args.quick else "ray")
    for p in args.partitions:
        try:
            partition_keys(p)
        except ValueError as exc:
            ap.error(str(exc))
    if args.clients is None:
        args.clients = [QUICK_CLIENTS] if args.quick else [8]
    return args


def planned_cells(args) -> list[dict[str, Any]]:
    groups = (
        SUITES[args.suite]
        if args.suite
        else [
            (
                args.methods,
                args.graphs,
                args.clients,
                args.partitions,
                args.ranks,
                args.seeds,
                args.variants,
            )
        ]
    )
    out: list[dict[str, Any]] = []
    for g in groups:
        out += [c for c in cells(*g) if c not in out]
    return out[args.shard_index :: args.shard_count]


def main(argv=None) -> None:
    args = parse_args(argv)
    todo = planned_cells(args)
    if args.dry_run:
        size = sizing(args)
        records = load_records(args.out)
        left = 0.0
        for c in todo:
            rc = run_config(c, size, args.threads)
            rc.pop("output-dir", None)
            key = {**c, "quick": bool(args.quick), "eval_split": size["eval_split"]}
            done = find_done(records, key, rc)
            est = estimate_s(c, size, args.ray_cpus)
            left += 0.0 if done else est
            print("done" if done else "todo", f"{est:6.0f} s", json.dumps(c))
        print(
            f"{len(todo)} cells, planned {sum(estimate_s(c, size, args.ray_cpus) for c in todo) / 3600:.2f} h"
            f" of run wall time, {left / 3600:.2f} h left (one process)"
        )
        return
    failed = []
    for cell in todo:
        try:
            ensure_cell(cell, args)
        except Exception:  # one broken cell must not stop the sweep; nothing recorded
            traceback.print_exc()
            failed.append(cell)
    if failed:
        raise SystemExit(f"[rwlora_sweep] cells failed (not recorded; rerun to retry): {failed}")


if __name__ == "__main__":
    main()
