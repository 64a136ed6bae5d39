"""The bytes-vs-accuracy frontier, short, on ``examples/digits``.

The digits app (small CNN on sklearn's 8x8 digits, 4 nodes, IID, 10 rounds of 1 local epoch)
runs in-process on the tests' fake grid, as ``benchmarks/dropin/isoloco_dropin.py`` runs it
(the app's own ``server_app.run_federation``; ``CountingGrid`` of message_bytes.py counts every
message), for DiLoCo and IsoLoCo x

- ``fp32``: no codec; ``int8`` / ``int4``: that codec both ways (uploads with error feedback);
- ``sparseloco+nesterov``: sparseloco both ways (64 x 64 tiles, k = 64, 2-bit), error
  feedback with the outer Nesterov momentum kept (mu = 0.9, as MuLoCo);
- ``sparseloco, mu=0``: the same codecs, outer momentum 0 (error feedback replaces it, as
  SparseLoCo), outer lr around 1.
- ``--diagnose``: :data:`DIAGNOSIS`, one direction at a time and 30 rounds.

Protocol: each configuration's outer lr is tuned on the validation split (the app's
``split="validation"``: 20 % of the training images held out, seed 0; 3 points, extended while
the lowest final validation loss is on the grid's edge), then 3 seeds (model, strategy and
partition seed) at the optimum on the test split. Bytes are the train messages only
(``fraction_evaluate=0``: the app evaluates on the server), per node per round, rounds 2+ (round
1 downloads the full model to every node whatever the codec), in Flower's accounting (records'
``count_bytes()``) and as array payload.

Small tensors: sparseloco cuts a 2-D tensor (R, C) into h x w tiles with h, w the largest
divisors of R, C that are at most 64 and keeps min(64, h w) entries per tile, so a tensor with
at most 64 entries is one tile kept whole (its values still 2-bit through the table) and the
kept share is 64 / (h w) per tile: conv1 (16 x 9 = 144 entries, one tile) 44 %, fc2 (10 x 64)
10 %, conv2 (32 x 144: three 32 x 48 tiles) 4.2 %, fc1 (64 x 128) 1.6 %; 1-D tensors (biases)
travel as raw fp32 (``min_dims = 2``), as with every codec.

Uploads are compressed for the app's unchanged handlers by
:func:`flwr_isoloco.clients.upload_mod` (downloads by ``download_mod``, which the app has).

    nice -n 15 .venv/bin/python benchmarks/compression/digits_frontier.py   # ~10 min, 2 cores
    .venv/bin/python benchmarks/compression/digits_frontier.py --configs NAME...  # add rows
    .venv/bin/python benchmarks/compression/digits_frontier.py --diagnose  # DIAGNOSIS rows
    .venv/bin/python benchmarks/compression/digits_frontier.py --table   # README from the JSON
    .venv/bin/python benchmarks/compression/digits_frontier.py --quick --out X.json  # seconds

writes ``benchmarks/results/digits_frontier.json`` and (``--table``) the table in
examples/digits/README.md ("Compression").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from message_bytes import CountingGrid, per_round  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.on_path("examples/digits", "tests")
import torch  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from flwr_isoloco.clients import upload_mod  # noqa: E402
from flwr_isoloco.strategies import Codec, DiLoCo, IsoLoCo  # noqa: E402

OUT = common.RESULTS / "digits_frontier.json"
README = common.REPO / "examples" / "digits" / "README.md"
BEGIN, END = "<!-- BEGIN DIGITS FRONTIER -->", "<!-- END DIGITS FRONTIER -->"
NODES, ROUNDS, SEEDS = 4, 10, (0, 1, 2)
SPARSELOCO = Codec("sparseloco", chunk=4096, k=64, bits=2)
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"codec": None, "momentum": 0.9},
    "int8": {"codec": "int8", "momentum": 0.9},
    "int4": {"codec": "int4", "momentum": 0.9},
    "sparseloco+nesterov": {"codec": SPARSELOCO, "momentum": 0.9},
    "sparseloco, mu=0": {"codec": SPARSELOCO, "momentum": 0.0},
}
DIAGNOSIS: dict[str, dict[str, Any]] = {  # where sparseloco+nesterov loses, at its tuned lr
    "sparseloco up only": {"upload": SPARSELOCO, "download": None, "momentum": 0.9},
    "sparseloco down only": {"upload": None, "download": SPARSELOCO, "momentum": 0.9},
    "sparseloco+nesterov, 30 rounds": {"codec": SPARSELOCO, "momentum": 0.9, "rounds": 30},
    "fp32, 30 rounds": {"codec": None, "momentum": 0.9, "rounds": 30, "lr-of": "fp32"},
}
STRATEGIES: dict[str, Callable[..., Any]] = {"DiLoCo": DiLoCo, "IsoLoCo": IsoLoCo}
GRIDS = {  # (strategy, momentum) -> first 3 outer lrs, centred on the defaults (0.7 / 0.5) or 1
    ("DiLoCo", 0.9): (0.5, 0.7, 1.0),
    ("IsoLoCo", 0.9): (0.35, 0.5, 0.7),
    ("DiLoCo", 0.0): (0.7, 1.0, 1.4),
    ("IsoLoCo", 0.0): (0.7, 1.0, 1.4),
}
STEP = math.sqrt(2)  # an edge optimum adds the next point this factor out
MAX_EXTEND = 3


def client_app() -> ClientApp:
    """The digits app's handlers behind its own mods (``download_mod``) and ``upload_mod``."""
    from digits import client_app as app

    out = ClientApp(mods=[*app.MODS, upload_mod])
    out.train()(app.train_fn)
    out.evaluate()(app.evaluate_fn)
    return out


