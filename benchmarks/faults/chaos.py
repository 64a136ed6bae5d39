"""Chaos benchmark (issue 39): a loopback TLS federation under a seeded fault schedule against
the same run without faults; one record per run in ``benchmarks/results/chaos.json``.

The scenario is the chaos deployment test's (``tests/test_chaos_deployment.py``,
``run_chaos``): SuperLink with TLS, SuperNode authentication and ``--database <file>``, N
SuperNodes (each its own process), the LM app (IsoLoCo, quorum) with every round
checkpointed; SuperNodes SIGKILLed at seeded moments and restarted (retrying until Flower lets
them back); the coordinator losing power once (SuperLink, SuperExec and ServerApp SIGKILLed)
after round ``--superlink-after``, the SuperLink restarted with the same port and database,
the lost run stopped and resumed from its checkpoint (``resume-from``), which counts as the
ServerApp restart. While it runs, the resident memory of every process is sampled each second
and recorded per process kind (peak, and the largest process of each kind every 5 s).

    python benchmarks/faults/chaos.py --quick            # the CI test's scenario: 6 nodes, 3 rounds
    python benchmarks/faults/chaos.py --nodes 16 --rounds 30 --kills 12 --superlink-after 10

``--quick`` is the test's scenario plus its fault-free twin (same seed, config and nodes).
``--plot`` runs nothing: it draws ``rss_mb_over_time`` of the last fault-free and the last chaos
record (of ``--plot-mode``, default ``quick``) per process kind into docs/img/chaos_memory.png,
with the kills from the chaos record's events marked.
"""

from __future__ import annotations

import argparse
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

from test_chaos_deployment import (  # noqa: E402
    DUPLICATE,
    SEED,
    fault_schedule,
    named_losses,
    run_chaos,
)

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


class MemoryMonitor:
    """Samples the RSS of every process the deployment started (and their descendants)."""

    def __init__(self, interval_s: float = 1.0, series_every_s: float = 5.0) -> None:
        self.interval_s, self.series_every_s = interval_s, series_every_s
        self.peak: dict[str, float] = {}
        self.series: dict[str, list[list[float]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, dep) -> None:
        self._thread = threading.Thread(target=self._run, args=(dep,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

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
            if t >= next_series:
                for kind, mb in now.items():
                    self.series.setdefault(kind, []).append([round(t, 1), round(mb, 1)])
                next_series = t + self.series_every_s
            self._stop.wait(self.interval_s)


def record(chaos, monitor: MemoryMonitor, args, faults: bool, free_loss: float | None) -> dict:
    final = chaos.final
    rounds = final["rounds"]
    named = {}
    for text in chaos.logs[:2]:
        named.update(named_losses(text))
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
        "node_starts_to_rejoin": chaos.node_starts,
        "superlink_restarts": chaos.superlink_restarts,
        "serverapp_restarts": chaos.superlink_restarts,  # the lost run resumed from its checkpoint
        "rounds_planned": args.rounds,
        "rounds_completed": len(rounds) if final.get("status") == "completed" else 0,
        "rounds_lost_in_flight": chaos.superlink_restarts,  # redone by the resumed run
        "run_statuses": chaos.statuses,
        "updates_lost": sum(r["replies-rejected"] + r["replies-missing"] for r in rounds),
        "updates_lost_named": lost_named,
        "updates_applied_twice": len(DUPLICATE.findall("\n".join(chaos.logs[:2]))),
        "replies_used": [r["replies-used"] for r in rounds],
        "replies_late": [r.get("replies-late", 0) for r in rounds],
        "replies_lost": [r.get("replies-lost", 0) for r in rounds],
        "resumed_model_bitwise": chaos.resumed_model_equal,
        "final_val_loss": rounds[-1]["val-loss"] if rounds else None,
        "fault_free_val_loss": free_loss,
        "wall_s": round(chaos.wall_s, 1),
        "setup_s": round(chaos.setup_s, 1),
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
                on_up=monitor.start,
            )
        finally:
            monitor.stop()
    rec = record(chaos, monitor, args, faults, free_loss)
    common.append_record(OUT, rec)
    shown = {k: v for k, v in rec.items() if k not in ("rss_mb_over_time", "machine", "events")}
    print(re.sub(r"\s+", " ", str(shown)))
    return rec


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
    ap.add_argument("--no-fault-free", action="store_true", help="skip the fault-free twin")
    ap.add_argument(
        "--plot", action="store_true", help="run nothing: draw docs/img/chaos_memory.png"
    )
    ap.add_argument("--plot-mode", default="quick", help="which records --plot draws")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot_mode)
        return
    if args.quick:
        args.nodes, args.rounds, args.kills, args.superlink_after = 6, 3, 3, 2
    free_loss = None
    if not args.no_fault_free:
        free = one(args, faults=False, free_loss=None)
        free_loss = free["final_val_loss"]
    one(args, faults=True, free_loss=free_loss)


if __name__ == "__main__":
    main()
