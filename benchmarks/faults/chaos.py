"""Chaos benchmark: a loopback TLS federation under seeded faults against the same run without.

One record per run in ``benchmarks/results/chaos.json``.

The scenario is ``tests/chaos_scenario.py``'s ``run_chaos`` (the CI test's): SuperLink with TLS,
SuperNode authentication and ``--database <file>``, N SuperNodes (each its own process), the LM
app (IsoLoCo, quorum) with every round checkpointed; SuperNodes SIGKILLed at seeded moments
(while training, the moment the ClientApp hands over its reply, between rounds) and restarted
(retrying until Flower lets them back); the coordinator losing power once (SuperLink,
SuperExec and ServerApp SIGKILLed) after round ``--superlink-after`` and, with
``--serverapp-after``, the ServerApp process alone SIGKILLed after that round; each time the
lost run is stopped and resumed from its checkpoint (``resume-from``). While it runs, the
resident memory of every process is sampled each second and recorded per process kind (peak,
and the largest process of each kind every 5 s), with the machine's load average.

    python benchmarks/faults/chaos.py --quick            # the CI test's scenario: 6 nodes, 3 rounds
    python benchmarks/faults/chaos.py --nodes 16 --rounds 30 --fault-free-only
    python benchmarks/faults/chaos.py --nodes 16 --rounds 30 --kills 12 --superlink-after 10 \
        --serverapp-after 20 --no-fault-free

``--quick`` is the test's scenario plus its fault-free twin (same seed, config and nodes).
``--table`` runs nothing: it writes the table of every record into docs/deployment.md.
``--plot`` runs nothing: it draws ``rss_mb_over_time`` of the last fault-free and the last chaos
record (of ``--plot-mode``, default ``quick``) per process kind into docs/img/chaos_memory.png,
with the kills from the chaos record's events marked.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("tests")

from chaos_accounting import account  # noqa: E402
from chaos_scenario import SEED, fault_schedule, run_chaos  # noqa: E402

OUT = common.RESULTS / "chaos.json"
PLOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "chaos_memory.png"
KINDS = (
    ("superlink", "flower-superlink"),
    ("superexec", "flower-superexec"),
    ("serverapp", "flwr-serverapp"),
    ("supernode", "flower-supernode"),
    ("clientapp", "flwr-clientapp"),
)


def kind_of(cmdline: list[str]) -> str | None:
    text = " ".join(cmdline[:3])
    for kind, needle in KINDS:
        if needle in text:
            return kind
    return None


class Sampler:
    """A daemon thread that runs ``self._run(dep)`` from ``start(dep)`` until ``stop()``
    (``_run`` loops while ``self._stop`` is not set)."""

    join_s = 10.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, dep) -> None:
        self._thread = threading.Thread(target=self._run, args=(dep,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_s)

    def _run(self, dep) -> None:
        raise NotImplementedError


class MemoryMonitor(Sampler):
    """Samples the RSS of every process the deployment started (and their descendants)."""

    def __init__(self, interval_s: float = 1.0, series_every_s: float = 5.0) -> None:
        super().__init__()
        self.interval_s, self.series_every_s = interval_s, series_every_s
        self.peak: dict[str, float] = {}
        self.series: dict[str, list[list[float]]] = {}
        self.load: list[float] = []  # 1-minute load average: min, mean, max over the run
        self._loads: list[float] = []

    def _sample(self, dep) -> dict[str, float]:
        now: dict[str, float] = {}
        for proc in list(dep._procs):
            if not proc.alive():
                continue
            try:
                root = psutil.Process(proc.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in family:
                try:
                    kind = kind_of(p.cmdline())
                    mb = p.memory_info().rss / common.MIB
                except psutil.Error:
                    continue
                if kind is not None:
                    now[kind] = max(now.get(kind, 0.0), mb)
        return now

    def _run(self, dep) -> None:
        t0 = time.monotonic()
        next_series = 0.0
        while not self._stop.is_set():
            now = self._sample(dep)
            for kind, mb in now.items():
                self.peak[kind] = max(self.peak.get(kind, 0.0), mb)
            t = time.monotonic() - t0
            self._loads.append(os.getloadavg()[0])
            self.load = [min(self._loads), sum(self._loads) / len(self._loads), max(self._loads)]
            if t >= next_series:
                for kind, mb in now.items():
                    self.series.setdefault(kind, []).append([round(t, 1), round(mb, 1)])
                next_series = t + self.series_every_s
            self._stop.wait(self.interval_s)


def record(chaos, monitor: MemoryMonitor, args, faults: bool, free_loss: float | None) -> dict:
    final = chaos.final
    rounds = final["rounds"]
    named, problems, unlogged = account(chaos)
    lost_named = sum(
        len(named[r["round"]]["dropped-nodes"]) + len(named[r["round"]]["missing-nodes"])
        for r in rounds
        if r["round"] in named
    )
    return {
        "mode": "quick" if args.quick else "custom",
        "faults": faults,
        "seed": args.seed,
        "supernodes": args.nodes,
        "node_kills": chaos.node_kills,
        "kill_moments": chaos.kill_moments,
        "node_starts_to_rejoin": chaos.node_starts,
        "superlink_restarts": chaos.superlink_restarts,
        "serverapp_kills": chaos.serverapp_kills,
        # a new ServerApp per coordinator fault: the lost run resumed from its checkpoint
        "serverapp_restarts": chaos.coordinator_faults,
        "rounds_planned": args.rounds,
        "rounds_completed": len(rounds) if final.get("status") == "completed" else 0,
        "rounds_restored": chaos.restored,  # rounds each resume took from the lost run
        "rounds_lost_in_flight": chaos.coordinator_faults,  # redone by the resumed run
        "run_statuses": chaos.statuses,
        "updates_lost": sum(r["replies-rejected"] + r["replies-missing"] for r in rounds),
        "updates_lost_named": lost_named,
        "updates_applied_twice": sum("duplicate" in p for p in problems),
        "ledger_problems": problems,
        # a lost run's last round whose log lines went with the coordinator (results.json has it)
        "rounds_unlogged": unlogged,
        "replies_used": [r["replies-used"] for r in rounds],
        "round_wall_s": [round(r.get("round-wall-s", float("nan")), 1) for r in rounds],
        "replies_late": [r.get("replies-late", 0) for r in rounds],
        "replies_lost": [r.get("replies-lost", 0) for r in rounds],
        "resumed_model_bitwise": chaos.resumed_model_equal,
        # (SuperNode index, age s, RSS MB) of ClientApps alive after every run ended
        "orphan_clientapps": chaos.orphan_clientapps,
        "restart_failures": chaos.restart_failures,
        "lost_checkpoints_unchanged": chaos.checkpoint_unchanged,
        "final_val_loss": rounds[-1]["val-loss"] if rounds else None,
        "fault_free_val_loss": free_loss,
        "wall_s": round(chaos.wall_s, 1),
        "setup_s": round(chaos.setup_s, 1),
        "load_avg_1m": [round(x, 2) for x in monitor.load],
        "peak_rss_mb": {k: round(v, 1) for k, v in sorted(monitor.peak.items())},
        "rss_mb_over_time": monitor.series,
        "events": chaos.events,
        "machine": common.machine(),
        "commit": common.git("rev-parse", "--short", "HEAD"),
    }


def one(args, faults: bool, free_loss: float | None) -> dict:
    monitor = MemoryMonitor()
    config = {"num-server-rounds": args.rounds}
    kills = (
        fault_schedule(args.seed, args.nodes, args.kills, args.rounds, args.superlink_after)
        if faults
        else []
    )
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        try:
            chaos = run_chaos(
                Path(tmp),
                seed=args.seed,
                num_nodes=args.nodes,
                config=config,
                kills=kills,
                superlink_after=args.superlink_after if faults else None,
                serverapp_after=args.serverapp_after if faults else None,
                on_up=monitor.start,
                strict=False,  # a site that never came back is recorded, not raised
            )
        finally:
            monitor.stop()
    rec = record(chaos, monitor, args, faults, free_loss)
    common.append_record(OUT, rec)
    shown = {k: v for k, v in rec.items() if k not in ("rss_mb_over_time", "machine", "events")}
    print(re.sub(r"\s+", " ", str(shown)))
    return rec


def last_fault_free_loss(args) -> float | None:
    """The final loss of the last fault-free record with this run's nodes, rounds and seed."""
    import json

    if not OUT.exists():
        return None
    loss = None
    for r in json.loads(OUT.read_text()):
        same = (r["supernodes"], r["rounds_planned"], r["seed"]) == (
            args.nodes,
            args.rounds,
            args.seed,
        )
        if same and not r["faults"]:
            loss = r["final_val_loss"]
    return loss


DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
BLOCK = ("<!-- chaos:begin -->", "<!-- chaos:end -->")


def _growth(series: list[list[float]], tail_s: float = 600.0) -> str:
    """RSS of the kind's largest process: first sample -> last, and the change over the
    last ``tail_s`` seconds (slow growth shows there, after the working set is built)."""
    if not series:
        return "-"
    t_end, last = series[-1]
    tail = [mb for t, mb in series if t >= t_end - tail_s]
    return f"{series[0][1]:.0f} -> {last:.0f} ({last - tail[0]:+.0f} in the last {tail_s / 60:.0f} min)"


def table(records: list[dict]) -> str:
    """The docs table: one row per record (the fault-free twin beside its chaos run)."""
    head = (
        "| run | SuperNodes | node kills (moments seen) | SuperLink / ServerApp kills | "
        "rounds done / planned | updates not merged (named) | applied twice | ledger breaches | "
        "final val loss (fault-free) | wall | load avg | "
        "peak RSS MB: SuperLink / ServerApp / SuperNode / ClientApp |"
    )
    rows = [head, common.rule(12)]
    notes = []
    for r in records:
        if "note" in r:
            notes.append(r["note"])
        moments = {}
        for m in r.get("kill_moments", []):
            key = m.split(" (")[0].split(" not seen")[0]
            moments[key] = moments.get(key, 0) + 1
        seen = ", ".join(f"{v} {k}" for k, v in moments.items())
        peak = r["peak_rss_mb"]
        load = r.get("load_avg_1m")
        load_text = f"{load[1]:.1f}" if load else f"{r['machine']['load-avg'][0]:.1f} at the end"
        free = r.get("fault_free_val_loss")
        rows.append(
            f"| {'chaos' if r['faults'] else 'fault-free'}, seed {r['seed']}, {r['commit']}"
            + (f" (note {len(notes)})" if "note" in r else "")
            + f" | {r['supernodes']} | {r['node_kills']}"
            + (f" ({seen})" if seen else "")
            + f" | {r['superlink_restarts']} / {r.get('serverapp_kills', 0)} "
            f"| {r['rounds_completed']} / {r['rounds_planned']} "
            f"| {r['updates_lost']} ({r['updates_lost_named']}) | {r['updates_applied_twice']} "
            f"| {len(r.get('ledger_problems', [])) if 'ledger_problems' in r else 'n/a'} "
            f"| {r['final_val_loss']:.4f}"
            + (f" ({free:.4f})" if free is not None else "")
            + f" | {r['wall_s']:.0f} s | {load_text} "
            f"| {' / '.join(f'{peak.get(k, 0):.0f}' for k in ('superlink', 'serverapp', 'supernode', 'clientapp'))} |"
        )
    rows += [""] + [f"Note {i}: {n}" for i, n in enumerate(notes, 1)]
    rows += ["", "SuperLink RSS over each run (largest process, MB):", ""]
    rows += [
        f"- {'chaos' if r['faults'] else 'fault-free'}, {r['supernodes']} SuperNodes, "
        f"{r['rounds_planned']} rounds: {_growth(r['rss_mb_over_time'].get('superlink', []))}"
        for r in records
    ]
    return "\n".join(rows)


