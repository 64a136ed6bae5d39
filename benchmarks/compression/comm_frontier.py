"""The bytes-vs-loss frontier of compressed uploads and downloads.

Lives under ``benchmarks/compression/`` (our benchmarks are grouped by study). The LM horizon
protocol of ``benchmarks/lm/lm_sweep_lib.py`` (combined corpora, M = 8, T = 600 inner steps, H = 10,
60 rounds, inner lr 3e-3, real Flower in a Ray simulation) for DiLoCo (mean merge) and IsoLoCo
(Iso-C merge of the decoded pseudo-gradients) x codec {fp32, int8, int4, sparseloco k = 64 and k =
128 per 4,096} x outer optimiser {Nesterov 0.8 kept with error feedback (MuLoCo-style), outer
momentum 0 with error feedback in its place (SparseLoCo-style)} x download {none, the same codec}
(:data:`CONFIGS`).

Uploads keep an error-feedback residual with decay 0.95 (``e <- 0.95 e + delta; send Q(e);
e <- e - sent``) with every codec; a compressed download sends ``Q(theta - B)`` and the gap
``theta - B`` is the server's residual (nothing is lost, it goes out later). The run's result
is the server's model ``theta`` (what ``evaluate_fn`` gets), not the broadcast copy ``B`` the
nodes hold.

Protocol per configuration: seed 0 at 3 outer lrs a factor sqrt(2) apart around the fp32
optimum of its outer optimiser (:data:`CENTRES`), selected on the validation loss only; an
optimum on the grid's edge adds one point beyond it; then seeds 1 and 2 at the optimum. The test
loss is reported (seed 0's from its tuning run). fp32 Nesterov baselines are the horizon
study's records (``lm_horizon.json``, same harness, seeds and splits) after one reproduction
run here (:data:`REPRO`).

Bytes are Flower's own accounting: the ``count_bytes()`` of every record of every message the
server pushed and pulled (a wrapper around the grid), per round; per node per round is a
round's total over its messages. Round 1 downloads are full models (nodes hold nothing), so
rounds 2+ are reported apart. ``--bytes`` computes the bytes of every configuration, run or
not, by encoding the model's real deltas once (exact for the arrays; the few hundred bytes of
config per message taken from a measured run).

    python benchmarks/compression/comm_frontier.py --queue --until 02:35   # the study
    python benchmarks/compression/comm_frontier.py --configs diloco-sl64-nesterov-both
    python benchmarks/compression/comm_frontier.py --bytes     # computed bytes, every config
    python benchmarks/compression/comm_frontier.py --table     # docs/results-compression.md, plot
    python benchmarks/compression/comm_frontier.py --quick     # 2 rounds, tiny, in process

Records: ``benchmarks/results/comm_frontier.json`` (one per run, appended at once; a rerun
skips a run whose key ``config|lr|seed`` is there), ``comm_frontier_bytes.json`` (--bytes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

common.on_path("", "benchmarks/lm")
import lm_sweep_lib as L  # noqa: E402

RECORDS = common.RESULTS / "comm_frontier.json"
QUICK_RECORDS = common.RESULTS / "comm_frontier_quick.json"
BYTES = common.RESULTS / "comm_frontier_bytes.json"
WORKERS, HORIZON, INNER_LR = 8, 600, 3e-3
UPLOAD_EF_DECAY = 0.95
MOMENTUM = {"nesterov": 0.8, "m0": 0.0}
CENTRES = {  # fp32 optimum of (method, outer optimiser) at T = 600, inner lr 3e-3 (lm_horizon_tuning)
    ("diloco", "nesterov"): 0.25,
    ("diloco", "m0"): 1.0,  # untuned in fp32: SparseLoCo's lr 1 with EF in place of momentum
    ("isoloco", "nesterov"): 1.8,
    ("isoloco", "m0"): 3.96,  # iso_c-sgd's optimum
}
CODECS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "fp32": None,
    "int8": ("int8", {}),
    "int4": ("int4", {}),
    "sl64": ("sparseloco", {"chunk": 4096, "k": 64, "bits": 2}),
    "sl128": ("sparseloco", {"chunk": 4096, "k": 128, "bits": 2}),
}
REPRO = ("diloco-fp32-nesterov", 0.25, 0, 3.929884)  # lm_horizon.json, seed 0 (3.9299 nats)
REPRO_TOL = 0.005


def _configs() -> dict[str, dict[str, Any]]:
    out = {}
    for method in ("diloco", "isoloco"):
        for codec in CODECS:
            for opt in MOMENTUM:
                for down in ("up", "both") if codec != "fp32" else ("up",):
                    name = f"{method}-{codec}-{opt}" + ("" if codec == "fp32" else f"-{down}")
                    out[name] = {"method": method, "codec": codec, "opt": opt, "down": down}
    return out


CONFIGS = _configs()
"""name -> method, codec, outer optimiser ('nesterov' | 'm0'), download ('up': none | 'both')."""


def lr_grid(centre: float, steps: tuple[int, ...] = (-1, 0, 1)) -> list[float]:
    """``centre * sqrt(2)^i``, 3 significant digits (0.25 -> 0.177, 0.25, 0.354)."""
    return [float(f"{centre * math.sqrt(2) ** i:.3g}") for i in steps]


def codecs_of(name: str) -> dict[str, Any]:
    """The strategy's ``upload`` / ``download`` arguments of configuration ``name``."""
    from flwr_isoloco.strategies import Codec

    spec = CODECS[CONFIGS[name]["codec"]]
    if spec is None:
        return {}
    codec, opts = spec
    out = {"upload": Codec(codec, **opts, ef_decay=UPLOAD_EF_DECAY)}
    if CONFIGS[name]["down"] == "both":
        out["download"] = Codec(codec, **opts)  # the server sends its whole residual: no decay
    return out


