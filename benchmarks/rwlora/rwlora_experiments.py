"""RW-LoRA vs gossip LoRA vs FedAvg-LoRA on 8 clients (complete graph and ring).

Runs the rwlora_sentiment app's own server (``run_server``) and its LoRA client handlers, for
each method and graph, under Flower's simulation engine (``flwr.simulation.run_simulation``,
Ray backend, in-process; ``--engine fake`` uses the in-process test grid instead). Records test
accuracy on a fixed held-out subset against local updates and bytes, and the local updates /
bytes each method needs to first reach ``--target`` accuracy (first evaluation at or above it;
the resolution is the evaluation spacing). FedAvg does not use the graph (the server is the
hub), so it runs once and is listed under both graphs. Gossip is evaluated twice: the A/B
averaged adapter (``test-accuracy``, used for the targets) and the mean of each vertex's own
adapter (``test-accuracy-vertex-mean``, reported in the summary and the table's last columns).

    nice -n 10 .venv/bin/python benchmarks/rwlora/rwlora_experiments.py            # full budget
    .venv/bin/python benchmarks/rwlora/rwlora_experiments.py --quick --engine fake  # smoke test

Outputs: ``benchmarks/results/rwlora_<method>_<graph>.json`` (the app's results.json),
``benchmarks/results/rwlora_summary.json``, ``docs/img/rwlora_*.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

ROOT = common.REPO
APP_DIR = ROOT / "simulations" / "rwlora-sentiment"
common.on_path("tests", "simulations/rwlora-sentiment")
common.offline_env()
common.export_path("simulations/rwlora-sentiment", "tests")


def run_config(args, method: str, graph: str, out: Path) -> dict:
    n, k = args.clients, args.local_steps
    per_round = k if method == "rwlora" else n * k
    budget = {"rwlora": args.rw_updates, "gossip": args.gossip_updates}.get(
        method, args.fedavg_updates
    )
    rounds = max(1, budget // per_round)
    eval_every = max(1, args.eval_every_updates // per_round)
    return {
        "num-server-rounds": rounds,
        "seed": args.seed,
        "output-dir": str(out),
        "checkpoint": False,
        "torch-threads": args.threads,
        "eval-every": eval_every,
        "strategy.name": method,
        "strategy.num-clients": n,
        "strategy.graph": graph,
        "strategy.transition": args.transition,
        "strategy.local-steps": k,
        "lora.r": args.rank,
        "model.max-length": args.max_length,
        "train.lr": args.lr,
        "train.batch-size": args.batch_size,
        "data.eval-examples": args.eval_examples,
        "data.max-examples": args.max_examples,
    }


def run_one(args, rc: dict) -> dict:
    """One run of the app: ``args.engine`` ``fake`` (the in-process test grid) or ``ray``
    (``flwr.simulation.run_simulation``; ``args.ray_address``, if set, joins an existing cluster
    through Flower's backend config, else a local one with ``args.ray_cpus`` CPUs). Returns the
    run's results.json; raises if the run did not complete."""
    from rwlora_sentiment.server_app import run_server
    from rwlora_sentiment.task import client_config, load_config

    from flwr_isoloco.clients.lora_client import LoRAClient

    client = LoRAClient(client_config(load_config(rc)))
    if args.engine == "fake":
        from fakegrid import FakeGrid

        handlers = {"train": client.train, "evaluate": client.evaluate, "query": client.query}
        out = run_server(FakeGrid(handlers, num_nodes=args.clients, run_config=rc), rc, 0)
    else:
        from flwr.clientapp import ClientApp
        from flwr.serverapp import ServerApp

        server = ServerApp()

        @server.main()
        def main(grid, context):
            run_server(grid, rc, context.run_id)

        capp = ClientApp()
        client.register(capp)
        address = getattr(args, "ray_address", None)
        init_args = {"address": address} if address else {"num_cpus": args.ray_cpus}
        common.ray_simulation(server, capp, args.clients, init_args=init_args)
        out = Path(rc["output-dir"])
    res = json.loads((Path(out) / "results.json").read_text())
    if res.get("status") != "completed":
        raise RuntimeError(
            f"run {rc['strategy.name']} on {rc['strategy.graph']}: status "
            f"{res.get('status')!r} ({res.get('error')})"
        )
    return res


def reach(rows: list[dict], target: float) -> dict:
    """First evaluated round with test accuracy >= target: updates and bytes at that point."""
    for r in rows:
        if r.get("test-accuracy", -1) >= target:
            return {
                "local-updates": r["local-updates"],
                "bytes-relayed": r["bytes-relayed"],
                "bytes-p2p": r["bytes-p2p"],
                "round": r["round"],
            }
    return {}


def plot(summary: dict, path_prefix: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import run_label, save_figure

    graphs = summary["graphs"]
    for xkey, xlabel, fname in (
        ("local-updates", "local updates (optimiser steps, all clients)", "updates"),
        ("bytes-p2p", "MB sent peer-to-peer", "bytes_p2p"),
        ("bytes-relayed", "MB relayed through the server", "bytes_relayed"),
    ):
        fig, axes = plt.subplots(1, len(graphs), figsize=(5.2 * len(graphs), 3.8), squeeze=False)
        for ax, g in zip(axes[0], graphs, strict=True):
            for run in summary["runs"].values():
                if run["graph"] not in (g, "any"):
                    continue
                rows = [r for r in run["rounds"] if "test-accuracy" in r]
                xs = [r[xkey] / (1e6 if xkey != "local-updates" else 1) for r in rows]
                label = run_label(run["method"])  # "RW-LoRA", not the config name "rwlora"
                if run["method"] == "fedavg":
                    label += "-LoRA (server average)"
                ax.plot(xs, [r["test-accuracy"] for r in rows], marker="o", ms=3, label=label)
            ax.axhline(summary["target"], ls="--", c="gray", lw=0.8)
            ax.set_title(f"{g} graph, {summary['clients']} clients")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        save_figure(fig, f"{path_prefix}_{fname}.png")  # atomic, 0644
        plt.close(fig)


def markdown_table(summary: dict) -> str:
    """The summary table as Markdown (updates / MB to each target accuracy)."""
    targets = ("0.7", "0.75", "0.8")
    head = (
        "| graph | method | updates to 0.70 | updates to 0.75 | updates to 0.80 "
        "| MB relayed to 0.75 | MB P2P to 0.75 | best acc | final acc | total updates | wall s "
        "| best acc, own adapters | final acc, own adapters |"
    )
    lines = [head, "|" + "---|" * 13]

    def mb(x):
        return "-" if x is None else f"{x / 1e6:.1f}"

    def acc(x):
        return "-" if x is None else f"{x:.3f}"

    for r in summary["table"]:
        ups = [r["updates-to"].get(t) for t in targets]
        lines.append(
            f"| {r['graph']} | {r['method']} | "
            + " | ".join("not reached" if u is None else str(u) for u in ups)
            + f" | {mb(r['bytes-relayed-to-target'])} | {mb(r['bytes-p2p-to-target'])}"
            f" | {r['best-accuracy']:.3f} | {r['final-accuracy']:.3f} | {r['total-updates']}"
            f" | {r['wall-s']:.0f} | {acc(r.get('best-accuracy-vertex-mean'))}"
            f" | {acc(r.get('final-accuracy-vertex-mean'))} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("ray", "fake"), default="ray")
    ap.add_argument("--graphs", default="complete,ring")
    ap.add_argument("--methods", default="rwlora,gossip,fedavg")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument(
        "--transition",
        choices=("metropolis", "simple"),
        default="metropolis",
        help="RW-LoRA walk (identical on the complete graph and the ring: both are regular)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--max-examples", type=int, default=0)
    ap.add_argument("--rw-updates", type=int, default=240)
    ap.add_argument("--gossip-updates", type=int, default=480)
    ap.add_argument("--fedavg-updates", type=int, default=480)
    ap.add_argument("--eval-every-updates", type=int, default=40)
    ap.add_argument("--target", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--img", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--work", default="/tmp/rwlora_experiments")
    ap.add_argument("--quick", action="store_true", help="tiny budgets (smoke test)")
    return ap


def run_all(args, summary: dict, methods: list[str], graphs: list[str], summary_path: Path) -> None:
    """Each (method, graph) run not yet in ``summary["runs"]``, ``summary`` written to
    ``summary_path`` after each (FedAvg runs once, under the graph ``any``)."""
    out_dir = summary_path.parent
    for method in methods:
        for graph in graphs if method != "fedavg" else ["complete"]:
            key = f"{method}_{graph if method != 'fedavg' else 'server'}"
            if key in summary["runs"]:
                print(f"[rwlora-exp] {key}: already done", flush=True)
                continue
            rc = run_config(args, method, graph, Path(args.work) / key)
            t0 = time.perf_counter()
            print(f"[rwlora-exp] {key}: {rc['num-server-rounds']} rounds ...", flush=True)
            res = run_one(args, rc)
            wall = time.perf_counter() - t0
            start = dict.fromkeys(("local-updates", "bytes-relayed", "bytes-p2p"), 0)
            rows = [{**start, **res["initial"]}, *res["rounds"]]  # from round 0
            if not args.quick:
                (out_dir / f"rwlora_{key}.json").write_text(json.dumps(res, indent=1))
            summary["runs"][key] = {
                "method": method,
                "graph": graph if method != "fedavg" else "any",
                "wall-s": wall,
                "rounds": rows,
                "visit-counts": res.get("visit-counts"),
                "run-config": rc,
            }
            best = max((r["test-accuracy"] for r in rows if "test-accuracy" in r), default=None)
            print(f"[rwlora-exp] {key}: {wall:.0f}s, best acc {best}", flush=True)
            summary_path.write_text(json.dumps(summary, indent=1))


def summary_table(summary: dict, graphs: list[str], target: float) -> list[dict]:
    """One row per (graph, run): local updates and bytes to ``target`` (and to 0.65 .. 0.8) by
    :func:`reach`, final and best accuracy (A/B adapter and, for gossip, the vertices' own)."""
    table = []
    for g in graphs:
        for run in summary["runs"].values():
            if run["graph"] not in (g, "any"):
                continue
            rows = [r for r in run["rounds"] if "test-accuracy" in r]
            hit = reach(rows, target)
            own = [r["test-accuracy-vertex-mean"] for r in rows if "test-accuracy-vertex-mean" in r]
            table.append(
                {
                    "graph": g,
                    "method": run["method"],
                    "target": target,
                    "updates-to": {
                        str(t): reach(rows, t).get("local-updates") for t in (0.65, 0.7, 0.75, 0.8)
                    },
                    "updates-to-target": hit.get("local-updates"),
                    "bytes-relayed-to-target": hit.get("bytes-relayed"),
                    "bytes-p2p-to-target": hit.get("bytes-p2p"),
                    "final-accuracy": rows[-1]["test-accuracy"] if rows else None,
                    "best-accuracy": max((r["test-accuracy"] for r in rows), default=None),
                    "total-updates": run["rounds"][-1]["local-updates"],
                    "best-accuracy-vertex-mean": max(own, default=None),
                    "final-accuracy-vertex-mean": own[-1] if own else None,
                    "wall-s": run["wall-s"],
                }
            )
    return table


def main() -> None:
    args = _parser().parse_args()
    if args.quick:
        args.clients, args.rw_updates, args.gossip_updates, args.fedavg_updates = 4, 20, 40, 40
        args.eval_every_updates, args.eval_examples, args.max_examples = 20, 32, 40
        args.batch_size, args.max_length = 4, 32

    out_dir, img_dir = Path(args.out), Path(args.img)
    out_dir.mkdir(parents=True, exist_ok=True)
    img_dir.mkdir(parents=True, exist_ok=True)
    graphs = [g for g in args.graphs.split(",") if g]
    methods = [m for m in args.methods.split(",") if m]
    summary_path = out_dir / ("rwlora_summary_quick.json" if args.quick else "rwlora_summary.json")
    summary: dict = {
        "engine": args.engine,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "img", "work")},
        "target": args.target,
        "clients": args.clients,
        "graphs": graphs,
        "runs": {},
        "table": [],
    }
    if summary_path.exists() and not args.quick:  # resume a partly done sweep
        old = json.loads(summary_path.read_text())
        if old.get("settings") == summary["settings"]:
            summary["runs"] = old.get("runs", {})
    run_all(args, summary, methods, graphs, summary_path)
    summary["table"] = summary_table(summary, graphs, args.target)
    summary_path.write_text(json.dumps(summary, indent=1))
    plot(summary, img_dir / ("rwlora_quick" if args.quick else "rwlora"))
    md = markdown_table(summary)
    if not args.quick:
        (out_dir / "rwlora_table.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
