"""The prepared GPU check: one command, at most 8 minutes on one GPU.

    python benchmarks/gpu/gpu_check.py --out $OUT/gpu_check.json

Four parts, each in its own Python process with its own time limit (``LIMITS_S``), so a part
that fails, hangs or runs out of memory costs only its own result; the JSON is rewritten after
every part (partial results survive):

- ``throughput``: the worker's handler against the bare loop on CUDA in bf16, without and with
  ``torch.compile``, at the sweep and SmolLM2-135M sizes (:mod:`worker_throughput`'s
  ``measure_cell``: ratio = t_bare / t_handler, overhead in inner steps, final-weight diff).
  A cell not started before the part's budget is recorded as skipped.
- ``stages``: one SmolLM2-135M bf16 message of the isoloco-lm app's path (its mods, the node's
  state in its temp folder, the worker) split into stages (:mod:`worker_stages`: unpack, load,
  optimiser restore and save, inner steps, reply, node-state read/write), seconds each, and
  tokens/s of the handler and of the bare loop.
- ``app``: the isoloco-lm app, 2 nodes on one GPU (``num_gpus = 0.5`` each, the Ray backend's
  ``client_resources``: the in-process spelling of ``flwr run ... --federation-config
  "num-supernodes=2 client-resources-num-gpus=0.5"``), ``train.precision = bf16``, 3 rounds.
  Evidence that the nodes trained on the GPU: each node's process writes what it sees
  (``CUDA_VISIBLE_DEVICES``, ``torch.cuda.is_available()``, the device name), and the log
  lines ``DiLoCo worker: ... trains on cuda...`` are counted.
- ``merge``: :func:`flwr_isoloco.merging.merge` on ``device="cuda"`` against ``device="cpu"``
  on 4 random pseudo-gradients of SmolLM2-135M's shapes (seeded, std 1e-3): seconds on each
  (CUDA: first call and a second, warm one) and max |cuda - cpu| (also relative to max |cpu|).

Without CUDA it writes ``{"cuda": false, ...}`` with the reason and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # worker_throughput, common
import common  # noqa: E402

common.on_path("simulations/isoloco-lm", "tests", "benchmarks/lm")
common.offline_env()

import torch  # noqa: E402

LIMITS_S = {"throughput": 210, "stages": 90, "app": 130, "merge": 50}  # 480 s: the 8 minutes
GPU_INFO_ENV = "GPU_CHECK_NODE_INFO"
APP_RC = {"num-server-rounds": 3, "train.precision": "bf16", "train.device": "auto"}
MERGE_RULES = ("mean", "iso_c", "iso_c_ns")


# ----------------------------------------------------------------------------- throughput
def throughput_part(budget_s: float, write) -> dict[str, Any]:
    """bf16 cells at the sweep and 135m sizes, compile off then on; ``write`` after each."""
    import worker_throughput as wt

    device = torch.device("cuda")
    table = wt.sizes("cuda")
    t0, cells = time.perf_counter(), []
    for comp in (False, True):
        for name in ("sweep", "135m"):
            key = {"size": name, "precision": "bf16", "compile": comp}
            if time.perf_counter() - t0 > budget_s:
                cells.append({**key, "skipped": f"part budget {budget_s:.0f} s used"})
                continue
            try:
                cell = wt.measure_cell(table[name], device, "bf16", comp, repeats=3)
                cell["cell_s"] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - recorded, the next cell goes on
                cell = {**key, "error": f"{type(exc).__name__}: {exc}"[:500]}
            cells.append({k: v for k, v in cell.items()})
            write({"cells": cells})
    return {"cells": cells}


# ----------------------------------------------------------------------------- stages
def stages_part(budget_s: float, write, device: str = "cuda", size_name: str = "135m"):
    """Where a 135m bf16 message's seconds go on the GPU (:mod:`worker_stages`, the app's path:
    its mods, ``with_node_state(temp_dir=True)``, the handler), with tokens/s of both arms."""
    import worker_stages as ws
    import worker_throughput as wt

    dev = torch.device(device)
    size = wt.sizes(dev.type, quick=size_name == "tiny", names=[size_name])[size_name]
    res = ws.stage_breakdown(size, dev, "bf16", messages=2, app=True)  # fits its 90 s
    tokens = size.batch * size.seq_len * size.h
    res["tokens_per_s_bare"] = tokens / res["bare_median_s"]
    res["tokens_per_s_handler"] = tokens / res["median_s"]["message"]
    res["budget_s"] = budget_s
    write({"cells": [res]})
    return {"cells": [res]}


# ----------------------------------------------------------------------------- app
def gpu_train(msg, context):
    """The isoloco-lm app's train handler on :data:`APP_RC` (``run_simulation`` passes no run
    config), appending what this node's process sees to ``$GPU_CHECK_NODE_INFO``."""
    from isoloco_lm import client_app

    t0 = time.perf_counter()
    reply = client_app.train(msg, common.with_run_config(context, APP_RC))
    cuda = torch.cuda.is_available()
    row = {
        "node": context.node_id,
        "pid": os.getpid(),
        "handler_s": time.perf_counter() - t0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "reply_error": reply.error.reason if reply.has_error() else None,
    }
    with open(os.environ[GPU_INFO_ENV], "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return reply


def gpu_client_app():
    from flwr.clientapp import ClientApp
    from isoloco_lm.client_app import app

    client = ClientApp(mods=list(getattr(app, "_mods", [])))
    client.train()(gpu_train)
    return client


def app_part(budget_s: float, write, num_gpus: float = 0.5) -> dict[str, Any]:
    """2 nodes at ``num_gpus = 0.5`` on one GPU, 3 rounds in bf16 (module docstring;
    ``num_gpus = 0`` runs the same on the CPU)."""
    import gpu_check  # by name, so Ray's workers import it too
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation
    from isoloco_lm import server_app

    common.export_path("benchmarks/gpu", "benchmarks", "simulations/isoloco-lm", "tests")
    with tempfile.TemporaryDirectory() as tmp:
        info = Path(tmp) / "nodes.jsonl"
        os.environ[GPU_INFO_ENV] = str(info)
        rc = {**APP_RC, "output-dir": str(Path(tmp) / "out")}
        server = ServerApp()

        @server.main()
        def main(grid, context):
            server_app.run_server(grid, rc, settle_s=2.0)

        t0 = time.perf_counter()
        run_simulation(
            server_app=server,
            client_app=gpu_check.gpu_client_app(),
            num_supernodes=2,
            backend_config={
                "client_resources": {"num_cpus": 2, "num_gpus": num_gpus},
                "init_args": {"include_dashboard": False},
            },
        )
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in info.read_text().splitlines()] if info.is_file() else []
        res_path = Path(rc["output-dir"]) / "results.json"
        res = json.loads(res_path.read_text()) if res_path.is_file() else {}
    rounds = res.get("rounds", [])
    return {
        "run_config": APP_RC,
        "nodes": 2,
        "num_gpus_per_node": num_gpus,
        "wall_s": wall,
        "node_messages": rows,
        "rounds_completed": len(rounds),
        "val_loss": [r.get("val-loss") for r in rounds],
        "all_nodes_saw_cuda": bool(rows) and all(r["cuda_available"] for r in rows),
    }


