"""The DiLoCo worker's message in a real deployment: SuperLink and 2 SuperNodes on loopback.

``worker_fresh.py`` emulates a deployed site's message on one machine; this runs the real thing:
``tests/deploy_harness.py``'s loopback federation (TLS SuperLink, SuperNode authentication, each
SuperNode its own process, one ``flwr-clientapp`` process per message, as Flower deploys) and the
isoloco-lm app at SmolLM2-135M's body (hidden 576, 30 layers, 9 heads of 64, 3 KV heads, MLP
1536) with an untied vocabulary of 24,576, which gives SmolLM2-135M's 134.5M parameters (it ties
49,152 x 576 once), so each message moves the same 0.54 GB. H = 4 inner steps of 1 x 64 tokens,
fp32, DiLoCo with the fp32 weights payload, ``checkpoint=false`` (the moments in the node's
private temp folder), 1 torch thread per process. The SuperLink keeps its state in memory
(``--database :flwr-in-memory:``): with its state in a file, the SuperLink answered 500
("sqlite3.OperationalError: database is locked") to the ServerApp's pull while a 0.54 GB reply
was being stored, on this machine at load 8, and the run failed in round 1.

The app is a copy of ``simulations/isoloco-lm`` whose ClientApp is :data:`STAGE_CLIENT`: the
app's own ClientApp with ``worker_stages.StageTimer`` installed and the handler timed; at its
exit (Flower's exit handlers, after the reply is sent) each ``flwr-clientapp`` process appends a
line to ``$ISOLOCO_STAGE_LOG``: seconds from the process's creation to Flower loading the app
(``before_app``: the interpreter and Flower's start, the FAB, pulling the message and its
Context), importing the app (``app_import``: torch, transformers, flwr_isoloco, the app), in
the handler and its stages, and to the exit (``process``). What is neither of these
(``after``: ``process - before_app - app_import - handler``) is Flower's sending of the reply
and the process's stop.

    python benchmarks/gpu/worker_deployed.py                # 3 rounds, records in worker_throughput.json
    python benchmarks/gpu/worker_deployed.py --rounds 2 --vocab 2048 --layers 2   # small, quick

Records ``worker_throughput.json`` phase ``--phase`` (default ``deployed``), part
``deployed:135m:fp32``: every process's line, the run's wall seconds and the medians of the train
messages after the first round (the first builds the node's state from nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import common  # noqa: E402

common.on_path("tests")
from deploy_harness import IN_MEMORY, loopback_deployment  # noqa: E402

APP = common.REPO / "simulations" / "isoloco-lm"

STAGE_CLIENT = '''"""Benchmark-only ClientApp (benchmarks/gpu/worker_deployed.py): the isoloco-lm ClientApp
with the worker's stages timed; one JSON line per process at its exit."""
import json, os, sys, time

import psutil

CREATED = psutil.Process().create_time()
T0 = time.time()
sys.path.insert(0, os.environ["ISOLOCO_BENCH_GPU"])
import torch  # noqa: E402
import worker_stages  # noqa: E402
from flwr_isoloco.clients import node_state  # noqa: E402

TIMER = worker_stages.StageTimer(torch.device("cpu"))
TIMER.install()
HANDLER = []
_with_node_state = node_state.with_node_state


def _timed(fn, **kw):
    inner = _with_node_state(fn, **kw)

    def call(msg, ctx):
        t = time.perf_counter()
        try:
            return inner(msg, ctx)
        finally:
            HANDLER.append((msg.metadata.message_type, time.perf_counter() - t))

    return call


node_state.with_node_state = _timed
BENCH_S = time.time() - T0
from isoloco_lm import client_app as _client_app  # noqa: E402

app = _client_app.app
for _name, _stage in (("build_model", "model_build"), ("node_batches", "data")):
    setattr(_client_app, _name, TIMER.wrap(_stage, getattr(_client_app, _name)))

READY = time.time()


def _line():
    rec = {
        "pid": os.getpid(),
        "before_app": T0 - CREATED,
        "app_import": READY - T0 - BENCH_S,
        "imports": READY - CREATED - BENCH_S,
        "handler": HANDLER,
        "stages": TIMER.seconds,
        "process": time.time() - CREATED,
    }
    with open(os.environ["ISOLOCO_STAGE_LOG"], "a") as f:
        f.write(json.dumps(rec) + "\\n")


from flwr.supercore.exit.exit_handler import add_exit_handler  # noqa: E402

