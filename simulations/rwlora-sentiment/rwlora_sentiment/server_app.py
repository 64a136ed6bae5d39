"""ServerApp: RW-LoRA / gossip LoRA / FedAvg-LoRA fine-tuning of all-MiniLM-L6-v2 on sentences.

Each round's results row holds the totals so far (local updates, bytes relayed through the
server and as a peer-to-peer deployment would send them), the train loss, failed replies, the
walk vertex and, every ``eval-every`` rounds and at the last, the test accuracy and loss of the
token / vertex average / global adapter on a fixed held-out subset (gossip: also the mean of
each vertex's own adapter's accuracy). Results, plots, the checkpoint, ``resume-from`` and the
export (``adapter/``, loads with peft) are the shared runner's (:mod:`flwr_isoloco.apprunner`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_isoloco.apprunner import CHECKPOINT, AppRun, AppSpec, run_app
from flwr_isoloco.checkpoint import Field
from flwr_isoloco.models import classifier
from flwr_isoloco.models.export import export_adapter
from flwr_isoloco.strategies.core.replies import array_digest

from .plots import plot_results, plot_title
from .task import build_strategy, load_config, load_evaluator, optimizer_shapes

__all__ = ["CHECKPOINT", "SPEC", "app", "run_server"]

app = ServerApp()


def summary(row: dict[str, Any]) -> str:
    """``test acc 0.8125 loss 0.4321 | 40 local updates, 1.2 MB relayed`` (parts present)."""
    parts = []
    if "test-accuracy" in row:
        parts.append(f"test acc {row['test-accuracy']:.4f} loss {row['test-loss']:.4f}")
    if row["round"]:
        parts.append(
            f"{row['local-updates']} local updates, {row['bytes-relayed'] / 1e6:.2f} MB relayed, "
            f"{row['failed-replies']} failed replies"
        )
    return " | ".join(parts) or "no evaluation this round"


def _walk_columns(strategy, tm: dict[str, Any]) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "dead-vertices": int(tm.get("dead-vertices", 0)),
        "relays-total": int(tm.get("relays-total", 0)),
    }
    if strategy.trajectory:
        v = strategy.trajectory[-1]
        cols["walk-vertex"] = int(v) if isinstance(v, int) else str(v)
        cols["hop-failures-total"] = strategy.failures
    return cols


def _plotter(cfg, strategy, cursors: dict[str, int], n: int):
    """``plot(results, out)``: accuracy.png and visits.png, redrawn on evaluated rounds."""
    name = cfg.strategy.name
    title = plot_title(name, cfg.strategy.graph, n)

    def plot(results: dict[str, Any], out: Path) -> None:
        if results["rounds"] and "test-accuracy" not in results["rounds"][-1]:
            return
        if name == "rwlora":
            visits = {str(k): int(v) for k, v in strategy.visit_counts().items()}
        else:
            per_visit = cfg.strategy["local-steps"] * cfg.train["batch-size"]
            visits = {k: c // per_visit for k, c in sorted(cursors.items())} or None
        results["visit-counts"] = visits
        start = dict.fromkeys(("local-updates", "bytes-relayed", "bytes-p2p"), 0)
        rows = ([{**start, **results["initial"]}] if results["initial"] else []) + results["rounds"]
        plot_results(rows, visits, out, title=title)

    return plot


def _evaluator(cfg, strategy, model, tokenizer, texts, labels):
    """``evaluate(round, arrays)``: test accuracy/loss every ``eval-every`` rounds (gossip: also
    the mean over each vertex's own adapter; equal adapters, e.g. at round 0, scored once)."""
    name = cfg.strategy.name

    per_class = cfg["eval-per-class"]
    classes = sorted(set(labels))
    by_class = {c: [i for i, y in enumerate(labels) if y == c] for c in classes}

    def accuracy(arrays: ArrayRecord) -> dict[str, float]:
        classifier.load_adapter_state_dict(model, arrays.to_torch_state_dict())
        if not per_class:
            return classifier.evaluate(
                model, tokenizer, texts, labels, max_length=cfg.model["max-length"]
            )
        # one pass per label: recall of class c; overall = the rows-weighted mean
        res: dict[str, float] = {"accuracy": 0.0, "loss": 0.0}
        for c, idx in by_class.items():
            r = classifier.evaluate(
                model,
                tokenizer,
                [texts[i] for i in idx],
                [c] * len(idx),
                max_length=cfg.model["max-length"],
            )
            res[f"accuracy-class-{c}"] = r["accuracy"]
            res["accuracy"] += r["accuracy"] * len(idx) / len(labels)
            res["loss"] += r["loss"] * len(idx) / len(labels)
        return res

    def evaluate(rnd: int, arrays: ArrayRecord) -> dict[str, float] | None:
        if rnd and rnd % cfg["eval-every"] and rnd != cfg["num-server-rounds"]:
            return None
        scored: dict[str, dict[str, float]] = {}  # digest -> result: equal adapters once

        def score(a: ArrayRecord) -> dict[str, float]:
            key = array_digest({"a": a})
            if key not in scored:
                scored[key] = accuracy(a)
            return scored[key]

        res = score(arrays)
        m = {"test-accuracy": res["accuracy"], "test-loss": res["loss"]}
        m.update({f"test-{k}": x for k, x in res.items() if k.startswith("accuracy-class-")})
        if name == "gossip":  # each vertex's own adapter, not the A/B average (round 0: the same)
            own = [score(a) for a in strategy.vertex_adapters().values()]
            m["test-accuracy-vertex-mean"] = sum(r["accuracy"] for r in own) / len(own)
            m["test-loss-vertex-mean"] = sum(r["loss"] for r in own) / len(own)
        return m

    return evaluate


def build(cfg, nodes: list[int]) -> AppRun:
    """Evaluator, strategy for the connected clients, and the app's row, plots and export."""
    name, n = cfg.strategy.name, len(nodes)
    random.seed(cfg.seed)  # FedAvg samples with Python's global random (restored on resume)
    model, tokenizer, texts, labels, initial_adapter = load_evaluator(cfg, n)
    strategy = build_strategy(cfg, n)
    cursors: dict[str, int] = {}  # partition -> data cursor, for the visit plot

    evaluate = _evaluator(cfg, strategy, model, tokenizer, texts, labels)

    def row(rnd: int, tm: dict[str, Any], em: dict[str, Any]) -> dict[str, Any]:
        replies = strategy.round_replies
        cursors.update(
            {
                str(int(m["partition-id"])): int(m["data-cursor"])
                for _, m in replies
                if "partition-id" in m and "data-cursor" in m
            }
        )
        losses = [m["train_loss"] for _, m in replies if "train_loss" in m]
        fails = strategy.round_failures if name == "fedavg" else tm.get("failures", 0)
        return {
            "local-updates": int(strategy.local_updates),
            "bytes-relayed": int(strategy.bytes_relayed),
            "bytes-p2p": int(strategy.bytes_p2p),
            "train-loss": sum(losses) / len(losses) if losses else None,
            "failed-replies": int(fails),
            **(_walk_columns(strategy, tm) if name == "rwlora" else {}),
            **em,
        }

    plot = _plotter(cfg, strategy, cursors, n)

    def export(arrays: ArrayRecord, out: Path) -> Path:  # loads with peft, head included
        export_adapter(model, arrays.to_torch_state_dict(), out / "adapter", tokenizer=tokenizer)
        return out / "adapter"

    restore = {"reference": initial_adapter}
    if name != "fedavg":
        restore["optimizer_reference"] = optimizer_shapes(model)
    return AppRun(
        strategy=strategy,
        initial_arrays=ArrayRecord(initial_adapter),
        evaluate=evaluate,
        row=row,
        summary=summary,
        info={
            "num-clients": n,
            "adapter-bytes": sum(t.numel() * 4 for t in initial_adapter.values()),
            "test-examples": len(texts),
            "eval-split": cfg.data["eval-split"],
        },
        restore_kwargs=restore,
        plot=plot,
        export=export,
        app_state=lambda: {"cursors": dict(cursors)},
        load_app_state=lambda st: cursors.update(st["cursors"]),
        app_state_spec={"cursors": Field("dict", keys=r"[0-9]{1,9}", values=Field("int", min=0))},
    )


SPEC = AppSpec(
    name="rwlora_sentiment",
    label="rwlora-sentiment",
    load_config=load_config,
    # strategy.num-clients = 0: as many as connect (their count stable for settle_s)
    nodes=lambda cfg: (
        cfg.strategy["num-clients"],
        cfg.strategy["num-clients"] > 0,
        cfg.strategy["node-wait-s"],
    ),
    build=build,
    resumable_differences=frozenset(
        {"num-server-rounds", "strategy.node-wait-s", "strategy.max-empty-rounds"}
    ),
    build_needs_nodes=True,  # one graph vertex per connected client
)


def run_server(
    grid: Grid, run_config: dict[str, Any], run_id: int = 0, *, settle_s: float = 3.0
) -> Path:
    """The whole server side; returns the output folder. Raises on a bad run config."""
    return run_app(SPEC, grid, run_config, run_id, settle_s=settle_s)


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, dict(context.run_config), context.run_id)