def key(name: str, lr: float, seed: int) -> str:
    return f"{name}|lr={lr:g}|seed={seed}"


# ----------------------------------------------------------------------------- bytes
def record_bytes(rec: Any) -> int:
    """``rec.count_bytes()``; for a ConfigRecord holding an empty string or list (Flower 1.42's
    ``count_bytes`` raises on those: zero bytes of value) the same rule item by item."""
    try:
        return rec.count_bytes()
    except ValueError:
        total = 0
        for k, v in rec.items():
            vals = v if isinstance(v, list) else [v]
            for x in vals:
                if isinstance(x, (str, bytes)):
                    total += len(x)
                else:
                    total += 1 if isinstance(x, bool) else 8
            total += len(k)
        return total


def message_bytes(msg: Any) -> tuple[int, int]:
    """(all records, array records) of a message's content, Flower's ``count_bytes()``."""
    if msg.has_error() or not msg.has_content():
        return 0, 0
    recs = msg.content
    arrays = sum(r.count_bytes() for r in recs.array_records.values())
    return sum(record_bytes(r) for r in recs.values()), arrays


class ByteCounter:
    """A grid wrapper counting Flower's bytes of what the strategy pushes and pulls, per round
    (a push that carries a train message opens a round)."""

    def __init__(self, grid: Any) -> None:
        self._grid = grid
        self.rounds: list[dict[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def _add(self, side: str, msg: Any) -> None:
        total, arrays = message_bytes(msg)
        cur = self.rounds[-1]
        cur[side] += total
        cur[f"{side}_arrays"] += arrays
        cur[f"{side}_msgs"] += 1

    def push_messages(self, messages: Any) -> Any:
        messages = list(messages)
        if any(m.metadata.message_type.startswith("train") for m in messages) or not self.rounds:
            self.rounds.append(
                dict.fromkeys(("down", "down_arrays", "down_msgs", "up", "up_arrays", "up_msgs"), 0)
            )
        for m in messages:
            self._add("down", m)
        return self._grid.push_messages(messages)

    def pull_messages(self, ids: Any) -> Any:
        out = list(self._grid.pull_messages(ids))
        for m in out:
            self._add("up", m)
        return out


def summarize_bytes(rounds: list[dict[str, int]], workers: int) -> dict[str, Any]:
    """Per node per round (round 1; mean of rounds 2+) each way, and the run's totals."""

    def per_node(rs: list[dict[str, int]], side: str) -> float:
        n = sum(r[side.split("_")[0] + "_msgs"] for r in rs)
        return sum(r[side] for r in rs) / n if n else float("nan")

    later = rounds[1:]
    out = {
        "round1_down_per_node": per_node(rounds[:1], "down"),
        "round1_up_per_node": per_node(rounds[:1], "up"),
        "down_per_node_round": per_node(later, "down"),
        "up_per_node_round": per_node(later, "up"),
        "down_arrays_per_node_round": per_node(later, "down_arrays"),
        "up_arrays_per_node_round": per_node(later, "up_arrays"),
        "total_run": sum(r["down"] + r["up"] for r in rounds),
        "messages": sum(r["down_msgs"] + r["up_msgs"] for r in rounds),
    }
    out["total_per_node_round"] = out["down_per_node_round"] + out["up_per_node_round"]
    out["total_run_per_node"] = out["total_run"] / workers
    return out


# ----------------------------------------------------------------------------- one run
def run_size(quick: bool) -> dict[str, Any]:
    if quick:
        return L.protocol_size("horizon", 2, quick=True, horizon=4)
    return L.protocol_size("horizon", WORKERS, horizon=HORIZON, inner_lr=INNER_LR)


def run_one(
    name: str,
    lr: float,
    seed: int,
    phase: str,
    quick: bool = False,
    *,
    size: dict[str, Any] | None = None,
    cfg: dict[str, Any] | None = None,
    codecs: dict[str, Any] | None = None,
    num_cpus: int | None = None,
) -> dict[str, Any]:
    """Train configuration ``name`` at outer lr ``lr``, seed ``seed``; the record. Another
    study passes its own ``size`` (default :func:`run_size`), ``cfg`` (default
    ``CONFIGS[name]``; ``cfg["lm_method"]``, where given, is the sweep's method, else
    ``cfg["method"]``), ``codecs`` (default :func:`codecs_of`) and Ray's ``num_cpus``."""
    cfg = cfg or CONFIGS[name]
    size = size or run_size(quick)
    codecs = codecs_of(name) if codecs is None else codecs
    workers = 2 if quick else WORKERS
    method = cfg.get("lm_method", cfg["method"])
    counters: list[ByteCounter] = []

    def wrap(grid: Any) -> ByteCounter:
        counters.append(ByteCounter(grid))
        return counters[-1]

    in_process = None
    if quick:
        common.on_path("tests")
        from fakegrid import FakeGrid

        def in_process(client_app: Any) -> Any:
            return FakeGrid(client_app, num_nodes=workers, seed=seed)

    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = L.run_flower(
        method,
        workers,
        seed,
        lr,
        MOMENTUM[cfg["opt"]],
        size,
        protocol="horizon",
        num_cpus=num_cpus,
        codecs=codecs,
        wrap_grid=wrap,
        in_process_grid=in_process,
    )
    tm = L.RESULT.get("train_metrics", {})
    codecs = {k: repr(v) for k, v in codecs.items()}
    return {
        "key": key(name, lr, seed),
        "config": name,
        **cfg,
        "phase": phase,
        "upload": codecs.get("upload", "none"),
        "download": codecs.get("download", "none"),
        "upload_ef_decay": UPLOAD_EF_DECAY if codecs else None,
        "outer_lr": lr,
        "outer_momentum": MOMENTUM[cfg["opt"]],
        "nesterov": True,
        "seed": seed,
        "workers": workers,
        "horizon": size["rounds"] * size["inner_steps"],
        "inner_lr": size["inner_lr"],
        "rounds": size["rounds"],
        "val_loss": out["val_loss"],
        "test_loss": out["test_loss"],
        "wall_s": out["wall_s"],
        "val_curve": out["val_curve"],
        "data_key": out["data_key"],
        "bytes": summarize_bytes(counters[-1].rounds, workers),
        "bytes_rounds": counters[-1].rounds,
        "strategy_bytes": {
            r: {k: m.get(k) for k in ("bytes-up", "bytes-down", "replies-used")}
            for r, m in tm.items()
        },
        "quick": quick,
        "started_utc": started,
        "git": common.git("rev-parse", "--short", "HEAD"),
    }


# ----------------------------------------------------------------------------- the queue
def recorded(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in records}


def tuning(
    name: str, done: dict[str, dict[str, Any]], points: int = 3, centre: float | None = None
) -> tuple[list, Any]:
    """(lrs still to run at seed 0, the val-optimal lr or None until the grid is in): the
    grid around the centre (default: :data:`CENTRES` of the configuration's method and outer
    optimiser), plus one point beyond an edge optimum (repeatedly)."""
    if centre is None:
        cfg = CONFIGS[name]
        centre = CENTRES[(cfg["method"], cfg["opt"])]
    if points == 1:
        steps = [0]
    else:
        steps = [-1, 0, 1]
        while True:
            grid = dict(zip(lr_grid(centre, tuple(steps)), steps, strict=True))
            runs = {lr: done.get(key(name, lr, 0)) for lr in grid}
            if any(r is None for r in runs.values()):
                break
            best = min(runs, key=lambda lr: runs[lr]["val_loss"])
            i = grid[best]
            if i == min(steps):
                steps.insert(0, i - 1)
            elif i == max(steps):
                steps.append(i + 1)
            else:
                break
    grid = lr_grid(centre, tuple(steps))
    todo = [lr for lr in grid if key(name, lr, 0) not in done]
    if todo:
        return todo, None
    return [], min(grid, key=lambda lr: done[key(name, lr, 0)]["val_loss"])


# (what, configs): "tune" the 3-point grid, "point" one lr (the fp32 optimum), "seeds" 1 and 2
PLAN: list[tuple[str, list[str]]] = [
    ("repro", [REPRO[0]]),
    ("tune", ["diloco-sl64-nesterov-both"]),
    ("tune", ["isoloco-sl64-nesterov-both"]),
    ("point", ["diloco-int4-nesterov-both", "isoloco-int4-nesterov-both"]),
    ("pseeds", ["diloco-int4-nesterov-both", "isoloco-int4-nesterov-both"]),
    ("tune", ["diloco-sl64-m0-both", "isoloco-sl64-m0-both"]),
    ("seeds", ["diloco-sl64-nesterov-both", "isoloco-sl64-nesterov-both"]),
    ("seeds", ["diloco-sl64-m0-both", "isoloco-sl64-m0-both"]),
    ("point", ["diloco-sl64-nesterov-up", "isoloco-sl64-nesterov-up"]),
    ("tune", ["diloco-sl128-nesterov-both", "isoloco-sl128-nesterov-both"]),
    ("point", ["diloco-int8-nesterov-both", "isoloco-int8-nesterov-both"]),
    ("point", ["diloco-sl64-m0-up", "isoloco-sl64-m0-up"]),
    ("seeds", ["diloco-sl128-nesterov-both", "isoloco-sl128-nesterov-both"]),
    ("pseeds", ["diloco-int8-nesterov-both", "isoloco-int8-nesterov-both"]),
]


def next_run(done: dict[str, dict[str, Any]], only: list[str] | None = None):
    """The next (config, lr, seed, phase) of :data:`PLAN` not yet recorded, or None."""
    for what, names in PLAN:
        for name in names:
            if only and name not in only:
                continue
            if what == "repro":
                if key(name, REPRO[1], REPRO[2]) not in done:
                    return name, REPRO[1], REPRO[2], "repro"
                continue
            todo, best = tuning(name, done, 1 if what in ("point", "pseeds") else 3)
            if what in ("tune", "point") and todo:
                return name, todo[0], 0, "tune" if what == "tune" else "point"
            if what in ("seeds", "pseeds") and best is not None:
                for s in (1, 2):
                    if key(name, best, s) not in done:
                        return name, best, s, "seed"
    if only:  # configurations outside the plan: tune, then seeds
        for name in only:
            todo, best = tuning(name, done)
            if todo:
                return name, todo[0], 0, "tune"
            for s in (1, 2):
                if key(name, best, s) not in done:
                    return name, best, s, "seed"
    return None


def queue(
    until: str | None,
    only: list[str] | None,
    quick: bool = False,
    *,
    path: Path | None = None,
    pick: Any = None,
    script: str | None = None,
    extra: tuple[str, ...] = (),
) -> None:
    """Run :func:`next_run` one subprocess at a time until the plan is done or ``until`` (UTC
    ``HH:MM`` today) has passed; each run appended to the records at once. Another study
    passes its records ``path``, ``pick(done)`` (its next run, default :func:`next_run`), the
    ``script`` whose ``--one`` runs it and ``extra`` arguments of that command line."""
    path = path or (QUICK_RECORDS if quick else RECORDS)
    stop = None
    if until:
        now = dt.datetime.now(dt.timezone.utc)
        h, m = map(int, until.split(":"))
        stop = now.replace(hour=h, minute=m, second=0, microsecond=0)
    while True:
        done = recorded(common.load_records(path))
        nxt = pick(done) if pick else next_run(done, only)
        if nxt is None:
            print("queue: nothing left to run", flush=True)
            return
        if stop and dt.datetime.now(dt.timezone.utc) >= stop:
            print(f"queue: {until} UTC passed, not starting {nxt}", flush=True)
            return
        name, lr, seed, phase = nxt
        print(f"queue: {dt.datetime.now(dt.timezone.utc):%H:%M:%S} start {nxt}", flush=True)
        cmd = [sys.executable, script or __file__, "--one", name, str(lr), str(seed), phase]
        cmd += [*extra, *(["--quick"] if quick else [])]
        rc = subprocess.run(cmd, check=False).returncode
        if rc:
            print(f"queue: run {nxt} failed (exit {rc}); stopping", flush=True)
            sys.exit(rc)


def one(
    name: str, lr: float, seed: int, phase: str, quick: bool, *, path: Path | None = None, run=None
) -> None:
    """Run one point (``run``, default :func:`run_one`) unless its key is recorded in ``path``
    (default this study's records), and append its record at once."""
    path = path or (QUICK_RECORDS if quick else RECORDS)
    if key(name, lr, seed) in recorded(common.load_records(path)):
        print(f"skip {key(name, lr, seed)}: recorded")
        return
    rec = (run or run_one)(name, lr, seed, phase, quick)
    common.append_record(path, rec)
    b = rec["bytes"]
    print(
        f"done {rec['key']}: val {rec['val_loss']:.4f} test {rec['test_loss']:.4f} "
        f"wall {rec['wall_s']:.0f}s up {b['up_per_node_round']:.0f} "
        f"down {b['down_per_node_round']:.0f} B/node/round, run {b['total_run']:.3e} B",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", help=f"configurations (of {len(CONFIGS)}) to run")
    p.add_argument("--queue", action="store_true", help="run the plan (PLAN) in priority order")
    p.add_argument("--until", help="queue: start no run after HH:MM UTC")
    p.add_argument("--one", nargs=4, metavar=("CONFIG", "LR", "SEED", "PHASE"))
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds, in process")
    p.add_argument("--bytes", action="store_true", help="compute every configuration's bytes")
    p.add_argument("--table", action="store_true", help="docs/results-compression.md + plot")
    a = p.parse_args(argv)
    for name in a.configs or []:
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    if a.one:
        one(a.one[0], float(a.one[1]), int(a.one[2]), a.one[3], a.quick)
    elif a.quick and not (a.bytes or a.table):
        names = a.configs or ["diloco-fp32-nesterov", "diloco-sl64-nesterov-both"]
        for name in names:
            one(name, CENTRES[(CONFIGS[name]["method"], CONFIGS[name]["opt"])], 0, "quick", True)
    elif a.queue or a.configs:
        queue(a.until, a.configs, a.quick)
    if a.bytes or a.table:
        import comm_frontier_report as R

        if a.bytes:
            R.compute_bytes(quick=a.quick)
        if a.table:
            R.table(quick=a.quick)


if __name__ == "__main__":
    main()