add_exit_handler(_line, run_before_force_exit=True)
'''


def make_app(root: Path) -> Path:
    """A copy of the isoloco-lm app whose ClientApp is :data:`STAGE_CLIENT`."""
    app = root / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__", "outputs", "*.png"))
    (app / "isoloco_lm" / "stage_client.py").write_text(STAGE_CLIENT)
    toml = app / "pyproject.toml"
    text = toml.read_text()
    old = 'clientapp = "isoloco_lm.client_app:app"'
    if old not in text:
        raise RuntimeError(f"{toml}: no {old!r} to replace")
    toml.write_text(text.replace(old, 'clientapp = "isoloco_lm.stage_client:app"'))
    return app


def run_config(args, out: Path) -> dict[str, Any]:
    return {
        "num-server-rounds": args.rounds,
        "output-dir": str(out),
        "checkpoint": False,
        "strategy.name": "diloco",
        "strategy.min-nodes": 2,
        "model.hidden": args.hidden,
        "model.layers": args.layers,
        "model.heads": args.hidden // 64,
        "model.kv-heads": 3 if args.hidden == 576 else 0,
        "model.intermediate": 1536 if args.hidden == 576 else 0,
        "model.vocab-size": args.vocab,
        "train.local-steps": 4,
        "train.warmup-steps": 0,
        "train.batch-size": 1,
        "train.seq-len": 64,
        "data.val-tokens": 1024,
    }


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the train messages after round 1's two (which start from nothing)."""
    train = [r for r in lines if any(t == "train" for t, _ in r["handler"])]  # in exit order
    later = train[2:] if len(train) > 2 else train
    rows: dict[str, list[float]] = {}
    for r in later:
        handler = sum(s for t, s in r["handler"] if t == "train")
        for k, v in r["stages"].items():
            rows.setdefault(k, []).append(v)
        rows.setdefault("imports", []).append(r["imports"])
        for k in ("before_app", "app_import"):
            rows.setdefault(k, []).append(r[k])
        rows.setdefault("after", []).append(
            r["process"] - r["before_app"] - r["app_import"] - handler
        )
        rows.setdefault("handler", []).append(handler)
        rows.setdefault("process", []).append(r["process"])
        rows.setdefault("transport_other", []).append(r["process"] - r["imports"] - handler)
        rows.setdefault("overhead", []).append(r["process"] - r["stages"].get("inner_steps", 0))
        rows.setdefault("handler_overhead", []).append(handler - r["stages"].get("inner_steps", 0))
    return {k: statistics.median(v) for k, v in rows.items()} | {"messages": len(later)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=24576)
    ap.add_argument("--phase", default="deployed")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "worker_throughput.json")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    from worker_throughput import update_record

    with tempfile.TemporaryDirectory(prefix="worker-deployed-") as tmp:
        root = Path(tmp)
        log = root / "stages.jsonl"
        os.environ["ISOLOCO_STAGE_LOG"] = str(log)
        os.environ["ISOLOCO_BENCH_GPU"] = str(HERE)
        os.environ["OMP_NUM_THREADS"] = "1"
        app = make_app(root)
        t0 = time.perf_counter()
        with loopback_deployment(root / "dep", num_supernodes=2, database=IN_MEMORY) as dep:
            up = time.perf_counter()
            outcome = dep.run_app(app, run_config(args, root / "out"), timeout=args.timeout)
            wall = time.perf_counter() - up
        if outcome.status != "finished:completed":
            keep = Path(tempfile.mkdtemp(prefix="worker-deployed-failed-"))
            shutil.copytree(root / "dep", keep / "dep", ignore=shutil.ignore_patterns("*.db"))
            print(f"the deployment's logs are kept in {keep}", file=sys.stderr)
            raise RuntimeError(
                f"run ended {outcome.status}: {outcome.output[-2000:]} {outcome.logs[-3000:]}"
            )
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        results = json.loads((root / "out" / "results.json").read_text())
    rec = {
        "rounds": args.rounds,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "run_wall_s": wall,
        "setup_s": up - t0,
        "processes": lines,
        "summary": summary(lines),
        "final": {k: v for k, v in results.items() if not isinstance(v, (list, dict))},
    }
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/gpu/worker_deployed.py " + " ".join(argv or sys.argv[1:]),
        "commit": common.git("rev-parse", "HEAD"),
        "machine": {**common.machine(), "load-avg-end": list(os.getloadavg())},
    }
    update_record(args.out, args.phase, f"deployed:{args.hidden}x{args.layers}:fp32", rec, meta)
    print(json.dumps(rec["summary"], indent=1))
    return rec


if __name__ == "__main__":
    main()
