"""Load benchmark: the chaos federation with many SuperNodes and a SmolLM2-sized message, no faults.

The federation is ``tests/deploy_harness.py``'s loopback TLS deployment (SuperLink with SuperNode
authentication, N SuperNodes each its own process); the SuperLink's state on disk
(``--database <root>/superlink.db``) or in memory (``:flwr-in-memory:``). One record per cell in
``benchmarks/results/chaos_load.json``.

The app is the LM app's ServerApp (IsoLoCo, the chaos test's quorum: a round closes
``strategy.grace-s`` = 2 s after 60 % of its replies are in) with the benchmark-only synthetic
workers of ``benchmarks/memory/server_memory.py --synthetic`` (they train nothing and answer each
train message with a seeded pseudo-gradient of the received arrays' shapes: the reply is as
large as the download). Size ``smollm2-shapes`` (default): the built-in LLaMA with
SmolLM2-135M's layers (hidden 576, 30 layers, 9 heads, 3 k/v heads, intermediate 1536) and,
untied, a vocabulary of 24,576, so ``2 x 24576 x 576`` = SmolLM2's tied ``49152 x 576`` and the
model has SmolLM2-135M's 134,515,008 parameters: 538 MB of fp32 per message, each way, without
the GGUF package (``smollm2``, ``server_memory.SYNTHETIC_SIZES``, runs that one where installed).

Memory bounds what a cell may send: every node that trains holds the message twice over (its
SuperNode, and its ClientApp process, which also builds the reply), so only ``--per-round K``
of the N nodes train each round (``strategy.fraction-train = (K + 0.5) / N``, floor'd by the
strategy to K). A cell starts only if the estimate from a smaller recorded cell
(:func:`estimate_gb`) is under ``--budget-gb``, and a guard stops the deployment (every process
it started) when the machine's available memory drops under ``--min-free-gb``: the cell is then
recorded ``aborted-low-memory``.

    nice -n 19 .venv/bin/python benchmarks/faults/chaos_load.py --quick    # 4 nodes, tiny model
    nice -n 19 .venv/bin/python benchmarks/faults/chaos_load.py --nodes 4 8 --per-round 2
    nice -n 19 .venv/bin/python benchmarks/faults/chaos_load.py --nodes 32 --per-round 2
    .venv/bin/python benchmarks/faults/chaos_load.py --table               # markdown, stdout

A cell (mode, size, SuperNodes, database, K, rounds) already recorded ``ok`` or
``aborted-low-memory`` is skipped (``--force`` runs it again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("tests", "benchmarks/memory", "benchmarks/faults")

from chaos import MemoryMonitor, Sampler, kind_of  # noqa: E402
from chaos_scenario import CONFIG  # noqa: E402
from deploy_harness import IN_MEMORY, loopback_deployment  # noqa: E402
from server_memory import SYNTHETIC_SIZES, synthetic_app, wait_for_memory  # noqa: E402

OUT = common.RESULTS / "chaos_load.json"
GIB = 2**30
SIZES = {
    "smollm2-shapes": [
        "model.hidden=576", "model.layers=30", "model.heads=9", "model.kv-heads=3",
        "model.intermediate=1536", "model.vocab-size=24576", "data.val-tokens=1280",
    ],
    "smollm2": SYNTHETIC_SIZES["smollm2"],
    "tiny-synthetic": SYNTHETIC_SIZES["tiny-synthetic"],
}  # fmt: skip
DATABASES = {"on-disk": None, "in-memory": IN_MEMORY}  # None: the harness's root/superlink.db
# run-log lines kept in the record: lost or late replies, errors (Flower's and the app's)
PROBLEM = re.compile(r"dropped reply|no reply|lost node|Node Unavailable|ERROR|Traceback")
KEY = ("mode", "size", "supernodes", "database", "per_round", "rounds_planned")


def overrides(items: list[str]) -> dict:
    """``["model.hidden=576", "model.name-or-path='smollm2'"]`` -> run-config values: a quoted
    string, ``true`` / ``false``, an int, else a float."""
    out: dict = {}
    for item in items:
        key, value = item.split("=", 1)
        if value[:1] in "'\"" and value:
            out[key] = value[1:-1]
        elif value in ("true", "false"):
            out[key] = value == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = float(value)
    return out


def fraction_for(nodes: int, per_round: int) -> float:
    """``strategy.fraction-train`` that makes the strategy sample ``per_round`` of ``nodes``:
    it takes ``k = max(floor(fraction N), min-nodes)``; ``(K + 0.5) / N`` floors to K whatever
    the float rounding (1.0 when K = N)."""
    if not 1 <= per_round <= nodes:
        raise ValueError(f"--per-round {per_round} must be within 1..{nodes}")
    return 1.0 if per_round == nodes else (per_round + 0.5) / nodes


def run_config(size: str, nodes: int, per_round: int, rounds: int, out: Path) -> dict:
    """The chaos test's CONFIG (IsoLoCo, quorum 0.6, grace 2 s) at ``size``, K of N nodes per
    round; no resume, a longer round timeout (a 538 MB round on 2 shared cores is minutes)."""
    return {
        **CONFIG,
        **overrides(SIZES[size]),
        "num-server-rounds": rounds,
        "round-timeout": 900.0,
        "strategy.fraction-train": fraction_for(nodes, per_round),
        "output-dir": str(out),
    }


def db_bytes(database: Path | str) -> int:
    """Bytes of the SuperLink's SQLite file with its ``-wal`` / ``-shm`` (0 in memory)."""
    if database == IN_MEMORY:
        return 0
    path = Path(database)
    return sum(
        p.stat().st_size for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()
    )


