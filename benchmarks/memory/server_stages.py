"""Where the LM app's server memory goes at 135M: one in-process run, RSS per stage.

Runs ``simulations/isoloco-lm``'s ServerApp (``run_server``: build, rounds, evaluation,
checkpoint, export) on SmolLM2-135M in this process with the test suite's in-process grid
(``tests/fakegrid.py``) and the benchmark-only workers of
``benchmarks/memory/apps/server_load/client_app.py`` (seeded pseudo-gradients; no training). A thread
samples this process's RSS every 10 ms; each stage records RSS on entry, its peak, RSS on exit
and ``live``: RSS on exit after ``gc.collect()`` and glibc's ``malloc_trim(0)`` (memory freed
but kept by the allocator is then returned). Stages nest; the innermost gets the samples.
``transport+client`` is the fake grid's deep copies and the synthetic worker: not server memory
in a Ray simulation (there the worker runs in a Ray actor), reported to keep it apart.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/memory/server_stages.py --nodes 4 --rounds 2

Writes ``benchmarks/results/server_stages_135m.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "server_stages_135m.json"
MIB = 2**20


class Stages:
    """RSS on entry / peak / on exit / live (after gc + malloc_trim) per stage occurrence."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.stack: list[dict] = []
        self.rows: list[dict] = []
        self.done = False
        self._libc = ctypes.CDLL("libc.so.6")
        threading.Thread(target=self._sample, daemon=True).start()

    def rss(self) -> int:
        return self.me.memory_info().rss

    def live(self) -> int:
        gc.collect()
        self._libc.malloc_trim(0)
        return self.rss()

    def sample_nodes(self) -> None:
        while not self.done:
            if self.stack:
                top = self.stack[-1]
                top["peak"] = max(top["peak"], self.rss())
            time.sleep(0.01)

    def wrap(self, name: str, fn, trim: bool = True):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            before = self.rss()
            row = {"stage": name, "depth": len(self.stack), "before": before, "peak": before}
            self.stack.append(row)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                row["s"] = time.perf_counter() - t0
                row["peak"] = max(row["peak"], self.rss())
                self.stack.pop()
                if self.stack:
                    self.stack[-1]["peak"] = max(self.stack[-1]["peak"], row["peak"])
                row["after"] = self.rss()
                if trim:
                    row["live"] = self.live()
                self.rows.append(row)

        return inner


def patch(st: Stages, server_app, fakegrid) -> None:
    """Wrap the server's stages (and the fake transport + worker) with ``st``."""
    from flwr_isoloco import apprunner
    from flwr_isoloco.merging.fold import RoundFold
    from flwr_isoloco.strategies.core.stream import ReplyStream
    from flwr_isoloco.strategies.diloco.diloco import DiLoCo
    from flwr_isoloco.strategies.diloco.train_round import TrainRound

    server_app.SPEC.build = st.wrap("build: corpus, val batches, model, strategy, arrays",
                                    server_app.SPEC.build)  # fmt: skip
    DiLoCo.configure_train = st.wrap("configure_train: the sent record", DiLoCo.configure_train)
    ReplyStream.run = st.wrap("round: pull, check, fold or spill each reply", ReplyStream.run)
    TrainRound.take = st.wrap("take one reply (decode, check, fold/spill)", TrainRound.take,
                              trim=False)  # fmt: skip
    RoundFold.finish = st.wrap("merge (RoundFold.finish)", RoundFold.finish)
    DiLoCo.outer_step = st.wrap("outer step", DiLoCo.outer_step)
    apprunner.Recorder.evaluate_fn = st.wrap("server evaluation", apprunner.Recorder.evaluate_fn)
    apprunner.Recorder.checkpoint = st.wrap("checkpoint", apprunner.Recorder.checkpoint)
    apprunner._finish = st.wrap("finish: export", apprunner._finish)
    fakegrid.FakeGrid._deliver = st.wrap("transport+client (not server)",
                                         fakegrid.FakeGrid._deliver, trim=False)  # fmt: skip


TINY = {
    "model.hidden": 32,
    "model.layers": 1,
    "model.heads": 2,
    "train.seq-len": 32,
    "train.batch-size": 2,
    "data.val-tokens": 1024,
}  # --tiny: a smoke test of the script