def strategy(name: str, config: str, lr: float, seed: int):
    c = CONFIGS.get(config) or DIAGNOSIS[config]
    return STRATEGIES[name](
        outer_lr=lr,
        outer_momentum=c["momentum"],
        upload=c["upload"] if "upload" in c else c["codec"],
        download=c["download"] if "download" in c else c["codec"],
        fraction_evaluate=0.0,
        seed=seed,
    )


def run(name: str, config: str, lr: float, seed: int, split: str, rounds: int) -> dict[str, Any]:
    """One federation of the digits app: final accuracy and loss, bytes per node per round."""
    from digits import server_app

    rc = {
        "num-server-rounds": rounds,
        "partitioner": "iid",
        "partition-seed": seed,
        "model-seed": seed,
        "split": split,
        "output-dir": "",
    }
    grid = CountingGrid(client_app(), num_nodes=NODES, run_config=rc)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    t0 = time.perf_counter()
    acc = server_app.run_federation(grid, ctx, strategy(name, config, lr, seed))
    res = server_app.LAST["result"]
    loss = {r: float(m["loss"]) for r, m in res.evaluate_metrics_serverapp.items()}
    traffic = per_round(grid.traffic)
    later = [traffic[r] for r in traffic if r >= 2]
    replies = [int(res.train_metrics_clientapp[r].get("replies-used", 0)) for r in traffic]
    out = {
        "final-accuracy": acc[max(acc)],
        "final-loss": loss[max(loss)],
        "accuracy": [acc[r] for r in sorted(acc)],
        "replies-used": replies,
        "errors": [t["error"] for t in grid.traffic if t["error"]][:3],
        "wall-s": round(time.perf_counter() - t0, 2),
    }
    for key in ("down", "up", "down-arrays", "up-arrays"):
        out[f"{key}-per-node-round-2+"] = statistics.mean(t[key] for t in later)
        out[f"{key}-run"] = sum(t[key] * t["nodes"] for t in traffic.values())
    out["down-round-1"] = traffic[1]["down"]
    out["down-arrays-round-1"] = traffic[1]["down-arrays"]
    return out


