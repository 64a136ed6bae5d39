"""Markdown tables from the lm_sweep results (stdout): tuning grids and the main cells.

    python benchmarks/lm_sweep_report.py [--sweep benchmarks/results/lm_sweep.json]
        [--tuning benchmarks/results/lm_tuning.json] [--protocol main]

Main table: one row per (method, M) with the mean and sample standard deviation of the test
and validation losses over seeds, and every seed's test loss. Tuning table: one row per
(method, M, momentum), the validation loss at each outer lr; the optimum is marked ``*``.
Quick (``--quick``) records are ignored.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text()) if not r.get("quick")] if path.is_file() else []


def tuning_table(recs: list[dict]) -> str:
    """Validation loss per (method, M, momentum) row and outer-lr column; ``*`` = optimum."""
    out = []
    for (method, m) in sorted({(r["method"], r["workers"]) for r in recs}):
        group = [r for r in recs if r["method"] == method and r["workers"] == m]
        best = min(group, key=lambda r: r["val_loss"])
        lrs = sorted({r["outer_lr"] for r in group})
        out += [f"\n{method}, M = {m} (validation loss; * = optimum)\n",
                "| momentum | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                "|---" * (len(lrs) + 1) + "|"]
        for mu in sorted({r["outer_momentum"] for r in group}):
            cells = []
            for lr in lrs:
                r = next((r for r in group if r["outer_lr"] == lr and r["outer_momentum"] == mu), None)
                cells.append("" if r is None else f"{r['val_loss']:.4f}{'*' if r is best else ''}")
            out.append(f"| {mu:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main_table(recs: list[dict], protocol: str) -> str:
    """Mean +- sd over seeds of test and validation loss per (method, M)."""
    cells = defaultdict(list)
    for r in recs:
        if r["protocol"] == protocol:
            cells[(r["method"], r["workers"])].append(r)
    rows = ["| method | M | seeds | test loss mean | sd | val loss mean | outer lr / mu (source) | test per seed |",
            "|---|---|---|---|---|---|---|---|"]
    for (method, m), group in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        group.sort(key=lambda r: r["seed"])
        test = [r["test_loss"] for r in group]
        val = [r["val_loss"] for r in group]
        sd = f"{statistics.stdev(test):.4f}" if len(test) > 1 else "-"
        hp = {(r["outer_lr"], r["outer_momentum"], r.get("hp_source")) for r in group}
        hp_s = "; ".join(f"{lr} / {mu} ({src})" for lr, mu, src in sorted(hp, key=str))
        seeds = ", ".join(f"s{r['seed']}: {r['test_loss']:.4f}" for r in group)
        rows.append(f"| {method} | {m} | {len(group)} | {statistics.mean(test):.4f} | {sd} | "
                    f"{statistics.mean(val):.4f} | {hp_s} | {seeds} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", type=Path, default=RESULTS / "lm_sweep.json")
    ap.add_argument("--tuning", type=Path, default=RESULTS / "lm_tuning.json")
    ap.add_argument("--protocol", default="main")
    args = ap.parse_args()
    print("## Tuning grid\n" + tuning_table(_load(args.tuning)))
    print(f"\n## Cells, protocol {args.protocol}\n\n" + main_table(_load(args.sweep), args.protocol))


if __name__ == "__main__":
    main()
