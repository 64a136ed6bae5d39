"""Per-message cost of keeping a DiLoCo worker's AdamW state on the node's disk.

In one process, for the flat AdamW state of a model of N parameters (``exp_avg``,
``exp_avg_sq``: N fp32 each; ``step``: one per parameter tensor), median of ``--repeats``:

- ``memory``: the in-memory path a simulation takes per message when the state lives in
  ``context.state``: build the ArrayRecord, pickle the RecordDict and unpickle it twice (the
  Context goes to the Ray actor and back), decode it (``to_torch_state_dict``);
- ``save``: :func:`~flwr_isoloco.clients.node_state.save_node_state` (sha256 of every tensor,
  safetensors write, atomic rename), which the apps already did every round before the
  offload; plus the header digest for the handle;
- ``load``: what a round now does first: header digest, verified read
  (:func:`~flwr_isoloco.clients.node_state.load_state_file`: sha256 and finiteness of every
  tensor), decode.

Ratios are against ``memory``. The file was just written, so it is read from the page cache.
Sizes: the 51 MiB benchmark model (13,373,952 parameters, 39 tensors) and SmolLM2-135M
(134,515,008 parameters, 272 tensors).

    nice -n 10 .venv/bin/python benchmarks/memory/node_state_cost.py [--repeats 5]

Writes ``benchmarks/results/node_state_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flwr_isoloco.clients.node_state import file_digest, load_state_file, save_node_state

OUT = Path(__file__).resolve().parents[1] / "results" / "node_state_cost.json"
SIZES = {"51MiB": (13_373_952, 39), "135M": (134_515_008, 272)}


def _state(n: int, tensors: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "exp_avg": torch.randn(n, generator=g) * 1e-3,
        "exp_avg_sq": torch.rand(n, generator=g) * 1e-6,
        "step": torch.full((tensors,), 30.0),
    }


def _memory(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rd = RecordDict({"diloco.adamw": ArrayRecord(arrays), "diloco.worker": ConfigRecord({"c": 1})})
    for _ in range(2):  # to the actor and back
        rd = pickle.loads(pickle.dumps(rd, protocol=pickle.HIGHEST_PROTOCOL))
    return rd["diloco.adamw"].to_torch_state_dict()


def _save(arrays: dict[str, torch.Tensor], folder: Path) -> tuple[Path, str]:
    rd = RecordDict({"diloco.adamw": ArrayRecord(arrays), "diloco.worker": ConfigRecord({"c": 1})})
    path = save_node_state(rd, folder, 0, 1)
    return path, file_digest(path)


def _load(path: Path, digest: str) -> dict[str, torch.Tensor]:
    if file_digest(path) != digest:
        raise RuntimeError("digest changed")
    return load_state_file(path, 0, 1)["diloco.adamw"].to_torch_state_dict()


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(size: str, repeats: int) -> dict:
    n, tensors = SIZES[size]
    arrays = _state(n, tensors)
    with tempfile.TemporaryDirectory(prefix="node-state-cost-") as tmp:
        t_mem, back = _median(lambda: _memory(arrays), repeats)
        assert all(torch.equal(back[k], arrays[k]) for k in arrays)
        del back
        t_save, (path, digest) = _median(lambda: _save(arrays, Path(tmp)), repeats)
        t_load, back = _median(lambda: _load(path, digest), repeats)
        assert all(torch.equal(back[k], arrays[k]) for k in arrays)  # bitwise round trip
        file_mb = path.stat().st_size / 2**20
    return {
        "size": size,
        "parameters": n,
        "state-mib": round(file_mb, 1),
        "memory-s": t_mem,
        "save-s": t_save,
        "load-s": t_load,
        "save/memory": t_save / t_mem,
        "load/memory": t_load / t_mem,
        "(save+load)/memory": (t_save + t_load) / t_mem,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(s, args.repeats) for s in args.sizes]
    for r in rows:
        print(json.dumps(r))
    OUT.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
