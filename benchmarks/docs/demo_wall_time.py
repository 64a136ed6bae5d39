"""Wall time of the README demo (``bash scripts/demo.sh``), with the machine's load recorded.

Runs the demo once as a user would and appends one record to
``benchmarks/results/demo_wall_time.json``: the seconds end to end (this script's clock), the
seconds ``demo.sh`` printed, the CPU count, the 1-minute load average before and after, the
commit and whether the working tree had uncommitted changes, and the validation loss the demo
printed. The README's and docs/results-lm.md's demo times are read from this file.

    .venv/bin/python benchmarks/docs/demo_wall_time.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
OUT = common.RESULTS / "demo_wall_time.json"
DEMO_LINE = re.compile(
    r"demo: (\d+) rounds of (\S+) on (\d+) nodes in (\d+) s: validation loss "
    r"([0-9.]+) -> ([0-9.]+) \(perplexity ([0-9.]+)\)"
)


def main() -> None:
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")], cwd=REPO, capture_output=True, text=True
    )
    wall = time.monotonic() - t0
    load_after = os.getloadavg()[0]
    match = DEMO_LINE.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        sys.stdout.write(proc.stdout[-4000:])
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"demo failed (exit {proc.returncode}); nothing recorded")
    rounds, strategy, nodes, demo_s, first, last, ppl = match.groups()
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "bash scripts/demo.sh",
        "commit": common.git("rev-parse", "HEAD"),
        "uncommitted-changes": bool(common.git("status", "--porcelain", "--untracked-files=no")),
        "cpus": os.cpu_count(),
        "load-avg-1min-before": round(load_before, 2),
        "load-avg-1min-after": round(load_after, 2),
        "wall-time-s": round(wall, 1),
        "demo-printed-s": int(demo_s),
        "rounds": int(rounds),
        "strategy": strategy,
        "nodes": int(nodes),
        "initial-val-loss": float(first),
        "final-val-loss": float(last),
        "final-val-ppl": float(ppl),
    }
    data = json.loads(OUT.read_text()) if OUT.exists() else {"runs": []}
    data["runs"].append(record)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
