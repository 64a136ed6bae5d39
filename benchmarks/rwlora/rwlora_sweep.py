"""RW-LoRA vs gossip LoRA vs FedAvg-LoRA with seeds: a resumable sweep.

Each cell (method, graph, clients, partition, rank, seed) is one run of the rwlora_sentiment
app's own server (``run_server``) and LoRA client under Flower's simulation engine (Ray
backend; ``--engine fake`` runs the same server and client code on the in-process test grid).
Run config and app launch are those of ``benchmarks/rwlora/rwlora_experiments.py`` (imported); the
cells, sizing, variants and cost model are in ``rwlora_sweep_plan.py``. The
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

    python benchmarks/rwlora/rwlora_sweep.py --methods rwlora gossip fedavg --graphs complete ring \\
        regular-3 --clients 8 --partitions iid dirichlet-0.5 --ranks 8 --seeds 0 1 2
    python benchmarks/rwlora/rwlora_sweep.py --suite all          # the whole planned suite
    python benchmarks/rwlora/rwlora_sweep.py --quick ...          # tiny, in-process (the tests)
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py

import rwlora_experiments as E  # noqa: E402  (sets sys.path and the offline env)
from common import append_record, load_records  # noqa: E402
from rwlora_sweep_plan import (  # noqa: E402, F401  (the plan; re-exported for the tests)
    EVAL_SPLITS,
    GRAPHS,
    METHODS,
    QUICK_CLIENTS,
    SIZES,
    SUITES,
    TARGETS,
    VARIANTS,
    cells,
    estimate_s,
    partition_keys,
    planned_cells,
    run_config,
    sizing,
)
from rwlora_sweep_skew import CELL  # noqa: E402

ROOT = HERE.parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "rwlora_sweep.json"
SWEEP_VERSION = 1
KEY_FIELDS = (*CELL, "variant", "eval_split")
# fields added after the first records: the value an older record (without them) stands for
KEY_DEFAULTS = {"variant": "paper", "eval_split": "test"}
# run-config keys that do not change the computation (excluded when matching a done cell)
NEUTRAL_KEYS = ("output-dir", "torch-threads")


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
    append_record(args.out, rec)  # under the records folder's lock (common.locked)
    ups = rec["updates_to_target"]
    print(
        f"[rwlora_sweep] done {cell}: final acc {rec['final_acc']:.3f} at "
        f"{rec['final_updates']} updates, to target {ups} ({rec['wall_s']:.0f} s)",
        flush=True,
    )
    return rec, True


def _cell_args(ap: argparse.ArgumentParser) -> None:
    """Which cells: the cross product of the six lists below, or a planned suite."""
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


def _sizing_args(ap: argparse.ArgumentParser) -> None:
    """Budget, schedule, lr, variants and evaluation split (overrides of the sizing)."""
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


def _run_args(ap: argparse.ArgumentParser) -> None:
    """Where the records go and how the runs are launched."""
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


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validate and complete ``args`` in place (``ap.error`` on a bad value)."""
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for add in (_cell_args, _sizing_args, _run_args):
        add(ap)
    args = ap.parse_args(argv)
    _check(ap, args)
    return args


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
