"""Compressed uploads: round-trip errors, bytes per round, and the loss study.

Three parts, each writing its own JSON under ``benchmarks/results/``:

``roundtrip`` -> ``compression_roundtrip.json``
    Each codec on pseudo-gradient-like tensors (the real deltas of the demo model after one
    round of H inner AdamW steps): relative Frobenius error ``||x - x_hat|| / ||x||``, max
    element error, the codec's stated bound, and payload bytes / fp32 bytes.

``bytes`` -> ``compression_bytes.json``
    One real ``flwr run`` of ``simulations/isoloco-lm`` per codec (``scripts/run_app.sh``:
    private SuperLink, Ray simulation, 2 nodes, 2 rounds, the app's default model) and the
    ``bytes-up`` / ``bytes-down`` per round from its ``results.json``; ratios against the
    uncompressed run of the same invocation.

``loss`` -> ``compression_loss.json``
    M = 8 workers, same tokens (same seed -> same batches and initial model), 3 seeds,
    IsoLoCo and DiLoCo, every codec with and without error feedback. Runs **in-process**: the
    real strategies and the LM app's real ClientApp train handler, driven by
    ``tests/fakegrid.FakeGrid`` (no Ray, no SuperLink: on a 2-core machine a Ray start costs
    more than a whole tiny run). The model is smaller than the app default to fit the budget
    (see ``LOSS_CONFIG``). Resumable: each finished run is appended to the JSON at once and a
    rerun skips the cells already there.

    nice -n 10 python benchmarks/compression/compression_bench.py roundtrip|bytes|loss|table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

from flwr_isoloco.strategies import Codec

REPO = common.REPO
common.on_path("", "simulations/isoloco-lm", "tests")
RESULTS = common.RESULTS
APP = REPO / "simulations" / "isoloco-lm"
CACHE = REPO / ".flwr" / "compression-cache"  # gitignored

# name -> (codec, options); "none" is the uncompressed baseline
CODEC_CELLS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "int8": ("int8", {}),
    "fp8": ("fp8", {}),
    "topk-10%": ("topk", {"fraction": 0.1}),
    "topk-1%": ("topk", {"fraction": 0.01}),
}
LOSS_CONFIG = {
    "num-server-rounds": 12,
    "model.hidden": 64,
    "model.layers": 2,
    "model.heads": 4,
    "model.vocab-size": 1024,
    "train.seq-len": 64,
    "train.batch-size": 8,
    "train.local-steps": 12,
    "train.warmup-steps": 12,
    "data.val-tokens": 8192,
    "checkpoint": False,
    "strategy.min-nodes": 8,
}


def _write(path: Path, obj) -> None:
    from flwr_isoloco.checkpoint import write_json_atomic

    write_json_atomic(path, obj)


# ----------------------------------------------------------------------------- loss study
def _strategy(name: str, codec: str, options: dict, ef: bool, seed: int, m: int):
    from flwr_isoloco.strategies import DiLoCo, IsoLoCo

    cls = IsoLoCo if name == "isoloco" else DiLoCo
    return cls(
        min_available_nodes=m,
        min_train_nodes=m,
        fraction_evaluate=0.0,
        min_evaluate_nodes=0,
        seed=seed,
        upload=Codec(codec, error_feedback=ef, **(options or {})),
    )


def loss_run(strategy_name: str, cell: str, ef: bool, seed: int, m: int = 8) -> dict:
    """One in-process federated run; final validation loss and per-round metrics."""
    from fakegrid import FakeGrid
    from flwr.app import ArrayRecord, ConfigRecord
    from isoloco_lm import client_app, task

    rc = {**LOSS_CONFIG, "seed": seed, "data.cache-dir": str(CACHE), "strategy.min-nodes": m}
    cfg = task.load_config(rc)
    codec, options = CODEC_CELLS[cell]
    strategy = _strategy(strategy_name, codec, options, ef, seed, m)
    grid = FakeGrid({"train": client_app.train}, num_nodes=m, run_config=rc, seed=seed)
    model = task.build_model(cfg)
    val = task.validation_batches(cfg)
    rounds: list[dict] = []
    t0 = time.perf_counter()

    def evaluate_fn(server_round, arrays):
        model.load_state_dict(arrays.to_torch_state_dict())
        loss = task.evaluate_model(model, val)
        rounds.append({"round": server_round, "val-loss": loss})
        from flwr.app import MetricRecord

        return MetricRecord({"val-loss": loss})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items()}),
        num_rounds=cfg["num-server-rounds"],
        train_config=ConfigRecord(task.train_config(cfg)),
        evaluate_fn=evaluate_fn,
    )
    train = result.train_metrics_clientapp
    up = [float(train[r]["bytes-up"]) for r in sorted(train)]
    used = [int(train[r]["replies-used"]) for r in sorted(train)]
    return {
        "strategy": strategy_name,
        "cell": cell,
        "codec": codec,
        "options": options,
        "error-feedback": ef,
        "seed": seed,
        "workers": m,
        "final-val-loss": rounds[-1]["val-loss"],
        "val-loss": [r["val-loss"] for r in rounds],
        "bytes-up-per-round": sum(up) / len(up),
        "replies-used": used,
        "wall-s": time.perf_counter() - t0,
    }


def loss_study(seeds: list[int], strategies: list[str], cells: list[str]) -> None:
    path = RESULTS / "compression_loss.json"
    data = json.loads(path.read_text()) if path.exists() else {"config": LOSS_CONFIG, "runs": []}
    done = {(r["strategy"], r["cell"], r["error-feedback"], r["seed"]) for r in data["runs"]}
    torch.set_num_threads(1)
    for seed in seeds:
        for s in strategies:
            for cell in cells:
                for ef in (False,) if cell == "none" else (True, False):
                    key = (s, cell, ef, seed)
                    if key in done:
                        continue
                    print(f"[loss] {key}", flush=True)
                    row = loss_run(s, cell, ef, seed)
                    print(f"[loss] {key}: {row['final-val-loss']:.4f} ({row['wall-s']:.0f} s)")
                    data["runs"].append(row)
                    _write(path, data)


def loss_table() -> str:
    """Markdown: mean (std) final val loss over seeds and its gap to uncompressed."""
    data = json.loads((RESULTS / "compression_loss.json").read_text())
    cells: dict[tuple, dict[int, float]] = {}
    for r in data["runs"]:
        cells.setdefault((r["strategy"], r["cell"], r["error-feedback"]), {})[r["seed"]] = r[
            "final-val-loss"
        ]
    lines = [
        "| strategy | codec | error feedback | final val loss (mean ± std, seeds) | Δ vs none (paired mean ± std) |",
        "|---|---|---|---|---|",
    ]
    for (s, cell, ef), by_seed in sorted(
        cells.items(), key=lambda kv: (kv[0][0], list(CODEC_CELLS).index(kv[0][1]), not kv[0][2])
    ):
        vals = list(by_seed.values())
        base = cells.get((s, "none", False), {})
        diffs = [by_seed[k] - base[k] for k in by_seed if k in base]
        lines.append(
            f"| {s} | {cell} | {'—' if cell == 'none' else ('yes' if ef else 'no')} | "
            f"{_ms(vals)} (n={len(vals)}) | {'0' if cell == 'none' else _ms(diffs, '+.4f')} |"
        )
    return "\n".join(lines)


def roundtrip_table() -> str:
    d = json.loads((RESULTS / "compression_roundtrip.json").read_text())
    lines = [
        f"{d['entries']:,} entries in {d['model-tensors']} tensors, fp32 record {d['fp32-bytes']:,} bytes.",
        "",
        "| codec | bytes | ratio vs fp32 | rel. Frobenius error (all 2-D) | worst tensor | max element error | per-entry bound holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell, r in d["codecs"].items():
        ok = {True: "yes", False: "NO", None: "—"}[r["bound-holds"]]
        lines.append(
            f"| {cell} | {r['bytes']:,} | {r['ratio-vs-fp32']:.4f} | "
            f"{r['rel-frobenius-error (all 2-D tensors)']:.4f} | {r['max-rel-frobenius-error (per tensor)']:.4f} | "
            f"{r['max-element-error']:.3g} | {ok} |"
        )
    return "\n".join(lines)


def bytes_table() -> str:
    d = json.loads((RESULTS / "compression_bytes.json").read_text())
    lines = [
        "| codec | bytes-up per round (2 nodes) | ratio vs fp32 | bytes-down per round | final val loss (2 rounds) |",
        "|---|---|---|---|---|",
    ]
    for cell, r in d["runs"].items():
        lines.append(
            f"| {cell} | {r['bytes-up-per-round']:,.0f} | {r['ratio-vs-fp32']:.4f} | "
            f"{sum(r['bytes-down']) / len(r['bytes-down']):,.0f} | {r['final-val-loss']:.4f} |"
        )
    return "\n".join(lines)


def write_doc() -> None:
    doc = REPO / "docs" / "compression.md"
    text = doc.read_text()
    for name, fn in (("ROUNDTRIP", roundtrip_table), ("BYTES", bytes_table), ("LOSS", loss_table)):
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = f"{head}{begin}\n{fn()}\n{end}{tail}"
    doc.write_text(text)


def _ms(xs: list[float], fmt: str = ".4f") -> str:
    if not xs:
        return "n/a"
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return f"{mean:{fmt}} ± {std:.4f}"


# ----------------------------------------------------------------------------- round trip
def demo_deltas(seed: int = 0) -> dict[str, torch.Tensor]:
    """Pseudo-gradients of the app's default model: one worker, one round of H AdamW steps."""
    from fakegrid import FakeGrid
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from isoloco_lm import client_app, task

    rc = {"data.cache-dir": str(CACHE), "checkpoint": False, "seed": seed}
    cfg = task.load_config(rc)
    FakeGrid({}, num_nodes=1, run_config=rc)  # sets Flower's task identity for Message()
    model = task.build_model(cfg)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx = Context(1, 1, {"partition-id": 0, "num-partitions": 4}, RecordDict(), rc)
    conf = ConfigRecord({**task.train_config(cfg), "server-round": 1, "payload": "delta"})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(theta), "config": conf}),
        dst_node_id=1,
        message_type="train",
    )
    reply = client_app.train(msg, ctx)
    new = reply.content["arrays"].to_torch_state_dict()
    return {k: theta[k] - new[k] for k in theta if theta[k].is_floating_point()}


