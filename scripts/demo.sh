#!/usr/bin/env bash
# The README demo: IsoLoCo pre-training of a small LLaMA on Shakespeare, 4 simulated nodes.
#
#   bash scripts/install.sh && bash scripts/demo.sh
#
# Runs `flwr run simulations/isoloco-lm` with the app's default run config (only the output
# folder is set: <repo>/outputs/demo-<UTC time>) against a private SuperLink and FLWR_HOME under
# <repo>/.flwr/ (see scripts/run_app.sh), checks that the run completed, prints where the results
# are, and stops everything it started. NUM_SUPERNODES / CPUS_PER_CLIENT override the federation.
set -euo pipefail

main() {  # parsed whole before it runs (safe to edit while a demo runs)
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT="$REPO/outputs/demo-$(date -u +%Y%m%d-%H%M%S)"
T0=$(date +%s)
bash "$REPO/scripts/run_app.sh" "$REPO/simulations/isoloco-lm" "$OUT"
T1=$(date +%s)
"$REPO/.venv/bin/python" - "$OUT" "$((T1 - T0))" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = json.load(open(out / "results.json"))
first, last = res["initial"], res["rounds"][-1]
print(f"demo: {len(res['rounds'])} rounds of {res['config']['strategy']['name']} on "
      f"{res['rounds'][-1]['replies-used']} nodes in {sys.argv[2]} s: validation loss "
      f"{first['val-loss']:.3f} -> {last['val-loss']:.3f} (perplexity {last['val-ppl']:.1f})")
# every entry of the output folder with its size, largest first (node-state/ holds the
# clients' optimiser moments for a resume and is usually the largest)
def size(p):
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
def human(n):
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
entries = sorted(((size(p), p.name + ("/" if p.is_dir() else "")) for p in out.iterdir()), reverse=True)
print(f"demo: results in {out} ({human(sum(n for n, _ in entries))}): "
      + ", ".join(f"{name} {human(n)}" for n, name in entries))
PY
}

main "$@"
