"""Kill experiment: the same deployment run with and without one SuperNode SIGKILLed mid-run.

On a loopback TLS deployment (tests/deploy_harness.py: SuperLink with SuperNode auth, N
SuperNodes), for each app: a run without faults, then the same run (same seed and config) in
which SuperNode ``--victim`` is SIGKILLed (with its child processes) once ``--kill-after``
rounds are in results.json. Prints rounds completed, replies lost and the final metric of both.

    python benchmarks/faults/kill_experiment.py --app isoloco --rounds 3
    python benchmarks/faults/kill_experiment.py --app rwlora --rounds 4 --victim next

The tiny configs are the loopback test's (tests/test_deployment.py); --rounds overrides the
number of rounds. ``--victim next`` (RW-LoRA) kills the vertex the walk visits right after the
kill point in the fault-free run, so the kill certainly costs a hop.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("tests")

from deploy_harness import loopback_deployment  # noqa: E402
from test_deployment import (  # noqa: E402
    ISOLOCO_APP,
    ISOLOCO_CONFIG,
    KILL_ROUND_TIMEOUT,
    RWLORA_APP,
    RWLORA_CONFIG,
    _isoloco_summary,
    _restore_all_nodes,
    _rwlora_summary,
    _wait_for_rounds,
)

APPS = {
    # name: (app dir, run config, summary fn, results rows before the first trained round)
    "isoloco": (ISOLOCO_APP, ISOLOCO_CONFIG, _isoloco_summary, 0),
    "rwlora": (RWLORA_APP, RWLORA_CONFIG, _rwlora_summary, 1),  # row 0 = initial evaluation
}


def run_pair(dep, app: str, rounds: int, kill_after: int, victim: str, out: Path) -> dict:
    app_dir, base, summarize, offset = APPS[app]
    config = {**base, "num-server-rounds": rounds}
    clean_out = out / f"{app}-no-kill"
    run = dep.run_app(app_dir, {**config, "output-dir": str(clean_out)}, 1800)
    if run.status != "finished:completed":
        raise RuntimeError(f"{app} fault-free run: {run.status}\n{run.output}\n{run.logs}")
    clean = summarize(json.loads((clean_out / "results.json").read_text()))
    clean["wall-s"] = round(run.wall_s, 1)

    if victim == "next":
        walk = clean.get("walk", [])
        if len(walk) <= kill_after:
            raise ValueError("--victim next needs --rounds > --kill-after and an RW-LoRA walk")
        target = int(walk[kill_after])
    else:
        target = int(victim)
    _restore_all_nodes(dep)
    kill_out = out / f"{app}-kill"
    running = dep.start_app(
        app_dir,
        {**config, "round-timeout": KILL_ROUND_TIMEOUT, "output-dir": str(kill_out)},
        1800,
    )
    _wait_for_rounds(kill_out / "results.json", kill_after + offset, running, 1800)
    dep.kill_supernode(target)
    outcome = running.wait()
    killed = {"status": outcome.status, "victim": target, "wall-s": round(outcome.wall_s, 1)}
    if (kill_out / "results.json").exists():
        killed.update(summarize(json.loads((kill_out / "results.json").read_text())))
    _restore_all_nodes(dep)
    return {"app": app, "kill-after-round": kill_after, "no-kill": clean, "kill": killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", choices=[*APPS, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=1, help="rounds done before the kill")
    parser.add_argument("--victim", default="2", help="SuperNode index, or 'next' (RW-LoRA)")
    parser.add_argument("--out", type=Path, default=None, help="keep outputs here")
    args = parser.parse_args()
    if not 1 <= args.kill_after < args.rounds:
        parser.error("need 1 <= --kill-after < --rounds")

    root = args.out or Path(tempfile.mkdtemp(prefix="kill-experiment-"))
    apps = list(APPS) if args.app == "both" else [args.app]
    reports = []
    try:
        with loopback_deployment(root / "deployment", num_supernodes=3) as dep:
            for app in apps:
                victim = args.victim
                if victim == "next" and app != "rwlora":
                    victim = "2"
                reports.append(run_pair(dep, app, args.rounds, args.kill_after, victim, root))
                print(json.dumps(reports[-1], indent=2), flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print("\napp      run      rounds  replies/hops lost  final metric")
    for r in reports:
        key = "final-val-loss" if r["app"] == "isoloco" else "final-test-accuracy"
        for kind in ("no-kill", "kill"):
            s = r[kind]
            lost = s.get("replies-lost", s.get("hop-failures-total"))
            print(f"{r['app']:8s} {kind:8s} {s.get('rounds')!s:7s} {lost!s:18s} {key}={s.get(key)}")


if __name__ == "__main__":
    main()