def roundtrip() -> None:
    from flwr_isoloco.compression import codecs as C
    from flwr_isoloco.compression import compress, decompress, payload_nbytes

    deltas = demo_deltas()
    mats = {k: v for k, v in deltas.items() if v.dim() >= 2}
    fp32 = payload_nbytes(compress(deltas, "none"))
    out = {
        "model-tensors": len(deltas),
        "entries": sum(v.numel() for v in deltas.values()),
        "fp32-bytes": fp32,
        "codecs": {},
    }
    cells = {**CODEC_CELLS, "topk-1%-int8": ("topk", {"fraction": 0.01, "values": "int8"})}
    for cell, (codec, opts) in cells.items():
        rec = compress(deltas, codec, **opts)
        dec = decompress(rec)
        rel, worst, bound_ok = [], 0.0, True
        for k, x in mats.items():
            err = (dec[k] - x).abs()
            rel.append(float(torch.linalg.vector_norm(dec[k] - x) / torch.linalg.vector_norm(x)))
            worst = max(worst, float(err.max()))
            flat, e = x.reshape(-1), err.reshape(-1)
            b = 256
            amax = (
                torch.nn.functional.pad(
                    flat.abs(), (0, C.n_blocks(flat.numel(), b) * b - flat.numel())
                )
                .view(-1, b)
                .amax(1)
            )
            per = amax.repeat_interleave(b)[: flat.numel()]
            if codec == "int8":
                bound_ok &= bool((e <= per / 254 * (1 + 1e-5) + 1e-12).all())
            elif codec == "fp8":
                bound_ok &= bool((e <= C.fp8_bound(flat, per / 448) * (1 + 1e-5) + 1e-12).all())
        tot = math.sqrt(
            sum(float((dec[k] - x).pow(2).sum()) for k, x in mats.items())
            / sum(float(x.pow(2).sum()) for x in mats.values())
        )
        out["codecs"][cell] = {
            "codec": codec,
            "options": opts,
            "bytes": payload_nbytes(rec),
            "ratio-vs-fp32": payload_nbytes(rec) / fp32,
            "rel-frobenius-error (all 2-D tensors)": tot,
            "max-rel-frobenius-error (per tensor)": max(rel),
            "max-element-error": worst,
            "bound-holds": bound_ok if codec in ("int8", "fp8") else None,
        }
        print(cell, out["codecs"][cell], flush=True)
    _write(RESULTS / "compression_roundtrip.json", out)


