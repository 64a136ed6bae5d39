"""Is the data-parallel AdamW reference line tuned? Its inner lr on the main protocol's tokens.

The sweep's ``dp-adamw`` uses the DiLoCo workers' inner schedule (peak lr 3e-3, warm-up, cosine
to 0.1x). A reference line with an untuned lr would flatter every method compared with it, so
this script runs ``dp-adamw`` (M = 8 batches, the main sizing, seed 0) at several peak lrs and
appends one record per lr to ``benchmarks/results/lm_inner_lr.json`` (resumable: a done lr is
skipped). The optimum is chosen on the validation split; the test loss is reported beside it.

    nice -n 19 python benchmarks/lm/lm_inner_lr.py [--lrs 0.0015 0.003 0.006 0.012 0.024] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lm_sweep  # noqa: E402
import lm_sweep_lib as lib  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "lm_inner_lr.json"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lrs", nargs="+", type=float, default=[0.0015, 0.003, 0.006, 0.012, 0.024])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    for lr in args.lrs:
        done = [
            r
            for r in lm_sweep.load_records(args.out)
            if r["inner_lr"] == lr
            and r["seed"] == args.seed
            and r["workers"] == args.workers
            and r["quick"] == args.quick
        ]
        if done:
            print(f"[inner-lr] skip (done): lr {lr}", flush=True)
            continue
        size = {**lib.protocol_size("main", args.workers, args.quick), "inner_lr": lr}
        t0 = time.time()
        out = lib.run_dp_adamw(args.workers, args.seed, size)
        rec = {
            "method": "dp-adamw",
            "protocol": "inner-lr",
            "workers": args.workers,
            "seed": args.seed,
            "inner_lr": lr,
            "quick": args.quick,
            "val_loss": out["val_loss"],
            "test_loss": out["test_loss"],
            "val_curve": out["val_curve"],
            "wall_s": out["wall_s"],
            "size": size,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "load_avg": os.getloadavg()[0],
        }
        lm_sweep.append_record(args.out, rec)
        print(
            f"[inner-lr] lr {lr}: val {rec['val_loss']:.4f} test {rec['test_loss']:.4f} "
            f"({rec['wall_s']:.0f} s)",
            flush=True,
        )
    recs = [r for r in lm_sweep.load_records(args.out) if r["quick"] == args.quick]
    if recs:
        best = min(recs, key=lambda r: r["val_loss"])
        print(
            json.dumps(
                {
                    "best_inner_lr": best["inner_lr"],
                    "val": best["val_loss"],
                    "test": best["test_loss"],
                }
            )
        )


if __name__ == "__main__":
    main()
