"""Server aggregation time per round: FedAvg (Flower's) vs DiLoCo vs IsoLoCo (SVD / fast).

Realistic inputs: the isoloco-lm demo model (default run config unless overridden), M workers
that each take ``--steps`` real AdamW steps on their own Shakespeare shard from the same start;
their trained weights travel as Flower replies (ArrayRecord + ``num-examples``). For each
strategy and repeat, ``configure_train`` + the in-process grid deliver the replies (untimed),
then ``aggregate_train`` (decode, validate, merge, outer step) is timed. Strategies are
interleaved repeat by repeat in one process, so machine load hits all of them alike; the ratio
to FedAvg uses medians. With ``--results <results.json>`` of a real demo run, each time is also
given as a share of that run's mean round wall time (rounds 2.., round 1 holds start-up).

    python benchmarks/merging/aggregation_bench.py [--workers 4] [--repeats 7] [--results out/results.json]

``--shapes 135m``: instead, every merge rule on M synthetic pseudo-gradients of SmolLM2-135M's
shapes, as ratios to a memory pass and to ``mean``, with peak extra memory (``rule_cost_135m.py``;
defaults M = 8, median of 3; ``--quick``: 4 layers and a small vocabulary, one repeat;
``--base DIR`` with ``base_<case>`` cases: the same rules, or a ``round_`` / ``fold_`` case,
by another checkout's merging code, in the same process, for before/after ratios;
``round_<rule>`` / ``fold_<rule>``: a server round's order-free fold, key by key / whole model;
``robust_<name>``: a rule of ``merging/robust.py`` with ``mean``; ``spill_pass``: the spill
store's write and read-back):

    nice -n 10 python benchmarks/merging/aggregation_bench.py --shapes 135m [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
common.on_path("tests", "simulations/isoloco-lm")

from fakegrid import FakeGrid  # noqa: E402  (in-process Grid; delivers replies, no Ray)
from isoloco_lm import task  # noqa: E402

from flwr_isoloco.strategies import DiLoCo, IsoLoCo  # noqa: E402


def worker_models(cfg, workers: int, steps: int) -> tuple[dict, list[dict]]:
    """Start model and each worker's weights after ``steps`` AdamW steps on its shard."""
    from flwr_isoloco.clients.diloco_worker import next_token_loss

    start = task.build_model(cfg)
    theta = {k: v.detach().clone() for k, v in start.state_dict().items()}
    out = []
    for p in range(workers):
        model = task.build_model(cfg)
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1
        )
        batch = task.node_batches(cfg, p, workers)
        for i in range(steps):
            opt.zero_grad()
            loss, _ = next_token_loss(model, batch(i))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return theta, out


def strategies(workers: int) -> dict:
    common = {
        "fraction_train": 1.0,
        "fraction_evaluate": 0.0,
        "min_available_nodes": workers,
        "min_train_nodes": workers,
    }
    return {
        "FedAvg (Flower)": lambda: FedAvg(**common),
        "DiLoCo (mean, Nesterov)": lambda: DiLoCo(**common),
        "IsoLoCo (SVD)": lambda: IsoLoCo(**common),
        "IsoLoCo (fast)": lambda: IsoLoCo(preset="isoloco-paper", merge="iso_c_ns", **common),
    }


MMAP_THRESHOLD = "65536"