def tune(name: str, config: str, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Outer lr on the validation split (seed 0): the grid, extended while its best is an edge."""
    grid = list(GRIDS[(name, CONFIGS[config]["momentum"])])
    cells: dict[float, dict[str, Any]] = {}
    for _ in range(MAX_EXTEND + 1):
        for lr in grid:
            if lr not in cells:
                cells[lr] = run(name, config, lr, 0, "validation", rounds)
                c = cells[lr]
                log(
                    f"tune {name} {config} lr {lr}: val loss {c['final-loss']:.4f} acc "
                    f"{c['final-accuracy']:.3f}"
                )
        best = min(grid, key=lambda lr: _loss(cells[lr]))
        if best == grid[0]:
            grid.insert(0, round(grid[0] / STEP, 3))
        elif best == grid[-1]:
            grid.append(round(grid[-1] * STEP, 3))
        else:
            break
    best = min(cells, key=lambda lr: _loss(cells[lr]))
    edge = best in (min(cells), max(cells))
    return {
        "best-lr": best,
        "optimum-on-edge": edge,
        "cells": {str(k): v for k, v in cells.items()},
    }


def _loss(cell: dict[str, Any]) -> float:
    v = cell["final-loss"]
    return v if math.isfinite(v) else math.inf


def test_seeds(name: str, config: str, lr: float, seeds, rounds: int, log) -> dict[str, Any]:
    runs = {}
    for seed in seeds:
        runs[str(seed)] = run(name, config, lr, seed, "test", rounds)
        log(
            f"test {name} {config} lr {lr} seed {seed}: acc {runs[str(seed)]['final-accuracy']:.3f}"
        )
    acc = [r["final-accuracy"] for r in runs.values()]
    loss = [r["final-loss"] for r in runs.values()]
    first = next(iter(runs.values()))
    return {
        "lr": lr,
        "seeds": runs,
        "accuracy-mean": statistics.mean(acc),
        "accuracy-sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
        "loss-mean": statistics.mean(loss),
        "loss-sd": statistics.stdev(loss) if len(loss) > 1 else 0.0,
        **{k: v for k, v in first.items() if "per-node" in k or k.endswith("-run")},
    }


def ratios(rows: dict[str, dict[str, Any]], fp: dict[str, Any]) -> None:
    """Each row's bytes vs the fp32 row ``fp`` (x fewer), in place."""
    for row in rows.values():
        for how, suffix in (("count", ""), ("payload", "-arrays")):
            d, u = f"down{suffix}-per-node-round-2+", f"up{suffix}-per-node-round-2+"
            row[f"x-fewer-{how}"] = {
                "down": fp[d] / row[d],
                "up": fp[u] / row[u],
                "total": (fp[d] + fp[u]) / (row[d] + row[u]),
            }


def diagnose(rec: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """:data:`DIAGNOSIS` for each strategy, seeds 0-2 on the test split, at the tuned lr of
    ``sparseloco+nesterov`` (``fp32`` for the fp32 row)."""
    out: dict[str, Any] = rec.get("diagnosis", {})
    for name, rows in rec["test"].items():
        for variant, c in DIAGNOSIS.items():
            if variant in out.get(name, {}):
                continue  # already measured
            lr = rows[c.get("lr-of", "sparseloco+nesterov")]["lr"]
            res = test_seeds(name, variant, lr, SEEDS, c.get("rounds", ROUNDS), log)
            out.setdefault(name, {})[variant] = {**res, "rounds": c.get("rounds", ROUNDS)}
        ratios(out[name], rows["fp32"])
    return out


def table(rec: dict[str, Any]) -> str:
    hdr = (
        "| strategy | codec both ways | outer lr (mu) | test accuracy | test loss | "
        "down B / node / round | up B | total B | x fewer (total) | x fewer (payload) | "
        "run total MB |"
    )
    lines = [hdr, common.rule(11)]
    for name, rows in rec["test"].items():
        for config, r in rows.items():
            mu = CONFIGS[config]["momentum"]
            d, u = r["down-per-node-round-2+"], r["up-per-node-round-2+"]
            lines.append(
                f"| {name} | {config} | {r['lr']:g} ({mu:g}) | {_spread(r)} | "
                f"{d:,.0f} | {u:,.0f} | {d + u:,.0f} | {r['x-fewer-count']['total']:.1f} | "
                f"{r['x-fewer-payload']['total']:.1f} | {(r['down-run'] + r['up-run']) / 1e6:.2f} |"
            )
    if "diagnosis" in rec:
        lines += ["", DIAGNOSIS_HEAD, "", DIAGNOSIS_HDR, common.rule(8)]
        for name, rows in rec["diagnosis"].items():
            for variant, r in rows.items():
                mu = DIAGNOSIS[variant]["momentum"]
                d, u = r["down-per-node-round-2+"], r["up-per-node-round-2+"]
                lines.append(
                    f"| {name} | {variant} | {r['lr']:g} ({mu:g}) | {r['rounds']} | "
                    f"{_spread(r)} | {d + u:,.0f} | {r['x-fewer-count']['total']:.1f} |"
                )
    return "\n".join(lines)


DIAGNOSIS_HEAD = (
    "Where sparseloco loses (seeds 0-2, test split, at the tuned outer lr of the row above "
    "that it varies; not re-tuned):"
)
DIAGNOSIS_HDR = (
    "| strategy | variant | outer lr (mu) | rounds | test accuracy | test loss | "
    "total B / node / round | x fewer (total) |"
)


def _step(rec: dict[str, Any], argv: list[str] | None, t0: float) -> None:
    """Append this invocation (its arguments, its wall time) to the record's ``steps``."""
    args = sys.argv[1:] if argv is None else argv
    rec.setdefault("steps", []).append({"args": args, "wall-s": round(time.perf_counter() - t0, 1)})


def _spread(r: dict[str, Any]) -> str:
    return (
        f"{r['accuracy-mean']:.3f} +- {r['accuracy-sd']:.3f} | "
        f"{r['loss-mean']:.3f} +- {r['loss-sd']:.3f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="DiLoCo, fp32 + sparseloco mu=0, no tuning, 2 seeds, 2 rounds",
    )
    ap.add_argument("--table", action="store_true", help="README table from the JSON, no run")
    ap.add_argument(
        "--diagnose", action="store_true", help="add DIAGNOSIS to the JSON (after a full run)"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--configs", nargs="+", default=None, help="only these CONFIGS, merged into --out's record"
    )
    args = ap.parse_args(argv)
    out = args.out or OUT
    if args.table:
        rec = json.loads(out.read_text())
        common.write_block(README, BEGIN, END, table(rec))
        return rec
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[digits_frontier {time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    if args.diagnose:
        rec = json.loads(out.read_text())
        rec["diagnosis"] = diagnose(rec, log)
        _step(rec, argv, t0)
        common.save_json(out, rec)
        print(table(rec), flush=True)
        return rec

    if args.quick:
        strategies, configs, seeds, rounds = ("DiLoCo",), ("fp32", "sparseloco, mu=0"), (0, 1), 2
    else:
        strategies, configs, seeds, rounds = tuple(STRATEGIES), tuple(CONFIGS), SEEDS, ROUNDS
    if args.configs:
        if bad := [c for c in args.configs if c not in CONFIGS]:
            ap.error(f"--configs: unknown {bad}; expected names from {list(CONFIGS)}")
        configs = tuple(args.configs)
    rec: dict[str, Any] = {
        "command": "benchmarks/compression/digits_frontier.py" + (" --quick" if args.quick else ""),
        "protocol": {
            "nodes": NODES,
            "rounds": rounds,
            "seeds": list(seeds),
            "partitioner": "iid",
            "grids": {f"{k[0]} mu={k[1]}": v for k, v in GRIDS.items()},
            "tuned-on": "validation split, seed 0, final loss",
        },
        "tuning": {},
        "test": {},
    }
    if args.configs and out.is_file():
        rec = json.loads(out.read_text())
    for name in strategies:
        for config in configs:
            if args.quick:
                best = GRIDS[(name, CONFIGS[config]["momentum"])][1]
            else:
                tuned = tune(name, config, rounds, log)
                rec["tuning"].setdefault(name, {})[config] = tuned
                best = tuned["best-lr"]
            rec["test"].setdefault(name, {})[config] = test_seeds(
                name, config, best, seeds, rounds, log
            )
            if not args.quick:
                common.save_json(out, rec)
    for rows in rec["test"].values():
        ratios(rows, rows["fp32"])
    _step(rec, argv, t0)
    print(table(rec), flush=True)
    if args.out or not args.quick:
        common.save_json(out, rec)
    return rec


if __name__ == "__main__":
    main()
