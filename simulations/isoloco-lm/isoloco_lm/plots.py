"""The isoloco-lm loss plot: validation loss from round 0 (before training) and train loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr_isoloco.plotting import integer_round_ticks, run_label, save_figure


def plot_title(
    name: str, merge: str, momentum: float, n_params: int, nesterov: bool = False
) -> str:
    """``"IsoLoCo, Iso-C merge, Nesterov momentum 0.8, 0.92M params"``; FedAvg is named alone."""
    if name == "fedavg":  # mean merge, outer lr 1, no momentum by definition
        return f"{run_label(name)}, {n_params / 1e6:.2f}M params"
    return f"{run_label(name, merge, momentum, nesterov)}, {n_params / 1e6:.2f}M params"


def plot_losses(
    rounds: list[dict[str, Any]],
    path: Path,
    title: str,
    initial: dict[str, Any] | None = None,
) -> None:
    """Write ``path`` (PNG, 0644, atomic): validation loss per round, starting at round 0
    (``initial``, the model before training) when given, and the workers' mean train loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = [(r["round"], r["val-loss"]) for r in rounds]
    if initial is not None and initial.get("val-loss") is not None:
        val.insert(0, (0, initial["val-loss"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*val, strict=True), "o-", label="validation loss (server, held-out text)")
    tr = [(r["round"], r["train-loss"]) for r in rounds if r.get("train-loss") is not None]
    if tr:
        ax.plot(
            *zip(*tr, strict=True), "s--", label="train loss (mean of the workers' inner steps)"
        )
    ax.set_xlabel("round (0 = before training)")
    integer_round_ticks(ax)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