def _reexec_for_memory() -> None:
    """glibc reads ``MALLOC_MMAP_THRESHOLD_`` at start-up only: re-exec so that freed tensors go
    back to the OS at once and each case's peak RSS starts from a true baseline."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main_shapes(args) -> None:
    import rule_cost_135m

    out = args.out or common.RESULTS / (
        f"aggregation_bench_135m{'_quick' if args.quick else ''}_t{args.threads}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(report):
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out)

    rule_cost_135m.run(args, save)
    print(f"written to {out}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="inner AdamW steps per worker")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results", type=Path, default=None, help="results.json of a real demo run")
    ap.add_argument("--run-config", default="{}", help="JSON overrides of the app run config")
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    ap.add_argument("--shapes", choices=["demo", "135m"], default="demo")
    ap.add_argument("--quick", action="store_true", help="--shapes 135m: a quick check")
    ap.add_argument(
        "--cases", default=None, help="--shapes 135m: comma-separated cases (default: all)"
    )
    ap.add_argument("--no-shapes", action="store_true", help="--shapes 135m: skip per shape")
    ap.add_argument(
        "--base",
        default=None,
        help="--shapes 135m: a checkout whose flwr_isoloco/merging the base_<rule> cases run",
    )
    return ap


def time_aggregation(theta: dict, trained: list[dict], repeats: int) -> dict[str, list[float]]:
    """Seconds of each strategy's ``aggregate_train`` per repeat (after one warm-up pass), the
    ``len(trained)`` replies delivered by the in-process grid; strategies interleaved."""
    workers = len(trained)

    def train_handler(msg: Message, context) -> Message:
        sd = trained[int(context.node_config["partition-id"])]
        content = RecordDict(
            {"arrays": ArrayRecord(sd), "metrics": MetricRecord({"num-examples": 1024})}
        )
        return Message(content, reply_to=msg)

    grid = FakeGrid({"train": train_handler}, num_nodes=workers)
    makers = strategies(workers)
    live = {name: make() for name, make in makers.items()}
    arrays = ArrayRecord(theta)
    times: dict[str, list[float]] = {name: [] for name in makers}
    for rep in range(repeats + 1):  # first pass is warm-up (not recorded)
        for name, strat in live.items():
            replies = list(
                grid.send_and_receive(strat.configure_train(rep + 1, arrays, ConfigRecord(), grid))
            )
            assert len(replies) == workers
            t = time.perf_counter()
            new, metrics = strat.aggregate_train(rep + 1, replies)
            dt = time.perf_counter() - t
            assert new is not None, name
            if rep > 0:
                times[name].append(dt)
        # keep every strategy at the same starting point each repeat
        live = {name: make() for name, make in makers.items()}
    return times


def demo_run(results: Path) -> tuple[dict, float]:
    """A real demo run's summary and its mean round wall: over rounds 2.. (round 1 holds
    start-up), over every round when there is only one."""
    res = json.loads(results.read_text())
    walls = [r["round-wall-s"] for r in res["rounds"][1:]] or [
        r["round-wall-s"] for r in res["rounds"]
    ]
    wall = statistics.mean(walls)
    run = {
        "results": str(results),
        "strategy": res["config"]["strategy"]["name"],
        "mean-round-wall-s": wall,
        "measured-aggregation-s-in-run": statistics.mean(
            r["aggregation-time-s"] for r in res["rounds"]
        ),
    }
    return run, wall


def main() -> None:
    args = _parser().parse_args()
    torch.set_num_threads(args.threads)
    if args.shapes == "135m":
        import rule_cost_135m

        args.workers = 8 if "--workers" not in sys.argv else args.workers
        args.repeats = (1 if args.quick else 3) if "--repeats" not in sys.argv else args.repeats
        args.cases = args.cases or rule_cost_135m.DEFAULT_CASES
        main_shapes(args)
        return
    args.out = args.out or common.RESULTS / "aggregation_bench.json"

    cfg = task.load_config(json.loads(args.run_config))
    t0 = time.perf_counter()
    theta, trained = worker_models(cfg, args.workers, args.steps)
    prep_s = time.perf_counter() - t0
    n_params = sum(v.numel() for v in theta.values())
    times = time_aggregation(theta, trained, args.repeats)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["FedAvg (Flower)"]
    report = {
        "what": "server aggregate_train time per round (decode + validate + merge + outer step)",
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch-threads": args.threads,
            "load-avg": os.getloadavg(),
        },
        "model": {
            "parameters": n_params,
            "tensors": len(theta),
            "run-config": json.loads(args.run_config),
        },
        "workers": args.workers,
        "inner-steps-for-deltas": args.steps,
        "repeats": args.repeats,
        "prep-s": prep_s,
        "median-s": med,
        "all-s": times,
        "ratio-to-fedavg": {name: m / base for name, m in med.items()},
    }
    if args.results:
        report["demo-run"], wall = demo_run(args.results)
        report["share-of-round-wall"] = {name: m / wall for name, m in med.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{n_params / 1e6:.2f}M parameters, {args.workers} workers, median of {args.repeats}:")
    for name, m in med.items():
        share = (
            f", {100 * report['share-of-round-wall'][name]:.2f}% of a round" if args.results else ""
        )
        print(f"  {name:26s} {1000 * m:8.1f} ms  x{m / base:5.2f} FedAvg{share}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    if "--shapes" in sys.argv and "135m" in sys.argv:
        _reexec_for_memory()
    main()