class Guard(Sampler):
    """Each second: the summed RSS and the count of the processes of each kind (the
    MemoryMonitor keeps the largest one), the database file's size, and the machine's available
    memory; under ``min_free_gb``, or past ``deadline`` (``HH:MM`` UTC), it stops the whole
    deployment (``dep.close()``)."""

    join_s = 30.0

    def __init__(self, min_free_gb: float, deadline: str = "", interval_s: float = 1.0) -> None:
        super().__init__()
        self.min_free_gb, self.deadline, self.interval_s = min_free_gb, deadline, interval_s
        self.total_peak: dict[str, float] = {}
        self.max_peak: dict[str, float] = {}  # the largest process, orphans included
        self.count_peak: dict[str, int] = {}
        self.all_peak_mb = 0.0
        self.db_peak = 0
        self.idle_mb: dict[str, float] = {}  # per kind, the smallest process at the first sample
        self.min_available_gb = math.inf
        self.aborted: str | None = None

    @staticmethod
    def processes(dep) -> list[psutil.Process]:
        """Every live process the deployment started and their descendants, also those that
        left the tree: a ServerApp whose SuperExec died is re-parented to init (seen with the
        on-disk database), so each descendant is remembered (``remember_descendants``: the
        harness's teardown then stops it too) and found again by pid and start time."""
        found: dict[int, psutil.Process] = {}
        for proc in list(dep._procs):
            proc.remember_descendants()
            for pid, started in [(proc.pid, None), *proc.descendants.items()]:
                try:
                    p = psutil.Process(pid)
                    if (started is None or p.create_time() == started) and p.status() != "zombie":
                        found[pid] = p
                except psutil.Error:
                    continue
        return list(found.values())

    def sample(self, dep) -> None:
        total: dict[str, float] = {}
        count: dict[str, int] = {}
        low: dict[str, float] = {}
        for p in self.processes(dep):
            try:
                kind, mb = kind_of(p.cmdline()), p.memory_info().rss / common.MIB
            except psutil.Error:
                continue
            if kind is not None:
                total[kind] = total.get(kind, 0.0) + mb
                count[kind] = count.get(kind, 0) + 1
                low[kind] = min(low.get(kind, mb), mb)
                self.max_peak[kind] = max(self.max_peak.get(kind, 0.0), mb)
        if not self.idle_mb and "supernode" in low:  # the run not started yet: all idle
            self.idle_mb = {k: round(v, 1) for k, v in low.items()}
        for kind, mb in total.items():
            self.total_peak[kind] = max(self.total_peak.get(kind, 0.0), mb)
            self.count_peak[kind] = max(self.count_peak.get(kind, 0), count[kind])
        self.all_peak_mb = max(self.all_peak_mb, sum(total.values()))
        self.db_peak = max(self.db_peak, db_bytes(dep.database))

    def _run(self, dep) -> None:
        while not self._stop.is_set():
            available = psutil.virtual_memory().available / GIB
            self.min_available_gb = min(self.min_available_gb, available)
            if available < self.min_free_gb:
                self.aborted = f"available memory {available:.1f} GiB < {self.min_free_gb} GiB"
            elif too_late(self.deadline):
                self.aborted = f"deadline {self.deadline} UTC"
            if self.aborted is not None:
                print(f"chaos_load: {self.aborted}: stopping the deployment", flush=True)
                dep.close()
                return
            self.sample(dep)
            self._stop.wait(self.interval_s)