# ----------------------------------------------------------------------------- merge
def smollm2_shapes() -> dict[str, tuple[int, ...]]:
    """SmolLM2-135M's parameter shapes (the tied head once), built on the meta device."""
    import worker_throughput as wt
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(wt.smollm2_135m_config())
    return {k: tuple(p.shape) for k, p in model.named_parameters()}


def random_deltas(shapes, workers: int = 4, seed: int = 0, std: float = 1e-3):
    g = torch.Generator().manual_seed(seed)
    return [
        {k: torch.randn(s, generator=g) * std for k, s in shapes.items()} for _ in range(workers)
    ]


def _timed_merge(merge, rule, deltas, device):
    """``merge(rule, deltas, device=device)`` (CPU tensors back) and its seconds."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = merge(rule, deltas, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return res, time.perf_counter() - t0


def merge_part(budget_s: float, write, device: str = "cuda", shapes=None) -> dict[str, Any]:
    """Each rule of :data:`MERGE_RULES` on ``device`` and on the CPU (module docstring)."""
    from flwr_isoloco.merging import merge

    shapes = shapes if shapes is not None else smollm2_shapes()
    t0 = time.perf_counter()
    deltas = random_deltas(shapes)
    out = {
        "workers": len(deltas),
        "parameters": sum(v.numel() for v in deltas[0].values()),
        "device": device,
        "rules": [],
    }
    for rule in MERGE_RULES:
        if time.perf_counter() - t0 > budget_s:
            out["rules"].append({"rule": rule, "skipped": f"part budget {budget_s:.0f} s used"})
            continue
        try:
            ref, cpu_s = _timed_merge(merge, rule, deltas, "cpu")
            res, first_s = _timed_merge(merge, rule, deltas, device)
            res, warm_s = _timed_merge(merge, rule, deltas, device)
            diff = max(float((res[k] - ref[k]).abs().max()) for k in ref)
            scale = max(float(ref[k].abs().max()) for k in ref)
            out["rules"].append(
                {
                    "rule": rule,
                    "cpu_s": cpu_s,
                    "device_first_s": first_s,
                    "device_warm_s": warm_s,
                    "max_abs_diff": diff,
                    "max_abs_cpu": scale,
                    "rel_diff": diff / scale,
                }
            )
        except Exception as exc:  # noqa: BLE001 - recorded, the next rule goes on
            out["rules"].append({"rule": rule, "error": f"{type(exc).__name__}: {exc}"[:500]})
        write(out)
    return out


PARTS = {
    "throughput": throughput_part,
    "stages": stages_part,
    "app": app_part,
    "merge": merge_part,
}


# ----------------------------------------------------------------------------- driver
def run_part(name: str, limit_s: float) -> dict[str, Any]:
    """Part ``name`` in a child process, killed after ``limit_s``; its (partial) result, its
    seconds and the tail of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        part_out = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, __file__, "--part", name, "--out", str(part_out)]
        t0 = time.perf_counter()
        # its own session: on a timeout the whole group goes (Ray's processes of the app part)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            log, _ = proc.communicate(timeout=limit_s)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            rc = "timeout"
        result = json.loads(part_out.read_text()) if part_out.is_file() else {}
    result |= {
        "part_s": time.perf_counter() - t0,
        "limit_s": limit_s,
        "exit": rc,
        "log_tail": log[-3000:],
    }
    if name == "app":
        lines = [x for x in log.splitlines() if "trains on" in x]
        result["log_trains_on"] = lines[:8]
        result["log_shows_cuda"] = any("trains on cuda" in x for x in lines)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts, comma separated")
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)  # the child
    args = ap.parse_args(argv)

    def write(data):
        common.save_json(args.out, data)

    if args.part:  # the child: one part, its result written as it goes
        budget = LIMITS_S[args.part] - 45  # start-up and the last cell's time
        write(PARTS[args.part](budget, write))
        return 0
    record: dict[str, Any] = {
        "cuda": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": common.git("rev-parse", "HEAD"),
        "machine": common.machine(),
        "limits_s": LIMITS_S,
        "parts": {},
    }
    if not record["cuda"]:
        record["message"] = (
            "no CUDA device visible (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}): nothing was measured; run this on a "
            "machine with a GPU and a CUDA build of torch"
        )
        write(record)
        print(f"gpu_check: {record['message']}; wrote {args.out}")
        return 0
    for name in args.parts.split(","):
        if name not in PARTS:
            raise SystemExit(f"--parts: unknown part {name!r}; choose from {', '.join(PARTS)}")
        print(f"gpu_check: {name} (at most {LIMITS_S[name]} s)", flush=True)
        record["parts"][name] = run_part(name, LIMITS_S[name])
        write(record)
    print(f"gpu_check: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
