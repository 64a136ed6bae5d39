"""IsoLoCo vs DiLoCo on the isoloco-lm app, same seed and budget, at M = 4 and M = 8 workers.

Each run is a real ``flwr run`` of ``simulations/isoloco-lm`` through ``scripts/run_app.sh``
(private SuperLink, Ray simulation, one CPU per ClientApp) with the app's default run config
except the strategy and the worker count. Records wall time, final validation loss and the
validation curve per run into ``benchmarks/results/lm_experiments.json`` (runs are merged in by
name, so the script can be re-run for a subset), then draws ``docs/img/lm_val_loss.png`` and
rewrites the generated table in ``docs/results-lm.md``.

    nice -n 10 python benchmarks/lm/lm_experiments.py [--workers 4 8] [--runs isoloco diloco]
        [--extra]   # also iso_c vs mean without outer momentum (docs/algorithms.md table values)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
APP = REPO / "simulations" / "isoloco-lm"
RESULTS = common.RESULTS / "lm_experiments.json"
PLOT = REPO / "docs" / "img" / "lm_val_loss.png"
DOC = REPO / "docs" / "results-lm.md"
COLORS = {"isoloco": "C3", "diloco": "C0", "fedavg": "C1", "iso_c-nomom": "C2", "mean-nomom": "C4"}
# legend text: what each run is (the app's defaults; the outer values of RUNS below)
LABELS = {
    "isoloco": "IsoLoCo (Iso-C merge, outer lr 1.8, Nesterov 0.8)",
    "diloco": "DiLoCo (mean merge, outer lr 0.7, Nesterov 0.9)",
    "fedavg": "FedAvg (mean, outer lr 1, no momentum)",
    "iso_c-nomom": "Iso-C merge, outer lr 2.1, no momentum",
    "mean-nomom": "mean merge, outer lr 1.6, no momentum",
}
BEGIN, END = "<!-- BEGIN GENERATED TABLE -->", "<!-- END GENERATED TABLE -->"

# name -> run-config overrides (besides the worker count); tuned outer values from the paper
RUNS = {
    "isoloco": ["strategy.name='isoloco'"],
    # the paper's DiLoCo values, explicit: the app's -1 now means the rule's sweep-tuned values
    "diloco": ["strategy.name='diloco'", "strategy.outer-lr=0.7", "strategy.outer-momentum=0.9"],
    "fedavg": ["strategy.name='fedavg'"],
    "iso_c-nomom": [
        "strategy.name='diloco'",
        "strategy.merge='iso_c'",
        "strategy.outer-lr=2.1",
        "strategy.outer-momentum=0.0",
    ],
    "mean-nomom": [
        "strategy.name='diloco'",
        "strategy.merge='mean'",
        "strategy.outer-lr=1.6",
        "strategy.outer-momentum=0.0",
    ],
}


def run_one(name: str, workers: int, out_root: Path, extra: list[str]) -> dict:
    out = out_root / f"{name}-M{workers}"
    overrides = [*RUNS[name], f"strategy.min-nodes={workers}", *extra]
    env = {**os.environ, "NUM_SUPERNODES": str(workers), "CPUS_PER_CLIENT": "1"}
    cmd = ["bash", str(REPO / "scripts" / "run_app.sh"), str(APP), str(out), *overrides]
    print(f"[lm_experiments] {name} M={workers}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{name} M={workers} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    res = json.loads((out / "results.json").read_text())
    rounds = res["rounds"]
    return {
        "name": name,
        "workers": workers,
        "overrides": overrides,
        "command": " ".join(cmd),
        "wall-time-s": wall,
        "flwr-run-wall-s": json.loads((out / "run_app.json").read_text())["wall-time-s"],
        "final-val-loss": rounds[-1]["val-loss"],
        "final-val-ppl": rounds[-1]["val-ppl"],
        "initial-val-loss": res["initial"]["val-loss"],
        "val-loss": [r["val-loss"] for r in rounds],
        "train-loss": [r["train-loss"] for r in rounds],
        "mean-aggregation-s": sum(r["aggregation-time-s"] for r in rounds) / len(rounds),
        "mean-round-wall-s": sum(r["round-wall-s"] for r in rounds[1:]) / max(len(rounds) - 1, 1),
        "replies-used": [r["replies-used"] for r in rounds],
        "config": res["config"],
        "load-avg-after": os.getloadavg(),
        "output-dir": str(out),
    }


def plot(entries: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flwr_isoloco.plotting import save_figure

    ms = sorted({e["workers"] for e in entries.values()})
    fig, axes = plt.subplots(1, len(ms), figsize=(5.5 * len(ms), 4), squeeze=False)
    for ax, m in zip(axes[0], ms, strict=True):
        for e in sorted(
            (e for e in entries.values() if e["workers"] == m), key=lambda e: e["name"]
        ):
            xs = list(range(0, len(e["val-loss"]) + 1))
            color = COLORS.get(e["name"])
            label = LABELS.get(e["name"], e["name"])
            ax.plot(
                xs, [e["initial-val-loss"], *e["val-loss"]], "o-", ms=3, label=label, color=color
            )
        ax.set_title(f"M = {m} workers")
        ax.set_xlabel("outer round")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, PLOT)  # atomic, 0644
    plt.close(fig)


def table(entries: dict) -> str:
    rows = [
        "| run | M | final val loss | final ppl | wall time (s) | mean round (s) | mean aggregation (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in sorted(entries.values(), key=lambda e: (e["workers"], e["name"])):
        rows.append(
            f"| {LABELS.get(e['name'], e['name'])} (`{e['name']}`) | {e['workers']} | {e['final-val-loss']:.4f} | {e['final-val-ppl']:.1f} | "
            f"{e['wall-time-s']:.0f} | {e['mean-round-wall-s']:.1f} | {e['mean-aggregation-s']:.3f} |"
        )
    return "\n".join(rows)


def update_doc(entries: dict) -> None:
    text = DOC.read_text() if DOC.exists() else f"# Language-model results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table(entries)}\n{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--runs", nargs="+", default=["isoloco", "diloco"], choices=sorted(RUNS))
    ap.add_argument("--extra", action="store_true", help="also iso_c-nomom and mean-nomom")
    ap.add_argument("--out-root", type=Path, default=REPO / "outputs" / "lm_experiments")
    ap.add_argument("--set", nargs="*", default=[], help="extra run-config overrides for every run")
    ap.add_argument("--report-only", action="store_true", help="redraw plot and table only")
    args = ap.parse_args()
    runs = list(args.runs) + (["iso_c-nomom", "mean-nomom"] if args.extra else [])
    entries = json.loads(RESULTS.read_text())["runs"] if RESULTS.exists() else {}
    if not args.report_only:
        for m in args.workers:
            for name in runs:
                e = run_one(name, m, args.out_root, args.set)
                entries[f"{name}-M{m}"] = e
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps({"runs": entries}, indent=2))
                print(
                    f"[lm_experiments] {name} M={m}: final val loss {e['final-val-loss']:.4f}, "
                    f"wall {e['wall-time-s']:.0f} s",
                    flush=True,
                )
    plot(entries)
    update_doc(entries)
    print(table(entries))


if __name__ == "__main__":
    sys.exit(main())