def _per_round(results: dict, key: str) -> list:
    return [r.get(key) for r in results.get("rounds", [])]


def results_fields(results: dict) -> dict:
    """The run's per-round columns; message sizes per message (MB = 1e6 bytes):
    download = ``bytes-down`` / nodes sent to, upload = ``bytes-up`` / replies used."""
    rounds = results.get("rounds", [])
    sent = [r["replies-used"] + r["replies-rejected"] + r["replies-missing"] for r in rounds]
    down = [r.get("bytes-down") for r in rounds]
    up = [r.get("bytes-up") for r in rounds]
    used = _per_round(results, "replies-used")
    return {
        "run_results_status": results.get("status"),
        "model_parameters": results.get("model-parameters"),
        "rounds_completed": len(rounds),
        "sent_per_round": sent,
        "replies_used": used,
        "replies_late": _per_round(results, "replies-late"),
        "replies_lost": _per_round(results, "replies-lost"),
        "round_wall_s": [round(x, 1) for x in _per_round(results, "round-wall-s") if x is not None],
        "aggregation_s": [round(x or 0.0, 1) for x in _per_round(results, "aggregation-time-s")],
        "message_mb_down": round(down[0] / sent[0] / 1e6, 1) if rounds and down[0] else None,
        "message_mb_up": round(up[0] / used[0] / 1e6, 1) if rounds and up[0] and used[0] else None,
        "bytes_down_per_round": down,
        "bytes_up_per_round": up,
        "final_val_loss": rounds[-1].get("val-loss") if rounds else None,
    }


def read_results(out: Path) -> dict:
    try:
        return json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def process_failures(dep) -> dict:
    """What the processes' own logs and states say: SuperNodes no longer running at the end,
    the SuperLink's HTTP 500 answers and SQLite ``database is locked`` errors among them."""
    text = dep.superlink.log_path.read_text(errors="replace") if dep.superlink else ""
    return {
        "supernodes_exited": sum(1 for n in dep.supernodes if n.process and not n.process.alive()),
        "superlink_http_500": len(re.findall(r'HTTP/1.1" 500', text)),
        "superlink_db_locked": text.count("database is locked"),
    }


def stop_if_broken(dep, running, grace_s: float = 30.0) -> str | None:
    """Wait for the run; once half of the SuperNodes have exited (seen after a 500 from the
    on-disk SuperLink) for ``grace_s``, stop it with ``flwr stop`` instead of letting the
    strategy wait out its round timeout for nodes that will not come. Returns why, or None."""
    since = None
    while running.process.alive():
        gone = sum(1 for n in dep.supernodes if n.process is not None and not n.process.alive())
        if 2 * gone < len(dep.supernodes):
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since > grace_s and running.run_id() is not None:
            dep.stop_run(running.run_id())
            return f"{gone} of {len(dep.supernodes)} SuperNodes exited: run stopped"
        time.sleep(2.0)
    return None


