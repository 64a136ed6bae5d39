"""The frontier's computed bytes, table (docs/results-compression.md) and plot (comm_frontier.py).

Bytes of a configuration that was not trained: the arrays are exact (the model's real
pseudo-gradient after H = 10 inner AdamW steps, encoded once with the configuration's codec,
``ArrayRecord.count_bytes()``), the non-array part of a message (config and metric records, a
few hundred bytes) is taken from a measured run with the same download mode. Per node:
round 1 sends the full fp32 model down; rounds 2+ the codec's bytes each way; a run of R rounds
moves ``M (round1_down + round1_up + (R - 1) (down + up))``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import comm_frontier as F

common, L = F.common, F.L
DOC = common.REPO / "docs" / "results-compression.md"
PLOT = common.REPO / "docs" / "img" / "comm_frontier.png"
BEGIN, END = "<!-- BEGIN COMM_FRONTIER -->", "<!-- END COMM_FRONTIER -->"
GOAL_X, GOAL_NATS = 100.0, 0.02


# ----------------------------------------------------------------------------- computed bytes
def real_delta(size: dict[str, Any], seed: int = 0) -> tuple[dict, dict]:
    """(model state, ``theta - theta_1``) after H inner AdamW steps of worker 0 at seed 0."""
    import numpy as np
    import torch

    from flwr_isoloco.clients.diloco_worker import next_token_loss

    torch.manual_seed(seed)
    model = L.build_model(size, seed)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path, _ = L.run_rows(size, seed)
    rows = np.load(path, allow_pickle=False, mmap_mode="r")
    opt = torch.optim.AdamW(model.parameters(), lr=size["inner_lr"], weight_decay=0.1)
    per = size["global_batch"] // F.WORKERS
    for t in range(size["inner_steps"]):
        loss, _ = next_token_loss(model, L.worker_batch(rows, 0, F.WORKERS, t, per))
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = model.state_dict()
    return start, {k: start[k] - end[k] for k in start}


def array_bytes(name: str, delta: dict, state: dict) -> tuple[int, int]:
    """(up, down) array bytes per node in rounds 2+ of configuration ``name``."""
    from flwr.app import ArrayRecord

    from flwr_isoloco.compression.record import compress

    full = ArrayRecord(state).count_bytes()
    spec = F.CODECS[F.CONFIGS[name]["codec"]]
    if spec is None:
        return ArrayRecord(delta).count_bytes(), full
    codec, opts = spec
    up = compress(delta, codec, **opts).count_bytes()
    return up, up if F.CONFIGS[name]["down"] == "both" else full


def compute_bytes(quick: bool = False) -> dict[str, Any]:
    """Every configuration's bytes (``comm_frontier_bytes.json``); each measured run's arrays
    checked against the computed ones (they must agree exactly)."""
    from flwr.app import ArrayRecord

    size = F.run_size(False)
    state, delta = real_delta(size)
    full = ArrayRecord(state).count_bytes()
    measured = [r for r in common.load_records(F.RECORDS) if not r.get("quick")]
    out = {}
    for name in F.CONFIGS:
        up, down = array_bytes(name, delta, state)
        same = [r for r in measured if r["config"] == name]
        for r in same:
            b = r["bytes"]
            got = (b["up_arrays_per_node_round"], b["down_arrays_per_node_round"])
            if got != (up, down):
                raise RuntimeError(f"{name}: measured arrays {got} != computed {(up, down)}")
        fp = F.CONFIGS[name]["codec"] == "fp32"
        like_up = same or [r for r in measured if (r["codec"] == "fp32") == fp] or measured
        like = same or [r for r in measured if r["down"] == F.CONFIGS[name]["down"]]
        if not like:
            raise RuntimeError(f"{name}: no measured run with download {F.CONFIGS[name]['down']}")
        b, bu = like[0]["bytes"], like_up[0]["bytes"]
        over_up = bu["up_per_node_round"] - bu["up_arrays_per_node_round"]
        over_down = b["down_per_node_round"] - b["down_arrays_per_node_round"]
        r1_down = full + (b["round1_down_per_node"] - full if same else over_down)
        row = {
            "source": "measured" if same else "computed",
            "up_per_node_round": up + over_up,
            "down_per_node_round": down + over_down,
            "round1_down_per_node": r1_down,
            "round1_up_per_node": up + over_up,
        }
        row["total_per_node_round"] = row["up_per_node_round"] + row["down_per_node_round"]
        rounds = size["rounds"]
        per_node = r1_down + row["round1_up_per_node"] + (rounds - 1) * row["total_per_node_round"]
        row["total_run"] = per_node * F.WORKERS
        if same:
            row["total_run"] = same[0]["bytes"]["total_run"]
        out[name] = row
    data = {
        "command": "benchmarks/compression/comm_frontier.py --bytes",
        "model_params": sum(v.numel() for v in state.values()),
        "fp32_model_bytes": full,
        "workers": F.WORKERS,
        "rounds": size["rounds"],
        "configs": out,
    }
    common.save_json(F.BYTES, data)
    print(f"bytes of {len(out)} configurations -> {F.BYTES}")
    return data


# ----------------------------------------------------------------------------- baselines, table
def baselines() -> dict[str, list[dict[str, Any]]]:
    """fp32 runs of the horizon study (same harness, seeds, splits, inner lr 3e-3), as records
    of this study: DiLoCo (0.25, 0.8), IsoLoCo (1.8, 0.8), iso_c-sgd (3.96, 0; seed 0 only)."""
    out: dict[str, list[dict[str, Any]]] = {}
    want = {
        ("diloco", 0.8): "diloco-fp32-nesterov",
        ("isoloco", 0.8): "isoloco-fp32-nesterov",
        ("iso_c-sgd", 0.0): "isoloco-fp32-m0",
    }
    files = ("lm_horizon.json", "lm_horizon_tuning.json")
    seen = set()
    for f in files:
        for r in common.load_records(common.RESULTS / f):
            name = want.get((r["method"], r["outer_momentum"]))
            if not name or r["horizon"] != F.HORIZON or r["workers"] != F.WORKERS:
                continue
            if (
                r["inner_lr"] != F.INNER_LR
                or r.get("nesterov") is False
                and name != "isoloco-fp32-m0"
            ):
                continue
            k = F.key(name, r["outer_lr"], r["seed"])
            if k in seen:
                continue
            seen.add(k)
            rec = {**r, "key": k, "config": name, "source": f}
            out.setdefault(name, []).append(rec)
    return out


def config_runs(name: str, done: dict[str, dict]) -> tuple[str, float | None, list[dict]]:
    """(status, chosen lr, runs at that lr by seed) of configuration ``name``."""
    lrs = sorted({r["outer_lr"] for r in done.values() if r["config"] == name})
    if not lrs:
        return "not run", None, []
    runs0 = {lr: done[F.key(name, lr, 0)] for lr in lrs if F.key(name, lr, 0) in done}
    todo, best = F.tuning(name, done)
    if best is None:
        best = min(runs0, key=lambda lr: runs0[lr]["val_loss"]) if runs0 else lrs[0]
        status = "not tuned (1 lr)" if len(runs0) == 1 else f"tuning {len(runs0)} lrs"
    else:
        status = f"tuned ({len(runs0)} lrs)"
    seeds = [done[F.key(name, best, s)] for s in (0, 1, 2) if F.key(name, best, s) in done]
    return status, best, seeds


def _fmt_bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.3g} {unit}"
    return f"{b:.0f} B"


def _run_local0(name: str, b: dict[str, Any], nbytes: dict[str, Any]) -> float:
    """The run total if every node built the initial model itself (a download codec with
    ``nodes_hold_initial=True``): round 1 then sends no arrays down. Plain downloads send the
    full model every round, so nothing changes for them."""
    if F.CONFIGS[name]["down"] != "both":
        return b["total_run"]
    return b["total_run"] - nbytes["workers"] * nbytes["fp32_model_bytes"]


def rows(done: dict[str, dict], nbytes: dict[str, Any]) -> list[dict[str, Any]]:
    base = {
        m: {r["seed"]: r["test_loss"] for r in config_runs(f"{m}-fp32-nesterov", done)[2]}
        for m in ("diloco", "isoloco")
    }
    fp32 = nbytes["configs"]["diloco-fp32-nesterov"]
    out = []
    for name, cfg in F.CONFIGS.items():
        status, lr, seeds = config_runs(name, done)
        b = nbytes["configs"][name]
        tests = {r["seed"]: r["test_loss"] for r in seeds}
        paired = {
            s: t - base[cfg["method"]][s] for s, t in tests.items() if s in base[cfg["method"]]
        }
        out.append(
            {
                "config": name,
                **cfg,
                "status": status,
                "lr": lr,
                "tests": tests,
                "paired": paired,
                "bytes": b,
                "x_fewer": fp32["total_run"] / b["total_run"],
                "x_fewer_round": fp32["total_per_node_round"] / b["total_per_node_round"],
                "x_fewer_local0": fp32["total_run"] / _run_local0(name, b, nbytes),
            }
        )
    return out


def _loss_cells(r: dict[str, Any]) -> tuple[str, str, str]:
    t = r["tests"]
    if not t:
        return "not run", "—", "—"
    vals = list(t.values())
    mean = f"{statistics.mean(vals):.3f}" + (
        f" ± {(max(vals) - min(vals)) / 2:.3f}" if len(vals) > 1 else ""
    )
    every = ", ".join(f"{t[s]:.4f}" for s in sorted(t))
    d = r["paired"]
    paired = ", ".join(f"{d[s]:+.3f}" for s in sorted(d)) if d else "—"
    return f"{mean} (n={len(vals)})", every, paired


def table_text(rs: list[dict[str, Any]]) -> str:
    head = (
        "| config | bytes up / node / round | down | total | x fewer (rounds 2+) | "
        "run total (8 nodes, 60 rounds) | x fewer (run) | x fewer (run, nodes build round 0) | "
        "bytes | outer lr | "
        "test loss, mean ± half-range | every seed (0, 1, 2) | "
        "paired Δ vs fp32 same method, per seed |"
    )
    lines = [head, common.rule(13)]
    for r in rs:
        b = r["bytes"]
        lr = "—" if r["lr"] is None else f"{r['lr']:g} ({r['status']})"
        loss, every, paired = _loss_cells(r)
        lines.append(
            f"| {r['config']} | {b['up_per_node_round']:,.0f} | {b['down_per_node_round']:,.0f} | "
            f"{b['total_per_node_round']:,.0f} | {r['x_fewer_round']:.1f}x | "
            f"{_fmt_bytes(b['total_run'])} | "
            f"{r['x_fewer']:.1f}x | {r['x_fewer_local0']:.1f}x | {b['source']} | {lr} | {loss} | "
            f"{every} | {paired} |"
        )
    return "\n".join(lines)


def plot(rs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for r in rs:
        if not r["tests"]:
            continue
        vals = list(r["tests"].values())
        m = statistics.mean(vals)
        color = "C0" if r["method"] == "diloco" else "C1"
        marker = {"fp32": "o", "int8": "s", "int4": "D", "sl64": "v", "sl128": "^"}[r["codec"]]
        face = color if r["opt"] == "nesterov" else "none"
        ax.errorbar(
            [r["bytes"]["total_run"]],
            [m],
            yerr=[[m - min(vals)], [max(vals) - m]],
            color=color,
            marker=marker,
            mfc=face,
            capsize=3,
            ls="none",
        )
        ax.annotate(
            r["config"].split("-", 1)[1],
            (r["bytes"]["total_run"], m),
            fontsize=6,
            xytext=(4, 2),
            textcoords="offset points",
        )
    fp32 = next(r for r in rs if r["config"] == "diloco-fp32-nesterov")["bytes"]["total_run"]
    ax.axvline(fp32 / GOAL_X, color="grey", ls=":", lw=1)
    ax.annotate(
        "goal: 100x fewer",
        (fp32 / GOAL_X, 0.02),
        xycoords=("data", "axes fraction"),
        fontsize=7,
        color="grey",
        xytext=(3, 0),
        textcoords="offset points",
    )
    ax.set_xscale("log")
    ax.set_xlabel("total bytes of the run (up + down, 8 nodes, 60 rounds; Flower count_bytes)")
    ax.set_ylabel("test loss (nats); bars: seed range")
    ax.set_title(
        "Frontier, LM horizon T = 600, M = 8 (blue DiLoCo, orange IsoLoCo; "
        "hollow: outer momentum 0)",
        fontsize=8,
    )
    fig.tight_layout()
    save_figure(fig, PLOT)
    plt.close(fig)


def table(quick: bool = False) -> str:
    """Regenerate the docs block and the plot from the records (+ fp32 baselines, + bytes)."""
    done = F.recorded(common.load_records(F.RECORDS))
    for recs in baselines().values():
        for r in recs:
            done[r["key"]] = r  # the baseline's own record, not this study's reproduction
    nbytes = common.load_records(F.BYTES) if F.BYTES.is_file() else None
    if not nbytes:
        sys.exit("run --bytes first (comm_frontier_bytes.json)")
    rs = rows(done, nbytes)
    text = table_text(rs)
    if not quick:
        common.write_block(DOC, BEGIN, END, text)
        plot(rs)
    print(text)
    return text


__all__ = ["compute_bytes", "table"]
