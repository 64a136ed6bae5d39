"""Where the DiLoCo worker's time goes (``benchmarks/gpu/worker_throughput.py --profile`` and
``--share``).

- :func:`profile_message`: one handler message under cProfile, the cumulative seconds of the
  functions of :data:`PROFILED` (after one warm-up message), and one bare message's seconds.
- :func:`measure_share`: the isoloco-lm demo at its defaults (4 nodes, 10 rounds, H = 20) in a
  Ray simulation (``common.run_lm_app``; 2 CPUs, 1 per node, so 2 nodes train at a time); a
  timer around the worker's inner-step loop (``diloco_worker._inner_steps``) and one around the
  app's whole train handler, written by each node's process to a file;
  share = (sum of inner-step seconds) / (2 x wall seconds).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent)]  # worker_throughput
import torch  # noqa: E402
from worker_throughput import Size, arms, common, timed  # noqa: E402

SHARE_TIMINGS_ENV = "WORKER_THROUGHPUT_TIMINGS"


PROFILED = {
    "message": "diloco_worker.py:train",
    "inner_steps": "inner_loop.py:inner_steps",
    "save_adamw": "worker_cache.py:save_adamw",
    "adamw_to_flat": "adamw_state.py:adamw_to_flat",
    "ArrayRecord.from_torch_state_dict": "arrayrecord.py:from_torch_state_dict",
    "reply_content": "reply_content",
    "load_model_arrays": "hf.py:load_model_arrays",
}


def profile_message(size: Size, device: torch.device, precision: str) -> dict[str, Any]:
    """Where one handler message's seconds go (cProfile, cumulative seconds of the functions
    of :data:`PROFILED`), after one warm-up message; and one bare message's seconds."""
    import cProfile
    import pstats

    bare, handler, batches = arms(size, device, precision, False, 3)
    handler.message()
    prof = cProfile.Profile()
    prof.enable()
    handler.message()
    prof.disable()
    bare_s = timed(lambda: bare.message(batches), device)
    cum: dict[str, float] = {}
    for (file, _line, fn), row in pstats.Stats(prof).stats.items():
        where = f"{Path(file).name}:{fn}"
        for name, pat in PROFILED.items():
            if where.endswith(pat) or (":" not in pat and fn == pat):
                cum[name] = max(cum.get(name, 0.0), row[3])
    return {
        "size": size.name,
        "precision": precision,
        "h": size.h,
        "bare_msg_s": bare_s,
        "cumulative_s": cum,
        "method": "cProfile of the second handler message",
    }


# ----------------------------------------------------------------------------- simulation share
_TIMER: dict[str, float] = {}


def _timed_inner_steps(original):
    def inner_steps(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _TIMER["inner_s"] = _TIMER.get("inner_s", 0.0) + time.perf_counter() - t0

    inner_steps.timed = True
    return inner_steps


def share_train(msg, context):
    """The isoloco-lm app's train handler with two timers (whole handler; the worker's loop of
    H inner steps, ``diloco_worker._inner_steps``), appended as one JSON line per message to the
    file named by ``$WORKER_THROUGHPUT_TIMINGS``."""
    from isoloco_lm import client_app

    from flwr_isoloco.clients import diloco_worker as dw

    loop = getattr(dw, "_inner_steps", None)
    if loop is not None and not getattr(loop, "timed", False):
        dw._inner_steps = _timed_inner_steps(loop)
    _TIMER.clear()
    t0 = time.perf_counter()
    reply = client_app.train(msg, context)
    row = {
        "handler_s": time.perf_counter() - t0,
        "inner_s": _TIMER.get("inner_s"),
        "pid": os.getpid(),
        "node": context.node_id,
    }
    with open(os.environ[SHARE_TIMINGS_ENV], "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return reply


def share_client_app():
    """A ClientApp with the app's mods and :func:`share_train`."""
    from flwr.clientapp import ClientApp
    from isoloco_lm.client_app import app

    client = ClientApp(mods=list(getattr(app, "_mods", [])))
    client.train()(share_train)
    return client


def measure_share(nodes: int = 4, actors: int = 2) -> dict[str, Any]:
    """The demo in a Ray simulation: where its wall time goes (module docstring)."""
    import worker_share as ws  # by name, so Ray's workers import it too

    common.export_path("benchmarks/gpu", "benchmarks", "simulations/isoloco-lm")
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "timings.jsonl"
        os.environ[SHARE_TIMINGS_ENV] = str(timings)
        load0 = os.getloadavg()[0]
        res, wall = common.run_lm_app(
            {"output-dir": str(Path(tmp) / "out")}, ws.share_client_app(), nodes
        )
        rows = [json.loads(line) for line in timings.read_text().splitlines()]
    inner = [r["inner_s"] for r in rows]
    rounds_s = sum(r["round-wall-s"] for r in res["rounds"])
    handler_s = sum(r["handler_s"] for r in rows)
    out = {
        "run": "isoloco-lm defaults (README demo) via common.run_lm_app (run_simulation, Ray)",
        "nodes": nodes,
        "actors": actors,
        "messages": len(rows),
        "wall_s": wall,
        "rounds_wall_s": rounds_s,
        "handler_s": handler_s,
        "share_handler_of_wall": handler_s / (actors * wall),
        "final_val_loss": res["rounds"][-1]["val-loss"],
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg()[0],
        "method": "timer around diloco_worker._inner_steps and around the app's train handler, "
        "in each node's process; share = sum / (actors x seconds)",
    }
    if all(x is not None for x in inner):
        out |= {
            "inner_s": sum(inner),
            "share_inner_of_wall": sum(inner) / (actors * wall),
            "share_inner_of_rounds": sum(inner) / (actors * rounds_s),
        }
    else:
        out["inner_s"] = None  # the worker has no _inner_steps to time
    return out
