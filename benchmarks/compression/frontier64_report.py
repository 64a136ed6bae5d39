"""The 64 x 64-tile frontier's table (docs/results-compression.md) and plot, from its records.

Every number is measured: bytes are the ``count_bytes()`` of every message of the run (the
records' ``bytes``: per node and round, and the whole run of 8 nodes and 80 rounds, round 1's
full download included), the losses are the runs' validation (chosen on) and test (reported)
losses. Per configuration: the validation-optimal outer lr of seed 0's grid
(``comm_frontier.tuning``), the test loss of every seed run at it, and the paired differences
seed by seed (the same seed draws the same data and initial model) to two fp32 runs of the same
method: its reference (``frontier64.reference``: the best-tuned fp32 outer optimiser, Nesterov
0.8 or momentum 0), which the goal is judged against, and fp32 under the configuration's own
outer optimiser, which isolates what the codec costs.
``x fewer`` divides fp32 DiLoCo's bytes by the configuration's, up and down apart and over the
run. A configuration still tuning is shown with its best lr so far and marked.

    python benchmarks/compression/frontier64.py --table    # the docs block and the plot
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import frontier64 as F64

CF, common = F64.CF, F64.common
DOC = common.REPO / "docs" / "results-compression.md"
PLOT = common.REPO / "docs" / "img" / "comm_frontier64.png"
BEGIN, END = "<!-- BEGIN COMM_FRONTIER64 -->", "<!-- END COMM_FRONTIER64 -->"
BASE = "diloco-fp32-nesterov"
GOAL_X, GOAL_NATS = 25.0, 0.02


def config_row(name: str, done: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration's optimum and its seeds, or None when nothing of it ran."""
    runs0 = {
        r["outer_lr"]: r for k, r in done.items() if k.startswith(name + "|") and r["seed"] == 0
    }
    if not runs0:
        return None
    todo, best = CF.tuning(name, done, 3, F64.centre(name))
    tuned = best is not None
    if best is None:
        best = min(runs0, key=lambda lr: runs0[lr]["val_loss"])
    seeds = {s: done[CF.key(name, best, s)] for s in (0, 1, 2) if CF.key(name, best, s) in done}
    return {
        "config": name,
        "method": F64.CONFIGS[name]["method"],
        "lr": best,
        "status": f"{'tuned' if tuned else 'tuning'}: {len(runs0)} lrs"
        + ("" if tuned else f", {len(todo)} to run"),
        "grid": {lr: r["val_loss"] for lr, r in sorted(runs0.items())},
        "val": {s: r["val_loss"] for s, r in seeds.items()},
        "test": {s: r["test_loss"] for s, r in seeds.items()},
        "bytes": seeds[0]["bytes"],
        "rounds": seeds[0]["rounds"],
        "workers": seeds[0].get("workers", 8),
        "compressed_down": seeds[0].get("download", "none") != "none",
    }