EVENT_S = re.compile(r"^(\d+) s: (SIGKILL \S+|restart SuperLink)")


def plot(mode: str = "quick", out: Path = PLOT) -> Path:
    """Memory over time per process kind: the last fault-free and the last chaos record of
    ``mode`` side by side (largest process of each kind every 5 s); the chaos record's kills
    and the SuperLink restart as vertical lines (event times are from before the deployment
    came up, so shifted by the record's ``setup_s`` onto the monitor's clock)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in json.loads(OUT.read_text()) if r.get("mode") == mode]
    pair = {}
    for r in records:  # the last of each
        pair[r["faults"]] = r
    if not pair:
        raise SystemExit(f"no {mode!r} record in {OUT}")
    fig, axes = plt.subplots(1, len(pair), figsize=(6 * len(pair), 4.5), sharey=True, squeeze=False)
    colours = {kind: f"C{i}" for i, (kind, _) in enumerate(KINDS)}
    for ax, faults in zip(axes[0], sorted(pair), strict=True):
        r = pair[faults]
        for kind, _ in KINDS:
            series = r["rss_mb_over_time"].get(kind)
            if series:
                t, mb = [], []
                for i, (ti, mbi) in enumerate(series):
                    if i and ti - series[i - 1][0] > 7.5:  # no such process then: a gap
                        t.append(ti)
                        mb.append(float("nan"))
                    t.append(ti)
                    mb.append(mbi)
                ax.plot(t, mb, label=kind, color=colours[kind])
        for ev in r.get("events", []):
            m = EVENT_S.match(ev)
            if m:
                x = int(m.group(1)) - r.get("setup_s", 0.0)
                style = "--" if m.group(2).startswith("SIGKILL supernode") else "-"
                ax.axvline(x, color="grey", linestyle=style, linewidth=0.8)
        ax.set_title(
            f"{'chaos' if faults else 'fault-free'}: {r['supernodes']} SuperNodes, "
            f"{r['rounds_completed']}/{r['rounds_planned']} rounds, seed {r['seed']}"
            + (
                "\ndashed: SuperNode SIGKILL, solid: coordinator SIGKILL / restart"
                if faults
                else ""
            ),
            fontsize=9,
        )
        ax.set_xlabel("s since the deployment was up")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("RSS MB (largest process of the kind)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="the CI test's scenario (6 nodes, 3 rounds)"
    )
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--superlink-after", type=int, default=2)
    ap.add_argument(
        "--serverapp-after",
        type=int,
        default=None,
        help="also SIGKILL the ServerApp alone after this round (then stop + resume)",
    )
    ap.add_argument(
        "--no-fault-free",
        action="store_true",
        help="skip the fault-free twin (its loss from the last matching record, if any)",
    )
    ap.add_argument("--fault-free-only", action="store_true", help="run only the fault-free twin")
    ap.add_argument(
        "--plot", action="store_true", help="run nothing: draw docs/img/chaos_memory.png"
    )
    ap.add_argument("--plot-mode", default="quick", help="which records --plot draws")
    ap.add_argument("--plot-out", type=Path, default=PLOT)
    ap.add_argument(
        "--table", action="store_true", help="run nothing: write the records' table into the docs"
    )
    args = ap.parse_args()
    if args.plot:
        plot(args.plot_mode, args.plot_out)
        return
    if args.table:
        import json

        common.write_block(DOC, *BLOCK, table(json.loads(OUT.read_text())))
        print(f"wrote the chaos table into {DOC}")
        return
    if args.quick:
        args.nodes, args.rounds, args.kills, args.superlink_after = 6, 3, 3, 2
        args.serverapp_after = None
    free_loss = None
    if not args.no_fault_free:
        free = one(args, faults=False, free_loss=None)
        free_loss = free["final_val_loss"]
    else:
        free_loss = last_fault_free_loss(args)
    if not args.fault_free_only:
        one(args, faults=True, free_loss=free_loss)


if __name__ == "__main__":
    main()
