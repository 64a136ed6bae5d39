"""PNG plots of a run: test accuracy against local updates and bytes; visits per vertex."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr_isoloco.plotting import run_label, save_figure


def plot_title(name: str, graph: str, num_clients: int) -> str:
    """``"RW-LoRA on a ring graph, 3 clients"`` (FedAvg has no graph: ``"FedAvg, 3 clients"``)."""
    if name == "fedavg":
        return f"{run_label(name)}-LoRA, {num_clients} clients"
    return f"{run_label(name)} on a {graph} graph, {num_clients} clients"


def plot_results(
    history: list[dict[str, Any]], visits: dict[str, int] | None, out: Path, title: str
) -> None:
    """Write ``accuracy.png`` (vs local updates, vs bytes; from round 0) and ``visits.png``
    (PNG, 0644, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history if "test-accuracy" in r]
    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        acc = [r["test-accuracy"] for r in rows]
        axes[0].plot([r["local-updates"] for r in rows], acc, marker="o")
        axes[0].set_xlabel("local updates (optimiser steps, all clients)")
        axes[0].set_ylabel("test accuracy")
        axes[1].plot(
            [r["bytes-relayed"] / 1e6 for r in rows],
            acc,
            marker="o",
            label="relayed through the server",
        )
        axes[1].plot(
            [r["bytes-p2p"] / 1e6 for r in rows],
            acc,
            marker="x",
            label="as peer-to-peer would send",
        )
        axes[1].set_xlabel("MB sent")
        axes[1].legend()
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        save_figure(fig, out / "accuracy.png")
        plt.close(fig)
    if visits:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(list(visits), list(visits.values()))
        ax.set_xlabel("vertex (partition-id)")
        ax.set_ylabel("visits")
        ax.set_title(title)
        fig.tight_layout()
        save_figure(fig, out / "visits.png")
        plt.close(fig)