def run(nodes: int, rounds: int, cache: str, threads: int, tiny: bool = False) -> dict:
    sys.path[:0] = [str(REPO / "simulations" / "isoloco-lm"), str(REPO / "tests"),
                    str(REPO / "benchmarks" / "memory" / "apps" / "server_load")]  # fmt: skip
    import torch

    torch.set_num_threads(threads)
    st = Stages()
    base = st.live()
    import client_app as synthetic  # benchmarks/memory/apps/server_load
    import fakegrid
    from isoloco_lm import server_app

    imported = st.live()
    patch(st, server_app, fakegrid)
    out = Path(tempfile.mkdtemp(prefix="server-stages-"))
    rc = {
        "num-server-rounds": rounds,
        "model.name-or-path": "smollm2",
        "data.val-tokens": 1280,
        "strategy.min-nodes": nodes,
        "output-dir": str(out / "run"),
        "torch-threads": threads,
        **({"data.cache-dir": cache} if cache else {}),
    }
    if tiny:
        del rc["model.name-or-path"]
        rc.update(TINY)
    grid = fakegrid.FakeGrid(
        {"train": synthetic.train, "evaluate": synthetic.evaluate}, num_nodes=nodes, run_config=rc
    )
    t0 = time.perf_counter()
    server_app.run_server(grid, rc, settle_s=0.0)
    wall = time.perf_counter() - t0
    st.done = True
    res = json.loads((out / "run" / "results.json").read_text())
    model = 4 * res["model-parameters"]
    rows = [{k: (round(v / MIB) if k in ("before", "peak", "after", "live") else v)
             for k, v in r.items()} for r in st.rows]  # fmt: skip
    return {
        "nodes": nodes,
        "rounds": rounds,
        "model-mib": model / MIB,
        "baseline-mib": base / MIB,
        "after-imports-mib": imported / MIB,
        "peak-mib": max(r["peak"] for r in st.rows) / MIB,
        "hwm-mib": _hwm() / MIB,
        "wall-s": wall,
        "replies-used": [r["replies-used"] for r in res["rounds"]],
        "load-at-end": os.getloadavg()[0],
        "stages": rows,
    }


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def table(res: dict) -> str:
    """Stage rows in order of their end, in MiB and in model copies over the baseline."""
    m, base = res["model-mib"], res["after-imports-mib"]
    lines = [f"model {m:.0f} MiB fp32; after imports {base:.0f} MiB; peak {res['peak-mib']:.0f} "
             f"MiB (VmHWM {res['hwm-mib']:.0f}) = {(res['peak-mib'] - base) / m:.1f} model "
             "copies over the imports",
             "| stage | entry | peak | exit | live | peak - entry (copies) | s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["stages"]:
        if r["stage"].startswith(("take one", "transport")):
            continue  # per reply: summarised below
        live = r.get("live", "-")
        lines.append(f"| {'  ' * r['depth']}{r['stage']} | {r['before']} | {r['peak']} | "
                     f"{r['after']} | {live} | {(r['peak'] - r['before']) / m:.2f} | "
                     f"{r['s']:.1f} |")  # fmt: skip
    for name in ("take one reply (decode, check, fold/spill)", "transport+client (not server)"):
        rs = [r for r in res["stages"] if r["stage"] == name]
        if rs:
            grow = max(r["peak"] - r["before"] for r in rs) / m
            lines.append(f"| {name}: {len(rs)} calls | | | | | max {grow:.2f} | "
                         f"{sum(r['s'] for r in rs):.1f} total |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-dir", default="", help="data.cache-dir (the converted GGUF)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny model (smoke test)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print the JSON's tables only")
    args = ap.parse_args(argv)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    if not args.table:
        res = {
            "label": args.label,
            "command": " ".join(["benchmarks/memory/server_stages.py", *(argv or sys.argv[1:])]),
            **run(args.nodes, args.rounds, args.cache_dir, args.threads, args.tiny),
        }
        data = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
        data["runs"].append(res)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    for res in data["runs"]:
        print(f"\n{res['label']}: {res['nodes']} nodes, {res['rounds']} rounds")
        print(table(res))


if __name__ == "__main__":
    main()