def deploy_and_run(args, tmp: Path, database: str, rec: dict, guard: Guard, mon) -> None:
    """Start the federation, run the app once, fill ``rec`` (status, walls, DB size)."""
    app = synthetic_app(tmp, common.REPO)
    out = tmp / "run"
    t0 = time.monotonic()
    db = DATABASES[database]
    with loopback_deployment(tmp / "dep", args.nodes_now, database=db) as dep:
        rec["setup_s"] = round(time.monotonic() - t0, 1)
        mon.start(dep)
        guard.start(dep)
        cfg = run_config(args.size, args.nodes_now, args.per_round, args.rounds, out)
        rec["fraction_train"] = cfg["strategy.fraction-train"]
        rec["quorum"], rec["grace_s"] = cfg["strategy.quorum"], cfg["strategy.grace-s"]
        t1 = time.monotonic()
        running = dep.start_app(app, cfg, timeout=args.run_timeout)
        rec["stopped_early"] = stop_if_broken(dep, running)
        outcome = running.wait()
        rec["run_wall_s"] = round(time.monotonic() - t1, 1)
        rec["run_status"] = outcome.status
        rec["db_bytes_end"] = db_bytes(dep.database)
        guard.sample(dep)
        rec.update(process_failures(dep))
        text = outcome.output + outcome.logs
        rec["log_problems"] = [line[:300] for line in text.splitlines() if PROBLEM.search(line)][
            :30
        ]
        name = f"chaos-load-{args.nodes_now}-{database}-{time.strftime('%H%M%S')}.log"
        (tmp.parent / name).write_text(text + dep.diagnostics())  # kept for a post-mortem
        rec["log_file"] = str(tmp.parent / name)
    rec.update(results_fields(read_results(out)))