def rows(done: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = [r for n in F64.CONFIGS if (r := config_row(n, done)) is not None]
    by_name = {r["config"]: r for r in out}
    base = by_name.get(BASE)
    for r in out:
        ref = by_name.get(F64.reference(r["config"], done))
        same = [n for n in F64.fp32_of(r["config"], same_optimiser=True) if n != r["config"]]
        twin = by_name.get(same[0]) if same else None
        r["reference"] = ref["config"] if ref else None
        r["paired"] = _paired(r, ref)
        r["paired_same_opt"] = _paired(r, twin)
        r["val_delta"] = r["val"][0] - ref["val"][0] if ref and 0 in r["val"] else None
        r["x"] = (
            {side: _run(base, side) / _run(r, side) for side in ("up", "down")}
            | {"run": base["bytes"]["total_run"] / r["bytes"]["total_run"]}
            | {"run_local0": base["bytes"]["total_run"] / _run_local0(r)}
            if base
            else {}
        )
    return out


def _paired(r: dict[str, Any], ref: dict[str, Any] | None) -> dict[int, float]:
    """Test loss minus ``ref``'s, seed by seed (the seeds both ran)."""
    if ref is None:
        return {}
    return {s: t - ref["test"][s] for s, t in r["test"].items() if s in ref["test"]}


def _run_local0(r: dict[str, Any]) -> float:
    """The run's bytes had every node built the initial model itself (a download codec with
    ``nodes_hold_initial=True``): round 1 then sends no model down, only its config. Computed
    from the measured run (its round-1 download arrays taken out); plain downloads send the
    full model every round, so nothing changes for them."""
    b = r["bytes"]
    if not r["compressed_down"]:
        return b["total_run"]
    model = b["round1_down_per_node"] - (b["down_per_node_round"] - b["down_arrays_per_node_round"])
    return b["total_run"] - r["workers"] * model


def _run(r: dict[str, Any], side: str) -> float:
    """Bytes ``side`` ("up" or "down") per node over the run: round 1's and the later rounds'."""
    b = r["bytes"]
    return b[f"round1_{side}_per_node"] + (r["rounds"] - 1) * b[f"{side}_per_node_round"]


def _mean_range(vals: list[float]) -> str:
    m = f"{statistics.mean(vals):.4f}"
    return m + (f" ± {(max(vals) - min(vals)) / 2:.4f}" if len(vals) > 1 else "")


def table_text(rs: list[dict[str, Any]]) -> str:
    head = (
        "| configuration | outer lr (status) | bytes up / node / round | down / node / round | "
        "run total (8 nodes, 80 rounds) | x fewer up | x fewer down | x fewer run | "
        "x fewer run, nodes build round 0 | "
        "test loss per seed (0, 1, 2) | mean ± half-range | "
        "paired Δ test vs the method's best fp32, per seed | Δ val, seed 0 | "
        "paired Δ test vs fp32, same outer optimiser |"
    )
    lines = [head, common.rule(14)]
    for r in rs:
        b, x = r["bytes"], r["x"]
        t = r["test"]
        every = ", ".join(f"{t[s]:.4f}" for s in sorted(t))
        paired = _deltas(r["paired"])
        if r["reference"] and r["reference"] != r["config"]:
            paired += f" (vs {r['reference'].split('-', 1)[1]})"
        dv = "—" if r["val_delta"] is None else f"{r['val_delta']:+.4f}"
        lines.append(
            f"| {r['config']} | {r['lr']:g} ({r['status']}) | {b['up_per_node_round']:,.0f} | "
            f"{b['down_per_node_round']:,.0f} | {b['total_run'] / 1e9:.3f} GB | "
            f"{x.get('up', float('nan')):.1f}x | {x.get('down', float('nan')):.1f}x | "
            f"{x.get('run', float('nan')):.1f}x | {x.get('run_local0', float('nan')):.1f}x | "
            f"{every} | {_mean_range(list(t.values()))} | "
            f"{paired} | {dv} | {_deltas(r['paired_same_opt'])} |"
        )
    return "\n".join(lines)


def _deltas(d: dict[int, float]) -> str:
    return ", ".join(f"{d[s]:+.4f}" for s in sorted(d)) or "—"


def plot(rs: list[dict[str, Any]], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for r in rs:
        vals = list(r["test"].values())
        m = statistics.mean(vals)
        color = "C0" if r["method"] == "diloco" else "C1"
        ax.errorbar(
            [r["bytes"]["total_run"]],
            [m],
            yerr=[[m - min(vals)], [max(vals) - m]],
            color=color,
            marker="o" if "fp32" in r["config"] else "D",
            capsize=3,
            ls="none",
        )
        ax.annotate(
            r["config"].split("-", 1)[1], (r["bytes"]["total_run"], m), fontsize=6,
            xytext=(4, 2), textcoords="offset points",
        )  # fmt: skip
    by_name = {r["config"]: r for r in rs}
    base = by_name.get(BASE)
    ref = by_name.get(base["reference"]) if base else None
    if base and ref:
        ax.axvline(base["bytes"]["total_run"] / GOAL_X, color="grey", ls=":", lw=1)
        ax.axhline(statistics.mean(ref["test"].values()) + GOAL_NATS, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("bytes of the run, up + down (8 nodes, 80 rounds; Flower count_bytes)")
    ax.set_ylabel("test loss (nats); bars: seed range")
    ax.set_title(
        "64 x 64 tiles: 2.13M LLaMA, M = 8, T = 800 (blue DiLoCo, orange IsoLoCo; dotted: "
        "25x fewer, DiLoCo's best fp32 + 0.02)",
        fontsize=8,
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def table(path: Path, write: bool = True) -> str:
    """The docs block and the plot from the records at ``path``."""
    done = CF.recorded(common.load_records(path))
    rs = rows(done)
    text = table_text(rs)
    if write:
        common.write_block(DOC, BEGIN, END, text)
        plot(rs)
    print(text)
    return text


__all__ = ["rows", "table", "table_text"]