# ----------------------------------------------------------------------------- bytes (real runs)
def bytes_runs(rounds: int = 2, nodes: int = 2) -> None:
    path = RESULTS / "compression_bytes.json"
    out_root = REPO / ".flwr" / "compression-runs"
    runs = {}
    for cell, (codec, opts) in CODEC_CELLS.items():
        over = [
            f"num-server-rounds={rounds}",
            f"strategy.min-nodes={nodes}",
            "train.local-steps=5",
            "train.warmup-steps=2",  # the warm-up must fit in the run (2 rounds x 5 steps)
            "checkpoint=false",
            f"strategy.upload-codec='{codec}'",
            f"data.cache-dir='{CACHE}'",
        ]
        if "fraction" in opts:
            over.append(f"strategy.codec-fraction={opts['fraction']}")
        out = out_root / cell
        env = {**os.environ, "NUM_SUPERNODES": str(nodes), "CPUS_PER_CLIENT": "1"}
        cmd = ["bash", str(REPO / "scripts" / "run_app.sh"), str(APP), str(out), *over]
        print("[bytes]", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cell} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        res = json.loads((out / "results.json").read_text())
        rows = res["rounds"]
        runs[cell] = {
            "codec": codec,
            "options": opts,
            "overrides": over,
            "model-parameters": res["model-parameters"],
            "bytes-up": [r["bytes-up"] for r in rows],
            "bytes-down": [r["bytes-down"] for r in rows],
            "replies-used": [r["replies-used"] for r in rows],
            "final-val-loss": rows[-1]["val-loss"],
            "wall-s": time.perf_counter() - t0,
        }
        print(cell, runs[cell], flush=True)
    base = sum(runs["none"]["bytes-up"]) / len(runs["none"]["bytes-up"])
    for r in runs.values():
        r["bytes-up-per-round"] = sum(r["bytes-up"]) / len(r["bytes-up"])
        r["ratio-vs-fp32"] = r["bytes-up-per-round"] / base
    _write(path, {"nodes": nodes, "rounds": rounds, "runs": runs})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["roundtrip", "bytes", "loss", "table"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--strategies", nargs="+", default=["isoloco", "diloco"])
    ap.add_argument("--cells", nargs="+", default=list(CODEC_CELLS))
    a = ap.parse_args()
    if a.part == "roundtrip":
        roundtrip()
    elif a.part == "bytes":
        bytes_runs()
    elif a.part == "loss":
        loss_study(a.seeds, a.strategies, a.cells)
    else:
        write_doc()
        print(loss_table())


if __name__ == "__main__":
    main()
