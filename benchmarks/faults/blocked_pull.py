"""Blocked pull: a SuperNode SIGKILLed while it uploads its reply, before and after core/pull.py.

When a SuperNode dies mid-upload, the SuperLink holds its reply's message but not all of the
message's objects; Flower 1.42's ``HttpGrid.pull_messages`` then retries the missing objects
until the SuperLink drops the upload's push session (``OBJECT_PUSH_SESSION_TTL_SECONDS``, 180 s)
and only then returns a MESSAGE_UNAVAILABLE error reply. The round drivers used to pull inline,
one id per call, so such a reply held the whole round for ~3 minutes; since commit 9f8127f
(``flwr_isoloco/strategies/core/pull.py``) each pull call runs in a daemon thread that the
round never waits for past its deadline (nor more than 1 s per sweep).

On a loopback TLS deployment (``tests/deploy_harness.py``: SuperLink with SuperNode auth, 3
SuperNodes) the app ``blocked-pull-app/`` runs one round of synchronous DiLoCo with
``Rounds(quorum=2, grace_s)`` and a round timeout of 60 s. Partition 2 (the doomed node)
replies with a ``--ballast-mb`` MB ArrayRecord besides its 2-float model; this script waits for
its SuperNode to log ``Sending: train message``, sleeps ``--kill-delay`` seconds and SIGKILLs it
(with its ClientApp), so the upload to the SuperLink is incomplete. Scenarios (``--scenario``):

- ``grace``: the two other nodes reply first (the quorum); the doomed node is let go 1 s after
  their replies were written and dies within the grace window (``grace-s`` 20 s). The round
  should close on its quorum + grace, the doomed node named late.
- ``held``: the doomed node replies first and dies; the other two are let go 1 s after the kill.

Each variant runs the same deployment: ``after`` imports this checkout's flwr_isoloco,
``before`` the commit before the pull change (``--before-rev``, default ``9f8127f~1``), checked
out into a temporary ``git worktree`` (removed at the end) and put first on the deployment's
PYTHONPATH, so the SuperLink's ServerApp process imports it (the app records
``flwr_isoloco.__file__``; the script checks it). Recorded per run: the round's wall time (the
ServerApp's ``run_round``), its ``wait-s`` and reply counts, whether the doomed node was named
late, whether a MESSAGE_UNAVAILABLE reply reached the server, the run's wall time.

Measured (2 shared cores, load 2-13, 256 MB ballast, kill 0.3 s after ``Sending``; the upload
was cut in every run): ``grace``: before 193.1 s and 188.6 s (the round waited for the
MESSAGE_UNAVAILABLE reply, then closed with the 2 fast replies merged), after 26.0 s and 27.7 s
(quorum + 20 s grace; the doomed node named late).
``held``: before 192.7 s (2 replies merged); after 7.7 s (2 replies merged, the doomed node
named late). The first version of the new pulls (9f8127f) took 60.2 s here (the timeout, 0 of 3
replies: the call that pulled the doomed reply had been asked for all three ids and a running
call's ids were never asked again; recorded as variant ``after-first-puller``); a call running
past its patience now has its ids asked again.

    nice -n 10 python benchmarks/faults/blocked_pull.py                    # grace, before + after
    nice -n 10 python benchmarks/faults/blocked_pull.py --scenario held --variant after
    nice -n 10 python benchmarks/faults/blocked_pull.py --quick            # grace, after only

Records go to ``benchmarks/results/blocked_pull.json`` (``--quick``: ``blocked_pull_quick.json``);
a run whose key (scenario, variant, kill delay, ballast, repetition) is there already is
skipped, so an interrupted study resumes. The waits and the ballast live in the app, not in the
library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("tests")

from deploy_harness import loopback_deployment  # noqa: E402

APP = Path(__file__).resolve().parent / "blocked-pull-app"
DOOMED = 2
SENDING = "Sending: train message"
UNAVAILABLE = "Reply message objects are unavailable"
GRACE_S = {"grace": 20.0, "held": 1.0}


def _wait(what: str, done, run, timeout: float, poll: float = 0.01) -> float:
    """Poll ``done()`` until true (returns ``time.time()`` then); fail if the run ends."""
    deadline = time.monotonic() + timeout
    while not done():
        if not run.process.alive():
            raise RuntimeError(f"run ended before {what}:\n{run.process.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(poll)
    return time.time()


def run_once(root: Path, scenario: str, kill_delay: float, ballast_mb: int) -> dict:
    """One deployment, one round, the doomed SuperNode killed mid-upload; the measurements."""
    out = root / "out"
    cfg = {
        "output-dir": str(out),
        "first": "fast" if scenario == "grace" else "doomed",
        "grace-s": GRACE_S[scenario],
        "ballast-mb": ballast_mb,
    }
    with loopback_deployment(root / "dep", num_supernodes=3) as dep:
        doomed = dep.supernodes[DOOMED]
        log = doomed.process.log_path
        run = dep.start_app(APP, cfg, 600)
        if scenario == "grace":
            fast = [out / f"replying-{p}" for p in range(3) if p != DOOMED]
            _wait("the fast replies", lambda: all(f.exists() for f in fast), run, 300, 0.05)
            time.sleep(1.0)  # pulled (25 ms polls), the quorum is in: its grace window runs
            (out / "go").write_text("")
            t_go = time.time()
        t_send = _wait("the doomed node's upload", lambda: SENDING in log.read_text(), run, 300)
        time.sleep(kill_delay)
        t_kill = time.time()
        dep.kill_supernode(DOOMED)
        if scenario == "held":
            time.sleep(1.0)
            (out / "go").write_text("")
            t_go = time.time()
        outcome = run.wait()
        t_end = time.time()
        upload_log = log.read_text(errors="replace")
    failed = {
        "status": outcome.status,
        "run-wall-s": round(outcome.wall_s, 1),
        "round-to-kill-s": None,
        "kill-to-run-end-s": round(t_end - t_kill, 2),
        "upload-finished-before-kill": "Sent successfully" in upload_log,
        "doomed-named-late": bool(
            re.search(rf"closed without the reply of node {doomed.node_id}, late", outcome.logs)
        ),
        # the ServerApp's warnings, errors and traceback (a run that wrote no results.json)
        "log-lines": [
            re.sub(r"\x1b\[[0-9;]*m", "", ln)
            for ln in outcome.logs.splitlines()
            if re.search(r"WARN|ERROR|Error|^\s+File|raise", ln)
        ][-40:],
    }
    if not (out / "results.json").is_file():
        return {**failed, "flwr-isoloco-file": "", "round-wall-s": None, "wait-s": None}
    results = json.loads((out / "results.json").read_text())
    metrics = results["train_metrics"].get("1", {})
    return {
        "status": outcome.status,
        "flwr-isoloco-file": results["flwr-isoloco-file"],
        "round-wall-s": round(results["round-wall-s"]["1"], 2),
        "wait-s": round(metrics["wait-s"], 2) if "wait-s" in metrics else None,
        "replies-arrived": metrics.get("replies-arrived"),
        "replies-used": metrics.get("replies-used"),
        "replies-late": metrics.get("replies-late"),
        "doomed-named-late": bool(
            re.search(rf"closed without the reply of node {doomed.node_id}, late", outcome.logs)
        ),
        "message-unavailable-reply": UNAVAILABLE in outcome.logs,
        "upload-finished-before-kill": "Sent successfully" in upload_log,
        # since the round started (the ServerApp's run_round, same machine clock)
        "round-to-go-s": round(t_go - results["round-marks"]["1"][0], 2),
        "round-to-sending-s": round(t_send - results["round-marks"]["1"][0], 2),
        "round-to-kill-s": round(t_kill - results["round-marks"]["1"][0], 2),
        "kill-to-run-end-s": round(t_end - t_kill, 2),
        "run-wall-s": round(outcome.wall_s, 1),
        "final-params": results["final_params"],
    }


def key(rec: dict) -> tuple:
    return (rec["scenario"], rec["variant"], rec["kill-delay-s"], rec["ballast-mb"], rec["rep"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["grace", "held", "both"], default="grace")
    ap.add_argument("--variant", choices=["before", "after", "both"], default="both")
    ap.add_argument("--kill-delay", type=float, default=0.3, help="s after 'Sending: train'")
    ap.add_argument("--ballast-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--before-rev", default="9f8127f~1")
    ap.add_argument("--quick", action="store_true", help="the grace scenario, after only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    common.offline_env()
    scenarios = ["grace", "held"] if args.scenario == "both" else [args.scenario]
    variants = ["before", "after"] if args.variant == "both" else [args.variant]
    if args.quick:
        scenarios, variants = ["grace"], ["after"]
    path = args.out or common.RESULTS / (
        "blocked_pull_quick.json" if args.quick else "blocked_pull.json"
    )
    done = {key(r) for r in common.load_records(path)}
    old_path = os.environ.get("PYTHONPATH", "")
    worktree = None
    try:
        for rep in range(args.repeat):
            for scenario in scenarios:
                for variant in variants:
                    rec = {
                        "scenario": scenario,
                        "variant": variant,
                        "kill-delay-s": args.kill_delay,
                        "ballast-mb": args.ballast_mb,
                        "rep": rep,
                    }
                    if key(rec) in done:
                        print(f"skip {key(rec)} (recorded)", flush=True)
                        continue
                    if variant == "before":
                        if worktree is None:
                            worktree = Path(tempfile.mkdtemp(prefix="blocked-pull-before-"))
                            worktree.rmdir()
                            subprocess.run(
                                ["git", "worktree", "add", "--detach", str(worktree),
                                 args.before_rev],
                                cwd=common.REPO, check=True, capture_output=True,
                            )  # fmt: skip
                        rec["rev"] = common.git("rev-parse", "--short", args.before_rev)
                        os.environ["PYTHONPATH"] = os.pathsep.join(
                            [str(worktree)] + [old_path] * bool(old_path)
                        )
                    else:
                        rec["rev"] = common.git("rev-parse", "--short", "HEAD")
                        os.environ["PYTHONPATH"] = old_path
                    want = str(worktree if variant == "before" else common.REPO)
                    print(f"run {key(rec)} ...", flush=True)
                    with tempfile.TemporaryDirectory(prefix="blocked-pull-") as tmp:
                        rec.update(run_once(Path(tmp), scenario, args.kill_delay, args.ballast_mb))
                    rec["imports-wanted-checkout"] = rec["flwr-isoloco-file"].startswith(want)
                    rec["grace-s"] = GRACE_S[scenario]
                    rec["machine"] = {"cpus": os.cpu_count(), "load-avg": list(os.getloadavg())}
                    common.append_record(path, rec)
                    print(json.dumps(rec, indent=1), flush=True)
    finally:
        os.environ["PYTHONPATH"] = old_path
        if worktree is not None:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(worktree)],
                cwd=common.REPO,
                check=False,
            )
    records = common.load_records(path)
    print("\nscenario variant  delay  round-wall-s  wait-s  arrived  doomed-late  unavailable")
    for r in records:
        print(
            f"{r['scenario']:8} {r['variant']:7} {r['kill-delay-s']:5}  {r['round-wall-s']!s:12}  "
            f"{r['wait-s']!s:6}  {r.get('replies-arrived')!s:7}  {r['doomed-named-late']!s:11}  "
            f"{r.get('message-unavailable-reply')}"
        )


if __name__ == "__main__":
    main()