def run_cell(args, database: str) -> dict:
    """One cell: wait for ``--wait-free-gb``, deploy, run, record (also when it fails)."""
    free = wait_for_memory(args.wait_free_gb)
    rec = {
        "mode": args.mode,
        "size": args.size,
        "supernodes": args.nodes_now,
        "database": database,
        "per_round": args.per_round,
        "rounds_planned": args.rounds,
        "free_gb_at_start": round(free, 1),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "started_utc": time.strftime("%H:%M:%S", time.gmtime()),
    }
    print(f"chaos_load: {json.dumps(rec)}", flush=True)
    mon, guard = MemoryMonitor(), Guard(args.min_free_gb, args.deadline)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chaos-load-", dir=args.tmp) as tmp:
        try:
            deploy_and_run(args, Path(tmp), database, rec, guard, mon)
        except Exception as err:  # recorded: a cell that failed is a result too
            rec["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
        finally:
            mon.stop()
            guard.stop()
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    rec["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    rec["load_avg_1m"] = [round(x, 2) for x in mon.load]
    ok = rec.get("run_status") == "finished:completed"
    ok = ok and rec.get("rounds_completed") == args.rounds
    rec["status"] = "ok" if ok else "failed"
    if guard.aborted:
        rec["status"] = "aborted-deadline" if "deadline" in guard.aborted else "aborted-low-memory"
    rec["aborted"] = guard.aborted
    rec["min_available_gb"] = round(guard.min_available_gb, 2)
    rec["db_bytes_peak"] = guard.db_peak
    # the monitor's largest process per kind, or the guard's where larger (it sees orphans)
    peak = {
        k: max(mon.peak.get(k, 0.0), guard.max_peak.get(k, 0.0))
        for k in {*mon.peak, *guard.max_peak}
    }
    rec["peak_rss_mb"] = {k: round(v, 1) for k, v in sorted(peak.items())}
    rec["peak_total_rss_mb"] = {k: round(v, 1) for k, v in sorted(guard.total_peak.items())}
    rec["peak_all_rss_mb"] = round(guard.all_peak_mb, 1)
    rec["idle_rss_mb"] = guard.idle_mb
    rec["max_processes"] = dict(sorted(guard.count_peak.items()))
    rec["rss_mb_over_time"] = mon.series
    rec["machine"] = common.machine()
    rec["commit"] = common.git("rev-parse", "--short", "HEAD")
    return rec


def estimate_gb(records: list[dict], size: str, nodes: int, per_round: int, rounds: int):
    """Expected peak of the summed RSS of every process of the deployment (GiB), from the
    recorded ``ok`` cell of ``size`` with the most SuperNodes (N0, K0, R0), or None::

        peak = peak0 + (N - N0) (idle SuperNode + idle SuperExec)
                     + (held(N, K, R) - held(N0, K0, R0)) (SuperNode peak - idle SuperNode)
                     + (K - K0) (ClientApp peak + SuperNode peak)

    ``held(N, K, R) = min(N - K, K (R - 1))``: SuperNodes that handled a message in an earlier
    round and kept its memory (glibc keeps a freed ~1 GB heap: measured) while K others work in
    the last round (an upper bound: the sample may pick a node twice). RSS counts shared pages
    once per process, so this over-estimates what the machine loses by ~40 MB per process."""
    done = [r for r in records if r.get("size") == size and r.get("status") == "ok"]
    if not done:
        return None
    ref = max(done, key=lambda r: (r["supernodes"], r["started_utc"]))
    n0, k0, r0 = ref["supernodes"], ref["per_round"], ref["rounds_planned"]
    # idle: the guard's first sample; in records from before it kept one, the monitor's first
    # sample (t = 0, the run not started: the largest process of each kind, idle)
    idle = ref.get("idle_rss_mb") or {k: v[0][1] for k, v in ref["rss_mb_over_time"].items()}
    peak = ref["peak_rss_mb"]
    pair = idle.get("supernode", 0.0) + idle.get("superexec", 0.0)
    kept = peak.get("supernode", 0.0) - idle.get("supernode", 0.0)

    def held(n: int, k: int, r: int) -> int:
        return min(n - k, k * (r - 1))

    mb = ref["peak_all_rss_mb"] + (nodes - n0) * pair
    mb += (held(nodes, per_round, rounds) - held(n0, k0, r0)) * kept
    mb += (per_round - k0) * (peak.get("clientapp", 0.0) + peak.get("supernode", 0.0))
    return mb / 1024


def _mb(x: float | None) -> str:
    """MB to show: none as ``-``, under 10 with a decimal (the quick cells' messages)."""
    return "-" if x is None else (f"{x:.1f}" if x < 10 else f"{x:.0f}")


def table(records: list[dict]) -> str:
    """Markdown: one row per record. RSS in MB: the largest process of the kind, and (after
    the slash) the sum over all processes of that kind at its peak."""
    head = (
        "| SuperNodes | database | trained / round (sent) | message MB down / up | rounds "
        "| replies used (lost) | round wall s | SuperLink | ServerApp | SuperNode: largest / all | "
        "ClientApp: largest / all (at once) | all processes | DB MB end (peak) | load start -> end "
        "| status |"
    )
    rows = [head, common.rule(15)]
    for r in records:
        p, t = r.get("peak_rss_mb", {}), r.get("peak_total_rss_mb", {})
        nclient = r.get("max_processes", {}).get("clientapp", 0)
        sent = r.get("sent_per_round") or []
        lost = r.get("replies_lost") or [0] * len(r.get("replies_used") or [])
        used = "/".join(
            f"{u}" + (f" ({n})" if n else "")
            for u, n in zip(r.get("replies_used") or [], lost, strict=False)
        )
        walls = ", ".join(f"{w:.0f}" for w in r.get("round_wall_s", [])) or "-"
        db = "-" if r["database"] == "in-memory" else (
            f"{r.get('db_bytes_end', 0) / 1e6:.0f} ({r.get('db_bytes_peak', 0) / 1e6:.0f})"
        )  # fmt: skip
        rows.append(
            f"| {r['supernodes']} | {r['database']} | {r['per_round']} ({'/'.join(map(str, sent)) or '-'}) "
            f"| {_mb(r.get('message_mb_down'))} / {_mb(r.get('message_mb_up'))} "
            f"| {r.get('rounds_completed', 0)} / {r['rounds_planned']} | {used} | {walls} "
            f"| {_mb(p.get('superlink'))} | {_mb(p.get('serverapp'))} "
            f"| {_mb(p.get('supernode'))} / {_mb(t.get('supernode'))} "
            f"| {_mb(p.get('clientapp'))} / {_mb(t.get('clientapp'))} ({nclient}) "
            f"| {_mb(r.get('peak_all_rss_mb'))} | {db} "
            f"| {r['load_avg_start'][0]:.1f} -> {r.get('load_avg_end', [0])[0]:.1f} "
            f"| {r['status']} ({r['size']}, {r.get('commit', '?')}) |"
        )
    return "\n".join(rows)


def recorded(records: list[dict], cell: dict) -> bool:
    """True if a record of this cell (:data:`KEY`) ended ``ok`` or ``aborted-low-memory``."""
    return any(
        all(r.get(k) == cell[k] for k in KEY) and r.get("status") in ("ok", "aborted-low-memory")
        for r in records
    )


def too_late(not_after: str) -> bool:
    """True once the UTC clock is past ``HH:MM`` (empty: never)."""
    return bool(not_after) and time.strftime("%H:%M", time.gmtime()) >= not_after


def sweep(args) -> None:
    """Every (SuperNodes, database) cell not yet recorded, smallest first; one record each."""
    for nodes in sorted(args.nodes):
        for database in args.databases:
            args.nodes_now = nodes
            cell = {
                "mode": args.mode, "size": args.size, "supernodes": nodes, "database": database,
                "per_round": args.per_round, "rounds_planned": args.rounds,
            }  # fmt: skip
            records = common.load_records(args.out)
            if recorded(records, cell) and not args.force:
                print(f"chaos_load: {cell} already recorded; skipped")
                continue
            if too_late(args.not_after):
                print(f"chaos_load: past {args.not_after} UTC; {cell} not started")
                return
            est = estimate_gb(records, args.size, nodes, args.per_round, args.rounds)
            print(f"chaos_load: {cell}: expected peak {est if est is None else round(est, 1)} GiB")
            if est is not None and est > args.budget_gb:
                print(f"chaos_load: over --budget-gb {args.budget_gb}; not started")
                continue
            rec = run_cell(args, database)
            rec["expected_peak_gib"] = None if est is None else round(est, 2)
            common.append_record(args.out, rec)
            shown = {k: v for k, v in rec.items() if k not in ("rss_mb_over_time", "machine")}
            print(f"chaos_load: {json.dumps(shown)}", flush=True)
            if rec["status"] == "aborted-low-memory":
                print("chaos_load: stopped: low memory")
                sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 SuperNodes, tiny model, 2 rounds")
    ap.add_argument("--nodes", type=int, nargs="+", default=[32])
    ap.add_argument("--databases", nargs="+", default=list(DATABASES), choices=list(DATABASES))
    ap.add_argument("--per-round", type=int, default=2, help="K: nodes sent the model per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="smollm2-shapes", choices=list(SIZES))
    ap.add_argument("--min-free-gb", type=float, default=3.0, help="guard: stop the deployment")
    ap.add_argument("--wait-free-gb", type=float, default=8.0, help="start a cell with this free")
    ap.add_argument("--budget-gb", type=float, default=16.0, help="refuse a cell expected above")
    ap.add_argument("--not-after", default="", help="start no cell after HH:MM UTC")
    ap.add_argument("--deadline", default="", help="stop a cell still running at HH:MM UTC")
    ap.add_argument("--run-timeout", type=float, default=2400.0, help="run_app.sh's wait, s")
    ap.add_argument("--tmp", default=None, help="folder for the deployments (default: TMPDIR)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--force", action="store_true", help="run recorded cells again")
    ap.add_argument("--table", action="store_true", help="run nothing: print the records' table")
    args = ap.parse_args(argv)
    if args.table:
        print(table(common.load_records(args.out)))
        return
    args.mode = "quick" if args.quick else "load"
    if args.quick:
        args.nodes, args.per_round, args.rounds, args.size = [4], 2, 2, "tiny-synthetic"
    sweep(args)
    print(table(common.load_records(args.out)))


if __name__ == "__main__":
    main()
