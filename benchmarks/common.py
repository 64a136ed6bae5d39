"""What the benchmark scripts share: the checkout's folders, the import path they need, the LM
app in a Ray simulation, JSON record files, and the generated blocks they write into the docs.

A script in ``benchmarks/<study>/`` reaches this module with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    import common  # noqa: E402
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
"""The checkout's root."""
RESULTS = REPO / "benchmarks" / "results"
"""The records the docs and tests cite by name (they stay here whatever the script's folder)."""
LM_APP = REPO / "simulations" / "isoloco-lm"
"""The LM app (its ``isoloco_lm`` package is imported by the scripts that drive it)."""
SMALL_LM = {"model.hidden": 64, "model.heads": 2, "data.val-tokens": 4096}
"""Run-config keys of the small LM that the Ray benchmarks of the LM app train and evaluate."""


MIB = 2**20


def status_mib(field: str) -> float | None:
    """A ``/proc/self/status`` field in MiB (``VmRSS``, ``VmHWM``); None off Linux."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def on_path(*folders: str) -> None:
    """Put ``REPO / folder`` first on ``sys.path`` for each folder, the first named first
    (``"simulations/isoloco-lm"`` for the LM app, ``"tests"`` for FakeGrid and test helpers)."""
    paths = [str(REPO / f) for f in folders]
    sys.path[:0] = [p for p in paths if p not in sys.path]


def offline_env() -> None:
    """No telemetry, no update check, no Hugging Face downloads, quiet tokenizers (each only
    where the environment does not set it already)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def export_path(*folders: str) -> None:
    """Put ``REPO / folder`` for each folder first on ``PYTHONPATH``, before what the
    environment had there: the import path of the processes a script starts (Ray's workers)."""
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / f) for f in folders] + [old] * bool(old))


def with_run_config(context: Any, rc: dict[str, Any]) -> Any:
    """A copy of a ClientApp's ``context`` whose run config has ``rc`` on top (``run_simulation``
    passes none, and a Context's run config is read-only); the same ``state``, so a worker's
    optimiser state persists across rounds."""
    from flwr.app import Context

    return Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=context.node_config,
        state=context.state,
        run_config={**context.run_config, **rc},
    )


def save_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def git(*args: str) -> str:
    """``git *args`` in the checkout: its output, stripped (empty where git fails)."""
    run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return run.stdout.strip()


def ray_simulation(
    server_app: Any,
    client_app: Any,
    nodes: int,
    *,
    cpus_per_node: float = 1.0,
    init_args: dict[str, Any] | None = None,
) -> None:
    """``flwr.simulation.run_simulation`` on the Ray backend with ``nodes`` SuperNodes of
    ``cpus_per_node`` CPUs and no GPU; Ray starts with ``init_args`` (default: 2 CPUs), never
    a dashboard."""
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=nodes,
        backend_config={
            "client_resources": {"num_cpus": cpus_per_node, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False, **(init_args or {"num_cpus": 2})},
        },
    )


def engine_threads(nodes: int) -> None:
    """Let a Ray simulation in this process run ``nodes`` nodes at once. Flower 1.42's
    simulation engine runs its worker loops in a ``ThreadPoolExecutor()`` of the default size,
    ``cpu_count + 4``: on 2 cores at most 6 nodes train at once whatever the actor pool holds,
    and the others wait for a thread (``flwr/server/superlink/fleet/vce/vce_api.py``)."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from flwr.server.superlink.fleet.vce import vce_api

    vce_api.ThreadPoolExecutor = functools.partial(ThreadPoolExecutor, max_workers=nodes + 2)


def run_lm_app(rc: dict[str, Any], client_app: Any, nodes: int) -> tuple[dict[str, Any], float]:
    """The LM app's server (``server_app.run_server`` on run config ``rc``, 2 s to settle)
    with ``client_app`` in a Ray simulation of ``nodes`` SuperNodes; returns the run's
    ``results.json`` (under ``rc["output-dir"]``) and the simulation's wall seconds.
    ``isoloco_lm`` must be importable (:func:`on_path` ``"simulations/isoloco-lm"``)."""
    from flwr.serverapp import ServerApp
    from isoloco_lm import server_app

    server = ServerApp()

    @server.main()
    def main(grid, context):
        server_app.run_server(grid, rc, settle_s=2.0)

    t0 = time.perf_counter()
    ray_simulation(server, client_app, nodes)
    wall = time.perf_counter() - t0
    return json.loads((Path(rc["output-dir"]) / "results.json").read_text()), wall


def load_records(path: Path) -> list[dict[str, Any]]:
    """The JSON list of records at ``path`` (empty when there is no file yet)."""
    return json.loads(path.read_text()) if path.is_file() else []


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive lock on the folder of ``path`` (``flock`` on the folder itself, so no lock file
    is left behind): processes appending to one records file take it in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to the JSON list at ``path`` at once (atomic replace), under
    :func:`locked`, so that processes sharing the file (a sweep's shards, two queues) lose no
    record."""
    with locked(path):
        records = load_records(path)
        records.append(record)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records, indent=1) + "\n")
        os.replace(tmp, path)


def splice(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what stands between the markers ``begin`` and ``end`` (each there once)
    replaced by ``body`` on lines of its own."""
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def write_block(doc: Path, begin: str, end: str, body: str) -> None:
    """Rewrite the generated block of ``doc`` between ``begin`` and ``end`` (:func:`splice`)."""
    doc.write_text(splice(doc.read_text(), begin, end, body))


def rule(columns: int) -> str:
    """A markdown table's separator row for ``columns`` columns."""
    return "|---" * columns + "|"


def machine() -> dict[str, Any]:
    """Where a timing ran: CPUs, load average (1, 5, 15 min), torch and its CUDA device."""
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load-avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "cuda-device": torch.cuda.get_device_name(0) if cuda else None,
    }


def node_context(partition_id: int = 0, num_partitions: int = 1, node_id: int = 77) -> Any:
    """A SuperNode's ``Context`` (empty state and run config) for calling a ClientApp handler in
    this process; Flower's task identity is set first (tests' ``FakeGrid``), without which no
    ``Message`` can be built. Needs ``tests`` on the path (:func:`on_path`)."""
    from fakegrid import FakeGrid
    from flwr.app import Context, RecordDict

    FakeGrid({}, num_nodes=1)
    nc = {"partition-id": partition_id, "num-partitions": num_partitions}
    return Context(1, node_id, nc, RecordDict(), {})


def train_message(arrays: Any, config: dict[str, Any], node_id: int = 77) -> Any:
    """A ``train`` Message to ``node_id`` holding the ArrayRecord ``arrays`` and ``config``, the
    records a DiLoCo worker reads (call :func:`node_context` once before)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    content = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
    return Message(content, node_id, "train")
